"""Meta's XGLM (``XGLMForCausalLM``: facebook/xglm-564M, 1.7B, 2.9B, 4.5B, 7.5B), on the Llama plumbing
(:mod:`specray.models.llama`) with the classic families' pieces (:mod:`specray.models.classic`). Where it differs from
Llama:

* no RoPE: a fixed sinusoidal embedding of each position joins the token's, the row ``position + 2`` of fairseq's
  table (``sin`` of the first half of the features, ``cos`` of the second, frequencies ``10000^(-i / (d/2 - 1))``),
  computed from the positions (:class:`XGLMModel`), never stored;
* the token embedding scaled by ``sqrt(d_model)`` where ``scale_embedding`` says (every release);
* pre-LayerNorms with biases (``self_attn_layer_norm``, ``final_layer_norm``; ``model.layer_norm`` after the last
  layer), biases on q/k/v, ``out_proj`` and the gateless MLP (``fc1``, ``fc2``, ``activation_function``), the LM head
  tied to the embedding.

Its decoder with cross-attention (``add_cross_attention``) is not a causal LM and is refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import torch

from specray.models.arcee import GATELESS_STACKED
from specray.models.attention import AttentionMetadata
from specray.models.classic import GatelessMLP, NoRopeAttention, PositionFreeModel, layer_norm, llama_view
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specray.parallel import PPGroup, TPGroup

POSITION_OFFSET = 2  # fairseq's table starts past its padding rows
_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^model\.layer_norm\.", "model.norm."), (r"\.self_attn_layer_norm\.", ".input_layernorm."),
    (r"\.final_layer_norm\.", ".post_attention_layernorm."), (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
    (r"\.fc1\.", ".mlp.c_fc."), (r"\.fc2\.", ".mlp.c_proj.")))
_POSITION_TABLE = re.compile(r"^model\.embed_positions\.")  # an older save's sinusoid buffers (not read)


class XGLMDecoderLayer(LlamaDecoderLayer):
    attention_class = NoRopeAttention
    mlp_class = GatelessMLP
    build_norm = staticmethod(layer_norm)  # (the final norm too: LlamaModel.final_norm)


def sinusoids(positions: torch.Tensor, inv_freq: torch.Tensor, width: int, offset: int) -> torch.Tensor:
    """fairseq's sinusoidal embeddings [T, width] (float32) of ``positions`` [T]: the rows ``position + offset`` of its
    table, ``sin`` then ``cos`` of each angle, a zero column where ``width`` is odd."""
    angles = (positions + offset).float()[:, None] * inv_freq[None, :]
    rows = torch.cat((angles.sin(), angles.cos()), dim=-1)
    return rows if width % 2 == 0 else torch.nn.functional.pad(rows, (0, 1))


class XGLMModel(PositionFreeModel):
    """A stack whose input is the scaled token embedding plus the sinusoid of each position."""

    layer_class = XGLMDecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__(config, tp, expert_parallel, pp)
        self.embedding_multiplier = math.sqrt(config.hidden_size) if config.scale_embedding else 1.0
        half = config.hidden_size // 2
        step = math.log(10000) / (half - 1)  # (fairseq's: the last frequency is 1 / 10000)
        inv_freq = torch.exp(torch.arange(half, dtype=torch.int64, device="cpu").float() * -step)  # (as on the host)
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)
        self.width = config.hidden_size

    def embed_step(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, meta.positions: [T] -> [T, H]
        x = self.embed(input_ids)
        return x + sinusoids(meta.positions, self.inv_freq, self.width, POSITION_OFFSET).to(x.dtype)


class XGLMForCausalLM(LlamaForCausalLM):
    """XGLM for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = XGLMModel
    stacked = GATELESS_STACKED
    # LoRA on q/k/v, out_proj and the MLP (an adapter names fc1 / fc2 / out_proj, renamed as the weights are)
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        if getattr(hf_config, "add_cross_attention", False):
            raise ValueError("add_cross_attention=True is not supported for model_type='xglm': a decoder attending "
                             "an encoder's states is not a causal LM; load a release with add_cross_attention false")
        if hf_config.hidden_size < 4:
            raise ValueError(f"d_model={hf_config.hidden_size} is too narrow for XGLM's sinusoidal positions (its "
                             "frequencies divide by d_model / 2 - 1): use d_model >= 4")
        config = llama_view(hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None,
                            sliding_window=None, attention_bias=True, hidden_act=hf_config.activation_function,
                            layer_norm_eps=1e-5, intermediate_size=hf_config.ffn_dim,
                            tie_word_embeddings=getattr(hf_config, "tie_word_embeddings", True))
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        return super()._unfused((name, tensor) for name, tensor in weights if not _POSITION_TABLE.match(name))
