"""Per-request drafting methods (``SamplingParams.speculative_method``): one drafter in front of several.

:class:`DrafterRouter` holds the engine's own drafter and, built on first use, one drafter per method that
requests picked for themselves (each with that method's default options and the engine's
``num_speculative_tokens``). It routes every request to its method's drafter and forwards the engine's calls
about a request (``finish``, the optional ``observe_*`` hooks) to the drafter that owns it.

A request may pick the engine's own method or one of ``registry.request_methods()``: built-in methods without a
model that propose cheaply, so building one for a request costs next to nothing. When the engine's drafter runs
elsewhere (the Ray backend's ``RemoteDrafter``), the drafters built for requests run here, in the engine's
process: they are lookups, not models. Drafting ahead (``drafts_ahead``/``prefetch``) serves the engine's own
drafter's requests only.

The engine puts the router in place only when a request first picks a method other than its own, so an engine
whose requests never do pays nothing for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from specray.config import SpeculativeConfig
from specray.drafters import registry
from specray.drafters.base import DraftRequest, Drafter, DrafterContext, Proposal, proposes_cheaply


def check_request_method(method: str | None, spec: SpeculativeConfig | None) -> None:
    """Admission: a ValueError unless a request may draft with ``method`` on an engine speculating with ``spec``
    (None: the engine does not speculate)."""
    if method is None:
        return
    if spec is None:
        raise ValueError(f"speculative_method={method!r} needs an engine that speculates; start the server or "
                         "LLM with a speculative method (speculative_config={'method': ...}, or --spec-method), or "
                         "leave speculative_method out")
    if method != spec.method and method not in registry.request_methods():
        raise ValueError(f"speculative_method={method!r} cannot be picked per request; a request may pick the "
                         f"engine's own method {spec.method!r} or a built-in method without a model of its own "
                         f"that proposes cheaply: {list(registry.request_methods())} (a draft model or a "
                         "user-provided drafter is picked for the whole engine, as speculative_config.method)")


class DrafterRouter:
    """The engine's drafter plus the drafters requests picked (see the module docstring)."""

    def __init__(self, own: Drafter, spec: SpeculativeConfig, ctx: DrafterContext):
        self.own = own
        self.spec = spec
        self.method = spec.method
        self._ctx = ctx
        self._own_cheap = proposes_cheaply(own)
        self.cheap_proposals = self._own_cheap  # the engine asks per request (proposes_cheaply_for)
        if hasattr(own, "prefetch"):
            self.drafts_ahead = getattr(own, "drafts_ahead", False)
        self._built: dict[str, Drafter] = {}  # method -> its drafter, built on first use
        self._owners: dict[str, Drafter] = {}  # req_id -> its drafter, for requests routed off the own one

    # ---- routing --------------------------------------------------------------------------------------
    def proposes_cheaply_for(self, params) -> bool:
        """Whether the drafter of a request with these sampling params proposes cheaply (every routed one
        does: admission lets no other through)."""
        return self._own_cheap or not self._is_own(params.speculative_method)

    def _is_own(self, method: str | None) -> bool:
        return method is None or method == self.method

    def _owner(self, dreq: DraftRequest) -> Drafter:
        method = dreq.sampling_params.speculative_method
        if self._is_own(method):
            return self.own
        owner = self._owners.get(dreq.req_id)
        if owner is None:
            owner = self._owners[dreq.req_id] = self._drafter(method)
        return owner

    def prepare(self, method: str) -> None:
        """Build ``method``'s drafter now, at a request's admission: a method that cannot run with this engine's
        settings is that request's ValueError, not a failed step (lookahead's tree is fitted to the engine's
        ``num_speculative_tokens``)."""
        try:
            self._drafter(method)
        except ValueError as err:
            raise ValueError(f"speculative_method={method!r} cannot run with this engine's speculative settings "
                             f"({err}); pick another method or none for this request") from None

    def _drafter(self, method: str) -> Drafter:
        found = self._built.get(method)
        if found is None:
            k = self.spec.num_speculative_tokens
            fitted = getattr(registry.options_class(method), "fitted_to", None)  # lookahead's tree within k
            spec = SpeculativeConfig(method=method, num_speculative_tokens=k, **(fitted(k) if fitted else {}))
            found = self._built[method] = registry.drafter_class(method)(spec, self._ctx)
        return found

    # ---- the protocol ---------------------------------------------------------------------------------
    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        owners = [self._owner(dreq) for dreq in batch]
        if all(owner is self.own for owner in owners):
            return self.own.propose(batch)
        proposals: list[Proposal | None] = [None] * len(batch)
        for drafter in {id(o): o for o in owners}.values():
            picked = [i for i, owner in enumerate(owners) if owner is drafter]
            for i, proposal in zip(picked, drafter.propose([batch[i] for i in picked])):
                proposals[i] = proposal if drafter is self.own else _namespaced(proposal, batch[i])
        return proposals

    def prefetch(self, batch: list[DraftRequest]) -> None:
        """Draft ahead for the own drafter's requests only (a routed drafter drafts when asked)."""
        own = [dreq for dreq in batch if self._is_own(dreq.sampling_params.speculative_method)]
        if own:
            self.own.prefetch(own)

    def finish(self, req_ids: Sequence[str]) -> None:
        own, routed = [], {}
        for req_id in req_ids:
            owner = self._owners.pop(req_id, None)
            if owner is None:
                own.append(req_id)
            else:
                routed.setdefault(id(owner), (owner, []))[1].append(req_id)
        if own:
            self.own.finish(own)
        for owner, ids in routed.values():
            owner.finish(ids)

    def shutdown(self) -> None:
        for drafter in (self.own, *self._built.values()):
            drafter.shutdown()

    def stats(self) -> dict | None:
        """Each drafter's own statistics (those that keep them), by method."""
        found = {m: _stats_of(d) for m, d in ((self.method, self.own), *self._built.items())}
        return {m: s for m, s in found.items() if s is not None} or None

    # ---- the optional hooks, for the drafter that owns the request --------------------------------------
    def observe_verification(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        self._tell("observe_verification", req_id, num_drafted, num_accepted)

    def observe_finished(self, req_id: str, token_ids: Sequence[int]) -> None:
        self._tell("observe_finished", req_id, token_ids)

    def observe_node_tokens(self, req_id: str, node_tokens) -> None:
        self._tell("observe_node_tokens", req_id, node_tokens)

    def reset_prefix_cache(self) -> None:
        """Every drafter's own prefix cache forgotten (a draft model's), as the engine's is."""
        for drafter in (self.own, *self._built.values()):
            reset = getattr(drafter, "reset_prefix_cache", None)
            if reset is not None:
                reset()

    def _tell(self, hook: str, req_id: str, *args) -> None:
        told = getattr(self._owners.get(req_id, self.own), hook, None)
        if told is not None:
            told(req_id, *args)


def _namespaced(proposal: Proposal, dreq: DraftRequest) -> Proposal:
    """A routed drafter's key, made its method's own: the draft policy pools evidence per key over every
    request, and one method's key (a match length, a count) means something else to another."""
    if proposal.key is None:
        return proposal
    return replace(proposal, key=(dreq.sampling_params.speculative_method, proposal.key))


def _stats_of(drafter) -> dict | None:
    stats = getattr(drafter, "stats", None)
    return stats() if callable(stats) else None
