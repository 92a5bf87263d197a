"""LLaVA-NeXT-Video (``LlavaNextVideoForConditionalGeneration``, transformers' ``models/llava_next_video``:
LLaVA-NeXT-Video-7B / 7B-DPO / 34B -hf): LLaVA-NeXT's images (:mod:`specray.models.llava_next`, reused whole: a CLIP
tower's tiles, the projector, unpadding, ``image_newline``) and videos, before a Llama-family text model (served as
LLaVA's through ``_TEXT_PARTS``).

A video: each frame through the same tower (the images' feature layer and select strategy: CLIP's class token dropped
by "default"), its ``side`` x ``side`` features pooled by ``spatial_pool_stride`` 2 (``spatial_pool_mode`` "average"
or "max", 2 x 2 windows, no padding: transformers' ``LlavaNextVideoPooler``) BEFORE the projector, the frames' pooled
features one after the other; no newline. The ``<video>`` placeholder (``video_token_index``) becomes ``frames *
(side / 2)^2`` copies of itself (``LlavaNextVideoProcessor.replace_video_token``'s count, which divides a frame's
features by 4 whatever the stride).

The pixels are transformers' ``LlavaNextVideoVideoProcessor``'s (torchvision-only; redone on
:class:`specray.models.llava_onevision_video.OnevisionVideoFrames`' steps): each frame resized so its shorter side is
``size["shortest_edge"]`` (the longer truncated, aspect kept; uint8 bicubic antialiased), centre-cropped to
``crop_size`` (zero-padded first where smaller, as transformers' torchvision backend crops), rescaled and normalized
in float32 (OpenAI CLIP's mean and std by default).

Refused by name: a ``spatial_pool_mode`` other than "average" / "max" (the "conv" pooler's weights are not read), a
``spatial_pool_stride`` other than 2 or a tile of an odd number of features a side (transformers' processor would count
other tokens than its model embeds), and for videos only (images still served) a ``size`` without a lone
``shortest_edge``, a ``crop_size`` other than the tower's tile or no centre crop, and what OneVision's frames refuse
(sampling, a resample other than bicubic, a step switched off)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specray.models import llava_onevision_video as ovv
from specray.models.llava_next import LlavaNextImageEncoder, LlavaNextImageProcessor
from specray.multimodal import ProcessedImage

logger = logging.getLogger(__name__)

ARCH = "LlavaNextVideoForConditionalGeneration"
POOLS = {"average": F.avg_pool2d, "max": F.max_pool2d}


def _pooling(config: Any, side: int) -> str:
    """The pooling mode; a ValueError for a pooler we do not serve."""
    mode = getattr(config, "spatial_pool_mode", "average")
    if mode not in POOLS:
        raise ValueError(f"spatial_pool_mode={mode!r} is not supported for {ARCH}: only {sorted(POOLS)} (the "
                         "releases' 'average'); the 'conv' pooler's weights are not read")
    stride = getattr(config, "spatial_pool_stride", 2)
    if stride != 2 or side % 2:
        raise ValueError(f"spatial_pool_stride={stride} with {side} features a tile's side is not supported for "
                         f"{ARCH}: transformers' processor counts a frame's features / 4 tokens, which only a stride "
                         "of 2 over an even side gives; use the releases' stride 2 and a tile of an even number of "
                         "patches")
    return mode


def tokens_per_video(side: int, frames: int) -> int:
    """A video's embeddings (and ``<video>`` copies): each frame's ``side / 2`` squared pooled features."""
    return frames * (side // 2) ** 2


class LlavaNextVideoEncoder(LlavaNextImageEncoder):
    """LLaVA-NeXT's encoder for images, and for a video (``pixel_values_videos`` [frames, C, S, S]) its frames'
    pooled, projected features; replicated on every tensor-parallel rank."""

    arch = ARCH

    def __init__(self, config: Any):
        super().__init__(config)
        self.pool = POOLS[_pooling(config, self.side)]

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        if ovv.VIDEO_KEY not in data:
            return super().encode(data)
        pixels = data[ovv.VIDEO_KEY]
        if pixels.dim() == 5 and pixels.shape[0] == 1:
            pixels = pixels[0]
        if pixels.dim() != 4 or tuple(pixels.shape[-2:]) != (self.tile, self.tile):
            raise ValueError(f"pixel_values_videos of shape {tuple(pixels.shape)}: a video's frames must be [frames, "
                             f"3, {self.tile}, {self.tile}] (vision_config.image_size)")
        features = self.features(pixels)  # [T, side * side, D]
        frames, _, width = features.shape
        grid = features.view(frames, self.side, self.side, width).permute(0, 3, 1, 2)
        pooled = self.pool(grid, 2, 2).flatten(2).transpose(1, 2)  # [T, (side / 2)^2, D]
        return self.project(pooled).reshape(-1, self.image_newline.shape[0])


class LlavaNextVideoFrames(ovv.OnevisionVideoFrames):
    """A video's pixels as ``LlavaNextVideoVideoProcessor`` makes them: shorter side to ``shortest_edge``, then a
    centre crop of the tower's tile."""

    release = "LLaVA-NeXT-Video"

    def geometry(self, settings: dict) -> None:
        tile = self.tile
        size = settings.get("size") or {"shortest_edge": 224}  # (LlavaNextVideoVideoProcessor's defaults)
        crop = settings.get("crop_size") or {"height": 224, "width": 224}
        if not isinstance(size, dict) or set(size) != {"shortest_edge"} or int(size["shortest_edge"]) < 1:
            raise ValueError(f"the video processor's size={size!r} is not supported: give {{'shortest_edge': N}} "
                             "(the frames' shorter side after resizing)" + ovv.FIX)
        if settings.get("do_center_crop", True) is False or crop != {"height": tile, "width": tile}:
            raise ValueError(f"the video processor's crop_size={crop!r} (do_center_crop="
                             f"{settings.get('do_center_crop', True)}) is not supported: each frame must be centre-"
                             f"cropped to the tower's tile, {{'height': {tile}, 'width': {tile}}}" + ovv.FIX)
        self.shortest = int(size["shortest_edge"])

    def resize(self, x: torch.Tensor) -> torch.Tensor:
        height, width = x.shape[-2:]
        short, long = min(height, width), max(height, width)
        new_long = int(self.shortest * long / short)
        x = ovv.scaled(x, *((new_long, self.shortest) if width <= height else (self.shortest, new_long)))
        height, width = x.shape[-2:]
        tile = self.tile
        if tile > height or tile > width:  # zero padding first, as transformers' torchvision backend crops
            pad_w, pad_h = max(tile - width, 0), max(tile - height, 0)
            x = F.pad(x, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2))
            height, width = x.shape[-2:]
        top, left = int((height - tile) / 2.0), int((width - tile) / 2.0)
        return x[..., top:top + tile, left:left + tile]


