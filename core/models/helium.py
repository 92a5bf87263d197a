"""Kyutai's Helium (``HeliumForCausalLM``: Helium-1 2B), Llama's layers (:mod:`specray.models.llama`) with RoPE on
interleaved pairs of features; q/k/v biased where ``attention_bias``, the output projection never."""

from __future__ import annotations

from specray.models.classic import llama_view
from specray.models.llama import LlamaForCausalLM
from specray.parallel import PPGroup, TPGroup


class HeliumForCausalLM(LlamaForCausalLM):
    """Helium for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(llama_view(hf_config, attention_out_bias=False), tp, expert_parallel, pp)
