"""GPT-Neo (``GPTNeoForCausalLM``) and CodeGen (``CodeGenForCausalLM``), classic families on
:mod:`specray.models.classic`'s pieces, against transformers on the same random tiny weights (fp32, max abs diff < 1e-4)
over a 40-token prompt, as a prefill and as chunks + single steps:

* GPT-Neo: learned positions, global and local layers in turn (a window of 8 positions, so the window decides the
  logits), unscaled scores, a bias on the output projection alone, a tied head;
* CodeGen: GPT-J's parallel block with RoPE on the interleaved pairs of half of each head, q/k/v fused in ``qkv_proj``
  in four model-parallel blocks of (q, v, k), eight heads so that each block holds two of them, an untied head with a
  bias.

Also: the engine's greedy tokens equal transformers' ``generate`` (n-gram chains eagerly, trees from graphs), two
tensor-parallel ranks or pipeline stages equal one, LoRA adapters of every projection (CodeGen's fused ``qkv_proj``
split as its weight is) against transformers with the adapter merged, each distinctive part broken once moves the
logits, and what is not served is refused by name. The tiny models are built here (transformers' own classes, random
weights with the norms and biases drawn away from their init), not in conftest."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from specray.models import codegen
from specray.models.classic import GatelessMLP
from specray.models.codegen import CodeGenForCausalLM
from specray.models.gpt_neo import GPTNeoForCausalLM
from specray.models.kv_cache import CAUSAL, FullAttentionSpec, MaskKind, SlidingWindowSpec
from specray.models.loader import load_model, read_config
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_ranks_match_one_rank, chunked_logits, max_diff, mutated_logits,
    prompt, reference_logits)

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
WINDOW = 8  # GPT-Neo's local layers' window (of a 40-token prompt)
HEAD_DIM = 16  # GPT-Neo's: 64 / 4 heads


def _randomized(model, seed: int) -> None:
    """The norms' weights away from ones and every bias away from zeros (their init), so that each shows; the biases
    small (std 0.1), else they outweigh the tokens in the residual stream and every prompt continues alike."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ln_" in name and name.endswith(".weight"):
                param.copy_(torch.rand(param.shape, generator=g) + 0.5)
            elif name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)


def _build(path: Path, config_class, model_class, seed: int, **fields) -> Path:
    """transformers' ``model_class`` at ``fields``' sizes with random weights, saved with conftest's tokenizer."""
    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path)
    config = config_class(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, initializer_range=0.1, **fields)
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    _randomized(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_gpt_neo(path: Path, seed: int = 120) -> Path:
    from transformers import GPTNeoConfig, GPTNeoForCausalLM as HFGPTNeo

    return _build(path, GPTNeoConfig, HFGPTNeo, seed, hidden_size=64, num_layers=4, num_heads=4,
                  attention_types=[[["global", "local"], 2]], window_size=WINDOW, intermediate_size=128,
                  max_position_embeddings=256, activation_function="gelu_new", layer_norm_epsilon=1e-5)


def build_tiny_codegen(path: Path, seed: int = 121) -> Path:
    from transformers import CodeGenConfig, CodeGenForCausalLM as HFCodeGen

    return _build(path, CodeGenConfig, HFCodeGen, seed, n_embd=64, n_layer=3, n_head=8, rotary_dim=4, n_inner=128,
                  n_positions=256, activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_gpt_neo_dir(tmp_path_factory) -> Path:
    return build_tiny_gpt_neo(tmp_path_factory.mktemp("tiny_gpt_neo"))


@pytest.fixture(scope="session")
def tiny_codegen_dir(tmp_path_factory) -> Path:
    return build_tiny_codegen(tmp_path_factory.mktemp("tiny_codegen"))


FAMILIES = {"gpt_neo": ("tiny_gpt_neo_dir", GPTNeoForCausalLM), "codegen": ("tiny_codegen_dir", CodeGenForCausalLM)}


@pytest.fixture(scope="module")
def references(tiny_gpt_neo_dir, tiny_codegen_dir) -> dict[str, torch.Tensor]:
    return {"gpt_neo": reference_logits(tiny_gpt_neo_dir), "codegen": reference_logits(tiny_codegen_dir)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(request, references, family, schedule):
    """Every position's logits equal transformers', a prefill and chunks + decode steps over shuffled blocks; GPT-Neo's
    layers cache alternately everything and a window of 8 positions."""
    fixture, model_class = FAMILIES[family]
    model = load_model(str(request.getfixturevalue(fixture)))
    assert isinstance(model, model_class) and isinstance(model.model.layers[0].mlp, GatelessMLP)
    if family == "gpt_neo":
        full, sliding = FullAttentionSpec(4, HEAD_DIM), SlidingWindowSpec(4, HEAD_DIM, sliding_window=WINDOW)
        assert model.kv_cache_specs() == [full, sliding] * 2
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.kv_cache_specs() == [FullAttentionSpec(8, 8)] * 3 and model.lm_head.bias is not None
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), references[family]) < TOL


STORED_MASKS = {"gpt_neo": ("attn.attention.bias", "attn.attention.masked_bias"),
                "codegen": ("attn.causal_mask", "attn.masked_bias")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stored_causal_masks_are_skipped(request, references, tmp_path, caplog, family):
    """The releases' checkpoints keep each layer's causal mask (GPT-Neo's local layers: their window's) and its fill
    value as tensors, as older transformers saved them: skipped without a warning, the logits unchanged."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / family
    shutil.copytree(request.getfixturevalue(FAMILIES[family][0]), folder)
    weights = load_file(str(folder / "model.safetensors"))
    for i in range(read_config(str(folder)).num_hidden_layers):
        mask, fill = STORED_MASKS[family]
        weights[f"transformer.h.{i}.{mask}"] = torch.tril(torch.ones(1, 1, 256, 256, dtype=torch.bool))
        weights[f"transformer.h.{i}.{fill}"] = torch.tensor(-1e9)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="specray.models.llama"):
        model = load_model(str(folder))
    assert "ignoring checkpoint tensor" not in caplog.text
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["prefill"]), references[family]) < TOL


# ---- each distinctive part, broken on purpose ------------------------------------------------------------------------

def _attns(model) -> list:
    return [layer.self_attn for layer in model.model.layers]


def _scaled_scores(model) -> None:
    """Llama's scores (q.k / sqrt(head_dim)) in place of GPT-Neo's q.k."""
    for a in _attns(model):
        a.attn.scale = HEAD_DIM ** -0.5


def _no_window(model) -> None:
    for a in _attns(model)[1::2]:
        a.attn.mask_kind = CAUSAL


def _window_one_wider(model) -> None:
    """A window of 9 positions: transformers' local layers see the query and the 7 before it."""
    for a in _attns(model)[1::2]:
        a.attn.mask_kind = MaskKind(window=WINDOW + 1)


def _local_first(config) -> None:
    """The kinds swapped: local, global, local, global."""
    config.attention_layers = ["local", "global"] * 2


def _no_positions(model) -> None:
    model.model.embed_positions.weight.data.zero_()


def _no_out_bias(model) -> None:
    for a in _attns(model):
        a.o_proj.bias.data.zero_()


def _qkv_in_thirds(monkeypatch) -> None:
    """Each model-parallel block read as (q, k, v): keys and values swapped."""
    monkeypatch.setattr(codegen, "ORDER", "qkv")


def _one_block(monkeypatch) -> None:
    """qkv_proj read as one block of (q, v, k) (mp_num 1)."""
    monkeypatch.setattr(codegen, "MP_NUM", 1)


def _rope_on_halves(model) -> None:
    for a in _attns(model):
        a.interleaved_rope = False


def _rope_on_whole_heads(config) -> None:
    config.rotary_dim = 8


def _no_head_bias(model) -> None:
    model.lm_head.bias.data.zero_()


MUTATIONS = {"gpt_neo": {"scaled-scores": (None, None, _scaled_scores), "no-window": (None, None, _no_window),
                         "window-one-wider": (None, None, _window_one_wider),
                         "local-first": (None, _local_first, None), "no-positions": (None, None, _no_positions),
                         "no-out-bias": (None, None, _no_out_bias)},
             "codegen": {"qkv-in-thirds": (_qkv_in_thirds, None, None), "one-block": (_one_block, None, None),
                         "rope-on-halves": (None, None, _rope_on_halves),
                         "rope-on-whole-heads": (None, _rope_on_whole_heads, None),
                         "no-head-bias": (None, None, _no_head_bias)}}


@pytest.mark.parametrize("family,mutation", [(f, m) for f in sorted(MUTATIONS) for m in sorted(MUTATIONS[f])])
def test_each_part_shows_in_the_logits(request, references, monkeypatch, family, mutation):
    """Each distinctive part broken once (GPT-Neo: the unscaled scores, the window and its width, which layers are
    local, the learned positions, the output bias; CodeGen: the (q, v, k) order and the four blocks of qkv_proj, RoPE
    on interleaved pairs of rotary_dim features, the head's bias): the logits move by more than a hundred times the
    tolerance."""
    patch, mutate_config, mutate = MUTATIONS[family][mutation]
    if patch is not None:
        patch(monkeypatch)
    folder = request.getfixturevalue(FAMILIES[family][0])
    assert max_diff(mutated_logits(folder, mutate_config, mutate), references[family]) > MOVED


# ---- LoRA ------------------------------------------------------------------------------------------------------------

ADAPTED = {"gpt_neo": ("q_proj", "k_proj", "v_proj", "out_proj", "c_fc", "c_proj"),
           "codegen": ("qkv_proj", "out_proj", "fc_in", "fc_out")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_adapted_logits_match_transformers_with_the_adapter_merged(request, tmp_path, family):
    """An adapter of every projection as PEFT names them (CodeGen's: the fused qkv_proj, whose B is split as the
    weight is), admitted by the engine's check against the model's shapes; its prefill's logits equal transformers'
    on the merged weights, and differ from the base's."""
    from transformers import AutoModelForCausalLM

    from specray.lora import LoRAConfig, LoRARequest, read_adapter
    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import allocate_kv_cache
    from specray.models.lora import LoRASlots, adapter_shapes

    checkpoints = sys.modules["specray_test_checkpoints"]
    base = request.getfixturevalue(FAMILIES[family][0])
    adapter = checkpoints.write_lora(base, tmp_path / "adapter", modules=ADAPTED[family], std=0.2)
    merged = checkpoints.merge_lora(base, adapter, tmp_path / "merged")
    model = load_model(str(base))
    info = read_adapter(str(adapter), adapter_shapes(model), 4, model.adapter_module)  # (the admission check)
    assert info.scale(4) == 2.0
    slots = LoRASlots(model, LoRAConfig(max_loras=1, max_lora_rank=4), torch.device("cpu"))
    assert {name.rsplit(".", 1)[-1] for name in slots.layers} == {"qkv_proj", "o_proj", "c_fc", "c_proj"}
    ids = prompt()[:20]
    slots.context.set_token_slots(torch.tensor(slots.slots_for([LoRARequest("a", 1, str(adapter))]) * len(ids)))
    allocate_kv_cache(model, 8, 4)
    meta = build_attention_metadata([len(ids)], [0], [list(range(8))[::-1]], 4, "cpu")
    with torch.no_grad():
        got = model.compute_logits(model(torch.tensor(ids), meta))
        want, plain = (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(
            torch.tensor([ids])).logits[0] for folder in (merged, base))
    assert max_diff(got, want) < TOL and max_diff(got, plain) > MOVED


# ---- what is refused -------------------------------------------------------------------------------------------------

def _set(field, value):
    def edit(config):
        setattr(config, field, value)
    return edit


def _sizes(hidden, heads):
    """Another n_embd and n_head (the names the config view reads too: hidden_size, num_attention_heads)."""
    def edit(config):
        config.n_embd = config.hidden_size = hidden
        config.n_head = config.num_attention_heads = heads
    return edit


@pytest.mark.parametrize("family,edit,match", [
    ("gpt_neo", _set("attention_layers", ["global", "sparse", "global", "local"]),
     r"attention_types=.* names layer kinds \['sparse'\]: GPT-Neo's layers are 'global' or 'local'"),
    ("gpt_neo", _set("attention_layers", ["global", "local"]),
     r"attention_types=.* lists 2 layers but num_layers=4"),
    ("gpt_neo", _set("window_size", 0), r"window_size=0: GPT-Neo's local layers need a positive int"),
    ("gpt_neo", _set("activation_function", "swish"), r"activation_function='swish' is not supported for "
                                                      r"model_type='gpt_neo'"),
    ("codegen", _set("rotary_dim", None), r"rotary_dim=None is not supported for model_type='codegen'"),
    ("codegen", _set("rotary_dim", 5), r"rotary_dim=5: an even number of each head's features, at most the head "
                                       r"size 8"),
    ("codegen", _sizes(66, 6), r"n_embd=66: CodeGen's fused qkv_proj holds 4 blocks"),
    ("codegen", _set("activation_function", "swish"), r"activation_function='swish' is not supported for "
                                                      r"model_type='codegen'"),
], ids=["gpt_neo-kinds", "gpt_neo-layers", "gpt_neo-window", "gpt_neo-act", "codegen-rotary-none",
        "codegen-rotary-odd", "codegen-mp-blocks", "codegen-act"])
def test_unserved_configs_are_refused_by_name(request, family, edit, match):
    folder = request.getfixturevalue(FAMILIES[family][0])
    config = read_config(str(folder))
    edit(config)
    with pytest.raises(ValueError, match=match):
        load_model(str(folder), config=config)


def test_a_fused_qkv_of_other_rows_is_refused(tiny_codegen_dir, tmp_path):
    """A qkv_proj whose rows are not 3 n_embd (a checkpoint that does not match its config) is refused by name."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "other"
    shutil.copytree(tiny_codegen_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    name = "transformer.h.1.attn.qkv_proj.weight"
    weights[name] = weights[name][:180]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"transformer.h.1.attn.qkv_proj.weight has 180 rows, not 3 \* n_embd = 192"):
        load_model(str(folder))


# ---- ranks and stages ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2], ids=["tp2", "pp2"])
def test_two_ranks_match_one_rank(tiny_gpt_neo_dir, tiny_codegen_dir, tmp_path, stages):
    """Two tensor-parallel ranks (heads, CodeGen's split q/k/v rows, MLP widths and the output bias split) or two
    pipeline stages (the learned positions and the tied head on their stages): the last rank's logits equal one
    rank's."""
    folders = [str(tiny_gpt_neo_dir), str(tiny_codegen_dir)]
    assert_ranks_match_one_rank(tmp_path, folders, stages, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_greedy_equals_transformers_with_drafts_and_graphs(request, no_host_sync, family):
    """``specray.LLM``'s greedy tokens equal transformers' ``generate``; so do they with n-gram chains verified
    eagerly and n-gram trees from graphs (GPT-Neo's window and learned positions, CodeGen's partial interleaved RoPE:
    each tree node at its depth's position), their forward syncing nothing with the host."""
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_drafts_and_graphs_equal_transformers(request.getfixturevalue(FAMILIES[family][0]), no_host_sync, 12)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(request, family, schedule):
    """tests/test_device_parity.py's check for this file's fixtures: fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(request.getfixturevalue(FAMILIES[family][0]), SCHEDULES[schedule])
