"""Options of the drafters that read the target's hidden states (``eagle``, ``eagle3``, ``mtp``, ``medusa``,
``redrafter``), and the plain data the target's workers build them from. The drafting itself runs inside the target's
driver rank: :mod:`specray.workers.head_drafter` (the step; Medusa's in :mod:`specray.workers.medusa_drafter`,
ReDrafter's in :mod:`specray.workers.redrafter_drafter`),
:mod:`specray.models.draft_head` (the head), :mod:`specray.models.draft_head_loader` (checkpoints);
``docs/hidden_state_drafters.md`` explains it all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class HeadOptions:
    """The keys every hidden-state drafter has."""

    # a lookup drafter run beside the head in the engine (a method a request could pick for itself: "ngram",
    # "suffix", ...; or a speculative_config dict of one, {"method": "suffix", "num_speculative_tokens": 12}):
    # each step, each request verifies whichever of the two proposals the draft policy prices higher
    combine_with: str | dict[str, Any] | None = None
    # the ranks the head is split over (vLLM's name): the target's tensor_parallel_size (None: that), each rank
    # holding its share as of a target layer; or 1, the head whole on the driver rank
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        given = self.combine_with
        if given is not None and not isinstance(given, str) and not (isinstance(given, dict) and "method" in given):
            raise ValueError(f"speculative_config.combine_with={given!r} must be a method name such as 'ngram' or "
                             "'suffix', or a speculative_config dict of one with its 'method'")
        tp = self.draft_tensor_parallel_size
        if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={tp!r} must be an int >= 1")

    def splits_over(self, tensor_parallel_size: int) -> bool:
        """Whether the head is split over the target's ``tensor_parallel_size`` ranks (else whole on the driver
        rank); a ValueError for a draft_tensor_parallel_size that is neither 1 nor the target's."""
        tp = self.draft_tensor_parallel_size
        allowed = sorted({1, tensor_parallel_size})
        if tp is not None and tp not in allowed:
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={tp}: the head runs with the target's "
                             f"ranks, so it is {' or '.join(map(str, allowed))} here (the target's "
                             f"tensor_parallel_size={tensor_parallel_size})")
        return tensor_parallel_size > 1 and tp != 1

    def drafts_trees(self) -> bool:
        """Whether the worker drafts token trees (each is priced and cut by the policy) rather than chains."""
        return False

    def writes_kv(self) -> bool:
        """Whether drafting writes the head's K/V past the verified drafts (slots the scheduler reserves)."""
        return True

    def drafts_blocks(self) -> bool:
        """Whether drafting writes a block of K/V from the sampled token's position on (DFlash: m + 1 slots for m
        drafts) rather than a chain's draft steps (m - 1)."""
        return False

    def check_draft_count(self, num_speculative_tokens: int) -> None:
        """A ValueError when the method cannot draft ``num_speculative_tokens`` per step (none here)."""

    def checkpoint(self, method: str, target_model: str) -> str | None:
        """The head's checkpoint: ``model`` (a subclass may default it); another method's is a ValueError."""
        path = getattr(self, "model", None)
        _refuse_other_kind(path, method)
        return path

    def worker_fields(self, path: str | None, target_model: str) -> dict[str, Any]:
        """What the worker's drafter class reads beside the method, checkpoint and split (plain data; a config read
        here, so that the ranks need no transformers)."""
        return {}

    def lookup_config(self, num_speculative_tokens: int) -> dict[str, Any] | None:
        """``combine_with`` as a speculative_config dict (its draft count defaults to the head's), or None."""
        given = self.combine_with
        if given is None:
            return None
        config = {"method": given} if isinstance(given, str) else dict(given)
        config.setdefault("num_speculative_tokens", num_speculative_tokens)
        return config


@dataclass
class HeadTreeOptions(HeadOptions):
    """Token trees of the heads that draft one token per pass with one module (EAGLE-1, EAGLE-3, MTP reusing one
    module): EAGLE-2's dynamic trees (TensorRT-LLM's names) or a static tree (vLLM's ``speculative_token_tree``)."""

    # EAGLE-2: draft a dynamic token tree of num_speculative_tokens nodes instead of a chain
    use_dynamic_tree: bool = False
    # (None: 4; either given needs use_dynamic_tree)
    dynamic_tree_max_topK: int | None = None  # children offered per expanded node, and nodes expanded per level
    dynamic_tree_depth: int | None = None  # levels of the tree
    # a static tree instead (vLLM's): paths of candidate ranks, e.g. [(0,), (1,), (0, 0)] (a JSON or Python list, or
    # a string of one): node (r1, .., rd) is the rd-th best token after the path (r1, .., rd-1); grown level by level
    # (one head pass over every node so far per level), its nodes verified level by level (num_speculative_tokens:
    # the most per step, the whole tree when not given)
    speculative_token_tree: list | str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.use_dynamic_tree, bool):
            raise ValueError(f"speculative_config.use_dynamic_tree={self.use_dynamic_tree!r} must be a bool")
        for name in ("dynamic_tree_max_topK", "dynamic_tree_depth"):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, value := 4)
            elif not self.use_dynamic_tree:
                raise ValueError(f"speculative_config.{name}={value!r} shapes EAGLE-2's dynamic tree: give "
                                 "use_dynamic_tree=True too (or drop it)")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name}={value!r} must be an int >= 1")
        if self.speculative_token_tree is not None:
            from specray.tree import parse_token_tree  # torch-free

            self.speculative_token_tree = [list(path) for path in parse_token_tree(self.speculative_token_tree)]
            if self.use_dynamic_tree:
                raise ValueError("speculative_config gives both use_dynamic_tree=True and a speculative_token_tree: "
                                 "pick one (EAGLE-2's dynamic tree, or the static tree)")

    @property
    def default_draft_count(self) -> int | None:
        """``num_speculative_tokens`` when it is not given: a static tree's nodes, every one of them."""
        return None if self.speculative_token_tree is None else len(self.speculative_token_tree)

    def drafts_trees(self) -> bool:
        return self.use_dynamic_tree or self.speculative_token_tree is not None

    def tree_lookahead_slots(self) -> int:
        """Slots past the root a tree's growth writes (every node above the deepest level: the last level's pass
        reads them); 0: chains."""
        if self.speculative_token_tree is not None:
            deepest = max(len(path) for path in self.speculative_token_tree)
            return sum(len(path) < deepest for path in self.speculative_token_tree)
        return self.dynamic_tree_max_topK * (self.dynamic_tree_depth - 1) if self.use_dynamic_tree else 0

    def tree_shape(self) -> tuple[int, int] | None:
        """(nodes per level, levels) of a dynamic tree; None: chains or a static tree."""
        return (self.dynamic_tree_max_topK, self.dynamic_tree_depth) if self.use_dynamic_tree else None

    def tree_fields(self) -> dict[str, Any]:
        """The worker's tree: a dynamic tree's shape, or a static tree's paths (None: chains)."""
        tree = self.tree_shape()
        return {"tree": None if tree is None else list(tree), "static_tree": self.speculative_token_tree}


@dataclass
class EagleOptions(HeadTreeOptions):
    """``speculative_config`` keys of ``method="eagle"`` and ``"eagle3"``; TensorRT-LLM's ``eagle_choices`` is
    the static tree's other name."""

    ALIASES: ClassVar[dict[str, str]] = {"eagle_choices": "speculative_token_tree"}

    model: str | None = None  # the head's checkpoint folder or hub id (eagle3 on the default model: the bundled one)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r} must be a path or hub id")

    def checkpoint(self, method: str, target_model: str) -> str | None:
        if self.model is None and method == "eagle3":  # EAGLE-3 on the default model: the bundled head
            from specray.models.bundled_heads import bundled_head  # torch-free

            return bundled_head(target_model, method)
        _refuse_other_kind(self.model, method)
        return self.model

    def worker_fields(self, path: str | None, target_model: str) -> dict[str, Any]:
        head_config = None
        if path is not None:
            from specray.models.draft_head_loader import read_head_config

            head_config = read_head_config(path)
        return {"head_config": head_config, "mtp_feedback_normed": False, "mtp_modules": 1, **self.tree_fields()}


