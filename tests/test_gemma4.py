"""Gemma 4's text model (``Gemma4ForCausalLM``, specray.models.gemma4) against transformers on the same random tiny
weights (fp32, max abs diff < 1e-4): sliding and full layers of different head sizes, each kind with its RoPE (the
full layers' proportional), k = v on the full layers, the last layers reading earlier layers' K/V (no cache of their
own) with double-wide MLPs, the MoE block beside the dense MLP, per-layer inputs, the layer scalars and the final
soft cap; variants that must fail; the refusals; a multimodal release's text part; LoRA adapters against
transformers with the adapter merged (and those of modules without LoRA refused by name); TP 2 (experts by width and
whole) and PP 2 equal to one rank, with an adapter and without; the engine's greedy output with n-gram drafts equal to
plain decoding and to transformers', and with an adapter to the merged model's."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specray.models.kv_cache import SharedKVSpec, allocate_kv_cache
from specray.models.layers import RotaryEmbedding
from specray.models.loader import load_model
from specray.models.moe import sync_free_experts
from specray_test_model_checks import (SCHEDULES, WORKER_PRELUDE, chunked_logits, max_diff, prompt,  # model_checks.py
                                       run_ranks)
import specray_test_checkpoints as checkpoints  # tests/checkpoints.py (registered by conftest)

TOL = 1e-4
SLIDING, FULL = "sliding_attention", "full_attention"
# 6 layers, sliding (heads of 16, 2 KV heads, a window of 8) and full (heads of 32, one KV head, k = v) in turn; the
# last 2 read the K/V of layers 2 and 3 and have double-wide MLPs; 4 experts (top 2) beside each dense MLP; per-layer
# inputs of 8 features; the full layers' RoPE rotates a quarter of each head's frequencies
GEMMA4 = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
              layer_types=[SLIDING, FULL] * 3, sliding_window=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
              enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
              hidden_size_per_layer_input=8, final_logit_softcapping=30.0, max_position_embeddings=1024,
              rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=None,
              rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                               FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                      "rope_theta": 10000.0}})
# the dense model (priority one): no experts, no per-layer inputs, no cap
DENSE = dict(enable_moe_block=False, hidden_size_per_layer_input=0, final_logit_softcapping=None)


def text_config(vocab_size: int, **overrides) -> dict:
    return {**GEMMA4, "vocab_size": vocab_size, "vocab_size_per_layer_input": vocab_size, **overrides}


def randomize(model) -> None:
    """Norms, layer scalars and router scales start at ones, the router at small values: random, so a wrong one
    shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                param.uniform_(0.5, 1.5)
            elif name.endswith("router.proj.weight"):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)


def save_tiny(path: Path, seed: int, **overrides) -> Path:
    """A model folder the engine loads: transformers' Gemma4ForCausalLM with random weights and a tiny tokenizer (the
    embedding doubled, so that greedy decoding loops now and then and n-gram drafts are accepted in some steps)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    config = Gemma4TextConfig(**text_config(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                            **overrides))
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(config).float().eval()
    randomize(model)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(2.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny_gemma4_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny_gemma4"), seed=40)


@pytest.fixture(scope="module")
def tiny_gemma4_dense_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny_gemma4_dense"), seed=41, **DENSE)


def hf_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():  # (transformers 5.24 cannot skip the KV-shared layers' rows without per-layer inputs:
        return hf(torch.tensor([prompt()]), output_hidden_states=True).logits[0].float()  # all rows asked for)


@pytest.fixture(scope="module")
def reference(tiny_gemma4_dir) -> torch.Tensor:
    return hf_logits(tiny_gemma4_dir)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_gemma4_dir, reference, schedule):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps through the paged
    cache (shuffled blocks), past the sliding window."""
    model = load_model(str(tiny_gemma4_dir))
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def test_dense_model_matches_transformers(tiny_gemma4_dense_dir):
    """Without experts, per-layer inputs or the cap (the dense releases' shape): the same."""
    model = load_model(str(tiny_gemma4_dense_dir))
    assert model.model.layers[0].moe is None and not model.model.per_layer
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), hf_logits(tiny_gemma4_dense_dir)) \
        < TOL


def test_shared_layers_have_no_cache_of_their_own(tiny_gemma4_dir):
    """Layers 4 and 5 read the caches of layers 2 and 3 (the last earlier sliding and full ones): their specs name
    those, take no memory, and their views are the sources'; the full layers' heads are 32 wide, one KV head."""
    model = load_model(str(tiny_gemma4_dir))
    specs = model.kv_cache_specs()
    assert specs[4] == SharedKVSpec(source=2) and specs[5] == SharedKVSpec(source=3)
    assert (specs[0].sliding_window, specs[0].head_dim, specs[0].num_kv_heads) == (8, 16, 2)
    assert (specs[1].head_dim, specs[1].num_kv_heads) == (32, 1)
    cache = allocate_kv_cache(model, 8, 4)
    assert cache.bytes_per_block() == sum(s.bytes_per_block(4, torch.float32) for s in specs[:4])
    assert cache.layer(4).data_ptr() == cache.layer(2).data_ptr()
    assert model.model.layers[4].mlp.down_proj.in_local == 2 * GEMMA4["intermediate_size"]
    slots = torch.tensor([0, 5])
    snap = cache.snapshot(slots)
    assert torch.equal(snap[5], snap[3]) and snap[5].shape == (2, 1, 2, 32)


def _no_layer_scalar(model) -> None:
    for layer in model.model.layers:
        layer.layer_scalar.data.fill_(1.0)


def _plain_full_rope(model) -> None:  # the full layers rotated over whole heads, every frequency
    model.model.rotary[FULL] = RotaryEmbedding(32, {"rope_type": "default", "rope_theta": 10000.0}, 1024)


def _wrong_source(model) -> None:  # layer 4 reads layer 0's K/V (a sliding layer too, but not the last one)
    model.model.sources[4] = 0


def _no_expert_scale(model) -> None:
    for layer in model.model.layers:
        layer.moe.per_expert_scale.data.fill_(1.0)


def _no_per_layer_inputs(model) -> None:
    model.model.per_layer = 0


@pytest.mark.parametrize("ablate", [_no_layer_scalar, _plain_full_rope, _wrong_source, _no_expert_scale,
                                    _no_per_layer_inputs],
                         ids=["layer-scalar", "proportional-rope", "kv-source", "expert-scale", "per-layer-inputs"])
def test_each_difference_shows_in_the_logits(tiny_gemma4_dir, reference, ablate):
    """Without its layer scalars, its proportional RoPE, the right layer's K/V, its experts' scales or its per-layer
    inputs the model is far from transformers': the comparison above sees each of them."""
    model = load_model(str(tiny_gemma4_dir))
    ablate(model)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) > 1e-2


@pytest.mark.parametrize("overrides, match", [
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
    (dict(num_kv_shared_layers=6), "num_kv_shared_layers=6"),
    (dict(num_kv_shared_layers=5), r"layer 1 \(full_attention\) shares K/V, but no layer before layer 1"),
    (dict(num_experts=None), "enable_moe_block=True needs num_experts"),
])
def test_unsupported_settings_are_named(overrides, match):
    from transformers import Gemma4TextConfig

    from specray.models.gemma4 import Gemma4ForCausalLM

    with pytest.raises(ValueError, match=match):
        Gemma4ForCausalLM(Gemma4TextConfig(**text_config(64, **overrides)))


def test_stages_splitting_a_shared_layer_from_its_source_are_refused(tiny_gemma4_dir):
    """Two stages of the 6 layers (0-2, 3-5): layer 4 reads layer 2's cache, on the other stage: refused, naming
    both settings, by the engine before any rank starts too. Of 8 layers (0-3, 4-7) the first stage has no store layer for Gemma 4's assistant to read."""
    from transformers import Gemma4TextConfig

    from specray.models.gemma4 import Gemma4ForCausalLM
    from specray.parallel import PPGroup

    from specray import LLM

    with pytest.raises(ValueError, match=r"num_kv_shared_layers=2 with pipeline_parallel_size=2: layer 4 reads the "
                                         r"KV cache of layer 2, which stage 0 holds"):
        load_model(str(tiny_gemma4_dir), pp=PPGroup.of_rank(1, 1, 2))
    with pytest.raises(ValueError, match=r"num_kv_shared_layers=2 with pipeline_parallel_size=2"):  # before any rank
        LLM(model=str(tiny_gemma4_dir), pipeline_parallel_size=2, distributed_executor_backend="ray")
    config = Gemma4TextConfig(**text_config(64, num_hidden_layers=8, layer_types=[SLIDING, FULL] * 4))
    with torch.device("meta"):
        first, last = (Gemma4ForCausalLM(config, pp=PPGroup.of_rank(r, 1, 2)) for r in (0, 1))
    assert last.kv_store_attention(FULL) is last.model.layers[5].self_attn.attn
    with pytest.raises(ValueError, match="attends over layer 5's KV cache, which another pipeline stage holds"):
        first.kv_store_attention(FULL)


# ---- a multimodal release --------------------------------------------------------------------------------------------

def test_multimodal_release_serves_its_text_model(tmp_path):
    """Gemma 4's releases are ``Gemma4ForConditionalGeneration``: the text model under ``model.language_model.``
    beside a vision tower (and, as released, k/v projections on the KV-shared layers, which transformers does not
    read either). specray loads the text model, whose logits equal transformers' for a text-only prompt."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    from specray.models.gemma4 import Gemma4ForCausalLM
    from specray.models.loader import load_hf_config

    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64)
    config = Gemma4Config(text_config=text_config(320, **DENSE), vision_config=vision.to_dict(), audio_config=None,
                          image_token_id=319, boi_token_id=318, eoi_token_id=317)  # past the prompt's ids
    torch.manual_seed(3)
    full = Gemma4ForConditionalGeneration(config).float().eval()
    randomize(full)
    full.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert any(name.startswith("model.vision_tower.") for name in tensors)
    for kind, rows in (("k_proj", 32), ("v_proj", 32)):  # what the shared layers' releases carry and nobody reads
        tensors[f"model.language_model.layers.5.self_attn.{kind}.weight"] = torch.randn(rows, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = load_model(str(tmp_path), pack=False)
    assert type(ours) is Gemma4ForCausalLM and ours.tie_word_embeddings
    assert load_hf_config(str(tmp_path)).model_type == "gemma4_text"
    with torch.no_grad():
        ref = full(input_ids=torch.tensor([prompt()]), output_hidden_states=True).logits[0].float()
    assert max_diff(chunked_logits(ours, prompt(), SCHEDULES["chunked+decode"]), ref) < TOL


# ---- LoRA adapters ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma4_adapter(tiny_gemma4_dir, tmp_path_factory) -> Path:
    """A PEFT adapter (rank 4) of every q/k/v/o and gate/up/down projection the tiny checkpoint has: the shared
    layers' q and o, the k = v layers' q, k and o."""
    return checkpoints.write_lora(tiny_gemma4_dir, tmp_path_factory.mktemp("gemma4_adapter"), rank=4, alpha=8, seed=5)


@pytest.fixture(scope="module")
def gemma4_merged(tiny_gemma4_dir, gemma4_adapter, tmp_path_factory) -> Path:
    """The tiny checkpoint with the adapter merged into its weights (PEFT's merge_and_unload)."""
    return checkpoints.merge_lora(tiny_gemma4_dir, gemma4_adapter, tmp_path_factory.mktemp("gemma4_merged") / "m")


def test_adapted_logits_match_transformers_with_the_adapter_merged(tiny_gemma4_dir, gemma4_adapter, gemma4_merged):
    """Two sequences in each forward, one with the adapter and one without (a prefill, then decode steps over a
    paged cache): the adapted row's logits equal transformers' on the merged weights, the other's the base model's."""
    from transformers import AutoModelForCausalLM

    from specray.lora import LoRAConfig, LoRARequest, read_adapter
    from specray.models.attention import build_attention_metadata
    from specray.models.lora import LoRASlots, adapter_shapes

    ours = load_model(str(tiny_gemma4_dir))
    info = read_adapter(str(gemma4_adapter), adapter_shapes(ours), 4)
    assert "model.layers.4.self_attn.q_proj" in info.ranks and "model.layers.1.self_attn.k_proj" in info.ranks
    slots = LoRASlots(ours, LoRAConfig(max_loras=1, max_lora_rank=4), torch.device("cpu"))
    z = slots.slots_for([LoRARequest("a", 1, str(gemma4_adapter))])[0]
    refs = [AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval() for f in (gemma4_merged,
                                                                                         tiny_gemma4_dir)]
    seqs, tables = [prompt(1)[:13], prompt(2)[:9]], [list(range(8))[::-1], list(range(8, 16))]
    allocate_kv_cache(ours, 16, 4)
    with torch.no_grad():
        for step in range(3):
            new = [s if step == 0 else s[-1:] for s in seqs]
            starts = [0, 0] if step == 0 else [len(s) - 1 for s in seqs]
            slots.context.set_token_slots(torch.tensor([z] * len(new[0]) + [0] * len(new[1])))
            meta = build_attention_metadata([len(n) for n in new], starts, tables, 4, "cpu")
            got = ours.compute_logits(ours(torch.tensor(new[0] + new[1]), meta)).split([len(n) for n in new])
            for seq, ref, row in zip(seqs, refs, got):
                want = ref(torch.tensor([seq]), output_hidden_states=True).logits[0, -len(row):].float()
                assert max_diff(row, want) < TOL, step
            if step == 0:  # the adapter matters
                base = refs[1](torch.tensor([seqs[0]]), output_hidden_states=True).logits[0].float()
                assert max_diff(got[0], base) > 1e-2
            for seq, row in zip(seqs, got):
                seq.append(int(row[-1].argmax()))


def _unloaded(folder: Path):
    """The model of ``folder`` built on the current device, without its weights (shapes only)."""
    from specray.models.gemma4 import Gemma4ForCausalLM
    from specray.models.loader import read_config

    return Gemma4ForCausalLM(read_config(str(folder)))


@pytest.mark.parametrize("module, shape", [
    ("model.layers.1.self_attn.v_proj", (32, 64)),  # a k = v full layer: no v projection
    ("model.layers.4.self_attn.k_proj", (32, 64)),  # a KV-shared layer: no k projection
    ("model.layers.0.per_layer_input_gate", (8, 64)),
    ("model.layers.0.router.proj", (4, 64)),
])
def test_adapters_of_modules_without_lora_are_refused_by_name(tiny_gemma4_dir, tmp_path, module, shape):
    """transformers builds no v projection on a k = v layer and no k/v projection on a KV-shared one, so PEFT never
    adapts them; the per-layer-input projections and the router take no LoRA here: an adapter naming one is refused
    at admission, naming it."""
    from safetensors.torch import save_file

    from specray.lora import read_adapter
    from specray.models.lora import adapter_shapes

    adapter = checkpoints.write_lora(tiny_gemma4_dir, tmp_path / "a", modules=("o_proj",), layers=(0,))
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    tensors[f"base_model.model.{module}.lora_A.weight"] = torch.zeros(4, shape[1])
    tensors[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(shape[0], 4)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with torch.device("meta"):
        shapes = adapter_shapes(_unloaded(tiny_gemma4_dir))
    with pytest.raises(ValueError, match=f"adapts '{module}', which specray does not apply LoRA to"):
        read_adapter(str(adapter), shapes, 4)


def test_engine_with_an_adapter_and_ngram_drafts_equals_the_merged_model(tiny_gemma4_dir, gemma4_adapter,
                                                                       gemma4_merged):
    """``specray.LLM`` with enable_lora and n-gram drafts (some accepted, some not): greedy tokens with the adapter
    equal the merged model's plain decoding, and differ from the base model's (requests without it, same engine)."""
    from specray import LLM
    from specray.lora import LoRARequest

    runs = sys.modules["specray_test_engine_runs"]
    prompts, params = runs.PROMPTS[:3], runs.greedy(12)
    with LLM(model=str(gemma4_merged), max_model_len=128) as llm:
        want = runs.token_ids(llm.generate(prompts, params, use_tqdm=False))
    with LLM(model=str(tiny_gemma4_dir), max_model_len=128, enable_lora=True, max_lora_rank=4,
             speculative_config=NGRAM) as llm:
        lora = LoRARequest("a", 1, str(gemma4_adapter))
        assert runs.token_ids(llm.generate(prompts, params, use_tqdm=False, lora_request=lora)) == want
        stats = llm.spec_stats
        assert 0 < stats.accepted_tokens < stats.draft_tokens, stats
        assert runs.token_ids(llm.generate(prompts, params, use_tqdm=False)) != want


# ---- tensor parallel ranks and pipeline stages over gloo -------------------------------------------------------------

# one rank of two (argv: ..., the model folders, then an adapter of them): {folder: [its layers, its layers' KV heads,
# None before the last stage or the diffs of its logits to one rank's without and with the adapter, and of one rank's
# with and without it]}; the adapter on the first sequence of each forward; a folder named *-ep splits experts whole
WORKER = WORKER_PRELUDE + textwrap.dedent("""
    from specray.lora import LoRAConfig, LoRARequest
    from specray.models.lora import LoRASlots

    *folders, adapter = folders

    @torch.no_grad()
    def adapted(model):  # logits(model)'s forwards, the first sequence of each with the adapter
        slots = LoRASlots(model, LoRAConfig(max_loras=1, max_lora_rank=4), torch.device("cpu"))
        (slot,) = slots.slots_for([LoRARequest("a", 1, adapter)])
        allocate_kv_cache(model, 32, 4)
        hidden = []
        for lens, starts, rows in (([20, 7], [0, 0], ids[:27]), ([4, 1], [20, 7], ids[27:])):
            slots.context.set_token_slots(torch.tensor([slot] * lens[0] + [0] * lens[1]))
            hidden.append(model(rows, plan(lens, starts, tables, 4)))
        return None if hidden[0] is None else model.compute_logits(torch.cat(hidden))

    result = {}
    for folder in folders:
        model, one = load_model(folder, tp, expert_parallel=folder.endswith("-ep"), pp=pp), load_model(folder)
        heads = [layer.self_attn.num_kv_heads for _, layer in model.model.stage_layers()]
        mine, want, mine_lora, want_lora = logits(model), logits(one), adapted(model), adapted(one)
        diffs = None if mine is None else [(mine - want).abs().max().item(), (mine_lora - want_lora).abs().max().item(),
                                           (want_lora - want).abs().max().item()]
        result[folder] = [list(model.model.stage), heads, diffs]
    del model
    gc.collect()
    dist.destroy_process_group()
    json.dump(result, open(f"{out}/{rank}.json", "w"))
""")


def test_tensor_parallel_ranks_match_one_rank(tiny_gemma4_dir, gemma4_adapter, tmp_path):
    """TP 2: each rank two of the 4 query heads, one of the sliding layers' 2 KV heads and the full layers' one KV
    head replicated, the shared layers reading their sources' shards, the per-layer embedding split by vocabulary,
    the experts split by width or whole (2 per rank), each rank its share of the adapter's matrices: every rank's
    logits, with the adapter and without, equal one rank's."""
    ep = tmp_path / "tiny-ep"
    ep.symlink_to(tiny_gemma4_dir, target_is_directory=True)
    folders = [str(tiny_gemma4_dir), str(ep)]
    for result in run_ranks(tmp_path / "tp", WORKER, 2, 1, folders + [str(gemma4_adapter)]):
        for folder in folders:
            layers, heads, (plain, adapted, adapter_matters) = result[folder]
            assert layers == list(range(6)) and heads == [1] * 6, (folder, result[folder])
            assert plain < TOL and adapted < TOL and adapter_matters > 1e-2, (folder, result[folder])


def test_two_stages_match_one_rank(tmp_path):
    """PP 2 over 8 layers (0-3, 4-7; layers 6 and 7 read the K/V of layers 4 and 5, on their stage): the first stage
    computes the per-layer inputs and hands them on behind the residual stream; the last stage's logits, with an
    adapter (each stage loading its own layers' matrices) and without, equal one rank's."""
    folder = save_tiny(tmp_path / "tiny8", seed=42, num_hidden_layers=8, layer_types=[SLIDING, FULL] * 4)
    adapter = checkpoints.write_lora(folder, tmp_path / "adapter", rank=4, alpha=8, seed=6)
    first, last = run_ranks(tmp_path / "pp", WORKER, 2, 2, [str(folder), str(adapter)])
    assert first[str(folder)][::2] == [[0, 1, 2, 3], None], first
    layers, _, (plain, adapted, adapter_matters) = last[str(folder)]
    assert layers == [4, 5, 6, 7] and plain < TOL and adapted < TOL and adapter_matters > 1e-2, last


# ---- the engine --------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def test_engine_greedy_with_ngram_drafts_equals_plain_and_transformers(tiny_gemma4_dir):
    """``specray.LLM``'s greedy tokens, with n-gram drafts verified (some accepted, some not) and without, equal
    transformers' ``generate`` token for token; every KV block is free again afterwards. Images and audio are
    refused (text only)."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    prompts, params = runs.PROMPTS[:4], runs.greedy(16)
    plain = LLM(model=str(tiny_gemma4_dir), max_model_len=128)
    plain_ids = runs.token_ids(plain.generate(prompts, params, use_tqdm=False))
    spec = LLM(model=str(tiny_gemma4_dir), max_model_len=128, speculative_config=NGRAM)
    free = spec.engine.scheduler.block_manager.num_free_blocks
    assert runs.token_ids(spec.generate(prompts, params, use_tqdm=False)) == plain_ids
    stats = spec.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, stats
    assert spec.engine.scheduler.block_manager.num_free_blocks == free
    runs.assert_transformers_generates(tiny_gemma4_dir, plain.get_tokenizer(), prompts, plain_ids)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(ValueError, match="this model reads text only"):
        plain.chat(image, params, use_tqdm=False)
    with pytest.raises(ValueError, match="this model reads text only"):
        plain.generate({"prompt": "Hello", "multi_modal_data": {"audio": [0.0]}}, params, use_tqdm=False)


def test_config_round_trip_keeps_the_full_layers_geometry(tiny_gemma4_dir):
    """config.json keeps the full layers' head size and KV heads per layer (``per_layer_config``); the plain config
    every rank builds from carries them."""
    from specray.models.gemma4 import layer_geometry
    from specray.models.loader import read_config

    saved = json.loads((tiny_gemma4_dir / "config.json").read_text())
    assert saved["per_layer_config"]["1"] == {"head_dim": 32, "num_key_value_heads": 1}
    config = read_config(str(tiny_gemma4_dir))
    assert [layer_geometry(config, i) for i in range(2)] == [(16, 2), (32, 1)]


def test_graph_steps_equal_eager_steps(tiny_gemma4_dir, no_host_sync):
    """Steps from graphs (``enforce_eager=False``: on CPU the padded static inputs run eagerly, the experts on their
    sync-free grouped path) with prefix caching give the eager engine's tokens, plain and with n-gram trees; the
    forward on a graph's static inputs has no host sync (a capture would refuse one)."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    prompts, params = runs.PROMPTS[:3], runs.greedy(8)
    for spec in (None, {**NGRAM, "num_speculative_tokens": 4, "num_branches": 2}):
        kwargs = dict(model=str(tiny_gemma4_dir), max_model_len=128, block_size=4, speculative_config=spec)
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
    with torch.inference_mode(), sync_free_experts(), no_host_sync():
        llm.engine.executor.worker.model(graph.input_ids, graph.meta)


def test_fp8_cache_equals_fake_quantized_attention(tiny_gemma4_dir, monkeypatch):
    """An FP8 KV cache (bytes, converted on read; the shared layers reading their sources' bytes, their own step's
    K/V rounded alike): the logits equal those over a full-precision cache holding the same rounded values."""
    from specray.models.attention import PagedAttention, build_attention_metadata

    def logits(kv_cache_dtype: str) -> torch.Tensor:
        model = load_model(str(tiny_gemma4_dir))
        allocate_kv_cache(model, 16, 4, kv_cache_dtype)
        ids, out, start = prompt(), [], 0
        for n in SCHEDULES["chunked+decode"][:5]:
            meta = build_attention_metadata([n], [start], [list(range(16))[::-1]], 4)
            out.append(model.compute_logits(model(torch.tensor(ids[start: start + n]), meta)))
            start += n
        return torch.cat(out)

    with torch.no_grad():
        got = logits("fp8")
        bound = torch.finfo(torch.float8_e4m3fn).max
        monkeypatch.setattr(PagedAttention, "_stored",
                            lambda self, x, scale=1.0: x.clamp(-bound, bound).to(torch.float8_e4m3fn).to(x.dtype))
        assert torch.equal(got, logits("auto"))
        monkeypatch.undo()
        assert torch.isfinite(got).all() and max_diff(got, logits("auto")) > 1e-4  # rounded: not the same


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_keep_greedy_output(tiny_gemma4_dir, tmp_path, method):
    """An EAGLE-1 / EAGLE-3 head over Gemma 4 (EAGLE-3 reading the residual streams entering its chosen layers of
    Gemma 4's own stack: sliding and full, experts, per-layer inputs, KV-shared layers): greedy output equals plain
    decoding, drafts accepted."""
    import specray_test_draft_heads as draft_heads  # tests/draft_heads.py (registered by conftest)

    from specray import LLM, SamplingParams

    head = draft_heads.write_accepting_head(tmp_path / method, method, tiny_gemma4_dir)
    prompts = [{"prompt_token_ids": list(range(30 + i, 50 + i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(model=str(tiny_gemma4_dir), max_model_len=128).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(tiny_gemma4_dir), max_model_len=128, speculative_config={
        "method": method, "model": str(head), "num_speculative_tokens": 3, "adaptive": False})
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert llm.spec_stats.accepted_tokens > 0
