"""Find a model (local HF folder, local ``.gguf`` file or hub id), read its config and tokenizer, and load our
model with this rank's shard of the weights.

A GGUF file is converted once with transformers' GGUF support (dequantized to float32, llama.cpp's q/k RoPE permutation
undone) into an HF folder -- config.json, safetensors shards of about ``GGUF_SHARD_BYTES`` with their index (or one
model.safetensors), tokenizer files -- cached under ``$SPECRAY_CACHE_DIR`` (default ``~/.cache/specray``) and keyed by
the file's path, size and mtime; later loads read the cached folder. Its linears and experts of llama.cpp's integer
types (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) keep their integers there (:mod:`specray.models.gguf_quant`:
dequantized at load, or the 4-bit ones kept in 4 bits where the device's kernel takes them); its other tensors are
float32 (every dequantized value exact), or with ``$SPECRAY_GGUF_DTYPE`` bfloat16 or float16 (half the disk; each
value rounded as loading the model in that dtype rounds it). The conversion reads,
converts and writes a layer at a time, so it holds about one shard, not the whole model in float32 (several times the
file). Only the families
transformers can map from GGUF load this way (``_GGUF_FAMILIES``; where its mapping misreads a file or leaves a default,
``_GGUF_CONFIG_FIXES`` and the tensors read here set what llama.cpp wrote; its RoPE scaling, Llama 3's per-frequency
factors included, by ``_fix_gguf_rope``), and the families whose config and tensors specray reads whole
(``_GGUF_READERS``): the hybrid linear-attention Qwens -- Qwen3.5 (``qwen35``), Qwen3.5-MoE (``qwen35moe``), Qwen3-Next
(``qwen3next``) -- (:mod:`specray.models.gguf_qwen3_5`) and the Mamba-2 hybrids -- Granite 4.0's hybrids and Bamba
(``granitehybrid``), Nemotron-H (``nemotron_h``), with experts (``nemotron_h_moe``: Nemotron 3), Falcon-H1
(``falcon-h1``) -- (:mod:`specray.models.gguf_mamba2`), Gemma 4's text (``gemma4``: :mod:`specray.models.gguf_gemma4`),
Gemma 3n's text (``gemma3n``: :mod:`specray.models.gguf_gemma3n`), Jamba (``jamba``:
:mod:`specray.models.gguf_jamba`), LFM2-MoE (``lfm2moe``: :mod:`specray.models.gguf_lfm2`), Kimi-Linear
(``kimi-linear``: :mod:`specray.models.gguf_kimi_linear`), the families llama.cpp writes in a Llama's layout under
architectures of their own -- Gemma (the first), SmolLM3, Arcee's AFM, Jais 2, Granite 3 (dense and MoE), OLMo 1, 2
and 3, OLMoE, Seed-OSS, ERNIE 4.5 and its MoE, GLM-4, EXAONE 4.0, Hunyuan's dense and MoE models, dots.llm1,
K-EXAONE, Command R / R+, Command R7B / A, Ministral 3, Apertus, Trinity and the Qwen VLs' text models
(:mod:`specray.models.gguf_llama_family`, ``LLAMA_FAMILY_GGUF_ARCHS``) --, DeepSeek-V3 (``deepseek2``) and GLM-5
(``glm-dsa``: :mod:`specray.models.gguf_deepseek`), GLM-4.5 with its MTP layers (``glm4moe``:
:mod:`specray.models.gguf_glm4_moe`), Llama 4 (``llama4``: :mod:`specray.models.gguf_llama4`), MiniCPM3 (``minicpm3``:
:mod:`specray.models.gguf_minicpm3`) and the classic GPT families -- GPT-2 (``gpt2``), StableLM (``stablelm``), Phi-2
(``phi2``), Falcon (``falcon``), GPT-NeoX (``gptneox``), BLOOM (``bloom``), MPT (``mpt``), GPT-BigCode / StarCoder
(``starcoder``), DBRX (``dbrx``) and GPT-J (``gptj``) -- (:mod:`specray.models.gguf_classic`), BitNet b1.58
(``bitnet``: :mod:`specray.models.gguf_bitnet`), Phi-3.5-MoE (``phimoe``: :mod:`specray.models.gguf_phimoe`),
MiMo-V2-Flash (``mimo2``: :mod:`specray.models.gguf_mimo2`), Mistral 4 (``mistral4``:
:mod:`specray.models.gguf_mistral4`); a GGUF of another architecture (of a
family specray does not serve, or one the installed transformers cannot map) is refused before any conversion, naming
the fix: load the model's HF checkpoint instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specray.config import GGUF_DTYPE_ENV, GGUF_DTYPES, LOAD_FORMATS, QUANTIZATIONS
from specray.models.cpu_kernels import can_pack, pack_linear_weights
from specray.models.fp8 import (dequantized, fp4_experts, fp8_block_size, renamed_block_scales, scale_suffix,
                                static_activations, w8a8_format)
from specray.models.gguf_bitnet import BITNET_GGUF_ARCHS, bitnet_gguf_checkpoint
from specray.models.gguf_classic import CLASSIC_GGUF_ARCHS, classic_gguf_checkpoint
from specray.models.gguf_deepseek import DEEPSEEK_GGUF_ARCHS, deepseek_gguf_checkpoint
from specray.models.gguf_gemma3n import GEMMA3N_GGUF_ARCHS, gemma3n_gguf_checkpoint
from specray.models.gguf_gemma4 import GEMMA4_GGUF_ARCHS, gemma4_gguf_checkpoint
from specray.models.gguf_glm4_moe import GLM4_MOE_GGUF_ARCHS, glm4_moe_gguf_checkpoint
from specray.models.gguf_jamba import JAMBA_GGUF_ARCHS, jamba_gguf_checkpoint
from specray.models.gguf_kimi_linear import KIMI_LINEAR_GGUF_ARCHS, kimi_linear_gguf_checkpoint
from specray.models.gguf_lfm2 import LFM2_GGUF_ARCHS, lfm2_moe_gguf_checkpoint
from specray.models.gguf_mamba2 import MAMBA2_GGUF_ARCHS, mamba2_gguf_checkpoint
from specray.models.gguf_llama4 import LLAMA4_GGUF_ARCHS, llama4_gguf_checkpoint
from specray.models.gguf_llama_family import LLAMA_FAMILY_GGUF_ARCHS, llama_family_gguf_checkpoint
from specray.models.gguf_minicpm3 import MINICPM3_GGUF_ARCHS, minicpm3_gguf_checkpoint
from specray.models.gguf_phimoe import PHIMOE_GGUF_ARCHS, phimoe_gguf_checkpoint
from specray.models.gguf_mimo2 import MIMO2_GGUF_ARCHS, mimo2_gguf_checkpoint
from specray.models.gguf_mistral4 import MISTRAL4_GGUF_ARCHS, mistral4_gguf_checkpoint
from specray.models.gguf_qwen3_5 import QWEN3_5_GGUF_ARCHS, qwen3_5_gguf_checkpoint
from specray.models.gguf_read import GGUFMeta, dequantized as gguf_dequantized, parsed_gguf, rope_parameters
from specray.models.gguf_quant import RowIndex, keeps_name, stored_weights
from specray.models.int_quant import IntScheme, IntWeight, dequantized as int_dequantized, gguf_parts, \
    gguf_quantization_config, int_scheme, keeps_int4, pack_int4, random_int4
from specray.models.mxfp4 import dequantized as mxfp4_dequantized, is_mxfp4
from specray.models.nvfp4 import MODELOPT, dequantized as nvfp4_dequantized, nvfp4_layout, renamed_kv_scales
from specray.models.fp8_blocks import keeps_block_fp8, pack_block_fp8, random_block_fp8
from specray.models.w8a8 import FP8, INT8, Format, keeps_w8a8, pack_w8a8, random_w8a8
from specray.models.moe import SparseMoE, is_expert_tensor, is_per_expert_tensor
from specray.models.interface import CausalLM
from specray.models.layers import (LinearBase, int_linears, keep_quantized_weights, quantize_linears,
                                   rope_per_kind)
from specray.models.plain_config import PlainConfig, plain_config
from specray.multimodal import VIDEO, text_only
from specray.models.registry import (get_model_class, multimodal_classes, supported_architectures, text_part,
                                     text_tensors)
from specray.parallel import PPGroup, TPGroup

logger = logging.getLogger(__name__)

CACHE_ENV = "SPECRAY_CACHE_DIR"
_GGUF_MARKER = "specray_gguf.json"  # written last: a cache folder holding it is complete
# the conversion's own version, part of a cached folder's key: raised whenever a file already converted would now
# convert to something else (2: the RoPE scaling read, Llama 3's per-frequency factors included, which conversions
# before it left out; 4: integer linears and experts kept as integers), so that no folder of an older conversion is
# served again
GGUF_CONVERSION_VERSION = 4
# a converted GGUF's tensors are written in safetensors shards of about this many bytes (plus a layer at most): the
# conversion holds one shard, not the model (whose dequantized float32 tensors are several times the file's size)
GGUF_SHARD_BYTES = 2 << 30
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
# llama.cpp's GGUF architecture (``general.architecture``) of each family we serve -> the family
_GGUF_FAMILIES = {"llama": "Llama / Mistral / Mixtral", "qwen2": "Qwen2", "qwen2moe": "Qwen2-MoE", "qwen3": "Qwen3",
                  "qwen3moe": "Qwen3-MoE", "gemma": "Gemma", "gemma2": "Gemma 2", "gemma3": "Gemma 3 text",
                  "gemma4": "Gemma 4 text", "deepseek2": "DeepSeek-V3 / R1 / Kimi K2", "llama4": "Llama-4 text",
                  "phi3": "Phi-3 / Phi-4", "lfm2": "LFM2",
                  "mamba": "Mamba", "starcoder2": "StarCoder2", "nemotron": "Nemotron", "gpt-oss": "GPT-OSS",
                  "minimax-m2": "MiniMax-M2", "qwen35": "Qwen3.5", "qwen35moe": "Qwen3.5-MoE",
                  "qwen3next": "Qwen3-Next", "granitehybrid": "Granite 4.0 hybrid / Bamba", "nemotron_h": "Nemotron-H",
                  "nemotron_h_moe": "Nemotron-H MoE / Nemotron 3", "falcon-h1": "Falcon-H1", "jamba": "Jamba",
                  "smollm3": "SmolLM3", "arcee": "Arcee AFM", "granite": "Granite 3 (dense)", "olmo2": "OLMo 2",
                  "seed_oss": "Seed-OSS", "glm4moe": "GLM-4.5", "ernie4_5": "ERNIE 4.5 (dense)",
                  "olmoe": "OLMoE", "glm4": "GLM-4 (dense)", "exaone4": "EXAONE 4.0",
                  "qwen2vl": "Qwen2-VL / Qwen2.5-VL text", "qwen3vl": "Qwen3-VL text",
                  "qwen3vlmoe": "Qwen3-VL-MoE text", "ernie4_5-moe": "ERNIE 4.5 MoE", "command-r": "Command R / R+",
                  "cohere2": "Command R7B / Command A", "mistral3": "Ministral 3",
                  "hunyuan-dense": "Hunyuan (dense)", "granitemoe": "Granite 3 MoE",
                  "kimi-linear": "Kimi-Linear", "jais2": "Jais 2",
                  "apertus": "Apertus", "minicpm3": "MiniCPM3", "dots1": "dots.llm1",
                  "hunyuan-moe": "Hunyuan (MoE)", "olmo": "OLMo (the first)", "glm-dsa": "GLM-5",
                  "exaone-moe": "K-EXAONE", "lfm2moe": "LFM2-MoE", "gpt2": "GPT-2", "stablelm": "StableLM",
                  "phi2": "Phi-1 / 1.5 / 2", "falcon": "Falcon (RoPE releases)", "gptneox": "GPT-NeoX / Pythia",
                  "bloom": "BLOOM", "mpt": "MPT", "starcoder": "GPT-BigCode / StarCoder", "dbrx": "DBRX",
                  "gemma3n": "Gemma 3n text", "gptj": "GPT-J", "bitnet": "BitNet b1.58",
                  "phimoe": "Phi-3.5-MoE", "afmoe": "Trinity",
                  "mimo2": "MiMo-V2-Flash", "mistral4": "Mistral 4"}
# llama.cpp's architectures whose config and tensors specray reads itself (transformers' GGUF mapping gives no dense
# tensors of them) -> the reader: (the GGUF, its architecture) -> (the HF config, the HF checkpoint's tensors)
_GGUF_READERS = {**dict.fromkeys(QWEN3_5_GGUF_ARCHS, qwen3_5_gguf_checkpoint),
                 **dict.fromkeys(MAMBA2_GGUF_ARCHS, mamba2_gguf_checkpoint),
                 **dict.fromkeys(GEMMA4_GGUF_ARCHS, gemma4_gguf_checkpoint),
                 **dict.fromkeys(GEMMA3N_GGUF_ARCHS, gemma3n_gguf_checkpoint),
                 **dict.fromkeys(JAMBA_GGUF_ARCHS, jamba_gguf_checkpoint),
                 **dict.fromkeys(KIMI_LINEAR_GGUF_ARCHS, kimi_linear_gguf_checkpoint),
                 **dict.fromkeys(LFM2_GGUF_ARCHS, lfm2_moe_gguf_checkpoint),
                 **dict.fromkeys(DEEPSEEK_GGUF_ARCHS, deepseek_gguf_checkpoint),
                 **dict.fromkeys(LLAMA_FAMILY_GGUF_ARCHS, llama_family_gguf_checkpoint),
                 **dict.fromkeys(GLM4_MOE_GGUF_ARCHS, glm4_moe_gguf_checkpoint),
                 **dict.fromkeys(LLAMA4_GGUF_ARCHS, llama4_gguf_checkpoint),
                 **dict.fromkeys(MINICPM3_GGUF_ARCHS, minicpm3_gguf_checkpoint),
                 **dict.fromkeys(CLASSIC_GGUF_ARCHS, classic_gguf_checkpoint),
                 **dict.fromkeys(BITNET_GGUF_ARCHS, bitnet_gguf_checkpoint),
                 **dict.fromkeys(PHIMOE_GGUF_ARCHS, phimoe_gguf_checkpoint),
                 **dict.fromkeys(MIMO2_GGUF_ARCHS, mimo2_gguf_checkpoint),
                 **dict.fromkeys(MISTRAL4_GGUF_ARCHS, mistral4_gguf_checkpoint)}
# where transformers' GGUF tables spell llama.cpp's architecture name otherwise
_TRANSFORMERS_GGUF_NAMES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "gpt-oss": "gpt_oss",
                            "minimax-m2": "minimax_m2"}


@dataclass(frozen=True)
class ModelSource:
    """An HF-layout folder to load from. For a GGUF model it is the converted cache folder and ``gguf_file`` is
    the original file."""

    path: Path
    weight_files: tuple[Path, ...]
    weight_format: str  # "safetensors" | "bin"
    gguf_file: Path | None = None


# ---------------------------------------------------------------------------------------------- resolving


def resolve_model(model: str | os.PathLike, weights: bool = True, field: str = "model") -> ModelSource:
    """Resolve ``model`` to a local HF folder (converting and caching a ``.gguf`` first, downloading a hub id
    when the hub is reachable). ``weights=False``: only its config and tokenizer are needed (its weight files are
    neither looked for nor downloaded: ``weight_files`` is empty). ``field``: the option errors name."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _folder_source(path, weights, field)
    if path.is_file():
        check_model_path(model, field)  # a .gguf
        folder = convert_gguf(path)
        return ModelSource(folder, *_weight_files(folder, field), gguf_file=path.resolve())
    check_path(model, field)
    return _folder_source(_download(str(model), weights, field), weights, field)


