"""DiffLlama (differential attention: two softmax maps per output head subtracted with a learned lambda, a weightless
RMSNorm over each output head's 2 head_dim, scaled by 1 - lambda_init of the layer) and BitNet (Llama's layer with an
RMSNorm before o_proj and before down_proj, a squared-ReLU gate; its release's ternary weights packed 4 a byte with a
weight scale, activations quantized to int8 per token) against transformers on the same random tiny weights (fp32,
max abs diff < 1e-4) over a prefill and over chunks + decode steps, two tensor-parallel ranks equal to one, the engine's
greedy output with drafts and graphs equal to transformers' ``generate``, each distinctive part broken once, and what is
not served refused by name. The tiny models are built here (transformers' configs, random weights made visible)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from specray.models.diffllama import DiffLlamaAttention, DiffLlamaForCausalLM
from specray.models.kv_cache import FullAttentionSpec
from specray.models.loader import load_model, read_config
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_ranks_match_one_rank, chunked_logits, max_diff, mutated_logits,
    prompt, reference_logits)

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)

# 3 layers (each its own lambda_init), 8 query heads over 4 KV heads (2 pairs, so two ranks hold one pair each),
# head_dim 16
DIFF_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
                 initializer_range=0.05, lambda_std_dev=0.3, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def build_tiny_diffllama(path: Path, seed: int = 0) -> Path:
    """transformers' DiffLlamaForCausalLM at :data:`DIFF_TINY`'s sizes, random weights (norms away from 1), saved
    with conftest's tiny tokenizer."""
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM as HFDiffLlama

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path)
    config = DiffLlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             bos_token_id=None, **DIFF_TINY)
    torch.manual_seed(seed)
    model = HFDiffLlama(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_diffllama_dir(tmp_path_factory) -> Path:
    return build_tiny_diffllama(tmp_path_factory.mktemp("tiny_diffllama"))


@pytest.fixture(scope="module")
def diff_reference(tiny_diffllama_dir) -> torch.Tensor:
    return reference_logits(tiny_diffllama_dir)


# ---- DiffLlama -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_diffllama_logits_match_transformers(tiny_diffllama_dir, diff_reference, schedule):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps over shuffled blocks;
    each layer caches 2 pair heads of 32 features (its 4 KV heads of 16)."""
    model = load_model(str(tiny_diffllama_dir))
    assert isinstance(model, DiffLlamaForCausalLM)
    attns = [layer.self_attn for layer in model.model.layers]
    assert all(isinstance(a, DiffLlamaAttention) for a in attns)
    assert len({a.lambda_init for a in attns}) == 3
    assert model.kv_cache_specs() == [FullAttentionSpec(num_kv_heads=2, head_dim=32)] * 3
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), diff_reference) < TOL


def _no_lambda(monkeypatch) -> None:
    monkeypatch.setattr(DiffLlamaAttention, "lambda_full", lambda self, dtype: torch.zeros((), dtype=dtype))


def _learned_lambda_off(monkeypatch) -> None:
    """lambda = lambda_init alone (the learned vectors ignored)."""
    monkeypatch.setattr(DiffLlamaAttention, "lambda_full",
                        lambda self, dtype: torch.tensor(self.lambda_init, dtype=dtype))


def _one_lambda_init(model) -> None:
    """Every layer with layer 0's lambda_init."""
    for layer in model.model.layers:
        layer.self_attn.lambda_init = model.model.layers[0].self_attn.lambda_init


def _no_group_norm(monkeypatch) -> None:
    monkeypatch.setattr(DiffLlamaAttention, "group_norm", lambda self, out: out)


def _value_halves_swapped(model) -> None:
    """Each pair head's value halves swapped (v_{p+h} where v_p belongs), its keys as they were."""
    for layer in model.model.layers:
        attn = layer.self_attn
        qkv = attn.qkv_proj.weight.data
        d, start = attn.head_dim, attn.qkv_proj.q_size + attn.qkv_proj.kv_size
        v = qkv[start:].view(attn.pairs, 2, d, -1)
        qkv[start:] = v.flip(1).reshape(qkv[start:].shape)


DIFF_MUTATIONS = {"no-lambda": (_no_lambda, None), "learned-lambda-off": (_learned_lambda_off, None),
                  "one-lambda-init": (None, _one_lambda_init), "no-group-norm": (_no_group_norm, None),
                  "value-halves-swapped": (None, _value_halves_swapped)}


@pytest.mark.parametrize("mutation", sorted(DIFF_MUTATIONS))
def test_diffllama_each_part_shows_in_the_logits(tiny_diffllama_dir, diff_reference, monkeypatch, mutation):
    """Each part of differential attention broken once moves the logits by more than a hundred times the tolerance:
    the second map's subtraction, the learned lambda, lambda_init by layer, the norm over each output head, and which
    value head each half of a pair head reads."""
    patch, mutate = DIFF_MUTATIONS[mutation]
    if patch is not None:
        patch(monkeypatch)
    assert max_diff(mutated_logits(tiny_diffllama_dir, None, mutate), diff_reference) > MOVED


@pytest.mark.parametrize("field,value,match", [
    ("num_key_value_heads", 3, r"num_key_value_heads=3 .*even number of KV heads"),
    ("attention_dropout", 0.1, r"attention_dropout=0.1 is not supported for DiffLlama"),
    ("sliding_window", 8, r"sliding_window=8 is not supported for DiffLlama"),
])
def test_diffllama_refuses_what_it_does_not_serve(tiny_diffllama_dir, field, value, match):
    config = read_config(str(tiny_diffllama_dir))
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_diffllama_dir), config=config)


def test_diffllama_engine_greedy_equals_transformers_with_drafts_and_graphs(tiny_diffllama_dir, no_host_sync):
    """``specray.LLM``'s greedy tokens equal transformers' ``generate``; so do they with n-gram chains verified
    eagerly and n-gram trees from graphs, whose forward syncs nothing with the host; a run over an FP8 KV cache (pair
    heads stored as any heads) completes."""
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_drafts_and_graphs_equal_transformers(tiny_diffllama_dir, no_host_sync, 12, fp8=True)


# ---- BitNet ----------------------------------------------------------------------------------------------------------

# 2 layers, 4 query heads over 2 KV heads of 16, a gated MLP of 96 (both sub-norms split evenly over two ranks); the
# embedding tied to the head, as the release's
BITNET_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.05,
                   tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
PACKED = {"quant_method": "bitnet", "linear_class": "bitlinear", "quantization_mode": "offline"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_tiny_bitnet(path: Path, seed: int = 0):
    """transformers' BitNetForCausalLM at :data:`BITNET_TINY`'s sizes, random weights (norms, the sub-norms too, away
    from 1), saved as the -bf16 release is (dense projections), with conftest's tiny tokenizer."""
    from transformers import BitNetConfig, BitNetForCausalLM as HFBitNet

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path)
    config = BitNetConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          bos_token_id=None, **BITNET_TINY)
    torch.manual_seed(seed)
    model = HFBitNet(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def packed_reference_model(dense: Path, seed: int = 1):
    """transformers' BitNet with its decoder projections as ``BitLinear`` (lm_head kept dense, as the quantizer keeps
    it), each of random ternary weights and a random weight_scale; the rest of ``dense``'s model. Built without
    ``from_pretrained`` (its quantizer wants accelerate), with torch.compile off (an eager reference)."""
    from transformers import AutoModelForCausalLM, BitNetQuantConfig
    from transformers.integrations.bitnet import BitLinear, pack_weights, replace_with_bitnet_linear

    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    state = {k: v for k, v in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    for name in list(state):
        if name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in PROJECTIONS:
            ternary = torch.randint(-1, 2, state[name].shape, generator=gen).float()
            state[name] = pack_weights(ternary.clone())
            state[name.replace(".weight", ".weight_scale")] = 4.0 + 4.0 * torch.rand(1, generator=gen)
    replace_with_bitnet_linear(hf, modules_to_not_convert=["lm_head"], quantization_config=BitNetQuantConfig())
    for module in hf.modules():
        if isinstance(module, BitLinear):
            module.to_empty(device="cpu")
            module.dtype = torch.float32
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    hf.tie_weights()
    return hf.eval(), state


def save_packed(dense: Path, path: Path, state: dict) -> Path:
    """A folder as the packed release is laid out: ``dense``'s config with :data:`PACKED` as its quantization_config,
    the packed projections (uint8 [rows/4, cols]) and their weight_scale [1]."""
    from safetensors.torch import save_file

    shutil.copytree(dense, path)
    (path / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = PACKED
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def tiny_bitnet_dir(tmp_path_factory) -> Path:
    return build_tiny_bitnet(tmp_path_factory.mktemp("tiny_bitnet") / "bf16")


@pytest.fixture(scope="session")
def packed_bitnet(tiny_bitnet_dir):
    """(the packed folder, transformers' model of it)."""
    hf, state = packed_reference_model(tiny_bitnet_dir)
    return save_packed(tiny_bitnet_dir, tiny_bitnet_dir.parent / "packed", state), hf


@pytest.fixture(scope="module")
def bitnet_reference(tiny_bitnet_dir) -> torch.Tensor:
    return reference_logits(tiny_bitnet_dir)


@pytest.fixture(scope="module")
def packed_reference(packed_bitnet) -> torch.Tensor:
    with torch.no_grad(), torch._dynamo.config.patch(disable=True):
        return packed_bitnet[1](torch.tensor([prompt()])).logits[0].float()


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_bitnet_logits_match_transformers(tiny_bitnet_dir, bitnet_reference, schedule):
    """The -bf16 layout (dense projections): every position's logits equal transformers'."""
    model = load_model(str(tiny_bitnet_dir))
    assert type(model).__name__ == "BitNetForCausalLM" and not model.packed_release
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), bitnet_reference) < TOL


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_packed_bitnet_logits_match_transformers(packed_bitnet, packed_reference, bitnet_reference, schedule):
    """The packed release's layout (ternary weights 4 a byte, a weight_scale each, activations quantized per token):
    every position's logits equal transformers' BitLinear model's, and differ from the dense model's."""
    from specray.models.bitnet import BitQKVParallelLinear, BitRowParallelLinear

    model = load_model(str(packed_bitnet[0]))
    assert model.packed_release and model.lora_modules == ()
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, BitQKVParallelLinear) and isinstance(attn.o_proj, BitRowParallelLinear)
    got = chunked_logits(model, prompt(), SCHEDULES[schedule])
    assert max_diff(got, packed_reference) < TOL and max_diff(got, bitnet_reference) > MOVED


def _no_attn_sub_norm(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.attn_sub_norm = torch.nn.Identity()


def _no_ffn_sub_norm(model) -> None:
    for layer in model.model.layers:
        layer.mlp.ffn_sub_norm = torch.nn.Identity()


def _plain_relu(monkeypatch) -> None:
    from specray.models.bitnet import BitNetMLP

    monkeypatch.setattr(BitNetMLP, "activation", lambda self, gate: torch.relu(gate))


def _activations_unquantized(monkeypatch) -> None:
    import specray.models.bitnet as bitnet

    monkeypatch.setattr(bitnet, "quantize_activations", lambda x, tp: (x, torch.ones_like(x[:, :1])))


def _rows_interleaved(monkeypatch) -> None:
    """Stored row i's 2-bit values read as rows 4 i .. 4 i + 3 (not one row per quarter)."""
    import specray.models.bitnet as bitnet

    unpack = bitnet.unpack_ternary

    def interleaved(packed, dtype):
        rows = unpack(packed, dtype)
        return rows.view(4, packed.shape[0], -1).transpose(0, 1).reshape(rows.shape)

    monkeypatch.setattr(bitnet, "unpack_ternary", interleaved)


def _no_weight_scale(model) -> None:
    for module in model.modules():
        if hasattr(module, "bit_scales"):
            module.weight_scale.data.fill_(1.0)


BITNET_MUTATIONS = {"no-attn-sub-norm": (False, None, _no_attn_sub_norm),
                    "no-ffn-sub-norm": (False, None, _no_ffn_sub_norm), "plain-relu": (False, _plain_relu, None),
                    "activations-unquantized": (True, _activations_unquantized, None),
                    "rows-interleaved": (True, _rows_interleaved, None),
                    "no-weight-scale": (True, None, _no_weight_scale)}


@pytest.mark.parametrize("mutation", sorted(BITNET_MUTATIONS))
def test_bitnet_each_part_shows_in_the_logits(tiny_bitnet_dir, bitnet_reference, packed_bitnet, packed_reference,
                                              monkeypatch, mutation):
    """Each part broken once moves the logits by more than a hundred times the tolerance: the two sub-norms and the
    squared ReLU (the -bf16 layout); the activations' int8 rounding, the packed rows' order and the weight scale (the
    packed layout)."""
    packed, patch, mutate = BITNET_MUTATIONS[mutation]
    if patch is not None:
        patch(monkeypatch)
    folder, reference = (packed_bitnet[0], packed_reference) if packed else (tiny_bitnet_dir, bitnet_reference)
    assert max_diff(mutated_logits(folder, None, mutate), reference) > MOVED


@pytest.mark.parametrize("field,value,match", [
    ("linear_class", "autobitlinear", r"quantization_config.linear_class='autobitlinear' is not supported for BitNet"),
    ("quantization_mode", "online", r"quantization_config.quantization_mode='online' is not supported for BitNet"),
    ("use_rms_norm", True, r"quantization_config.use_rms_norm=True is not supported for BitNet"),
    ("modules_to_not_convert", ["model.layers.0.mlp.down_proj"], r"modules_to_not_convert=\['model.layers.0.mlp"),
    ("quant_method", "gptq", r"quant_method='gptq' is not supported for model_type='bitnet'"),
])
def test_bitnet_refuses_other_quantizations_by_name(packed_bitnet, field, value, match):
    config = read_config(str(packed_bitnet[0]))
    quant = dict(config.quantization_config if isinstance(config.quantization_config, dict)
                 else vars(config.quantization_config))
    quant[field] = value
    config.quantization_config = quant
    with pytest.raises(ValueError, match=match):
        load_model(str(packed_bitnet[0]), config=config)


def test_the_bitnet_method_is_refused_for_another_family(tiny_llama_dir, packed_bitnet, tmp_path):
    """BitNet's packed method in another family's config.json: a ValueError naming the method and the model type,
    not a shape mismatch on the first packed tensor."""
    folder = tmp_path / "llama_bitnet"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = PACKED
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quant_method='bitnet' .* not for model_type='llama'"):
        load_model(str(folder))
    load_model(str(packed_bitnet[0]))  # (BitNet's own release reads it)


def test_bitnet_refuses_another_activation(tiny_bitnet_dir):
    config = read_config(str(tiny_bitnet_dir))
    config.hidden_act = "silu"
    with pytest.raises(ValueError, match=r"hidden_act='silu' is not supported for model_type='bitnet'"):
        load_model(str(tiny_bitnet_dir), config=config)


def test_bitnet_engine_greedy_equals_transformers_with_drafts_and_graphs(tiny_bitnet_dir, no_host_sync):
    """The -bf16 layout: ``specray.LLM``'s greedy tokens equal transformers' ``generate``, with n-gram chains and
    trees from graphs too."""
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_drafts_and_graphs_equal_transformers(tiny_bitnet_dir, no_host_sync, 12)


def test_packed_bitnet_engine_greedy_equals_transformers(packed_bitnet, no_host_sync):
    """The packed layout: greedy tokens equal transformers' BitLinear model's ``generate`` (built here, not loaded),
    plainly, with n-gram chains verified eagerly and with n-gram trees from graphs, whose forward syncs nothing."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    folder, hf = packed_bitnet
    prompts = runs.PROMPTS[:4]
    plain = LLM(model=str(folder), max_model_len=256, block_size=4)
    want = runs.token_ids(plain.generate(prompts, runs.greedy(12), use_tqdm=False))
    tokenizer = plain.get_tokenizer()
    with torch.no_grad(), torch._dynamo.config.patch(disable=True):
        for text, ours in zip(prompts, want, strict=True):
            ids = torch.tensor([tokenizer.encode(text)])
            out = hf.generate(ids, max_new_tokens=len(ours), min_new_tokens=len(ours), do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            assert out[0, ids.shape[1]:].tolist() == ours, text
    for spec, eager in ((runs.CHAIN_NGRAM, True), ({**runs.CHAIN_NGRAM, "num_branches": 2}, False)):
        llm = LLM(model=str(folder), max_model_len=256, block_size=4, speculative_config=spec, enforce_eager=eager)
        assert runs.token_ids(llm.generate(prompts, runs.greedy(12), use_tqdm=False)) == want
        assert llm.spec_stats.accepted_tokens > 0
    graphs = llm.engine.executor.worker.runner.graphs
    graph = next(iter(graphs.graphs.values()))
    with torch.inference_mode(), no_host_sync():
        graphs._step(graph.input_ids, graph.meta, graph.inputs)


# ---- ranks -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2], ids=["tp2", "pp2"])
def test_two_ranks_match_one_rank(tiny_diffllama_dir, tiny_bitnet_dir, packed_bitnet, tmp_path, stages):
    """Two tensor-parallel ranks (DiffLlama: one pair of KV heads each; BitNet: half of each sub-norm's features, the
    squares summed over the ranks; packed, each token's largest activation of a row-parallel input over both ranks)
    or two pipeline stages: the last rank's logits equal one rank's."""
    folders = [str(tiny_diffllama_dir), str(tiny_bitnet_dir), str(packed_bitnet[0])]
    assert_ranks_match_one_rank(tmp_path, folders, stages, TOL)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("which", ["diffllama", "bitnet", "bitnet-packed"])
def test_logits_on_the_gpu_equal_the_cpu(tiny_diffllama_dir, tiny_bitnet_dir, packed_bitnet, which):
    """tests/test_device_parity.py's check for this file's fixtures: fp32 logits on CUDA equal the CPU's (chunks and
    decode steps)."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    folder = {"diffllama": tiny_diffllama_dir, "bitnet": tiny_bitnet_dir, "bitnet-packed": packed_bitnet[0]}[which]
    checks.assert_logits_on_the_gpu_equal_the_cpu(folder, SCHEDULES["chunked+decode"])
