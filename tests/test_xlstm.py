"""xLSTM (``xLSTMForCausalLM``: specray.models.xlstm) against transformers on the same random tiny weights (fp32, max
abs diff < 1e-4): a prefill and chunks then single steps with the mLSTM state (C, n, m) carried; two sequences batched
in uneven chunks; a prefill long enough for several chunks of the chunkwise form; drafts replayed after verification;
a token tree's rows each on its own path; the fused release layout and biases; each part of the family shown to
matter (broken once, the comparison fails); the engine's greedy tokens plain, with n-gram chains from graph steps and
with trees equal transformers'; TP 2 equal to one rank; the refusals; on a GPU, its logits equal the CPU's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import specray.models.xlstm as xl
from specray.models.loader import load_model, read_config
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    TOL, TP_WORKER, check_drafts_replayed, check_graph_form_equals_eager, check_greedy_equals_transformers,
    check_long_prefill, check_ngram_replays_keep_greedy, check_no_host_sync_in_a_step, check_prefill_chunks_and_decode,
    check_prefix_caching_keeps_tokens, check_tree_rows_match_their_paths, generate, greedy, tokens)
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, chunked_logits, max_diff, mutated_logits, prompt, reference_logits, run_ranks)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# three blocks; 4 heads (2 a rank at TP 2) of q/k 16 and v 32 (hidden 128: transformers' cache rounds the q/k and v
# widths up to multiples of 64, so they must be); an FFN of 128 * 1.3 rounded up to 192; caps small enough to bite; a
# norm eps large enough that each head's output scale (which the normalizer n and the floor exp(-m) set, and the
# per-head norm otherwise cancels) shows in the logits
TINY_XLSTM = dict(norm_eps=0.05, hidden_size=128, num_hidden_layers=3, num_heads=4, qk_dim_factor=0.5, v_dim_factor=1.0,
                  ffn_proj_factor=1.3, ffn_round_up_to_multiple_of=64, gate_soft_cap=4.0, output_logit_soft_cap=4.0,
                  bos_token_id=None, pad_token_id=None)


def build_xlstm(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random xLSTM folder with conftest's tiny tokenizer. transformers zeroes the gates' weights (and starts
    the input gates at -10): drawn here so that the gates vary by token, the input gates both sides of the forget
    path (the stabilizer m moving up and down) and the caps bite; the norms and biases random; the embedding
    doubled, so that greedy decoding falls into loops (n-gram drafts then accepted in some steps, rejected in
    others)."""
    import transformers as tf

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    config = tf.xLSTMConfig(**{**TINY_XLSTM, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                               **overrides})
    torch.manual_seed(seed)
    model = tf.xLSTMForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "gate_preact" in name and name.endswith("weight"):
                param.normal_(0.0, 0.4)
            elif name.endswith("igate_preact.bias"):
                param.normal_(-1.0, 1.0)
            elif name.endswith("fgate_preact.bias"):
                param.normal_(2.0, 1.0)
            elif "norm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif name.endswith(("q.weight", "k.weight", "v.weight")) or ".ffn." in name:
                param.normal_(0.0, 0.15)
        model.get_input_embeddings().weight.mul_(2.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_xlstm_dir(tmp_path_factory) -> Path:
    return build_xlstm(tmp_path_factory.mktemp("tiny_xlstm"), seed=6)


@pytest.fixture(scope="module")
def hf_xlstm(tiny_xlstm_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_xlstm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(tiny_xlstm_dir):
    return reference_logits(tiny_xlstm_dir)


# ---- logits against transformers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_xlstm_dir, reference, schedule):
    """A 40-token prefill (the chunkwise form), and the same prompt in chunks (17, 9, 3) then single tokens (the
    token steps), the mLSTM state carried in slot 0: every logit row equals transformers'; the logit cap bites."""
    model = load_model(str(tiny_xlstm_dir))
    assert type(model).__name__ == "XLSTMForCausalLM"
    got = chunked_logits(model, prompt(), SCHEDULES[schedule])
    assert max_diff(got, reference) < TOL
    assert got.abs().max() > 0.5 * TINY_XLSTM["output_logit_soft_cap"]


def test_batched_chunks_long_prefill_and_replayed_drafts(tiny_xlstm_dir, hf_xlstm):
    """(tests/hybrid_models.py) two sequences batched in uneven chunks then decode steps; a 150-token prefill whole
    (transformers' chunkwise kernel over its first 128) and in two chunks; verify chunks whose accepted drafts the
    next chunk replays."""
    model = load_model(str(tiny_xlstm_dir))
    check_prefill_chunks_and_decode(model, hf_xlstm)
    check_long_prefill(model, hf_xlstm)
    check_drafts_replayed(model, hf_xlstm)


def test_token_tree_rows_match_their_paths(tiny_xlstm_dir, hf_xlstm):
    """A verify chunk whose drafts form a tree (the real token, two children of it, a grandchild under each, a
    great-grandchild under the second branch): each row's logits equal transformers' for its own path alone."""
    check_tree_rows_match_their_paths(load_model(str(tiny_xlstm_dir)), hf_xlstm, tokens(16, 5), 10, 1,
                                      [-1, -1, 0, 1, 3], seed=5)


def test_chunked_form_equals_the_token_scan():
    """:func:`mlstm_chunked` against :func:`mlstm_scan` on random inputs over a random start state, padding rows at
    a sequence's end, the state kept at host rows (one -1: the state given) and at device rows."""
    torch.manual_seed(0)
    b, length, h, dk, dv = 3, 150, 2, 8, 6
    q, k = torch.randn(b, length, h, dk) * 0.3, torch.randn(b, length, h, dk)
    v = torch.randn(b, length, h, dv)
    g = torch.nn.functional.logsigmoid(torch.randn(b, length, h) * 2 + 2)
    beta = (torch.rand(b, length, h) * 8 - 4).exp()
    g[2, 100:], beta[2, 100:], k[2, 100:], v[2, 100:] = 0.0, 0.0, 0.0, 0.0  # sequence 2: 100 rows, then padding
    state = torch.randn(b, h, dk, dv + 2)
    state[..., -1] = state[..., :1, -1]  # m: one per head
    for keep in (None, [149, -1, 99], torch.tensor([70, 5, -1])):
        want = xl.mlstm_scan(q, k, v, g, beta, state, keep, 1e-6)
        got = xl.mlstm_chunked(q, k, v, g, beta, state, keep, 1e-6)
        torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)


def _fused_copy(src: Path, dst: Path) -> Path:
    """``src``'s checkpoint in the fused layout (``weight_mode`` "fused": q | k | v | o, i | f and the FFN's gate |
    up each one tensor), which transformers can load but not build (its initialiser fails on it)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    for b in range(TINY_XLSTM["num_hidden_layers"]):
        p = f"backbone.blocks.{b}."
        layer = p + "mlstm_layer."
        weights[layer + "qkv_opreact.weight"] = torch.cat([weights.pop(layer + n + ".weight")
                                                           for n in ("q", "k", "v", "ogate_preact")])
        for part in ("weight", "bias"):
            weights[layer + f"ifgate_preact.{part}"] = torch.cat([weights.pop(layer + f"{n}.{part}")
                                                                  for n in ("igate_preact", "fgate_preact")])
        weights[p + "ffn.proj_up_gate_z.weight"] = torch.cat([weights.pop(p + f"ffn.{n}.weight")
                                                             for n in ("proj_up_gate", "proj_up")])
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "weight_mode": "fused"}))
    return dst


def test_fused_layout_reads_as_the_single_one(tiny_xlstm_dir, reference, tmp_path):
    """The fused release layout of the same weights gives transformers' logits of the single layout."""
    model = load_model(str(_fused_copy(tiny_xlstm_dir, tmp_path / "fused")))
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) < TOL


def test_biases_and_reductions_in_the_model_dtype(tmp_path):
    """``use_bias`` (biases on every projection and norm) and ``norm_reduction_force_float32`` false: transformers'
    logits, prefill and chunked + decode."""
    folder = build_xlstm(tmp_path / "biased", seed=2, use_bias=True, norm_reduction_force_float32=False)
    want = reference_logits(folder)
    model = load_model(str(folder))
    assert model.model.layers[0].mixer.multihead_norm.bias is not None
    for sizes in SCHEDULES.values():
        assert max_diff(chunked_logits(model, prompt(), sizes), want) < TOL


def _set(config, **fields):
    for field, value in fields.items():
        setattr(config, field, value)


def _on_mixers(**fields):
    def mutate(model):
        for _, layer in model.model.stage_layers():
            _set(layer.mixer, **fields)
    return mutate


# name -> (mutate_config, mutate, monkeypatched (object, attribute, value) or None)
MUTATIONS = {
    "no gate soft cap": (None, _on_mixers(gate_cap=None), None),
    "no logit soft cap": (None, lambda m: setattr(m, "final_logit_softcapping", None), None),
    "forget gate not log-sigmoid": (None, None, (xl.MLSTMLayer, "_gates", staticmethod(
        lambda i, f: (-torch.nn.functional.softplus(f) * 0.5, i.exp())))),
    "input gate sigmoid, not exp": (None, None, (xl.MLSTMLayer, "_gates", staticmethod(
        lambda i, f: (torch.nn.functional.logsigmoid(f), torch.sigmoid(i))))),
    "no exp(-m) floor on the denominator": (None, None, (xl, "_outputs", lambda num, m, eps: num[..., :-1] / (
        num[..., -1:].abs() + eps))),
    "no normalizer": (None, None, (xl, "_outputs", lambda num, m, eps: num[..., :-1] * (m[..., None]).exp())),
    "q not scaled": (None, _on_mixers(scale=1.0), None),
    "no per-head norm": (None, None, (xl.MLSTMLayer, "_head_norm", lambda self, h: h.reshape(h.shape[0], -1))),
    "no output gate": (None, None, (xl.MLSTMLayer, "_output_gate", staticmethod(lambda o: 1.0))),
    "FFN width not rounded up": (lambda c: _set(c, ffn_round_up_to_multiple_of=1), None, None),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_part_shows_in_the_logits(tiny_xlstm_dir, reference, monkeypatch, name):
    """The comparison above can fail: each of xLSTM's own parts (module docstring) broken once moves the chunked +
    decode schedule's logits past tolerance (a config edit that changes shapes fails to load, which also shows)."""
    mutate_config, mutate, patch = MUTATIONS[name]
    if patch is not None:
        monkeypatch.setattr(*patch)
    try:
        got = mutated_logits(tiny_xlstm_dir, mutate_config, mutate)
    except ValueError as err:  # a weight that no longer fits
        assert "does not fit" in str(err) or "does not match" in str(err), err
        return
    assert max_diff(got, reference) > 10 * TOL, name


@pytest.mark.parametrize("q_rows", [4, 16])
def test_the_graph_form_equals_the_eager_one(tiny_xlstm_dir, q_rows):
    """An mLSTM layer's graph form (a RecurrentGraphBatch) against its eager form on random states and inputs: a
    sequence replaying drafts, a fresh one over a slot holding an old state, one with drafts, and a padding
    sequence: the same outputs for every real row and the same committed state in each target slot."""
    layer = load_model(str(tiny_xlstm_dir)).model.layers[0].mixer

    def fill(st):  # C, n random, m repeated down the last column; forget gates as log-sigmoids, input gates as exps
        st.inputs.normal_(), st.matrix.normal_()
        st.matrix[..., -1] = st.matrix[..., :1, -1]
        st.gates[:, :, 0] = torch.nn.functional.logsigmoid(torch.randn_like(st.gates[:, :, 0]))
        st.gates[:, :, 1] = torch.randn_like(st.gates[:, :, 1]).exp()

    check_graph_form_equals_eager(layer, q_rows, fill, lambda rows: (
        torch.randn(rows, layer.state_spec.conv_dim), torch.nn.functional.logsigmoid(torch.randn(rows, layer.heads)),
        torch.randn(rows, layer.heads).exp()))


def test_no_host_sync_in_a_step(tiny_xlstm_dir, no_host_sync):
    """(check_no_host_sync_in_a_step) a step with a replay, a verify chunk and a fresh prefill reads no tensor's value
    on the host."""
    check_no_host_sync_in_a_step(load_model(str(tiny_xlstm_dir)), no_host_sync)


# ---- the engine --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(tiny_xlstm_dir) -> list[list[int]]:
    from specray import LLM

    return generate(LLM(model=str(tiny_xlstm_dir), max_model_len=128), greedy())


def test_plain_engine_equals_transformers(tiny_xlstm_dir, plain):
    """(check_greedy_equals_transformers) several requests at once, each in its own state slot."""
    check_greedy_equals_transformers(tiny_xlstm_dir, plain)


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_ngram_drafts_keep_greedy(tiny_xlstm_dir, plain, monkeypatch, tree):
    """(check_ngram_replays_keep_greedy) n-gram chains and trees of three branches from graph steps (the
    fixed-shape recurrence, its tree form for trees): plain greedy's tokens, drafts accepted and replayed."""
    check_ngram_replays_keep_greedy(tiny_xlstm_dir, plain, tree, monkeypatch)


def test_prefix_caching_keeps_tokens(tiny_xlstm_dir):
    """(check_prefix_caching_keeps_tokens) second turns behind cached blocks and kept recurrent states give the tokens
    an engine without prefix caching gives."""
    check_prefix_caching_keeps_tokens(tiny_xlstm_dir)


# ---- refusals ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, match", [
    (dict(weight_mode="packed"), "weight_mode='packed'"),
    (dict(add_out_norm=False), "add_out_norm=False"),
    (dict(inference_state_dtype="bfloat16"), "inference_state_dtype='bfloat16'"),
    (dict(gate_soft_cap=None), "gate_soft_cap=None"),
    (dict(gate_soft_cap=200.0), "gate_soft_cap=200.0"),
    (dict(qk_dim_factor=0.3), "qk_dim_factor=0.3"),
])
def test_config_refusals(tiny_xlstm_dir, change, match):
    config = read_config(str(tiny_xlstm_dir))
    _set(config, **change)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_xlstm_dir), config=config)


