"""OpenAI's first GPT (``OpenAIGPTLMHeadModel``, model type ``openai-gpt``: openai-community/openai-gpt and the models
trained in its layout), on the Llama plumbing (:mod:`specray.models.llama`) with the classic families' pieces
(:mod:`specray.models.classic`). GPT-2's projections and positions with these differences:

* post-LayerNorm blocks, ``n = ln_1(h + attn(h))``, ``h' = ln_2(n + mlp(n))``, and no norm after the last layer
  (OPT-350M's layer, :class:`~specray.models.opt.OPTPostNormLayer`, and its :class:`~specray.models.opt.StreamSum`);
* no RoPE: a learned embedding of each position joins the token's from row 0 of its table (``positions_embed``);
* its activations by ``afn``: ``gelu`` is GELU's tanh approximation (transformers' ``gelu_new``), ``relu``, and
  ``silu`` / ``swish`` (SiLU);
* its projections are ``Conv1D`` weights, ``[in, out]`` (transposed at load), q/k/v fused in thirds as ``c_attn``
  (split at load); every projection and LayerNorm has a bias; the LM head is tied to the token embedding;
* its names: ``transformer.tokens_embed`` / ``positions_embed`` / ``h.N`` (``ln_1``, ``ln_2``, ``attn.c_attn``,
  ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``), the first release without ``transformer.``. The causal mask
  transformers keeps per layer (``attn.bias``) is skipped where a checkpoint stores it.

Scores are scaled by ``head_dim ** -0.5`` (transformers builds every block with ``scale=True``); its masked scores are
-1e4 rather than -inf, which softmax rounds to the same zero weights in float32.
"""

from __future__ import annotations

import functools
import re

import torch.nn.functional as F

from specray.models.arcee import GATELESS_STACKED
from specray.models.classic import GatelessMLP, LearnedPositionsModel, ThirdsQKVAdapters, llama_view
from specray.models.gpt2 import GPT2LMHeadModel
from specray.models.llama import LlamaForCausalLM
from specray.models.opt import OPTPostNormLayer, StreamSum
from specray.parallel import PPGroup, TPGroup

# afn -> the function transformers' ACT_FNS gives it ("gelu" is gelu_new: GELU's tanh approximation)
AFNS = {"gelu": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu, "silu": F.silu, "swish": F.silu}
_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^(?:transformer\.)?tokens_embed\.", "model.embed_tokens."),
    (r"^(?:transformer\.)?positions_embed\.", "model.embed_positions."), (r"^(?:transformer\.)?h\.", "model.layers."),
    (r"\.ln_1\.", ".input_layernorm."), (r"\.ln_2\.", ".post_attention_layernorm."),
    (r"\.attn\.c_proj\.", ".self_attn.o_proj."), (r"\.attn\.", ".self_attn.")))
_BUFFERS = re.compile(r"(?:\.attn\.bias|^(?:transformer\.)?position_ids)$")  # the stored causal mask, position ids


class OpenAIGPTMLP(GatelessMLP):
    """``c_proj(afn(c_fc(x)))`` with biases, the activation by the config's ``afn``."""

    def __init__(self, config, tp: TPGroup):
        super().__init__(llama_view(config, hidden_act="relu"), tp)  # (the projections; the activation: afn's)
        self.act = AFNS[config.afn]


class OpenAIGPTDecoderLayer(OPTPostNormLayer):
    """OPT-350M's post-norm layer (no-RoPE attention, LayerNorms with biases) with :class:`OpenAIGPTMLP`."""

    mlp_class = OpenAIGPTMLP


class OpenAIGPTModel(LearnedPositionsModel):
    """Learned positions from row 0, post-norm layers, nothing after the last layer."""

    layer_class = OpenAIGPTDecoderLayer

    @classmethod
    def final_norm(cls, config) -> StreamSum:
        return StreamSum()


class OpenAIGPTLMHeadModel(ThirdsQKVAdapters, LlamaForCausalLM):
    """OpenAI GPT for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = OpenAIGPTModel
    stacked = GATELESS_STACKED
    skipped_buffers = _BUFFERS
    # LoRA on q/k/v (an adapter's c_attn: its B's rows split into q, k, v as the weight's are), c_proj and the MLP, as
    # GPT-2's (PEFT's adapters of a Conv1D are A [r, in] and B [out, r], as a Linear's)
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        if hf_config.afn not in AFNS:
            raise ValueError(f"afn={hf_config.afn!r} is not supported for model_type='openai-gpt'; one of "
                             f"{sorted(AFNS)} (transformers' OpenAI GPT activations)")
        hidden = hf_config.hidden_size
        config = llama_view(hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None,
                            sliding_window=None, attention_bias=True, hidden_act=hf_config.afn,
                            layer_norm_eps=hf_config.layer_norm_epsilon, intermediate_size=4 * hidden,
                            tie_word_embeddings=getattr(hf_config, "tie_word_embeddings", True))
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES

    _unfused = GPT2LMHeadModel._unfused  # GPT-2's Conv1D weights and c_attn in thirds

