"""Loading our model from an HF folder (safetensors, pytorch .bin, sharded either way), from a GGUF file (converted
once, then cached), and the errors for paths and architectures we cannot serve."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specray.config import DEQUANTIZE_INT4_ENV
from specray.models import loader
from specray.models.attention import build_attention_metadata
from specray.models.gguf_mamba2 import MAMBA2_GGUF_ARCHS
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import check_model_path, load_hf_config, load_model, load_tokenizer, resolve_model
from specray_test_checkpoints import (FP8_BLOCK, INT_SCHEMES, assert_refused, gguf_blocks,  # tests/checkpoints.py,
                                      split_experts, write_fp8, write_int)  # via conftest

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


def test_a_folder_without_tokenizer_files_names_the_tokenizer_option(tiny_llama_dir, tmp_path):
    """A model folder with no tokenizer files is a ValueError naming the files looked for and the ``tokenizer``
    option, not transformers' error about converting a slow tokenizer; one with a tokenizer file loads it."""
    folder = copy_config(tiny_llama_dir, tmp_path / "no_tokenizer")
    with pytest.raises(ValueError, match=r"has no tokenizer files \(tokenizer\*, \*\.model, .*pass tokenizer= "
                                         r"\(--tokenizer\)"):
        load_tokenizer(str(folder))
    shutil.copy(tiny_llama_dir / "tokenizer.json", folder)
    assert load_tokenizer(str(folder)).encode("hi")


# ------------------------------------------------------------------------------------------ errors


def test_checkpoint_tensors_with_no_place_are_named_in_one_warning(tiny_llama_dir, tmp_path, caplog):
    """Checkpoint tensors the model has no place for -- the layers past config.json's num_hidden_layers, a tensor of
    no parameter -- are one WARNING naming how many and the first, as transformers warns; an MTP layer after the
    last (DeepSeek's layout: an eh_proj among its tensors) is the mtp drafter's, and unnamed."""
    import logging

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    one_layer = copy_config(tiny_llama_dir, tmp_path / "one_layer", num_hidden_layers=1)
    shutil.copy(tiny_llama_dir / "model.safetensors", one_layer)
    extra = copy_config(tiny_llama_dir, tmp_path / "extra")
    mtp = {f"model.layers.2.{name}": torch.zeros(2) for name in ("eh_proj.weight", "mlp.down_proj.weight")}
    save_file({**tensors, **mtp, "model.layers.0.foo.weight": torch.zeros(2)}, str(extra / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="specray.models.llama"):
        load_model(str(one_layer), pack=False)
        load_model(str(extra), pack=False)
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring checkpoint tensors LlamaForCausalLM has no place for: 9, e.g. ['model.layers.1.input_layernorm."
        "weight', 'model.layers.1.mlp.down_proj.weight', 'model.layers.1.mlp.gate_proj.weight', 'model.layers.1."
        "mlp.up_proj.weight', 'model.layers.1.post_attention_layernorm.weight']; the checkpoint has layers past "
        "config.json's num_hidden_layers=1: does the config match the checkpoint?",
        "ignoring checkpoint tensors LlamaForCausalLM has no place for: 1, e.g. ['model.layers.0.foo.weight']"]


def test_missing_weights_are_named_as_the_checkpoint_names_them(tiny_llama_dir, tmp_path):
    """A checkpoint without a tensor the model merges with others (gate_proj and up_proj into one parameter) names
    that tensor, not the merged parameter's part."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"], tensors["model.layers.1.self_attn.k_proj.weight"]
    folder = copy_config(tiny_llama_dir, tmp_path / "missing")
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint is missing 2 weights, e\.g\. \['model.layers.0.mlp.up_proj."
                                         r"weight', 'model.layers.1.self_attn.k_proj.weight'\]; is it a complete"):
        load_model(str(folder), pack=False)


def test_unknown_architecture(tiny_llama_dir, tmp_path):
    folder = copy_config(tiny_llama_dir, tmp_path / "marian", architectures=["MarianForCausalLM"], model_type="marian")
    shutil.copy(tiny_llama_dir / "model.safetensors", folder)
    with pytest.raises(ValueError, match=r"MarianForCausalLM.*not supported.*LlamaForCausalLM"):
        load_model(str(folder))


def test_each_family_ties_its_head_where_transformers_does():
    """A family whose transformers class ties nothing (no ``_tied_weights_keys``) keeps its own LM head whatever
    ``tie_word_embeddings`` says (``may_tie`` False: Kimi-Linear's and Ling 3.0's saved a head of their own that a tied
    model would have ignored), and one whose class ties may tie."""
    import importlib

    import transformers

    from specray.models import registry

    checked = 0
    for arch, target in sorted(registry._ARCHITECTURES.items()):
        theirs = getattr(transformers, arch, None)
        module, name = target.split(":")
        ours = getattr(importlib.import_module(module), name)
        if theirs is None or not hasattr(ours, "may_tie"):
            continue
        assert bool(ours.may_tie) == bool(getattr(theirs, "_tied_weights_keys", None)), arch
        checked += 1
    assert checked > 100


def test_bad_paths(tmp_path, tiny_llama_dir, gguf_cache):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "no" / "such" / "model"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="hub could not provide it"):  # conftest sets HF_HUB_OFFLINE=1
        resolve_model("specray-test/no-such-model")
    with pytest.raises(ValueError, match="no config.json; pass an HF model folder"):
        resolve_model(str(tmp_path))
    (tmp_path / "ggufs").mkdir()
    (tmp_path / "ggufs" / "m-Q4_K_M.gguf").write_bytes(b"")  # a llama.cpp release's folder: the file is the model
    with pytest.raises(ValueError, match=r"no config.json but holds GGUF files \['m-Q4_K_M.gguf'\]: pass one of them "
                                         r"as the model \(e.g. '.*ggufs/m-Q4_K_M.gguf'\), or pass an HF model folder"):
        resolve_model(str(tmp_path / "ggufs"))
    with pytest.raises(ValueError, match=r"speculative_config.model='.*ggufs' is a folder without config.json but "
                                         r"holds GGUF files \['m-Q4_K_M.gguf'\]: pass one of them as the model"):
        check_model_path(str(tmp_path / "ggufs"), "speculative_config.model")
    with pytest.raises(ValueError, match="no weights"):
        resolve_model(str(copy_config(tiny_llama_dir, tmp_path / "empty")))
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.txt"))
    for name in ("M-Q4_K.GGUF", "blob"):  # a GGUF by its suffix in any case, or by its magic (a hub blob), as vLLM's
        (tmp_path / name).write_bytes(b"GGUF\x03\x00")  # (cut short: read as a GGUF, it is refused as one)
        with pytest.raises(ValueError, match="is truncated or corrupt"):
            resolve_model(str(tmp_path / name))


@pytest.mark.parametrize("case, match", [
    ("config", r"config.json' is unreadable: not valid JSON \(Expecting .*fix it, or download the model again"),
    ("safetensors", r"model.safetensors' is unreadable: not a complete safetensors file \(.*download or save it"),
    ("bin", r"pytorch_model.bin' is unreadable: torch.load\(weights_only=True\) cannot read it \(UnpicklingError: "
            r"Unsupported operand \d+\); the file is corrupt"),
    ("missing_shard", r"index.json' lists weight files the folder lacks: \['model-2.safetensors'\] \(1 of 2\)"),
    ("stale_index", None),  # an index beside one model.safetensors: the file is read, as transformers reads it
    ("legacy_bin", None),  # torch's format before 1.6 (not a zip archive: read whole, not memory-mapped)
    ("heads", r"model='.*heads' has a config transformers refuses: The hidden size \(64\) is not a multiple of the "
              r"number of attention heads \(5\); fix config.json"),
], ids=["config", "safetensors", "bin", "missing_shard", "stale_index", "legacy_bin", "heads"])
def test_unreadable_checkpoint_files_are_named(tiny_llama_dir, tmp_path, case, match):
    """A corrupt or half-written config.json, safetensors or torch file, or an index whose shards are missing, is a
    ValueError naming the file, not the parser's own error; so is a config whose sizes transformers refuses (not
    huggingface_hub's StrictDataclassError, which the CLI showed as a traceback); a stale index beside one file and
    a legacy torch file load."""
    from safetensors.torch import load_file

    folder = copy_config(tiny_llama_dir, tmp_path / case, **({"num_attention_heads": 5} if case == "heads" else {}))
    weights = tiny_llama_dir / "model.safetensors"
    if case in ("config", "stale_index", "heads"):
        shutil.copy(weights, folder)
    if case == "config":
        (folder / "config.json").write_text("{'model_type': 'llama'")
    elif case == "safetensors":
        (folder / "model.safetensors").write_bytes(weights.read_bytes()[:-100])
    elif case == "bin":
        (folder / "pytorch_model.bin").write_text("not a pickle")
    elif case == "legacy_bin":
        torch.save(load_file(str(weights)), folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    else:
        shutil.copy(weights, folder / "model-1.safetensors")
        index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if match is None:
        net = load_model(str(folder), pack=False)
        assert torch.equal(net.model.embed_tokens.weight, load_file(str(weights))["model.embed_tokens.weight"])
        return
    with pytest.raises(ValueError, match=match):
        load_model(str(folder), pack=False)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_moe_dir", "tiny_deepseek_dir", "tiny_gemma3_dir"])
def test_dummy_weights_need_only_the_config(request, tmp_path, fixture):
    """load_format="dummy" (vLLM's): a folder with a config and a tokenizer and no weights makes a model of the
    checkpoint's shapes with small random weights (dense, experts, latent attention), which the engine runs end to
    end; "auto" refuses the same folder for its missing weights, before any rank starts."""
    from specray import LLM, SamplingParams

    src = request.getfixturevalue(fixture)
    folder = tmp_path / "config_only"
    shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.index.json"))
    assert load_tokenizer(str(folder)) is not None and load_hf_config(str(folder)) is not None  # no weights needed
    net = load_model(str(folder), load_format="dummy", pack=False)
    reference = load_model(str(src), pack=False)
    assert {n: p.shape for n, p in net.named_parameters()} == {n: p.shape for n, p in reference.named_parameters()}
    assert all(0 < p.abs().max() <= loader.DUMMY_WEIGHT_RANGE for p in net.parameters())
    llm = LLM(model=str(folder), max_model_len=128, load_format="dummy",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    out = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8
    with pytest.raises(ValueError, match="no weights"):
        LLM(model=str(folder), max_model_len=128)
    with pytest.raises(ValueError, match="load_format='pt' must be"):
        load_model(str(folder), load_format="pt")


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
def test_gguf_logits_match_transformers(smol, smol_tokenizer, smollm2_gguf, monkeypatch):
    """Reference: transformers' Llama built from the GGUF's config with transformers' own dequantized GGUF tensors
    (``from_pretrained(gguf_file=...)`` would do the same but needs `accelerate`, which is not a dependency)."""
    import functools

    import gguf
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers' name mapping builds gguf-py's name table again for each of the model's ~400 modules (most of
    # this test's time); the table depends on its arguments alone
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    with loader._parsed_once(smollm2_gguf.resolve()):  # gguf-py's parse of the file, once for both reads
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


def test_a_gguf_converted_by_an_older_conversion_is_converted_again(tiny_llama_dir, tmp_path, gguf_cache,
                                                                     monkeypatch):
    """A conversion whose version (``GGUF_CONVERSION_VERSION``) differs from the cached folder's is not served the
    older folder: the file is converted again, into a folder of its own, and the older conversion is deleted (so is
    one of an earlier version of the file; another file's stays). A new conversion also deletes the partial ones
    a killed process left (its PID gone, idle for 10 minutes), not a live process's."""
    import subprocess

    path = write_gguf(tiny_llama_dir, tmp_path / "llama.gguf", "llama")
    other = resolve_model(str(shutil.copy(path, tmp_path / "other.gguf"))).path
    first = resolve_model(str(path)).path
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    abandoned, fresh, live = (first.parent / f".{name}.tmp-{pid}-ab12cd34"
                              for name, pid in (("a", gone), ("b", gone), ("c", os.getpid())))
    for tmp in (abandoned, fresh, live):
        tmp.mkdir()
    for tmp in (abandoned, live):
        os.utime(tmp, (time.time() - 3600, time.time() - 3600))
    assert json.loads((first / loader._GGUF_MARKER).read_text())["version"] == loader.GGUF_CONVERSION_VERSION
    monkeypatch.setattr(loader, "GGUF_CONVERSION_VERSION", loader.GGUF_CONVERSION_VERSION + 1)
    converted = []
    write = loader._write_gguf_folder
    monkeypatch.setattr(loader, "_write_gguf_folder", lambda *args: converted.append(args) or write(*args))
    second = resolve_model(str(path)).path
    assert converted and second != first and not first.exists() and (other / loader._GGUF_MARKER).is_file()
    assert not abandoned.exists() and fresh.exists() and live.exists()
    assert json.loads((second / loader._GGUF_MARKER).read_text())["version"] == loader.GGUF_CONVERSION_VERSION
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # the file changed
    third = resolve_model(str(path)).path
    assert third != second and not second.exists() and (other / loader._GGUF_MARKER).is_file()


def test_a_gguf_converts_into_the_dtype_asked_for(tiny_llama_dir, tmp_path, gguf_cache, monkeypatch):
    """``SPECRAY_GGUF_DTYPE=bfloat16`` converts a GGUF into bfloat16 shards (half of float32's bytes on disk) in a
    cache folder of its own, beside the float32 one (a process without the variable may be reading that): each
    tensor is the float32 conversion's rounded to bfloat16, as loading a model in bfloat16 rounds it, so the model
    run in bfloat16 has the same weights from either. Another value is a ValueError naming the variable."""
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in folder.glob("*.safetensors") for k, v in load_file(str(f)).items()}

    path = write_gguf(tiny_llama_dir, tmp_path / "llama.gguf", "llama")
    full = resolve_model(str(path)).path
    exact = tensors(full)
    as_f32 = dict(load_model(str(path), pack=False, dtype=torch.bfloat16).state_dict())
    monkeypatch.setenv(loader.GGUF_DTYPE_ENV, "bfloat16")
    half = resolve_model(str(path)).path
    assert half != full and (full / loader._GGUF_MARKER).is_file()
    rounded = tensors(half)
    assert sorted(rounded) == sorted(exact)
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, exact[k].to(torch.bfloat16)) for k, v in rounded.items())
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((half / loader._GGUF_MARKER).read_text())["dtype"] == "bfloat16"
    as_bf16 = dict(load_model(str(path), pack=False, dtype=torch.bfloat16).state_dict())
    assert sorted(as_bf16) == sorted(as_f32) and all(torch.equal(as_bf16[k], as_f32[k]) for k in as_f32)
    monkeypatch.setenv(loader.GGUF_DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match="SPECRAY_GGUF_DTYPE='int8' is not a dtype a GGUF is converted into"):
        resolve_model(str(path))


# ---- a GGUF's 4-bit linears kept in 4 bits (specray.models.gguf_quant) -----------------------------------------

# each projection's llama.cpp type in the test file: the three 4-bit types, mixed within a layer (q, k and v merge
# into one linear); layer 1's attn_v in Q8_0 and ffn_down in Q5_1 (as Q4_K_M gives some layers 6 bits), stored a
# byte per value
Q4_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q4_K", "ffn_gate": "Q4_0",
            "ffn_up": "Q4_1", "ffn_down": "Q4_K"}
Q4_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj")


def q4_types(name: str) -> str | None:
    if name in ("blk.1.attn_v.weight", "blk.1.ffn_down.weight"):
        return "Q8_0" if "attn_v" in name else "Q5_1"
    return Q4_TYPES.get(name.split(".")[2]) if name.startswith("blk.") else None


@pytest.fixture(scope="module")
def tiny_llama_256(make_tiny_model, tmp_path_factory) -> Path:
    """The tiny llama, its linears 256 or 512 columns wide (Q4_K's super-blocks are 256)."""
    return make_tiny_model(tmp_path_factory.mktemp("llama256"), "llama", hidden_size=256, intermediate_size=512,
                           tie_word_embeddings=True)


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in folder.glob("*.safetensors") for k, v in load_file(str(f)).items()}


def test_gguf_integer_types_unpack_to_gguf_py_s_values():
    """Rows of each integer type kept (Q4_0, Q4_1, Q4_K: 4 bits; Q5_0, Q5_1, Q5_K, Q6_K, Q8_0: a byte each) unpack
    into integers of their width with a scale, zero point and offset per group (32 columns; Q6_K's 16) that
    dequantize to gguf-py's values exactly (the K types' blocks random bytes: every bit of their packed scales, mins
    and high bits read)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from specray.models.gguf_quant import KEPT_TYPES, unpack

    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 512)).astype(np.float32)

    def k_blocks(size: int, scale_at: int) -> np.ndarray:  # random super-blocks, their f16 scales finite
        blocks = rng.integers(0, 256, (5, 2, size), dtype=np.uint8)
        scales = (rng.standard_normal((5, 2, 2)) * 0.01).astype(np.float16).view(np.uint8).reshape(5, 2, 4)
        blocks[..., scale_at: scale_at + (4 if scale_at == 0 else 2)] = scales[..., : 4 if scale_at == 0 else 2]
        return blocks.reshape(5, -1)

    raws = {"Q4_K": k_blocks(144, 0), "Q5_K": k_blocks(176, 0), "Q6_K": k_blocks(210, 208),
            **{kind: gguf_blocks(x, kind) for kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")}}
    assert sorted(raws) == sorted(KEPT_TYPES)
    for kind, raw in raws.items():
        w = unpack(torch.from_numpy(raw), kind)
        width = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}[kind]
        group = 16 if kind == "Q6_K" else 32
        assert w.q.shape == (5, 512) and int(w.q.max()) < 2 ** width and w.bits == (4 if width == 4 else 8), kind
        assert w.group_size == group and w.scale.shape == w.offset.shape == (5, 512 // group), kind
        want = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[kind]).copy())
        assert torch.equal(w.dense(), want), kind


def test_row_index_finds_rows_moved_split_or_joined_and_nothing_else(tmp_path, monkeypatch):
    """The index of a file's integer rows gives back a weight made of them in any order and from several tensors (a
    permutation, a join), exactly; a weight with a changed value, float32 rows, rows of another width, or rows of
    4-bit and 8-bit types together is not found. Which converted names may be kept: a decoder layer's projections and
    experts, not an MTP layer's after them, not embeddings or norms."""
    import gguf
    import numpy as np

    from specray.models.gguf_quant import RowIndex, keeps_name
    from specray.models.gguf_read import dequantized

    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(tmp_path / "rows.gguf"), "llama")
    for name, kind, shape in (("a", "Q4_K", (8, 256)), ("b", "Q4_1", (4, 256)), ("c", None, (4, 256)),
                              ("d", "Q4_0", (3, 64)), ("e", "Q4_1", (2, 3, 256)),  # e: stacked experts
                              ("f", "Q8_0", (2, 256)), ("token_embd", "Q8_0", (4, 256))):  # (not a layer's)
        x = rng.standard_normal(shape).astype(np.float32)
        name = name if name == "token_embd" else f"blk.0.{name}"
        if kind:
            blocks = gguf_blocks(x.reshape(-1, shape[-1]), kind).reshape(*shape[:-1], -1)
            w.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            w.add_tensor(name, x)
    _write_out(w)
    tensors = {t.name.removeprefix("blk.0."): t for t in gguf.GGUFReader(str(tmp_path / "rows.gguf")).tensors}
    index = RowIndex(list(tensors.values()))
    assert len(index) == 8 + 4 + 3 + 6 + 2  # the layer's integer rows, not the embedding's
    a, b, c, e, f = (dequantized(tensors[n]) for n in "abcef")
    assert index.match(dequantized(tensors["token_embd"])) is None
    for want in (a[[5, 0, 7, 1]], torch.cat([b[2:], a[:3], b[:1]])):
        got = index.match(want)
        assert got is not None and torch.equal(got.dense(), want)
    changed = a.clone()
    changed[2, 7] += 1e-3
    assert index.match(changed) is None and index.match(c) is None and index.match(a[:, :64]) is None
    assert index.match(a.double()) is None
    assert index.match(f[[1, 0]]).bits == 8 and index.match(torch.cat([a[:2], f])) is None  # one width per weight
    x3 = torch.cat([e.reshape(6, 256)[[4, 1]], a[:3], e[0]]).reshape(2, 4, 256)  # 3-D: experts' rows in turn
    got = index.match(x3)
    assert got is not None and torch.equal(got.dense(), x3.reshape(8, 256))
    from specray.models import gguf_quant

    monkeypatch.setattr(gguf_quant, "row_hashes", lambda x: torch.zeros(len(x), dtype=torch.long))  # all collide
    assert index.match(a) is None and RowIndex(list(tensors.values())).match(a) is None  # the values decide
    assert keeps_name("model.layers.0.self_attn.q_proj.weight", 2)
    assert keeps_name("model.layers.1.mlp.shared_expert.down_proj.weight", 2)
    for name in ("model.layers.0.mlp.experts.1.up_proj.weight", "model.layers.1.block_sparse_moe.experts.0.w1.weight",
                 "model.layers.0.feed_forward.w1.weight", "model.layers.1.mlp.c_fc.weight"):  # linears of any name
        assert keeps_name(name, 2), name
    assert keeps_name("model.layers.0.mlp.experts.gate_up_proj", 2, dims=3)  # a block's experts fused
    assert not keeps_name("model.layers.0.block_sparse_moe.input_linear.weight", 2, dims=3)  # stacked otherwise
    assert not keeps_name("model.layers.0.mlp.experts.gate_up_proj", 2, dims=1)
    assert not keeps_name("model.layers.2.self_attn.q_proj.weight", 2)  # an MTP layer
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.1.self_attn.q_norm.weight", "model.layers.0.self_attn.q_proj.bias",
                 "model.layers.0.mlp.experts.gate_up_proj_bias"):
        assert not keeps_name(name, 2), name


def test_a_q4_gguf_keeps_its_4_bit_linears_through_conversion(tiny_llama_256, tmp_path, gguf_cache, monkeypatch):
    """A GGUF whose projections are Q4_0, Q4_1 and Q4_K converts into a folder that stores them as integers with
    their scales (``quant_method: specray_gguf``; under a quarter of float32's bytes), the query and key rows still
    in transformers' order; its Q8_0 and Q5_1 ones a byte per value (under a third). Loaded (dequantized on this CPU),
    every weight and the logits equal those of the same file converted dense, as conversions were before."""
    path = write_gguf(tiny_llama_256, tmp_path / "q4.gguf", "llama", q4_types)
    dense_path = Path(shutil.copy(path, tmp_path / "dense.gguf"))
    folder = resolve_model(str(path)).path
    assert json.loads((folder / "config.json").read_text())["quantization_config"] == {
        "quant_method": "specray_gguf", "bits": 4, "group_size": 32}
    stored = _safetensors(folder)
    index = loader.RowIndex
    monkeypatch.setattr(loader, "RowIndex", lambda tensors: index([]))  # no row found: every tensor stored dense
    dense_folder = resolve_model(str(dense_path)).path
    assert "quantization_config" not in json.loads((dense_folder / "config.json").read_text())
    dense = _safetensors(dense_folder)
    for i in range(2):
        for projection in Q4_PROJECTIONS:
            base = f"model.layers.{i}.{projection}"
            wide = i == 1 and projection in ("self_attn.v_proj", "mlp.down_proj")
            assert f"{base}.weight" not in stored and stored[f"{base}.q_weight"].dtype == torch.uint8
            assert stored[f"{base}.q_bits"].tolist() == [8 if wide else 4]
            parts = sum(stored[f"{base}.{p}"].nbytes for p in ("q_weight", "q_scale", "q_zero", "q_offset"))
            assert parts < dense[f"{base}.weight"].nbytes / (3 if wide else 4)
    model, ref = load_model(str(path), pack=False), load_model(str(dense_path), pack=False)
    want = dict(ref.state_dict())
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    ids = list(range(3, 40))
    assert torch.equal(prefill_logits(model, ids), prefill_logits(ref, ids))


def q4_expert_types(name: str) -> str | None:
    """A Q4_K_M-like mix for a mixture of experts: attention in Q4_1, the experts' gate Q4_0 and up Q4_1, their down
    Q4_0 in layer 0 and Q8_0 in layer 1 (a byte per value)."""
    kind = name.split(".")[2] if name.startswith("blk.") else None
    if kind == "ffn_down_exps":
        return "Q4_0" if name.startswith("blk.0.") else "Q8_0"
    return {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_1", "ffn_gate_exps": "Q4_0",
            "ffn_up_exps": "Q4_1"}.get(kind)


def test_a_q4_gguf_s_experts_stay_in_4_bits(make_tiny_model, tmp_path, gguf_cache, int4_weights):
    """A mixture's 4-bit experts (llama.cpp's stacked ``ffn_*_exps``, transformers' fused ``gate_up_proj``) are
    stored one expert's projection at a time as integers (a Q8_0 down projection a byte per value). Where the device
    keeps 4-bit weights, each block keeps its 4-bit projections packed (a byte per two values) and dequantizes an
    expert's when tokens reach it, the Q8_0 one dense beside them; logits within the kernel's rounding of the
    dequantized model's (the experts' own values equal), and greedy engine output with n-gram drafts that of plain
    decoding and of the dequantized model. Asked to dequantize, nothing stays packed."""
    from specray import LLM, SamplingParams
    from specray.models import cpu_kernels

    folder = make_tiny_model(tmp_path / "moe", "qwen3_moe", seed=9, head_dim=16, tie_word_embeddings=False,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
    path = write_gguf(folder, tmp_path / "moe.gguf", "qwen3moe", q4_expert_types)
    dense_path = Path(shutil.copy(path, tmp_path / "dense.gguf"))
    stored = _safetensors(resolve_model(str(path)).path)
    index = loader.RowIndex
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "RowIndex", lambda tensors: index([]))  # the same file converted dense: the reference
        resolve_model(str(dense_path))
    assert stored["model.layers.0.mlp.experts.3.gate_proj.q_bits"].tolist() == [4]
    assert stored["model.layers.0.mlp.experts.3.down_proj.q_bits"].tolist() == [4]
    assert stored["model.layers.1.mlp.experts.3.down_proj.q_bits"].tolist() == [8]
    assert not any(".mlp.experts." in n and n.endswith(("_proj", ".weight")) for n in stored)
    model = load_model(str(path), pack=False)
    first, second = (model.model.layers[i].mlp for i in range(2))
    assert first.w13.dtype == first.w2.dtype == second.w13.dtype == torch.uint8 and second.w2.is_floating_point()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DEQUANTIZE_INT4_ENV, "1")
        assert load_model(str(path), pack=False).model.layers[0].mlp.w13.is_floating_point()
    cpu_kernels.INT4_WEIGHTS = False  # (int4_weights restores it)
    ref = load_model(str(path), pack=False)
    assert ref.model.layers[0].mlp.w13.is_floating_point()
    want = dict(load_model(str(dense_path), pack=False).state_dict())
    assert all(torch.equal(v, want[k]) for k, v in ref.state_dict().items())
    for i in range(8):
        for kept, dense in ((first, ref.model.layers[0].mlp), (second, ref.model.layers[1].mlp)):
            for w, s, d in ((kept.w13, kept.w13_scale, dense.w13), (kept.w2, kept.w2_scale, dense.w2)):
                assert torch.equal(kept._weight(w, s, i, torch.float32), d[i])
    ids = list(range(3, 40))
    cpu_kernels.INT4_WEIGHTS = True
    assert (prefill_logits(model, ids) - prefill_logits(ref, ids)).abs().max() < TOL
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    outs = []
    for keep, s in ((True, spec), (True, None), (False, None)):
        cpu_kernels.INT4_WEIGHTS = keep
        llm = LLM(model=str(path), max_model_len=128, speculative_config=s)
        outs.append([o.outputs[0].token_ids for o in llm.generate(["The quick brown fox", "def add(a, b):"], greedy,
                                                                   use_tqdm=False)])
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's 4-bit kernel (tinygemm) needs a GPU")
def test_a_q4_gguf_on_a_gpu_keeps_4_bits(tiny_llama_256, make_tiny_model, tmp_path, gguf_cache):
    """On CUDA in bf16 (no flag: what a GPU does by default), a Q4 GGUF's linears run in tinygemm and a mixture's
    4-bit experts stay packed; their logits stray from the float32 model's by at most twice what the same file
    dequantized at load in bf16 (``SPECRAY_DEQUANTIZE_INT4``) does (bf16's rounding, and the kernel's bf16 scales)."""
    dense_path = write_gguf(tiny_llama_256, tmp_path / "q4.gguf", "llama", q4_types)
    folder = make_tiny_model(tmp_path / "moe", "qwen3_moe", seed=9, head_dim=16, tie_word_embeddings=False,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
    moe_path = write_gguf(folder, tmp_path / "moe.gguf", "qwen3moe", q4_expert_types)
    ids = list(range(3, 40))
    for path in (dense_path, moe_path):
        model = load_model(str(path), dtype=torch.bfloat16, device="cuda")
        assert int4_linears(model)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(DEQUANTIZE_INT4_ENV, "1")
            ref = load_model(str(path), dtype=torch.bfloat16, device="cuda")
        assert not int4_linears(ref)
        if path == moe_path:
            assert model.model.layers[0].mlp.w13.dtype == torch.uint8
            assert ref.model.layers[0].mlp.w13.is_floating_point()
        exact = prefill_logits(load_model(str(path), pack=False), ids)  # float32, dequantized (on this host's CPU)
        got, rounded = ((prefill_logits(m, ids).float().cpu() - exact).abs().max() for m in (model, ref))
        assert got <= 2 * rounded, (got, rounded)


def test_a_q4_gguf_runs_its_linears_in_4_bits(tiny_llama_256, tmp_path, gguf_cache, int4_weights):
    """Where the device keeps 4-bit weights (here asked of the CPU, as a GPU in bf16 does), a Q4 GGUF's linears keep
    their integers (no dense weight), unless ``SPECRAY_DEQUANTIZE_INT4`` asks otherwise; the logits stay within the
    kernel's rounding of the dequantized model's, and the engine's greedy output with n-gram drafts is plain greedy
    decoding's and the dequantized model's. vLLM's ``quantization="gguf"`` names a .gguf model."""
    from specray import LLM, SamplingParams
    from specray.models import cpu_kernels

    path = write_gguf(tiny_llama_256, tmp_path / "q4.gguf", "llama", q4_types)
    model = load_model(str(path))
    kept = int4_linears(model)
    # layer 0's q/k/v, o, gate/up and down; layer 1's o and gate/up (its q/k/v dense with its v, its down dense)
    assert len(kept) == 6 and all(m.weight.numel() == 0 for m in kept)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DEQUANTIZE_INT4_ENV, "1")  # asked to dequantize them: none kept
        assert not int4_linears(load_model(str(path)))
    ids = list(range(3, 40))
    got = prefill_logits(model, ids)
    cpu_kernels.INT4_WEIGHTS = False  # (int4_weights restores it)
    ref = load_model(str(path), pack=False)
    assert not int4_linears(ref) and (got - prefill_logits(ref, ids)).abs().max() < TOL
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    outs = []
    for keep, s in ((True, spec), (True, None), (False, None)):
        cpu_kernels.INT4_WEIGHTS = keep
        llm = LLM(model=str(path), max_model_len=128, speculative_config=s, quantization="gguf")
        outs.append([o.outputs[0].token_ids for o in llm.generate(["The quick brown fox", "def add(a, b):"], greedy,
                                                                   use_tqdm=False)])
    assert outs[0] == outs[1] == outs[2]
    with pytest.raises(ValueError, match=r"quantization='gguf' but model=.* is not a .gguf file"):
        LLM(model=str(tiny_llama_256), quantization="gguf")


@pytest.mark.parametrize("cut, match", [
    ("tensor", r"is truncated or corrupt: its tensor 'token_embd.weight' ends at byte \d+, past the file's \d+ bytes"),
    ("header", r"is truncated or corrupt: gguf-py cannot read it"),
    ("empty", r"is truncated or corrupt: gguf-py cannot read it \(cannot mmap an empty file\)"),
    ("type", r"stores its tensor 'output.weight' as Q8_K, a type specray cannot read \(gguf-py cannot dequantize it\);"
             r" the types it reads: \['BF16', .*'Q8_0'.*\]. Convert or quantize"),
], ids=["tensor", "header", "empty", "type"])
def test_a_truncated_or_corrupt_gguf_is_refused_naming_the_file(tmp_path, gguf_cache, cut, match):
    """A GGUF cut short (a download stopped part way) or not a GGUF at all is a ValueError naming the file (and the
    first tensor past its end), not gguf-py's numpy reshape error; so is one holding a type gguf-py cannot dequantize
    (Q8_K), up front, not gguf-py's NotImplementedError part-way through; nothing is left in the cache."""
    import gguf
    import numpy as np

    path = tmp_path / f"cut-{cut}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.ones((64, 32), np.float32))
    if cut == "type":  # one Q8_K super-block per row (292 bytes: 256 values)
        w.add_tensor("output.weight", np.zeros((4, 292), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    _write_out(w)
    data = path.read_bytes()
    path.write_bytes({"tensor": data[:-100], "header": data[:30], "empty": b"", "type": data}[cut])
    end = " the model again" if cut == "type" else ".*download or convert"
    with pytest.raises(ValueError, match=re.escape(repr(str(path))) + " " + match + end):
        resolve_model(str(path))
    assert not any((gguf_cache / "gguf").glob(f"cut-{cut}-*"))


def test_a_shard_of_a_split_gguf_is_refused_with_the_way_out(tmp_path, gguf_cache):
    """Each shard of a GGUF split by llama.cpp's gguf-split (``-0000k-of-0000n.gguf``) is refused naming the merge,
    where the first was refused as lacking tensors and the others as of architecture None."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "split.gguf"), "llama", split_max_tensors=1)
    for name in ("token_embd.weight", "output.weight"):
        w.add_tensor(name, np.ones((64, 32), np.float32))
    _write_out(w)
    for k in (1, 2):
        path = tmp_path / f"split-0000{k}-of-00002.gguf"
        with pytest.raises(ValueError, match=rf"is shard {k} of 2 of a split GGUF; specray loads a single file: merge "
                                             r"the shards first \(llama.cpp's `llama-gguf-split --merge"):
            resolve_model(str(path))
    assert not any((gguf_cache / "gguf").glob("split-*"))


@pytest.mark.parametrize("case, match", [
    ("blocks", r"has llama.block_count=1 but holds tensors of blocks up to blk.1"),
    ("tokens", r"has no tokenizer.ggml.tokens, which transformers needs to build its 'gpt2' tokenizer"),
    ("merges", r"has no tokenizer.ggml.scores, which transformers needs to build its 'gpt2' tokenizer from the file "
               r"\(tokenizer.ggml.tokens, and merges or scores\)"),
    ("model", r"has no tokenizer.ggml.model \(nor, then, a vocabulary transformers can build a tokenizer from\)"),
    ("heads", r"model='.*heads.gguf' has a config transformers refuses: The hidden size \(64\) is not a multiple of "
              r"the number of attention heads \(5\); fix config.json \(a .gguf: its metadata\)"),
    ("shape", r"GGUF '.*shape.gguf': its tensor 'blk.0.attn_k.weight' of shape \[31, 64\] does not fit the llama "
              r"model its metadata describes \(cannot reshape .*\); the file is corrupt or its metadata wrong"),
    ("head_count", r"checkpoint tensor of shape \(64, 64\) does not fit parameter of shape \(64, 512\): .* \(at "
                   r"'model.layers.0.self_attn.o_proj.weight'; converted from GGUF '.*head_count.gguf', whose "
                   r"metadata gave that config\)"),
    ("rope", r"GGUF '.*rope.gguf' has llama.rope.freq_base=0.0, which must be positive; its metadata is corrupt"),
    ("eos", r"GGUF '.*eos.gguf' has tokenizer.ggml.eos_token_id=99999, past its vocabulary of \d+ tokens"),
    ("ctx", r"GGUF '.*ctx.gguf' has llama.context_length=0, which must be positive; its metadata is corrupt"),
], ids=["blocks", "tokens", "merges", "model", "heads", "shape", "head_count", "rope", "eos", "ctx"])
def test_a_gguf_whose_metadata_does_not_describe_it_is_refused(tiny_llama_dir, tmp_path, gguf_cache, case, match):
    """A GGUF whose ``block_count`` is below the blocks its tensors hold is refused naming both, where transformers'
    mapping left the extra blocks' tensors out and the model loaded without those layers; one without its
    vocabulary's tokens, or with neither merges nor scores, is refused naming the field, not transformers'
    KeyError; one whose head count does not divide its width names the model, not huggingface_hub's
    StrictDataclassError; a tensor of the wrong size, or a missing head count (transformers' default, 32, then
    sizes the model), is named with the GGUF; a RoPE base of 0 (every logit NaN) is refused naming the key, and so
    is a special token id past the vocabulary (transformers' IndexError, a traceback from the CLI), and a context
    length of 0 (the model loaded with max_position_embeddings=0)."""
    import gguf

    path = write_gguf(tiny_llama_dir, tmp_path / f"{case}.gguf", "llama")
    reader = gguf.GGUFReader(str(path), "r+")
    if case in ("blocks", "heads", "rope", "eos", "ctx"):  # it holds blk.0 and blk.1, is 64 wide; base 0: NaN logits
        key = {"blocks": "llama.block_count", "heads": "llama.attention.head_count", "rope": "llama.rope.freq_base",
               "eos": "tokenizer.ggml.eos_token_id", "ctx": "llama.context_length"}[case]
        field = reader.fields[key]
        field.parts[field.data[0]][0] = {"blocks": 1, "heads": 5, "rope": 0, "eos": 99999, "ctx": 0}[case]
    elif case == "shape":  # attn_k's rows 32 -> 31 (its data read shorter)
        field = next(t.field for t in reader.tensors if t.name == "blk.0.attn_k.weight")
        field.parts[3][1] = 31
    else:  # the key renamed in place (the same length): the field gone
        field = reader.fields["llama.attention.head_count" if case == "head_count" else f"tokenizer.ggml.{case}"]
        field.parts[1][-1] = ord("X")
    field.parts[1].flush()
    with pytest.raises(ValueError, match=match):
        load_model(str(path), pack=False)
    assert case == "head_count" or not any((gguf_cache / "gguf").glob(f"{case}-*"))


def test_a_gguf_without_its_context_length_loads_with_a_warning_naming_the_way_out(tiny_llama_dir, tmp_path,
                                                                                   gguf_cache, caplog):
    """llama.cpp's converter leaves ``context_length`` out where the HF config had none: the model loads with
    transformers' default length, and the log says so and how to set it."""
    import gguf

    path = write_gguf(tiny_llama_dir, tmp_path / "no_ctx.gguf", "llama")
    reader = gguf.GGUFReader(str(path), "r+")
    field = reader.fields["llama.context_length"]
    field.parts[1][-1] = ord("X")  # the key renamed in place: the field gone
    field.parts[1].flush()
    with caplog.at_level(logging.WARNING, logger="specray.models.loader"):
        model = load_model(str(path), pack=False)
    assert "has no llama.context_length; the model's length is transformers' default for llama (2048)" in caplog.text
    assert model.config.max_position_embeddings == 2048


# ---- GGUF of the newer families, written here from tiny HF models ---------------------------------------------

def _write_out(w) -> None:
    """Write a ``gguf.GGUFWriter``'s header, metadata and tensors to its file, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(folder: Path, out: Path, arch: str, types: Callable[[str], str | None] | None = None) -> Path:
    """A float32 GGUF of the tiny HF model in ``folder`` as llama.cpp's converter lays ``arch`` out (``qwen3``,
    ``qwen3moe``, ``gemma3``, ...; ``mixtral``: a ``llama`` with experts): its hyperparameters, its byte-level BPE
    tokenizer (``gpt2``: tokens, types, merges) and its tensors under GGUF names, a mixture of experts' stacked per
    kind (``ffn_gate_exps`` [E, I, H], ...), Gemma's norm weights stored as the ``1 + w`` they scale by, a llama's
    query and key rows in llama.cpp's order for its RoPE. ``types``: the llama.cpp type (``Q4_K``, ...) a tensor of
    that GGUF name is quantized to (None: float32)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    falcon_mamba = arch == "falcon_mamba"  # llama.cpp's: a mamba with its B, C and dt normed
    arch = {"mixtral": "llama", "falcon_mamba": "mamba", "mistral-nemo": "llama"}.get(arch, arch)
    w = gguf.GGUFWriter(str(out), arch)
    tensors = load_file(str(folder / "model.safetensors"))
    xielu = {name: [tensors.pop(f"model.layers.{i}.mlp.act_fn.{name}").item() for i in range(cfg["num_hidden_layers"])]
             for name in ("alpha_n", "alpha_p", "beta", "eps")} if arch == "apertus" else None
    _write_gguf_params(w, cfg, arch, xielu)
    if arch == "mamba":
        w.add_ssm_dt_b_c_rms(falcon_mamba)
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    if arch == "hunyuan-dense":  # its vocabulary's fix: the end of generation as EOS
        w.add_eos_token_id(cfg["eod_token_id"])
    if (cfg.get("rope_parameters") or {}).get("rope_type") == "llama3":  # llama.cpp's LlamaModel: in a tensor
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg).numpy())
    _write_gguf_tensors(w, tensors, arch, cfg, types)
    _write_out(w)
    return out


def _write_gguf_params(w, cfg: dict, arch: str, xielu: dict | None = None) -> None:
    import gguf

    if arch == "mamba":
        _write_mamba_params(w, cfg)
        return
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3 keeps one per kind of layer: the file's is the global one
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    if arch in ("lfm2", "lfm2moe"):  # llama.cpp's LFM2: K/V heads per layer (0: a short conv), the conv's width
        w.add_head_count_kv([cfg["num_key_value_heads"] if kind == "full_attention" else 0
                             for kind in cfg["layer_types"]])
        w.add_uint32(f"{arch}.shortconv.l_cache", cfg["conv_L_cache"])
    else:
        w.add_head_count_kv(cfg["num_key_value_heads"])
    if arch in ("starcoder2", "nemotron", "command-r", "cohere2"):  # LayerNorms: llama.cpp writes their epsilon so
        w.add_layer_norm_eps(cfg.get("norm_epsilon") or cfg.get("layer_norm_eps") or cfg["norm_eps"])
    elif arch == "olmo":  # llama.cpp's OlmoModel: its weightless LayerNorms' epsilon (fixed), the q/k/v clamp
        w.add_layer_norm_eps(1e-5)
        if cfg.get("clip_qkv") is not None:
            w.add_clamp_kqv(cfg["clip_qkv"])
    else:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"] if "rms_norm_eps" in cfg else cfg["norm_eps"])
    if arch == "gemma":  # llama.cpp's GemmaModel writes no base: it takes Gemma's, 10000
        assert rope.get("rope_type", "default") == "default" and rope["rope_theta"] == 10000.0
    else:
        w.add_rope_freq_base(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "llama":  # llama.cpp's LlamaModel: the rotated dims, the head's own size where it has one
        w.add_rope_dimension_count(head_dim)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 writes the latter
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"] if "moe_topk" not in cfg else cfg["moe_topk"])
        if "moe_intermediate_size" in cfg:  # Mixtral's experts are intermediate_size wide: llama.cpp writes no other
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "gemma3":
        _write_gemma3_params(w, cfg, rope)
    if arch == "gemma2":
        _write_gemma2_params(w, cfg)
    if arch == "phi3":
        _write_phi3_params(w, cfg, rope, head_dim)
    if arch == "glm4":  # llama.cpp's GLM-4: the rotated share of each head
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
    if arch == "exaone-moe":  # llama.cpp's ExaoneMoEModel (an Exaone4Model): the experts, shared ones, the router's
        # groups (TextModel's), no RoPE scaling, no MTP layer in a folder without one
        w.add_expert_shared_count(cfg["num_shared_experts"])
        w.add_expert_shared_feed_forward_length(cfg["moe_intermediate_size"] * cfg["num_shared_experts"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
        w.add_nextn_predict_layers(0)
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    if arch in ("olmo2", "exaone4", "exaone-moe") and cfg.get("sliding_window"):  # the window, its sliding layers
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    sliding_rope = (cfg.get("rope_parameters") or {}).get("sliding_attention")
    if sliding_rope and arch != "gemma3":  # as llama.cpp's TextModel writes a sliding layers' own base
        w.add_rope_freq_base_swa(sliding_rope["rope_theta"])
    if arch == "hunyuan-moe":  # llama.cpp's HunYuanMoEModel: the experts' and the shared MLP's widths (the release's
        # per-layer lists, all alike), one shared MLP
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["intermediate_size"])
        w.add_expert_shared_count(1)
    if arch.startswith("hunyuan") and rope.get("alpha"):  # llama.cpp's HunYuan models: the base stretched by NTK alpha
        w.add_rope_freq_base(rope["rope_theta"] * rope["alpha"] ** (head_dim / (head_dim - 2)))
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        w.add_rope_scaling_factor(1)
        w.add_rope_scaling_orig_ctx_len(256 * 1024)
        w.add_context_length(256 * 1024)
    if arch == "mistral3":  # llama.cpp's Ministral3Model: a LlamaModel, YaRN's log multiplier, the query scaling
        w.add_rope_dimension_count(head_dim)
        w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    if arch in ("command-r", "cohere2"):  # llama.cpp's CommandR2Model, Cohere2Model: the logit scale, no scaling
        w.add_logit_scale(cfg["logit_scale"])
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        if arch == "cohere2":
            w.add_sliding_window(cfg["sliding_window"])
            w.add_rope_dimension_count(head_dim)
    if arch == "dots1":  # llama.cpp's Dots1Model (a Qwen2MoeModel): the experts, shared ones and the sigmoid router
        _write_sigmoid_router(w, cfg, cfg["first_k_dense_replace"])  # (its groups: TextModel's, the release's)
    if arch == "ernie4_5-moe":  # llama.cpp's Ernie4_5MoeModel (its shared experts' width, as it derives it)
        w.add_expert_count(cfg["moe_num_experts"])
        w.add_expert_used_count(cfg["moe_k"])
        w.add_interleave_moe_layer_step(cfg["moe_layer_interval"])
        w.add_leading_dense_block_count(cfg["moe_layer_start_index"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["moe_num_shared_experts"])
        if cfg["moe_num_shared_experts"]:
            w.add_expert_shared_feed_forward_length(cfg["intermediate_size"] // cfg["num_key_value_heads"])
    if arch in ("qwen2vl", "qwen3vl", "qwen3vlmoe"):  # the Qwen VLs' multimodal RoPE sections, padded to 4
        w.add_rope_dimension_sections([head_dim // 2 - 2 * (head_dim // 6), head_dim // 6, head_dim // 6, 0])
        if arch != "qwen2vl":
            w.add_num_deepstack_layers(3)
    if arch == "apertus":  # llama.cpp's ApertusModel: the xIELU scalars, one per layer each (their tensors' values)
        w.add_rope_dimension_count(head_dim)
        for name, values in xielu.items():
            getattr(w, f"add_xielu_{name}")(values)
    if arch == "granitemoe" and cfg.get("shared_intermediate_size"):  # GraniteMoeShared's MLP
        w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
    if arch in ("granite", "granitemoe"):  # llama.cpp's Granite: its multipliers as scales
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if arch == "lfm2moe":  # llama.cpp's LFM2MoeModel: the dense first layers, sigmoid gating, the vocabulary's size;
        # a routed scale other than 1 as a converter that writes it would (LFM2MoeModel itself writes none)
        w.add_leading_dense_block_count(cfg["num_dense_layers"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_vocab_size(cfg["vocab_size"])
        if cfg["routed_scaling_factor"] != 1.0:
            w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if arch == "minimax-m2":  # llama.cpp's MiniMax-M2: the rotated share of each head, sigmoid gating
        w.add_rope_dimension_count(cfg["rotary_dim"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if rope.get("rope_type") in ("linear", "yarn") and arch not in ("gemma3", "nemotron", "phi3"):
        _write_rope_scaling(w, rope)  # as llama.cpp's TextModel writes it (those three: by their own code above, below)
    if arch == "nemotron":  # llama.cpp's Nemotron: the rotated share of each head, linear scaling or none
        rotated = int(rope["partial_rotary_factor"] * cfg["hidden_size"]) // cfg["num_attention_heads"]
        w.add_rope_dimension_count(rotated)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if "factor" in rope else gguf.RopeScalingType.NONE)
        if "factor" in rope:
            w.add_rope_scaling_factor(rope["factor"])


def _write_sigmoid_router(w, cfg: dict, first_k: int) -> None:
    """DeepSeek-V3's router as llama.cpp's converters write it (DeepseekV2Model's, Glm4MoeModel's, Dots1Model's): the
    routed experts, how many are used and each one's width, the shared experts, the ``first_k`` dense layers before
    them, and the sigmoid scores' groups, scale and renormalisation."""
    import gguf

    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_leading_dense_block_count(first_k)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob")))


def _write_rope_scaling(w, rope: dict) -> None:
    """A linear or YaRN RoPE scaling as llama.cpp's converter writes any model's (``rope.scaling.*``)."""
    import gguf

    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
        return
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if "beta_fast" in rope:
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    if "beta_slow" in rope:
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def llama3_rope_freqs(cfg: dict) -> torch.Tensor:
    """Llama 3's RoPE scaling as the per-frequency factors llama.cpp's converter writes in its place (the tensor
    ``rope_freqs``; ggml divides each frequency by its factor): 1 for the short wavelengths, ``factor`` for the
    long ones and a smooth blend between. As the converter does, the pretrained length is the config's top-level
    ``original_max_position_embeddings`` (8192 where it has none)."""
    rope = cfg["rope_parameters"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    length, low, high = cfg.get("original_max_position_embeddings", 8192), rope["low_freq_factor"], \
        rope["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq
    smooth = (length / wavelength - low) / (high - low)
    blended = 1 / ((1 - smooth) / rope["factor"] + smooth)
    return torch.where(wavelength < length / high, 1.0,
                       torch.where(wavelength > length / low, rope["factor"], blended)).float()


def _write_mamba_params(w, cfg: dict) -> None:
    """What llama.cpp's converter writes for Mamba: no attention, the SSM's sizes, a context length of its own."""
    w.add_context_length(2 ** 20)  # llama.cpp's: a Mamba has none
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_ssm_conv_kernel(cfg["conv_kernel"])
    w.add_ssm_inner_size(cfg["intermediate_size"])
    w.add_ssm_state_size(cfg["state_size"])
    w.add_ssm_time_step_rank(cfg["time_step_rank"])
    w.add_layer_norm_rms_eps(cfg["layer_norm_epsilon"])


def _write_phi3_params(w, cfg: dict, rope: dict, head_dim: int) -> None:
    """What llama.cpp's converter adds for Phi-3: the pretrained length, the rotated share of each head, the window
    (0: none) and LongRoPE's factors (as two tensors) and cos/sin scale."""
    import math

    import numpy as np

    orig = cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        scale = cfg["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(rope.get("attention_factor") or
                                        (1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(orig))))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def _write_gemma2_params(w, cfg: dict) -> None:
    """What llama.cpp's converter adds for Gemma 2: the window and both soft caps. The rest is fixed in llama.cpp
    (every other layer sliding, from the first; a query scale of 1/sqrt(head_dim) below 27B's 46 layers)."""
    assert cfg["layer_types"] == ["sliding_attention" if i % 2 == 0 else "full_attention"
                                  for i in range(cfg["num_hidden_layers"])], "a Gemma 2 GGUF has no other pattern"
    assert cfg["query_pre_attn_scalar"] == cfg["head_dim"], "a Gemma 2 GGUF scales queries by 1/sqrt(head_dim)"
    w.add_sliding_window(cfg["sliding_window"])
    w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    w.add_final_logit_softcapping(cfg["final_logit_softcapping"])


def _write_gemma3_params(w, cfg: dict, rope: dict) -> None:
    """What llama.cpp's converter adds for Gemma 3: the window, the global layers' RoPE scaling. The rest is fixed
    in llama.cpp (every 6th layer global, a local RoPE base of 10000, a query scale of 1/sqrt(head_dim)), so the
    model must have those to be written faithfully."""
    import gguf

    layers = cfg["num_hidden_layers"]
    assert cfg["layer_types"] == ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                  for i in range(layers)], "a Gemma 3 GGUF has no other layer pattern"
    assert cfg["query_pre_attn_scalar"] == cfg["head_dim"], "a Gemma 3 GGUF scales queries by 1/sqrt(head_dim)"
    assert cfg["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    w.add_sliding_window(cfg["sliding_window"])
    if rope.get("rope_type", "default") != "default":
        assert rope["rope_type"] == "linear"
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])


def _write_gguf_tokenizer(w, cfg: dict, tok: dict) -> None:
    if tok["model"].get("byte_fallback"):  # a sentencepiece-style vocabulary (conftest.build_spm_tokenizer)
        _write_gguf_spm_tokenizer(w, cfg, tok)
        return
    special = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = {i: t for t, i in tok["model"]["vocab"].items()} | special
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([tokens.get(i, f"<unused{i}>") for i in range(cfg["vocab_size"])])
    w.add_token_types([3 if i in special else 1 for i in range(cfg["vocab_size"])])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("pad_token_id") is not None:
        w.add_pad_token_id(cfg["pad_token_id"])


def _write_gguf_spm_tokenizer(w, cfg: dict, tok: dict) -> None:
    """A sentencepiece vocabulary as llama.cpp's converter writes one (``llama``: its pieces in id order, their scores,
    each piece's type -- control, unknown, byte, normal --, no merges), with BOS added to every prompt and, for the
    Gemmas, no prefix space."""
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda item: item[1])]
    assert len(tokens) == cfg["vocab_size"]
    is_byte = [t.startswith("<0x") and t.endswith(">") and len(t) == 6 for t in tokens]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0 if t in special or b else -float(i) for i, (t, b) in enumerate(zip(tokens, is_byte))])
    w.add_token_types([2 if t == "<unk>" else 3 if t in special else 6 if b else 1 for t, b in zip(tokens, is_byte)])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_unk_token_id(tokens.index("<unk>"))
    if cfg.get("pad_token_id") is not None:
        w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if w.arch.startswith("gemma"):
        w.add_add_space_prefix(False)


def _block_type(types: Callable[[str], str | None] | None, name: str | None, shape) -> str | None:
    """The llama.cpp type ``types`` asks for tensor ``name`` of ``shape``, where its rows are whole blocks of it (else
    None, float32: as llama.cpp's quantizer falls back for such a tensor)."""
    kind = types(name) if types and name and len(shape) >= 2 else None
    return kind if kind and shape[-1] % (256 if kind.endswith("_K") else 32) == 0 else None


def _write_gguf_tensors(w, tensors: dict, arch: str, cfg: dict, types: Callable[[str], str | None] | None = None
                        ) -> None:
    import gguf

    arch_id = {name: value for value, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, cfg["num_hidden_layers"])
    stacked: dict[str, list] = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if ".experts." in name:  # model.layers.i.{mlp,block_sparse_moe}.experts.e.{gate_proj,w1}.weight: by kind
            stacked.setdefault(".".join(parts[:5] + [parts[6]]), []).append((int(parts[5]), tensor))
            continue
        if name.endswith(("block_sparse_moe.input_linear.weight", "shared_mlp.input_linear.weight")):
            # llama.cpp's GraniteMoeModel: the fused gate/up of the experts, and of the shared MLP, split in two
            kind = "exps" if "block_sparse_moe" in name else "shexp"
            gate, up = tensor.split(tensor.shape[-2] // 2, dim=-2)
            for projection, half in (("gate", gate), ("up", up)):
                w.add_tensor(f"blk.{parts[2]}.ffn_{projection}_{kind}.weight", half.float().numpy())
            continue
        if arch in ("llama", "smollm3", "arcee", "granite", "granitemoe", "mistral3", "olmo") and name.endswith((
                "q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            tensor = tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, -1).transpose(1, 2).reshape(tensor.shape)
        if arch in ("gemma", "gemma2", "gemma3") and name.endswith("norm.weight"):  # Gemma's by 1 + w, llama.cpp's w
            tensor = tensor + 1
        if name.endswith("e_score_correction_bias"):  # llama.cpp: exp_probs_b.bias
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if name.endswith("feed_forward.expert_bias"):  # LFM2-MoE's router bias, as its converter renames it
            name += ".bias"
        if name.endswith("shared_expert_gate.weight"):  # llama.cpp keeps the shared expert's gate as [H]
            tensor = tensor.reshape(-1)
        if name.endswith(("conv.conv.weight", "mixer.conv1d.weight")):  # short / Mamba conv: [C, 1, K] as [C, K]
            tensor = tensor.squeeze(1)
        if name.endswith("mixer.A_log"):  # llama.cpp keeps Mamba's A itself: -exp(A_log)
            tensor = -torch.exp(tensor)
        if arch == "nemotron" and name.endswith(("layernorm.weight", "norm.weight")):  # LayerNorm1P's 1 + w
            tensor = tensor + 1
        if arch == "mamba" and name == "lm_head.weight":  # tied: llama.cpp writes no output tensor
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        kind = _block_type(types, gguf_name, tensor.shape)
        if kind:
            blocks = gguf_blocks(tensor.float().numpy(), kind)
            w.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        w.add_tensor(gguf_name, tensor.float().numpy())
    for name, experts in stacked.items():
        if arch == "lfm2moe":  # its converter merges the release's w1 / w3 / w2 under these names
            name = name.replace("model.layers.", "layers.")
        gguf_name = names.get_name(name) + ".weight"
        tensor = torch.stack([t for _, t in sorted(experts, key=lambda e: e[0])]).float().numpy()
        kind = _block_type(types, gguf_name, tensor.shape)
        if kind:  # each expert's rows quantized as a 2-D tensor's: [E, rows, bytes]
            blocks = gguf_blocks(tensor.reshape(-1, tensor.shape[-1]), kind)
            w.add_tensor(gguf_name, blocks.reshape(*tensor.shape[:2], -1), raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        w.add_tensor(gguf_name, tensor)


# llama.cpp architecture -> (HF model_type, the tiny model's overrides). transformers' GGUF mapping reads neither
# Qwen3's head_dim nor the experts' widths from the file, the loader does (llama.cpp writes them): the Qwen3s' heads
# are 16 wide, not its default (128). Gemma 3 has what llama.cpp fixes (see _write_gemma3_params; 6 layers: 5 local,
# 1 global), a window (8) shorter than the prompts and, as Gemma 3 4B-27B, linearly scaled RoPE on its global layer.
GGUF_TINY = {
    # Llama 3's RoPE scaling, which llama.cpp writes as per-frequency factors (rope_freqs), with a base and a
    # pretrained length so small that every kind of frequency occurs among a tiny head's 8 and the scaling bites
    "llama": ("llama", dict(tie_word_embeddings=False, original_max_position_embeddings=64,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64})),
    "mistral-nemo": ("llama", dict(head_dim=32, tie_word_embeddings=False)),
    # YaRN (rope.scaling.*), which transformers' GGUF mapping drops
    "qwen3": ("qwen3", dict(head_dim=16, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 64})),
    "qwen3moe": ("qwen3_moe", dict(head_dim=16, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1)),
    # a gated shared expert, q/k/v biases; the experts' widths from the file, not transformers' defaults
    "qwen2moe": ("qwen2_moe", dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=40, shared_expert_intermediate_size=56,
                                   decoder_sparse_step=1)),
    # LongRoPE over half of each head (factors and scale as llama.cpp stores them), a window shorter than the prompts;
    # its checkpoint's fused q/k/v and gate/up as llama.cpp keeps them (attn_qkv, ffn_up)
    "phi3": ("phi3", dict(max_position_embeddings=512, original_max_position_embeddings=512, sliding_window=6,
                          tie_word_embeddings=False,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                           "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [1.2, 2.5, 6.0, 9.0],
                                           "attention_factor": 1.2})),
    # llama.cpp's Mixtral: a llama with 4 experts (top 2) and its router, the experts intermediate_size wide; linearly
    # scaled RoPE (rope.scaling.*)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                                tie_word_embeddings=False,
                                rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    # soft caps other than transformers' defaults (50, 30), so that a GGUF's are read: small enough to bite
    "gemma2": ("gemma2", dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
                              attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
    # LayerNorms (an epsilon other than the default) and projections with biases, RoPE's base read from the file
    # (transformers' mapping does not); no window: llama.cpp's StarCoder2 has none
    "starcoder2": ("starcoder2", dict(norm_epsilon=1e-2, rope_parameters={"rope_type": "default", "rope_theta": 1e5},
                                      tie_word_embeddings=False)),
    # LayerNorm1P (stored as 1 + w; an epsilon other than the default), biased attention, linearly scaled RoPE over
    # a quarter of each head (read from the file)
    "nemotron": ("nemotron", dict(head_dim=16, attention_bias=True, norm_eps=1e-2, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.25})),
    # partial RoPE (8 of 16), q/k norms over all heads, sigmoid-scored experts with a correction bias
    "minimax-m2": ("minimax_m2", dict(head_dim=16, rotary_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                      intermediate_size=32, tie_word_embeddings=False)),
    "gemma3": ("gemma3", dict(num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


@pytest.mark.parametrize("arch", sorted(GGUF_TINY))
def test_gguf_of_newer_families_matches_transformers(make_tiny_model, tmp_path, gguf_cache, arch):
    """A GGUF of Llama (Llama 3's RoPE scaling as the per-frequency factors llama.cpp writes; and in Mistral Nemo's and
    Mistral Small 3's shape, heads of a size apart from hidden / heads, as ``rope.dimension_count``), Qwen3 (YaRN),
    Qwen3-MoE, MiniMax-M2 (as llama.cpp writes them: stacked experts), Mixtral (a llama with experts, its q/k rows in
    llama.cpp's order; linear RoPE scaling), Gemma 2 and 3 text (as llama.cpp writes them: 1 + w norms, their attention
    settings implied or, Gemma 2's soft caps, written), Phi-3 (fused projections, LongRoPE's factors as tensors),
    StarCoder2 and Nemotron (LayerNorms, biases) goes through transformers' GGUF mapping to our model: its logits equal
    transformers' on the original folder, and the engine's greedy output on the GGUF equals the one on the folder (the
    tokenizer came through the GGUF too)."""
    from specray import LLM, SamplingParams

    kind, overrides = GGUF_TINY[arch]
    folder = make_tiny_model(tmp_path / kind, kind, seed=9, **overrides)
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", arch)
    model = load_model(str(path), pack=False)
    assert_matches_hf(model, hf_model(folder))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The quick brown fox", "def add(a, b):"]
    outs = [[o.outputs[0].token_ids for o in LLM(model=str(m), max_model_len=128).generate(prompts, greedy,
                                                                                           use_tqdm=False)]
            for m in (folder, path)]
    assert outs[0] == outs[1]


# the families of specray's own GGUF readers, from the tests' tiny folders: (fixture, llama.cpp's architecture)
INTEGER_GGUF_FIXTURES = [("tiny_smollm3_dir", "smollm3"), ("tiny_granite_dir", "granite"),
                         ("tiny_granitemoeshared_dir", "granitemoe"), ("tiny_hunyuan_v1_moe_dir", "hunyuan-moe"),
                         ("tiny_ministral3_dir", "mistral3"), ("tiny_olmo_dir", "olmo"),
                         ("tiny_ernie4_5_moe_dir", "ernie4_5-moe")]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("case", [*sorted(GGUF_TINY), *(arch for _, arch in INTEGER_GGUF_FIXTURES)])
def test_integer_gguf_weights_load_as_their_dense_conversion(request, make_tiny_model, tmp_path, gguf_cache,
                                                              monkeypatch, case, qtype):
    """Each family's GGUF (through transformers' mapping, or one of specray's readers) with its layers' weights in
    Q8_0 or Q4_0 (those whose rows are whole blocks) converts with them kept as integers (Granite MoE's experts,
    stacked in its own fused layout, dense) and loads through the family's own loader (its renames, fused
    projections, experts): Q8_0's to the weights and the logits of the same file converted dense; Q4_0's kept in 4
    bits (asked of this CPU, as a GPU does), its linears and, where whole groups, its experts, to logits within the
    kernel's rounding of the dense file's."""
    if case in GGUF_TINY:
        kind, overrides = GGUF_TINY[case]
        folder = make_tiny_model(tmp_path / kind, kind, seed=9, **overrides)
    else:
        folder = request.getfixturevalue(dict((a, f) for f, a in INTEGER_GGUF_FIXTURES)[case])
    path = write_gguf(folder, tmp_path / f"{case}.gguf", case,
                      lambda name: qtype if name.startswith("blk.") and "norm" not in name else None)
    dense_path = Path(shutil.copy(path, tmp_path / f"{case}-dense.gguf"))
    assert any(n.endswith(".q_weight") for n in _safetensors(resolve_model(str(path)).path))
    index = loader.RowIndex
    monkeypatch.setattr(loader, "RowIndex", lambda tensors: index([]))
    ref = load_model(str(dense_path), pack=False)
    ids = list(range(3, 40))
    if qtype == "Q4_0":
        from specray.models import cpu_kernels

        monkeypatch.setattr(cpu_kernels, "INT4_WEIGHTS", True)
        model = load_model(str(path), pack=False)
        assert int4_linears(model)
        assert (prefill_logits(model, ids) - prefill_logits(ref, ids)).abs().max() < TOL
        return
    model = load_model(str(path), pack=False)
    want = dict(ref.state_dict())
    assert sorted(model.state_dict()) == sorted(want)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    assert torch.equal(prefill_logits(model, ids), prefill_logits(ref, ids))


def requantized(src: Path, out: Path, kind: str = "Q8_0") -> Path:
    """The GGUF at ``src`` written again with each layer's float32 weight of two or more dims (but the norms') whose
    rows are whole blocks in llama.cpp's ``kind``, everything else (metadata, other tensors) as it was."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        value = np.array(t.data)
        if (t.tensor_type == gguf.GGMLQuantizationType.F32 and t.name.startswith("blk.") and "norm" not in t.name
                and value.ndim >= 2 and value.shape[-1] % 32 == 0):
            blocks = gguf_blocks(value.reshape(-1, value.shape[-1]), kind)
            w.add_tensor(t.name, blocks.reshape(*value.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            w.add_tensor(t.name, value, raw_dtype=t.tensor_type if t.tensor_type != gguf.GGMLQuantizationType.F32
                         else None)
    _write_out(w)
    return out


def _reader_case(case: str, request, tmp_path: Path) -> Path:
    """A float32 GGUF of one family specray reads itself, written by its test's writer."""
    import specray_test_hybrid_models as hybrid

    if case == "jamba":
        return write_jamba_gguf(hybrid.save(tmp_path / "jamba", "jamba", 7), tmp_path / "f.gguf")
    if case in HYBRID_QWEN_GGUF:
        return write_hybrid_qwen_gguf(hybrid.save(tmp_path / case, case, 7, linear_num_value_heads=6),
                                      tmp_path / "f.gguf", HYBRID_QWEN_GGUF[case])
    if case in MAMBA2_GGUF:
        kind, gguf_arch, overrides = MAMBA2_GGUF[case]
        return write_mamba2_gguf(hybrid.save(tmp_path / case, kind, 7, **overrides), tmp_path / "f.gguf", gguf_arch)
    if case == "gemma4":
        from tests import test_gemma4 as gemma4

        return write_gemma4_gguf(gemma4.save_tiny(tmp_path / "gemma4", seed=40), tmp_path / "f.gguf")
    return write_deepseek_gguf(request.getfixturevalue(case), tmp_path / "f.gguf")


def loaded_beside_dense(path: Path, dense_path: Path, monkeypatch):
    """The models of the quantized GGUF ``path`` (converted already, its integers kept) and of its copy ``dense_path``
    converted with none kept (the conversion's row index finding no rows), asserted to hold the same weights;
    -> (model, ref)."""
    index = loader.RowIndex
    monkeypatch.setattr(loader, "RowIndex", lambda tensors: index([]))
    model, ref = load_model(str(path), pack=False), load_model(str(dense_path), pack=False)
    want = dict(ref.state_dict())
    assert sorted(model.state_dict()) == sorted(want)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    return model, ref


@pytest.mark.parametrize("case", ["jamba", "qwen3_5_moe", "nemotron_h_moe", "falcon_h1", "gemma4", "tiny_deepseek_dir",
                                  "tiny_glm4_moe_lite_dir"])
def test_integer_gguf_weights_of_specray_s_readers_load_as_their_dense_conversion(request, tmp_path, gguf_cache,
                                                                                   monkeypatch, case):
    """The families specray reads whole (Jamba, the hybrid Qwens, the Mamba-2 hybrids, Gemma 4, DeepSeek-V3 and
    GLM-4.7-Flash as ``deepseek2``), their layers' weights requantized to Q8_0: those the reader hands on as the file
    has them keep their integers, and the model loads to the weights and logits of the same file converted dense."""
    path = requantized(_reader_case(case, request, tmp_path), tmp_path / "q8.gguf")
    dense_path = Path(shutil.copy(path, tmp_path / "dense.gguf"))
    assert any(n.endswith(".q_weight") for n in _safetensors(resolve_model(str(path)).path))
    model, ref = loaded_beside_dense(path, dense_path, monkeypatch)
    import specray_test_hybrid_models as hybrid

    ids = list(range(3, 40))  # (a recurrent model's state over the hybrids' stepper)
    logits = [hybrid.Stepper(m).step([(0, ids, 0, 0)])[0] if getattr(m, "recurrent_state_specs", lambda: [])()
              else prefill_logits(m, ids) for m in (model, ref)]
    assert torch.equal(*logits)


@pytest.mark.parametrize("arch, overrides", [("lfm2", dict(block_auto_adjust_ff_dim=False)), ("mamba", {}),
                                             ("falcon_mamba", {})])
def test_a_recurrent_gguf_matches_transformers(tmp_path, gguf_cache, arch, overrides):
    """A GGUF of LFM2 (as llama.cpp writes it: K/V heads per layer, 0 for a short conv, whose weight is [C, K]) or
    of Mamba (its SSM's sizes, A stored as -exp(A_log), the conv's weight [C, K], no output tensor: tied) or of
    Falcon-Mamba (llama.cpp's: a Mamba marked ``ssm.dt_b_c_rms``, read here as Falcon-Mamba, not a plain Mamba) goes
    through transformers' GGUF mapping to our model: its logits (the recurrent state carried over chunks) equal
    transformers' on the original folder, and the engine's greedy output with n-gram drafts on the GGUF equals the
    folder's."""
    import specray_test_hybrid_models as hybrid  # tests/hybrid_models.py (registered by conftest)
    from specray import LLM

    folder = hybrid.save(tmp_path / arch, arch, 7, **overrides)
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", arch)
    model = load_model(str(path), pack=False)
    hybrid.check_prefill_chunks_and_decode(model, hf_model(folder))
    outs = [hybrid.generate(LLM(model=str(m), max_model_len=128, speculative_config=hybrid.NGRAM), hybrid.greedy())
            for m in (folder, path)]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("scale", [1.5, 1.0])
def test_an_lfm2_moe_gguf_matches_transformers(tmp_path, gguf_cache, scale):
    """A GGUF of LFM2-MoE (``lfm2moe``, read by specray: transformers has no mapping), as llama.cpp's converter
    writes it (K/V heads per layer, 0 for a short conv; the dense first layer; the router's bias as
    ``exp_probs_b.bias``; the release's w1 / w3 / w2 experts stacked), with the routed scale written or (1, as
    LFM2-8B-A1B's) not: the config read back is the folder's, every converted tensor the folder's, our logits over
    chunked prefill and decode are transformers' on the folder, and greedy engine output with n-gram drafts on the
    GGUF is the folder's."""
    import specray_test_hybrid_models as hybrid  # tests/hybrid_models.py (registered by conftest)
    from specray import LLM

    folder = hybrid.save(tmp_path / "lfm2_moe", "lfm2_moe", 7, routed_scaling_factor=scale)
    path = write_gguf(folder, tmp_path / "lfm2moe.gguf", "lfm2moe")
    want, got = (json.loads((f / "config.json").read_text()) for f in (folder, resolve_model(str(path)).path))
    for key in ("layer_types", "num_dense_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "intermediate_size", "use_expert_bias", "conv_bias", "conv_L_cache", "routed_scaling_factor",
                "norm_topk_prob", "norm_eps", "num_key_value_heads", "rope_parameters", "tie_word_embeddings"):
        assert got[key] == want[key], key
    assert_converted_as_folder(folder, path)
    hybrid.check_prefill_chunks_and_decode(load_model(str(path), pack=False), hf_model(folder))
    outs = [hybrid.generate(LLM(model=str(m), max_model_len=128, speculative_config=hybrid.NGRAM), hybrid.greedy())
            for m in (folder, path)]
    assert outs[0] == outs[1]


def test_an_lfm2_moe_gguf_routed_otherwise_is_refused(tmp_path, gguf_cache, monkeypatch):
    """An LFM2-MoE GGUF whose experts are routed by softmax (not LFM2-MoE's sigmoid) is refused, naming the key."""
    import gguf

    import specray_test_hybrid_models as hybrid

    folder = hybrid.save(tmp_path / "lfm2_moe", "lfm2_moe", 7)
    write = gguf.GGUFWriter.add_expert_gating_func
    monkeypatch.setattr(gguf.GGUFWriter, "add_expert_gating_func",
                        lambda self, value: write(self, gguf.ExpertGatingFuncType.SOFTMAX))
    path = write_gguf(folder, tmp_path / "softmax.gguf", "lfm2moe")
    with pytest.raises(ValueError, match=r"routes its experts by lfm2moe.expert_gating_func=1; LFM2-MoE's router is "
                                         r"sigmoid \(2\)"):
        resolve_model(str(path))


def test_an_lfm2_moe_gguf_s_4_bit_experts(tmp_path, gguf_cache, int4_weights):
    """LFM2-MoE's Q4 experts (gate Q4_0, up and down Q4_1) and short convs' projections stay in 4 bits through the
    conversion (its dense layer's Q8_0 gate a byte per value) and, where the device keeps 4-bit weights, in memory;
    greedy engine output with n-gram drafts is the dequantized model's."""
    import specray_test_hybrid_models as hybrid
    from specray import LLM
    from specray.models import cpu_kernels

    kinds = {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q4_1", "shortconv.in_proj": "Q4_1",
             "ffn_gate": "Q8_0"}  # (the dense first layer's w1)
    folder = hybrid.save(tmp_path / "lfm2_moe", "lfm2_moe", 7, routed_scaling_factor=1.0)
    path = write_gguf(folder, tmp_path / "q4.gguf", "lfm2moe",
                      lambda n: kinds.get(n.split(".", 2)[2].removesuffix(".weight")) if n.startswith("blk.") else None)
    stored = _safetensors(resolve_model(str(path)).path)
    assert "model.layers.2.feed_forward.experts.5.w2.q_weight" in stored
    assert "model.layers.0.conv.in_proj.q_weight" in stored and "model.layers.0.feed_forward.w1.q_weight" in stored
    model = load_model(str(path), pack=False)
    assert model.model.layers[2].mlp.w13.dtype == model.model.layers[2].mlp.w2.dtype == torch.uint8
    outs = []
    for keep in (True, False):
        cpu_kernels.INT4_WEIGHTS = keep
        outs.append(hybrid.generate(LLM(model=str(path), max_model_len=128, speculative_config=hybrid.NGRAM),
                                    hybrid.greedy()))
    assert outs[0] == outs[1]


# GPT-OSS as test_gpt_oss.py builds it, with the SwiGLU clamp llama.cpp fixes (transformers' default, 7)
GPT_OSS_GGUF_TINY = dict(num_hidden_layers=3, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                         intermediate_size=32, sliding_window=6, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                          "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 256})


def write_gpt_oss_gguf(folder: Path, out: Path, twin: Path, mxfp4: bool, fused: bool) -> tuple[Path, Path]:
    """A GGUF of the tiny GPT-OSS in ``folder`` as llama.cpp's converter writes one (architecture ``gpt-oss``: the
    fused gate/up split into ``ffn_gate_exps`` and ``ffn_up_exps`` [E, I, H] by its even and odd features, biases
    alike, ``down_proj`` transposed to [E, H, I], the sinks as ``attn_sinks.weight``, YaRN as ``rope.scaling.*``, the
    window, the experts' width), its experts in MXFP4 when ``mxfp4`` (as the releases are), gate and up in one
    ``ffn_gate_up_exps`` [E, 2I, H] (gate rows, then up rows) when ``fused`` (llama.cpp's ``--fuse-gate-up-exps``);
    and the HF folder that
    GGUF stands for: ``folder``, or its copy ``twin`` holding the values the MXFP4 codes stand for."""
    import gguf
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    _write_gguf_params(w, cfg, "gpt-oss")
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg["num_hidden_layers"])
    mx = gguf.GGMLQuantizationType.MXFP4

    def add(name: str, value: torch.Tensor) -> torch.Tensor:
        """Write ``value`` under ``name``'s GGUF name; returns what the file holds."""
        base, suffix = name.rsplit(".", 1) if name.endswith((".weight", ".bias")) else (name, "weight")
        layer = base.split(".")[2] if base.startswith("model.layers.") else None
        gguf_name = f"blk.{layer}.ffn_gate_up_exps.{suffix}" if base.endswith("gate_up_proj") else \
            f"{names.get_name(base)}.{suffix}"
        if mxfp4 and gguf_name.endswith("_exps.weight"):
            codes = quantize(value.float().numpy(), mx)
            w.add_tensor(gguf_name, codes, raw_dtype=mx)
            return torch.from_numpy(dequantize(codes, mx).copy()).reshape(value.shape)
        w.add_tensor(gguf_name, value.float().numpy())
        return value

    stands_for = {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):  # even features gate, odd up
            bias = name.endswith("_bias")
            rows = t if bias else t.transpose(1, 2)  # [E, 2I, H] (weight) or [E, 2I]
            parts = rows[:, 0::2].contiguous(), rows[:, 1::2].contiguous()
            named = f"{name.removesuffix('_bias').removesuffix('gate_up_proj')}{{}}_proj.{'bias' if bias else 'weight'}"
            if fused:
                gate, up = add(named.format("gate_up"), torch.cat(parts, 1)).chunk(2, 1)
            else:
                gate, up = (add(named.format(kind), part) for kind, part in zip(("gate", "up"), parts))
            t = torch.stack((gate, up), 2).reshape(rows.shape)
            t = t if bias else t.transpose(1, 2)
        elif name.endswith("experts.down_proj"):
            t = add(name + ".weight", t.transpose(1, 2).contiguous()).transpose(1, 2)
        elif name.endswith("experts.down_proj_bias"):
            t = add(name.replace("down_proj_bias", "down_proj.bias"), t)
        else:
            t = add(name, t)
        stands_for[name] = t.contiguous()
    _write_out(w)
    if not mxfp4:
        return out, folder
    shutil.copytree(folder, twin)
    save_file(stands_for, str(twin / "model.safetensors"))
    return out, twin


@pytest.mark.parametrize("mxfp4, fused", [(False, False), (True, False), (True, True)],
                         ids=["float32", "mxfp4", "mxfp4-fused"])
def test_a_gpt_oss_gguf_matches_transformers(make_tiny_model, tmp_path, gguf_cache, mxfp4, fused):
    """A GGUF of GPT-OSS as llama.cpp writes it (its split experts with biases, sinks, YaRN, the window; the experts
    in float32 or MXFP4 as released, gate and up split or fused) goes through transformers' GGUF mapping (attention,
    router, norms) and ours (the experts, the sinks, the config) to our model: its logits equal transformers' on the
    HF model the file stands for, and the engine's greedy output with n-gram drafts on the GGUF equals the one on
    that folder."""
    from specray import LLM, SamplingParams

    folder = make_tiny_model(tmp_path / "gpt_oss", "gpt_oss", seed=9, **GPT_OSS_GGUF_TINY)
    path, reference = write_gpt_oss_gguf(folder, tmp_path / "gpt-oss.gguf", tmp_path / "twin", mxfp4, fused)
    model = load_model(str(path), pack=False)
    assert_matches_hf(model, hf_model(reference))
    if mxfp4:  # the codes stand for other values than the original's: the reference is the twin, not the folder
        with pytest.raises(AssertionError):
            assert_matches_hf(model, hf_model(folder))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    prompts = ["The quick brown fox", "def add(a, b): return a + b; def add(a, b):"]
    outs = [[o.outputs[0].token_ids for o in LLM(model=str(m), max_model_len=128, speculative_config=ngram)
             .generate(prompts, greedy, use_tqdm=False)] for m in (reference, path)]
    assert outs[0] == outs[1]


# the hybrid linear-attention Qwens of tests/hybrid_models.py -> llama.cpp's architecture for each
HYBRID_QWEN_GGUF = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}


def _grouped_to_tiled(t: torch.Tensor, dim: int, key_heads: int, per_key: int, size: int = 1) -> torch.Tensor:
    """llama.cpp's reorder of value heads (``size`` wide each) along ``dim``: grouped by key head
    (``k0v0 k0v1 k1v0 k1v1``) to tiled (``k0v0 k1v0 k0v1 k1v1``)."""
    shape = t.shape
    return t.reshape(*shape[:dim], key_heads, per_key, size, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def _hybrid_qwen_tensor(name: str, t: torch.Tensor, cfg: dict, arch: str) -> list[tuple[str, torch.Tensor]]:
    """What llama.cpp's converter makes of one HF tensor of a hybrid Qwen (HF names, as its name map then reads
    them): Qwen3.5's value heads tiled, ``A_log`` as ``-exp(A_log)``, ``dt_bias`` as ``dt_proj.bias``, the conv
    squeezed to [C, K], the stack's norms as ``1 + w``, Qwen3-Next's ``in_proj_qkvz`` split into all q, k, v (rows)
    and all z."""
    nk, hk, hv = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    per_key, qk_rows = cfg["linear_num_value_heads"] // nk, 2 * nk * hk
    if arch != "qwen3next" and ".linear_attn." in name:  # llama.cpp's _LinearAttentionVReorderBase

        def tile(x: torch.Tensor, dim: int = 0, size: int = 1) -> torch.Tensor:
            return _grouped_to_tiled(x, dim, nk, per_key, size)

        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            t = t.squeeze()
            t = torch.cat([t[:qk_rows], tile(t[qk_rows:], size=hv)])
        elif name.endswith("in_proj_z.weight"):
            t = tile(t, size=hv)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            t = tile(t)
        elif name.endswith("out_proj.weight"):
            t = tile(t, 1, hv)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix("dt_bias") + "dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    if name.endswith("in_proj_qkvz.weight"):  # per key head [q, k, v, z] -> [all q, all k, all v], [all z]
        v_width = per_key * hv
        q, k, v, z = t.reshape(nk, -1, t.shape[-1]).split([hk, hk, v_width, v_width], dim=1)
        base = name.removesuffix("in_proj_qkvz.weight")
        qkv = torch.cat([q.reshape(-1, t.shape[-1]), k.reshape(-1, t.shape[-1]), v.reshape(-1, t.shape[-1])])
        return [(base + "in_proj_qkv.weight", qkv), (base + "in_proj_z.weight", z.reshape(-1, t.shape[-1]))]
    return [(name, t)]


def write_hybrid_qwen_gguf(folder: Path, out: Path, arch: str, fused: bool = False, mtp: bool = False) -> Path:
    """A float32 GGUF of the tiny hybrid Qwen in ``folder`` as llama.cpp's converter writes ``arch`` (``qwen35``,
    ``qwen35moe``, ``qwen3next``): its hyperparameters (the linear layers' as ``ssm.*``, the kinds of layers as
    ``full_attention_interval``, partial RoPE as ``rope.dimension_count``, multimodal RoPE's sections padded to 4,
    the experts'), the byte-level BPE tokenizer and the tensors as :func:`_hybrid_qwen_tensor` transforms them, the
    experts stacked per kind (gate and up in one ``ffn_gate_up_exps`` [E, 2I, H] when ``fused``: llama.cpp's
    ``--fuse-gate-up-exps``). ``mtp``: a multi-token-prediction block after the layers, as newer llama.cpp writes
    it (counted in ``block_count``, ``nextn_predict_layers`` 1)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    layers, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    interval = cfg["layer_types"].index("full_attention") + 1
    assert cfg["layer_types"] == ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                  for i in range(layers)], "a GGUF has no other pattern than every interval-th"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(layers + mtp)
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg["rope_parameters"]
    if "mrope_section" in rope:  # padded to 4
        w.add_rope_dimension_sections(list(rope["mrope_section"]) + [0] * (4 - len(rope["mrope_section"])))
    if rope.get("rope_type") == "yarn":
        _write_rope_scaling(w, rope)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("num_experts"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if cfg.get("num_experts"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(interval)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), layers)
    stacked: dict[str, list] = {}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        parts = name.split(".")
        if ".experts." in name:  # model.layers.i.mlp.experts.e.gate_proj.weight: stacked by kind
            stacked.setdefault(".".join(parts[:5] + parts[6:]), []).append((int(parts[5]), tensor))
            continue
        for hf_name, value in _hybrid_qwen_tensor(name, tensor, cfg, arch):
            w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), value.float().numpy())
    experts = {name: torch.stack([t for _, t in sorted(group, key=lambda e: e[0])]) for name, group in stacked.items()}
    for name, value in experts.items():
        if fused and name.endswith("gate_proj.weight"):  # gate rows, then up rows
            value = torch.cat([value, experts[name.replace("gate_proj", "up_proj")]], 1)
            w.add_tensor(names.get_name(name, try_suffixes=(".weight",)).replace("gate_exps", "gate_up_exps"),
                         value.float().numpy())
        elif not (fused and name.endswith("up_proj.weight")):
            w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), value.float().numpy())
    if mtp:  # a few of the MTP block's tensors: enough to be left out
        hidden = cfg["hidden_size"]
        w.add_tensor(f"blk.{layers}.attn_norm.weight", torch.ones(hidden).numpy())
        w.add_tensor(f"blk.{layers}.nextn.eh_proj.weight", torch.zeros(hidden, 2 * hidden).numpy())
    _write_out(w)
    return out


@pytest.mark.parametrize("arch, variant", [("qwen3_5", ""), ("qwen3_5", "mrope-mtp"), ("qwen3_5_moe", ""),
                                           ("qwen3_5_moe", "fused"), ("qwen3_next", ""), ("qwen3_next", "yarn")])
def test_a_hybrid_qwen_gguf_matches_transformers(tmp_path, gguf_cache, arch, variant):
    """A GGUF of Qwen3.5, Qwen3.5-MoE or Qwen3-Next as llama.cpp writes it (the linear layers' sizes as ``ssm.*``,
    the layers' kinds as an interval; value heads tiled (Qwen3.5's), ``A`` as ``-exp(A_log)``, the conv squeezed,
    ``1 + w`` norms, Qwen3-Next's ``in_proj_qkvz`` split, stacked experts; with multimodal RoPE's sections and an MTP
    block, gate and up fused, or YaRN) is read by specray's own mapping into our model: its logits (the recurrent state
    carried over chunks, decode steps) equal transformers' on the original folder, and the engine's greedy output with
    n-gram drafts on the GGUF equals the folder's."""
    import specray_test_hybrid_models as hybrid  # tests/hybrid_models.py (registered by conftest)
    from specray import LLM

    # 3 value heads per key head: llama.cpp's reorder then differs from its inverse (with 2 they are the same)
    overrides = dict(linear_num_value_heads=6)
    if "mrope" in variant:  # a release's: sections over the 2 rotated pairs, which text gives the same position
        overrides["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                        "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    if variant == "yarn":  # betas other than the defaults (32, 1), so that the file's are read
        overrides["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                        "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0,
                                        "beta_slow": 2.0}
    folder = hybrid.save(tmp_path / arch, arch, 7, **overrides)
    path = write_hybrid_qwen_gguf(folder, tmp_path / f"{arch}.gguf", HYBRID_QWEN_GGUF[arch],
                                  fused="fused" in variant, mtp="mtp" in variant)
    ours, theirs = load_hf_config(str(path)), load_hf_config(str(folder))
    fields = ("model_type", "architectures", "layer_types", "rope_parameters", "num_hidden_layers", "head_dim",
              "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim", "tie_word_embeddings", "vocab_size", "eos_token_id", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
    assert {f: getattr(ours, f, None) for f in fields} == {f: getattr(theirs, f, None) for f in fields}
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)  # (a float32 in the GGUF)
    model = load_model(str(path), pack=False)
    hybrid.check_prefill_chunks_and_decode(model, hf_model(folder))
    outs = [hybrid.generate(LLM(model=str(m), max_model_len=128, speculative_config=hybrid.NGRAM), hybrid.greedy())
            for m in (folder, path)]
    assert outs[0] == outs[1]


def test_a_hybrid_qwen_gguf_lacking_what_llama_cpp_writes_is_refused(tmp_path, gguf_cache):
    """A ``qwen35`` GGUF without the hyperparameters llama.cpp writes for one is refused naming the key and the way
    out, and leaves no conversion behind."""
    from specray import LLM

    path = write_bare_gguf(tmp_path / "tiny-qwen35.gguf", "qwen35")
    with pytest.raises(ValueError, match=r"lacks qwen35.attention.head_count, which llama.cpp writes for every qwen35 "
                                         r"model; convert the model again.*or pass its HF checkpoint"):
        LLM(model=str(path))
    assert not any((gguf_cache / "gguf").glob("tiny-qwen35-*"))


# a case -> (the Mamba-2 hybrid of tests/hybrid_models.py, llama.cpp's architecture, the tiny model's overrides).
# llama.cpp's converter writes a Granite 4.0 hybrid's attention without RoPE whatever its config says (only Bamba's
# rotates), so the dense Granite is NoPE here, as the releases are; Nemotron-H with experts has no dense MLP layer
# (the converter marks only the experts' layers), its experts over a latent width (Nemotron 3 Super's) or not (Nano's).
_NEMOTRON_3 = ["linear_attention", "moe", "full_attention", "moe", "linear_attention"]
# Falcon-H1 as the converter can write it: no in_proj bias (it scales in_proj's rows as 2-D), no attention biases (it
# scales them with the attention's input multiplier, which HF applies before them), the LM head's multiplier the
# embedding's (tied, it has no LM head of its own to scale: llama.cpp's output is the scaled embedding)
_FALCON_H1 = dict(mamba_proj_bias=False, attention_bias=False, lm_head_multiplier=2.0)
MAMBA2_GGUF = {"granite": ("granite", "granitehybrid", {}), "bamba": ("bamba", "granitehybrid", {}),
               "granite_dense": ("granite_dense", "granitehybrid", dict(position_embedding_type="nope")),
               "nemotron_h": ("nemotron_h", "nemotron_h", {}),
               "nemotron_h_moe": ("nemotron_h_moe", "nemotron_h_moe", dict(layers_block_type=_NEMOTRON_3)),
               "nemotron_h_moe_nano": ("nemotron_h_moe", "nemotron_h_moe",
                                       dict(layers_block_type=_NEMOTRON_3, moe_latent_size=None)),
               "falcon_h1": ("falcon_h1", "falcon-h1", _FALCON_H1), "falcon_h1_gate": ("falcon_h1_gate", "falcon-h1",
                                                                               _FALCON_H1)}


def _llama_permute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order for its RoPE: each head's two halves interleaved."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _mamba2_tensors(name: str, t: torch.Tensor, cfg: dict, kinds: list[str]) -> list[tuple[str, torch.Tensor]]:
    """What llama.cpp's converter makes of one HF tensor of a Mamba-2 hybrid (HF names, as its name map then reads
    them): ``dt_bias`` as ``dt_proj.bias``, ``A_log`` as ``-exp(A_log)`` [H, 1], ``D`` [H, 1], the conv squeezed to
    [C, K], the gated norm [groups, inner / groups], an attention layer's q/k rows permuted for RoPE, Granite's fused
    experts and shared MLP split into gate and up (the shared MLP's into the dense ``ffn_*`` where there are no
    experts)."""
    groups = cfg.get("mamba_n_groups") or cfg["n_groups"]
    parts = name.split(".")
    layer = int(parts[2]) if len(parts) > 3 and parts[1] == "layers" else None
    if cfg["model_type"] == "falcon_h1":  # every muP multiplier folded into the weights
        t = _falcon_h1_fold(name, t, cfg)
    if name.endswith(".dt_bias"):
        return [(name.removesuffix("dt_bias") + "dt_proj.bias", t)]
    if name.endswith("e_score_correction_bias"):
        return [(name.replace("e_score_correction_bias", "e_score_correction.bias"), t)]
    if name.endswith(".A_log"):
        return [(name, -torch.exp(t).reshape(-1, 1))]
    if name.endswith(".D"):
        return [(name, t.reshape(-1, 1))]
    if name.endswith("conv1d.weight"):
        return [(name, t.squeeze())]
    if name.endswith(("mamba.norm.weight", "mixer.norm.weight")) and kinds[layer] == "linear_attention":
        return [(name, t.reshape(groups, -1))]
    if layer is not None and kinds[layer] == "full_attention" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
        return [(name, _llama_permute(t, heads))]
    if name.endswith("block_sparse_moe.input_linear.weight"):  # [E, 2I, H]: gate rows, then up rows
        gate, up = t.split(cfg["intermediate_size"], dim=-2)
        return [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
    experts = bool(cfg.get("num_local_experts"))
    if name.endswith("shared_mlp.input_linear.weight"):
        gate, up = t.split(cfg["shared_intermediate_size"], dim=-2)
        suffix = "_shexp" if experts else ""
        return [(f"blk.{layer}.ffn_gate{suffix}.weight", gate), (f"blk.{layer}.ffn_up{suffix}.weight", up)]
    if name.endswith("shared_mlp.output_linear.weight") and not experts:
        return [(f"blk.{layer}.ffn_down.weight", t)]
    return [(name, t)]


def _falcon_h1_fold(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """llama.cpp's converter folds Falcon-H1's multipliers into its weights (and their biases), by name."""
    inner, bc = cfg["mamba_d_ssm"], cfg["mamba_n_groups"] * cfg["mamba_d_state"]
    for part, scale in (("down_proj", cfg["mlp_multipliers"][1]), ("gate_proj", cfg["mlp_multipliers"][0]),
                        ("k_proj", cfg["key_multiplier"] * cfg["attention_in_multiplier"]),
                        ("q_proj", cfg["attention_in_multiplier"]), ("v_proj", cfg["attention_in_multiplier"]),
                        ("o_proj", cfg["attention_out_multiplier"]), ("out_proj", cfg["ssm_out_multiplier"]),
                        ("in_proj", cfg["ssm_in_multiplier"]), ("lm_head", cfg["lm_head_multiplier"]),
                        ("embed_tokens", cfg["embedding_multiplier"])):
        if part in name:
            t = t * scale
            if part == "in_proj":  # z, x, B, C, dt rows
                sizes = [inner, inner, bc, bc, t.shape[0] - 2 * inner - 2 * bc]
                t = torch.cat([rows * m for rows, m in zip(t.split(sizes), cfg["ssm_multipliers"])])
            return t
    return t


def write_mamba2_gguf(folder: Path, out: Path, arch: str) -> Path:
    """A float32 GGUF of the tiny Mamba-2 hybrid in ``folder`` as llama.cpp's converter writes ``arch``
    (``granitehybrid``: a Granite 4.0 hybrid or Bamba; ``nemotron_h``, ``nemotron_h_moe``; ``falcon-h1``:
    :func:`_write_falcon_h1_gguf`): its hyperparameters as the converter's
    Granite / Mamba-2 / Nemotron-H classes write them (the kinds of layers as per-layer K/V heads and, Nemotron-H's,
    feed-forward widths; the SSM's sizes as ``ssm.*``; Granite's multipliers as scales; whether the attention rotates
    as ``rope.scaling.finetuned``: Bamba's only, over ``attn_rotary_emb`` dims; a context length of 2^20 where it
    does not), the byte-level BPE tokenizer (the converter pads the vocabulary to a multiple of 8: already one here)
    and the tensors as :func:`_mamba2_tensors` transforms them. The converter reads the release's config.json
    (``hybrid_override_pattern``, ``layer_types`` of "mamba" / "attention", ``attn_rotary_emb``); transformers 5 saves
    them otherwise, so they are taken from the config here."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = json.loads((folder / "config.json").read_text())
    if arch == "falcon-h1":
        return _write_falcon_h1_gguf(folder, out, cfg)
    config = AutoConfig.from_pretrained(folder)
    kinds = list(getattr(config, "layers_block_type", None) or config.layer_types)
    layers, bamba, nemotron = len(kinds), cfg["model_type"] == "bamba", arch.startswith("nemotron_h")
    assert cfg["vocab_size"] % 8 == 0, "the converter pads the vocabulary to a multiple of 8"
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"] if bamba else 2 ** 20)
    w.add_embedding_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv([cfg["num_key_value_heads"] if k == "full_attention" else 0 for k in kinds])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(hidden // heads // 2 if bamba else hidden // heads)  # Bamba's attn_rotary_emb
    w.add_rope_scaling_finetuned(bamba)  # llama.cpp's "use RoPE"
    if nemotron:
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        if arch == "nemotron_h_moe":  # the experts' layers marked by their width
            assert "mlp" not in kinds, "the converter marks no dense MLP layer of a Nemotron-H with experts"
            w.add_feed_forward_length([cfg["moe_intermediate_size"] if k == "moe" else 0 for k in kinds])
            w.add_expert_used_count(cfg["num_experts_per_tok"])
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            w.add_expert_shared_feed_forward_length(cfg["moe_shared_expert_intermediate_size"])
            w.add_expert_count(cfg["n_routed_experts"])
            w.add_expert_shared_count(cfg["n_shared_experts"])
            w.add_expert_weights_norm(cfg["norm_topk_prob"])
            w.add_expert_weights_scale(cfg["routed_scaling_factor"])
            w.add_expert_group_count(cfg["n_group"])
            w.add_expert_group_used_count(cfg["topk_group"])
            if cfg.get("moe_latent_size") is not None:
                w.add_moe_latent_size(cfg["moe_latent_size"])
        else:
            w.add_feed_forward_length([cfg["intermediate_size"] if k == "mlp" else 0 for k in kinds])
        inner, ssm_heads = cfg["mamba_num_heads"] * cfg["mamba_head_dim"], cfg["mamba_num_heads"]
        w.add_ssm_conv_kernel(cfg["conv_kernel"])
        w.add_ssm_state_size(cfg["ssm_state_size"])
        w.add_ssm_group_count(cfg["n_groups"])
    else:
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        if "num_local_experts" in cfg:
            w.add_expert_count(cfg["num_local_experts"])
        if "num_experts_per_tok" in cfg:
            w.add_expert_used_count(cfg["num_experts_per_tok"])
        for key, add in (("attention_multiplier", w.add_attention_scale),
                         ("embedding_multiplier", w.add_embedding_scale),
                         ("residual_multiplier", w.add_residual_scale), ("logits_scaling", w.add_logit_scale)):
            if cfg.get(key):
                add(cfg[key])
        if cfg.get("shared_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
        inner, ssm_heads = cfg["mamba_expand"] * hidden, cfg["mamba_n_heads"]
        w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
        w.add_ssm_state_size(cfg["mamba_d_state"])
        w.add_ssm_group_count(cfg["mamba_n_groups"])
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(ssm_heads)
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map({"granitehybrid": gguf.MODEL_ARCH.GRANITE_HYBRID,
                                      "nemotron_h": gguf.MODEL_ARCH.NEMOTRON_H,
                                      "nemotron_h_moe": gguf.MODEL_ARCH.NEMOTRON_H_MOE}[arch], layers)
    stacked: dict[str, list] = {}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        parts = name.split(".")
        if ".mixer.experts." in name:  # backbone.layers.i.mixer.experts.e.up_proj.weight: stacked by kind
            stacked.setdefault(f"blk.{parts[2]}.ffn_{parts[6].removesuffix('_proj')}_exps.weight", []).append(
                (int(parts[5]), tensor))
            continue
        for hf_name, value in _mamba2_tensors(name, tensor, cfg, kinds):
            gguf_name = hf_name if hf_name.startswith("blk.") else \
                names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            w.add_tensor(gguf_name, value.float().numpy())
    for name, experts in stacked.items():
        w.add_tensor(name, torch.stack([t for _, t in sorted(experts, key=lambda e: e[0])]).float().numpy())
    _write_out(w)
    return out


def _write_falcon_h1_gguf(folder: Path, out: Path, cfg: dict) -> Path:
    """A float32 GGUF of the tiny Falcon-H1 in ``folder`` as llama.cpp's converter writes it (``falcon-h1``: Mamba-2's
    sizes and Falcon-H1's; the tensors as :func:`_mamba2_tensors` transforms them, the multipliers folded in; no q/k
    permutation)."""
    import gguf
    from safetensors.torch import load_file

    layers = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(out), "falcon-h1")
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_inner_size(cfg["mamba_d_ssm"])
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_time_step_rank(cfg["mamba_d_ssm"] // cfg["mamba_d_head"])
    w.add_ssm_group_count(cfg["mamba_n_groups"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]  # (the release's config has it)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON_H1, layers)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        for hf_name, value in _mamba2_tensors(name, tensor, cfg, ["linear_attention"] * layers):
            w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), value.float().numpy())
    _write_out(w)
    return out


@pytest.mark.parametrize("arch", sorted(MAMBA2_GGUF))
def test_a_mamba2_hybrid_gguf_matches_transformers(tmp_path, gguf_cache, arch):
    """A GGUF of a Granite 4.0 hybrid (experts beside a shared MLP, or the dense one; Granite's multipliers), of Bamba
    (read from ``granitehybrid`` as Bamba: its attention rotates), of Nemotron-H (with experts: grouped sigmoid
    routing, a score bias, a shared expert, over a latent width or not) or of Falcon-H1 (its multipliers folded into
    the weights; with the gated norm or without) as llama.cpp writes it (the layers' kinds as per-layer arrays, ``A``
    as ``-exp(A_log)``, ``D`` and the conv reshaped, the gated norm grouped, the q/k rows permuted for RoPE but
    Falcon-H1's, experts stacked, Granite's fused experts and shared MLP split) is read by specray's own mapping: its
    config is the model's, its tensors are the HF checkpoint's (the q/k permutation undone also where no RoPE would
    show it; Falcon-H1's with the multipliers folded in), its logits (the recurrent state carried over chunks, decode
    steps) equal transformers' on the original folder, and the engine's greedy output with n-gram drafts on the GGUF
    equals the folder's."""
    import specray_test_hybrid_models as hybrid  # tests/hybrid_models.py (registered by conftest)
    from safetensors.torch import load_file

    from specray import LLM

    kind, gguf_arch, overrides = MAMBA2_GGUF[arch]
    folder = hybrid.save(tmp_path / arch, kind, 7, **overrides)
    path = write_mamba2_gguf(folder, tmp_path / f"{arch}.gguf", gguf_arch)
    ours, theirs = load_hf_config(str(path)), load_hf_config(str(folder))
    fields = ("model_type", "architectures", "num_hidden_layers", "hidden_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "eos_token_id", "layer_types",
              "layers_block_type", "attn_layer_indices", "mamba_n_heads", "mamba_d_head", "mamba_n_groups",
              "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_conv_bias", "mamba_proj_bias",
              "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel", "use_conv_bias",
              "num_local_experts", "num_experts_per_tok", "shared_intermediate_size", "rope_parameters",
              "tie_word_embeddings", "mamba_d_ssm", "mamba_rms_norm", "mamba_norm_before_gate", "attention_bias",
              "mlp_bias")
    if gguf_arch == "nemotron_h_moe":
        fields += ("n_routed_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
                   "n_shared_experts", "norm_topk_prob", "n_group", "topk_group", "moe_latent_size")
    floats = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling", "rms_norm_eps",
              "layer_norm_epsilon", "routed_scaling_factor")  # (float32 in the GGUF)
    got, want = ({f: getattr(c, f, None) for f in fields} for c in (ours, theirs))
    for values, c in ((got, ours), (want, theirs)):  # (None: hidden_size / num_attention_heads)
        values["head_dim"] = values["head_dim"] or c.hidden_size // c.num_attention_heads
    if not getattr(theirs, "num_local_experts", 0):  # unused where there are no experts
        got.pop("num_experts_per_tok"), want.pop("num_experts_per_tok")
    if gguf_arch == "nemotron_h_moe":  # the dense MLPs' width: unused, there are none
        got.pop("intermediate_size"), want.pop("intermediate_size")
    # tied unless the checkpoint has an lm_head (transformers saves Nemotron-H's although it is tied): the converter
    # writes it then (as output.weight), with the same values as the embedding
    want["tie_word_embeddings"] = "lm_head.weight" not in load_file(str(folder / "model.safetensors"))
    assert got == want
    if gguf_arch == "falcon-h1":  # the multipliers are folded into the weights: 1 in the config read back
        floats = ("rms_norm_eps",)
        assert [ours.embedding_multiplier, ours.lm_head_multiplier, ours.key_multiplier, ours.attention_in_multiplier,
                ours.attention_out_multiplier, ours.ssm_in_multiplier, ours.ssm_out_multiplier, *ours.mlp_multipliers,
                *ours.ssm_multipliers] == [1.0] * 14
    assert [getattr(ours, f, None) for f in floats] == pytest.approx([getattr(theirs, f, None) for f in floats])
    if arch.startswith("granite"):  # no RoPE (theirs: None or "nope", the same to transformers)
        assert ours.position_embedding_type == "nope" and theirs.position_embedding_type in (None, "nope")
    converted, original = (load_file(str(f / "model.safetensors")) for f in (resolve_model(str(path)).path, folder))
    if gguf_arch == "falcon-h1":  # the multipliers are in the weights now (and 1 in the config)
        cfg = json.loads((folder / "config.json").read_text())
        original = {n: _falcon_h1_fold(n, t, cfg) for n, t in original.items()}
    assert sorted(converted) == sorted(original)
    differ = [n for n in original if converted[n].shape != original[n].shape
              or not torch.allclose(converted[n], original[n], rtol=1e-6, atol=1e-6)]  # (A_log: log(exp(.)))
    assert not differ
    model = load_model(str(path), pack=False)
    hybrid.check_prefill_chunks_and_decode(model, hf_model(folder))
    outs = [hybrid.generate(LLM(model=str(m), max_model_len=128, speculative_config=hybrid.NGRAM), hybrid.greedy())
            for m in (folder, path)]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("arch", sorted(MAMBA2_GGUF_ARCHS))
def test_a_mamba2_hybrid_gguf_lacking_what_llama_cpp_writes_is_refused(tmp_path, gguf_cache, arch):
    """A Mamba-2 hybrid's GGUF without the hyperparameters llama.cpp writes for one is refused naming the key and the
    way out, and leaves no conversion behind."""
    from specray import LLM

    path = write_bare_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    with pytest.raises(ValueError, match=rf"lacks {arch}\.ssm\.time_step_rank, which llama.cpp writes for every "
                                         rf"{arch} model; convert the model again.*or pass its HF checkpoint"):
        LLM(model=str(path))
    assert not any((gguf_cache / "gguf").glob(f"tiny-{arch}-*"))


def write_bare_gguf(path: Path, arch: str) -> Path:
    """A GGUF of llama.cpp architecture ``arch`` with a few hyperparameters and two tensors: enough to be refused."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    _write_out(w)
    return path


# every GGUF architecture specray loads (llama.cpp's names), as its error for another one lists them
GGUF_LOADABLE = ["afmoe", "apertus", "arcee", "bitnet", "bloom", "cohere2", "command-r", "dbrx", "deepseek2", "dots1",
                 "ernie4_5", "ernie4_5-moe", "exaone-moe", "exaone4", "falcon", "falcon-h1", "gemma", "gemma2",
                 "gemma3", "gemma3n", "gemma4", "glm-dsa", "glm4", "glm4moe", "gpt-oss", "gpt2", "gptj", "gptneox",
                 "granite", "granitehybrid", "granitemoe", "hunyuan-dense", "hunyuan-moe", "jais2", "jamba",
                 "kimi-linear", "lfm2", "lfm2moe", "llama", "llama4", "mamba", "mimo2", "minicpm3", "minimax-m2",
                 "mistral3", "mistral4", "mpt", "nemotron", "nemotron_h", "nemotron_h_moe", "olmo", "olmo2", "olmoe",
                 "phi2", "phi3", "phimoe", "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen35", "qwen35moe", "qwen3moe",
                 "qwen3next", "qwen3vl", "qwen3vlmoe", "seed_oss", "smollm3", "stablelm", "starcoder", "starcoder2"]
_NO_HF_GGUF = r"HF folder \(config.json \+ \*.safetensors\) or its hub id instead of the .gguf"


@pytest.mark.parametrize("arch, match", [
    ("qwen3", rf"general.architecture='qwen3' \(Qwen3\).*cannot map from GGUF.*{_NO_HF_GGUF}"),
    ("rwkv6", r"general.architecture='rwkv6', not a family specray serves; GGUF architectures it loads: "
              + re.escape(str(sorted(GGUF_LOADABLE)))),
])
def test_gguf_of_unmapped_architecture_fails_early(tmp_path, gguf_cache, monkeypatch, arch, match):
    """A GGUF transformers has no mapping for and specray reads no other way -- a family we serve that the installed
    transformers cannot map (here Qwen3's, its mapping taken away), or one of a family we do not serve at all -- is
    refused by ``LLM(model="x.gguf")`` up front with the architecture and the way out, before transformers reads it
    (its own error names neither fix)."""
    import transformers
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from specray import LLM

    monkeypatch.setattr(gguf_utils, "GGUF_SUPPORTED_ARCHITECTURES",
                        [a for a in gguf_utils.GGUF_SUPPORTED_ARCHITECTURES if a != arch])

    def unreachable(*args, **kwargs):
        raise AssertionError("transformers read a GGUF the loader should have refused")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", unreachable)
    path = write_bare_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    with pytest.raises(ValueError, match=match):
        LLM(model=str(path))
    assert not any((gguf_cache / "gguf").glob(f"tiny-{arch}-*"))  # no conversion, not even a partial one, left


def test_gguf_of_mixtral_s_first_layout_fails_early(tmp_path, gguf_cache, monkeypatch):
    """llama.cpp's first Mixtral GGUFs (a llama with experts, a tensor per expert): refused up front with the way out
    (convert it again, or the HF checkpoint), before transformers reads the file."""
    import gguf
    import numpy as np
    import transformers

    from specray import LLM

    def unreachable(*args, **kwargs):
        raise AssertionError("transformers read a GGUF the loader should have refused")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", unreachable)
    path = tmp_path / "tiny-mixtral.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_expert_count(8)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    w.add_tensor("blk.0.ffn_gate.3.weight", np.zeros((4, 8), np.float32))
    _write_out(w)
    with pytest.raises(ValueError, match=r"stores a tensor per expert \(blk.0.ffn_gate.3.weight: llama.cpp's first "
                                         r"Mixtral layout\); convert it again.*HF checkpoint"):
        LLM(model=str(path))


# ---- FP8 releases with block scales (specray.models.fp8) -------------------------------------------------------

@pytest.mark.parametrize("fixture,block", [("tiny_llama_dir", FP8_BLOCK), ("tiny_llama_dir", None),
                                           ("tiny_deepseek_dir", FP8_BLOCK), ("tiny_deepseek_v32_dir", FP8_BLOCK)])
def test_fp8_release_loads_dequantized(request, tmp_path, fixture, block):
    """An FP8 release (block scales, or one per tensor) loads with every weight its dequantized value: the model's
    logits equal those of the same weights dequantized by hand and stored in full precision (DeepSeek-V3's
    latent-attention and expert weights included, and V3.2's indexer projections)."""
    fp8, ref = write_fp8(request.getfixturevalue(fixture), tmp_path, block)
    ids = list(range(3, 40))
    want = prefill_logits(load_model(ref), ids)
    got = prefill_logits(load_model(fp8), ids)
    assert torch.equal(got, want)
    assert got.std() > 0.01


@pytest.fixture
def fp8_experts(monkeypatch):
    """Keep FP8 experts on this CPU as a GPU does (on CPU they are dequantized at load by default)."""
    from specray.models import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", True)


@pytest.mark.parametrize("fixture,strategy", [("tiny_deepseek_dir", None), ("tiny_qwen3_moe_dir", None),
                                              ("tiny_qwen3_moe_dir", "channel"), ("tiny_deepseek_dir", "tensor")])
def test_fp8_experts_stay_fp8_with_the_same_outputs(request, tmp_path, fixture, strategy, monkeypatch):
    """An FP8 release with one tensor per expert (DeepSeek's and Qwen3-MoE's layout): kept as a GPU keeps them, the
    experts hold their float8 values and block scales (a quarter of float32's bytes, half of bf16's) and are
    dequantized as tokens reach them, so the logits equal the by-hand dequantized checkpoint's exactly; the dense
    weights load dequantized. llm-compressor's releases scaled per row or per tensor keep theirs the same way, a
    scale per row. By default on CPU the experts are dequantized at load, with the same logits."""
    from specray.models import cpu_kernels
    from specray.models.fp8 import ROW_SCALES
    from specray.models.moe import SparseMoE

    fp8, ref = write_fp8(split_experts(request.getfixturevalue(fixture), tmp_path / "split"), tmp_path / "q",
                         strategy=strategy)
    ids = list(range(3, 40))
    want = prefill_logits(load_model(ref), ids)
    for keep in (True, False):
        monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", keep)
        model = load_model(fp8)
        assert torch.equal(prefill_logits(model, ids), want) and want.std() > 0.01
        blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
        kept_block = tuple(FP8_BLOCK) if strategy is None else ROW_SCALES
        assert blocks and all(b.fp8_block == (kept_block if keep else None) for b in blocks)
        kind = torch.float8_e4m3fn if keep else torch.float32
        assert all(b.w13.dtype == b.w2.dtype == kind for b in blocks)
        assert all((b.w13_scale is not None) == keep for b in blocks)


def test_fp8_experts_split_into_partial_blocks_are_dequantized_at_load_and_say_why(fp8_experts, monkeypatch,
                                                                                      caplog):
    """Experts stay FP8 only where each rank holds whole blocks: width 32 in blocks of 16 over 2 ranks by width, or
    whole experts over 4; over 4 ranks by width (8 each) they load dequantized, with one warning naming the fix."""
    import logging
    from types import SimpleNamespace

    from specray.models import moe

    monkeypatch.setattr(moe, "_told_partial", set())
    config = SimpleNamespace(model_type="qwen3_moe", hidden_act="silu", hidden_size=64, num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                             quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})

    def block(size: int, expert_parallel: bool = False):
        return moe.SparseMoE(config, SimpleNamespace(size=size, rank=1), expert_parallel).fp8_block

    with caplog.at_level(logging.WARNING, logger="specray.models.moe"):
        assert block(2) == (16, 16) and block(4, expert_parallel=True) == (16, 16) and not caplog.records
        assert block(4) is None and block(4) is None
    assert len(caplog.records) == 1 and "enable_expert_parallel=True" in caplog.records[0].getMessage()


@pytest.mark.parametrize("per_expert", [False, True], ids=["fused-experts", "per-expert"])
def test_fp8_mtp_module_loads_dequantized(tiny_deepseek_dir, tmp_path, per_expert, fp8_experts):
    """DeepSeek-V3's MTP layer in an FP8 release serves method="mtp": greedy output equals the dequantized
    checkpoint's, plain and speculative. The target's experts (one tensor each) stay FP8; the MTP layer's, written
    fused and left unquantized by ``write_fp8``, keep full precision, or, split one tensor per expert, stay FP8."""
    import importlib

    from specray import LLM, SamplingParams
    from specray.models.moe import SparseMoE

    heads = importlib.import_module("specray_test_draft_heads")
    with_mtp = heads.write_deepseek_mtp(tmp_path / "mtp", tiny_deepseek_dir)
    if per_expert:
        with_mtp = split_experts(with_mtp, tmp_path / "split")
    fp8, ref = write_fp8(with_mtp, tmp_path / "q")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 25))}, {"prompt_token_ids": [7, 8, 9, 7, 8, 9, 7]}]
    want = [o.outputs[0].token_ids for o in LLM(str(ref), max_model_len=128).generate(prompts, params,
                                                                                        use_tqdm=False)]
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(str(fp8), max_model_len=128, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert llm.spec_stats.drafts > 0
    worker = llm.engine.executor.worker  # the target's two sparse blocks (saved one tensor per expert), the head's
    blocks = [m for part in (worker.model, worker.head) for m in part.modules() if isinstance(m, SparseMoE)]
    assert [b.fp8_block is not None for b in blocks] == [True, True, per_expert]


@pytest.mark.parametrize("strategy", ["channel", "tensor", "block"])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_moe_dir"])
def test_compressed_tensors_fp8_loads_dequantized(request, tmp_path, fixture, strategy):
    """llm-compressor's FP8 checkpoints (compressed-tensors, float-quantized: RedHatAI's -FP8 releases): weight_scale
    per output row, per tensor or per block, static input scales dropped; the logits equal the by-hand dequantized
    checkpoint's exactly."""
    fp8, ref = write_fp8(request.getfixturevalue(fixture), tmp_path, strategy=strategy)
    ids = list(range(3, 40))
    got = prefill_logits(load_model(fp8), ids)
    assert torch.equal(got, prefill_logits(load_model(ref), ids))
    assert got.std() > 0.01


def test_compressed_tensors_other_schemes_are_refused(tiny_llama_dir, tmp_path):
    """2:4 sparse weights (marlin-24), INT8 W8A8 grouped, and mixed strategies are refused by name."""
    fp8, _ = write_fp8(tiny_llama_dir, tmp_path, strategy="channel")
    config = json.loads((fp8 / "config.json").read_text())
    quant = config["quantization_config"]
    sparse = {**quant, "format": "marlin-24", "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}
    int8 = {**quant, "format": "int-quantized", "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "type": "int", "strategy": "group", "group_size": 128}}}}
    mixed = {**quant, "config_groups": {"a": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}},
                                        "b": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}}
    for changed, match in ((sparse, "format='marlin-24'"), (int8, "int-quantized weights .*'group'"),
                           (mixed, r"strategies \['channel', 'tensor'\]")):
        (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": changed}))
        with pytest.raises(ValueError, match=match):
            load_model(fp8)


def test_fp8_release_errors_name_the_fix(tiny_llama_dir, tmp_path):
    """Another quantization, static activation scales, a weight without its scale: ValueErrors naming the field."""
    from safetensors.torch import load_file, save_file

    fp8, _ = write_fp8(tiny_llama_dir, tmp_path)
    config = json.loads((fp8 / "config.json").read_text())
    for change, match in (({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
                          ({"activation_scheme": "static"}, "activation_scheme='static'"),
                          ({"weight_block_size": [16]}, "weight_block_size")):
        (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": {
            **config["quantization_config"], **change}}))
        with pytest.raises(ValueError, match=match):
            load_model(fp8)
    (fp8 / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(fp8 / "model.safetensors"))
    dropped = next(n for n in tensors if n.endswith("_scale_inv"))
    save_file({n: t for n, t in tensors.items() if n != dropped}, str(fp8 / "model.safetensors"))
    with pytest.raises(ValueError, match="without their weight_scale_inv"):
        load_model(fp8)


# ---- integer releases: GPTQ, AWQ, llm-compressor's packed (specray.models.int_quant) --------------------------------

INT4_KEPT = {"gptq4-g32", "awq4-g32", "w4a16-g64"}  # 4 bits in groups of 32-256 in column order: kept so


@pytest.fixture
def int4_weights(monkeypatch):
    """Keep 4-bit weights on this CPU as a GPU does (on CPU they are dequantized at load by default)."""
    from specray.models import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "INT4_WEIGHTS", True)


def int4_linears(model) -> list:
    return [m for m in model.modules() if getattr(m, "kept", None) is not None]


@pytest.mark.parametrize("scheme", sorted(INT_SCHEMES))
def test_int_release_loads(tiny_llama_dir, tmp_path, scheme, int4_weights):
    """A GPTQ (4 and 8 bits, groups or one per row, act order, both checkpoint formats), AWQ or pack-quantized
    (W4A16, W8A16, act order) release loads with every weight its stored value: the model's logits equal those of
    the stored integers dequantized by the writer and kept in full precision, and differ from the unquantized
    model's (the quantization is there to see). 4-bit linears in groups torch's kernel takes keep their integers
    (packed, no dense weight: under a quarter of its bytes); the others are dequantized as they load."""
    quant, ref = write_int(tiny_llama_dir, tmp_path, scheme, seed=1)
    ids = list(range(3, 40))
    model, dense = load_model(quant), load_model(ref, pack=False)
    kept = int4_linears(model)
    assert len(kept) == (8 if scheme in INT4_KEPT else 0)  # q/k/v, o, gate/up and down of 2 layers
    if kept:
        int4_bytes = sum(b.numel() * b.element_size() for m in kept for b in m.kept.buffers())
        dense_bytes = sum(m.weight.numel() * 4 for name, m in dense.named_modules() if name.endswith("proj"))
        assert all(m.weight.numel() == 0 for m in kept) and int4_bytes < dense_bytes / 4
    got = prefill_logits(model, ids)
    assert (got - prefill_logits(dense, ids)).abs().max() < TOL
    assert (got - prefill_logits(load_model(tiny_llama_dir), ids)).abs().max() > 1e-3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA's 4-bit kernel (tinygemm) needs a GPU"))])
def test_int4_kernel_in_bf16(tiny_llama_dir, tmp_path, device, int4_weights):
    """In bf16 (tinygemm's one dtype on CUDA; the CPU kernel's too), on each device with torch's 4-bit kernel: the
    linears keep 4 bits and the logits stay within bf16's rounding of the dequantized twin's (a layout or offset
    mistake in the packing would move them by whole units)."""
    quant, ref = write_int(tiny_llama_dir, tmp_path, "awq4-g32", seed=1)
    model = load_model(quant, dtype=torch.bfloat16, device=device)
    assert len(int4_linears(model)) == 8
    ids = list(range(3, 40))
    got = prefill_logits(model, ids).float()
    want = prefill_logits(load_model(ref, dtype=torch.bfloat16, device=device), ids).float()
    assert (got - want).abs().max() < 0.03 * want.abs().max()


@pytest.mark.parametrize("fixture,kept", [("tiny_phi3_dir", 8), ("tiny_deepseek_dir", 6)])
def test_int_release_of_other_layouts(request, tmp_path, fixture, kept, int4_weights):
    """Phi-3's fused q/k/v and gate/up (each part's rows staged in place, all kept in 4 bits) and DeepSeek-V3
    (kv_b_proj, read as a matrix, and the linears whose shapes torch's kernel does not take are dequantized; the
    dense and shared experts' MLPs kept): logits equal the dequantized twin's."""
    folder = request.getfixturevalue(fixture)
    if fixture == "tiny_deepseek_dir":
        folder = split_experts(folder, tmp_path / "split")
    quant, ref = write_int(folder, tmp_path, "awq4-g32")
    model = load_model(quant)
    assert len(int4_linears(model)) == kept
    ids = list(range(3, 40))
    assert (prefill_logits(model, ids) - prefill_logits(load_model(ref, pack=False), ids)).abs().max() < TOL


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA's 4-bit kernel (tinygemm) needs a GPU"))])
def test_dummy_weights_of_a_4_bit_release(tiny_llama_dir, tmp_path, device, int4_weights):
    """load_format="dummy" of a 4-bit release's config (timing the 4-bit kernel at a real size with no checkpoint):
    its linears hold random integers kept in 4 bits, no dense weight, values within the dummy range (the LM head
    and norms dense, as a release's are); the engine runs it; on a CPU that dequantizes 4-bit weights, dense."""
    from specray import LLM, SamplingParams
    from specray.models import cpu_kernels

    quant, _ = write_int(tiny_llama_dir, tmp_path, "awq4-g32")
    folder = tmp_path / "config_only"
    shutil.copytree(quant, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    dtype = torch.bfloat16
    net = load_model(str(folder), load_format="dummy", dtype=dtype, device=device)
    kept = int4_linears(net)
    assert len(kept) == 8 and all(m.weight.numel() == 0 for m in kept)
    eye = torch.eye(kept[0].dense_shape[1], dtype=dtype, device=device)
    weight = kept[0].kept.matmul(eye).float()  # x = I: the weight the kernel applies, transposed
    assert 0 < weight.abs().max() <= loader.DUMMY_WEIGHT_RANGE * 1.01 and weight.unique().numel() > 8
    assert torch.isfinite(prefill_logits(net, list(range(3, 20))).float()).all()
    out = LLM(model=str(folder), max_model_len=64, load_format="dummy", dtype="bfloat16", device=device).generate(
        ["Hello there"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    if device == "cpu":
        cpu_kernels.INT4_WEIGHTS = False  # (int4_weights restores it)
        dense = load_model(str(folder), load_format="dummy", dtype=dtype)
        assert not int4_linears(dense) and all(p.numel() for p in dense.parameters())


def test_a_cpu_dequantizes_4_bit_weights_unless_asked_to_keep_them(tiny_llama_dir, tmp_path):
    """On CPU (whose 4-bit kernel is slow in fp32) a 4-bit release's linears are dequantized at load by default: no
    4-bit linear, the same logits as the dequantized twin's."""
    quant, ref = write_int(tiny_llama_dir, tmp_path, "gptq4-g32", seed=1)
    model = load_model(quant)
    assert not int4_linears(model)
    ids = list(range(3, 40))
    assert torch.equal(prefill_logits(model, ids), prefill_logits(load_model(ref), ids))


def test_int_mixture_of_experts_and_the_engine(tiny_qwen3_moe_dir, tmp_path, int4_weights):
    """A GPTQ release of a mixture of experts (one tensor per expert, as released) keeps its attention and its
    experts in 4 bits (the experts packed, dequantized one at a time as tokens reach them); the engine serves it, its
    greedy output with n-gram drafts that of plain greedy decoding and of the dequantized twin."""
    from specray import LLM, SamplingParams

    quant, ref = write_int(split_experts(tiny_qwen3_moe_dir, tmp_path / "split"), tmp_path, "gptq4-g32")
    assert any(".experts.3.up_proj.qweight" in n for n in json.loads(
        (quant / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
            (quant / "model.safetensors").read_bytes()[:8], "little")]))
    model = load_model(quant)
    assert int4_linears(model) and model.model.layers[0].mlp.w13.dtype == torch.uint8  # experts packed too
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    outs = [[o.outputs[0].token_ids for o in LLM(model=str(m), max_model_len=128, speculative_config=s).generate(
        ["The quick brown fox", "def add(a, b):"], greedy, use_tqdm=False)] for m, s in
            ((quant, spec), (quant, None), (ref, None))]
    assert outs[0] == outs[1] == outs[2]


def test_quantization_option_confirms_the_checkpoint_s_method(tiny_llama_dir, tmp_path):
    """vLLM's ``quantization`` names the checkpoint's own method (its Marlin names too): an AWQ release serves with
    ``awq`` or ``awq_marlin``; another method is refused naming what the checkpoint has, as is one other than fp8
    over a checkpoint without quantization (``fp8`` quantizes it online: tests/test_w8a8.py; on this CPU, which keeps
    no FP8 linears, that is refused, saying what it needs); an unknown name is refused with the known ones."""
    from specray import LLM, SamplingParams
    from specray.config import EngineArgs

    quant, _ = write_int(tiny_llama_dir, tmp_path, "awq4-g32")
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for name in ("awq", "awq_marlin"):
        assert len(LLM(model=str(quant), quantization=name, max_model_len=64).generate(
            ["Hello"], greedy, use_tqdm=False)[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"quantization='gptq' but the checkpoint has quantization_config.quant_method="
                                         r"'awq'.*drop the quantization option"):
        LLM(model=str(quant), quantization="gptq")
    with pytest.raises(ValueError, match="quantization='awq' but the checkpoint has no quantization_config"):
        LLM(model=str(tiny_llama_dir), quantization="awq")
    with pytest.raises(ValueError, match="quantization='fp8' over an unquantized checkpoint .* compute capability 8.9"):
        LLM(model=str(tiny_llama_dir), quantization="fp8")
    with pytest.raises(ValueError, match=r"quantization='bitsandbytes' is not supported; one of \['awq'"):
        EngineArgs(model=str(tiny_llama_dir), quantization="bitsandbytes")


def test_int_release_errors_name_the_fix(tiny_llama_dir, tmp_path):
    """Integer schemes specray does not load are refused by name, as is a linear missing one of its tensors."""
    quant, _ = write_int(tiny_llama_dir, tmp_path, "gptq4-g32")
    cases = (({"quant_method": "gptq", "bits": 3, "group_size": 32}, r"bits=3 \(supported: \[4, 8\]\)"),
             ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size=0"),
             ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
             ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "version='gemv'"),
             ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
                 "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}}}},
              "symmetric=False"))
    assert_refused(quant, cases, "model.layers.1.mlp.up_proj.qzeros",
                   r"'model.layers.1.mlp.up_proj': \['qzeros'\].*incomplete")


def test_trust_remote_code_lets_a_checkpoint_s_own_config_class_load(tiny_llama_dir, tmp_path):
    """A checkpoint whose config class is its own code (auto_map, as Kimi K2's tokenizer is): refused at once with
    our error naming trust_remote_code (never transformers' prompt on the terminal), loaded and served with it."""
    from specray import LLM, SamplingParams

    folder = tmp_path / "custom"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass CustomLlamaConfig(LlamaConfig):\n"
        "    model_type = 'specray_custom_llama'\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="specray_custom_llama", auto_map={"AutoConfig": "configuration_custom.CustomLlamaConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="code of its own .*trust_remote_code=True"):
        loader.read_config(str(folder))
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        LLM(model=str(folder), max_model_len=64)
    assert loader.read_config(str(folder), trust_remote_code=True).hidden_size == 64
    llm = LLM(model=str(folder), max_model_len=64, trust_remote_code=True)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    reference = LLM(model=str(tiny_llama_dir), max_model_len=64)
    assert llm.generate(["Hi"], params, use_tqdm=False)[0].outputs[0].token_ids == \
        reference.generate(["Hi"], params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="trust_remote_code='yes' must be true or false"):
        LLM(model=str(folder), trust_remote_code="yes")


def test_hf_overrides_change_the_config_every_rank_builds_from(tiny_llama_dir):
    """vLLM's hf_overrides: set on the config once read, so the engine's limits and the model's layers follow them;
    linear RoPE scaling given this way gives transformers' logits under the same config, not the file's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specray import LLM
    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import allocate_kv_cache
    from specray.models.loader import load_model, read_config

    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    with LLM(model=str(tiny_llama_dir), hf_overrides={"max_position_embeddings": 512}) as llm:
        assert llm.engine.max_model_len == 512  # the file says 1024
    ids = list(range(5, 45))
    logits = {}
    for name, overrides in (("file", None), ("scaled", {"rope_parameters": rope})):
        ours = load_model(tiny_llama_dir, config=read_config(tiny_llama_dir, hf_overrides=overrides))
        allocate_kv_cache(ours, 16, 4)
        meta = build_attention_metadata([len(ids)], [0], [list(range(10))], 4, "cpu")
        with torch.no_grad():
            logits[name] = ours.compute_logits(ours(torch.tensor(ids), meta))
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    config.rope_parameters = rope
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    assert (logits["scaled"] - want).abs().max() < 1e-4
    assert (logits["scaled"] - logits["file"]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="hf_overrides=.* must be a dict"):
        LLM(model=str(tiny_llama_dir), hf_overrides=["max_position_embeddings"])


def test_hf_overrides_of_rope_keep_the_checkpoints_base(tiny_llama_dir, tmp_path):
    """RoPE overrides as vLLM's users write them: a new rope_parameters or the old rope_scaling without rope_theta
    keeps the checkpoint's base (it became 10000, or None and a TypeError), and rope_theta alone changes it (it was
    ignored); a model with RoPE per kind of layer refuses a bare rope_theta, or one setting for every kind, by name."""
    from specray.models.layers import rope_parameters
    from specray.models.loader import read_config

    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    (tmp_path / "config.json").write_text(json.dumps(config))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    for overrides, want in (({"rope_parameters": yarn}, ("yarn", 1e6)), ({"rope_scaling": yarn}, ("yarn", 1e6)),
                            ({"rope_theta": 5e5}, ("default", 5e5)),
                            ({"rope_parameters": {**yarn, "rope_theta": 2e6}}, ("yarn", 2e6))):
        params = rope_parameters(read_config(tmp_path, hf_overrides=overrides))
        assert (params["rope_type"], params["rope_theta"]) == want, (overrides, params)
    config = {"model_type": "gemma3_text", "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    per_kind = {kind: {"rope_type": "linear", "factor": 2.0} for kind in config["rope_parameters"]}
    read = read_config(tmp_path, hf_overrides={"rope_parameters": per_kind})
    assert [rope_parameters(read, kind)["rope_theta"] for kind in per_kind] == [1e4, 1e6]
    with pytest.raises(ValueError, match=r"rope_theta=500000.0 cannot be set alone .* per kind of layer"):
        read_config(tmp_path, hf_overrides={"rope_theta": 5e5})
    with pytest.raises(ValueError, match=r"rope_parameters / rope_scaling \['factor', .*\] give one setting for "
                                         r"every layer, but this model's RoPE is given per kind of layer"):
        read_config(tmp_path, hf_overrides={"rope_scaling": yarn})


def test_rope_scaling_stretches_the_longest_sequence_as_vllm_derives_it():
    """max_model_len's default and bound: factor x the pretrained length under linear, dynamic and YaRN scaling (a
    Qwen3 with its model card's YaRN serves 4 x 32768, past max_position_embeddings=40960: it was refused), the
    config's own length otherwise (llama3, per-kind RoPE: already the stretched one)."""
    from transformers import Gemma3TextConfig, LlamaConfig

    from specray.engine.builder import resolve_max_model_len

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 5e5}
    for rope, want in ((yarn, 131072), ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, 81920),
                       ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, 81920), (llama3, 40960),
                       ({"rope_type": "default", "rope_theta": 1e4}, 40960)):
        config = LlamaConfig(max_position_embeddings=40960, rope_parameters=rope)
        assert resolve_max_model_len(None, config) == want, rope
    config = LlamaConfig(max_position_embeddings=40960, rope_parameters=yarn)
    assert resolve_max_model_len(131072, config) == 131072
    with pytest.raises(ValueError, match=r"max_model_len=131073 exceeds the model's max_position_embeddings=40960 "
                                         r"stretched by its rope scaling to 131072; pass max_model_len <= 131072"):
        resolve_max_model_len(131073, config)
    gemma3 = Gemma3TextConfig(max_position_embeddings=1024, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    assert resolve_max_model_len(None, gemma3) == 1024


@pytest.mark.parametrize("arch", ["qwen2moe", "mixtral", "qwen3_5_moe", "nemotron_h"])
def test_a_gguf_is_converted_a_layer_at_a_time_into_shards(make_tiny_model, tmp_path, gguf_cache, monkeypatch, arch):
    """Converting a GGUF holds a layer's tensors (two while the next is read) at a time, never the model's: with
    ``GGUF_SHARD_BYTES`` at 1 each group (the embeddings, a layer, the head) goes to a shard of its own, the folder is
    an HF sharded checkpoint (its index names every tensor), and the model loaded from it equals transformers' on the
    original folder. Through transformers' mapping (Qwen2-MoE: its processor merges gate and up experts in the dict
    it writes into; Mixtral: the experts read here) and through specray's own readers (Qwen3.5-MoE, Nemotron-H)."""
    import weakref
    from collections import Counter

    import specray_test_hybrid_models as hybrid  # tests/hybrid_models.py (registered by conftest)

    from specray.models import gguf_read

    refs: list[weakref.ref] = []  # the tensors written
    read: list[weakref.ref] = []  # the tensors our readers dequantized (Mixtral's experts, the two hybrids' all)
    most_alive = most_read = 0
    setitem, dequantized = loader._ShardWriter.__setitem__, gguf_read.dequantized

    def tracking(self, name, tensor):
        nonlocal most_alive
        setitem(self, name, tensor)
        refs.append(weakref.ref(tensor))
        most_alive = max(most_alive, sum(ref() is not None for ref in refs))

    def reading(t):
        nonlocal most_read
        tensor = dequantized(t)
        read.append(weakref.ref(tensor))
        most_read = max(most_read, sum(ref() is not None for ref in read))
        return tensor

    monkeypatch.setattr(loader._ShardWriter, "__setitem__", tracking)
    monkeypatch.setattr(gguf_read, "dequantized", reading)
    monkeypatch.setattr(loader, "gguf_dequantized", reading)
    monkeypatch.setattr(loader, "GGUF_SHARD_BYTES", 1)
    if arch in GGUF_TINY:
        kind, overrides = GGUF_TINY[arch]
        folder = make_tiny_model(tmp_path / kind, kind, seed=9, **{**overrides, "num_hidden_layers": 6})
        path = write_gguf(folder, tmp_path / f"{arch}.gguf", arch)
    elif arch in HYBRID_QWEN_GGUF:
        folder = hybrid.save(tmp_path / arch, arch, 7, linear_num_value_heads=6)
        path = write_hybrid_qwen_gguf(folder, tmp_path / f"{arch}.gguf", HYBRID_QWEN_GGUF[arch])
    else:
        kind, gguf_arch, overrides = MAMBA2_GGUF[arch]
        folder = hybrid.save(tmp_path / arch, kind, 7, **overrides)
        path = write_mamba2_gguf(folder, tmp_path / f"{arch}.gguf", gguf_arch)
    model = load_model(str(path), pack=False)
    converted = loader.gguf_cache_folder(path)
    weight_map = json.loads((converted / "model.safetensors.index.json").read_text())["weight_map"]
    per_shard = Counter(weight_map.values())
    assert sorted(per_shard) == sorted(p.name for p in converted.glob("*.safetensors"))
    assert len(weight_map) == len(refs) and len(per_shard) >= model.config.num_hidden_layers
    assert most_alive <= 2 * max(per_shard.values()) < len(refs)
    assert 2 * most_read <= len(read)
    if arch in GGUF_TINY:
        assert_matches_hf(model, hf_model(folder))
    else:
        hybrid.check_prefill_chunks_and_decode(model, hf_model(folder))


def write_gemma4_gguf(folder: Path, out: Path) -> Path:
    """A GGUF of a Gemma 4 text folder written as llama.cpp's converter writes one (its Gemma4Model over Gemma3Model
    and TextModel): the metadata its ``set_gguf_parameters`` adds (per-layer KV heads and sliding flags, the two head
    sizes and RoPE bases, the sliding layers' rotated width, KV sharing and the per-layer widths of double-wide
    MLPs, per-layer inputs, experts), the full layers' proportional RoPE as ``rope_freqs`` (1 per rotated frequency,
    1e30 per other), every tensor renamed through gguf-py's tensor map after the converter's own renames (a
    ``.weight`` suffix for ``layer_scalar`` and the stacked experts; the router's scales as ``ffn_gate_inp.scale``
    and ``ffn_down_exps.scale``), norms unshifted, no ``lm_head`` (tied)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from transformers import AutoConfig

    from specray.models.gemma4 import layer_geometry

    config = AutoConfig.from_pretrained(folder)
    cfg = config.to_dict()  # (config.json leaves out what equals a default)
    layers, sliding = cfg["num_hidden_layers"], [t == "sliding_attention" for t in cfg["layer_types"]]
    head_full, kv_full = layer_geometry(config, sliding.index(False))
    first_shared = layers - cfg["num_kv_shared_layers"]
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(out), "gemma4")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    width = cfg["intermediate_size"]
    w.add_feed_forward_length([width if i < first_shared else 2 * width for i in range(layers)]
                              if cfg["use_double_wide_mlp"] else width)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if s else kv_full for s in sliding])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    if cfg["enable_moe_block"]:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_shared_kv_layers(cfg["num_kv_shared_layers"])
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(sliding)
    w.add_key_length(head_full)
    w.add_value_length(head_full)
    w.add_key_length_swa(cfg["head_dim"])
    w.add_value_length_swa(cfg["head_dim"])
    w.add_rope_dimension_count(head_full)
    w.add_rope_dimension_count_swa(int(cfg["head_dim"] * rope["sliding_attention"].get("partial_rotary_factor", 1.0)))
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    rotated = int(head_full * rope["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (head_full // 2 - rotated),
                                               dtype=np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    for name, value in load_file(str(folder / "model.safetensors")).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name == "lm_head.weight":
            continue
        if name.endswith("router.scale"):
            gguf_name = f"blk.{layer}.ffn_gate_inp.scale"
        elif name.endswith("router.per_expert_scale"):
            gguf_name = f"blk.{layer}.ffn_down_exps.scale"
        else:
            if name.endswith("layer_scalar") or (".experts." in name and not name.endswith(".weight")):
                name += ".weight"
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        w.add_tensor(gguf_name, value.float().numpy())
    _write_out(w)
    return out


@pytest.mark.parametrize("variant", ["experts", "dense"])
def test_a_gemma4_gguf_matches_transformers(tmp_path, gguf_cache, variant):
    """A GGUF of Gemma 4 as llama.cpp writes it (sliding and full layers of different head sizes and KV heads, k = v
    full layers, proportional RoPE as frequency factors, KV-shared layers with double-wide MLPs; with experts beside
    the dense MLPs and per-layer inputs, or the dense releases' shape) is read by specray's own mapping: its config
    is the folder's, its logits equal transformers' on the original folder (chunks and decode steps past the
    window), and the engine's greedy output with n-gram drafts on the GGUF equals the folder's."""
    from specray import LLM
    from tests import test_gemma4 as gemma4
    from specray_test_model_checks import SCHEDULES, chunked_logits, max_diff, prompt

    runs = sys.modules["specray_test_engine_runs"]
    folder = gemma4.save_tiny(tmp_path / "gemma4", seed=40, **({} if variant == "experts" else gemma4.DENSE))
    path = write_gemma4_gguf(folder, tmp_path / "gemma4.gguf")
    ours, theirs = load_hf_config(str(path)), load_hf_config(str(folder))
    fields = ("model_type", "architectures", "layer_types", "rope_parameters", "num_hidden_layers", "head_dim",
              "per_layer_config", "num_key_value_heads", "attention_k_eq_v",
              "num_kv_shared_layers", "use_double_wide_mlp", "intermediate_size", "enable_moe_block", "num_experts",
              "top_k_experts", "moe_intermediate_size", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
              "final_logit_softcapping", "sliding_window", "tie_word_embeddings", "vocab_size", "eos_token_id",
              "rms_norm_eps")  # (the file's float32 epsilon read back as the decimal it was written from)
    unused = (("num_experts", "top_k_experts", "moe_intermediate_size") if not theirs.enable_moe_block else ()) + \
        (("vocab_size_per_layer_input",) if not theirs.hidden_size_per_layer_input else ())  # the dense model's
    fields = [f for f in fields if f not in unused]
    assert {f: getattr(ours, f, None) for f in fields} == {f: getattr(theirs, f, None) for f in fields}
    model = load_model(str(path), pack=False)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), gemma4.hf_logits(folder)) \
        < gemma4.TOL
    prompts = ["The quick brown fox", "def add(a, b):"]  # (the file's tokenizer pre-splits a run of spaces otherwise)
    llms = [LLM(model=str(m), max_model_len=128, speculative_config=gemma4.NGRAM) for m in (folder, path)]
    outs = [runs.token_ids(llm.generate(prompts, runs.greedy(16), use_tqdm=False)) for llm in llms]
    assert outs[0] == outs[1] and llms[1].spec_stats.accepted_tokens > 0


def _held_expert(stacked: dict[tuple[int, str], list], name: str, value) -> bool:
    """Whether ``name`` is one expert's projection (``model.layers.{i}.{block}.experts.{e}.{proj}.weight``), then held
    in ``stacked`` under (layer, projection) for :func:`_add_stacked_experts`."""
    if ".experts." not in name:
        return False
    parts = name.split(".")
    stacked.setdefault((int(parts[2]), parts[6]), []).append((int(parts[5]), value))
    return True


def _add_renamed(w, names, name: str, value) -> None:
    """One tensor under the GGUF name gguf-py's map gives it, the router's correction bias renamed first to the
    ``.bias`` llama.cpp's converter maps (``exp_probs_b.bias``)."""
    name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), value.float().numpy())


def _add_stacked_experts(w, names, stacked: dict[tuple[int, str], list]) -> None:
    """Each MoE layer's experts, ``(layer, projection) -> [(expert, tensor)]``, as llama.cpp's converter writes them:
    stacked per projection under the merged name ``model.layers.{i}.mlp.experts.{projection}``."""
    for (layer, projection), experts in stacked.items():
        merged = torch.stack([v for _, v in sorted(experts, key=lambda e: e[0])])
        w.add_tensor(names.get_name(f"model.layers.{layer}.mlp.experts.{projection}.weight", try_suffixes=(".weight",)),
                     merged.float().numpy())


def write_jamba_gguf(folder: Path, out: Path) -> Path:
    """A GGUF of a Jamba folder written as llama.cpp's converter writes one (its JambaModel): the per-layer KV heads
    (0 on Mamba layers), the Mamba sizes as ``ssm.*``, the experts' counts; every tensor renamed through gguf-py's
    tensor map, ``A_log`` as ``-exp(A_log)``, the conv squeezed, each MoE layer's experts stacked per projection
    (under the merged name ``mlp.experts.{proj}``)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder).to_dict()
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    attn = [i >= cfg["attn_layer_offset"] and (i - cfg["attn_layer_offset"]) % cfg["attn_layer_period"] == 0
            for i in range(layers)]
    w = gguf.GGUFWriter(str(out), "jamba")
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if a else 0 for a in attn])
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_inner_size(cfg["mamba_expand"] * hidden)
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_time_step_rank(cfg["mamba_dt_rank"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.JAMBA, layers)
    tensors = load_file(str(folder / "model.safetensors"))
    stacked: dict[tuple[int, str], list] = {}
    for name, value in tensors.items():
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        if _held_expert(stacked, name, value):
            continue
        if name.endswith(".A_log"):
            value = -torch.exp(value)
        if name.endswith("mamba.conv1d.weight"):
            value = value.squeeze()
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), value.float().numpy())
    _add_stacked_experts(w, names, stacked)
    _write_out(w)
    return out


def test_a_jamba_gguf_matches_transformers(tmp_path, gguf_cache):
    """A GGUF of Jamba as llama.cpp writes it (attention and expert layers as per-layer KV heads and routers, the
    Mamba sizes as ``ssm.*``, ``A`` as ``-exp(A_log)``, the conv squeezed, stacked experts) is read by specray's own
    mapping: its config is the folder's, its logits (the recurrent state carried over chunks, decode steps) equal
    transformers' on the original folder, and the engine's greedy output with n-gram drafts on the GGUF equals the
    folder's."""
    import specray_test_hybrid_models as hybrid  # tests/hybrid_models.py (registered by conftest)
    from specray import LLM

    folder = hybrid.save(tmp_path / "jamba", "jamba", 7)
    path = write_jamba_gguf(folder, tmp_path / "jamba.gguf")
    ours, theirs = load_hf_config(str(path)), load_hf_config(str(folder))
    fields = ("model_type", "architectures", "num_hidden_layers", "attn_layer_offset", "attn_layer_period",
              "expert_layer_offset", "expert_layer_period", "num_experts", "num_experts_per_tok", "mamba_d_state",
              "mamba_d_conv", "mamba_expand", "mamba_dt_rank", "mamba_conv_bias", "mamba_proj_bias",
              "num_key_value_heads", "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps")
    assert {f: getattr(ours, f, None) for f in fields} == {f: getattr(theirs, f, None) for f in fields}
    model = load_model(str(path), pack=False)
    hybrid.check_prefill_chunks_and_decode(model, hf_model(folder))
    outs = [hybrid.generate(LLM(model=str(m), max_model_len=128, speculative_config=hybrid.NGRAM), hybrid.greedy())
            for m in (folder, path)]
    assert outs[0] == outs[1]


