"""Load a hidden-state draft head from the public checkpoint layouts into :class:`~specray.models.draft_head.DraftHead`.

* **EAGLE-1** (the EAGLE repository, vLLM's ``EagleLlamaForCausalLM``): a folder with ``config.json`` (a Llama
  config of one layer) and ``fc.weight`` [H, 2H] (+ ``fc.bias``), ``layers.0.*`` without ``input_layernorm``.
* **EAGLE-3** (the EAGLE repository, SpecForge, vLLM's ``LlamaForCausalLMEagle3``): ``fc.weight`` [H, 3H_target],
  ``midlayer.*`` or ``layers.0.*`` (with ``input_layernorm``, ``hidden_norm`` and a 2H-wide ``q/k/v_proj``),
  ``norm.weight``, ``lm_head.weight`` [V_draft, H] and ``d2t`` [V_draft] (``t2d`` is derived, so ignored).
  ``config.json`` may give ``draft_vocab_size``, ``target_hidden_size`` and
  ``eagle_config.eagle_aux_hidden_state_layer_ids``. specray extension: without ``lm_head.weight`` the head uses
  the target's LM head rows of its draft vocabulary (what ``specray train-draft`` writes, to stay small).
* **MTP** (DeepSeek-V3 layout): the target's own checkpoint, module k at ``model.layers.{num_hidden_layers + k}``
  (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` or Hunyuan 3's ``final_layernorm``, the block's
  ``self_attn``/``mlp``/norms, named as the target's layers are, the family's renames applied); the shared
  embedding and head are the target's. Or a folder of its own in the same names. With ``num_modules`` = 1 specray
  reuses module 0 for every draft step (TensorRT-LLM's "MTP-Eagle"); with more, modules 0..K-1 each draft one
  position further (:class:`~specray.models.draft_head.ChainedModules`, DeepSeek's ``num_nextn_predict_layers``).
* **MTP** (Qwen3.5 / Qwen3.5-MoE / Qwen3-Next layout, a family's ``mtp_names``): one layer under ``mtp.``
  (``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``layers.0.*``, ``norm``), the same head under other
  names, reused for every draft step.
* **MTP** (MiMo-V2-Flash layout, a family's ``mtp_module_prefix`` with its ``mtp_names``): module k under
  ``model.mtp.layers.{k}.`` (``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm``, the block's ``self_attn``,
  ``mlp``, ``input_layernorm`` and ``pre_mlp_layernorm``), renamed; one module reused, or modules chained as
  DeepSeek's.

Tensors shared with the target (``embed_tokens``, ``shared_head.head``, EAGLE-1's ``lm_head``) are not loaded: the
head reads the target's.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.deepseek_v4 import DeepseekV4ForCausalLM
from specray.models.deepseek_v4_mtp import load_mtp_head
from specray.models.draft_head import LAYOUTS, ChainedModules, DraftHead, eagle3_aux_layers
from specray.models.layers import ParallelLMHead, VocabParallelEmbedding, materialize, shape_of
from specray.models.llama import _CHECKPOINT_NAMES
from specray.models.loader import _default_dtype, checkpoint_weights, iter_weights, resolve_model
from specray.models.plain_config import PlainConfig, plain_config
from specray.parallel import TPGroup

logger = logging.getLogger(__name__)

_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
# families whose MTP module is a head class of its own, not a DraftHead: their model class -> its loader
OWN_MTP_HEADS = {DeepseekV4ForCausalLM: load_mtp_head}


def load_draft_head(method: str, path: str | os.PathLike | None, target, target_config,
                    feedback_normed: bool = False, num_modules: int = 1, tp: TPGroup | None = None,
                    expert_parallel: bool = False, head_config: PlainConfig | None = None
                    ) -> DraftHead | ChainedModules:
    """The ``method`` head ("eagle", "eagle3", "mtp") for ``target`` from ``path`` (a folder or hub id; for MTP the
    checkpoint holding the MTP layers, usually the target's own), on the target's device and dtype, in eval mode.
    MTP with ``num_modules`` > 1: the checkpoint's first ``num_modules`` MTP modules, chained. With ``tp`` (the
    target's group, every rank calling this) each rank keeps its shard of the head, as of a target layer (an MTP
    block's experts whole per rank with ``expert_parallel``, as the target's). ``head_config``: an EAGLE head's
    config as :func:`read_head_config` gives it, if the caller has read it."""
    if method not in LAYOUTS:
        raise ValueError(f"speculative_config.method={method!r} has no draft head layout; one of {sorted(LAYOUTS)}")
    if path is None:
        raise ValueError(f"speculative_config.model is required for method={method!r}: the head's checkpoint "
                         "folder (or hub id)")
    own = OWN_MTP_HEADS.get(_target_family(target_config)) if method == "mtp" else None
    if own is not None:  # a family whose MTP module is no DraftHead (DeepSeek-V4's, on its streams)
        return own(path, target, target_config, num_modules, tp, expert_parallel)
    if method == "mtp":
        config, modules = _mtp_sources(path, target_config, num_modules)
        heads = [_build(method, config, target_config, weights, target, feedback_normed, tp, expert_parallel)
                 for weights in modules]
        return heads[0] if num_modules == 1 else ChainedModules(heads)
    if num_modules != 1:
        raise ValueError(f"num_modules={num_modules} is for method='mtp' only")
    config, weights = _head_source(path, head_config)
    return _build(method, config, target_config, weights, target, feedback_normed, tp)


def _build(method: str, config, target_config, weights: list[tuple[str, Any]], target,
           feedback_normed: bool, tp: TPGroup | None = None, expert_parallel: bool = False) -> DraftHead:
    weights = dict(weights)
    kwargs = _layout_kwargs(method, config, target_config, weights)
    with _default_dtype(target.dtype), torch.device(target.device):
        head = DraftHead(method, config, target, feedback_normed=feedback_normed, tp=tp,
                         expert_parallel=expert_parallel, **kwargs)
    lm_from_target = method == "eagle3" and "lm_head.weight" not in weights
    head.load_weights(_with_target_rows(head, weights) if lm_from_target else weights.items())
    head.eval()
    for p in head.parameters():
        p.requires_grad_(False)
    return head


def _with_target_rows(head: DraftHead, weights: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    d2t = materialize(weights["d2t"]).to(torch.long)
    ids = torch.arange(d2t.shape[0]) + d2t
    rows = target_head_rows(head.target, ids)
    yield from weights.items()
    yield "lm_head.weight", rows


def target_head_rows(target, target_ids: torch.Tensor) -> torch.Tensor:
    """The target's LM head rows of ``target_ids`` [Vd, H]: read as the logits of unit vectors would be too costly,
    so from the head's weight (the embedding's when tied), looked up as the embedding looks up its rows: a target
    split by vocabulary over ranks (every rank calls this) has each rank put in the rows it holds, summed over the
    ranks, so every rank gets them all."""
    head = getattr(target, "lm_head", None)
    weight = getattr(head, "weight", None)
    if isinstance(head, ParallelLMHead):
        return VocabParallelEmbedding.forward(head, target_ids.to(weight.device)).detach().clone()
    if weight is None or weight.shape[0] < int(target_ids.max()) + 1:
        raise ValueError("the target's LM head weight is not readable here; give the head's own lm_head.weight")
    return weight.detach()[target_ids.to(weight.device)].clone()


def head_aux_layers(method: str, head_config, target_config) -> tuple[int, ...]:
    """The target layers whose input residual stream ``method``'s head reads (EAGLE-3: its config's
    ``eagle_aux_hidden_state_layer_ids``, else the usual three); () for a head that reads the final hidden states;
    a family's own MTP module, what its family says (DeepSeek-V4's: the streams past the last layer)."""
    own = getattr(_target_family(target_config), "mtp_feature_layers", None) if method == "mtp" else None
    if own is not None:
        return tuple(own(target_config))
    if not LAYOUTS[method].aux_features:
        return ()
    eagle_config = getattr(head_config, "eagle_config", None) or {}
    return tuple(eagle_config.get("eagle_aux_hidden_state_layer_ids")
                 or eagle3_aux_layers(stack_layers(target_config)))


def stack_layers(target_config) -> int:
    """The layers of the target's stack, whose input streams a head may read: ``num_hidden_layers``, unless the
    family counts its layers otherwise (``stack_layers``: LongCat-Flash's layers hold two attention blocks each,
    which ``num_hidden_layers`` counts)."""
    own = getattr(_target_family(target_config), "stack_layers", None)
    return own(target_config) if own is not None else target_config.num_hidden_layers


def read_head_config(path) -> PlainConfig:
    """An EAGLE / EAGLE-3 head's config (read with transformers, where the engine runs; the ranks get it as plain
    data): its own architecture's, or a Llama layer's for one transformers does not know (vLLM's Eagle ones), with
    the EAGLE keys transformers drops."""
    from transformers import AutoConfig, LlamaConfig

    source = resolve_model(path, field="speculative_config.model")
    raw = json.loads((Path(source.path) / "config.json").read_text())
    try:
        config = plain_config(AutoConfig.from_pretrained(source.path))
    except (ValueError, KeyError):  # an architecture transformers does not know (vLLM's Eagle ones): a Llama layer
        layer = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
        config = plain_config(LlamaConfig(**layer))
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_config"):
        if key in raw and getattr(config, key, None) is None:
            setattr(config, key, raw[key])
    return config


def _head_source(path, config: PlainConfig | None = None) -> tuple[Any, list[tuple[str, Any]]]:
    config = config or read_head_config(path)
    source = resolve_model(path, field="speculative_config.model")
    names = []
    for name, tensor in iter_weights(source):
        if name.startswith("model."):
            name = name[len("model."):]
        name = name.replace("midlayer.", "layers.0.")
        names.append((name, tensor))
    return config, names


def _mtp_sources(path, target_config, num_modules: int = 1) -> tuple[Any, list[list[tuple[str, Any]]]]:
    """Modules 0..num_modules-1 of the MTP layers in a checkpoint laid out as DeepSeek-V3's (module k at
    ``model.layers.{L + k}``), each under the head's names; one pass over the checkpoint."""
    num_layers = target_config.num_hidden_layers
    if not isinstance(num_modules, int) or isinstance(num_modules, bool) or num_modules < 1:
        raise ValueError(f"speculative_config.num_nextn_predict_layers={num_modules!r} must be an int >= 1")
    family = _target_family(target_config)
    names = getattr(family, "mtp_names", None)
    indexed = getattr(family, "mtp_module_prefix", None)
    own = getattr(family, "mtp_tensor", None)
    if own is not None:  # a family that names its MTP tensors its own way (ERNIE 4.5's)
        return target_config, _named_mtp(path, own, getattr(target_config, "model_type", None), num_modules)
    if indexed is not None:
        return target_config, _indexed_mtp(path, indexed, names, num_modules)
    if names is not None:
        return target_config, [_prefixed_mtp(path, names, num_modules)]
    prefixes = [f"model.layers.{num_layers + k}." for k in range(num_modules)]
    source = resolve_model(path, field="speculative_config.model")
    renames = _CHECKPOINT_NAMES.get(getattr(target_config, "model_type", None), ())  # the block's, as the target's
    modules: list[list[tuple[str, Any]]] = [[] for _ in prefixes]
    for name, tensor in checkpoint_weights(source):
        k = next((k for k, p in enumerate(prefixes) if name.startswith(p)), None)
        if k is None:
            continue
        name = name[len(prefixes[k]):]
        if name in _SHARED:
            continue
        final = next((n for n in ("shared_head.norm.", "final_layernorm.") if name.startswith(n)), None)
        if final is not None:  # the module's last norm: DeepSeek's name, Hunyuan 3's
            name = "norm." + name[len(final):]
        elif not name.startswith(("enorm.", "hnorm.", "eh_proj.")):
            name = "layers.0." + name
            for pattern, ours in renames:
                name = pattern.sub(ours, name)
        modules[k].append((name, tensor))
    if not modules[0]:
        raise ValueError(f"the checkpoint {str(source.path)!r} has no MTP layer ({prefixes[0]}*): method='mtp' needs "
                         "a model trained with multi-token prediction (num_nextn_predict_layers >= 1); use another "
                         "speculative method for this model" + _from_gguf(source))
    found = next((k for k, weights in enumerate(modules) if not weights), num_modules)
    if found < num_modules:
        raise ValueError(f"speculative_config.num_nextn_predict_layers={num_modules} but the checkpoint "
                         f"{str(source.path)!r} has {found} MTP module(s) (model.layers.{num_layers}.. "
                         f"model.layers.{num_layers + found - 1}); give num_nextn_predict_layers <= {found}")
    return target_config, modules


def _named_mtp(path, own, model_type, num_modules: int) -> list[list[tuple[str, Any]]]:
    """Modules 0..num_modules-1 of a release whose family names its MTP tensors (``own``: checkpoint name -> (module,
    name in the head), or None; module -1: a tensor every module reads, as ERNIE 4.5's final norm)."""
    source = resolve_model(path, field="speculative_config.model")
    modules: list[list[tuple[str, Any]]] = [[] for _ in range(num_modules)]
    shared, found = [], set()
    for name, tensor in checkpoint_weights(source, wanted=lambda name: own(name, model_type) is not None):
        k, ours = own(name, model_type)
        if k < 0:
            shared.append((ours, tensor))
            continue
        found.add(k)
        if k < num_modules:
            modules[k].append((ours, tensor))
    if not found:
        raise ValueError(f"the checkpoint {str(source.path)!r} has no MTP module: method='mtp' needs a release with "
                         "its multi-token-prediction weights (num_nextn_predict_layers >= 1); use another "
                         "speculative method for this model" + _from_gguf(source))
    _check_module_count(found, num_modules, source)
    return [weights + shared for weights in modules]


def _check_module_count(found: set[int], num_modules: int, source, names=None) -> None:
    """ValueError unless the checkpoint holds MTP modules 0 .. num_modules - 1 (``found``: the indices it holds);
    ``names(k)`` names module k's tensors in the message."""
    have = next((k for k in range(num_modules) if k not in found), num_modules)
    if have < num_modules:
        where = f" ({names(0)}.. {names(have - 1)})" if names is not None and have else ""
        raise ValueError(f"speculative_config.num_nextn_predict_layers={num_modules} but the checkpoint "
                         f"{str(source.path)!r} has {have} MTP module(s){where}; give num_nextn_predict_layers "
                         f"<= {have}")


