"""RWKV-4 (``RwkvForCausalLM``: specray.models.rwkv) against transformers on the same random tiny weights (fp32, max
abs diff < 1e-4): a prefill and chunks then single steps with the token shifts and the WKV state carried; two
sequences batched in uneven chunks; a long prefill; drafts replayed after verification; a token tree's rows each on
its own path; each part of the family shown to matter (broken once, the comparison fails); rescale_every's halvings in
float16 against transformers' float16; the graph form of the WKV mixer against its eager form; the engine's greedy
tokens plain and with n-gram chains (from graph steps) and trees equal transformers'; TP 2 equal to one rank; the
refusals; on a GPU, its logits equal the CPU's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import specray.models.rwkv as rwkv
from specray.models.loader import load_model
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    TOL, TP_WORKER, check_drafts_replayed, check_graph_form_equals_eager, check_greedy_equals_transformers,
    check_long_prefill, check_ngram_replays_keep_greedy, check_no_host_sync_in_a_step, check_prefill_chunks_and_decode,
    check_tree_rows_match_their_paths, generate, greedy, tokens)
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, chunked_logits, max_diff, mutated_logits, prompt, reference_logits, run_ranks)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# four blocks, hidden 48 (the WKV's channels too), a channel mix of 64; the
# hidden state halved after blocks 1 and 3 (rescale_every 2: blocks 2 and 3's output weights divided by 2); a
# LayerNorm eps large enough that ln_out's own (1e-5) shows
TINY_RWKV = dict(hidden_size=48, num_hidden_layers=4, intermediate_size=64,
                 rescale_every=2, layer_norm_epsilon=1e-3, context_length=512, bos_token_id=None)


def build_rwkv(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random RWKV folder with conftest's tiny tokenizer: transformers' init, then the decays spread so that
    channels forget within a token or keep hundreds (w = -exp(time_decay), time_decay in (-4, 2)), the bonus, the
    mixes and the norms drawn at random, the linears scaled up so that the keys reach past the running max's range
    and the logits spread."""
    import transformers as tf

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    config = tf.RwkvConfig(**{**TINY_RWKV, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id, **overrides})
    torch.manual_seed(seed)
    model = tf.RwkvForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("time_decay"):
                param.uniform_(-4.0, 2.0)
            elif name.endswith("time_first"):
                param.normal_(0.0, 1.0)
            elif "time_mix" in name:
                param.uniform_(0.0, 1.0)
            elif name.endswith(("ln1.weight", "ln2.weight", "pre_ln.weight", "ln_out.weight")):
                param.normal_(1.0, 0.3)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif param.dim() == 2:
                param.normal_(0.0, 1.5 / param.shape[1] ** 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_rwkv_dir(tmp_path_factory) -> Path:
    return build_rwkv(tmp_path_factory.mktemp("tiny_rwkv"), seed=1)


@pytest.fixture(scope="module")
def hf_rwkv(tiny_rwkv_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_rwkv_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(tiny_rwkv_dir):
    return reference_logits(tiny_rwkv_dir)


# ---- logits against transformers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_rwkv_dir, reference, schedule):
    """A 40-token prefill, and the same prompt in chunks (17, 9, 3) then single tokens, the state carried in slot 0:
    every logit row equals transformers'; the logits spread (a test on near-constant rows could not fail)."""
    model = load_model(str(tiny_rwkv_dir))
    assert type(model).__name__ == "RwkvForCausalLM"
    got = chunked_logits(model, prompt(), SCHEDULES[schedule])
    assert max_diff(got, reference) < TOL
    assert reference.std(-1).min() > 0.5


def test_batched_chunks_long_prefill_and_replayed_drafts(tiny_rwkv_dir, hf_rwkv):
    """(tests/hybrid_models.py) two sequences batched in uneven chunks then decode steps; a 150-token prefill whole and
    in two chunks; verify chunks whose accepted drafts the next chunk replays through the token shifts and WKV."""
    model = load_model(str(tiny_rwkv_dir))
    check_prefill_chunks_and_decode(model, hf_rwkv)
    check_long_prefill(model, hf_rwkv)
    check_drafts_replayed(model, hf_rwkv)


def test_token_tree_rows_match_their_paths(tiny_rwkv_dir, hf_rwkv):
    """A verify chunk whose drafts form a tree (the real token, two children of it, a grandchild under each, a
    great-grandchild under the second branch): each row's logits equal transformers' for its own path alone (its
    token shifts read its parent's input, its WKV its parent's state)."""
    check_tree_rows_match_their_paths(load_model(str(tiny_rwkv_dir)), hf_rwkv, tokens(16, 5), 10, 1,
                                      [-1, -1, 0, 1, 3], seed=5)


def _params(suffix: str, value: float):
    def mutate(model):
        for name, param in model.named_parameters():
            if name.endswith(suffix):
                param.data.fill_(value)
    return mutate


def _no_shift(self, cur, prev):
    return rwkv.TokenShift._shift(self, cur, torch.zeros_like(prev))


def _no_halving(model):
    for _, layer in model.model.stage_layers():
        layer.halves = False


# name -> (mutate_config, mutate, monkeypatched (object, attribute, value) or None)
MUTATIONS = {
    "no token shift in time mixing": (None, None, (rwkv.WKVMixer, "_shift", _no_shift)),
    "no token shift in channel mixing": (None, None, (rwkv.ChannelMixer, "_shift", _no_shift)),
    "no time_first bonus": (None, _params("attention.time_first", 0.0), None),
    "one decay for every channel": (None, _params("attention.time_decay", 0.0), None),
    "time mixing's receptance left out": (None, None, (rwkv.WKVMixer, "_skip", lambda self, out, v: out)),
    "relu not squared": (None, None, (rwkv.ChannelMixer, "square_relu", staticmethod(torch.relu))),
    "channel mixing's receptance left out": (None, _params("feed_forward.receptance.weight", 0.0), None),
    "no pre_ln": (None, lambda m: delattr(m.model.layers[0], "pre_ln"), None),
    "hidden state not halved": (None, _no_halving, None),
    "output weights not divided": (None, None, (rwkv, "_RESCALED", rwkv.re.compile("^$"))),
    "ln_out with the config's eps": (None, None, (rwkv, "LN_OUT_EPS", TINY_RWKV["layer_norm_epsilon"])),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_part_shows_in_the_logits(tiny_rwkv_dir, reference, monkeypatch, name):
    """The comparison above can fail: each of RWKV's own parts (module docstring) broken once moves the chunked +
    decode schedule's logits past tolerance."""
    mutate_config, mutate, patch = MUTATIONS[name]
    if patch is not None:
        monkeypatch.setattr(*patch)
    got = mutated_logits(tiny_rwkv_dir, mutate_config, mutate)
    assert max_diff(got, reference) > 10 * TOL, name


F16_TOL = 0.03  # a few float16 steps at the logits' size (|logit| < 8: a step is 1/128 at most)


def test_rescaling_in_float16_matches_transformers(tiny_rwkv_dir):
    """In float16, where rescale_every exists for, transformers rescales as in float32 (the output weights divided,
    the hidden state halved): a prefill's logits equal its float16 ones within a few float16 steps, and the state's
    float16 token-shift history carries chunks as the prefill does."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_rwkv_dir, dtype=torch.float16).eval()
    assert hf.rwkv.blocks[0].attention.time_decay.dtype == torch.float32
    with torch.no_grad():
        want = hf(torch.tensor([prompt()])).logits[0].float()
    model = load_model(str(tiny_rwkv_dir), dtype=torch.float16)
    assert model.model.layers[0].attention.time_decay.dtype == torch.float32
    for schedule in SCHEDULES.values():
        assert max_diff(chunked_logits(model, prompt(), schedule), want) < F16_TOL


@pytest.mark.parametrize("q_rows", [4, 16])
def test_the_graph_form_equals_the_eager_one(tiny_rwkv_dir, q_rows):
    """A WKV mixer's graph form (a RecurrentGraphBatch) against its eager form on random histories and states: a
    sequence replaying drafts, a fresh one over a slot holding an old state, one with drafts, and a padding sequence:
    the same outputs for every real row and the same committed state in each target slot."""
    layer = load_model(str(tiny_rwkv_dir)).model.layers[1].attention

    def fill(st):  # histories random; per channel a WKV state (num, den > 0, max)
        slots = st.matrix.shape[0]
        st.inputs.normal_()
        st.matrix.copy_(torch.stack((torch.randn(slots, layer.width), torch.rand(slots, layer.width) + 0.5,
                                     torch.randn(slots, layer.width)), -1)[..., None])

    check_graph_form_equals_eager(layer, q_rows, fill, lambda rows: (
        torch.randn(rows, layer.hidden), torch.zeros(rows, layer.width), torch.zeros(rows, layer.width)))


def test_no_host_sync_in_a_step(tiny_rwkv_dir, no_host_sync):
    """(check_no_host_sync_in_a_step) a step with a replay, a verify chunk and a fresh prefill reads no tensor's value
    on the host."""
    check_no_host_sync_in_a_step(load_model(str(tiny_rwkv_dir)), no_host_sync)


# ---- the engine --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(tiny_rwkv_dir) -> list[list[int]]:
    from specray import LLM

    return generate(LLM(model=str(tiny_rwkv_dir), max_model_len=128), greedy())


def test_plain_engine_equals_transformers(tiny_rwkv_dir, plain):
    """(check_greedy_equals_transformers) several requests at once, each in its own state slot."""
    check_greedy_equals_transformers(tiny_rwkv_dir, plain)


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_ngram_drafts_keep_greedy(tiny_rwkv_dir, plain, monkeypatch, tree):
    """(check_ngram_replays_keep_greedy) n-gram chains and trees of three branches from graph steps (the
    fixed-shape recurrence, its tree form for trees): plain greedy's tokens, drafts accepted and replayed."""
    check_ngram_replays_keep_greedy(tiny_rwkv_dir, plain, tree, monkeypatch)


# ---- refusals ----------------------------------------------------------------------------------------------------

def test_attention_width_refused(tiny_rwkv_dir):
    from specray.models.loader import read_config

    config = read_config(str(tiny_rwkv_dir))
    config.attention_hidden_size = 64
    with pytest.raises(ValueError, match="attention_hidden_size=64"):
        load_model(str(tiny_rwkv_dir), config=config)


def test_split_and_lora_refusals(tiny_rwkv_dir):
    """Pipeline stages, TP that does not split the attention width, LoRA: refused before any rank starts."""
    from specray import LLM

    for kw, match in ((dict(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
                      (dict(tensor_parallel_size=32), "attention_hidden_size=48"),
                      (dict(enable_lora=True), "enable_lora")):
        with pytest.raises(ValueError, match=match):
            LLM(model=str(tiny_rwkv_dir), max_model_len=128, **kw)


# ---- tensor parallelism --------------------------------------------------------------------------------------------

def test_tensor_parallel_shards_match_one_rank(tiny_rwkv_dir, tmp_path):
    """TP 2 over gloo: the WKV channels, the channel mix's width, key / value / receptance / output split over the
    ranks; logits of prefills, a verify chunk and the replay after it equal one rank's."""
    folder = str(tiny_rwkv_dir)
    for r, result in enumerate(run_ranks(tmp_path, TP_WORKER, 2, 2, [folder], timeout=240)):
        diff, heads = result[folder]
        assert diff < TOL and heads == TINY_RWKV["hidden_size"] // 2, (r, diff, heads)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_rwkv_dir, schedule):
    """tests/test_device_parity.py's check for this file's fixture: fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(tiny_rwkv_dir, SCHEDULES[schedule])