def test_split_and_lora_refusals(tiny_xlstm_dir):
    """Pipeline stages, TP that does not split the heads, LoRA: refused before any rank starts."""
    from specray import LLM

    for kw, match in ((dict(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
                      (dict(tensor_parallel_size=8), "num_heads"),
                      (dict(enable_lora=True), "enable_lora")):
        with pytest.raises(ValueError, match=match):
            LLM(model=str(tiny_xlstm_dir), max_model_len=128, **kw)


# ---- tensor parallelism --------------------------------------------------------------------------------------------

def test_tensor_parallel_shards_match_one_rank(tiny_xlstm_dir, tmp_path):
    """TP 2 over gloo: the heads (q, k, v, o rows, the gates, the per-head norm) and the FFN split over the ranks;
    logits of prefills, a verify chunk and the replay after it equal one rank's."""
    folder = str(tiny_xlstm_dir)
    for r, result in enumerate(run_ranks(tmp_path, TP_WORKER, 2, 2, [folder], timeout=240)):
        diff, heads = result[folder]
        assert diff < TOL and heads == TINY_XLSTM["num_heads"] // 2, (r, diff, heads)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_xlstm_dir, schedule):
    """tests/test_device_parity.py's check for this file's fixture: fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(tiny_xlstm_dir, SCHEDULES[schedule])
