"""Meta's OPT (``OPTForCausalLM``: OPT-125M to OPT-66B, and Galactica, which shares its layout), on the Llama plumbing
(:mod:`specray.models.llama`). Where it differs from Llama:

* no RoPE: a learned embedding of each position joins the token's, from row ``position + 2`` of its table
  (:class:`~specray.models.classic.LearnedPositionsModel`);
* LayerNorms with biases before each block (``self_attn_layer_norm``, ``final_layer_norm``) and after the last layer,
  biases on every projection (``enable_bias``), a gateless ReLU MLP (``fc1``, ``fc2``), the LM head tied;
* its names: ``model.decoder.*`` (some releases ``decoder.*``), ``self_attn.out_proj``.

OPT-350M's layout too: each block's norm after it (``do_layer_norm_before=False``: ``h = ln(h + block(h))``, no norm
after the last layer) and embeddings narrower than the layers (``word_embed_proj_dim``: ``project_in`` to the layers'
width after the embedding, ``project_out`` back before the tied LM head).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.arcee import GATELESS_STACKED
from specray.models.attention import AttentionMetadata
from specray.models.classic import GatelessMLP, LearnedPositionsModel, NoRopeAttention, layer_norm, llama_view
from specray.models.layers import ParallelLMHead, VocabParallelEmbedding, _param, on_stage
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^(?:model\.)?decoder\.final_layer_norm\.", "model.norm."), (r"^(?:model\.)?decoder\.", "model."),
    (r"\.self_attn_layer_norm\.", ".input_layernorm."), (r"\.final_layer_norm\.", ".post_attention_layernorm."),
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."), (r"\.fc1\.", ".mlp.c_fc."), (r"\.fc2\.", ".mlp.c_proj.")))


class OPTDecoderLayer(LlamaDecoderLayer):
    attention_class = NoRopeAttention
    mlp_class = GatelessMLP
    build_norm = staticmethod(layer_norm)  # (the final norm too: LlamaModel.final_norm)


class OPTPostNormLayer(OPTDecoderLayer):
    """OPT-350M's: each block's norm after its output joins the stream, ``h = ln(h + block(h))``."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H], the stream being x + residual -> the normed stream, as (it, zeros)
        h = x if residual is None else x + residual
        h = self.input_layernorm(h + self.mix(h, cos, sin, meta))
        h = self.post_attention_layernorm(h + self.mlp(h))
        return h, torch.zeros_like(h)


class Projection(nn.Module):
    """A replicated linear map without a bias (OPT-350M's ``project_in`` / ``project_out``)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = _param(out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class StreamSum(nn.Module):
    """No norm after the last layer: the stream as it is (``x + residual``)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return x
        x = x + residual
        return x, x


class OPTModel(LearnedPositionsModel):
    layer_class = OPTDecoderLayer
    position_offset = 2

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        if not config.do_layer_norm_before:
            self.layer_class = OPTPostNormLayer
        super().__init__(config, tp, expert_parallel, pp)
        width, hidden = config.word_embed_proj_dim, config.hidden_size
        self.project_in = self.project_out = None
        if width != hidden:  # the embeddings (and the tied LM head) narrower than the layers
            if self.pp.holds_embedding:
                self.embed_tokens = VocabParallelEmbedding(config.vocab_size, width, tp)
            self.project_in = on_stage(self.pp.holds_embedding, lambda: Projection(width, hidden))
            self.project_out = on_stage(self.pp.is_last, lambda: Projection(hidden, width))
        if not config.do_layer_norm_before and self.pp.is_last:
            self.norm = StreamSum()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, H] (through project_in where the embeddings are narrower)
        x = self.embed_tokens(input_ids)
        return x if self.project_in is None else self.project_in(x)


class OPTForCausalLM(LlamaForCausalLM):
    """OPT for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = OPTModel
    stacked = GATELESS_STACKED
    # LoRA on q/k/v, the output projection and the MLP: our names (adapters name the checkpoint's: adapter_module
    # renames them)
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        checks = (("_remove_final_layer_norm", False, "no norm after the last layer of a pre-norm release"),
                  ("layer_norm_elementwise_affine", True, "LayerNorms without a weight"))
        for field, supported, what in checks:
            value = getattr(hf_config, field, supported)
            if value != supported:
                raise ValueError(f"{field}={value!r} is not supported for model_type='opt' ({what}); specray serves "
                                 f"OPT releases with {field}={supported!r}")
        config = llama_view(hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None,
                            sliding_window=None, attention_bias=hf_config.enable_bias, use_bias=hf_config.enable_bias,
                            hidden_act=hf_config.activation_function, layer_norm_eps=1e-5,
                            intermediate_size=hf_config.ffn_dim,
                            word_embed_proj_dim=hf_config.word_embed_proj_dim or hf_config.hidden_size)
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES
        width = config.word_embed_proj_dim
        if width != config.hidden_size and self.pp.is_last:  # the head over the projected width, tied as before
            self.lm_head = ParallelLMHead(config.vocab_size, width, self.tp)
            if self.shares_embedding:
                self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, V] (through project_out where the embeddings are narrower)
        if self.model.project_out is not None:
            hidden = self.model.project_out(hidden)
        return super().compute_logits(hidden)
