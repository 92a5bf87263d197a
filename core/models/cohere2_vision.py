"""Command A Vision's images (``Cohere2VisionForConditionalGeneration``, transformers' ``models/cohere2_vision``:
CohereLabs' command-a-vision-07-2025): a SigLIP2 vision tower of fixed size (SigLIP2's fixed-resolution checkpoints
are SigLIP's ``siglip_vision_model``: :class:`specray.models.vision_towers.VisionTower`, with its
``post_layernorm``, since transformers reads ``last_hidden_state``), InternVL's pixel shuffle
(:func:`specray.models.internvl.pixel_shuffle`, transformers' reshape/permute, ``downsample_factor``) and a SwiGLU
projector without a norm: ``linear_2(silu(gate) * x)`` where ``x, gate`` are the halves of ``linear_1(features)``
(``alignment_intermediate_size`` wide). The text model is a Cohere2 (Command R7B's layers,
:class:`specray.models.cohere2.Cohere2ForCausalLM`) served through ``registry._TEXT_PARTS``; transformers' composite
model computes its logits with a plain ``lm_head`` (the text config's ``logit_scale`` unapplied,
``registry._TEXT_CONFIG_FIXES``).

The host side (:class:`Cohere2VisionImageProcessor`) makes transformers' ``Cohere2VisionImageProcessor``'s pixels
itself: that processor exists only on transformers' torchvision backend, which is not installed here. Its steps, in
torch: the RGB image as uint8 [C, H, W]; the tile grid (columns, rows) that needs the least upscaling of the image
(or, where every grid downscales it, the least downscaling) among those of at most ``max_patches`` tiles; the image
resized (bicubic, antialiased, on uint8 as torchvision does it on a CPU) to that grid, cut into tiles row-major and,
where there are several, a thumbnail (the whole image resized to one tile) appended; each tile rescaled and normalized
in one step, ``(x - mean / rescale) / (std / rescale)`` in float32. ``Cohere2VisionProcessor``'s expansion of the
prompt's ``<|IMG_PATCH|>`` (the tokenizer's ``image_token``, once per image) is written out as token ids:
``boi_token``, then per tile ``patch_size²`` image tokens and ``img_line_break_token``, then ``eoi_token``; the image
token rows take the embeddings (``embed_rows``).

Refused by name: a vision tower other than SigLIP's fixed-size one (SigLIP2's NaFlex ``siglip2_vision_model`` among
them), a ``downsample_factor`` that does not divide the patch grid, an odd ``alignment_intermediate_size``, image
processor settings that would give other pixels or another token count than the tower makes (tile size other than
``vision_config.image_size``, non-square tiles, ``patch_size²`` other than the tokens a tile gives, resampling other
than bicubic, resize / rescale / normalize switched off), a tokenizer lacking the image tokens, and a config whose
``image_token_id`` is not the tokenizer's image token."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.aya_vision import shuffled_grid
from specray.models.internvl import pixel_shuffle
from specray.models.kimi_k25_vision import _resize as bicubic_resize  # torchvision's uint8 antialiased bicubic
from specray.models.vision_towers import SIGLIP, Linear, VisionTower, load_tower_and_projector
from specray.multimodal import MultiModalItem, ProcessedImage, image_processor_settings, special_token_ids

logger = logging.getLogger(__name__)

ARCH = "Cohere2VisionForConditionalGeneration"
# Cohere2VisionProcessor reads these tokenizer attributes; the release's tokens where a tokenizer does not name them
TOKENS = {"boi_token": "<|START_OF_IMG|>", "eoi_token": "<|END_OF_IMG|>", "image_token": "<|IMG_PATCH|>",
          "img_line_break_token": "<|IMG_LINE_BREAK|>"}
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
BICUBIC = 3


def _grid(config: Any) -> int:
    vision = config.vision_config
    kind = getattr(vision, "model_type", None)
    if kind != SIGLIP:
        raise ValueError(f"vision_config.model_type={kind!r} is not supported for {ARCH}: its images are served with "
                         f"the fixed-size SigLIP / SigLIP2 tower ({SIGLIP!r}; SigLIP2's NaFlex tower, with its "
                         "resized position table, is not)")
    return shuffled_grid(config, ARCH)


def tokens_per_tile(config: Any) -> int:
    """The embeddings one tile makes: the patch grid folded by ``downsample_factor``, squared."""
    return (_grid(config) // int(getattr(config, "downsample_factor", 2))) ** 2


class Cohere2VisionImageEncoder(nn.Module):
    """SigLIP's tower (post-normed), pixel shuffle and the norm-free SwiGLU projector
    (:class:`specray.multimodal.ImageEncoder`), built from the whole checkpoint's config; replicated on every
    tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        self.grid = _grid(config)
        vision = config.vision_config
        self.fold = int(getattr(config, "downsample_factor", 2))
        self.tower = VisionTower(vision, post_norm=True)
        text_hidden = config.text_config.hidden_size
        middle = int(getattr(config, "alignment_intermediate_size", 36864))
        if middle % 2:
            raise ValueError(f"alignment_intermediate_size={middle} is not supported for {ARCH}: the SwiGLU projector "
                             "splits it in two halves; it must be even")
        self.projector = nn.Module()
        self.projector.linear_1 = Linear(vision.hidden_size * self.fold ** 2, middle)
        self.projector.linear_2 = Linear(middle // 2, text_hidden)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The tower's tensors (its head skipped) and the projector's; a ValueError names any of ours missing."""
        load_tower_and_projector(self, weights, ARCH)

    @property
    def device(self) -> torch.device:
        return self.projector.linear_1.weight.device

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles [T, C, S, S] -> the tower's last hidden state (post-normed), pixel-shuffled: [T, tokens, width]."""
        x = self.tower(pixel_values)
        return pixel_shuffle(x.reshape(x.shape[0], self.grid, self.grid, -1), self.fold)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        x, gate = self.projector.linear_1(features).chunk(2, dim=-1)
        return self.projector.linear_2(F.silu(gate) * x)

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's tiles ``pixel_values`` [T, C, S, S] -> its embeddings [T * tokens per tile, text hidden]."""
        pixels = data["pixel_values"]
        if pixels.dim() == 3:
            pixels = pixels.unsqueeze(0)
        return self.project(self.features(pixels)).flatten(0, 1)


@lru_cache(maxsize=16)
def _grids(max_tiles: int) -> list[tuple[int, int]]:
    """Every (columns, rows) of at most ``max_tiles`` tiles, by tile count (ties in (columns, rows) order)."""
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1) if c * r <= max_tiles]
    return sorted(grids, key=lambda g: g[0] * g[1])


