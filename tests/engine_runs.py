"""What the engine-level tests share: the prompts their greedy comparisons run, greedy sampling parameters and
the token ids of ``LLM.generate``'s outputs, and a virtual clock for engines whose draft policy should not follow
this machine's load. Imported as ``specray_test_engine_runs`` (tests/conftest.py)."""
from __future__ import annotations

from specray import SamplingParams

# code, prose, a one-word prompt and text that repeats itself: n-gram drafters find matches in some, none in others
PROMPTS = [
    "def add(a, b):\n    return",
    "The quick brown fox",
    "Hello",
    "Summarize the following text in one sentence. The quick brown fox jumps over the lazy dog.",
    "for i in range(10):",
    "Extract the names from: Alice met Bob",
    "def mul(a, b):\n    return a * b\ndef add(a, b):",
    "I am fine, thank you. Hello world! How are",
]


def greedy(n: int = 24, **kw) -> SamplingParams:
    """``n`` greedy tokens, EOS ignored (every run has the same length to compare)."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def token_ids(outs) -> list[list[int]]:
    """The first choice's token ids of each of ``LLM.generate``'s outputs."""
    return [o.outputs[0].token_ids for o in outs]


class VirtualClock:
    """Wraps an executor: ``clock`` is a virtual one that each step advances by what a small model's GPU step might
    cost (4 ms, plus 2 us a token), so that a draft policy pricing drafts by step times sees the same costs however
    loaded this machine is. Use as ``engine.executor = vc = VirtualClock(engine.executor); engine.clock = vc.clock``."""

    def __init__(self, inner):
        self.inner, self.now = inner, 0.0

    def clock(self) -> float:
        return self.now

    def execute(self, plan, draft_probs=None):
        self.now += 4e-3 + 2e-6 * plan.num_tokens
        return self.inner.execute(plan, draft_probs)

    def __getattr__(self, name):
        return getattr(self.inner, name)
