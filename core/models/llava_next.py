"""LLaVA-NeXT's images (``LlavaNextForConditionalGeneration``, transformers' ``models/llava_next``:
llava-v1.6-mistral-7b, llava-v1.6-vicuna-7b / 13b, llava-v1.6-34b; granite-vision-3.x: a SigLIP tower's several
feature layers before a Granite text model, which scales the image rows as its tokens'): LLaVA 1.5's
CLIP (or SigLIP) tower and two-layer projector (:class:`specray.models.llava.LlavaImageEncoder`, reused whole) over
an image seen at any resolution.

Any-resolution tiling: of ``image_grid_pinpoints`` (resolutions, each a whole number of ``vision_config.image_size``
tiles a side) the processor picks the one that keeps most of the image's pixels at its scale and wastes the fewest
(transformers' ``select_best_resolution``), resizes the image into it (aspect kept, padded), and cuts it into
``image_size`` tiles; the tower sees the whole image resized to one tile (the *base*) and then each tile, row-major.
Each tile gives ``image_size / patch_size`` squared features (CLIP's class token dropped by the "default" strategy).

The encoder (:class:`LlavaNextImageEncoder`) projects every tile's features, keeps the base's as they are and lays the
tiles' out as one grid of ``grid rows * side`` by ``grid cols * side`` features; it drops the rows (or columns) that
only cover the padding, so the grid keeps the original image's aspect ratio (transformers' ``unpad_image``, the same
rounding), and appends the learned ``image_newline`` after each of the grid's rows. An image's embeddings: the base's
features, then the unpadded grid row by row, each row closed by the newline. The image's original size travels with
its pixels (``image_sizes``, the processor's data).

The processor (:class:`LlavaNextImageProcessor`): transformers' LLaVA-NeXT image processor (its PIL backend) makes the
tiles; one ``<image>`` placeholder becomes as many copies of itself as the encoder gives rows
(:func:`tokens_per_image`, the count ``LlavaNextProcessor._get_number_of_features`` gives).

Refused by name: a tower other than CLIP's or SigLIP's (Pixtral's, LLaVA-OneVision's are other architectures), a
select strategy that leaves other than ``side * side`` features a tile (CLIP's "full", SigLIP's "default"), grid
pinpoints that are not whole tiles, an image processor whose pinpoints or tile size differ from the model's, and
what :mod:`specray.models.llava` refuses (activations, feature layers, a ``processor_config.json`` counting other
tokens)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specray.models.layers import _copy, _param, materialize
from specray.models.llava import LlavaImageEncoder, _check_processor_config, _strategy
from specray.models.vision_towers import CLIP, VISION_MODEL_TYPES
from specray.multimodal import MultiModalItem, ProcessedImage

ARCH = "LlavaNextForConditionalGeneration"
NEWLINE_NAMES = ("image_newline", "model.image_newline")


def _tiling(config: Any, arch: str = ARCH) -> tuple[int, int, list[tuple[int, int]]]:
    """(tile size in pixels, features a tile's side, the grid pinpoints as (height, width)); a ValueError for a tower
    or strategy this family does not serve or pinpoints that are not whole tiles (``arch``: the family it names)."""
    vision = getattr(config, "vision_config", None)
    kind = getattr(vision, "model_type", None)
    if kind not in VISION_MODEL_TYPES:
        raise ValueError(f"vision_config.model_type={kind!r} is not supported for {arch}: its tiles go through "
                         f"the vision towers {list(VISION_MODEL_TYPES)} (CLIP's, SigLIP's); serve this checkpoint's "
                         "text alone with a release of its text model")
    strategy = _strategy(config)
    if (kind == CLIP) != (strategy == "default"):
        raise ValueError(f"vision_feature_select_strategy={strategy!r} with a {kind} tower is not supported for "
                         f"{arch}: a tile must give (image_size / patch_size)^2 features (transformers lays them out "
                         "as a square), so CLIP needs 'default' (its class token dropped) and SigLIP 'full'")
    tile, patch = vision.image_size, vision.patch_size
    if tile % patch:
        raise ValueError(f"vision_config.image_size={tile} is not a multiple of vision_config.patch_size={patch}")
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    try:
        grid = [(int(h), int(w)) for h, w in pinpoints]
    except (TypeError, ValueError):
        grid = []
    if not grid or any(h <= 0 or w <= 0 or h % tile or w % tile for h, w in grid):
        raise ValueError(f"image_grid_pinpoints={pinpoints!r} is not supported for {arch}: give a non-empty list of "
                         f"[height, width] resolutions, each a positive multiple of vision_config.image_size={tile}")
    return tile, tile // patch, grid


def best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The pinpoint (height, width) an image of ``height`` x ``width`` is resized into: the one keeping most of its
    pixels at the scale that fits it (never more than it has), ties to the one with the least unused area."""
    best, best_key = None, None
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        key = (kept, -(w * h - kept))
        if best_key is None or key > best_key:
            best, best_key = (h, w), key
    return best


def unpadded_span(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int, int]:
    """Of a ``rows`` x ``cols`` feature grid covering an image of ``height`` x ``width`` pixels resized into it with
    its aspect kept and centred, the rows [r0, r1) and columns [c0, c1) that cover the image (not the padding)."""
    if width / height > cols / rows:  # the image is wider: padding above and below
        kept = int(round(height * (cols / width), 7))
        pad = (rows - kept) // 2
        return pad, rows - pad, 0, cols
    kept = int(round(width * (rows / height), 7))
    pad = (cols - kept) // 2
    return 0, rows, pad, cols - pad


def image_layout(config: Any, height: int, width: int) -> tuple[int, int, tuple[int, int, int, int]]:
    """An image of ``height`` x ``width`` pixels: its tile grid (rows, cols) and the unpadded span of its feature
    grid (``unpadded_span``)."""
    tile, side, pinpoints = _tiling(config)
    best_h, best_w = best_resolution(height, width, pinpoints)
    rows, cols = best_h // tile, best_w // tile
    return rows, cols, unpadded_span(height, width, rows * side, cols * side)


def tokens_per_image(config: Any, height: int, width: int) -> int:
    """The embeddings (and placeholder tokens) of an image of ``height`` x ``width`` pixels: the base tile's
    ``side * side`` features, then the unpadded grid's rows, each with its newline."""
    _, side, _ = _tiling(config)
    _, _, (r0, r1, c0, c1) = image_layout(config, height, width)
    return side * side + (r1 - r0) * (c1 - c0 + 1)


class LlavaNextImageEncoder(LlavaImageEncoder):
    """LLaVA's tower and projector over the base image and its tiles, then LLaVA-NeXT's unpadding and newlines
    (:class:`specray.multimodal.ImageEncoder`); replicated on every tensor-parallel rank."""

    arch = ARCH  # the release its refusals name

    def __init__(self, config: Any):
        self.tile, self.side, self.pinpoints = _tiling(config, self.arch)
        super().__init__(config)
        self.config = config
        self.image_newline = _param(config.text_config.hidden_size)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The tower's and projector's tensors (as LLaVA reads them) and ``image_newline`` (``model.`` prefixed as
        transformers' modules name it); a ValueError names any missing."""
        rest, found = [], False
        for name, tensor in weights:
            if name in NEWLINE_NAMES:
                _copy(self.image_newline, materialize(tensor))
                found = True
            else:
                rest.append((name, tensor))
        if not found:
            raise ValueError(f"the checkpoint lacks {ARCH}'s image_newline tensor (the embedding closing each row of "
                             "an image's tiles); it is not a LLaVA-NeXT checkpoint")
        super().load_weights(rest)

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's tiles ``pixel_values`` [1 + tiles, C, S, S] (the base first) and its original ``image_sizes``
        (height, width) -> its embeddings [tokens_per_image, text hidden size]."""
        pixels = data["pixel_values"]
        height, width = (int(v) for v in torch.as_tensor(data["image_sizes"]).reshape(-1).tolist())
        rows, cols, (r0, r1, c0, c1) = image_layout(self.config, height, width)
        if pixels.dim() != 4 or pixels.shape[0] != 1 + rows * cols:
            raise ValueError(f"pixel_values of shape {tuple(pixels.shape)} for an image of {height}x{width} pixels: "
                             f"{self.arch} expects its base image and {rows}x{cols} tiles of image_grid_pinpoints="
                             f"{self.pinpoints} (the image processor's pinpoints must be the model's)")
        features = self.project(self.features(pixels))  # [1 + tiles, side * side, H]
        side, hidden = self.side, features.shape[-1]
        grid = features[1:].view(rows, cols, side, side, hidden).permute(0, 2, 1, 3, 4)
        grid = self.bounded(grid.reshape(rows * side, cols * side, hidden)[r0:r1, c0:c1])
        newline = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, hidden)
        return torch.cat([features[0], torch.cat([grid, newline], dim=1).reshape(-1, hidden)])

    def bounded(self, grid: torch.Tensor) -> torch.Tensor:
        """The unpadded tiles' features [rows, cols, H] as the newlines close them (LLaVA-OneVision resamples a
        large grid)."""
        return grid


class LlavaNextImageProcessor:
    """LLaVA-NeXT's host side (:class:`specray.multimodal.ImageProcessor`): transformers' image processor makes the
    base image and the tiles; the placeholder (``image_token_index``) becomes :func:`tokens_per_image` copies of
    itself; the image's original size goes with its pixels (``image_sizes``)."""

    def __init__(self, image_processor: Any, config: Any):
        tile, _, pinpoints = _tiling(config)
        theirs = getattr(image_processor, "image_grid_pinpoints", None)
        if theirs is not None and [tuple(p) for p in theirs] != pinpoints:
            raise ValueError(f"the image processor's image_grid_pinpoints={theirs!r} differ from config.json's "
                             f"image_grid_pinpoints={[list(p) for p in pinpoints]}: the tiles would not match the "
                             "model's layout; fix preprocessor_config.json")
        self.image_processor, self.config, self.tile = image_processor, config, tile
        self.image_token_id = int(config.image_token_index)

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> LlavaNextImageProcessor:
        from transformers import AutoImageProcessor

        folder = Path(folder)
        _tiling(config)
        _check_processor_config(folder, config)
        return cls(AutoImageProcessor.from_pretrained(folder), config)

    def process(self, image: Any) -> ProcessedImage:
        out = self.image_processor(images=[image], return_tensors="np")
        height, width = (int(v) for v in out["image_sizes"][0])
        pixels = np.asarray(out["pixel_values"][0], dtype=np.float32)
        rows, cols, _ = image_layout(self.config, height, width)
        if pixels.shape[0] != 1 + rows * cols or pixels.shape[-2:] != (self.tile, self.tile):
            raise ValueError(f"the image processor made {pixels.shape[0]} tiles of {pixels.shape[-2:]} pixels for an "
                             f"image of {height}x{width}; the model expects 1 + {rows * cols} of vision_config."
                             f"image_size={self.tile}: fix preprocessor_config.json (crop_size, size)")
        count = tokens_per_image(self.config, height, width)
        sizes = np.array([height, width], dtype=np.int64)
        return ProcessedImage([self.image_token_id] * count, {"pixel_values": pixels, "image_sizes": sizes})

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE
