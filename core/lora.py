"""LoRA adapters served beside the base model (vLLM's multi-LoRA): plain data and adapter checks, torch-free.

A request names an adapter with a :class:`LoRARequest` (``LLM.generate(..., lora_request=...)``, or the OpenAI
server's ``model`` field naming one of its ``--lora-modules``). An adapter is a PEFT folder: ``adapter_config.json``
(``r``, ``lora_alpha``, ``use_rslora``) and ``adapter_model.safetensors`` (or ``.bin``) holding, for each adapted
projection, ``...<module>.lora_A.weight`` [r, in] and ``...<module>.lora_B.weight`` [out, r]; the projection then
computes ``x W^T + s (x A^T) B^T`` with ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA).

The engine checks an adapter when a request first names it (:class:`AdapterChecker`: the folder, its config, the
modules its tensors adapt, its rank against ``max_lora_rank``), so a bad adapter fails its request alone; the
workers load its tensors into one of ``max_loras`` slots when a step first needs it
(:mod:`specray.models.lora`). A step holds at most ``max_loras`` distinct adapters (the scheduler sees to it) and
any mix of requests with and without them.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# what precedes a module's name in PEFT's tensor names (``base_model.model.`` + the base model's own name)
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
_LORA_BIAS = re.compile(r".+\.lora_[AB](?:\.[^.]+)?\.bias$")  # a trained LoRA bias (PEFT's lora_bias=True)
_NO_LORA_BIAS = ("trained LoRA biases (lora_bias) are not supported: train the adapter with lora_bias=False, or "
                 "merge it into the base model")
# an adapter of a multimodal release (Gemma 3's, Llama-4's ...ForConditionalGeneration): its text model's modules
# under these names (transformers' older layout, then its newer one) are the text model's own ``model.``
_TEXT_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")
# ... and the modules of its other towers, which a text-only engine never runs (their matrices are left out, as
# they cannot change any output of ours; Qwen-VL's vision tower and merger are ``visual.``, or ``model.visual.``
# where the text model is ``model.language_model.``)
_OTHER_TOWERS = ("vision_tower.", "vision_model.", "multi_modal_projector.", "model.vision_tower.",
                 "model.vision_model.", "model.multi_modal_projector.", "visual.", "model.visual.")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter a request runs with. ``lora_int_id`` (>= 1) identifies it: requests with the same id
    share its slot and its cached prefixes, so one id must always name one folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} must be an int >= 1 (it identifies the adapter)")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r} must be the adapter's folder (adapter_config.json and "
                             "adapter_model.safetensors)")

    @property
    def cache_key(self) -> str:
        """What separates this adapter's cached prefixes from the base model's and other adapters'."""
        return f"lora:{self.lora_int_id}"


# an adapter's name in a folder of adapters (Ray Serve LLM's dynamic_lora_loading_path): one plain path component
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_DYNAMIC_IDS = 1 << 20  # dynamic adapters' ids start here, above any list of named adapters
RUNTIME_IDS = 1 << 19  # adapters loaded through the server's load route: ids from here, below the dynamic ones


def dynamic_lora_id(name: str) -> int:
    """The id of the adapter ``name`` from a folder of adapters: the same on every replica and every restart (an id
    names one folder in an engine), from the name alone."""
    return _DYNAMIC_IDS + zlib.crc32(name.encode()) % (1 << 30)


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA options: ``max_loras`` adapters in one step (each a slot on every rank), of rank at most
    ``max_lora_rank``; ``max_cpu_loras`` adapters' tensors kept in host memory (at least ``max_loras``)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras={cpu!r} must be an int >= max_loras={self.max_loras}, or None "
                             "(max_loras)")

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class AdapterInfo:
    """What the engine read of an adapter: its scale per rank, and the projections it adapts (base-model module
    names, e.g. ``model.layers.0.self_attn.q_proj``) with their ranks."""

    path: str
    lora_alpha: float
    use_rslora: bool
    ranks: dict[str, int]

    def scale(self, rank: int) -> float:
        return self.lora_alpha / (rank ** 0.5 if self.use_rslora else rank)


def peft_module_of(key: str) -> str | None:
    """A PEFT tensor name -> the module it adapts as PEFT named it (the adapted model's own name, which
    ``target_modules`` and ``rank_pattern`` match); None for a tensor that is not a LoRA matrix."""
    match = _LORA_KEY.fullmatch(key.removeprefix(_PEFT_PREFIX))
    return None if match is None else match["module"]


def module_of(key: str) -> tuple[str, str] | None:
    """A PEFT tensor name -> (the base model's module it adapts, "A" or "B"), a multimodal release's text modules
    named as the text model's (``model.layers...``); None for a tensor that is not a LoRA matrix (e.g.
    ``lora_embedding_A``, a saved module)."""
    key = key.removeprefix(_PEFT_PREFIX)
    for prefix in _TEXT_MODEL_PREFIXES:
        if key.startswith(prefix):
            key = "model." + key[len(prefix):]
            break
    match = _LORA_KEY.fullmatch(key)
    return None if match is None else (match["module"], match["which"])


def of_other_tower(module: str) -> bool:
    """A module of a multimodal release's vision tower or projector: text-only serving never runs it."""
    return module.startswith(_OTHER_TOWERS)


def adapter_folder(path: str) -> Path:
    folder = Path(path).expanduser()
    if not (folder / ADAPTER_CONFIG).is_file():
        raise ValueError(f"lora_path={path!r} holds no {ADAPTER_CONFIG}: give the folder of a PEFT LoRA adapter "
                         "(adapter_config.json and adapter_model.safetensors)")
    return folder


def weights_file(folder: Path) -> Path:
    for name in ADAPTER_WEIGHTS:
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"lora adapter {str(folder)!r} holds none of {list(ADAPTER_WEIGHTS)}: save it with PEFT's "
                     "save_pretrained")


def read_adapter_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {folder / ADAPTER_CONFIG}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{folder / ADAPTER_CONFIG} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{folder / ADAPTER_CONFIG}: peft_type={config.get('peft_type')!r}; only LoRA adapters are "
                         "served")
    refused = {"use_dora": "DoRA", "modules_to_save": "modules saved whole (modules_to_save)",
               "alpha_pattern": "per-module alphas (alpha_pattern)"}
    for field, what in refused.items():
        if config.get(field):
            raise ValueError(f"{folder / ADAPTER_CONFIG}: {field}={config[field]!r}; adapters with {what} are not "
                             "supported: merge them into the base model, or train a plain LoRA adapter")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{folder / ADAPTER_CONFIG}: bias={config['bias']!r}; only adapters without trained biases "
                         "(bias='none') are supported")
    if config.get("lora_bias"):
        raise ValueError(f"{folder / ADAPTER_CONFIG}: lora_bias={config['lora_bias']!r}; {_NO_LORA_BIAS}")
    if "r" not in config:
        raise ValueError(f"{folder / ADAPTER_CONFIG} has no r: give the rank of its LoRA matrices (as PEFT's "
                         "save_pretrained writes it)")
    for field in ("r", "lora_alpha"):
        value = config.get(field, 8)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"{folder / ADAPTER_CONFIG}: {field}={value!r} must be a number > 0")
    targets = config.get("target_modules")
    if targets is not None and not isinstance(targets, str) and (
            not isinstance(targets, list) or not all(isinstance(t, str) for t in targets)):
        raise ValueError(f"{folder / ADAPTER_CONFIG}: target_modules={targets!r:.100} must be a list of module names "
                         "or a regular expression (a string)")
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict) or not all(isinstance(r, int) and not isinstance(r, bool) and r > 0
                                                for r in pattern.values()):
        raise ValueError(f"{folder / ADAPTER_CONFIG}: rank_pattern={pattern!r:.100} must map module patterns to "
                         "ranks (ints > 0)")
    regexes = [("rank_pattern", key) for key in pattern]
    if isinstance(targets, str):
        regexes.append(("target_modules", targets))
    for field, regex in regexes:
        try:
            re.compile(regex)
        except re.error as err:
            raise ValueError(f"{folder / ADAPTER_CONFIG}: {field} holds {regex!r:.100}, not a regular expression "
                             f"({err})") from None
    return config


