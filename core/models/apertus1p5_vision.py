"""Apertus 1.5's images (``Apertus1p5ForConditionalGeneration``, transformers' ``models/apertus1p5``): an image becomes
discrete tokens, Chameleon-style, not continuous features. Its vision tokenizer (EMU3.5's encode-only VQGAN: a 2D
convolutional encoder as Chameleon's, ``quant_conv``, and an IBQ codebook scored by dot product, the best code taken by
argmax) gives one code per ``2 ** (stages - 1)`` square of pixels; code ``i`` is the vocabulary id
``image_token_offset + i``. ``encode`` returns those ids (an encoder of discrete codes, :class:`~specray.multimodal.
ImageEncoder`): the runner writes them over the image tokens' ids, and the text model (:mod:`specray.models.apertus1p5`,
served through ``registry._TEXT_PARTS``) embeds them as the prompt's own tokens, exactly as the prompt would had it held
the codes. Images only: the release's audio tokenizer is not served.

:class:`Apertus1p5ImageEncoder` holds the VQGAN encoder under transformers' names (``conv_in``; per stage
``num_res_blocks`` residual blocks (GroupNorm of 32 groups, eps 1e-6, swish, 3x3 convs, a 1x1 ``nin_shortcut`` where
the width changes), each followed by a single-head spatial attention block where the stage's resolution (``resolution /
2 ** stage``) is in ``attn_resolutions``, and a stride-2 3x3 conv after a right/bottom zero pad on all but the last
stage; the middle block, residual / attention / residual; ``norm_out``, swish, ``conv_out``), ``quant_conv`` and the
codebook (``quantize.embedding``), always in float32 (transformers keeps them so: half precision flips codes), on every
tensor-parallel rank. ``encode`` takes one image at its own size (transformers encodes each image alone, cropped from
the padded batch) and returns its codes' vocabulary ids, row-major.

:class:`Apertus1p5ImageProcessor` makes the pixels as transformers' image processor does (a torchvision processor
there, which specray does not depend on: done here with torch): both sides rounded to multiples of ``spatial_factor``
within ``[min_pixels, max_pixels]`` (Qwen2-VL's ``smart_resize`` rule), a bicubic antialiased resize of the uint8 image
(torchvision's native uint8 kernel on a CPU) where the size changes, then ``(x - 127.5) / 127.5`` as transformers fuses
rescale and normalize. The prompt's image token becomes what ``Apertus1p5Processor`` writes: ``<boi>``, the grid as
text (``"{rows}*{cols}"``), the wrapper token, the rows of image tokens joined by the end-of-line token, ``<eoi>``
(tokenized alone: the markers are special tokens); the image-token rows take the embeddings.

Refused by name: processor settings that disagree with the model (``spatial_factor``), no resizing (``do_resize``
false), a resampling other than bicubic, a tokenizer lacking the image tokens or whose image token is not
``image_token_id``, a code range past the vocabulary."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import _param
from specray.models.registry import text_tensors
from specray.models.vision_towers import copy_weights
from specray.multimodal import MultiModalItem, ProcessedImage, image_processor_settings, special_token_ids

logger = logging.getLogger(__name__)

ARCH = "Apertus1p5ForConditionalGeneration"
GROUPS, EPS = 32, 1e-6  # the VQGAN's GroupNorms (transformers builds them so whatever the config says)
PREFIX = "model.vision_tokenizer."
BICUBIC = 3
# the processor's special tokens, by the tokenizer attribute that names each
TOKENS = ("image_token", "boi_token", "eoi_token", "image_wrapper_token", "eol_token")


def _conv(channels_in: int, channels_out: int, kernel: int) -> nn.Module:
    conv = nn.Module()
    conv.weight, conv.bias = _param(channels_out, channels_in, kernel, kernel), _param(channels_out)
    return conv


def _norm(channels: int) -> nn.Module:
    if channels % GROUPS:
        raise ValueError(f"a vision tokenizer width of {channels} channels is not a multiple of the GroupNorms' "
                         f"{GROUPS} groups: vision_config.base_channels * channel_multiplier must be; the vision "
                         "config is inconsistent")
    norm = nn.Module()
    norm.weight, norm.bias = _param(channels), _param(channels)
    return norm


def _group_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.group_norm(x, GROUPS, norm.weight, norm.bias, EPS)


def _swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)  # as transformers writes it (F.silu may round differently: codes are an argmax)


def _apply(conv: nn.Module, x: torch.Tensor, stride: int = 1, padding: int = 1) -> torch.Tensor:
    return F.conv2d(x, conv.weight, conv.bias, stride=stride, padding=padding)


class ResnetBlock(nn.Module):
    """``shortcut(x) + conv2(swish(norm2(conv1(swish(norm1(x))))))`` (dropout: inference only)."""

    def __init__(self, channels_in: int, channels_out: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(channels_in), _conv(channels_in, channels_out, 3)
        self.norm2, self.conv2 = _norm(channels_out), _conv(channels_out, channels_out, 3)
        self.nin_shortcut = _conv(channels_in, channels_out, 1) if channels_in != channels_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _apply(self.conv1, _swish(_group_norm(self.norm1, x)))
        h = _apply(self.conv2, _swish(_group_norm(self.norm2, h)))
        return (x if self.nin_shortcut is None else _apply(self.nin_shortcut, x, padding=0)) + h


class AttnBlock(nn.Module):
    """Single-head attention over the feature map's positions (1x1 convs for q, k, v and the output)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v = (_conv(channels, channels, 1) for _ in range(3))
        self.proj_out = _conv(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in transformers' order of products (the codes are an argmax: the last bits may matter)
        b, c, h, w = x.shape
        y = _group_norm(self.norm, x)
        q, k, v = (_apply(p, y, padding=0).reshape(b, c, h * w) for p in (self.q, self.k, self.v))
        weights = torch.softmax(torch.bmm(q.transpose(1, 2), k) * c ** -0.5, dim=2)  # [b, query, key]
        out = torch.bmm(v, weights.transpose(1, 2)).reshape(b, c, h, w)
        return x + _apply(self.proj_out, out, padding=0)


class EncoderBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, attention: bool):
        super().__init__()
        self.resnet = ResnetBlock(channels_in, channels_out)
        self.attention = AttnBlock(channels_out) if attention else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnet(x)
        return x if self.attention is None else self.attention(x)


class Stage(nn.Module):
    def __init__(self, vision: Any, index: int):
        super().__init__()
        mult = list(vision.channel_multiplier)
        channels_in = vision.base_channels * (1 if index == 0 else mult[index - 1])
        channels = vision.base_channels * mult[index]
        attention = vision.resolution // 2 ** index in list(vision.attn_resolutions)
        self.layers = nn.ModuleList(EncoderBlock(channels_in if i == 0 else channels, channels, attention)
                                    for i in range(vision.num_res_blocks))
        self.downsample = None
        if index < len(mult) - 1:
            self.downsample = nn.Module()
            self.downsample.conv = _conv(channels, channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        if self.downsample is not None:  # a zero pad right and bottom, then a stride-2 conv
            x = _apply(self.downsample.conv, F.pad(x, (0, 1, 0, 1)), stride=2, padding=0)
        return x


class VisionTokenizer(nn.Module):
    """The VQGAN encoder, ``quant_conv`` and the codebook (transformers' ``Apertus1p5VisionTokenizerModel``, its
    names): pixels [1, 3, H, W] -> codes [H / f, W / f] (f = ``2 ** (stages - 1)``)."""

    def __init__(self, vision: Any):
        super().__init__()
        mult = list(vision.channel_multiplier)
        width = vision.base_channels * mult[-1]
        self.encoder = nn.Module()
        self.encoder.conv_in = _conv(vision.in_channels, vision.base_channels, 3)
        self.encoder.stages = nn.ModuleList(Stage(vision, i) for i in range(len(mult)))
        self.encoder.mid = nn.Module()
        self.encoder.mid.block_1, self.encoder.mid.block_2 = ResnetBlock(width, width), ResnetBlock(width, width)
        self.encoder.mid.attn_1 = AttnBlock(width)
        self.encoder.norm_out = _norm(width)
        self.encoder.conv_out = _conv(width, vision.latent_channels, 3)
        self.quant_conv = _conv(vision.latent_channels, vision.embed_dim, 1)
        self.quantize = nn.Module()
        self.quantize.embedding = nn.Module()
        self.quantize.embedding.weight = _param(vision.codebook_size, vision.embed_dim)

    def latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels [1, 3, H, W] -> the quantizer's input [D, H / f, W / f]."""
        e = self.encoder
        x = _apply(e.conv_in, pixels)
        for stage in e.stages:
            x = stage(x)
        x = e.mid.block_2(e.mid.attn_1(e.mid.block_1(x)))
        x = _apply(e.conv_out, _swish(_group_norm(e.norm_out, x)))
        return _apply(self.quant_conv, x, padding=0)[0]

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.latents(pixels)
        scores = F.linear(x.flatten(1).t(), self.quantize.embedding.weight)  # the IBQ codebook's dot products
        return scores.argmax(-1).reshape(x.shape[1:])


def _check(config: Any) -> None:
    vision, text = config.vision_config, config.text_config
    offset, codes = int(config.image_token_offset), int(vision.codebook_size)
    if not 0 <= offset or offset + codes > text.vocab_size:
        raise ValueError(f"image_token_offset={offset} with vision_config.codebook_size={codes} runs past "
                         f"text_config.vocab_size={text.vocab_size}: the image codes must be vocabulary ids; fix "
                         "config.json")


class Apertus1p5ImageEncoder(nn.Module):
    """The vision tokenizer (float32) (:class:`specray.multimodal.ImageEncoder` of discrete codes), built from the
    whole checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        _check(config)
        # (float32 parameters: the runner casts the pixels to that dtype)
        self.tokenizer = VisionTokenizer(config.vision_config).float()
        self.offset = int(config.image_token_offset)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Read the vision tokenizer's tensors (``model.vision_tokenizer.*``, transformers' and the release's names).
        A ValueError names any of ours missing."""
        missing = copy_weights(dict(self.tokenizer.named_parameters()), text_tensors(weights, PREFIX))
        if missing:
            raise ValueError(f"the checkpoint lacks {ARCH}'s image tensor(s) {missing[:6]} (model.vision_tokenizer.*); "
                             "it does not match its config.json's vision_config")

    def image_codes(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image's pixels [3, H, W] -> its codes [H / f, W / f] (codebook indices, no offset)."""
        return self.tokenizer(pixels.float()[None])

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's ``pixel_values`` [3, H, W] (its own size) -> its codes' vocabulary ids [H / f * W / f]
        (int64), row-major."""
        return self.image_codes(data["pixel_values"]).flatten() + self.offset


def smart_resize(height: int, width: int, factor: int, least: int, most: int) -> tuple[int, int]:
    """The size transformers' processor resizes an image to: each side rounded to a multiple of ``factor``, scaled
    down into ``most`` pixels (sides floored) or up to ``least`` (sides ceiled), keeping the aspect."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {height}x{width} pixels: its aspect ratio must be below 200 (as transformers' "
                         "Apertus 1.5 processor requires); crop it")
    rows, cols = round(height / factor) * factor, round(width / factor) * factor
    if rows * cols > most:
        beta = math.sqrt(height * width / most)
        rows = max(factor, math.floor(height / beta / factor) * factor)
        cols = max(factor, math.floor(width / beta / factor) * factor)
    elif rows * cols < least:
        beta = math.sqrt(least / (height * width))
        rows, cols = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return rows, cols



class Apertus1p5ImageProcessor:
    """Apertus 1.5's host side (:class:`specray.multimodal.ImageProcessor`): transformers' image processor's pixels
    (done here with torch, see the module's docstring) and ``Apertus1p5Processor``'s tokens for the image token."""

    def __init__(self, settings: dict, config: Any, tokenizer: Any, ids: dict[str, int]):
        factor = int(settings.get("spatial_factor", 16))
        stages = len(list(config.vision_config.channel_multiplier))
        if factor != 2 ** (stages - 1):
            raise ValueError(f"the image processor's spatial_factor={factor} is not the vision tokenizer's "
                             f"downsampling 2 ** (len(vision_config.channel_multiplier) - 1) = {2 ** (stages - 1)}: "
                             "the prompt would hold another number of image tokens than the codes; fix "
                             "preprocessor_config.json")
        if not settings.get("do_resize", True):
            raise ValueError(f"the image processor's do_resize=False is not supported for {ARCH}: an image must be "
                             "resized to multiples of spatial_factor; fix preprocessor_config.json")
        resample = settings.get("resample", BICUBIC)
        if resample not in (BICUBIC, "bicubic"):
            raise ValueError(f"the image processor's resample={resample!r} is not supported for {ARCH}: only bicubic "
                             f"({BICUBIC}, the release's) is; fix preprocessor_config.json")
        size = settings.get("size") or {}
        self.factor = factor
        self.least, self.most = int(size.get("min_pixels", 128 * 128)), int(size.get("max_pixels", 1400 * 1400))
        self.rescale = float(settings.get("rescale_factor", 1 / 255)) if settings.get("do_rescale", True) else None
        self.normalize = settings.get("do_normalize", True)
        self.mean = [float(v) for v in settings.get("image_mean", [0.5] * 3)]
        self.std = [float(v) for v in settings.get("image_std", [0.5] * 3)]
        self.tokenizer, self.ids = tokenizer, ids
        self.image_token_id = ids["image_token"]

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Apertus1p5ImageProcessor:
        """From the folder's ``preprocessor_config.json`` (or the ``image_processor`` of its
        ``processor_config.json``) and tokenizer (its image tokens, named by the attributes Apertus1p5Processor
        reads)."""
        from transformers import AutoTokenizer

        folder = Path(folder)
        _check(config)
        settings = image_processor_settings(folder)
        tok = AutoTokenizer.from_pretrained(folder)
        ids = dict(zip(TOKENS, special_token_ids(tok, [getattr(tok, attr, None) for attr in TOKENS], folder,
                                                 "Apertus1p5Processor")))
        if ids["image_token"] != int(config.image_token_id):
            raise ValueError(f"the tokenizer's image_token is id {ids['image_token']} but image_token_id="
                             f"{config.image_token_id}: transformers fills image_token_id's rows with the image; fix "
                             "config.json or the tokenizer")
        return cls(settings, config, tok, ids)

    def pixels(self, image: Any) -> np.ndarray:
        """One PIL image -> its pixels [3, H, W] (float32), H and W multiples of ``spatial_factor``."""
        x = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1).contiguous()[None]
        height, width = x.shape[-2:]
        rows, cols = smart_resize(height, width, self.factor, self.least, self.most)
        if (rows, cols) != (height, width):  # natively on uint8, as torchvision resizes on a CPU
            x = F.interpolate(x, size=[rows, cols], mode="bicubic", align_corners=False, antialias=True)
        x = x[0].to(torch.float32)
        if self.normalize:  # transformers folds the rescale into the mean and std
            scale = 1.0 if self.rescale is None else 1.0 / self.rescale
            x = (x - (torch.tensor(self.mean) * scale).view(-1, 1, 1)) / (torch.tensor(self.std) * scale).view(-1, 1, 1)
        elif self.rescale is not None:
            x = x * self.rescale
        return x.numpy()

    def process(self, image: Any) -> ProcessedImage:
        pixels = self.pixels(image)
        rows, cols = pixels.shape[1] // self.factor, pixels.shape[2] // self.factor
        tok, names = self.tokenizer, {attr: getattr(self.tokenizer, attr) for attr in TOKENS}
        grid = names["eol_token"].join([names["image_token"] * cols] * rows)
        text = f"{names['boi_token']}{rows}*{cols}{names['image_wrapper_token']}{grid}{names['eoi_token']}"
        replacement = tok.encode(text, add_special_tokens=False)
        embed_rows = [i for i, t in enumerate(replacement) if t == self.image_token_id]
        assert len(embed_rows) == rows * cols, (len(embed_rows), rows, cols)
        return ProcessedImage(replacement, {"pixel_values": pixels}, embed_rows=embed_rows)

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE
