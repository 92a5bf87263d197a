"""DeepSeek-V4's multi-token-prediction layer as a draft head (``speculative_config={"method": "mtp"}``).

The release keeps one MTP module under ``mtp.0.`` (``num_nextn_predict_layers``: V4-Flash's and V4-Pro's), a full
V4 block that works on the ``hc_mult`` residual streams rather than on one hidden state as DeepSeek-V3's does. At
position p it reads the streams the target's last layer left there, ``S[p]`` ([n, H], before the target's
``hc_head`` collapses them), and the next token's embedding ``e = embed(t[p+1])``:

    x = h_proj(hnorm(S[p])) + e_proj(enorm(e))       (the embedding's projection added to every stream)
    S' = block(x)                                    (hyper-connections, attention, experts: a V4 layer)
    logits = lm_head(norm(hc_head'(S')))             (its own hc_head collapse and norm; the target's LM head)

and ``S'`` is what the next draft step reads in place of the target's streams (the module reused for every draft
step, as vLLM and SGLang run it). The embedding and the LM head are the target's. The release's FP8 / FP4 weights
come dequantized, as the target's do (:mod:`specray.models.fp8`).

Its block's attention is the kind of layer the release's config gives it (``compress_ratios`` lists one more entry
than there are layers; V4-Flash's is 0: a sliding-window layer): read here from which tensors the module has (a
compressor, an indexer), so no config field that transformers drops is needed. It caches its rows in a paged cache
of its own on the target's block tables, as every head here. The target hands the head its streams as the residual
past its last layer (aux layer ``num_hidden_layers``, [T, n * H]).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from typing import Any

import torch

from specray.models.attention import AttentionMetadata
from specray.models.deepseek_v4 import (CSA, HCA, SLIDING, DeepseekV4DecoderLayer, DeepseekV4ForCausalLM, HyperHead,
                                        release_to_ours, rope_tables, step_rope)
from specray.models.draft_head import LAYOUTS, ReadsTarget
from specray.models.kv_cache import KVCache, KVCacheSpec
from specray.models.layers import ColumnParallelLinear, RMSNorm
from specray.models.llama import _map_name, expected_keys, load_param
from specray.models.loader import _default_dtype, checkpoint_weights, resolve_model
from specray.models.moe import EXPERT_PARAMS, is_expert_tensor
from specray.parallel import TPGroup

# a module's tensors in the release (mtp.{k}.*); transformers-style folders may put them under model.mtp.{k}.*
_MODULE = re.compile(r"^(?:model\.)?mtp\.(\d+)\.")
_SHARED = re.compile(r"^(emb|embed|embed_tokens|head|shared_head\.head)\.")  # the target's embedding and LM head
_OWN = {"e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight"}
_HC_HEAD = re.compile(r"^hc_head[._](?:hc_)?(fn|base|scale)$")


class DeepseekV4MTP(ReadsTarget):
    """DeepSeek-V4's MTP module over ``target`` (see the module docstring), split over ``tp`` as a target layer is
    (query heads and output groups; the fusion's projections, norms and hyper-connections replicated). ``kind``: its
    attention's (sliding, CSA or HCA); ``hash_routed``: its experts routed by token id (a release whose module
    has ``ffn.gate.tid2eid``)."""

    layout = LAYOUTS["mtp"]
    lm_head = None  # the target's
    graph_trees = False  # as the target's (a tree's windows found on the host): a tree's passes run eagerly

    def __init__(self, config, target, tp: TPGroup | None = None, expert_parallel: bool = False,
                 kind: str = SLIDING, hash_routed: bool = False):
        super().__init__()
        self._target = (target,)
        layers = config.num_hidden_layers
        self.config = config = copy.copy(config)
        config.layer_types = [*config.layer_types[:layers], kind]  # the block is layer L of the stack
        config.mlp_layer_types = [*config.mlp_layer_types[:layers], "hash_moe" if hash_routed else "moe"]
        self.tp = tp = tp or TPGroup.single()
        self.aux_layers = (layers,)  # the streams past the target's last layer
        self.hc_mult, self.hidden_size = config.hc_mult, config.hidden_size
        h, eps, one = config.hidden_size, config.rms_norm_eps, TPGroup.single()
        self.enorm, self.hnorm, self.norm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        self.e_proj, self.h_proj = ColumnParallelLinear(h, h, one), ColumnParallelLinear(h, h, one)
        self.block = DeepseekV4DecoderLayer(config, tp, layers, expert_parallel)
        self.hc_head = HyperHead(config)
        self.rotary = rope_tables(config)
        self.target_vocab_size = self.draft_vocab_size = target.vocab_size
        self.kv_cache_bound = False

    # ------------------------------------------------------------------------------------------ the head's protocol

    def target_features(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """The target's streams past its last layer, [T, n * H] (its aux row of layer ``num_hidden_layers``)."""
        return aux[0]

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] (the token after each position), features [T, n * H] (the target's streams, or this
        module's own from the step before) -> (its streams [T, n * H] for the next draft step, the normed hidden
        [T, H] its logits come from)."""
        if not self.kv_cache_bound:
            raise ValueError("the MTP module's KV cache is not allocated: allocate_kv_cache(head, ...) first")
        t, n, h = input_ids.shape[0], self.hc_mult, self.hidden_size
        e = self.e_proj(self.enorm(meta.with_input_embeds(self.target.embed(input_ids).to(features.dtype))))
        streams = self.h_proj(self.hnorm(features.reshape(t * n, h))).view(t, n, h) + e[:, None]
        streams = self.block(streams, input_ids, step_rope(self.rotary, meta, streams.dtype), meta)
        return streams.flatten(1), self.norm(self.hc_head(streams))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32, from the target's LM head."""
        return self.target.compute_logits(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # no draft vocabulary of its own

    def full_vocab(self, values: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        return values

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [self.block.self_attn.kv_spec]

    def bind_kv_cache(self, cache: KVCache) -> None:
        assert cache.specs == self.kv_cache_specs(), "the cache was allocated for another model's specs"
        self.block.self_attn.bind_cache(cache.layer(0), cache.block_size, cache.fp8)
        self.kv_cache_bound = True

    # ------------------------------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The module's tensors named within it (``e_proj.weight``, ``hc_head_fn``, ``attn.wq_a.weight``,
        ``ffn.experts.3.w1.weight``, ... as the release names them, or as transformers' modules would); the
        shared embedding and head are skipped."""
        params = dict(self.named_parameters())
        stacked = DeepseekV4ForCausalLM.stacked  # (the target may be a WholeTarget: the driver's whole head)
        loaded: set[str] = set()
        for name, tensor in weights:
            if _SHARED.match(name):
                continue
            if name.endswith(".scale") or name.endswith("_scale_inv"):  # (the release's come dequantized)
                raise ValueError(f"the MTP tensor {name!r} is a quantized weight's scale, but the checkpoint's "
                                 "config.json has no quantization_config saying how to read it (DeepSeek-V4's "
                                 "release: quant_method 'fp8', scale_fmt 'ue8m0', expert_dtype 'fp4')")
            head = _HC_HEAD.match(name)
            if head is not None:
                name = f"hc_head.hc_{head.group(1)}"
            elif name not in _OWN:
                name = "block." + release_to_ours("layers.0." + name).removeprefix("model.layers.0.")
            if is_expert_tensor("." + name):
                loaded.update("block.mlp." + key for key in self.block.mlp.load_expert_tensor("." + name, tensor))
                continue
            target, shard = _map_name(name, stacked)
            param = params.get(target)
            if param is None:
                raise ValueError(f"the MTP checkpoint tensor {name!r} has no place in DeepSeek-V4's MTP module")
            loaded.add(load_param(param, target, tensor, shard))
        expected = expected_keys(n for n in params if not n.endswith(EXPERT_PARAMS))
        expected.update("block.mlp." + key for key in self.block.mlp.expected_keys())
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"DeepSeek-V4's MTP module is missing {len(missing)} weights, e.g. {missing[:5]}")


def load_mtp_head(path, target, target_config, num_modules: int = 1, tp: TPGroup | None = None,
                  expert_parallel: bool = False) -> DeepseekV4MTP:
    """The MTP module ``mtp.0.*`` of the checkpoint at ``path`` (usually the target's own) for ``target``, this
    rank's share of it with ``tp``, on the target's device and dtype, in eval mode."""
    source = resolve_model(path)
    if num_modules != 1:
        raise ValueError(f"speculative_config.num_nextn_predict_layers={num_modules}: DeepSeek-V4 releases keep one "
                         "MTP module (mtp.0), which specray reuses for every draft step; leave "
                         "num_nextn_predict_layers unset (or 1)")
    weights = [(m.string[m.end():], tensor) for name, tensor in
               checkpoint_weights(source, wanted=lambda name: _MODULE.match(name) is not None)
               if (m := _MODULE.match(name)) is not None and m.group(1) == "0"]
    if not weights:
        raise ValueError(f"the checkpoint {str(source.path)!r} has no MTP module (mtp.0.*): method='mtp' needs a "
                         "DeepSeek-V4 release with its multi-token-prediction weights; use another speculative "
                         "method for this model")
    names = {name for name, _ in weights}
    compressed = any(n.startswith("attn.compressor.") or ".compressor." in n for n in names)
    kind = (CSA if any(n.startswith("attn.indexer.") for n in names) else HCA) if compressed else SLIDING
    with _default_dtype(target.dtype), torch.device(target.device):
        head = DeepseekV4MTP(target_config, target, tp, expert_parallel, kind=kind,
                             hash_routed="ffn.gate.tid2eid" in names)
    head.load_weights(weights)
    head.eval()
    for p in head.parameters():
        p.requires_grad_(False)
    return head
