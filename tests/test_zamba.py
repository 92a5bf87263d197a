"""Zamba (``ZambaForCausalLM``: specray.models.zamba) against transformers on the same random tiny weights (fp32, max
abs diff < 1e-4): a prefill and chunks then single steps; two sequences batched in uneven chunks, drafts replayed after
verification, a long prefill; each part of the family shown to matter (broken once, the comparison fails); a checkpoint
with the shared block saved under every hybrid layer; the engine's greedy tokens plain, with n-gram chains from graph
steps and with trees equal transformers'; no host sync in a step; TP 2 (a channel group split over the ranks) and two
pipeline stages equal one rank; the refusals; on a GPU, its logits equal the CPU's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import specray.models.zamba as zamba
from specray.models.loader import load_model, read_config
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    NGRAM, PP_WORKER, TOL, TP_WORKER, check_drafts_replayed, check_greedy_equals_transformers, check_long_prefill,
    check_ngram_replays_keep_greedy, check_no_host_sync_in_a_step, check_prefill_chunks_and_decode,
    check_prefix_caching_keeps_tokens, generate, greedy)
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, chunked_logits, max_diff, mutated_logits, prompt, reference_logits, run_ranks)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# four layers (mamba, hybrid, mamba, hybrid: the one block run twice); attention 4 heads of 24 (2 H / heads) in 2 KV
# groups; Mamba-1 over 96 channels in 3 groups of 32 (at TP 2 the middle group is split over the two ranks)
TINY_ZAMBA = dict(hidden_size=48, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                  num_attention_heads=4, num_key_value_heads=2, n_mamba_heads=3, mamba_d_state=8, mamba_dt_rank=8,
                  mamba_expand=2, mamba_d_conv=4, intermediate_size=64, max_position_embeddings=512,
                  initializer_range=0.1, bos_token_id=None, pad_token_id=None)


def build_zamba(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random Zamba folder with conftest's tiny tokenizer: norms, D, dt biases, conv biases and decays drawn at
    random (transformers starts them at 1, 0 or fixed ranges); the tied embedding doubled, so that greedy decoding
    falls into loops (n-gram drafts then accepted in some steps, rejected in others)."""
    import transformers as tf

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    config = tf.ZambaConfig(**{**TINY_ZAMBA, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id, **overrides})
    torch.manual_seed(seed)
    model = tf.ZambaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith((".D", "dt_proj_bias", "conv1d.bias")):
                param.normal_(0.0, 0.5)
            elif name.endswith("A_log"):
                param.uniform_(-1.0, 1.5)
        model.get_input_embeddings().weight.mul_(2.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_zamba_dir(tmp_path_factory) -> Path:
    return build_zamba(tmp_path_factory.mktemp("tiny_zamba"), seed=1)


@pytest.fixture(scope="module")
def hf_zamba(tiny_zamba_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_zamba_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(tiny_zamba_dir):
    return reference_logits(tiny_zamba_dir)


# ---- logits against transformers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_zamba_dir, reference, schedule):
    """A 40-token prefill, and the same prompt in chunks (17, 9, 3) then single tokens, the Mamba state carried in
    slot 0: every logit row equals transformers'."""
    model = load_model(str(tiny_zamba_dir))
    assert type(model).__name__ == "ZambaForCausalLM"
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def test_batched_chunks_replayed_drafts_and_a_long_prefill(tiny_zamba_dir, hf_zamba):
    """(check_prefill_chunks_and_decode, check_drafts_replayed, check_long_prefill: tests/hybrid_models.py) two
    sequences batched in uneven chunks then decode steps; verify chunks whose accepted drafts the next chunk replays
    through the convs and the scan; a 150-token prefill, whole and in two chunks."""
    model = load_model(str(tiny_zamba_dir))
    check_prefill_chunks_and_decode(model, hf_zamba)
    check_drafts_replayed(model, hf_zamba)
    check_long_prefill(model, hf_zamba)


def test_the_block_saved_under_every_hybrid_layer_loads(tiny_zamba_dir, tmp_path, reference):
    """A checkpoint holding the shared block under each hybrid layer (``layers.3.shared_transf.`` too, as a save that
    keeps tied copies does) loads into the one block: transformers' logits."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_zamba_dir / "model.safetensors")
    copies = {n.replace("layers.1.shared_transf.", "layers.3.shared_transf."): t.clone() for n, t in tensors.items()
              if ".layers.1.shared_transf." in n}
    (tmp_path / "config.json").write_text((tiny_zamba_dir / "config.json").read_text())
    save_file({**tensors, **copies}, tmp_path / "model.safetensors")
    assert max_diff(chunked_logits(load_model(str(tmp_path)), prompt(), SCHEDULES["prefill"]), reference) < TOL


def _interleaved(model):  # in_proj's rows back in the checkpoint's order (x and z channel by channel)
    for layer in model.model.layers:
        w = layer.mamba.in_proj.weight.data
        w.copy_(w.view(2, -1, w.shape[1]).transpose(0, 1).reshape(w.shape))


def _each(kind: type, fn):
    def mutate(model):
        for module in model.modules():
            if isinstance(module, kind):
                fn(module)
    return mutate


_RUN = zamba.ZambaInvocation.forward

# name -> (mutate_config, mutate, monkeypatched (object, attribute, value) or None)
MUTATIONS = {
    "in_proj rows left interleaved": (None, _interleaved, None),
    "every channel reads group 0's B and C": (None, _each(zamba.ZambaMambaMixer, lambda m: m.group_of.zero_()), None),
    "dt_proj not block-diagonal": (None, _each(zamba.ZambaMambaMixer, lambda m: m.dt_proj.weight.data.add_(0.3)),
                                   None),
    "no D skip": (None, None, (zamba.ZambaMambaMixer, "_skip", lambda self, out, v: out)),
    "attention scaled by 1/sqrt(head_dim)": (None, _each(zamba.ZambaInvocation, lambda m: setattr(
        m.attn, "scale", m.head_dim ** -0.5)), None),
    "block reads the stream twice": (None, None, (zamba.ZambaInvocation, "forward", lambda self, block, x, e, *a: _RUN(
        self, block, x, x, *a))),
    "block's output not added": (None, lambda m: [layer.linear.weight.data.zero_() for layer in m.model.layers
                                                  if hasattr(layer, "linear")], None),
    "MLP with silu, not gelu": (lambda c: setattr(c, "hidden_act", "silu"), None, None),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_part_shows_in_the_logits(tiny_zamba_dir, reference, monkeypatch, name):
    """The comparison above can fail: each of Zamba's own parts (module docstring) broken once moves the chunked +
    decode schedule's logits far past tolerance."""
    mutate_config, mutate, patch = MUTATIONS[name]
    if patch is not None:
        monkeypatch.setattr(*patch)
    with torch.no_grad():
        got = mutated_logits(tiny_zamba_dir, mutate_config, mutate)
    assert max_diff(got, reference) > 100 * TOL, name


def test_no_host_sync_in_a_step(tiny_zamba_dir, no_host_sync):
    """(check_no_host_sync_in_a_step) a step with a replay, a verify chunk and a fresh prefill reads no tensor's value
    on the host."""
    check_no_host_sync_in_a_step(load_model(str(tiny_zamba_dir)), no_host_sync)


# ---- the engine --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(tiny_zamba_dir) -> list[list[int]]:
    from specray import LLM

    return generate(LLM(model=str(tiny_zamba_dir), max_model_len=128), greedy())


def test_plain_engine_equals_transformers(tiny_zamba_dir, plain):
    """(check_greedy_equals_transformers) several requests at once, each in its own state slot."""
    check_greedy_equals_transformers(tiny_zamba_dir, plain)


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_ngram_drafts_keep_greedy(tiny_zamba_dir, plain, tree, monkeypatch):
    """(check_ngram_replays_keep_greedy) n-gram chains and trees of three branches from graph steps (the
    fixed-shape recurrence; its tree form for trees: each row's conv and scan from its parent's): plain greedy's tokens, drafts
    accepted and replayed."""
    check_ngram_replays_keep_greedy(tiny_zamba_dir, plain, tree, monkeypatch)


@pytest.mark.parametrize("case", ["chunked-prefill", "preemption"])
def test_chunked_prefill_and_preemption_keep_greedy(tiny_zamba_dir, plain, case):
    """n-gram chains with prefills in chunks of a few tokens (the state carried between them), and with a KV pool so
    small that requests are preempted and recompute their state from token 0: plain greedy's tokens."""
    from specray import LLM

    kw = {"chunked-prefill": dict(max_num_batched_tokens=8, long_prefill_token_threshold=5),
          "preemption": dict(block_size=4, num_kv_blocks=24)}[case]
    llm = LLM(model=str(tiny_zamba_dir), max_model_len=128, speculative_config=NGRAM, **kw)
    assert generate(llm, greedy()) == plain
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_caching_keeps_tokens(tiny_zamba_dir):
    """(check_prefix_caching_keeps_tokens) second turns behind cached blocks and kept states give the tokens an
    engine without prefix caching gives."""
    check_prefix_caching_keeps_tokens(tiny_zamba_dir)


# ---- refusals ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, match", [
    (dict(layers_block_type=["mamba", "attention", "mamba", "hybrid"]), "layers_block_type="),
    (dict(hidden_mamba_act="gelu"), "hidden_mamba_act='gelu'"),
    (dict(hidden_act="relu"), "hidden_act='relu'"),
])
def test_config_refusals(tiny_zamba_dir, change, match):
    config = read_config(str(tiny_zamba_dir))
    for field, value in change.items():
        setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_zamba_dir), config=config)