def _from_gguf(source) -> str:
    """What to say when the checkpoint without MTP layers was converted from a GGUF: its release may have them."""
    if source.gguf_file is None:
        return ""
    return (f" (it was converted from the GGUF {str(source.gguf_file)!r}, and llama.cpp's converter leaves the MTP "
            "layers out: pass the model's HF checkpoint for method='mtp')")


def _target_family(target_config):
    """The target's model class (None for an architecture specray does not serve)."""
    from specray.models.registry import get_model_class  # lazily, as draft_head's _family: the registry is wide

    try:
        return get_model_class(target_config)
    except ValueError:
        return None


def _prefixed_mtp(path, names: tuple[tuple[str, str], ...], num_modules: int) -> list[tuple[str, Any]]:
    """The MTP layer of a release that keeps one under ``mtp.`` (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: ``mtp.fc``,
    ``mtp.pre_fc_norm_*``, ``mtp.layers.0.*``, ``mtp.norm``; Nemotron 3: its two blocks ``mtp.layers.0`` and
    ``mtp.layers.1``), renamed by the family's ``names`` (theirs, ours)."""
    source = resolve_model(path, field="speculative_config.model")
    if num_modules != 1:
        raise ValueError(f"speculative_config.num_nextn_predict_layers={num_modules}: the checkpoint "
                         f"{str(source.path)!r} keeps one MTP layer (mtp.*), which specray reuses for every draft "
                         "step; leave num_nextn_predict_layers unset (or 1)")
    out = []
    for name, tensor in checkpoint_weights(source, wanted=lambda name: name.startswith("mtp.")):  # the rest unread
        out.append((_head_name(name, name[len("mtp."):], names, source), tensor))
    if not out:
        raise ValueError(f"the checkpoint {str(source.path)!r} has no MTP layer (mtp.*): method='mtp' needs a release "
                         "with its multi-token-prediction weights (mtp_num_hidden_layers / num_nextn_predict_layers "
                         ">= 1); use another speculative method for this model" + _from_gguf(source))
    return out