def targeted(module: str, targets: list[str] | str | None) -> bool:
    """Whether PEFT adapts ``module`` (the adapted model's name for it) under ``target_modules``: a list names
    modules by their name or its last parts (``q_proj``), a string is a regular expression the whole name matches,
    ``"all-linear"`` any linear layer (specray's own check then says which it adapts); None: not recorded."""
    if targets is None or targets == "all-linear":
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def config_rank(config: dict, module: str) -> int:
    """The rank PEFT gives ``module``: its ``rank_pattern`` entry (the first whose pattern matches the name's end, at
    a ``.``), else ``r``."""
    for pattern, rank in (config.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return rank
    return config["r"]


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from a safetensors file's header alone (the tensors are not read)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError("header too large")
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError) as e:
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
    return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def bin_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape of a ``.bin`` (pickled) adapter, read onto the meta device (no tensor data)."""
    import torch  # only here: this module stays importable without torch

    try:
        state = torch.load(path, map_location="meta", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError) as e:
        raise ValueError(f"{path} is not a readable PyTorch file: {e}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds {type(state).__name__}, not a dict of tensors")
    return {k: list(v.shape) for k, v in state.items()}


def read_adapter(path: str, shapes: dict[str, tuple[int, int]] | None, max_rank: int,
                 rename: Callable[[str], str] | None = None) -> AdapterInfo:
    """Check the adapter at ``path`` against a base model whose projections that take LoRA are ``shapes``
    (module name -> its weight's (out, in) shape; None: the modules are not checked, only the folder, its config and
    its rank); ``rename``: an adapter's module name (the checkpoint's) as ``shapes`` names it (a family whose
    checkpoint names differ from its modules'); ValueError naming what does not fit."""
    folder = adapter_folder(path)
    config = read_adapter_config(folder)
    weights = weights_file(folder)
    tensors = safetensors_shapes(weights) if weights.suffix == ".safetensors" else bin_shapes(weights)
    ranks: dict[str, int] = {}
    seen: dict[str, set[str]] = {}
    towers = set()
    for key, shape in tensors.items():
        found = module_of(key)
        if found is None and _LORA_BIAS.fullmatch(key):
            raise ValueError(f"lora adapter {path!r}: tensor {key!r} is a LoRA bias; {_NO_LORA_BIAS}")
        if found is None:
            raise ValueError(f"lora adapter {path!r}: tensor {key!r} is not a LoRA matrix of a projection "
                             "(embeddings, LM heads and saved modules are not supported)")
        module, which = found
        if of_other_tower(module):
            towers.add(module)
            continue  # never run for text
        ours = module if rename is None else rename(module)
        if shapes is not None:  # by name first: a conv's LoRA (a linear-attention layer's conv1d) is not 2-D
            check_module(path, ours, shapes)
        if len(shape) != 2:
            raise ValueError(f"lora adapter {path!r}: {key} has shape {shape}; a LoRA matrix is 2-D")
        if shapes is not None:
            check_shape(path, ours, which, shape, shapes)
        named = peft_module_of(key)
        if not targeted(named, config.get("target_modules")):
            raise ValueError(f"lora adapter {path!r} holds LoRA matrices of {named!r}, which its target_modules="
                             f"{config['target_modules']!r:.200} does not name: save the adapter again with PEFT, "
                             "or fix target_modules in its adapter_config.json")
        seen.setdefault(module, set()).add(which)
        rank = shape[0] if which == "A" else shape[1]
        if ranks.setdefault(module, rank) != rank:
            raise ValueError(f"lora adapter {path!r}: {module}'s lora_A and lora_B disagree on the rank")
        if rank != config_rank(config, named):
            raise ValueError(f"lora adapter {path!r}: {named}'s LoRA matrices have rank {rank}, but its "
                             f"adapter_config.json gives it r={config_rank(config, named)} (r, or its rank_pattern "
                             "entry): the config does not describe these tensors; fix r (or rank_pattern)")
    for module, pair in seen.items():
        if pair != {"A", "B"}:
            raise ValueError(f"lora adapter {path!r}: {module} has lora_{''.join(pair)} without its other half")
    if not ranks:
        raise ValueError(f"lora adapter {path!r} holds no LoRA matrices" +
                         (" of the text model (only of the vision tower or projector, which text never runs)"
                          if towers else ""))
    if towers and shapes is not None:  # once, at admission (each rank reads the adapter again with shapes=None)
        logger.info("lora adapter %r: its %d modules of the vision tower and projector are left out (text-only "
                    "serving never runs them)", path, len(towers))
    rank = max(ranks.values())
    if rank > max_rank:
        raise ValueError(f"lora adapter {path!r} has rank {rank}, above max_lora_rank={max_rank}; start the engine "
                         f"with max_lora_rank >= {rank}")
    if shapes is not None:  # at admission: the tensors themselves, which each rank then loads unchecked
        check_values(path, weights)
    return AdapterInfo(str(folder), float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False)), ranks)


def check_values(path: str, weights: Path) -> None:
    """ValueError unless every LoRA matrix in ``weights`` reads whole (a file cut short passes the header's check)
    and is floating point with finite values: a NaN or an infinity would reach the other requests of its steps (each
    row computes every slot's columns, masked by a multiplication)."""
    import torch  # only here: this module stays importable without torch

    if weights.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(str(weights), framework="pt", device="cpu") as f:
                tensors = {key: f.get_tensor(key) for key in f.keys()}
        except (OSError, SafetensorError) as e:
            raise ValueError(f"lora adapter {path!r}: {weights.name} cannot be read whole ({e}): save the adapter "
                             "again") from None
    else:
        try:
            tensors = torch.load(weights, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, ValueError, EOFError) as e:
            raise ValueError(f"lora adapter {path!r}: {weights.name} cannot be read whole ({e}): save the adapter "
                             "again") from None
    for key, tensor in tensors.items():
        found = module_of(key)
        if found is None or of_other_tower(found[0]):  # (left out: never loaded)
            continue
        if not tensor.is_floating_point():
            raise ValueError(f"lora adapter {path!r}: {key} has dtype {tensor.dtype}; LoRA matrices are floating "
                             "point (save the adapter unquantized)")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"lora adapter {path!r}: {key} holds NaN or infinite values; the adapter cannot "
                             "serve (retrain it, or save it again from a finite checkpoint)")


def check_module(path: str, module: str, shapes: dict[str, tuple[int, int]]) -> None:
    """ValueError unless ``module`` is a projection the base model applies LoRA to."""
    if module not in shapes:
        layer = re.match(r"model\.layers\.(\d+)\.", module)
        layers = {int(found) for found in re.findall(r"^model\.layers\.(\d+)\.", "\n".join(shapes), re.M)}
        if layer is not None and layers and int(layer[1]) > max(layers):  # a deeper model's
            raise ValueError(f"lora adapter {path!r} adapts {module!r}, but this model's decoder layers are "
                             f"model.layers.{min(layers)} to model.layers.{max(layers)}: is the adapter for another "
                             "base model?")
        kinds = sorted({name.rsplit(".", 1)[-1] for name in shapes})
        raise ValueError(f"lora adapter {path!r} adapts {module!r}, which specray does not apply LoRA to in this "
                         f"model: it adapts the decoder layers' {kinds} (no experts, embeddings or LM head)")


def check_shape(path: str, module: str, which: str, shape: list[int], shapes: dict[str, tuple[int, int]]) -> None:
    """ValueError unless ``module`` is a projection the base model applies LoRA to and the matrix fits its weight:
    A [r, in], B [out, r]."""
    check_module(path, module, shapes)
    out_features, in_features = shapes[module]
    width, expected = (shape[1], in_features) if which == "A" else (shape[0], out_features)
    if width != expected:
        side = "input" if which == "A" else "output"
        raise ValueError(f"lora adapter {path!r}: {module}.lora_{which} has shape {shape}, but the base model's "
                         f"{module} has {expected} {side} features: is the adapter for another base model?")


class AdapterChecker:
    """The engine's record of the adapters its requests named: each checked once (``read_adapter``), and one id
    never naming two folders."""

    def __init__(self, config: LoRAConfig | None, shapes: dict[str, tuple[int, int]],
                 rename: Callable[[str], str] | None = None):
        self.config = config
        self.shapes = shapes  # the projections that take LoRA (specray.models.lora.adapter_shapes)
        self.rename = rename  # an adapter's module name as shapes names it (the model's adapter_module)
        self.seen: dict[int, tuple[str, AdapterInfo]] = {}

    def check(self, request: LoRARequest) -> AdapterInfo:
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request={request!r:.100} must be a specray.LoRARequest")
        if self.config is None:
            raise ValueError(f"lora_request names adapter {request.lora_name!r} but this engine serves no adapters; "
                             "start it with enable_lora=True (specray serve --enable-lora)")
        if not self.shapes:
            raise ValueError("this model's family does not take LoRA adapters in specray yet; serve it without "
                             "lora_request")
        known = self.seen.get(request.lora_int_id)
        if known is not None:
            if known[0] != request.lora_path:
                raise ValueError(f"lora_int_id={request.lora_int_id} already names the adapter at {known[0]!r}, not "
                                 f"{request.lora_path!r}: give each adapter its own id")
            return known[1]
        try:
            info = read_adapter(request.lora_path, self.shapes, self.config.max_lora_rank, self.rename)
        except ValueError as err:  # the request's adapter, by the name it gave (a server's "model")
            raise ValueError(f"lora_request={request.lora_name!r:.100}: {err}") from None
        self.seen[request.lora_int_id] = (request.lora_path, info)
        return info