@dataclass
class MTPOptions(HeadTreeOptions):
    """``speculative_config`` keys of ``method="mtp"``."""

    model: str | None = None  # a checkpoint holding the MTP layers; None: the target's own
    # feed the next draft step the head's normed output, as transformers' MtpModel does (vLLM and SGLang feed the
    # block's output before the norm, the default)
    mtp_feedback_normed: bool = False
    # DeepSeek's MTP modules to draft with: None or 1 reuses module 0 for every draft (TensorRT-LLM's "MTP-Eagle");
    # K > 1 drafts the k-th token with module k - 1 of the checkpoint's (at most K drafts per step)
    num_nextn_predict_layers: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r} must be a path or hub id")
        if not isinstance(self.mtp_feedback_normed, bool):
            raise ValueError(f"speculative_config.mtp_feedback_normed={self.mtp_feedback_normed!r} must be a bool")
        n = self.num_nextn_predict_layers
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"speculative_config.num_nextn_predict_layers={n!r} must be an int >= 1 (the MTP "
                             "modules to draft with)")
        if self.drafts_trees() and self.num_modules > 1 and self._tree_depth() > self.num_modules:
            # module k drafts a tree's level k + 1 (its nodes read module k - 1's outputs along their paths)
            what = ("dynamic_tree_depth" if self.use_dynamic_tree else "the speculative_token_tree's deepest path")
            raise ValueError(f"speculative_config {what} is {self._tree_depth()} with num_nextn_predict_layers={n}: "
                             "each level of a tree of distinct MTP modules comes from its own module; give at most "
                             f"{n} levels, or num_nextn_predict_layers=1 to reuse module 0 at every level")

    @property
    def num_modules(self) -> int:
        return self.num_nextn_predict_layers or 1

    @property
    def default_draft_count(self) -> int | None:
        """``num_speculative_tokens`` when it is not given: one draft per module when there are several (a static
        tree's nodes with one)."""
        return self.num_modules if self.num_modules > 1 and not self.drafts_trees() else super().default_draft_count

    def check_draft_count(self, num_speculative_tokens: int) -> None:
        if self.num_modules > 1 and not self.drafts_trees() and num_speculative_tokens > self.num_modules:
            raise ValueError(f"speculative_config.num_speculative_tokens={num_speculative_tokens} with "
                             f"num_nextn_predict_layers={self.num_modules}: each draft comes from its own MTP module; "
                             f"give num_speculative_tokens <= {self.num_modules}, or num_nextn_predict_layers=1 to "
                             "reuse module 0 for every draft")

    def _tree_depth(self) -> int:
        if self.speculative_token_tree is not None:
            return max(len(path) for path in self.speculative_token_tree)
        return self.dynamic_tree_depth

    def writes_kv(self) -> bool:
        # distinct modules write K/V at committed positions only, but for their trees' nodes past the root's
        return self.num_modules == 1 or self.tree_lookahead_slots() > 0

    def tree_lookahead_slots(self) -> int:
        """Distinct modules: module k's level pass places the nodes of depths 1..k from k positions before the
        root's on, so it writes past the root's slot only where they outnumber k."""
        if self.num_modules == 1 or not self.drafts_trees():
            return super().tree_lookahead_slots()
        if self.speculative_token_tree is None:
            k = self.dynamic_tree_max_topK
            return (k - 1) * (self.dynamic_tree_depth - 1)
        above = [sum(len(path) <= d for path in self.speculative_token_tree) - d for d in range(1, self._tree_depth())]
        return max([0, *above])

    def checkpoint(self, method: str, target_model: str) -> str | None:
        path = target_model if self.model is None else self.model  # the target's own MTP layers by default
        _refuse_other_kind(path, method)
        return path

    def worker_fields(self, path: str | None, target_model: str) -> dict[str, Any]:
        return {"head_config": None, "mtp_feedback_normed": self.mtp_feedback_normed, "mtp_modules": self.num_modules,
                **self.tree_fields()}


@dataclass
class DFlashOptions(HeadOptions):
    """``speculative_config`` keys of ``method="dflash"``: the DFlash checkpoint (z-lab's ``DFlashDraftModel``
    layout), which drafts up to its block size - 1 tokens per step in one pass."""

    model: str | None = None  # the DFlash checkpoint's folder or hub id (e.g. z-lab/Qwen3-8B-DFlash-b16)
    # a token tree instead of a chain: Medusa's paths of top-k indices, depth d + 1 filled from block row d's top-k
    # (the block's positions draft apart from each other, as Medusa's heads do); num_speculative_tokens: the most
    # nodes verified per step (a prefix of the tree, best first)
    speculative_token_tree: list[list[int]] | str | None = None  # (or a string of one: JSON, or a Python literal)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r}: method='dflash' needs the DFlash "
                             "checkpoint's folder (or hub id), e.g. z-lab/Qwen3-8B-DFlash-b16")
        if self.speculative_token_tree is not None:
            self.speculative_token_tree = check_choices("speculative_token_tree", self.speculative_token_tree)

    @property
    def default_draft_count(self) -> int:
        """``num_speculative_tokens`` when it is not given: a tree's nodes, every one of them (as EAGLE's static
        tree's); a chain's 5, or the block's drafts where it holds fewer."""
        if self.speculative_token_tree is not None:
            return len(self.speculative_token_tree)
        return min(5, dflash_block_size(self.model) - 1)

    def drafts_blocks(self) -> bool:
        return self.speculative_token_tree is None

    def drafts_trees(self) -> bool:
        return self.speculative_token_tree is not None

    def tree_lookahead_slots(self) -> int:
        """A tree's block: the sampled token's slot and one per level after it (0: chains, sized per request)."""
        if self.speculative_token_tree is None:
            return 0
        return 1 + max(len(c) for c in self.speculative_token_tree)

    def check_draft_count(self, num_speculative_tokens: int) -> None:
        block = dflash_block_size(self.model)
        tree = self.speculative_token_tree
        if tree is not None and max(len(c) for c in tree) > block - 1:
            raise ValueError(f"speculative_config.speculative_token_tree goes {max(len(c) for c in tree)} levels "
                             f"deep but the DFlash checkpoint {self.model!r} drafts blocks of {block} ({block - 1} "
                             f"positions after the sampled token): keep its paths at most {block - 1} long")
        if tree is None and num_speculative_tokens > block - 1:
            raise ValueError(f"speculative_config.num_speculative_tokens={num_speculative_tokens}: the DFlash "
                             f"checkpoint {self.model!r} drafts blocks of {block} (the sampled token and {block - 1} "
                             f"drafts); give num_speculative_tokens <= {block - 1}")

    def worker_fields(self, path: str | None, target_model: str) -> dict[str, Any]:
        from specray.models.draft_head_loader import read_head_config

        tree = None if self.speculative_token_tree is None else choices_in_order(self.speculative_token_tree)
        return {"head_config": read_head_config(path), "choices": tree}


def dflash_block_size(path: str) -> int:
    """A DFlash checkpoint's block size, from its config.json (``dflash_config.block_size`` or the top level's;
    16 when neither gives it), read without torch."""
    import json
    from pathlib import Path

    from specray.models.loader import resolve_model

    raw = json.loads((Path(resolve_model(path, field="speculative_config.model").path) / "config.json").read_text())
    block = (raw.get("dflash_config") or {}).get("block_size", raw.get("block_size", 16))
    if not isinstance(block, int) or isinstance(block, bool) or block < 2:
        raise ValueError(f"the DFlash checkpoint {path!r} gives block_size={block!r}: it must be an int >= 2")
    return block


# a small default tree: paths of top-k indices, one per head (best-first: each path's prefix comes before it)
DEFAULT_MEDUSA_CHOICES = ([0], [0, 0], [1], [0, 0, 0], [0, 1], [2], [1, 0], [0, 0, 0, 0], [0, 0, 1], [3])


