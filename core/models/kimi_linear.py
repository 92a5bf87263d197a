"""Moonshot's Kimi-Linear (``KimiLinearForCausalLM``, model_type ``kimi_linear``: Kimi-Linear-48B-A3B) on the Llama
plumbing: Kimi Delta Attention layers (:mod:`specray.models.kimi_delta`: a recurrent state per request) among
DeepSeek-V3's latent-attention layers (:class:`~specray.models.deepseek_v3.MLAttention`: paged latent cache, absorbed
for decode), each layer's kind by ``layer_types`` (transformers' config derives it from the release's
``linear_attn_config``: ``kda_layers`` / ``full_attn_layers``, numbered from 1); the MLPs DeepSeek-V3's experts
(grouped sigmoid router with a correction bias, shared experts) but the dense ``mlp_layer_types`` ones
(``first_k_dense_replace``).

Where it differs from Qwen3-Next / DeepSeek-V3:

* the linear layers are KDA, not Gated DeltaNet: a per-channel decay from a low-rank forget gate, short convs on q, k
  and v, a sigmoid-gated output norm (:mod:`specray.models.kimi_delta`);
* the latent attention has no RoPE (NoPE): the shared ``k_rot`` and each head's ``q_rot`` stay as they are (a rotation
  by 0 here: cos 1, sin 0), the softmax scale ``qk_head_dim ** -0.5``;
* every RMSNorm scales by a plain weight (not Qwen3-Next's ``1 + w``), and the residual stream is Llama's;
* the router's config fields are Kimi's (``num_experts``, ``num_experts_per_token``, ``num_shared_experts``,
  ``num_expert_group``, ``moe_renormalize``: transformers maps them to DeepSeek's), its row of
  :data:`specray.models.moe.FAMILIES` declared here;
* the release's names: a KDA layer's modules under ``self_attn.`` (read here as ``linear_attn.``), its forget gate's
  ``f_a_proj`` / ``f_b_proj`` / ``A_log`` ([1, 1, H, 1]) / ``dt_bias`` on the layer, q/k/v convs apart, the MLPs under
  ``block_sparse_moe.`` with Mixtral's per-expert ``w1`` / ``w3`` / ``w2`` (transformers saves them so too, the dense
  layers' MLP included).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM, DeepseekV3Model
from specray.models.gated_deltanet import RecurrentModel
from specray.models.kimi_delta import KimiDeltaAttention, check_kda_heads_split
from specray.models.layers import RMSNorm, VocabParallelEmbedding, loaded_whole
from specray.models.llama import LlamaDecoderLayer, LlamaMLP
from specray.models.moe import FAMILIES, MoEFamily, SparseMoE
from specray.parallel import PPGroup, TPGroup

LAYER_TYPES = ("linear_attention", "full_attention")
# DeepSeek-V3's router and shared experts under Kimi's config fields (num_experts, num_shared_experts)
FAMILIES.setdefault("kimi_linear", MoEFamily("grouped_sigmoid", "num_experts", "moe_intermediate_size",
                                             shared="shared_experts", shared_width="moe_intermediate_size",
                                             shared_count="num_shared_experts"))
# the release's (and transformers' saved) names -> ours, after a KDA layer's self_attn. became linear_attn.
_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"\.block_sparse_moe\.", ".mlp."), (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
    (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."), (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    (r"\.linear_attn\.forget_gate\.", ".linear_attn.")))  # (transformers' in-memory names, if saved without revert)
_STACKED_KDA = {**{f".linear_attn.{p}_proj.": (".linear_attn.in_proj_qkv.", i) for i, p in enumerate("qkv")},
                **{f".linear_attn.{p}_conv1d.": (".linear_attn.conv1d.", i) for i, p in enumerate("qkv")}}
# LoRA: an adapter of a KDA layer's q_proj / k_proj / v_proj (parts of our in_proj_qkv) named so that it cannot be
# taken for a latent-attention layer's q_proj (adapter_module renames it): its piece of in_proj_qkv
_KDA_LORA = {f".kda_{p}_proj.": (".in_proj_qkv.", i) for i, p in enumerate("qkv")}
_PART = re.compile(r"\.linear_attn\.(in_proj_qkv\.weight|conv1d\.weight):(\d)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.self_attn\.")


def _layer_kinds(config) -> list[str]:
    kinds = list(getattr(config, "layer_types", None) or [])
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types={kinds} must name one of {list(LAYER_TYPES)} for each of the num_hidden_layers="
                         f"{config.num_hidden_layers} layers; the release's linear_attn_config (kda_layers, "
                         "full_attn_layers) gives them through transformers' KimiLinearConfig")
    return kinds


def _is_dense(config, layer: int) -> bool:
    kinds = getattr(config, "mlp_layer_types", None)
    if not kinds or len(kinds) != config.num_hidden_layers or not set(kinds) <= {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types={kinds} must name 'dense' or 'sparse' for each of the num_hidden_layers="
                         f"{config.num_hidden_layers} layers (transformers' KimiLinearConfig derives it from "
                         "first_k_dense_replace)")
    return kinds[layer] == "dense"


class KimiDeltaLayer(LlamaDecoderLayer):
    """A KDA layer: the recurrent mixer in place of attention, DeepSeek-V3's MLP or experts."""

    def build_mixer(self, config, tp: TPGroup, layer: int) -> None:
        self.linear_attn = KimiDeltaAttention(config, tp)

    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        return LlamaMLP(config, tp) if _is_dense(config, layer) else SparseMoE(config, tp, expert_parallel)

    def mix(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.linear_attn(x, meta)


def _kimi_layer(config, tp: TPGroup, layer: int, expert_parallel: bool = False) -> nn.Module:
    if _layer_kinds(config)[layer] == "linear_attention":
        return KimiDeltaLayer(config, tp, layer, expert_parallel)
    _is_dense(config, layer)  # (checks the kinds; DeepseekV3DecoderLayer reads them)
    return DeepseekV3DecoderLayer(config, tp, layer, expert_parallel)


class KimiLinearModel(DeepseekV3Model):
    """The stack: embedding, the layers by kind, the final norm; no RoPE table (NoPE latent attention)."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        self.build_stage(config, pp, lambda i: _kimi_layer(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.embedding_multiplier = 1.0
        self.half_rope = config.qk_rope_head_dim // 2

    def rope_tables(self, meta: AttentionMetadata, dtype: torch.dtype) -> Callable[[int], tuple[torch.Tensor, ...]]:
        t = meta.positions.shape[0]  # NoPE: a rotation by 0 (cos 1, sin 0) leaves q_rot and k_rot as they are
        cos = torch.ones(t, 1, self.half_rope, dtype=dtype, device=meta.positions.device)
        tables = (cos, torch.zeros_like(cos))
        return lambda layer: tables


class KimiLinearForCausalLM(RecurrentModel, DeepseekV3ForCausalLM):
    """Kimi-Linear for causal LM, sharded over ``tp`` (KDA heads, latent-attention heads and experts split as their
    families'): the latent-attention layers cache in the paged cache, the KDA layers keep a recurrent state per
    request (module docstring)."""

    model_class = KimiLinearModel
    may_tie = False  # its head is its own whatever tie_word_embeddings says (transformers' ties nothing; Ling's too)
    stacked = {**DeepseekV3ForCausalLM.stacked, **_STACKED_KDA, **_KDA_LORA}
    # LoRA on every projection applied as a linear to the layer's input: the latent attention's as DeepSeek-V3's
    # (kv_b_proj, read as W_UK and W_UV, refused by name), a KDA layer's q/k/v (parts of in_proj_qkv, each with its
    # own A: adapter_module names them kda_*), o_proj, b_proj and the low-rank gates' f_a_proj, g_a_proj, g_b_proj,
    # the dense MLPs and the shared experts; not f_b_proj (applied to the conv's output, not to the step's tokens),
    # the convs, the router or the experts
    lora_modules: tuple[str, ...] = DeepseekV3ForCausalLM.lora_modules + (
        "kda_q_proj", "kda_k_proj", "kda_v_proj", "b_proj", "f_a_proj", "g_a_proj", "g_b_proj")
    check_split = staticmethod(check_kda_heads_split)

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.renames = _RENAMES
        self.linear_layers = {i for i, kind in enumerate(_layer_kinds(hf_config)) if kind == "linear_attention"}

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False):
        raise ValueError("Kimi-Linear has no multi-token-prediction layer; use another speculative method "
                         "(ngram, or a draft model)")

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The checkpoint's tensors with a KDA layer's ``self_attn.`` named ``linear_attn.`` (its layer's kind by the
        config), so that the latent-attention layers keep DeepSeek-V3's names."""
        for name, tensor in super()._unfused(weights):
            found = _LAYER.match(name)
            if found is not None and int(found.group(1)) in self.linear_layers:
                name = name[: found.end() - len("self_attn.")] + "linear_attn." + name[found.end():]
            yield name, tensor

    def _linear_name(self, name: str) -> str:
        """A checkpoint name with a KDA layer's ``self_attn.`` as ``linear_attn.``."""
        found = _LAYER.match(name)
        if found is not None and int(found.group(1)) in self.linear_layers:
            name = name[: found.end() - len("self_attn.")] + "linear_attn." + name[found.end():]
        return name

    def reads_weight(self, name: str) -> bool:
        return super().reads_weight(self._linear_name(name))

    def adapter_module(self, name: str) -> str:
        """An adapter's module (the checkpoint's name) as ours: a KDA layer's under ``linear_attn.``, its q/k/v as the
        ``kda_*`` pieces of in_proj_qkv."""
        name = super().adapter_module(self._linear_name(name))
        parent, _, leaf = name.rpartition(".")
        if parent.endswith(".linear_attn") and leaf in ("q_proj", "k_proj", "v_proj"):
            return f"{parent}.kda_{leaf}"
        return name

    def _check_loaded(self, loaded: set[str], params: dict[str, nn.Parameter]) -> None:
        """A KDA projection or conv loaded from its three parts (q, k, v) counts as loaded once all three came."""
        super()._check_loaded(loaded_whole(loaded, _PART), params)