def _indexed_mtp(path, prefix: str, names: tuple[tuple[str, str], ...], num_modules: int
                 ) -> list[list[tuple[str, Any]]]:
    """Modules 0..num_modules-1 of a release that numbers its MTP modules under ``prefix`` (``{k}`` the module:
    MiMo-V2-Flash's ``model.mtp.layers.{k}.``), each renamed by the family's ``names`` (theirs, ours)."""
    source = resolve_model(path, field="speculative_config.model")
    pattern = re.compile(re.escape(prefix).replace(re.escape("{k}"), r"(\d+)"))
    root = prefix[: prefix.index("{k}")]
    modules: list[list[tuple[str, Any]]] = [[] for _ in range(num_modules)]
    found: set[int] = set()
    for name, tensor in checkpoint_weights(source, wanted=lambda name: name.startswith(root)):  # the rest unread
        match = pattern.match(name)
        if match is None:
            continue
        k = int(match.group(1))
        found.add(k)
        if k >= num_modules:
            continue
        modules[k].append((_head_name(name, name[match.end():], names, source), tensor))
    if not found:
        raise ValueError(f"the checkpoint {str(source.path)!r} has no MTP layer ({prefix.format(k=0)}*): method='mtp' "
                         "needs a release with its multi-token-prediction weights; use another speculative method "
                         "for this model" + _from_gguf(source))
    _check_module_count(found, num_modules, source, lambda k: prefix.format(k=k))
    return modules


