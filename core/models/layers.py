"""Tensor-parallel building blocks: column/row parallel linears, merged QKV and gate-up projections, vocab-parallel
embedding and LM head, RMSNorm and rotary embeddings.

Every parameter carries a ``weight_loader(param, loaded[, shard_id])`` that takes the full checkpoint tensor (a
``torch.Tensor`` or a lazily sliceable safetensors slice) and copies this rank's shard, so a rank only ever
materializes its part.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models import cpu_kernels
from specray.models.int_quant import Int4Weight, IntStaging, IntWeight
from specray.models.fp8_blocks import BlockFP8Linear, BlockScaled, BlockScaledStaging
from specray.models.w8a8 import Format, RowScaled, RowScaledStaging, W8A8Linear, pack_w8a8, quantize_weight
from specray.parallel import TPGroup

# ---------------------------------------------------------------------------------------------- weight helpers


def shape_of(w: Any) -> tuple[int, ...]:
    """Shape of a tensor or of a safetensors slice."""
    return tuple(w.shape) if isinstance(w, torch.Tensor) else tuple(w.get_shape())


def narrow(w: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """``w.narrow(dim, start, length)`` for a tensor or a safetensors slice (reads only that part)."""
    if isinstance(w, torch.Tensor):
        return w.narrow(dim, start, length)
    index = [slice(None)] * len(shape_of(w))
    index[dim] = slice(start, start + length)
    return w[tuple(index)]


def loaded_whole(loaded: set[str], part: re.Pattern, parts: int = 3) -> set[str]:
    """The loaded names with a tensor loaded part by part (``part`` matches ``<name>:<k>``, its group 2 the part
    ``k``) counted as its whole ``<name>`` once all ``parts`` came (a family's fused projection or conv that its
    checkpoint stores as pieces)."""
    found: dict[str, set[str]] = {}
    for key in loaded:
        match = part.search(key)
        if match is not None:
            found.setdefault(key[: match.start(2) - 1], set()).add(match.group(2))
    whole = {base for base, got in found.items() if got == {str(k) for k in range(parts)}}
    return {k for k in loaded if part.search(k) is None} | whole


def materialize(w: Any) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w[...]  # "..." reads a 0-dim slice too


DEFAULT_MAX_POSITIONS = 2048  # a model's length where its config gives none (Mamba-2's), as vLLM's default


def max_positions(config) -> int:
    """The longest sequence ``config``'s model serves: its ``max_position_embeddings`` (MPT's ``max_seq_len``), else
    :data:`DEFAULT_MAX_POSITIONS` (raise it with ``hf_overrides``)."""
    given = getattr(config, "max_position_embeddings", None) or getattr(config, "max_seq_len", None)
    return given or DEFAULT_MAX_POSITIONS


def rope_per_kind(params: Any) -> bool:
    """Whether RoPE settings (``rope_parameters``) are given per kind of layer (Gemma 3's: a dict of dicts)."""
    return isinstance(params, dict) and bool(params) and all(isinstance(v, dict) for v in params.values())


def rope_scaled_positions(config) -> int | None:
    """The longest sequence RoPE scaling stretches ``config``'s model to, as vLLM derives it: ``factor`` times the
    pretrained length (YaRN's ``original_max_position_embeddings``, else ``max_position_embeddings``) for linear,
    dynamic and YaRN scaling (a Qwen3 given YaRN by its model card: 4 x 32768); None for other RoPE (llama3's and
    LongRoPE's configs name the stretched length as max_position_embeddings), for none and for RoPE given per kind
    of layer (Gemma 3's max_position_embeddings is already the stretched one)."""
    given = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(given, dict) or not given or rope_per_kind(given):
        return None
    try:
        params = rope_parameters(config, partial=True)
    except (ValueError, KeyError, TypeError):  # settings the model refuses by name when it is built
        return None
    factor = params.get("factor")
    if params["rope_type"] not in ("linear", "dynamic", "yarn") or not isinstance(factor, (int, float)):
        return None
    yarn = params["rope_type"] == "yarn"
    return int((params["original_max_position_embeddings"] if yarn else max_positions(config)) * factor)


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={d}; choose a tensor_parallel_size "
                         f"that divides {what}")
    return n // d


