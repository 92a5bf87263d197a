"""Mistral 3's images (``Mistral3ForConditionalGeneration``: Mistral Small 3.1 / 3.2, Devstral and Magistral with
vision, Ministral 3): the image encoder and the processor that put an image into a prompt of its text model (a
Mistral, served as ``registry._TEXT_PARTS`` says).

Encoder (:class:`Mistral3ImageEncoder`): Pixtral's vision tower (:mod:`specray.models.pixtral_vision`) up to
``vision_feature_layer`` (transformers' hidden-state index: ``-1``, the last layer, in every release), then the
multi-modal projector: an RMSNorm (the text config's ``rms_norm_eps``), the patch merger (each ``spatial_merge_size``
square of patches, its features concatenated channel by channel as ``torch.nn.functional.unfold`` orders them, one
bias-free linear back to the tower's width), ``linear_1``, ``projector_hidden_act``, ``linear_2`` (biases where
``multimodal_projector_bias``). An image of ``rows x cols`` merged patches gives ``rows * cols`` embeddings, row-major.

Processor (:class:`Mistral3Processor`): transformers' Pixtral image processor (its PIL backend) resizes the image
(aspect kept, within ``size["longest_edge"]``, each side then rounded up to a multiple of ``patch_size *
spatial_merge_size``) and normalizes it. One ``[IMG]`` placeholder in the prompt becomes ``rows`` runs of ``cols``
``[IMG]`` tokens, each run closed by ``[IMG_BREAK]``, the last by ``[IMG_END]`` (transformers' ``PixtralProcessor``
expansion); the image's embeddings fill the ``[IMG]`` rows only (``embed_rows``), the break and end tokens keep their
own embeddings. Positions are plain RoPE ones (``rope_positions`` gives None).

Refused by name: a vision tower other than Pixtral's, a ``vision_feature_layer`` list of several layers (transformers'
projector norm cannot take their concatenation either), activations outside ``vision_towers.VISION_ACTIVATIONS``, a
non-axial vision RoPE, a processor config whose ``patch_size`` / ``spatial_merge_size`` disagree with the model's, a
tokenizer whose ``[IMG]`` is not the config's ``image_token_index`` or that lacks ``[IMG_BREAK]`` / ``[IMG_END]``, and
vision or projector tensors the encoder does not read (a quantized tower)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specray.models.layers import RMSNorm, _copy, materialize
from specray.models.pixtral_vision import PixtralVisionModel
from specray.models.vision_towers import Linear, vision_activation
from specray.multimodal import ProcessedImage

TOWER, PROJECTOR = "vision_tower.", "multi_modal_projector."
# transformers' PixtralProcessor's defaults for the three image tokens' spellings
DEFAULT_TOKENS = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}


def feature_layer(config: Any) -> int:
    """``vision_feature_layer`` (one transformers hidden-state index, or a list of one) as the number of tower
    layers to run; a ValueError for a list of several or an index out of range."""
    layers = config.vision_feature_layer
    wanted = list(layers) if isinstance(layers, (list, tuple)) else [layers]
    total = config.vision_config.num_hidden_layers
    if len(wanted) != 1:
        raise ValueError(f"vision_feature_layer={layers!r} is not supported: Mistral 3's projector normalizes one "
                         "layer's features (transformers' fails on several too); give one index, e.g. -1")
    index = wanted[0]
    if not isinstance(index, int) or not -(total + 1) <= index <= total:
        raise ValueError(f"vision_feature_layer={layers!r} must be a hidden-state index in [-{total + 1}, {total}] "
                         f"(vision_config.num_hidden_layers={total})")
    return index % (total + 1)


class PatchMerger(nn.Module):
    """Each ``merge x merge`` square of patches as one vector (channel-major, then the square's row and column:
    ``unfold``'s order) through ``merging_layer``."""

    def __init__(self, hidden: int, merge: int):
        super().__init__()
        self.merge = merge
        self.merging_layer = Linear(hidden * merge * merge, hidden, bias=False)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        # x: [rows * cols, C] row-major -> [(rows // m) * (cols // m), C] (a partial square at an edge dropped)
        m, channels = self.merge, x.shape[-1]
        r, c = rows // m, cols // m
        grid = x.view(rows, cols, channels)[: r * m, : c * m].reshape(r, m, c, m, channels)
        return self.merging_layer(grid.permute(0, 2, 4, 1, 3).reshape(r * c, channels * m * m))


class Mistral3Projector(nn.Module):
    """RMSNorm, patch merger, ``linear_2(act(linear_1(x)))``: the tower's features to the text model's width."""

    def __init__(self, config: Any):
        super().__init__()
        hidden, text = config.vision_config.hidden_size, config.text_config
        merge = config.spatial_merge_size
        if not isinstance(merge, int) or merge < 1:
            raise ValueError(f"spatial_merge_size={merge!r} must be a positive int")
        bias = bool(getattr(config, "multimodal_projector_bias", False))
        self.norm = RMSNorm(hidden, text.rms_norm_eps)
        self.patch_merger = PatchMerger(hidden, merge)
        self.linear_1 = Linear(hidden, text.hidden_size, bias=bias)
        self.act = vision_activation(getattr(config, "projector_hidden_act", "gelu"), "projector_hidden_act")
        self.linear_2 = Linear(text.hidden_size, text.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        x = self.patch_merger(self.norm(x), rows, cols)
        return self.linear_2(self.act(self.linear_1(x)))


class Mistral3ImageEncoder(nn.Module):
    """Pixtral's tower and Mistral 3's projector (:class:`specray.multimodal.ImageEncoder`), built from the whole
    checkpoint's config, replicated on every tensor-parallel rank."""

    def __init__(self, config: Any):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.vision_tower = PixtralVisionModel(config.vision_config, depth=feature_layer(config))
        self.multi_modal_projector = Mistral3Projector(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features, (rows, cols) = self.vision_tower(pixel_values)
        if rows < self.merge or cols < self.merge:
            raise ValueError(f"an image of {rows}x{cols} patches is smaller than one merged patch (spatial_merge_size"
                             f"={self.merge}); the image processor must resize images to at least patch_size * "
                             "spatial_merge_size pixels a side")
        return self.multi_modal_projector(features, rows, cols)

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's ``pixel_values`` [C, H, W] -> its embeddings [rows * cols, text hidden size]."""
        return self(data["pixel_values"])

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The tower's and the projector's tensors among the whole checkpoint's, named as the release names them
        (``vision_tower.``, ``multi_modal_projector.``) or as transformers' modules do (under ``model.``)."""
        tower, projector = [], []
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith(TOWER):
                tower.append((name[len(TOWER):], tensor))
            elif name.startswith(PROJECTOR):
                projector.append((name[len(PROJECTOR):], tensor))
        self.vision_tower.load_weights(tower)
        params = dict(self.multi_modal_projector.named_parameters())
        unknown = sorted(PROJECTOR + name for name, _ in projector if name not in params)
        if unknown:
            raise ValueError(f"the checkpoint holds {len(unknown)} tensor(s) of Mistral 3's projector that it does "
                             f"not read: {unknown[:6]}; only an unquantized projector of the config's "
                             "multimodal_projector_bias is supported")
        for name, tensor in projector:
            _copy(params[name], materialize(tensor))
        missing = sorted(PROJECTOR + name for name in set(params) - {name for name, _ in projector})
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of Mistral 3's projector: {missing[:6]}; "
                             "it does not match its config.json (multimodal_projector_bias, spatial_merge_size)")


def processor_settings(folder: Path) -> dict[str, Any]:
    """The folder's ``processor_config.json`` (transformers' PixtralProcessor settings), {} without one."""
    path = folder / "processor_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def token_ids(folder: Path, tokens: Sequence[str]) -> list[int]:
    """The ids of ``tokens`` in the folder's tokenizer; a ValueError for a folder without one or a token it lacks."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ValueError(f"{str(folder)!r} holds no tokenizer ({err}); Mistral 3's images need the checkpoint's "
                         f"tokenizer for the ids of {list(tokens)}: keep its tokenizer files beside config.json") \
            from None
    ids = tokenizer.convert_tokens_to_ids(list(tokens))
    for token, tid in zip(tokens, ids):
        if tid is None or tokenizer.convert_ids_to_tokens(tid) != token:
            raise ValueError(f"the tokenizer in {str(folder)!r} has no token {token!r}, which Mistral 3's images "
                             "need (its processor_config.json names the image tokens)")
    return ids


class Mistral3Processor:
    """Mistral 3's host side (:class:`specray.multimodal.ImageProcessor`): one image to its pixels and the
    ``[IMG]`` / ``[IMG_BREAK]`` / ``[IMG_END]`` tokens that replace its placeholder."""

    def __init__(self, image_processor: Any, image_token_id: int, break_token_id: int, end_token_id: int,
                 unit: int):
        self.image_processor = image_processor
        self.image_token_id, self.break_token_id, self.end_token_id = image_token_id, break_token_id, end_token_id
        self.unit = unit  # pixels a side of one merged patch: patch_size * spatial_merge_size

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Mistral3Processor:
        from transformers import AutoImageProcessor

        folder = Path(folder)
        settings = processor_settings(folder)
        # a config without spatial_merge_size (Pixtral-12B's LLaVA one) merges nothing, as PixtralProcessor's default
        ours = {"patch_size": config.vision_config.patch_size,
                "spatial_merge_size": getattr(config, "spatial_merge_size", 1)}
        for field, value in ours.items():
            if settings.get(field, value) != value:
                raise ValueError(f"processor_config.json has {field}={settings[field]!r} but the model's config "
                                 f"says {value!r}: the prompt's image tokens would not match the encoder's "
                                 "embeddings; fix processor_config.json")
        names = [settings.get(key) or default for key, default in DEFAULT_TOKENS.items()]
        image, brk, end = token_ids(folder, names)
        if image != config.image_token_index:
            raise ValueError(f"the tokenizer's {names[0]!r} is id {image} but config.json has image_token_index="
                             f"{config.image_token_index}; fix the config or processor_config.json's image_token")
        processor = AutoImageProcessor.from_pretrained(folder)
        return cls(processor, image, brk, end, ours["patch_size"] * ours["spatial_merge_size"])

    def replacement(self, rows: int, cols: int) -> tuple[list[int], list[int]]:
        """The tokens of a ``rows x cols`` image (merged patches) and the indices of its ``[IMG]`` ones."""
        tokens = ([self.image_token_id] * cols + [self.break_token_id]) * rows
        tokens[-1] = self.end_token_id
        return tokens, [r * (cols + 1) + c for r in range(rows) for c in range(cols)]

    def process(self, image: Any) -> ProcessedImage:
        out = self.image_processor([image], patch_size=self.unit, return_tensors="np")
        height, width = (int(v) for v in out["image_sizes"][0])
        rows, cols = height // self.unit, width // self.unit
        if rows == 0 or cols == 0:
            raise ValueError(f"the image processor made a {height}x{width} image, smaller than one merged patch "
                             f"({self.unit} pixels a side); enable its do_resize")
        pixels = np.ascontiguousarray(out["pixel_values"][0][:, :height, :width], dtype=np.float32)
        tokens, rows_of_image = self.replacement(rows, cols)
        return ProcessedImage(tokens, {"pixel_values": pixels}, rows_of_image)

    def rope_positions(self, token_ids: list[int], items: list) -> None:
        return None
