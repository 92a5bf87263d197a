"""Videos (frames only, no sound track) for the Qwen Omni thinkers: Qwen2.5-Omni's
(:mod:`specray.models.qwen2_5_omni`) and Qwen3-Omni-MoE's (:mod:`specray.models.qwen3_omni_moe`), whose processors
serve a video beside audios and images through :class:`OmniVideo` and :func:`rope_positions`.

A video's pixels and grid are Qwen2-VL's (:class:`specray.models.qwen2_vl_video.QwenVLVideoFrames`, reused: both Omni
processors run transformers' ``Qwen2VLVideoProcessor``), with the size the Omni processor passes it on every call
(its class default ``videos_kwargs["size"]``, which outranks the folder's ``min_pixels`` / ``max_pixels``:
Qwen2.5-Omni 128..768 blocks of 28 x 28 pixels, Qwen3-Omni 128..768 of 32 x 32). Its placeholder (``<|VIDEO|>`` in
Qwen2.5-Omni, ``<|video_pad|>`` in Qwen3-Omni, between the vision marks) is repeated t*h*w / merge² times, as the Omni
processors' ``replace_video_token`` writes it. The vision tower runs a video as an image (its frame pairs: the
thinkers' ``get_video_features`` is their tower over ``pixel_values_videos`` / ``video_grid_thw``).

TMRoPE (the thinkers' ``get_rope_index``): text and audio tokens take consecutive positions on all three axes; an
image's or a video's tokens take (start + temporal index, start + row, start + column) over the merged grid, and the
tokens after it continue from the largest of them + 1 (also past a video's last temporal index). A video's frame pair
``k`` has the temporal index ``k * second_per_grid * position_id_per_seconds`` (float32, the config's
``position_id_per_seconds``), with ``second_per_grid = temporal_patch_size / fps`` (``video_second_per_grid``);
Qwen2.5-Omni truncates it to an integer, Qwen3-Omni keeps it as a float (served only where it is a whole number). The
fps is, for Qwen2.5-Omni, the frames' own rate where known (a decoded file's), else its processor's default (2) for
frames given alone; Qwen3-Omni always takes its processor's default (1), as transformers' processor does when no fps
is passed (a file's own rate would give most files fractional positions; not transformers' 24 of Qwen2.5-VL's
processor either).

Not served: the video's own sound (``use_audio_in_video``: the video's and its audio's tokens interleaved in
``seconds_per_chunk`` chunks), frame sampling (``do_sample_frames``, refused by :class:`QwenVLVideoFrames`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specray.models.qwen2_vl_video import QwenVLVideoFrames, video_settings
from specray.multimodal import MultiModalItem, ProcessedImage

logger = logging.getLogger(__name__)
SECONDS = "video_second_per_grid"  # a video item's data: its frame pairs' spacing in seconds, float32 [1]


def _field(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


class OmniVideo:
    """A thinker's video side: the frames' processor, the placeholder's id, the fps of frames given alone, the
    config's ``position_id_per_seconds`` and whether temporal positions are truncated (Qwen2.5-Omni) or must be whole
    (Qwen3-Omni)."""

    def __init__(self, frames: QwenVLVideoFrames, token_id: int, fps: float, per_second: float, truncate: bool,
                 audio_start: int | None = None):
        self.frames, self.token_id, self.fps = frames, token_id, fps
        self.per_second, self.truncate = per_second, truncate
        self.audio_start = audio_start  # the audio's start mark: right before a video's span, its sound's layout

    @classmethod
    def side(cls, folder: Path, thinker: Any, size: dict, fps: float, truncate: bool) -> dict:
        """The processor's video arguments: ``video_token_id`` and ``video`` (this side), or ``video_token_id`` and
        ``video_problem`` (why the release's videos are refused: settings not served; its images and audios still
        are); none when the config names no video token or vision tower."""
        token = _field(thinker, "video_token_id", _field(thinker, "video_token_index"))
        vision = _field(thinker, "vision_config")
        if token is None or vision is None:
            return {}
        settings = {k: v for k, v in video_settings(folder).items() if k not in ("min_pixels", "max_pixels")}
        try:
            frames = QwenVLVideoFrames({**settings, "size": dict(size)}, vision)
        except ValueError as err:
            logger.warning("videos are refused for %s: %s", folder, err)
            return {"video_token_id": int(token), "video_problem": str(err)}
        per_second = _field(thinker, "position_id_per_seconds", 25)
        start = _field(thinker, "audio_start_token_id")
        return {"video_token_id": int(token),
                "video": cls(frames, int(token), fps, per_second, truncate, None if start is None else int(start))}

    def process(self, frames: list) -> ProcessedImage:
        """One video's frames -> its placeholder tokens and tensors (``pixel_values_videos``, ``video_grid_thw``,
        ``video_second_per_grid``)."""
        pixels, grid = self.frames.pixels(frames)
        # Qwen2.5-Omni times a decoded file's frames at their own rate; Qwen3-Omni, whose positions stay floats
        # (whole numbers only at some rates), at its processor's, as transformers' processor does without an fps
        fps = float(getattr(frames, "fps", None) or self.fps) if self.truncate else self.fps
        seconds = np.array([self.frames.temporal / fps], dtype=np.float32)
        if not self.truncate:
            index = temporal_index(int(grid[0, 0]), seconds, self.per_second, False)
            if not torch.equal(index, index.round()):
                raise ValueError(f"a video at {fps:g} frames a second gives its frame pairs temporal positions "
                                 f"{index[:4].tolist()}... (position_id_per_seconds={self.per_second} x "
                                 f"{float(seconds[0]):g} s a pair), not whole numbers, which specray's positions "
                                 "cannot hold; use the release's position_id_per_seconds")
        merge = self.frames.merge
        tokens = int(grid.prod()) // (merge * merge)
        return ProcessedImage([self.token_id] * tokens,
                              {"pixel_values_videos": pixels, "video_grid_thw": grid, SECONDS: seconds})


def temporal_index(pairs: int, seconds: np.ndarray, per_second: float, truncate: bool) -> torch.Tensor:
    """Each frame pair's temporal position index (before the start is added): ``k * seconds * per_second`` in
    float32, in that order, truncated where ``truncate`` (as transformers computes it)."""
    index = torch.arange(pairs) * torch.as_tensor(np.asarray(seconds, dtype=np.float32).reshape(-1)[0]) * per_second
    return index.long() if truncate else index


def after(grid: torch.Tensor) -> int:
    """Where the tokens after an image or a video continue: its largest position on any axis + 1 (past a video's
    last frame pair's time)."""
    return int(grid.max()) + 1


def rope_positions(token_ids: list[int], items: list[MultiModalItem], merge: int, per_second: float,
                   truncate: bool, audio_start: int | None = None) -> tuple[list[list[int]], int] | None:
    """The thinkers' ``get_rope_index`` (TMRoPE) for a prompt with images and videos (audios among them, taking
    consecutive positions): ([temporal, height, width] position lists, each as long as ``token_ids``; the delta the
    tokens past the prompt add to their slot index, the largest position + 1 - length). None without an image or a
    video (plain positions). A video right after the audio's start mark ``audio_start`` (the layout of a video with
    its own sound, ``use_audio_in_video``) is refused."""
    for item in items:
        if item.modality == "video" and audio_start is not None and item.offset and \
                token_ids[item.offset - 1] == audio_start:
            raise ValueError("the prompt holds a video right after the audio's start mark, the layout of a video with "
                             "its own sound (use_audio_in_video=True), which is not served: render the video part "
                             "without its audio (use_audio_in_video=False) and send the sound as an audio of its own")
    if not any(item.modality != "audio" for item in items):
        return None
    axes: list[list[int]] = [[], [], []]
    position = done = 0
    for item in sorted(items, key=lambda it: it.offset):
        for axis in axes:
            axis.extend(range(position, position + item.offset - done))
        position += item.offset - done
        done = item.end
        if item.modality == "audio":
            for axis in axes:
                axis.extend(range(position, position + item.length))
            position += item.length
            continue
        video = item.modality == "video"
        t, h, w = (int(g) for g in np.asarray(item.data["video_grid_thw" if video else "image_grid_thw"]).ravel())
        rows, cols = h // merge, w // merge
        if t * rows * cols != item.length:
            raise ValueError(f"a {item.modality}'s span of {item.length} tokens does not match its grid {[t, h, w]} "
                             f"(t * h * w / {merge}² tokens)")
        grid = torch.from_numpy(np.indices((t, rows, cols)).reshape(3, -1))
        if video:
            grid[0] = temporal_index(t, item.data[SECONDS], per_second, truncate).round().long()[grid[0]]
        grid = grid + position
        for axis, values in zip(axes, grid.tolist()):
            axis.extend(values)
        position = after(grid)
    for axis in axes:
        axis.extend(range(position, position + len(token_ids) - done))
    top = max(max(axis) for axis in axes) if token_ids else -1
    return axes, top + 1 - len(token_ids)
