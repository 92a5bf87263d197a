"""GLM-4.1V's and GLM-4.5V's videos (``Glm4vForConditionalGeneration``, ``Glm4vMoeForConditionalGeneration``): the
host side of a video, which :class:`specray.models.glm4v.Glm4vImageProcessor` serves beside its images
(``video_token_id``, ``process_video``, the multimodal RoPE positions of its frames). The tower is the images' one
(:class:`~specray.models.glm4v.Glm4vImageEncoder` takes ``pixel_values_videos`` / ``video_grid_thw`` as an image's:
transformers' ``get_video_features`` runs each frame pair as an image of one frame, which is what the tower does
with a grid of ``t`` frame pairs: attention, RoPE and the resampled position table per frame pair).

:class:`Glm4vVideoFrames` makes a video's pixels as transformers' ``Glm4vVideoProcessor`` does (torchvision-only;
redone with torch on :class:`~specray.models.qwen2_vl_video.QwenVLVideoFrames`' resize, normalization and patches):

* frame sampling (``do_sample_frames``, on by default as in transformers) needs the video's rate: for a decoded
  file's frames (``VideoFrames.fps``) ``fps`` (2) frames a second are taken as transformers' ``sample_frames`` takes
  them (frame ``ceil(i * rate / fps)`` for ``i`` under ``floor(duration * fps)``, the duration ``round((frames - 1) /
  rate) + 1`` seconds; past ``max_duration`` seconds ``max_duration * fps`` evenly spaced), repeats dropped, the last
  one repeated to an even count. Frames given without a rate are taken as given (transformers refuses them unless
  ``do_sample_frames=False``; specray serves them as that call does);
* the resize target budgets the whole video (frames x height x width within ``size``: Qwen3-VL's ``smart_resize``,
  which is GLM-4V's), frames smaller than ``patch_size * merge_size`` scaled up first, fewer frames than
  ``temporal_patch_size`` refused.

The prompt (transformers' ``Glm4vProcessor``): the video's ``<|video|>`` (between the template's
``<|begin_of_video|>`` and ``<|end_of_video|>``, which stay) becomes, per frame pair, ``<|begin_of_image|>``, one
``<|image|>`` per merged token of the pair, ``<|end_of_image|>``, then the pair's first frame's time in whole seconds
as text (frame index / rate; transformers' 24 frames a second for frames given without one). Positions (GLM-4V's
``get_rope_index``): each frame pair is an image of one frame (start, start + row, start + column), the text between
them continues from start + max(rows, columns): Qwen3-VL's layout
(:func:`specray.models.qwen3_vl_video.rope_positions`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from specray.models.qwen2_vl_video import CLIP_MEAN, CLIP_STD, DEFAULT_FPS, QwenVLVideoFrames, video_settings
from specray.models.qwen3_vl_video import rope_positions, smart_resize

logger = logging.getLogger(__name__)

VIDEO_MODEL_TYPES = ("glm4v", "glm4v_moe")  # the releases whose videos Glm4vImageProcessor serves
DEFAULT_SIZE = {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 2 * 30000}  # Glm4vVideoProcessor's

__all__ = ["Glm4vVideoFrames", "process_video", "rope_positions", "video_side"]


class Glm4vVideoFrames(QwenVLVideoFrames):
    """A video's sampled frames, pixels and grid as transformers' ``Glm4vVideoProcessor`` makes them."""

    def __init__(self, settings: dict, vision: Any):
        settings = {"size": DEFAULT_SIZE, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "patch_size": 14,
                    **settings}
        self.sample = settings.pop("do_sample_frames", True) is not False
        self.fps = float(settings.get("fps") or 2)
        self.max_duration = float(settings.get("max_duration", 300))
        settings.pop("cap_pixels_per_frame", None)  # (not a GLM-4V setting: its processor ignores it)
        super().__init__(settings, vision)

    def indices(self, total: int, fps: float | None) -> np.ndarray:
        """The frames taken of ``total`` given at ``fps`` a second (transformers' ``sample_frames``; all of them
        where sampling is off or the rate is unknown)."""
        if not self.sample or not fps:
            return np.arange(total)
        last = total - 1
        duration = round(last / fps) + 1
        if duration <= self.max_duration:
            count = max(int(math.floor(duration * self.fps)), 1)
            taken = [min(last, int(math.ceil(i * fps / self.fps))) for i in range(count)]
        else:
            count = int(self.max_duration * self.fps)
            if count >= total:
                taken = list(range(total))
            else:
                taken = [min(last, int(math.ceil(s * fps))) for s in np.linspace(0, duration, count, endpoint=True)]
        unique = list(dict.fromkeys(taken))
        if len(unique) % 2:
            unique.append(unique[-1])
        return np.array(unique, dtype=int)

    def target(self, frames: int, height: int, width: int) -> tuple[int, int]:
        factor = self.patch * self.merge
        return smart_resize(frames, height, width, self.temporal, factor, self.min_pixels, self.max_pixels)

    def timestamps(self, indices: np.ndarray, fps: float | None, pairs: int) -> list[int]:
        """Each frame pair's time in whole seconds: its first frame's (index / rate), the last repeated where the
        pairs outnumber them (transformers' ``replace_video_token``)."""
        seconds = [int(i) / (fps or DEFAULT_FPS) for i in indices][::self.temporal][:pairs]
        seconds += (seconds[-1:] or [0]) * (pairs - len(seconds))
        return [int(s) for s in seconds]


def video_side(folder: Path, config: Any) -> dict:
    """:class:`~specray.models.glm4v.Glm4vImageProcessor`'s video members (none: videos refused by the seam; a
    release whose video settings are not served keeps its images, its videos refused with the reason)."""
    from transformers import AutoTokenizer

    from specray.models.qwen2_vl_vision import _field

    model_type = str(_field(config, "model_type", ""))
    token = _field(config, "video_token_id")
    if model_type not in VIDEO_MODEL_TYPES or token is None:
        return {}
    start, end = _field(config, "image_start_token_id"), _field(config, "image_end_token_id")
    try:
        if start is None or end is None:
            raise ValueError("the config lacks image_start_token_id / image_end_token_id (each frame pair's "
                             "<|begin_of_image|> and <|end_of_image|>); set them")
        video = Glm4vVideoFrames(video_settings(folder), _field(config, "vision_config") or {})
    except ValueError as err:
        logger.warning("videos are refused for %s: %s", folder, err)
        return {"video_token_id": int(token), "video_problem": str(err)}
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return {"video_token_id": int(token), "video": video,
            "frame_text": lambda seconds: tokenizer.encode(str(seconds), add_special_tokens=False),
            "frame_marks": (int(start), int(end))}


def process_video(processor, frames: list):
    """One video's frames -> its replacement (per frame pair: ``<|begin_of_image|>``, the pair's ``<|image|>``
    tokens, ``<|end_of_image|>``, its time's text), the rows taking embeddings, and its tensors."""
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
    for seconds in processor.video.timestamps(indices, fps, t):
        replacement.append(start)
        rows += range(len(replacement), len(replacement) + per_pair)
        replacement += [processor.image_token_id] * per_pair + [end] + processor.frame_text(seconds)
    assert len(rows) == t * per_pair
    return ProcessedImage(replacement, {"pixel_values_videos": pixels, "video_grid_thw": grid}, rows)
