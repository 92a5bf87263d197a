"""ZAYA (``ZayaForCausalLM``: specray.models.zaya) against transformers on the same random tiny weights (fp32, max abs
diff < 1e-4; a bfloat16 prefill within bfloat16 steps): a prefill and chunks then single steps with the CCA conv state
carried, a second config (q/k/v and head biases, one KV head whose value rows are half current and half delayed, other
conv widths, an untied head); two sequences batched in uneven chunks, drafts replayed after verification, a token
tree's rows each on its own path; each part of the family shown to matter (broken once, the comparison fails); the
engine's greedy tokens plain, with n-gram chains from graph steps and with trees equal transformers'; no host sync in a
step; TP 2 equal to one rank; the refusals; on a GPU, its logits equal the CPU's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import specray.models.zaya as zaya
from specray.models.loader import load_model, read_config
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    NGRAM, TOL, TP_WORKER, Stepper, check_drafts_replayed, check_greedy_equals_transformers,
    check_ngram_replays_keep_greedy, check_prefill_chunks_and_decode, check_prefix_caching_keeps_tokens,
    check_tree_rows_match_their_paths, generate, greedy, tokens)
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, chunked_logits, max_diff, mutated_logits, prompt, reference_logits, run_ranks)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# three layers (full, sliding over 6 positions, full); 4 query heads of 8 in 2 KV groups (one a rank at TP 2: one
# rank's values all current, the other's all delayed); convs of widths 2 and 3 (a history of 3 inputs); 4 experts
TINY_ZAYA = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 moe_intermediate_size=16, num_experts=4, router_hidden_size=16,
                 layer_types=["hybrid", "hybrid_sliding", "hybrid"], sliding_window=6, cca_time0=2, cca_time1=3,
                 max_position_embeddings=512, initializer_range=0.1, bos_token_id=None, pad_token_id=None)
# q/k/v and o biases (the delayed values' bias alone before the first token), one KV head (its value rows half
# current, half delayed), a depthwise conv of 3 and no grouped one, a biased head of its own
VARIANT = dict(attention_bias=True, num_key_value_heads=1, cca_time0=3, cca_time1=1, lm_head_bias=True,
               tie_word_embeddings=False)


def build_zaya(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random ZAYA folder with conftest's tiny tokenizer. Everything transformers starts at 0 or 1 (norms,
    residual and input scales and biases, key temperatures, router state scales) drawn at random, the routers' weights
    large enough for each token to choose its own expert, and the balancing biases around -1.5 with the skip class's at
    -1.0 (transformers sets it so as it loads), so that tokens choose the skip expert now and then; the embedding
    doubled, so that greedy decoding falls into loops (n-gram drafts then accepted in some steps, rejected in
    others)."""
    import transformers as tf

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    config = tf.ZayaConfig(**{**TINY_ZAYA, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id, **overrides})
    torch.manual_seed(seed)
    model = tf.ZayaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "_scale", "temp")):
                param.uniform_(0.5, 1.5)
            elif name.endswith("_bias") or name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif ".mlp.gate." in name and name.endswith("weight"):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("balancing_biases"):
                buffer.normal_(-1.5, 0.1)[-1] = -1.0
        model.get_input_embeddings().weight.mul_(2.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_zaya_dir(tmp_path_factory) -> Path:
    # (a seed whose n-gram trees have branches, some paths other than the first accepted: K/V and pending moves)
    return build_zaya(tmp_path_factory.mktemp("tiny_zaya"), seed=1)


@pytest.fixture(scope="module")
def hf_zaya(tiny_zaya_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_zaya_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(tiny_zaya_dir):
    return reference_logits(tiny_zaya_dir)


# ---- logits against transformers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_zaya_dir, reference, schedule, monkeypatch):
    """A 40-token prefill, and the same prompt in chunks (17, 9, 3) then single tokens, the conv state carried in slot
    0: every logit row equals transformers'; some tokens chose the skip expert, others routed ones."""
    model = load_model(str(tiny_zaya_dir))
    assert type(model).__name__ == "ZayaForCausalLM"
    chosen, choose = [], zaya.ZayaRouter._choose
    monkeypatch.setattr(zaya.ZayaRouter, "_choose", lambda self, probs: chosen.append(
        (probs.float() + self.balancing_biases.float()).argmax(-1)) or choose(self, probs))
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL
    classes = set(torch.cat(chosen).tolist())
    assert TINY_ZAYA["num_experts"] in classes and len(classes) >= 3, classes  # the skip class, routed experts


def test_second_config_matches_transformers(tmp_path):
    """VARIANT's biases, its one KV head (each value head half current, half delayed rows), its conv widths and its
    biased untied head: both schedules equal transformers'."""
    folder = build_zaya(tmp_path, seed=2, **VARIANT)
    model, want = load_model(str(folder)), reference_logits(folder)
    for sizes in SCHEDULES.values():
        assert max_diff(chunked_logits(model, prompt(), sizes), want) < TOL


def test_bfloat16_prefill_matches_transformers(tiny_zaya_dir):
    """In bfloat16 (the residual stream in float32, as transformers keeps it) a prefill's logits equal transformers'
    bfloat16 ones within a few bfloat16 steps (bit for bit on the CPU this was written on)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_zaya_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt()])).logits[0].float()
    model = load_model(str(tiny_zaya_dir), dtype=torch.bfloat16)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["prefill"]), want) < 0.1


def test_batched_chunks_and_replayed_drafts_match_transformers(tiny_zaya_dir, hf_zaya):
    """(check_prefill_chunks_and_decode, check_drafts_replayed: tests/hybrid_models.py) two sequences batched in
    uneven chunks, then decode steps; verify chunks whose accepted drafts the next chunk replays through the convs and
    the delayed values."""
    model = load_model(str(tiny_zaya_dir))
    check_prefill_chunks_and_decode(model, hf_zaya)
    check_drafts_replayed(model, hf_zaya)


def test_token_tree_rows_match_their_paths(tiny_zaya_dir, hf_zaya):
    """A verify chunk whose drafts form a tree (the real token, two children of it, a grandchild under each, a
    great-grandchild under the second branch): each row's logits equal transformers' for its own path alone (its
    convs and delayed values over its ancestors' inputs, its attention over them)."""
    check_tree_rows_match_their_paths(load_model(str(tiny_zaya_dir)), hf_zaya, tokens(16, 5), 10, 1,
                                      [-1, -1, 0, 1, 3], seed=5)


_CONV = zaya.CCAProjection._conv


def _no_qk_conv(self, window):  # the convs left out: q and k their residuals alone
    out = _CONV(self, window)
    return torch.cat((torch.zeros_like(out[..., : self.qk_size]), out[..., self.qk_size:]), dim=-1)


def _identity_scaling(model):
    for module in model.modules():
        if isinstance(module, zaya.ResidualScaling):
            for name, param in module.named_parameters():
                param.data.fill_(1.0 if name.endswith("scale") else 0.0)


def _params(suffix: str, value: float):
    def mutate(model):
        for name, param in model.named_parameters():
            if name.endswith(suffix):
                param.data.fill_(value)
    return mutate


def _unskipped(self, probs):  # the skip class's choice taken as expert 0 at its probability
    ids = (probs.float() + self.balancing_biases.float()).topk(1, dim=-1).indices
    return probs.gather(1, ids), ids.masked_fill(ids == self.num_experts, 0)


def _rope(field: str, value):
    def mutate(config):
        config.rope_parameters = {kind: {**params, field: value} for kind, params in config.rope_parameters.items()}
    return mutate


# name -> (mutate_config, mutate, monkeypatched (object, attribute, value) or None)
MUTATIONS = {
    "q/k convs left out": (None, None, (zaya.CCAProjection, "_conv", _no_qk_conv)),
    "q/k residuals left out": (None, None, (zaya.CCAProjection, "_residuals", lambda self, q, k: (0.0, 0.0))),
    "values not delayed": (None, None, (zaya.CCAProjection, "delay", 0)),
    "q/k not scaled to sqrt(D)": (None, None, (zaya.ZayaAttention, "_unit", lambda self, x: x)),
    "key temperatures left out": (None, _params(".qk_norm.temp", 1.0), None),
    "residual scaling left out": (None, _identity_scaling, None),
    "input scale and bias left out": (None, lambda m: (_params("input_hidden_states_scale", 1.0)(m),
                                                       _params("input_hidden_states_bias", 0.0)(m)), None),
    "router state not carried": (None, _params("router_states_scale", 0.0), None),
    "balancing biases left out": (None, _params("balancing_biases", 0.0), None),
    "skip expert computed": (None, None, (zaya.ZayaRouter, "_choose", _unskipped)),
    "no sliding window": (lambda c: setattr(c, "sliding_window", 4096), None, None),
    "whole heads rotated": (_rope("partial_rotary_factor", 1.0), None, None),
    "one RoPE base for both kinds": (_rope("rope_theta", 10_000.0), None, None),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_part_shows_in_the_logits(tiny_zaya_dir, reference, monkeypatch, name):
    """The comparison above can fail: each of ZAYA's own parts (module docstring) broken once moves the chunked +
    decode schedule's logits far past tolerance."""
    mutate_config, mutate, patch = MUTATIONS[name]
    if patch is not None:
        monkeypatch.setattr(*patch)
    got = mutated_logits(tiny_zaya_dir, mutate_config, mutate)
    assert max_diff(got, reference) > 100 * TOL, name


def test_no_host_sync_in_a_step(tiny_zaya_dir, no_host_sync):
    """A step with a replay, a verify chunk and a fresh prefill reads no tensor's value on the host (the experts as
    graph steps run them: sync_free_experts)."""
    from specray.models.moe import sync_free_experts

    run = Stepper(load_model(str(tiny_zaya_dir)))
    seq = tokens(24, 10)
    run.step([(0, seq[:8], 0, 0)])
    run.step([(0, seq[8:11], 8, 2)])
    with no_host_sync(), sync_free_experts():
        run.step([(0, seq[10:12], 10, 1), (1, seq[:20], 0, 0)])


# ---- the engine --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(tiny_zaya_dir) -> list[list[int]]:
    from specray import LLM

    return generate(LLM(model=str(tiny_zaya_dir), max_model_len=128), greedy())


def test_plain_engine_equals_transformers(tiny_zaya_dir, plain):
    """(check_greedy_equals_transformers) several requests at once, each in its own state slot."""
    check_greedy_equals_transformers(tiny_zaya_dir, plain)


def test_ngram_chains_from_graphs_keep_greedy(tiny_zaya_dir, plain, monkeypatch):
    """(check_ngram_replays_keep_greedy) n-gram chains from graph steps (the fixed-shape recurrence): plain greedy's
    tokens, drafts accepted and replayed."""
    check_ngram_replays_keep_greedy(tiny_zaya_dir, plain, False, monkeypatch)


def test_ngram_trees_keep_greedy(tiny_zaya_dir, plain, monkeypatch):
    """(check_ngram_replays_keep_greedy) trees of three branches from graph steps (each row's convs and delayed
    values over its own path), paths other than the first branch accepted (their K/V and pending conv inputs moved
    into path order, then replayed): plain greedy's tokens."""
    from specray.workers.model_runner import ModelRunner

    rows, moves = [], []
    tree_conv, apply = zaya.CCAProjection._tree_conv, ModelRunner.apply_plan_state
    monkeypatch.setattr(zaya.CCAProjection, "_tree_conv", lambda self, r: rows.append(len(r)) or tree_conv(self, r))
    monkeypatch.setattr(ModelRunner, "apply_plan_state", lambda self, plan: moves.extend(plan.kv_moves) or apply(
        self, plan))
    check_ngram_replays_keep_greedy(tiny_zaya_dir, plain, True, monkeypatch)
    assert rows and moves, "no tree verified, or only first branches accepted"


@pytest.mark.parametrize("case", ["chunked-prefill", "preemption"])
def test_chunked_prefill_and_preemption_keep_greedy(tiny_zaya_dir, plain, case):
    """n-gram chains with prefills in chunks of a few tokens (the conv state carried between them), and with a KV pool
    so small that requests are preempted and recompute their state from token 0: plain greedy's tokens."""
    from specray import LLM

    kw = {"chunked-prefill": dict(max_num_batched_tokens=8, long_prefill_token_threshold=5),
          "preemption": dict(block_size=4, num_kv_blocks=24)}[case]
    llm = LLM(model=str(tiny_zaya_dir), max_model_len=128, speculative_config=NGRAM, **kw)
    assert generate(llm, greedy()) == plain
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_caching_keeps_tokens(tiny_zaya_dir):
    """(check_prefix_caching_keeps_tokens) second turns behind cached blocks and kept conv states give the tokens an
    engine without prefix caching gives."""
    check_prefix_caching_keeps_tokens(tiny_zaya_dir)


# ---- refusals ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["hybrid", "sliding_attention", "hybrid"]), "layer_types="),
    (dict(sliding_window=None), "sliding_window=None"),
    (dict(num_experts_per_tok=2), "num_experts_per_tok=2"),
])
def test_config_refusals(tiny_zaya_dir, change, match):
    config = read_config(str(tiny_zaya_dir))
    for field, value in change.items():
        setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_zaya_dir), config=config)


