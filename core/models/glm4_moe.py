"""Zhipu AI's GLM-4.5 / GLM-4.6 / GLM-4.5-Air (``Glm4MoeForCausalLM``), on the Llama plumbing
(:mod:`specray.models.llama`: paged KV per layer, pipeline stages, weight loading, the model interface). Where it
differs from the Llama family:

* **Attention**: grouped-query attention with biases on q/k/v only (``attention_bias``; ``o_proj`` never has one),
  an optional RMSNorm over each query and key head before RoPE (``use_qk_norm``, Qwen3's), and partial RoPE: the
  first ``partial_rotary_factor`` (0.5 in the releases) of each head rotated in the rotate-half layout (the rotated
  part's first half against its second half, as transformers' ``apply_rotary_pos_emb`` for ``glm4_moe`` and vLLM's
  neox-style rotary do; GLM-4's dense models interleave pairs instead, which this family does not).
* **MLP**: the first ``first_k_dense_replace`` layers dense, the rest DeepSeek-V3's mixture of experts
  (:mod:`specray.models.moe`'s ``glm4_moe`` row: sigmoid scores, the choice biased by ``e_score_correction_bias``
  over the ``topk_group`` best of ``n_group`` groups, weights renormalised with ``norm_topk_prob`` and times
  ``routed_scaling_factor``; ``n_shared_experts`` shared experts every token takes).
* **MTP**: the releases carry ``num_nextn_predict_layers`` multi-token-prediction layers after the last decoder
  layer, named as DeepSeek-V3's (``model.layers.{num_hidden_layers}.eh_proj`` ...). The target skips them; the
  ``mtp`` drafter builds their block from this family's attention and experts (:meth:`mtp_layer_parts`).

rednote's dots.llm1 (``Dots1ForCausalLM``) is this class too: Qwen3's attention (no biases, q/k norms always, full
RoPE) with DeepSeek-V3's experts after ``first_k_dense_replace`` dense layers.
"""

from __future__ import annotations

from torch import nn

from specray.models.layers import RMSNorm, RowParallelLinear
from specray.models.llama import (QK_NORM_MODEL_TYPES, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP,
                                  LlamaModel)
from specray.models.moe import SparseMoE
from specray.parallel import TPGroup


class Glm4MoeAttention(LlamaAttention):
    """Llama's attention (its forward: the optional per-head q/k norms, then the partial rotation the stack's cos and
    sin cover) with GLM's switches: ``attention_bias`` biases q/k/v but never ``o_proj``, and ``use_qk_norm`` gives
    each query and key head an RMSNorm."""

    def __init__(self, config, tp: TPGroup, layer: int):
        # Llama's own construction (so this layer keeps whatever else Llama's attention sets up), then GLM's two
        # differences from it
        super().__init__(config, tp, layer)
        if self.o_proj.bias is not None:
            h, width = config.hidden_size, config.num_attention_heads * self.head_dim
            self.o_proj = RowParallelLinear(width, h, tp, bias=False)
        # (dots.llm1's config has no flag: its heads are always normed, as Qwen3's)
        qk_norm = bool(getattr(config, "use_qk_norm", False)) or config.model_type in QK_NORM_MODEL_TYPES
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    """A pre-norm layer (Llama's forward) whose MLP is dense before ``first_k_dense_replace`` and sparse after."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        nn.Module.__init__(self)
        self.self_attn = Glm4MoeAttention(config, tp, layer)
        dense = layer < (getattr(config, "first_k_dense_replace", None) or 0)  # (Solar Open's config has none)
        self.mlp = LlamaMLP(config, tp) if dense else SparseMoE(config, tp, expert_parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Glm4MoeModel(LlamaModel):
    layer_class = Glm4MoeDecoderLayer


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """GLM-4.5 / 4.6 / 4.5-Air for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is (experts split
    by width, or whole per rank with ``expert_parallel``)."""

    model_class = Glm4MoeModel

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        """An MTP layer's block (``model.layers.{num_hidden_layers + k}``): a layer past the dense ones, so GLM's
        attention and the experts, split over ``tp`` as the target's layers are
        (:class:`~specray.models.draft_head.DraftHead` builds the rest)."""
        return Glm4MoeAttention(config, tp, config.num_hidden_layers), SparseMoE(config, tp, expert_parallel)
