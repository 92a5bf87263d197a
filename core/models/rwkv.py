"""RWKV-4 (``RwkvForCausalLM``: RWKV/rwkv-4-169m-pile to rwkv-4-14b-pile and the rwkv-raven-* releases; Peng et al.,
"RWKV: Reinventing RNNs for the Transformer Era", 2023) on the Llama plumbing (:mod:`specray.models.llama`), with the
recurrent state per request that every recurrent family keeps
(:class:`~specray.models.gated_deltanet.RecurrentMixer`).

The embedding goes through a LayerNorm (``pre_ln``, layer 0's), then every block is
``h = h + time_mix(ln1(h))``, ``h = h + channel_mix(ln2(h))``, and ``ln_out`` (eps 1e-5 whatever the config says, as
transformers builds it) comes after the last one; the head is ``head`` (tied to the embedding only where
``tie_word_embeddings``). Both mixers start with a token shift: for an input x_t and the previous token's x_(t-1)
(zeros at position 0), each of their projections reads ``x_t * m + x_(t-1) * (1 - m)`` with a mix m [hidden] of its
own (``time_mix_key`` and so on).

* Time mixing: ``k = key(x_k)``, ``v = value(x_v)``, ``r = sigmoid(receptance(x_r))``, then per channel c the WKV
  recurrence with w = -exp(``time_decay``) and u = ``time_first`` (float32), on a state (num, den, max) that keeps
  ``sum_i exp(k_i + (t - 1 - i) w) v_i`` as num * exp(max) (den likewise without v): the output of token t is
  ``(e1 num + e2 v_t) / (e1 den + e2)`` with p = max(max, u + k_t), e1 = exp(max - p), e2 = exp(u + k_t - p); the
  state then becomes (e1' num + e2' v_t, e1' den + e2', p') with p' = max(max + w, k_t), e1' = exp(max + w - p'),
  e2' = exp(k_t - p'). The block's output is ``output(r * wkv)``.
* Channel mixing: ``sigmoid(receptance(x_r)) * value(relu(key(x_k))^2)``.

Each mixer is a :class:`~specray.models.gated_deltanet.RecurrentMixer` whose conv has width 2 (a history of one
input: the previous token's normed hidden state, in the model's dtype, as transformers keeps it) and whose ``_conv``
is the token shift's mixes (:class:`TokenShift`), so replayed drafts, token trees (a row's window is its parent's
input and its own), graph steps and the state slots are the shared machinery's. The time mixer's matrix is the WKV
state, [channels, 3, 1] per slot (num, den, max; a fresh slot is zeros, read as den = 0: no history, max -1e30 as
transformers starts it): :class:`WKVMixer` computes k, v and r from the conv's output inside the recurrence
(``gates_from_conv``) and overrides the rule (:func:`wkv_scan`, :func:`wkv_tree`); beta marks real rows (1) from
padding (0: the state left as it is). The channel mixer keeps no matrix (a :class:`ConvOnlyMixer`).

``rescale_every`` (R > 0): transformers, in eval mode and in every dtype alike (fp32, fp16, bf16), divides each
block i's ``attention.output`` and ``feed_forward.value`` weights by 2^(i // R) and halves the hidden state after
every R-th block, so the residual stream stays in fp16's range; mathematically a no-op but for the LayerNorms' eps.
specray does the same: the two weights divided as they load (in float32, then rounded to the model's dtype, exact for
powers of two), the halving in the block.

Tensor parallelism: the time mixer's channels (``attention_hidden_size``) split over the ranks (key, value,
receptance column-parallel, time_decay / time_first by rows, ``output`` row-parallel), the channel mixer's
intermediate width too (key column-, value row-parallel; its receptance replicated, since it gates the reduced
output); the token shift's inputs are the whole hidden state on every rank. Refused by name: pipeline stages and
LoRA (not built), and an ``attention_hidden_size`` other than ``hidden_size`` (no release has one; transformers'
cached path fails on it, so it is not checked)."""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.gated_deltanet import ConvOnlyMixer, RecurrentMixer, RecurrentModel
from specray.models.kv_cache import RecurrentStateSpec
from specray.models.layers import (ColumnParallelLinear, LayerNorm, RowParallelLinear, VocabParallelEmbedding,
                                   _copy, _param, divide, materialize, narrow)
from specray.models.llama import _CHECKPOINT_NAMES, LlamaForCausalLM, StageModel
from specray.parallel import PPGroup, TPGroup

NO_HISTORY = -1e30  # the max of a state with nothing in it (transformers' start)
LN_OUT_EPS = 1e-5  # transformers builds ln_out with nn.LayerNorm's default eps, not layer_norm_epsilon


def _fp32_rows(tp: TPGroup, rows: int) -> nn.Parameter:
    """A float32 parameter [rows] loading this rank's rows of the checkpoint's (transformers keeps time_decay and
    time_first in float32 whatever the model's dtype)."""
    param = nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
    param.weight_loader = lambda p, loaded: _copy(p, narrow(loaded, 0, tp.rank * rows, rows))
    return param


def _wkv_step(num, den, mx, k, v, w, u):
    """One token of the WKV recurrence per channel (module docstring): -> its output and the state after it."""
    uk = k + u
    p = torch.maximum(mx, uk)
    e1, e2 = torch.exp(mx - p), torch.exp(uk - p)
    out = (e1 * num + e2 * v) / (e1 * den + e2)
    decayed = mx + w
    p = torch.maximum(decayed, k)
    e1, e2 = torch.exp(decayed - p), torch.exp(k - p)
    return out, (e1 * num + e2 * v, e1 * den + e2, p)


def _unpack(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # state [..., C, 3, 1] -> num, den, max [..., C]; a slot with nothing in it (den 0) starts from transformers' max
    num, den, mx = state[..., 0].unbind(-1)
    return num, den, torch.where(den > 0, mx, torch.full_like(mx, NO_HISTORY))


def wkv_scan(k: torch.Tensor, v: torch.Tensor, real: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
             state: torch.Tensor, keep_at: list[int] | torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The WKV recurrence token by token, float32, B sequences padded to L tokens: k, v [B, L, C], ``real`` [B, L, C]
    (0 on padding rows: the state left as it is), w, u [C], state [B, C, 3, 1] (num, den, max). Returns the outputs
    [B, L, C] and the state after token ``keep_at[b]`` of each sequence (None: after the last; a host list or a [B]
    long tensor on the device, -1 keeping the state given)."""
    length = k.shape[1]
    num, den, mx = _unpack(state)
    keep = None
    if isinstance(keep_at, torch.Tensor):
        keep = torch.arange(length, device=k.device)[:, None] == keep_at[None, :]  # [L, B]
    elif keep_at is not None:
        hits = torch.zeros(length, len(keep_at), dtype=torch.bool)
        for b, t in enumerate(keep_at):  # (-1: no row; the initial state kept)
            if t >= 0:
                hits[t, b] = True
        keep = hits.to(k.device)
    kept = (num, den, mx)
    outputs = []
    for t in range(length):
        out, new = _wkv_step(num, den, mx, k[:, t], v[:, t], w, u)
        on = real[:, t] > 0
        num, den, mx = (torch.where(on, a, b) for a, b in zip(new, (num, den, mx)))
        outputs.append(out)
        if keep is not None:
            kept = tuple(torch.where(keep[t][:, None], a, b) for a, b in zip((num, den, mx), kept))
    final = (num, den, mx) if keep is None else kept
    return torch.stack(outputs, 1), torch.stack(final, -1)[..., None]


def wkv_tree(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor, state: torch.Tensor,
             parent_rows: list[int], keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The WKV recurrence over one sequence's rows that form a tree (each row from its parent row's state; -1: from
    ``state`` [C, 3, 1]): k, v [L, C] -> the outputs [L, C] and the state after row ``keep``."""
    start = _unpack(state)
    states, outputs = [], []
    for j, parent in enumerate(parent_rows):
        out, new = _wkv_step(*(start if parent < 0 else states[parent]), k[j], v[j], w, u)
        states.append(new)
        outputs.append(out)
    return torch.stack(outputs), torch.stack(start if keep < 0 else states[keep], -1)[..., None]


class TokenShift:
    """A :class:`RecurrentMixer` whose conv (width 2) is RWKV's token shift: each output row is, per mix m of
    ``mixes`` (parameters [1, 1, hidden]), ``x_t * m + x_(t-1) * (1 - m)``, the mixes side by side."""

    kernel = 2
    mixes: tuple[str, ...]

    def _shift(self, cur: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        parts = []
        for name in self.mixes:
            m = getattr(self, name).view(-1)
            parts.append(cur * m + prev * (1 - m))
        return torch.cat(parts, -1)

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        # window [B, 1 + L, H] -> [B, L, len(mixes) * H]
        return self._shift(window[:, 1:], window[:, :-1])

    def _tree_conv(self, rows: torch.Tensor) -> torch.Tensor:
        # rows [L, 2, H] (the parent's input, the row's own) -> [L, len(mixes) * H]
        return self._shift(rows[:, 1], rows[:, 0])


class WKVMixer(TokenShift, RecurrentMixer):
    """RWKV's time mixing over this rank's channels (module docstring); checkpoint names ``attention.``."""

    delta_rule = False
    gates_from_conv = True
    mixes = ("time_mix_key", "time_mix_value", "time_mix_receptance")

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        h, a = config.hidden_size, attention_width(config)
        self.hidden = h
        self.width = divide(a, tp.size, "attention_hidden_size")
        self.time_decay = _fp32_rows(tp, self.width)
        self.time_first = _fp32_rows(tp, self.width)
        for name in self.mixes:
            setattr(self, name, _param(1, 1, h))
        self.key = ColumnParallelLinear(h, a, tp)
        self.value = ColumnParallelLinear(h, a, tp)
        self.receptance = ColumnParallelLinear(h, a, tp)
        self.output = RowParallelLinear(a, h, tp)

    @property
    def state_spec(self) -> RecurrentStateSpec:
        # the previous token's normed hidden state; per channel a head of (num, den, max)
        return RecurrentStateSpec(conv_dim=self.hidden, conv_width=1, num_heads=self.width, key_dim=3, value_dim=1)

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        # x: ln1 of the residual stream [T, H] -> [T, H] (meta.recurrent: see RecurrentMixer.recurrence)
        t = x.shape[0]
        unused = x.new_zeros(t, self.width, dtype=torch.float32)  # k, v and r come from the conv's output
        out = self.recurrence(x, unused, unused, meta).reshape(t, -1)  # r * wkv [T, C], the model's dtype
        return self.output(out.to(x.dtype))

    def _heads_and_gates(self, conv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """conv [B, L, 3H] (the shifted inputs of key, value, receptance) -> q = r, k, v [B, L, C, 1] (v's second
        column r again, for :meth:`_skip`), g = 0 and beta = 1 (a real row) [B, L, C], float32."""
        b, length, _ = conv.shape
        xk, xv, xr = conv.reshape(b * length, -1).split(self.hidden, dim=-1)
        k = self.key(xk).float().view(b, length, self.width)
        v = self.value(xv).float().view(b, length, self.width)
        r = torch.sigmoid(self.receptance(xr)).float().view(b, length, self.width)
        ones = torch.ones_like(k)
        return r[..., None], k[..., None], torch.stack((v, r), -1), torch.zeros_like(k), ones

    def _rule(self, q, k, v, g, beta, state, keep_at):
        out, kept = wkv_scan(k[..., 0], v[..., 0], beta, -self.time_decay.exp(), self.time_first, state, keep_at)
        return out[..., None], kept

    def _tree_rule(self, q, k, v, g, beta, state, parent_rows, keep):
        out, kept = wkv_tree(k[..., 0], v[..., 0], -self.time_decay.exp(), self.time_first, state, parent_rows, keep)
        return out[..., None], kept

    def _skip(self, out: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """r * wkv, both rounded to the model's dtype first (as transformers multiplies them)."""
        dtype = self.key.weight.dtype
        return out.to(dtype) * v[..., 1:].to(dtype)


class ChannelMixer(TokenShift, ConvOnlyMixer):
    """RWKV's channel mixing (module docstring): a token shift and no matrix; checkpoint names ``feed_forward.``."""

    mixes = ("time_mix_key", "time_mix_receptance")

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        h = config.hidden_size
        self.hidden = h
        for name in self.mixes:
            setattr(self, name, _param(1, 1, h))
        inter = config.intermediate_size or 4 * h
        self.key = ColumnParallelLinear(h, inter, tp)
        self.receptance = ColumnParallelLinear(h, h, TPGroup.single())  # replicated: it gates the reduced output
        self.value = RowParallelLinear(inter, h, tp)

    @property
    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(conv_dim=self.hidden, conv_width=1, num_heads=0, key_dim=1, value_dim=1)

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        # x: ln2 of the residual stream [T, H] -> [T, H]
        t = x.shape[0]
        none = x.new_zeros(t, 0, dtype=torch.float32)
        xk, xr = self.recurrence(x, none, none, meta).reshape(t, -1).to(x.dtype).split(self.hidden, dim=-1)
        return torch.sigmoid(self.receptance(xr)) * self.value(self.square_relu(self.key(xk)))

    @staticmethod
    def square_relu(x: torch.Tensor) -> torch.Tensor:
        return torch.square(torch.relu(x))


def attention_width(config) -> int:
    return config.attention_hidden_size or config.hidden_size


def check_config(config) -> None:
    """A ValueError naming a setting this family does not serve."""
    width = attention_width(config)
    if width != config.hidden_size:  # (transformers' cached path, hence its generate, fails on it too)
        raise ValueError(f"attention_hidden_size={width} is not supported for model_type='rwkv' (every release has "
                         f"it equal to hidden_size={config.hidden_size}; not checked against transformers, whose "
                         "state is hidden_size wide); set it to null or to hidden_size")


def rescale_every(config) -> int:
    return int(getattr(config, "rescale_every", 0) or 0)


class RwkvBlock(nn.Module):
    """One block (module docstring); ``input_layernorm`` / ``post_attention_layernorm`` are its ln1 / ln2, layer 0
    holds ``pre_ln``."""

    mlp = None  # (what the plumbing asks a layer for its experts: none; the channel mixer is ``feed_forward``)

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_epsilon
        if layer == 0:
            self.pre_ln = LayerNorm(h, eps)
        self.input_layernorm = LayerNorm(h, eps)
        self.post_attention_layernorm = LayerNorm(h, eps)
        self.attention = WKVMixer(config, tp)
        self.feed_forward = ChannelMixer(config, tp)
        every = rescale_every(config)
        self.halves = every > 0 and (layer + 1) % every == 0

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: the residual stream [T, H] -> the next block's
        if hasattr(self, "pre_ln"):
            x = self.pre_ln(x)
        x = x + self.attention(self.input_layernorm(x), meta)
        x = x + self.feed_forward(self.post_attention_layernorm(x), meta)
        return x / 2 if self.halves else x


class RwkvModel(StageModel):
    """The stack: embedding, blocks, ``ln_out`` (no positions: the token shifts and the WKV state carry order)."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__()
        check_config(config)
        self.build_stage(config, pp, lambda i: RwkvBlock(config, tp, i),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: LayerNorm(config.hidden_size, LN_OUT_EPS))

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids: [T] -> hidden [T, H], and the residual stream [T, H] entering each layer of aux_layers
        assert intermediate is None, "RWKV runs as one pipeline stage"
        x = self.embed_tokens(input_ids)
        aux: dict[int, torch.Tensor] = {}
        for i, layer in self.stage_layers():
            if i in aux_layers:
                aux[i] = x
            x = layer(x, meta)
        return self.norm(x), [aux[i] for i in aux_layers]


_CHECKPOINT_NAMES["rwkv"] = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^rwkv\.embeddings\.", "model.embed_tokens."), (r"^rwkv\.blocks\.", "model.layers."),
    (r"\.ln1\.", ".input_layernorm."), (r"\.ln2\.", ".post_attention_layernorm."),
    (r"^rwkv\.ln_out\.", "model.norm."), (r"^head\.", "lm_head.")))

_RESCALED = re.compile(r"^rwkv\.blocks\.(\d+)\.(?:attention\.output|feed_forward\.value)\.weight$")



class RwkvForCausalLM(RecurrentModel, LlamaForCausalLM):
    """RWKV-4 for causal LM, sharded over ``tp`` (module docstring)."""

    model_class = RwkvModel
    stage_width = 1
    one_stage = "not built or checked yet"
    lora_modules: tuple[str, ...] = ()  # not yet: no adapter of this family was checked

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        check_config(config)
        divide(attention_width(config), tp, "attention_hidden_size")
        divide(config.intermediate_size or 4 * config.hidden_size, tp, "intermediate_size")

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The checkpoint's tensors, block i's ``attention.output`` and ``feed_forward.value`` weights divided by
        2^(i // rescale_every) (module docstring)."""
        every = rescale_every(self.config)
        for name, tensor in weights:
            hit = _RESCALED.match(name) if every > 0 else None
            if hit is not None and int(hit.group(1)) // every:
                tensor = materialize(tensor).float() / 2 ** (int(hit.group(1)) // every)
            yield name, tensor