def _head_name(name: str, rest: str, names: tuple[tuple[str, str], ...], source) -> str:
    """An MTP tensor's name in the head (``rest``: its name within its module, renamed by the family's ``names``,
    theirs to ours); a ValueError for one the head has no place for."""
    theirs, ours = next(((t, o) for t, o in names if rest.startswith(t)), (None, None))
    if theirs is None:
        raise ValueError(f"the checkpoint {str(source.path)!r} has MTP tensor {name!r}, which the mtp head has no "
                         "place for; drop it, or use another speculative method")
    return ours + rest[len(theirs):]


def _layout_kwargs(method: str, config, target_config, weights: dict[str, Any]) -> dict[str, Any]:
    """Sizes the head takes from its config and checkpoint, checked against the target: a ValueError naming
    both when they do not fit."""
    h, th = config.hidden_size, target_config.hidden_size
    kwargs: dict[str, Any] = {}
    if method in ("eagle", "mtp") and h != th:
        raise ValueError(f"the {method} head's hidden_size={h} does not fit the target's hidden_size={th}: the "
                         "head was trained for another model")
    if getattr(config, "vocab_size", target_config.vocab_size) != target_config.vocab_size and method != "eagle3":
        raise ValueError(f"the {method} head's vocab_size={config.vocab_size} does not match the target's "
                         f"vocab_size={target_config.vocab_size}")
    if method == "mtp":
        eh = weights.get("eh_proj.weight")
        if eh is not None and tuple(shape_of(eh)) != (th, 2 * th):
            raise ValueError(f"the mtp layer's eh_proj.weight is {tuple(shape_of(eh))}, expected {(th, 2 * th)} for "
                             f"the target's hidden_size={th}: the MTP layer was trained for another model")
    if method == "eagle":
        kwargs["fc_bias"] = "fc.bias" in weights
        fc = weights.get("fc.weight")
        if fc is not None and tuple(shape_of(fc)) != (h, 2 * h):
            hint = (": an EAGLE-3 head's fusion (it reads several target layers and maps a draft vocabulary, d2t); "
                    "use method='eagle3' with it" if "d2t" in weights else "")
            raise ValueError(f"the eagle head's fc.weight is {tuple(shape_of(fc))}, expected {(h, 2 * h)}{hint}")
    if method == "eagle3":
        aux, layers = head_aux_layers(method, config, target_config), stack_layers(target_config)
        if any(not 0 <= i < layers for i in aux):
            raise ValueError(f"the eagle3 head reads target layers {list(aux)} but the target has {layers}")
        head_th = getattr(config, "target_hidden_size", None) or th
        fc = weights.get("fc.weight")
        if head_th != th or (fc is not None and tuple(shape_of(fc)) != (h, len(aux) * th)):
            eagle1 = fc is not None and tuple(shape_of(fc)) == (h, 2 * th) and "d2t" not in weights
            why = ("an EAGLE-1 head's fc (over the token's embedding and one hidden state; no d2t): use method='eagle' "
                   "with it" if eagle1 else "the head was trained for another model")
            raise ValueError(f"the eagle3 head's fc.weight is {None if fc is None else tuple(shape_of(fc))} "
                             f"(target_hidden_size={head_th}) but the target's hidden_size={th} needs "
                             f"{(h, len(aux) * th)}: {why}")
        d2t = weights.get("d2t")
        vd = getattr(config, "draft_vocab_size", None) or (shape_of(d2t)[0] if d2t is not None else th)
        if d2t is None:
            raise ValueError("the eagle3 head checkpoint has no d2t (draft-to-target vocabulary offsets)")
        if shape_of(d2t)[0] != vd:
            raise ValueError(f"the eagle3 head's d2t has {shape_of(d2t)[0]} entries but draft_vocab_size={vd}")
        ids = torch.arange(vd) + materialize(d2t).to(torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= target_config.vocab_size:
            raise ValueError(f"the eagle3 head's d2t maps draft ids outside the target's vocabulary "
                             f"[0, {target_config.vocab_size})")
        kwargs.update(aux_layers=tuple(aux), draft_vocab_size=vd, fc_bias="fc.bias" in weights, target_hidden_size=th)
    for name in _SHARED + (("lm_head.weight",) if method != "eagle3" else ()):
        weights.pop(name, None)
    weights.pop("t2d", None)
    return kwargs


def save_draft_head(head: DraftHead | ChainedModules, folder: str | os.PathLike, config: dict[str, Any], *,
                    with_lm_head: bool = True, dtype: torch.dtype = torch.float16) -> None:
    """Write ``head`` as a public-layout checkpoint folder (``config.json`` + ``model.safetensors``); an EAGLE-3
    head without ``with_lm_head`` leaves its LM head out (the target's rows are used when it loads); an MTP head
    in DeepSeek-V3's names (``model.layers.{L}.*``; distinct modules, module k at ``model.layers.{L + k}.*``), which
    :func:`load_draft_head` reads back."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    modules = list(head.heads) if isinstance(head, ChainedModules) else [head]
    if head.layout.name == "mtp":
        layers = _num_target_layers(head)
        tensors = {name: tensor for k, module in enumerate(modules)
                   for name, tensor in _mtp_checkpoint_names(module.state_for_saving(), layers + k).items()}
    else:
        tensors = head.state_for_saving()
    if not with_lm_head:
        tensors.pop("lm_head.weight", None)
    tensors = {k: (v if k == "d2t" else v.to(dtype)) for k, v in tensors.items()}
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _num_target_layers(head: DraftHead | ChainedModules) -> int:
    """The target's decoder layer count, which numbers an MTP layer (the head's own config may be a one-layer one,
    as ``specray train-draft`` builds it)."""
    layers = getattr(getattr(head.target, "config", None), "num_hidden_layers", None)
    if layers is None:
        raise ValueError("saving an MTP head needs its target's config.num_hidden_layers: the layer is written as "
                         "model.layers.{num_hidden_layers}.*")
    return int(layers)


def _mtp_checkpoint_names(tensors: dict[str, torch.Tensor], num_target_layers: int) -> dict[str, torch.Tensor]:
    """An MTP head's tensors under DeepSeek-V3's names (what :func:`_mtp_source` reads): module 0 at
    ``model.layers.{num_target_layers}``, the block's names without ``layers.0.``, the final norm as
    ``shared_head.norm``."""
    prefix = f"model.layers.{num_target_layers}."
    out = {}
    for name, tensor in tensors.items():
        if name.startswith("layers.0."):
            name = name[len("layers.0."):]
        elif name.startswith("norm."):
            name = "shared_head." + name
        out[prefix + name] = tensor
    return out
