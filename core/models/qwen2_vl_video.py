"""Qwen2-VL's and Qwen2.5-VL's videos (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``):
the host side of a video, which :class:`specray.models.qwen2_vl_vision.QwenVLImageProcessor` serves beside its images
(``video_token_id``, ``process_video``) and whose tokens its multimodal RoPE positions cover. The vision tower is the
images' one (:class:`~specray.models.qwen2_vl_vision.Qwen2VLImageEncoder` takes a video's ``pixel_values_videos`` /
``video_grid_thw`` as an image's: attention within each frame pair, Qwen2.5-VL's windows per frame pair).

:class:`QwenVLVideoFrames` makes a video's pixels as transformers' ``Qwen2VLVideoProcessor`` does (a torchvision-only
processor, redone here with torch): the frames (RGB, one size) resized together to multiples of ``patch_size *
merge_size`` pixels within the pixel budget (``smart_resize``; with ``cap_pixels_per_frame`` each frame's budget is
also held to an even share of ``max_video_tokens`` tokens' pixels), bicubically with antialiasing on uint8 (as
torchvision resizes uint8 natively on a CPU), rescaled and normalized in float32 (transformers' fused form, ``(x -
mean / rescale) / (std / rescale)``), the last frame repeated up to a multiple of ``temporal_patch_size``, and cut into
``temporal_patch_size`` x ``patch_size`` x ``patch_size`` patches in merge-block order: ``pixel_values_videos``
[t*h*w, C*T*P*P] and ``video_grid_thw`` [1, 3]. The frames are taken as given (no sampling: ``do_sample_frames`` is
refused).

Positions (transformers' ``get_rope_index``): a video's tokens take (start + temporal index, start + row, start +
column) over its merged grid, then the text continues from start + max(rows, columns) as after an image. Qwen2.5-VL
spaces the temporal index by ``tokens_per_second * second_per_grid_ts`` (float32, truncated), where
``second_per_grid_ts = temporal_patch_size / fps`` and the fps is transformers' default for frames given without
metadata (24); Qwen2-VL's temporal index is the frame pair's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from specray.multimodal import frame_stack

VIDEO = "video"
DEFAULT_FPS = 24.0  # transformers' VideoMetadata.sampled_fps for frames given without metadata
DEFAULT_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}  # Qwen2VLVideoProcessor's
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _field(config: Any, name: str, default: Any) -> Any:
    """``config.name`` of a config object or a dict."""
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen's resize target: each side a multiple of ``factor`` near the original, the area brought within
    ``[min_pixels, max_pixels]`` keeping the aspect ratio."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a video of {height} x {width} pixels has an aspect ratio over 200, which Qwen's processor "
                         "refuses; crop or pad its frames")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = (max(factor, math.floor(side / beta / factor) * factor) for side in (height, width))
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = (math.ceil(side * beta / factor) * factor for side in (height, width))
    return h, w


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def video_settings(folder: Path) -> dict:
    """The video processor's settings as transformers' ``AutoVideoProcessor`` finds them: the ``video_processor``
    entry of ``processor_config.json``, else ``video_preprocessor_config.json``, else the image processor's
    ``preprocessor_config.json``."""
    folder = Path(folder)
    nested = (_read_json(folder / "processor_config.json") or {}).get("video_processor")
    if nested is not None:
        return nested
    return (_read_json(folder / "video_preprocessor_config.json") or _read_json(folder / "preprocessor_config.json")
            or {})


class QwenVLVideoFrames:
    """A video's pixels and grid as transformers' ``Qwen2VLVideoProcessor`` makes them (see the module's docstring),
    from its settings (:func:`video_settings`)."""

    def __init__(self, settings: dict, vision: Any):
        size = dict(settings.get("size") or DEFAULT_SIZE)
        for key, side in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if settings.get(key) is not None:  # (the older releases' names win, as in transformers)
                size[side] = settings[key]
        if not size.get("shortest_edge") or not size.get("longest_edge"):
            raise ValueError(f"the video processor's size={size} must hold shortest_edge and longest_edge (the pixel "
                             "budget of a frame); fix video_preprocessor_config.json")
        self.min_pixels, self.max_pixels = int(size["shortest_edge"]), int(size["longest_edge"])
        resample = settings.get("resample", 3)
        if resample not in (3, "bicubic"):
            raise ValueError(f"the video processor's resample={resample!r} is not supported: only bicubic (3), "
                             "Qwen2-VL's, is; fix video_preprocessor_config.json")
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if settings.get(flag) is False:
                raise ValueError(f"the video processor's {flag}=False is not supported (Qwen2-VL's video processor "
                                 "converts, resizes, rescales and normalizes every frame); fix "
                                 "video_preprocessor_config.json")
        if settings.get("do_sample_frames"):
            raise ValueError("the video processor's do_sample_frames=True is not supported: specray takes a video's "
                             "frames as given; sample them before sending, and set it to false")
        self.patch = int(settings.get("patch_size", 14))
        self.merge = int(settings.get("merge_size", 2))
        self.temporal = int(settings.get("temporal_patch_size", 2))
        for ours, theirs, value in (("patch_size", "patch_size", self.patch),
                                    ("merge_size", "spatial_merge_size", self.merge),
                                    ("temporal_patch_size", "temporal_patch_size", self.temporal)):
            tower = _field(vision, theirs, 2 if theirs != "patch_size" else 14)
            if value != tower:
                raise ValueError(f"the video processor's {ours}={value} differs from vision_config.{theirs}={tower}; "
                                 "the checkpoint's video processor settings do not match its config.json")
        self.cap = bool(settings.get("cap_pixels_per_frame"))
        self.max_video_tokens = int(settings.get("max_video_tokens", 128000))
        rescale = float(settings.get("rescale_factor", 1 / 255))
        # transformers' fused rescale and normalize: (x - mean / rescale) / (std / rescale), in float32
        self.mean = torch.tensor([float(v) for v in settings.get("image_mean") or CLIP_MEAN]) * (1.0 / rescale)
        self.std = torch.tensor([float(v) for v in settings.get("image_std") or CLIP_STD]) * (1.0 / rescale)

    def target(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The frames' size after resizing."""
        factor = self.patch * self.merge
        budget = self.max_pixels
        if self.cap:  # an even share of the whole video's pixel budget, floored
            total = int(self.max_video_tokens * factor * factor * 0.9)
            budget = max(min(budget, total * self.temporal // frames), int(self.min_pixels * 1.05))
        return smart_resize(height, width, factor, self.min_pixels, budget)

    def pixels(self, frames: list) -> tuple[np.ndarray, np.ndarray]:
        """RGB frames of one size -> (``pixel_values_videos`` [t*h*w, C*T*P*P] float32, ``video_grid_thw`` [[t, h,
        w]] int64)."""
        x = torch.from_numpy(frame_stack(frames)).permute(0, 3, 1, 2).contiguous()  # [T, C, H, W] uint8
        count, channels, height, width = x.shape
        new_h, new_w = self.target(count, height, width)
        if (new_h, new_w) != (height, width):  # torchvision's uint8 bicubic antialiased resize on a CPU
            x = F.interpolate(x, size=[new_h, new_w], mode="bicubic", align_corners=False, antialias=True)
        x = x.to(torch.float32).sub_(self.mean[:, None, None]).div_(self.std[:, None, None])
        if pad := -count % self.temporal:  # the last frame repeated
            x = torch.cat((x, x[-1:].expand(pad, -1, -1, -1)))
        p, m, tp = self.patch, self.merge, self.temporal
        t, h, w = x.shape[0] // tp, new_h // p, new_w // p
        patches = x.view(t, tp, channels, h // m, m, p, w // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return (patches.reshape(t * h * w, channels * tp * p * p).numpy(),
                np.array([[t, h, w]], dtype=np.int64))


def temporal_indices(frames: int, item_data: dict, tokens_per_second: float | None) -> np.ndarray:
    """A video's temporal position index per frame pair (before the start is added): the pair's index (Qwen2-VL),
    or (Qwen2.5-VL, ``tokens_per_second`` given) the index times ``tokens_per_second * second_per_grid_ts`` in
    float32, truncated, as transformers computes it."""
    index = torch.arange(frames)
    if tokens_per_second is not None:
        seconds = torch.as_tensor(np.asarray(item_data["second_per_grid_ts"], dtype=np.float32).reshape(-1)[0])
        index = (index * (tokens_per_second * seconds)).long()
    return index.numpy()
