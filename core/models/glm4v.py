"""Zhipu AI's vision-language GLM-4.1V (``Glm4vForConditionalGeneration``: GLM-4.1V-9B-Thinking / -Base) and GLM-4.5V
(``Glm4vMoeForConditionalGeneration``): their text models on GLM-4's and GLM-4.5's classes, and their images through
the seam of :mod:`specray.multimodal` (:class:`Glm4vImageEncoder`, :class:`Glm4vImageProcessor`).

Text. GLM-4.1V's text model (``glm4v_text``) is GLM-4's dense layer (:mod:`specray.models.glm4`: the sandwich of norms,
q/k/v biases and none on o, the fused ``gate_up_proj``, the first ``partial_rotary_factor`` of each head rotated on
interleaved pairs); GLM-4.5V's (``glm4v_moe_text``) is GLM-4.5's (:mod:`specray.models.glm4_moe`: q/k/v biases,
partial RoPE on the two halves of the rotated part, DeepSeek-V3's experts after ``first_k_dense_replace`` dense
layers; its releases' MTP layer is skipped). Both are built from a view of the text config whose model type is their
family's (:func:`specray.models.aliases.served_as`), so each family's switches apply unchanged. Their only addition
is multimodal RoPE: the rotated frequencies of a head split by ``mrope_section`` (in order, contiguous: temporal,
height, width; transformers' default ``[8, 12, 12]`` where the config gives none) each take the position of their
axis, which ``RotaryEmbedding.multimodal`` does from ``meta.rope_positions`` (``layers.mrope_axes``); GLM-4.1V then
rotates interleaved pairs (frequency j turning features 2j and 2j + 1), GLM-4.5V halves, exactly as their text
families do. A text-only prompt has three equal position ids, so it runs as plain RoPE.

Images. :class:`Glm4vImageProcessor` is Qwen2-VL's host side
(:class:`~specray.models.qwen2_vl_vision.QwenVLImageProcessor`): the checkpoint's transformers image processor (patches
in merge-block order, ``image_grid_thw``), the ``<|image|>`` placeholder (the config's ``image_token_id``, which the
chat template renders between ``<|begin_of_image|>`` and ``<|end_of_image|>``) repeated ``t*h*w / merge²`` times, and
the same multimodal positions: transformers' GLM-4V ``get_rope_index`` for a still image (one frame) is Qwen2-VL's (the
image's tokens at start + (0, row, column) of its merged grid, the text after it from start + max(rows, columns)).

:class:`Glm4vImageEncoder` is transformers' ``Glm4vVisionModel`` for one image: the Conv3d patch embedding (with a
bias) as the linear it is, an RMSNorm (``post_conv_layernorm``), then the learned position table (a square of
``(image_size / patch_size)²`` entries) resampled to the image's patch grid by bicubic ``grid_sample`` at the patch
centres (border padding, unaligned corners, float32) and added; RMSNorm pre-norm blocks (Qwen2-VL's attention
within the frame with the same 2D RoPE, fused ``qkv`` biased where ``attention_bias``, a bias-free ``proj``; a
bias-free SwiGLU MLP whose width is ``out_hidden_size``), ``post_layernorm``, the ``downsample`` Conv2d over each
merge block (``merge x merge`` patches into one token of ``out_hidden_size``) and the merger (``proj`` -> LayerNorm
-> GELU -> a bias-free gated MLP of ``intermediate_size``). It reads its tensors under ``model.visual.`` or
``visual.``, is replicated on every tensor-parallel rank, and sets ``deepstack_layers = 0``. Videos:
:mod:`specray.models.glm4v_video` (the same tower over ``pixel_values_videos`` / ``video_grid_thw``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models import glm4v_video
from specray.models.aliases import served_as
from specray.models.glm4 import Glm4ForCausalLM
from specray.models.glm4_moe import Glm4MoeForCausalLM
from specray.models.layers import (LayerNorm, RMSNorm, _param, mrope_axes, rope_parameters, rope_per_kind,
                                   rotary_dim)
from specray.models.llama import _head_dim
from specray.models.qwen2_vl_vision import (GatedMLP, Qwen2VLImageEncoder, QwenVLImageProcessor, VisionBlock, _field,
                                            vision_rope)
from specray.models.qwen3_vl_vision import merge_order
from specray.models.vision_towers import Linear, vision_activation
from specray.parallel import PPGroup, TPGroup

DEFAULT_MROPE_SECTION = [8, 12, 12]  # transformers' GLM-4V text rotary where rope_parameters names none


def text_view(config: Any, family: str) -> Any:
    """The GLM-4V text config as its family's (``family``: ``glm4`` or ``glm4_moe``), with the checks transformers'
    GLM-4V text model implies: a head of ``hidden_size / num_attention_heads`` (GLM-4.1V's attention ignores any
    other ``head_dim``) and ``mrope_section`` defaulted as transformers does."""
    view = served_as(config, family)
    params = dict(getattr(view, "rope_parameters", None) or {})
    per_kind = rope_per_kind(params)  # (refused by rope_parameters)
    if not per_kind and "mrope_section" not in params:
        params["mrope_section"] = list(DEFAULT_MROPE_SECTION)
        view.rope_parameters = params
    if family == "glm4":
        width = view.hidden_size // view.num_attention_heads
        if getattr(view, "head_dim", None) not in (None, width):
            raise ValueError(f"text_config.head_dim={view.head_dim} differs from hidden_size / num_attention_heads = "
                             f"{width}: transformers' GLM-4.1V attention uses the latter; remove head_dim")
    params = rope_parameters(view, partial=True)
    if params.get("mrope_interleaved"):
        raise ValueError("text_config.rope_parameters.mrope_interleaved=True is not supported: GLM-4V's text model "
                         "rotates contiguous mrope_section sections; remove it")
    mrope_axes(params, rotary_dim(_head_dim(view), params))  # a ValueError naming the field where it cannot
    return view


class Glm4vTextForCausalLM(Glm4ForCausalLM):
    """GLM-4.1V's text model: GLM-4's class on a view of its config (module docstring)."""

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(text_view(hf_config, "glm4"), tp, expert_parallel, pp)


class Glm4vMoeTextForCausalLM(Glm4MoeForCausalLM):
    """GLM-4.5V's text model: GLM-4.5's class on a view of its config (module docstring)."""

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(text_view(hf_config, "glm4_moe"), tp, expert_parallel, pp)


class Glm4vMLP(GatedMLP):
    """The blocks' and the merger's gated MLP: ``down(act(gate(x)) * up(x))``, no biases."""

    def __init__(self, dim: int, hidden: int, act):
        nn.Module.__init__(self)
        self.gate_proj, self.up_proj = Linear(dim, hidden, bias=False), Linear(dim, hidden, bias=False)
        self.down_proj, self.act = Linear(hidden, dim, bias=False), act


class Glm4vMerger(Glm4vMLP):
    """``proj`` (no bias) -> LayerNorm -> GELU -> the gated MLP, per merged token."""

    def __init__(self, dim: int, hidden: int, act):
        super().__init__(dim, hidden, act)
        self.proj = Linear(dim, dim, bias=False)
        self.post_projection_norm = LayerNorm(dim, 1e-5)  # (transformers' nn.LayerNorm default)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.gelu(self.post_projection_norm(self.proj(x))))


class Glm4vImageEncoder(Qwen2VLImageEncoder):
    """GLM-4.1V's / GLM-4.5V's vision tower, downsample and merger, built from the whole checkpoint's config
    (replicated on every rank); :meth:`encode` gives one image's embeddings [t*h*w / merge², text hidden size]."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        nn.Module.__init__(self)  # its own modules (the parent's constructor builds Qwen2-VL's); its loader is reused
        vision = self._geometry(config, "GLM-4.1V / GLM-4.5V", 14, ("axial",))
        text = _field(config, "text_config")
        family = "glm4_moe" if _field(text, "model_type") == "glm4v_moe_text" else "glm4"
        text_view(text, family)  # the text model's multimodal RoPE must be buildable
        dim, heads, out = _field(vision, "hidden_size"), _field(vision, "num_heads"), _field(vision, "out_hidden_size")
        act = vision_activation(_field(vision, "hidden_act", "silu"), "vision_config.hidden_act")
        if out != _field(text, "hidden_size"):
            raise ValueError(f"vision_config.out_hidden_size={out} differs from text_config.hidden_size="
                             f"{_field(text, 'hidden_size')}: the image embeddings replace token embeddings; the "
                             "checkpoint's config is inconsistent")
        self.dim, self.heads = dim, heads
        image, patch = _field(vision, "image_size", 336), self.patch_size
        if not isinstance(image, int) or not isinstance(patch, int) or image % patch:
            raise ValueError(f"vision_config.image_size={image!r} must be a whole number of patch_size={patch!r} "
                             "(one int each: the learned position table is that square grid)")
        self.side = image // patch
        eps = float(_field(vision, "rms_norm_eps", 1e-5))
        self.patch_embed = nn.Module()  # transformers' Conv3d (stride = kernel), applied as the linear it is
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight = _param(dim, self.in_channels, self.temporal_patch_size, patch, patch)
        self.patch_embed.proj.bias = _param(dim)
        self.post_conv_layernorm = RMSNorm(dim, eps)
        self.embeddings = nn.Module()
        self.embeddings.position_embedding = nn.Module()
        self.embeddings.position_embedding.weight = _param(self.side * self.side, dim)
        self.blocks = nn.ModuleList(self._block(dim, heads, eps, out, act, bool(_field(vision, "attention_bias")))
                                    for _ in range(_field(vision, "depth")))
        self.post_layernorm = RMSNorm(dim, eps)
        self.downsample = nn.Module()  # Conv2d over each merge block (kernel = stride = merge)
        self.downsample.weight = _param(out, dim, self.merge, self.merge)
        self.downsample.bias = _param(out)
        self.merger = Glm4vMerger(out, _field(vision, "intermediate_size"), act)

    @staticmethod
    def _block(dim: int, heads: int, eps: float, mlp_width: int, act, qkv_bias: bool) -> VisionBlock:
        """Qwen2-VL's block with GLM's parts: RMSNorms at the config's eps, ``qkv`` biased where ``attention_bias``,
        ``proj`` without a bias, the bias-free gated MLP."""
        block = VisionBlock(dim, heads, lambda d: RMSNorm(d, eps), Glm4vMLP(dim, mlp_width, act))
        block.attn.qkv, block.attn.proj = Linear(dim, 3 * dim, bias=qkv_bias), Linear(dim, dim, bias=False)
        return block

    def position_embeddings(self, grid: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
        """The learned position table resampled (bicubic, at patch centres, border padding) to one image's patches
        in merge-block order: [t*h*w, dim]."""
        weight = self.embeddings.position_embedding.weight
        table = weight.view(self.side, self.side, self.dim).permute(2, 0, 1)[None].float()  # [1, dim, side, side]
        _, h, w = grid
        rows, cols = merge_order(grid, self.merge, weight.device)
        x = (cols.float() + 0.5) / float(w) * 2 - 1
        y = (rows.float() + 0.5) / float(h) * 2 - 1
        where = torch.stack((x, y), dim=-1)[None, :, None]  # [1, N, 1, 2]
        sampled = F.grid_sample(table, where, mode="bicubic", align_corners=False, padding_mode="border")
        return sampled[0, :, :, 0].t().to(weight.dtype).to(dtype)

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's ``pixel_values`` [t*h*w, C*T*P*P] and ``image_grid_thw`` [1, 3] -> [t*h*w / merge², out]."""
        if "pixel_values_videos" in data:  # a video: its frame pairs through the same tower (get_video_features)
            data = {"pixel_values": data["pixel_values_videos"], "image_grid_thw": data["video_grid_thw"]}
        grid = self._grid(data)
        proj = self.patch_embed.proj
        x = F.linear(data["pixel_values"].to(proj.weight.dtype), proj.weight.reshape(self.dim, -1), proj.bias)
        x = self.post_conv_layernorm(x)
        x = x + self.position_embeddings(grid, x.dtype)
        rope = vision_rope(grid, self.merge, self.dim // self.heads, self.rope_theta, x.device)
        t, h, w = grid
        for block in self.blocks:
            x = block(x, rope, [h * w] * t)
        x = self.post_layernorm(x)
        m = self.merge
        x = x.view(-1, m, m, self.dim).permute(0, 3, 1, 2).flatten(1)  # each merge block [dim * m * m]
        # the Conv2d whose kernel is its stride: one linear per merge block (a CUDA conv in fp32 would take TF32's
        # products, cuDNN's default)
        down = self.downsample
        x = F.linear(x, down.weight.reshape(down.weight.shape[0], -1), down.bias)  # [N / m², out]
        return self.merger(x)


class Glm4vImageProcessor(QwenVLImageProcessor):
    """GLM-4.1V's / GLM-4.5V's host side: Qwen2-VL's (transformers' image processor of the checkpoint, ``<|image|>``
    once per merged token, the same multimodal RoPE positions for still images) and its videos
    (:mod:`specray.models.glm4v_video`)."""

    def __init__(self, *args, frame_text=None, frame_marks=None, **kwargs):
        super().__init__(*args, **kwargs)
        # videos: a frame pair's time -> its text tokens; the pair's <|begin_of_image|> / <|end_of_image|> ids
        self.frame_text, self.frame_marks = frame_text, frame_marks

    _video_side = staticmethod(glm4v_video.video_side)

    def process_video(self, frames: list):
        return glm4v_video.process_video(self, frames)

    def rope_positions(self, token_ids: list[int], items: list) -> tuple[list[list[int]], int]:
        return glm4v_video.rope_positions(self, token_ids, items)
