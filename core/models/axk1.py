"""SK Telecom's A.X-K1 (``AXK1ForCausalLM``), DeepSeek-V3 (:mod:`specray.models.deepseek_v3`: latent attention, always
with a q LoRA rank; DeepSeek-V3's grouped sigmoid router, experts and shared expert, each layer's kind by
``mlp_layer_types``) with one change: each sparse layer's MoE output RMS-normed (``post_mlp_layernorm``) before it
joins the residual stream. The release keeps that norm on the layer (``model.layers.N.post_mlp_layernorm``);
transformers saves it under the block (``mlp.post_mlp_layernorm``): both are read."""

from __future__ import annotations

import re

import torch

from specray.models.attention import AttentionMetadata
from specray.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM, DeepseekV3Model
from specray.models.layers import RMSNorm
from specray.models.llama import _CHECKPOINT_NAMES, norm_stream
from specray.models.moe import FAMILIES, SparseMoE
from specray.parallel import TPGroup

FAMILIES["axk1"] = FAMILIES["deepseek_v3"]
_CHECKPOINT_NAMES["axk1"] = ((re.compile(r"\.mlp\.post_mlp_layernorm\."), ".post_mlp_layernorm."),)


class AXK1DecoderLayer(DeepseekV3DecoderLayer):
    """DeepSeek-V3's layer; a sparse one norms its MoE output."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__(config, tp, layer, expert_parallel)
        sparse = isinstance(self.mlp, SparseMoE)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sparse else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H], the stream being x + residual (added in the next norm)
        x, residual = norm_stream(self.input_layernorm, x, residual)
        x, residual = self.post_attention_layernorm(self.mix(x, cos, sin, meta), residual)
        x = self.mlp(x)
        return (x if self.post_mlp_layernorm is None else self.post_mlp_layernorm(x)), residual


class AXK1Model(DeepseekV3Model):
    layer_class = AXK1DecoderLayer


class AXK1ForCausalLM(DeepseekV3ForCausalLM):
    """A.X-K1 for causal LM, sharded over ``tp`` (experts by width, or whole with expert parallelism) and ``pp``."""

    model_class = AXK1Model
