"""Gemma 3n's text model (``Gemma3nForCausalLM``, specray.models.gemma3n) against transformers on the same random tiny
weights (fp32, max abs diff < 1e-4): AltUp's three streams (made from the embedding, predicted, corrected, merged
back), LAuReL, per-layer inputs (token ids past the per-layer vocabulary among the prompt's), the last two layers
reading earlier layers' K/V (no cache of their own), activation sparsity on the first two layers, sliding and full
layers, per-layer MLP widths and the final soft cap; each part broken once must fail the comparison; the refusals; a
multimodal release's text part; TP 2 and PP 2 equal to one rank; the engine's greedy output with n-gram chains and
trees equal to plain decoding and to transformers' ``generate``; graph steps equal to eager ones; a LoRA adapter's
output equal to the merged model's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specray.models.kv_cache import SharedKVSpec, allocate_kv_cache
from specray.models.loader import load_model
import specray_test_checkpoints as checkpoints  # tests/checkpoints.py (registered by conftest)
from specray_test_model_checks import (DIFF_WORKER, SCHEDULES, chunked_logits, max_diff, prompt,  # model_checks.py
                                       run_ranks)

TOL = 1e-4
SLIDING, FULL = "sliding_attention", "full_attention"
# 4 layers, sliding (a window of 8) and full in turn, 4 query heads of 16 over 2 KV heads; the last 2 read the K/V of
# layers 0 and 1; three AltUp streams; LAuReL of rank 6; per-layer inputs of 8 features from a table of 256 tokens
# (the prompts' ids run to 299: some past it); the first two layers' gates sparsified; a small altup_coef_clip (the
# coefficients are randomized past it: transformers clamps them only while training)
GEMMA3N = dict(hidden_size=64, intermediate_size=[48, 64, 40, 48], num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, layer_types=[SLIDING, FULL] * 2, sliding_window=8,
               num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
               altup_num_inputs=3, altup_active_idx=0, altup_coef_clip=0.5, laurel_rank=6,
               activation_sparsity_pattern=[0.95, 0.6, 0.0, 0.0], final_logit_softcapping=30.0,
               max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=None,
               rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                FULL: {"rope_type": "default", "rope_theta": 1000000.0}})


def text_config(vocab_size: int, **overrides) -> dict:
    return {**GEMMA3N, "vocab_size": vocab_size, **overrides}


def randomize(model) -> None:
    """Norms start at ones, AltUp's output scale at zeros, its coefficients and router small: random, so a wrong one
    shows (the prediction coefficients partly past altup_coef_clip)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("altup.correct_output_scale"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(("altup.prediction_coefs.weight", "altup.correction_coefs.weight")):
                param.normal_(0.0, 0.5)
            elif name.endswith("altup.modality_router.weight"):
                param.normal_(0.0, 1.0)


def save_tiny(path: Path, seed: int, **overrides) -> Path:
    """A model folder the engine loads: transformers' Gemma3nForCausalLM with random weights and a tiny tokenizer (the
    embedding doubled, so that greedy decoding loops now and then and n-gram drafts are accepted in some steps)."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    config = Gemma3nTextConfig(**text_config(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                             **overrides))
    torch.manual_seed(seed)
    model = Gemma3nForCausalLM(config).float().eval()
    randomize(model)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(2.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_gemma3n_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny_gemma3n"), seed=30)


def hf_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt()])).logits[0].float()


@pytest.fixture(scope="session")
def reference(tiny_gemma3n_dir) -> torch.Tensor:
    return hf_logits(tiny_gemma3n_dir)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_gemma3n_dir, reference, schedule):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps through the paged
    cache (shuffled blocks), past the sliding window."""
    model = load_model(str(tiny_gemma3n_dir))
    assert max(prompt()) >= GEMMA3N["vocab_size_per_layer_input"]  # ids past the per-layer table are among them
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def test_other_altup_settings_match_transformers(tmp_path):
    """Four streams, the second one active, no output scale on the per-layer branch's gate, sparsity on
    the first layer alone, a tighter soft cap: the same."""
    folder = save_tiny(tmp_path / "variant", seed=31, altup_num_inputs=4, altup_active_idx=1,
                       altup_correct_scale=False, final_logit_softcapping=5.0,
                       activation_sparsity_pattern=[0.8, 0.0, 0.0, 0.0])
    model = load_model(str(folder))
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), hf_logits(folder)) < TOL


def test_shared_layers_have_no_cache_of_their_own(tiny_gemma3n_dir):
    """Layers 2 and 3 read the caches of layers 0 and 1 (the last earlier sliding and full ones): their specs name
    those, take no memory, and their views are the sources'."""
    model = load_model(str(tiny_gemma3n_dir))
    specs = model.kv_cache_specs()
    assert specs[2] == SharedKVSpec(source=0) and specs[3] == SharedKVSpec(source=1)
    assert (specs[0].sliding_window, specs[0].head_dim, specs[0].num_kv_heads) == (8, 16, 2)
    cache = allocate_kv_cache(model, 8, 4)
    assert cache.bytes_per_block() == sum(s.bytes_per_block(4, torch.float32) for s in specs[:2])
    assert cache.layer(3).data_ptr() == cache.layer(1).data_ptr()
    assert [layer.mlp.down_proj.in_local for layer in model.model.layers] == GEMMA3N["intermediate_size"]


# ---- each part, broken once, must show ----------------------------------------------------------------------------

def _no_sparsity(model) -> None:
    for layer in model.model.layers:
        layer.mlp.std_multiplier = None


def _sparsity_per_rank(model) -> None:  # the gate's statistics over half its width (what one of two ranks holds)
    mlp = model.model.layers[0].mlp
    topk = type(mlp)._gaussian_topk

    def half(gate):
        return torch.cat((topk(mlp, gate[:, :24]), topk(mlp, gate[:, 24:])), dim=-1)
    mlp._gaussian_topk = half


def _no_laurel(model) -> None:
    for layer in model.model.layers:
        layer.laurel.forward = lambda x: x


def _no_prediction(model) -> None:  # each stream predicted as itself
    for layer in model.model.layers:
        layer.altup.predict = lambda streams: streams


def _no_correction(model) -> None:  # only the active stream takes the layer's output
    for layer in model.model.layers:
        altup = layer.altup

        def correct(predictions, activated, altup=altup):
            return torch.cat((activated[None], predictions[1:]))
        altup.correct = correct


def _coef_clip(model) -> None:  # the prediction coefficients clamped at altup_coef_clip (transformers' training only)
    for layer in model.model.layers:
        layer.altup.prediction_coefs.weight.data.clamp_(-GEMMA3N["altup_coef_clip"], GEMMA3N["altup_coef_clip"])


def _router_unnormed(model) -> None:
    for layer in model.model.layers:
        layer.altup.router_norm.forward = lambda x: x


def _no_output_scale(model) -> None:
    for layer in model.model.layers:
        layer.correct_scale = False


def _streams_unmatched(model) -> None:  # the projected streams not rescaled to the embedding's magnitude
    model.model._matched = lambda x, target: x


def _first_stream_only(model) -> None:  # the final merge ignores the other streams
    model.model.merged = lambda streams: streams[0]


def _per_layer_ids_wrapped(model) -> None:  # ids past the per-layer table wrapped into it rather than read as 0
    plain = type(model.model).__mro__[1].per_layer_inputs
    model.model.per_layer_inputs = lambda ids, x: plain(model.model, ids % model.model.vocab_per_layer, x)


def _no_per_layer_inputs(model) -> None:
    model.model.per_layer = 0


def _wrong_source(model) -> None:  # layer 3 reads layer 0's K/V (a sliding layer's)
    model.model.sources[3] = 0


def _no_softcap(model) -> None:
    model.final_logit_softcapping = None


def _embedding_unscaled(model) -> None:
    model.model.embed_scale = 1.0


def _no_sliding_window(model) -> None:  # the sliding layers (and the one sharing their K/V) attend to every key
    from specray.models.kv_cache import CAUSAL

    for layer in model.model.layers[::2]:
        layer.self_attn.attn.mask_kind = CAUSAL


def _one_rope(model) -> None:  # the full layers rotated at the sliding layers' base
    model.model.rotary[FULL] = model.model.rotary[SLIDING]


def _q_unnormed(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.q_norm.forward = lambda x: x


def _v_scaled(model) -> None:  # the values' norm given a scale (the keys')
    for layer in model.model.layers[:2]:
        layer.self_attn.v_norm.weight = layer.self_attn.k_norm.weight


ABLATIONS = {"sparsity": _no_sparsity, "sparsity-per-rank": _sparsity_per_rank, "laurel": _no_laurel,
             "altup-predict": _no_prediction, "altup-correct": _no_correction, "altup-coef-clip": _coef_clip,
             "altup-router-norm": _router_unnormed, "altup-output-scale": _no_output_scale,
             "altup-projections": _streams_unmatched, "altup-unembed": _first_stream_only,
             "per-layer-vocab": _per_layer_ids_wrapped, "per-layer-inputs": _no_per_layer_inputs,
             "kv-source": _wrong_source, "softcap": _no_softcap, "embedding-scale": _embedding_unscaled,
             "sliding-window": _no_sliding_window, "rope-per-kind": _one_rope, "q-norm": _q_unnormed,
             "v-norm-unscaled": _v_scaled}


@pytest.mark.parametrize("ablate", list(ABLATIONS.values()), ids=list(ABLATIONS))
def test_each_part_shows_in_the_logits(tiny_gemma3n_dir, reference, ablate):
    """Without its activation sparsity (or with it over one rank's share of the gate), LAuReL, AltUp's prediction,
    correction, router norm or output scale, the streams' magnitude matching or unembedding, the per-layer inputs
    (or their reading of ids past the table), the right layer's K/V, the soft cap, the embedding's scale, the sliding
    window, a RoPE per kind of layer or the query norm, or with the coefficients clipped or a scale on the values'
    norm, the model is far from transformers': the comparison above sees each of them."""
    model = load_model(str(tiny_gemma3n_dir))
    ablate(model)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) > 1e-2


@pytest.mark.parametrize("overrides, match", [
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(num_kv_shared_layers=4), "num_kv_shared_layers=4"),
    (dict(altup_num_inputs=0), "altup_num_inputs=0 must be a positive integer"),
    (dict(altup_active_idx=3), "altup_active_idx=3 must index one of the altup_num_inputs=3 streams"),
    (dict(activation_sparsity_pattern=[1.0, 0.0, 0.0, 0.0]), r"activation_sparsity_pattern\[0\]=1.0 must lie in"),
    (dict(activation_sparsity_pattern=[0.5, 0.0]), "activation_sparsity_pattern has 2 entries for num_hidden_layers"),
    (dict(intermediate_size=[48, 48]), "intermediate_size has 2 entries for num_hidden_layers=4"),
    (dict(laurel_rank=0), "laurel_rank=0 must be a positive integer"),
    (dict(layer_types=["chunked_attention"] * 4, num_kv_shared_layers=0), r"layer_types\[0\]='chunked_attention'"),
])
def test_unsupported_settings_are_named(overrides, match):
    from specray.models.gemma3n import Gemma3nForCausalLM
    from specray.models.plain_config import PlainConfig

    config = PlainConfig(**{**text_config(64), "model_type": "gemma3n_text", "hidden_activation": "gelu_pytorch_tanh",
                            "altup_correct_scale": True, "attention_bias": False, "tie_word_embeddings": True,
                            **overrides})
    with pytest.raises(ValueError, match=match):
        with torch.device("meta"):
            Gemma3nForCausalLM(config)


# ---- a multimodal release --------------------------------------------------------------------------------------------

def test_multimodal_release_serves_its_text_model(tiny_gemma3n_dir, reference, tmp_path):
    """Gemma 3n's releases are ``Gemma3nForConditionalGeneration``: the text model under ``model.language_model.``
    beside the vision and audio towers and their embedders (and k/v projections on the KV-shared layers, which
    transformers does not read either); the config's ``text_config`` is the text model's. (transformers' vision tower
    needs timm, so the folder is the text checkpoint renamed, with stand-ins for the rest.) specray loads the text
    model, whose logits equal transformers' text model's for a text-only prompt."""
    from specray.models.gemma3n import Gemma3nForCausalLM
    from specray.models.loader import load_hf_config

    from transformers import Gemma3nAudioConfig, Gemma3nConfig, Gemma3nTextConfig, Gemma3nVisionConfig

    config = Gemma3nConfig(text_config=Gemma3nTextConfig.from_pretrained(tiny_gemma3n_dir),  # ids past the text's
                           vision_config=Gemma3nVisionConfig(hidden_size=16, vocab_size=8, vocab_offset=320).to_dict(),
                           audio_config=Gemma3nAudioConfig(hidden_size=16, vocab_size=8, vocab_offset=328).to_dict())
    config.architectures = ["Gemma3nForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    tensors = {f"model.language_model.{k[len('model.'):]}": v
               for k, v in load_file(str(tiny_gemma3n_dir / "model.safetensors")).items()}
    tensors.update({"model.vision_tower.timm_model.conv_stem.conv.weight": torch.randn(4, 3, 3, 3),
                    "model.audio_tower.conformer.0.ffw_layer_start.ffw_layer_1.weight": torch.randn(8, 16),
                    "model.embed_vision.embedding.weight": torch.randn(8, 16),
                    "model.embed_audio.embedding_projection.weight": torch.randn(64, 16)})
    for kind in ("k_proj", "v_proj"):  # what the shared layers' releases carry and nobody reads
        tensors[f"model.language_model.layers.3.self_attn.{kind}.weight"] = torch.randn(32, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_gemma3n_dir / name).read_bytes())
    ours = load_model(str(tmp_path), pack=False)
    assert type(ours) is Gemma3nForCausalLM and ours.tie_word_embeddings
    assert load_hf_config(str(tmp_path)).model_type == "gemma3n_text"
    assert max_diff(chunked_logits(ours, prompt(), SCHEDULES["chunked+decode"]), reference) < TOL


# ---- tensor parallel ranks and pipeline stages over gloo -------------------------------------------------------------

def test_tensor_parallel_ranks_match_one_rank(tiny_gemma3n_dir, tmp_path):
    """TP 2: each rank two of the 4 query heads and one of the 2 KV heads, the shared layers reading their sources'
    shards, the MLP split by width (the sparsified gates' mean and deviation summed over both ranks), the per-layer
    embedding split by vocabulary, AltUp and LAuReL whole on each: every rank's logits equal one rank's."""
    for result in run_ranks(tmp_path / "tp", DIFF_WORKER, 2, 1, [str(tiny_gemma3n_dir)]):
        assert result["diffs"][0] < TOL, result


def test_two_stages_match_one_rank(tmp_path):
    """PP 2 over 6 layers (0-2, 3-5; layers 4 and 5 read layer 3's K/V, on their stage): the first stage makes the
    AltUp streams and the per-layer inputs and hands them on; the last stage's logits equal one rank's. A split that
    puts a shared layer on another stage than its source is refused."""
    from transformers import Gemma3nTextConfig

    from specray.models.gemma3n import Gemma3nForCausalLM
    from specray.parallel import PPGroup

    folder = save_tiny(tmp_path / "tiny6", seed=32, num_hidden_layers=6, intermediate_size=48,
                       layer_types=[SLIDING, FULL] + [SLIDING] * 4,
                       activation_sparsity_pattern=[0.9, 0.9] + [0.0] * 4)
    first, last = run_ranks(tmp_path / "pp", DIFF_WORKER, 2, 2, [str(folder)])
    assert first["diffs"] == [None] and last["diffs"][0] < TOL, (first, last)
    with pytest.raises(ValueError, match=r"num_kv_shared_layers=2 with pipeline_parallel_size=2: layer 2 reads the "
                                         r"KV cache of layer 0, which stage 0 holds"):
        with torch.device("meta"):
            Gemma3nForCausalLM(Gemma3nTextConfig(**text_config(320)), pp=PPGroup.of_rank(1, 1, 2))


# ---- the engine --------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def test_engine_greedy_with_ngram_drafts_equals_plain_and_transformers(tiny_gemma3n_dir):
    """``specray.LLM``'s greedy tokens, with n-gram chains and trees verified (some drafts accepted, some not) and
    without, equal transformers' ``generate`` token for token; every KV block is free again afterwards."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    prompts, params = runs.PROMPTS[:4], runs.greedy(16)
    plain = LLM(model=str(tiny_gemma3n_dir), max_model_len=128)
    plain_ids = runs.token_ids(plain.generate(prompts, params, use_tqdm=False))
    for spec in (NGRAM, {**NGRAM, "num_speculative_tokens": 4, "num_branches": 2}):
        llm = LLM(model=str(tiny_gemma3n_dir), max_model_len=128, speculative_config=spec)
        free = llm.engine.scheduler.block_manager.num_free_blocks
        assert runs.token_ids(llm.generate(prompts, params, use_tqdm=False)) == plain_ids, spec
        stats = llm.spec_stats
        assert 0 < stats.accepted_tokens < stats.draft_tokens, (spec, stats)
        assert llm.engine.scheduler.block_manager.num_free_blocks == free
    runs.assert_transformers_generates(tiny_gemma3n_dir, plain.get_tokenizer(), prompts, plain_ids)


def test_graph_steps_equal_eager_steps(tiny_gemma3n_dir, no_host_sync):
    """Steps from graphs (``enforce_eager=False``: on CPU the padded static inputs run eagerly) with prefix caching
    give the eager engine's tokens, plain and with n-gram trees; the forward on a graph's static inputs has no host
    sync (a capture would refuse one)."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    prompts, params = runs.PROMPTS[:3], runs.greedy(8)
    for spec in (None, {**NGRAM, "num_speculative_tokens": 4, "num_branches": 2}):
        kwargs = dict(model=str(tiny_gemma3n_dir), max_model_len=128, block_size=4, speculative_config=spec)
        want = runs.token_ids(LLM(**kwargs).generate(prompts, params, use_tqdm=False))
        llm = LLM(enforce_eager=False, enable_prefix_caching=True, **kwargs)
        for batch in (prompts, prompts[:1]):
            assert runs.token_ids(llm.generate(batch, params, use_tqdm=False)) == want[: len(batch)]
        graphs = llm.engine.executor.worker.runner.graphs
        assert llm.engine.scheduler.prefix_cache_hits > 0
        if runs.refused_on_this_gpu(llm):
            return
        assert graphs is not None and graphs.graphs
    _, graph = next(iter(graphs.graphs.items()))
    with torch.inference_mode(), no_host_sync():
        llm.engine.executor.worker.model(graph.input_ids, graph.meta)


def test_engine_with_an_adapter_and_ngram_drafts_equals_the_merged_model(tiny_gemma3n_dir, tmp_path):
    """``specray.LLM`` with enable_lora and n-gram drafts: greedy tokens with a PEFT adapter of every q/k/v/o and
    gate/up/down projection the checkpoint has (the shared layers' q and o) equal the merged model's plain decoding,
    and differ from the base model's (requests without it, same engine). An adapter of LAuReL or AltUp's router,
    which take no LoRA here, is refused at admission, naming it."""
    from specray import LLM
    from specray.lora import LoRARequest, read_adapter
    from specray.models.gemma3n import Gemma3nForCausalLM
    from specray.models.loader import read_config
    from specray.models.lora import adapter_shapes

    runs = sys.modules["specray_test_engine_runs"]
    adapter = checkpoints.write_lora(tiny_gemma3n_dir, tmp_path / "adapter", rank=4, alpha=8, seed=5)
    merged = checkpoints.merge_lora(tiny_gemma3n_dir, adapter, tmp_path / "merged")
    prompts, params = runs.PROMPTS[:3], runs.greedy(12)
    with LLM(model=str(merged), max_model_len=128) as llm:
        want = runs.token_ids(llm.generate(prompts, params, use_tqdm=False))
    with LLM(model=str(tiny_gemma3n_dir), max_model_len=128, enable_lora=True, max_lora_rank=4,
             speculative_config=NGRAM) as llm:
        lora = LoRARequest("a", 1, str(adapter))
        assert runs.token_ids(llm.generate(prompts, params, use_tqdm=False, lora_request=lora)) == want
        assert llm.spec_stats.accepted_tokens > 0
        assert runs.token_ids(llm.generate(prompts, params, use_tqdm=False)) != want
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.laurel.linear_left.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.model.layers.0.laurel.linear_left.lora_B.weight"] = torch.zeros(6, 4)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with torch.device("meta"):
        shapes = adapter_shapes(Gemma3nForCausalLM(read_config(str(tiny_gemma3n_dir))))
    with pytest.raises(ValueError, match="adapts 'model.layers.0.laurel.linear_left', which specray does not apply"):
        read_adapter(str(adapter), shapes, 4)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_keep_greedy_output(tiny_gemma3n_dir, tmp_path, method):
    """An EAGLE-1 / EAGLE-3 head over Gemma 3n (EAGLE-3 reading the active AltUp stream entering its chosen layers:
    the embedding at layer 0, sliding and full layers, a KV-shared one): greedy output equals plain decoding, drafts
    accepted."""
    import specray_test_draft_heads as draft_heads  # tests/draft_heads.py (registered by conftest)

    from specray import LLM, SamplingParams

    shapes = tmp_path / "shapes"  # the target's config with one MLP width: what a head's own config would hold
    shapes.mkdir()
    config = json.loads((tiny_gemma3n_dir / "config.json").read_text())
    (shapes / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    head = draft_heads.write_accepting_head(tmp_path / method, method, shapes)
    prompts = [{"prompt_token_ids": list(range(30 + i, 50 + i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(model=str(tiny_gemma3n_dir), max_model_len=128).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(tiny_gemma3n_dir), max_model_len=128, speculative_config={
        "method": method, "model": str(head), "num_speculative_tokens": 3, "adaptive": False})
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert llm.spec_stats.accepted_tokens > 0


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_gemma3n_dir, schedule):
    """tests/test_device_parity.py's check for this file's fixture (that file's list cannot reach a fixture defined
    here): fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(tiny_gemma3n_dir, SCHEDULES[schedule])
