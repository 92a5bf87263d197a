"""Emu3's images (``Emu3ForConditionalGeneration``, transformers' ``models/emu3``): an image becomes discrete tokens of
the text model's vocabulary, as Chameleon's and Apertus 1.5's do. Its VQ-VAE (a video tokenizer: the image is repeated
``temporal_downsample_factor`` times in time and squeezed back to one frame by causal temporal convolutions) gives one
code per 8 x 8 square of pixels; each code maps to its ``<|visual token NNNNNN|>`` vocabulary id, and each row of codes
ends with the end-of-line id (``<|extra_200|>``). ``encode`` returns those ids (an encoder of discrete codes,
:class:`~specray.multimodal.ImageEncoder`): the runner writes them over the image tokens' ids and the text model
(:mod:`specray.models.emu3`, served through ``registry._TEXT_PARTS``) embeds them as its own tokens.

:class:`Emu3ImageEncoder` holds the VQ-VAE's encoder side under transformers' names (``vqmodel.`` or
``model.vqmodel.``): ``conv_in``; per level ``num_res_blocks`` residual blocks (Apertus 1.5's
:class:`~specray.models.apertus1p5_vision.ResnetBlock`: GroupNorm of 32 groups, eps 1e-6, swish, 3x3 convs, a 1x1
``nin_shortcut``), each followed where the level's index is in ``attn_resolutions`` by a GroupNorm and a multi-head
attention over the positions (linear q/k/v/out of ``hidden_size``, ``num_attention_heads`` heads); a right/bottom zero
pad and a stride-2 3x3 conv after all levels but the last; the middle block (residual, normed attention, residual);
``norm_out``, swish, ``conv_out``; then in time: ``log2(temporal_downsample_factor)`` stride-2 causal 3D convs each
followed by swish, ``num_res_blocks`` temporal residual blocks (BatchNorm3d with its running statistics, swish,
causal 3x3x3 convs), the causal 3x1x1 ``quant_conv``, and the codebook's nearest code in L2 (computed as transformers
does: the argmin must agree). The 2D part runs once (the repeated frames are equal); everything in float32 on
every tensor-parallel rank (transformers runs the VQ-VAE in the model's dtype: under bfloat16 its codes may differ
from these, the float32 ones, since half precision flips an argmin's close calls). ``encode`` takes one image at its
own size and returns ``rows * (cols + 1)`` ids, row-major with an end-of-line id after each row (transformers
encodes a prompt's images as one batch zero-padded to the largest: for images of different sizes its codes then depend
on that padding; ours are each image's alone, which transformers gives for one image or images of one size).

:class:`Emu3ImageProcessor` takes transformers' own ``Emu3ImageProcessor`` (PIL and numpy: no torchvision) for the
pixels, one image at a time, and writes what ``Emu3Processor`` writes for the image token: ``<|image start|>``, the grid
as text (``"{rows}*{cols}"``), ``<|image token|>``, ``rows * (cols + 1)`` image tokens, ``<|extra_201|>`` (the eof
token), ``<|image end|>`` (tokenized alone: the markers are special tokens); every image token takes a row. (The
``bos_token`` Emu3Processor writes before the whole text is the prompt's own, not the image's.)

Refused by name: a downsampling other than 8 (``Emu3Processor`` writes the grid for 8 whatever the model's), a double
latent, a temporal factor not a power of two, an attention width other than its level's channels, codes lacking a
visual token in ``vocabulary_map`` (or no end-of-line token), no resizing, a tokenizer lacking the image tokens or whose
image token is not ``vocabulary_map["<image>"]``. Not served: image generation (the VQ-VAE's decoder), videos."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.apertus1p5_vision import ResnetBlock, _apply, _conv, _group_norm, _norm, _swish
from specray.models.layers import _param
from specray.models.registry import text_tensors
from specray.models.vision_towers import copy_weights
from specray.multimodal import MultiModalItem, ProcessedImage, special_token_ids

logger = logging.getLogger(__name__)

ARCH = "Emu3ForConditionalGeneration"
FACTOR = 8  # Emu3Processor's downsample_ratio (fixed there)
PREFIXES = ((re.compile(r"^(?:model\.)?vqmodel\."), ""),)  # the release's names and transformers' modules'
EOL = "<|extra_200|>"
VISUAL = "<|visual token"
BN_EPS = 1e-5  # the temporal blocks' BatchNorm3d (torch's default)
# the processor's special tokens, by the tokenizer attribute that names each
TOKENS = ("image_token", "boi_token", "eoi_token", "image_wrapper_token", "eof_token")


def _linear(width: int) -> nn.Module:
    linear = nn.Module()
    linear.weight, linear.bias = _param(width, width), _param(width)
    return linear


class Attention(nn.Module):
    """Multi-head attention over a feature map's positions (transformers' ``Emu3VQVAEAttentionBlock``), its GroupNorm
    and residual applied by the caller."""

    def __init__(self, vq: Any, channels: int):
        super().__init__()
        width, heads = int(vq.hidden_size), int(vq.num_attention_heads)
        if width != channels or width % heads:
            raise ValueError(f"vq_config.hidden_size={width} with num_attention_heads={heads}: the VQ-VAE's attention "
                             f"runs over {channels} channels there, so hidden_size must be {channels} and a multiple "
                             "of the heads (transformers could not run it either); fix config.json")
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (_linear(width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        seq = x.reshape(b, c, h * w).transpose(1, 2)
        q, k, v = (F.linear(seq, p.weight, p.bias).reshape(b, h * w, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5)
        out = F.linear(out.transpose(1, 2).reshape(b, h * w, c), self.out_proj.weight, self.out_proj.bias)
        return out.reshape(b, h, w, c).permute(0, 3, 1, 2)


def _attend(norm: nn.Module, attn: Attention, x: torch.Tensor) -> torch.Tensor:
    return x + attn(_group_norm(norm, x))


class Level(nn.Module):
    """One resolution level (transformers' ``down_block.down[i]``)."""

    def __init__(self, vq: Any, index: int):
        super().__init__()
        mult = list(vq.channel_multiplier)
        channels_in = vq.base_channels * (1 if index == 0 else mult[index - 1])
        channels = vq.base_channels * mult[index]
        attention = vq.attn_resolutions is not None and index in list(vq.attn_resolutions)
        self.block = nn.ModuleList(ResnetBlock(channels_in if i == 0 else channels, channels)
                                   for i in range(vq.num_res_blocks))
        self.attn = nn.ModuleList(Attention(vq, channels) for _ in range(vq.num_res_blocks if attention else 0))
        self.attn_norms = nn.ModuleList(_norm(channels) for _ in range(vq.num_res_blocks if attention else 0))
        self.downsample = None
        if index < len(mult) - 1:
            self.downsample = nn.Module()
            self.downsample.conv = _conv(channels, channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.block):
            x = block(x)
            if len(self.attn):
                x = _attend(self.attn_norms[i], self.attn[i], x)
        if self.downsample is not None:  # a zero pad right and bottom, then a stride-2 conv
            x = _apply(self.downsample.conv, F.pad(x, (0, 1, 0, 1)), stride=2, padding=0)
        return x


def _conv3d(channels_in: int, channels_out: int, kernel: tuple[int, int, int]) -> nn.Module:
    """transformers' ``Emu3VQVAEConv3d`` (its Conv3d under ``.conv``)."""
    outer = nn.Module()
    outer.conv = nn.Module()
    outer.conv.weight, outer.conv.bias = _param(channels_out, channels_in, *kernel), _param(channels_out)
    return outer


def _causal(conv: nn.Module, x: torch.Tensor, stride: int = 1) -> torch.Tensor:
    """A 3D conv padded as transformers pads it: two frames before (none after), the spatial sides centred."""
    _, _, kt, kh, kw = conv.conv.weight.shape
    pad = (kw - 1) // 2 + (kw - 1) % 2, (kw - 1) // 2, (kh - 1) // 2 + (kh - 1) % 2, (kh - 1) // 2, 2, 0
    return F.conv3d(F.pad(x, pad), conv.conv.weight, conv.conv.bias, stride=(stride, 1, 1))


def _batch_norm(channels: int) -> nn.Module:
    norm = nn.Module()
    norm.weight, norm.bias = _param(channels), _param(channels)
    norm.running_mean, norm.running_var = _param(channels), _param(channels)
    return norm


class TemporalBlock(nn.Module):
    """transformers' ``Emu3VQVAETemporalResnetBlock`` at inference (BatchNorm3d from its running statistics)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm1, self.conv1 = _batch_norm(channels), _conv3d(channels, channels, (3, 3, 3))
        self.norm2, self.conv2 = _batch_norm(channels), _conv3d(channels, channels, (3, 3, 3))

    @staticmethod
    def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, norm.running_mean, norm.running_var, norm.weight, norm.bias, False, 0.0, BN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _causal(self.conv1, _swish(self._norm(self.norm1, x)))
        return x + _causal(self.conv2, _swish(self._norm(self.norm2, h)))


class VQEncoder(nn.Module):
    """The VQ-VAE's encoder side (transformers' names): pixels [1, 3, H, W] -> codes [H / 8, W / 8]."""

    def __init__(self, vq: Any):
        super().__init__()
        mult = list(vq.channel_multiplier)
        width, latent = vq.base_channels * mult[-1], int(vq.latent_channels)
        self.temporal = int(vq.temporal_downsample_factor)
        e = self.encoder = nn.Module()
        e.conv_in = _conv(vq.in_channels, vq.base_channels, 3)
        e.down_block = nn.Module()
        e.down_block.down = nn.ModuleList(Level(vq, i) for i in range(len(mult)))
        e.middle_block = nn.Module()
        e.middle_block.block_1, e.middle_block.block_2 = ResnetBlock(width, width), ResnetBlock(width, width)
        e.middle_block.attn_1, e.middle_block.attn_norm = Attention(vq, width), _norm(width)
        e.norm_out = _norm(width)
        e.conv_out = _conv(width, latent, 3)
        e.time_conv = nn.ModuleList(nn.Module() for _ in range(int(math.log2(self.temporal))))
        for down in e.time_conv:
            down.conv = _conv3d(latent, latent, (4, 3, 3))
        e.time_res_stack = nn.ModuleList(TemporalBlock(latent) for _ in range(vq.num_res_blocks))
        self.quant_conv = _conv3d(latent, vq.embed_dim, (3, 1, 1))
        self.quantize = nn.Module()
        self.quantize.embedding = nn.Module()
        self.quantize.embedding.weight = _param(vq.codebook_size, vq.embed_dim)

    def latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels [1, 3, H, W] -> the quantizer's input [h * w, D]."""
        e, mid = self.encoder, self.encoder.middle_block
        x = _apply(e.conv_in, pixels)
        for level in e.down_block.down:
            x = level(x)
        x = mid.block_2(_attend(mid.attn_norm, mid.attn_1, mid.block_1(x)))
        x = _apply(e.conv_out, _swish(_group_norm(e.norm_out, x)))
        # the image repeated in time (its frames equal: the 2D part ran once), then squeezed back to one frame
        x = x[:, :, None].expand(-1, -1, self.temporal, -1, -1).contiguous()
        for down in e.time_conv:
            x = _swish(_causal(down.conv, x, stride=2))
        for block in e.time_res_stack:
            x = block(x)
        x = _causal(self.quant_conv, x)
        assert x.shape[2] == 1, x.shape
        return x[0, :, 0].flatten(1).t()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        z = self.latents(pixels)
        book = self.quantize.embedding.weight  # |z|^2 + |e|^2 - 2 z.e, in transformers' order of sums
        distances = (z ** 2).sum(1, keepdim=True) + (book ** 2).sum(1) - 2 * torch.matmul(z, book.t())
        return distances.argmin(1).reshape(pixels.shape[-2] // FACTOR, pixels.shape[-1] // FACTOR)


def _check(config: Any) -> None:
    vq = config.vq_config
    stages = len(list(vq.channel_multiplier))
    if 2 ** (stages - 1) != FACTOR:
        raise ValueError(f"vq_config.channel_multiplier={list(vq.channel_multiplier)} downsamples by "
                         f"{2 ** (stages - 1)}, but Emu3Processor writes each image's grid for {FACTOR}: only four "
                         "levels are supported; fix config.json")
    if getattr(vq, "double_latent", False):
        raise ValueError("vq_config.double_latent=True is not supported for Emu3ForConditionalGeneration: its "
                         "quant_conv takes latent_channels (transformers could not run it either); set it to false")
    factor = int(vq.temporal_downsample_factor)
    if factor < 1 or factor & (factor - 1):
        raise ValueError(f"vq_config.temporal_downsample_factor={factor} is not a power of two: the temporal convs "
                         "would not squeeze an image back to one frame; fix config.json")


def _code_ids(config: Any) -> tuple[list[int], int]:
    """Each code's vocabulary id (from ``vocabulary_map``'s visual tokens) and the end-of-line id."""
    vocab, codes = dict(config.vocabulary_map or {}), int(config.vq_config.codebook_size)
    size = int(config.text_config.vocab_size)
    found = {int(name[-8:-2]): int(i) for name, i in vocab.items() if name.startswith(VISUAL)}
    missing = [c for c in range(codes) if c not in found]
    if missing or EOL not in vocab:
        lacks = [f"the end-of-line token {EOL}"] * (EOL not in vocab)
        lacks += [f"visual tokens of codes {missing[:6]}"] * bool(missing)
        raise ValueError(f"config.json's vocabulary_map lacks {' and '.join(lacks)}: every one of "
                         f"vq_config.codebook_size={codes} codes needs its '<|visual token NNNNNN|>' id; use the "
                         "release's config.json")
    ids = [found[c] for c in range(codes)] + [int(vocab[EOL])]
    if max(ids) >= size or min(ids) < 0:
        raise ValueError(f"vocabulary_map names id {max(ids)} for an image code, past text_config.vocab_size={size}; "
                         "fix config.json")
    return ids[:-1], ids[-1]


class Emu3ImageEncoder(nn.Module):
    """The VQ-VAE's encoder (float32) (:class:`specray.multimodal.ImageEncoder` of discrete codes), built from the
    whole checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        _check(config)
        ids, self.eol = _code_ids(config)
        # (float32 whatever the serving dtype: the runner casts the pixels to the parameters' dtype)
        self.vq = VQEncoder(config.vq_config).float()
        self.register_buffer("code_ids", torch.tensor(ids, dtype=torch.long), persistent=False)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Read the VQ-VAE's encoder tensors (``vqmodel.*`` or ``model.vqmodel.*``; its decoder is not read). A
        ValueError names any of ours missing."""
        missing = copy_weights(dict(self.vq.named_parameters()), text_tensors(weights, PREFIXES))
        if missing:
            raise ValueError(f"the checkpoint lacks {ARCH}'s image tensor(s) {missing[:6]} (vqmodel.*); it does not "
                             "match its config.json's vq_config")

    def image_codes(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image's pixels [3, H, W] -> its codes [H / 8, W / 8] (codebook indices)."""
        return self.vq(pixels.float()[None])

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's ``pixel_values`` [3, H, W] (its own size) -> its vocabulary ids [H / 8 * (W / 8 + 1)] (int64):
        each row's codes' visual tokens, then the end-of-line id."""
        ids = self.code_ids[self.image_codes(data["pixel_values"])]
        return torch.cat((ids, torch.full_like(ids[:, :1], self.eol)), dim=1).flatten()


class Emu3ImageProcessor:
    """Emu3's host side (:class:`specray.multimodal.ImageProcessor`): transformers' image processor's pixels and
    ``Emu3Processor``'s tokens for the image token."""

    def __init__(self, pixels: Any, tokenizer: Any, ids: dict[str, int]):
        self.pixels, self.tokenizer, self.ids = pixels, tokenizer, ids
        self.image_token_id = ids["image_token"]

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Emu3ImageProcessor:
        """From the folder's image processor settings and tokenizer (its image tokens, named by the attributes
        Emu3Processor reads)."""
        from transformers import AutoTokenizer
        from transformers.models.emu3.image_processing_emu3 import Emu3ImageProcessor as Pixels

        folder = Path(folder)
        _check(config)
        pixels = Pixels.from_pretrained(folder)
        if int(pixels.spatial_factor) != FACTOR:
            raise ValueError(f"the image processor's spatial_factor={pixels.spatial_factor} is not the VQ-VAE's "
                             f"downsampling {FACTOR} (which Emu3Processor writes the grid for); fix "
                             "preprocessor_config.json")
        if not pixels.do_resize:
            raise ValueError(f"the image processor's do_resize=False is not supported for {ARCH}: an image must be "
                             f"resized to multiples of {FACTOR}; fix preprocessor_config.json")
        tok = AutoTokenizer.from_pretrained(folder)
        ids = dict(zip(TOKENS, special_token_ids(tok, [getattr(tok, attr, None) for attr in TOKENS], folder,
                                                 "Emu3Processor")))
        want = (config.vocabulary_map or {}).get("<image>")
        if ids["image_token"] != want:
            raise ValueError(f"the tokenizer's image_token is id {ids['image_token']} but vocabulary_map['<image>']="
                             f"{want}: transformers fills that id's rows with the image; fix config.json or the "
                             "tokenizer")
        return cls(pixels, tok, ids)

    def process(self, image: Any) -> ProcessedImage:
        pixels = np.asarray(self.pixels(images=[image], return_tensors="np")["pixel_values"][0], dtype=np.float32)
        rows, cols = pixels.shape[1] // FACTOR, pixels.shape[2] // FACTOR
        names = {attr: getattr(self.tokenizer, attr) for attr in TOKENS}
        text = (f"{names['boi_token']}{rows}*{cols}{names['image_wrapper_token']}"
                f"{names['image_token'] * (rows * (cols + 1))}{names['eof_token']}{names['eoi_token']}")
        replacement = self.tokenizer.encode(text, add_special_tokens=False)
        embed_rows = [i for i, t in enumerate(replacement) if t == self.image_token_id]
        assert len(embed_rows) == rows * (cols + 1), (len(embed_rows), rows, cols)
        return ProcessedImage(replacement, {"pixel_values": pixels}, embed_rows=embed_rows)

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE
