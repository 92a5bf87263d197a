"""MosaicML's MPT (``MptForCausalLM``: MPT-7B and its Instruct / Chat / StoryWriter / 8k releases, MPT-30B), on the
Llama plumbing (:mod:`specray.models.llama`). Where it differs from Llama:

* no position embeddings: ALiBi's bias on every head's scores (:mod:`specray.models.alibi`; ``alibi_bias_max``
  read from the config, 8 in every release);
* q/k/v fused as ``Wqkv`` (q, k and v in turn), split at load; q, k and v clamped to ``clip_qkv`` where the config
  sets it; the scores scaled by ``softmax_scale`` where it sets one;
* LayerNorms without biases (``no_bias``: every release; with it false, biases on the norms and projections); a
  gateless GELU MLP ``expansion_ratio`` times the width (``up_proj``, ``down_proj``), the head tied;
* its names: ``transformer.wte``, ``transformer.blocks.N`` (``norm_1``, ``attn``, ``norm_2``, ``ffn``),
  ``transformer.norm_f``; its length ``max_seq_len``.

Refused by name, as no release sets them: learned positions instead of ALiBi (``alibi`` false), q/k LayerNorms
(``qk_ln``), grouped or multi-query attention (``attn_type``), scaled logits (``logit_scale``), norms other than
LayerNorm (``norm_type``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from torch import nn

from specray.models.alibi import AlibiSelfAttention
from specray.models.arcee import GATELESS_STACKED
from specray.models.classic import GatelessMLP, PositionFreeModel, ThirdsQKVAdapters, llama_view, sub_field
from specray.models.layers import LayerNorm, materialize
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^transformer\.wte\.", "model.embed_tokens."), (r"^transformer\.norm_f\.", "model.norm."),
    (r"^transformer\.blocks\.", "model.layers."), (r"\.norm_1\.", ".input_layernorm."),
    (r"\.norm_2\.", ".post_attention_layernorm."), (r"\.attn\.out_proj\.", ".self_attn.o_proj."),
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.up_proj\.", ".mlp.c_fc."), (r"\.ffn\.down_proj\.", ".mlp.c_proj.")))
_NORMS = ("layernorm", "low_precision_layernorm")  # (the low-precision one is computed in float32 here)


def mpt_norm(config) -> nn.Module:
    """MPT's LayerNorm: a bias only where the release has biases (``no_bias`` false)."""
    return LayerNorm(config.hidden_size, config.layer_norm_epsilon, bias=not config.no_bias)


class MptDecoderLayer(LlamaDecoderLayer):
    attention_class = AlibiSelfAttention
    mlp_class = GatelessMLP
    build_norm = staticmethod(mpt_norm)  # (the final norm too: LlamaModel.final_norm)


class MptModel(PositionFreeModel):
    layer_class = MptDecoderLayer


def check_supported(hf_config) -> None:
    """The ValueError naming the first field no MPT release sets (module docstring)."""
    attn = hf_config.attn_config
    alibi, qk_ln, kind = (sub_field(attn, f, d) for f, d in (("alibi", True), ("qk_ln", False),
                                                             ("attn_type", "multihead_attention")))
    logit_scale, norm = getattr(hf_config, "logit_scale", None), getattr(hf_config, "norm_type", "layernorm")
    checks = ((f"attn_config.alibi={alibi!r}", alibi, "ALiBi: alibi true"),
              (f"attn_config.qk_ln={qk_ln!r}", not qk_ln, "qk_ln false"),
              (f"attn_config.attn_type={kind!r}", kind == "multihead_attention", "attn_type 'multihead_attention'"),
              (f"logit_scale={logit_scale!r}", logit_scale is None, "logit_scale null"),
              (f"norm_type={norm!r}", norm in _NORMS, f"norm_type one of {_NORMS}"))
    for what, ok, supported in checks:
        if not ok:
            raise ValueError(f"{what} is not supported for model_type='mpt': specray serves MPT's releases "
                             f"({supported})")


class MptForCausalLM(ThirdsQKVAdapters, LlamaForCausalLM):
    """MPT for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is (each rank its heads' slopes)."""

    model_class = MptModel
    stacked = GATELESS_STACKED
    fused_qkv_module = ".attn.Wqkv"
    # LoRA on q/k/v (an adapter's Wqkv split in three, as the weight is), out_proj and the MLP
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        check_supported(hf_config)
        bias, attn = not hf_config.no_bias, hf_config.attn_config
        config = llama_view(hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None,
                            sliding_window=None, attention_bias=bias, use_bias=bias, hidden_act="gelu",
                            intermediate_size=hf_config.expansion_ratio * hf_config.hidden_size,
                            max_position_embeddings=hf_config.max_seq_len, clip_qkv=sub_field(attn, "clip_qkv"),
                            softmax_scale=sub_field(attn, "softmax_scale"),
                            alibi_bias_max=sub_field(attn, "alibi_bias_max", 8))
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            if ".attn.Wqkv." in name:  # [3 H, ...]: q, k, v in turn
                parts = materialize(tensor).chunk(3)
                yield from ((name.replace(".Wqkv.", f".{p}_proj."), part) for p, part in zip("qkv", parts))
            else:
                yield name, tensor
