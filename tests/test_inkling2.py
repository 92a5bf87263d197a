"""Inkling 2's text model (``Inkling2ForCausalLM``: specray.models.inkling2) against transformers on the same random
weights (fp32, max abs diff < 1e-4): a prefill and chunks then single steps; two sequences batched in uneven chunks;
verify chunks whose accepted drafts every short conv replays (the dynamic ones' per-token taps too); each of its own
parts broken once, which the comparison must see; the engine end to end (greedy, n-gram chains and trees, trees from
graphs, preemption); the multimodal release's text model; the refusals; TP 2 against one rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import specray.models.inkling2 as ink
from specray.models.loader import load_model, read_config
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    NGRAM, PROMPT_IDS, TP_WORKER, check_drafts_replayed, check_prefill_chunks_and_decode, generate, greedy)
from specray_test_engine_runs import refused_on_this_gpu  # tests/engine_runs.py
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, chunked_logits, max_diff, mutated_logits, prompt, run_ranks)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
PAD = 16  # the unembedding's padding rows past unpadded_vocab_size (the tokenizer's size)
# sliding, global, sliding, global; a new block every second layer (layers 0 and 2 save the stream); a window of 6
# and a relative extent of 10 tokens, a log-scale floor of 8 positions, clips low enough to bite (so that every one
# of them shows within the checks' 40-token prompts); two KV heads per kind (TP 2 splits them)
TINY = dict(hidden_size=64, num_hidden_layers=4, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
            swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=6, d_rel=8, rel_extent=10,
            log_scaling_n_floor=8, conv_kernel_size=4, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_layers_per_attn_res_block=2, qk_l2_clip_threshold=1.5,
            rel_l2_clip_threshold=0.8, initializer_range=0.1, bos_token_id=None, pad_token_id=None)
NEW_TOKENS = 20


def build_inkling2(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random Inkling 2 folder as transformers saves it (the release's names) with conftest's tiny tokenizer,
    its unembedding padded by PAD rows. What transformers starts at ones or zeros (norms, clip scales, the block
    queries, the dynamic convs' static taps, the router and its bias) drawn at random, so that a wrong formula
    shows."""
    import transformers as tf

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    config = tf.Inkling2TextConfig(**{**TINY, "vocab_size": len(tok) + PAD, "unpadded_vocab_size": len(tok),
                                      "eos_token_id": tok.eos_token_id, **overrides})
    torch.manual_seed(seed)
    model = tf.Inkling2ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".scale")):
                param.uniform_(0.5, 1.5)
            elif name.endswith((".query", "static_weight", "conv1d.weight", "mlp.gate.weight")):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
        model.lm_head.weight.mul_(3.0)  # (peaked logits: greedy decoding loops now and then, drafts get accepted)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_inkling2_dir(tmp_path_factory) -> Path:
    return build_inkling2(tmp_path_factory.mktemp("tiny_inkling2"), seed=6)


@pytest.fixture(scope="module")
def hf_inkling2(tiny_inkling2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_inkling2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(hf_inkling2):
    with torch.no_grad():
        return hf_inkling2(torch.tensor([prompt()])).logits[0].float()


def unpadded(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Our logits [N, vocab_size] cut to transformers' unpadded_vocab_size columns; those past must be the pad."""
    cut = reference.shape[-1]
    assert logits.shape[-1] == cut + PAD and (logits[:, cut:] == float("-inf")).all()
    return logits[:, :cut]


# ---- logits against transformers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_inkling2_dir, reference, schedule):
    """A 40-token prefill, and the same prompt in chunks (17: attended alone; 9, 3: the short batch) then single
    tokens, the conv histories carried in slot 0: every logit row equals transformers', and the padded rows of the
    unembedding are the pad."""
    model = load_model(str(tiny_inkling2_dir))
    assert type(model).__name__ == "Inkling2ForCausalLM"
    got = unpadded(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference)
    assert max_diff(got, reference) < TOL


def test_batched_chunks_and_replayed_drafts_match_transformers(tiny_inkling2_dir, hf_inkling2):
    """(check_prefill_chunks_and_decode, check_drafts_replayed: tests/hybrid_models.py) two sequences batched in
    uneven chunks, then decode steps; verify chunks whose accepted drafts the next chunk replays through every conv
    (the dynamic ones with each draft's own taps), the rejected ones' never seen."""
    model = load_model(str(tiny_inkling2_dir))
    cut = hf_inkling2.config.unpadded_vocab_size
    full = model.compute_logits
    model.compute_logits = lambda hidden: full(hidden)[:, :cut]
    check_prefill_chunks_and_decode(model, hf_inkling2)
    check_drafts_replayed(model, hf_inkling2)


def _no_block_attention(self, blocks, x):  # the stream as it is, in place of the attention over the blocks
    return (x.float(),) * (1 if self.query.dim() == 1 else self.query.shape[0])


def _static_only(self, windows):  # the global layers' convs without the per-token taps
    k, c = self.kernel, self.width
    x = windows[..., :c].float()
    taps = self.static_weight.float().flip(0)  # [K, C] oldest first
    return ((x * taps).sum(-2) + x[..., -1, :]) / (2 * k + 1) ** 0.5


def _conv_without_input(self, windows):  # the short conv without the token's own input added
    x = windows.float()
    return (x * self.conv1d.weight.float().t()).sum(-2) / (self.kernel + 1) ** 0.5


def _plain_swiglu(self, h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


_ATTEND = ink.BiasedAttention.forward


def _no_bias(self, q, k, v, meta, profiles=None, sinks=None):
    return _ATTEND(self, q, k, v, meta, profiles * 0.0, sinks)


def _no_sinks(self, q, k, v, meta, profiles=None, sinks=None):  # a sink logit so low it takes no weight
    return _ATTEND(self, q, k, v, meta, profiles, sinks - 1e4)


def _no_output_gate(model):  # sigmoid(0) = 1/2 for every gate, doubled back by wo_ud: no gate at all
    for module in model.modules():
        if isinstance(module, ink.Inkling2Attention):
            module.gate_attn.weight.data.zero_()
            module.wo_ud.weight.data.mul_(2.0)


def _no_window(model):  # the sliding layers' queries see every earlier key (their bias still within the window)
    from specray.models.kv_cache import CAUSAL

    for module in model.modules():
        if isinstance(module, ink.Inkling2Attention) and module.sliding:
            module.attn.mask_kind = CAUSAL


def _set_all(cls, attr, value):
    def mutate(model):
        for module in model.modules():
            if isinstance(module, cls):
                setattr(module, attr, value)
    return mutate


# name -> (mutate_config, mutate(model), monkeypatched (object, attribute, value) or None)
MUTATIONS = {
    "block attention residual left out": (None, None, (ink.BlockAttentionResidual, "forward", _no_block_attention)),
    "relative position bias left out": (None, None, (ink.BiasedAttention, "forward", _no_bias)),
    "per-token sinks left out": (None, None, (ink.BiasedAttention, "forward", _no_sinks)),
    "no sliding window": (None, _no_window, None),
    "no log scale on global layers": (None, _set_all(ink.Inkling2Attention, "alpha", 0.0), None),
    "no q/k L2 clip": (None, _set_all(ink.Inkling2Attention, "qk_clip", 1e9), None),
    "no relative-state L2 clip": (None, _set_all(ink.Inkling2Attention, "rel_clip", 1e9), None),
    "dynamic conv's per-token taps left out": (None, None, (ink.Inkling2DynamicConv, "_taps", _static_only)),
    "short convs without their input added": (None, None, (ink.Inkling2Conv, "_taps", _conv_without_input)),
    "output gate left out": (None, _no_output_gate, None),
    "experts' plain SwiGLU": (None, None, (ink.Inkling2MoE, "_activate", _plain_swiglu)),
    "logits not soft-capped": (None, _set_all(ink.Inkling2ForCausalLM, "cap", 0.0), None),
    "embedding not normed": (None, None, (ink.Inkling2Model, "embed", lambda self, ids: self.embed_tokens(ids))),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_part_shows_in_the_logits(tiny_inkling2_dir, reference, monkeypatch, name):
    """The comparison above can fail: each distinctive part (module docstring) broken once moves the chunked + decode
    schedule's logits far past tolerance."""
    mutate_config, mutate, patch = MUTATIONS[name]
    if patch is not None:
        monkeypatch.setattr(*patch)
    got = mutated_logits(tiny_inkling2_dir, mutate_config, mutate)
    assert max_diff(unpadded(got, reference), reference) > MOVED, name


# ---- the multimodal release --------------------------------------------------------------------------------------

def test_multimodal_checkpoint_serves_its_text_model(tiny_inkling2_dir, reference, tmp_path):
    """Inkling2ForConditionalGeneration's checkpoint (model_type inkling2, the text model's tensors under
    ``model.llm.`` as transformers saves them, the vision tower under ``model.visual.``): the text model is built
    from its text_config and reads its own tensors alone; its logits equal the text model's in transformers."""
    from safetensors.torch import load_file, save_file

    text = json.loads((tiny_inkling2_dir / "config.json").read_text())
    folder = tmp_path / "mm"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny_inkling2_dir / name).exists():
            (folder / name).write_text((tiny_inkling2_dir / name).read_text())
    config = {"architectures": ["Inkling2ForConditionalGeneration"], "model_type": "inkling2",
              "text_config": {k: v for k, v in text.items() if k != "architectures"},
              "vision_config": {"model_type": "inkling2_vision", "hidden_size": 32, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "text_hidden_size": TINY["hidden_size"]},
              "image_token_id": 5}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(tiny_inkling2_dir / "model.safetensors")
    tensors["model.visual.proj_in.weight"] = torch.zeros(3, 3)  # (a tower tensor: never offered to the text model)
    save_file(tensors, folder / "model.safetensors")
    model = load_model(str(folder))
    assert type(model).__name__ == "Inkling2ForCausalLM"
    got = unpadded(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference)
    assert max_diff(got, reference) < TOL


# ---- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, match", [
    ("loop_num_passes", 3, r"loop_num_passes=3 is not supported"),
    ("layer_types", ["hybrid_sliding", "linear", "hybrid_sliding", "hybrid"], r"layer_types\[1\]='linear'"),
    ("mlp_up_softcap", 0.0, r"mlp_up_softcap=0.0"),
])
def test_config_refusals(tiny_inkling2_dir, field, value, match):
    """What this module does not build is a ValueError naming the field: the looped release's loop (its passes
    over the middle layers), an unknown kind of layer, an experts' cap of zero."""
    config = read_config(str(tiny_inkling2_dir))
    setattr(config, field, value)
    if field == "loop_num_passes":
        config.loop_layer_index_start, config.loop_layer_index_end = 2, 4
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_inkling2_dir), config=config)


def test_engine_refusals(tiny_inkling2_dir):
    """Two pipeline stages (every layer reads every saved block) and a TP size that does not split the heads."""
    from specray import LLM

    for kw, match in ((dict(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
                      (dict(tensor_parallel_size=3), "tensor_parallel_size=3")):
        with pytest.raises(ValueError, match=match):
            LLM(model=str(tiny_inkling2_dir), max_model_len=128, **kw)


# ---- the engine --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_greedy(hf_inkling2) -> list[list[int]]:
    """transformers' ``generate`` (greedy, NEW_TOKENS tokens, no stop at EOS) for each of PROMPT_IDS."""
    hf_inkling2.generation_config.eos_token_id = None
    outs = []
    for ids in PROMPT_IDS:
        out = hf_inkling2.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("case", ["chains", "trees", "trees-graphs", "preemption"])
def test_ngram_greedy_equals_transformers_generate(tiny_inkling2_dir, hf_greedy, monkeypatch, case):
    """n-gram drafts (some accepted, some rejected: the accepted ones replayed through every conv) give transformers'
    greedy tokens: chains from graph steps (on CPU their padded static inputs: the convs' fixed-shape form); token
    trees of three branches (each row's convs over its own path, the accepted path's
    K/V and pending conv inputs moved), eagerly and from graphs; a KV pool so small that requests are preempted and
    recompute from token 0."""
    from specray import LLM
    from specray.models.step_graphs import StepGraphs

    shapes, run = [], StepGraphs.run
    monkeypatch.setattr(StepGraphs, "run", lambda self, shape, *a, **k: shapes.append(shape) or run(
        self, shape, *a, **k))
    spec = {**NGRAM, "num_speculative_tokens": 6, "num_branches": 3} if case.startswith("trees") else NGRAM
    kw = {"chains": dict(enforce_eager=False), "trees": dict(block_size=4, enforce_eager=True),
          "trees-graphs": dict(block_size=4, enforce_eager=False),
          "preemption": dict(block_size=4, num_kv_blocks=24, enforce_eager=True)}[case]
    llm = LLM(model=str(tiny_inkling2_dir), max_model_len=128, speculative_config=spec, **kw)
    runner, moves = llm.engine.executor.worker.runner, []
    apply = runner.apply_plan_state
    runner.apply_plan_state = lambda plan: moves.extend(plan.kv_moves) or apply(plan)
    assert generate(llm, greedy(NEW_TOKENS)) == hf_greedy
    stats = llm.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, stats
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if case.startswith("trees"):
        assert moves, "no tree path other than the first branch was accepted"
    graphs = case in ("chains", "trees-graphs") and not refused_on_this_gpu(llm)
    assert bool(shapes) == graphs, "graph steps (on CPU: their padded static inputs)"


def test_engine_comparison_can_fail(tiny_inkling2_dir, hf_greedy, monkeypatch):
    """The comparison above can fail: replaying no accepted draft (the convs' histories left where the last verify
    chunk began) changes the output."""
    from specray import LLM
    from specray.workers.model_runner import RecurrentSlots

    real = RecurrentSlots.batch

    def no_replay(self, chunks):
        batch = real(self, chunks)
        batch.replay = [0] * len(batch.replay)
        return batch

    monkeypatch.setattr(RecurrentSlots, "batch", no_replay)
    llm = LLM(model=str(tiny_inkling2_dir), max_model_len=128, speculative_config=NGRAM)
    out = generate(llm, greedy(NEW_TOKENS))
    assert all(len(o) == NEW_TOKENS for o in out) and out != hf_greedy


# ---- tensor parallelism --------------------------------------------------------------------------------------------

def test_tensor_parallel_shards_match_one_rank(tiny_inkling2_dir, tmp_path):
    """TP 2 over gloo: each kind's query and KV heads (their clip scales, the k / v convs' channels, the dynamic taps'
    heads, the relative states, sinks and output gate rows) and the experts' width split over the ranks; logits of
    prefills, a verify chunk and the replay after it equal one rank's."""
    folder = str(tiny_inkling2_dir)
    for r, result in enumerate(run_ranks(tmp_path, TP_WORKER, 2, 2, [folder], timeout=240)):
        diff, heads = result[folder]
        assert diff < TOL, (r, diff)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_inkling2_dir, schedule):
    """tests/test_device_parity.py's check for this file's fixture: fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(tiny_inkling2_dir, SCHEDULES[schedule])
