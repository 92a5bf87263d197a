"""xLSTM (``xLSTMForCausalLM``: NX-AI's xLSTM-7b; Beck et al., "xLSTM: Extended Long Short-Term Memory", 2024, and
"xLSTM 7B: A Recurrent LLM for Fast and Efficient Inference", 2025): a stack of mLSTM blocks, no attention at all.

Every block is ``x = x + mlstm(rmsnorm(x))``, then ``x = x + ffn(rmsnorm(x))`` (the FFN a SwiGLU of width
``round_up(hidden * ffn_proj_factor, ffn_round_up_to_multiple_of)``); after the last block an RMSNorm, the LM head
and the logits soft-capped, ``cap * tanh(logits / cap)`` (``output_logit_soft_cap``).

The mLSTM layer, per head (``num_heads``; q, k of ``hidden * qk_dim_factor / heads`` features, v of
``hidden * v_dim_factor / heads``), with ``q, k, v, o`` linear in the normed input and the gate preactivations
``i, f`` (one each per head, biased) soft-capped, ``cap * tanh(x / cap)`` (``gate_soft_cap``), keeps a matrix memory
C [dk, dv], a normalizer n [dk] and a max-stabilizer m (a scalar), all starting at zero. Per token:

* ``m' = max(logsigmoid(f) + m, i)``; ``f' = exp(logsigmoid(f) + m - m')``, ``i' = exp(i - m')``;
* ``C = f' C + i' k v^T``, ``n = f' n + i' k``;
* with ``q~ = q / sqrt(dk)``: ``h = (q~^T C) / (max(|q~ . n|, exp(-m')) + eps)``;
* the heads' h layer-normed per head (no centring bias unless ``use_bias``; a weight over every feature), times
  ``sigmoid(o)``, then ``out_proj``.

C and n are the true (unstabilized) sums times exp(-m), so h, up to ``eps``, does not depend on m; transformers'
chunkwise kernel (long prefills) computes the same m, C, n and h as its step kernel, in another order.

The layer is a :class:`~specray.models.gated_deltanet.RecurrentMixer` (:class:`MLSTMLayer`) whose conv is the
identity (kernel 1: the pending drafts' inputs are their q | k | v rows), whose per-token "decay" g is
``logsigmoid(f)`` and whose "strength" beta is ``exp(i)`` (the unstabilized input gate: a padding row's beta = 0 is
``i = -inf``, which leaves m, C and n as they are, as the machinery requires). Its state matrix per head is
[dk, dv + 2]: C, then n as one more column, then m repeated down the last column; the rules (:func:`mlstm_scan`,
:func:`mlstm_chunked` for long steps, :func:`mlstm_tree`) are the layer's own ``_rule`` / ``_tree_rule``, so the
slots, chunked prefill, replayed drafts, token trees, graph steps and prefix caching's kept states are the machinery
every recurrent family shares. ``beta`` carries exp(i), so ``gate_soft_cap`` must bound i (the releases' 15).

Tensor parallelism: heads split over the ranks (q, k, v, o rows and each head's gates, the per-head norm's weight),
the FFN by width; ``out_proj`` and ``proj_down`` reduce once each. Refused by name: pipeline stages and LoRA (not
built or checked), ``add_out_norm`` False, an ``inference_state_dtype`` other than float32, an unbounded or huge
``gate_soft_cap``, and ``weight_mode`` values transformers does not know.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.classic import llama_view
from specray.models.gated_deltanet import (CHUNK, CHUNKED_FROM, FusedColumnLinear, RecurrentMixer, RecurrentModel,
                                           _segment_sums, rank_rows, to_chunks)
from specray.models.kv_cache import RecurrentStateSpec
from specray.models.layers import RMSNorm, RowParallelLinear, VocabParallelEmbedding, _param, divide, materialize
from specray.models.llama import _STACKED, LlamaForCausalLM, LlamaMLP, StageModel
from specray.parallel import PPGroup, TPGroup

MAX_GATE_CAP = 80.0  # exp(i) of a capped input gate stays finite in float32 (exp(88.7) overflows)
WEIGHT_MODES = ("single", "fused")


def _round_up(x: float, multiple: int) -> int:
    return int(((x + multiple - 1) // multiple) * multiple)


def check_config(config) -> None:
    """A ValueError naming the first setting this family's code does not compute."""
    mode = getattr(config, "weight_mode", "single")
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weight_mode={mode!r} is not supported for model_type='xlstm'; one of {list(WEIGHT_MODES)}")
    if not getattr(config, "add_out_norm", True):
        raise ValueError("add_out_norm=False is not supported for model_type='xlstm' (transformers applies the output "
                         "norm whatever it says; the xlstm package does not): use a config with add_out_norm true")
    state = getattr(config, "inference_state_dtype", "float32")
    if state != "float32":
        raise ValueError(f"inference_state_dtype={state!r} is not supported for model_type='xlstm'; the recurrent "
                         "state is kept in float32 ('float32')")
    cap = getattr(config, "gate_soft_cap", None)
    if cap is None or not 0 < cap <= MAX_GATE_CAP:
        raise ValueError(f"gate_soft_cap={cap} is not supported for model_type='xlstm': the input gate is carried as "
                         f"exp(i), which needs a cap in (0, {MAX_GATE_CAP}] (the releases use 15.0)")
    heads = config.num_heads
    for field in ("qk_dim_factor", "v_dim_factor"):
        width = int(config.hidden_size * getattr(config, field))
        if width % heads or width == 0:
            raise ValueError(f"{field}={getattr(config, field)} gives {width} features, not a positive multiple of "
                             f"num_heads={heads}; choose a factor whose width splits into the heads")


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else cap * torch.tanh(x / cap)


# ---- the mLSTM recurrence over the packed state [..., H, dk, dv + 2]: C | n | m ---------------------------------

def _unpack(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """state [..., H, dk, dv + 2] -> C | n [..., H, dk, dv + 1] and m [..., H]."""
    return state[..., :-1], state[..., 0, -1]


def _pack(cn: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.cat((cn, m[..., None, None].expand(*cn.shape[:-1], 1)), -1)


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    """v [..., dv] -> [..., dv + 1]: the normalizer's column of ones after the values."""
    return torch.cat((v, torch.ones_like(v[..., :1])), -1)


def _outputs(num: torch.Tensor, m: torch.Tensor, eps: float) -> torch.Tensor:
    """num [..., dv + 1] (q~^T C, then q~ . n), m [...] -> h [..., dv]."""
    return num[..., :-1] / (torch.maximum(num[..., -1].abs(), (-m).exp()) + eps)[..., None]


def _step(q, k, v1, logf, logi, cn, m, eps):
    """One token: q, k [..., H, dk], v1 [..., H, dv + 1], logf, logi [..., H], cn [..., H, dk, dv + 1], m [..., H]
    -> h [..., H, dv], the new cn and m."""
    m_new = torch.maximum(logf + m, logi)
    forget, write = (logf + m - m_new).exp(), (logi - m_new).exp()
    cn = forget[..., None, None] * cn + write[..., None, None] * (k[..., :, None] * v1[..., None, :])
    return _outputs((q[..., :, None] * cn).sum(-2), m_new, eps), cn, m_new


def _keep_rows(keep_at: list[int] | torch.Tensor | None, length: int, batch: int, device) -> torch.Tensor | None:
    """[L, B, 1, 1, 1] bool: sequence b's state is taken after its row keep_at[b] (-1: the state given)."""
    if keep_at is None:
        return None
    if isinstance(keep_at, torch.Tensor):
        return (torch.arange(length, device=device)[:, None] == keep_at[None, :])[:, :, None, None, None]
    hits = torch.zeros(length, batch, dtype=torch.bool)
    rows = [(t, b) for b, t in enumerate(keep_at) if t >= 0]
    if rows:
        hits[torch.tensor([t for t, _ in rows]), torch.tensor([b for _, b in rows])] = True
    return hits.to(device)[:, :, None, None, None]


def mlstm_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, keep_at: list[int] | torch.Tensor | None, eps: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The mLSTM token by token (module docstring), float32, B sequences padded to L rows: q (scaled), k [B, L, H,
    dk], v [B, L, H, dv], g = logsigmoid(f) and beta = exp(i) [B, L, H] (padding rows: g = 0, beta = 0, the state
    unchanged), state [B, H, dk, dv + 2]. Returns h [B, L, H, dv] and the state after row ``keep_at[b]`` (None: the
    last row; a host list or a [B] device tensor, -1 keeping the state given)."""
    b, length = q.shape[:2]
    keep = _keep_rows(keep_at, length, b, state.device)
    cn, m = _unpack(state)
    logi, v1 = beta.log(), _with_ones(v)
    kept, outputs = state, []
    for t in range(length):
        h, cn, m = _step(q[:, t], k[:, t], v1[:, t], g[:, t], logi[:, t], cn, m, eps)
        outputs.append(h)
        if keep is not None:
            kept = torch.where(keep[t], _pack(cn, m), kept)
    return torch.stack(outputs, 1), (_pack(cn, m) if keep is None else kept)


def mlstm_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, keep_at: list[int] | torch.Tensor | None, eps: float, chunk: int = CHUNK
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mlstm_scan`'s results (same arguments) chunk by chunk, the chunkwise-parallel form: within a chunk
    from state (C0, n0, m0), with G_t the cumulative log forget gate through row t and
    ``D[t, s] = G_t - G_s + i_s`` (s <= t), the stabilizer is ``m_t = max(G_t + m0, max_s D[t, s])`` (the step's m,
    unrolled), and ``C_t | n_t = exp(G_t + m0 - m_t) (C0 | n0) + sum_s exp(D[t, s] - m_t) k_s [v_s; 1]^T``, so
    every row's output is one masked matrix product plus the start state's share, and the state at the chunk's end
    (or a kept row) the same sum at that row."""
    b, length, h, dk = q.shape
    rows = torch.arange(b, device=q.device)
    chunk, (q, k, v1, g, beta) = to_chunks(chunk, q, k, _with_ones(v), g, beta)  # [B, H, N, C(, d)]
    n = q.shape[2]
    log_d = _segment_sums(g) + beta.log()[..., None, :]  # [B, H, N, C, C], -inf above the diagonal and at padding
    cum = g.cumsum(-1)  # [B, H, N, C]
    intra = log_d.amax(-1)  # [B, H, N, C]
    scores = q @ k.transpose(-1, -2)  # [B, H, N, C, C]
    cn, m = _unpack(state)
    at_chunk = at_token = None
    if keep_at is not None:
        keep = keep_at if isinstance(keep_at, torch.Tensor) else torch.tensor(keep_at, device=q.device)
        at_chunk, at_token = keep.div(chunk, rounding_mode="floor"), keep.remainder(chunk)
        kept = state
    outputs = []
    for c in range(n):
        m_t = torch.maximum(cum[:, :, c] + m[..., None], intra[:, :, c])  # [B, H, C]
        start = (cum[:, :, c] + m[..., None] - m_t).exp()  # the start state's weight per row [B, H, C]
        weights = (log_d[:, :, c] - m_t[..., None]).exp()  # [B, H, C, C]
        num = start[..., None] * (q[:, :, c] @ cn) + (scores[:, :, c] * weights) @ v1[:, :, c]  # [B, H, C, dv + 1]
        outputs.append(_outputs(num, m_t, eps))
        if at_chunk is not None:  # each sequence's state after its row at_token (where it lies in this chunk)
            w_j = weights[rows, :, at_token]  # [B, H, C]
            cn_j = (start[rows, :, at_token][..., None, None] * cn
                    + (k[:, :, c] * w_j[..., None]).transpose(-1, -2) @ v1[:, :, c])
            kept = torch.where((at_chunk == c)[:, None, None, None], _pack(cn_j, m_t[rows, :, at_token]), kept)
        cn = start[..., -1, None, None] * cn + (k[:, :, c] * weights[..., -1, :, None]).transpose(-1, -2) @ v1[:, :, c]
        m = m_t[..., -1]
    out = torch.stack(outputs, 2).reshape(b, h, n * chunk, -1)[:, :, :length].transpose(1, 2)  # [B, L, H, dv]
    return out, (_pack(cn, m) if keep_at is None else kept)


def mlstm_tree(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, parent_rows: list[int], keep: int, eps: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The mLSTM over one sequence's rows that form a tree (:func:`~specray.models.gated_deltanet.tree_rows`): row j
    steps from its parent row's state (``state`` [H, dk, dv + 2] for parent -1). q, k [L, H, dk], v [L, H, dv],
    g, beta [L, H] -> h [L, H, dv] and the state after row ``keep``."""
    logi, v1 = beta.log(), _with_ones(v)
    states, outputs = [], []
    for j, parent in enumerate(parent_rows):
        cn, m = _unpack(state) if parent < 0 else states[parent]
        h, cn, m = _step(q[j], k[j], v1[j], g[j], logi[j], cn, m, eps)
        states.append((cn, m))
        outputs.append(h)
    return torch.stack(outputs), (state if keep < 0 else _pack(*states[keep]))


# ---- the layers ----------------------------------------------------------------------------------------------------

class XLSTMRMSNorm(RMSNorm):
    """transformers' xLSTM RMSNorm: normed in float32 (or in the input's dtype, ``norm_reduction_force_float32``
    false), then the weight and, with ``use_bias``, a bias."""

    def __init__(self, size: int, eps: float, bias: bool, in_float32: bool):
        super().__init__(size, eps)
        self.bias = _param(size) if bias else None
        self.in_float32 = in_float32

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_float32:
            y = super()._norm(x)
        else:
            y = self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        return y if self.bias is None else y + self.bias


class MLSTMLayer(RecurrentMixer):
    """One mLSTM layer over this rank's heads (module docstring); checkpoint names transformers' under
    ``mlstm_layer.`` (``q``, ``k``, ``v``, ``ogate_preact`` stacked in ``in_proj``; ``igate_preact``,
    ``fgate_preact`` in ``if_preact``; or the fused release's ``qkv_opreact`` and ``ifgate_preact`` whole)."""

    kernel = 1  # the conv is the identity: a pending draft's input is its q | k | v row

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        h, heads = config.hidden_size, config.num_heads
        qk, v = int(h * config.qk_dim_factor), int(h * config.v_dim_factor)
        self.heads = divide(heads, tp.size, "num_heads")
        self.dk, self.dv = qk // heads, v // heads
        bias = bool(config.use_bias)
        self.in_proj = FusedColumnLinear(h, [qk, qk, v, v], tp, bias=bias)  # q | k | v | o
        self.if_preact = FusedColumnLinear(h, [heads, heads], tp, bias=True)  # i | f, one per head each
        self.multihead_norm = nn.Module()  # [v] over every head's features: this rank's heads'
        self.multihead_norm.weight = rank_rows(tp, self.heads * self.dv)
        self.multihead_norm.bias = rank_rows(tp, self.heads * self.dv) if bias else None
        self.out_proj = RowParallelLinear(v, h, tp, bias=bias)
        self.gate_cap = config.gate_soft_cap
        self.eps, self.norm_eps = float(config.eps), float(config.norm_eps)
        self.norm_in_float32 = bool(config.norm_reduction_force_float32)
        self.scale = self.dk ** -0.5  # q's

    @property
    def state_spec(self) -> RecurrentStateSpec:
        # per head C [dk, dv], n and m as two more columns
        return RecurrentStateSpec(conv_dim=self.heads * (2 * self.dk + self.dv), conv_width=0, num_heads=self.heads,
                                  key_dim=self.dk, value_dim=self.dv + 2)

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        # x: [T, H] (normed) -> [T, H] (meta.recurrent: see RecurrentMixer.recurrence)
        t = x.shape[0]
        mixed, o = self.in_proj(x).split([self.heads * (2 * self.dk + self.dv), self.heads * self.dv], dim=-1)
        i, f = soft_cap(self.if_preact(x), self.gate_cap).float().chunk(2, dim=-1)  # [T, heads] each
        out = self.recurrence(mixed, *self._gates(i, f), meta)  # [T, heads, dv] float32
        return self.out_proj(self._output_gate(o) * self._head_norm(out.to(x.dtype)).reshape(t, -1))

    @staticmethod
    def _gates(i: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The capped preactivations [T, heads] as the mixer's g = logsigmoid(f) and beta = exp(i)."""
        return F.logsigmoid(f), i.exp()

    @staticmethod
    def _output_gate(o: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(o)

    def _head_norm(self, h: torch.Tensor) -> torch.Tensor:
        """Each head's outputs [T, heads, dv] layer-normed over dv (in float32 unless told otherwise), then the
        weight (and bias) over every feature -> [T, heads * dv]."""
        y = F.layer_norm(h.float() if self.norm_in_float32 else h, (self.dv,), eps=self.norm_eps)
        y = y.to(h.dtype).reshape(h.shape[0], -1) * self.multihead_norm.weight
        return y if self.multihead_norm.bias is None else y + self.multihead_norm.bias

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        return window

    def _tree_conv(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, -1]

    def _split_heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv [B, L, C] -> q (scaled by dk^-0.5), k [B, L, heads, dk], v [B, L, heads, dv], float32."""
        b, length, _ = conv.shape
        q, k, v = conv.float().split([self.heads * self.dk, self.heads * self.dk, self.heads * self.dv], dim=-1)
        return (q.view(b, length, self.heads, self.dk) * self.scale, k.view(b, length, self.heads, self.dk),
                v.view(b, length, self.heads, self.dv))

    def _rule(self, q, k, v, g, beta, state, keep_at):
        rule = mlstm_chunked if q.shape[1] >= CHUNKED_FROM else mlstm_scan  # the same results
        return rule(q, k, v, g, beta, state, keep_at, self.eps)

    def _tree_rule(self, q, k, v, g, beta, state, parent_rows, keep):
        return mlstm_tree(q, k, v, g, beta, state, parent_rows, keep, self.eps)


class XLSTMBlock(nn.Module):
    """``x = x + mixer(norm(x))``, ``x = x + mlp(norm(x))`` (transformers' ``norm_mlstm``, ``mlstm_layer``,
    ``norm_ffn``, ``ffn``)."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        self.input_layernorm = build_norm(config)
        self.mixer = MLSTMLayer(config, tp)
        self.post_attention_layernorm = build_norm(config)
        self.mlp = LlamaMLP(ffn_view(config), tp)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.mixer(self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


def build_norm(config) -> XLSTMRMSNorm:
    return XLSTMRMSNorm(config.hidden_size, float(config.norm_eps), bool(config.use_bias),
                        bool(config.norm_reduction_force_float32))


def ffn_view(config):
    """The config as :class:`~specray.models.llama.LlamaMLP` reads it: a SwiGLU of the rounded-up width."""
    width = _round_up(config.hidden_size * config.ffn_proj_factor, config.ffn_round_up_to_multiple_of)
    return llama_view(config, hidden_act="silu", intermediate_size=width, mlp_bias=bool(config.use_bias))


class XLSTMModel(StageModel):
    """The stack: the embedding, the blocks, the output norm (one pipeline stage; transformers builds the output norm
    with neither a bias nor reductions in the model's dtype, whatever ``use_bias`` and
    ``norm_reduction_force_float32`` say)."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__()
        check_config(config)
        self.build_stage(config, pp, lambda i: XLSTMBlock(config, tp),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: XLSTMRMSNorm(config.hidden_size, float(config.norm_eps), False, True))

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids: [T] -> hidden [T, H], and the residual stream [T, H] entering each layer of aux_layers
        x = self.embed_tokens(input_ids)
        aux: dict[int, torch.Tensor] = {}
        for i, layer in self.stage_layers():
            if i in aux_layers:
                aux[i] = x
            x = layer(x, meta)
        return self.norm(x), [aux[i] for i in aux_layers]


# the checkpoint's names onto ours (q, k, v, o and the gates then stacked by XLSTMForCausalLM.stacked)
_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^backbone\.embeddings\.", "model.embed_tokens."), (r"^backbone\.out_norm\.", "model.norm."),
    (r"^backbone\.blocks\.", "model.layers."), (r"\.norm_mlstm\.", ".input_layernorm."),
    (r"\.norm_ffn\.", ".post_attention_layernorm."), (r"\.mlstm_layer\.", ".mixer."),
    (r"\.mixer\.qkv_opreact\.", ".mixer.in_proj."), (r"\.mixer\.ifgate_preact\.", ".mixer.if_preact."),
    (r"\.ffn\.proj_up_gate\.", ".mlp.gate_proj."), (r"\.ffn\.proj_up\.", ".mlp.up_proj."),
    (r"\.ffn\.proj_down\.", ".mlp.down_proj.")))
_FUSED_FFN = re.compile(r"\.ffn\.proj_up_gate_z\.(weight|bias)$")



class XLSTMForCausalLM(RecurrentModel, LlamaForCausalLM):
    """xLSTM for causal LM, sharded over ``tp`` (module docstring)."""

    model_class = XLSTMModel
    stage_width = 1
    one_stage = "not built or checked yet"
    may_tie = False  # transformers' class ties nothing (its head is its own)
    lora_modules: tuple[str, ...] = ()  # not yet: no adapter of this family was checked
    stacked = {".mixer.q.": (".mixer.in_proj.", 0), ".mixer.k.": (".mixer.in_proj.", 1),
               ".mixer.v.": (".mixer.in_proj.", 2), ".mixer.ogate_preact.": (".mixer.in_proj.", 3),
               ".mixer.igate_preact.": (".mixer.if_preact.", 0), ".mixer.fgate_preact.": (".mixer.if_preact.", 1),
               **_STACKED}

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        check_config(hf_config)
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.renames = _RENAMES
        self.final_logit_softcapping = getattr(hf_config, "output_logit_soft_cap", None)

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        check_config(config)
        divide(config.num_heads, tp, "num_heads")

    def _check_loaded(self, loaded: set[str], params: dict[str, nn.Parameter]) -> None:
        """The single layout's stacked parts count as their merged parameter once every part loaded."""
        whole = set(loaded)
        for key in loaded:
            name = key.rpartition(":")[0]
            for piece, parts in ((".mixer.in_proj.", 4), (".mixer.if_preact.", 2)):
                if piece in name and all(f"{name}:{i}" in loaded for i in range(parts)):
                    whole.add(name)
        super()._check_loaded(whole, params)

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The fused release's FFN input projection (gate rows, then up rows) as the two it stacks."""
        for name, tensor in weights:
            if _FUSED_FFN.search(name):
                gate, up = materialize(tensor).chunk(2, dim=0)
                yield _FUSED_FFN.sub(r".ffn.proj_up_gate.\1", name), gate
                yield _FUSED_FFN.sub(r".ffn.proj_up.\1", name), up
            else:
                yield name, tensor
