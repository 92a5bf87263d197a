"""What the runner, the drafters and the tests may ask of a model: the one seam between them and a model class.

Callers use these members only, never a model's submodules (``model.model.layers[...]``), so a new family
(MLA, MoE, chunked-local attention) or a draft head plugs in by implementing this protocol and registering its
class in :mod:`specray.models.registry`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from specray.models.attention import AttentionMetadata
from specray.models.kv_cache import KVCache, KVCacheSpec


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model sharded over a tensor-parallel group, attending over a paged KV cache that its
    caller owns."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> token embeddings [T, H] (full hidden size on every rank)."""
        ...

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = ()) -> Any:
        """input_ids [T], ``meta`` (positions, slots, masks) -> the final hidden states [T, H]; with
        ``aux_layers``, ``(hidden, [residual stream entering each of those layers, [T, H]])`` (what transformers'
        ``output_hidden_states[i]`` holds; EAGLE-3 reads three of them). A model built for a pipeline stage before
        the last (``pp``) hands its output to the next stage and returns None."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32, full vocabulary on every rank."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """HF-named checkpoint tensors; each rank keeps its shard."""
        ...

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per attention layer, in layer order: what it caches on this rank."""
        ...

    def bind_kv_cache(self, cache: KVCache) -> None:
        """Attend over ``cache``, allocated by its owner for :meth:`kv_cache_specs`."""
        ...
