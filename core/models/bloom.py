"""BigScience's BLOOM (``BloomForCausalLM``: bloom-560m to BLOOM-176B, BLOOMZ and the models trained in its layout),
on the Llama plumbing (:mod:`specray.models.llama`). Where it differs from Llama:

* no position embeddings: ALiBi's bias on every head's scores (:mod:`specray.models.alibi`);
* a LayerNorm on the token embeddings (``word_embeddings_layernorm``), LayerNorms with biases everywhere;
* q/k/v fused head by head (``query_key_value``: each head's q, k and v rows in turn, as GPT-NeoX's), split at load;
  biases on every projection; a gateless GELU MLP (``dense_h_to_4h``, ``dense_4h_to_h``; GELU's tanh form), the head
  tied;
* where ``apply_residual_connection_post_layernorm`` (no release sets it), each block's residual is its normed
  input rather than the stream;
* its names: ``transformer.word_embeddings``, ``transformer.h.N``, ``self_attention``, ``transformer.ln_f`` (the
  first releases without ``transformer.``).

A config gives no length: 2048, as vLLM's default, unless it says otherwise (``hf_overrides``'
``max_position_embeddings``).
"""

from __future__ import annotations

import re
import torch

from specray.models.alibi import AlibiSelfAttention
from specray.models.arcee import GATELESS_STACKED
from specray.models.attention import AttentionMetadata
from specray.models.classic import FusedQKVAdapters, GatelessMLP, PositionFreeModel, layer_norm, llama_view
from specray.models.layers import max_positions, on_stage
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^(?:transformer\.)?word_embeddings\.", "model.embed_tokens."),
    (r"^(?:transformer\.)?word_embeddings_layernorm\.", "model.embed_norm."),
    (r"^(?:transformer\.)?ln_f\.", "model.norm."), (r"^(?:transformer\.)?h\.", "model.layers."),
    (r"\.self_attention\.dense\.", ".self_attn.o_proj."), (r"\.self_attention\.", ".self_attn."),
    (r"\.mlp\.dense_h_to_4h\.", ".mlp.c_fc."), (r"\.mlp\.dense_4h_to_h\.", ".mlp.c_proj.")))


class BloomDecoderLayer(LlamaDecoderLayer):
    attention_class = AlibiSelfAttention
    mlp_class = GatelessMLP
    build_norm = staticmethod(layer_norm)  # (the final norm too: LlamaModel.final_norm)


class BloomNormedResidualLayer(BloomDecoderLayer):
    """``apply_residual_connection_post_layernorm``: ``a = ln1(h) + attn(ln1(h))``, ``out = ln2(a) + mlp(ln2(a))``."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H], the stream being x + residual -> (the MLP's output, its normed input)
        h = self.input_layernorm(x if residual is None else x + residual)
        a = self.post_attention_layernorm(h + self.mix(h, cos, sin, meta))
        return self.mlp(a), a


class BloomModel(PositionFreeModel):
    layer_class = BloomDecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        if config.apply_residual_connection_post_layernorm:
            self.layer_class = BloomNormedResidualLayer
        super().__init__(config, tp, expert_parallel, pp)
        self.embed_norm = on_stage(self.pp.holds_embedding, lambda: layer_norm(config))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, H], normed
        return self.embed_norm(self.embed_tokens(input_ids))


class BloomForCausalLM(FusedQKVAdapters, LlamaForCausalLM):
    """BLOOM for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is (each rank its heads' slopes)."""

    model_class = BloomModel
    stacked = GATELESS_STACKED
    # LoRA on q/k/v (an adapter's query_key_value split head by head, as the weight is), dense and the MLP
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        hidden = hf_config.hidden_size
        config = llama_view(hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None,
                            sliding_window=None, attention_bias=True, hidden_act="gelu_pytorch_tanh",
                            layer_norm_eps=hf_config.layer_norm_epsilon, intermediate_size=4 * hidden,
                            max_position_embeddings=max_positions(hf_config))
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES
