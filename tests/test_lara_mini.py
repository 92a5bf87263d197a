"""Lara Mini (``LaraMiniForCausalLM``: specray.models.lara_mini) against transformers on the same random weights (fp32,
max abs diff < 1e-4): a prefill, chunks then single steps with the recurrent state carried, two sequences batched in
uneven chunks, drafts replayed after verification; the release's fused ``in_proj`` and ``out_norm`` read (and a
folder with them apart); each of its own parts broken once, which the comparison must see (what it computes in float32
where Qwen3-Next rounds first: against transformers in bfloat16); the engine end to end
(plain greedy and n-gram chains and trees equal transformers' ``generate``, with chunked prefill, preemption, prefix
caching); the refusals; TP 2 and two pipeline stages against one rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import specray.models.lara_mini as lara
from specray.models.gated_deltanet import GatedRMSNorm
from specray.models.layers import RMSNorm
from specray.models.loader import load_model, read_config
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    NGRAM, PP_WORKER, PROMPT_IDS, TOL, TP_WORKER, check_drafts_replayed, check_lora_keeps_transformers_logits,
    check_prefill_chunks_and_decode, check_prefix_caching_keeps_tokens, generate, greedy)
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, chunked_logits, max_diff, mutated_logits, prompt, reference_logits, run_ranks)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the releases' period of five layers (linear, sliding, linear, full, sliding); a window of 6 tokens, so that the
# sliding layers' window shows within the checks' prompts
TINY_LARA = dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                 linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 sliding_window=6, bos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
NEW_TOKENS = 24


def build_lara_mini(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random Lara Mini folder (transformers' save: fused ``in_proj``, ``out_norm``) with conftest's tiny
    tokenizer. Norm weights (ones at init) drawn from [0.5, 1.5] and the router (zeros at init) from N(0, 0.5), so
    that a wrong norm or routing shows; the tied embedding doubled, so that greedy decoding falls into loops now and
    then (n-gram drafts then accepted in some steps and rejected in others)."""
    import transformers as tf

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    config = tf.LaraMiniConfig(**{**TINY_LARA, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                                  **overrides})
    torch.manual_seed(seed)
    model = tf.LaraMiniForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(("mlp.gate.weight", "dt_bias")):
                param.normal_(0.0, 0.5)
        model.get_input_embeddings().weight.mul_(2.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_lara_mini_dir(tmp_path_factory) -> Path:
    # (a seed whose n-gram trees have paths other than the first branch accepted: K/V moves made)
    return build_lara_mini(tmp_path_factory.mktemp("tiny_lara_mini"), seed=1)


@pytest.fixture(scope="module")
def hf_lara(tiny_lara_mini_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_lara_mini_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(tiny_lara_mini_dir):
    return reference_logits(tiny_lara_mini_dir)


# ---- logits against transformers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_lara_mini_dir, reference, schedule):
    """A 40-token prefill, and the same prompt in chunks (17, 9, 3) then single tokens, the state carried in slot 0:
    every logit row equals transformers'."""
    model = load_model(str(tiny_lara_mini_dir))
    assert type(model).__name__ == "LaraMiniForCausalLM"
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def test_batched_chunks_and_replayed_drafts_match_transformers(tiny_lara_mini_dir, hf_lara):
    """(check_prefill_chunks_and_decode, check_drafts_replayed: tests/hybrid_models.py) two sequences batched in
    uneven chunks, then decode steps; verify chunks whose accepted drafts the next chunk replays."""
    model = load_model(str(tiny_lara_mini_dir))
    check_prefill_chunks_and_decode(model, hf_lara)
    check_drafts_replayed(model, hf_lara)


def test_release_layout_is_read(tiny_lara_mini_dir, reference, tmp_path):
    """transformers saves what the releases ship, each linear layer's projections fused in one ``in_proj`` (rows
    q | k | v | z | b | a) and its gated norm as ``out_norm``; a folder with them apart (transformers' module names)
    loads to the same logits; an ``in_proj`` of the wrong height is a ValueError naming the sizes."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_lara_mini_dir / "model.safetensors")
    assert "model.layers.0.linear_attn.in_proj.weight" in tensors
    assert "model.layers.0.linear_attn.out_norm.weight" in tensors
    assert not any(".in_proj_" in n or ".linear_attn.norm." in n for n in tensors)
    model = load_model(str(tiny_lara_mini_dir))
    apart = {}
    for name, tensor in tensors.items():
        if ".linear_attn.in_proj." in name:
            apart.update(model._split_in_proj(name, tensor))
        else:
            apart[name.replace(".out_norm.", ".norm.")] = tensor
    for folder, weights in (("apart", apart), ("short", {**tensors, "model.layers.2.linear_attn.in_proj.weight":
                                                         tensors["model.layers.2.linear_attn.in_proj.weight"][:-1]})):
        (tmp_path / folder).mkdir()
        save_file(weights, tmp_path / folder / "model.safetensors")
        (tmp_path / folder / "config.json").write_text((tiny_lara_mini_dir / "config.json").read_text())
    got = chunked_logits(load_model(str(tmp_path / "apart")), prompt(), SCHEDULES["chunked+decode"])
    assert max_diff(got, reference) < TOL
    with pytest.raises(ValueError, match=r"in_proj.weight has 135 rows .* need 136"):
        load_model(str(tmp_path / "short"))


def _flint_router(self, x, token_ids=None):  # Flint's: sigmoids of the top k logits, renormalised
    logits, ids = F.linear(x.float(), self.router_module.weight.float()).topk(self.top_k, dim=-1)
    weights = torch.sigmoid(logits)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), ids


def _layers(model, kind: str):
    return [layer for layer in model.model.layers if layer.layer_type == kind]


def _set(attr: str, value, kind: str):
    def mutate(model):
        for layer in _layers(model, kind):
            setattr(layer.self_attn, attr, value)
    return mutate


def _one_plus_w(model):  # Qwen3-Next's norms: 1 + w (the stack's and the q/k norms)
    for module in model.modules():
        if isinstance(module, lara.Fp32RMSNorm):
            module.weight.data += 1.0


def _gated_shared_expert(model):  # Qwen3-Next's sigmoid gate on the shared expert, at a zero gate weight: halved
    for layer in model.model.layers:
        layer.mlp.shared_expert.down_proj.weight.data *= 0.5


# name -> (mutate_config, mutate, monkeypatched (object, attribute, value) or None)
MUTATIONS = {
    "full layers rotated (RoPE, not NoPE)": (None, _set("use_rope", True, "full_attention"), None),
    "sliding layers unrotated": (None, _set("use_rope", False, "sliding_attention"), None),
    "no sliding window": (lambda c: setattr(c, "sliding_window", 4096), None, None),
    "q/k norms left out": (None, lambda m: [_set(a, None, k)(m) for a in ("q_norm", "k_norm")
                                            for k in ("sliding_attention", "full_attention")], None),
    "norms scale by 1 + w": (None, _one_plus_w, None),
    "shared expert gated": (None, _gated_shared_expert, None),
    "top k not renormalised": (lambda c: setattr(c, "norm_topk_prob", False), None, None),
    "Flint's sigmoid router": (None, None, (lara.LaraMiniMoE, "route", _flint_router)),
    "in_proj's b and a swapped": (None, None, (lara, "IN_PROJ_PARTS",
                                               ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"))),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_part_matters(tiny_lara_mini_dir, reference, monkeypatch, name):
    """The comparison above can fail: each of Lara Mini's own parts (module docstring) broken once moves the chunked
    + decode schedule's logits far past tolerance."""
    mutate_config, mutate, patch = MUTATIONS[name]
    if patch is not None:
        monkeypatch.setattr(*patch)
    got = mutated_logits(tiny_lara_mini_dir, mutate_config, mutate)
    assert max_diff(got, reference) > 100 * TOL, name


def _bf16_router(self, x, token_ids=None):  # Qwen3-Next's: router logits in x's dtype, the softmax in float32
    probs = F.softmax(F.linear(x, self.router_module.weight), dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(self.top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), ids


BF16_TOL = 0.1  # a few bfloat16 steps at the logits' size (|logit| < 8 here: a step is 1/32)
# what Lara computes in float32 where Qwen3-Next (or the plain layers) round to the model's dtype first
BF16_MUTATIONS = {"norm weights in bf16": (lara.Fp32RMSNorm, "_norm", RMSNorm._norm),
                  "gated norm in bf16": (lara.Fp32GatedRMSNorm, "forward", GatedRMSNorm.forward),
                  "router logits in bf16": (lara.LaraMiniMoE, "route", _bf16_router)}


def test_float32_details_show_in_bfloat16(tiny_lara_mini_dir, monkeypatch):
    """In bfloat16 a prefill's logits equal transformers' bfloat16 ones (bit for bit on the CPU this was written on;
    within BF16_TOL asked), and each detail Lara computes in float32 (its norms' weights, the gated norm, the router's
    logits), done in bfloat16 instead, moves them past it: what the fp32 comparisons cannot see."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_lara_mini_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt()])).logits[0].float()

    def error() -> float:
        model = load_model(str(tiny_lara_mini_dir), dtype=torch.bfloat16)
        return max_diff(chunked_logits(model, prompt(), SCHEDULES["prefill"]), want)

    assert error() < BF16_TOL
    for name, patch in BF16_MUTATIONS.items():
        monkeypatch.setattr(*patch)
        assert error() > BF16_TOL, name
        monkeypatch.undo()


def test_out_norm_must_be_renamed(tiny_lara_mini_dir, monkeypatch):
    """Without the ``out_norm`` rename the gated norms are missing, and the load says so."""
    monkeypatch.setattr(lara, "_RENAMES", ())
    with pytest.raises(ValueError, match=r"missing .*linear_attn\.norm\.weight"):
        load_model(str(tiny_lara_mini_dir))


# ---- the engine --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_greedy(tiny_lara_mini_dir, hf_lara) -> list[list[int]]:
    """transformers' ``generate`` (greedy, NEW_TOKENS tokens, no stop at EOS) for each of PROMPT_IDS."""
    hf_lara.generation_config.eos_token_id = None
    outs = []
    for ids in PROMPT_IDS:
        out = hf_lara.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(ids):].tolist())
    return outs


def test_plain_engine_equals_transformers_generate(tiny_lara_mini_dir, hf_greedy):
    from specray import LLM

    assert generate(LLM(model=str(tiny_lara_mini_dir), max_model_len=128), greedy(NEW_TOKENS)) == hf_greedy


@pytest.mark.parametrize("case", ["chains", "chunked-prefill", "preemption", "trees", "trees-graphs"])
def test_ngram_greedy_equals_transformers_generate(tiny_lara_mini_dir, hf_greedy, case):
    """n-gram drafts (some accepted, some rejected: the accepted ones replayed over the recurrent state) give
    transformers' greedy tokens: chains batched, with prefills in small chunks, with a KV pool so small that requests
    are preempted and recompute their state from token 0; token trees (three branches: each draft's state along its
    own path, the accepted path's K/V and pending inputs moved), eagerly and beside chain steps from graphs."""
    from specray import LLM

    spec = {**NGRAM, "num_speculative_tokens": 6, "num_branches": 3} if case.startswith("trees") else NGRAM
    kw = {"chunked-prefill": dict(max_num_batched_tokens=8, long_prefill_token_threshold=5),
          "preemption": dict(block_size=4, num_kv_blocks=24), "trees": dict(block_size=4, enforce_eager=True),
          "trees-graphs": dict(block_size=4, enforce_eager=False)}.get(case, {})
    llm = LLM(model=str(tiny_lara_mini_dir), max_model_len=128, speculative_config=spec, **kw)
    moves = []
    if case.startswith("trees"):
        runner = llm.engine.executor.worker.runner
        apply = runner.apply_plan_state

        def recording(plan):
            moves.extend(plan.kv_moves)
            return apply(plan)

        runner.apply_plan_state = recording
    assert generate(llm, greedy(NEW_TOKENS)) == hf_greedy
    stats = llm.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, stats
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if case.startswith("trees"):
        assert moves, "no tree path other than the first branch was accepted"


def test_engine_comparison_can_fail(tiny_lara_mini_dir, hf_greedy, monkeypatch):
    """The comparison above can fail: replaying no accepted draft (the state left where the last verify chunk began)
    changes the output."""
    from specray import LLM
    from specray.workers.model_runner import RecurrentSlots

    real = RecurrentSlots.batch

    def no_replay(self, chunks):
        batch = real(self, chunks)
        batch.replay = [0] * len(batch.replay)
        return batch

    monkeypatch.setattr(RecurrentSlots, "batch", no_replay)
    llm = LLM(model=str(tiny_lara_mini_dir), max_model_len=128, speculative_config=NGRAM)
    out = generate(llm, greedy(NEW_TOKENS))
    assert all(len(o) == NEW_TOKENS for o in out) and out != hf_greedy


def test_graphs_allowed(tiny_lara_mini_dir):
    """Decode and verify steps may replay graphs (the trees-graphs case above runs its chain steps so): the linear
    layers' fixed-shape recurrence, paged attention, the experts' grouped path; nothing blocks a capture."""
    from specray.models.step_graphs import graph_safe

    assert graph_safe(load_model(str(tiny_lara_mini_dir))) is None


def test_prefix_caching_keeps_tokens(tiny_lara_mini_dir):
    """(check_prefix_caching_keeps_tokens, tests/hybrid_models.py): second turns behind cached blocks and kept
    recurrent states give the tokens an engine without prefix caching gives."""
    check_prefix_caching_keeps_tokens(tiny_lara_mini_dir)


@pytest.mark.parametrize("kw, match", [
    (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1}), "no MTP layer"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3"),
])
def test_refusals(tiny_lara_mini_dir, kw, match):
    """No MTP layer to draft with; a TP size that does not split the linear layers' heads."""
    from specray import LLM

    with pytest.raises(ValueError, match=match):
        LLM(model=str(tiny_lara_mini_dir), max_model_len=128, **kw)


def test_config_refusals(tiny_lara_mini_dir):
    """A config whose layer kinds or sliding window this module does not build: a ValueError naming the field."""
    for change, match in ((dict(layer_types=["linear_attention", "mamba", "linear_attention", "full_attention",
                                             "sliding_attention"]), "layer_types="),
                          (dict(sliding_window=None), "sliding_window=None")):
        config = read_config(str(tiny_lara_mini_dir))
        for field, value in change.items():
            setattr(config, field, value)
        with pytest.raises(ValueError, match=match):
            load_model(str(tiny_lara_mini_dir), config=config)


# ---- tensor parallelism and pipeline stages ---------------------------------------------------------------------

def test_tensor_parallel_shards_match_one_rank(tiny_lara_mini_dir, tmp_path):
    """TP 2 over gloo: the linear layers' key and value heads (their fused in_proj split, then each part's rows), the
    attention heads (sliding and global) and the experts' and shared expert's widths split over the ranks; logits of
    prefills, a verify chunk and the replay after it equal one rank's."""
    folder = str(tiny_lara_mini_dir)
    for r, result in enumerate(run_ranks(tmp_path, TP_WORKER, 2, 2, [folder], timeout=240)):
        diff, heads = result[folder]
        assert diff < TOL, (r, diff)
        assert heads == TINY_LARA["linear_num_value_heads"] // 2


