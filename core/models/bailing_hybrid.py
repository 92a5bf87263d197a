"""inclusionAI's Ling 3.0 hybrid (``BailingHybridForCausalLM``, model_type ``bailing_hybrid``: Ling-3.0-Flash) on the
Llama plumbing: Kimi Delta Attention layers (:mod:`specray.models.kimi_delta`, a recurrent state per request) among
DeepSeek-V3's latent-attention layers (:class:`~specray.models.deepseek_v3.MLAttention`: paged latent cache), each
layer's kind by ``layer_types`` (transformers' config derives it from ``layer_group_size``: the last layer of each
group is latent attention), the MLPs DeepSeek-V3's experts but the dense ``mlp_layer_types`` ones
(``first_k_dense_replace``). Built as :mod:`specray.models.kimi_linear`'s classes with the parts below swapped.

Where it differs from Kimi-Linear:

* the forget gate is full rank and bounded: ``f = f_proj(x)`` (hidden to H * d, split by head over the ranks) and,
  with ``kda_safe_gate`` (the release's), ``g = kda_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`` per key
  channel, else Kimi's ``-exp(A_log) * softplus(f + dt_bias)``; g rounded to the model's dtype as transformers
  rounds it. ``f`` (Hl * d channels, not Kimi's d) rides the conv as Kimi's ``f_a(x)`` does;
* the output gate is full rank too (``g_proj``: hidden to H * d), into the same sigmoid-gated norm;
* the latent attention has RoPE (not NoPE), always on interleaved pairs (the config has no ``rope_interleave``), over
  ``qk_rope_head_dim`` with ``rope_theta`` / ``rope_parameters``; and a per-head output gate: each head's output times
  ``sigmoid(g_proj(x))`` (hidden to heads, split by head) before ``o_proj``;
* the config's fields: the KDA heads are the attention heads (``linear_num_heads = num_attention_heads``), their
  width the release's ``head_dim`` (``linear_head_dim``: transformers then sets ``head_dim`` to the RoPE width),
  the conv's ``short_conv_kernel_size``; the router's ``num_experts`` / ``num_experts_per_tok`` / ``n_group`` /
  ``norm_topk_prob`` (its row of :data:`specray.models.moe.FAMILIES` declared here, Kimi's);
* the release's names: ``model.word_embeddings``, both kinds of layer under ``attention.`` (read here as
  ``self_attn.`` or ``linear_attn.`` by the layer's kind), ``attention.dense`` for ``o_proj``, the forget gate's
  ``f_proj`` / ``A_log`` ([H]) / ``dt_bias`` on the layer (transformers' ``forget_gate.`` read alike), q/k/v convs
  apart (or transformers' one ``conv1d``), Qwen2-MoE's per-expert ``gate_proj`` / ``up_proj`` / ``down_proj``, the
  router's correction bias as ``mlp.gate.expert_bias``. The MTP layers past ``num_hidden_layers`` are skipped; they
  are not served as a draft head (a ValueError names the methods that are).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM, DeepseekV3Model, MLAttention
from specray.models.kimi_delta import KimiDeltaAttention
from specray.models.kimi_linear import LAYER_TYPES, KimiDeltaLayer, KimiLinearForCausalLM, _is_dense
from specray.models.layers import (ColumnParallelLinear, RMSNorm, RotaryEmbedding, VocabParallelEmbedding,
                                   rope_parameters)
from specray.models.llama import LlamaMLP, multiplier
from specray.models.moe import FAMILIES, MoEFamily, SparseMoE
from specray.parallel import PPGroup, TPGroup

# DeepSeek-V3's router and shared experts under Ling's config fields (num_experts, num_shared_experts), as Kimi's
FAMILIES.setdefault("bailing_hybrid", MoEFamily("grouped_sigmoid", "num_experts", "moe_intermediate_size",
                                                shared="shared_experts", shared_width="moe_intermediate_size",
                                                shared_count="num_shared_experts"))
# the release's names -> the ones Kimi-Linear's loading reads (before a KDA layer's self_attn. becomes linear_attn.)
_RELEASE = tuple((re.compile(a), b) for a, b in (
    (r"^model\.word_embeddings\.", "model.embed_tokens."), (r"^(model\.layers\.\d+)\.attention\.", r"\1.self_attn.")))
# then -> ours (transformers' in-memory names, if saved without revert, read alike)
_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"\.(self_attn|linear_attn)\.dense\.", r".\1.o_proj."),
    (r"\.mlp\.gate\.expert_bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.linear_attn\.forget_gate\.", ".linear_attn.")))


def _release_name(name: str) -> str:
    for theirs, ours in _RELEASE:
        name = theirs.sub(ours, name)
    return name


def check_config(config) -> None:
    """What this port serves exactly, checked before anything is built (actionable ValueErrors)."""
    n = config.num_hidden_layers
    kinds = list(getattr(config, "layer_types", None) or [])
    if len(kinds) != n or not set(kinds) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types={kinds} must name one of {list(LAYER_TYPES)} for each of the num_hidden_layers="
                         f"{n} layers; transformers' BailingHybridConfig derives them from layer_group_size (drop "
                         "layer_types from config.json to have it do so)")
    mlp = list(getattr(config, "mlp_layer_types", None) or [])
    if len(mlp) != n or not set(mlp) <= {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types={mlp} must name 'dense' or 'sparse' for each of the num_hidden_layers={n} "
                         "layers; transformers' BailingHybridConfig derives them from first_k_dense_replace (drop "
                         "mlp_layer_types from config.json to have it do so)")
    if bool(getattr(config, "kda_safe_gate", True)) and float(config.kda_lower_bound) > 0:
        raise ValueError(f"kda_lower_bound={config.kda_lower_bound} would make the bounded forget gate grow the "
                         "state instead of decaying it; the release's is -5.0 (any value <= 0 is served)")
    if config.linear_num_heads != config.num_attention_heads:
        raise ValueError(f"linear_num_heads={config.linear_num_heads} differs from num_attention_heads="
                         f"{config.num_attention_heads}; Ling 3.0's KDA heads are its attention heads (transformers' "
                         "BailingHybridConfig sets them so): remove linear_num_heads from config.json")


def check_heads_split(config, tp: int, pp: int) -> None:
    """The family's ``check_split``: ``tp`` ranks split the heads (KDA and latent attention count the same)."""
    if config.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not split this model's num_attention_heads="
                         f"{config.num_attention_heads}; choose a tensor_parallel_size that divides it")


class BailingDeltaAttention(KimiDeltaAttention):
    """Kimi Delta Attention with Ling's full-rank, bounded forget gate and full-rank output gate (module docstring);
    the release's names under ``linear_attn.`` (the model renames its ``attention.``)."""

    def _build_gates(self, config, tp: TPGroup) -> int:
        width = config.linear_num_heads * self.dk
        self.safe_gate = bool(getattr(config, "kda_safe_gate", True))
        self.lower_bound = float(getattr(config, "kda_lower_bound", -5.0))
        self.f_proj = ColumnParallelLinear(config.hidden_size, width, tp)  # by head
        self.g_proj = ColumnParallelLinear(config.hidden_size, width, tp)
        return self.heads * self.dk

    def _gate_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.f_proj(x)

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x)

    def _decay(self, f: torch.Tensor) -> torch.Tensor:
        hl, d = self.heads, self.dk
        gate_input = f.float().view(-1, hl, d) + self.dt_bias.float().view(hl, d)
        rate = self.A_log.float().exp()[:, None]  # [Hl, 1]
        if self.safe_gate:
            g = self.lower_bound * torch.sigmoid(rate * gate_input)
        else:
            g = -rate * F.softplus(gate_input)
        return g.to(f.dtype).float()  # transformers hands the gate on in the model's dtype


