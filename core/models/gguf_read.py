"""What the GGUF readers of our own (``specray.models.gguf_*``, listed in the loader's ``_GGUF_READERS``) share: the
file's metadata, looked up by key with an error naming what is missing; its tensors, dequantized one at a time as
they are read and grouped by layer; gguf-py's tensor map, by which llama.cpp's converter named them; the check that
the file holds the tensors its metadata describes. :func:`parsed_gguf`: gguf-py's parse of a file, refusing a
truncated or corrupt one by name."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import torch


def dequantized(t) -> torch.Tensor:
    """A tensor of gguf-py's reader (any of llama.cpp's types) as float32 in its logical shape (slowest dim first;
    GGUF lists dims fastest first)."""
    from gguf.quants import dequantize

    value = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
    return value.reshape([int(n) for n in reversed(t.shape)])


class GGUFTensors(MutableMapping):
    """Tensors by name, each dequantized when it is read (and not kept): a reader that takes a layer's tensors,
    turns them into the HF layout and hands them on holds one layer at a time in float32, never the whole model.
    A tensor set here (one computed from others) is held as given."""

    def __init__(self, entries: dict[str, Any]):
        self._entries = entries  # name -> gguf-py's tensor (read when asked for) or a torch tensor (held)

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        return entry if isinstance(entry, torch.Tensor) else dequantized(entry)

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._entries[name] = value

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's logical shape, without reading it."""
        entry = self._entries[name]
        return tuple(entry.shape) if isinstance(entry, torch.Tensor) else tuple(int(n) for n in reversed(entry.shape))

    def raw_items(self) -> Iterator[tuple[str, Any]]:
        return iter(self._entries.items())

    def split(self, names) -> GGUFTensors:
        """The given tensors moved into a mapping of their own, none read."""
        return GGUFTensors({name: self._entries.pop(name) for name in list(names)})


