"""Gemma 4's images (``Gemma4ForConditionalGeneration``, transformers' ``models/gemma4``); audio and video are not
served (the text model is, through ``registry._TEXT_PARTS``).

:class:`Gemma4ImageEncoder`: Gemma 4's own vision model, then its embedder:

* patches of ``patch_size`` pixels a side (transformers' image processor makes them: [n, 3 * p * p] rows in
  row-major order with their (x, y) grid positions) are mapped from [0, 1] to [-1, 1], projected (``input_proj``)
  and given a learned position: column ``x``'s row of ``position_embedding_table[0]`` plus row ``y``'s of ``[1]``;
* encoder layers of Gemma 4's text shape: RMSNorms (``x * weight``) before and after attention and the gated-GELU
  MLP; q and k RMS-normed per head, v normed without a scale, attention scale 1, bidirectional over the image; a 2D
  RoPE: the first half of each head rotated by the patch's column, the second by its row, each half at
  ``theta ** (-4i / head_dim)`` (``rope_parameters`` "axial"); with ``use_clipped_linears`` each linear's input and
  output clamped to the checkpoint's bounds;
* the pooler: the patch grid averaged over ``pooling_kernel_size`` squares, in row-major order of the pooled grid,
  times sqrt(vision hidden size) in float32 (and ``standardize``'s bias and scale);
* the embedder: an RMSNorm without a scale, then ``embedding_projection`` into the text model's width.

The padding transformers' processor adds up to ``max_soft_tokens * k * k`` patches is masked out of its attention
and pooling; :class:`Gemma4ImageProcessor` drops it instead (one image a call), so no mask is needed.

:class:`Gemma4ImageProcessor`: transformers' image processor of the folder makes the patches (the aspect-preserving
resize to the patch budget); the placeholder a prompt holds once per image is ``<|image|>`` (``image_token_id``: what
``Gemma4Processor`` expands), replaced as that processor does: ``boi``, the image's soft tokens, ``eoi``. Only the soft
tokens take embeddings. Where the text config's ``use_bidirectional_attention`` is "vision", transformers lets an
image's soft tokens (its ``mm_token_type_ids``, not boi / eoi) see each other both ways in the sliding layers only
(its full layers stay causal: their mask kind's ``causal_keys``, :class:`specray.models.gemma4.Gemma4Attention`); the
items are then ``bidirectional``, narrowed to the soft tokens by :meth:`Gemma4ImageProcessor.finish_prompt`. The text
model puts the image rows in place after its sqrt(hidden) scale (unscaled) and, for per-layer inputs, reads the pad
token's per-layer embedding on those rows (:meth:`specray.models.gemma4.Gemma4Model.text_ids`), as transformers does.

Refused by name: a vision config other than Gemma 4's, another activation or RoPE type, an image processor whose patch
or pooling size differs from the vision config's, an image whose patch grid the pooling window does not divide, and
(with per-layer inputs) a text config without ``pad_token_id``."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.gemma4 import ACTIVATION, Gemma4RMSNorm
from specray.models.layers import _param, apply_rotary
from specray.models.registry import text_tensors
from specray.models.vision_towers import copy_weights
from specray.multimodal import MultiModalItem, ProcessedImage

logger = logging.getLogger(__name__)

ARCH = "Gemma4ForConditionalGeneration"
VISION_TYPE = "gemma4_vision"
# the checkpoint's names of this encoder's tensors -> ours: what transformers saves (``model.vision_tower.``,
# ``model.embed_vision.``) or without the ``model.`` prefix
_OWN_NAMES = ((re.compile(r"^(?:model\.)?vision_tower\."), "tower."),
              (re.compile(r"^(?:model\.)?embed_vision\."), "embedder."))
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def vision_config(config: Any) -> Any:
    """The whole checkpoint config's vision config; a ValueError for what is not served."""
    vision = getattr(config, "vision_config", None)
    kind = getattr(vision, "model_type", None)
    if kind != VISION_TYPE:
        raise ValueError(f"vision_config.model_type={kind!r} is not supported for {ARCH}: its images are served with "
                         f"Gemma 4's vision model ({VISION_TYPE!r}); serve this checkpoint's text without images")
    act = getattr(vision, "hidden_activation", None) or getattr(vision, "hidden_act", None)
    if act != ACTIVATION:
        raise ValueError(f"vision_config.hidden_activation={act!r} is not supported; Gemma 4's vision model uses "
                         f"{ACTIVATION!r}")
    rope = dict(getattr(vision, "rope_parameters", None) or {})
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision_config.rope_parameters.rope_type={rope['rope_type']!r} is not supported; Gemma 4's "
                         "vision model rotates its heads by an 'axial' 2D RoPE")
    if vision.head_dim % 4:
        raise ValueError(f"vision_config.head_dim={vision.head_dim} must be a multiple of 4 (a 2D RoPE rotates each "
                         "half of a head by pairs)")
    return vision


class ClippableLinear(nn.Module):
    """A linear map without bias (``linear.weight``), its input and output clamped to the checkpoint's bounds where
    ``clipped`` (transformers' ``Gemma4ClippableLinear``)."""

    def __init__(self, in_features: int, out_features: int, clipped: bool):
        super().__init__()
        self.linear = nn.Module()
        self.linear.weight = _param(out_features, in_features)
        self.clipped = clipped
        if clipped:
            for name in _CLIP_BOUNDS:
                setattr(self, name, nn.Parameter(torch.empty(()), requires_grad=False))  # scalars, as transformers'

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min.to(x.dtype), self.input_max.to(x.dtype))
        x = F.linear(x, self.linear.weight)
        if self.clipped:
            x = torch.clamp(x, self.output_min.to(x.dtype), self.output_max.to(x.dtype))
        return x


class VisionAttention(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        h, d, clipped = config.hidden_size, config.head_dim, bool(getattr(config, "use_clipped_linears", False))
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = ClippableLinear(h, self.num_heads * d, clipped)
        self.k_proj = ClippableLinear(h, self.num_kv_heads * d, clipped)
        self.v_proj = ClippableLinear(h, self.num_kv_heads * d, clipped)
        self.o_proj = ClippableLinear(self.num_heads * d, h, clipped)
        self.q_norm = Gemma4RMSNorm(d, config.rms_norm_eps)
        self.k_norm = Gemma4RMSNorm(d, config.rms_norm_eps)
        self.v_norm = Gemma4RMSNorm(d, config.rms_norm_eps, scaled=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # x: [n, H]; rope: (cos_x, sin_x, cos_y, sin_y) [n, 1, D/4] -> [n, H]
        n, d = x.shape[0], self.head_dim
        q = rotate_2d(self.q_norm(self.q_proj(x).view(n, self.num_heads, d)), rope)
        k = rotate_2d(self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, d)), rope)
        v = self.v_norm(self.v_proj(x).view(n, self.num_kv_heads, d))
        groups = self.num_heads // self.num_kv_heads
        k, v = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=1.0)
        return self.o_proj(o.transpose(0, 1).reshape(n, self.num_heads * d))