@dataclass
class MedusaOptions(HeadOptions):
    """``speculative_config`` keys of ``method="medusa"``: the heads' checkpoint and the token tree they fill."""

    model: str | None = None  # the heads' checkpoint folder (FasterDecoding's or vLLM's layout)
    # the tree: each path [i0, i1, ...] is the node holding head 0's i0-th best token, then head 1's i1-th best
    # under it, ... (Medusa's and TensorRT-LLM's ``medusa_choices``); verified best-first, in the given order
    # with every path after its prefix (sorted by length otherwise); the policy verifies a prefix of it
    medusa_choices: list[list[int]] | str | None = None  # (or a string of one: JSON, or a Python literal)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r}: method='medusa' needs the heads' checkpoint "
                             "folder (or hub id)")
        if self.medusa_choices is not None:
            self.medusa_choices = check_choices("medusa_choices", self.medusa_choices)

    @property
    def default_draft_count(self) -> int | None:
        """``num_speculative_tokens`` when it is not given: the nodes of the medusa_choices given, every one of them
        (as EAGLE's static tree's); with the default tree it stays 5."""
        return None if self.medusa_choices is None else len(self.medusa_choices)

    def drafts_trees(self) -> bool:
        return True

    def writes_kv(self) -> bool:
        return False  # no attention in Medusa's heads

    def tree(self) -> list[list[int]]:
        """The choices in verification order: as given when every path follows its prefix, else by length."""
        return choices_in_order(self.medusa_choices or DEFAULT_MEDUSA_CHOICES)

    def worker_fields(self, path: str | None, target_model: str) -> dict[str, Any]:
        return {"choices": self.tree()}


def check_choices(name: str, choices: Any) -> list[list[int]]:
    """``choices`` (or a string of them: JSON, or a Python literal as vLLM takes trees) as a list of paths, with a
    ValueError naming ``speculative_config.<name>`` unless it is a tree of top-k paths (Medusa's ``medusa_choices``):
    a non-empty list of distinct non-empty lists of indices >= 0, each path's prefix a path."""
    from specray.tree import read_tree  # torch-free

    choices = read_tree(choices, f"speculative_config.{name}")
    if not isinstance(choices, (list, tuple)) or not choices or not all(
            isinstance(c, (list, tuple)) and c and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                        for i in c) for c in choices):
        raise ValueError(f"speculative_config.{name}={choices!r} must be a non-empty list of paths, each a non-empty "
                         "list of top-k indices >= 0, e.g. [[0], [1], [0, 0]]")
    paths = {tuple(c) for c in choices}
    if len(paths) != len(choices):
        raise ValueError(f"speculative_config.{name} lists a path twice")
    orphans = [list(c) for c in choices if len(c) > 1 and tuple(c[:-1]) not in paths]
    if orphans:
        raise ValueError(f"speculative_config.{name} has paths without their parent path: {orphans}; add each path's "
                         "prefix as well")
    return [list(c) for c in choices]


def choices_in_order(choices) -> list[list[int]]:
    """A tree's paths in verification order: as given when every path follows its prefix, else by length."""
    choices = [list(c) for c in choices]
    seen: set[tuple[int, ...]] = set()
    for c in choices:
        if len(c) > 1 and tuple(c[:-1]) not in seen:
            return sorted(choices, key=lambda c: (len(c), c))
        seen.add(tuple(c))
    return choices


@dataclass
class ReDrafterOptions(HeadOptions):
    """``speculative_config`` keys of ``method="redrafter"`` (TensorRT-LLM's names for the beams): the recurrent
    drafter's checkpoint and its beam search, whose beams' prefix tree is verified (``num_speculative_tokens``: the
    most nodes of it per step)."""

    model: str | None = None  # the drafter's checkpoint folder (Apple's recurrent_drafting layout) or hub id
    redrafter_num_beams: int = 5  # beams kept by the beam search
    redrafter_draft_len_per_beam: int = 5  # drafts per beam (the tree's depth)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r}: method='redrafter' needs the drafter's "
                             "checkpoint folder (or hub id)")
        for name in ("redrafter_num_beams", "redrafter_draft_len_per_beam"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name}={value!r} must be an int >= 1 (TensorRT-LLM's default: 5)")

    def drafts_trees(self) -> bool:
        return True

    def writes_kv(self) -> bool:
        return False  # no attention in the recurrent drafter

    def worker_fields(self, path: str | None, target_model: str) -> dict[str, Any]:
        return {"beams": self.redrafter_num_beams, "beam_length": self.redrafter_draft_len_per_beam}


@dataclass
class MLPSpeculatorOptions(HeadOptions):
    """``speculative_config`` keys of ``method="mlp_speculator"`` (vLLM's): IBM's MLP speculator checkpoint, whose
    stages draft a chain of up to its ``n_predict`` tokens (the default draft count); or, with ``candidate_tree``, a
    greedy request's token tree of IBM's candidates (``num_speculative_tokens``: the most nodes of it per step)."""

    # the speculator's checkpoint folder or hub id (e.g. ibm-ai-platform/llama3-8b-accelerator)
    model: str | None = None
    # IBM's candidate tree (its inference server's, which vLLM leaves out): stage k's top_k_tokens_per_head[k] best
    # tokens under every path so far, the n_candidates best paths by log q merged into a prefix tree; both default to
    # the checkpoint's config.json. Sampled requests draft chains drawn from q either way.
    candidate_tree: bool = False
    top_k_tokens_per_head: list[int] | None = None
    n_candidates: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r}: method='mlp_speculator' needs the "
                             "speculator's checkpoint folder (or hub id), e.g. ibm-ai-platform/llama3-8b-accelerator")
        if not isinstance(self.candidate_tree, bool):
            raise ValueError(f"speculative_config.candidate_tree={self.candidate_tree!r} must be a bool")
        given = [name for name in ("top_k_tokens_per_head", "n_candidates") if getattr(self, name) is not None]
        if given and not self.candidate_tree:
            raise ValueError(f"speculative_config.{given[0]} shapes the candidate tree: give candidate_tree=True too "
                             "(or leave it out for chains)")

    def candidates(self) -> tuple[list[int], int] | None:
        """The candidate tree's (top-k per stage, candidates kept), checked; None: chains."""
        if not self.candidate_tree:
            return None
        config = mlp_speculator_config(self.model)
        stages = int(config["n_predict"])
        top = self.top_k_tokens_per_head if self.top_k_tokens_per_head is not None else config.get(
            "top_k_tokens_per_head")
        n = self.n_candidates if self.n_candidates is not None else config.get("n_candidates")
        if not isinstance(top, list) or len(top) != stages or not all(
                isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in top):
            raise ValueError(f"speculative_config.top_k_tokens_per_head={top!r}: the candidate tree takes one int >= 1 "
                             f"per stage of the speculator {self.model!r} ({stages}, n_predict)")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= math.prod(top):
            raise ValueError(f"speculative_config.n_candidates={n!r}: the candidate tree keeps between 1 and "
                             f"{math.prod(top)} candidates (the product of top_k_tokens_per_head={top})")
        return top, n

    @property
    def default_draft_count(self) -> int:
        """``num_speculative_tokens`` when it is not given: one draft per stage, or a candidate tree's most nodes
        (per stage, its paths so far, at most the candidates kept)."""
        tree = self.candidates()
        if tree is None:
            return mlp_speculator_stages(self.model)
        top, n = tree
        return sum(min(n, math.prod(top[: k + 1])) for k in range(len(top)))

    def check_draft_count(self, num_speculative_tokens: int) -> None:
        stages = mlp_speculator_stages(self.model)
        if self.candidates() is None and num_speculative_tokens > stages:
            raise ValueError(f"speculative_config.num_speculative_tokens={num_speculative_tokens}: the MLP "
                             f"speculator {self.model!r} has {stages} stages (n_predict), one draft each; give "
                             f"num_speculative_tokens <= {stages} (or leave it out), or candidate_tree=True")

    def drafts_trees(self) -> bool:
        return self.candidate_tree

    def writes_kv(self) -> bool:
        return False  # no attention in the stages

    def worker_fields(self, path: str | None, target_model: str) -> dict[str, Any]:
        tree = self.candidates()
        return {"candidates": None if tree is None else [tree[0], tree[1]]}


def mlp_speculator_config(path: str) -> dict[str, Any]:
    """An MLP speculator checkpoint's config.json, checked."""
    from pathlib import Path

    from specray.models.loader import resolve_model
    from specray.models.mlp_speculator import read_mlp_speculator_config

    folder = Path(path).expanduser()
    if not folder.is_dir():  # a hub id: its config alone
        folder = Path(resolve_model(path, weights=False).path)
    return read_mlp_speculator_config(folder)


