"""Salesforce's CTRL (``CTRLLMHeadModel``, model type ``ctrl``: Salesforce/ctrl), on the Llama plumbing
(:mod:`specray.models.llama`) with the classic families' pieces (:mod:`specray.models.classic`). Where it differs from
Llama:

* no RoPE: a fixed sinusoidal embedding of each position joins the token's, row ``position`` of its table (no offset):
  ``sin`` of the angles at the even features' rates, then ``cos`` at the odd features' (feature ``i``'s rate
  ``10000^(-2 floor(i / 2) / d)``), computed from the positions (:class:`CTRLModel`), never stored;
* the token embedding scaled by ``sqrt(n_embd)``;
* pre-LayerNorms with biases (``layernorm1``, ``layernorm2``; their eps fixed at 1e-6 as transformers builds them,
  ``transformer.layernorm`` after the last layer at ``layer_norm_epsilon``), biases on q/k/v (``Wq``, ``Wk``, ``Wv``),
  the output projection (``dense``) and the gateless ReLU MLP (``ffn.0``, ``ffn.2``), scores scaled by
  ``head_dim ** -0.5``;
* the LM head tied to the embedding, with a bias of its own (``lm_head.bias``).

Its names: ``transformer.w`` / ``h.N`` (``multi_head_attention.*``, ``ffn.*``) / ``layernorm``.
"""

from __future__ import annotations

import math
import re

import torch

from specray.models.arcee import GATELESS_STACKED
from specray.models.attention import AttentionMetadata
from specray.models.classic import GatelessMLP, NoRopeAttention, PositionFreeModel, layer_norm, llama_view
from specray.models.layers import LayerNorm
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specray.parallel import PPGroup, TPGroup

LAYER_NORM_EPS = 1e-6  # the layers' LayerNorms (transformers' EncoderLayer fixes it; the final one reads the config)
_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^transformer\.w\.", "model.embed_tokens."), (r"^transformer\.layernorm\.", "model.norm."),
    (r"^transformer\.h\.", "model.layers."), (r"\.layernorm1\.", ".input_layernorm."),
    (r"\.layernorm2\.", ".post_attention_layernorm."), (r"\.multi_head_attention\.Wq\.", ".self_attn.q_proj."),
    (r"\.multi_head_attention\.Wk\.", ".self_attn.k_proj."), (r"\.multi_head_attention\.Wv\.", ".self_attn.v_proj."),
    (r"\.multi_head_attention\.dense\.", ".self_attn.o_proj."), (r"\.ffn\.0\.", ".mlp.c_fc."),
    (r"\.ffn\.2\.", ".mlp.c_proj.")))


class CTRLDecoderLayer(LlamaDecoderLayer):
    attention_class = NoRopeAttention
    mlp_class = GatelessMLP

    @staticmethod
    def build_norm(config) -> LayerNorm:
        return LayerNorm(config.hidden_size, LAYER_NORM_EPS, bias=True)


def sinusoids(positions: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
    """CTRL's positional encodings [T, d] (float32) of ``positions`` [T]: ``sin`` of the even features' angles, then
    ``cos`` of the odd features' (``rates`` [d]: each feature's)."""
    angles = positions.float()[:, None] * rates[None, :]
    return torch.cat((angles[:, 0::2].sin(), angles[:, 1::2].cos()), dim=-1)


class CTRLModel(PositionFreeModel):
    """A stack whose input is the scaled token embedding plus the sinusoid of each position."""

    layer_class = CTRLDecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__(config, tp, expert_parallel, pp)
        width = config.hidden_size
        self.embedding_multiplier = math.sqrt(width)
        features = torch.arange(width, dtype=torch.int64, device="cpu").float()  # (on the host, as transformers does)
        rates = 1 / torch.pow(10000, (2 * (features // 2)) / width)
        self.register_buffer("rates", rates.to(torch.get_default_device()), persistent=False)

    @classmethod
    def final_norm(cls, config) -> LayerNorm:
        return layer_norm(config)  # (the config's layer_norm_epsilon)

    def embed_step(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, meta.positions: [T] -> [T, H]
        x = self.embed(input_ids)
        return x + sinusoids(meta.positions, self.rates).to(x.dtype)


class CTRLLMHeadModel(LlamaForCausalLM):
    """CTRL for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = CTRLModel
    stacked = GATELESS_STACKED
    # LoRA on q/k/v, the output projection and the MLP: our names (adapters name the checkpoint's Wq / Wk / Wv / dense
    # / ffn.0 / ffn.2: adapter_module renames them)
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        config = llama_view(hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None,
                            sliding_window=None, attention_bias=True, hidden_act="relu",
                            layer_norm_eps=hf_config.layer_norm_epsilon, intermediate_size=hf_config.dff,
                            lm_head_bias=True, tie_word_embeddings=getattr(hf_config, "tie_word_embeddings", True))
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES
