"""Idefics3 and SmolVLM with images (``Idefics3ForConditionalGeneration``: HuggingFaceM4/Idefics3-8B-Llama3;
``SmolVLMForConditionalGeneration``: SmolVLM-256M / 500M / 2B-Instruct and SmolVLM2; transformers' ``models/idefics3``
and ``models/smolvlm``).

An image is cut by transformers' image processor into a grid of square crops of ``max_image_size`` pixels plus the
whole image resized to one crop (the "global" image, last; ``do_image_splitting`` off: the global image alone). Each
crop goes through a SigLIP-like vision model (:class:`Idefics3VisionModel`: a biased patch conv, a learned embedding
per position of the ``image_size`` grid, looked up by each patch's fractional place in its crop as transformers buckets
it, SigLIP's pre-norm encoder layers from :mod:`specray.models.vision_towers`, then ``post_layernorm``); the connector
folds each ``scale_factor`` x ``scale_factor`` block of patches into one vector (the pixel shuffle) and projects it
with a bias-free linear (``modality_projection``) to the text width: ``image_seq_len`` embeddings per crop.

The prompt's ``<image>`` (once per image, as the chat template renders an image part) becomes what Idefics3Processor
and SmolVLMProcessor write for it: per crop ``<fake_token_around_image><row_r_col_c>`` and ``image_seq_len``
``<image>`` tokens, a newline closing each grid row, then ``\\n<fake_token_around_image><global-img>``, the global
image's ``<image>`` tokens and a closing ``<fake_token_around_image>``; only the ``<image>`` rows take embeddings (in
crop order, the global image last). The text model (Llama 3 for Idefics3, SmolLM2 for SmolVLM: a Llama) is served by
``LlamaForCausalLM`` from ``model.text_model.*`` and ``lm_head.*`` (``registry._TEXT_PARTS``).

Refused by name: another vision model type, an unknown activation, a crop grid the pixel shuffle cannot fold, a
processor whose crops or ``image_seq_len`` disagree with the vision config, a tokenizer without the image tokens or
whose ``<image>`` is not ``image_token_id``, and padded crops (transformers pads only when it batches images of
different crop sizes, which one image at a time never is)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specray.models.layers import LayerNorm, _param
from specray.models.registry import text_tensors
from specray.models.vision_towers import Linear, VisionEncoderLayer, copy_weights, patch_rows, vision_activation
from specray.multimodal import MultiModalItem, ProcessedImage

logger = logging.getLogger(__name__)

ARCHS = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
VISION_TYPES = ("idefics3_vision", "smolvlm_vision")
FAKE, IMAGE, GLOBAL = "<fake_token_around_image>", "<image>", "<global-img>"
DEFAULT_SEQ_LEN = 169  # the processors' image_seq_len when processor_config.json names none
# the checkpoint's names of this encoder's tensors -> ours (releases and transformers 5 alike: model.vision_model.*,
# model.connector.modality_projection.proj.weight; without the ``model.`` of older saves too)
_OWN_NAMES = ((re.compile(r"^(?:model\.)?vision_model\."), "tower."),
              (re.compile(r"^(?:model\.)?connector\."), "connector."))


def _vision_config(config: Any) -> Any:
    vision = getattr(config, "vision_config", None)
    kind = getattr(vision, "model_type", None)
    if kind not in VISION_TYPES:
        raise ValueError(f"vision_config.model_type={kind!r} is not supported for {ARCHS[0]} / {ARCHS[1]}: only "
                         f"{list(VISION_TYPES)} (their SigLIP-like vision models) are; serve the text alone with a "
                         "release of its text model")
    return vision


def _scale(config: Any) -> int:
    """The pixel shuffle's ``scale_factor``: the patches per side of a crop must fold into its blocks."""
    vision = _vision_config(config)
    scale = getattr(config, "scale_factor", 2)
    side = vision.image_size // vision.patch_size
    if not isinstance(scale, int) or isinstance(scale, bool) or scale < 1 or side % scale:
        raise ValueError(f"scale_factor={scale!r} with vision_config.image_size={vision.image_size}, patch_size="
                         f"{vision.patch_size}: the pixel shuffle needs the {side} patches per side of a crop "
                         "divisible by an integer scale_factor; fix config.json")
    return scale


def tokens_per_crop(config: Any) -> int:
    """The ``<image>`` tokens (and embeddings) of one crop: its patches over ``scale_factor ** 2``."""
    vision = _vision_config(config)
    return (vision.image_size // vision.patch_size) ** 2 // _scale(config) ** 2


def load_tower_and_connector(encoder: nn.Module, weights: Iterable[tuple[str, Any]], configs: str) -> None:
    """Read an Idefics encoder's vision model and connector tensors among the whole checkpoint's (the text model's
    are skipped); a ValueError names any of ours missing, and the config.json fields (``configs``) that shape them."""
    missing = copy_weights(dict(encoder.named_parameters()), text_tensors(weights, _OWN_NAMES))
    if missing:
        theirs = [re.sub(r"^tower\.", "model.vision_model.", re.sub(r"^connector\.", "model.connector.", m))
                  for m in missing]
        raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of the vision model or connector: "
                         f"{theirs[:6]}; it does not match its config.json's {configs}")


class Idefics3Embeddings(nn.Module):
    """A biased conv of stride ``patch_size`` plus a learned embedding per place of the ``image_size`` grid: a patch
    takes the embedding of the grid cell its fractional coordinates fall in (transformers' bucketing; a crop of
    ``image_size`` pixels takes every cell once, row-major)."""

    def __init__(self, config: Any):
        super().__init__()
        hidden, channels = config.hidden_size, getattr(config, "num_channels", 3)
        self.patch_size, self.side = config.patch_size, config.image_size // config.patch_size
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = _param(hidden, channels, self.patch_size, self.patch_size)
        self.patch_embedding.bias = _param(hidden)
        self.position_embedding = nn.Module()
        self.position_embedding.weight = _param(self.side ** 2, hidden)

    def positions(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """The position ids [rows * cols] of a crop of ``rows`` x ``cols`` patches, every patch real."""
        edges = torch.arange(1 / self.side, 1.0, 1 / self.side, device=device, dtype=torch.float32)

        def cells(n: int) -> torch.Tensor:
            step = 1.0 / torch.tensor(n, device=device, dtype=torch.float32)  # as transformers divides a patch count
            where = (torch.arange(n, device=device, dtype=torch.float32) * step).clamp(max=1.0 - 1e-6)
            return torch.bucketize(where, edges, right=True)

        return (cells(rows)[:, None] * self.side + cells(cols)[None, :]).flatten()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [B, C, H, W] -> [B, (H / patch) * (W / patch), hidden]
        rows, cols = pixel_values.shape[-2] // self.patch_size, pixel_values.shape[-1] // self.patch_size
        x = patch_rows(pixel_values, self.patch_embedding.weight, self.patch_embedding.bias)
        return x + self.position_embedding.weight[self.positions(rows, cols, x.device)]


class Idefics3VisionModel(nn.Module):
    """Idefics3's / SmolVLM's vision model over whole crops (no padded patches): embeddings, SigLIP's encoder
    layers, ``post_layernorm``; named as the checkpoint names ``model.vision_model.*``."""

    def __init__(self, config: Any):
        super().__init__()
        act = vision_activation(config.hidden_act, "vision_config.hidden_act")
        self.embeddings = Idefics3Embeddings(config)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionEncoderLayer(config, act) for _ in range(config.num_hidden_layers))
        self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[B, side * side, D] patches (row-major) -> [B, (side / scale) ** 2, scale * scale * D]: each scale x scale
    block one vector, its rows outer, its columns inner, the blocks row-major."""
    b, n, d = x.shape
    side = round(n ** 0.5)
    if side * side != n or side % scale:
        raise ValueError(f"a crop of {n} patches cannot be folded by scale_factor={scale}: crops must be square, of "
                         "vision_config.image_size pixels (the image processor's max_image_size)")
    blocks = side // scale
    x = x.reshape(b, blocks, scale, blocks, scale, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, blocks * blocks, scale * scale * d)


class Idefics3ImageEncoder(nn.Module):
    """The vision model and the connector (:class:`specray.multimodal.ImageEncoder`), built from the whole
    checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        vision = _vision_config(config)
        self.scale = _scale(config)
        self.tower = Idefics3VisionModel(vision)
        self.connector = nn.Module()
        self.connector.modality_projection = nn.Module()
        self.connector.modality_projection.proj = Linear(vision.hidden_size * self.scale ** 2,
                                                         config.text_config.hidden_size, bias=False)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_tower_and_connector(self, weights, "vision_config / scale_factor")

    @property
    def device(self) -> torch.device:
        return self.connector.modality_projection.proj.weight.device

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's ``pixel_values`` [crops, C, S, S] (the global image last) -> its embeddings [crops *
        image_seq_len, text hidden size], crop by crop."""
        pixels = data["pixel_values"]
        if pixels.dim() == 3:
            pixels = pixels.unsqueeze(0)
        features = self.connector.modality_projection.proj(pixel_shuffle(self.tower(pixels), self.scale))
        return features.reshape(-1, features.shape[-1])


def image_text(rows: int, cols: int, seq_len: int) -> str:
    """What Idefics3Processor / SmolVLMProcessor write for an image cut into ``rows`` x ``cols`` crops (0 x 0: the
    global image alone)."""
    image = IMAGE * seq_len
    whole = f"{FAKE}{GLOBAL}{image}{FAKE}"
    if rows == 0 and cols == 0:
        return whole
    grid = "".join("".join(f"{FAKE}<row_{r}_col_{c}>{image}" for c in range(1, cols + 1)) + "\n"
                   for r in range(1, rows + 1))
    return f"{grid}\n{whole}"


class Idefics3ImageProcessor:
    """Idefics3's / SmolVLM's host side (:class:`specray.multimodal.ImageProcessor`): transformers' image processor
    of the checkpoint's folder cuts and normalizes the crops; the ``<image>`` placeholder becomes
    :func:`image_text`'s tokens, the ``<image>`` rows taking the embeddings."""

    def __init__(self, image_processor: Any, tokenizer: Any, config: Any, seq_len: int):
        vision = _vision_config(config)
        want = tokens_per_crop(config)
        if seq_len != want:
            raise ValueError(f"processor_config.json's image_seq_len={seq_len} disagrees with the model's "
                             f"{want} embeddings per crop ((image_size / patch_size) ** 2 / scale_factor ** 2 of "
                             "config.json): the prompt would hold another number of <image> tokens; fix "
                             "processor_config.json")
        crop = (getattr(image_processor, "max_image_size", None) or {}).get("longest_edge")
        if crop != vision.image_size:
            raise ValueError(f"the image processor's max_image_size={getattr(image_processor, 'max_image_size', None)}"
                             f" must have longest_edge equal to vision_config.image_size={vision.image_size} (the "
                             "crops the pixel shuffle folds into image_seq_len tokens); fix preprocessor_config.json")
        names = {name: getattr(tokenizer, attr, name) for name, attr in
                 ((FAKE, "fake_image_token"), (IMAGE, "image_token"), (GLOBAL, "global_image_token"))}
        if names != {FAKE: FAKE, IMAGE: IMAGE, GLOBAL: GLOBAL}:
            raise ValueError(f"the tokenizer names its image tokens {sorted(names.values())}, not "
                             f"{[FAKE, IMAGE, GLOBAL]}: only the releases' tokens are supported")
        unk = getattr(tokenizer, "unk_token_id", None)
        for token in (FAKE, IMAGE):
            found = tokenizer.convert_tokens_to_ids(token)
            if found is None or found == unk or len(tokenizer.encode(token, add_special_tokens=False)) != 1:
                raise ValueError(f"the tokenizer has no {token} token, which the processor writes around each "
                                 "image; use the release's tokenizer")
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE))
        if self.image_token_id != int(config.image_token_id):
            raise ValueError(f"the tokenizer's {IMAGE} is id {self.image_token_id} but image_token_id="
                             f"{config.image_token_id}: transformers fills image_token_id's rows with the image; fix "
                             "config.json or the tokenizer")
        self.image_processor, self.tokenizer, self.seq_len = image_processor, tokenizer, seq_len
        self._texts: dict[tuple[int, int], list[int]] = {}

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Idefics3ImageProcessor:
        """From the folder's image processor (``preprocessor_config.json``), tokenizer and ``processor_config.json``
        (``image_seq_len``)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        folder = Path(folder)
        path = folder / "processor_config.json"
        saved = json.loads(path.read_text()) if path.is_file() else {}
        seq_len = saved.get("image_seq_len", DEFAULT_SEQ_LEN)
        return cls(AutoImageProcessor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), config,
                   int(seq_len))

    def replacement(self, rows: int, cols: int) -> list[int]:
        """The token ids of :func:`image_text` (each text between two special tokens tokenized alone, as in a
        whole prompt)."""
        if (rows, cols) not in self._texts:
            self._texts[rows, cols] = self.tokenizer.encode(image_text(rows, cols, self.seq_len),
                                                            add_special_tokens=False)
        return self._texts[rows, cols]

    def process(self, image: Any) -> ProcessedImage:
        out = self.image_processor(images=[[image]], return_tensors="np", return_row_col_info=True)
        pixels = np.asarray(out["pixel_values"][0], dtype=np.float32)
        mask = out.get("pixel_attention_mask")
        if mask is not None and not np.asarray(mask).all():
            raise ValueError("the image processor padded this image's crops (do_pad with crops of different sizes): "
                             "only whole crops of max_image_size pixels are supported")
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        ids = self.replacement(rows, cols)
        embed_rows = [i for i, t in enumerate(ids) if t == self.image_token_id]
        crops = rows * cols + 1 if rows or cols else 1
        assert pixels.shape[0] == crops and len(embed_rows) == crops * self.seq_len, (pixels.shape, rows, cols)
        return ProcessedImage(list(ids), {"pixel_values": pixels}, embed_rows)

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE
