"""Llama 4's images (``Llama4ForConditionalGeneration``: Llama 4 Scout, Maverick; transformers' ``models/llama4``).
The text model is :mod:`specray.models.llama4`'s, served through ``registry._TEXT_PARTS`` (its chunked local
attention and NoPE layers see an image's rows as any other tokens); this module is the family's two seams of
:mod:`specray.multimodal`.

:class:`Llama4ImageEncoder` runs one image's tiles (each ``image_size`` square; the tiles of its canvas, then a
global tile of the whole image where the canvas has more than one) through transformers' ``Llama4VisionModel``:
each tile's ``patch_size`` squares unfolded (channel-major) and mapped by a bias-free linear, a learned class
embedding appended *after* the patches, a learned position embedding per token (``positional_embedding_vlm``),
``layernorm_pre``, pre-norm encoder layers (``x + attn(ln(x))``, ``x + fc2(gelu(fc1(ln(x))))``, biases everywhere,
LayerNorms of eps 1e-5 as transformers builds them) whose bidirectional attention rotates queries and keys by a 2D
RoPE over the patch grid (interleaved pairs; the first half of the pairs turn by the patch's column + 1, the second by
its row + 1, times ``rope_theta``'s frequencies; the class token is not turned), ``layernorm_post``, the class token
dropped, then the ``vision_adapter``: a pixel shuffle (``pixel_shuffle_ratio``: each 2 x 2 block of patches folded
into one token of 4x the channels, in transformers' order) and a bias-free two-layer MLP with a GELU after each layer.
The ``multi_modal_projector``'s bias-free ``linear_1`` maps the result into the text model's width: one embedding per
``<|patch|>`` token (``image_token_index``).

:class:`Llama4ImageProcessor` makes the pixels as transformers' ``Llama4ImageProcessor`` does (a torchvision image
processor in transformers, which specray does not depend on: its steps are done here with torch alone): the canvas of
at most ``max_patches`` tiles that needs the least resizing, the image resized onto it without distortion (bilinear,
antialiased, on uint8 as torchvision does it on a CPU), zero-padded right and bottom, rescaled and normalized in
bfloat16, cut into tiles row by row, plus the global tile (the whole image resized to one tile) when there are several.
The prompt's ``<|image|>`` placeholder becomes what ``Llama4Processor`` writes: ``<|image_start|>``, for a canvas
of several tiles each tile's ``<|patch|>`` tokens with ``<|tile_x_separator|>`` between tiles of a row and
``<|tile_y_separator|>`` after each row, then ``<|image|>`` and the global tile's ``<|patch|>`` tokens, then
``<|image_end|>``; only the ``<|patch|>`` rows take embeddings (``embed_rows``), in tile order.

Refused by name: another vision model type, a vision ``hidden_act`` other than GELU (transformers computes GELU
whatever it says), a projector bias, inconsistent adapter widths (on an image only: such a checkpoint's text is still
served), a resampling other than bilinear, a non-square tile, processor settings that disagree with the model (patch
size, shuffle ratio, the patch token), and an image of another size than ``vision_config.image_size``."""

from __future__ import annotations

import math
import platform
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import LayerNorm, _param, apply_rotary
from specray.models.registry import text_tensors
from specray.models.vision_towers import Linear, VisionMLP, copy_weights
from specray.multimodal import MultiModalItem, ProcessedImage, image_processor_settings, read_json, special_token_ids

ARCH = "Llama4ForConditionalGeneration"
VISION_TYPE = "llama4_vision_model"
# transformers builds every LayerNorm of the tower with torch's default eps (vision_config.norm_eps is not read)
NORM_EPS = 1e-5
# the tokens Llama4Processor writes (it spells them literally, whatever its own token settings say)
IMAGE, START, END, PATCH = "<|image|>", "<|image_start|>", "<|image_end|>", "<|patch|>"
X_SEP, Y_SEP = "<|tile_x_separator|>", "<|tile_y_separator|>"
# the checkpoint's names of this encoder's tensors -> ours
_OWN_NAMES = ((re.compile(r"^(?:model\.)?vision_model\."), "vision."),
              (re.compile(r"^(?:model\.)?multi_modal_projector\."), "projector."))


def _exact_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def _vision_config(config: Any) -> Any:
    vision = getattr(config, "vision_config", None)
    kind = getattr(vision, "model_type", None)
    if kind != VISION_TYPE:
        raise ValueError(f"vision_config.model_type={kind!r} is not supported for {ARCH}; its images are served with "
                         f"Llama 4's vision model ({VISION_TYPE!r}); fix the checkpoint's vision_config")
    act = getattr(vision, "hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"vision_config.hidden_act={act!r} is not supported: Llama 4's vision model computes the "
                         "exact GELU (transformers ignores the field); set it to 'gelu'")
    if getattr(vision, "multi_modal_projector_bias", False) or getattr(config, "multi_modal_projector_bias", False):
        raise ValueError("vision_config.multi_modal_projector_bias=True is not supported: Llama 4's projector is "
                         "bias-free (transformers builds it so); set it to false")
    size, patch = vision.image_size, vision.patch_size
    if not isinstance(size, int) or not isinstance(patch, int) or size % patch:
        raise ValueError(f"vision_config.image_size={size!r} and patch_size={patch!r} must be ints, the tile a whole "
                         "number of patches (square tiles of square patches)")
    hidden, heads = vision.hidden_size, vision.num_attention_heads
    if hidden % heads or (hidden // heads) % 4:
        raise ValueError(f"vision_config.hidden_size={hidden} over num_attention_heads={heads} must give a head size "
                         "that is a multiple of 4 (the 2D RoPE turns half of its pairs per axis)")
    ratio = float(vision.pixel_shuffle_ratio)
    fold = round(1 / ratio)
    side = size // patch
    if abs(fold * ratio - 1) > 1e-6 or side % fold:
        raise ValueError(f"vision_config.pixel_shuffle_ratio={ratio} must be 1 / n for an n dividing the "
                         f"{side} patches of a tile's side")
    return vision


def adapter_problem(vision: Any) -> str | None:
    """Why the vision adapter's widths cannot take the pixel shuffle's output (transformers builds such a model, and
    fails only on an image), or None. The text of such a checkpoint is still served; its images are refused."""
    fold = round(1 / float(vision.pixel_shuffle_ratio))
    if (vision.intermediate_size != vision.hidden_size * fold * fold
            or vision.projector_input_dim != vision.projector_output_dim
            or vision.projector_output_dim != vision.vision_output_dim):
        return (f"vision_config's adapter widths are inconsistent (intermediate_size={vision.intermediate_size} must "
                f"be hidden_size * {fold * fold} = {vision.hidden_size * fold * fold}; projector_input_dim="
                f"{vision.projector_input_dim}, projector_output_dim={vision.projector_output_dim} and "
                f"vision_output_dim={vision.vision_output_dim} must be equal): transformers' model cannot embed an "
                "image either; fix the checkpoint's vision_config, or send this checkpoint text only")
    return None


def tokens_per_tile(vision: Any) -> int:
    """The embeddings (``<|patch|>`` tokens) of one tile: its patches, folded by the pixel shuffle."""
    fold = round(1 / float(vision.pixel_shuffle_ratio))
    return (vision.image_size // vision.patch_size) ** 2 // (fold * fold)


class Llama4VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one tile's tokens, biases on every projection, queries and keys
    turned by the tower's 2D RoPE."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj = Linear(hidden, hidden), Linear(hidden, hidden)
        self.v_proj, self.o_proj = Linear(hidden, hidden), Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [B, N, C]; cos, sin: [N, 1, head_dim / 2] -> [B, N, C]
        b, n, _ = x.shape

        def turned(proj: Linear) -> torch.Tensor:
            # interleaved pairs, turned as the halves of the de-interleaved head (q and k alike: a dot product does
            # not see the order), in float32 as transformers turns them
            y = proj(x).view(b, n, self.heads, self.head_dim).float()
            y = torch.cat((y[..., 0::2], y[..., 1::2]), dim=-1)
            return apply_rotary(y, cos, sin).to(x.dtype).transpose(1, 2)

        v = self.v_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(turned(self.q_proj), turned(self.k_proj), v,
                                             scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class Llama4VisionLayer(nn.Module):
    """``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``."""

    def __init__(self, vision: Any):
        super().__init__()
        hidden = vision.hidden_size
        self.input_layernorm, self.post_attention_layernorm = LayerNorm(hidden, NORM_EPS), LayerNorm(hidden, NORM_EPS)
        self.self_attn = Llama4VisionAttention(hidden, vision.num_attention_heads)
        self.mlp = VisionMLP(hidden, vision.intermediate_size, _exact_gelu)

    def _ln(self, norm: LayerNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x.reshape(-1, x.shape[-1])).view(x.shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self._ln(self.input_layernorm, x), cos, sin)
        return x + self.mlp(self._ln(self.post_attention_layernorm, x))


def pixel_shuffle(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """transformers' Llama 4 pixel shuffle of ``x`` [B, N, C] (N a square of side s): [B, N * r^2, C / r^2]. The
    grid's width is folded into the channels, the result transposed, folded again, transposed back."""
    b, n, c = x.shape
    side = math.isqrt(n)
    fold = round(1 / ratio)
    # [B, h, w, C] -> [B, h, w / f, C f] -> (swap) [B, w / f, h, C f] -> [B, w / f, h / f, C f^2] -> (swap)
    y = x.reshape(b, side, side // fold, c * fold).transpose(1, 2)
    y = y.reshape(b, side // fold, side // fold, c * fold * fold).transpose(1, 2)
    return y.reshape(b, -1, c * fold * fold)


def rope_angles(side: int, head_dim: int, theta: float, offset: int = 1) -> torch.Tensor:
    """The tower's 2D RoPE angles [side^2 + 1, 1, head_dim / 2] in float32: patch p (row-major) turns its first
    head_dim / 4 pairs by (column + ``offset``) and the rest by (row + ``offset``) times ``theta ** (-4 j / head_dim)``;
    the class token (last) is not turned."""
    half = head_dim // 2
    freqs = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
    cells = torch.arange(side * side)
    cols, rows = (cells % side + offset).float(), (cells // side + offset).float()
    angles = torch.cat([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1)
    return torch.cat([angles, torch.zeros(1, angles.shape[1])])[:, None]


class Llama4VisionAdapter(nn.Module):
    """The pixel shuffle, then ``gelu(fc2(gelu(fc1(x))))``, bias-free (transformers' ``vision_adapter``)."""

    def __init__(self, vision: Any):
        super().__init__()
        self.ratio = float(vision.pixel_shuffle_ratio)
        self.mlp = nn.Module()
        self.mlp.fc1 = Linear(vision.intermediate_size, vision.projector_input_dim, bias=False)
        self.mlp.fc2 = Linear(vision.projector_output_dim, vision.projector_output_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _exact_gelu(self.mlp.fc2(_exact_gelu(self.mlp.fc1(pixel_shuffle(x, self.ratio)))))


class Llama4VisionTower(nn.Module):
    """transformers' ``Llama4VisionModel`` (its vision config), for the tiles of one image at a time; parameter names
    as transformers' (``patch_embedding.linear.weight``, ``model.layers.<i>.self_attn.q_proj.weight``, ...)."""

    def __init__(self, vision: Any):
        super().__init__()
        hidden, patch = vision.hidden_size, vision.patch_size
        channels = getattr(vision, "num_channels", 3)
        self.image_size, self.patch_size = vision.image_size, patch
        side = vision.image_size // patch
        self.patch_embedding = nn.Module()
        self.patch_embedding.linear = Linear(channels * patch * patch, hidden, bias=False)
        self.class_embedding = _param(hidden)
        self.positional_embedding_vlm = _param(side * side + 1, hidden)
        self.layernorm_pre, self.layernorm_post = LayerNorm(hidden, NORM_EPS), LayerNorm(hidden, NORM_EPS)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Llama4VisionLayer(vision) for _ in range(vision.num_hidden_layers))
        self.vision_adapter = Llama4VisionAdapter(vision)
        params = dict(getattr(vision, "rope_parameters", None) or {})
        kind = params.get("rope_type", "default")
        if kind != "default":
            raise ValueError(f"vision_config.rope_parameters.rope_type={kind!r} is not supported: Llama 4's vision "
                             "tower turns by patch column and row ('default'); fix the checkpoint's vision_config")
        theta = float(params.get("rope_theta", getattr(vision, "rope_theta", 10000.0)))
        angles = rope_angles(side, hidden // vision.num_attention_heads, theta)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def _ln(self, norm: LayerNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x.reshape(-1, x.shape[-1])).view(x.shape)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [tiles, C, S, S] -> [tiles, (S / patch)^2 * r^2, projector_output_dim]
        height, width = pixel_values.shape[-2:]
        if (height, width) != (self.image_size, self.image_size):
            raise ValueError(f"tiles of {height}x{width} pixels reached a vision tower of vision_config.image_size="
                             f"{self.image_size}; the image processor's size must be {self.image_size} square")
        weight = self.patch_embedding.linear.weight
        x = self.patch_embedding.linear(F.unfold(pixel_values.to(weight.dtype), self.patch_size,
                                                 stride=self.patch_size).transpose(1, 2))
        x = torch.cat([x, self.class_embedding.expand(x.shape[0], 1, -1)], dim=1) + self.positional_embedding_vlm
        x = self._ln(self.layernorm_pre, x)
        cos, sin = self.rope_cos, self.rope_sin
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.vision_adapter(self._ln(self.layernorm_post, x)[:, :-1])  # the class token dropped


class Llama4ImageEncoder(nn.Module):
    """Llama 4's vision tower and projector (:class:`specray.multimodal.ImageEncoder`), built from the whole
    checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        vision = _vision_config(config)
        self.problem = adapter_problem(vision)  # refused on an image, not here: the text model may still be served
        self.vision = Llama4VisionTower(vision)
        self.projector = nn.Module()
        self.projector.linear_1 = Linear(vision.vision_output_dim, config.text_config.hidden_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.projector.linear_1.weight.device

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Read ``vision_model.*`` and ``multi_modal_projector.*`` among the whole checkpoint's tensors (the text
        model's skipped); a ValueError names any of ours missing."""
        missing = copy_weights(dict(self.named_parameters()), text_tensors(weights, _OWN_NAMES))
        if missing:
            theirs = [re.sub(r"^vision\.", "vision_model.", n).replace("projector.", "multi_modal_projector.", 1)
                      for n in missing]
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of {ARCH}'s vision model or projector: "
                             f"{theirs[:6]}; it does not match its config.json's vision_config")

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's ``pixel_values`` [tiles, C, S, S] -> its embeddings [tiles * tokens_per_tile, text hidden],
        tile after tile (the global tile last), as transformers scatters them over the ``<|patch|>`` tokens."""
        if self.problem is not None:
            raise ValueError(self.problem)
        pixels = data["pixel_values"]
        if pixels.dim() == 3:
            pixels = pixels.unsqueeze(0)
        features = self.vision(pixels)
        return self.projector.linear_1(features.reshape(-1, features.shape[-1]))


# ---- the processor ---------------------------------------------------------------------------------------------------

def _factor_pairs(n: int) -> list[tuple[int, int]]:
    return [(a, n // a) for a in sorted(d for d in range(1, n + 1) if n % d == 0)]


def canvases(max_tiles: int, tile: int) -> list[tuple[int, int]]:
    """The canvases (height, width in pixels) of at most ``max_tiles`` tiles, in transformers' order (grouped by
    aspect ratio, first seen from the most tiles down)."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for rows, cols in _factor_pairs(count):
            by_ratio.setdefault(rows / cols, []).append((rows, cols))
    return [(rows * tile, cols * tile) for pairs in by_ratio.values() for rows, cols in pairs]


def best_canvas(height: int, width: int, options: list[tuple[int, int]], to_max: bool) -> tuple[int, int]:
    """The canvas an image of ``height`` x ``width`` goes onto: the least upscaling where some canvas upscales (the
    most with ``to_max``), else the least downscaling; of those the smallest area (the first such in ``options``)."""
    opts = torch.tensor(options)
    scale_h, scale_w = opts[:, 0] / height, opts[:, 1] / width
    scales = torch.where(scale_h > scale_w, scale_w, scale_h)  # the limiting side, computed as transformers does
    up = scales[scales >= 1]
    chosen = (up.max() if to_max else up.min()) if len(up) else scales[scales < 1].max()
    fits = opts[scales == chosen]
    best = fits[torch.argmin(fits[:, 0] * fits[:, 1])] if len(fits) > 1 else fits[0]
    return int(best[0]), int(best[1])


def _fit_without_distortion(height: int, width: int, target_h: int, target_w: int) -> tuple[int, int]:
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.floor(height * scale_w), target_h), target_w
    return target_h, min(math.floor(width * scale_h), target_w)


def _resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's bilinear, antialiased resize of a uint8 [C, H, W] image on a CPU: natively in uint8 where
    the CPU has AVX2 / AVX-512 (or is an ARM one), else in float32, rounded back."""
    if tuple(image.shape[-2:]) == (height, width):
        return image
    native = (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
              or platform.machine() in ("aarch64", "arm64"))
    x = image[None] if native else image[None].float()
    x = F.interpolate(x, size=[height, width], mode="bilinear", align_corners=False, antialias=True)
    return x[0] if native else x[0].round_().to(torch.uint8)


class Llama4ImageProcessor:
    """Llama 4's host side (:class:`specray.multimodal.ImageProcessor`): transformers' ``Llama4ImageProcessor``'s
    tiles (made here, see the module's docstring) and ``Llama4Processor``'s tokens for the ``<|image|>``
    placeholder."""

    def __init__(self, settings: dict, tokens: dict[str, int], config: Any, patch_size: int, shuffle_ratio: float):
        vision = _vision_config(config)
        problem = adapter_problem(vision)
        if problem is not None:
            raise ValueError(problem)
        size = settings.get("size") or {"height": 336, "width": 336}
        tile = size.get("height"), size.get("width")
        if tile[0] != tile[1] or tile[0] != vision.image_size:
            raise ValueError(f"the image processor's size={size} must be a square of vision_config.image_size="
                             f"{vision.image_size} (the tower's tiles); fix preprocessor_config.json")
        resample = settings.get("resample", 2)
        if resample not in (2, "bilinear"):
            raise ValueError(f"the image processor's resample={resample!r} is not supported: only bilinear (2), "
                             "Llama 4's, is; fix preprocessor_config.json")
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if not settings.get(flag, True):
                raise ValueError(f"the image processor's {flag}=False is not supported (Llama 4 resizes, rescales "
                                 "and normalizes every image); fix preprocessor_config.json")
        if patch_size != vision.patch_size or abs(shuffle_ratio - float(vision.pixel_shuffle_ratio)) > 1e-6:
            raise ValueError(f"processor_config.json's patch_size={patch_size}, pixel_shuffle_ratio={shuffle_ratio} "
                             f"disagree with vision_config's ({vision.patch_size}, {vision.pixel_shuffle_ratio}): the "
                             "prompt would hold another number of <|patch|> tokens than the model embeds; fix "
                             "processor_config.json")
        if tokens[PATCH] != int(config.image_token_index):
            raise ValueError(f"the tokenizer's {PATCH} is id {tokens[PATCH]} but image_token_index="
                             f"{config.image_token_index}: transformers fills image_token_index's rows with the image, "
                             f"and Llama4Processor writes {PATCH}; fix config.json or the tokenizer")
        self.tile = int(tile[0])
        self.max_tiles = int(settings.get("max_patches", 16))
        self.to_max = bool(settings.get("resize_to_max_canvas", False))
        self.rescale = float(settings.get("rescale_factor", 1 / 255))
        self.mean = [float(v) for v in settings.get("image_mean", [0.5] * 3)]
        self.std = [float(v) for v in settings.get("image_std", [0.5] * 3)]
        self.tokens = tokens
        self.image_token_id = tokens[IMAGE]
        self.per_tile = tokens_per_tile(vision)
        self.options = canvases(self.max_tiles, self.tile)

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Llama4ImageProcessor:
        """From the folder's ``preprocessor_config.json`` (or the ``image_processor`` of its
        ``processor_config.json``), ``processor_config.json`` (patch size, shuffle ratio) and tokenizer."""
        from transformers import AutoTokenizer

        folder = Path(folder)
        processor, settings = read_json(folder / "processor_config.json"), image_processor_settings(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        names = (IMAGE, START, END, PATCH, X_SEP, Y_SEP)
        tokens = dict(zip(names, special_token_ids(tokenizer, names, folder, "Llama4Processor")))
        return cls(settings, tokens, config, int(processor.get("patch_size", 14)),
                   float(processor.get("pixel_shuffle_ratio", 0.5)))

    def _normalize(self, image: torch.Tensor) -> torch.Tensor:
        # in bfloat16, as transformers' Llama 4 processor does it
        x = image.to(torch.bfloat16) * self.rescale
        mean = torch.tensor(self.mean, dtype=x.dtype)[:, None, None]
        std = torch.tensor(self.std, dtype=x.dtype)[:, None, None]
        return (x - mean) / std

    def tiles(self, image: Any) -> tuple[np.ndarray, tuple[int, int]]:
        """One PIL image -> its tiles [n, C, S, S] (float32 holding bfloat16 values) and its grid (rows, cols)."""
        pixels = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1)
        height, width = pixels.shape[-2:]
        canvas_h, canvas_w = best_canvas(height, width, self.options, self.to_max)
        if self.to_max:
            bound_h, bound_w = canvas_h, canvas_w
        else:  # never upscaled past one tile's side
            bound_h, bound_w = min(max(height, self.tile), canvas_h), min(max(width, self.tile), canvas_w)
        new_h, new_w = _fit_without_distortion(height, width, bound_h, bound_w)
        resized = _resize(pixels, max(new_h, 1), max(new_w, 1))
        padded = F.pad(resized, (0, canvas_w - resized.shape[-1], 0, canvas_h - resized.shape[-2]))
        x = self._normalize(padded)
        rows, cols = canvas_h // self.tile, canvas_w // self.tile
        channels = x.shape[0]
        tiles = x.view(channels, rows, self.tile, cols, self.tile).permute(1, 3, 0, 2, 4)
        tiles = tiles.reshape(rows * cols, channels, self.tile, self.tile)
        if rows * cols > 1:
            tiles = torch.cat([tiles, self._normalize(_resize(pixels, self.tile, self.tile))[None]])
        return tiles.float().numpy(), (rows, cols)

    def replacement(self, rows: int, cols: int) -> list[int]:
        """The tokens ``Llama4Processor`` writes for an image of ``rows`` x ``cols`` tiles."""
        t, patches = self.tokens, [self.tokens[PATCH]] * self.per_tile
        out = [t[START]]
        if rows * cols > 1:
            for _ in range(rows):
                for col in range(cols):
                    out += patches + ([t[X_SEP]] if col < cols - 1 else [])
                out.append(t[Y_SEP])
        return out + [t[IMAGE]] + patches + [t[END]]

    def process(self, image: Any) -> ProcessedImage:
        tiles, (rows, cols) = self.tiles(image)
        tokens = self.replacement(rows, cols)
        rows_of_patches = [i for i, t in enumerate(tokens) if t == self.tokens[PATCH]]
        return ProcessedImage(tokens, {"pixel_values": tiles}, embed_rows=rows_of_patches)

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE

