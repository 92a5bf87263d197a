"""Naver's HyperCLOVA X SEED (``HyperCLOVAXForCausalLM``: HyperCLOVAX-SEED-Think-14B), Granite's layers
(:mod:`specray.models.llama`: its ``embedding_multiplier``, ``attention_multiplier`` as the attention's scale, by
default ``head_dim ** -0.5``, and ``residual_multiplier``) with:

* with ``use_post_norm`` (Peri-LN), an RMSNorm on each block's output before it joins the residual stream
  (``post_norm1`` after attention, ``post_norm2`` after the MLP);
* the logits *multiplied* by ``logits_scaling`` (Granite divides by it).
"""

from __future__ import annotations

import re

from specray.models.glm4 import Glm4DecoderLayer
from specray.models.llama import _CHECKPOINT_NAMES, LlamaForCausalLM, LlamaModel
from specray.parallel import TPGroup


# its norms on the blocks' outputs, GLM-4's names for them
_CHECKPOINT_NAMES["hyperclovax"] = ((re.compile(r"\.post_norm1\."), ".post_self_attn_layernorm."),
                                   (re.compile(r"\.post_norm2\."), ".post_mlp_layernorm."))


class HyperCLOVAXDecoderLayer(Glm4DecoderLayer):
    """GLM-4's sandwich of norms (:class:`~specray.models.glm4.Glm4DecoderLayer`), the norms on the blocks' outputs
    only with ``use_post_norm``, and Granite's residual multiplier."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__(config, tp, layer, expert_parallel)
        if not config.use_post_norm:
            self.post_self_attn_layernorm = self.post_mlp_layernorm = None


class HyperCLOVAXModel(LlamaModel):
    layer_class = HyperCLOVAXDecoderLayer


class HyperCLOVAXForCausalLM(LlamaForCausalLM):
    """HyperCLOVA X SEED for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = HyperCLOVAXModel

    def __init__(self, hf_config, *args, **kwargs):
        super().__init__(hf_config, *args, **kwargs)
        self.logits_scaling = 1.0 / float(getattr(hf_config, "logits_scaling", 1.0))  # the stack divides by it
