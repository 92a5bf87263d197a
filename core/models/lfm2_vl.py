"""LFM2-VL's images (``Lfm2VlForConditionalGeneration``): a SigLIP2 NaFlex vision tower, a pixel unshuffle and a
projector into the LFM2 text model (:mod:`specray.models.lfm2`, served through ``_TEXT_PARTS``; its short convs keep
their conv history per request, so chunks that split an image's span carry it as for text).

Host side (transformers' ``Lfm2VlImageProcessor`` needs torchvision; made here with torch, the same arithmetic): an
image whose side-rounded size exceeds ``max_image_tokens * (patch * downsample)^2 * max_pixels_tolerance`` pixels is
resized (bilinear, antialiased, on uint8 as torchvision does it on a CPU) to a grid of ``tile_size`` tiles (the grid of
``min_tiles..max_tiles`` tiles whose aspect is closest to the image's) cut row by row, then a thumbnail (the image
resized by the smart-resize rule: sides multiples of ``patch * downsample``, the pixels within the min / max image
token budget); a smaller image is resized by that rule alone. Each tile is rescaled and normalized, cut into patches
(each ``patch * patch * 3`` values, channels last) and padded to the most patches a tile may hold, with its mask and
its patch grid (``spatial_shapes``). ``Lfm2VlProcessor`` expands ``<image>`` to ``<|image_start|>``, for a grid each
tile's ``<|img_row_R_col_C|>`` and its tokens, ``<|img_thumbnail|>`` and the thumbnail's, else the image's tokens,
then ``<|image_end|>`` (without the start / end / row / thumbnail tokens where ``use_image_special_tokens`` is off:
a per-call argument in transformers, a constructor one here).

Encoder: per tile, the real patches' linear embedding plus the learned position table (a square grid) resized to the
tile's patch grid (bilinear with an antialiasing triangle filter, as SigLIP2 does), SigLIP's encoder layers
(:class:`specray.models.vision_towers.VisionEncoderLayer`) and ``post_layernorm``; then each ``downsample x
downsample`` block of patches concatenated (row by row) into one vector, LayerNorm (where
``projector_use_layernorm``), ``linear_1``, the activation and ``linear_2``. A tile attends only to its own real
patches (transformers masks the padding as keys, so its real rows are the same)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import LayerNorm, _param
from specray.models.llama4_vision import _resize as bilinear_resize  # torchvision's uint8 antialiased bilinear
from specray.models.vision_towers import Linear, VisionEncoderLayer, VisionTower, load_tower_and_projector, \
    vision_activation
from specray.multimodal import ProcessedImage, image_processor_settings

logger = logging.getLogger(__name__)

IMAGE, START, END, THUMBNAIL = "<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"


def _field(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


# ---- host side -------------------------------------------------------------------------------------------------------

def _round_to(value: float, factor: int) -> int:
    return round(value / factor) * factor


def smart_size(height: int, width: int, patch: int, down: int, min_tokens: int, max_tokens: int) -> tuple[int, int]:
    """(height, width) an untiled image (or a grid's thumbnail) is resized to: sides multiples of ``patch * down``,
    its pixels brought within ``[min_tokens, max_tokens] * (patch * down)^2`` keeping the aspect."""
    factor = patch * down
    low, high = min_tokens * factor ** 2, max_tokens * factor ** 2
    h, w = max(factor, _round_to(height, factor)), max(factor, _round_to(width, factor))
    if h * w > high:
        beta = math.sqrt(height * width / high)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < low:
        beta = math.sqrt(low / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def grid_for(height: int, width: int, min_tiles: int, max_tiles: int, tile: int) -> tuple[int, int]:
    """(columns, rows) of tiles: among the grids of ``min_tiles..max_tiles`` tiles (fewest tiles first), the one whose
    aspect is closest to the image's; on a tie the later one where the image covers over half its area."""
    grids = sorted({(w, h) for n in range(min_tiles, max_tiles + 1) for w in range(1, n + 1)
                    for h in range(1, n + 1) if min_tiles <= w * h <= max_tiles}, key=lambda g: g[0] * g[1])
    aspect, best, best_gap = width / height, (1, 1), float("inf")
    for cols, rows in grids:
        gap = abs(aspect - cols / rows)
        if gap < best_gap:
            best, best_gap = (cols, rows), gap
        elif gap == best_gap and height * width > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


class Lfm2VlImageProcessor:
    """LFM2-VL's host side (:class:`specray.multimodal.ImageProcessor`): ``Lfm2VlImageProcessor``'s tiles and patches
    (made here, see the module docstring) and ``Lfm2VlProcessor``'s expansion of ``<image>``."""

    def __init__(self, settings: dict, tokenizer: Any, config: Any, special_tokens: bool = True):
        for flag in ("do_rescale", "do_normalize", "do_pad"):
            if not settings.get(flag, True):
                raise ValueError(f"the image processor's {flag}=False is not supported (LFM2-VL rescales, normalizes "
                                 "and pads every tile); fix preprocessor_config.json")
        resample = settings.get("resample", 2)
        if resample not in (2, "bilinear"):
            raise ValueError(f"the image processor's resample={resample!r} is not supported: only bilinear (2), "
                             "LFM2-VL's, is; fix preprocessor_config.json")
        self.patch = int(settings.get("encoder_patch_size", 16))
        self.down = int(settings.get("downsample_factor", 2))
        vision = _field(config, "vision_config") or {}
        if self.patch != int(_field(vision, "patch_size", 16)) or self.down != int(
                _field(config, "downsample_factor", 2)):
            raise ValueError(f"the image processor's encoder_patch_size={self.patch}, downsample_factor={self.down} "
                             f"disagree with vision_config.patch_size={_field(vision, 'patch_size', 16)}, "
                             f"downsample_factor={_field(config, 'downsample_factor', 2)}: the prompt would hold "
                             "another number of tokens than the encoder embeds; fix preprocessor_config.json")
        self.split = bool(settings.get("do_image_splitting", True))
        self.min_tiles, self.max_tiles = (int(settings.get("min_tiles", 2)), int(settings.get("max_tiles", 10))) \
            if self.split else (1, 1)
        if self.split and self.min_tiles > self.max_tiles:
            raise ValueError(f"the image processor's min_tiles={self.min_tiles} exceeds max_tiles={self.max_tiles}; "
                             "fix preprocessor_config.json")
        self.thumbnail = bool(settings.get("use_thumbnail", True))
        self.min_tokens = int(settings.get("min_image_tokens", 64))
        self.max_tokens = int(settings.get("max_image_tokens", 256))
        self.tile = int(settings.get("tile_size", 512))
        self.tolerance = float(settings.get("max_pixels_tolerance", 2.0))
        self.max_patches = max(self.max_tokens * self.down ** 2, (self.tile // self.patch) ** 2 if self.split else 0)
        rescale = float(settings.get("rescale_factor", 1 / 255))
        # transformers' fused rescale and normalize: (x - mean / rescale) / (std / rescale), float32
        self.mean = torch.tensor([float(v) for v in settings.get("image_mean", [0.5] * 3)]) * (1.0 / rescale)
        self.std = torch.tensor([float(v) for v in settings.get("image_std", [0.5] * 3)]) * (1.0 / rescale)
        self.tokenizer, self.special = tokenizer, special_tokens
        self.image_token_id = self._id(IMAGE)
        if self.image_token_id != int(_field(config, "image_token_id", 396)):
            raise ValueError(f"the tokenizer's {IMAGE} is id {self.image_token_id} but image_token_id="
                             f"{_field(config, 'image_token_id', 396)}: transformers fills image_token_id's rows "
                             "with the image; fix config.json or the tokenizer")
        self._ids: dict[str, int] = {}

    def _id(self, token: str) -> int:
        found = self.tokenizer.convert_tokens_to_ids(token)
        if found is None or found == getattr(self.tokenizer, "unk_token_id", None) or \
                len(self.tokenizer.encode(token, add_special_tokens=False)) != 1:
            raise ValueError(f"the tokenizer has no {token} token, which LFM2-VL's processor writes for each image; "
                             "use the release's tokenizer")
        return int(found)

    def token(self, text: str) -> int:
        if text not in self._ids:
            self._ids[text] = self._id(text)
        return self._ids[text]

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Lfm2VlImageProcessor:
        """From the folder's image processor settings and tokenizer, the special tokens written as transformers'
        ``Lfm2VlProcessor.from_pretrained`` writes them: always (it takes ``use_image_special_tokens`` per call only,
        not from ``processor_config.json``; a false one there is logged and not followed)."""
        from transformers import AutoTokenizer

        folder = Path(folder)
        extra = folder / "processor_config.json"
        if extra.exists() and json.loads(extra.read_text()).get("use_image_special_tokens", True) is False:
            logger.warning("%s sets use_image_special_tokens=false; transformers' Lfm2VlProcessor ignores it there "
                           "(only a per-call argument turns the special tokens off), and so does specray", extra)
        return cls(image_processor_settings(folder), AutoTokenizer.from_pretrained(folder), config)

    def _too_large(self, height: int, width: int) -> bool:
        factor = self.patch * self.down
        h, w = max(self.patch, _round_to(height, factor)), max(self.patch, _round_to(width, factor))
        return h * w > self.max_tokens * factor ** 2 * self.tolerance

    def tiles(self, image: torch.Tensor) -> tuple[list[torch.Tensor], int, int, tuple[int, int]]:
        """A uint8 [3, H, W] image -> its resized uint8 tiles (the thumbnail last), grid rows, columns and the
        thumbnail's (or the single tile's) size."""
        height, width = image.shape[-2:]
        size = smart_size(height, width, self.patch, self.down, self.min_tokens, self.max_tokens)
        if not (self._too_large(height, width) and not self.min_tiles == self.max_tiles == 1):
            return [bilinear_resize(image, *size)], 1, 1, size
        cols, rows = grid_for(height, width, self.min_tiles, self.max_tiles, self.tile)
        big, t = bilinear_resize(image, rows * self.tile, cols * self.tile), self.tile
        out = [big[:, r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
        if self.thumbnail and rows * cols != 1:
            out.append(bilinear_resize(image, *size))
        return out, rows, cols, size

    def replacement(self, rows: int, cols: int, size: tuple[int, int]) -> list[int]:
        per_tile = math.ceil(self.tile // self.patch / self.down) ** 2
        whole = math.ceil(size[0] // self.patch / self.down) * math.ceil(size[1] // self.patch / self.down)
        image, out = self.image_token_id, [self.token(START)] if self.special else []
        if rows > 1 or cols > 1:
            for r in range(rows):
                for c in range(cols):
                    out += ([self.token(f"<|img_row_{r + 1}_col_{c + 1}|>")] if self.special else []) + \
                        [image] * per_tile
            if self.thumbnail:
                out += ([self.token(THUMBNAIL)] if self.special else []) + [image] * whole
        else:
            out += [image] * whole
        return out + ([self.token(END)] if self.special else [])

    def process(self, image: Any) -> ProcessedImage:
        pixels = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).contiguous()
        tiles, rows, cols, size = self.tiles(pixels)
        values, mask, shapes = [], [], []
        for tile in tiles:
            x = (tile.float() - self.mean[:, None, None]) / self.std[:, None, None]
            c, h, w = x.shape
            gh, gw = h // self.patch, w // self.patch
            x = x.view(c, gh, self.patch, gw, self.patch).permute(1, 3, 2, 4, 0).reshape(gh * gw, -1)
            values.append(F.pad(x, (0, 0, 0, self.max_patches - gh * gw)))
            mask.append(torch.arange(self.max_patches) < gh * gw)
            shapes.append((gh, gw))
        replacement = self.replacement(rows, cols, size)
        return ProcessedImage(replacement=replacement,
                              data={"pixel_values": torch.stack(values).numpy(),
                                    "pixel_attention_mask": torch.stack(mask).to(torch.int32).numpy(),
                                    "spatial_shapes": np.array(shapes, dtype=np.int64)},
                              embed_rows=[i for i, t in enumerate(replacement) if t == self.image_token_id])

    def rope_positions(self, token_ids: list[int], items: list) -> None:
        return None


# ---- encoder ---------------------------------------------------------------------------------------------------------

def _axis_weights(size: int, grid: int) -> torch.Tensor:
    """[size, grid]: each output position's weights over the ``grid`` table positions along one axis (a triangle
    filter, widened by the scale where shrinking; normalized)."""
    scale = grid / size
    centre = (torch.arange(size, dtype=torch.float32) + 0.5) * scale - 0.5
    w = (1 - (torch.arange(grid, dtype=torch.float32) - centre[:, None]).abs() / max(scale, 1.0)).clamp(min=0)
    return w / w.sum(-1, keepdim=True)


class NaflexTower(nn.Module):
    """SigLIP2's NaFlex vision model: patches already cut (``C * p * p`` values each) embedded by a linear, the
    square position table resized to each image's patch grid, SigLIP's encoder layers, ``post_layernorm``."""

    load_weights = VisionTower.load_weights

    def __init__(self, config: Any):
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.grid = math.isqrt(config.num_patches)
        if self.grid ** 2 != config.num_patches:
            raise ValueError(f"vision_config.num_patches={config.num_patches} is not a square: SigLIP2's position "
                             "table is a square grid; the checkpoint's vision config is inconsistent")
        act = vision_activation(config.hidden_act, "vision_config.hidden_act")
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = Linear(getattr(config, "num_channels", 3) * patch * patch, hidden)
        self.embeddings.position_embedding = nn.Module()
        self.embeddings.position_embedding.weight = _param(config.num_patches, hidden)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionEncoderLayer(config, act) for _ in range(config.num_hidden_layers))
        self.post_layernorm = LayerNorm(hidden, config.layer_norm_eps)

    def positions(self, rows: int, cols: int) -> torch.Tensor:
        """The position table resized to ``rows x cols`` patches: [rows * cols, hidden], row by row."""
        table = self.embeddings.position_embedding.weight
        grid = table.float().view(self.grid, self.grid, -1)
        wr, wc = (_axis_weights(n, self.grid).to(table.device) for n in (rows, cols))
        return torch.einsum("rg,gkd,ck->rcd", wr, grid, wc).reshape(rows * cols, -1).to(table.dtype)

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        # patches: [rows * cols, C * p * p] -> [rows * cols, hidden]
        embed = self.embeddings.patch_embedding
        x = (embed(patches.to(embed.weight.dtype)) + self.positions(rows, cols))[None]
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x[0])


class Lfm2VlProjector(nn.Module):
    """Each ``k x k`` block of patch features concatenated, LayerNorm (optional), linear_1, act, linear_2."""

    def __init__(self, config: Any):
        super().__init__()
        vision, k = config.vision_config, int(config.downsample_factor)
        width = vision.hidden_size * k * k
        self.k = k
        self.layer_norm = LayerNorm(width, 1e-5) if config.projector_use_layernorm else None
        bias = bool(config.projector_bias)
        self.linear_1 = Linear(width, config.projector_hidden_size, bias)
        self.act = vision_activation(config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = Linear(config.projector_hidden_size, config.text_config.hidden_size, bias)

    def unshuffle(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        k = self.k
        x = x.view(rows // k, k, cols // k, k, -1).permute(0, 2, 1, 3, 4)
        return x.reshape((rows // k) * (cols // k), -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return self.linear_2(self.act(self.linear_1(x)))


class Lfm2VlImageEncoder(nn.Module):
    """LFM2-VL's :class:`specray.multimodal.ImageEncoder`: each tile through :class:`NaflexTower`, unshuffled and
    projected; the tiles' rows in order (the thumbnail last)."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        vision = config.vision_config
        kind = getattr(vision, "model_type", None)
        if kind != "siglip2_vision_model":
            raise ValueError(f"vision_config.model_type={kind!r} is not supported: LFM2-VL's tower is SigLIP2's "
                             "(siglip2_vision_model); use the release's config.json")
        k = int(config.downsample_factor)
        if k < 1:
            raise ValueError(f"downsample_factor={k} must be a positive integer; fix config.json")
        self.tower = NaflexTower(vision)
        self.projector = Lfm2VlProjector(config)

    def load_weights(self, weights) -> None:
        load_tower_and_projector(self, weights, "LFM2-VL", " (projector_hidden_size, downsample_factor)")

    def encode(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        shapes = data["spatial_shapes"].tolist()  # a host sync, once per image, before its prefill
        out = []
        for patches, (rows, cols) in zip(data["pixel_values"], shapes):
            if rows % self.projector.k or cols % self.projector.k:
                raise ValueError(f"a tile of {rows}x{cols} patches does not split into downsample_factor="
                                 f"{self.projector.k} blocks; the image processor must size tiles in multiples of "
                                 "encoder_patch_size * downsample_factor")
            features = self.tower(patches[: rows * cols], rows, cols)
            out.append(self.projector(self.projector.unshuffle(features, rows, cols)))
        return torch.cat(out)

