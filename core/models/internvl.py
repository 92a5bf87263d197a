"""InternVL's images (``InternVLForConditionalGeneration``, transformers' ``models/internvl``: OpenGVLab's
InternVL3 / InternVL3.5 ``-hf`` releases): the InternViT vision tower, pixel shuffle and a LayerNorm-led projector
turn each image tile into ``image_seq_length`` text embeddings.

The tower (:class:`InternViT`) cuts a tile into ``patch_size`` squares (a strided conv with a bias), puts a learned
class token first and adds a learned embedding per position, then runs pre-norm layers whose two branches are scaled
per channel by learned layer-scale vectors: ``h = x + lambda_1 * attn(norm1(x))``, ``h + lambda_2 * mlp(norm2(h))``.
The norms are LayerNorms or RMSNorms (``norm_type``); the attention is bidirectional multi-head, with q/k/v biases by
``attention_bias`` and, by ``use_qk_norm`` (InternViT-6B's), an RMSNorm over the whole query and key width before the
heads split. Where ``use_mean_pooling`` is off, a final LayerNorm follows the last layer (read when the feature layer
is the last one, as transformers reads ``last_hidden_state``).

The hidden states at ``vision_feature_layer`` (one transformers index), less the class token (the "default"
strategy), form a square grid of patches; pixel shuffle (``downsample_ratio``: 0.5 folds each 2 x 2 block into one
token of four times the width, in transformers' order) shrinks it, and ``linear_2(act(linear_1(layer_norm(x))))``
maps each token into the text model's width.

The host side (:class:`InternVLImageProcessor`) is transformers' GotOcr2 image processor with ``crop_to_patches`` on
(as ``InternVLProcessor`` calls it): the image in up to ``max_patches`` tiles of the tower's size chosen by its aspect
ratio, plus a thumbnail of the whole image where there is more than one tile. The prompt's placeholder (the
``<IMG_CONTEXT>`` token, ``image_token_id``) becomes ``<img>``, ``image_seq_length`` context tokens per tile and
``</img>``; the context tokens take the embeddings (``embed_rows``), the two markers keep their own.

The text model (Qwen2, Qwen3, Llama, as ``text_config`` names it) is served by its own class through
``registry._TEXT_PARTS``; the checkpoint's tensors are read as transformers 5 saves them (``language_model.model.*``,
``language_model.lm_head.*``, ``vision_tower.*``, ``multi_modal_projector.*``) or as its modules name them
(``model.language_model.*``, ``lm_head.*``, ``model.vision_tower.*``, ``model.multi_modal_projector.*``).

Refused by name: a list of feature layers, the "full" strategy (the class token would break transformers' square grid),
a grid or ratio pixel shuffle cannot fold, unknown norm types and activations, images at another size than the
tower's (position embeddings are not interpolated) and an ``image_seq_length`` that disagrees with the tower's count."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import LayerNorm, RMSNorm, _param
from specray.models.registry import text_tensors
from specray.models.vision_towers import Linear, copy_weights, feature_indices, patch_rows, vision_activation
from specray.multimodal import MultiModalItem, ProcessedImage, special_token_ids

logger = logging.getLogger(__name__)

ARCH = "InternVLForConditionalGeneration"
NORM_TYPES = ("layer_norm", "rms_norm")
QK_NORM_EPS = 1e-6  # transformers builds InternViT's q/k RMSNorms with their default eps, not layer_norm_eps
# the checkpoint's names of the encoder's tensors -> ours
_OWN_NAMES = ((re.compile(r"^(?:model\.)?vision_tower\."), "tower."),
              (re.compile(r"^(?:model\.)?multi_modal_projector\."), "projector."))


def _pair(value: Any, field: str) -> int:
    """A square size given as an int or an (h, w) pair; a ValueError for a non-square one."""
    if isinstance(value, int):
        return value
    h, w = value
    if h != w:
        raise ValueError(f"vision_config.{field}={list(value)!r} is not supported for {ARCH}: square tiles and patches "
                         "only (the releases' 448 and 14)")
    return int(h)


def _fold(config: Any) -> int:
    """Pixel shuffle's fold ``1 / downsample_ratio`` (2 for the releases' 0.5), checked to divide the patch grid."""
    ratio = float(getattr(config, "downsample_ratio", 0.5))
    fold = round(1 / ratio) if ratio > 0 else 0
    grid = _pair(config.vision_config.image_size, "image_size") // _pair(config.vision_config.patch_size, "patch_size")
    if fold < 1 or abs(fold * ratio - 1) > 1e-9 or grid % fold:
        raise ValueError(f"downsample_ratio={ratio} is not supported for {ARCH} with a grid of {grid} x {grid} patches "
                         "(vision_config.image_size / patch_size): pixel shuffle needs 1 / downsample_ratio to be a "
                         "whole number that divides the grid (the releases' 0.5)")
    return fold


def tokens_per_tile(config: Any) -> int:
    """The embeddings of one tile: its patch grid, folded by pixel shuffle."""
    vision = config.vision_config
    grid = _pair(vision.image_size, "image_size") // _pair(vision.patch_size, "patch_size")
    return (grid // _fold(config)) ** 2


def _check(config: Any) -> None:
    vision = getattr(config, "vision_config", None)
    if getattr(vision, "model_type", None) != "internvl_vision":
        raise ValueError(f"vision_config.model_type={getattr(vision, 'model_type', None)!r} is not supported for "
                         f"{ARCH}: its images are served with InternViT ('internvl_vision')")
    strategy = getattr(config, "vision_feature_select_strategy", "default")
    if strategy != "default":
        raise ValueError(f"vision_feature_select_strategy={strategy!r} is not supported for {ARCH}: only 'default' "
                         "(the class token dropped; with it the patches make no square grid to pixel-shuffle)")
    layer = getattr(config, "vision_feature_layer", -1)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer={layer!r} is not supported for {ARCH}: one hidden-state index only "
                         "(the releases' -1)")
    norm = getattr(vision, "norm_type", "layer_norm")
    if norm not in NORM_TYPES:
        raise ValueError(f"vision_config.norm_type={norm!r} is not supported for {ARCH}; one of {list(NORM_TYPES)}")
    tokens_per_tile(config)


def _norm(vision: Any) -> nn.Module:
    if getattr(vision, "norm_type", "layer_norm") == "rms_norm":
        return RMSNorm(vision.hidden_size, vision.layer_norm_eps)
    return LayerNorm(vision.hidden_size, vision.layer_norm_eps)


class InternViTAttention(nn.Module):
    """Bidirectional multi-head attention over one tile's tokens; q/k RMSNorms over the full width where asked."""

    def __init__(self, vision: Any):
        super().__init__()
        hidden, heads = vision.hidden_size, vision.num_attention_heads
        if hidden % heads:
            raise ValueError(f"vision_config.hidden_size={hidden} is not divisible by vision_config."
                             f"num_attention_heads={heads}; the checkpoint's vision config is inconsistent")
        self.heads, self.head_dim = heads, hidden // heads
        bias = bool(getattr(vision, "attention_bias", False))
        self.q_proj, self.k_proj = Linear(hidden, hidden, bias), Linear(hidden, hidden, bias)
        self.v_proj, self.projection_layer = Linear(hidden, hidden, bias), Linear(hidden, hidden)
        qk_norm = bool(getattr(vision, "use_qk_norm", False))
        self.q_norm = RMSNorm(hidden, QK_NORM_EPS) if qk_norm else None
        self.k_norm = RMSNorm(hidden, QK_NORM_EPS) if qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, N, C] -> [B, N, C]
        b, n, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(b, n, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.projection_layer(out.transpose(1, 2).reshape(b, n, -1))


class InternViTLayer(nn.Module):
    """``h = x + lambda_1 * attn(norm1(x))``, then ``h + lambda_2 * mlp(norm2(h))``."""

    def __init__(self, vision: Any):
        super().__init__()
        hidden = vision.hidden_size
        self.layernorm_before, self.layernorm_after = _norm(vision), _norm(vision)
        self.attention = InternViTAttention(vision)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = Linear(hidden, vision.intermediate_size), Linear(vision.intermediate_size, hidden)
        self.act = vision_activation(vision.hidden_act, "vision_config.hidden_act")
        self.lambda_1, self.lambda_2 = _param(hidden), _param(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp.fc2(self.act(self.mlp.fc1(self.layernorm_after(x))))


class InternViT(nn.Module):
    """InternVL's vision model (``vision_config``), as deep as ``depth`` layers; ``final_norm``: its LayerNorm after
    the last layer (built where ``use_mean_pooling`` is off and the last layer is read)."""

    def __init__(self, vision: Any, depth: int, final_norm: bool):
        super().__init__()
        hidden, channels = vision.hidden_size, getattr(vision, "num_channels", 3)
        self.image_size, self.patch = _pair(vision.image_size, "image_size"), _pair(vision.patch_size, "patch_size")
        patches = (self.image_size // self.patch) ** 2
        self.embeddings = nn.Module()
        self.embeddings.cls_token = _param(1, 1, hidden)
        self.embeddings.patch_embeddings = nn.Module()
        self.embeddings.patch_embeddings.projection = nn.Module()
        conv = self.embeddings.patch_embeddings.projection
        conv.weight, conv.bias = _param(hidden, channels, self.patch, self.patch), _param(hidden)
        absolute = bool(getattr(vision, "use_absolute_position_embeddings", True))
        self.embeddings.position_embeddings = _param(1, patches + 1, hidden) if absolute else None
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(InternViTLayer(vision) for _ in range(depth))
        self.layernorm = LayerNorm(hidden, vision.layer_norm_eps) if final_norm else None

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [B, C, S, S] -> [B, 1 + patches, hidden], the class token first
        size = tuple(pixel_values.shape[-2:])
        if size != (self.image_size, self.image_size):
            raise ValueError(f"a tile of {size[0]}x{size[1]} pixels reached InternViT of vision_config.image_size="
                             f"{self.image_size} (position embeddings are not interpolated); the image processor must "
                             "cut images into tiles of that size (its size)")
        conv = self.embeddings.patch_embeddings.projection
        x = patch_rows(pixel_values, conv.weight, conv.bias)
        x = torch.cat([self.embeddings.cls_token.expand(x.shape[0], 1, -1), x], dim=1)
        if self.embeddings.position_embeddings is not None:
            x = x + self.embeddings.position_embeddings
        return x

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The output of the built layers (transformers' ``hidden_states[depth]``), the final LayerNorm after it
        where built."""
        x = self.embed(pixel_values)
        for layer in self.encoder.layer:
            x = layer(x)
        return x if self.layernorm is None else self.layernorm(x)


def pixel_shuffle(x: torch.Tensor, fold: int) -> torch.Tensor:
    """[B, R, R, C] patches (row-major grid) -> [B, (R / fold) ** 2, C * fold ** 2], each ``fold`` x ``fold`` block in
    one token: first ``fold`` neighbours along a row join channel-wise, then ``fold`` such along a column."""
    b, rows, cols, c = x.shape
    x = x.reshape(b, rows, cols // fold, c * fold).transpose(1, 2)
    x = x.reshape(b, cols // fold, rows // fold, c * fold * fold).transpose(1, 2)
    return x.reshape(b, -1, c * fold * fold)


class InternVLImageEncoder(nn.Module):
    """InternViT, pixel shuffle and the projector (:class:`specray.multimodal.ImageEncoder`), built from the whole
    checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        _check(config)
        vision = config.vision_config
        self.fold = _fold(config)
        layers = vision.num_hidden_layers
        self.index = feature_indices(config.vision_feature_layer, layers, "vision_feature_layer")[0]
        # transformers' -1 is the last hidden state after the final norm (when built); another index is the raw
        # hidden state of that layer
        last = config.vision_feature_layer == -1
        self.tower = InternViT(vision, self.index, final_norm=last and not getattr(vision, "use_mean_pooling", True))
        width = vision.hidden_size * self.fold ** 2
        text_hidden = config.text_config.hidden_size
        self.projector = nn.Module()
        self.projector.layer_norm = LayerNorm(width, 1e-5)  # transformers' nn.LayerNorm default eps
        self.projector.linear_1, self.projector.linear_2 = Linear(width, text_hidden), Linear(text_hidden, text_hidden)
        self.act = vision_activation(getattr(config, "projector_hidden_act", "gelu"), "projector_hidden_act")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Read the tower's and the projector's tensors among the whole checkpoint's; the text model's and the tower's
        unused ones (layers past the feature layer, its mask token, an unread final norm) are skipped. A ValueError
        names any of ours missing."""
        missing = copy_weights(dict(self.named_parameters()), text_tensors(weights, _OWN_NAMES))
        if missing:
            raise ValueError(f"the checkpoint lacks {ARCH}'s tensor(s) {missing[:6]} (vision_tower.* / "
                             "multi_modal_projector.*); it does not match its config.json's vision_config")

    @property
    def device(self) -> torch.device:
        return self.projector.linear_1.weight.device

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles [T, C, S, S] -> the tower's patch tokens, pixel-shuffled: [T, tokens per tile, hidden * fold ** 2]."""
        x = self.tower(pixel_values)[:, 1:]
        grid = self.tower.image_size // self.tower.patch
        return pixel_shuffle(x.reshape(x.shape[0], grid, grid, -1), self.fold)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        p = self.projector
        return p.linear_2(self.act(p.linear_1(p.layer_norm(features))))

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's tiles ``pixel_values`` [T, C, S, S] -> its embeddings [T * tokens per tile, text hidden]."""
        pixels = data["pixel_values"]
        if pixels.dim() == 3:
            pixels = pixels.unsqueeze(0)
        return self.project(self.features(pixels)).flatten(0, 1)


class InternVLImageProcessor:
    """InternVL's host side (:class:`specray.multimodal.ImageProcessor`): transformers' GotOcr2 image processor cuts
    an image into tiles (``crop_to_patches``, as InternVLProcessor asks); the placeholder becomes ``<img>``,
    ``image_seq_length`` context tokens per tile, ``</img>``, the context tokens taking the embeddings."""

    def __init__(self, image_processor: Any, config: Any, start_id: int, end_id: int, seq_length: int):
        self.image_processor = image_processor
        self.image_token_id = int(config.image_token_id)
        self.start_id, self.end_id, self.seq_length = start_id, end_id, seq_length

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> InternVLImageProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        folder = Path(folder)
        _check(config)
        seq = _seq_length(folder, config)
        tok = AutoTokenizer.from_pretrained(folder)
        ids = special_token_ids(tok, [getattr(tok, attr, None) or default for attr, default in
                                      (("start_image_token", "<img>"), ("end_image_token", "</img>"))],
                                folder, "InternVLProcessor")
        return cls(AutoImageProcessor.from_pretrained(folder), config, ids[0], ids[1], seq)

    def process(self, image: Any) -> ProcessedImage:
        out = self.image_processor(images=[image], crop_to_patches=True, return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)  # [tiles, C, S, S] (the thumbnail last)
        count = self.seq_length * pixels.shape[0]
        replacement = [self.start_id] + [self.image_token_id] * count + [self.end_id]
        return ProcessedImage(replacement, {"pixel_values": pixels}, embed_rows=list(range(1, count + 1)))

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE


def _seq_length(folder: Path, config: Any) -> int:
    """The context tokens per tile (``processor_config.json``'s ``image_seq_length``, else the config's), checked to
    be the tower's count."""
    seq = getattr(config, "image_seq_length", None)
    path = folder / "processor_config.json"
    if path.is_file():
        seq = json.loads(path.read_text()).get("image_seq_length", seq)
    ours = tokens_per_tile(config)
    if seq is not None and int(seq) != ours:
        raise ValueError(f"image_seq_length={seq} ({path if path.is_file() else 'config.json'}) is not the "
                         f"{ours} embeddings InternViT makes of a tile (vision_config.image_size / patch_size, "
                         "downsample_ratio); fix it to match the model")
    return ours
