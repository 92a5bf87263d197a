"""Google's Gemma 3n (text): ``Gemma3nForCausalLM`` (``gemma3n_text``) and the text model of
``Gemma3nForConditionalGeneration`` (``gemma3n``: read from ``model.language_model.``; its vision and audio towers
and their embedders are not read), on Gemma 4's stack (:mod:`specray.models.gemma4`: the Llama plumbing, its
attention, KV sharing, per-layer inputs and pipeline-stage hand-over).

Where it differs from Gemma 3 / Gemma 4:

* AltUp: the residual stream is ``altup_num_inputs`` streams. The first is the scaled embedding, the others its
  ``altup_projections`` rescaled to its root mean square; each layer predicts every stream from all of them (a
  router over the active stream, ``altup_active_idx``, RMS-normed and times 1 / hidden_size, tanh, gives per-token
  coefficients), runs the active prediction through attention and MLP, and corrects every stream by the innovation
  (the layer's output minus the active prediction) times coefficients from the router over that output. After the
  last layer the other streams go through ``altup_unembed_projections``, are rescaled to the first's magnitude and
  all are averaged before the final norm. ``altup_coef_clip`` clamps the coefficient weights only while training in
  transformers, so inference (theirs and ours) reads them as stored;
* LAuReL (``laurel_rank``): a low-rank branch of the normed active stream (left, right, normed) added to it; the
  layer's attention output joins it, both averaged by 1 / sqrt(2), before the MLP;
* per-layer inputs are Gemma 4's (a token past ``vocab_size_per_layer_input`` takes token 0's per-layer embedding),
  gated by the corrected active stream times ``correct_output_scale`` (``altup_correct_scale``) and added to every
  stream but the first, after the correction;
* activation sparsity (``activation_sparsity_pattern``, per layer): the MLP's gate keeps only what exceeds its
  mean plus the standard normal quantile of the sparsity times its standard deviation (over the whole intermediate
  width: two sums all-reduced over tensor-parallel ranks), shifted down by that cutoff, before the GELU;
* ``intermediate_size`` per layer; no experts, no layer scalars, one head size for every layer, no k = v (Gemma 4's
  attention otherwise: scale 1, q/k norms scaled by ``weight``, v normed without a scale; its RMSNorm throughout);
* KV sharing (``num_kv_shared_layers``), sliding/full layers (``layer_types``, each kind its RoPE), the scaled
  embedding and the final logit soft cap as Gemma 4.

LoRA adapters adapt what Gemma 4's do (q/k/v/o of each layer that has them, gate/up/down); LAuReL, AltUp and the
per-layer-input projections take none (an adapter naming one is refused at admission).

A multimodal checkpoint's audio rows (:mod:`specray.models.gemma3n_audio`: the soft tokens' and
``<end_of_audio>``'s) replace their tokens' embeddings (``meta.with_input_embeds``). Other prompt ids at or past its
vision tower's ``vocab_offset`` are embedded from the text model's table here; transformers' multimodal model embeds
them through ``embed_vision`` / ``embed_audio``'s hard embeddings (text prompts never hold them). The hidden state a
drafter reads as the residual stream entering a layer (``aux_layers``) is the active AltUp stream. Tiny random
models against transformers only: never run on a GPU or a real checkpoint.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.gemma3 import Gemma3MLP
from specray.models.gemma4 import (LAYER_TYPES, Gemma4Attention, Gemma4ForCausalLM, Gemma4Model, Gemma4RMSNorm,
                                   _single_linear)
from specray.models.layers import _param, on_stage
from specray.parallel import PPGroup, TPGroup


@functools.lru_cache(maxsize=None)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as transformers' constants (buffers cast with the model) multiply: a plain
    scalar, worked out once on the host (a step never reads a tensor's value)."""
    return torch.tensor(value, dtype=torch.float32, device="cpu").to(dtype).item()


def _per_layer(config, field: str) -> list:
    """``config.<field>``: one value per layer (a single value for all layers, as transformers widens it)."""
    value, layers = getattr(config, field), config.num_hidden_layers
    values = list(value) if isinstance(value, (list, tuple)) else [value] * layers
    if len(values) != layers:
        raise ValueError(f"{field} has {len(values)} entries for num_hidden_layers={layers}: give one value per layer "
                         "(or a single value for every layer)")
    return values


def check_gemma3n(config) -> None:
    """A ValueError naming the field of a Gemma 3n setting served here otherwise than transformers computes it."""
    streams, active = getattr(config, "altup_num_inputs", None), getattr(config, "altup_active_idx", None)
    if not isinstance(streams, int) or streams < 1:
        raise ValueError(f"altup_num_inputs={streams!r} must be a positive integer (the number of AltUp streams)")
    if not isinstance(active, int) or not 0 <= active < streams:
        raise ValueError(f"altup_active_idx={active!r} must index one of the altup_num_inputs={streams} streams "
                         f"(0 to {streams - 1})")
    for i, sparsity in enumerate(_per_layer(config, "activation_sparsity_pattern")):
        if not 0.0 <= float(sparsity) < 1.0:
            raise ValueError(f"activation_sparsity_pattern[{i}]={sparsity} must lie in [0, 1) (the share of the "
                             "MLP's gate activations cut; 0 keeps them all)")
    _per_layer(config, "intermediate_size")
    rank = getattr(config, "laurel_rank", None)
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"laurel_rank={rank!r} must be a positive integer (the LAuReL branch's width)")
    width = getattr(config, "hidden_size_per_layer_input", 0) or 0
    if width and not (getattr(config, "vocab_size_per_layer_input", 0) or 0) > 0:
        raise ValueError(f"hidden_size_per_layer_input={width} needs vocab_size_per_layer_input > 0 (got "
                         f"{getattr(config, 'vocab_size_per_layer_input', None)!r})")


class Gemma3nMLP(Gemma3MLP):
    """Gemma 3's gated GELU of this layer's ``intermediate_size``, its gate sparsified where the layer's
    ``activation_sparsity_pattern`` entry is above 0 (a Gaussian top-k: transformers' ``_gaussian_topk``)."""

    def __init__(self, config, tp: TPGroup, layer: int):
        width = int(_per_layer(config, "intermediate_size")[layer])
        super().__init__(config, tp, width)
        self.tp, self.width = tp, width
        sparsity = float(_per_layer(config, "activation_sparsity_pattern")[layer])
        self.std_multiplier = None
        if sparsity > 0.0:  # the standard normal's quantile, as torch.distributions.Normal(0, 1).icdf in float32
            normal = torch.distributions.Normal(torch.tensor(0.0, device="cpu"), torch.tensor(1.0, device="cpu"))
            self.std_multiplier = normal.icdf(torch.tensor(sparsity, dtype=torch.float32, device="cpu")).item()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.std_multiplier is not None:
            gate = self._gaussian_topk(gate)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)

    def _gaussian_topk(self, gate: torch.Tensor) -> torch.Tensor:
        # gate: this rank's share [T, I / tp] of the gate; its mean and (biased) deviation are over the whole width
        if self.tp.size == 1:
            mean = torch.mean(gate, dim=-1, keepdim=True)
            std = torch.std(gate, dim=-1, keepdim=True, unbiased=False)
        else:  # two passes, as torch.std: a sum of squares about the mean, not E[x^2] - E[x]^2
            mean = self.tp.all_reduce(gate.sum(dim=-1, keepdim=True)) / self.width
            std = (self.tp.all_reduce((gate - mean).pow(2).sum(dim=-1, keepdim=True)) / self.width).sqrt()
        return F.relu(gate - (mean + std * _rounded(self.std_multiplier, gate.dtype)))


