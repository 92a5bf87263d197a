"""Model types that transformers serves through another family's class, each with a config class of its own and its
releases' own tensor names (``transformers/conversion_mapping.py``), served here by that family's class the same way:

* EXAONE 3.0 / 3.5 (``exaone``, ``ExaoneForCausalLM``): Llama. Its config names some fields as GPT-2 does
  (``num_layers``, ``layer_norm_epsilon``, ``activation_function``: transformers' ``attribute_map``) and its releases
  name the tensors so too (``transformer.wte``, ``transformer.h.N.attn.attention.{q,k,v,out}_proj``, ``ln_1`` /
  ``ln_2``, ``mlp.c_fc_0`` / ``c_fc_1`` / ``c_proj``, ``transformer.ln_f``), renamed as transformers renames them.
* InternLM3 (``internlm3``) and IQuest-Coder (``iquestcoder``): Llama, Llama's tensor names (InternLM3's
  ``qkv_bias`` / ``bias`` are ``attention_bias`` / ``mlp_bias``, which its config class requires equal).
* Sarvam's 105B (``sarvam_mla``): DeepSeek-V3 (latent attention, grouped sigmoid router), DeepSeek's names, its
  config's own names (``num_experts``, ``num_shared_experts``) being transformers' aliases.
* Sarvam's 30B (``sarvam_moe``): GLM-4.5 (GQA with q/k norms, RoPE over the whole head), its releases naming
  Bailing's tensors: ``model.word_embeddings``, ``attention.query_key_value`` (q, k and v fused by rows, split here
  before anything else reads them), ``attention.dense``, ``query_layernorm`` / ``key_layernorm``, and the router's
  correction bias ``mlp.gate.expert_bias``.

Each class builds its family's modules from a view of the config whose ``model_type`` is the family's
(:func:`served_as`): every switch the family keys on its model type (its experts' row in ``moe.py``, Llama's ignored
``sliding_window``) is then the one transformers' class applies. transformers' own save writes the releases' names
back (with the family's class as ``architectures``), so the registry picks these classes by model type too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from torch import nn

from specray.models.deepseek_v3 import DeepseekV3ForCausalLM
from specray.models.glm4_moe import Glm4MoeForCausalLM
from specray.models.llama import LlamaForCausalLM, unfuse
from specray.models.plain_config import PlainConfig, plain_config
from specray.parallel import PPGroup, TPGroup


def served_as(config: Any, model_type: str) -> PlainConfig:
    """A copy of ``config`` (a transformers config or a :class:`PlainConfig`) whose ``model_type`` is ``model_type``
    (the family transformers serves it with), its own kept as ``served_model_type``."""
    own = config.model_type
    if own == model_type:
        return config
    view = PlainConfig(**vars(plain_config(config)))
    view.model_type, view.served_model_type = model_type, own
    return view


def _renames(*pairs: tuple[str, str]) -> tuple[tuple[re.Pattern, str], ...]:
    return tuple((re.compile(pattern), ours) for pattern, ours in pairs)


class _Served:
    """A family's class for a model type transformers serves with it: ``family`` is that family's model type,
    ``release_names`` the release's tensor names as ours (applied in order, as ``_CHECKPOINT_NAMES``)."""

    family: str
    release_names: tuple[tuple[re.Pattern, str], ...] = ()

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(served_as(hf_config, self.family), tp, expert_parallel, pp)
        self.renames = self.release_names + tuple(self.renames)


class ExaoneForCausalLM(_Served, LlamaForCausalLM):
    """EXAONE 3.0 / 3.5: Llama, reading the release's GPT-2-style tensor names (module docstring)."""

    family = "llama"
    release_names = _renames((r"^transformer\.wte\.", "model.embed_tokens."), (r"^transformer\.h\.", "model.layers."),
                             (r"^transformer\.ln_f\.", "model.norm."), (r"\.attn\.attention\.", ".self_attn."),
                             (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
                             (r"\.ln_1\.", ".input_layernorm."), (r"\.ln_2\.", ".post_attention_layernorm."),
                             (r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."), (r"\.mlp\.c_fc_1\.", ".mlp.up_proj."),
                             (r"\.mlp\.c_proj\.", ".mlp.down_proj."))


class InternLM3ForCausalLM(_Served, LlamaForCausalLM):
    """InternLM3: Llama (its ``qkv_bias`` and ``bias`` biasing q/k/v and o, and the MLP)."""

    family = "llama"


class IQuestCoderForCausalLM(_Served, LlamaForCausalLM):
    """IQuest-Coder: Llama."""

    family = "llama"


class SarvamMLAForCausalLM(_Served, DeepseekV3ForCausalLM):
    """Sarvam's 105B: DeepSeek-V3, DeepSeek's tensor names."""

    family = "deepseek_v3"

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        return DeepseekV3ForCausalLM.mtp_layer_parts(served_as(config, "deepseek_v3"), tp, expert_parallel)


class SarvamMoEForCausalLM(_Served, Glm4MoeForCausalLM):
    """Sarvam's 30B: GLM-4.5's layers, reading the release's Bailing names (module docstring)."""

    family = "glm4_moe"
    release_names = _renames((r"^model\.word_embeddings\.", "model.embed_tokens."), (r"\.attention\.", ".self_attn."),
                             (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
                             (r"\.self_attn\.query_layernorm\.", ".self_attn.q_norm."),
                             (r"\.self_attn\.key_layernorm\.", ".self_attn.k_norm."),
                             (r"\.mlp\.gate\.expert_bias$", ".mlp.gate.e_score_correction_bias"))

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        d = self.model.layers[self.model.stage.start].self_attn.head_dim
        q, kv = self.config.num_attention_heads * d, self.config.num_key_value_heads * d
        self.fused = {".query_key_value.": ((".q_proj.", q), (".k_proj.", kv), (".v_proj.", kv))}

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:  # the release's q | k | v rows, as transformers splits them
            yield from unfuse(name, tensor, self.fused)

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        return Glm4MoeForCausalLM.mtp_layer_parts(served_as(config, "glm4_moe"), tp, expert_parallel)