def assert_converted_as_folder(folder: Path, path: Path) -> None:
    """The GGUF's converted folder holds the folder's tensors, every one (but a tied head), equal in float32."""
    source = {k: v for k, v in _safetensors(folder).items()
              if not (k == "lm_head.weight" and load_hf_config(str(folder)).tie_word_embeddings)}
    converted = _safetensors(resolve_model(str(path)).path)
    assert sorted(converted) == sorted(source)
    assert [k for k in source if not torch.equal(converted[k], source[k].float())] == []


def assert_gguf_serves_as_its_folder(folder: Path, path: Path, fields) -> None:
    """The GGUF's config read back has the folder's ``fields``, its converted folder holds the folder's tensors (every
    one, equal in float32), our model on it gives transformers' logits on the folder, and the engine's greedy tokens
    with n-gram drafts on it equal the folder's."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    ours, theirs = load_hf_config(str(path)), load_hf_config(str(folder))
    assert {f: getattr(ours, f, None) for f in fields} == {f: getattr(theirs, f, None) for f in fields}
    assert_converted_as_folder(folder, path)
    assert_matches_hf(load_model(str(path), pack=False), hf_model(folder))
    prompts = ["The quick brown fox", "def add(a, b):"]  # (the file's tokenizer pre-splits a run of spaces otherwise)
    llms = [LLM(model=str(m), max_model_len=128, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
            for m in (folder, path)]
    outs = [runs.token_ids(llm.generate(prompts, runs.greedy(12), use_tqdm=False)) for llm in llms]
    assert outs[0] == outs[1]


def write_deepseek_gguf(folder: Path, out: Path, arch: str = "deepseek2") -> Path:
    """A GGUF of a DeepSeek-V3 folder written as llama.cpp's converter writes one (its DeepseekV2Model over TextModel):
    MLA as MQA (one KV head; the latent and heads' widths as ``attention.*``), YaRN with ``mscale_all_dim`` as
    ``yarn_log_multiplier``, the router's settings; ``kv_b_proj`` split per head into ``attn_k_b`` (transposed) and
    ``attn_v_b``, each MoE layer's experts stacked per projection, the correction bias renamed to a ``.bias``, no
    ``lm_head`` when tied; every tensor renamed through gguf-py's tensor map. ``arch`` ``glm-dsa``: a GLM-5 folder as
    its GlmMoeDsaModel writes it, besides: the indexer's sizes (``attention.indexer.*``) and tensors, and the MTP
    layers the folder has (``nextn_predict_layers``, counted in ``block_count``, their ``nextn.*`` tensors)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    weights = load_file(str(folder / "model.safetensors"))
    nextn = len({n.split(".")[2] for n in weights if n.startswith("model.layers.")
                 and int(n.split(".")[2]) >= layers}) if arch == "glm-dsa" else 0
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(layers + nextn)
    if arch == "glm-dsa":
        w.add_nextn_predict_layers(nextn)
        w.add_indexer_head_count(cfg["index_n_heads"])
        w.add_indexer_key_length(cfg["index_head_dim"])
        w.add_indexer_top_k(cfg["index_topk"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    # (GLM-4.7-Flash's release config says first_k_dense_replace too; transformers saves its mlp_layer_types)
    _write_sigmoid_router(w, cfg, cfg.get("first_k_dense_replace", (cfg.get("mlp_layer_types") or []).count("dense")))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    w.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    w.add_value_length(cfg["kv_lora_rank"])
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    model_arch = gguf.MODEL_ARCH.GLM_DSA if arch == "glm-dsa" else gguf.MODEL_ARCH.DEEPSEEK2
    names = gguf.get_tensor_name_map(model_arch, layers + nextn)
    stacked: dict[tuple[int, str], list] = {}
    for name, value in weights.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if _held_expert(stacked, name, value):
            continue
        if name.endswith("kv_b_proj.weight"):
            kv_b = value.view(heads, cfg["qk_nope_head_dim"] + cfg["v_head_dim"], -1)
            k_b, v_b = kv_b.split([cfg["qk_nope_head_dim"], cfg["v_head_dim"]], dim=1)
            for part, tensor in (("k_b_proj", k_b.transpose(1, 2)), ("v_b_proj", v_b)):
                w.add_tensor(names.get_name(name.replace("kv_b_proj", part), try_suffixes=(".weight",)),
                             tensor.float().contiguous().numpy())
            continue
        _add_renamed(w, names, name, value)
    _add_stacked_experts(w, names, stacked)
    _write_out(w)
    return out


def test_a_deepseek_v3_gguf_matches_transformers(tiny_deepseek_dir, tmp_path, gguf_cache):
    """A GGUF of DeepSeek-V3 as llama.cpp writes it (MLA as MQA with ``kv_b_proj`` split per head into a transposed
    ``attn_k_b`` and ``attn_v_b``, YaRN's ``mscale_all_dim`` as ``yarn_log_multiplier``, the grouped sigmoid router
    with its correction bias, stacked experts, a shared expert, a dense first layer) is read by specray's own
    mapping: its config is the folder's, its logits equal transformers' on the original folder, and the engine's
    greedy output with n-gram drafts on the GGUF equals the folder's."""
    from specray import LLM

    path = write_deepseek_gguf(tiny_deepseek_dir, tmp_path / "deepseek.gguf")
    ours, theirs = load_hf_config(str(path)), load_hf_config(str(tiny_deepseek_dir))
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
              "num_experts_per_tok", "n_group", "topk_group", "n_shared_experts", "routed_scaling_factor",
              "norm_topk_prob", "first_k_dense_replace", "moe_intermediate_size", "intermediate_size",
              "tie_word_embeddings", "vocab_size", "rms_norm_eps", "max_position_embeddings")
    assert {k: v for k, v in ours.rope_parameters.items() if k not in ("beta_fast", "beta_slow")} == \
        {k: v for k, v in theirs.rope_parameters.items() if k not in ("beta_fast", "beta_slow")}
    assert_gguf_serves_as_its_folder(tiny_deepseek_dir, path, fields)
    with pytest.raises(ValueError, match="has no MTP layer.*converted from the GGUF .*leaves the MTP layers out: pass "
                                         "the model's HF checkpoint for method='mtp'"):
        LLM(model=str(path), max_model_len=128, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_a_glm5_gguf_with_its_mtp_layer_drafts_as_its_folder(tiny_glm5_dir, tmp_path, gguf_cache):
    """A GGUF of GLM-5 as llama.cpp writes it (its GlmMoeDsaModel: DeepSeek-V3's layout with the sparse attention's
    indexer -- its sizes as ``attention.indexer.*``, its tensors on the layers that have their own, none where a layer
    shares the previous one's choice -- and the MTP layer kept) is read by specray's own mapping: its config is the
    folder's (the indexer's kinds told by which layers have its tensors), its tensors are (so our logits on it are
    our logits on the folder, which tests/test_deepseek_v32.py checks against transformers'), and ``method="mtp"`` on
    the GGUF makes the drafts and the greedy tokens it makes on the folder."""
    import specray_test_draft_heads as draft_heads  # tests/draft_heads.py (registered by conftest)
    from specray import LLM
    from specray_test_checkpoints import split_experts

    runs = sys.modules["specray_test_engine_runs"]
    folder = split_experts(draft_heads.write_deepseek_mtp(tmp_path / "glm5_mtp", tiny_glm5_dir), tmp_path / "glm5")
    assert load_hf_config(str(folder)).indexer_types == ["full", "shared", "full"]
    path = write_deepseek_gguf(folder, tmp_path / "glm5.gguf", "glm-dsa")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "q_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
              "n_group", "topk_group", "n_shared_experts", "routed_scaling_factor", "norm_topk_prob",
              "first_k_dense_replace", "moe_intermediate_size", "intermediate_size", "index_n_heads", "index_head_dim",
              "index_topk", "indexer_types", "tie_word_embeddings", "vocab_size", "rms_norm_eps")
    ours, theirs = load_hf_config(str(path)), load_hf_config(str(folder))
    assert {f: getattr(ours, f, None) for f in fields} == {f: getattr(theirs, f, None) for f in fields}
    assert ours.num_nextn_predict_layers == 1  # (the folder's config names none: its layer's tensors say so)
    assert {k: v for k, v in ours.rope_parameters.items() if k not in ("beta_fast", "beta_slow")} == \
        {k: v for k, v in theirs.rope_parameters.items() if k not in ("beta_fast", "beta_slow")}
    assert_converted_as_folder(folder, path)
    mtp = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    llms = [LLM(model=str(m), max_model_len=128, speculative_config=mtp) for m in (folder, path)]
    prompts = ["The quick brown fox", "def add(a, b):"]
    outs = [runs.token_ids(llm.generate(prompts, runs.greedy(12), use_tqdm=False)) for llm in llms]
    assert outs[0] == outs[1]
    stats = [(llm.spec_stats.draft_tokens, llm.spec_stats.accepted_tokens) for llm in llms]
    assert stats[0] == stats[1] and stats[0][1] > 0, stats


def test_a_glm_4_7_flash_gguf_matches_transformers(tiny_glm4_moe_lite_dir, tmp_path, gguf_cache):
    """GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``), which llama.cpp's converter writes as a DeepSeek-V3 (``deepseek2``:
    its DeepseekV2Model, the leading dense layers from the release's ``first_k_dense_replace``), is read by the same
    mapping into DeepSeek-V3's config, which computes as GLM-4.7-Flash's: the sizes are the folder's, its tensors
    are, its logits equal transformers' Glm4MoeLite on the folder, and the engine's greedy output with n-gram drafts
    on the GGUF equals the folder's."""
    path = write_deepseek_gguf(tiny_glm4_moe_lite_dir, tmp_path / "glm.gguf")
    config = load_hf_config(str(path))
    assert (config.model_type, config.first_k_dense_replace, config.rope_interleave) == ("deepseek_v3", 1, True)
    fields = ("num_hidden_layers", "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
              "n_shared_experts", "routed_scaling_factor", "norm_topk_prob", "moe_intermediate_size",
              "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps", "rope_parameters")
    assert_gguf_serves_as_its_folder(tiny_glm4_moe_lite_dir, path, fields)


def write_minicpm3_gguf(folder: Path, out: Path) -> Path:
    """A GGUF of a MiniCPM3 folder written as llama.cpp's converter writes one (its MiniCPM3Model over TextModel): the
    sizes, the latent attention's ranks and key width, the rotated share; no RoPE base, no value width, none of the
    scales (llama.cpp fixes them); LongRoPE's factors as two tensors; every tensor as released under gguf-py's name,
    none permuted, no ``lm_head`` when tied; its sentencepiece vocabulary."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg["rope_parameters"]
    assert rope["rope_theta"] == 10000.0 and cfg["v_head_dim"] == cfg["hidden_size"] // cfg["num_attention_heads"]
    assert {k: cfg[k] for k in ("scale_emb", "scale_depth", "dim_model_base")} == \
        {"scale_emb": 12, "scale_depth": 1.4, "dim_model_base": 256}, "llama.cpp fixes MiniCPM3's scales"
    w = gguf.GGUFWriter(str(out), "minicpm3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    w.add_key_length(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    if rope["rope_type"] == "longrope":
        w.add_tensor("rope_factors_long.weight", torch.tensor(rope["long_factor"]).numpy())
        w.add_tensor("rope_factors_short.weight", torch.tensor(rope["short_factor"]).numpy())
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MINICPM3, cfg["num_hidden_layers"])
    for name, value in load_file(str(folder / "model.safetensors")).items():
        if not (name == "lm_head.weight" and cfg["tie_word_embeddings"]):
            _add_renamed(w, names, name, value)
    _write_out(w)
    return out


def test_a_minicpm3_gguf_matches_transformers(make_tiny_model, tmp_path, gguf_cache):
    """A GGUF of MiniCPM3 as llama.cpp writes it (the latent attention's widths, its tensors as released; LongRoPE's
    factors as tensors; its scales in no key, fixed by llama.cpp as MiniCPM3-4B sets them; a sentencepiece
    vocabulary) is read by specray's own mapping: its config is the folder's, its tensors are, its logits equal
    transformers' on the folder, its tokenizer tokenizes as the folder's, and the engine's greedy output with n-gram
    drafts on the GGUF equals the folder's."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 2.1, 3.7],
            "long_factor": [1.2, 2.5, 6.0, 9.0], "original_max_position_embeddings": 1024}
    folder = make_tiny_model(tmp_path / "minicpm3", "minicpm3", seed=39, spm="llama", num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                             qk_rope_head_dim=8, v_head_dim=16, head_dim=8, scale_emb=12, scale_depth=1.4,
                             dim_model_base=256, rope_parameters=rope, tie_word_embeddings=True)
    path = write_minicpm3_gguf(folder, tmp_path / "minicpm3.gguf")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "scale_emb",
              "scale_depth", "dim_model_base", "rope_parameters", "intermediate_size", "tie_word_embeddings",
              "vocab_size", "rms_norm_eps", "max_position_embeddings", "bos_token_id", "eos_token_id")
    assert_gguf_serves_as_its_folder(folder, path, fields)
    assert_same_tokenizer(folder, path)


def test_a_smollm3_gguf_matches_transformers(make_tiny_model, tmp_path, gguf_cache):
    """A GGUF of SmolLM3 as llama.cpp writes it (a Llama's layout: its query and key rows in llama.cpp's RoPE order;
    its NoPE layers in no key, every 4th as llama.cpp fixes them) is read by specray's own mapping: its config is the
    folder's (the same layers without RoPE), its logits equal transformers' on the original folder, and the engine's
    greedy output with n-gram drafts on the GGUF equals the folder's."""
    # the release's pattern (every 4th layer without RoPE): a GGUF cannot carry another (tiny_smollm3_dir's)
    tiny_smollm3_dir = make_tiny_model(tmp_path / "smollm3", "smollm3", seed=14, num_hidden_layers=8,
                                       no_rope_layer_interval=4)
    assert load_hf_config(str(tiny_smollm3_dir)).no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]
    path = write_gguf(tiny_smollm3_dir, tmp_path / "smollm3.gguf", "smollm3")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "no_rope_layers", "rope_parameters", "intermediate_size", "tie_word_embeddings", "vocab_size",
              "rms_norm_eps", "attention_bias", "mlp_bias", "use_sliding_window")
    assert_gguf_serves_as_its_folder(tiny_smollm3_dir, path, fields)


# text a sentencepiece vocabulary must take apart as the original tokenizer does: BOS, turn markers whole, runs of
# spaces and newlines, characters the vocabulary lacks as their bytes
SPM_TEXTS = ["Hello world", " Hello  world", "def add(a, b):\n    return a + b", "na\u00efve caf\u00e9 \u65e5\u672c",
             "<start_of_turn>user\nHi<end_of_turn>\n", "  two  spaces\n\n", "The quick brown fox."]


def assert_same_tokenizer(folder: Path, path: Path) -> None:
    """The tokenizer specray loads for the GGUF tokenizes every one of ``SPM_TEXTS`` as the folder's does, and
    decodes the ids back alike."""
    ours, theirs = loader.load_tokenizer(str(path)), loader.load_tokenizer(str(folder))
    for text in SPM_TEXTS:
        ids = theirs(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text


def test_a_gemma_gguf_matches_transformers(make_tiny_model, tmp_path, gguf_cache):
    """A GGUF of Gemma (the first) as llama.cpp writes it (the release's layout, q/k rows as they are; the norms'
    weights as the 1 + w they scale by; no RoPE base; a sentencepiece vocabulary without a prefix space) is read by
    specray's own mapping: its config is the folder's, its tensors are, its logits equal transformers' on the folder,
    its tokenizer tokenizes as the folder's, and the engine's greedy output with n-gram drafts on the GGUF equals the
    folder's."""
    from safetensors.torch import load_file, save_file

    folder = make_tiny_model(tmp_path / "gemma", "gemma", seed=28, spm="gemma", head_dim=32, hidden_act="gelu",
                             tie_word_embeddings=True)
    # the norms' weights on a grid of 2^-10, which the file's float32 1 + w holds exactly: read back, they must
    # equal the folder's
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: (v * 1024).round() / 1024 if k.endswith("norm.weight") else v for k, v in weights.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    path = write_gguf(folder, tmp_path / "gemma.gguf", "gemma")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rope_parameters", "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps",
              "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id")
    assert_gguf_serves_as_its_folder(folder, path, fields)
    assert_same_tokenizer(folder, path)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])
def test_a_sentencepiece_gguf_tokenizes_as_its_folder(make_tiny_model, tmp_path, gguf_cache, arch):
    """The GGUFs of Llama 2 and Mistral, and of Gemma 2 and 3, carry a sentencepiece vocabulary (llama.cpp's
    ``llama``: pieces, scores and types, no merges), not a byte-level BPE one; through transformers' path it
    tokenizes as the folder's tokenizer does, and the engine's greedy output on the GGUF equals the folder's."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    kind, overrides = GGUF_TINY[arch]
    folder = make_tiny_model(tmp_path / kind, kind, seed=9, spm="gemma" if arch.startswith("gemma") else "llama",
                             **overrides)
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", arch)
    assert_same_tokenizer(folder, path)
    prompts = ["The quick brown fox", " def add(a, b):"]
    outs = [runs.token_ids(LLM(model=str(m), max_model_len=128).generate(prompts, runs.greedy(12), use_tqdm=False))
            for m in (folder, path)]
    assert outs[0] == outs[1]


def test_gguf_rope_settings_are_read_as_llama_cpp_wrote_them_or_refused(tmp_path):
    """The RoPE of a GGUF (``rope_parameters``: every reader's and transformers' path's): linear and YaRN scaling from
    ``rope.scaling.*``, Llama 3's per-frequency factors as LongRoPE's (no scaling where they are all 1); what the HF
    config cannot say (llama.cpp's own YaRN extrapolation factor, factors with another scaling or of the wrong count,
    another kind of scaling) is a ValueError naming the key and the way out."""
    from specray.models.gguf_read import GGUFMeta, rope_parameters

    def read(factors=None, rotated=8, **keys):
        meta = {f"llama.{k.replace('__', '.')}": v for k, v in {"rope__freq_base": 500000.0, "context_length": 512,
                                                                **keys}.items()}
        return rope_parameters(GGUFMeta(meta, "llama", tmp_path / "m.gguf"), factors, rotated)

    assert read() == {"rope_type": "default", "rope_theta": 500000.0}
    assert read(rope__scaling__type="linear", rope__scaling__factor=4.0) == \
        {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}
    assert read(rope__scaling__type="yarn", rope__scaling__factor=4.0, rope__scaling__original_context_length=128,
                rope__scaling__yarn_beta_fast=16.0) == \
        {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 128,
         "beta_fast": 16.0}
    assert read(torch.ones(4)) == {"rope_type": "default", "rope_theta": 500000.0}
    assert read(torch.tensor([1.0, 1.5, 8.0, 8.0]))["short_factor"] == [1.0, 1.5, 8.0, 8.0]
    assert read(rope__scaling__type="yarn", rope__scaling__factor=4.0, rope__scaling__original_context_length=128,
                rope__scaling__yarn_attn_factor=1.2)["attention_factor"] == 1.2
    assert read(rope__scaling__type="yarn", rope__scaling__factor=4.0, rope__scaling__original_context_length=128,
                rope__scaling__attn_factor=1.3)["attention_factor"] == 1.3  # OLMo 3's older files
    with pytest.raises(ValueError, match="llama.rope.scaling.yarn_ext_factor, a YaRN setting of llama.cpp's own.*HF "
                                         "checkpoint"):
        read(rope__scaling__type="yarn", rope__scaling__factor=4.0, rope__scaling__original_context_length=128,
             rope__scaling__yarn_ext_factor=1.0)
    for factors, scaling in ((torch.ones(3), "none"), (torch.ones(4) * 2, "linear")):
        with pytest.raises(ValueError, match="per-frequency RoPE factors .*not Llama 3's scaling.*HF checkpoint"):
            read(factors, rope__scaling__type=scaling, rope__scaling__factor=2.0)
    with pytest.raises(ValueError, match="llama.rope.scaling.type='longrope'; specray reads a llama GGUF with linear"):
        read(rope__scaling__type="longrope")


def test_an_afm_gguf_matches_transformers(make_tiny_model, tmp_path, gguf_cache):
    """A GGUF of Arcee's AFM as llama.cpp writes it (a Llama's layout: the query and key rows in llama.cpp's RoPE
    order, heads of their own size; a gateless relu^2 MLP; Llama 3's RoPE scaling as the per-frequency factors
    ``rope_freqs``) is read by specray's own mapping: its config is the folder's (the factors as LongRoPE's, the
    same for any length), its logits equal transformers' on the original folder, and the engine's greedy output
    with n-gram drafts on the GGUF equals the folder's."""
    rope = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # every kind of frequency, as "llama"
    folder = make_tiny_model(tmp_path / "arcee", "arcee", seed=23, head_dim=16, tie_word_embeddings=False,
                             original_max_position_embeddings=64, rope_parameters=rope)
    path = write_gguf(folder, tmp_path / "arcee.gguf", "arcee")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "hidden_act", "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps",
              "attention_bias", "mlp_bias")
    assert_gguf_serves_as_its_folder(folder, path, fields)
    factors = llama3_rope_freqs(json.loads((folder / "config.json").read_text()))
    assert 1 < len(set(factors.tolist())) - 2  # some blended between 1 and the factor
    rope = dict(load_hf_config(str(path)).rope_parameters)
    for kind in ("short_factor", "long_factor"):  # the file's float32 factors, as decimals that read back as them
        assert torch.equal(torch.tensor(rope.pop(kind), dtype=torch.float32), factors)
    assert rope == {"rope_type": "longrope", "rope_theta": 100.0, "attention_factor": 1.0,
                    "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("fixture", ["tiny_granitemoe_dir", "tiny_granitemoeshared_dir"])
def test_a_granite_moe_gguf_matches_transformers(request, tmp_path, gguf_cache, fixture):
    """A GGUF of Granite 3's MoE, with or without its shared MLP, as llama.cpp writes it (a Llama's layout, the query
    and key rows in llama.cpp's RoPE order; the four multipliers; the experts' fused gate/up, and the shared MLP's,
    split in two) is read by specray's own mapping into the release's layout (``input_linear``, ``output_linear``,
    ``router.layer``): its config is the folder's, its tensors are, its logits equal transformers' on the folder, and
    the engine's greedy output with n-gram drafts on the GGUF equals the folder's."""
    folder = request.getfixturevalue(fixture)
    path = write_gguf(folder, tmp_path / "granitemoe.gguf", "granitemoe")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling",
              "num_local_experts", "num_experts_per_tok", "shared_intermediate_size", "rope_parameters",
              "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps")
    assert_gguf_serves_as_its_folder(folder, path, fields)


def test_an_apertus_gguf_matches_transformers(make_tiny_model, tmp_path, gguf_cache):
    """A GGUF of Apertus as llama.cpp writes it (a Llama's layout without the RoPE reordering; q/k norms; Llama 3's
    RoPE factors; the gateless MLP's xIELU scalars as four metadata arrays, one value per layer) is read by specray's
    own mapping: its config is the folder's, its tensors are (the scalars rebuilt per layer), its logits equal
    transformers' on the folder, and the engine's greedy output with n-gram drafts on the GGUF equals the folder's."""
    # tiny_apertus_dir's, the pretrained length also at the top of the config, where llama.cpp's converter reads it
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    folder = make_tiny_model(tmp_path / "apertus", "apertus", seed=37, head_dim=16, dtype="float32",
                             rope_parameters=rope, original_max_position_embeddings=16, tie_word_embeddings=False)
    path = write_gguf(folder, tmp_path / "apertus.gguf", "apertus")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "hidden_act", "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps")
    assert_gguf_serves_as_its_folder(folder, path, fields)


def test_a_granite_gguf_matches_transformers(tiny_granite_dir, tmp_path, gguf_cache):
    """A GGUF of Granite 3 (dense) as llama.cpp writes it (a Llama's layout, the query and key rows in llama.cpp's
    RoPE order; its four multipliers as scales) is read by specray's own mapping: its config is the folder's, its
    logits equal transformers' on the original folder, and the engine's greedy output with n-gram drafts on the GGUF
    equals the folder's."""
    path = write_gguf(tiny_granite_dir, tmp_path / "granite.gguf", "granite")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling",
              "rope_parameters", "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps")
    assert_gguf_serves_as_its_folder(tiny_granite_dir, path, fields)


@pytest.mark.parametrize("arch, fixture", [("command-r", "tiny_cohere_dir"), ("cohere2", "tiny_cohere2_dir")])
def test_a_cohere_gguf_matches_transformers(request, tmp_path, gguf_cache, arch, fixture):
    """A GGUF of Command R+ (per-head q/k LayerNorms, RoPE on every layer) or Command R7B / Command A (three layers of
    four sliding over a window with RoPE, the fourth global without: as llama.cpp fixes it) as llama.cpp writes them
    (one LayerNorm per layer, its epsilon as ``layer_norm_epsilon``, the logit scale, the weights as released: RoPE on
    interleaved pairs in llama.cpp too) is read by specray's own mapping: its config is the folder's, its tensors are,
    its logits equal transformers' on the folder, and the engine's greedy output with n-gram drafts on the GGUF equals
    the folder's."""
    folder = request.getfixturevalue(fixture)
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", arch)
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "rope_parameters", "intermediate_size", "tie_word_embeddings", "vocab_size", "layer_norm_eps",
              "logit_scale", "use_qk_norm", "sliding_window", "layer_types")
    assert_gguf_serves_as_its_folder(folder, path, fields)


def test_a_hunyuan_dense_gguf_matches_transformers(tiny_hunyuan_v1_dense_dir, tmp_path, gguf_cache):
    """A GGUF of Hunyuan's dense model as llama.cpp writes it (a plain layout, q/k norms; the RoPE base stretched by
    the release's NTK alpha, written as the file's base with no scaling; its end-of-generation token as EOS) is read
    by specray's own mapping: its config is the folder's but for the RoPE, which rotates by the same frequencies
    (the logits say so), its tensors are the folder's, its logits equal transformers' on the folder, and the engine's
    greedy output with n-gram drafts on the GGUF equals the folder's."""
    path = write_gguf(tiny_hunyuan_v1_dense_dir, tmp_path / "hunyuan.gguf", "hunyuan-dense")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps", "attention_bias")
    assert_gguf_serves_as_its_folder(tiny_hunyuan_v1_dense_dir, path, fields)
    config = load_hf_config(str(path))
    assert config.rope_parameters["rope_type"] == "default" and config.eos_token_id == 3  # its eod_token_id


def test_a_hunyuan_moe_gguf_matches_transformers(tiny_hunyuan_v1_moe_dir, tmp_path, gguf_cache):
    """A GGUF of Hunyuan's MoE (Hunyuan-A13B) as llama.cpp writes it (a plain layout, q/k norms; the RoPE base
    stretched by the release's NTK alpha, written as the file's base; the experts stacked per projection beside the
    shared MLP, both as wide as ``feed_forward_length``) is read by specray's own mapping: its config is the folder's
    but for the RoPE, which rotates by the same frequencies (the logits say so), its tensors are the folder's, its
    logits equal transformers' on the folder, and the engine's greedy output with n-gram drafts on the GGUF equals the
    folder's. A file whose experts and shared MLP differ in width is refused (transformers' Hunyuan has one)."""
    import gguf as gguf_py

    path = write_gguf(tiny_hunyuan_v1_moe_dir, tmp_path / "hunyuan.gguf", "hunyuan-moe")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "num_experts", "moe_topk", "tie_word_embeddings", "vocab_size",
              "rms_norm_eps", "attention_bias")
    assert_gguf_serves_as_its_folder(tiny_hunyuan_v1_moe_dir, path, fields)
    assert load_hf_config(str(path)).rope_parameters["rope_type"] == "default"
    reader = gguf_py.GGUFReader(str(path))
    w = gguf_py.GGUFWriter(str(tmp_path / "other.gguf"), "hunyuan-moe")
    for field in reader.fields.values():  # the same file, its experts 16 wide
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == "hunyuan-moe.expert_feed_forward_length":
            value = 16
        w.add_key_value(field.name, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data)
    _write_out(w)
    with pytest.raises(ValueError, match="experts 16 wide beside a shared MLP 32 wide"):
        load_hf_config(str(tmp_path / "other.gguf"))


def test_a_ministral3_gguf_matches_transformers(tiny_ministral3_dir, tmp_path, gguf_cache):
    """A GGUF of Ministral 3 as llama.cpp writes it (a Llama's layout, the query and key rows in llama.cpp's RoPE
    order; YaRN with its log multiplier, the queries' scaling by position as ``attention.temperature_scale``) is read
    by specray's own mapping: its config is the folder's (the pretrained length of 8 makes the prompts' positions
    reach several steps of the query scaling), its tensors are, its logits equal transformers' on the folder, and the
    engine's greedy output with n-gram drafts on the GGUF equals the folder's. A multiplier other than the releases'
    1 is refused, naming the way out."""
    path = write_gguf(tiny_ministral3_dir, tmp_path / "ministral3.gguf", "mistral3")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rope_parameters", "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps")
    assert_gguf_serves_as_its_folder(tiny_ministral3_dir, path, fields)
    rope = json.loads((tiny_ministral3_dir / "config.json").read_text())["rope_parameters"]
    changed = copy_config(tiny_ministral3_dir, tmp_path / "other", rope_parameters={**rope, "mscale_all_dim": 0.5})
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_ministral3_dir / name, changed / name)
    with pytest.raises(ValueError, match="yarn_log_multiplier=0.5; specray reads a Ministral 3 GGUF with the "
                                         "releases' 1"):
        load_hf_config(str(write_gguf(changed, tmp_path / "other.gguf", "mistral3")))


def test_an_olmo_gguf_matches_transformers(tiny_olmo_dir, tmp_path, gguf_cache):
    """A GGUF of the first OLMo as llama.cpp writes it (a Llama's layout: its query and key rows in llama.cpp's RoPE
    order; no norm tensors, its LayerNorms having no weights; the q/k/v clamp as ``attention.clamp_kqv``) is read by
    specray's own mapping: its config is the folder's, its tensors are, its logits equal transformers' on the folder,
    and the engine's greedy output with n-gram drafts on the GGUF equals the folder's."""
    path = write_gguf(tiny_olmo_dir, tmp_path / "olmo.gguf", "olmo")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "clip_qkv", "rope_parameters", "intermediate_size", "tie_word_embeddings", "vocab_size",
              "attention_bias")
    assert_gguf_serves_as_its_folder(tiny_olmo_dir, path, fields)


def test_a_dots1_gguf_matches_transformers(make_tiny_model, tmp_path, gguf_cache):
    """A GGUF of dots.llm1 as llama.cpp writes it (a Qwen2-MoE's layout: q/k norms, no RoPE reordering; the experts
    stacked per projection, the shared experts, the sigmoid router's groups, correction bias and scale, the dense
    first layer) is read by specray's own mapping: its config is the folder's, its tensors are, its logits equal
    transformers' on the folder, and the engine's greedy output with n-gram drafts on the GGUF equals the folder's."""
    # tiny_dots1_dir's without its window (the release has none, llama.cpp's converter writes none)
    folder = make_tiny_model(tmp_path / "dots1", "dots1", seed=20, head_dim=16, num_hidden_layers=3,
                             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                             n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                             routed_scaling_factor=1.5, tie_word_embeddings=False)
    path = write_gguf(folder, tmp_path / "dots1.gguf", "dots1")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
              "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group",
              "rope_parameters", "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps",
              "layer_types")
    assert_gguf_serves_as_its_folder(folder, path, fields)


def with_mtp_block(path: Path, out: Path) -> Path:
    """``path``'s GGUF with an MTP layer after its own, as llama.cpp's converter keeps one: ``block_count`` one more,
    ``nextn_predict_layers`` 1, and a block (the last layer's tensors again) with its ``nextn.*`` tensors."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    layers = reader.fields[f"{arch}.block_count"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == f"{arch}.block_count":
            value = layers + 1
        if field.name == f"{arch}.nextn_predict_layers":
            value = 1
        w.add_key_value(field.name, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data)
        if t.name.startswith(f"blk.{layers - 1}."):
            w.add_tensor(t.name.replace(f"blk.{layers - 1}.", f"blk.{layers}.", 1), t.data)
    hidden = reader.fields[f"{arch}.embedding_length"].contents()
    w.add_tensor(f"blk.{layers}.nextn.eh_proj.weight", torch.zeros(hidden, 2 * hidden).numpy())
    for name in ("enorm", "hnorm", "shared_head_norm"):
        w.add_tensor(f"blk.{layers}.nextn.{name}.weight", torch.ones(hidden).numpy())
    _write_out(w)
    return out


def test_a_k_exaone_gguf_matches_transformers(make_tiny_model, tmp_path, gguf_cache):
    """A GGUF of K-EXAONE as llama.cpp writes it (its ExaoneMoEModel: EXAONE 4.0's window and sliding layers, pre-norm
    layers with q/k norms, a dense first layer, then experts stacked per projection beside a shared one, the router's
    groups, correction bias and scale; an MTP layer, kept by the converter, which specray leaves out) is read by
    specray's own mapping: its config is the folder's, its tensors are, its logits equal transformers' on the
    folder, and the engine's greedy output with n-gram drafts on the GGUF equals the folder's."""
    # tiny_exaone_moe_dir's, its layers' kinds as the release writes them (first_k_dense_replace)
    folder = make_tiny_model(tmp_path / "exaone_moe", "exaone_moe", seed=32, head_dim=16, num_hidden_layers=4,
                             sliding_window=8, sliding_window_pattern=4, first_k_dense_replace=1,
                             mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, n_group=2,
                             topk_group=1, routed_scaling_factor=1.5, tie_word_embeddings=False)
    path = with_mtp_block(write_gguf(folder, tmp_path / "plain.gguf", "exaone-moe"), tmp_path / "exaone.gguf")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "sliding_window", "layer_types", "mlp_layer_types", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "num_shared_experts", "first_k_dense_replace", "routed_scaling_factor",
              "norm_topk_prob", "n_group", "topk_group", "rope_parameters", "intermediate_size",
              "tie_word_embeddings", "vocab_size", "rms_norm_eps")
    assert_gguf_serves_as_its_folder(folder, path, fields)


def test_an_ernie4_5_moe_gguf_matches_transformers(tiny_ernie4_5_moe_dir, tmp_path, gguf_cache):
    """A GGUF of ERNIE 4.5's MoE as llama.cpp writes it (a dense first layer, then experts stacked per projection,
    two shared experts, the router's correction bias renamed to a ``.bias``) is read by specray's own mapping: its
    config is the folder's, its tensors are, its logits equal transformers' on the folder, and the engine's greedy
    output with n-gram drafts on the GGUF equals the folder's."""
    path = write_gguf(tiny_ernie4_5_moe_dir, tmp_path / "ernie4_5_moe.gguf", "ernie4_5-moe")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rope_parameters", "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps",
              "use_bias", "moe_num_experts", "moe_k", "moe_intermediate_size", "moe_num_shared_experts",
              "moe_layer_start_index", "moe_layer_interval", "moe_layer_end_index")
    assert_gguf_serves_as_its_folder(tiny_ernie4_5_moe_dir, path, fields)


@pytest.mark.parametrize("arch", ["olmo2", "seed_oss", "ernie4_5", "glm4"])
def test_a_plain_layout_gguf_matches_transformers(request, tmp_path, gguf_cache, arch):
    """A GGUF of OLMo 2 (norms after attention and MLP, q/k normed over all heads), Seed-OSS (q/k/v biases, none on
    o_proj, heads apart from hidden / heads) ERNIE 4.5 (dense: biases everywhere) or GLM-4 (sandwich norms, a fused
    gate/up, RoPE over half of each head) as llama.cpp writes them (a plain layout: no RoPE reordering) is read by
    specray's own mapping: its config is the folder's, its logits equal transformers' on the original folder, and
    the engine's greedy output with n-gram drafts on the GGUF equals the folder's; so does OLMo 3's (an OLMo 2 with
    sliding-window layers: plain RoPE on those, of their own base, YaRN on the full ones)."""
    folder = request.getfixturevalue(f"tiny_{arch}_dir")
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", arch)
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rope_parameters", "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps",
              "attention_bias", "use_bias") + (("attention_out_bias",) if arch == "seed_oss" else ())
    assert_gguf_serves_as_its_folder(folder, path, fields)
    if arch == "olmo2":
        folder = request.getfixturevalue("tiny_olmo3_dir")
        olmo3 = write_gguf(folder, tmp_path / "olmo3.gguf", "olmo2")
        assert_gguf_serves_as_its_folder(folder, olmo3, fields[:-2] + ("sliding_window", "layer_types"))


@pytest.mark.parametrize("shape", ["windowed", "global"])
def test_an_exaone4_gguf_matches_transformers(make_tiny_model, tmp_path, gguf_cache, shape):
    """A GGUF of EXAONE 4.0 as llama.cpp writes it (a plain layout; post-norm layers and q/k norms; Llama 3's RoPE
    scaling as per-frequency factors, as the releases scale; the 32B's shape: three layers sliding over a window with
    RoPE to one global without, marked per layer in the file; the 1.2B's: every layer global, with RoPE) is read by
    specray's own mapping: its config is the folder's, its logits equal transformers' on the original folder, and the
    engine's greedy output with n-gram drafts on the GGUF equals the folder's."""
    rope = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 16.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # every kind of frequency, as "llama"
    window = dict(sliding_window=8, sliding_window_pattern=4) if shape == "windowed" else \
        dict(sliding_window=None, layer_types=["full_attention"] * 4)
    folder = make_tiny_model(tmp_path / "exaone4", "exaone4", seed=22, head_dim=16, num_hidden_layers=4,
                             tie_word_embeddings=False, original_max_position_embeddings=64, rope_parameters=rope,
                             **window)
    path = write_gguf(folder, tmp_path / "exaone4.gguf", "exaone4")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "sliding_window", "layer_types", "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps")
    assert_gguf_serves_as_its_folder(folder, path, fields)
    assert load_hf_config(str(path)).rope_parameters["rope_type"] == "longrope"


def write_llama4_gguf(folder: Path, out: Path, window: int | None = None) -> Path:
    """A GGUF of a Llama 4 text folder written as llama.cpp's converter writes one (its Llama4Model over LlamaModel):
    the dense layers' width as ``feed_forward_length`` and the experts' as ``expert_feed_forward_length``, the MoE
    interleave step, Llama 3's RoPE scaling as ``rope_freqs``; the query and key rows as released (no RoPE reordering),
    the experts' fused ``gate_up_proj`` [E, H, 2I] split into gate and up and transposed to [E, I, H] each, their
    ``down_proj`` transposed, every tensor renamed through gguf-py's tensor map. ``window``: an
    ``attention.sliding_window`` (the converter writes 0 for a model whose layers are all full: MobileLLM's)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(out), "llama4")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size_mlp"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_interleave_moe_layer_step(cfg["interleave_moe_layer_step"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    if window is not None:
        w.add_sliding_window(window)
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    if cfg["rope_parameters"].get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg).numpy())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA4, layers)
    for name, value in load_file(str(folder / "model.safetensors")).items():
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        if name.endswith("experts.gate_up_proj"):
            gate, up = value.transpose(-1, -2).split(value.shape[-1] // 2, dim=-2)
            for projection, part in (("gate_proj", gate), ("up_proj", up)):
                _add_renamed(w, names, name.replace("gate_up_proj", f"{projection}.weight"), part)
            continue
        if name.endswith("experts.down_proj"):
            name, value = name + ".weight", value.transpose(-1, -2)
        _add_renamed(w, names, name, value)
    _write_out(w)
    return out


@pytest.mark.parametrize("shape", ["scout", "maverick"])
def test_a_llama4_gguf_matches_transformers(make_tiny_model, tmp_path, gguf_cache, shape):
    """A GGUF of Llama 4's text model as llama.cpp writes it (see write_llama4_gguf) is read by specray's own mapping:
    its config is the folder's -- the NoPE layers, chunk size, temperature tuning and q/k norms no key carries, as
    llama.cpp fixes them (the Scout shape: experts in every layer, q/k norms, Llama 3's RoPE scaling with equal low and
    high frequency factors; the Maverick shape: 128 experts every other layer, no q/k norm) --, its tensors are the
    folder's, its logits equal transformers' on the original folder, and the engine's greedy output with n-gram
    drafts on the GGUF equals the folder's. One whose layers are all full (MobileLLM's) is refused, naming the way
    out."""
    if shape == "scout":
        rope = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 16.0, "low_freq_factor": 1.0,
                "high_freq_factor": 1.0, "original_max_position_embeddings": 64}  # wavelengths either side of 64
        kind = dict(num_local_experts=4, interleave_moe_layer_step=1, use_qk_norm=True, rope_parameters=rope,
                    original_max_position_embeddings=64)
    else:
        kind = dict(num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False)
    folder = make_tiny_model(tmp_path / "llama4", "llama4", seed=7, num_hidden_layers=8, head_dim=16,
                             num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=48,
                             tie_word_embeddings=False, **kind)
    path = write_llama4_gguf(folder, tmp_path / "llama4.gguf")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "intermediate_size_mlp", "num_local_experts", "num_experts_per_tok",
              "interleave_moe_layer_step", "moe_layers", "no_rope_layers", "layer_types", "attention_chunk_size",
              "use_qk_norm", "attn_temperature_tuning", "floor_scale", "attn_scale", "tie_word_embeddings",
              "vocab_size", "rms_norm_eps") + (() if shape == "scout" else ("rope_parameters",))
    assert_gguf_serves_as_its_folder(folder, path, fields)
    with pytest.raises(ValueError, match="sliding_window 0 \\(llama.cpp's MobileLLM shape.*HF checkpoint"):
        load_hf_config(str(write_llama4_gguf(folder, tmp_path / "full.gguf", window=0)))


@pytest.mark.parametrize("arch, kind, overrides", [
    ("qwen2vl", "qwen2", dict(tie_word_embeddings=False)),
    ("qwen3vl", "qwen3", dict(head_dim=24, tie_word_embeddings=True)),  # heads of their own width, as released
    ("qwen3vlmoe", "qwen3_moe", dict(head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                     norm_topk_prob=True, decoder_sparse_step=1, tie_word_embeddings=False))])
def test_a_qwen_vl_text_gguf_matches_transformers(make_tiny_model, tmp_path, gguf_cache, arch, kind, overrides):
    """A GGUF of the text model of Qwen2-VL / Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE as llama.cpp writes it (a Qwen2, a
    Qwen3 or a Qwen3-MoE under an architecture of its own, with multimodal RoPE sections and, the Qwen3-VLs, a
    deepstack count, neither of which changes a text-only sequence) is read by specray's own mapping as that Qwen:
    its config is the folder's, its tensors are, its logits equal transformers' on the folder, and the engine's greedy
    output with n-gram drafts on the GGUF equals the folder's."""
    folder = make_tiny_model(tmp_path / kind, kind, seed=31, **overrides)
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", arch)
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rope_parameters", "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
    assert_gguf_serves_as_its_folder(folder, path, fields)


def write_glm4_moe_gguf(folder: Path, out: Path) -> Path:
    """A GGUF of a GLM-4.5 folder (its MTP layer included) written as llama.cpp's converter writes one (its
    Glm4MoeModel over TextModel): ``block_count`` with the MTP layers, ``nextn_predict_layers``, the rotated share of
    each head as ``rope.dimension_count``, the router's settings; no RoPE reordering, each MoE layer's experts stacked
    per projection, the correction bias renamed to a ``.bias``; every tensor renamed through gguf-py's tensor map (the
    MTP layer's own as ``nextn.*``)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    layers, nextn = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)
    rope, head_dim = cfg["rope_parameters"], cfg["head_dim"]
    w = gguf.GGUFWriter(str(out), "glm4moe")
    w.add_block_count(layers + nextn)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    _write_sigmoid_router(w, cfg, cfg["first_k_dense_replace"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
    w.add_nextn_predict_layers(nextn)
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, layers + nextn)
    stacked: dict[tuple[int, str], list] = {}
    for name, value in load_file(str(folder / "model.safetensors")).items():
        if _held_expert(stacked, name, value):
            continue
        _add_renamed(w, names, name, value)
    _add_stacked_experts(w, names, stacked)
    _write_out(w)
    return out


def test_a_glm4_moe_gguf_with_its_mtp_layer_drafts_as_its_folder(tiny_glm4_moe_dir, tmp_path, gguf_cache):
    """A GGUF of GLM-4.5 as llama.cpp writes it, its MTP layer included (``nextn_predict_layers``, the layer's block
    and its ``nextn.*`` tensors; q/k/v biases and norms, partial RoPE in NeoX order, the grouped sigmoid router with its
    correction bias, stacked and shared experts, a dense first layer) is read by specray's own mapping: its config is
    the folder's, its logits equal transformers' on the folder, and ``method="mtp"`` on the GGUF makes the drafts and
    the greedy tokens it makes on the folder (experts per expert, as the releases name them)."""
    import specray_test_draft_heads as draft_heads  # tests/draft_heads.py (registered by conftest)
    from specray import LLM
    from specray_test_checkpoints import split_experts

    runs = sys.modules["specray_test_engine_runs"]
    folder = split_experts(draft_heads.write_deepseek_mtp(tmp_path / "glm_mtp", tiny_glm4_moe_dir, bias_std=0.1),
                           tmp_path / "glm")
    path = write_glm4_moe_gguf(folder, tmp_path / "glm.gguf")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_nextn_predict_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rope_parameters", "n_routed_experts", "num_experts_per_tok",
              "n_group", "topk_group", "n_shared_experts", "routed_scaling_factor", "norm_topk_prob",
              "first_k_dense_replace",
              "moe_intermediate_size", "intermediate_size", "attention_bias", "use_qk_norm", "tie_word_embeddings",
              "vocab_size", "rms_norm_eps")
    assert_gguf_serves_as_its_folder(folder, path, fields)
    mtp = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    llms = [LLM(model=str(m), max_model_len=128, speculative_config=mtp) for m in (folder, path)]
    prompts = ["The quick brown fox", "def add(a, b):"]  # (the file's tokenizer pre-splits a run of spaces otherwise)
    outs = [runs.token_ids(llm.generate(prompts, runs.greedy(12), use_tqdm=False)) for llm in llms]
    assert outs[0] == outs[1]
    stats = [(llm.spec_stats.draft_tokens, llm.spec_stats.accepted_tokens) for llm in llms]
    assert stats[0] == stats[1] and stats[0][1] > 0, stats


def test_an_olmoe_gguf_matches_transformers(make_tiny_model, tmp_path, gguf_cache):
    """A GGUF of OLMoE as llama.cpp writes it (OLMo 2's q/k norms over all heads, experts in every layer stacked per
    projection, no RoPE reordering) is read by specray's own mapping, its experts split back per expert: its config is
    the folder's, its logits equal transformers' on the original folder, and the engine's greedy output with n-gram
    drafts on the GGUF equals the folder's. (No q/k/v clamp: the file has no key for one, and the release has none.)"""
    folder = make_tiny_model(tmp_path / "olmoe", "olmoe", seed=29, num_experts=8, num_experts_per_tok=2,
                             intermediate_size=32, tie_word_embeddings=False)
    path = write_gguf(folder, tmp_path / "olmoe.gguf", "olmoe")
    fields = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "num_experts", "num_experts_per_tok", "norm_topk_prob", "clip_qkv", "rope_parameters",
              "intermediate_size", "tie_word_embeddings", "vocab_size", "rms_norm_eps")
    assert_gguf_serves_as_its_folder(folder, path, fields)
