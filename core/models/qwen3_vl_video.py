"""Qwen3-VL's and Qwen3-VL-MoE's videos (``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``),
and Qwen3.5's / Qwen3.5-MoE's (the same processor; :mod:`specray.models.qwen3_5_vision`'s tower, without DeepStack):
the host side of a video, which :class:`specray.models.qwen3_vl_vision.Qwen3VLImageProcessor` serves beside its images
(``video_token_id``, ``process_video``, the multimodal RoPE positions of its frames). The tower is the images' one
(:class:`~specray.models.qwen3_vl_vision.Qwen3VLImageEncoder` takes ``pixel_values_videos`` / ``video_grid_thw`` as an
image's, DeepStack features included: transformers' ``get_video_features`` is its ``get_image_features``).

:class:`Qwen3VLVideoFrames` makes a video's pixels as transformers' ``Qwen3VLVideoProcessor`` does (torchvision-only;
redone with torch on :class:`~specray.models.qwen2_vl_video.QwenVLVideoFrames`' resize, normalization and patches):

* frame sampling (``do_sample_frames``, on by default as in transformers): ``fps`` (2) frames a second of the
  video's rate (a decoded file's ``VideoFrames.fps``, else transformers' 24 for frames given alone), at least
  ``min_frames`` (4), at most ``max_frames`` and the frames given, evenly spaced (``linspace`` rounded);
* the resize target budgets the whole video (frames x height x width within ``size``, Qwen3-VL's ``smart_resize``),
  frames smaller than ``patch_size * merge_size`` scaled up first, fewer frames than ``temporal_patch_size`` refused;
  ``cap_pixels_per_frame`` as transformers (``max_video_tokens`` per frame).

The prompt (transformers' ``Qwen3VLProcessor``): the video's ``<|video_pad|>`` becomes, per frame pair, the text
``<{seconds:.1f} seconds>`` (the pair's mean time: sampled frame index / fps) then ``<|vision_start|>``, one
``<|video_pad|>`` per merged token of the pair, ``<|vision_end|>`` (the template's own start and end tokens stay around
it all). Positions (Qwen3-VL's ``get_rope_index``): each frame pair is an image of one frame (start, start + row,
start + column), the text between them continues from start + max(rows, columns).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from specray.models.qwen2_vl_video import DEFAULT_FPS, QwenVLVideoFrames, video_settings

# the releases whose videos Qwen3VLImageProcessor serves (Qwen3.5 / Qwen3.5-MoE: transformers' same processor, video
# processor and get_rope_index; their tower, DeepStack-free, takes videos as Qwen3-VL's)
VIDEO_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
DEFAULT_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}  # Qwen3VLVideoProcessor's
HALF = [0.5, 0.5, 0.5]  # transformers' IMAGENET_STANDARD_MEAN / _STD


def smart_resize(frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's resize target: sides multiples of ``factor``, the whole video's pixels within the budget."""
    if frames < temporal:
        raise ValueError(f"a video of {frames} frames is shorter than temporal_patch_size={temporal}, which "
                         "Qwen3-VL's video processor refuses; send at least that many frames (or send it as an image)")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a video of {height} x {width} pixels has an aspect ratio over 200, which Qwen's processor "
                         "refuses; crop or pad its frames")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h, w = (max(factor, math.floor(side / beta / factor) * factor) for side in (height, width))
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h, w = (math.ceil(side * beta / factor) * factor for side in (height, width))
    return h, w


class Qwen3VLVideoFrames(QwenVLVideoFrames):
    """A video's sampled frames, pixels and grid as transformers' ``Qwen3VLVideoProcessor`` makes them."""

    def __init__(self, settings: dict, vision: Any):
        settings = {"size": DEFAULT_SIZE, "image_mean": HALF, "image_std": HALF, "patch_size": 16, **settings}
        self.sample = settings.pop("do_sample_frames", True) is not False
        if settings.get("num_frames") is not None:
            raise ValueError(f"the video processor's num_frames={settings['num_frames']} is not supported: specray "
                             "samples by fps (Qwen3-VL's default); remove num_frames from "
                             "video_preprocessor_config.json")
        self.fps = float(settings.get("fps") or 2)
        self.min_frames, self.max_frames = int(settings.get("min_frames", 4)), int(settings.get("max_frames", 768))
        super().__init__(settings, vision)
        self.max_video_tokens = int(settings.get("max_video_tokens", 768))

    def indices(self, total: int, fps: float | None) -> np.ndarray:
        """The frames taken of ``total`` given at ``fps`` a second (transformers' ``sample_frames``)."""
        if not self.sample:
            return np.arange(total)
        count = int(total / (fps or DEFAULT_FPS) * self.fps)
        count = min(max(count, self.min_frames), self.max_frames, total)
        return np.linspace(0, total - 1, count).round().astype(int)

    def target(self, frames: int, height: int, width: int) -> tuple[int, int]:
        factor = self.patch * self.merge
        budget = self.max_pixels
        if self.cap:  # each frame's share, as transformers' cap_pixels_per_frame
            per_frame = max(min(self.max_video_tokens * factor * factor, self.max_pixels // frames),
                            int(self.min_pixels * 1.05))
            budget = per_frame * frames
        return smart_resize(frames, height, width, self.temporal, factor, self.min_pixels, budget)

    def timestamps(self, indices: np.ndarray, fps: float | None) -> list[float]:
        """Each frame pair's time in seconds: the mean of its first and last frame's (the last frame repeated to fill
        the last pair)."""
        seconds = [int(i) / (fps or DEFAULT_FPS) for i in indices]
        seconds += seconds[-1:] * (-len(seconds) % self.temporal)
        return [(seconds[i] + seconds[i + self.temporal - 1]) / 2 for i in range(0, len(seconds), self.temporal)]


def video_side(folder, config: Any) -> dict:
    """:class:`~specray.models.qwen3_vl_vision.Qwen3VLImageProcessor`'s video members (none: videos refused by the
    seam; a release whose video settings are not served keeps its images, its videos refused with the reason)."""
    import logging

    from transformers import AutoTokenizer

    from specray.models.qwen2_vl_vision import _field

    model_type = str(_field(config, "model_type", ""))
    token = _field(config, "video_token_id")
    if model_type not in VIDEO_MODEL_TYPES or token is None:
        return {}
    start, end = _field(config, "vision_start_token_id"), _field(config, "vision_end_token_id")
    try:
        if start is None or end is None:
            raise ValueError("the config lacks vision_start_token_id / vision_end_token_id (each frame pair's "
                             "<|vision_start|> and <|vision_end|>); set them")
        video = Qwen3VLVideoFrames(video_settings(folder), _field(config, "vision_config") or {})
    except ValueError as err:
        logging.getLogger(__name__).warning("videos are refused for %s: %s", folder, err)
        return {"video_token_id": int(token), "video_problem": str(err)}
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return {"video_token_id": int(token), "video": video,
            "frame_text": lambda seconds: tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False),
            "frame_marks": (int(start), int(end))}


def process_video(processor, frames: list):
    """One video's frames -> its replacement (per frame pair: the time's text tokens, ``<|vision_start|>``, the
    pair's ``<|video_pad|>`` tokens, ``<|vision_end|>``), the rows taking embeddings, and its tensors."""
    from specray.multimodal import ProcessedImage

    if processor.video_problem is not None:
        raise ValueError(processor.video_problem)
    fps = getattr(frames, "fps", None)
    indices = processor.video.indices(len(frames), fps)
    pixels, grid = processor.video.pixels([frames[i] for i in indices])
    t, h, w = (int(g) for g in grid.ravel())
    per_pair = h * w // (processor.merge * processor.merge)
    start, end = processor.frame_marks
    replacement, rows = [], []
    for seconds in processor.video.timestamps(indices, fps):
        replacement += processor.frame_text(seconds) + [start]
        rows += range(len(replacement), len(replacement) + per_pair)
        replacement += [processor.video_token_id] * per_pair + [end]
    assert len(rows) == t * per_pair
    return ProcessedImage(replacement, {"pixel_values_videos": pixels, "video_grid_thw": grid}, rows)


def rope_positions(processor, token_ids: list[int], items: list) -> tuple[list[list[int]], int]:
    """Qwen3-VL's ``get_rope_index``: an image's tokens over its grid, each frame pair of a video as an image of one
    frame, text (a video's times and marks too) one position a token."""
    axes: list[list[int]] = [[], [], []]
    position = done = 0
    merge = processor.merge

    def text(count: int) -> None:
        nonlocal position
        for axis in axes:
            axis.extend(range(position, position + count))
        position += count

    def frames(count: int, rows: int, cols: int) -> None:
        nonlocal position
        grid = np.indices((count, rows, cols)).reshape(3, -1)
        grid[0] = 0  # (transformers' Qwen3-VL: every frame of an image at its start)
        for axis, values in zip(axes, grid):
            axis.extend((values + position).tolist())
        position += max(rows, cols)

    for item in sorted(items, key=lambda it: it.offset):
        text(item.offset - done)
        video = "video_grid_thw" in item.data
        t, h, w = (int(g) for g in np.asarray(item.data["video_grid_thw" if video else "image_grid_thw"]).ravel())
        rows, cols = h // merge, w // merge
        if not video:
            if t * rows * cols != item.length:
                raise ValueError(f"an image's span of {item.length} tokens does not match its grid {[t, h, w]}")
            grid = np.indices((t, rows, cols)).reshape(3, -1)
            for axis, values in zip(axes, grid):
                axis.extend((values + position).tolist())
            position += max(rows, cols)
        else:
            embed = item.embed_rows
            if embed is None or len(embed) != t * rows * cols:
                raise ValueError(f"a video's span does not match its grid {[t, h, w]} (t * h * w / {merge}² rows)")
            at = 0
            for pair in range(t):
                first = embed[pair * rows * cols]
                text(first - at)
                frames(1, rows, cols)
                at = first + rows * cols
            text(item.length - at)
        done = item.end
    text(len(token_ids) - done)
    top = max(axis[-1] for axis in axes) if token_ids else -1
    return axes, top + 1 - len(token_ids)