class Gemma3nAltUp(nn.Module):
    """One layer's AltUp: predicting every stream before the layer and correcting them after (transformers'
    ``Gemma3nTextAltUp``; its small matrices on every rank)."""

    def __init__(self, config):
        super().__init__()
        n, h = config.altup_num_inputs, config.hidden_size
        self.num_inputs, self.active = n, config.altup_active_idx
        self.correct_output_scale = _param(h)
        self.correction_coefs = _single_linear(n, n)
        self.prediction_coefs = _single_linear(n, n * n)
        self.modality_router = _single_linear(h, n)
        self.router_norm = Gemma4RMSNorm(h, config.rms_norm_eps)
        self.router_input_scale = h ** -1.0

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> the router's coefficients' inputs [T, N]
        routed = self.modality_router(self.router_norm(x) * _rounded(self.router_input_scale, x.dtype))
        return torch.tanh(routed.float()).to(x.dtype)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        # streams: [N, T, H] -> predictions [N, T, H]: stream a plus sum_j coef[t, a, j] * stream j
        n = self.num_inputs
        coefs = self.prediction_coefs(self.modalities(streams[self.active])).view(-1, n, n).transpose(1, 2)
        predictions = torch.matmul(streams.permute(1, 2, 0), coefs).permute(2, 0, 1)  # [T, H, N] @ [T, N, N]
        return (predictions + streams).contiguous()

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        # predictions: [N, T, H]; activated: the layer's output [T, H] -> the corrected streams [N, T, H]
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0  # [T, N]
        innovation = activated - predictions[self.active]
        return (innovation[None] * coefs.t()[:, :, None] + predictions).contiguous()

    def scale_corrected_output(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(self.correct_output_scale.dtype) * self.correct_output_scale).to(x.dtype)


