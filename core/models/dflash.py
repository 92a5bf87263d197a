"""DFlash (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding"; z-lab's ``DFlashDraftModel``
checkpoints, vLLM's and SGLang's ``method="dflash"``): a small stack of decoder layers that drafts a whole block of
tokens in one forward, conditioned on features of the target's hidden states, with the target's embedding and LM
head.

After the target has committed ``t[0..N-1]`` and sampled ``t[N]`` (the anchor, at position N), with m drafts wanted:

* **Context.** Each committed position p gets one feature from the target's residual stream after the layers
  ``target_layer_ids`` (``h_j(p)``, the stream entering layer j + 1: :attr:`DFlashHead.aux_layers`):
  ``c_p = hidden_norm(fc(cat_j h_j(p)))``. Every draft layer l caches ``K_l(p) = rope_p(k_norm(k_proj_l(c_p)))`` and
  ``V_l(p) = v_proj_l(c_p)``: the same ``c_p`` in every layer (not the layer below's output) and no input norm, so a
  position's K/V is written once, when its feature arrives, and never depends on the drafts.
* **Block.** ``x = [e(t[N]), e(mask), ..., e(mask)]`` (m masks, ``mask_token_id``) at positions N..N+m. Each layer:
  ``x += attn(input_layernorm(x))`` with queries from the block over the keys of every position up to N + m (the
  cached context and the block's own K/V, written at N..N+m), every block row seeing every other (no causal order
  inside the block; a "sliding_attention" layer, or ``is_causal``, keeps it causal, as the reference runs those), then
  ``x += mlp(post_attention_layernorm(x))``.
* **Drafts.** ``d_i = argmax lm_head(norm(x_i))`` at block rows i = 1..m: draft i is the token at position N + i.
  A sampled request draws each d_i from q_i, its warpers over those logits; the positions' q are independent of one
  another, and verification by rejection sampling against each draft's own q keeps the target's distribution.

The context rows and the block run as one sequence per request through each layer's ordinary attention (the context
rows' own outputs are discarded): a request's rows are its new context positions, then its block, at consecutive
positions and slots, with an ancestor mask that lets block rows see all of them (:func:`block_ancestors`). A block's
K/V at N..N+m is overwritten by the context K/V of those positions when their features arrive, before anything reads
them again.

The embedding and LM head are the target's, read through its interface (its ``embed`` and ``compute_logits``, so a
family that scales its embedding or its logits applies that here too, where the reference reads the raw rows: equal
for the Llama and Qwen families the public checkpoints are for). Refused with a clear error: DFlash-2's extensions
(``conv_kernel_size``, ``selector_rank``: grouped convolutions and a candidate selector), a ``target_layer_ids``
entry naming the target's last layer (its output is the final hidden state before the norm, which no target hands
on), and a window narrower than the block in a layer that attends the block both ways.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.draft_head import ReadsTarget, check_split
from specray.models.kv_cache import KVCache, KVCacheSpec
from specray.models.layers import ColumnParallelLinear, RMSNorm, RotaryEmbedding, rope_parameters, rotary_dim
from specray.models.llama import _STACKED, LlamaAttention, LlamaMLP, _head_dim, _map_name, expected_keys, load_param
from specray.models.plain_config import PlainConfig
from specray.parallel import TPGroup

logger = logging.getLogger(__name__)

# DFlash-2's parts (grouped dynamic convolutions around attention and MLP, a candidate selector over the logits)
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def dflash_value(config, name: str, default: Any = None) -> Any:
    """A DFlash setting: from the config's ``dflash_config`` dict, else its top level (releases put ``block_size``
    in either)."""
    nested = getattr(config, "dflash_config", None) or {}
    if name in nested:
        return nested[name]
    return getattr(config, name, default)


def dflash_settings(config) -> tuple[int, int, tuple[int, ...]]:
    """(block_size, mask_token_id, target_layer_ids) of a DFlash checkpoint's config; a ValueError naming what is
    missing or not supported."""
    layers = dflash_value(config, "target_layer_ids")
    if not isinstance(layers, (list, tuple)) or not layers or not all(
            isinstance(j, int) and not isinstance(j, bool) and j >= 0 for j in layers):
        raise ValueError(f"the DFlash checkpoint's target_layer_ids={layers!r} must be a non-empty list of target "
                         "layer indices (in its config's dflash_config)")
    mask = dflash_value(config, "mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
        raise ValueError(f"the DFlash checkpoint's mask_token_id={mask!r} must be a token id (in its config's "
                         "dflash_config)")
    block = dflash_value(config, "block_size", 16)
    if not isinstance(block, int) or isinstance(block, bool) or block < 2:
        raise ValueError(f"the DFlash checkpoint's block_size={block!r} must be an int >= 2 (the anchor and at least "
                         "one draft)")
    extras = [k for k in _DFLASH2_KEYS if dflash_value(config, k) is not None]
    if extras:
        raise ValueError(f"the DFlash checkpoint sets {extras}: DFlash-2's convolutions and candidate selector are not "
                         "supported; use a DFlash (v1) checkpoint")
    return block, mask, tuple(layers)


def dflash_aux_layers(config, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input residual stream the head reads: one past each of ``target_layer_ids`` (the
    output of layer j is the stream entering layer j + 1)."""
    _, _, layers = dflash_settings(config)
    if max(layers) >= num_target_layers - 1:
        raise ValueError(f"the DFlash checkpoint's target_layer_ids={list(layers)} name layer {max(layers)} of a "
                         f"target with {num_target_layers} layers: only the outputs of layers "
                         f"0..{num_target_layers - 2} (the streams entering the next layer) are read; this checkpoint "
                         "was made for a deeper target")
    return tuple(j + 1 for j in layers)