class LlavaNextVideoProcessor(LlavaNextImageProcessor):
    """LLaVA-NeXT's image host side, and videos: ``video_token_id`` (``<video>``) and :meth:`process_video`."""

    def __init__(self, image_processor: Any, config: Any):
        self.side = config.vision_config.image_size // config.vision_config.patch_size
        _pooling(config, self.side)
        super().__init__(image_processor, config)
        self.video_token_id, self.video, self.video_problem = None, None, None  # (from_pretrained sets them)

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> LlavaNextVideoProcessor:
        from specray.models.qwen2_vl_video import video_settings

        processor = super().from_pretrained(folder, config)
        token = getattr(config, "video_token_index", None)
        if token is not None:
            processor.video_token_id = int(token)
            try:
                processor.video = LlavaNextVideoFrames(video_settings(Path(folder)), processor.tile)
            except ValueError as err:
                logger.warning("videos are refused for %s: %s", folder, err)
                processor.video_problem = str(err)
        return processor

    def process_video(self, frames: list) -> ProcessedImage:
        """One video's frames (RGB PIL images of one size) -> its ``<video>`` tokens and ``pixel_values_videos``."""
        if self.video is None:
            raise ValueError(self.video_problem or f"{ARCH}'s processor was built without its video settings")
        pixels = self.video.pixels(frames)
        return ProcessedImage([self.video_token_id] * tokens_per_video(self.side, pixels.shape[0]),
                              {ovv.VIDEO_KEY: pixels})