def rotate_2d(x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x [n, heads, D]: the first half of each head rotated by the column angles, the second by the row angles."""
    cos_x, sin_x, cos_y, sin_y = rope
    first, second = x.chunk(2, dim=-1)
    return torch.cat((apply_rotary(first, cos_x, sin_x), apply_rotary(second, cos_y, sin_y)), dim=-1)


class VisionMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        h, i, clipped = config.hidden_size, config.intermediate_size, bool(getattr(config, "use_clipped_linears", 0))
        self.gate_proj = ClippableLinear(h, i, clipped)
        self.up_proj = ClippableLinear(h, i, clipped)
        self.down_proj = ClippableLinear(i, h, clipped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class VisionLayer(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = VisionAttention(config)
        self.mlp = VisionMLP(config)
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma4ImageEncoder(nn.Module):
    """Gemma 4's vision model and embedder (:class:`specray.multimodal.ImageEncoder`): see the module docstring.
    Built from the whole checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        vision = vision_config(config)
        h = vision.hidden_size
        self.patch_size, self.window = vision.patch_size, vision.pooling_kernel_size
        self.theta = float((getattr(vision, "rope_parameters", None) or {}).get("rope_theta", 100.0))
        self.head_dim = vision.head_dim
        self.tower = nn.Module()
        self.tower.patch_embedder = nn.Module()
        self.tower.patch_embedder.input_proj = nn.Module()
        self.tower.patch_embedder.input_proj.weight = _param(h, 3 * self.patch_size ** 2)
        self.tower.patch_embedder.position_embedding_table = _param(2, vision.position_embedding_size, h)
        self.tower.encoder = nn.Module()
        self.tower.encoder.layers = nn.ModuleList(VisionLayer(vision) for _ in range(vision.num_hidden_layers))
        self.standardize = bool(getattr(vision, "standardize", False))
        if self.standardize:
            self.tower.std_bias = _param(h)
            self.tower.std_scale = _param(h)
        self.root_size = h ** 0.5
        self.embedder = nn.Module()
        self.embedder.embedding_pre_projection_norm = Gemma4RMSNorm(h, vision.rms_norm_eps, scaled=False)
        self.embedder.embedding_projection = nn.Module()
        self.embedder.embedding_projection.weight = _param(config.text_config.hidden_size, h)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Read the vision model's and the embedder's tensors among the whole checkpoint's (the text model's, the
        audio tower's and its embedder's are skipped unread). A ValueError names any of ours missing."""
        missing = copy_weights(dict(self.named_parameters()), text_tensors(weights, _OWN_NAMES))
        if missing:
            theirs = [re.sub(r"^tower\.", "vision_tower.", re.sub(r"^embedder\.", "embed_vision.", m))
                      for m in missing]
            raise ValueError(f"the checkpoint lacks {len(missing)} of {ARCH}'s vision tensor(s), e.g. {theirs[:4]} "
                             "(model.vision_tower.*, model.embed_vision.*); is it a complete checkpoint?")

    @property
    def device(self) -> torch.device:
        return self.embedder.embedding_projection.weight.device

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(cos, sin) of the columns' and of the rows' angles, each [n, 1, D/4], from positions [n, 2] (x, y)."""
        half = self.head_dim // 2
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, half, 2, device=positions.device).float() / half))
        out = []
        for axis in (0, 1):
            angles = positions[:, axis, None].float() * inv_freq  # [n, D/4]
            out += [angles.cos()[:, None].to(dtype), angles.sin()[:, None].to(dtype)]
        return tuple(out)

    def pool(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [n, H] over the patch grid at ``positions`` [n, 2] -> [n / k^2, H] float32: each k x k square's average,
        in row-major order of the pooled grid."""
        k = self.window
        columns = (positions[:, 0].max() + 1) // k  # the pooled grid's width (a device scalar: no host sync)
        index = positions[:, 0] // k + columns * (positions[:, 1] // k)
        out = torch.zeros(x.shape[0] // (k * k), x.shape[1], dtype=torch.float32, device=x.device)
        return out.index_add_(0, index, x.float()) / (k * k)

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's ``pixel_values`` [n, 3 * p * p] and ``image_position_ids`` [n, 2] (its real patches: the
        processor drops the padding) -> its embeddings [n / k^2, text hidden]."""
        pixels, positions = data["pixel_values"], data["image_position_ids"].long()
        if pixels.dim() == 3:  # a batch of one
            pixels, positions = pixels[0], positions[0]
        embedder = self.tower.patch_embedder
        weight = embedder.input_proj.weight
        x = F.linear((2 * (pixels - 0.5)).to(weight.dtype), weight)
        table = embedder.position_embedding_table
        x = x + table[0][positions[:, 0]] + table[1][positions[:, 1]]
        rope = self.rope(positions, x.dtype)
        for layer in self.tower.encoder.layers:
            x = layer(x, rope)
        pooled = self.pool(x, positions) * self.root_size
        if self.standardize:
            pooled = (pooled - self.tower.std_bias.float()) * self.tower.std_scale.float()
        pooled = pooled.to(x.dtype)
        return F.linear(self.embedder.embedding_pre_projection_norm(pooled), self.embedder.embedding_projection.weight)


class SoftTokenImages:
    """What Gemma 4's host sides share (Gemma 4 Unified's too): an image is boi, its soft tokens (the placeholder
    ``image_token_id``, the rows that take embeddings) and eoi, seen both ways where the text config's
    ``use_bidirectional_attention`` is "vision"; plain RoPE; audio and video placeholders refused (``arch``: the
    release its refusals name)."""

    arch = ARCH

    def _soft_tokens(self, config: Any) -> None:
        self.image_token_id = int(config.image_token_id)
        self.boi, self.eoi = int(config.boi_token_id), int(config.eoi_token_id)
        self.bidirectional = getattr(config.text_config, "use_bidirectional_attention", None) == "vision"
        # audio and video placeholders (not served): refused in a prompt with images (finish_prompt)
        self.refused = {int(i): name for name in ("audio_token_id", "video_token_id")
                        if (i := getattr(config, name, None)) is not None}

    def _image(self, tokens: int, data: dict[str, np.ndarray]) -> ProcessedImage:
        return ProcessedImage([self.boi] + [self.image_token_id] * tokens + [self.eoi], data,
                              list(range(1, 1 + tokens)), bidirectional=self.bidirectional)

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE

    def finish_prompt(self, token_ids: list[int], items: list[MultiModalItem]
                      ) -> tuple[list[int], list[MultiModalItem]]:
        """Each item narrowed to its soft tokens (the rows that take embeddings and, where bidirectional, the block
        transformers' ``mm_token_type_ids`` marks); the prompt unchanged. Idempotent."""
        for token, name in self.refused.items():
            if token in token_ids:
                raise ValueError(f"the prompt holds {name}={token}: only images are served for {self.arch} (no audio "
                                 "or video); send the prompt without that placeholder")
        narrowed = []
        for item in items:
            rows = item.embed_rows if item.embed_rows is not None else list(range(item.length))
            narrowed.append(dataclasses.replace(item, offset=item.offset + rows[0], length=len(rows), embed_rows=None))
        return token_ids, narrowed


class Gemma4ImageProcessor(SoftTokenImages):
    """Gemma 4's host side (:class:`specray.multimodal.ImageProcessor`): see the module docstring."""

    def __init__(self, image_processor: Any, config: Any):
        vision = vision_config(config)
        for field in ("patch_size", "pooling_kernel_size"):
            ours, theirs = getattr(vision, field), getattr(image_processor, field, None)
            if theirs != ours:
                raise ValueError(f"the image processor's {field}={theirs!r} differs from vision_config.{field}="
                                 f"{ours!r}; fix the checkpoint's processor config to match config.json")
        text = config.text_config
        if getattr(text, "hidden_size_per_layer_input", 0) and getattr(text, "pad_token_id", None) is None:
            raise ValueError("text_config.pad_token_id=None: with per-layer inputs (hidden_size_per_layer_input="
                             f"{text.hidden_size_per_layer_input}) an image's rows read the pad token's per-layer "
                             "embedding, as transformers does; set pad_token_id in config.json")
        self.image_processor = image_processor
        self.window = vision.pooling_kernel_size
        self._soft_tokens(config)

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Gemma4ImageProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        folder = Path(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        for name in ("image_token_id", "boi_token_id", "eoi_token_id"):
            theirs = getattr(tokenizer, name, None)
            if theirs is not None and theirs != getattr(config, name):
                raise ValueError(f"the tokenizer's {name}={theirs} differs from config.json's {name}="
                                 f"{getattr(config, name)}; the checkpoint's tokenizer and config do not match")
        return cls(AutoImageProcessor.from_pretrained(folder), config)

    def process(self, image: Any) -> ProcessedImage:
        out = self.image_processor(images=[image], return_tensors="np")
        positions = np.asarray(out["image_position_ids"][0], dtype=np.int64)
        real = int((positions != -1).all(-1).sum())  # the padding comes last
        positions = positions[:real]
        columns, rows = int(positions[:, 0].max()) + 1, int(positions[:, 1].max()) + 1
        if columns % self.window or rows % self.window:
            raise ValueError(f"the image's {columns} x {rows} patch grid is not a multiple of pooling_kernel_size="
                             f"{self.window}; let the image processor resize it (do_resize=True)")
        tokens = real // self.window ** 2
        pixels = np.asarray(out["pixel_values"][0][:real], dtype=np.float32)
        return self._image(tokens, {"pixel_values": pixels, "image_position_ids": positions})