def check_path(model: str | os.PathLike, field: str) -> None:
    """A ValueError naming ``field`` when ``model`` is a local path (not a hub id) that does not exist."""
    if _looks_local(str(model)) and not Path(model).expanduser().exists():
        raise ValueError(f"{field}={str(model)!r} does not exist; pass an existing HF model folder or .gguf file")


def check_model_path(model: str | os.PathLike, field: str) -> None:
    """:func:`check_path`, and a local path that exists must be a model: a folder with ``config.json`` or a
    ``.gguf`` file (what :func:`resolve_model` would refuse only once a replica loads it)."""
    check_path(model, field)
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{field}={str(model)!r} is a folder without config.json{_gguf_files_hint(path) or ';'} pass "
                         "an HF model folder (config.json + weights), a checkpoint folder of the method's layout or a "
                         ".gguf file")
    if path.is_file() and not is_gguf_file(path):
        raise ValueError(f"{field}={str(model)!r} is a file but not a .gguf; pass an HF model folder "
                         "(config.json + weights) or a .gguf file")


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` is a GGUF file: named ``.gguf`` (in any case), or beginning with GGUF's magic bytes (a file
    renamed, a hub cache's blob), as vLLM tells one."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _looks_local(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or model.endswith(".gguf") or os.sep + os.sep in model \
        or model.count("/") > 1


def _download(repo_id: str, weights: bool = True, field: str = "model") -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    patterns = _HUB_PATTERNS if weights else [p for p in _HUB_PATTERNS if p != "*.safetensors"]
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=patterns))
        if weights and not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS + ["pytorch_model*.bin"]))
    except (OSError, ValueError, HfHubHTTPError) as err:
        raise ValueError(
            f"{field}={repo_id!r} is not a local path, and the hub could not provide it "
            f"({type(err).__name__}: {err}); pass an existing local folder or .gguf file, or go online"
        ) from err
    return folder


def _gguf_files_hint(folder: Path) -> str:
    """For a folder without config.json that holds GGUF files (a llama.cpp release's: a GGUF loads as a file, not a
    folder, as in vLLM), the words naming them and the way out, ending in "or"; else nothing."""
    ggufs = sorted(p.name for p in folder.glob("*") if p.suffix.lower() == ".gguf" and p.is_file())
    if not ggufs:
        return ""
    return (f" but holds GGUF files {ggufs[:5]}: pass one of them as the model (e.g. {str(folder / ggufs[0])!r}), "
            "or")


def _folder_source(folder: Path, weights: bool = True, field: str = "model") -> ModelSource:
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {str(folder)!r} has no config.json{_gguf_files_hint(folder) or ';'} pass an "
                         "HF model folder")
    if not isinstance(_json_file(folder / "config.json"), dict):
        raise ValueError(f"{str(folder / 'config.json')!r} holds no JSON object; fix it, or download the model again")
    return ModelSource(folder, *_weight_files(folder, field)) if weights else ModelSource(folder, (), "none")


def _json_file(path: Path) -> Any:
    """A checkpoint's JSON file read; a ValueError naming it where it is not valid JSON."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(path)!r} is unreadable: not valid JSON ({err}); the file is corrupt or written in "
                         "part: fix it, or download the model again") from None


def _weight_files(folder: Path, field: str = "model") -> tuple[tuple[Path, ...], str]:
    # one file before an index, as transformers reads them (an index left beside it from an older download is stale)
    for single, index, fmt in (("model.safetensors", "model.safetensors.index.json", "safetensors"),
                               ("pytorch_model.bin", "pytorch_model.bin.index.json", "bin")):
        if (folder / single).is_file():
            return (folder / single,), fmt
        if (folder / index).is_file():
            weight_map = _json_file(folder / index).get("weight_map") or {}
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (folder / n).is_file()]
            if missing or not names:
                raise ValueError(f"{str(folder / index)!r} lists weight files the folder lacks: {missing[:3]} "
                                 f"({len(missing)} of {len(names)}) or none at all; download the model's missing "
                                 "files again")
            return tuple(folder / n for n in names), fmt
    for pattern, fmt in (("model*.safetensors", "safetensors"), ("*.safetensors", "safetensors"),
                         ("pytorch_model*.bin", "bin")):
        files = sorted(folder.glob(pattern))
        if files:
            return tuple(files), fmt
    raise ValueError(f"{field} folder {str(folder)!r} has no weights: expected *.safetensors or pytorch_model*.bin "
                     "(optionally sharded with an index .json)")


# ---------------------------------------------------------------------------------------------- public loaders


def read_config(model: str | os.PathLike, trust_remote_code: bool = False,
                hf_overrides: dict[str, Any] | None = None) -> PlainConfig:
    """The whole checkpoint's config (transformers' ``AutoConfig``, read here) as plain attributes.
    ``trust_remote_code`` (vLLM's): a checkpoint whose config class is its own code (``auto_map``) may run it.
    ``hf_overrides`` (vLLM's): attributes set on it once read, as transformers sets them (a dict for a nested
    config, e.g. ``text_config``, updates that config's attributes)."""
    from transformers import AutoConfig

    folder = resolve_model(model, weights=False).path
    with _remote_code_errors(model):
        config = _fixed_config(Path(folder)) or AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if getattr(config, "quantization_config", None) is None:  # an older ModelOpt export: hf_quant_config.json
        quant = _modelopt_export(Path(folder))
        if quant is not None:
            config.quantization_config = quant
    _override(config, hf_overrides or {})
    return plain_config(config)


def _nemotron_omni_sound(config: dict) -> bool:
    """Nemotron 3 Nano Omni's release names its sound encoder's config ``"model_type": "parakeet"``, no registered
    type; transformers 5.24's config drops it from a copy and then reads the original (and fails): drop it here."""
    sound = [key for key in ("sound_config", "audio_config")
             if isinstance(config.get(key), dict) and config[key].get("model_type") == "parakeet"]
    for key in sound:
        config[key] = {name: value for name, value in config[key].items() if name != "model_type"}
    return bool(sound)


# model type -> a fix of its config.json's dict that transformers cannot read as a release ships it (True: fixed)
_CONFIG_JSON_FIXES = {"nemotron_h_omni": _nemotron_omni_sound}


def _fixed_config(folder: Path) -> Any:
    """The folder's config, read by transformers from its config.json's dict fixed first, where a release's needs
    a fix (:data:`_CONFIG_JSON_FIXES`); None where transformers reads the file as it is."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    path = folder / "config.json"
    fix = _CONFIG_JSON_FIXES.get(json.loads(path.read_text()).get("model_type")) if path.is_file() else None
    if fix is None:
        return None
    config, _ = PretrainedConfig.get_config_dict(str(folder))  # (transformers' JSON, its special floats read)
    return CONFIG_MAPPING[config["model_type"]].from_dict(config) if fix(config) else None


def _modelopt_export(folder: Path) -> dict | None:
    """The quantization of a ModelOpt export that keeps it in ``hf_quant_config.json`` alone (its ``quantization``
    section, as ``quant_method: modelopt``), as vLLM reads it; None without one."""
    path = folder / "hf_quant_config.json"
    section = json.loads(path.read_text()).get("quantization") if path.is_file() else None
    return {"quant_method": "modelopt", **section} if isinstance(section, dict) else None


def _override(config: Any, overrides: dict[str, Any]) -> None:
    rope_before = getattr(config, "rope_parameters", None)
    for name, value in overrides.items():
        current = getattr(config, name, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):  # a nested config: its own attributes
            _override(current, value)
            continue
        try:
            setattr(config, name, value)
        except (AttributeError, TypeError, ValueError) as err:
            raise ValueError(f"hf_overrides: {name}={value!r:.80} cannot be set on the model's config: {err}") from None
    _keep_rope_base(config, rope_before, overrides)


_ROPE_BASE = ("rope_theta", "partial_rotary_factor")  # what a RoPE setting keeps apart from its scaling


def _keep_rope_base(config: Any, before: Any, overrides: dict[str, Any]) -> None:
    """RoPE in ``hf_overrides`` as vLLM's users write it (transformers 4's config kept ``rope_theta`` apart from
    ``rope_scaling``), on transformers 5's config, which keeps both in ``rope_parameters``: a new ``rope_parameters``
    or ``rope_scaling`` naming no ``rope_theta`` / ``partial_rotary_factor`` keeps the checkpoint's (transformers
    would leave it None; read as 10000 it silently changed every rotation), and ``rope_theta`` or
    ``partial_rotary_factor`` alone is set in ``rope_parameters`` (transformers 5 keeps a bare attribute and rotates
    by the old value). A model with RoPE per kind of layer (Gemma 3) takes those per kind only (one setting for
    every kind would rotate its sliding layers by the global layers' scaling; transformers fails on it)."""
    loose = {key: overrides[key] for key in _ROPE_BASE if key in overrides}
    replaced = "rope_parameters" in overrides or "rope_scaling" in overrides
    params = getattr(config, "rope_parameters", None)
    if not (loose or replaced) or not isinstance(params, dict) or not isinstance(before, dict):
        return
    per_kind = rope_per_kind(before)
    if per_kind and loose:
        key = next(iter(loose))
        raise ValueError(f"hf_overrides: {key}={loose[key]!r} cannot be set alone on a model whose RoPE is given per "
                         f"kind of layer (rope_parameters {sorted(before)}); override rope_parameters with each "
                         f"kind's {key} instead")
    params = {kind: dict(value) if isinstance(value, dict) else value for kind, value in params.items()}
    if per_kind and not rope_per_kind(params):
        raise ValueError(f"hf_overrides: rope_parameters / rope_scaling {sorted(params)} give one setting for every "
                         f"layer, but this model's RoPE is given per kind of layer ({sorted(before)}, each its own "
                         f"base); override rope_parameters as {{{', '.join(repr(k) + ': {...}' for k in before)}}}")
    if per_kind:
        for kind, setting in params.items():
            for key in _ROPE_BASE:
                if setting.get(key) is None and before.get(kind, {}).get(key) is not None:
                    setting[key] = before[kind][key]
    else:
        for key in _ROPE_BASE:
            if key in loose:
                params[key] = loose[key]
            elif replaced and params.get(key) is None and before.get(key) is not None:
                params[key] = before[key]
    config.rope_parameters = params


def load_hf_config(model: str | os.PathLike, config: PlainConfig | None = None,
                   trust_remote_code: bool = False) -> PlainConfig:
    """The config of ``model`` (of its text model, for a multimodal checkpoint whose text we serve:
    :func:`specray.models.registry.text_part`); ``config``: the whole checkpoint's, already read."""
    config = config or read_config(model, trust_remote_code)
    part = text_part(config)
    return config if part is None else part[0]


def read_generation_config(model: str | os.PathLike) -> dict[str, Any]:
    """``model``'s generation_config.json (transformers' generation defaults) as a dict; {} when it has none (a
    GGUF file carries none). ``model`` may also be a folder holding only that file."""
    path = Path(model).expanduser()
    folder = path if path.is_dir() and not (path / "config.json").is_file() else resolve_model(model, False).path
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(file)!r} is not valid JSON ({err}); fix it, or pass generation_config: a "
                         "folder holding a valid one") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(file)!r} holds {type(config).__name__}, not a JSON object; fix it, or pass "
                         "generation_config: a folder holding a valid one")
    return config


def load_tokenizer(model: str | os.PathLike, trust_remote_code: bool = False):
    """The HF tokenizer of ``model``, chat template included (``trust_remote_code``: as :func:`read_config`)."""
    from transformers import AutoTokenizer

    folder = resolve_model(model, weights=False).path
    with _remote_code_errors(model):
        try:
            return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
        except (ValueError, OSError) as err:
            if any(file for pattern in _TOKENIZER_FILES for file in Path(folder).glob(pattern)):
                raise
            raise ValueError(f"{str(model)!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in "
                             f"{str(folder)!r}; pass tokenizer= (--tokenizer): a folder or hub id holding the "
                             "model's tokenizer") from err


# the files a tokenizer is read from (transformers' fast and slow ones: BPE, SentencePiece, WordPiece, tiktoken)
_TOKENIZER_FILES = ("tokenizer*", "*.model", "vocab*", "merges.txt", "*.tiktoken", "tekken.json")


@contextlib.contextmanager
def _remote_code_errors(model: str | os.PathLike):
    """transformers' refusal to run a checkpoint's own code, in our terms (passing ``trust_remote_code=False``
    explicitly makes it refuse at once rather than ask on the terminal), and its refusal of a config whose sizes do
    not fit (huggingface_hub's StrictDataclassError, which is no ValueError) as a ValueError naming the model."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        yield
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise ValueError(f"model={str(model)!r} loads its config or tokenizer with code of its own (auto_map); "
                         "pass trust_remote_code=True (--trust-remote-code) if you trust that code") from None
    except StrictDataclassError as err:  # transformers' own check of the config's sizes (not a ValueError)
        why = str(err.__cause__ or err).rstrip(".")
        raise ValueError(f"model={str(model)!r} has a config transformers refuses: {why}; fix config.json (a .gguf: "
                         "its metadata), or download or convert the model again") from None


def iter_weights(source: ModelSource) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) pairs; safetensors entries come as lazy slices so a TP rank reads only its shard."""
    for file in source.weight_files:
        if source.weight_format == "safetensors":
            with _opened_safetensors(file) as fh:
                for name in fh.keys():
                    yield name, fh.get_slice(name)
        else:
            yield from _torch_file(file).items()


def _opened_safetensors(file: Path):
    """safetensors' ``safe_open`` of a weight file; a ValueError naming it where its header is unreadable."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as err:
        raise ValueError(f"{str(file)!r} is unreadable: not a complete safetensors file ({err}); the file is corrupt "
                         "or written in part: download or save it again") from None


def _torch_file(file: Path) -> dict[str, Any]:
    """A ``pytorch_model*.bin``'s contents (memory-mapped where it is a zip archive, torch's format since 1.6; read
    whole where it is the legacy one); a ValueError naming it where ``torch.load`` cannot read it."""
    import pickle
    import zipfile

    try:
        return torch.load(file, map_location="cpu", mmap=zipfile.is_zipfile(file), weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as err:
        # (torch's weights-only refusal: the unpickler's own words between its advice)
        detail = " ".join(str(err).split("WeightsUnpickler error:")[-1].split("Check the documentation")[0].split())
        raise ValueError(f"{str(file)!r} is unreadable: torch.load(weights_only=True) cannot read it "
                         f"({type(err).__name__}: {detail[:300]}); the file is corrupt, written in part, or holds "
                         "more than tensors: download or save it again") from None


def head_tensors(path: str | os.PathLike, what: str, torch_files: tuple[str, ...]) -> tuple[Path, dict[str, Any]]:
    """A small head's checkpoint (Medusa's, a recurrent drafter's): its folder (local, or a hub id fetched) and every
    tensor in it by name: its ``*.safetensors`` as lazy slices, else the torch files matching ``torch_files``."""
    folder = Path(path).expanduser()
    if not folder.is_dir():  # a hub id
        folder = Path(resolve_model(path).path)
    tensors: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with _opened_safetensors(file) as fh:
            tensors.update((name, fh.get_slice(name)) for name in fh.keys())
    for file in [] if tensors else sorted(f for pattern in torch_files for f in folder.glob(pattern)):
        tensors.update(_torch_file(file))
    if not tensors:
        raise ValueError(f"the {what} checkpoint folder {str(folder)!r} has no *.safetensors or "
                         f"{' / '.join(torch_files)} weights")
    return folder, tensors


def head_config(folder: Path, what: str, model_type: str, kind: str) -> dict[str, Any]:
    """A small head's ``config.json`` (in ``folder``, from :func:`head_tensors`), its ``model_type`` checked: a
    ValueError naming the file otherwise (``kind``: what a checkpoint of that type is, for the message)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"the {what} checkpoint folder {str(folder)!r} has no config.json")
    config = json.loads(config_file.read_text())
    if config.get("model_type") != model_type:
        raise ValueError(f"{str(config_file)!r} has model_type={config.get('model_type')!r}; {kind} has "
                         f"{model_type!r}")
    return config


def load_frozen(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> nn.Module:
    """``module`` with ``state`` loaded (every parameter, nothing else: a ValueError naming ``what`` otherwise), in
    eval mode, its parameters frozen."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{what}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def check_quantization(quantization: str | None, config, model: str | os.PathLike = "",
                       option: str = "quantization") -> None:
    """``quantization`` (vLLM's option), where given, names the checkpoint's own method, or with ``"fp8"`` over an
    unquantized checkpoint asks for vLLM's online FP8 (the ranks quantize its linears as they load:
    :func:`specray.models.layers.quantize_linears`); any other mismatch is refused; ``"gguf"`` names a ``.gguf``
    ``model`` (whatever types its tensors have)."""
    if quantization is None:
        return
    if quantization == "gguf":
        if not str(model).endswith(".gguf") and not is_gguf_file(Path(model).expanduser()):
            raise ValueError(f"{option}='gguf' but model={str(model)!r} is not a .gguf file: pass the GGUF file, "
                             "or drop the quantization option (the method is read from the checkpoint's config.json)")
        return
    quant = getattr(config, "quantization_config", None) or getattr(getattr(config, "text_config", None),
                                                                    "quantization_config", None)
    if quant is not None and not isinstance(quant, dict):
        quant = vars(quant)
    method = (quant or {}).get("quant_method")
    if quantization == "fp8" and method is None:
        return  # online FP8
    if QUANTIZATIONS[quantization] != method:
        found = f"quantization_config.quant_method={method!r}" if method else "no quantization_config"
        raise ValueError(f"{option}={quantization!r} but the checkpoint has {found}: specray loads quantized "
                         "weights as the checkpoint stores them and quantizes none itself (but for 'fp8' over an "
                         "unquantized checkpoint); drop the quantization option (the method is read from config.json) "
                         "or pass a checkpoint quantized that way")


def checkpoint_quantization(source: ModelSource) -> dict | None:
    """The checkpoint's ``quantization_config`` (a multimodal one's may sit in its text config), as config.json
    gives it; without one, a ModelOpt export's ``hf_quant_config.json`` (its ``quantization`` section, as
    ``quant_method: modelopt``), as vLLM reads it."""
    config = json.loads((Path(source.path) / "config.json").read_text())
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    return quant if quant is not None else _modelopt_export(Path(source.path))


def checkpoint_weights(source: ModelSource, prefix: Any = "", wanted: Callable[[str], bool] | None = None,
                       w8a8: Format | None = None, blocks: bool = False) -> Iterator[tuple[str, Any]]:
    """:func:`iter_weights`, with a quantized release's weights dequantized as they come (MXFP4, integers, FP8), but
    for an FP8 release's experts' (which
    come as :class:`~specray.models.fp8.Fp8Weight`, kept so by the model: :mod:`specray.models.fp8`). ``prefix``:
    only the tensors under it, named without it (a multimodal checkpoint's text model); ``wanted``: only the tensors
    (and their scales) it names, the others not read (a pipeline stage's). A prefix may also be name patterns
    (:func:`specray.models.registry.text_tensors`). ``w8a8``: the 8-bit format (FP8, INT8) of a row-scaled release
    whose linears the model keeps in 8 bits (:func:`load_model`): their weights come as
    :class:`~specray.models.w8a8.RowScaled`; ``blocks``: a block-scaled FP8 release whose linears the model keeps in
    FP8, as :class:`~specray.models.fp8_blocks.BlockScaled`."""
    quant = checkpoint_quantization(source)
    weights = renamed_block_scales(iter_weights(source), quant)  # DeepSeek-V4's X.scale as X.weight_scale_inv
    if prefix:
        weights = text_tensors(weights, prefix)
    if wanted is not None:
        weights = ((name, t) for name, t in weights if wanted(name))
    if (quant or {}).get("quant_method") == MODELOPT:
        weights = renamed_kv_scales(weights)
    if is_mxfp4(quant):  # GPT-OSS's experts: specray.models.mxfp4 (kept, or not, by the mixture)
        return mxfp4_dequantized(weights, keep=is_expert_tensor)
    layout = nvfp4_layout(quant)
    if layout is not None:  # ModelOpt's and llm-compressor's NVFP4: specray.models.nvfp4
        return nvfp4_dequantized(weights, layout, keep=is_per_expert_tensor)
    scheme = int_scheme(quant)
    if scheme is not None:  # GPTQ, AWQ, packed integers: specray.models.int_quant
        return int_dequantized(weights, scheme, rows=w8a8 is INT8, static=static_activations(quant))
    block = fp8_block_size(quant)
    if block is False:
        return weights
    return dequantized(weights, block, keep=is_per_expert_tensor, suffix=scale_suffix(quant), rows=w8a8 is FP8,
                       static=static_activations(quant), blocks=blocks, fp4=fp4_experts(quant))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


DUMMY_WEIGHT_RANGE = 1e-3  # dummy weights are uniform in [-r, r] (vLLM's too): small, so no layer overflows


def load_model(model: str | os.PathLike, tp: TPGroup | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", pack: bool = True, expert_parallel: bool = False,
               config: PlainConfig | None = None, load_format: str = "auto", pp: PPGroup | None = None,
               quantization: str | None = None) -> CausalLM:
    """Our model for ``model`` with this rank's weights, in eval mode, on ``device`` in ``dtype``; fp32 on CPU
    with its linears' weights in oneDNN's blocked layout unless ``pack=False`` (see ``cpu_kernels.pack_weight``).
    ``expert_parallel``: a mixture of experts' experts split whole over the ranks of ``tp`` (else by width).
    ``config``: the whole checkpoint's config as :func:`read_config` gives it, if the caller has read it (then
    transformers is not imported here). ``load_format="dummy"`` (vLLM's): random weights from torch's generator,
    none read (the folder needs only its config): a model of the checkpoint's shapes, for measuring speed and
    memory without its weights; its outputs mean nothing. ``pp``: this rank's pipeline stage, which builds and reads
    only its own layers (the embedding on the first stage, the final norm and LM head on the last).
    ``quantization="fp8"`` over an unquantized checkpoint (vLLM's online FP8): its projections quantized to FP8 at
    load and kept for FP8 matmuls (:func:`~specray.models.layers.quantize_linears`), on a device that runs them (a
    ValueError saying so elsewhere)."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} must be a floating point dtype (float32, float16, bfloat16)")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} must be one of {list(LOAD_FORMATS)}")
    dummy = load_format == "dummy"
    source = resolve_model(model, weights=not dummy)
    config = config or read_config(source.path)
    part = text_part(config)
    prefix = ""
    if part is not None:  # a multimodal checkpoint: its text model's config and tensors only
        config, prefix = part
    model_cls = get_model_class(config)
    # a 4-bit checkpoint whose groups the device's kernel takes: its linears keep the integers (int_quant); an FP8
    # or INT8 one scaled per row or per tensor on a device with that 8-bit matmul: its linears stay 8-bit (w8a8)
    quant = checkpoint_quantization(source)
    method = (quant or {}).get("quant_method")
    if method == "bitnet" and getattr(model_cls, "reads_quantization", None) != method:
        raise ValueError(f"quantization_config.quant_method='bitnet' (packed ternary weights) is read for BitNet "
                         f"(model_type='bitnet') alone, not for model_type={config.model_type!r}; load a bf16 or "
                         "fp16 version of the checkpoint")
    online = quantization == "fp8" and not quant
    if online and not keeps_w8a8(FP8, torch.device(device), dtype):
        raise ValueError(f"quantization='fp8' over an unquantized checkpoint quantizes its linears to FP8 at load for "
                         f"FP8 matmuls (W8A8), which need a CUDA GPU of compute capability 8.9 or more (Ada, Hopper, "
                         f"Blackwell) and dtype='bfloat16'; this rank has {device} in {dtype}: drop the quantization "
                         "option, or load an FP8 release of the model")
    scheme = int_scheme(quant)
    ints = keeps_int4(scheme, torch.device(device), dtype)
    w8a8 = w8a8_format(quant)
    w8a8 = w8a8 if w8a8 is not None and keeps_w8a8(w8a8, torch.device(device), dtype) else None
    # a block-scaled FP8 one on a device with a block-wise FP8 matmul: its linears stay FP8 too (fp8_blocks)
    block = fp8_block_size(quant) if scheme is None else False
    block = block if block and keeps_block_fp8(block, torch.device(device), dtype) else None
    kept = "4-bit" if ints else w8a8.name if w8a8 is not None else f"FP8 {list(block)}-block" if block else None
    with _default_dtype(dtype), torch.device(device), int_linears(kept is not None):
        net = model_cls(config, tp or TPGroup.single(), expert_parallel, pp)
    if dummy:
        _dummy_weights(net, scheme if ints else None, w8a8, block)
    else:
        read: list[str] = []  # the last tensor read, named where its shape does not fit

        def named(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                read[:] = [name]
                yield name, tensor

        try:
            net.load_weights(named(checkpoint_weights(source, prefix, getattr(net, "reads_weight", None), w8a8,
                                                      blocks=block is not None)))
        except ValueError as err:
            if not read or not str(err).startswith("checkpoint tensor of shape"):
                raise
            gguf = f"; converted from GGUF {str(source.gguf_file)!r}, whose metadata gave that config" \
                if source.gguf_file else ""
            raise ValueError(f"{err} (at {read[0]!r}{gguf})") from None
        if kept is not None:
            logger.info("%d linears keep their %s weights", keep_quantized_weights(net), kept)
    if online:
        logger.info("quantization='fp8': %d linears quantized to FP8 at load", quantize_linears(net, FP8))
    net.eval()
    for p in net.parameters():
        p.requires_grad_(False)
    if pack and can_pack(torch.device(device).type, str(dtype).removeprefix("torch.")):
        pack_linear_weights(net)
    return net


def load_image_encoder(model: str | os.PathLike, config: PlainConfig, dtype: torch.dtype, device: str | torch.device,
                       load_format: str = "auto") -> nn.Module | None:
    """The image encoder (vision tower and projector, :class:`specray.multimodal.ImageEncoder`) of a vision-language
    checkpoint whose images we serve, its own tensors read (random ones with ``load_format="dummy"``), in eval mode;
    None for any other checkpoint. ``config``: the whole checkpoint's config (:func:`read_config`)."""
    classes = multimodal_classes(config)
    if classes is None:
        return None
    with _default_dtype(dtype), torch.device(device):
        encoder = classes[0](config)
    if load_format == "dummy":
        _dummy_weights(encoder, None)
    else:
        part = text_part(config)
        encoder.load_weights(_non_text_weights(resolve_model(model), None if part is None else part[1]))
    encoder.eval()
    for p in encoder.parameters():
        p.requires_grad_(False)
    return encoder


def _non_text_weights(source: ModelSource, part: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors outside its text model (``part``, :func:`text_part`'s): vision tower, projector,
    read whole."""
    def is_text(name: str) -> bool:
        if part is None:
            return False
        return name.startswith(part) if isinstance(part, str) else any(p.match(name) for p, _ in part)

    for name, tensor in iter_weights(source):
        if not is_text(name):
            yield name, tensor if isinstance(tensor, torch.Tensor) else tensor[...]  # (0-dim slices too)


def load_image_processor(model: str | os.PathLike, config: PlainConfig | None = None,
                         trust_remote_code: bool = False):
    """The image processor (:class:`specray.multimodal.ImageProcessor`) of a vision-language checkpoint whose images
    we serve, None for any other checkpoint. ``config``: the whole checkpoint's, if read already."""
    config = config or read_config(model, trust_remote_code)
    classes = multimodal_classes(config)
    if classes is None:
        return None
    return classes[1].from_pretrained(resolve_model(model, weights=False).path, config)


def engine_image_processor(args):
    """The image processor of the engine ``args``' checkpoint (:func:`load_image_processor`), None where it serves
    no images, videos or audio (a text model, or its encoders turned off: ``limit_mm_per_prompt`` of 0); with the
    frames ``media_io_kwargs`` takes from a video file (:func:`specray.multimodal.video_frames`)."""
    if text_only(args.limit_mm_per_prompt):
        return None
    processor = load_image_processor(args.model, read_config(args.model, args.trust_remote_code, args.hf_overrides))
    frames = (args.media_io_kwargs or {}).get(VIDEO, {}).get("num_frames")
    if processor is not None and frames is not None:
        processor.num_frames = frames
    return processor


@torch.no_grad()
def _dummy_weights(net: nn.Module, ints: IntScheme | None, w8a8: Format | None = None,
                   block: tuple[int, int] | None = None) -> None:
    """Random weights (``load_format="dummy"``). ``ints``: a 4-bit release's scheme, whose linears (built under
    ``int_linears``, their weights empty) get random integers kept in 4 bits as a checkpoint's would be, so a dummy
    model times the 4-bit kernel at a real size; ``w8a8``: a row-scaled 8-bit release's format, whose linears get
    random values of it kept so, and ``block``'s (a block-scaled FP8 release's) random block-scaled values; a
    linear the kernel cannot take, or one read as a matrix, is dense."""
    for param in net.parameters():
        # an integer table (DeepSeek-V4's hash routing) stays zeros: valid, but its hash layers send every token to
        # expert 0; kept 8-bit experts' values (float8 too) get theirs below
        if not param.is_floating_point() or param.element_size() == 1:
            continue
        param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE)
    for module in net.modules():
        if isinstance(module, SparseMoE):  # kept quantized experts: random values over scales of about the range
            module.random_kept(DUMMY_WEIGHT_RANGE)
    if ints is None and w8a8 is None and block is None:
        return
    for module in net.modules():
        if isinstance(module, LinearBase) and module.keeps_ints and module.weight.numel() == 0:
            w = module.weight
            if not module.keeps_dense_weight:
                rows, cols = module.dense_shape
                if block is not None:
                    module.kept = pack_block_fp8(random_block_fp8(rows, cols, DUMMY_WEIGHT_RANGE, block, w.device),
                                                 w.device, w.dtype)
                elif w8a8 is not None:
                    module.kept = pack_w8a8(random_w8a8(rows, cols, DUMMY_WEIGHT_RANGE, w8a8, w.device), w.device)
                else:
                    module.kept = pack_int4(random_int4(rows, cols, ints.group_size, DUMMY_WEIGHT_RANGE, w.device),
                                            w.device, w.dtype)
            if module.kept is None:
                module.dense_weight().uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE)


# ---------------------------------------------------------------------------------------------- GGUF


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/specray").expanduser()


def gguf_storage_dtype() -> str:
    """The dtype conversions are stored in (``$SPECRAY_GGUF_DTYPE``, default float32)."""
    dtype = os.environ.get(GGUF_DTYPE_ENV) or "float32"
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"{GGUF_DTYPE_ENV}={dtype!r} is not a dtype a GGUF is converted into; use one of "
                         f"{list(GGUF_DTYPES)} (float32 keeps the dequantized values exactly, the others take half "
                         "the disk) or leave it unset")
    return dtype


def gguf_cache_folder(gguf: Path) -> Path:
    """Where the converted ``gguf`` lives: keyed by its absolute path, size and mtime, the conversion's version
    (``GGUF_CONVERSION_VERSION``) and the dtype it is stored in (:func:`gguf_storage_dtype`; float32's key is the
    one conversions had before there was a choice)."""
    gguf = gguf.resolve()
    st = gguf.stat()
    dtype = gguf_storage_dtype()
    text = f"{gguf}|{st.st_size}|{st.st_mtime_ns}|{GGUF_CONVERSION_VERSION}"
    text += "" if dtype == "float32" else f"|{dtype}"
    return cache_dir() / "gguf" / f"{gguf.stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def convert_gguf(gguf: Path) -> Path:
    """The cached HF folder for ``gguf``, converting it on first use; a new conversion replaces the file's older ones
    (:func:`_drop_older_conversions`)."""
    folder = gguf_cache_folder(gguf)
    if (folder / _GGUF_MARKER).is_file():
        logger.info("GGUF %s: using cached conversion %s", gguf, folder)
        return folder
    logger.info("GGUF %s: converting into %s", gguf, folder)
    _drop_abandoned_conversions(folder.parent)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        _write_gguf_folder(gguf.resolve(), tmp)
        if folder.exists():  # a stale partial folder, or another process won the race
            if (folder / _GGUF_MARKER).is_file():
                return folder
            shutil.rmtree(folder)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / _GGUF_MARKER).is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _drop_older_conversions(gguf.resolve(), folder)
    return folder


def _drop_abandoned_conversions(parent: Path, idle_s: float = 600.0) -> None:
    """Delete the partial conversions a killed process left (``.NAME.tmp-PID-*``: its own cleanup never ran, as on
    SIGKILL): those of a process no longer alive on this machine, untouched for ``idle_s`` (a cache shared with
    other machines may hold another host's live conversion under a PID that is free here)."""
    if not parent.is_dir():
        return
    for tmp in parent.glob(".*.tmp-*-*"):
        pid = tmp.name.rsplit(".tmp-", 1)[1].split("-")[0]
        try:
            stale = pid.isdigit() and not _alive(int(pid)) and time.time() - tmp.stat().st_mtime > idle_s
        except OSError:  # gone meanwhile
            continue
        if stale:
            logger.info("GGUF cache: removing %s, a conversion its process left unfinished", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _drop_older_conversions(gguf: Path, current: Path) -> None:
    """Delete the cached conversions of the file at ``gguf``'s path other than ``current`` in its dtype: those of an
    earlier version of the file (another size or mtime) or of an older conversion (``GGUF_CONVERSION_VERSION``), which
    are never read again and hold 2 or 4 bytes per parameter each. One in another dtype stays (a process that loads
    the model with another ``SPECRAY_GGUF_DTYPE`` may be reading it). Only complete folders whose marker names this
    path."""
    dtype = gguf_storage_dtype()
    for marker in current.parent.glob(f"*/{_GGUF_MARKER}"):
        folder = marker.parent
        if folder == current:
            continue
        try:
            written = json.loads(marker.read_text())
            if written.get("gguf") != str(gguf) or written.get("dtype", "float32") != dtype:
                continue
        except (OSError, ValueError):  # a folder being written or removed by another process: not ours to judge
            continue
        logger.info("GGUF %s: deleting its older conversion %s", gguf, folder)
        shutil.rmtree(folder, ignore_errors=True)


class _NameOnlyModel(nn.Module):
    """Stands in for the HF model in transformers' GGUF name mapping, which only needs its config and
    parameter names (passing the real model maps every submodule again, several times slower)."""

    def __init__(self, config, names: list[str]):
        super().__init__()
        self.config = config
        self._names = names

    def state_dict(self, *args, **kwargs):
        return dict.fromkeys(self._names)


def _gguf_metadata(gguf: Path) -> dict[str, Any]:
    """The GGUF's scalar metadata, key -> value (arrays, the tokenizer's vocabulary and merges, are left out)."""
    from gguf import GGUFReader, GGUFValueType

    fields = GGUFReader(str(gguf)).fields
    return {key: f.contents() for key, f in fields.items() if f.types and f.types[0] != GGUFValueType.ARRAY}


def _transformers_maps_gguf(arch: str) -> bool:
    """Whether the installed transformers can turn a GGUF of llama.cpp's ``arch`` into a config and HF tensors (or,
    those of ``_GGUF_READERS``, we read both ourselves)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return arch in _GGUF_READERS or _TRANSFORMERS_GGUF_NAMES.get(arch, arch) in GGUF_SUPPORTED_ARCHITECTURES


def _check_gguf_architecture(gguf: Path, arch: str | None) -> None:
    """ValueError, naming the fix, for a GGUF we cannot convert: one of a family we do not serve, or of one
    transformers has no GGUF mapping for and specray reads no other way (with the transformers specray pins, every
    family of ``_GGUF_FAMILIES`` has one or the other). Called before transformers reads the file, whose own error
    names no way out."""
    loadable = sorted(a for a in _GGUF_FAMILIES if _transformers_maps_gguf(a))
    family = _GGUF_FAMILIES.get(arch)
    if family is None:
        raise ValueError(
            f"GGUF {str(gguf)!r} has general.architecture={arch!r}, not a family specray serves; GGUF "
            f"architectures it loads: {loadable}. Pass a GGUF of one of those, or an HF model folder of a supported "
            f"architecture ({supported_architectures()})")
    if arch not in loadable:
        import transformers

        raise ValueError(
            f"GGUF {str(gguf)!r} has general.architecture={arch!r} ({family}), which transformers "
            f"{transformers.__version__} cannot map from GGUF (specray converts GGUF files through it; GGUF "
            f"architectures it loads: {loadable}). specray serves {family} from its HF checkpoint: pass the model's "
            "HF folder (config.json + *.safetensors) or its hub id instead of the .gguf, or convert the model to "
            "that layout first")


def _check_gguf_split(gguf: Path, meta: dict[str, Any]) -> None:
    """ValueError, naming the way out, for one shard of a GGUF split in several files (llama.cpp's gguf-split,
    ``NAME-00001-of-00003.gguf``: ``split.count`` in each): specray (as vLLM) reads a single file, and a shard alone
    would be refused as lacking tensors or an architecture."""
    count = int(meta.get("split.count") or 1)
    if count > 1:
        shard = int(meta.get("split.no") or 0) + 1
        raise ValueError(f"GGUF {str(gguf)!r} is shard {shard} of {count} of a split GGUF; specray loads a single "
                         "file: merge the shards first (llama.cpp's `llama-gguf-split --merge FIRST_SHARD.gguf "
                         "merged.gguf`) and pass the merged file")