def check_whole(loaded: Any, shape: tuple[int, ...]) -> None:
    """ValueError unless a checkpoint tensor has the whole (unsharded) ``shape`` its parameter was built for: a
    larger one would be read in part, silently (the config's head counts, head_dim or widths smaller)."""
    if tuple(shape_of(loaded)) != tuple(shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(shape_of(loaded))} does not fit parameter of shape "
                         f"{tuple(shape)}: the checkpoint does not match its config.json (its head counts, head_dim "
                         "or widths)")


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter of shape "
                         f"{tuple(param.shape)}: the checkpoint does not match its config.json")
    param.data.copy_(loaded)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


# ---------------------------------------------------------------------------------------------- linears


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, kept: Int4Weight | W8A8Linear | BlockFP8Linear | None = None
           ) -> torch.Tensor:
    """``F.linear`` for 2-D ``x``, the one entry every linear calls: a weight kept quantized (``kept``: in 4 bits
    through torch's weight-only kernel, or in 8 bits through an 8-bit matmul); on CPU the kernels of
    :mod:`specray.models.cpu_kernels` (``packed`` is a weight they prepared at load), elsewhere plain."""
    # x: [M, K]; weight: [N, K] -> [M, N]
    if kept is not None:
        y = kept.matmul(x)
        return y if bias is None else y + bias
    if x.device.type == "cpu":
        return cpu_kernels.cpu_linear(x, weight, bias, packed)
    return F.linear(x, weight, bias)


_KEEP_INTS = False  # linears built now keep a quantized checkpoint's values (int_linears)
# the quantized weights a linear keeps so (each with .rows, .cols, .staging; a cut it cannot keep is None)
KEPT_TYPES = (IntWeight, RowScaled, BlockScaled)


@contextlib.contextmanager
def int_linears(enabled: bool = True):
    """Linears built inside keep a quantized checkpoint's values (:data:`KEPT_TYPES`: integers,
    :mod:`specray.models.int_quant`; row-scaled 8-bit ones, :mod:`specray.models.w8a8`; block-scaled FP8 ones,
    :mod:`specray.models.fp8_blocks`) instead of a dense weight:
    no dense storage until a dense weight loads; then :func:`keep_quantized_weights`."""
    global _KEEP_INTS
    old, _KEEP_INTS = _KEEP_INTS, enabled
    try:
        yield
    finally:
        _KEEP_INTS = old


class LinearBase(nn.Module):
    """Base of the TP linears. ``packed`` is a kernel-specific copy of ``weight`` made once after loading
    (:func:`specray.models.cpu_kernels.pack_linear_weights`), None until then. Built under :func:`int_linears`, a
    linear's ``weight`` starts empty (``keeps_ints``): a quantized weight (:data:`KEPT_TYPES`) loading into it is
    staged (``staged``) and, once all have loaded, kept for its kernel (``kept``, :func:`keep_quantized_weights`); a
    dense one gets its dense storage then."""

    packed: torch.Tensor | None = None
    keeps_dense_weight = False  # packing keeps ``weight`` too
    lora = None  # a projection that takes LoRA adapters: its stacked adapters (specray.models.lora.LinearLoRA)
    keeps_ints = False
    staged: IntStaging | RowScaledStaging | BlockScaledStaging | None = None
    # a submodule once kept (set per instance: a class default would hide it)
    kept: Int4Weight | W8A8Linear | BlockFP8Linear | None

    def _own_weight(self, rows: int, cols: int) -> nn.Parameter:
        """The weight [rows, cols]: empty under :func:`int_linears` (its shape kept in ``dense_shape``)."""
        self.kept = None
        self.dense_shape = (rows, cols)
        self.keeps_ints = _KEEP_INTS
        weight = _param(0) if _KEEP_INTS else _param(rows, cols)
        weight.weight_loader = self.weight_loader
        return weight

    def _stage(self, offset: int, part: IntWeight | RowScaled | BlockScaled | None) -> bool:
        """Stage a part's quantized values at rows ``offset``; False (nothing staged) where they cannot be kept."""
        if part is None or not self.keeps_ints or self.keeps_dense_weight or self.weight.numel():
            return False  # (a weight read as a matrix, DeepSeek's kv_b_proj, stays dense)
        if self.staged is None:
            self.staged = part.staging(*self.dense_shape)
        if not self.staged.fits(part, offset):
            return False
        self.staged.put(offset, part)
        return True

    def dense_weight(self) -> nn.Parameter:
        """The weight with its dense storage (the values staged so far dequantized into it)."""
        w = self.weight
        if w.numel() == 0 and self.keeps_ints:
            w.data = torch.zeros(self.dense_shape, dtype=w.dtype, device=w.device)
            if self.staged is not None:
                w.data.copy_(self.staged.dense())
                self.staged = None
        return w


class ColumnParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's output rows split across ranks; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_local = divide(out_features, tp.size, "output features")
        self.weight = self._own_weight(self.out_local, in_features)
        self.bias = _param(self.out_local) if bias else None
        if bias:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        self._load_rows(param, loaded, 0, self.out_local, self.tp.rank * self.out_local, self.out_local * self.tp.size)

    def _load_rows(self, param: nn.Parameter, loaded: Any, offset: int, size: int, start: int,
                   whole: int | None = None) -> None:
        """Rows ``start .. start + size`` of a checkpoint tensor into rows ``offset ..`` of ``param`` (this
        linear's weight, staged where it keeps integers; its bias; or a LoRA shard); ``whole``: the rows the
        checkpoint's tensor must have (a ValueError otherwise: a larger one was read in part, silently)."""
        if whole is not None:
            check_whole(loaded, (whole, *shape_of(loaded)[1:]))
        if param is self.weight:
            if isinstance(loaded, KEPT_TYPES) and self._stage(offset, loaded.rows(start, size)):
                return
            param = self.dense_weight()
        _copy(param.data.narrow(0, offset, size), narrow(loaded, 0, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out_local]
        y = linear(x, self.weight, self.bias, packed=self.packed, kept=self.kept)
        return y if self.lora is None or not self.lora.context.active else y + self.lora.delta(x)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_proj + up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], tp: TPGroup, bias: bool = False):
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), tp, bias)
        self.local_sizes = [divide(s, tp.size, "output features") for s in output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int) -> None:
        size = self.local_sizes[shard_id]
        self._load_rows(param, loaded, sum(self.local_sizes[:shard_id]), size, self.tp.rank * size,
                        self.output_sizes[shard_id])


def splits_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> bool:
    """Whether :class:`QKVParallelLinear` can shard these heads over ``tp_size`` ranks: the query heads divide,
    and the KV heads divide too or, fewer than the ranks, are replicated (``tp_size`` a multiple of them)."""
    kv_ok = num_kv_heads % tp_size == 0 if num_kv_heads >= tp_size else tp_size % num_kv_heads == 0
    return num_heads % tp_size == 0 and kv_ok


def check_heads_split(config, tp: int, option: str = "tensor_parallel_size", whose: str = "this model's") -> None:
    """A ValueError naming ``option`` and the sizes that fit unless ``tp`` ranks split ``config``'s attention and
    KV heads (checked before any rank starts)."""
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        return
    kv = getattr(config, "num_key_value_heads", None) or heads
    if not splits_heads(heads, kv, tp):
        fits = [d for d in range(1, heads + 1) if splits_heads(heads, kv, d)]
        raise ValueError(f"{option}={tp} does not split {whose} heads (num_attention_heads={heads}, "
                         f"num_key_value_heads={kv}); choose one of {fits}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul. Query heads split across ranks; key/value heads too, or replicated
    (one per rank) when there are fewer KV heads than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: TPGroup,
                 bias: bool = False):
        self.head_dim = head_dim
        if num_heads % num_kv_heads:
            fits = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}:"
                             " each key/value head serves a whole group of query heads; the config's "
                             f"num_key_value_heads must be one of {fits} (k_proj's rows over head_dim={head_dim})")
        self.num_heads = divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size={tp.size} must be a multiple of num_key_value_heads="
                                 f"{num_kv_heads} when it exceeds it (KV heads are then replicated)")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank // (tp.size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.total_rows = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        super().__init__(hidden_size, out * tp.size, tp, bias)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str) -> None:
        if shard_id == "q":
            offset, size, src = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id == "k":
            offset, size, src = self.q_size, self.kv_size, self.kv_head_start * self.head_dim
        else:
            assert shard_id == "v", shard_id
            offset, size, src = self.q_size + self.kv_size, self.kv_size, self.kv_head_start * self.head_dim
        self._load_rows(param, loaded, offset, size, src, self.total_rows[shard_id])


class RowParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's input columns split across ranks: partial products are summed (all-reduce)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.in_local = divide(in_features, tp.size, "input features")
        self.out_features = out_features
        self.weight = self._own_weight(out_features, self.in_local)
        self.bias = _param(out_features) if bias else None
        if bias:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        if param is self.bias:  # the bias is added once, after the reduction
            _copy(param, materialize(loaded))
            return
        start, whole = self.tp.rank * self.in_local, self.in_local * self.tp.size
        check_whole(loaded, (*shape_of(loaded)[:-1], whole))
        if param is self.weight:
            if isinstance(loaded, KEPT_TYPES) and self._stage(0, loaded.cols(start, self.in_local)):
                return
            param = self.dense_weight()
        _copy(param, narrow(loaded, 1, start, self.in_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_local] -> [T, out]
        y = self.tp.all_reduce(self.partial(x))
        return y if self.bias is None else y + self.bias

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``x W^T`` before the sum over ranks (no bias): for a caller that adds several
        row-parallel outputs and reduces once."""
        y = linear(x, self.weight, packed=self.packed, kept=self.kept)
        return y if self.lora is None or not self.lora.context.active else y + self.lora.delta(x)


def keep_quantized_weights(model: nn.Module) -> int:
    """After loading: every linear that staged quantized values keeps them for its device's kernel (4 or 8 bits),
    or, where the kernel does not take its shape, dequantized. Returns how many kept them."""
    kept = 0
    for module in model.modules():
        if isinstance(module, LinearBase) and module.staged is not None:
            w = module.weight
            module.kept = module.staged.kept(w.device, w.dtype)
            if module.kept is None:
                module.dense_weight()
            kept += module.kept is not None
            module.staged = None
    return kept


@torch.no_grad()
def quantize_linears(model: nn.Module, fmt: Format) -> int:
    """Online quantization (vLLM's ``quantization="fp8"`` over an unquantized checkpoint), after loading: every
    projection's dense weight rounded to ``fmt`` with a scale per row and kept for its 8-bit matmul
    (:mod:`specray.models.w8a8`), its dense storage freed; the LM head, a weight read as a matrix and a shape the
    kernel does not take stay dense (a mixture's routers are no linears: full precision, as vLLM keeps them); a
    mixture's experts kept in FP8 by row where the device keeps FP8 experts (``SparseMoE.quantize_experts``). A
    row-parallel rank scales each row by the whole row's largest magnitude (gathered over the ranks), so every rank
    holds what one rank would. Returns how many linears and expert blocks it kept."""
    kept = 0
    for module in model.modules():
        experts = getattr(module, "quantize_experts", None)  # a mixture's experts (SparseMoE: FP8 by row)
        if experts is not None:
            kept += experts(fmt)
            continue
        w = getattr(module, "weight", None)
        if (not isinstance(module, LinearBase) or hasattr(module, "num_embeddings") or module.keeps_dense_weight
                or getattr(module, "kept", None) is not None or w is None or w.dim() != 2
                or not w.numel()):
            continue
        row_max = w.abs().amax(1).float()
        if isinstance(module, RowParallelLinear) and module.tp.size > 1:  # this rank holds a share of each row
            row_max = module.tp.all_gather(row_max[:, None], -1).amax(1)
        module.kept = pack_w8a8(quantize_weight(w, fmt, row_max), w.device)
        if module.kept is not None:
            w.data = torch.empty(0, dtype=w.dtype, device=w.device)
            kept += 1
    return kept


# ---------------------------------------------------------------------------------------------- embeddings


def vocab_shard(tp: TPGroup, vocab_size: int) -> tuple[int, int]:
    """This rank's first row and row count of a matrix split by vocabulary over ``tp`` as :class:`ParallelLMHead`
    splits it (padded to a multiple of the ranks; the last rank's padding rows are zeros)."""
    rows = -(-vocab_size // tp.size)
    return tp.rank * rows, rows


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks (vocab padded to a multiple of the TP size)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.vocab_start, self.per_rank = vocab_shard(tp, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.per_rank, num_embeddings)
        self.weight = _param(self.per_rank, embedding_dim)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        rows = self.vocab_end - self.vocab_start
        if shape_of(loaded)[0] != self.num_embeddings:
            raise ValueError(f"embedding of {shape_of(loaded)[0]} rows does not match vocab_size="
                             f"{self.num_embeddings} in config.json")
        param.data[rows:].zero_()
        _copy(param.data[:rows], narrow(loaded, 0, self.vocab_start, rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, H]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        y = F.embedding((ids - self.vocab_start) * mine, self.weight) * mine[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(y)


def shard_vocab_rows(weight: Any, tp: TPGroup, vocab_size: int) -> torch.Tensor:
    """This rank's rows of a checkpoint's [V, ...] matrix (a tensor or a safetensors slice), zeros past V."""
    start, rows = vocab_shard(tp, vocab_size)
    count = max(0, min(rows, vocab_size - start))
    mine = materialize(narrow(weight, 0, start, count))
    return mine if count == rows else torch.cat([mine, mine.new_zeros(rows - count, *mine.shape[1:])])


def gather_vocab(logits: torch.Tensor, tp: TPGroup, vocab_size: int) -> torch.Tensor:
    """Logits over this rank's vocabulary rows [..., rows] -> over the whole vocabulary [..., V] on every rank."""
    if tp.size == 1:
        return logits
    return tp.all_gather(logits, dim=-1)[..., :vocab_size]


class ParallelLMHead(VocabParallelEmbedding, LinearBase):
    """Logits over this rank's vocab slice, all-gathered to the full vocabulary. Packed, it keeps its dense
    weight too (the embedding's, when tied; the model reads its dtype and device). ``bias``: a bias per vocabulary
    entry (Phi-3.5-MoE's ``lm_head_bias``), this rank's slice of it."""

    keeps_dense_weight = True

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup, bias: bool = False):
        super().__init__(num_embeddings, embedding_dim, tp)
        self.bias = None
        if bias:
            self.bias = _param(self.per_rank)
            self.bias.weight_loader = self.weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, V]
        logits = linear(hidden, self.weight, self.bias, packed=self.packed)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, : self.num_embeddings]


def widen_to_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A head that scores only the vocabulary's first ids (a release whose unembedding is pruned to its text tokens, or
    padded past the real vocabulary): logits [N, kept] -> [N, vocab_size] with the ids past ``kept`` at -inf, so every
    engine part sized by ``vocab_size`` (sampler, grammar masks, drafters, verification) sees whole rows and such an id
    is never sampled nor accepted as a draft (-inf as the sampler's own masks; the OpenAI layer floors logprobs)."""
    pad = vocab_size - logits.shape[-1]
    assert pad >= 0, (logits.shape, vocab_size)
    return F.pad(logits, (0, pad), value=float("-inf")) if pad else logits


# ---------------------------------------------------------------------------------------------- norm


class OtherStage(nn.Module):
    """Where a module of the model lives on another pipeline stage (its decoder layers, the embedding, the final
    norm or the LM head): no parameters, so the checkpoint names of the modules this stage holds keep their indices."""

    def forward(self, *args, **kwargs):
        raise AssertionError("a module of another pipeline stage was called on this one")


def on_stage(held: bool, make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` where this stage holds the module, else an :class:`OtherStage` in its place."""
    return make() if held else OtherStage()


def other_stage_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The name prefixes (``"model.layers.7."``) of the modules ``model`` leaves to other pipeline stages."""
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, OtherStage))


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (like transformers); with ``residual`` it first adds it and returns
    ``(normed, new_residual)``."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden_size)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]. F.rms_norm computes in float32 whatever x's dtype and rounds x / rms(x) to it, then the weight
        # multiplies in x's dtype, as transformers' order; one op (on CUDA one fused kernel, not eight small ones)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x, self.weight.shape, None, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x


class LayerNorm(RMSNorm):
    """LayerNorm (mean-centred) in float32, with a weight and, where ``bias``, a bias; ``unit_offset``: scaling by
    ``1 + weight`` (Nemotron's LayerNorm1P); with ``residual``, as :class:`RMSNorm` (adds it first)."""

    def __init__(self, hidden_size: int, eps: float, bias: bool = True, unit_offset: bool = False):
        super().__init__(hidden_size, eps)
        self.bias = _param(hidden_size) if bias else None
        self.unit_offset = unit_offset

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        bias = None if self.bias is None else self.bias.float()
        weight = self.weight.float() + 1.0 if self.unit_offset else self.weight.float()
        return F.layer_norm(x.float(), self.weight.shape, weight, bias, self.eps).to(x.dtype)


# ---------------------------------------------------------------------------------------------- rotary


def position_query_scaling(config) -> tuple[float, int] | None:
    """(beta, L0) where the config scales queries by position (``rope_parameters``' ``llama_4_scaling_beta`` and
    ``original_max_position_embeddings``: Mistral 4, Ministral 3), else None (RoPE given per kind of layer: never)."""
    given = getattr(config, "rope_parameters", None) or {}
    if rope_per_kind(given):
        return None
    params = rope_parameters(config, partial=True)
    if params.get("llama_4_scaling_beta") is None:
        return None
    return float(params["llama_4_scaling_beta"]), int(params["original_max_position_embeddings"])


def scale_queries(q: torch.Tensor, positions: torch.Tensor, scaling: tuple[float, int]) -> torch.Tensor:
    """q [T, ...] times ``1 + beta ln(1 + floor(p / L0))`` at each row's position p [T]."""
    beta, original = scaling
    scale = 1 + beta * torch.log1p(torch.floor(positions / original))
    return q * scale.view(-1, *[1] * (q.dim() - 1)).to(q.dtype)

# ntk_alpha: the base stretched once by a fixed alpha (Hunyuan's "dynamic" with an ``alpha``), whatever the length
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "ntk_alpha")
_ROPE_ALIASES = {"su": "longrope"}  # Phi-3's first 128k releases name LongRoPE "su"


def rope_parameters(config, layer_type: str | None = None, partial: bool = False) -> dict:
    """The config's RoPE settings as one flat dict with ``rope_type`` and ``rope_theta`` (transformers 5 keeps
    them in ``config.rope_parameters``; older configs in ``rope_scaling`` + ``rope_theta``); with ``layer_type``,
    that kind of layer's where the config gives them per kind (Gemma 3: ``sliding_attention``, ``full_attention``).
    ``partial``: the caller rotates only the first ``partial_rotary_factor`` of each head (see
    :func:`rotary_dim`); other callers refuse a factor below 1."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    per_kind = rope_per_kind(params)
    kinds = sorted(k for k, v in params.items() if isinstance(v, dict))
    if layer_type is not None and kinds and not per_kind:  # (transformers' Gemma 3 config given flat settings)
        raise ValueError(f"rope_parameters mixes settings per kind of layer ({kinds}) with settings for every layer "
                         f"({sorted(k for k in params if k not in kinds)}); give each kind its own: "
                         f"{{{', '.join(repr(k) + ': {...}' for k in kinds)}}}")
    if per_kind:
        if layer_type is None or layer_type not in params:
            raise ValueError(f"per-layer-type rope_parameters {sorted(params)} are not supported for this model; "
                             "use a model with one RoPE setting for all layers")
        params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = _ROPE_ALIASES.get(kind, kind)
    if params["rope_type"] == "dynamic" and params.get("alpha"):
        params["rope_type"] = "ntk_alpha"
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"rope_type={params['rope_type']!r} is not supported; supported: {list(ROPE_TYPES)}")
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    if params["partial_rotary_factor"] != 1.0 and not partial:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported for "
                         f"model_type={config.model_type!r} (it rotates the whole head)")
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        # the pretrained length: a config's own original_max_position_embeddings first (Phi-3 keeps it outside; as
        # transformers' standardize_rope_params, over one inside rope_parameters), else rope_parameters', else the
        # config's max_position_embeddings (per kind of layer: rope_parameters' first)
        outside = getattr(config, "original_max_position_embeddings", None)
        if outside and not per_kind:
            params["original_max_position_embeddings"] = outside
        params.setdefault("original_max_position_embeddings", outside or config.max_position_embeddings)
    if getattr(config, "max_model_len", None):  # the longest sequence served (set_max_model_len): LongRoPE's choice
        params["max_model_len"] = config.max_model_len
    return params


def set_max_model_len(config, max_model_len: int) -> None:
    """Tell the model built from ``config`` (and its text model's, a multimodal one's) the longest sequence it will
    serve, which some settings depend on (LongRoPE's factors)."""
    for part in (config, getattr(config, "text_config", None)):
        if part is not None:
            part.max_model_len = max_model_len


def rotary_dim(head_dim: int, params: dict) -> int:
    """How many of a head's ``head_dim`` features RoPE rotates (the first ones; Phi-4-mini: three quarters)."""
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def mrope_axes(params: dict, rotated: int) -> torch.Tensor:
    """Multimodal RoPE (Qwen2-VL): the position axis (0 temporal, 1 height, 2 width) of each of the ``rotated`` cos |
    sin table columns: the ``mrope_section`` sections of the rotated / 2 frequencies take axis i % 3 in turn (on the
    CPU); a ValueError naming the field where the config's sections cannot be built so. ``mrope_interleaved``
    (Qwen3-VL): frequency j takes axis j % 3 (height, width) while j < 3 * that axis's section, else the temporal."""
    sections = params.get("mrope_section")
    if not sections or any(int(s) < 0 for s in sections) or sum(int(s) for s in sections) != rotated // 2:
        raise ValueError(f"rope_parameters.mrope_section={sections!r} must split the {rotated // 2} rotated "
                         "frequencies of a head (its sections summing to that) for multimodal RoPE; set it as the "
                         "release's config.json does")
    if params.get("mrope_interleaved"):
        if len(sections) != 3:
            raise ValueError(f"rope_parameters.mrope_section={sections!r} must have three sections (temporal, "
                             "height, width) with mrope_interleaved=True; set it as the release's config.json does")
        j = torch.arange(rotated // 2)
        axes = torch.where((j % 3 > 0) & (j < 3 * torch.tensor([int(s) for s in sections])[j % 3]), j % 3, 0)
        return torch.cat((axes, axes))
    axes = torch.repeat_interleave(torch.arange(len(sections)) % 3, torch.tensor([int(s) for s in sections]))
    return torch.cat((axes, axes))


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))  # [dim/2]


def _llama3_inv_freq(p: dict, dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(p["rope_theta"], dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(p: dict, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    base, old_len = p["rope_theta"], p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position_embeddings / old_len
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(p: dict, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): each frequency divided by its own factor -> (inv_freq, the cos/sin scale: Phi-3.5-MoE's
    ``short_mscale`` / ``long_mscale`` with the factors of that name, else ``attention_factor``, else
    sqrt(1 + ln s / ln L0), s = max_position_embeddings / L0 unless the config gives ``factor``). The factors are
    ``short_factor`` when the model serves sequences of at most the pretrained length L0 (``max_model_len``, by
    default ``max_position_embeddings``), else ``long_factor``, for every position: rotations of one sequence must
    not mix (vLLM chooses alike; transformers switches a sequence to the long ones when it grows past L0 and
    recomputes its cache, which a server sharing steps between requests does not)."""
    old_len = p["original_max_position_embeddings"]
    kind = "long_factor" if p.get("max_model_len", max_position_embeddings) > old_len else "short_factor"
    factors = torch.tensor(p[kind], dtype=torch.float32, device="cpu")
    if factors.shape != (dim // 2,):
        raise ValueError(f"rope {kind} has {factors.numel()} entries; a rotary dimension of {dim} needs {dim // 2}: "
                         "the config's rope_scaling does not match its head size")
    scale = p.get("factor") or max_position_embeddings / old_len
    attention_factor = p.get(kind.replace("factor", "mscale"), p.get("attention_factor"))
    if attention_factor is None:
        attention_factor = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(old_len))
    return _base_inv_freq(p["rope_theta"], dim) / factors, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """RoPE (rotate-half layout) with a lazily grown cos/sin table indexed by position.

    ``dynamic`` (NTK) scaling is applied per position: position p uses the base stretched for a sequence of
    ``max(p + 1, max_position_embeddings)`` tokens. That equals transformers for any prefix shorter than
    ``max_position_embeddings`` and for token-by-token decoding past it, and, unlike transformers' per-batch
    rescaling, it does not depend on how the tokens are batched or chunked.
    """

    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int):
        super().__init__()
        self.head_dim = head_dim
        self.params = params
        self.max_position_embeddings = max_position_embeddings
        self.attention_scaling = 1.0
        self.device = torch.get_default_device()  # the table follows the device the model is built on
        self.inv_freq = self._inv_freq()  # [D/2], on the CPU
        self.table_len = 0
        self.cos_sin = torch.empty(0)  # [P, D] float32: cos | sin (each D/2)
        self.ensure(min(max_position_embeddings, 4096))
        self.mrope = None  # multimodal RoPE: each table column's position axis [D] (mrope_axes), where it applies
        if params.get("mrope_section"):
            with contextlib.suppress(ValueError):  # sections it cannot take: multimodal() names them, if ever called
                self.mrope = mrope_axes(params, head_dim).to(self.device)

    def _inv_freq(self) -> torch.Tensor:
        p, dim = self.params, self.head_dim
        kind = p["rope_type"]
        if kind == "linear":
            return _base_inv_freq(p["rope_theta"], dim) / p["factor"]
        if kind == "llama3":
            return _llama3_inv_freq(p, dim)
        if kind == "yarn":
            inv_freq, self.attention_scaling = _yarn_inv_freq(p, dim, self.max_position_embeddings)
            return inv_freq
        if kind == "longrope":
            inv_freq, self.attention_scaling = _longrope_inv_freq(p, dim, self.max_position_embeddings)
            return inv_freq
        if kind == "ntk_alpha":
            return _base_inv_freq(p["rope_theta"] * p["alpha"] ** (dim / (dim - 2)), dim)
        return _base_inv_freq(p["rope_theta"], dim)  # default; dynamic at or below max_position_embeddings

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        p, dim, mpe = self.params, self.head_dim, self.max_position_embeddings
        factor = p["factor"]
        base = p["rope_theta"] * ((factor * seq_len / mpe) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim)

    def ensure(self, length: int) -> None:
        """Make the table cover positions ``0 .. length-1`` (called from forward with a Python int)."""
        if length <= self.table_len:
            return
        length = max(length, 2 * self.table_len)
        pos = torch.arange(length, dtype=torch.float32, device="cpu")
        freqs = pos[:, None] * self.inv_freq[None, :]  # [P, D/2]
        if self.params["rope_type"] == "dynamic" and length > self.max_position_embeddings:
            for p in range(self.max_position_embeddings, length):
                freqs[p] = pos[p] * self._dynamic_inv_freq(p + 1)
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_scaling
        self.cos_sin = table.to(self.device)
        self.table_len = length

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, 1, D/2] in `dtype`
        cos, sin = self.cos_sin[positions].to(dtype).chunk(2, dim=-1)
        return cos[:, None], sin[:, None]

    def multimodal(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # multimodal RoPE (Qwen2-VL's mrope_section): positions [3, T] (temporal, height, width) -> cos, sin
        # [T, 1, D/2], each frequency at the position of its section's axis
        if self.mrope is None:
            mrope_axes(self.params, self.head_dim)  # raises, naming the field
        table = self.cos_sin[positions]  # [3, T, D]
        picked = table.gather(0, self.mrope.expand(1, *table.shape[1:])).squeeze(0)
        cos, sin = picked.to(dtype).chunk(2, dim=-1)
        return cos[:, None], sin[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, R/2] -> [T, H, D], the first R features rotated (R < D: partial RoPE)
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): the halves as a dimension of two, cos and sin broadcast over
    # it, so the rotation is five ops (neg, stack, two muls, an add) rather than seven; the same values bit for bit
    halves = x.unflatten(-1, (2, -1))  # [..., 2, R/2]
    x1, x2 = halves.unbind(-2)
    return (halves * cos.unsqueeze(-2) + torch.stack((-x2, x1), dim=-2) * sin.unsqueeze(-2)).flatten(-2)
