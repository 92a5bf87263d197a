"""Salesforce's CodeGen (``CodeGenForCausalLM``: codegen-350M / 2B / 6B / 16B, mono, multi and nl), on GPT-J's layers
(:mod:`specray.models.gptj`: one LayerNorm before parallel attention and MLP, RoPE on the interleaved pairs of each
head's first ``rotary_dim`` features, unbiased attention, a gateless GELU MLP with biases, an LM head with a bias;
GPT-J's names). Where it differs from GPT-J:

* q, k and v fused in one projection (``qkv_proj``) in the layout of the model-parallel code it was trained with: its
  rows are ``mp_num`` = 4 blocks, each holding a quarter of the heads' queries, then their values, then their keys
  (``[4, (q, v, k), hidden / 4]``); split at load into the three projections (an adapter's B too);
* the releases' config fields are GPT-J's (``n_embd``, ``n_head``, ``rotary_dim``, ``n_inner``), so the config view is
  GPT-J's. Releases also store each layer's causal mask as a tensor (not read).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from specray.models.classic import ACTIVATIONS, FusedQKVAdapters
from specray.models.gptj import GPTJForCausalLM
from specray.models.layers import materialize
from specray.parallel import PPGroup, TPGroup

MP_NUM = 4  # the model-parallel blocks of qkv_proj's rows (transformers' CodeGenAttention.mp_num)
ORDER = "qvk"  # each block's parts, in turn
_BUFFERS = re.compile(r"\.attn\.(?:causal_mask|masked_bias|bias)$")  # each layer's causal mask and its fill value


def split_mp_qkv(name: str, tensor: Any, hidden: int) -> list[tuple[str, torch.Tensor]]:
    """CodeGen's fused q/k/v weight (or an adapter's B) ``name`` [3 hidden, ...] as the three projections' tensors
    [hidden, ...], named with ``.qkv_proj.`` replaced by ``.q_proj.``, ``.k_proj.`` and ``.v_proj.``: its rows are
    :data:`MP_NUM` blocks, each of a quarter of the queries, values and keys (:data:`ORDER`)."""
    value = materialize(tensor)
    if value.shape[0] != 3 * hidden:
        raise ValueError(f"checkpoint tensor {name} has {value.shape[0]} rows, not 3 * n_embd = {3 * hidden}: the "
                         f"checkpoint does not match its config.json")
    blocks = value.reshape(MP_NUM, len(ORDER), hidden // MP_NUM, *value.shape[1:])
    return [(name.replace(".qkv_proj.", f".{p}_proj."), blocks[:, ORDER.index(p)].reshape(hidden, *value.shape[1:]))
            for p in "qkv"]


def _check(config) -> None:
    """A ValueError naming a setting of ``config`` that CodeGen's layers as transformers builds them do not serve."""
    hidden, heads, rotary = config.hidden_size, config.num_attention_heads, config.rotary_dim
    if hidden % MP_NUM:
        raise ValueError(f"n_embd={hidden}: CodeGen's fused qkv_proj holds {MP_NUM} blocks of n_embd / {MP_NUM} rows "
                         f"each, so n_embd must be a multiple of {MP_NUM}")
    if hidden % heads:
        raise ValueError(f"n_embd={hidden} is not a multiple of n_head={heads}")
    if rotary is None:
        raise ValueError("rotary_dim=None is not supported for model_type='codegen' (transformers' CodeGen then "
                         "rotates n_embd features of each head, which fit no head); set rotary_dim, at most the head "
                         f"size {hidden // heads} (the releases: 32 or 64)")
    if not (isinstance(rotary, int) and 0 < rotary <= hidden // heads and rotary % 2 == 0):
        raise ValueError(f"rotary_dim={rotary!r}: an even number of each head's features, at most the head size "
                         f"{hidden // heads}")
    if config.activation_function not in ACTIVATIONS:
        raise ValueError(f"activation_function={config.activation_function!r} is not supported for "
                         f"model_type='codegen'; one of {sorted(ACTIVATIONS)}")


class CodeGenForCausalLM(FusedQKVAdapters, GPTJForCausalLM):
    """CodeGen for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is; LoRA on q/k/v (an adapter's
    ``qkv_proj`` split as the weight is, :class:`~specray.models.classic.FusedQKVAdapters`' fusion shapes),
    ``out_proj`` and the MLP."""

    fused_qkv = ".qkv_proj."

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        _check(hf_config)
        super().__init__(hf_config, tp, expert_parallel, pp)

    def split_adapter(self, module: str, lora_b: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        if not f"{module}.".endswith(self.fused_qkv):
            return None
        return split_mp_qkv(f"{module}.", lora_b, self.config.hidden_size)

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            if _BUFFERS.search(name):
                continue
            if self.fused_qkv in name:  # (only the attention's projection has the name)
                yield from split_mp_qkv(name, tensor, self.config.hidden_size)
            else:
                yield name, tensor