def test_pipeline_stages_match_one_rank(tiny_lara_mini_dir, tmp_path):
    """Two pipeline stages over gloo (each keeps the recurrent states of its own linear layers and the K/V of its
    attention layers): the last stage's logits of prefills, a verify chunk and the replay after it equal one rank's."""
    folder = str(tiny_lara_mini_dir)
    first, last = run_ranks(tmp_path, PP_WORKER, 2, 2, [folder], timeout=240)
    (first_layers, none), (last_layers, diff) = first[folder], last[folder]
    assert none is None and first_layers + last_layers == list(range(TINY_LARA["num_hidden_layers"]))
    assert diff < TOL, diff


def test_config_of_the_fixture_is_the_releases_pattern(tiny_lara_mini_dir):
    """The fixture's layers are the releases' period (transformers' default layer_types), so every kind is tested."""
    config = json.loads((tiny_lara_mini_dir / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention", "sliding_attention", "linear_attention", "full_attention",
                                     "sliding_attention"]
    assert config["architectures"] == ["LaraMiniForCausalLM"] and config["tie_word_embeddings"]


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_lara_mini_dir, schedule):
    """tests/test_device_parity.py's check for this file's fixture (that file's list cannot reach a fixture defined
    here): fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(tiny_lara_mini_dir, SCHEDULES[schedule])


# ---------------------------------------------------------------------------------------------- LoRA


def test_lora_adapted_logits_match_transformers_with_the_adapter_merged(tiny_lara_mini_dir, tmp_path):
    """LoRA on the attention layers' q/k/v/o, the linear layers' fused ``in_proj`` (its B split into q | k | v | z |
    b | a as the weight is) and out_proj, and the shared experts; the router (``mlp.gate``) is refused by name."""
    leaves = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "gate_proj", "up_proj", "down_proj")
    check_lora_keeps_transformers_logits(tiny_lara_mini_dir, tmp_path, leaves, "gate")
