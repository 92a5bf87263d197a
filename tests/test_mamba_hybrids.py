"""Hybrid Mamba-2 models (Bamba, Granite 4.0's MoE and dense hybrids, Nemotron-H with and without experts, latent or
not, Falcon-H1, Zamba2 and its shared blocks), Mamba-2 alone (no paged layer at all), Mamba-1's (Jamba, Mamba,
Falcon-Mamba), LFM2's and LFM3's short convs (dense and MoE) and MiniMax's lightning attention:
specray.models.mamba_hybrid, mamba2, mamba1, lfm2, lfm3, zamba2, minimax,
against transformers on the same random weights (fp32, max abs diff < 1e-4): one prefill, a prefill in chunks, decode
steps with the recurrent state carried, drafts replayed after verification; each family's own parts shown to matter;
no host sync in a step; the engine end to end (plain greedy equals transformers', speculative greedy with n-gram
chains and trees equals plain, from graphs too, chunked prefill, preemption, prefix caching, seeded sampling); the
refusals; TP 2 and two pipeline stages against one rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specray.models.mamba2 import GroupedGatedRMSNorm, Mamba2Mixer
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    MAMBA_ARCHS, NGRAM, PP_WORKER, TOL, TP_WORKER, Stepper, check_drafts_replayed, check_greedy_equals_transformers,
    check_eagle3_keeps_greedy, check_prefill_chunks_and_decode, check_prefix_caching_keeps_tokens, generate, greedy,
    branched, hf_logits, hf_pair, ours, recorded_batches, save, tokens, tree_graphs)
from specray_test_engine_runs import refused_on_this_gpu  # tests/engine_runs.py
from specray_test_model_checks import run_ranks  # tests/model_checks.py

CASES = [(arch, {}) for arch in MAMBA_ARCHS] + [("bamba", {"mamba_n_groups": 1}),
                                               ("falcon_h1", {"mamba_norm_before_gate": True}),
                                               ("nemotron_h_moe", {"moe_latent_size": None})]  # (Nano's experts)


@pytest.mark.parametrize("arch, overrides", CASES, ids=[a + "-" + "-".join(o) for a, o in CASES])
def test_prefill_chunks_and_decode_match_transformers(tmp_path, arch, overrides):
    """(check_prefill_chunks_and_decode, tests/hybrid_models.py)"""
    check_prefill_chunks_and_decode(*ours(tmp_path, arch, **overrides))


@pytest.mark.parametrize("arch", ["bamba", "nemotron_h"])
def test_drafts_are_replayed_as_accepted(tmp_path, arch):
    """(check_drafts_replayed, tests/hybrid_models.py): the Mamba-2 layers replay the accepted drafts."""
    check_drafts_replayed(*ours(tmp_path, arch, seed=3))


@pytest.mark.parametrize("arch", ["bamba", "falcon_h1", "lfm2", "lfm3", "falcon_mamba", "minimax"])
def test_no_host_sync_in_a_step(tmp_path, no_host_sync, arch):
    """A step with a replay, a verify chunk and a fresh prefill (long enough for the chunked or parallel scan) reads
    no tensor's value on the host: Mamba-2's, LFM2's short convs', Mamba-1's (dt, B and C inside the recurrence),
    MiniMax's lightning attention (its experts as graph steps run them: sync_free_experts)."""
    import contextlib

    from specray.models.moe import sync_free_experts

    model, _ = ours(tmp_path, arch, seed=9)
    run = Stepper(model)
    seq = tokens(24, 10)
    run.step([(0, seq[:8], 0, 0)])
    run.step([(0, seq[8:11], 8, 2)])
    with no_host_sync(), (sync_free_experts() if arch == "minimax" else contextlib.nullcontext()):
        run.step([(0, seq[10:12], 10, 1), (1, seq[:20], 0, 0)])


def test_minimax_reads_its_releases_rotary_dim(tmp_path):
    """A MiniMax release's ``rotary_dim`` (half of each head in MiniMax-Text-01's) rotates that many features of each
    head in the softmax layers (vLLM's reading; transformers' port rotates whole heads, which is what the family's
    other tests compare with: their configs have no rotary_dim)."""
    from specray.models.loader import load_model, read_config

    _, hf = hf_pair("minimax", 12)
    hf.save_pretrained(tmp_path)
    whole = load_model(str(tmp_path))
    config = read_config(str(tmp_path))
    config.rotary_dim = 8  # of 16
    half = load_model(str(tmp_path), config=config)
    assert whole.model.rotary_emb.inv_freq.numel() == 8 and half.model.rotary_emb.inv_freq.numel() == 4
    seq = tokens(12, 4)
    assert (Stepper(half).step([(0, seq, 0, 0)])[0] - hf_logits(hf, seq)).abs().max() > 100 * TOL


def test_each_mamba2_part_matters(tmp_path, monkeypatch):
    """The comparison can fail: without D's skip, with the delta rule in place of the plain one, with one norm over
    all the heads in place of one per group, or with the heads' groups of B and C swapped, the logits leave
    tolerance."""
    model, hf = ours(tmp_path, "bamba", seed=5)
    seq = tokens(20, 6)
    ref = hf_logits(hf, seq)

    def error() -> float:
        return (Stepper(model).step([(0, seq, 0, 0)])[0] - ref).abs().max().item()

    assert error() < TOL
    split = Mamba2Mixer._split_heads
    for attr, value in (("_skip", lambda self, out, v: out), ("delta_rule", True),
                        ("_split_heads", lambda self, conv: tuple(x.flip(2) if i < 2 else x
                                                                  for i, x in enumerate(split(self, conv))))):
        monkeypatch.setattr(Mamba2Mixer, attr, value)
        assert error() > 100 * TOL, attr
        monkeypatch.undo()
    whole = torch.nn.functional.rms_norm  # one norm over all the heads
    monkeypatch.setattr(GroupedGatedRMSNorm, "forward", lambda self, y, z, dtype: self.weight * whole(
        y.float() * torch.nn.functional.silu(z.float()), (y.shape[-1],), eps=self.eps).to(dtype))
    assert error() > 100 * TOL


def test_nemotron_h_loads_release_and_module_names(tmp_path):
    """Nemotron-H's releases (and transformers' saves) name the stack ``backbone.`` (``embeddings``, ``norm_f``,
    each layer's ``norm`` and ``mixer``); transformers' modules name it ``model.``: both load."""
    from safetensors.torch import load_file, save_file

    from specray.models.loader import load_model

    model, hf = ours(tmp_path / "hf", "nemotron_h", seed=7)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    assert "backbone.norm_f.weight" in tensors and any(".mixer." in n for n in tensors)
    (tmp_path / "modules").mkdir()
    save_file({n.replace("backbone.", "model.", 1): t for n, t in tensors.items()},
              tmp_path / "modules" / "model.safetensors")
    (tmp_path / "modules" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    seq = tokens(12, 8)
    ref = hf_logits(hf, seq)
    for folder in (tmp_path / "hf", tmp_path / "modules"):
        got = Stepper(load_model(folder)).step([(0, seq, 0, 0)])[0]
        assert (got - ref).abs().max() < TOL, folder


def test_mamba1_parts_matter(tmp_path, monkeypatch):
    """The comparison can fail: Mamba-1 with one decay per channel (its state's rows at their mean rate), without
    D's skip, or (Jamba) without its norms of dt, B and C, changes the logits."""
    from specray.models.mamba1 import Mamba1Mixer

    model, hf = ours(tmp_path, "jamba", seed=8)
    seq = tokens(14, 9)
    ref = hf_logits(hf, seq)

    def error() -> float:
        return (Stepper(model).step([(0, seq, 0, 0)])[0] - ref).abs().max().item()

    assert error() < TOL
    decay = Mamba1Mixer._decay
    for attr, value in (("_decay", lambda self: decay(self).mean(-1, keepdim=True).expand_as(decay(self))),
                        ("_skip", lambda self, out, v: out)):
        monkeypatch.setattr(Mamba1Mixer, attr, value)
        assert error() > 100 * TOL, attr
        monkeypatch.undo()
    for layer in model.model.layers:
        if hasattr(layer, "mamba"):
            layer.mamba.dims = dataclasses.replace(layer.mamba.dims, norms=None)
    assert error() > 100 * TOL


def test_zamba2_shared_block_parts_matter(tmp_path, monkeypatch):
    """The comparison can fail: Zamba2's shared block without its invocations' own adapters, with attention scaled
    by 1 / sqrt(head_dim) (its is sqrt(2) more), or reading the stream twice rather than beside the embedding,
    changes the logits; so does running one block where two cycle (num_mem_blocks=2: each hybrid layer its own)."""
    from specray.models.zamba2 import Zamba2Invocation

    model, hf = ours(tmp_path / "one", "zamba2", seed=12)
    seq = tokens(14, 13)
    ref = hf_logits(hf, seq)

    def error(m=model, reference=ref) -> float:
        return (Stepper(m).step([(0, seq, 0, 0)])[0] - reference).abs().max().item()

    assert error() < TOL
    run = Zamba2Invocation.forward
    for change in ("adapters", "scale", "embedding"):
        def changed(self, block, x, embedded, cos, sin, meta, change=change):
            if change == "adapters":
                self.qkv_adapters, saved = None, self.qkv_adapters
                try:
                    return run(self, block, x, embedded, cos, sin, meta)
                finally:
                    self.qkv_adapters = saved
            if change == "scale":
                self.attn.scale, saved = self.head_dim ** -0.5, self.attn.scale
                try:
                    return run(self, block, x, embedded, cos, sin, meta)
                finally:
                    self.attn.scale = saved
            return run(self, block, x, x, cos, sin, meta)

        monkeypatch.setattr(Zamba2Invocation, "forward", changed)
        assert error() > 100 * TOL, change
        monkeypatch.undo()
    two, hf_two = ours(tmp_path / "two", "zamba2", seed=12, num_mem_blocks=2)
    ref_two = hf_logits(hf_two, seq)
    assert error(two, ref_two) < TOL
    two.model.block_of = {layer: 0 for layer in two.model.block_of}  # every run on the first block
    assert error(two, ref_two) > 100 * TOL


def test_lfm2_short_conv_matters(tmp_path, monkeypatch):
    """The comparison can fail: LFM2's short conv with an activation after it (as the other recurrent mixers' have),
    or not gated by C, changes the logits."""
    from specray.models.lfm2 import ShortConv

    model, hf = ours(tmp_path, "lfm2", seed=6)
    seq = tokens(14, 7)
    ref = hf_logits(hf, seq)

    def error() -> float:
        return (Stepper(model).step([(0, seq, 0, 0)])[0] - ref).abs().max().item()

    assert error() < TOL
    monkeypatch.setattr(ShortConv, "conv_activation", True)
    assert error() > 100 * TOL
    monkeypatch.undo()

    def ungated(self, x, meta):  # B * x through the conv, not gated by C
        b, _, h = self.in_proj(x).split(self.width, dim=-1)
        none = x.new_zeros(x.shape[0], 0)
        return self.out_proj(self.recurrence(b * h, none, none, meta).reshape(x.shape[0], -1))

    monkeypatch.setattr(ShortConv, "forward", ungated)
    assert error() > 100 * TOL


def test_falcon_h1_multipliers_fold_into_the_weights(tmp_path, monkeypatch):
    """The comparison can fail: Falcon-H1's weights loaded unscaled (no multiplier folded in) change the logits."""
    from specray.models.llama import LlamaForCausalLM
    from specray.models.loader import load_model
    from specray.models.mamba_hybrid import FalconH1ForCausalLM

    model, hf = ours(tmp_path, "falcon_h1", seed=4)
    seq = tokens(12, 5)
    ref = hf_logits(hf, seq)
    assert (Stepper(model).step([(0, seq, 0, 0)])[0] - ref).abs().max() < TOL
    monkeypatch.setattr(FalconH1ForCausalLM, "_unfused", LlamaForCausalLM._unfused)
    assert (Stepper(load_model(tmp_path)).step([(0, seq, 0, 0)])[0] - ref).abs().max() > 100 * TOL


# ---- the engine --------------------------------------------------------------------------------------------------


# (the dense Granite and the plain Nemotron-H: in the TP and pipeline checks below)
@pytest.fixture(scope="module", params=["bamba", "granite", "nemotron_h_moe", "falcon_h1", "mamba2", "lfm2", "lfm3",
                                        "jamba", "falcon_mamba", "zamba2", "minimax"])
def engine_case(request, tmp_path_factory):
    from specray import LLM

    folder = save(tmp_path_factory.mktemp(request.param), request.param, 11)
    return folder, generate(LLM(model=str(folder), max_model_len=128), greedy())


def test_plain_engine_equals_transformers_greedy(engine_case):
    check_greedy_equals_transformers(*engine_case)


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_ngram_greedy_equals_plain_from_graphs(engine_case, tree, monkeypatch):
    """n-gram chains, and trees of three branches (each draft's state from its parent's, the plain gated rule), some
    accepted and some not, from graph steps (Mamba-2's fixed-shape recurrence, its tree form for trees; on CPU the
    padded static inputs run eagerly) where the engine takes them: plain greedy's tokens."""
    from specray import LLM
    from specray.models.step_graphs import StepGraphs

    folder, plain = engine_case
    spec = {**NGRAM, "num_speculative_tokens": 6, "num_branches": 3} if tree else NGRAM
    llm = LLM(model=str(folder), max_model_len=128, speculative_config=spec, block_size=4, enforce_eager=False)
    shapes, run = [], StepGraphs.run
    monkeypatch.setattr(StepGraphs, "run", lambda self, shape, *a, **kw: shapes.append(shape) or run(
        self, shape, *a, **kw))
    batches = recorded_batches(monkeypatch)
    assert generate(llm, greedy()) == plain
    assert bool(shapes) != refused_on_this_gpu(llm), "no step replayed a graph"
    assert not shapes or tree_graphs(llm) == branched(batches)  # a tree step replays the tree form's graphs
    assert 0 < llm.spec_stats.accepted_tokens < llm.spec_stats.draft_tokens, llm.spec_stats


@pytest.mark.parametrize("case", ["chunked-prefill", "preemption"])
def test_chunked_prefill_and_preemption(engine_case, case):
    from specray import LLM

    folder, plain = engine_case
    kw = {"chunked-prefill": dict(max_num_batched_tokens=8, long_prefill_token_threshold=5),
          "preemption": dict(block_size=4, num_kv_blocks=24)}[case]
    llm = LLM(model=str(folder), max_model_len=128, speculative_config=NGRAM, **kw)
    assert generate(llm, greedy()) == plain
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


def test_seeded_sampling_with_ngram_equals_plain(engine_case):
    from specray import LLM, SamplingParams

    folder, _ = engine_case  # (a random model's text is nearly uniform at temperature 1: no draft would match)
    params = SamplingParams(temperature=0.2, seed=8, max_tokens=20, ignore_eos=True)
    plain = generate(LLM(model=str(folder), max_model_len=128), params)
    spec = LLM(model=str(folder), max_model_len=128, speculative_config=NGRAM)
    assert generate(spec, params) == plain and spec.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("arch, overrides, kw, match", [
    ("bamba", dict(mamba_n_heads=1, mamba_d_head=128, mamba_n_groups=1), dict(tensor_parallel_size=2),
     "mamba_n_heads=1"),  # 2 ranks split the attention heads but not one Mamba-2 head
    ("nemotron_h", dict(mamba_num_heads=12, n_groups=3), dict(tensor_parallel_size=2), "n_groups=3"),
    ("bamba", {}, dict(speculative_config={"method": "gemma4_assistant", "model": "nowhere",
                                           "num_speculative_tokens": 4}), "method='gemma4_assistant'"),
])
def test_refusals(tmp_path, arch, overrides, kw, match):
    from specray import LLM

    folder = save(tmp_path, arch, 0, **overrides)
    with pytest.raises(ValueError, match=match):
        LLM(model=str(folder), max_model_len=128, **kw)


def test_nemotron_h_experts_load_fused(tmp_path):
    """Nemotron-H's experts saved fused (``experts.up_proj`` [E, I, latent], ``experts.down_proj`` [E, latent, I])
    load as per-expert ones do."""
    import json

    from safetensors.torch import load_file, save_file

    from specray.models.loader import load_model

    _, hf = ours(tmp_path / "hf", "nemotron_h_moe", seed=9)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    fused = {}
    for name, t in tensors.items():
        parts = name.split(".experts.")
        if len(parts) == 2:
            expert, kind, _ = parts[1].split(".")
            fused.setdefault(f"{parts[0]}.experts.{kind}", {})[int(expert)] = t
        else:
            fused[name] = t
    fused = {n: torch.stack([t[e] for e in sorted(t)]) if isinstance(t, dict) else t for n, t in fused.items()}
    assert fused["backbone.layers.1.mixer.experts.up_proj"].shape == (8, 16, 24)
    (tmp_path / "fused").mkdir()
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "fused" / "config.json").write_text(json.dumps(config))
    seq = tokens(16, 3)
    got = Stepper(load_model(tmp_path / "fused")).step([(0, seq, 0, 0)])[0]
    assert (got - hf_logits(hf, seq)).abs().max() < TOL


# ---- tensor parallelism ------------------------------------------------------------------------------------------


def test_tensor_parallel_shards_match_one_rank(tmp_path):
    """TP 2 over gloo: the Mamba-2 heads split over the ranks (their projections, conv channels, decays, D and
    states); B and C's two groups split (Bamba, Nemotron-H) or, one group, repeat on both ranks with the gated norm's
    sums of squares summed across them (Granite's dense hybrid); Nemotron-H's gateless experts and shared experts
    split by width; Falcon-H1's side-by-side mixers; LFM2-MoE's short convs' channels and experts; LFM3's heads' gates
    with their heads; MiniMax's lightning heads (their norm over every head: the sums of squares over the ranks);
    logits of
    prefills, a verify chunk and the replay after it equal one rank's; Jamba's Mamba-1 channels (x_proj's sum over
    the ranks) and experts."""
    folders = []
    for arch, seed, overrides in (("bamba", 41, {}), ("granite_dense", 42, {"mamba_n_groups": 1}),
                                  ("nemotron_h_moe", 43, {}), ("falcon_h1", 47, {}), ("lfm2_moe", 48, {}),
                                  ("jamba", 49, {}), ("zamba2", 50, {}), ("lfm3", 52, {}), ("minimax", 53, {})):
        _, hf = hf_pair(arch, seed, **overrides)
        hf.save_pretrained(tmp_path / arch)
        folders.append(str(tmp_path / arch))
    for r, result in enumerate(run_ranks(tmp_path, TP_WORKER, 2, 2, folders, timeout=240)):
        for folder, (diff, heads) in result.items():
            assert diff < TOL, (r, folder, diff)
            # (LFM2's short convs: no heads; Jamba's Mamba-1: a head per channel, 128 over two ranks; MiniMax's 4 heads
            # over two)
            want = {"lfm2_moe": 0, "lfm3": 0, "jamba": 64, "minimax": 2}.get(folder.rsplit("/", 1)[-1], 4)
            assert heads == want, folder


def test_prefix_caching_starts_from_kept_states(engine_case):
    """Two turns of three conversations with prefix caching (each prompt's state kept at its last whole block):
    the second turn's requests start behind their conversation's cached blocks and kept Mamba-2 states, and give
    the tokens an engine without prefix caching gives, with n-gram drafts (tests/hybrid_models.py)."""
    check_prefix_caching_keeps_tokens(engine_case[0])


def test_the_omni_release_serves_its_text_model(tmp_path):
    """Nemotron 3 Nano Omni (``NemotronH_Omni_Reasoning_V3``): its Nemotron-H text model from under
    ``language_model.`` (its vision and audio towers not read) gives the text model's logits over a prefill and a
    verify chunk."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from specray.models.loader import load_model

    _, hf = hf_pair("nemotron_h", 45)
    hf.save_pretrained(tmp_path / "text")
    tensors = {"language_model." + n: t for n, t in load_file(str(tmp_path / "text" / "model.safetensors")).items()}
    tensors["vision_model.radio_model.input_conditioner.norm_mean"] = torch.zeros(3)  # (a tower: not read)
    (tmp_path / "omni").mkdir()
    save_file(tensors, str(tmp_path / "omni" / "model.safetensors"), metadata={"format": "pt"})
    config = AutoConfig.for_model("nemotron_h_omni", text_config=hf.config.to_dict()).to_dict()
    config["architectures"] = ["NemotronH_Omni_Reasoning_V3"]
    (tmp_path / "omni" / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path / "omni")
    seq = tokens(24, 8)
    want = hf_logits(hf, seq)
    run = Stepper(model)
    assert (run.step([(0, seq[:16], 0, 0)])[0] - want[:16]).abs().max() < TOL
    assert (run.step([(0, seq[16:20], 16, 3)])[0] - want[16:20]).abs().max() < TOL


def test_pipeline_stages_match_one_rank(tmp_path):
    """Two pipeline stages over gloo, each keeping its own Mamba-2 layers' states (Bamba: layers 0-1 and 2;
    Nemotron-H: 0-1 and 2-3; Zamba2: 0-2 and 3-4, its shared block run at layers 1 and 3, on both stages, or two
    blocks, one a stage, the stream and the embedding handed on; MiniMax: 0-1 and 2, its scaled normed input
    handed on as the residual): the last stage's logits of prefills, a verify chunk and the replay after it equal one
    rank's."""
    folders = []
    for name, arch, seed, kw in (("bamba", "bamba", 44, {}), ("nemotron_h", "nemotron_h", 45, {}),
                                 ("zamba2", "zamba2", 46, {}), ("zamba2-2", "zamba2", 47, {"num_mem_blocks": 2}),
                                 ("minimax", "minimax", 48, {})):
        _, hf = hf_pair(arch, seed, **kw)
        hf.save_pretrained(tmp_path / name)
        folders.append(str(tmp_path / name))
    first, last = run_ranks(tmp_path / "ranks", PP_WORKER, 2, 2, folders, timeout=240)
    for folder, layers in zip(folders, (3, 4, 5, 5, 3)):
        (first_layers, none), (last_layers, diff) = first[folder], last[folder]
        assert none is None and first_layers + last_layers == list(range(layers)), (first_layers, last_layers)
        assert diff < TOL, (folder, diff)


def test_a_release_of_attention_layers_alone_serves_as_an_attention_model(tmp_path):
    """A Granite 4.0 release whose layers are all attention (granite-4.0-micro's kind: the hybrid architecture with
    no Mamba layer) keeps no recurrent state: its logits equal transformers', and the engine serves it as an attention
    model (n-gram token trees verified as any attention model's, no recurrent state allocated)."""
    from specray import LLM

    kinds = dict(layer_types=["attention"] * 3)
    model, hf = ours(tmp_path / "hf", "granite_dense", **kinds)
    assert not model.recurrent_state_specs()
    seq = tokens(20, 3)
    assert (Stepper(model).step([(0, seq, 0, 0)])[0] - hf_logits(hf, seq)).abs().max() < TOL
    folder = save(tmp_path / "engine", "granite_dense", 4, **kinds)
    plain = generate(LLM(model=str(folder), max_model_len=128), greedy())
    spec = {**NGRAM, "num_speculative_tokens": 6, "num_branches": 3}
    llm = LLM(model=str(folder), max_model_len=128, speculative_config=spec)
    assert llm.engine.executor.worker.runner.recurrent is None
    assert generate(llm, greedy()) == plain and llm.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("arch", ["bamba", "granite", "falcon_h1", "jamba", "lfm2", "lfm3", "minimax"])
def test_an_eagle3_head_on_the_target_keeps_greedy_output(tmp_path, arch):
    """An EAGLE-3 head drafting chains, then EAGLE-2 trees, for each kind of layer here (the streams entering its
    layers handed out by Llama's, Falcon-H1's and LFM2's stacks, over Mamba-2, Mamba-1 and short convs; its own K/V,
    the target's recurrent state untouched): greedy output equals plain decoding's, and its drafts are accepted now
    and then (the test head drafts "the same token again" under the target's tied LM head)."""
    check_eagle3_keeps_greedy(tmp_path, arch)  # (tests/hybrid_models.py)


def test_four_ranks_share_each_group_of_b_and_c(tmp_path):
    """TP 4 over gloo with two groups of B and C: each group's heads on two ranks, which both hold it whole and sum
    the gated norm's squares across the pair (the all-reduce of a [T, groups] tensor); the attention's two K/V heads
    repeated; logits of prefills, a verify chunk and the replay after it equal one rank's."""
    _, hf = hf_pair("bamba", 51)
    hf.save_pretrained(tmp_path / "bamba")
    for r, result in enumerate(run_ranks(tmp_path, TP_WORKER, 4, 4, [str(tmp_path / "bamba")], timeout=240)):
        for folder, (diff, heads) in result.items():
            assert diff < TOL and heads == 2, (r, folder, diff, heads)