def mlp_speculator_stages(path: str) -> int:
    """An MLP speculator checkpoint's stages (``n_predict`` of its config.json)."""
    return int(mlp_speculator_config(path)["n_predict"])


@dataclass
class Gemma4AssistantOptions(HeadOptions):
    """``speculative_config`` keys of ``method="gemma4_assistant"``: Gemma 4's assistant checkpoint (its MTP drafter,
    ``Gemma4AssistantForCausalLM``), which drafts chains from the target's hidden state and K/V on one rank."""

    model: str | None = None  # the assistant's checkpoint folder or hub id (e.g. google/gemma-4-e2b-it-assistant)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r}: method='gemma4_assistant' needs the "
                             "assistant's checkpoint folder (or hub id), e.g. google/gemma-4-e2b-it-assistant")

    def splits_over(self, tensor_parallel_size: int) -> bool:
        if tensor_parallel_size > 1:
            raise ValueError(f"method='gemma4_assistant' with tensor_parallel_size={tensor_parallel_size}: the "
                             "assistant attends the target's K/V of every head, which one rank holds only at "
                             "tensor_parallel_size=1; set tensor_parallel_size=1 or pick another method")
        return super().splits_over(tensor_parallel_size)

    def writes_kv(self) -> bool:
        return False  # it attends the target's K/V and writes none

    def worker_fields(self, path: str | None, target_model: str) -> dict[str, Any]:
        from specray.models.gemma4_assistant import check_assistant
        from specray.models.loader import load_hf_config, read_config

        head_config = read_config(path)  # both configs read and checked here, before any worker starts
        check_assistant(head_config, load_hf_config(target_model))
        return {"head_config": head_config}


def worker_config(method: str, options: Any, target_model: str, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """What the target's workers need to build ``method``'s head and drafter (plain data: it crosses Ray): the
    head's checkpoint (each options class's: EAGLE-3 on the default model, the bundled head; MTP, the target's own
    checkpoint unless ``model`` names one), whether it is split over the target's ``tensor_parallel_size`` ranks,
    and what the method's drafter class reads besides (:meth:`HeadOptions.worker_fields`)."""
    split = options.splits_over(tensor_parallel_size)
    path = options.checkpoint(method, target_model)
    return {"method": method, "model": path, "split": split, **options.worker_fields(path, target_model)}


# what marks another method's checkpoint in its config.json: the method that reads it, what it is, the mark
_OTHER_KINDS = (("medusa", "Medusa heads", "its config.json gives medusa_num_heads",
                 lambda raw: "medusa_num_heads" in raw),
                ("redrafter", "a ReDrafter", "model_type 'recurrent_drafting_drafter'",
                 lambda raw: raw.get("model_type") == "recurrent_drafting_drafter"),
                ("mlp_speculator", "an MLP speculator", "model_type 'mlp_speculator'",
                 lambda raw: raw.get("model_type") == "mlp_speculator"),
                ("dflash", "a DFlash model", "its config.json gives dflash_config",
                 lambda raw: "dflash_config" in raw),
                ("gemma4_assistant", "a Gemma 4 assistant", "model_type {kind!r}",
                 lambda raw: raw.get("model_type") in ("gemma4_assistant", "gemma4_unified_assistant")))


def _refuse_other_kind(path: str | None, method: str) -> None:
    """A local checkpoint whose config.json marks it as another method's (Medusa heads, a ReDrafter, an MLP
    speculator, a DFlash model, a Gemma 4 assistant) given to ``method``: a ValueError naming the method that reads
    it, rather than a size mismatch its loader would find (a hub id is not read here)."""
    import json
    from pathlib import Path

    config = None if path is None else Path(path).expanduser() / "config.json"
    if config is None or not config.is_file():
        return
    raw = json.loads(config.read_text())
    for owner, what, mark, marks in _OTHER_KINDS:
        if isinstance(raw, dict) and owner != method and marks(raw):
            mark = mark.format(kind=raw.get("model_type"))
            detail = " (method='mtp' reads MTP layers inside a target's checkpoint)" if method == "mtp" else ""
            raise ValueError(f"speculative_config.model={path!r} is {what}, not a checkpoint of method={method!r} "
                             f"({mark}): use method={owner!r} with it{detail}")
