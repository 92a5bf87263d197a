"""specray train-draft: training-time test equals serving's drafting, and the pipeline trains a head that drafts.

Tiny random target (6 layers, so EAGLE-3's layers 2, L/2, L-3 exist); prompts from a file."""

import json
import shutil
from dataclasses import asdict

import pytest
import torch

from specray import LLM, SamplingParams
from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import load_hf_config, load_model
from specray.training.data import DataConfig, make_prompts
from specray.training.pipeline import PipelineConfig, run
from specray.training.train import TrainConfig, build_draft, load_trained, train_module, unroll

PROMPTS = ["def add(a, b):", "Hello world", "The quick brown fox", "for i in range(10):", "Summarize the text",
           "Extract the names", "How are you today?", "print(i)"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, make_tiny_model):
    return make_tiny_model(tmp_path_factory.mktemp("train_target"), "llama", seed=5, num_hidden_layers=6,
                           tie_word_embeddings=True)


def nudged_draft(target_dir, train: TrainConfig, vocab_ids: torch.Tensor | None, seed: int):
    """The target, its config, a fresh draft for it (:func:`build_draft`; ``vocab_ids`` None: the whole vocabulary)
    with every weight nudged off its start, and 40 random token ids."""
    target = load_model(str(target_dir), pack=False)
    config = load_hf_config(str(target_dir))
    draft = build_draft(target, config, train, torch.arange(config.vocab_size) if vocab_ids is None else vocab_ids)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(seed))
    return target, config, draft, ids


@pytest.mark.parametrize("method", ["eagle3", "eagle", "mtp"])
def test_unrolled_training_steps_equal_paged_drafting(target_dir, method):
    """What training optimises is what serving runs: the training-time-test unroll's step j at position R + j
    equals a first pass over positions 0..R through the paged cache followed by j one-token draft steps, each fed
    the head's own feedback (and the true next token)."""
    target, config, head, ids = nudged_draft(target_dir, TrainConfig(method=method, draft_vocab_size=64,
                                                                      init_from_target=False),
                                             torch.arange(0, 128, 2), seed=1)
    allocate_kv_cache(target, 8, 16)
    table = [5, 2, 7, 0]  # shuffled blocks
    with torch.no_grad():
        meta = build_attention_metadata([40], [0], [table], 16)
        out = target(ids, meta, aux_layers=head.aux_layers) if head.aux_layers else (target(ids, meta), [])
        hidden, aux = out
        features = torch.cat(aux, -1) if aux else hidden
        steps = 3
        trained = unroll(head, ids[1:][None], features[:-1][None], torch.ones(1, 39, dtype=torch.bool), steps)
        allocate_kv_cache(head, 8, 16)
        r = 30
        feats = head.target_features(hidden[: r + 1], [a[: r + 1] for a in aux])
        # the first pass in two chunks, as a chunked prefill writes it
        fb, normed = None, None
        for a, b in ((0, 17), (17, r + 1)):
            m = build_attention_metadata([b - a], [a], [table], 16)
            fb, normed = head(ids[a + 1 : b + 1], feats[a:b], m)
        got = [normed[-1]]
        feedback = fb[-1:]
        for j in range(1, steps):
            m = build_attention_metadata([1], [r + j], [table], 16)
            feedback, normed = head(ids[r + j + 1 : r + j + 2], feedback, m)
            got.append(normed[0])
    for j in range(steps):
        torch.testing.assert_close(got[j], trained[j][0, r + j], rtol=1e-4, atol=1e-4)


