"""Qwen2-VL's and Qwen2.5-VL's images (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``):
their vision towers with the patch merger that projects into the text model (:class:`Qwen2VLImageEncoder`,
:class:`Qwen2_5_VLImageEncoder`) and their host side (:class:`QwenVLImageProcessor`: transformers' image processor,
the placeholder's expansion and the prompt's multimodal RoPE positions), the two seams of :mod:`specray.multimodal`.
The text models are Qwen2's layers (``LlamaForCausalLM``), whose rotary tables take the three position ids per token
that :meth:`QwenVLImageProcessor.rope_positions` gives (``RotaryEmbedding.multimodal``, ``mrope_section``).

An image is resized to multiples of ``patch_size * spatial_merge_size`` pixels and cut into ``patch_size`` squares,
each repeated ``temporal_patch_size`` times (a still image is one frame pair): ``pixel_values`` [patches, C*T*P*P] in
merge-block order (the ``spatial_merge_size``² patches that merge into one token are consecutive) and
``image_grid_thw`` [1, 3] (frames, patch rows, patch columns). The tower embeds each patch (transformers' Conv3d of
stride = kernel, computed here as the linear it is), rotates q and k by a 2D RoPE (the first half of the frequencies
at the patch's row, the second at its column), and runs pre-norm blocks whose attention stays within the image
(within each frame); the merger norms each patch, concatenates each merge block's patches and projects them through
a GELU MLP into the text model's width: one embedding per placeholder token, ``t * h * w / merge²`` per image.

* Qwen2-VL: LayerNorm blocks, an ``fc1 -> act -> fc2`` MLP (QuickGELU), a LayerNorm in the merger.
* Qwen2.5-VL: RMSNorm blocks, a SwiGLU MLP with biases, an RMSNorm in the merger, and window attention: the merge
  blocks are put in order of ``window_size``-pixel windows (row-major windows, row-major blocks within each), every
  block but those of ``fullatt_block_indexes`` attends only within its window, and the merger's outputs are put back
  in the image's order.

Multimodal RoPE (transformers' ``get_rope_index``): text tokens take consecutive positions on all three axes; an
image's tokens take (its start, start + row, start + column) over its merged grid, where start is the position after
the text before it; the text after it continues from start + max(rows, columns). Tokens past the prompt take their
slot index plus ``max position + 1 - prompt length`` on every axis.

The encoder is replicated on every tensor-parallel rank; it reads its tensors under ``visual.`` (the releases') or
``model.visual.`` (transformers 5's modules). Videos: :mod:`specray.models.qwen2_vl_video`. Tensor shapes per
image come from its grid on the host (one ``tolist`` per image, outside the text model's steps)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import (LayerNorm, RMSNorm, _base_inv_freq, _param, apply_rotary, mrope_axes,
                                   rope_parameters, rotary_dim)
from specray.models.llama import _head_dim
from specray.models.vision_towers import Linear, copy_weights, vision_activation
from specray.multimodal import MultiModalItem, ProcessedImage

logger = logging.getLogger(__name__)
_OWN = re.compile(r"^(?:model\.)?visual\.(.+)$")  # the releases' names, and transformers 5's modules'
NORM_EPS = 1e-6  # the tower's and the merger's norms (fixed in transformers' modules)
VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # the releases whose videos QwenVLImageProcessor serves


def _field(config: Any, name: str, default: Any = None) -> Any:
    """``config.name`` of a config object or a dict (a PlainConfig's nested configs may be either)."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def vision_rope(grid: tuple[int, int, int], merge: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor,
                                                                                                       torch.Tensor]:
    """The tower's 2D RoPE for one image's patches in merge-block order: cos, sin [t*h*w, 1, head_dim / 2] (float32),
    the first half of the frequencies (head_dim / 4 of them) at the patch's row, the second at its column."""
    t, h, w = grid
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)
    blocks = (h // merge, merge, w // merge, merge)  # each merge block's patches consecutive
    rows, cols = (p.reshape(blocks).transpose(1, 2).flatten().repeat(t) for p in (rows, cols))
    inv_freq = _base_inv_freq(theta, head_dim // 2).to(device)  # [head_dim / 4]
    angles = torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)  # [N, head_dim / 2]
    return angles.cos()[:, None], angles.sin()[:, None]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention of each token within its segment (``lengths``: consecutive segments covering the
    tokens); q, k, v: [N, H, D] -> [N, H, D]. Segments of one length run as one batch."""
    if len(lengths) == 1:
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
    out = torch.empty_like(q)
    starts: dict[int, list[int]] = {}
    offset = 0
    for n in lengths:
        starts.setdefault(n, []).append(offset)
        offset += n
    for n, group in starts.items():
        index = (torch.tensor(group)[:, None] + torch.arange(n)).to(q.device)  # [G, n]
        qs, ks, vs = (x[index].transpose(1, 2) for x in (q, k, v))  # [G, H, n, D]
        out[index] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
    return out


class VisionAttention(nn.Module):
    """Multi-head self-attention over one image's patches (fused ``qkv`` and ``proj``, biases), q and k rotated by
    the tower's 2D RoPE in float32, each token attending within its segment."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads or (dim // heads) % 4:
            raise ValueError(f"the vision tower's width {dim} over vision_config.num_heads={heads} must give a head "
                             "size divisible by 4 (its 2D RoPE splits each head into row and column halves); the "
                             "checkpoint's vision config is inconsistent")
        self.heads, self.head_dim = heads, dim // heads
        self.qkv, self.proj = Linear(dim, 3 * dim), Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        # x: [N, dim] -> [N, dim]
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
        q, k = (apply_rotary(p.float(), *rope).to(x.dtype) for p in (q, k))
        return self.proj(segment_attention(q, k, v, lengths).reshape(x.shape[0], -1))


class GatedMLP(nn.Module):
    """Qwen2.5-VL's block MLP: ``down(act(gate(x)) * up(x))``, every projection with a bias."""

    def __init__(self, dim: int, hidden: int, act):
        super().__init__()
        self.gate_proj, self.up_proj = Linear(dim, hidden), Linear(dim, hidden)
        self.down_proj, self.act = Linear(hidden, dim), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    """Qwen2-VL's block MLP: ``fc2(act(fc1(x)))``."""

    def __init__(self, dim: int, hidden: int, act):
        super().__init__()
        self.fc1, self.fc2, self.act = Linear(dim, hidden), Linear(hidden, dim), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, dim: int, heads: int, norm: type[nn.Module], mlp: nn.Module):
        super().__init__()
        self.norm1, self.norm2 = norm(dim), norm(dim)
        self.attn, self.mlp = VisionAttention(dim, heads), mlp

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each patch normed (``ln_q``), each merge block's ``merge²`` patches concatenated, then ``Linear -> GELU ->
    Linear`` into the text model's width."""

    def __init__(self, dim: int, out: int, merge: int, norm: type[nn.Module]):
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = norm(dim)
        self.mlp = nn.Sequential(Linear(self.width, self.width), nn.GELU(), Linear(self.width, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, dim] (merge blocks consecutive) -> [N / merge², out]
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


def _layer_norm(dim: int) -> nn.Module:
    return LayerNorm(dim, NORM_EPS)


def _rms_norm(dim: int) -> nn.Module:
    return RMSNorm(dim, NORM_EPS)


def _check_text_rope(config: Any) -> None:
    """The text model's multimodal RoPE must be the sectioned kind its rotary tables build (``mrope_section``
    splitting a head's frequencies between the temporal, height and width positions, not interleaved)."""
    text = _field(config, "text_config") or config
    params = rope_parameters(text, partial=True)
    if params.get("mrope_interleaved"):  # (Qwen3-VL's; transformers' Qwen2-VL rotates contiguous sections)
        raise ValueError("rope_parameters.mrope_interleaved=True (Qwen3-VL's interleaved sections) is not supported "
                         "by Qwen2-VL's text model, which rotates contiguous mrope_section sections; remove it")
    mrope_axes(params, rotary_dim(_head_dim(text), params))  # a ValueError naming the field where it cannot


class Qwen2VLImageEncoder(nn.Module):
    """Qwen2-VL's vision tower and patch merger, built from the whole checkpoint's config (replicated on every
    rank); :meth:`encode` gives one image's embeddings [t*h*w / merge², text hidden size]."""

    norm = staticmethod(_layer_norm)  # the blocks' and the merger's norm (Qwen2.5-VL: RMSNorm)
    check_text_rope = staticmethod(_check_text_rope)  # (a release whose text model takes plain positions: none)

    def __init__(self, config: Any):
        super().__init__()
        vision = self._geometry(config, "Qwen2-VL / Qwen2.5-VL", 14, ("axial", "default"))
        self.check_text_rope(config)
        dim, heads, out, act = self._sizes(vision)
        self.dim, self.heads = dim, heads
        self.patch_embed = nn.Module()  # transformers' Conv3d (stride = kernel), applied as the linear it is
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight = _param(dim, self.in_channels, self.temporal_patch_size, self.patch_size,
                                              self.patch_size)
        depth = _field(vision, "depth")
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, self.norm, self._mlp(vision, dim, act))
                                    for _ in range(depth))
        self.merger = PatchMerger(dim, out, self.merge, self.norm)

    def _geometry(self, config: Any, release: str, patch: int, rope_kinds: tuple[str, ...]) -> Any:
        """Read the vision config's patches, merge size and 2D RoPE (``rope_kinds``: the rope types taken as the
        axial one; ``patch``: the patch size where the config has none); returns the vision config."""
        vision = _field(config, "vision_config")
        if vision is None:
            raise ValueError(f"the checkpoint's config has no vision_config; it is not a {release} release")
        self.patch_size = _field(vision, "patch_size", patch)
        self.temporal_patch_size = _field(vision, "temporal_patch_size", 2)
        self.in_channels = _field(vision, "in_channels", 3)
        self.merge = _field(vision, "spatial_merge_size", 2)
        rope = _field(vision, "rope_parameters") or {}
        kind = rope.get("rope_type", "axial")
        if kind not in rope_kinds:
            raise ValueError(f"vision_config.rope_parameters.rope_type={kind!r} is not supported; {release}'s vision "
                             "tower rotates by the axial 2D RoPE ('axial') only")
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        return vision

    def _sizes(self, vision: Any) -> tuple[int, int, int, Any]:
        """(tower width, heads, output width, the MLP's activation) from Qwen2-VL's vision config."""
        act = vision_activation(_field(vision, "hidden_act", "quick_gelu"), "vision_config.hidden_act")
        return _field(vision, "embed_dim"), _field(vision, "num_heads"), _field(vision, "hidden_size"), act

    def _mlp(self, vision: Any, dim: int, act) -> nn.Module:
        return PlainMLP(dim, int(dim * _field(vision, "mlp_ratio", 4)), act)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy the tower's and the merger's tensors (``visual.*`` or ``model.visual.*``) among ``weights``; a
        ValueError names any of its own tensors that did not come."""
        missing = copy_weights(dict(self.named_parameters()),
                               ((m.group(1), t) for name, t in weights if (m := _OWN.match(name)) is not None))
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of the vision tower: "
                             f"{['visual.' + n for n in missing[:6]]}; it does not match its config.json's "
                             "vision_config")

    def _layout(self, grid: tuple[int, int, int], device) -> tuple[torch.Tensor | None, list[int], list[int]]:
        """(the merge blocks' order the blocks run in, or None for the image's; the full-attention segments' lengths
        in patches; the windowed blocks' segments): here every block attends within each frame."""
        t, h, w = grid
        return None, [h * w] * t, [h * w] * t

    def _grid(self, data: dict[str, Any]) -> tuple[int, int, int]:
        """The image's (frames, patch rows, patch columns), checked against its pixels (one host read per image)."""
        pixels = data["pixel_values"]
        grid = tuple(int(g) for g in torch.as_tensor(data["image_grid_thw"]).reshape(-1).tolist())
        t, h, w = grid if len(grid) == 3 else (0, 0, 0)
        if len(grid) != 3 or h % self.merge or w % self.merge or tuple(pixels.shape) != (t * h * w, self.patch_dim):
            raise ValueError(f"an image of pixel_values {tuple(pixels.shape)} and image_grid_thw {grid} does not fit "
                             f"this vision tower ({self.patch_dim} values per patch, rows and columns multiples of "
                             f"spatial_merge_size={self.merge}); process images with the checkpoint's own image "
                             "processor")
        return grid

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's ``pixel_values`` [t*h*w, C*T*P*P] and ``image_grid_thw`` [1, 3] -> [t*h*w / merge², out]; a
        video's ``pixel_values_videos`` and ``video_grid_thw`` run through the same tower (its frame pairs)."""
        if "pixel_values_videos" in data:
            data = {"pixel_values": data["pixel_values_videos"], "image_grid_thw": data["video_grid_thw"]}
        pixels, grid = data["pixel_values"], self._grid(data)
        weight = self.patch_embed.proj.weight
        x = F.linear(pixels.to(weight.dtype), weight.reshape(self.dim, -1))  # [N, dim]
        cos, sin = vision_rope(grid, self.merge, self.dim // self.heads, self.rope_theta, x.device)
        order, full, windows = self._layout(grid, x.device)
        unit = self.merge * self.merge
        if order is not None:  # the merge blocks (and their patches' rotations) in window order
            x, cos, sin = (p.reshape(-1, unit, *p.shape[1:])[order].flatten(0, 1) for p in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            x = block(x, (cos, sin), full if self._full(i) else windows)
        out = self.merger(x)
        if order is not None:  # back in the image's order
            out = torch.empty_like(out).index_copy_(0, order, out)
        return out

    def _full(self, block: int) -> bool:
        return True


class Qwen2_5_VLImageEncoder(Qwen2VLImageEncoder):
    """Qwen2.5-VL's vision tower and merger: RMSNorms, SwiGLU MLPs with biases, window attention in every block but
    ``fullatt_block_indexes``."""

    norm = staticmethod(_rms_norm)

    def __init__(self, config: Any):
        vision = _field(config, "vision_config")
        super().__init__(config)
        self.full_blocks = set(_field(vision, "fullatt_block_indexes", ()))
        window = _field(vision, "window_size", 112)
        self.window = window // self.merge // self.patch_size  # merge blocks along a window's side
        if self.window < 1:
            raise ValueError(f"vision_config.window_size={window} is narrower than one merge block (spatial_merge_size"
                             f" * patch_size = {self.merge * self.patch_size} pixels); the config is inconsistent")
        bad = sorted(i for i in self.full_blocks if not 0 <= i < len(self.blocks))
        if bad:
            raise ValueError(f"vision_config.fullatt_block_indexes names blocks {bad} outside the tower's "
                             f"depth={len(self.blocks)}; the config is inconsistent")

    def _sizes(self, vision: Any) -> tuple[int, int, int, Any]:
        act = vision_activation(_field(vision, "hidden_act", "silu"), "vision_config.hidden_act")
        return _field(vision, "hidden_size"), _field(vision, "num_heads"), _field(vision, "out_hidden_size"), act

    def _mlp(self, vision: Any, dim: int, act) -> nn.Module:
        return GatedMLP(dim, _field(vision, "intermediate_size"), act)

    def _full(self, block: int) -> bool:
        return block in self.full_blocks

    def _layout(self, grid: tuple[int, int, int], device) -> tuple[torch.Tensor | None, list[int], list[int]]:
        """The merge blocks in window order (windows of ``window`` x ``window`` blocks, row-major over the image, the
        last row and column of windows cut short; row-major blocks within each), each window a segment."""
        t, h, w = grid
        rows, cols, win = h // self.merge, w // self.merge, self.window
        frame = torch.arange(t)[:, None, None]
        row = torch.arange(rows)[None, :, None]
        col = torch.arange(cols)[None, None, :]
        across = -(-cols // win)  # windows per row of windows
        window = (frame * -(-rows // win) + row // win) * across + col // win  # [t, rows, cols]
        key = (window * rows * cols + row * cols + col).flatten()
        order = key.argsort()
        sizes = torch.bincount(window.flatten()).tolist()
        unit = self.merge * self.merge
        return order.to(device), [h * w] * t, [n * unit for n in sizes if n]


class QwenVLImageProcessor:
    """Qwen2-VL's and Qwen2.5-VL's host side: transformers' image processor of the checkpoint (resizing, patches in
    merge-block order), the placeholder (``<|image_pad|>``, the config's ``image_token_id``) repeated once per token
    the merger gives, and the prompt's multimodal RoPE positions."""

    def __init__(self, image_processor: Any, image_token_id: int, merge: int, video_token_id: int | None = None,
                 video: Any = None, tokens_per_second: float | None = None, video_problem: str | None = None):
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.merge = merge
        # videos (specray.models.qwen2_vl_video): the <|video_pad|> placeholder, the frames' processor, Qwen2.5-VL's
        # temporal spacing (None: Qwen2-VL's frame-pair index), why videos are refused (None: they are served)
        self.video_token_id = video_token_id
        self.video, self.tokens_per_second, self.video_problem = video, tokens_per_second, video_problem

    def process_video(self, frames: list) -> ProcessedImage:
        """One video's frames (RGB PIL images of one size) -> its ``<|video_pad|>`` tokens and tensors
        (``pixel_values_videos``, ``video_grid_thw``, and Qwen2.5-VL's ``second_per_grid_ts``: the frames' own rate
        where known, a file's (``multimodal.VideoFrames.fps``), else transformers' default for frames alone)."""
        from specray.models.qwen2_vl_video import DEFAULT_FPS

        if self.video_problem is not None:
            raise ValueError(self.video_problem)
        pixels, grid = self.video.pixels(frames)
        data = {"pixel_values_videos": pixels, "video_grid_thw": grid}
        if self.tokens_per_second is not None:
            fps = getattr(frames, "fps", None) or DEFAULT_FPS
            data["second_per_grid_ts"] = np.array([self.video.temporal / fps], dtype=np.float32)
        return ProcessedImage([self.video_token_id] * (int(grid.prod()) // (self.merge * self.merge)), data)

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> QwenVLImageProcessor:
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(str(folder))
        vision = _field(config, "vision_config") or {}
        for ours, theirs, default in (("merge_size", "spatial_merge_size", 2), ("patch_size", "patch_size", 14),
                                      ("temporal_patch_size", "temporal_patch_size", 2)):
            mine, tower = getattr(image_processor, ours, None), _field(vision, theirs, default)
            if mine != tower:
                raise ValueError(f"the image processor's {ours}={mine} differs from vision_config.{theirs}={tower}; "
                                 "the checkpoint's preprocessor_config.json does not match its config.json")
        token = _field(config, "image_token_id")
        if token is None:
            raise ValueError("the checkpoint's config has no image_token_id (the <|image_pad|> token's id); set it")
        return cls(image_processor, int(token), int(image_processor.merge_size), **cls._video_side(folder, config))

    @staticmethod
    def _video_side(folder: Path, config: Any) -> dict:
        """The video members' arguments (none: videos are not taken); a release whose video settings are not served
        keeps its images, and its videos are refused with the reason."""
        from specray.models.qwen2_vl_video import QwenVLVideoFrames, video_settings

        model_type = str(_field(config, "model_type", ""))
        token = _field(config, "video_token_id")
        if model_type not in VIDEO_MODEL_TYPES or token is None:  # (a family built on this processor, or no
            return {}                                                # <|video_pad|> id: videos refused by the seam)
        vision = _field(config, "vision_config") or {}
        qwen2_5 = model_type == "qwen2_5_vl"  # (Qwen2.5-VL spaces frames by time)
        try:
            video = QwenVLVideoFrames(video_settings(folder), vision)
        except ValueError as err:
            logger.warning("videos are refused for %s: %s", folder, err)
            return {"video_token_id": int(token), "video_problem": str(err)}
        return {"video_token_id": int(token), "video": video,
                "tokens_per_second": _field(vision, "tokens_per_second", 4) if qwen2_5 else None}

    def process(self, image: Any) -> ProcessedImage:
        out = self.image_processor(images=[image], return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        grid = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(1, 3)
        tokens = int(grid.prod()) // (self.merge * self.merge)
        return ProcessedImage([self.image_token_id] * tokens, {"pixel_values": pixels, "image_grid_thw": grid})

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> tuple[list[list[int]], int]:
        """transformers' ``get_rope_index`` for a prompt with images: ([temporal, height, width] position lists, each
        as long as ``token_ids``; the delta the tokens past the prompt add to their slot index)."""
        axes: list[list[int]] = [[], [], []]
        position = done = 0
        for item in sorted(items, key=lambda it: it.offset):
            text = item.offset - done
            for axis in axes:
                axis.extend(range(position, position + text))
            position += text
            video = "video_grid_thw" in item.data
            t, h, w = (int(g) for g in np.asarray(item.data["video_grid_thw" if video else "image_grid_thw"]).ravel())
            rows, cols = h // self.merge, w // self.merge
            if t * rows * cols != item.length:
                raise ValueError(f"an image's span of {item.length} tokens does not match its grid {[t, h, w]} "
                                 f"(t * h * w / {self.merge}² tokens)")
            grid = np.indices((t, rows, cols)).reshape(3, -1)
            if video:  # a video's temporal index (Qwen2.5-VL: spaced by time)
                from specray.models.qwen2_vl_video import temporal_indices

                grid[0] = temporal_indices(t, item.data, self.tokens_per_second)[grid[0]]
            for axis, values in zip(axes, grid):
                axis.extend((values + position).tolist())
            position += max(rows, cols)
            done = item.end
        for axis in axes:
            axis.extend(range(position, position + len(token_ids) - done))
        # later tokens continue from the last one's position, as transformers' generate does (with images alone its
        # largest; a video's temporal positions may pass it: transformers' text after a video continues from start +
        # max(rows, columns))
        top = max(axis[-1] for axis in axes) if token_ids else -1
        return axes, top + 1 - len(token_ids)
