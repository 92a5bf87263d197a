"""LLaVA-OneVision's videos (``LlavaOnevisionForConditionalGeneration``, transformers' ``get_video_features``): the
video side of :mod:`specray.models.llava_onevision`, whose processor serves it beside its images (``video_token_id``,
``process_video``) and whose encoder takes a video's ``pixel_values_videos`` (told from an image by that key).

A video's frames go through the images' SigLIP tower and projector one by one, each as a single base tile (no anyres
grid); each frame's ``side`` x ``side`` projected features (``side = image_size / patch_size``) are resampled
bilinearly (no corner alignment) to ``ceil(side / 2)`` a side (:func:`pool`, transformers' ``apply_pooling``); the
frames' pooled features follow each other and the learned ``image_newline`` closes the video once. The placeholder
``<video>`` (the config's ``video_token_index``) becomes ``frames * ceil(side / 2)^2 + 1`` copies of itself
(:func:`tokens_per_video`, ``LlavaOnevisionProcessor.replace_video_token``'s count).

The pixels (:class:`OnevisionVideoFrames`) are transformers' ``LlavaOnevisionVideoProcessor``'s, a torchvision-only
processor redone with torch: each frame (RGB) resized to ``size`` (the tower's square tile) bicubically with
antialiasing on uint8 (as torchvision resizes uint8 on a CPU; a frame already of that size is kept), rescaled and
normalized in float32 in transformers' fused form ``(x - mean / rescale) / (std / rescale)`` with the video
processor's mean and std (OpenAI CLIP's by default: not the SigLIP images' 0.5): ``pixel_values_videos`` [frames, C,
S, S]. The settings are found where ``AutoVideoProcessor`` finds them
(:func:`specray.models.qwen2_vl_video.video_settings`). The frames are taken as given (no sampling).

Refused by name, for videos only (the release's images are still served): ``do_sample_frames`` true, a
``do_center_crop`` true, ``do_resize`` / ``do_rescale`` / ``do_normalize`` / ``do_convert_rgb`` false, a resample
other than bicubic, a ``size`` other than the tower's ``image_size`` square."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from specray.multimodal import frame_stack

logger = logging.getLogger(__name__)

VIDEO_KEY = "pixel_values_videos"
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # LlavaOnevisionVideoProcessor's defaults (OpenAI CLIP's)
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
FIX = "; fix the video processor's settings (video_preprocessor_config.json)"


def pooled_side(side: int) -> int:
    """A frame's pooled features a side: ``ceil(side / 2)``."""
    return -(-side // 2)


def tokens_per_video(side: int, frames: int) -> int:
    """A video's embeddings (and ``<video>`` copies): each frame's pooled features, then one newline."""
    return frames * pooled_side(side) ** 2 + 1


def pool(features: torch.Tensor, side: int) -> torch.Tensor:
    """Each frame's projected features [T, side * side, H] resampled bilinearly (no corner alignment) to
    [T, ceil(side / 2)^2, H]."""
    frames, _, hidden = features.shape
    grid = features.view(frames, side, side, hidden).permute(0, 3, 1, 2)
    small = pooled_side(side)
    grid = F.interpolate(grid, size=[small, small], mode="bilinear", align_corners=False)
    return grid.permute(0, 2, 3, 1).reshape(frames, small * small, hidden)


def encode_video(encoder: Any, pixels: torch.Tensor) -> torch.Tensor:
    """A video's frames ``pixels`` [T, C, S, S] through ``encoder`` (a :class:`LlavaOnevisionImageEncoder`: its
    tower, projector, ``side`` and ``image_newline``) -> [T * ceil(side / 2)^2 + 1, text hidden size]."""
    if pixels.dim() == 5 and pixels.shape[0] == 1:  # ([1, T, C, S, S] as transformers batches one video)
        pixels = pixels[0]
    if pixels.dim() != 4 or tuple(pixels.shape[-2:]) != (encoder.tile, encoder.tile):
        raise ValueError(f"pixel_values_videos of shape {tuple(pixels.shape)}: a video's frames must be [frames, 3, "
                         f"{encoder.tile}, {encoder.tile}] (vision_config.image_size)")
    features = pool(encoder.project(encoder.features(pixels)), encoder.side)
    newline = encoder.image_newline.to(features.dtype)[None]
    return torch.cat([features.reshape(-1, features.shape[-1]), newline])


class OnevisionVideoFrames:
    """A video's pixels as transformers' ``LlavaOnevisionVideoProcessor`` makes them (see the module's docstring),
    from its settings; ``tile``: the tower's ``image_size``. Subclasses change the frames' geometry
    (:meth:`geometry`, :meth:`resize`)."""

    release = "LLaVA-OneVision"

    def __init__(self, settings: dict, tile: int):
        if settings.get("do_sample_frames"):
            raise ValueError("the video processor's do_sample_frames=True is not supported: specray takes a video's "
                             "frames as given; sample them before sending, and set it to false" + FIX)
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if settings.get(flag) is False:
                raise ValueError(f"the video processor's {flag}=False is not supported ({self.release}'s video "
                                 "processor converts, resizes, rescales and normalizes every frame)" + FIX)
        resample = settings.get("resample", 3)
        if resample not in (3, "bicubic"):
            raise ValueError(f"the video processor's resample={resample!r} is not supported: only bicubic (3), "
                             f"{self.release}'s, is" + FIX)
        self.tile = tile
        self.geometry(settings)
        rescale = float(settings.get("rescale_factor", 1 / 255))
        # transformers' fused rescale and normalize: (x - mean / rescale) / (std / rescale), in float32
        self.mean = torch.tensor([float(v) for v in settings.get("image_mean") or CLIP_MEAN]) * (1.0 / rescale)
        self.std = torch.tensor([float(v) for v in settings.get("image_std") or CLIP_STD]) * (1.0 / rescale)

    def pixels(self, frames: list) -> np.ndarray:
        """RGB frames of one size -> ``pixel_values_videos`` [frames, C, S, S] float32."""
        x = torch.from_numpy(frame_stack(frames)).permute(0, 3, 1, 2).contiguous()  # [T, C, H, W] uint8
        x = self.resize(x)
        x = x.to(torch.float32).sub_(self.mean[:, None, None]).div_(self.std[:, None, None])
        return x.numpy()

    def geometry(self, settings: dict) -> None:
        """Check the settings that size a frame: OneVision resizes it to the tower's square tile, no crop."""
        tile = self.tile
        if settings.get("do_center_crop"):
            raise ValueError("the video processor's do_center_crop=True is not supported: LLaVA-OneVision resizes "
                             "each frame to the tower's square tile; set it to false" + FIX)
        size = settings.get("size") or {"height": tile, "width": tile}
        square = isinstance(size, dict) and set(size) == {"height", "width"}
        if not square or (size["height"], size["width"]) != (tile, tile):
            raise ValueError(f"the video processor's size={size!r} is not supported: each frame must be resized to "
                             f"the tower's tile, {{'height': {tile}, 'width': {tile}}} (vision_config.image_size)"
                             + FIX)

    def resize(self, x: torch.Tensor) -> torch.Tensor:
        """The frames [T, C, H, W] uint8 at the tower's tile size (kept where they are)."""
        return scaled(x, self.tile, self.tile)


def scaled(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Frames [T, C, H, W] of uint8 resized to ``height`` x ``width`` as torchvision resizes uint8 on a CPU
    (bicubic, antialiased, in uint8); frames of that size are kept."""
    if tuple(x.shape[-2:]) == (height, width):
        return x
    return F.interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True)


def video_side(folder: Path, config: Any) -> tuple[int | None, OnevisionVideoFrames | None, str | None]:
    """(``video_token_index`` or None: videos not taken, the frames' processor, why videos are refused or None); a
    release whose video settings are not served keeps its images."""
    from specray.models.qwen2_vl_video import video_settings

    token = getattr(config, "video_token_index", None)
    if token is None:
        return None, None, None
    try:
        frames = OnevisionVideoFrames(video_settings(folder), int(config.vision_config.image_size))
    except ValueError as err:
        logger.warning("videos are refused for %s: %s", folder, err)
        return int(token), None, str(err)
    return int(token), frames, None
