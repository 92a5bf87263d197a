"""An example of a user-provided drafter (see docs/user_drafter.md): after the history's last token, propose
what followed that token's previous occurrence, as a token tree of the two latest occurrences' continuations.

Use it with ``SpeculativeConfig(method="last_token_drafter:LastTokenDrafter", lookback=512)`` when this file's
folder is on ``sys.path``, or install it and declare an entry point in the ``specray.drafters`` group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specray.drafters.base import DraftRequest, DrafterContext, Proposal
from specray.drafters.registry import options_of


@dataclass
class LastTokenOptions:
    lookback: int = 512  # how far back to look for the last token

    def __post_init__(self) -> None:
        if not isinstance(self.lookback, int) or self.lookback < 2:
            raise ValueError(f"speculative_config.lookback={self.lookback!r} must be an int >= 2")


class LastTokenDrafter:
    Options = LastTokenOptions  # its own keys in speculative_config
    cheap_proposals = True  # a lookup: the engine asks for the most drafts and sizes them itself

    def __init__(self, spec, ctx: DrafterContext):
        self.options: LastTokenOptions = options_of(spec)  # checked: unknown keys are a clear error

    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        return [self._one(req) for req in batch]

    def _one(self, req: DraftRequest) -> Proposal:
        k = req.num_speculative_tokens
        history = list(req.token_ids[-self.options.lookback:])
        last = history[-1]
        starts = [i + 1 for i in range(len(history) - 2, -1, -1) if history[i] == last][:2]
        tokens: list[int] = []
        parents: list[int] = []
        for start in starts:  # each continuation is a branch from the root (a chain below it)
            branch = history[start : start + max(1, k // len(starts))][: k - len(tokens)]
            for j, token in enumerate(branch):
                parents.append(-1 if j == 0 else len(tokens) - 1)
                tokens.append(token)
        return Proposal(tokens, parents=parents) if tokens else Proposal([])

    def finish(self, req_ids: Sequence[str]) -> None:
        pass  # it keeps no per-request state

    def shutdown(self) -> None:
        pass