def _layer_config(config) -> PlainConfig:
    """The draft layers' config as our Llama layers read it: Qwen3's attention (per-head q and k RMSNorms), whatever
    the checkpoint's model_type, as the reference builds every layer."""
    values = dict(vars(config))
    values["model_type"] = "qwen3"
    return PlainConfig(**values)


class DFlashLayer(nn.Module):
    """One draft layer: Qwen3's attention and a gated SiLU MLP, pre-norm."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = LlamaAttention(config, tp, layer)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = LlamaMLP(config, tp)


class DFlashHead(ReadsTarget):
    """A DFlash draft model over ``target`` (see the module docstring). ``config``: the checkpoint's (a Qwen3-style
    config with ``dflash_config``). Split over ``tp`` as a target's layers are (heads by column, o/down by row);
    ``fc`` and the norms whole on every rank. Build it under the target's device and dtype."""

    def __init__(self, config, target, num_target_layers: int, tp: TPGroup | None = None,
                 target_hidden_size: int | None = None):
        super().__init__()
        self.block_size, self.mask_token_id, self.target_layer_ids = dflash_settings(config)
        if self.mask_token_id >= target.vocab_size:
            raise ValueError(f"the DFlash checkpoint's mask_token_id={self.mask_token_id} is past the target's "
                             f"vocabulary of {target.vocab_size}: it was made for another target")
        self.aux_layers = dflash_aux_layers(config, num_target_layers)
        self.config = layer_config = _layer_config(config)
        self._target = (target,)  # a tuple: not a submodule, so its weights are never ours
        self.tp = tp = tp or TPGroup.single()
        check_split("dflash", config.num_attention_heads, getattr(config, "num_key_value_heads", None), tp.size)
        h = config.hidden_size
        self.hidden_size = h
        self.layers = nn.ModuleList([DFlashLayer(layer_config, tp, i) for i in range(config.num_hidden_layers)])
        whole = TPGroup.single()
        self.fc = ColumnParallelLinear(len(self.target_layer_ids) * (target_hidden_size or h), h, whole)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        rope = rope_parameters(layer_config, partial=True)
        self.rotary_emb = RotaryEmbedding(rotary_dim(_head_dim(layer_config), rope), rope,
                                          config.max_position_embeddings)
        # which layers keep the block causal: "sliding_attention" ones unless the config's is_causal says otherwise
        kinds = getattr(config, "layer_types", None) or ["full_attention"] * len(self.layers)
        forced = getattr(config, "is_causal", None)
        self.causal = [kind == "sliding_attention" if forced is None else bool(forced) for kind in kinds]
        for layer, causal in zip(self.layers, self.causal):
            attn = layer.self_attn.attn
            window = getattr(attn.kv_spec, "sliding_window", None)
            if not causal and window is not None and window < self.block_size:  # its window would cut the block
                raise ValueError(f"the DFlash checkpoint's sliding_window={window} is narrower than its block of "
                                 f"{self.block_size} in a layer that attends the block both ways: not supported")
            if causal:  # the pass's ancestor masks (the block both ways) narrowed to causal order
                attn.mask_kind = dataclasses.replace(attn.mask_kind, causal_keys=True)
        self.kv_cache_bound = False

    def context(self, aux: Sequence[torch.Tensor]) -> torch.Tensor:
        """The target's residual streams at :attr:`aux_layers`, each [T, H_target] -> the context features [T, H]."""
        return self.hidden_norm(self.fc(torch.cat(list(aux), dim=-1)))

    def forward(self, context: torch.Tensor, block_ids: torch.Tensor, context_rows: torch.Tensor,
                block_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One pass over every request's rows: ``context`` [Tc, H] (features of new committed positions) at rows
        ``context_rows``, the block's tokens ``block_ids`` [Tb] (anchor, then masks) at rows ``block_rows`` of the
        pass's ``meta.num_tokens``; ``meta``'s ancestor masks let block rows see their whole block (the layers that
        keep it causal narrow them to causal order: their mask kind's ``causal_keys``). Writes every row's K/V.
        Returns the block rows' normed hidden states [Tb, H]."""
        if not self.kv_cache_bound:
            raise ValueError("the DFlash head's KV cache is not allocated: allocate_kv_cache(head, ...) first")
        x = self.target.embed(block_ids).to(context.dtype)  # [Tb, H]: the block's residual stream
        self.rotary_emb.ensure(meta.max_position + 1)
        cos, sin = self.rotary_emb(meta.positions, x.dtype)
        rows = context.new_empty(meta.num_tokens, self.hidden_size).index_copy_(0, context_rows, context)
        for layer in self.layers:
            rows.index_copy_(0, block_rows, layer.input_layernorm(x))  # context rows: c as it is, no norm
            a = layer.self_attn(rows, cos, sin, meta).index_select(0, block_rows)
            x = x + a
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def forward_rows(self, rows: torch.Tensor, ids: torch.Tensor, block: torch.Tensor, meta: AttentionMetadata
                     ) -> torch.Tensor:
        """:meth:`forward` in fixed shapes (a pass replayed from a graph): every row runs the layers, ``rows`` [T, H]
        the context features (zeros elsewhere), ``ids`` [T] the block's tokens (any id elsewhere), ``block`` [T, 1]
        bool the block's rows. A row reads its feature or, in the block, its normed stream, so every K/V is
        :meth:`forward`'s; the other rows' outputs are dropped. Returns every row's normed hidden state [T, H]."""
        x = self.target.embed(ids).to(rows.dtype)
        self.rotary_emb.ensure(meta.max_position + 1)
        cos, sin = self.rotary_emb(meta.positions, x.dtype)
        for layer in self.layers:
            x = x + layer.self_attn(torch.where(block, layer.input_layernorm(x), rows), cos, sin, meta)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32, through the target's LM head."""
        return self.target.compute_logits(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the target's own vocabulary

    def full_vocab(self, values: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        return values

    # ------------------------------------------------------------------------------------------ KV cache

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [layer.self_attn.attn.kv_spec for layer in self.layers]

    def bind_kv_cache(self, cache: KVCache) -> None:
        assert cache.specs == self.kv_cache_specs(), "the cache was allocated for another model's specs"
        for i, layer in enumerate(self.layers):
            layer.self_attn.attn.bind_cache(cache.layer(i), cache.block_size, cache.fp8)
        self.kv_cache_bound = True

    # ------------------------------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The checkpoint's tensors (``layers.{i}.self_attn.q_proj.weight``, ``fc.weight``, ``hidden_norm.weight``,
        ``norm.weight``; a ``model.`` prefix is dropped); the target's embedding and LM head, if a checkpoint
        carries copies, are not loaded (the target's are read)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith(("embed_tokens.", "lm_head.")) or "rotary_emb" in name:
                continue
            target, shard = _map_name(name, _STACKED)
            param = params.get(target)
            if param is None:
                raise ValueError(f"DFlash checkpoint tensor {name!r} has no place in the DFlash model")
            loaded.add(load_param(param, target, tensor, shard))
        missing = sorted(expected_keys(params) - loaded)
        if missing:
            raise ValueError(f"the DFlash checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")


def block_ancestors(num_context: int, block: int, device: torch.device) -> torch.Tensor:
    """[q, q] bool over one request's rows (``num_context`` context rows, then its block of ``block``): context rows
    causal among themselves (their outputs are discarded; only their K/V matters), block rows see every row. A decode
    step's (a few context rows) is made once per shape and device, as those recur every step; read only."""
    if num_context <= 64:
        return _decode_ancestors(num_context, block, device)
    return _ancestors(num_context, block, device)


@functools.lru_cache(maxsize=256)
def _decode_ancestors(num_context: int, block: int, device: torch.device) -> torch.Tensor:
    return _ancestors(num_context, block, device)


def _ancestors(num_context: int, block: int, device: torch.device) -> torch.Tensor:
    q = num_context + block
    allowed = torch.ones(q, q, dtype=torch.bool, device=device).tril_()
    allowed[num_context:] = True
    return allowed


def load_dflash(path, target, target_config, tp: TPGroup | None = None, head_config=None) -> DFlashHead:
    """The DFlash model in ``path`` (a folder or hub id) over ``target``, on its device and dtype, in eval mode; with
    ``tp`` (the target's group, every rank calling this) each rank keeps its share."""
    from specray.models.draft_head_loader import _head_source
    from specray.models.loader import _default_dtype

    config, weights = _head_source(path, head_config)
    target_hidden = getattr(config, "target_hidden_size", None) or target_config.hidden_size
    with _default_dtype(target.dtype), torch.device(target.device):
        head = DFlashHead(config, target, target_config.num_hidden_layers, tp=tp, target_hidden_size=target_hidden)
    head.load_weights(weights)
    head.eval()
    for p in head.parameters():
        p.requires_grad_(False)
    return head
