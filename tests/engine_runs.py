"""What the engine-level tests share: the prompts their greedy comparisons run, greedy sampling parameters, the
token ids of ``LLM.generate``'s outputs and transformers' greedy ``generate`` of the same prompts, relaxed
acceptance's check against transformers' logits, executor wrappers (a recorder of plans and results, a virtual
clock for engines whose draft policy should not follow this machine's load; a counter of verified trees), and
whether an engine's model was refused graphs on this GPU. Imported
as ``specray_test_engine_runs`` (tests/conftest.py registers it)."""
from __future__ import annotations

import torch

from specray import SamplingParams

# lookahead decoding's default window (W=4, N=3, G=4: 15 nodes): test_lookahead checks its drafts, test_trees its
# exactness under preemption, chunked prefill and stop strings
LOOKAHEAD = {"method": "lookahead", "num_speculative_tokens": 15, "adaptive": False}

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


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    """``max_tokens`` greedy tokens, EOS ignored (every run has the same length to compare)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def generate_greedy(llm, batch: int):
    """Every prompt greedily: one request at a time (batch 1), or all at once."""
    if batch == 1:
        return [o for p in PROMPTS for o in llm.generate([p], greedy(), use_tqdm=False)]
    return llm.generate(PROMPTS, greedy(), use_tqdm=False)


def token_ids(outs) -> list[list[int]]:
    """The first choice's token ids of each of ``LLM.generate``'s outputs."""
    return [o.outputs[0].token_ids for o in outs]


def assert_transformers_generates(folder, tokenizer, prompts: list[str], ours: list[list[int]],
                                  model_class=None) -> None:
    """transformers' greedy ``generate`` of the model in ``folder`` (fp32, EOS ignored) gives each prompt the tokens
    ``ours`` holds for it, token for token. ``model_class``: transformers' class, where its auto class has none."""
    from transformers import AutoModelForCausalLM

    hf = (model_class or AutoModelForCausalLM).from_pretrained(folder, dtype=torch.float32).eval()
    for text, want in zip(prompts, ours, strict=True):
        ids = torch.tensor([tokenizer.encode(text)])
        out = hf.generate(ids, max_new_tokens=len(want), min_new_tokens=len(want), do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert out[0, ids.shape[1]:].tolist() == want, text


def assert_ngram_greedy_equals_transformers(folder, model_class=None, max_tokens: int = 16):
    """``specray.LLM`` on the model in ``folder`` with n-gram drafts (chains of 3) gives the first four prompts'
    greedy tokens as transformers' ``generate`` does, some drafts accepted. Returns the engine."""
    from specray import LLM

    llm = LLM(model=str(folder), max_model_len=256, block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    got = token_ids(llm.generate(PROMPTS[:4], greedy(max_tokens), use_tqdm=False))
    assert_transformers_generates(folder, llm.get_tokenizer(), PROMPTS[:4], got, model_class)
    assert llm.spec_stats.accepted_tokens > 0
    return llm


def check_candidates(hf_model, prompt_ids, output, begin, end, topk, delta):
    """Each output token against transformers' logits at its position: inside the thinking phase (the later of
    the last ``begin`` and the last ``end`` before it is ``begin``) one of the topk within delta of the best,
    outside it the argmax (a near tie, under 1e-4, either way). Returns how many tokens were kept inside the phase
    that are not the argmax."""
    ids = torch.tensor([prompt_ids + output])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt_ids) - 1: -1]  # the row predicting each output token
    off_argmax, inside = 0, False
    for t in prompt_ids:
        inside = True if t == begin else False if t == end else inside
    for row, token in zip(logits, output):
        best = float(row.max())
        gap = best - float(row[token])
        if inside:
            rank = int((row > row[token] + 1e-4).sum())  # tokens clearly better than it
            assert rank < topk and gap <= delta + 1e-4, (token, rank, gap)
            off_argmax += gap > 1e-4
        else:
            assert gap < 1e-4, (token, gap)
        inside = True if token == begin else False if token == end else inside
    return off_argmax


class Recorder:
    """Wraps an executor: keeps every (plan, result) pair."""

    def __init__(self, inner):
        self.inner, self.steps = inner, []

    def execute(self, plan, draft_probs=None):
        result = self.inner.execute(plan, draft_probs)
        self.steps.append((plan, result))
        return result

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def chunks(self):
        """(chunk, kept tokens, worker drafts) of every step."""
        for plan, result in self.steps:
            drafts = result.draft_token_ids or [[]] * len(plan.chunks)
            yield from zip(plan.chunks, result.sampled_token_ids, drafts)


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


class PathCounter(VirtualClock):
    """Wraps an executor: counts verified trees and accepted paths that were not the first nodes; its virtual
    clock (``engine.clock = counter.clock``) keeps the draft policy off this machine's load."""

    def __init__(self, inner):
        super().__init__(inner)
        self.trees, self.moved, self.last_moved = 0, 0, set()

    def execute(self, plan, draft_probs=None):
        result = super().execute(plan, draft_probs)
        self.trees += sum(c.draft_parents is not None for c in plan.chunks)
        paths = result.accepted_draft_indices or [[]] * len(plan.chunks)
        self.last_moved = {rid for rid, path in zip(result.req_ids, paths) if path != list(range(len(path)))}
        self.moved += len(self.last_moved)
        return result


def refused_on_this_gpu(llm) -> bool:
    """Whether this engine's model runs eagerly as its grouped matmul would sync here: never on CPU; on a GPU in the
    suite's fp32 (or on a compute capability without torch's grouped kernel), with the reason in its refusal."""
    from specray.models.step_graphs import graph_safe

    worker = llm.engine.executor.worker
    why = graph_safe(worker.model)
    if why is None:
        return False
    assert worker.device.type == "cuda" and "host" in why and worker.runner.graphs is None, why
    return True