class GatedLatentAttention(MLAttention):
    """DeepSeek-V3's latent attention with RoPE on interleaved pairs and a per-head sigmoid output gate."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.interleave = True  # Ling rotates interleaved pairs always (its config has no rope_interleave)
        self.g_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads, tp)  # by head

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        heads = self.head_outputs(x, cos, sin, meta)  # [T, Hl, v]
        gate = torch.sigmoid(self.g_proj(x).float()).to(x.dtype)  # [T, Hl]
        return self.o_proj((heads * gate[..., None]).reshape(x.shape[0], -1))


class BailingDeltaLayer(KimiDeltaLayer):
    """A KDA layer (Ling's gates), DeepSeek-V3's MLP or experts."""

    def build_mixer(self, config, tp: TPGroup, layer: int) -> None:
        self.linear_attn = BailingDeltaAttention(config, tp)


class BailingLatentLayer(DeepseekV3DecoderLayer):
    """A latent-attention layer (gated, with RoPE), its MLP's kind by ``mlp_layer_types``."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        nn.Module.__init__(self)
        self.self_attn = GatedLatentAttention(config, tp, layer)
        self.mlp = LlamaMLP(config, tp) if _is_dense(config, layer) else SparseMoE(config, tp, expert_parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = multiplier(config, "residual_multiplier")


def _bailing_layer(config, tp: TPGroup, layer: int, expert_parallel: bool = False) -> nn.Module:
    if config.layer_types[layer] == "linear_attention":
        return BailingDeltaLayer(config, tp, layer, expert_parallel)
    return BailingLatentLayer(config, tp, layer, expert_parallel)


class BailingHybridModel(DeepseekV3Model):
    """The stack: embedding, the layers by kind, the final norm, DeepSeek-V3's RoPE table for the latent layers."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        self.build_stage(config, pp, lambda i: _bailing_layer(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.embedding_multiplier = 1.0
        self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, rope_parameters(config, partial=True),
                                          config.max_position_embeddings)


class BailingHybridForCausalLM(KimiLinearForCausalLM):
    """Ling 3.0 hybrid for causal LM, sharded over ``tp`` (KDA heads, latent-attention heads and experts split as
    Kimi-Linear's): the latent-attention layers cache in the paged cache, the KDA layers keep a recurrent state per
    request (module docstring)."""

    model_class = BailingHybridModel
    check_split = staticmethod(check_heads_split)
    # LoRA on every projection applied as a linear to the layer's input: the latent attention's as DeepSeek-V3's
    # (kv_b_proj refused by name) and its output gate g_proj, a KDA layer's q/k/v (Kimi-Linear's kda_* pieces of
    # in_proj_qkv), dense (o_proj), b_proj and the full-rank gates f_proj and g_proj, the dense MLPs and the shared
    # experts; not the convs, the router or the experts
    lora_modules: tuple[str, ...] = DeepseekV3ForCausalLM.lora_modules + (
        "kda_q_proj", "kda_k_proj", "kda_v_proj", "b_proj", "f_proj", "g_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        check_config(hf_config)
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.renames = _RENAMES

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False):
        raise ValueError("Ling 3.0's multi-token-prediction layer is not served as a draft head yet; use another "
                         "speculative method (ngram, or a draft model)")

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The release's tensors under Kimi-Linear's names (``attention.`` as ``self_attn.``, then a KDA layer's as
        ``linear_attn.`` by its kind)."""
        return super()._unfused((_release_name(name), tensor) for name, tensor in weights)

    def reads_weight(self, name: str) -> bool:
        return super().reads_weight(_release_name(name))

    def adapter_module(self, name: str) -> str:
        """An adapter's module (the release's name: ``attention.dense`` ...) as ours (Kimi-Linear's renaming)."""
        return super().adapter_module(_release_name(name))
