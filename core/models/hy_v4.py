"""Tencent's Hunyuan 4 (``HYV4ForCausalLM``), built from parts written for other families:

* DeepSeek-V3's multi-head latent attention with DeepSeek Sparse Attention as GLM-5 has it (an indexer on "full"
  layers, "shared" layers attending the last pick; :mod:`specray.models.deepseek_v3`), its indexer rotating each
  head's last ``qk_rope_head_dim`` features, with a learned sink logit per head (the absorbed form attends
  explicitly with them; the unabsorbed form, which has no sinks, is not used) and a sigmoid output gate per head
  (``gate_proj``, on the attention output before ``o_proj``);
* ``hc_mult`` residual streams (:class:`~specray.models.deepseek_v4.StreamsModel`) mixed by independent
  hyper-connections: DeepSeek-V4's without the mixing matrix (the streams pass on as they are, the block's output
  spread by ``hc_magnitude * sigmoid(...) + hc_eps``);
* each layer's MLP dense or DeepSeek-V3's experts as ``mlp_layer_types`` names it, the routed experts' SwiGLU clamped
  at ``swiglu_limit`` (:mod:`specray.models.moe`, the ``hy_v4`` row).

Its releases' multi-token-prediction layers are not read; hidden-state heads are refused, as for DeepSeek-V4.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.deepseek_v3 import MLAttention
from specray.models.deepseek_v4 import HyperConnection, StreamsModel
from specray.models.layers import ColumnParallelLinear, RMSNorm, RotaryEmbedding, _copy, narrow, rope_parameters
from specray.models.llama import LlamaForCausalLM, LlamaMLP
from specray.models.moe import SparseMoE
from specray.parallel import PPGroup, TPGroup

# the release's names (what transformers saves) and transformers' -> ours: the sinks sit on our latent attention,
# the hyper-connections' parameters on their modules as DeepSeek-V4's are
_NAMES = tuple((re.compile(a), b) for a, b in (
    (r"\.self_attn\.(?:sinks|learnable_sink_param)$", ".self_attn.attn.sinks"), (r"\.linear_gate\.", ".gate_proj."),
    (r"\.hc_pre\.hc_attn_layer\.hc_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_pre\.hc_mlp_layer\.hc_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.hc_pre\.hc_head\.hc_head_(fn|base|scale)$", r".hc_head.hc_\1")))


class HYV4Attention(MLAttention):
    """Latent attention with sparse selection, sinks and a sigmoid output gate per head, over ``tp``."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.gate_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads * self.v_dim, tp)
        self.attn.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        first = tp.rank * self.num_heads

        def load_sinks(param: nn.Parameter, loaded: Any) -> None:
            _copy(param, narrow(loaded, 0, first, self.num_heads))

        self.attn.sinks.weight_loader = load_sinks
        self.attn.unabsorbed_from = 1 << 62  # the unabsorbed form attends by SDPA, which has no sinks

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        gate = torch.sigmoid(self.gate_proj(x)).view(t, self.num_heads, self.v_dim)
        return self.o_proj((self.head_outputs(x, cos, sin, meta) * gate).reshape(t, -1))


class HYV4DecoderLayer(nn.Module):
    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__()
        self.self_attn = HYV4Attention(config, tp, layer)
        sparse = config.mlp_layer_types[layer] == "sparse"
        self.mlp = SparseMoE(config, tp, expert_parallel) if sparse else LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(config, comb=False), HyperConnection(config, comb=False)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        # streams [T, n, H] -> [T, n, H]
        post, _, x = self.attn_hc(streams)
        streams = HyperConnection.merge(post, None, self.self_attn(self.input_layernorm(x), *rope, meta), streams)
        post, _, x = self.ffn_hc(streams)
        return HyperConnection.merge(post, None, self.mlp(self.post_attention_layernorm(x)), streams)


class HYV4Model(StreamsModel):
    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__()
        self.build_streams(config, tp, pp, lambda i: HYV4DecoderLayer(config, tp, i, expert_parallel))
        self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, rope_parameters(config, partial=True),
                                          config.max_position_embeddings)

    def rope(self, meta: AttentionMetadata, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        self.rotary_emb.ensure(meta.max_position + 1)
        return self.rotary_emb(meta.positions, dtype)


class HYV4ForCausalLM(LlamaForCausalLM):
    """Hunyuan 4 for causal LM, sharded over ``tp`` (heads, their sinks and gates; experts by width, or whole with
    ``expert_parallel``) and ``pp`` (a stage hands on the streams)."""

    model_class = HYV4Model
    # gate/up merged in the MLPs only (the attention's gate_proj is its own)
    stacked = {".mlp.gate_proj.": (".mlp.gate_up_proj.", 0), ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
               ".shared_experts.gate_proj.": (".shared_experts.gate_up_proj.", 0),
               ".shared_experts.up_proj.": (".shared_experts.gate_up_proj.", 1)}
    lora_modules: tuple[str, ...] = ()
    serves_heads = False  # no hidden-state head drafts for it (specray.engine.builder.check_heads_served)

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.stage_width = hf_config.hc_mult  # a stage hands the next its residual streams
        self.renames = _NAMES
