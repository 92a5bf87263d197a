"""Structured outputs (``SamplingParams.structured_outputs``): the request spec's checks, the grammar's cuts of
drafts and its masks, and the engine's outputs: they match the spec, greedy output equals an independent
grammar-masked greedy decoding over transformers' logits, and every drafter (forced tokens included) gives plain
decoding's output token for token; sampled outputs follow the constrained target distribution (a chi-square test
against the exact probabilities); bad specs are refused at admission and harm nobody."""
from __future__ import annotations

import collections
import json
import re
import sys

import jsonschema
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specray import LLM, SamplingParams, StructuredOutputsParams
from specray.sampling import apply_token_bitmask
from specray.structured_outputs import StructuredOutputs, allowed_tokens
from specray.tree import DraftTree

runs = sys.modules["specray_test_engine_runs"]

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}
SPECS = {
    "regex": StructuredOutputsParams(regex=r"(ab|cd|the ){2,6}x"),
    "choice": StructuredOutputsParams(choice=["yes please", "no thanks", "maybe", "the quick brown fox"]),
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "lark": StructuredOutputsParams(grammar='start: "(" item ("," item)* ")"\nitem: /[0-9]/ | "the"'),
}


def matches(spec: StructuredOutputsParams, text: str) -> bool:
    if spec.regex is not None:
        return re.fullmatch(spec.regex, text) is not None
    if spec.choice is not None:
        return text in spec.choice
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json)
        return True
    return re.fullmatch(r"\((?:[0-9]|the)(?:,(?:[0-9]|the))*\)", text) is not None


def constrained(spec, max_tokens=48, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec, **kw)


# ---- the request's spec ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": ["a", 3]},
                                    {"regex": ""}, {"json": 3}, {"json_object": "yes"},
                                    {"regex": "a", "disable_any_whitespace": 1}])
def test_a_spec_sets_exactly_one_valid_constraint(fields):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**fields).check()
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=fields)


def test_a_false_or_zero_constraint_is_named_as_wrong_not_taken_for_none():
    for fields, field in (({"json": False}, "json"), ({"json": 0}, "json"), ({"regex": False}, "regex"),
                          ({"choice": False}, "choice"), ({"grammar": 0}, "grammar")):
        with pytest.raises(ValueError, match=rf"structured_outputs\.{field}="):
            StructuredOutputsParams(**fields).check()
    StructuredOutputsParams(regex="a", json_object=False).check()  # json_object=False is no constraint


def test_sampling_params_take_a_dict():
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")


# ---- the grammar: cuts and masks ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from specray.models.loader import load_tokenizer
    return load_tokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_chains_are_cut_at_the_first_refused_draft_or_after_it_for_a_sampled_request(grammars, tokenizer):
    g = grammars.grammar(StructuredOutputsParams(regex="(ab)+c"))
    good = ids(tokenizer, "ababab")
    bad = ids(tokenizer, "x")
    assert g.constrain(good + bad + good, keep_refused=False)[0] == good
    assert g.constrain(good + bad + good, keep_refused=True)[0] == good + bad
    assert g.constrain(bad, keep_refused=False)[0] == []
    assert g.constrain(good, keep_refused=False)[0] == good
    assert g.num_tokens == 0 and g.constrain(good + bad, False)[0] == good  # nothing consumed


def test_trees_lose_refused_nodes_and_everything_under_them(grammars, tokenizer):
    g = grammars.grammar(StructuredOutputsParams(choice=["ab", "cd"]))
    a, b, c, x = (ids(tokenizer, s)[0] for s in "abcx")
    #  0:a  1:x  2:c     (root's children)   3:b under a   4:a under x   5:d-less: x under c
    tree = DraftTree([a, x, c, b, a, x], [-1, -1, -1, 0, 1, 2], scores=[.9, .8, .7, .6, .5, .4])
    pruned, kept = g.constrain(tree, keep_refused=False, prefix_only=False)
    assert kept == [0, 2, 3] and pruned.token_ids == [a, c, b] and pruned.parents == [-1, -1, 0]
    assert pruned.scores == [.9, .7, .6]
    prefix, kept = g.constrain(tree, keep_refused=False, prefix_only=True)
    assert kept == [0] and prefix.token_ids == [a]
    leaves, kept = g.constrain(tree, keep_refused=True)  # refused nodes stay as leaves; what is under them goes
    assert kept == [0, 1, 2, 3] and leaves.parents == [-1, -1, -1, 0]


def test_masks_are_the_allowed_tokens_after_each_draft_path(grammars, tokenizer):
    spec = StructuredOutputsParams(regex="(ab|cd)+x")
    g = grammars.grammar(spec)
    a, b, c, x = (ids(tokenizer, s)[0] for s in "abcx")
    tree = DraftTree([a, c, b, x], [-1, -1, 0, 0])  # node 3 (x after a) is refused
    rows = g.bitmasks(tree.token_ids, tree.parents)
    V = len(tokenizer)
    for row, path in zip(rows, [[], [a], [c], [a, b]]):
        fresh = grammars.grammar(spec)
        assert fresh.advance(path)
        reference = np.zeros((1, fresh.words), dtype=np.int32)
        fresh._fill(reference, 0)
        assert allowed_tokens(row, V) == allowed_tokens(reference[0], V)
    assert allowed_tokens(rows[4], V) == list(range(V))  # after a refused node: never read, all allowed
    assert b in allowed_tokens(rows[1], V) and x not in allowed_tokens(rows[1], V)
    assert x in allowed_tokens(rows[3], V)
    assert g.num_tokens == 0 and g.constrain([a, b, x], False)[0] == [a, b, x]  # the walk left no trace


def test_forced_tokens_and_termination(grammars, tokenizer):
    g = grammars.grammar(StructuredOutputsParams(choice=["the quick brown fox"]))
    forced = g.forced()
    assert tokenizer.decode(forced) == "the quick brown fox" and not g.terminated
    assert g.advance(forced) and g.terminated


@pytest.mark.parametrize("fields, fault", [({"regex": "[a-"}, "regex"), ({"json": {"type": "nope"}}, "json"),
                                           ({"json": "{not json"}, "JSON"), ({"grammar": "start: undefined_rule"},
                                                                             "grammar")])
def test_invalid_specs_raise_a_value_error_naming_the_field(grammars, fields, fault):
    with pytest.raises(ValueError, match=fault):
        grammars.grammar(StructuredOutputsParams(**fields))


def test_apply_token_bitmask_refuses_exactly_the_unset_bits():
    gen = torch.Generator().manual_seed(0)
    V = 70
    logits = torch.randn(5, V, generator=gen)
    words = torch.randint(-2**31, 2**31 - 1, (2, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    out = logits.clone()
    apply_token_bitmask(out, torch.tensor([1, 3]), words)
    for j, r in enumerate([1, 3]):
        allowed = allowed_tokens(words[j].numpy(), V)
        assert torch.isinf(out[r]).logical_not().nonzero().flatten().tolist() == allowed
        assert torch.equal(out[r, allowed], logits[r, allowed])
    assert torch.equal(out[[0, 2, 4]], logits[[0, 2, 4]])


# ---- the engine ------------------------------------------------------------------------------------------------

def reference_greedy(hf_model, grammars, prompt_ids, spec, max_tokens):
    """Grammar-masked greedy decoding, one token per transformers forward: the argmax of the allowed tokens until
    the grammar is complete (or EOS, or max_tokens)."""
    g = grammars.grammar(spec)
    out = []
    while len(out) < max_tokens and not g.terminated:
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt_ids + out])).logits[0, -1]
        row = np.zeros((1, g.words), dtype=np.int32)
        g._fill(row, 0)
        allowed = allowed_tokens(row[0], logits.shape[-1])
        token = allowed[int(torch.argmax(logits[allowed]))]
        out.append(token)
        if token == grammars.eos_token_ids[0]:
            break
        assert g.advance([token])
    return out


@pytest.fixture(scope="module")
def references(tiny_llama_dir, tokenizer, grammars):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return {name: [reference_greedy(hf, grammars, tokenizer.encode(p), spec, 48) for p in runs.PROMPTS]
            for name, spec in SPECS.items()}


def test_plain_greedy_equals_grammar_masked_greedy_over_transformers(plain, references):
    for name, spec in SPECS.items():
        outs = plain.generate(runs.PROMPTS, constrained(spec), use_tqdm=False)
        assert runs.token_ids(outs) == references[name], name
        for o in outs:
            if o.outputs[0].finish_reason == "stop":
                assert matches(spec, o.outputs[0].text), (name, o.outputs[0].text)
        assert any(o.outputs[0].finish_reason == "stop" for o in outs)
    assert plain.engine.scheduler.block_manager.num_free_blocks == plain.engine.scheduler.block_manager.num_blocks


DRAFTERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 6, "num_branches": 2, "adaptive": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "ngram_simple": {"method": "ngram_simple", "num_speculative_tokens": 4},
    "ngram_map_k": {"method": "ngram_map_k", "num_speculative_tokens": 4},
    "lookahead": runs.LOOKAHEAD,
    "draft_model": "draft",
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_every_drafter_keeps_greedy_constrained_output(name, tiny_llama_dir, tiny_draft_dir, references):
    spec = DRAFTERS[name]
    if spec == "draft":
        spec = {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3, "adaptive": False}
    with LLM(str(tiny_llama_dir), max_model_len=256, speculative_config=spec) as llm:
        for spec_name, structured in SPECS.items():
            outs = llm.generate(runs.PROMPTS, constrained(structured), use_tqdm=False)
            assert runs.token_ids(outs) == references[spec_name], (name, spec_name)
            one = llm.generate(runs.PROMPTS[:1], constrained(structured), use_tqdm=False)  # batch 1
            assert runs.token_ids(one) == references[spec_name][:1]
        assert llm.spec_stats.accepted_tokens > 0
        blocks = llm.engine.scheduler.block_manager
        assert blocks.num_free_blocks == blocks.num_blocks


def test_forced_tokens_are_drafted_and_accepted(plain, references):
    """A plain engine verifies the grammar's forced tokens as drafts: a JSON schema's keys take no steps of
    their own."""
    before = plain.spec_stats.accepted_tokens
    outs = plain.generate(runs.PROMPTS, constrained(SPECS["json"]), use_tqdm=False)
    assert runs.token_ids(outs) == references["json"]
    assert plain.spec_stats.accepted_tokens - before >= len(runs.PROMPTS) * 4  # '{"answer":"', ...


def test_constrained_and_free_requests_share_a_batch(tiny_llama_dir, references, plain_outputs):
    """Masks apply to the constrained rows only: free requests in the same steps keep their own output."""
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    with LLM(str(tiny_llama_dir), max_model_len=256, speculative_config=spec) as llm:
        params = [constrained(SPECS["regex"]) if i % 2 else runs.greedy() for i in range(len(runs.PROMPTS))]
        outs = runs.token_ids(llm.generate(runs.PROMPTS, params, use_tqdm=False))
        for i, out in enumerate(outs):
            assert out == (references["regex"][i] if i % 2 else plain_outputs[i])


def test_a_bad_spec_is_refused_at_admission_and_harms_nobody(plain, references):
    engine = plain.engine
    with pytest.raises(ValueError, match="regex"):
        engine.add_request([5, 6, 7], constrained(StructuredOutputsParams(regex="(unclosed")))
    assert not engine.has_unfinished_requests() and not engine._grammars
    outs = plain.generate(runs.PROMPTS[:2], constrained(SPECS["choice"]), use_tqdm=False)
    assert runs.token_ids(outs) == references["choice"][:2]


def test_constraints_that_leave_no_token_are_refused_or_fail_their_request_alone(plain, references, tokenizer):
    """allowed_token_ids holding none of the grammar's first tokens, or all banned by one-token bad_words, is a
    ValueError at admission; a grammar that runs out of allowed tokens later fails its request alone: its output comes
    back finished with the error (none vanishes), and the requests beside it keep their output."""
    engine = plain.engine
    first = tokenizer.encode("yes please")
    [seven] = tokenizer.encode("7")  # no choice starts with it
    with pytest.raises(ValueError, match="allowed_token_ids=.* holds no token the structured output allows first"):
        engine.add_request([5, 6, 7], constrained(SPECS["choice"], allowed_token_ids=[seven]))
    word = tokenizer.decode([first[0]])
    with pytest.raises(ValueError, match="are all banned by bad_words"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, allowed_token_ids=[first[0]], bad_words=[word]))
    assert not engine.has_unfinished_requests() and not engine._grammars
    # the first token of "yes please" only: the grammar's second position has nothing left
    stuck = constrained(SPECS["choice"], allowed_token_ids=[first[0]])
    ids = [engine.add_request(tokenizer.encode(p), stuck if i == 0 else constrained(SPECS["choice"]))
           for i, p in enumerate(runs.PROMPTS[:2])]
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(outs) == set(ids)
    failed = outs[ids[0]]
    assert failed.outputs[0].finish_reason == "error" and failed.refused  # the request's own fault
    assert failed.error.startswith("structured_outputs cannot be met") and "allowed_token_ids" in failed.error
    assert "after 1 output tokens" in failed.error, failed.error  # the one the grammar took
    assert outs[ids[1]].error is None and outs[ids[1]].outputs[0].token_ids == references["choice"][1]
    assert not engine.tracked and not engine._grammars


def test_json_object_and_penalties_and_logprobs(plain):
    """json_object gives an object; penalties shape the logits before the mask; logprobs stay the raw ones."""
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs={"json_object": True},
                            repetition_penalty=1.3, logprobs=1)
    out = plain.generate(runs.PROMPTS[:2], params, use_tqdm=False)
    for o in out:
        assert o.outputs[0].text.startswith("{")
        assert len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids)


# ---- sampling: the constrained target distribution ---------------------------------------------------------------

def exact_distribution(hf_model, grammars, prompt_ids, spec, temperature):
    """Every token sequence the (finite) grammar allows with its probability under the target's masked,
    temperature-scaled distribution, by enumeration."""
    out = {}

    def expand(prefix, prob):
        g = grammars.grammar(spec)
        assert g.advance(prefix)
        if g.terminated:
            out[tuple(prefix)] = prob
            return
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt_ids + prefix])).logits[0, -1]
        row = np.zeros((1, g.words), dtype=np.int32)
        g._fill(row, 0)
        allowed = allowed_tokens(row[0], logits.shape[-1])
        probs = torch.softmax(logits[allowed] / temperature, -1)
        for token, p in zip(allowed, probs.tolist()):
            expand(prefix + [token], prob * p)

    expand([], 1.0)
    return out


@pytest.mark.parametrize("drafter", ["plain", "draft_model", "ngram"])
def test_sampled_outputs_follow_the_constrained_target_distribution(drafter, tiny_llama_dir, tiny_draft_dir,
                                                                    tokenizer, grammars):
    """The draft model's q mostly draws tokens the grammar refuses: they are kept (as the first refused draft) and
    rejected, so the resampled token follows norm(max(0, p' - q)) and the output p'. Chi-square against the exact
    probabilities of every output the grammar allows."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    spec = StructuredOutputsParams(regex="[abc]{3}")
    prompt = "abc cab bca abc"  # n-gram drafts find matches in it
    prompt_ids = tokenizer.encode(prompt)
    expected = exact_distribution(hf, grammars, prompt_ids, spec, 1.0)
    spec_config = {"draft_model": {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3,
                                   "adaptive": False},
                   "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                             "adaptive": False},
                   "plain": None}[drafter]
    n = 3000
    with LLM(str(tiny_llama_dir), max_model_len=64, speculative_config=spec_config, max_num_seqs=256) as llm:
        params = SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=spec)
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        if drafter != "plain":
            assert llm.spec_stats.draft_tokens > 0
    counts = collections.Counter(tuple(o.outputs[0].token_ids) for o in outs)
    assert set(counts) <= set(expected)
    keys = sorted(expected, key=expected.get, reverse=True)
    probs = np.array([expected[k] for k in keys])
    assert abs(probs.sum() - 1) < 1e-4
    probs /= probs.sum()
    observed = np.array([counts.get(k, 0) for k in keys], dtype=float)
    big = probs * n >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(probs[big], probs[~big].sum()) * n
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp *= obs.sum() / exp.sum()
    assert chisquare(obs, exp).pvalue > 1e-3


COIN_DRAFTER = '''
from dataclasses import dataclass
import torch
from specray.drafters.base import Proposal
from specray.drafters.registry import options_of


@dataclass
class CoinOptions:
    good: int = 0
    bad: int = 0


class CoinDrafter:
    """One draft, drawn from q = {good: 1/2, bad: 1/2}, and that q."""
    Options = CoinOptions

    def __init__(self, spec, ctx):
        self.options, self.vocab_size = options_of(spec), ctx.vocab_size
        self.gen = torch.Generator().manual_seed(0)

    def propose(self, batch):
        out = []
        for req in batch:
            q = torch.zeros(1, self.vocab_size)
            q[0, self.options.good] = q[0, self.options.bad] = 0.5
            token = self.options.good if torch.rand(1, generator=self.gen).item() < 0.5 else self.options.bad
            out.append(Proposal([token], probs=q) if req.num_speculative_tokens else Proposal([]))
        return out

    def finish(self, req_ids):
        pass

    def shutdown(self):
        pass
'''


def test_a_refused_draft_drawn_from_q_is_kept_and_rejected(tiny_llama_dir, tokenizer, grammars, tmp_path,
                                                          monkeypatch):
    """A drafter whose q gives half its mass to a token the grammar refuses: the refused draft must stay (and be
    rejected) so that the token is resampled from norm(max(0, p' - q)); cutting it off would sample p' there and
    give the good token about (1/2) p' + min(1/2, p') instead of p'. The first token's frequencies, chi-square."""
    from transformers import AutoModelForCausalLM
    (tmp_path / "coin_drafter.py").write_text(COIN_DRAFTER)
    monkeypatch.syspath_prepend(str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    spec = StructuredOutputsParams(regex="c[ab]")  # "c" from the prefill, then one drafted position
    prompt = "abc cab bca abc"
    a, b, c, x = (ids(tokenizer, s)[0] for s in "abcx")
    expected = exact_distribution(hf, grammars, tokenizer.encode(prompt), spec, 1.0)
    assert (c, a) in expected and (c, b) in expected
    n = 4000
    config = {"method": "coin_drafter:CoinDrafter", "num_speculative_tokens": 1, "adaptive": False, "good": a,
              "bad": x}
    with LLM(str(tiny_llama_dir), max_model_len=64, speculative_config=config, max_num_seqs=256) as llm:
        outs = llm.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=4, structured_outputs=spec),
                            use_tqdm=False)
        drafted = llm.spec_stats.draft_tokens
    counts = collections.Counter(tuple(o.outputs[0].token_ids) for o in outs)
    assert drafted >= (counts[c, a] + counts[c, b]) > n / 4  # every request past "c" verified a draft
    keys = sorted(expected)
    observed = np.array([counts[k] for k in keys], dtype=float)
    assert observed.sum() == n
    p = np.array([expected[k] for k in keys])
    assert chisquare(observed, p / p.sum() * n).pvalue > 1e-3


def test_grammar_termination_ends_the_request_where_plain_decoding_ends_it(plain, tiny_llama_dir):
    """The grammar completes on a forced token whose step also kept the target's EOS: the request ends at the
    grammar's end, with the tokens plain decoding gives one at a time; also with ``min_tokens`` beyond it and
    ``ignore_eos`` (nothing can follow a complete answer)."""
    spec = SPECS["choice"]
    engine = plain.engine
    one_by_one = []
    engine.forced_draft_limit = 0
    try:
        one_by_one = runs.token_ids(plain.generate(runs.PROMPTS, constrained(spec), use_tqdm=False))
    finally:
        engine.forced_draft_limit = 16
    assert runs.token_ids(plain.generate(runs.PROMPTS, constrained(spec), use_tqdm=False)) == one_by_one
    for extra in ({"min_tokens": 40}, {"ignore_eos": True}):
        outs = plain.generate(runs.PROMPTS, constrained(spec, **extra), use_tqdm=False)
        assert runs.token_ids(outs) == one_by_one, extra
        assert all(o.outputs[0].finish_reason == "stop" for o in outs), extra


# ---- a reasoning model: the grammar governs what follows the thinking phase --------------------------------------

THINK = ("<think>", "</think>")


@pytest.fixture(scope="module")
def thinking_dir(make_tiny_model, tmp_path_factory):
    """A tiny model whose tokenizer has <think> and </think> as single tokens."""
    return make_tiny_model(tmp_path_factory.mktemp("thinking"), "llama", tie_word_embeddings=True,
                           extra_special_tokens=THINK)


def thinking_grammars(thinking_dir, parser):
    from specray.models.loader import load_tokenizer
    tok = load_tokenizer(thinking_dir)
    return tok, StructuredOutputs(tok, len(tok), [tok.eos_token_id], reasoning_parser=parser)


def test_the_grammar_waits_for_the_end_of_the_thinking_phase(thinking_dir):
    tok, grammars = thinking_grammars(thinking_dir, "deepseek_r1")
    begin, end = grammars.thinking_ids()
    spec = StructuredOutputsParams(regex="(ab)+x")
    a, b, x, z = (ids(tok, s)[0] for s in "abxz")
    g = grammars.grammar(spec, ids(tok, "hello"))
    assert not g.active and g.forced() == [] and not g.terminated
    V = len(tok)
    # free before </think> (z is anything), governed after it: z after </think> is refused
    assert g.constrain([z, z, end, a, b, z, a], keep_refused=False)[0] == [z, z, end, a, b]
    assert g.constrain([z, z], keep_refused=False)[0] == [z, z]
    rows = g.bitmasks([z, end, a], None)
    assert allowed_tokens(rows[0], V) == allowed_tokens(rows[1], V) == list(range(V))  # thinking: unmasked
    assert a in allowed_tokens(rows[2], V) and z not in allowed_tokens(rows[2], V)  # after </think>
    assert allowed_tokens(rows[3], V) == [b]
    tree = DraftTree([z, end, end, z, a], [-1, 0, -1, 2, 2])  # z </think> | </think> z(refused) | </think> a
    pruned, kept = g.constrain(tree, keep_refused=False, prefix_only=False)
    assert kept == [0, 1, 2, 4]
    assert g.advance([z, z, end]) and g.active and g.num_tokens == 3
    assert g.advance([a, b]) and not g.advance([z])
    # qwen3: the prompt's last thinking tag decides (Qwen3 with enable_thinking=False closes an empty one)
    _, qwen = thinking_grammars(thinking_dir, "qwen3")
    assert qwen.grammar(spec, [begin, 5, end]).active
    assert not qwen.grammar(spec, [end, 5, begin]).active and not qwen.grammar(spec, [5, 6]).active


def test_a_reasoning_parser_the_tokenizer_cannot_tell_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="reasoning_parser"):
        LLM(str(tiny_llama_dir), max_model_len=64, reasoning_parser="nope")
    with pytest.raises(ValueError, match="</think>"):
        LLM(str(tiny_llama_dir), max_model_len=64, reasoning_parser="deepseek_r1")


def test_reasoning_outputs_think_freely_then_follow_the_grammar_with_every_drafter(thinking_dir):
    """A bias on </think> ends the thinking phase a few tokens in (the tiny model never would): what precedes it
    is free, what follows matches the regex, and every drafter gives plain decoding's tokens."""
    from specray.models.loader import load_tokenizer
    tok = load_tokenizer(thinking_dir)
    end = tok.convert_tokens_to_ids("</think>")
    spec = StructuredOutputsParams(regex="(ab|cd|the ){2,6}x")
    with LLM(str(thinking_dir), max_model_len=256, reasoning_parser="deepseek_r1") as plain_llm:
        for bias in (1.0, 1.5, 2.0, 3.0, 4.0):
            params = constrained(spec, logit_bias={end: bias})
            reference = plain_llm.generate(runs.PROMPTS, params, use_tqdm=False)
            late = [o.outputs[0].token_ids.index(end) for o in reference if end in o.outputs[0].token_ids]
            if sum(i >= 2 for i in late) >= 2:
                break
        assert sum(i >= 2 for i in late) >= 2, late  # thinking a few tokens, then the answer
        for o in reference:
            out = o.outputs[0].token_ids
            if end in out and o.outputs[0].finish_reason == "stop":
                answer = tok.decode(out[out.index(end) + 1:], skip_special_tokens=True)
                assert re.fullmatch(spec.regex, answer), answer
        assert any(o.outputs[0].finish_reason == "stop" for o in reference)
    for config in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False},
                   {"method": "ngram", "num_speculative_tokens": 6, "num_branches": 2, "adaptive": False},
                   {"method": "draft_model", "model": str(thinking_dir), "num_speculative_tokens": 3,
                    "adaptive": False}):
        with LLM(str(thinking_dir), max_model_len=256, reasoning_parser="deepseek_r1",
                 speculative_config=config) as llm:
            assert runs.token_ids(llm.generate(runs.PROMPTS, params, use_tqdm=False)) == runs.token_ids(reference)
            assert llm.spec_stats.accepted_tokens > 0


def test_the_servers_reasoning_parser_reaches_the_engine(tiny_llama_dir):
    """``specray serve --reasoning-parser`` (a server key) also sets the engine's, whose grammars wait for the
    thinking to end; given only in engine_kwargs, the server splits with it too; given both ways, it is refused."""
    pytest.importorskip("ray")  # the server's module imports it (a GPU image may lack it)
    from specray.cluster.serve import ServeArgs
    top = ServeArgs.from_dict({"model": str(tiny_llama_dir), "reasoning_parser": "qwen3"})
    assert top.engine_kwargs["reasoning_parser"] == "qwen3" and top.engine_args().reasoning_parser == "qwen3"
    nested = ServeArgs.from_dict({"model": str(tiny_llama_dir), "engine_kwargs": {"reasoning_parser": "deepseek_r1"}})
    assert nested.reasoning_parser == "deepseek_r1"
    with pytest.raises(ValueError, match="give it once"):
        ServeArgs.from_dict({"model": str(tiny_llama_dir), "reasoning_parser": "qwen3",
                             "engine_kwargs": {"reasoning_parser": "deepseek_r1"}})


def test_seeded_sampling_is_the_same_with_and_without_forced_drafts(plain):
    """Forced tokens are verified by coupling (the target samples its own token, keyed by seed and position, and
    keeps a draft iff it is that token), so a seeded request samples the tokens it samples one at a time."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=32, structured_outputs=SPECS[name])
              for s, name in enumerate(["json", "choice", "regex", "lark"] * 2)]
    engine = plain.engine
    engine.forced_draft_limit = 0
    try:
        one_by_one = runs.token_ids(plain.generate(runs.PROMPTS, params, use_tqdm=False))
    finally:
        engine.forced_draft_limit = 16
    before = plain.spec_stats.draft_tokens
    assert runs.token_ids(plain.generate(runs.PROMPTS, params, use_tqdm=False)) == one_by_one
    assert plain.spec_stats.draft_tokens > before


def test_a_draft_model_drafts_under_the_grammar(tiny_llama_dir, tiny_draft_dir, tokenizer, grammars, references):
    """The draft model masks each draft step's logits by the grammar after the history and the drafts before it:
    every proposal is one the grammar accepts whole (none is cut), greedy output is unchanged."""
    spec = {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 4, "adaptive": False}
    with LLM(str(tiny_llama_dir), max_model_len=256, speculative_config=spec) as llm:
        drafter = llm.engine.drafter
        propose = drafter.propose
        seen = []
        # each history as it was when drafted (a DraftRequest's token_ids is the request's live list)
        drafter.propose = lambda batch: seen.append(([(list(d.token_ids), d.num_prompt_tokens) for d in batch],
                                                     propose(batch))) or seen[-1][1]
        for name, structured in SPECS.items():
            seen.clear()
            outs = llm.generate(runs.PROMPTS, constrained(structured), use_tqdm=False)
            assert runs.token_ids(outs) == references[name]
            checked = 0
            for batch, proposals in seen:
                for (history, num_prompt), proposal in zip(batch, proposals):
                    g = grammars.grammar(structured)
                    assert g.advance(history[num_prompt:])
                    if proposal.token_ids and not g.terminated:
                        assert g.constrain(list(proposal.token_ids), keep_refused=False)[0] == proposal.token_ids
                        checked += 1
            assert checked > 0, name
        assert all(s.grammar is None or s.grammar.num_tokens == len(s.grammar_tokens)
                   for s in drafter.states.values())  # every draft read was rolled back


def test_a_grammar_rolls_back_across_the_end_of_the_thinking_phase(thinking_dir):
    tok, grammars = thinking_grammars(thinking_dir, "deepseek_r1")
    _, end = grammars.thinking_ids()
    a, b, x, z = (ids(tok, s)[0] for s in "abxz")
    g = grammars.grammar(StructuredOutputsParams(regex="(ab)+x"), [5])
    assert g.advance([z, z]) and g.advance([end, a])
    g.rollback(1)
    assert g.active and g.num_tokens == 3 and g.constrain([a, b, x], False)[0] == [a, b, x]
    g.rollback(2)  # back before </think>: thinking again, the matcher at its start
    assert not g.active and g.num_tokens == 1 and g.constrain([z, end, a], False)[0] == [z, end, a]
    assert g.advance([z, end, a, b, x]) and g.terminated