class Gemma3nLaurel(nn.Module):
    """LAuReL, the learned augmented residual: ``x + norm(right(left(x)))`` through a rank-``laurel_rank``
    bottleneck (on every rank)."""

    def __init__(self, config):
        super().__init__()
        h, rank = config.hidden_size, config.laurel_rank
        self.linear_left = _single_linear(h, rank)
        self.linear_right = _single_linear(rank, h)
        self.post_laurel_norm = Gemma4RMSNorm(h, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class Gemma3nDecoderLayer(nn.Module):
    moe = None  # no experts (Gemma 4's loader asks)

    def __init__(self, config, tp: TPGroup, layer: int, source: int | None, expert_parallel: bool = False):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_types[{layer}]={self.layer_type!r} is not supported; one of {list(LAYER_TYPES)}")
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, tp, layer, source)
        self.mlp = Gemma3nMLP(config, tp, layer)
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.altup = Gemma3nAltUp(config)
        self.laurel = Gemma3nLaurel(config)
        self.active, self.correct_scale = config.altup_active_idx, bool(config.altup_correct_scale)
        per_layer = getattr(config, "hidden_size_per_layer_input", 0) or 0
        if per_layer:
            self.per_layer_input_gate = _single_linear(h, per_layer)
            self.per_layer_projection = _single_linear(per_layer, h)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)

    def forward(self, streams: torch.Tensor, per_layer: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, shared: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        # streams: the AltUp streams [N, T, H]; per_layer: this layer's input [T, P] (or None) -> the next layer's
        # streams, and this layer's (k, v) for the layers sharing them
        predictions = self.altup.predict(streams)
        active = predictions[self.active]
        normed = self.input_layernorm(active)
        laurel = self.laurel(normed)
        a, kv = self.self_attn(normed, cos, sin, meta, shared)
        x = (active + self.post_attention_layernorm(a) + laurel) / math.sqrt(2)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        corrected = self.altup.correct(predictions, x)
        if per_layer is None:  # no per-layer inputs: their branch adds nothing
            return corrected, kv
        first = corrected[self.active]
        if self.correct_scale:
            first = self.altup.scale_corrected_output(first)
        gated = F.gelu(self.per_layer_input_gate(first), approximate="tanh") * per_layer
        branch = self.post_per_layer_input_norm(self.per_layer_projection(gated))
        # every stream but the first takes it (the first, whatever altup_active_idx says, as transformers)
        return torch.cat((corrected[:1], corrected[1:] + branch)), kv


class Gemma3nModel(Gemma4Model):
    layer_class = Gemma3nDecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        check_gemma3n(config)
        super().__init__(config, tp, expert_parallel, pp)
        h, n = config.hidden_size, config.altup_num_inputs
        self.num_streams, self.active = n, config.altup_active_idx
        self.vocab_per_layer = getattr(config, "vocab_size_per_layer_input", 0) or 0
        # the other streams made from the embedding (the first stage's) and merged back (the last stage's)
        self.altup_projections = on_stage(self.pp.is_first, lambda: nn.ModuleList(
            _single_linear(h, h) for _ in range(1, n)))
        self.altup_unembed_projections = on_stage(self.pp.is_last, lambda: nn.ModuleList(
            _single_linear(h, h) for _ in range(1, n)))

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # a token outside the per-layer table (the multimodal placeholders past it) reads token 0's row
        inside = (input_ids >= 0) & (input_ids < self.vocab_per_layer)
        return super().per_layer_inputs(torch.where(inside, input_ids, torch.zeros_like(input_ids)), x)

    @staticmethod
    def _matched(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # x: [T, H] rescaled to the root mean square ``target`` [T, 1] (its own floored at sqrt(1e-5))
        return x * target / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))

    def streams(self, x: torch.Tensor) -> torch.Tensor:
        # x: the scaled embedding [T, H] -> the AltUp streams [N, T, H]
        target = torch.mean(x ** 2, dim=-1, keepdim=True) ** 0.5
        return torch.stack([x] + [self._matched(proj(x), target) for proj in self.altup_projections])

    def merged(self, streams: torch.Tensor) -> torch.Tensor:
        # streams: [N, T, H] -> [T, H]: the others unembedded to the first's magnitude, all averaged
        target = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
        return torch.mean(torch.stack([streams[0]] + [self._matched(proj(s), target) for proj, s in
                                                       zip(self.altup_unembed_projections, streams[1:])]), dim=0)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids: [T] -> hidden [T, H], and the active stream [T, H] entering each layer of aux_layers. A stage
        # after the first starts from the previous stage's ``intermediate`` [N + R, T, H] (the AltUp streams, then
        # the per-layer inputs packed); a stage before the last ends there, returning its own
        n = self.num_streams
        if intermediate is None:
            # audio rows in place, unscaled; the per-layer inputs' token half reads the prompt's own ids (an audio
            # token's past the per-layer table: token 0's row), their projected half these rows, as transformers
            x = meta.with_input_embeds(self.embed(input_ids))
            per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer else None
            streams = self.streams(x)
        else:
            streams = intermediate[:n]
            per_layer = self._unpack(intermediate[n:]) if self.per_layer else None
        tables = self.kind_tables(meta, streams.dtype)
        aux: dict[int, torch.Tensor] = {}
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> its (k, v) of this step
        for i, layer in self.stage_layers():
            if i in aux_layers:
                aux[i] = streams[self.active]
            source = self.sources[i]
            streams, kv = layer(streams, None if per_layer is None else per_layer[:, i], *tables[layer.layer_type],
                                meta, None if source is None else shared[source])
            if kv is not None and i in self.sources:
                shared[i] = kv
        if not self.pp.is_last:
            return torch.cat([streams] + ([self._pack(per_layer)] if self.per_layer else [])), \
                [aux[i] for i in aux_layers]
        return self.norm(self.merged(streams)), [aux[i] for i in aux_layers]


class Gemma3nForCausalLM(Gemma4ForCausalLM):
    """Gemma 3n's text model for causal LM, sharded over ``tp``; Gemma 4's loading (a KV-shared layer's k/v
    projections and norms skipped), scaled embedding and soft-capped logits."""

    model_class = Gemma3nModel

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.stage_width = self.model.num_streams + self.model.per_layer_rows  # the streams, then per-layer inputs
