"""The one registry from ``speculative_config.method`` to a drafter: its class, its options and what it can do.

Each drafter declares its options as a dataclass next to its class (``NgramOptions`` beside ``NgramDrafter``);
:class:`specray.config.SpeculativeConfig` carries them as given and :func:`options_of` checks and parses them,
so every method-specific question is answered here and nowhere else. Modules import lazily: the draft model
needs torch, the n-gram drafter does not.

User-provided drafters (TensorRT-LLM's ``UserProvidedDecodingConfig``): any class with the ``Drafter`` protocol,
built as ``cls(spec, ctx)``, is a method when ``method`` is its dotted path (``"my_pkg.drafts:MyDrafter"``) or
the name of an entry point in the ``specray.drafters`` group (``my_drafter = "my_pkg.drafts:MyDrafter"`` in its
package's ``pyproject.toml``). Its own options are the fields of its ``Options`` dataclass attribute (none when it
has none); ``docs/user_drafter.md`` has an example.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from functools import lru_cache
from importlib import import_module
from importlib.metadata import entry_points
from inspect import signature
from typing import Any

from specray.config import SpeculativeConfig, check_keys, jsonable_fields


@dataclass(frozen=True)
class DrafterEntry:
    drafter: str  # "module:Class"
    options: str  # "module:Class", the dataclass of the method's own options
    # a model of its own: the target's tokenizer must match it, and its options carry
    # ``draft_tensor_parallel_size`` (its weights can be split over ranks)
    has_weights: bool = False
    # its options carry ``is_public_pool``: replicas may share what it learns through a named pool
    shares_pool: bool = False
    # it runs inside the target's driver rank and drafts from the target's hidden states
    # (specray.drafters.hidden_state): the engine gets its drafts with each step's result, and builds no drafter
    in_worker: bool = False


_DRAFTERS = {
    "ngram": DrafterEntry("specray.drafters.ngram:NgramDrafter", "specray.drafters.ngram:NgramOptions",
                          shares_pool=True),
    "draft_model": DrafterEntry("specray.drafters.draft_model:DraftModelDrafter",
                                "specray.drafters.draft_model:DraftModelOptions", has_weights=True),
    # llama.cpp's n-gram family (--spec-type ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache)
    "ngram_simple": DrafterEntry("specray.drafters.ngram_simple:NgramSimpleDrafter",
                                 "specray.drafters.ngram_simple:NgramSimpleOptions"),
    "ngram_map_k": DrafterEntry("specray.drafters.ngram_map:NgramMapKDrafter",
                                "specray.drafters.ngram_map:NgramMapOptions"),
    "ngram_map_k4v": DrafterEntry("specray.drafters.ngram_map:NgramMapK4vDrafter",
                                  "specray.drafters.ngram_map:NgramMapK4vOptions"),
    "ngram_mod": DrafterEntry("specray.drafters.ngram_mod:NgramModDrafter", "specray.drafters.ngram_mod:NgramModOptions"),
    "ngram_cache": DrafterEntry("specray.drafters.ngram_cache:NgramCacheDrafter",
                                "specray.drafters.ngram_cache:NgramCacheOptions"),
    "suffix": DrafterEntry("specray.drafters.suffix:SuffixDrafter", "specray.drafters.suffix:SuffixOptions",
                           shares_pool=True),
    # OpenAI's Predicted Outputs: drafts from the output a request says it expects (SamplingParams.prediction)
    "prediction": DrafterEntry("specray.drafters.prediction:PredictionDrafter",
                               "specray.drafters.prediction:PredictionOptions"),
    "lookahead": DrafterEntry("specray.drafters.lookahead:LookaheadDrafter",
                              "specray.drafters.lookahead:LookaheadOptions"),
    # heads that read the target's hidden states, on the target's driver rank (one module family:
    # specray.models.draft_head)
    "eagle": DrafterEntry("specray.workers.head_drafter:HiddenStateDrafter",
                          "specray.drafters.hidden_state:EagleOptions", in_worker=True),
    "eagle3": DrafterEntry("specray.workers.head_drafter:HiddenStateDrafter",
                           "specray.drafters.hidden_state:EagleOptions", in_worker=True),
    "mtp": DrafterEntry("specray.workers.head_drafter:HiddenStateDrafter",
                        "specray.drafters.hidden_state:MTPOptions", in_worker=True),
    "medusa": DrafterEntry("specray.workers.medusa_drafter:MedusaDrafter",
                           "specray.drafters.hidden_state:MedusaOptions", in_worker=True),
    "redrafter": DrafterEntry("specray.workers.redrafter_drafter:ReDrafterDrafter",
                              "specray.drafters.hidden_state:ReDrafterOptions", in_worker=True),
    # IBM's MLP speculator (vLLM's mlp_speculator): a chain of MLP stages over the target's last hidden state
    "mlp_speculator": DrafterEntry("specray.workers.mlp_speculator_drafter:MLPSpeculatorDrafter",
                                   "specray.drafters.hidden_state:MLPSpeculatorOptions", in_worker=True),
    # DFlash: a block of drafts in one pass of a small model reading the target's hidden states
    "dflash": DrafterEntry("specray.workers.dflash_drafter:DFlashDrafter",
                           "specray.drafters.hidden_state:DFlashOptions", in_worker=True),
    # Gemma 4's assistant (Gemma4AssistantForCausalLM, its MTP drafter): a checkpoint of its own that attends the
    # target's K/V, named after its model_type
    "gemma4_assistant": DrafterEntry("specray.workers.gemma4_assistant_drafter:Gemma4AssistantDrafter",
                                     "specray.drafters.hidden_state:Gemma4AssistantOptions", in_worker=True),
}


USER_GROUP = "specray.drafters"  # entry points of user-provided drafters


@dataclass(frozen=True)
class _NoOptions:
    """A user-provided drafter without an ``Options`` dataclass takes no options of its own."""


def drafter_names() -> list[str]:
    """The built-in methods and the user-provided drafters declared as entry points."""
    return list(_DRAFTERS) + sorted(ep.name for ep in entry_points(group=USER_GROUP) if ep.name not in _DRAFTERS)


def entry(method: str) -> DrafterEntry:
    if not isinstance(method, str):
        raise ValueError(f"speculative_config.method={method!r} must be a string")
    if method in _DRAFTERS:
        return _DRAFTERS[method]
    return _user_entry(method)


@lru_cache(maxsize=None)
def _user_entry(method: str) -> DrafterEntry:
    """A user-provided drafter: an entry point of that name, or a dotted path ``module:Class``; checked now."""
    found = [ep.value for ep in entry_points(group=USER_GROUP, name=method)]
    path = found[0] if found else method
    if ":" not in path:
        raise ValueError(f"speculative_config.method={method!r} is unknown; choose one of {drafter_names()}, or "
                         "give a drafter class of your own as 'package.module:ClassName' (or an entry point of "
                         f"that name in the {USER_GROUP!r} group)")
    module, _, name = path.partition(":")
    try:
        cls = getattr(import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"speculative_config.method={method!r}: cannot import {path!r} ({err}); give an "
                         "importable 'package.module:ClassName' of a class with the Drafter protocol") from None
    missing = [m for m in ("propose", "finish", "shutdown") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"speculative_config.method={method!r}: {path!r} is not a drafter class (missing "
                         f"{missing or 'a class'}); it must implement specray.drafters.base.Drafter "
                         "(propose, finish, shutdown) and take (spec, ctx)")
    options = getattr(cls, "Options", None)
    if options is not None and not (isinstance(options, type) and is_dataclass(options)):
        raise ValueError(f"speculative_config.method={method!r}: {name}.Options={options!r:.60} is not a dataclass; "
                         "declare the drafter's own speculative_config keys as a @dataclass's fields (or no Options)")
    try:
        signature(cls).bind(None, None)
    except TypeError as err:
        raise ValueError(f"speculative_config.method={method!r}: {path!r} cannot be built as {name}(spec, ctx) "
                         f"({err}); its __init__ must take the SpeculativeConfig and the DrafterContext") from None
    except ValueError:  # no signature to read (a class built in C): built as it is
        pass
    return DrafterEntry(path, "")


def _load(path: str):
    module, name = path.split(":")
    return getattr(import_module(module), name)


def drafter_class(method: str):
    return _load(entry(method).drafter)


def options_class(method: str):
    found = entry(method)
    if not found.options:  # user-provided: its Options dataclass, if it declares one
        return getattr(drafter_class(method), "Options", _NoOptions)
    return _load(found.options)


def options_of(spec: SpeculativeConfig) -> Any:
    """``spec``'s method options as that method's options dataclass: input aliases (an options class's
    ``ALIASES``, e.g. TensorRT-LLM's ``max_matching_ngram_size``) mapped, unknown or misplaced keys refused."""
    cls = options_class(spec.method)
    aliases: dict[str, str] = getattr(cls, "ALIASES", {})
    given = dict(spec.options)
    for alias, name in aliases.items():
        if alias in given:
            if name in given and given[name] != given[alias]:
                raise ValueError(f"speculative_config gives {name}={given[name]!r} and its alias {alias}="
                                 f"{given[alias]!r}; give {name} only")
            given[name] = given.pop(alias)
    own = [f.name for f in fields(cls)]
    known = [*SpeculativeConfig.COMMON_KEYS, *own]
    for key in sorted(set(given) - set(known)):  # another method's key says so, rather than guess a near name
        owners = [method for method, found in _DRAFTERS.items() if found.options and key in _option_names(method)]
        if owners:
            raise ValueError(f"speculative_config.{key} is an option of method {' / '.join(map(repr, owners))}, "
                             f"not of method={spec.method!r}; remove it (its keys: {sorted(known)})")
    check_keys("speculative_config", given, known, f" for method={spec.method!r}")
    return cls(**given)


def _option_names(method: str) -> set[str]:
    """A built-in method's option keys, its aliases among them."""
    cls = options_class(method)
    return {f.name for f in fields(cls)} | set(getattr(cls, "ALIASES", {}))


def check(spec: SpeculativeConfig | None) -> None:
    """Everything about ``spec`` that needs its method: the name, and its options. A draft count left unset
    becomes the method's own where its options imply one (``default_draft_count``: lookahead's whole tree, one
    draft per MTP module), else stays 5."""
    if spec is None:
        return
    options = options_of(spec)
    default = getattr(options, "default_draft_count", None)
    if not spec.count_given and default is not None:
        spec.num_speculative_tokens, spec.count_given = default, True
    check_budget = getattr(options, "check_budget", None)  # what the draft count must hold, known without files
    if check_budget is not None:
        check_budget(spec.num_speculative_tokens)


def has_weights(method: str) -> bool:
    """The method loads a model of its own (its tokenizer must be the target's)."""
    return entry(method).has_weights


@lru_cache(maxsize=None)
def request_methods() -> tuple[str, ...]:
    """The built-in methods a request may pick for itself (``SamplingParams.speculative_method``) whatever the
    engine's: no model of their own and cheap proposals (a lookup), so the engine can build one for a request
    at no real cost. A user-provided drafter is never imported on a request's word."""
    from specray.drafters.base import proposes_cheaply

    return tuple(m for m, found in _DRAFTERS.items()
                 if not found.has_weights and not found.in_worker and proposes_cheaply(drafter_class(m)))


def runs_in_worker(method: str) -> bool:
    """The method drafts inside the target's driver rank, from its hidden states."""
    return entry(method).in_worker


def worker_drafter_config(spec: SpeculativeConfig, target_model: str, tensor_parallel_size: int = 1
                          ) -> dict[str, Any]:
    """What the target's ``tensor_parallel_size`` workers need to build ``spec``'s worker-side drafter (plain data:
    it crosses Ray; see :func:`specray.drafters.hidden_state.worker_config`)."""
    from specray.drafters.hidden_state import worker_config

    options = options_of(spec)
    options.check_draft_count(spec.num_speculative_tokens)
    return {**worker_config(spec.method, options, target_model, tensor_parallel_size),
            "drafter": entry(spec.method).drafter}


def worker_drafts_trees(spec: SpeculativeConfig) -> bool:
    """A worker drafter that drafts token trees (EAGLE-2, Medusa) rather than chains."""
    return options_of(spec).drafts_trees()


def worker_writes_kv(spec: SpeculativeConfig) -> bool:
    """A worker drafter whose drafting writes K/V past the verified drafts (all but Medusa's attention-free heads)."""
    return options_of(spec).writes_kv()


def worker_block_slots(spec: SpeculativeConfig) -> bool:
    """A worker drafter that writes a block of K/V from the sampled token's position on (DFlash)."""
    return options_of(spec).drafts_blocks()


def worker_lookahead_slots(spec: SpeculativeConfig) -> int:
    """Slots a worker drafter growing token trees writes past the root (0: it drafts chains)."""
    return getattr(options_of(spec), "tree_lookahead_slots", lambda: 0)()


def worker_tree_shape(spec: SpeculativeConfig) -> tuple[int, int] | None:
    """(nodes per level, levels) of the trees a worker drafter grows level by level (EAGLE-2); None otherwise."""
    return getattr(options_of(spec), "tree_shape", lambda: None)()


def tensor_parallel_size(spec: SpeculativeConfig) -> int:
    """Over how many ranks the drafter's weights are split (1 for a drafter without weights)."""
    return options_of(spec).draft_tensor_parallel_size if has_weights(spec.method) else 1


def uses_public_pool(spec: SpeculativeConfig) -> bool:
    """The drafter shares its n-gram pool (``is_public_pool``), so replicas may link theirs."""
    return entry(spec.method).shares_pool and options_of(spec).is_public_pool


def options_schema() -> dict[str, Any]:
    """JSON-able: the keys every method has and each method's own options with their types and defaults."""
    common = {k: v for k, v in jsonable_fields(SpeculativeConfig).items() if k in SpeculativeConfig.COMMON_KEYS}
    return {"common": common, "methods": {m: jsonable_fields(options_class(m)) for m in drafter_names()}}
