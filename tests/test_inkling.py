"""Inkling's text model (``InklingForCausalLM``: specray.models.inkling) against transformers on the same random weights
(fp32, max abs diff < 1e-4): a prefill, chunks then single steps with the four short convs' histories carried, two
sequences batched in uneven chunks, verify chunks whose accepted drafts the next chunk replays; a head padded past
``unpadded_vocab_size``; each distinctive part broken once, which the comparison must see; the multimodal release
(``InklingForConditionalGeneration``, the release's own tensor names) serving its text model; the engine end to end
(greedy and n-gram chains, trees and graph steps equal transformers' ``generate``; chunked prefill, preemption); the
refusals; TP 2 and two pipeline stages against one rank."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import specray.models.inkling as inkling
from specray.models.kv_cache import CAUSAL
from specray.models.layers import VocabParallelEmbedding
from specray.models.loader import load_model, read_config
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    NGRAM, PP_WORKER, PROMPT_IDS, TOL, TP_WORKER, check_drafts_replayed, check_lora_keeps_transformers_logits,
    check_prefill_chunks_and_decode, check_prefix_caching_keeps_tokens, check_tree_rows_match_their_paths, generate,
    greedy)
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, chunked_logits, max_diff, mutated_logits, prompt, reference_logits, run_ranks)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# three layers: sliding (dense MLP), full (experts), sliding (experts); the sliding layers' heads of their own size; a
# window of 6 and a relative extent of 10, both short of the checks' prompts, so that the window and the bias's end
# show; log scaling from position 8; the logits' muP divisor below 1, so that they are not tiny
TINY_INKLING = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=12, sliding_window_size=6,
                    d_rel=4, rel_extent=10, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                    mlp_layer_types=["dense", "sparse", "sparse"], intermediate_size=48, moe_intermediate_size=16,
                    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, route_scale=1.5,
                    conv_kernel_size=3, log_scaling_n_floor=8, log_scaling_alpha=0.5, logits_mup_width_multiplier=0.5,
                    rms_norm_eps=1e-5, initializer_range=0.1, max_position_embeddings=512, bos_token_id=None,
                    pad_token_id=None)
NEW_TOKENS = 24


def build_inkling(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random Inkling folder (transformers' save) with conftest's tiny tokenizer. Norm weights and the learned
    scales (ones at init) drawn from [0.5, 1.5], the convs from N(0, 0.3), the router's correction bias (zeros at
    init) from N(0, 0.3) and the relative logits' profiles from N(0, 1), so that a wrong formula shows. Its untied head
    stays random: greedy decoding then falls into loops now and then (n-gram drafts accepted in some steps, rejected
    in others); a head made from the embedding, as other families' tests tie theirs, only repeats the last token."""
    import transformers as tf

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    config = tf.InklingTextConfig(**{**TINY_INKLING, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                                     **overrides})
    torch.manual_seed(seed)
    model = tf.InklingForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "global_scale")):
                param.uniform_(0.5, 1.5)
            elif "sconv" in name:
                param.normal_(0.0, 0.3)
            elif name.endswith("rel_logits_proj.proj"):  # biases of a few units: a wrong distance shows
                param.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_inkling_multimodal(text: Path, path: Path) -> Path:
    """transformers' InklingForConditionalGeneration holding the text model in ``text`` (the same weights) beside tiny
    vision and audio towers, saved as transformers saves it: the release's names (``model.llm.``, ``attn.wq_du``,
    gate and up interleaved in ``w13`` tensors, ``model.visual.``, ``model.audio.``)."""
    import transformers as tf

    hf_text = tf.AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
    config = tf.InklingConfig(text_config=hf_text.config.to_dict(),
                              vision_config=dict(num_hidden_layers=3, patch_size=4, temporal_patch_size=2),
                              audio_config=dict(n_mel_bins=4, mel_vocab_size=8))
    torch.manual_seed(0)
    model = tf.InklingForConditionalGeneration(config).float().eval()
    model.model.language_model.load_state_dict(hf_text.model.state_dict())
    model.lm_head.load_state_dict(hf_text.lm_head.state_dict())
    model.save_pretrained(path, safe_serialization=True)
    for file in text.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, path / file.name)
    return path


@pytest.fixture(scope="session")
def tiny_inkling_dir(tmp_path_factory) -> Path:
    # (a seed whose n-gram trees have a path other than the first branch accepted: K/V and conv inputs moved)
    return build_inkling(tmp_path_factory.mktemp("tiny_inkling"), seed=2)


@pytest.fixture(scope="module")
def hf_inkling(tiny_inkling_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_inkling_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(tiny_inkling_dir):
    return reference_logits(tiny_inkling_dir)


# ---- logits against transformers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_inkling_dir, reference, schedule):
    """A 40-token prefill, and the same prompt in chunks (17, 9, 3) then single tokens, the convs' histories carried in
    slot 0: every logit row equals transformers'."""
    model = load_model(str(tiny_inkling_dir))
    assert type(model).__name__ == "InklingForCausalLM"
    assert len(model.recurrent_state_specs()) == 4 * TINY_INKLING["num_hidden_layers"]
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def test_batched_chunks_and_replayed_drafts_match_transformers(tiny_inkling_dir, hf_inkling):
    """(check_prefill_chunks_and_decode, check_drafts_replayed: tests/hybrid_models.py) two sequences batched in
    uneven chunks, then decode steps; verify chunks whose accepted drafts (0 to 3, the rest wrong) the next chunk
    replays through the key, value and block convs: logits equal transformers' on the accepted path."""
    model = load_model(str(tiny_inkling_dir))
    check_prefill_chunks_and_decode(model, hf_inkling)
    check_drafts_replayed(model, hf_inkling)


def test_padded_head_is_cut_to_the_unpadded_vocabulary(tiny_inkling_dir, reference, tmp_path):
    """With ``unpadded_vocab_size`` below ``vocab_size`` transformers returns the first columns alone; ours keeps the
    head's width with the padded columns at -inf (no share of the softmax) and the rest equal; the engine's sampled
    tokens (top-p, with logprobs) never reach them."""
    from transformers import AutoModelForCausalLM

    from specray import LLM, SamplingParams

    cut = 300
    hf = AutoModelForCausalLM.from_pretrained(tiny_inkling_dir, dtype=torch.float32, unpadded_vocab_size=cut).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt()])).logits[0]
    assert want.shape[-1] == cut
    config = read_config(str(tiny_inkling_dir))
    config.unpadded_vocab_size = cut
    got = chunked_logits(load_model(str(tiny_inkling_dir), config=config), prompt(), SCHEDULES["chunked+decode"])
    assert got.shape[-1] == config.vocab_size and bool((got[:, cut:] == float("-inf")).all())
    assert max_diff(got[:, :cut], want) < TOL and max_diff(got[:, :cut], reference[:, :cut]) < TOL
    folder = shutil.copytree(tiny_inkling_dir, tmp_path / "padded")
    edited = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**edited, "unpadded_vocab_size": 200}))
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, ignore_eos=True, logprobs=2, seed=0)
    outs = LLM(model=str(folder), max_model_len=128).generate(
        [{"prompt_token_ids": ids} for ids in PROMPT_IDS[:3]], params, use_tqdm=False)
    for out in outs:
        assert max(out.outputs[0].token_ids) < 200
        assert all(lp.logprob > float("-inf") for step in out.outputs[0].logprobs for lp in step.values())


@pytest.mark.parametrize("real, parents", [(1, [-1, -1, 0, 1, 2, 2]),  # the short path
                                           (3, [-1, 0, 1, -1, 3, 4, 0, 6, 7, 2, 5, 5, 11, 12, 13])],  # its own
                         ids=["short", "own"])
def test_token_tree_rows_match_their_paths(tiny_inkling_dir, hf_inkling, real, parents):
    """A verify chunk whose drafts form a tree (6 drafts: the padded short batch; 3 real tokens and 15 drafts: a
    sequence attended on its own): each node's key and value convs and block convs read its ancestors' inputs, and
    its relative logits its ancestors' distances (positions, not slots); its logits equal transformers' over its
    path."""
    seq = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    check_tree_rows_match_their_paths(load_model(str(tiny_inkling_dir)), hf_inkling, seq, 19, real, parents,
                                      seed=len(parents))


# ---- each distinctive part, broken on purpose ------------------------------------------------------------------------

def _attns(model):
    return [layer.self_attn for layer in model.model.layers]


def _zero_convs(*names):
    def mutate(model):
        for layer in model.model.layers:
            for conv in layer.convs():
                if any(conv is getattr(owner, n, None) for owner in (layer, layer.self_attn) for n in names):
                    conv.conv1d.weight.data.zero_()
    return mutate


def _each_attn(change):
    def mutate(model):
        for attn in _attns(model):
            change(attn)
    return mutate


def _unwindowed(model):
    for attn in _attns(model):
        attn.attn.mask_kind = CAUSAL


def _no_residual_conv(self, x, meta):  # the conv alone, its input not added back
    t = x.shape[0]
    none = x.new_zeros(t, 0, dtype=torch.float32)
    return self.recurrence(x.float(), none, none, meta).reshape(t, -1).to(x.dtype)


def _bias_past_extent(self, table, distance):  # the last profile value kept past the extent (not zeroed)
    extent = table.shape[-1]
    index = distance.clamp(0, extent - 1).unsqueeze(-3).expand(*table.shape[:-1], distance.shape[-1])
    return table.float().gather(-1, index).masked_fill(~(distance >= 0).unsqueeze(-3), 0.0)


_ROUTE_ALL = inkling.InklingMoE.route_all


def _routed_softmax_alone(self, x):  # the shared experts out of the softmax (weights of one each), the routed
    weights, ids, shared = _ROUTE_ALL(self, x)  # ones renormalised among themselves
    return weights / weights.sum(-1, keepdim=True) * self.route_scale, ids, torch.ones_like(shared)


def _set_scale(value):
    def mutate(model):
        for layer in model.model.layers:
            mlp = layer.mlp
            scale = mlp.gate.global_scale if isinstance(mlp, inkling.InklingMoE) else mlp.global_scale
            scale.data.fill_(value)
    return mutate


def _no_correction_bias(model):
    for layer in model.model.layers:
        if isinstance(layer.mlp, inkling.InklingMoE):
            layer.mlp.gate.e_score_correction_bias.data.zero_()


# name -> (mutate_config, mutate, monkeypatched (object, attribute, value) or None)
MUTATIONS = {
    "key and value convs left out": (None, _zero_convs("k_sconv", "v_sconv"), None),
    "block output convs left out": (None, _zero_convs("attn_sconv", "mlp_sconv"), None),
    "convs without their residual": (None, None, (inkling.InklingShortConv, "forward", _no_residual_conv)),
    "relative logits left out": (None, _each_attn(lambda a: a.rel_logits_proj.proj.data.zero_()), None),
    "relative bias past its extent": (None, None, (inkling.RelativeAttention, "_bias", _bias_past_extent)),
    "sliding layers unwindowed": (None, _unwindowed, None),
    "no log scaling": (None, _each_attn(lambda a: setattr(a, "log_scaling", None)), None),
    "scores scaled by 1/sqrt(d)": (None, _each_attn(lambda a: setattr(a.attn, "scale", a.head_dim ** -0.5)), None),
    "q/k norms left out": (None, _each_attn(lambda a: [a.q_norm.weight.data.fill_(1.0),
                                                        a.k_norm.weight.data.fill_(1.0)]), None),
    "embedding not normed": (None, None, (inkling.NormedEmbedding, "forward", VocabParallelEmbedding.forward)),
    "no muP divisor": (None, lambda m: setattr(m, "width_multiplier", 1.0), None),
    "shared experts outside the softmax": (None, None, (inkling.InklingMoE, "route_all", _routed_softmax_alone)),
    "no correction bias": (None, _no_correction_bias, None),
    "learned global scales ignored": (None, _set_scale(1.0), None),
    "route_scale ignored": (lambda c: setattr(c, "route_scale", 1.0), None, None),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_part_shows_in_the_logits(tiny_inkling_dir, reference, monkeypatch, name):
    """The comparison above can fail: each of Inkling's own parts (module docstring) broken once moves the chunked +
    decode schedule's logits far past tolerance."""
    mutate_config, mutate, patch = MUTATIONS[name]
    if patch is not None:
        monkeypatch.setattr(*patch)
    got = mutated_logits(tiny_inkling_dir, mutate_config, mutate)
    assert max_diff(got, reference) > 100 * TOL, name


# ---- the multimodal release --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_inkling_multimodal_dir(tiny_inkling_dir, tmp_path_factory) -> Path:
    return build_inkling_multimodal(tiny_inkling_dir, tmp_path_factory.mktemp("tiny_inkling_mm") / "m")


def test_multimodal_release_serves_its_text_model(tiny_inkling_multimodal_dir, reference, caplog):
    """InklingForConditionalGeneration's checkpoint (the text model under ``model.llm.`` in the release's own names,
    its fused gate/up tensors interleaved, beside ``model.visual.`` and ``model.audio.``): the text model is built
    from its text_config and reads its own tensors alone, renamed and de-interleaved; its logits equal the text
    model's in transformers. A w13 tensor read without de-interleaving changes them."""
    from safetensors import safe_open

    folder = tiny_inkling_multimodal_dir
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("model.audio.") for n in names)
    for name in ("model.llm.layers.1.attn.wq_du.weight", "model.llm.layers.0.mlp.w13_dn.weight",
                 "model.llm.layers.1.mlp.experts.w13_weight", "model.llm.layers.1.mlp.shared_experts.shared_w13_weight",
                 "model.llm.unembed.weight"):
        assert name in names, name
    config = read_config(str(folder))
    assert config.architectures == ["InklingForConditionalGeneration"]
    with caplog.at_level("WARNING", logger="specray.models.llama"):
        model = load_model(str(folder))
    assert isinstance(model, inkling.InklingForCausalLM) and model.config.model_type == "inkling_text"
    assert "ignoring checkpoint tensor" not in caplog.text
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) < TOL
    real = inkling._deinterleaved
    try:
        inkling._deinterleaved = lambda tensor, dim: tuple(torch.as_tensor(tensor[...]).chunk(2, dim))
        wrong = chunked_logits(load_model(str(folder)), prompt(), SCHEDULES["prefill"])
    finally:
        inkling._deinterleaved = real
    assert max_diff(wrong, reference) > 100 * TOL


# ---- the engine --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_greedy(hf_inkling) -> list[list[int]]:
    """transformers' ``generate`` (greedy, NEW_TOKENS tokens, no stop at EOS) for each of PROMPT_IDS."""
    hf_inkling.generation_config.eos_token_id = None
    outs = []
    for ids in PROMPT_IDS:
        out = hf_inkling.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(ids):].tolist())
    return outs


def test_plain_engine_equals_transformers_generate(tiny_inkling_dir, hf_greedy):
    from specray import LLM

    assert generate(LLM(model=str(tiny_inkling_dir), max_model_len=128), greedy(NEW_TOKENS)) == hf_greedy


@pytest.mark.parametrize("case", ["chains", "chunked-prefill", "preemption", "trees", "trees-graphs"])
def test_ngram_greedy_equals_transformers_generate(tiny_inkling_dir, hf_greedy, case):
    """n-gram drafts (some accepted, some rejected: the accepted ones replayed through the convs) give transformers'
    greedy tokens: chains batched, with prefills in small chunks, with a KV pool so small that requests are preempted
    and recompute their convs' histories from token 0; token trees (three branches: each node's convs and relative
    logits along its own path, the accepted path's K/V and pending conv inputs moved), eagerly and beside chain steps
    from graphs."""
    from specray import LLM

    spec = {**NGRAM, "num_speculative_tokens": 6, "num_branches": 3} if case.startswith("trees") else NGRAM
    kw = {"chunked-prefill": dict(max_num_batched_tokens=8, long_prefill_token_threshold=5),
          "preemption": dict(block_size=4, num_kv_blocks=24), "trees": dict(block_size=4, enforce_eager=True),
          "trees-graphs": dict(block_size=4, enforce_eager=False)}.get(case, {})
    llm = LLM(model=str(tiny_inkling_dir), max_model_len=128, speculative_config=spec, **kw)
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


def test_engine_comparison_can_fail(tiny_inkling_dir, hf_greedy, monkeypatch):
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
    llm = LLM(model=str(tiny_inkling_dir), max_model_len=128, speculative_config=NGRAM)
    out = generate(llm, greedy(NEW_TOKENS))
    assert all(len(o) == NEW_TOKENS for o in out) and out != hf_greedy


def test_graphs_allowed(tiny_inkling_dir):
    """Decode and verify steps may replay graphs (the trees-graphs case above runs its chain steps so): the convs'
    fixed-shape form, the relative bias built from the step's static metadata, the experts' grouped path."""
    from specray.models.step_graphs import graph_safe

    assert graph_safe(load_model(str(tiny_inkling_dir))) is None


def test_prefix_caching_keeps_tokens(tiny_inkling_dir):
    """(check_prefix_caching_keeps_tokens, tests/hybrid_models.py): second turns behind cached blocks and kept conv
    histories give the tokens an engine without prefix caching gives."""
    check_prefix_caching_keeps_tokens(tiny_inkling_dir)


# ---- refusals ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, match", [
    ("layer_types", ["hybrid_sliding", "linear", "hybrid"], r"layer_types\[1\]='linear'"),
    ("mlp_layer_types", ["dense", "moe", "sparse"], r"mlp_layer_types\[1\]='moe'"),
    ("shared_expert_sink", False, "shared_expert_sink=False"),
    ("n_shared_experts", 0, "n_shared_experts=0"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
])
def test_config_refusals(tiny_inkling_dir, field, value, match):
    """Settings this module does not build: a ValueError naming the field and its value."""
    config = read_config(str(tiny_inkling_dir))
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_inkling_dir), config=config)


def test_tensor_parallel_size_that_does_not_split_the_heads_is_refused(tiny_inkling_dir):
    from specray import LLM

    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        LLM(model=str(tiny_inkling_dir), max_model_len=128, tensor_parallel_size=3)


# ---- tensor parallelism and pipeline stages ---------------------------------------------------------------------

def test_tensor_parallel_shards_match_one_rank(tiny_inkling_dir, tmp_path):
    """TP 2 over gloo: query and KV heads (full and sliding, with the key and value convs' channels and the relative
    logits' heads), the MLP's, experts' and shared experts' widths split over the ranks; logits of prefills, a verify
    chunk and the replay after it equal one rank's."""
    folder = str(tiny_inkling_dir)
    worker = TP_WORKER.replace("recurrent_state_specs()[0].num_heads", "recurrent_state_specs()[0].conv_dim")
    for r, result in enumerate(run_ranks(tmp_path, worker, 2, 2, [folder], timeout=240)):
        diff, channels = result[folder]  # (the first layer's key conv: one of its two KV heads on each rank)
        assert diff < TOL, (r, diff)
        assert channels == TINY_INKLING["swa_head_dim"], channels


def test_pipeline_stages_match_one_rank(tiny_inkling_dir, tmp_path):
    """Two pipeline stages over gloo (each keeps its own layers' conv histories and K/V): the last stage's logits of
    prefills, a verify chunk and the replay after it equal one rank's."""
    folder = str(tiny_inkling_dir)
    first, last = run_ranks(tmp_path, PP_WORKER, 2, 2, [folder], timeout=240)
    (first_layers, none), (last_layers, diff) = first[folder], last[folder]
    assert none is None and first_layers + last_layers == list(range(TINY_INKLING["num_hidden_layers"]))
    assert diff < TOL, diff


def test_fixture_config(tiny_inkling_dir):
    """The fixture has both kinds of attention and of MLP, and a log scaling floor inside the prompts."""
    config = json.loads((tiny_inkling_dir / "config.json").read_text())
    assert config["architectures"] == ["InklingForCausalLM"] and config["model_type"] == "inkling_text"
    assert set(config["layer_types"]) == {"hybrid", "hybrid_sliding"}
    assert set(config["mlp_layer_types"]) == {"dense", "sparse"}


# ---- LoRA ------------------------------------------------------------------------------------------------------------

def test_lora_adapted_logits_match_transformers_with_the_adapter_merged(tiny_inkling_dir, tmp_path):
    """LoRA on the attention's q/k/v/o: a prefill, verify chunks whose drafts stay pending and the replays after them,
    beside a sequence without the adapter, equal transformers' with the adapter merged; the relative logits'
    projection (``r_proj``) is refused by name."""
    check_lora_keeps_transformers_logits(tiny_inkling_dir, tmp_path, ("q_proj", "k_proj", "v_proj", "o_proj"), "r_proj")


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_inkling_dir, schedule):
    """tests/test_device_parity.py's check for this file's fixture: fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(tiny_inkling_dir, SCHEDULES[schedule])