def tile_grid(height: int, width: int, tile: int, max_tiles: int) -> tuple[int, int]:
    """The (columns, rows) transformers' ``get_optimal_tiled_canvas`` picks for an image of ``height`` x ``width``:
    each grid's scale is the smaller of its sides' (grid side / image side); the grid of the smallest scale >= 1, or
    where every scale is < 1, that of the largest."""
    grids = _grids(max_tiles)
    scales = (np.array(grids) * tile / np.array([width, height])).min(axis=-1)
    if np.all(scales < 1):
        return grids[int(np.argmax(scales))]
    return grids[int(np.argmin(np.where(scales < 1.0, 10e9, scales)))]


class Cohere2VisionImageProcessor:
    """Command A Vision's host side (:class:`specray.multimodal.ImageProcessor`): transformers'
    ``Cohere2VisionImageProcessor``'s tiles (made here in torch, see the module's docstring) and
    ``Cohere2VisionProcessor``'s tokens for the image token."""

    def __init__(self, settings: dict, token_ids: dict[str, int], config: Any):
        size = settings.get("size") or {"height": 512, "width": 512}
        tile = config.vision_config.image_size
        if size.get("height") != size.get("width") or size.get("height") != tile:
            raise ValueError(f"the image processor's size={size} is not supported for {ARCH}: tiles must be square, "
                             f"of vision_config.image_size ({tile}, the tower's fixed position table); fix "
                             "preprocessor_config.json")
        per_tile = tokens_per_tile(config)
        side = int(settings.get("patch_size", 16))
        if side * side != per_tile:
            raise ValueError(f"the image processor's patch_size={side} writes {side * side} image tokens a tile, not "
                             f"the {per_tile} embeddings the model makes ((vision_config.image_size / patch_size / "
                             "downsample_factor)²); fix preprocessor_config.json")
        resample = settings.get("resample", BICUBIC)
        if resample not in (BICUBIC, "bicubic"):
            raise ValueError(f"the image processor's resample={resample!r} is not supported for {ARCH}: only bicubic "
                             f"({BICUBIC}, the release's); fix preprocessor_config.json")
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if not settings.get(flag, True):
                raise ValueError(f"the image processor's {flag}=False is not supported for {ARCH} (the release "
                                 "resizes, rescales and normalizes every RGB image); fix preprocessor_config.json")
        self.tile, self.per_tile = int(tile), per_tile
        self.crop = bool(settings.get("crop_to_patches", True))
        self.max_tiles = int(settings.get("max_patches", 12))
        rescale = float(settings.get("rescale_factor", 1 / 255))
        # transformers' fused rescale and normalize: (x - mean / rescale) / (std / rescale), float32
        self.mean = torch.tensor([float(v) for v in settings.get("image_mean") or CLIP_MEAN]) * (1.0 / rescale)
        self.std = torch.tensor([float(v) for v in settings.get("image_std") or CLIP_STD]) * (1.0 / rescale)
        self.ids = token_ids
        self.image_token_id = token_ids["image_token"]
        wanted = getattr(config, "image_token_id", self.image_token_id)
        if wanted != self.image_token_id:
            raise ValueError(f"image_token_id={wanted} is not the tokenizer's image token ({self.image_token_id}), the "
                             "rows the embeddings fill; fix config.json or use the release's tokenizer")

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Cohere2VisionImageProcessor:
        """From the folder's ``preprocessor_config.json`` (or its ``processor_config.json``'s ``image_processor``) and
        its tokenizer (the image tokens by the names Cohere2VisionProcessor reads, else the release's)."""
        from transformers import AutoTokenizer

        folder = Path(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        names = {key: getattr(tokenizer, key, None) or token for key, token in TOKENS.items()}
        ids = special_token_ids(tokenizer, list(names.values()), folder, "Cohere2VisionProcessor")
        return cls(image_processor_settings(folder), dict(zip(names, ids)), config)

    def tiles(self, image: Any) -> np.ndarray:
        """One PIL image -> its tiles [T, 3, S, S] float32, the thumbnail last where there are several."""
        from transformers.image_transforms import convert_to_rgb  # PIL only: transparency composited onto white

        x = torch.from_numpy(np.ascontiguousarray(convert_to_rgb(image, return_numpy=True), dtype=np.uint8))
        x = x.permute(2, 0, 1)
        s = self.tile
        if self.crop:
            cols, rows = tile_grid(x.shape[1], x.shape[2], s, self.max_tiles)
            canvas = bicubic_resize(x, rows * s, cols * s)
            parts = [canvas[:, r * s:(r + 1) * s, c * s:(c + 1) * s] for r in range(rows) for c in range(cols)]
            if len(parts) > 1:
                parts.append(bicubic_resize(x, s, s))
        else:
            parts = [bicubic_resize(x, s, s)]
        out = torch.stack(parts).to(torch.float32).sub_(self.mean[:, None, None]).div_(self.std[:, None, None])
        return out.numpy()

    def replacement(self, count: int) -> list[int]:
        """Cohere2VisionProcessor's tokens for an image of ``count`` tiles."""
        ids = self.ids
        tile = [ids["image_token"]] * self.per_tile + [ids["img_line_break_token"]]
        return [ids["boi_token"], *tile * count, ids["eoi_token"]]

    def process(self, image: Any) -> ProcessedImage:
        pixels = self.tiles(image)
        ids = self.replacement(len(pixels))
        rows = [i for i, token in enumerate(ids) if token == self.image_token_id]
        return ProcessedImage(ids, {"pixel_values": pixels}, embed_rows=rows)

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE
