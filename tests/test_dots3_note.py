"""dots.llm3 / Dots3-Note's text model (``Dots3NoteForCausalLM``): DeepSeek-V3.2's latent attention and experts with
indexed (GLM-5's indexer, on interleaved pairs), full (no indexer) and sliding layers of their own geometry
(per_layer_config: other heads, ranks and widths), a RoPE per kind of layer (YaRN with an attention factor on the
indexed ones, plain on the sliding ones), the query and KV latents scaled, the shared RoPE key normed, a per-head output
gate, and the shared experts of their own width; against transformers on the same random tiny weights (fp32, max abs
diff < 1e-4) with ``index_topk`` 6 and a window of 8 over a 40-token prompt, so that the selection and the window decide
the logits. Every attention path (the padded short batch, one sequence at a time, the unabsorbed form of a chunk), the
experts' sync-free path, tensor parallel 2 and two pipeline stages equal to one rank, the multimodal checkpoint's text
part, LoRA on every linear projection, and the engine: greedy with n-gram chains and trees, from graphs, equal to
transformers' ``generate``. Each distinctive part broken once moves the logits; what is not served (MTP, inconsistent
configs) is refused by name. The seed keeps every query's 6th and 7th index scores of the prompt apart (0.7% at the
least), where a near-tie could flip the pick between two exact implementations. The tiny models are built here
(transformers' Dots3NoteTextConfig, random weights made visible), not in conftest."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from specray.models import cpu_kernels
from specray.models.deepseek_v3 import _yarn_softmax_scale
from specray.models.dots3_note import (Dots3NoteAttention, Dots3NoteForCausalLM, SlidingMLAAttentionSpec,
                                       layer_config)
from specray.models.kv_cache import CAUSAL, MLAAttentionSpec
from specray.models.llama import LlamaMLP
from specray.models.loader import load_model, read_config
from specray.models.moe import SparseMoE, sync_free_experts
from specray.parallel import TPGroup
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_ranks_match_one_rank, chunked_logits, max_diff, mutated_logits,
    prefill_logits, prompt, reference_logits)

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
TOPK = 6  # index_topk of a 40-token prompt: most queries attend a few of their keys
WINDOW = 8  # the sliding layers' window
SEED = 100
# 4 layers (indexed, sliding, indexed, sliding; the first dense, then experts); the indexed layers at V3.2's tiny
# latent sizes (tests/conftest.py's DSA_TINY) with 16 indexer heads (with few, many keys score exactly 0 and the k-th
# pick is a tie), the sliding ones with other heads, ranks and widths (the release's swa_* fields); 8 experts in 4
# groups of which 2 are kept, shared experts wider than the routed ones; YaRN with mscale_all_dim 0.5 on the indexed
# layers (an attention factor in the cos/sin, none in the softmax scale), a plain RoPE of another theta on the others
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            layer_types=["indexed_attention", "sliding_attention", "indexed_attention", "sliding_attention"],
            num_attention_heads=4, num_key_value_heads=4, head_dim=24, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=16, swa_kv_lora_rank=24,
            swa_head_dim=16, swa_qk_nope_head_dim=8, swa_qk_rope_head_dim=8, swa_v_head_dim=16, sliding_window=WINDOW,
            index_n_heads=16, index_head_dim=16, index_topk=TOPK, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, moe_intermediate_size=32, shared_experts_intermediate_size=48, n_group=4, topk_group=2,
            routed_scaling_factor=1.5, max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.05,
            tie_word_embeddings=False,
            rope_parameters={"indexed_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 256, "mscale": 1.0,
                                                   "mscale_all_dim": 0.5},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})
INDEXED, SLIDING = [0, 2], [1, 3]


def build_tiny_dots3(path: Path, seed: int) -> Path:
    """transformers' Dots3NoteForCausalLM at :data:`TINY`'s sizes with random weights (norms, the routers, the
    output gates, the indexer's key-norm bias and the correction biases drawn away from their init, so that each
    shows), saved as transformers saves it, with conftest's tiny tokenizer."""
    from transformers import Dots3NoteForCausalLM as HFDots3, Dots3NoteTextConfig

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path)
    config = Dots3NoteTextConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                 bos_token_id=None, **TINY)
    torch.manual_seed(seed)
    model = HFDots3(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the router: zeros at init
                param.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):  # ones at init (k_rope_only_layernorm's and the latents' too)
                param.uniform_(0.5, 1.5)
            elif name.endswith("indexer.k_norm.bias"):  # zeros at init
                param.normal_(0.0, 0.5)
            elif name.endswith("self_attn.g_proj.weight"):  # gates far from 1/2
                param.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_dots3_multimodal(text: Path, path: Path) -> Path:
    """transformers' Dots3NoteForConditionalGeneration holding the text model in ``text`` (the same weights) beside
    one-layer vision and audio towers, saved as transformers saves it (the release's names: the text model under
    ``model.``, the towers under ``vision_encoder.`` and ``audio_encoder.``)."""
    from transformers import (AutoModelForCausalLM, Dots3NoteAudioConfig, Dots3NoteConfig,
                              Dots3NoteForConditionalGeneration, Dots3NoteVisionConfig)

    hf_text = AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
    hidden = hf_text.config.hidden_size
    vision = Dots3NoteVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   mlp_layer_types=["dense"], adapter_in_dim=32, adapter_out_dim=hidden)
    audio = Dots3NoteAudioConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 adapter_input_size=32, adapter_out_dim=hidden, downsample_hidden_size=16,
                                 feature_size=16)
    config = Dots3NoteConfig(text_config=hf_text.config.to_dict(), vision_config=vision.to_dict(),
                             audio_config=audio.to_dict(), image_token_id=300, video_token_id=301, audio_token_id=302,
                             tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Dots3NoteForConditionalGeneration(config).float().eval()
    model.model.language_model.load_state_dict(hf_text.model.state_dict())
    model.lm_head.load_state_dict(hf_text.lm_head.state_dict())
    model.save_pretrained(path, safe_serialization=True)
    for file in text.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, path / file.name)
    return path


@pytest.fixture(scope="session")
def tiny_dots3_dir(tmp_path_factory) -> Path:
    return build_tiny_dots3(tmp_path_factory.mktemp("tiny_dots3"), seed=SEED)


@pytest.fixture(scope="module")
def reference(tiny_dots3_dir) -> torch.Tensor:
    return reference_logits(tiny_dots3_dir)


@pytest.mark.parametrize("path", ["batched", "own", "unabsorbed"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_dots3_dir, reference, monkeypatch, schedule, path):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps over shuffled blocks;
    short queries as the padded batch or one sequence at a time, and every chunk in the unabsorbed form. Each layer
    has its own geometry, cache row and mask: the indexed layers an indexer and V3.2's row, the sliding ones none,
    half the heads, a wider latent and a window."""
    if path == "own":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    model = load_model(str(tiny_dots3_dir))
    assert isinstance(model, Dots3NoteForCausalLM)
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == [LlamaMLP, SparseMoE, SparseMoE, SparseMoE]
    assert layers[1].mlp.shared.down_proj.weight.shape[-1] == 48  # shared_experts_intermediate_size
    attns = [layer.self_attn for layer in layers]
    assert all(isinstance(a, Dots3NoteAttention) for a in attns)
    assert [a.num_heads for a in attns] == [4, 2, 4, 2]
    assert [a.indexer is not None for a in attns] == [True, False, True, False]
    assert [a.attn.index_topk for a in attns] == [TOPK, 0, TOPK, 0]
    assert model.kv_cache_specs() == [MLAAttentionSpec(16, 8, 16), SlidingMLAAttentionSpec(24, 8, 0, WINDOW)] * 2
    if path == "unabsorbed":
        for a in attns:
            a.attn.unabsorbed_from = 1
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def _full_third_layer(config: dict) -> None:
    """Layer 2 a full-attention layer (a ``use_dsa: false`` release's kind: no indexer, every earlier key), with the
    indexed layers' RoPE; its indexer's tensors stay in the checkpoint, unread by either side."""
    config["layer_types"][2] = "full_attention"
    config["rope_parameters"]["full_attention"] = dict(config["rope_parameters"]["indexed_attention"])


def test_full_attention_layers_match_transformers(tiny_dots3_dir, reference, tmp_path):
    """A "full_attention" layer among the others: no indexer, a causal latent cache row; the logits equal
    transformers' on that config, and differ from the indexed model's."""
    folder = tmp_path / "full"
    shutil.copytree(tiny_dots3_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    _full_third_layer(config)
    (folder / "config.json").write_text(json.dumps(config))
    model = load_model(str(folder))
    assert model.model.layers[2].self_attn.indexer is None and model.model.layers[2].self_attn.attn.index_topk == 0
    assert model.kv_cache_specs()[2] == MLAAttentionSpec(16, 8, 0)
    got = chunked_logits(model, prompt(), SCHEDULES["chunked+decode"])
    assert max_diff(got, reference_logits(folder)) < TOL
    assert max_diff(got, reference) > MOVED


def test_the_experts_sync_free_path_matches_transformers(tiny_dots3_dir, reference):
    """The experts' sync-free path (what graph steps run) gives the same logits."""
    model = load_model(str(tiny_dots3_dir))
    with sync_free_experts():
        assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) < TOL


# ---- the multimodal checkpoint ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dots3_multimodal_dir(tiny_dots3_dir, tmp_path_factory) -> Path:
    return build_tiny_dots3_multimodal(tiny_dots3_dir, tmp_path_factory.mktemp("tiny_dots3_mm") / "m")


def test_multimodal_checkpoint_serves_its_text_model(tiny_dots3_multimodal_dir, reference, tmp_path, caplog):
    """Dots3NoteForConditionalGeneration's checkpoint (model_type dots3_note, the text model's tensors under
    ``model.``, its towers under ``vision_encoder.`` / ``audio_encoder.``): the text model is built from its
    text_config and reads its own tensors alone (no tower tensor is offered to it); its logits equal the text
    model's in transformers. A release naming Dots3NoteForCausalLM over that config reads the same way."""
    from safetensors import safe_open

    folder = tiny_dots3_multimodal_dir
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(n.startswith("vision_encoder.") for n in names) and any(n.startswith("audio_encoder.") for n in names)
    assert "model.layers.1.self_attn.g_proj.weight" in names
    config = read_config(str(folder))
    assert config.model_type == "dots3_note" and config.architectures == ["Dots3NoteForConditionalGeneration"]
    causal = tmp_path / "causal"
    shutil.copytree(folder, causal)
    edited = json.loads((causal / "config.json").read_text())
    edited["architectures"] = ["Dots3NoteForCausalLM"]
    (causal / "config.json").write_text(json.dumps(edited))
    for source in (folder, causal):
        with caplog.at_level("WARNING", logger="specray.models.llama"):
            model = load_model(str(source))
        assert isinstance(model, Dots3NoteForCausalLM) and model.config.model_type == "dots3_note_text"
        assert "ignoring checkpoint tensor" not in caplog.text
        assert max_diff(prefill_logits(model, prompt()), reference) < TOL


# ---- each distinctive part, broken on purpose ------------------------------------------------------------------------

def _attns(model, layers=range(4)) -> list[Dots3NoteAttention]:
    return [model.model.layers[i].self_attn for i in layers]


def _q_latent_unscaled(model) -> None:
    for a in _attns(model):
        a.q_a_layernorm.scale = 1.0


def _kv_latent_unscaled(model) -> None:
    for a in _attns(model):
        a.kv_a_layernorm.scale = 1.0


def _rope_key_unnormed(model) -> None:
    for a in _attns(model):
        a.k_rope_only_layernorm = nn.Identity()


def _no_output_gate(monkeypatch) -> None:
    monkeypatch.setattr(Dots3NoteAttention, "gate", lambda self, out, gate: out)


def _no_window(model) -> None:
    """The sliding layers attending every earlier key."""
    for a in _attns(model, SLIDING):
        a.attn.mask_kind = CAUSAL


def _no_selection(config) -> None:
    """Every key attended (the indexer keeping more than any context holds)."""
    config.index_topk = 1024


def _mla_rope_on_halves(model) -> None:
    for a in _attns(model):
        a.interleave = False


def _indexer_rope_on_halves(model) -> None:
    """V3.2's indexer RoPE (halves) in place of GLM-5's (interleaved pairs)."""
    for a in _attns(model, INDEXED):
        a.indexer.interleave = False


def _deepseek_softmax_scale(model) -> None:
    """DeepSeek's softmax scale: YaRN's mscale_all_dim squared in it."""
    for i, a in zip(INDEXED, _attns(model, INDEXED)):
        a.attn.scale = _yarn_softmax_scale(layer_config(model.config, i))
        assert a.attn.scale != (a.nope + a.rope) ** -0.5


def _one_rope_for_both_kinds(model) -> None:
    """The sliding layers rotating by the indexed layers' RoPE table."""
    model.model.rotary["sliding_attention"] = model.model.rotary["indexed_attention"]


def _ungrouped(config) -> None:
    """Every group kept: the grouping decides nothing."""
    config.topk_group = config.n_group


MUTATIONS = {"q-latent-unscaled": (None, None, _q_latent_unscaled),
             "kv-latent-unscaled": (None, None, _kv_latent_unscaled),
             "rope-key-unnormed": (None, None, _rope_key_unnormed),
             "no-output-gate": (_no_output_gate, None, None),
             "no-window": (None, None, _no_window),
             "no-selection": (None, _no_selection, None),
             "mla-rope-on-halves": (None, None, _mla_rope_on_halves),
             "indexer-rope-on-halves": (None, None, _indexer_rope_on_halves),
             "deepseek-softmax-scale": (None, None, _deepseek_softmax_scale),
             "one-rope-for-both-kinds": (None, None, _one_rope_for_both_kinds),
             "no-grouping": (None, _ungrouped, None)}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_logits(tiny_dots3_dir, reference, monkeypatch, mutation):
    """Each distinctive part broken once (the latents' scales, the RoPE key's norm, the output gate, the window, the
    indexer's selection, the interleaved RoPE of MLA and of the indexer, the plain softmax scale, the RoPE per kind,
    the expert groups): the logits move by more than a hundred times the tolerance."""
    patch, mutate_config, mutate = MUTATIONS[mutation]
    if patch is not None:
        patch(monkeypatch)
    assert max_diff(mutated_logits(tiny_dots3_dir, mutate_config, mutate), reference) > MOVED


# ---- LoRA ------------------------------------------------------------------------------------------------------------

def test_adapted_logits_match_transformers_with_the_adapter_merged(tiny_dots3_dir, tmp_path):
    """An adapter of every projection applied as a linear (the output gate's g_proj included), its prefill's logits
    equal transformers' on the merged weights, and differ from the base's."""
    from transformers import AutoModelForCausalLM

    from specray.lora import LoRAConfig, LoRARequest
    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import allocate_kv_cache
    from specray.models.lora import LoRASlots

    checkpoints = sys.modules["specray_test_checkpoints"]
    every = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "g_proj", "gate_proj", "up_proj", "down_proj")
    adapter = checkpoints.write_lora(tiny_dots3_dir, tmp_path / "adapter", modules=every, std=0.1)
    merged = checkpoints.merge_lora(tiny_dots3_dir, adapter, tmp_path / "merged")
    model = load_model(str(tiny_dots3_dir))
    slots = LoRASlots(model, LoRAConfig(max_loras=1, max_lora_rank=4), torch.device("cpu"))
    assert {name.rsplit(".", 1)[-1] for name in slots.layers} == {
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "g_proj", "gate_up_proj", "down_proj"}
    ids = prompt()[:20]
    slots.context.set_token_slots(torch.tensor(slots.slots_for([LoRARequest("a", 1, str(adapter))]) * len(ids)))
    allocate_kv_cache(model, 8, 4)
    meta = build_attention_metadata([len(ids)], [0], [list(range(8))[::-1]], 4, "cpu")
    with torch.no_grad():
        got = model.compute_logits(model(torch.tensor(ids), meta))
        want, base = (AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
                      for f in (merged, tiny_dots3_dir))
    assert max_diff(got, want) < TOL and max_diff(got, base) > MOVED


# ---- what is refused -------------------------------------------------------------------------------------------------

def _set(field, value):
    def edit(config):
        setattr(config, field, value)
    return edit


def _sliding_override(field, value):
    def edit(config):
        for layer in SLIDING:
            config.per_layer_config[layer][field] = value
    return edit


def _sliding_rope(config) -> None:
    config.rope_parameters["sliding_attention"]["partial_rotary_factor"] = 0.25


@pytest.mark.parametrize("edit,match", [
    (_set("layer_types", ["indexed_attention", "chunked_attention", "indexed_attention", "sliding_attention"]),
     r"layer_types=\['indexed_attention', 'chunked_attention', .*Dots3-Note needs one of"),
    (_set("mlp_layer_types", ["dense", "moe", "sparse", "sparse"]),
     r"mlp_layer_types=\['dense', 'moe', 'sparse', 'sparse'\]: Dots3-Note needs one 'dense' or 'sparse'"),
    (_sliding_override("q_lora_rank", None), r"q_lora_rank=None \(layer 1, sliding_attention\): .* every layer"),
    (_sliding_rope, r"qk_rope_head_dim=8 \(layer 1\) but rope_parameters\['sliding_attention'\] rotates 4 features"),
    (_set("index_topk", 0), r"index_topk=0: layer 0 is an 'indexed_attention' layer"),
    (_set("sliding_window", 0), r"sliding_window=0 \(layer 1, sliding_attention\): a positive int"),
    (_set("per_layer_config", [{}] * 4), r"per_layer_config of type list: Dots3-Note reads it as a dict"),
    (_set("n_shared_experts", 0), r"n_shared_experts=0: Dots3-Note's experts have at least one shared expert"),
    (_set("n_group", 8), r"n_routed_experts=8, n_group=8: the experts must split into n_group groups of at least 2"),
], ids=["layer_types", "mlp_layer_types", "q_lora_rank", "partial_rotary_factor", "index_topk", "sliding_window",
        "per_layer_config", "n_shared_experts", "n_group"])
