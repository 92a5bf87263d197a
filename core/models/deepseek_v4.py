"""DeepSeek-V4 (``DeepseekV4ForCausalLM``: V4-Flash, V4-Pro), written with tensor-parallel layers on the Llama
plumbing (weight loading, the LM head, the model interface).

**Hyper-connections (mHC).** The residual stream is ``hc_mult`` streams per token ([T, n, H]). Before each block
(attention, then the experts) a small projection of the normed streams gives three mixes: ``pre`` collapses the
streams into the block's input, ``post`` spreads the block's output over them, and ``comb`` (n x n, made doubly
stochastic by Sinkhorn-Knopp iterations) mixes the old streams into the new: ``S' = post * out + comb^T S``. After
the last layer one more ``pre`` mix (``hc_head``) collapses the streams before the final norm. All in float32.

**Attention.** Multi-query attention with one head of ``head_dim`` (512) that is both key and value, a learned sink
logit per query head (as GPT-OSS's), queries from a low-rank latent (``q_a_proj``, ``q_b_proj``, each head
RMS-normed without a weight), and RoPE on the last ``qk_rope_head_dim`` features of each head in interleaved pairs
(rotated in halves here: q and k alike, so their products keep; the output's rotation is undone at the query's
position before the grouped output projection, ``o_a_proj`` per group of heads then ``o_b_proj``). Every layer
attends a sliding window of ``sliding_window`` keys (RoPE base ``rope_theta``). Two kinds of layer attend more, with
their own RoPE (``compress_rope_theta``, YaRN):

* heavily compressed attention (HCA, rate m' = 128): every m' tokens pool into one entry (a softmax over the window
  of each feature's gate plus a learned bias by place in the window, weighting the tokens' compressor keys; then an
  RMSNorm and RoPE at the window's first position); a query attends every entry whose window it has passed;
* compressed sparse attention (CSA, rate m = 4): the same with two series per token and windows that overlap (entry
  w pools the first series of window w - 1 with the second of window w), and an indexer (pooled keys of its own, and
  queries from the query latent) that keeps each query's ``index_topk`` best entries
  (:func:`specray.models.deepseek_v3.top_index_keys`, as DeepSeek-V3.2's).

**The cache** (:class:`~specray.models.kv_cache.CompressedAttentionSpec`): one row per token and layer holds its key
and, on a compressing layer, its compressor's (and indexer's) key and gate before pooling, and the entry of the
window it closes (a window's last token holds it). A step writes its tokens' rows, pools the windows its tokens close
(from the rows of the window's tokens, earlier steps' and its own; a token tree's node, from its ancestors' rows),
and attends. So every row follows from the tokens up to it: chunked prefill, preemption, prefix caching, rejected
drafts and a tree's accepted path (its rows moved to their committed slots, as any layer's K/V) need nothing of their
own. The rows keep every token's key and pooling inputs (the sliding window masks what it may not see, as every
sliding layer here does), so the cache takes more memory per token than the model needs: a cache that keeps only the
window and the entries is not written yet. Attention is computed densely over the window's keys and the entries (no
sparse kernel).

**Pipeline stages** hand on the ``hc_mult`` streams (the embedding on the first, ``hc_head`` and the norm on the last).
**Tensor parallelism**: query heads, their sinks and the output groups split over the ranks (``o_groups`` a multiple
of the ranks); the key, the compressors, the indexer and the hyper-connections are replicated (every head reads them);
the experts split as DeepSeek-V3's (:mod:`specray.models.moe`, the ``deepseek_v4`` row: its scoring, its hash-routed
first layers, its clamped SwiGLU). **CUDA graphs**: a step of chains pools every query row's window on the device
(fixed shapes, no host value; a row that closes no window writes an entry nothing reads), so decode and verify steps
replay graphs; a step with a token tree runs eagerly (its windows are found on the host). Checked on CPU only.
**Drafting**: its release's MTP module (:mod:`specray.models.deepseek_v4_mtp`), reading the streams past the last
layer (aux layer ``num_hidden_layers``). **An FP8 KV cache** (``kv_cache_dtype="fp8"``): every column of a row one
byte (scale 1: the keys and entries are normed), read back in the model's dtype; a step reads the rows and entries
it writes as later steps will, rounded. **Its release's quantization**: block-scaled FP8 linears with E8M0 scales
and FP4 experts (:mod:`specray.models.fp8`), the linears dequantized as they load (or kept in FP8 where a GPU runs
block-scaled FP8 matmuls), the experts kept in FP4 where a mixture keeps quantized experts (a GPU), else dequantized
to bfloat16. **Not supported**: other hidden-state heads, other
quantizations (tiny random models only: never a real checkpoint, never on a GPU).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import (AttentionMetadata, explicit_attention, own_key_positions, seq_positions,
                                      short_key_positions)
from specray.models.deepseek_v3 import top_index_keys
from specray.models.kv_cache import CAUSAL, CompressedAttentionSpec, KVCache, KVCacheSpec, MaskKind
from specray.models.layers import (ColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                                   VocabParallelEmbedding, _copy, divide, narrow, on_stage, rope_parameters)
from specray.models.llama import LlamaForCausalLM, StageModel
from specray.models.moe import SparseMoE
from specray.parallel import PPGroup, TPGroup

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# one query chunk's attention scores [heads, queries, keys] at most this many (a long prefill chunk in pieces)
SCORE_ELEMENTS = 1 << 26

# DeepSeek's own tensor names (its release, and what transformers saves) -> the names the modules here have (those
# transformers' modules have), applied in order to a name in the release's style (_RELEASE_STYLE)
_RELEASE_NAMES = tuple((re.compile(a), b) for a, b in (
    (r"^layers\.", "model.layers."), (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"), (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"), (r"\.attn_sink$", ".sinks"),
    (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"(\.self_attn\.(?:compressor\.(?:indexer\.)?)?)norm\.", r"\1kv_norm."),
    (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."), (r"\.wq_b\.", ".q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj."),
))
_RELEASE_STYLE = re.compile(r"^layers\.|^embed\.|^head\.|^norm\.|^hc_head_|\.attn\.|\.ffn\.|\.attn_norm\.|\.ffn_norm\."
                            r"|\.hc_(attn|ffn)_")


def release_to_ours(name: str) -> str:
    """A checkpoint tensor's name as the modules here name it (DeepSeek's release names renamed; others kept)."""
    if _RELEASE_STYLE.search(name):
        for theirs, ours in _RELEASE_NAMES:
            name = theirs.sub(ours, name)
    return name


def _float_param(*shape: int) -> nn.Parameter:
    """A parameter kept in float32 whatever the model's dtype (the hyper-connections', sinks', pooling biases')."""
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight over the last dimension (in float32, back in x's dtype)."""
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _to_halves(x: torch.Tensor, rope: int) -> torch.Tensor:
    """The last ``rope`` features from interleaved pairs (x0, y0, x1, y1, ...) to halves (x0, x1, ..., y0, y1, ...)."""
    tail = x[..., -rope:]
    return torch.cat((x[..., :-rope], tail[..., 0::2], tail[..., 1::2]), dim=-1)


def _to_pairs(x: torch.Tensor, rope: int) -> torch.Tensor:
    """Inverse of :func:`_to_halves`."""
    first, second = x[..., -rope:].chunk(2, dim=-1)
    return torch.cat((x[..., :-rope], torch.stack((first, second), dim=-1).flatten(-2)), dim=-1)


def _rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (halves layout) on the last 2 * cos.shape[-1] features of x [T, H, D]; cos, sin [T, 1, r/2]."""
    rope = 2 * cos.shape[-1]
    x1, x2 = x[..., -rope:].chunk(2, dim=-1)
    return torch.cat((x[..., :-rope], x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class HyperConnection(nn.Module):
    """One block's mixes of the ``n`` residual streams (see the module docstring); replicated, float32. ``comb``
    False: Hunyuan 4's independent form, with no mixing matrix (the old streams pass as they are) and ``post`` scaled
    by ``hc_magnitude`` plus ``hc_eps``."""

    def __init__(self, config, comb: bool = True):
        super().__init__()
        n, h = config.hc_mult, config.hidden_size
        self.n, self.eps, self.norm_eps, self.comb = n, config.hc_eps, config.rms_norm_eps, comb
        self.iters = config.hc_sinkhorn_iters if comb else 0
        self.post_scale, self.post_eps = (2.0, 0.0) if comb else (float(config.hc_magnitude), config.hc_eps)
        mixes = (2 + n) * n if comb else 2 * n
        self.fn = _float_param(mixes, n * h)
        self.base = _float_param(mixes)
        self.scale = _float_param(3 if comb else 2)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        # streams [T, n, H] -> post [T, n], comb [T, n, n] (float32; None without one) and the block's input [T, H]
        t, n = streams.shape[0], self.n
        mix = F.linear(_unit_rms(streams.flatten(1).float(), self.norm_eps), self.fn)
        sizes = [n, n, n * n] if self.comb else [n, n]
        pre_w, post_w, *comb_w = mix.split(sizes, dim=-1)
        pre_b, post_b, *comb_b = self.base.split(sizes)
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = self.post_scale * torch.sigmoid(post_w * self.scale[1] + post_b) + self.post_eps
        collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
        if not self.comb:
            return post, None, collapsed
        comb = torch.softmax(comb_w[0].view(t, n, n) * self.scale[2] + comb_b[0].view(n, n), dim=-1) + self.eps
        # Sinkhorn-Knopp: columns, then rows and columns in turn, towards a doubly stochastic matrix
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return post, comb, collapsed

    @staticmethod
    def merge(post: torch.Tensor, comb: torch.Tensor | None, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The streams after a block: ``post * out + comb^T streams`` ([T, n, H]; without comb, ``+ streams``)."""
        dtype = streams.dtype
        if comb is None:
            return (post[..., None] * out[:, None].float() + streams.float()).to(dtype)
        return post.to(dtype)[..., None] * out[:, None] + torch.matmul(comb.to(dtype).transpose(1, 2), streams)


class HyperHead(nn.Module):
    """The last collapse of the streams into one, before the final norm."""

    def __init__(self, config):
        super().__init__()
        n, h = config.hc_mult, config.hidden_size
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn, self.hc_base, self.hc_scale = _float_param(n, n * h), _float_param(n), _float_param(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mix = F.linear(_unit_rms(streams.flatten(1).float(), self.norm_eps), self.hc_fn)
        pre = torch.sigmoid(mix * self.hc_scale + self.hc_base) + self.eps
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)


class Pooling(nn.Module):
    """A compressor's (or an indexer's) projections of the tokens and its pooling of a window into one entry."""

    def __init__(self, config, dim: int, rate: int, overlap: bool):
        super().__init__()
        series = 2 if overlap else 1
        one = TPGroup.single()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = ColumnParallelLinear(config.hidden_size, series * dim, one)
        self.gate_proj = ColumnParallelLinear(config.hidden_size, series * dim, one)
        self.position_bias = _float_param(rate, series * dim)
        self.kv_norm = RMSNorm(dim, config.rms_norm_eps)

    @property
    def span(self) -> int:
        """The tokens one entry pools: its window, and where windows overlap the one before too."""
        return 2 * self.rate if self.overlap else self.rate

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """kv, gate [C, span, series * dim]: the pooling inputs of each entry's tokens, oldest first; valid [C, span]
        (rows before position 0: none) -> the entries [C, dim], normed (not yet rotated)."""
        d, m = self.dim, self.rate
        gate = gate.float() + self.position_bias.repeat(self.span // m, 1)  # each row's bias by its place in its window
        if self.overlap:  # the earlier window's first series, then this window's second
            kv = torch.cat((kv[:, :m, :d], kv[:, m:, d:]), dim=1)
            gate = torch.cat((gate[:, :m, :d], gate[:, m:, d:]), dim=1)
        weights = gate.masked_fill(~valid[..., None], float("-inf")).softmax(dim=1)
        return self.kv_norm((kv.float() * weights).sum(dim=1).to(kv.dtype))


class Indexer(Pooling):
    """CSA's indexer: its own pooled keys (overlapping windows, ``index_head_dim``), queries from the query latent, and
    per-head weights; ``scorer.weights_proj`` as the checkpoint names it."""

    def __init__(self, config, rate: int):
        super().__init__(config, config.index_head_dim, rate, overlap=True)
        self.heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, self.heads * self.dim, TPGroup.single())
        self.scorer = nn.Module()
        self.scorer.weights_proj = ColumnParallelLinear(config.hidden_size, self.heads, TPGroup.single())


class Compressor(Pooling):
    def __init__(self, config, kind: str):
        rate = config.compress_rates[kind]
        super().__init__(config, config.head_dim, rate, overlap=kind == CSA)
        self.indexer = Indexer(config, rate) if kind == CSA else None


class DeepseekV4Attention(nn.Module):
    """One layer's attention over ``tp`` (see the module docstring)."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__()
        self.kind = kind = config.layer_types[layer]
        one, h = TPGroup.single(), config.hidden_size
        self.tp = tp
        self.num_heads = divide(config.num_attention_heads, tp.size, "num_attention_heads")
        self.head_dim, self.window, self.eps = config.head_dim, config.sliding_window, config.rms_norm_eps
        self.rope = int(config.head_dim * (config.partial_rotary_factor or 1.0))
        self.rope_kind = "main" if kind == SLIDING else "compress"
        self.scale = self.head_dim ** -0.5
        self.q_a_proj = ColumnParallelLinear(h, config.q_lora_rank, one)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, config.num_attention_heads * self.head_dim, tp)
        self.kv_proj = ColumnParallelLinear(h, self.head_dim, one)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        groups = divide(config.o_groups, tp.size, "o_groups")
        if config.num_attention_heads % config.o_groups:
            raise ValueError(f"o_groups={config.o_groups} does not divide num_attention_heads="
                             f"{config.num_attention_heads}: the checkpoint's config.json is inconsistent")
        self.groups, self.group_rank = groups, config.o_lora_rank
        per_group = config.num_attention_heads // config.o_groups * self.head_dim
        self.o_a_proj = nn.Module()
        self.o_a_proj.weight = nn.Parameter(torch.empty(groups * config.o_lora_rank, per_group), requires_grad=False)
        self.o_a_proj.weight.weight_loader = self._load_rows(groups * config.o_lora_rank)
        self.o_b_proj = RowParallelLinear(config.o_groups * config.o_lora_rank, h, tp)
        self.sinks = _float_param(self.num_heads)
        self.sinks.weight_loader = self._load_rows(self.num_heads)
        self.compressor = None if kind == SLIDING else Compressor(config, kind)
        indexer = None if self.compressor is None else self.compressor.indexer
        self.kv_spec = CompressedAttentionSpec(self.head_dim, 0 if self.compressor is None else self.compressor.rate,
                                               self.compressor is not None and self.compressor.overlap,
                                               0 if indexer is None else indexer.dim)
        self.cols = self.kv_spec.columns
        self.rows = torch.empty(0)
        self.block_size = 1
        self.fp8: torch.dtype | None = None  # the rows' FP8 format (kv_cache_dtype="fp8"): stored as its bytes
        self.rotary_at = None  # the compressing layers' RoPE table at any position, handed in by each forward

    def _load_rows(self, count: int):
        def load(param: nn.Parameter, loaded: Any) -> None:
            _copy(param, narrow(loaded, 0, self.tp.rank * count, count))
        return load

    def bind_cache(self, cache: torch.Tensor, block_size: int, fp8: torch.dtype | None = None) -> None:
        assert cache.shape == self.kv_spec.shape(cache.shape[0]), (tuple(cache.shape), self.kv_spec)
        self.rows, self.block_size, self.fp8 = cache, block_size, fp8

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        """Row values as the cache holds them: FP8 bytes (clamped to the format's range, scale 1: the keys and entries
        are normed, the pooling inputs of a projection's size), or in the cache's dtype."""
        if self.fp8 is None:
            return x.to(self.rows.dtype)
        bound = torch.finfo(self.fp8).max
        return x.clamp(-bound, bound).to(self.fp8).view(torch.uint8)

    def _read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cached rows (gathered, or a view) in the model's dtype (a copy where the cache holds FP8)."""
        return rows if self.fp8 is None else rows.view(self.fp8).to(dtype)

    def _col(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        start, width = self.cols[name]
        return rows[..., start: start + width]

    def forward(self, x: torch.Tensor, rope: dict, meta: AttentionMetadata) -> torch.Tensor:
        # x [T, H] -> [T, H]; rope: {"main" / "compress": (cos, sin) [T, 1, r/2], "table": the compress RotaryEmbedding}
        t, hl, d = x.shape[0], self.num_heads, self.head_dim
        cos, sin = rope[self.rope_kind]
        q_latent = self.q_a_norm(self.q_a_proj(x))
        q = _rotate_tail(_to_halves(_unit_rms(self.q_b_proj(q_latent).view(t, hl, d), self.eps), self.rope), cos, sin)
        kv = _rotate_tail(_to_halves(self.kv_norm(self.kv_proj(x)), self.rope)[:, None], cos, sin)[:, 0]
        parts, index = [kv], None
        comp = self.compressor
        if comp is not None:
            parts += [comp.kv_proj(x), comp.gate_proj(x), kv.new_zeros(t, d)]
            if comp.indexer is not None:
                ix = comp.indexer
                parts += [ix.kv_proj(x), ix.gate_proj(x), kv.new_zeros(t, ix.dim)]
                queries = ix.q_b_proj(q_latent).view(t, ix.heads, ix.dim)
                queries = _rotate_tail(_to_halves(queries, self.rope), cos, sin).float()
                weights = ix.scorer.weights_proj(x).float() * (ix.heads * ix.dim) ** -0.5
                index = (queries, weights)
        self.rows.index_copy_(0, meta.slot_mapping, self._stored(torch.cat(parts, dim=-1)))
        out = q.new_empty(t, hl, d)
        self.rotary_at = rope["table"].forward  # (positions [C], dtype) -> cos, sin: the entries' RoPE, this step
        if meta.short is not None:
            self._short(q, index, meta, out)
        for i in range(len(meta.own)):
            self._own(q, index, meta, i, out)
        out = _to_pairs(_rotate_tail(out, cos, -sin), self.rope)  # the values' rotation undone at the query's position
        grouped = torch.einsum("tgi,goi->tgo", out.reshape(t, self.groups, -1),
                               self.o_a_proj.weight.view(self.groups, self.group_rank, -1))
        return self.o_b_proj(grouped.reshape(t, -1))

    # ---- windows closed in this step: their entries pooled and written to the closing token's row

    def _close(self, ctx: torch.Tensor, closing: list[tuple[int, int, int, list[int] | None]],
               meta: AttentionMetadata) -> None:
        """ctx [N, L, W]: the rows of N sequences' contexts by slot index (this step's included); closing: (sequence
        in ctx, position, the token's row in the step, its window's rows in ctx or None) of each new token that
        closes a window (:meth:`_closing`). Pools their entries, into the cache and into ``ctx``."""
        if self.compressor is None or not closing:
            return
        n, length, width = ctx.shape
        device, span = ctx.device, self.compressor.span
        flat = ctx.view(n * length, width)
        seq = torch.tensor([c[0] for c in closing], device=device)
        end = torch.tensor([c[1] for c in closing], device=device)
        tokens = torch.tensor([c[2] for c in closing], device=device)
        slots = meta.slot_mapping.index_select(0, tokens)
        starts = end - self.compressor.rate + 1  # each entry's RoPE position: its window's first
        cos, sin = self.rotary_at(starts, ctx.dtype)
        # a chain's window is the rows up to the closing one; a tree node's, its ancestors' (rows given)
        positions = end[:, None] - span + 1 + torch.arange(span, device=device)  # [C, span]
        rows = positions.clone()
        given = [(k, c[3]) for k, c in enumerate(closing) if c[3] is not None]
        if given:
            rows[torch.tensor([k for k, _ in given], device=device)] = torch.tensor([r for _, r in given],
                                                                                    device=device)
        index = (seq[:, None] * length + rows.clamp(min=0)).flatten()
        window = flat.index_select(0, index).view(len(closing), span, width)
        self._pool_into(window, positions >= 0, cos, sin, slots, flat, seq * length + rows[:, -1])

    def _close_rows(self, ctx: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """The short batch of a step of chains, every query row at once with shapes fixed by the batch's and no host
        value (what a graph step captures): ctx [N, L, W] by position, positions [N, Q] each row's, slots [N * Q]
        its cache slot. Each row's window is pooled as if the row closed one: an entry is read only at its window's
        last row, so a row that closes none keeps a value nothing reads (a padding row repeats its sequence's last)."""
        n, length, width = ctx.shape
        device, span, q = ctx.device, self.compressor.span, positions.shape[1]
        flat = ctx.view(n * length, width)
        rows = positions[..., None] - span + 1 + torch.arange(span, device=device)  # [N, Q, span]
        window = flat.index_select(0, (torch.arange(n, device=device)[:, None, None] * length
                                       + rows.clamp(min=0)).flatten()).view(n * q, span, width)
        cos, sin = self.rotary_at((positions.flatten() - self.compressor.rate + 1).clamp(min=0), ctx.dtype)
        dest = (torch.arange(n, device=device)[:, None] * length + positions).flatten()
        self._pool_into(window, (rows >= 0).view(n * q, span), cos, sin, slots, flat, dest)

    def _pool_into(self, window: torch.Tensor, valid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, flat: torch.Tensor, dest: torch.Tensor) -> None:
        """Pool each window [C, span, W] (rows valid [C, span]) into the compressor's and the indexer's entries,
        rotated by (cos, sin) at the window's first position, written to the cache at ``slots`` [C] and to the
        context rows ``flat`` at ``dest`` [C]."""
        for pooling, names in ((self.compressor, ("raw_kv", "raw_gate", "entry")),
                               (self.compressor.indexer, ("index_raw_kv", "index_raw_gate", "index_entry"))):
            if pooling is None:
                continue
            entry = pooling.pool(self._col(window, names[0]), self._col(window, names[1]), valid)
            entry = _rotate_tail(_to_halves(entry, self.rope)[:, None], cos, sin)[:, 0].to(flat.dtype)
            start, size = self.cols[names[2]]
            stored = self._stored(entry)  # the context reads it as later steps will (an FP8 cache's: rounded)
            self.rows[:, start: start + size].index_copy_(0, slots, stored)
            flat[:, start: start + size].index_copy_(0, dest, self._read(stored, flat.dtype))

    def _closing(self, meta: AttentionMetadata, i: int, seq: int, first_token: int
                 ) -> list[tuple[int, int, int, list[int] | None]]:
        """The new tokens of step sequence ``i`` (``seq`` in its context group, its rows from ``first_token``) that
        close a window, as :meth:`_close` takes them: a chain's window rows follow from the position (None); a tree
        node's are its ancestors' rows where the window reaches past the context (host lists: the plan's)."""
        if self.compressor is None:
            return []
        m, span = self.compressor.rate, self.compressor.span
        start, count = meta.start_positions[i], meta.query_lens[i]
        anc = None if meta.ancestors is None else meta.ancestors[i]
        if meta.seq_positions is None and anc is None:
            first = start + (-(start + 1)) % m  # the first position p >= start with (p + 1) % m == 0
            return [(seq, p, first_token + p - start, None) for p in range(first, start + count, m)]
        positions = seq_positions(meta, i)
        sees = None if anc is None else anc.tolist()  # the plan's [q, q] mask, on the host
        out = []
        for j, p in enumerate(positions):
            if (p + 1) % m:
                continue
            seen = {positions[a]: start + a for a in range(count) if (a <= j if sees is None else sees[j][a])}
            rows = [x if x < start else seen.get(x, -1) for x in range(p - span + 1, p + 1)]
            assert all(r >= 0 for x, r in zip(range(p - span + 1, p + 1), rows) if x >= 0), (
                "a tree node's ancestors hold every position from the context to it")
            out.append((seq, p, first_token + j, rows))
        return out

    # ---- attention: the window's keys and the entries passed, one softmax with the sinks

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q [N, Q, Hl, D], keys [N, K, D] (also the values), allowed [N, Q, K] -> [N, Q, Hl, D]."""
        keys = keys[:, None]  # one key/value head
        out = explicit_attention(q.transpose(1, 2), keys, keys, allowed[:, None], self.scale,
                                 sinks=self.sinks.view(-1, 1, 1))
        return out.transpose(1, 2)

    def _entries(self, ctx: torch.Tensor, causal: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor] | None,
                 key_pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries a query may attend: (keys [N, E, D], allowed [N, Q, E]) from ctx [N, L, W] and the causal mask
        [N, Q, L]. An entry sits in its window's last row: every m-th row of a chain's context (E = L / m); in a step
        with trees, any row whose key position ``key_pos`` [N, L] closes a window (E = L). The indexer's pick where
        it has one."""
        m = self.compressor.rate
        if key_pos is None:
            rows, allowed = ctx[:, m - 1:: m], causal[..., m - 1:: m]
        else:
            rows, allowed = ctx, causal & ((key_pos + 1) % m == 0)[:, None, :]
        if index is not None:
            keys = self._col(rows, "index_entry").float()
            allowed = top_index_keys(index[0], index[1], keys, allowed, self.compressor.indexer.topk)
        return self._col(rows, "entry"), allowed

    def _short(self, q: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata,
               out: torch.Tensor) -> None:
        sb = meta.short
        bs, length = sb.num_seqs, sb.num_ctx_blocks * meta.block_size
        width = self.rows.shape[-1]
        ctx = self._read(self.rows.view(-1, meta.block_size, width).index_select(0, sb.block_index), q.dtype)
        ctx = ctx.view(bs, length, width)
        if self.compressor is None:
            pass
        elif meta.seq_positions is None:  # chains: every row at once on the device (graph steps are such)
            slots = meta.slot_mapping if sb.token_index is None else meta.slot_mapping.index_select(0, sb.token_index)
            self._close_rows(ctx, sb.query_positions, slots)
        else:  # trees: the windows that close, each over its node's ancestors (eager steps only)
            offsets = [0, *itertools.accumulate(meta.query_lens)]  # each sequence's first row in the step
            self._close(ctx, [c for b, i in enumerate(sb.seq_ids) for c in self._closing(meta, i, b, offsets[i])],
                        meta)
        if sb.token_index is not None:
            q = q.index_select(0, sb.token_index)
            index = None if index is None else tuple(v.index_select(0, sb.token_index) for v in index)
        q = q.view(bs, sb.max_query_len, *q.shape[1:])
        if index is not None:
            index = tuple(v.view(bs, sb.max_query_len, *v.shape[1:]) for v in index)
        keys, allowed = self._col(ctx, "kv"), meta.short_mask(1, MaskKind(window=self.window))[:, 0]
        if self.compressor is not None:
            key_pos = None if meta.seq_positions is None else short_key_positions(meta)
            entries, seen = self._entries(ctx, meta.short_mask(1, CAUSAL)[:, 0], index, key_pos)
            keys, allowed = torch.cat((keys, entries), dim=1), torch.cat((allowed, seen), dim=-1)
        o = self._attend(q, keys, allowed).flatten(0, 1)  # [Bs * Q, Hl, D]
        if sb.token_index is None:
            out.copy_(o)
        else:
            out.index_copy_(0, sb.out_dst, o.index_select(0, sb.out_src))

    def _own(self, q: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata,
             i: int, out: torch.Tensor) -> None:
        seq = meta.own[i]
        width = self.rows.shape[-1]
        if seq.fresh:  # its context is its new tokens
            ctx = self.rows.index_select(0, meta.slot_mapping[seq.token_start: seq.token_end])
        elif seq.first_slot is not None:
            ctx = self.rows[seq.first_slot: seq.first_slot + seq.context_len]
        else:
            ctx = self.rows.view(-1, self.block_size, width).index_select(0, seq.block_index).view(-1, width)
            ctx = ctx[: seq.context_len]
        ctx = self._read(ctx, q.dtype)[None]
        self._close(ctx, self._closing(meta, seq.seq_id, 0, seq.token_start), meta)
        window, causal = meta.own_allowed(i, MaskKind(window=self.window)), meta.own_allowed(i, CAUSAL)
        keys = self._col(ctx, "kv")[0]
        positions = seq_positions(meta, seq.seq_id)
        key_pos = None if meta.seq_positions is None else own_key_positions(meta, i)[None]
        # a few queries at a time, each attending only the keys in its window (from the first query's position:
        # a tree node's is at most its row's) and the entries
        step = max(1, SCORE_ELEMENTS // max(1, self.num_heads * (self.window + seq.context_len)))
        for first in range(0, seq.query_len, step):
            rows = slice(first, min(first + step, seq.query_len))
            lo = max(0, min(positions[rows]) - self.window + 1)
            hi = seq.start_pos + rows.stop
            part_keys, allowed = keys[lo:hi][None], window[rows, lo:hi][None]
            if self.compressor is not None:
                part_index = None if index is None else tuple(
                    v[seq.token_start + rows.start: seq.token_start + rows.stop][None] for v in index)
                entries, seen = self._entries(ctx, causal[None, rows], part_index, key_pos)
                part_keys, allowed = torch.cat((part_keys, entries), dim=1), torch.cat((allowed, seen), dim=-1)
            token_rows = slice(seq.token_start + rows.start, seq.token_start + rows.stop)
            out[token_rows] = self._attend(q[None, token_rows], part_keys, allowed)[0]


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__()
        self.self_attn = DeepseekV4Attention(config, tp, layer)
        kinds = config.mlp_layer_types
        self.mlp = SparseMoE(config, tp, expert_parallel, hash_routed=kinds[layer] == "hash_moe")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(config), HyperConnection(config)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, rope: dict, meta: AttentionMetadata
                ) -> torch.Tensor:
        # streams [T, n, H] -> [T, n, H]
        post, comb, x = self.attn_hc(streams)
        streams = HyperConnection.merge(post, comb, self.self_attn(self.input_layernorm(x), rope, meta), streams)
        post, comb, x = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(x), token_ids=input_ids)
        return HyperConnection.merge(post, comb, out, streams)


class StreamsModel(StageModel):
    """A decoder stack whose residual is ``hc_mult`` streams (DeepSeek-V4's, Hunyuan 4's): the embedding copied into
    each on the first stage, ``hc_head`` and the final norm on the last; a stage hands the next its streams. A family
    gives its layers (``layer(streams, input_ids, rope, meta)``) and the step's RoPE (:meth:`rope`)."""

    def build_streams(self, config, tp: TPGroup, pp: PPGroup | None, layer) -> None:
        self.build_stage(config, pp, layer, lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.hc_mult = config.hc_mult
        self.hc_head = on_stage(self.pp.is_last, lambda: HyperHead(config))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def rope(self, meta: AttentionMetadata, dtype: torch.dtype) -> Any:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids [T] -> hidden [T, H]. A stage after the first starts from the previous stage's streams
        # ``intermediate`` [n, T, H]; a stage before the last ends there, returning its own. The one aux layer a
        # drafter may ask for is the one past the last (an MTP layer's place): the streams there, [T, n * H]
        assert set(aux_layers) <= {len(self.layers)}, "refused at build: heads other than the MTP layer's"
        if intermediate is None:
            x = self.embed(input_ids)
            streams = x[:, None].expand(-1, self.hc_mult, -1).contiguous()
        else:
            streams = intermediate.transpose(0, 1).contiguous()
        rope = self.rope(meta, streams.dtype)
        for _, layer in self.stage_layers():
            streams = layer(streams, input_ids, rope, meta)
        if not self.pp.is_last:
            return streams.transpose(0, 1).contiguous(), []
        return self.norm(self.hc_head(streams)), [streams.flatten(1) for _ in aux_layers]


def rope_tables(config) -> dict[str, RotaryEmbedding]:
    """The two RoPE tables of DeepSeek-V4's layers: ``main`` (the sliding layers') and ``compress`` (the others')."""
    rope = int(config.head_dim * (config.partial_rotary_factor or 1.0))
    return {kind: RotaryEmbedding(rope, rope_parameters(config, kind, partial=True), config.max_position_embeddings)
            for kind in ("main", "compress")}


def step_rope(tables: dict[str, RotaryEmbedding], meta: AttentionMetadata, dtype: torch.dtype) -> dict:
    """Each kind's (cos, sin) at the step's positions, and the compressing layers' table (their entries'): what a
    layer's forward takes as ``rope``."""
    rope: dict = {"table": tables["compress"]}
    for kind, table in tables.items():
        table.ensure(meta.max_position + 1)
        rope[kind] = table(meta.positions, dtype)
    return rope


class DeepseekV4Model(StreamsModel):
    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__()
        self.build_streams(config, tp, pp, lambda i: DeepseekV4DecoderLayer(config, tp, i, expert_parallel))
        self.rotary = rope_tables(config)

    def rope(self, meta: AttentionMetadata, dtype: torch.dtype) -> dict:
        return step_rope(self.rotary, meta, dtype)


class DeepseekV4ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V4 for causal LM, sharded over ``tp`` (see the module docstring)."""

    model_class = DeepseekV4Model
    stacked = {".shared_experts.gate_proj.": (".shared_experts.gate_up_proj.", 0),
               ".shared_experts.up_proj.": (".shared_experts.gate_up_proj.", 1)}
    lora_modules: tuple[str, ...] = ()
    # the one hidden-state head it serves: its release's MTP module, which reads the streams past the last layer
    # (specray.engine.builder.check_heads_served; specray.models.deepseek_v4_mtp, which builds on this module)
    serves_heads = ("mtp",)
    aux_past_end = True
    skipped = ("mtp.", "model.mtp.")  # the MTP module: the drafter's

    @staticmethod
    def mtp_feature_layers(config) -> tuple[int, ...]:
        """The aux layer the MTP module reads: the streams past the last layer (the module's loader:
        :data:`specray.models.draft_head_loader.OWN_MTP_HEADS`)."""
        return (config.num_hidden_layers,)

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        quant = getattr(hf_config, "quantization_config", None) or {}
        quant = quant if isinstance(quant, dict) else quant.to_dict()
        if quant and quant.get("quant_method") != "fp8":
            raise ValueError(f"DeepSeek-V4 with quantization_config.quant_method={quant.get('quant_method')!r} is "
                             "not supported: load its release (block-scaled FP8 linears, FP4 experts) or a bf16 "
                             "conversion")
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.stage_width = hf_config.hc_mult  # a stage hands the next its residual streams

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        """What the engine checks before any rank starts: the output groups split over the ranks."""
        if config.o_groups % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide DeepSeek-V4's o_groups={config.o_groups} "
                             "(its grouped output projection splits by group): choose a tensor_parallel_size that "
                             "divides it")

    graph_trees = False  # a tree step's windows are its nodes' ancestors', found on the host: run eagerly

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [layer.self_attn.kv_spec for _, layer in self.model.stage_layers()]

    def bind_kv_cache(self, cache: KVCache) -> None:
        assert cache.specs == self.kv_cache_specs(), "the cache was allocated for another model's specs"
        for j, (_, layer) in enumerate(self.model.stage_layers()):
            layer.self_attn.bind_cache(cache.layer(j), cache.block_size, cache.fp8)
        self.kv_cache_allocated = True

    def _our_name(self, name: str) -> str:
        return release_to_ours(name)
