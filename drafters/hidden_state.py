"""Options of the drafters that read the target's hidden states (``eagle``, ``eagle3``, ``mtp``), and the plain data
the target's workers build them from. The drafting itself runs inside the target's driver rank:
:mod:`specray.workers.head_drafter` (the step), :mod:`specray.models.draft_head` (the head),
:mod:`specray.models.draft_head_loader` (checkpoints); ``docs/hidden_state_drafters.md`` explains it all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class HeadOptions:
    """The keys every hidden-state drafter has."""

    # a lookup drafter run beside the head in the engine (a method a request could pick for itself: "ngram",
    # "suffix", ...; or a speculative_config dict of one, {"method": "suffix", "num_speculative_tokens": 12}):
    # each step, each request verifies whichever of the two proposals the draft policy prices higher
    combine_with: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        given = self.combine_with
        if given is not None and not isinstance(given, str) and not (isinstance(given, dict) and "method" in given):
            raise ValueError(f"speculative_config.combine_with={given!r} must be a method name such as 'ngram' or "
                             "'suffix', or a speculative_config dict of one with its 'method'")

    def lookup_config(self, num_speculative_tokens: int) -> dict[str, Any] | None:
        """``combine_with`` as a speculative_config dict (its draft count defaults to the head's), or None."""
        given = self.combine_with
        if given is None:
            return None
        config = {"method": given} if isinstance(given, str) else dict(given)
        config.setdefault("num_speculative_tokens", num_speculative_tokens)
        return config


@dataclass
class EagleOptions(HeadOptions):
    """``speculative_config`` keys of ``method="eagle"`` and ``"eagle3"`` (TensorRT-LLM's names for the tree)."""

    model: str | None = None  # the head's checkpoint folder or hub id (eagle3 on the default model: the bundled one)
    # EAGLE-2: draft a dynamic token tree of num_speculative_tokens nodes instead of a chain
    use_dynamic_tree: bool = False
    dynamic_tree_max_topK: int = 4  # children offered per expanded node, and nodes expanded per level
    dynamic_tree_depth: int = 4  # levels of the tree

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r} must be a path or hub id")
        if not isinstance(self.use_dynamic_tree, bool):
            raise ValueError(f"speculative_config.use_dynamic_tree={self.use_dynamic_tree!r} must be a bool")
        for name in ("dynamic_tree_max_topK", "dynamic_tree_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name}={value!r} must be an int >= 1")

    def tree_lookahead_slots(self) -> int:
        """Slots past the root a dynamic tree's growth writes (every level's nodes but the deepest); 0: chains."""
        return self.dynamic_tree_max_topK * (self.dynamic_tree_depth - 1) if self.use_dynamic_tree else 0


@dataclass
class MTPOptions(HeadOptions):
    """``speculative_config`` keys of ``method="mtp"``."""

    model: str | None = None  # a checkpoint holding the MTP layers; None: the target's own
    # feed the next draft step the head's normed output, as transformers' MtpModel does (vLLM and SGLang feed the
    # block's output before the norm, the default)
    mtp_feedback_normed: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r} must be a path or hub id")
        if not isinstance(self.mtp_feedback_normed, bool):
            raise ValueError(f"speculative_config.mtp_feedback_normed={self.mtp_feedback_normed!r} must be a bool")


def worker_config(method: str, options: Any, target_model: str) -> dict[str, Any]:
    """What the target's workers need to build ``method``'s head and drafter (plain data: it crosses Ray): the
    head's checkpoint (EAGLE-3 on the default model: the bundled head; MTP: the target's own checkpoint unless
    ``model`` names one), MTP's feedback, and an EAGLE-2 tree's shape."""
    path = options.model
    if method == "eagle3" and path is None:
        from specray.models.bundled_heads import bundled_head  # torch-free

        path = bundled_head(target_model, method)
    if method == "mtp" and path is None:
        path = target_model
    tree = getattr(options, "use_dynamic_tree", False)
    return {"method": method, "model": path, "mtp_feedback_normed": bool(getattr(options, "mtp_feedback_normed", False)),
            "tree": [options.dynamic_tree_max_topK, options.dynamic_tree_depth] if tree else None}