def test_unrolled_mtp_modules_equal_paged_drafting(target_dir):
    """Distinct MTP modules trained as served: module k's teacher-forced output placed at R + k equals every module run
    over positions 0..R through the paged cache (a first pass in two chunks, as a chunked prefill writes it), module k
    reading t[q + 1 + k] and module k - 1's output, its row at R the draft k + 1 made after t[R + 1]."""
    target, config, modules, ids = nudged_draft(target_dir, TrainConfig(method="mtp", mtp_num_modules=3,
                                                                         init_from_target=False), None, seed=2)
    allocate_kv_cache(target, 8, 16)
    table = [5, 2, 7, 0]  # shuffled blocks
    r = 30
    with torch.no_grad():
        hidden = target(ids, build_attention_metadata([40], [0], [table], 16))
        trained = unroll(modules, ids[1:][None], hidden[:-1][None], torch.ones(1, 39, dtype=torch.bool), 1)
        allocate_kv_cache(modules, 8, 16)
        got, feeds = [], hidden[: r + 1]  # module 0 reads the target's rows, module k module k - 1's
        for k in range(3):
            outs = []
            for a, b in ((0, 17), (17, r + 1)):
                m = build_attention_metadata([b - a], [a], [table], 16)
                outs.append(modules.module(k, ids[a + 1 + k: b + 1 + k], feeds[a:b], m))
            feeds = torch.cat([fb for fb, _ in outs])
            got.append(outs[-1][1][-1])
    assert len(trained) == 3
    for k in range(3):
        torch.testing.assert_close(got[k], trained[k][0, r + k], rtol=1e-4, atol=1e-4)


def tiny_data(tmp_path) -> DataConfig:
    """The data stage's settings for the pipeline tests: 32 samples from the prompts above, 40-token answers."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS * 4))
    return DataConfig(num_prompts=32, prompt_file=str(prompts), answer_max_tokens=40, batch_size=16)


def served_like_plain(target_dir, spec: dict):
    """Greedy chats with ``spec`` equal plain ones; returns the speculating engine's stats."""
    sp = SamplingParams(temperature=0, max_tokens=32)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:4]]
    plain = [o.outputs[0].token_ids for o in LLM(str(target_dir)).chat(chats, sp, use_tqdm=False)]
    llm = LLM(str(target_dir), speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.chat(chats, sp, use_tqdm=False)] == plain
    return llm.spec_stats


def test_train_draft_pipeline_trains_resumes_and_drafts(tmp_path, target_dir):
    """The whole pipeline on a tiny target: data, features, training (stopped and resumed), export. The head
    agrees with the target on held-out text and, served, keeps greedy output identical while getting drafts
    accepted."""
    data = tiny_data(tmp_path)
    train = dict(method="eagle3", lr=3e-3, draft_vocab_size=128, tokens_per_batch=512, warmup_steps=5,
                 checkpoint_every=5, eval_fraction=0.15)
    out = tmp_path / "out"
    first = run(PipelineConfig(str(target_dir), str(out), data, TrainConfig(epochs=2, **train),
                               stages=("data", "features", "train")))
    assert len((out / "samples.jsonl").read_text().splitlines()) == 32
    step = torch.load(out / "train" / "checkpoint.pt", weights_only=False)["step"]
    assert step == first["step"] > 0
    # the same command with more epochs goes on from the checkpoint (features are not recomputed)
    # (a later command's own data options do not reach the head's card: the data stage's, kept in data.json, do)
    second = run(PipelineConfig(str(target_dir), str(out), DataConfig(num_prompts=999), TrainConfig(epochs=12, **train),
                                stages=("features", "train", "export")))
    assert second["step"] > step and second["draft_vocab_size"] <= 128
    assert second["agreement"][0] > 0.5, second
    assert second["mean_accepted_length"] > 1.5, second
    card = json.loads((out / "head" / "card.json").read_text())
    assert card["held_out"]["step"] == second["step"]
    assert card["data"]["samples"] == 32 and card["data"]["num_prompts"] == data.num_prompts, card["data"]

    stats = served_like_plain(target_dir, {"method": "eagle3", "model": str(out / "head"),
                                           "num_speculative_tokens": 3, "adaptive": False})
    assert stats.acceptance_rate > 0.3, stats.as_dict()


class _FakeLLM:
    """Stands in for the target in the prompt stage: each sample's text is decided by its seed (few distinct
    texts, so repeats happen), and ``stop`` decides whether it ended on EOS."""

    def __init__(self, tokenizer, distinct: int = 40, stop: bool = True):
        self.tokenizer, self.distinct, self.stop, self.seeds = tokenizer, distinct, stop, []

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, params, use_tqdm=False):
        from types import SimpleNamespace

        outs = []
        for p in params:
            self.seeds.append(p.seed)
            text = f"question number {p.seed % self.distinct}?"
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(text=text, finish_reason="stop" if self.stop
                                                                 else "length")]))
        return outs


def test_magpie_prompts_resume_without_repeats(tmp_path, target_dir):
    from specray.models.loader import load_tokenizer
    from specray.training.data import make_prompts, read_jsonl, user_turn_prefix

    tok = load_tokenizer(str(target_dir))
    assert user_turn_prefix(tok) == "<|im_start|>user\n"
    fake = _FakeLLM(tok)
    first = make_prompts(fake, DataConfig(num_prompts=10, batch_size=8), str(tmp_path))
    again = _FakeLLM(tok)  # a new run in the same folder goes on from the 10 it finds
    both = make_prompts(again, DataConfig(num_prompts=20, batch_size=8), str(tmp_path))
    assert both[:10] == first and len(both) == 20 == len(set(both))
    assert [r["prompt"] for r in read_jsonl(str(tmp_path / "prompts.jsonl"))] == both
    assert not set(fake.seeds) & set(again.seeds)  # the resumed run drew new samples
    with pytest.raises(ValueError, match="prompt-file"):
        make_prompts(_FakeLLM(tok, stop=False), DataConfig(num_prompts=5, batch_size=4), str(tmp_path / "none"))


def test_a_prompt_longer_than_the_target_is_named_before_any_answer(tmp_path, target_dir):
    """A prompt of the prompt file that leaves no room for an answer is a ValueError naming it and the limit, raised
    before the target answers any prompt (not the engine's error about some prompt_token_ids)."""
    from types import SimpleNamespace

    from specray.models.loader import load_tokenizer
    from specray.training.data import make_samples

    def generate(*args, **kwargs):
        raise AssertionError("answered before the prompts were checked")

    llm = SimpleNamespace(get_tokenizer=lambda: load_tokenizer(str(target_dir)), generate=generate,
                          engine=SimpleNamespace(max_model_len=64))
    with pytest.raises(ValueError, match=r"^prompt 2 of the prompts \('word word.*\) is \d+ tokens in the "
                                         r"chat template, and the target's max_model_len=64 .*shorten it"):
        make_samples(llm, ["Hello", "word " * 100], DataConfig(), str(tmp_path))


# per method: its own training options, what its export writes, how it is served
WHOLE_MODULES = {
    "medusa": (dict(medusa_num_heads=4), 4, lambda head: (head / "medusa_lm_head.safetensors").exists(),
               {"num_speculative_tokens": 6}),
    "redrafter": (dict(ttt_steps=3), 3,
                  lambda head: json.loads((head / "config.json").read_text())["model_type"] ==
                  "recurrent_drafting_drafter",
                  {"num_speculative_tokens": 6, "redrafter_num_beams": 3, "redrafter_draft_len_per_beam": 3}),
    "mlp_speculator": (dict(ttt_steps=3), 3,
                       lambda head: json.loads((head / "config.json").read_text())["model_type"] == "mlp_speculator",
                       {"num_speculative_tokens": 3}),
    "dflash": (dict(dflash_block_size=4, dflash_num_layers=1, dflash_anchors=8), 3,
               lambda head: json.loads((head / "config.json").read_text())["architectures"] == ["DFlashDraftModel"],
               {"num_speculative_tokens": 3}),
    # three distinct MTP modules (DeepSeek's layout: model.layers.{L + k}), served as chains and as EAGLE-2 trees
    "mtp-modules": (dict(mtp_num_modules=3), 3,
                    lambda head: json.loads((head / "config.json").read_text())["num_nextn_predict_layers"] == 3,
                    {"num_nextn_predict_layers": 3}),
}