def _check_gguf_tensor_types(gguf: Path, tensors: list) -> None:
    """ValueError naming a tensor whose llama.cpp type gguf-py cannot dequantize (Q8_K, Q8_1, the integer and F64
    types: none a converter writes for a model's weights), up front, where the conversion would fail part-way on
    gguf-py's bare NotImplementedError."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    def readable(kind) -> bool:
        try:
            dequantize(np.zeros(GGML_QUANT_SIZES[kind][1], dtype=np.uint8), kind)  # one block
        except NotImplementedError:
            return False
        return True

    first: dict[Any, Any] = {}  # each type's first tensor, in the file's order (one block dequantized per type)
    for t in tensors:
        first.setdefault(t.tensor_type, t)
    for t in first.values():
        if not readable(t.tensor_type):
            kinds = sorted(k.name for k in GGMLQuantizationType if k in GGML_QUANT_SIZES and readable(k))
            raise ValueError(
                f"GGUF {str(gguf)!r} stores its tensor {t.name!r} as {t.tensor_type.name}, a type specray cannot "
                f"read (gguf-py cannot dequantize it); the types it reads: {kinds}. Convert or quantize the model "
                "again into one of those (llama.cpp's llama-quantize, e.g. Q4_K_M or Q8_0)")


def _fix_gemma3_gguf_config(config, meta: dict[str, Any], gguf: Path) -> None:
    """Set what transformers' Gemma 3 GGUF mapping leaves at its defaults although llama.cpp (whose files these
    are) derives it otherwise: the query scale, ``query_pre_attn_scalar`` (llama.cpp: ``head_dim``, or
    ``hidden_size / heads`` for the 62-layer 27B; transformers: 256 whatever the head size) and the global
    layers' linear RoPE scaling (``rope.scaling.*``; Gemma 3 4B, 12B and 27B scale by 8). The local layers' RoPE
    (base 10000, unscaled) and the sliding pattern (every 6th layer global) are fixed in llama.cpp and
    transformers' defaults alike."""
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads \
        if config.num_hidden_layers == 62 else config.head_dim
    scaling = meta.get("gemma3.rope.scaling.type", "none")
    if scaling == "none":
        return
    factor = meta.get("gemma3.rope.scaling.factor")
    if scaling != "linear" or factor is None:
        raise ValueError(f"GGUF gemma3.rope.scaling.type={scaling!r} with gemma3.rope.scaling.factor={factor!r} is "
                         "not Gemma 3's RoPE scaling (linear, with a factor); pass the model's HF checkpoint instead")
    config.rope_parameters["full_attention"].update(rope_type="linear", factor=float(factor))


def _fix_gemma2_gguf_config(config, meta: dict[str, Any], gguf: Path) -> None:
    """Set what transformers' Gemma 2 GGUF mapping leaves at its defaults (one release's) although llama.cpp writes
    or derives it: the soft caps (``attn_logit_softcapping``, ``final_logit_softcapping``) and the query scale
    (llama.cpp: ``head_dim``, or ``hidden_size / heads`` for the 46-layer 27B). The pattern (every other layer
    sliding, from the first) is fixed in llama.cpp and transformers' default alike."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta.get(f"gemma2.{key}")
        setattr(config, key, float(value) if value else None)
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads \
        if config.num_hidden_layers == 46 else config.head_dim


def _fix_qwen_gguf_config(arch: str) -> Callable[[Any, dict[str, Any]], None]:
    """Qwen's widths as the GGUF gives them, where transformers' mapping reads none and leaves its defaults (one
    release's): a Qwen3's head size (``{arch}.attention.key_length``; a Qwen3 of any other than 128 would not load)
    and a mixture of experts' widths (``{arch}.expert_feed_forward_length`` and, with a shared expert,
    ``{arch}.expert_shared_feed_forward_length``: Qwen2-57B-A14B's or Qwen3-235B-A22B's would not load)."""

    def fix(config, meta: dict[str, Any], gguf: Path) -> None:
        widths = [("expert_feed_forward_length", "moe_intermediate_size"),
                  ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")]
        if arch.startswith("qwen3"):  # Qwen2's heads are hidden_size / heads wide, as its config has no head_dim
            widths.append(("attention.key_length", "head_dim"))
        for key, field in widths:
            value = meta.get(f"{arch}.{key}")
            if value is not None:
                setattr(config, field, int(value))

    return fix


def _fix_phi3_gguf_config(config, meta: dict[str, Any], gguf: Path) -> None:
    """Set what transformers' Phi-3 GGUF mapping leaves at its defaults although llama.cpp writes it: the pretrained
    length, the rotated share of each head (``rope.dimension_count``: Phi-4-mini rotates 3/4), the sliding window
    (0: none) and LongRoPE, whose per-frequency factors llama.cpp stores as the tensors ``rope_factors_short`` and
    ``rope_factors_long`` and whose cos/sin scale as ``rope.scaling.attn_factor``."""
    from gguf import GGUFReader

    head_dim = config.hidden_size // config.num_attention_heads
    config.original_max_position_embeddings = int(meta.get("phi3.rope.scaling.original_context_length",
                                                           config.max_position_embeddings))
    config.sliding_window = int(meta.get("phi3.attention.sliding_window", 0)) or None
    rope = dict(config.rope_parameters)
    rope["partial_rotary_factor"] = int(meta.get("phi3.rope.dimension_count", head_dim)) / head_dim
    factors = {t.name: t.data.tolist() for t in GGUFReader(str(gguf)).tensors if t.name.startswith("rope_factors_")}
    if factors:
        if set(factors) != {"rope_factors_short.weight", "rope_factors_long.weight"}:
            raise ValueError(f"GGUF {str(gguf)!r} has LongRoPE factors {sorted(factors)}, not Phi-3's short and long "
                             "ones; pass the model's HF checkpoint instead")
        rope.update(rope_type="longrope", short_factor=factors["rope_factors_short.weight"],
                    long_factor=factors["rope_factors_long.weight"],
                    original_max_position_embeddings=config.original_max_position_embeddings)
        if "phi3.rope.scaling.attn_factor" in meta:
            rope["attention_factor"] = float(meta["phi3.rope.scaling.attn_factor"])
    config.rope_parameters = rope


def _fix_nemotron_gguf_config(config, meta: dict[str, Any], gguf: Path) -> None:
    """What transformers' Nemotron mapping leaves at its defaults although the GGUF has it: the head size
    (``attention.key_length``), the rotated share of each head (``rope.dimension_count``; the releases rotate half),
    linear RoPE scaling (``rope.scaling.*``), the LayerNorms' epsilon (llama.cpp writes ``layer_norm_epsilon``,
    transformers looks for the RMS one) and whether the attention and MLP projections have biases (their tensors are
    in the file or not)."""
    from gguf import GGUFReader

    config.norm_eps = float(meta.get("nemotron.attention.layer_norm_epsilon", config.norm_eps))
    head_dim = int(meta.get("nemotron.attention.key_length") or config.hidden_size // config.num_attention_heads)
    config.head_dim = head_dim
    rotated = meta.get("nemotron.rope.dimension_count")
    if rotated is not None:
        config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": int(rotated) / head_dim}
    scaling = meta.get("nemotron.rope.scaling.type")
    if scaling == "linear":
        config.rope_parameters = {**config.rope_parameters, "rope_type": "linear",
                                  "factor": float(meta["nemotron.rope.scaling.factor"])}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF {str(gguf)!r} has nemotron.rope.scaling.type={scaling!r}; llama.cpp writes Nemotron's "
                         "as 'linear' or none. Pass the model's HF checkpoint instead")
    names = {t.name for t in GGUFReader(str(gguf)).tensors}
    config.attention_bias = "blk.0.attn_q.bias" in names
    config.mlp_bias = "blk.0.ffn_up.bias" in names


def _fix_gpt_oss_gguf_config(config, meta: dict[str, Any], gguf: Path) -> None:
    """GPT-OSS's config as llama.cpp writes it, where transformers' mapping leaves defaults (or misreads the RoPE
    scaling): the head size, the window, the experts' width, YaRN (``rope.scaling.*``; the betas where written, else
    the release's 32 and 1; the release's untruncated correction range, which a GGUF cannot say) and the layers'
    kinds (fixed in llama.cpp: every other layer sliding, from the first). The SwiGLU's clamp (7) and alpha (1.702)
    are fixed in llama.cpp and are transformers' defaults."""
    def get(key: str, default=None):
        return meta.get(f"gpt-oss.{key}", default)

    config.head_dim = int(get("attention.key_length", config.head_dim))
    config.sliding_window = int(get("attention.sliding_window", config.sliding_window))
    config.intermediate_size = int(get("expert_feed_forward_length", config.intermediate_size))
    config.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                          for i in range(config.num_hidden_layers)]
    rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type")
    if scaling == "yarn":
        rope.update(rope_type="yarn", factor=float(get("rope.scaling.factor")), truncate=False,
                    beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
                    original_max_position_embeddings=int(get("rope.scaling.original_context_length")))
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF {str(gguf)!r} has gpt-oss.rope.scaling.type={scaling!r}; GPT-OSS's is 'yarn' (or "
                         "none). Pass the model's HF checkpoint instead")
    config.rope_parameters = rope