def test_split_and_lora_refusals(tiny_zaya_dir):
    """Pipeline stages (the router state crosses every layer), TP past the KV heads (a key's residual averages its
    whole group), LoRA: refused before any rank starts, by name."""
    from specray import LLM

    for kw, match in ((dict(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
                      (dict(tensor_parallel_size=4), "num_key_value_heads=2"),
                      (dict(enable_lora=True), "enable_lora")):
        with pytest.raises(ValueError, match=match):
            LLM(model=str(tiny_zaya_dir), max_model_len=128, **kw)


def test_balancing_biases_default_as_transformers_starts_them(tiny_zaya_dir, tmp_path, reference):
    """A checkpoint without the routers' balancing biases loads, with transformers' initial ones (0, the skip class
    -1): its logits equal transformers' on that folder (and differ from the fixture's, whose biases are others)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_zaya_dir / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if not n.endswith("balancing_biases")}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny_zaya_dir / "config.json").read_text())
    got = chunked_logits(load_model(str(tmp_path)), prompt(), SCHEDULES["prefill"])
    assert max_diff(got, reference_logits(tmp_path)) < TOL
    assert max_diff(got, reference) > 100 * TOL


def test_half_a_value_projection_is_refused(tiny_zaya_dir, tmp_path):
    """A checkpoint with one of a layer's two value projections is refused, naming the stacked value."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_zaya_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.qkv_proj.v_proj_delayed.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny_zaya_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.v_proj\.weight.*v_proj_delayed"):
        load_model(str(tmp_path))


# ---- tensor parallelism --------------------------------------------------------------------------------------------

def test_tensor_parallel_shards_match_one_rank(tiny_zaya_dir, tmp_path):
    """TP 2 over gloo: the query and KV heads, their convs (depthwise and per head), the value rows (one rank's all
    current, the other's all delayed: its conv state holds them), the key temperatures and the experts' widths split
    over the ranks, the routers replicated; logits of prefills, a verify chunk and the replay after it equal one
    rank's."""
    folder = str(tiny_zaya_dir)
    for r, result in enumerate(run_ranks(tmp_path, TP_WORKER, 2, 2, [folder], timeout=240)):
        diff, _ = result[folder]
        assert diff < TOL, (r, diff)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_zaya_dir, schedule):
    """tests/test_device_parity.py's check for this file's fixture: fp32 logits on CUDA equal the CPU's, within
    5e-4 (the router MLP's outputs reach about 10 in the tiny model, and fp32 sums in the GPU's order moved its decode
    steps' logits by 1.06e-4 on an H200, 2026-11-30)."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(tiny_zaya_dir, SCHEDULES[schedule], 5e-4)