def test_split_and_lora_refusals(tiny_zamba_dir):
    """TP that splits neither the 96 Mamba channels nor the heads: refused before any rank starts, by name (LoRA is
    served, the shared block's projections refused: tests/test_lora_hybrids.py)."""
    from specray import LLM

    for kw, match in ((dict(tensor_parallel_size=5), "tensor_parallel_size=5"),
                      (dict(tensor_parallel_size=8), "num_attention_heads=4")):
        with pytest.raises(ValueError, match=match):
            LLM(model=str(tiny_zamba_dir), max_model_len=128, **kw)


# ---- tensor parallelism and pipeline stages ----------------------------------------------------------------------

def test_tensor_parallel_and_pipeline_stages_match_one_rank(tiny_zamba_dir, tmp_path):
    """TP 2 over gloo (the attention heads and the Mamba channels split, the middle channel group over both ranks:
    x_proj's block-diagonal sum), and two pipeline stages (layers 0-1 and 2-3, the block on both, the stream and the
    embedding handed on): logits of prefills, a verify chunk and the replay after it equal one rank's."""
    folder = str(tiny_zamba_dir)
    for r, result in enumerate(run_ranks(tmp_path / "tp", TP_WORKER, 2, 2, [folder], timeout=240)):
        diff, heads = result[folder]
        assert diff < TOL and heads == 48, (r, diff, heads)
    first, last = run_ranks(tmp_path / "pp", PP_WORKER, 2, 2, [folder], timeout=240)
    (first_layers, none), (last_layers, diff) = first[folder], last[folder]
    assert none is None and first_layers + last_layers == [0, 1, 2, 3], (first_layers, last_layers)
    assert diff < TOL, diff


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_zamba_dir, schedule):
    """tests/test_device_parity.py's check for this file's fixture: fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(tiny_zamba_dir, SCHEDULES[schedule])