def test_inconsistent_configs_are_refused_by_name(tiny_dots3_dir, edit, match):
    config = read_config(str(tiny_dots3_dir))
    edit(config)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_dots3_dir), config=config)


def test_mtp_is_refused(tiny_dots3_dir):
    """transformers' Dots3-Note skips a release's MTP tensors and has no MTP module, so no layout to follow: the
    ``mtp`` head's block is refused by name (and this checkpoint, like transformers', has no MTP layer at all)."""
    from specray import LLM

    config = read_config(str(tiny_dots3_dir))
    with pytest.raises(ValueError, match=r"method='mtp' is not supported for model_type='dots3_note_text'"):
        Dots3NoteForCausalLM.mtp_layer_parts(config, TPGroup.single())
    with pytest.raises(ValueError, match=r"has no MTP layer"):
        LLM(model=str(tiny_dots3_dir), max_model_len=64, block_size=4,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})


# ---- ranks and stages ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2], ids=["tp2", "pp2"])
def test_two_ranks_match_one_rank(tiny_dots3_dir, tmp_path, stages):
    """Two tensor-parallel ranks (each half of every layer's heads, their g_proj rows and the experts' width; the
    latents, the indexer, the RoPE key's norm and the router replicated) or two pipeline stages: the last rank's
    logits equal one rank's."""
    assert_ranks_match_one_rank(tmp_path, [str(tiny_dots3_dir)], stages, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------


def test_engine_greedy_equals_transformers_with_drafts_and_graphs(tiny_dots3_dir, no_host_sync):
    """``specray.LLM``'s greedy tokens equal transformers' ``generate``; so do they with n-gram chains verified
    eagerly and n-gram trees from graphs (on CPU their padded static inputs; the gates, the window, the selection and
    the grouped routing sync nothing with the host)."""
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_drafts_and_graphs_equal_transformers(tiny_dots3_dir, no_host_sync, 12)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_dots3_dir, schedule):
    """tests/test_device_parity.py's check for this file's fixture (that file's list cannot reach a fixture defined
    here): fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(tiny_dots3_dir, SCHEDULES[schedule])
