"""Aya Vision's images (``AyaVisionForConditionalGeneration``, transformers' ``models/aya_vision``: CohereLabs'
aya-vision-8b / 32b): SigLIP's vision tower (:mod:`specray.models.vision_towers`) over GotOcr2's tiles, InternVL's
pixel shuffle (:func:`specray.models.internvl.pixel_shuffle`, ``downsample_factor``) and a SwiGLU projector:
``linear_2(silu(gate) * x)`` where ``x, gate`` are the two halves of ``linear_1(layer_norm(features))``
(``alignment_intermediate_size`` wide, LayerNorm eps ``adapter_layer_norm_eps``).

The hidden states at ``vision_feature_layer`` (one transformers index, or several concatenated feature-wise) are taken
whole (the "full" strategy: SigLIP has no class token). The text model is a Cohere2 (Command R7B's layers,
:mod:`specray.models.cohere2`), served through ``registry._TEXT_PARTS``.

The host side (:class:`AyaVisionImageProcessor`) runs transformers' GotOcr2 image processor with ``crop_to_patches``
(as ``AyaVisionProcessor`` asks: up to ``max_patches`` tiles plus a thumbnail) and writes what AyaVisionProcessor
writes for the prompt's ``<image>``: ``<|START_OF_IMG|>``, for each tile but the thumbnail ``TILE_<i>`` and its
patch tokens, then ``TILE_GLOBAL`` and the thumbnail's, ``<|END_OF_IMG|>`` (tokenized as that text; the
``<|IMG_PATCH|>`` rows take the embeddings, ``embed_rows``).

Refused by name: a vision tower other than SigLIP's, the "default" strategy, a ``downsample_factor`` that does not
divide the patch grid, an odd ``alignment_intermediate_size``, a tokenizer without a single ``<image>`` token, and a
``processor_config.json`` whose tile size or patch size gives another token count than the model's."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.internvl import pixel_shuffle
from specray.models.layers import LayerNorm
from specray.models.vision_towers import SIGLIP, Linear, VisionTower, load_tower_and_projector, feature_indices
from specray.multimodal import MultiModalItem, ProcessedImage

logger = logging.getLogger(__name__)

ARCH = "AyaVisionForConditionalGeneration"
# AyaVisionProcessor's defaults (its processor_config.json may rename them)
TOKENS = {"image_token": "<image>", "start_of_img_token": "<|START_OF_IMG|>", "end_of_img_token": "<|END_OF_IMG|>",
          "img_patch_token": "<|IMG_PATCH|>", "tile_token": "TILE", "tile_global_token": "TILE_GLOBAL"}


def _grid(config: Any) -> int:
    vision = config.vision_config
    if getattr(vision, "model_type", None) != SIGLIP:
        raise ValueError(f"vision_config.model_type={getattr(vision, 'model_type', None)!r} is not supported for "
                         f"{ARCH}: its images are served with SigLIP's vision tower ({SIGLIP!r})")
    strategy = getattr(config, "vision_feature_select_strategy", "full")
    if strategy != "full":
        raise ValueError(f"vision_feature_select_strategy={strategy!r} is not supported for {ARCH}: only 'full' "
                         "(SigLIP has no class token; dropping its first patch leaves no square grid to pixel-shuffle)")
    return shuffled_grid(config, ARCH)


def shuffled_grid(config: Any, arch: str) -> int:
    """A fixed-size tower's patch grid a side, which ``downsample_factor``'s pixel shuffle must divide."""
    factor = int(getattr(config, "downsample_factor", 2))
    grid = config.vision_config.image_size // config.vision_config.patch_size
    if factor < 1 or grid % factor:
        raise ValueError(f"downsample_factor={factor} is not supported for {arch}: it must divide the patch grid "
                         f"({grid} = vision_config.image_size / patch_size)")
    return grid


def tokens_per_tile(config: Any) -> int:
    """The embeddings one tile makes: the patch grid folded by ``downsample_factor``, squared."""
    return (_grid(config) // int(getattr(config, "downsample_factor", 2))) ** 2


class AyaVisionImageEncoder(nn.Module):
    """SigLIP's tower, pixel shuffle and the SwiGLU projector (:class:`specray.multimodal.ImageEncoder`), built from
    the whole checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        self.grid = _grid(config)
        vision = config.vision_config
        self.fold = int(getattr(config, "downsample_factor", 2))
        self.indices = feature_indices(getattr(config, "vision_feature_layer", -1), vision.num_hidden_layers,
                                       "vision_feature_layer")
        self.tower = VisionTower(vision, depth=max(self.indices))
        text_hidden = config.text_config.hidden_size
        middle = int(getattr(config, "alignment_intermediate_size", None) or text_hidden)
        if middle % 2:
            raise ValueError(f"alignment_intermediate_size={middle} is not supported for {ARCH}: the SwiGLU projector "
                             "splits it in two halves; it must be even")
        width = vision.hidden_size * len(self.indices) * self.fold ** 2
        self.projector = nn.Module()
        self.projector.layernorm = LayerNorm(width, float(getattr(config, "adapter_layer_norm_eps", 1e-6)))
        self.projector.linear_1, self.projector.linear_2 = Linear(width, middle), Linear(middle // 2, text_hidden)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The tower's tensors (its unread layers, ``post_layernorm`` and head skipped) and the projector's; a
        ValueError names any of ours missing."""
        load_tower_and_projector(self, weights, ARCH)

    @property
    def device(self) -> torch.device:
        return self.projector.linear_1.weight.device

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles [T, C, S, S] -> the selected hidden states, pixel-shuffled: [T, tokens per tile, width]."""
        x = torch.cat(self.tower.hidden_states(pixel_values, self.indices), dim=-1)
        return pixel_shuffle(x.reshape(x.shape[0], self.grid, self.grid, -1), self.fold)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        p = self.projector
        x, gate = p.linear_1(p.layernorm(features)).chunk(2, dim=-1)
        return p.linear_2(F.silu(gate) * x)

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's tiles ``pixel_values`` [T, C, S, S] -> its embeddings [T * tokens per tile, text hidden]."""
        pixels = data["pixel_values"]
        if pixels.dim() == 3:
            pixels = pixels.unsqueeze(0)
        return self.project(self.features(pixels)).flatten(0, 1)


class AyaVisionImageProcessor:
    """Aya Vision's host side (:class:`specray.multimodal.ImageProcessor`): GotOcr2's tiles, the ``<image>``
    placeholder written out as AyaVisionProcessor writes it, the patch tokens taking the embeddings."""

    def __init__(self, image_processor: Any, tokenizer: Any, tokens: dict[str, str], per_tile: int):
        self.image_processor, self.tokenizer, self.tokens, self.per_tile = image_processor, tokenizer, tokens, per_tile
        self.image_token_id = _single_token(tokenizer, tokens["image_token"], "image_token")
        self.patch_id = _single_token(tokenizer, tokens["img_patch_token"], "img_patch_token")

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> AyaVisionImageProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        folder = Path(folder)
        per_tile = tokens_per_tile(config)
        tokens = dict(TOKENS)
        path = folder / "processor_config.json"
        if path.is_file():
            saved = json.loads(path.read_text())
            tokens.update({k: saved[k] for k in TOKENS if saved.get(k)})
            size, patch = saved.get("img_size", 364), saved.get("patch_size", 28) * saved.get("downsample_factor", 1)
            if (size // patch) ** 2 != per_tile:
                raise ValueError(f"{path} (img_size={size}, patch_size * downsample_factor={patch}) writes "
                                 f"{(size // patch) ** 2} patch tokens a tile, not the {per_tile} embeddings the model "
                                 "makes (vision_config.image_size / patch_size / downsample_factor); fix it to match")
        ours = cls(AutoImageProcessor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), tokens, per_tile)
        if ours.patch_id != getattr(config, "image_token_index", ours.patch_id):
            raise ValueError(f"image_token_index={config.image_token_index} is not the tokenizer's "
                             f"{tokens['img_patch_token']!r} ({ours.patch_id}), the rows the embeddings fill; fix "
                             "config.json or use the release's tokenizer")
        return ours

    def process(self, image: Any) -> ProcessedImage:
        out = self.image_processor(images=[image], crop_to_patches=True, return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)  # [tiles, C, S, S], the thumbnail last
        t, patches = self.tokens, self.tokens["img_patch_token"] * self.per_tile
        text = t["start_of_img_token"] + "".join(f"{t['tile_token']}_{i}{patches}" for i in range(1, len(pixels)))
        text += t["tile_global_token"] + patches + t["end_of_img_token"]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        rows = [i for i, token in enumerate(ids) if token == self.patch_id]
        assert len(rows) == self.per_tile * len(pixels), (len(rows), len(pixels))
        return ProcessedImage(ids, {"pixel_values": pixels}, embed_rows=rows)

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE


def _single_token(tokenizer: Any, token: str, field: str) -> int:
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the tokenizer has no single token for {field}={token!r} (it encodes to {ids}); Aya Vision's "
                         "prompts need it as one special token: use the release's tokenizer")
    return int(ids[0])
