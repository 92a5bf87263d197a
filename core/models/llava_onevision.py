"""LLaVA-OneVision's images (``LlavaOnevisionForConditionalGeneration``, transformers' ``models/llava_onevision``:
llava-onevision-qwen2-0.5b / 7b / 72b-ov-hf and -si-hf): a SigLIP tower and LLaVA's two-layer projector before a
Qwen2 text model, each image seen at any resolution as LLaVA-NeXT sees it (:mod:`specray.models.llava_next`, reused:
the best ``image_grid_pinpoints`` grid, the base image and its tiles through the tower, the tiles' features laid out
as one grid and unpadded to the image's aspect ratio, a learned ``image_newline`` after each of the grid's rows, the
base's features first).

What OneVision does otherwise: ``vision_aspect_ratio`` "anyres_max_N" bounds the unpadded grid. Where its area
exceeds N tiles' worth of features by more than 1.1 squared (``ratio = sqrt(rows * cols / (N * side^2)) > 1.1``,
``side = image_size / patch_size``), the grid is resampled bilinearly (no corner alignment) to
``int(rows // ratio)`` x ``int(cols // ratio)`` features before the newlines are appended; the placeholder count
(:func:`tokens_per_image`) follows the same rule, as ``LlavaOnevisionProcessor`` counts it. Its image processor
resizes the base image to ``size`` (a square, no crop) and pads the grid's resize with zeros; we run transformers' own
(its PIL backend) and keep each image's original size with its pixels (``image_sizes``).

Several images in one prompt: we expand and encode each as transformers' processor does when handed a flat list of
images (each image its own anyres grid). transformers' *multi-image* mode (images nested per prompt,
``batch_num_images`` > 1: each image padded to a square and given its base features and one newline only) is not
served. Videos: :mod:`specray.models.llava_onevision_video` (the encoder tells one by its ``pixel_values_videos``).

Refused by name: a tower other than SigLIP's, a select strategy other than "full", a ``vision_aspect_ratio`` not of
the form "anyres_max_N", pinpoints that are not whole tiles, an image processor whose pinpoints or tile size differ from
the model's, and a ``processor_config.json`` whose ``num_image_tokens`` / ``vision_aspect_ratio`` /
``vision_feature_select_strategy`` differ from the model's (transformers' forward would refuse that prompt)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from specray.models import llava_onevision_video as video
from specray.models.llava import _strategy
from specray.models.llava_next import LlavaNextImageEncoder, LlavaNextImageProcessor, _tiling, image_layout
from specray.models.vision_towers import SIGLIP
from specray.multimodal import ProcessedImage

ARCH = "LlavaOnevisionForConditionalGeneration"
_ASPECT = re.compile(r"^anyres_max_([1-9][0-9]*)$")


def _check(config: Any) -> tuple[int, int]:
    """(features a tile's side, N of ``vision_aspect_ratio`` "anyres_max_N"); a ValueError for what we do not
    serve."""
    kind = getattr(getattr(config, "vision_config", None), "model_type", None)
    if kind != SIGLIP:
        raise ValueError(f"vision_config.model_type={kind!r} is not supported for {ARCH}: its images are served with "
                         f"SigLIP's vision tower ({SIGLIP!r}, the releases'); serve this checkpoint's text alone with "
                         "a release of its text model")
    strategy = _strategy(config)
    if strategy != "full":
        raise ValueError(f"vision_feature_select_strategy={strategy!r} is not supported for {ARCH}: its SigLIP tiles "
                         "keep every patch ('full', the releases' setting); set it to 'full' in config.json")
    _, side, _ = _tiling(config, ARCH)
    aspect = getattr(config, "vision_aspect_ratio", "anyres_max_9")
    match = _ASPECT.match(str(aspect))
    if match is None:
        raise ValueError(f"vision_aspect_ratio={aspect!r} is not supported for {ARCH}: give 'anyres_max_N' (N the "
                         "most tiles' worth of features an image's grid keeps, the releases' 'anyres_max_9')")
    return side, int(match.group(1))


def reduced(config: Any, rows: int, cols: int) -> tuple[int, int]:
    """The size an unpadded ``rows`` x ``cols`` feature grid is resampled to under ``vision_aspect_ratio`` (itself
    where it is within 1.1 of N tiles' worth of features)."""
    side, most = _check(config)
    ratio = math.sqrt(rows * cols / (most * side * side))
    if ratio > 1.1:
        return int(rows // ratio), int(cols // ratio)
    return rows, cols


def tokens_per_image(config: Any, height: int, width: int) -> int:
    """The embeddings (and placeholder tokens) of an image of ``height`` x ``width`` pixels: the base tile's
    ``side * side`` features, then the (unpadded, perhaps resampled) grid's rows, each closed by a newline."""
    side, _ = _check(config)
    _, _, (r0, r1, c0, c1) = image_layout(config, height, width)
    rows, cols = reduced(config, r1 - r0, c1 - c0)
    return side * side + rows * (cols + 1)


class LlavaOnevisionImageEncoder(LlavaNextImageEncoder):
    """LLaVA-NeXT's encoder (tower, projector, tiling, unpadding, ``image_newline``) with OneVision's bound on the
    grid (:func:`reduced`); replicated on every tensor-parallel rank."""

    arch = ARCH

    def __init__(self, config: Any):
        _check(config)
        super().__init__(config)

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """An image's embeddings (LLaVA-NeXT's layout), or a video's (``pixel_values_videos``:
        :func:`specray.models.llava_onevision_video.encode_video`)."""
        if video.VIDEO_KEY in data:
            return video.encode_video(self, data[video.VIDEO_KEY])
        return super().encode(data)

    def bounded(self, grid: torch.Tensor) -> torch.Tensor:
        """The unpadded grid [rows, cols, H] resampled bilinearly to :func:`reduced`'s size where "anyres_max_N"
        bounds it."""
        size = reduced(self.config, grid.shape[0], grid.shape[1])
        if size == tuple(grid.shape[:2]):
            return grid
        return F.interpolate(grid.permute(2, 0, 1)[None], list(size), mode="bilinear")[0].permute(1, 2, 0)

class LlavaOnevisionImageProcessor(LlavaNextImageProcessor):
    """OneVision's host side (:class:`specray.multimodal.ImageProcessor`): transformers' image processor makes the
    base image and the tiles of one image; the placeholder (``image_token_index``) becomes :func:`tokens_per_image`
    copies of itself; the image's original size goes with its pixels (``image_sizes``)."""

    def __init__(self, image_processor: Any, config: Any):
        _check(config)
        super().__init__(image_processor, config)
        self.video_token_id, self.video, self.video_problem = None, None, None  # (from_pretrained sets them)

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> LlavaOnevisionImageProcessor:
        from transformers import AutoImageProcessor

        folder = Path(folder)
        side, _ = _check(config)
        path = folder / "processor_config.json"
        saved = json.loads(path.read_text()) if path.is_file() else {}
        ours = {"num_image_tokens": side * side, "vision_aspect_ratio": getattr(config, "vision_aspect_ratio",
                                                                                "anyres_max_9"),
                "vision_feature_select_strategy": _strategy(config)}
        for field, value in ours.items():
            if saved.get(field) not in (None, value):
                raise ValueError(f"{path} has {field}={saved[field]!r} but the model's config.json gives {value!r}: "
                                 "the placeholder would be expanded to another number of tokens than the model "
                                 f"embeds; fix processor_config.json to match config.json")
        processor = cls(AutoImageProcessor.from_pretrained(folder), config)
        # videos (llava_onevision_video): the <video> id (None: not taken), the frames' processor, why refused
        processor.video_token_id, processor.video, processor.video_problem = video.video_side(folder, config)
        return processor

    def process_video(self, frames: list) -> ProcessedImage:
        """One video's frames (RGB PIL images of one size) -> its ``<video>`` tokens and ``pixel_values_videos``."""
        if self.video is None:
            raise ValueError(self.video_problem or f"{ARCH}'s processor was built without its video settings")
        pixels = self.video.pixels(frames)
        count = video.tokens_per_video(self.tile // self.config.vision_config.patch_size, pixels.shape[0])
        return ProcessedImage([self.video_token_id] * count, {video.VIDEO_KEY: pixels})

    def process(self, image: Any) -> ProcessedImage:
        out = self.image_processor(images=[image], return_tensors="np")
        height, width = (int(v) for v in out["image_sizes"][0])
        rows, cols, _ = image_layout(self.config, height, width)
        pixels = np.asarray(out["pixel_values"][0][:1 + rows * cols], dtype=np.float32)
        if pixels.shape[0] != 1 + rows * cols or pixels.shape[-2:] != (self.tile, self.tile):
            raise ValueError(f"the image processor made {pixels.shape[0]} tiles of {pixels.shape[-2:]} pixels for an "
                             f"image of {height}x{width}; {ARCH} expects 1 + {rows * cols} of vision_config."
                             f"image_size={self.tile}: fix preprocessor_config.json (size, crop_size)")
        count = tokens_per_image(self.config, height, width)
        sizes = np.array([height, width], dtype=np.int64)
        return ProcessedImage([self.image_token_id] * count, {"pixel_values": pixels, "image_sizes": sizes})