@pytest.mark.parametrize("method", list(WHOLE_MODULES))
def test_train_draft_whole_module_trains_resumes_and_drafts(tmp_path, target_dir, method):
    """``--method medusa``, ``redrafter``, ``mlp_speculator``, ``dflash`` and ``mtp --mtp-num-modules 3``: the
    pipeline trains the heads (Medusa's), the recurrent drafter, the MLP speculator, the DFlash model or the MTP
    modules on the target's own text (stopped after one step and resumed from its checkpoint); each head, each
    teacher-forced draft step, stage or module or each block row agrees with the target on held-out text; they are
    written in their public layout (FasterDecoding's, Apple's, IBM's, z-lab's, DeepSeek's), and served (a token tree;
    chains; distinct modules' chains and trees) they keep greedy output identical while getting drafts accepted."""
    options, steps, written, serving = WHOLE_MODULES[method]
    method = method.partition("-")[0]
    data = tiny_data(tmp_path)
    train = dict(method=method, lr=3e-3, tokens_per_batch=512, warmup_steps=5, checkpoint_every=5,
                 eval_fraction=0.15, **options)
    out = tmp_path / "out"
    run(PipelineConfig(str(target_dir), str(out), data, TrainConfig(epochs=0.01, **train),
                       stages=("data", "features", "train")))
    first = torch.load(out / "train" / "checkpoint.pt", weights_only=False)["step"]
    if method == "dflash":  # resumed, each step draws the anchors an unstopped run draws: the same weights
        unstopped = tmp_path / "unstopped"
        shutil.copytree(out, unstopped, ignore=shutil.ignore_patterns("train"))
        for folder in (out, unstopped):
            run(PipelineConfig(str(target_dir), str(folder), data, TrainConfig(epochs=1, **train), stages=("train",)))
        resumed, whole = (torch.load(f / "train" / "checkpoint.pt", weights_only=False) for f in (out, unstopped))
        assert resumed["step"] == whole["step"] > first
        assert all(torch.equal(resumed["head"][k], whole["head"][k]) for k in whole["head"])
    trained = run(PipelineConfig(str(target_dir), str(out), data, TrainConfig(epochs=12, **train),
                                 stages=("features", "train", "export")))
    assert trained["step"] > first >= 1 and "draft_vocab_size" not in trained  # the target's whole vocabulary
    assert len(trained["agreement"]) == steps and min(trained["agreement"]) > 0.5, trained
    if method in ("redrafter", "mlp_speculator"):
        assert trained["expected_accepted_length_one_beam"] > 1.5, trained
    assert written(out / "head")
    assert json.loads((out / "head" / "card.json").read_text())["method"] == method

    stats = served_like_plain(target_dir, {"method": method, "model": str(out / "head"), "adaptive": False, **serving})
    assert stats.accepted_tokens > 0, stats.as_dict()
    if "num_nextn_predict_layers" in serving:  # distinct modules' trees too
        tree = {"use_dynamic_tree": True, "dynamic_tree_max_topK": 2, "dynamic_tree_depth": 3}
        stats = served_like_plain(target_dir, {"method": method, "model": str(out / "head"), "adaptive": False,
                                               **serving, **tree})
        assert stats.accepted_tokens > 0, stats.as_dict()


def _written(path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


SAMPLE = '{"prompt": 0, "token_ids": [1, 2, 3], "num_prompt_tokens": 1}\n'  # a samples.jsonl record


def _checkpoint(folder, **options) -> str:
    """``folder`` holding a checkpoint.pt as a run with ``options`` saves it (no weights: none are read)."""
    torch.save({"head": {}, "opt": {}, "step": 1, "config": asdict(TrainConfig(**options))}, folder / "checkpoint.pt")
    return str(folder)


@pytest.mark.parametrize("make_bad, match", [
    (lambda tmp: TrainConfig(epochs=0), r"^epochs=0 must be a number > 0"),
    (lambda tmp: TrainConfig(lr=float("nan")), r"^lr=nan must be a number > 0"),
    (lambda tmp: DataConfig(prompt_file=str(tmp / "missing.txt")), r"^prompt_file='.*missing.txt' is not a file"),
    (lambda tmp: run(PipelineConfig("unused", str(tmp / "file" / "out"))), r"^out_dir='.*out' cannot be made"),
    (lambda tmp: run(PipelineConfig("unused", str(tmp / "out"), head_dir=str(tmp / "file"))),
     r"^head_dir='.*file' cannot be made \(File exists\); pass a folder you can write to"),
    (lambda tmp: PipelineConfig("unused", str(tmp), num_threads=0), r"^num_threads=0 must be an int >= 1"),
    # a target too shallow for EAGLE-3's three feature layers: said before the data stage loads it
    (lambda tmp: run(PipelineConfig(_written(tmp / "m" / "config.json", json.dumps(
        {"model_type": "llama", "num_hidden_layers": 2})) and str(tmp / "m"), str(tmp / "o"))),
     r"^num_hidden_layers=2: EAGLE-3's features .* the target needs 3 layers or more"),
    (lambda tmp: PipelineConfig("unused", str(tmp), stages=()), r"^stages=\(\) is empty: nothing would run"),
    # a prompt file's faults: said before the target (here none) is loaded
    (lambda tmp: run(PipelineConfig("unused", str(tmp), data=DataConfig(
        prompt_file=_written(tmp / "p.txt", 'Hi\n{"prompt": "x"\n')))),
     r"p.txt:2: a line starting with '\{' must be a JSON object \{\"prompt\": \"...\"\} \(Expecting"),
    # an output folder whose samples answer another prompt file's prompts
    (lambda tmp: _written(tmp / "o" / "prompts.jsonl", '{"prompt": "Hello"}\n') and
     make_prompts(None, DataConfig(prompt_file=_written(tmp / "b.txt", "Hello\nHi\n")), str(tmp / "o")) and
     run(PipelineConfig("unused", str(tmp / "o"), data=DataConfig(prompt_file=_written(tmp / "c.txt", "Bye\n")))),
     r"prompts.jsonl holds other prompts than prompt_file='.*c.txt' \(prompt 1: 'Hello', not 'Bye'\).*another --out"),
    # an output folder of more prompts than asked for (training would read the samples of them all), the target's
    # own or a prompt file's: said before the target (here none) is loaded
    (lambda tmp: _written(tmp / "prompts.jsonl", '{"prompt": "Hello"}\n{"prompt": "Hi"}\n') and
     run(PipelineConfig("unused", str(tmp), data=DataConfig(num_prompts=1))),
     r"prompts.jsonl already holds 2 prompts, more than num_prompts=1.*--num-prompts 2 \(or more\)"),
    (lambda tmp: _written(tmp / "prompts.jsonl", '{"prompt": "Hello"}\n{"prompt": "Hi"}\n') and
     run(PipelineConfig("unused", str(tmp), data=DataConfig(num_prompts=1,
                                                          prompt_file=_written(tmp / "b.txt", "Hello\nHi\n")))),
     r"prompts.jsonl already holds 2 prompts, more than num_prompts=1"),
    # a stage without what the stage before it leaves: said before the target (here none) is loaded
    (lambda tmp: _written(tmp / "samples.jsonl", SAMPLE) and run(PipelineConfig("unused", str(tmp), stages=("train",))),
     r"features holds no features: run the 'features' stage first"),
    (lambda tmp: _written(tmp / "samples.jsonl", SAMPLE) and _written(tmp / "features" / "features.json", "{}") and
     run(PipelineConfig("unused", str(tmp), stages=("export",))), r"holds no checkpoint.pt: run the 'train' stage"),
    # a checkpoint of another method, or of another number of heads, is not resumed (nor exported) as this one
    (lambda tmp: load_trained(None, None, None, TrainConfig(method="dflash"), _checkpoint(tmp, method="eagle3")),
     r"checkpoint.pt was trained with method='eagle3', not 'dflash': run with --method eagle3 .*another --out"),
    (lambda tmp: train_module(torch.nn.Linear(1, 1), TrainConfig(method="medusa", medusa_num_heads=3), [], None,
                              f"{_checkpoint(tmp, method='medusa')}/checkpoint.pt", None),
     r"trained with medusa_num_heads=4, not 3: run with --medusa-num-heads 4"),
])
def test_bad_training_options_are_clear_errors_before_any_work(tmp_path, make_bad, match):
    (tmp_path / "file").write_text("a file where the output folder's parent should be")
    with pytest.raises(ValueError, match=match):
        make_bad(tmp_path)