def _fix_gguf_rope(config, meta: dict[str, Any], gguf: Path, arch: str) -> None:
    """The RoPE llama.cpp's converter writes, where transformers' GGUF mapping reads the base alone (StarCoder2's
    not even that): the scaling, linear or YaRN (``rope.scaling.*``), or Llama 3's per-frequency factors (the tensor
    ``rope_freqs``, in every Llama 3.1, 3.2 and 3.3 GGUF); see :func:`specray.models.gguf_read.rope_parameters`. A
    StarCoder2 GGUF carries no sliding window: llama.cpp runs StarCoder2 without one, and so does the model loaded
    from it."""
    from gguf import GGUFReader

    factors = next((gguf_dequantized(t) for t in GGUFReader(str(gguf)).tensors if t.name == "rope_freqs.weight"), None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotated = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    rope = rope_parameters(GGUFMeta(meta, arch, gguf), factors, rotated)
    config.rope_parameters = {**config.rope_parameters, **rope}


# llama.cpp's architectures whose RoPE their own fix reads (Phi-3's LongRoPE, Gemma 3's per kind of layer, Nemotron's,
# GPT-OSS's YaRN) or that have none (Mamba); the others' RoPE scaling is read by _fix_gguf_rope
_GGUF_OWN_ROPE = {"phi3", "gemma3", "nemotron", "gpt-oss", "mamba"}
_GGUF_CONFIG_FIXES = {"nemotron": _fix_nemotron_gguf_config,
                      "gpt-oss": _fix_gpt_oss_gguf_config,
                      "gemma2": _fix_gemma2_gguf_config, "gemma3": _fix_gemma3_gguf_config,
                      "phi3": _fix_phi3_gguf_config, "qwen2moe": _fix_qwen_gguf_config("qwen2moe"),
                      "qwen3": _fix_qwen_gguf_config("qwen3"), "qwen3moe": _fix_qwen_gguf_config("qwen3moe")}


# llama.cpp's names of a Mixtral layer's router and stacked experts -> Mixtral's checkpoint names (w1: gate, w3: up,
# w2: down; one tensor per expert)
_GGUF_MIXTRAL = {"ffn_gate_inp": "gate", "ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}


def _check_mixtral_layout(gguf: Path) -> None:
    """Refuse, with the way out, llama.cpp's first Mixtral layout: a tensor per expert (``blk.0.ffn_gate.3``), where
    current files stack them (``blk.0.ffn_gate_exps``)."""
    from gguf import GGUFReader

    for t in GGUFReader(str(gguf)).tensors:
        parts = t.name.split(".")
        if len(parts) == 5 and parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down") \
                and parts[3].isdigit():  # blk.0.ffn_gate.3.weight
            raise ValueError(f"GGUF {str(gguf)!r} stores a tensor per expert ({t.name}: llama.cpp's first Mixtral "
                             "layout); convert it again with a current llama.cpp, or pass the HF checkpoint")


def _gguf_layer_tensors(gguf: Path, kinds) -> Iterator[tuple[int, dict[tuple[str, str], torch.Tensor]]]:
    """A GGUF's per-layer tensors ``blk.{layer}.{kind}.{weight|bias}`` of the given kinds, in any of llama.cpp's
    types, dequantized to float32 in their logical shape (slowest dim first): one layer at a time, as
    ``(layer, {(kind, weight|bias): tensor})``, each layer read when it is taken."""
    from gguf import GGUFReader

    per_layer: dict[int, dict[tuple[str, str], Any]] = {}
    for t in GGUFReader(str(gguf)).tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in kinds:
            per_layer.setdefault(int(parts[1]), {})[parts[2], parts[3]] = t
    for layer in sorted(per_layer):
        yield layer, {key: gguf_dequantized(t) for key, t in per_layer.pop(layer).items()}


def _gguf_mixtral_experts(gguf: Path) -> Iterator[dict[str, torch.Tensor]]:
    """A Mixtral GGUF's routers and experts (stacked per kind, [E, ...]) named as Mixtral's HF checkpoint names
    them, a layer at a time."""
    for layer, t in _gguf_layer_tensors(gguf, _GGUF_MIXTRAL):
        base = f"model.layers.{layer}.block_sparse_moe."
        out: dict[str, torch.Tensor] = {}
        for (kind, _), value in t.items():
            if kind == "ffn_gate_inp":
                out[base + "gate.weight"] = value
                continue
            for e, expert in enumerate(value):
                out[f"{base}experts.{e}.{_GGUF_MIXTRAL[kind]}.weight"] = expert.contiguous()
        yield out


def _gguf_gpt_oss_tensors(gguf: Path) -> Iterator[dict[str, torch.Tensor]]:
    """A GPT-OSS GGUF's sinks (``attn_sinks.weight``) and experts (llama.cpp splits the release's fused gate/up:
    ``ffn_gate_exps`` and ``ffn_up_exps`` [E, I, H], or with ``--fuse-gate-up-exps`` ``ffn_gate_up_exps`` [E, 2I, H],
    gate rows then up rows; ``ffn_down_exps`` [E, H, I]; each with a bias; MXFP4 in the releases) in the HF
    checkpoint's layout: ``gate_up_proj`` [E, H, 2I] with gate and up interleaved along 2I (its bias too),
    ``down_proj`` [E, I, H]; a layer at a time."""
    kinds = ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps", "attn_sinks")
    for layer, t in _gguf_layer_tensors(gguf, kinds):
        out = {f"model.layers.{layer}.self_attn.sinks": t["attn_sinks", "weight"]}
        if ("ffn_gate_up_exps", "weight") in t:
            (gate, up), (gate_bias, up_bias) = (t["ffn_gate_up_exps", part].chunk(2, dim=1)
                                                for part in ("weight", "bias"))
        else:
            gate, up, gate_bias, up_bias = (t[kind, part] for part in ("weight", "bias")
                                            for kind in ("ffn_gate_exps", "ffn_up_exps"))
        down = t["ffn_down_exps", "weight"]
        base = f"model.layers.{layer}.mlp.experts."
        out[base + "gate_up_proj"] = torch.stack((gate, up), -1).transpose(1, 2).flatten(2).contiguous()
        out[base + "gate_up_proj_bias"] = torch.stack((gate_bias, up_bias), -1).flatten(1)
        out[base + "down_proj"] = down.transpose(1, 2).contiguous()
        out[base + "down_proj_bias"] = t["ffn_down_exps", "bias"]
        yield out


def _mixtral_config(config, meta: dict[str, Any]):
    """Mixtral's config from transformers' reading of the GGUF as a dense Llama (its attention, sizes and tokens)
    and the experts llama.cpp writes (``llama.expert_count``, ``llama.expert_used_count``)."""
    from transformers import MixtralConfig

    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
              "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act")
    width = meta.get("llama.expert_feed_forward_length") or config.intermediate_size
    return MixtralConfig(**{f: getattr(config, f) for f in fields if getattr(config, f, None) is not None},
                         num_local_experts=int(meta["llama.expert_count"]),
                         num_experts_per_tok=int(meta["llama.expert_used_count"]), sliding_window=None,
                         intermediate_size=int(width), architectures=["MixtralForCausalLM"])


def _falcon_mamba_config(config):
    """Falcon-Mamba's config from transformers' reading of its GGUF as a Mamba (the same sizes and tensor names);
    the B / C / dt norms' epsilon is the release's (llama.cpp writes none)."""
    from transformers import FalconMambaConfig

    fields = {k: v for k, v in config.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version")}
    return FalconMambaConfig(**fields, architectures=["FalconMambaForCausalLM"])


def _save_gguf_tokenizer(gguf: Path, out: Path, meta: dict[str, Any]) -> None:
    """The GGUF's tokenizer, as transformers builds it from the file, saved into ``out``. A byte-level BPE
    vocabulary (``tokenizer.ggml.model`` ``gpt2``) is saved under the generic class, so that loading the folder
    reads its tokenizer.json as written: the model type's own class would rebuild its pipeline around the
    vocabulary (Gemma's: a sentencepiece one, spaces as metaspaces and no byte level, which then fails on the
    first byte it lacks, having no unk token), where loading the GGUF itself kept the byte-level one. The tokenizer
    of a family we read ourselves (``_GGUF_READERS``) is built by the generic class directly: ``AutoTokenizer`` would
    first read the file's config, which transformers cannot for a Qwen3-Next, a Mamba-2 hybrid (nor for a Qwen3.5
    written without multimodal RoPE sections)."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer, TokenizersBackend

    tokenizer_class = TokenizersBackend if meta.get("general.architecture") in _GGUF_READERS else AutoTokenizer
    if meta.get("tokenizer.ggml.model") is None:
        raise ValueError(f"GGUF {str(gguf)!r} has no tokenizer.ggml.model (nor, then, a vocabulary transformers can "
                         "build a tokenizer from): pass a GGUF converted with its tokenizer")
    tokens = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.tokens")
    for kind in ("bos", "eos", "unknown", "padding"):  # the ids transformers looks up in the vocabulary
        token_id = meta.get(f"tokenizer.ggml.{kind}_token_id")
        if tokens is not None and token_id is not None and not 0 <= token_id < len(tokens.data):
            raise ValueError(f"GGUF {str(gguf)!r} has tokenizer.ggml.{kind}_token_id={token_id}, past its vocabulary "
                             f"of {len(tokens.data)} tokens; its metadata is corrupt: convert the model again")
    try:
        tokenizer = tokenizer_class.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except KeyError as err:  # transformers' reading of the tokenizer.ggml.* fields looks each up by name
        raise ValueError(
            f"GGUF {str(gguf)!r} has no tokenizer.ggml.{err.args[0]}, which transformers needs to build its "
            f"{meta.get('tokenizer.ggml.model')!r} tokenizer from the file (tokenizer.ggml.tokens, and merges or "
            "scores); its vocabulary is incomplete: pass a GGUF converted with its tokenizer") from None
    tokenizer.save_pretrained(out)
    if meta.get("tokenizer.ggml.model") == "gpt2":
        path = out / "tokenizer_config.json"
        tokenizer_config = json.loads(path.read_text())
        tokenizer_config["tokenizer_class"] = "TokenizersBackend"
        path.write_text(json.dumps(tokenizer_config, indent=2))


# fields transformers must not see, by llama.cpp architecture: its reading of GPT-OSS's RoPE scaling fails on every
# file that has it (transformers 5 takes each field's first part, the key's length, for its value); we read them
_GGUF_FIELDS_HIDDEN = {"gpt-oss": "gpt-oss.rope.scaling."}


_PARSE_LOCK = threading.RLock()  # one conversion at a time patches gguf.GGUFReader (threads of one process)


@contextlib.contextmanager
def _parsed_once(gguf: Path) -> Iterator[Any]:
    """Within the block, ``gguf.GGUFReader(gguf)`` is one parse of the file, made here and yielded: every read of
    it (ours, and transformers' for its config, its tokenizer and its tensors, which import the class as they read)
    shares it, where each would parse the file again (a parse walks every metadata field, a vocabulary's strings
    one at a time: seconds each). Other files parse as usual."""
    import gguf as gguf_module

    with _PARSE_LOCK:
        reader_class = gguf_module.GGUFReader
        parsed = parsed_gguf(gguf, reader_class)  # a ValueError naming a truncated or corrupt file

        class Reader(reader_class):
            def __new__(cls, path, *args, **kwargs):
                if not args and not kwargs and Path(path).resolve() == gguf:
                    return parsed  # an instance of the class itself, not of Reader: no second __init__
                return super().__new__(cls)

        gguf_module.GGUFReader = Reader
        try:
            yield parsed
        finally:
            gguf_module.GGUFReader = reader_class


class _ShardWriter:
    """A converted GGUF's HF tensors, saved into ``out`` as they come: held until a group of them ends (a layer:
    transformers' tensor processors may still fill in a tensor of the layer they read) with ``shard_bytes`` or more
    held, then saved as one safetensors shard. Names, ``in`` and item access are what those processors use of the
    dict they write into. ``close`` names the shards as HF names a sharded checkpoint's, with its index (one shard:
    ``model.safetensors``)."""

    def __init__(self, out: Path, shard_bytes: int, dtype: torch.dtype = torch.float32, ints: RowIndex | None = None):
        self.out, self.shard_bytes, self.dtype = out, shard_bytes, dtype  # the floating tensors' dtype on disk
        self.skip: Callable[[str], bool] | None = None  # names not to keep, while it is set
        # the file's integer rows, and the model's decoder layers once its config is read (None: keep no integers): a
        # weight of those layers made of the rows is saved as their integers (gguf_quant)
        self.ints, self.layers = ints, None
        self.kept_ints: set[str] = set()  # the names saved as integers
        self.held: dict[str, torch.Tensor] = {}
        self.saved: dict[str, str] = {}  # name -> its shard's file
        self.shards: list[str] = []
        self.total_bytes = 0

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        if self.skip is not None and self.skip(name):
            return
        assert name not in self.saved, f"{name} was saved before the group that sets it again"
        self.held[name] = tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.held[name]

    def __contains__(self, name: str) -> bool:
        return name in self.held or name in self.saved

    def names(self) -> set[str]:
        return set(self.held) | set(self.saved) | self.kept_ints

    def add_group(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self[name] = tensor
        self.end_group()

    def end_group(self) -> None:
        if sum(t.numel() * t.element_size() for t in self.held.values()) >= self.shard_bytes:
            self._save()

    def _save(self) -> None:
        from safetensors.torch import save_file

        if not self.held:
            return
        name = f"model-{len(self.shards) + 1:05d}.safetensors"
        held = {}
        for k in list(self.held):  # each dropped as it is cast: at most the shard and one tensor held at once
            v = self.held.pop(k)
            kept = self._ints(k, v)
            if kept is not None:
                for name, w in stored_weights(k, tuple(v.shape), kept):
                    held |= {f"{name.removesuffix('.weight')}.{part}": t for part, t in gguf_parts(w).items()}
                self.kept_ints.add(k)
                continue
            held[k] = (v.to(self.dtype) if v.is_floating_point() else v).contiguous()
        save_file(held, str(self.out / name), metadata={"format": "pt"})
        self.shards.append(name)
        self.saved |= dict.fromkeys(held, name)
        self.total_bytes += sum(t.numel() * t.element_size() for t in held.values())
        self.held = {}

    def _ints(self, name: str, tensor: torch.Tensor) -> IntWeight | None:
        if self.ints is None or self.layers is None or not keeps_name(name, self.layers, tensor.dim()):
            return None
        return self.ints.match(tensor)

    def close(self) -> None:
        self._save()
        if len(self.shards) == 1:
            os.rename(self.out / self.shards[0], self.out / "model.safetensors")
            return
        final = {name: f"model-{i:05d}-of-{len(self.shards):05d}.safetensors"
                 for i, name in enumerate(self.shards, 1)}
        for name, final_name in final.items():
            os.rename(self.out / name, self.out / final_name)
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": {k: final[v] for k, v in sorted(self.saved.items())}}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_gguf_folder(gguf: Path, out: Path) -> None:
    with _parsed_once(gguf) as parsed:
        meta = _gguf_metadata(gguf)
        arch = meta.get("general.architecture")
        _check_gguf_split(gguf, meta)
        _check_gguf_architecture(gguf, arch)
        _check_gguf_tensor_types(gguf, parsed.tensors)
        mixtral = arch == "llama" and bool(meta.get("llama.expert_count"))  # llama.cpp's Mixtral: a llama with experts
        if mixtral:
            _check_mixtral_layout(gguf)
        hidden = _GGUF_FIELDS_HIDDEN.get(arch)
        for key in [key for key in parsed.fields if hidden and key.startswith(hidden)]:
            del parsed.fields[key]  # after our own reads of them (``meta``)
        writer = _ShardWriter(out, GGUF_SHARD_BYTES, getattr(torch, gguf_storage_dtype()), RowIndex(parsed.tensors))
        if arch in _GGUF_READERS:  # read by us: transformers' mapping gives no dense tensors of these
            config, groups = _GGUF_READERS[arch](gguf, arch)
            get_model_class(config)
            writer.layers = getattr(config, "num_hidden_layers", None)
            for group in groups:
                writer.add_group(group)
        else:
            config = _gguf_checkpoint(gguf, meta, arch, mixtral, writer)
        writer.close()
        if writer.dtype != torch.float32:
            config.dtype = writer.dtype
        if writer.kept_ints:
            config.quantization_config = gguf_quantization_config()
            logger.info("GGUF %s: %d weights keep their integers", gguf, len(writer.kept_ints))
        config.save_pretrained(out)
        _save_gguf_tokenizer(gguf, out, meta)
    st = gguf.stat()
    marker = {"gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "version": GGUF_CONVERSION_VERSION,
              "dtype": gguf_storage_dtype()}
    (out / _GGUF_MARKER).write_text(json.dumps(marker))


def _gguf_checkpoint(gguf: Path, meta: dict[str, Any], arch: str, mixtral: bool, writer: _ShardWriter) -> Any:
    """The HF config a GGUF stands for, its tensors written into ``writer``: transformers' GGUF mapping, with our
    fixes where it reads the file wrongly or not at all."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with _remote_code_errors(gguf):
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _check_gguf_context_length(gguf, meta, arch, config)
    if arch in _GGUF_CONFIG_FIXES:
        _GGUF_CONFIG_FIXES[arch](config, meta, gguf)
    if arch not in _GGUF_OWN_ROPE:
        _fix_gguf_rope(config, meta, gguf, arch)
    get_model_class(config)  # fail early on an architecture we do not serve
    writer.layers = config.num_hidden_layers
    _check_gguf_blocks(gguf, arch, config.num_hidden_layers)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    # read below, not by transformers: a Mixtral's experts (it maps none), GPT-OSS's (it maps them wrongly) and
    # sinks (llama.cpp names them ``attn_sinks.weight``, transformers looks for ``attn_sinks``)
    own = (".mlp.",) if mixtral else (".mlp.experts.", ".self_attn.sinks") if arch == "gpt-oss" else ()
    expected = {n for n in hf_model.state_dict() if not (n == "lm_head.weight" and config.tie_word_embeddings)
                and not any(part in n for part in own)}
    writer.skip = lambda name: any(part in name for part in own)
    _transformers_gguf_tensors(gguf, arch, _NameOnlyModel(config, sorted(expected)), hf_model, expected, writer)
    writer.skip = None
    missing = expected - writer.names()
    if missing:
        raise ValueError(f"GGUF {str(gguf)!r} lacks tensors {sorted(missing)[:5]} of {config.model_type}")
    for group in _gguf_mixtral_experts(gguf) if mixtral else _gguf_gpt_oss_tensors(gguf) if arch == "gpt-oss" else ():
        writer.add_group(group)
    if mixtral:
        config = _mixtral_config(config, meta)
    if arch == "mamba" and meta.get("mamba.ssm.dt_b_c_rms"):  # llama.cpp's Falcon-Mamba: a Mamba whose B, C and dt
        config = _falcon_mamba_config(config)  # are normed, which transformers' mapping reads as a plain Mamba
    return config


def _check_gguf_context_length(gguf: Path, meta: dict[str, Any], arch: str, config) -> None:
    """ValueError where ``{arch}.context_length`` is not positive (a model of length 0 would load);
    a warning where it is absent (llama.cpp's converter leaves it out where the HF config had none), naming the
    length transformers' default then gives the model."""
    value = meta.get(f"{arch}.context_length")
    if value is not None and not int(value) > 0:
        raise ValueError(f"GGUF {str(gguf)!r} has {arch}.context_length={value}, which must be positive; its "
                         "metadata is corrupt: fix the key, or convert the model again")
    if value is None:
        length = getattr(config, "max_position_embeddings", None)
        logger.warning("GGUF %r has no %s.context_length; the model's length is transformers' default for %s "
                       "(%s); pass hf_overrides={'max_position_embeddings': N} (--hf-overrides) to set it",
                       str(gguf), arch, config.model_type, length)


def _check_gguf_blocks(gguf: Path, arch: str, layers: int) -> None:
    """ValueError where the file holds a block's tensors past its ``{arch}.block_count``: transformers' mapping
    leaves them out, and the model would load without those layers and compute something else."""
    from gguf import GGUFReader

    blocks = sorted({int(t.name.split(".")[1]) for t in GGUFReader(str(gguf)).tensors
                     if t.name.startswith("blk.") and t.name.split(".")[1].isdigit()})
    if blocks and blocks[-1] >= layers:
        raise ValueError(f"GGUF {str(gguf)!r} has {arch}.block_count={layers} but holds tensors of blocks up to "
                         f"blk.{blocks[-1]}: its metadata does not describe its tensors (a file edited or written "
                         "by hand?); fix block_count to the number of blocks, or convert the model again")


def _transformers_gguf_tensors(gguf: Path, arch: str, names: nn.Module, hf_model: nn.Module, expected: set[str],
                               writer: _ShardWriter) -> None:
    """The GGUF's tensors that transformers' GGUF support maps, in the HF layout (its tensor processors: llama.cpp's
    q/k permutation undone, experts merged, ...) and under HF names, written into ``writer`` a layer at a time:
    what its ``load_gguf_checkpoint(return_tensors=True)`` returns as one dict, without holding them all. The name
    map comes from ``names`` (parameter names alone: fast) unless it misses an ``expected`` name, then from the
    model itself."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, \
        get_gguf_hf_weights_map, load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(gguf))  # the metadata as transformers reads it: its tensor processor's config
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    mapping = get_gguf_hf_weights_map(names, processor)
    if not expected <= set(mapping.values()):
        mapping = get_gguf_hf_weights_map(hf_model, processor)
    parsed["tensors"] = writer  # where the processors that merge tensors (experts) write them
    layer = None
    for t in GGUFReader(str(gguf)).tensors:
        block = t.name.split(".")[1] if t.name.startswith("blk.") else None
        if block != layer:
            writer.end_group()
            layer = block
        try:
            result = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name,
                                       tensor_key_mapping=mapping, parsed_parameters=parsed)
        except ValueError as err:  # a processor's reshape (llama.cpp's q/k order undone) of a tensor of wrong size
            shape = [int(n) for n in reversed(t.shape)]
            raise ValueError(f"GGUF {str(gguf)!r}: its tensor {t.name!r} of shape {shape} does not fit the {arch} "
                             f"model its metadata describes ({err}); the file is corrupt or its metadata wrong: "
                             "convert the model again") from None
        if result.name in mapping:
            writer[mapping[result.name]] = torch.from_numpy(np.copy(result.weights))
    writer.end_group()
