"""Find a model (local HF folder, local ``.gguf`` file or hub id), read its config and tokenizer, and load our
model with this rank's shard of the weights.

A GGUF file is converted once with transformers' GGUF support (dequantized, llama.cpp's q/k RoPE permutation
undone) into an HF folder -- config.json, model.safetensors, tokenizer files -- cached under
``$SPECRAY_CACHE_DIR`` (default ``~/.cache/specray``) and keyed by the file's path, size and mtime; later loads
read the cached folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specray.models.cpu_kernels import can_pack, pack_linear_weights
from specray.models.interface import CausalLM
from specray.models.registry import get_model_class, text_part
from specray.parallel import TPGroup

logger = logging.getLogger(__name__)

CACHE_ENV = "SPECRAY_CACHE_DIR"
_GGUF_MARKER = "specray_gguf.json"  # written last: a cache folder holding it is complete
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


@dataclass(frozen=True)
class ModelSource:
    """An HF-layout folder to load from. For a GGUF model it is the converted cache folder and ``gguf_file`` is
    the original file."""

    path: Path
    weight_files: tuple[Path, ...]
    weight_format: str  # "safetensors" | "bin"
    gguf_file: Path | None = None


# ---------------------------------------------------------------------------------------------- resolving


def resolve_model(model: str | os.PathLike) -> ModelSource:
    """Resolve ``model`` to a local HF folder (converting and caching a ``.gguf`` first, downloading a hub id
    when the hub is reachable)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _folder_source(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model={str(model)!r} is a file but not a .gguf; pass an HF model folder "
                             "(config.json + weights) or a .gguf file")
        folder = convert_gguf(path)
        return ModelSource(folder, *_weight_files(folder), gguf_file=path.resolve())
    if _looks_local(str(model)):
        raise ValueError(f"model={str(model)!r} does not exist; pass an existing HF model folder or .gguf file")
    return _folder_source(_download(str(model)))


def _looks_local(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or model.endswith(".gguf") or os.sep + os.sep in model \
        or model.count("/") > 1


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS + ["pytorch_model*.bin"]))
    except (OSError, ValueError, HfHubHTTPError) as err:
        raise ValueError(
            f"model={repo_id!r} is not a local path, and the hub could not provide it "
            f"({type(err).__name__}: {err}); pass an existing local folder or .gguf file, or go online"
        ) from err
    return folder


def _folder_source(folder: Path) -> ModelSource:
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {str(folder)!r} has no config.json; pass an HF model folder")
    return ModelSource(folder, *_weight_files(folder))


def _weight_files(folder: Path) -> tuple[tuple[Path, ...], str]:
    for index, fmt in (("model.safetensors.index.json", "safetensors"), ("pytorch_model.bin.index.json", "bin")):
        if (folder / index).is_file():
            names = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            return tuple(folder / n for n in names), fmt
    for pattern, fmt in (("model*.safetensors", "safetensors"), ("*.safetensors", "safetensors"),
                         ("pytorch_model*.bin", "bin")):
        files = sorted(folder.glob(pattern))
        if files:
            return tuple(files), fmt
    raise ValueError(f"model folder {str(folder)!r} has no weights: expected *.safetensors or pytorch_model*.bin "
                     "(optionally sharded with an index .json)")


# ---------------------------------------------------------------------------------------------- public loaders


def load_hf_config(model: str | os.PathLike):
    """The transformers ``PretrainedConfig`` of ``model`` (of its text model, for a multimodal checkpoint whose
    text we serve: :func:`specray.models.registry.text_part`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model(model).path)
    part = text_part(config)
    return config if part is None else part[0]


def load_tokenizer(model: str | os.PathLike):
    """The HF tokenizer of ``model``, chat template included."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(model).path)


def iter_weights(source: ModelSource) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) pairs; safetensors entries come as lazy slices so a TP rank reads only its shard."""
    from safetensors import safe_open

    for file in source.weight_files:
        if source.weight_format == "safetensors":
            with safe_open(str(file), framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    yield name, fh.get_slice(name)
        else:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            yield from state.items()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(model: str | os.PathLike, tp: TPGroup | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", pack: bool = True, expert_parallel: bool = False) -> CausalLM:
    """Our model for ``model`` with this rank's weights, in eval mode, on ``device`` in ``dtype``; fp32 on CPU
    with its linears' weights in oneDNN's blocked layout unless ``pack=False`` (see ``cpu_kernels.pack_weight``).
    ``expert_parallel``: a mixture of experts' experts split whole over the ranks of ``tp`` (else by width)."""
    from transformers import AutoConfig

    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} must be a floating point dtype (float32, float16, bfloat16)")
    source = resolve_model(model)
    config = AutoConfig.from_pretrained(source.path)
    weights = iter_weights(source)
    part = text_part(config)
    if part is not None:  # a multimodal checkpoint: its text model's config and tensors only
        config, prefix = part
        weights = ((name[len(prefix):], t) for name, t in weights if name.startswith(prefix))
    model_cls = get_model_class(config)
    with _default_dtype(dtype), torch.device(device):
        net = model_cls(config, tp or TPGroup.single(), **({"expert_parallel": True} if expert_parallel else {}))
    net.load_weights(weights)
    net.eval()
    for p in net.parameters():
        p.requires_grad_(False)
    if pack and can_pack(torch.device(device).type, str(dtype).removeprefix("torch.")):
        pack_linear_weights(net)
    return net


# ---------------------------------------------------------------------------------------------- GGUF


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/specray").expanduser()


def gguf_cache_folder(gguf: Path) -> Path:
    """Where the converted ``gguf`` lives: keyed by its absolute path, size and mtime."""
    gguf = gguf.resolve()
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """The cached HF folder for ``gguf``, converting it on first use."""
    folder = gguf_cache_folder(gguf)
    if (folder / _GGUF_MARKER).is_file():
        logger.info("GGUF %s: using cached conversion %s", gguf, folder)
        return folder
    logger.info("GGUF %s: converting (dequantizing) into %s", gguf, folder)
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
    return folder


class _NameOnlyModel(nn.Module):
    """Stands in for the HF model in transformers' GGUF name mapping, which only needs its config and
    parameter names (passing the real model maps every submodule again, several times slower)."""

    def __init__(self, config, names: list[str]):
        super().__init__()
        self.config = config
        self._names = names

    def state_dict(self, *args, **kwargs):
        return dict.fromkeys(self._names)


def _write_gguf_folder(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    get_model_class(config)  # fail early on an architecture we do not serve
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    expected = {n for n in hf_model.state_dict() if not (n == "lm_head.weight" and config.tie_word_embeddings)}
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True,
                                   model_to_load=_NameOnlyModel(config, sorted(expected)))["tensors"]
    if not expected <= set(tensors):  # the fast name map missed something: use transformers' full mapping
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=hf_model)["tensors"]
    missing = expected - set(tensors)
    if missing:
        raise ValueError(f"GGUF {str(gguf)!r} lacks tensors {sorted(missing)[:5]} of {config.model_type}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    st = gguf.stat()
    marker = {"gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    (out / _GGUF_MARKER).write_text(json.dumps(marker))
