"""Loading our model from an HF folder (safetensors, pytorch .bin, sharded either way), from a GGUF file (converted
once, then cached), and the errors for paths and architectures we cannot serve."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from specray.models import loader
from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import load_hf_config, load_model, load_tokenizer, resolve_model

TOL = 1e-4


@torch.no_grad()
def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    allocate_kv_cache(model, -(-len(ids) // 4) + 1, 4)
    meta = build_attention_metadata([len(ids)], [0], [list(range(-(-len(ids) // 4)))[::-1]], 4, model.device)
    return model.compute_logits(model(torch.tensor(ids, device=model.device), meta))


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def assert_matches_hf(model, hf, ids: list[int] | None = None) -> None:
    ids = ids or [5, 17, 3, 99, 250, 42, 7, 8, 1, 64, 128, 200, 31, 2, 9, 77, 150, 11, 13]  # > 16: long path too
    ref = hf(torch.tensor([ids])).logits[0]
    diff = (prefill_logits(model, ids) - ref).abs().max().item()
    # oneDNN's packed matmuls sum in another order than MKL: over SmolLM2's 30 layers that is ~1e-4 on logits
    # of size 30 (3e-6 relative), so the bound is TOL or 1e-5 of the logits' scale, whichever is larger
    assert diff < max(TOL, 1e-5 * ref.abs().max().item()), diff


def copy_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# ------------------------------------------------------------------------------------------ HF folders


def test_safetensors_folder(tiny_llama_dir):
    source = resolve_model(str(tiny_llama_dir))
    assert source.weight_format == "safetensors" and source.gguf_file is None
    model = load_model(str(tiny_llama_dir))
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert_matches_hf(model, hf_model(tiny_llama_dir))


def test_pytorch_bin_folder(tiny_llama_untied_dir, tmp_path):
    hf = hf_model(tiny_llama_untied_dir)
    folder = copy_config(tiny_llama_untied_dir, tmp_path / "bin")
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    source = resolve_model(str(folder))
    assert source.weight_format == "bin" and [f.name for f in source.weight_files] == ["pytorch_model.bin"]
    assert_matches_hf(load_model(str(folder)), hf)


def test_sharded_safetensors_folder(tiny_qwen2_dir, tmp_path):
    hf = hf_model(tiny_qwen2_dir)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    source = resolve_model(str(tmp_path / "sharded"))
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert source.weight_format == "safetensors" and len(source.weight_files) > 1
    assert_matches_hf(load_model(str(tmp_path / "sharded")), hf)


def test_sharded_bin_folder(tiny_qwen2_dir, tmp_path):
    hf = hf_model(tiny_qwen2_dir)
    folder = copy_config(tiny_qwen2_dir, tmp_path / "bin_sharded")
    state = hf.state_dict()
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, keys in shards.items():
        torch.save({k: state[k] for k in keys}, folder / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    source = resolve_model(str(folder))
    assert source.weight_format == "bin" and len(source.weight_files) == 2
    assert_matches_hf(load_model(str(folder)), hf)


def test_bfloat16_load(tiny_llama_dir):
    model = load_model(str(tiny_llama_dir), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    ids = [5, 17, 3, 99, 250, 42]
    logits = prefill_logits(model, ids)
    assert logits.dtype == torch.float32
    assert model.model.layers[0].self_attn.attn.k_cache.dtype == torch.bfloat16
    ref = prefill_logits(load_model(str(tiny_llama_dir)), ids)
    assert (logits - ref).abs().max().item() < 0.1


def test_config_and_tokenizer(tiny_llama_dir):
    assert load_hf_config(str(tiny_llama_dir)).model_type == "llama"
    tok = load_tokenizer(str(tiny_llama_dir))
    assert tok.chat_template
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


# ------------------------------------------------------------------------------------------ errors


def test_unknown_architecture(tiny_llama_dir, tmp_path):
    folder = copy_config(tiny_llama_dir, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    shutil.copy(tiny_llama_dir / "model.safetensors", folder)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        load_model(str(folder))


def test_bad_paths(tmp_path, tiny_llama_dir):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "no" / "such" / "model"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="hub could not provide it"):  # conftest sets HF_HUB_OFFLINE=1
        resolve_model("specray-test/no-such-model")
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="no weights"):
        resolve_model(str(copy_config(tiny_llama_dir, tmp_path / "empty")))
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.txt"))


# ------------------------------------------------------------------------------------------ GGUF (SmolLM2)


@pytest.fixture(scope="module")
def gguf_cache(specray_cache):
    assert os.environ[loader.CACHE_ENV] == str(specray_cache)
    return specray_cache


@pytest.fixture(scope="module")
def smol(smollm2_gguf, gguf_cache):
    return load_model(str(smollm2_gguf))


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_gguf, gguf_cache, smol):
    return load_tokenizer(str(smollm2_gguf))


@pytest.mark.slow
def test_gguf_logits_match_transformers(smol, smol_tokenizer, smollm2_gguf):
    """Reference: transformers' Llama built from the GGUF's config with transformers' own dequantized GGUF tensors
    (``from_pretrained(gguf_file=...)`` would do the same but needs `accelerate`, which is not a dependency)."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    with no_init_weights():
        hf = LlamaForCausalLM(config).float().eval()
    tensors = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    hf.tie_weights()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smol_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert 16 < len(ids) < 64
    assert_matches_hf(smol, hf, list(ids))


@pytest.mark.slow
def test_gguf_tokenizer_has_chat_template(smol_tokenizer):
    assert smol_tokenizer.chat_template and len(smol_tokenizer) == 49152
    text = smol_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                              add_generation_prompt=True)
    assert "<|im_start|>user" in text and text.rstrip().endswith("assistant")


@pytest.mark.slow
def test_gguf_second_load_reads_the_cache(smol, smollm2_gguf, gguf_cache, monkeypatch):
    def no_conversion(*args):
        raise AssertionError("converted the GGUF again instead of reading the cache")

    monkeypatch.setattr(loader, "_write_gguf_folder", no_conversion)
    source = resolve_model(str(smollm2_gguf))
    assert source.gguf_file == smollm2_gguf.resolve() and source.path.parent.parent == gguf_cache
    assert [f.name for f in source.weight_files] == ["model.safetensors"]
    again = load_model(str(smollm2_gguf), pack=False)
    assert torch.equal(again.lm_head.weight, smol.lm_head.weight)  # (smol's linears are packed: opaque)
    x = torch.randn(3, smol.config.hidden_size)
    with torch.no_grad():
        # packed vs dense sums differ by fp32 rounding (~1e-4 here); wrong weights would differ by O(1)
        torch.testing.assert_close(again.model.layers[3].mlp(x), smol.model.layers[3].mlp(x), rtol=1e-3, atol=1e-3)
