"""Meituan's LongCat-Flash (``LongcatFlashForCausalLM``), on the Llama plumbing (:mod:`specray.models.llama`: paged KV
per attention layer, pipeline stages, weight loading, the model interface) with DeepSeek-V3's latent attention
(:mod:`specray.models.deepseek_v3`) and :mod:`specray.models.moe`'s experts. Where it differs from DeepSeek-V3:

* **Two sublayers per layer and a shortcut MoE.** Each of the config's ``num_layers`` layers holds two attention
  blocks and two dense MLPs (``self_attn.{0,1}``, ``mlps.{0,1}``, each behind its own ``input_layernorm.{i}`` and
  ``post_attention_layernorm.{i}``) and one mixture of experts (``mlp``) that reads the first MLP's normed input and
  whose output joins the residual stream after the second MLP. transformers counts the attention blocks
  (``num_hidden_layers`` = 2 x ``num_layers``; the KV cache's layers 2i and 2i + 1 are layer i's); here a layer is
  the config's, so pipeline stages split whole layers and an aux layer index (EAGLE-3's) names the stream entering
  one, as transformers' ``hidden_states`` does.
* **Latent attention scaled.** The query latent's and the KV latent's norms are scaled by
  ``sqrt(hidden_size / q_lora_rank)`` and ``sqrt(hidden_size / kv_lora_rank)`` where the release's
  ``mla_scale_q_lora`` / ``mla_scale_kv_lora`` say so (as vLLM reads them; on where a config omits them, as
  transformers always scales): q_b_proj has no bias, so scaling its input scales the query, and the cached latent is
  the scaled one (its keys and values alike). Those two norms' epsilon is 1e-6 (transformers', as LongCat's own
  modeling code builds them), not ``rms_norm_eps`` (vLLM's port's). RoPE rotates interleaved pairs.
* **Zero-computation experts.** The router (``router.classifier``, kept in float32 as transformers keeps it) scores
  ``n_routed_experts + zero_expert_num`` experts by softmax; the top ``moe_topk`` of score + correction bias are
  chosen, weighted by their scores times ``routed_scaling_factor`` (not renormalised); a chosen zero expert adds its
  weight times the token's input (:mod:`specray.models.moe`'s ``zero_experts``, the ``longcat_flash`` row). A
  ``router_bias`` is refused: transformers builds it but never adds it, vLLM adds it.

Its release's multi-token-prediction module (``model.mtp.*``: ``layers.0.{enorm.m, hnorm.m, eh_proj}``, one latent
attention block with a dense MLP under ``transformer_layer.mlp``, then ``model.mtp.norm`` and the target's LM head,
as vLLM's ``longcat_flash_mtp`` reads it; its own ``embed_tokens`` is not read, the target's embedding is, as vLLM
shares it) is the ``mtp`` drafter's (:meth:`LongcatFlashForCausalLM.mtp_tensor`, ``mtp_layer_parts``), reused for
every draft step; the target skips it. transformers has no MTP code for it: the module's output is checked against
vLLM's formula over transformers' own attention and MLP classes. vLLM feeds the module's normed output to its next
draft step, which ``speculative_config.mtp_feedback_normed=True`` does here (drafts only: the output is the target's
either way).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.deepseek_v3 import LATENT_NORM_EPS, DeepseekV3ForCausalLM, MLAttention
from specray.models.kv_cache import KVCache, KVCacheSpec
from specray.models.layers import RMSNorm, RotaryEmbedding, VocabParallelEmbedding, rope_parameters
from specray.models.llama import _CHECKPOINT_NAMES, LlamaMLP, LlamaModel, norm_stream
from specray.models.moe import SparseMoE
from specray.parallel import PPGroup, TPGroup

# the release's router weight under router.classifier: our router's own weight
_CHECKPOINT_NAMES["longcat_flash"] = ((re.compile(r"\.mlp\.router\.classifier\."), ".mlp.router."),)
_MTP = re.compile(r"^model\.mtp\.layers\.(\d+)\.(.*)$")
# the MTP module's names (after model.mtp.layers.{k}.) -> the mtp head's
_MTP_NAMES = (("enorm.m.", "enorm."), ("hnorm.m.", "hnorm."), ("eh_proj.", "eh_proj."),
              ("transformer_layer.mlp.", "layers.0.mlp."), ("input_layernorm.", "layers.0.input_layernorm."),
              ("post_attention_layernorm.", "layers.0.post_attention_layernorm."),
              ("self_attn.", "layers.0.self_attn."))


def check_config(config) -> None:
    """ValueErrors for what this port does not serve, naming the field."""
    if config.q_lora_rank is None:
        raise ValueError("q_lora_rank=None is not supported for model_type='longcat_flash': its queries always come "
                         "through a latent (q_a_proj, q_b_proj); the checkpoint's config.json must give q_lora_rank")
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    if (getattr(config, "qk_head_dim", None) or qk) != qk:
        raise ValueError(f"qk_head_dim={config.qk_head_dim} must equal qk_nope_head_dim + qk_rope_head_dim = {qk} "
                         "for model_type='longcat_flash' (its queries split into those two parts)")
    if (getattr(config, "head_dim", None) or config.qk_rope_head_dim) != config.qk_rope_head_dim:
        raise ValueError(f"head_dim={config.head_dim} must equal qk_rope_head_dim={config.qk_rope_head_dim} for "
                         "model_type='longcat_flash': transformers builds its RoPE tables head_dim wide and rotates "
                         "the qk_rope_head_dim features; fix the config.json")
    if getattr(config, "router_bias", False):
        raise ValueError("router_bias=True is not supported for model_type='longcat_flash': transformers builds the "
                         "router's bias but never adds it, vLLM adds it, so its meaning is unclear; load a release "
                         "without a router bias")
    kind = getattr(config, "zero_expert_type", None)
    if kind not in (None, "identity"):
        raise ValueError(f"zero_expert_type={kind!r} is not supported for model_type='longcat_flash'; 'identity' is "
                         "(a zero-computation expert passes its token's input through)")


class ScaledRMSNorm(RMSNorm):
    """An RMSNorm whose output is multiplied by ``scale`` (LongCat's latent scalings)."""

    def __init__(self, hidden_size: int, eps: float, scale: float):
        super().__init__(hidden_size, eps)
        self.scale = scale

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        out = super()._norm(x)
        return out if self.scale == 1.0 else out * self.scale


class LongcatFlashMLA(MLAttention):
    """DeepSeek-V3's latent attention with LongCat's latent scalings, its latent norms' epsilon and interleaved RoPE
    (module docstring)."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.interleave = True  # (transformers' apply_rotary_pos_emb_interleave, whatever rope_interleave says)
        h = config.hidden_size
        q_scale = (h / config.q_lora_rank) ** 0.5 if getattr(config, "mla_scale_q_lora", True) else 1.0
        kv_scale = (h / config.kv_lora_rank) ** 0.5 if getattr(config, "mla_scale_kv_lora", True) else 1.0
        self.q_a_layernorm = ScaledRMSNorm(config.q_lora_rank, LATENT_NORM_EPS, q_scale)
        self.kv_a_layernorm = ScaledRMSNorm(config.kv_lora_rank, LATENT_NORM_EPS, kv_scale)


class LongcatFlashDecoderLayer(nn.Module):
    """One of the config's layers: two attention + MLP sublayers and the shortcut MoE (module docstring)."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = nn.ModuleList([LongcatFlashMLA(config, tp, 2 * layer + i) for i in range(2)])
        self.mlps = nn.ModuleList([LlamaMLP(config, tp) for _ in range(2)])
        self.input_layernorm = nn.ModuleList([RMSNorm(h, eps) for _ in range(2)])
        self.post_attention_layernorm = nn.ModuleList([RMSNorm(h, eps) for _ in range(2)])
        self.mlp = SparseMoE(config, tp, expert_parallel)
        # the router's weight in float32, as transformers keeps it (_keep_in_fp32_modules): rounded to bf16 it could
        # change which of the release's 768 experts make a token's top 12
        router = self.mlp.router_module
        router.weight = nn.Parameter(router.weight.data.float(), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H] (the residual added lazily, in the next norm) -> the same
        x, residual = norm_stream(self.input_layernorm[0], x, residual)
        x, residual = self.post_attention_layernorm[0](self.self_attn[0](x, cos, sin, meta), residual)
        shortcut = self.mlp(x)  # the experts read the first MLP's input; their output joins after the second MLP
        x, residual = self.input_layernorm[1](self.mlps[0](x), residual)
        x, residual = self.post_attention_layernorm[1](self.self_attn[1](x, cos, sin, meta), residual)
        return self.mlps[1](x) + shortcut, residual


class LongcatFlashModel(LlamaModel):
    layer_class = LongcatFlashDecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        check_config(config)
        # the stack is the config's num_layers layers (the stages split them whole); build_stage reads only the count
        self.build_stage(SimpleNamespace(num_hidden_layers=config.num_layers), pp,
                         lambda i: self.layer_class(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, rope_parameters(config, partial=True),
                                          config.max_position_embeddings)


class LongcatFlashForCausalLM(DeepseekV3ForCausalLM):
    """LongCat-Flash for causal LM, sharded over ``tp`` (see the module docstring)."""

    model_class = LongcatFlashModel
    skipped = ("model.mtp.",)  # the release's MTP module: the mtp drafter's

    @staticmethod
    def stack_layers(config) -> int:
        """The stack's layers (a head's aux layer ids index them): ``num_layers``, each two attention blocks."""
        return config.num_layers

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        """Pipeline stages split the config's ``num_layers`` layers (each holds two attention blocks), before any
        rank starts."""
        if pp > config.num_layers:
            raise ValueError(f"pipeline_parallel_size={pp} exceeds num_layers={config.num_layers} for "
                             "model_type='longcat_flash' (each stage holds whole layers of two attention blocks "
                             "each; num_hidden_layers counts those blocks); use at most num_layers stages")

    def _a_norm(self) -> torch.Tensor:
        return self.model.layers[self.model.stage.start].input_layernorm[0].weight

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Two per layer of this stage (its two attention blocks), in order: transformers' cache layers 2i, 2i + 1."""
        return [attn.attn.kv_spec for _, layer in self.model.stage_layers() for attn in layer.self_attn]

    def bind_kv_cache(self, cache: KVCache) -> None:
        assert cache.specs == self.kv_cache_specs(), "the cache was allocated for another model's specs"
        blocks = [attn for _, layer in self.model.stage_layers() for attn in layer.self_attn]
        for j, attn in enumerate(blocks):
            attn.attn.bind_cache(cache.layer(j), cache.block_size, cache.fp8)
        self.kv_cache_allocated = True

    # ------------------------------------------------------------------------------------------ MTP (the drafter's)

    @staticmethod
    def mtp_tensor(name: str, model_type: str) -> tuple[int, str] | None:
        """A checkpoint tensor's (module, name in the mtp head) where it is the release's MTP module's (its final
        norm ``model.mtp.norm``: module -1, every module's), else None (its own embedding: the target's is read)."""
        if name == "model.mtp.norm.weight":
            return -1, "norm.weight"
        found = _MTP.match(name)
        if found is None:
            return None
        k, rest = found.groups()
        theirs, ours = next(((t, o) for t, o in _MTP_NAMES if rest.startswith(t)), ("", "unknown."))
        return int(k), ours + rest[len(theirs):]  # (an unknown one is refused by name when the head loads it)

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        """The MTP block: LongCat's latent attention (scaled, split over ``tp`` as the target's) and a dense MLP of
        ``ffn_hidden_size`` (no experts)."""
        check_config(config)
        return LongcatFlashMLA(config, tp, config.num_hidden_layers), LlamaMLP(config, tp)