def parsed_gguf(gguf: Path, reader_class: type | None = None) -> Any:
    """gguf-py's reader (``reader_class``: that class or a subclass) of ``gguf``, its header read; a ValueError
    naming the file where it is not a readable GGUF, and the first tensor whose data lies past the file's end where
    it is cut short (gguf-py's own error for that is a bare numpy reshape)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    cut: list[str] = []  # the message for a tensor past the file's end

    def past_end(start_offs: int, fields: list, size: int) -> str | None:
        """The first tensor whose data ends past ``size`` bytes, and where it ends (gguf-py's tensor fields)."""
        for field in fields:
            name, dims, ggml_type, offset = (field.parts[i] for i in (1, 3, 4, 5))
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type[0]))]
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                return f"its tensor {bytes(name).decode(errors='replace')!r} ends at byte {end}"
        return None

    class Checked(reader_class or GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            try:
                where = past_end(start_offs, fields, len(self.data))
            except (AttributeError, IndexError, KeyError, TypeError, ValueError):  # another gguf-py's fields: its
                where = None  # own errors stand, named below
            if where is not None:
                cut.append(f"GGUF {str(gguf)!r} is truncated or corrupt: {where}, past the file's {len(self.data)} "
                           "bytes; download or convert the file again")
                raise ValueError(cut[0])
            super()._build_tensors(start_offs, fields)

    try:
        return Checked(str(gguf))
    except (ValueError, IndexError, KeyError, UnicodeDecodeError) as err:
        raise ValueError(cut[0] if cut else f"GGUF {str(gguf)!r} is truncated or corrupt: gguf-py cannot read it "
                         f"({err}); download or convert the file again") from None


def read_model_gguf(gguf: Path, arch: str) -> tuple[GGUFMeta, GGUFTensors]:
    """:func:`read_gguf` of a model's file (its embedding there, else a ValueError), its metadata read by key."""
    meta, tensors = read_gguf(gguf)
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF {str(gguf)!r} has no token_embd.weight; pass a complete {arch} GGUF")
    return GGUFMeta(meta, arch, gguf), tensors


def read_gguf(gguf: Path) -> tuple[dict[str, Any], GGUFTensors]:
    """The GGUF's metadata (arrays as lists, but for the tokenizer's vocabulary and merges) and its tensors, each
    dequantized to float32 when read."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(gguf))
    meta = {key: f.contents() for key, f in reader.fields.items()
            if f.types and not (key.startswith("tokenizer.") and f.types[0] == GGUFValueType.ARRAY)}
    return meta, GGUFTensors({t.name: t for t in reader.tensors})


class GGUFMeta:
    """The GGUF's metadata of one architecture, read by key (without the ``{arch}.`` prefix)."""

    def __init__(self, meta: dict[str, Any], arch: str, gguf: Path):
        self.meta, self.arch, self.gguf = meta, arch, gguf

    def __call__(self, key: str, default: Any = ...) -> Any:
        value = self.meta.get(f"{self.arch}.{key}", default)
        if value is ...:
            raise ValueError(f"GGUF {str(self.gguf)!r} lacks {self.arch}.{key}, which llama.cpp writes for every "
                             f"{self.arch} model; convert the model again with a current llama.cpp, or pass its HF "
                             "checkpoint")
        return value

    def per_layer(self, key: str, layers: int) -> list[int]:
        """A per-layer value (an array, or one number for every layer)."""
        value = self(key)
        values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers
        if len(values) != layers:
            raise ValueError(f"GGUF {str(self.gguf)!r} has {len(values)} values of {self.arch}.{key} for {layers} "
                             "layers (block_count); convert the model again with a current llama.cpp, or pass its "
                             "HF checkpoint")
        return values

    def mtp_layers(self) -> int:
        """The MTP layers ``block_count`` counts after the model's own (``nextn_predict_layers``; none unless set)."""
        return int(self("nextn_predict_layers", 0))

    def model_layers(self) -> int:
        """The model's own layers: ``block_count`` less the MTP layers after them."""
        return int(self("block_count")) - self.mtp_layers()

    def token_ids(self) -> dict[str, Any]:
        """The config's special token ids, as the file's tokenizer names them."""
        return {"eos_token_id": self.meta.get("tokenizer.ggml.eos_token_id"),
                "bos_token_id": self.meta.get("tokenizer.ggml.bos_token_id"),
                "pad_token_id": self.meta.get("tokenizer.ggml.padding_token_id")}


def rope_parameters(get: GGUFMeta, factors: torch.Tensor | None, rotated: int,
                    log_multiplier: str | None = None) -> dict[str, Any]:
    """The HF ``rope_parameters`` of a GGUF's RoPE as llama.cpp's converter writes it: the base
    (``rope.freq_base``), a linear or YaRN scaling (``rope.scaling.*``), or Llama 3's scaling, which the converter
    bakes into a tensor of per-frequency factors (``factors``: the file's ``rope_freqs``, each frequency of the
    ``rotated`` dims divided by its factor). Those factors become LongRoPE's, the same for short and long sequences
    and with no cos/sin scale: the frequencies llama.cpp rotates by, exactly as the file has them (a Llama 3.1 GGUF
    without them would rotate its low frequencies 8 times too fast). A YaRN's ``yarn_attn_factor`` (or, in older
    files, ``attn_factor``) is the HF config's ``attention_factor`` the converter wrote. What the HF config cannot
    say (llama.cpp's own YaRN extrapolation factor or log multiplier, any other kind of scaling) is refused, naming
    the way out. ``log_multiplier``: the HF field a family's converter wrote as ``yarn_log_multiplier``, read as it."""
    rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type", "none")
    refuse = f"GGUF {str(get.gguf)!r}"
    if factors is not None:
        if factors.shape != (rotated // 2,) or scaling != "none":
            raise ValueError(f"{refuse} has {factors.numel()} per-frequency RoPE factors (rope_freqs) with "
                             f"{get.arch}.rope.scaling.type={scaling!r} for {rotated} rotated dims: not Llama 3's "
                             "scaling as llama.cpp writes it (one factor per frequency, no other scaling); pass the "
                             "model's HF checkpoint instead")
        if bool((factors != 1).any()):
            values = [as_written(v) for v in factors.tolist()]
            rope.update(rope_type="longrope", short_factor=values, long_factor=values, attention_factor=1.0,
                        original_max_position_embeddings=int(get("context_length")))
    elif scaling == "linear":
        rope.update(rope_type="linear", factor=as_written(get("rope.scaling.factor")))
    elif scaling == "yarn":  # the factor and pretrained length always; the betas and cos/sin scale where written
        unread = ("yarn_ext_factor",) if log_multiplier else ("yarn_ext_factor", "yarn_log_multiplier")
        own = [key for key in unread if get(f"rope.scaling.{key}", None) is not None]
        if own:
            raise ValueError(f"{refuse} sets {get.arch}.rope.scaling.{own[0]}, a YaRN setting of llama.cpp's own that "
                             f"specray does not read from a {get.arch} GGUF; pass the model's HF checkpoint instead")
        rope.update(rope_type="yarn", factor=as_written(get("rope.scaling.factor")),
                    original_max_position_embeddings=int(get("rope.scaling.original_context_length")))
        # the converter's names for HF's fields (OLMo 3's older files: HF's attention_factor as ``attn_factor``)
        for key, field in (("attn_factor", "attention_factor"), ("yarn_attn_factor", "attention_factor"),
                           ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if get(f"rope.scaling.{key}", None) is not None:
                rope[field] = as_written(get(f"rope.scaling.{key}"))
        if log_multiplier and get("rope.scaling.yarn_log_multiplier", None) is not None:
            rope[log_multiplier] = as_written(get("rope.scaling.yarn_log_multiplier"))
    elif scaling != "none":
        raise ValueError(f"{refuse} has {get.arch}.rope.scaling.type={scaling!r}; specray reads a {get.arch} GGUF "
                         "with linear, YaRN, Llama 3's (rope_freqs) or no RoPE scaling. Pass the model's HF "
                         "checkpoint instead")
    for key, value in (("rope.freq_base", rope["rope_theta"]), ("rope.scaling.factor", rope.get("factor", 1.0))):
        if not value > 0:  # (0, negative or NaN: every logit NaN)
            raise ValueError(f"{refuse} has {get.arch}.{key}={value}, which must be positive; its metadata is "
                             "corrupt: convert the model again, or pass its HF checkpoint")
    return rope


def tensors_by_layer(tensors: GGUFTensors, gguf: Path, arch: str) -> dict[int, GGUFTensors]:
    """``blk.{i}.{name}`` tensors as ``{i: {name: tensor}}`` (none read yet); any other name left in ``tensors`` is
    refused."""
    per_layer: dict[int, dict[str, Any]] = {}
    for name, entry in tensors.raw_items():
        parts = name.split(".", 2)
        if parts[0] != "blk" or len(parts) != 3 or not parts[1].isdigit():
            raise ValueError(f"GGUF {str(gguf)!r} has a tensor {name!r} specray cannot place in a {arch} model; "
                             "pass the model's HF checkpoint instead")
        per_layer.setdefault(int(parts[1]), {})[parts[2]] = entry
    return {layer: GGUFTensors(entries) for layer, entries in per_layer.items()}


def hf_tensor_names(model_class, config, skip=lambda name: False) -> list[str]:
    """The tensor names of ``model_class`` built from ``config`` (on the meta device: no storage), but those
    ``skip`` names and a tied ``lm_head.weight`` (the file has no output tensor then)."""
    with torch.device("meta"):
        names = list(model_class(config).state_dict())
    return [n for n in names if not skip(n) and not (n == "lm_head.weight" and config.tie_word_embeddings)]


def gguf_names(arch, layers: int, hf_names) -> dict[str, str]:
    """GGUF name -> HF name of each of ``hf_names``, through gguf-py's tensor map of llama.cpp's ``arch`` (a
    ``gguf.MODEL_ARCH``): the map llama.cpp's converter renames a checkpoint's tensors by. A name without a
    ``.weight`` / ``.bias`` suffix (a bare parameter: ``A_log``, ``D``) maps without one; a router's correction
    bias (``e_score_correction_bias``; LFM2-MoE's ``expert_bias``) as the converter renames it first
    (``e_score_correction.bias``, ``expert_bias.bias``)."""
    import gguf

    table = gguf.get_tensor_name_map(arch, layers)
    out = {}
    for name in hf_names:
        spelled = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if spelled.endswith(".expert_bias"):  # LFM2-MoE's router bias, which its converter names expert_bias.bias
            spelled += ".bias"
        gguf_name = table.get_name(spelled, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            from importlib.metadata import version

            raise ValueError(f"the installed gguf-py ({version('gguf')}) has no GGUF name for {name} of "
                             f"{gguf.MODEL_ARCH_NAMES[arch]}, which llama.cpp's converter writes; install a newer "
                             "gguf (pip install -U gguf)")
        out[gguf_name] = name
    return out


def as_written(value: float) -> float:
    """A float32 of the file as the decimal it was written from (1e-05, not 9.999999747378752e-06): the shortest
    decimal that float32 rounds to the same value."""
    import numpy as np

    for digits in range(1, 10):
        if np.float32(f"{value:.{digits}g}") == np.float32(value):
            return float(f"{value:.{digits}g}")
    return float(value)


def by_layer(tensors: GGUFTensors) -> list[list[str]]:
    """The tensors' names in groups: each layer's (``blk.{i}.*``) and the model's own (the rest), in file order."""
    groups: dict[str | None, list[str]] = {}
    for name in tensors:
        groups.setdefault(name.split(".")[1] if name.startswith("blk.") else None, []).append(name)
    return list(groups.values())


def converted_groups(tensors: GGUFTensors, convert: Callable[[str], dict[str, torch.Tensor]]
                     ) -> Iterator[dict[str, torch.Tensor]]:
    """The HF tensors of each group of :func:`by_layer` (the model's own, then a layer), each GGUF tensor of it turned
    into its HF ones by ``convert`` (given its name) as the group is taken."""
    for group in by_layer(tensors):
        yield {k: v for name in group for k, v in convert(name).items()}


def check_tensor_names(gguf: Path, family: str, expected, tensors: GGUFTensors) -> None:
    """ValueError naming what differs, unless the file holds exactly the ``expected`` tensors."""
    missing, unknown = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise ValueError(f"GGUF {str(gguf)!r} does not hold the tensors of the {family} its metadata describes: "
                         f"missing {missing[:5]}, not placeable {unknown[:5]}; convert the model again with a current "
                         "llama.cpp, or pass its HF checkpoint")


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def stacked_experts(arch, count: int, layers) -> dict[str, tuple[int, str]]:
    """GGUF name -> (layer, projection) of the experts llama.cpp's converter stacks per projection in each of
    ``layers`` (under the merged name ``model.layers.{i}.mlp.experts.{projection}``, mapped by gguf-py)."""
    merged = {f"model.layers.{i}.mlp.experts.{p}.weight": (i, p) for i in layers for p in EXPERT_PROJECTIONS}
    return {g: merged[n] for g, n in gguf_names(arch, count, merged).items()}


def per_expert(stacked: torch.Tensor, prefix: str, projection: str) -> dict[str, torch.Tensor]:
    """A stacked ``[E, ...]`` projection as the releases name it, one tensor per expert:
    ``{prefix}{e}.{projection}.weight``."""
    return {f"{prefix}{e}.{projection}.weight": w.contiguous() for e, w in enumerate(stacked)}
