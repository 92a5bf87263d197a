"""What the engine-level tests share: the prompts their greedy comparisons run, greedy sampling parameters, the
token ids of ``LLM.generate``'s outputs and transformers' greedy ``generate`` of the same prompts, relaxed
acceptance's check against transformers' logits, executor wrappers (a recorder of plans and results, a virtual
clock for engines whose draft policy should not follow this machine's load; a counter of verified trees),
whether an engine's model was refused graphs on this GPU, and a chi-square test of sampled output against the
target's distribution. Imported
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

    def last_by_request(self) -> tuple[dict, dict, dict]:
        """The last step's worker drafts, their scores and (chunk, kept tokens), each by request id."""
        plan, result = self.steps[-1]
        none = [[]] * len(plan.chunks)
        return (dict(zip(result.req_ids, result.draft_token_ids or none)),
                dict(zip(result.req_ids, result.draft_scores or none)),
                {c.req_id: (c, kept) for c, kept in zip(plan.chunks, result.sampled_token_ids)})

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


CHAIN_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
               "adaptive": False}


def assert_drafts_and_graphs_equal_transformers(folder, no_host_sync, max_tokens: int = 12, fp8: bool = False):
    """Greedy tokens of ``folder``'s model equal transformers' ``generate`` for a batch of four; so do they with n-gram
    chains verified eagerly and n-gram trees from graphs (drafts accepted), whose forward (the one a capture records)
    syncs nothing with the host (``no_host_sync``: the conftest fixture); with ``fp8``, a run over an FP8 KV cache
    completes too."""
    import torch

    from specray import LLM

    prompts = PROMPTS[:4]
    plain = LLM(model=str(folder), max_model_len=256, block_size=4)
    want = token_ids(plain.generate(prompts, greedy(max_tokens), use_tqdm=False))
    assert_transformers_generates(folder, plain.get_tokenizer(), prompts, want)
    for spec, eager in ((CHAIN_NGRAM, True), ({**CHAIN_NGRAM, "num_branches": 2}, False)):
        llm = LLM(model=str(folder), max_model_len=256, block_size=4, speculative_config=spec, enforce_eager=eager)
        assert token_ids(llm.generate(prompts, greedy(max_tokens), use_tqdm=False)) == want
        assert llm.spec_stats.accepted_tokens > 0
    graphs = llm.engine.executor.worker.runner.graphs
    if not refused_on_this_gpu(llm):
        graph = next(iter(graphs.graphs.values()))  # the second ran from graphs
        with torch.inference_mode(), no_host_sync():
            graphs._step(graph.input_ids, graph.meta, graph.inputs)  # the forward a capture records
    if fp8:
        fp8_llm = LLM(model=str(folder), max_model_len=256, block_size=4, kv_cache_dtype="fp8")
        outs = token_ids(fp8_llm.generate(prompts, greedy(max_tokens), use_tqdm=False))
        assert [len(ids) for ids in outs] == [max_tokens] * len(prompts)


# ---- the sampled distribution ------------------------------------------------------------------------------------

SAMPLED = dict(temperature=0.7, top_k=3, max_tokens=3, ignore_eos=True)


def target_triples(target_dir, prompt: list[int], temperature: float) -> dict[tuple[int, int, int], float]:
    """{(x0, x1, x2): p(x0) p(x1 | x0) p(x2 | x0 x1)} of transformers' target after ``prompt``, each step warped as
    SAMPLED at ``temperature``."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from specray.sampling import SamplingBatch, logits_to_probs

    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    params = SamplingParams(**{**SAMPLED, "temperature": temperature})

    @torch.inference_mode()
    def probs(tokens: list[int]):
        logits = target(torch.tensor([tokens])).logits[0, -1:].float()
        return logits_to_probs(logits, SamplingBatch.build([params], [None], "cpu"))[0].double().numpy()

    out, p0 = {}, probs(prompt)
    for a in np.flatnonzero(p0):
        p1 = probs(prompt + [int(a)])
        for b in np.flatnonzero(p1):
            p2 = probs(prompt + [int(a), int(b)])
            out.update({(int(a), int(b), int(c)): p0[a] * p1[b] * p2[c] for c in np.flatnonzero(p2)})
    return out


def sampled_triples_pvalue(llm, prompt: list[int], expected: dict, n: int, first_seed: int = 0,
                           max_tokens: int = 3) -> float:
    """``n`` requests for ``prompt`` sampled as SAMPLED (``max_tokens`` of them, room for longer chains) with seeds
    ``first_seed``.. through ``llm``: the chi-square p-value of their first three tokens against ``expected`` (cells
    expected to hold fewer than 5 pooled into one; a token the target could not sample gives 0)."""
    import numpy as np
    from scipy.stats import chisquare

    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        [SamplingParams(seed=first_seed + i, **{**SAMPLED, "max_tokens": max_tokens})
                         for i in range(n)], use_tqdm=False)
    seen = [tuple(o.outputs[0].token_ids[:3]) for o in outs]
    keys = sorted(set(expected) | set(seen))
    observed = np.array([seen.count(k) for k in keys], dtype=float)
    p = np.array([expected.get(k, 0.0) for k in keys])
    if observed[p == 0].sum() > 0:
        return 0.0
    e = p / p.sum() * n
    small, big = (e > 0) & (e < 5), e >= 5
    if not small.any():
        return chisquare(observed[big], e[big]).pvalue
    return chisquare(np.append(observed[big], observed[small].sum()), np.append(e[big], e[small].sum())).pvalue


def check_sampled_distribution(llm, target_dir, prompt: list[int], max_tokens: int = 3) -> None:
    """``llm``'s sampled output after ``prompt`` (requests of ``max_tokens``) fits the target's distribution in its
    first three tokens (a p-value under 1e-3 decided by three times as many fresh seeds), with drafts both kept and
    rejected; and, a negative control, does not fit the target's distribution at T=1."""
    expected = target_triples(target_dir, prompt, SAMPLED["temperature"])
    value = sampled_triples_pvalue(llm, prompt, expected, 800, max_tokens=max_tokens)
    stats = llm.spec_stats
    assert stats.draft_tokens > stats.accepted_tokens > 0, stats
    if value <= 1e-3:
        value = sampled_triples_pvalue(llm, prompt, expected, 2400, first_seed=800, max_tokens=max_tokens)
    assert value > 1e-3
    at_one = target_triples(target_dir, prompt, 1.0)
    assert sampled_triples_pvalue(llm, prompt, at_one, 800, max_tokens=max_tokens) < 1e-3


def assert_images_greedy_equals_transformers(llm, hf, processor, text: str, images: list,
                                             plain_text: str = "The quick brown fox", max_tokens: int = 16,
                                             modality: str = "image", inputs: dict | None = None):
    """``llm``'s greedy tokens for ``text`` with ``images`` (``processor``: transformers' processor of the release)
    and for ``plain_text`` in the same batch equal transformers' ``generate`` of the whole model ``hf``, some drafts
    accepted; transformers without the images generates other tokens (the images matter). ``modality``: what
    ``images`` are (``"audio"``: waveforms, with ``inputs`` transformers' processor's output for them)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt": text, "multi_modal_data": {modality: images}}, plain_text], params,
                        use_tqdm=False)
    inputs = inputs if inputs is not None else processor(text=[text], images=images, return_tensors="pt")
    greedy = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                  pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**inputs, **greedy)
        tokens = llm.get_tokenizer().encode(plain_text)
        plain = hf.generate(torch.tensor([tokens]), **greedy)
        blind = hf.generate(inputs["input_ids"], **greedy)  # the placeholders' own embeddings, plain positions
    assert list(outs[0].outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()
    assert want[0].tolist() != blind[0].tolist()
    assert list(outs[1].outputs[0].token_ids) == plain[0, len(tokens):].tolist()
    assert llm.spec_stats.accepted_tokens > 0


def siblings_reversed(runner) -> None:
    """Wrap the runner's drafter so that each tree it drafts is renumbered level by level, each level's nodes in
    reverse: the same tree, its best path (what the accepting heads' trees mostly keep) now the last of each level,
    so that kept paths need the K/V moves a first path never does."""
    from specray.tree import depths

    draft = runner.drafter.draft

    def reversed_levels(*args, **kwargs):
        out = draft(*args, **kwargs)
        for made in out:
            if made is not None and made.parents is not None:
                level = depths(made.parents)
                order = sorted(range(len(level)), key=lambda n: (level[n], -n))
                where = {n: i for i, n in enumerate(order)}
                made.parents = [-1 if made.parents[n] < 0 else where[made.parents[n]] for n in order]
                made.token_ids = [made.token_ids[n] for n in order]
                made.scores = None if made.scores is None else [made.scores[n] for n in order]
        return out

    runner.drafter.draft = reversed_levels
