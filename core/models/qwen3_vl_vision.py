"""Qwen3-VL's and Qwen3-VL-MoE's images (``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``):
their vision tower with the patch merger and the DeepStack mergers (:class:`Qwen3VLImageEncoder`), the seam of
:mod:`specray.multimodal` whose host side is Qwen2-VL's (:class:`~specray.models.qwen2_vl_vision.QwenVLImageProcessor`:
transformers' image processor, ``<|image_pad|>`` repeated once per merged token between the prompt's
``<|vision_start|>`` and ``<|vision_end|>``, and the same multimodal RoPE positions, which for a still image are
transformers' Qwen3-VL ``get_rope_index``'s). The text models are Qwen3 and Qwen3-MoE layers (``LlamaForCausalLM``),
whose rotary tables interleave the axes (``mrope_interleaved``: ``layers.mrope_axes``) and whose stack adds the
DeepStack features (``llama.add_deepstack``).

The tower, as Qwen2-VL's (patches in merge-block order, 2D RoPE of the patch's row and column, pre-norm blocks
attending within each frame, :mod:`specray.models.qwen2_vl_vision`'s attention), with:

* a patch embedding with a bias, to which a learned position embedding is added: a square table of
  ``num_position_embeddings`` entries resampled to the image's patch grid bilinearly with aligned corners (each
  patch's four taps and weights as transformers' ``get_vision_interpolation_indices_and_weights`` computes them, in
  float32, the last row and column clamped with weight 0);
* LayerNorm blocks with a ``linear_fc1 -> act -> linear_fc2`` MLP (``hidden_act``, GELU-tanh in the releases);
* the merger: LayerNorm per patch, the ``merge²`` patches of a block concatenated, ``Linear -> GELU -> Linear``;
* DeepStack: after each block of ``deepstack_visual_indexes`` a merger of its own (the list's n-th block the n-th
  merger; its LayerNorm over the concatenated block, "post-shuffle") gives features the text model adds to the image
  rows' hidden states after its layer j: the j-th such block's in block order, whatever the list's order (as
  transformers collects them). :meth:`Qwen3VLImageEncoder.encode` returns [1 + k, tokens, text hidden]: the input
  embeddings, then the k layers' features (the runner hands them to the model as ``meta.deepstack_embeds``). DeepStack
  layers must lie on the first pipeline stage, the one that takes the image rows in
  (:meth:`Qwen3VLImageEncoder.check_split` refuses other splits before any rank starts; a step missing one refuses).

The encoder is replicated on every tensor-parallel rank and reads its tensors under ``model.visual.`` (the releases'
and transformers 5's names) or ``visual.``. Videos: :mod:`specray.models.qwen3_vl_video` (the same
tower over ``pixel_values_videos`` / ``video_grid_thw``, DeepStack features included)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import _param, mrope_axes, rope_parameters, rotary_dim
from specray.models.llama import _head_dim
from specray.models.qwen2_vl_vision import (Qwen2VLImageEncoder, QwenVLImageProcessor, VisionBlock, _field,
                                            _layer_norm, vision_rope)
from specray.models.vision_towers import Linear, vision_activation
from specray.models import qwen3_vl_video
from specray.parallel import stage_layers


def merge_order(grid: tuple[int, int, int], merge: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column) of one image in merge-block order (a block's ``merge²`` patches consecutive,
    frames after each other): two [t*h*w] int64 tensors."""
    t, h, w = grid
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)
    blocks = (h // merge, merge, w // merge, merge)
    return tuple(p.reshape(blocks).transpose(1, 2).flatten().repeat(t) for p in (rows, cols))


def _taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear resampling with aligned corners of a ``side``-long axis to ``size`` entries: for each target
    ``index`` [N] its two source taps [N, 2] (the second clamped to the table) and their float32 weights [N, 2]."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(grid: tuple[int, int, int], merge: int, side: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The learned position table's four taps [t*h*w, 4] (entries of the ``side`` x ``side`` table) and their weights
    [t*h*w, 4] (float32) per patch of one image in merge-block order."""
    _, h, w = grid
    rows, cols = merge_order(grid, merge, device)
    (row_taps, row_weights), (col_taps, col_weights) = _taps(rows, h, side), _taps(cols, w, side)
    taps = (row_taps[:, :, None] * side + col_taps[:, None, :]).flatten(1)
    return taps, (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)


class Qwen3VLMerger(nn.Module):
    """A merge block's ``merge²`` patches normed and concatenated, then ``Linear -> GELU -> Linear`` into the text
    model's width; ``post_shuffle`` (the DeepStack mergers): the LayerNorm over the concatenated block, else per
    patch before it."""

    def __init__(self, dim: int, out: int, merge: int, post_shuffle: bool):
        super().__init__()
        self.width, self.post_shuffle = dim * merge * merge, post_shuffle
        self.norm = _layer_norm(self.width if post_shuffle else dim)
        self.linear_fc1, self.linear_fc2 = Linear(self.width, self.width), Linear(self.width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, dim] (merge blocks consecutive) -> [N / merge², out]
        x = self.norm(x.reshape(-1, self.width)) if self.post_shuffle else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VLMLP(nn.Module):
    """The blocks' MLP: ``linear_fc2(act(linear_fc1(x)))``, biases on both."""

    def __init__(self, dim: int, hidden: int, act):
        super().__init__()
        self.linear_fc1, self.linear_fc2, self.act = Linear(dim, hidden), Linear(hidden, dim), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def _check_text_rope(config: Any, release: str = "Qwen3-VL") -> None:
    """Qwen3-VL's text model (and Qwen3.5's) rotates interleaved sections (transformers' ignores the flag and always
    interleaves): the config must say so, and its sections must split a head's (rotated) frequencies."""
    text = _field(config, "text_config") or config
    params = rope_parameters(text, partial=True)
    if not params.get("mrope_interleaved"):
        raise ValueError(f"text_config.rope_parameters.mrope_interleaved={params.get('mrope_interleaved')!r}: "
                         f"{release}'s text model interleaves the multimodal RoPE sections (transformers does whatever "
                         "the flag says); set mrope_interleaved: true as the releases' config.json do")
    mrope_axes(params, rotary_dim(_head_dim(text), params))  # a ValueError naming the field where it cannot


class Qwen3VLImageEncoder(Qwen2VLImageEncoder):
    """Qwen3-VL's vision tower, patch merger and DeepStack mergers, built from the whole checkpoint's config
    (replicated on every rank); :meth:`encode` gives one image's [1 + k, t*h*w / merge², text hidden size]."""

    deepstack_layers = 0  # set per config: len(vision_config.deepstack_visual_indexes)
    release = "Qwen3-VL"  # the name its refusals give (a subclass serving another release's tower names that)
    check_text_rope = staticmethod(_check_text_rope)  # (config, release): a release whose text model differs: its own

    def __init__(self, config: Any):
        nn.Module.__init__(self)  # its own modules (the parent's constructor builds Qwen2-VL's); its loader is reused
        vision = self._geometry(config, self.release, 16, ("axial",))
        self.check_text_rope(config, self.release)
        dim, heads, out = _field(vision, "hidden_size"), _field(vision, "num_heads"), _field(vision, "out_hidden_size")
        act = vision_activation(_field(vision, "hidden_act", "gelu_pytorch_tanh"), "vision_config.hidden_act")
        self.dim, self.heads = dim, heads
        positions = _field(vision, "num_position_embeddings")
        self.side = int(positions ** 0.5)
        if self.side * self.side != positions:
            raise ValueError(f"vision_config.num_position_embeddings={positions} is not a square; the learned "
                             "position table is a square grid resampled to each image (the config is inconsistent)")
        depth = _field(vision, "depth")
        self.deepstack = list(_field(vision, "deepstack_visual_indexes", ()) or ())
        bad = sorted(i for i in self.deepstack if not 0 <= i < depth)
        if bad or len(set(self.deepstack)) != len(self.deepstack):
            raise ValueError(f"vision_config.deepstack_visual_indexes={self.deepstack} must name distinct blocks of "
                             f"the tower's depth={depth}; the config is inconsistent")
        self.deepstack_layers = len(self.deepstack)
        self.patch_embed = nn.Module()  # transformers' Conv3d (stride = kernel), applied as the linear it is
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight = _param(dim, self.in_channels, self.temporal_patch_size, self.patch_size,
                                              self.patch_size)
        self.patch_embed.proj.bias = _param(dim)
        self.pos_embed = nn.Module()
        self.pos_embed.weight = _param(positions, dim)
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, _layer_norm,
                                                Qwen3VLMLP(dim, _field(vision, "intermediate_size"), act))
                                    for _ in range(depth))
        self.merger = Qwen3VLMerger(dim, out, self.merge, post_shuffle=False)
        self.deepstack_merger_list = nn.ModuleList(Qwen3VLMerger(dim, out, self.merge, post_shuffle=True)
                                                   for _ in self.deepstack)

    @staticmethod
    def check_split(config: Any, tp: int, pp: int) -> None:
        """Before any rank starts: the DeepStack layers must lie on the first pipeline stage, the one that takes the
        image rows in (each rank holds the encoder whole, so ``tp`` is free)."""
        layers = len(_field(_field(config, "vision_config") or {}, "deepstack_visual_indexes", ()) or ())
        text = _field(config, "text_config") or config
        first = len(stage_layers(_field(text, "num_hidden_layers"), 0, pp))
        if layers > first:
            raise ValueError(f"pipeline_parallel_size={pp} leaves {first} of the text model's layers on the first "
                             f"stage, but DeepStack adds image features after its first {layers} "
                             f"(len(vision_config.deepstack_visual_indexes)), which only the first stage receives: "
                             "use a smaller pipeline_parallel_size, or limit_mm_per_prompt={'image': 0} for text only")

    def position_embeddings(self, grid: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
        """The learned position table resampled to one image's patches in merge-block order: [t*h*w, dim]."""
        taps, weights = position_taps(grid, self.merge, self.side, self.pos_embed.weight.device)
        return (self.pos_embed.weight[taps] * weights[:, :, None]).sum(1).to(dtype)

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's ``pixel_values`` [t*h*w, C*T*P*P] and ``image_grid_thw`` [1, 3] -> [1 + k, t*h*w / merge²,
        out] (the input embeddings, then the DeepStack features of the k layers; [t*h*w / merge², out] for k = 0)."""
        if "pixel_values_videos" in data:  # a video: its frame pairs through the same tower (get_video_features)
            data = {"pixel_values": data["pixel_values_videos"], "image_grid_thw": data["video_grid_thw"]}
        grid = self._grid(data)
        proj = self.patch_embed.proj
        x = F.linear(data["pixel_values"].to(proj.weight.dtype), proj.weight.reshape(self.dim, -1), proj.bias)
        x = x + self.position_embeddings(grid, x.dtype)
        rope = vision_rope(grid, self.merge, self.dim // self.heads, self.rope_theta, x.device)
        t, h, w = grid
        frames = [h * w] * t
        features = []  # in block order (text layer j takes the j-th), each through the merger its index names
        for i, block in enumerate(self.blocks):
            x = block(x, rope, frames)
            if i in self.deepstack:
                features.append(self.deepstack_merger_list[self.deepstack.index(i)](x))
        out = self.merger(x)
        return torch.stack([out, *features]) if features else out


class Qwen3VLImageProcessor(QwenVLImageProcessor):
    """Qwen3-VL's host side: Qwen2-VL's (transformers' image processor of the checkpoint, ``<|image_pad|>`` once
    per merged token, the same multimodal RoPE positions for still images, one frame each)."""

    def __init__(self, *args, frame_text=None, frame_marks=None, **kwargs):
        super().__init__(*args, **kwargs)
        # videos (specray.models.qwen3_vl_video): a frame pair's time -> its text tokens; the pair's start / end ids
        self.frame_text, self.frame_marks = frame_text, frame_marks

    _video_side = staticmethod(qwen3_vl_video.video_side)

    def process_video(self, frames: list):
        """One video's frames -> per frame pair its time's text, ``<|vision_start|>``, ``<|video_pad|>`` tokens,
        ``<|vision_end|>`` (:func:`specray.models.qwen3_vl_video.process_video`)."""
        return qwen3_vl_video.process_video(self, frames)

    def rope_positions(self, token_ids: list[int], items: list) -> tuple[list[list[int]], int]:
        return qwen3_vl_video.rope_positions(self, token_ids, items)
