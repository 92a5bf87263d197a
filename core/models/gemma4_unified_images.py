"""Gemma 4 Unified's images (``Gemma4UnifiedForConditionalGeneration``, transformers' ``models/gemma4_unified``): the
encoder-free multimodal Gemma 4, whose text model is served through ``registry._TEXT_PARTS``
(:mod:`specray.models.gemma4_unified`); audio and video are not served.

:class:`Gemma4UnifiedImageEncoder`: no vision tower, only transformers' ``Gemma4UnifiedVisionEmbedder``, token by
token: a merged patch's raw pixels ([(k * p)^2 * 3], k = ``pooling_kernel_size``, p = ``patch_size``: 48 x 48 in the
releases) LayerNormed (``patch_ln1``), projected (``patch_dense``, with bias), LayerNormed (``patch_ln2``); the
factorized position added (``pos_embedding[x, 0] + pos_embedding[y, 1]`` at the merged patch's column and row) and
LayerNormed (``pos_norm``); then the multimodal embedder: an RMSNorm without a scale and ``embedding_projection`` into
the text model's width. No token sees another, so an image's padding (which transformers zeroes) is simply dropped.

:class:`Gemma4UnifiedImageProcessor`: transformers' ``Gemma4UnifiedImageProcessor`` needs torchvision (not installed
here), so its work is redone with torch: RGB as uint8, the aspect-preserving resize to the largest size of at most
``max_soft_tokens * k^2`` patches whose sides are multiples of ``k * p`` (bicubic, antialiased, on uint8 as
torchvision does it on a CPU: :func:`specray.models.kimi_k25_vision._resize`), times ``rescale_factor``, cut into
merged patches of ``k * p`` pixels a side in row-major order (what its teacher patches merged k x k come to), with
their (column, row). Its placeholder ``<|image|>`` (``image_token_id``) is replaced as ``Gemma4UnifiedProcessor``
writes it: boi, one soft token per merged patch, eoi; only the soft tokens take embeddings.

Attention: with ``use_bidirectional_attention`` "vision" transformers' Unified model lets an image's soft tokens
(``mm_token_type_ids``) see each other both ways in EVERY layer (its forward's masks: causal OR block in the full
layers, the sliding window OR block in the sliding ones; unlike Gemma 4's, whose full layers stay causal), so the
items are ``bidirectional`` (narrowed to the soft tokens by :meth:`finish_prompt`) and the Unified text model's full
layers take the plain paged attention (:mod:`specray.models.gemma4_unified`). Our sliding layers' window still bounds
earlier keys inside a block, where transformers' does not: the two agree while an image's soft tokens are no more than
``sliding_window``, and an image of more is refused by name. The text model puts the image rows in place after its
sqrt(hidden) scale (unscaled, as transformers scatters them; it has no per-layer inputs).

Refused by name: a vision config other than Unified's, ``output_proj_dims`` other than ``mm_embed_dim``, an image
processor whose patch or pooling size differs from the vision config's, ``max_soft_tokens`` outside transformers' set
or past the position table, another resampling, ``do_resize`` / ``do_rescale`` off or ``do_normalize`` on, an image of
more soft tokens than the sliding window (bidirectional), audio/video placeholders in a prompt with images."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specray.models.gemma4 import Gemma4RMSNorm
from specray.models.gemma4_images import SoftTokenImages
from specray.models.kimi_k25_vision import _resize as bicubic_resize  # torchvision's uint8 antialiased bicubic
from specray.models.layers import LayerNorm, _param
from specray.models.registry import text_tensors
from specray.models.vision_towers import Linear, copy_weights
from specray.multimodal import ProcessedImage, image_processor_settings

logger = logging.getLogger(__name__)

ARCH = "Gemma4UnifiedForConditionalGeneration"
VISION_TYPE = "gemma4_unified_vision"
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # transformers' accepted max_soft_tokens
LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, which transformers' embedder uses
# the checkpoint's names of the embedder's tensors -> ours: what transformers saves (and the releases hold:
# ``model.vision_embedder.patch_*`` / ``pos_*``, ``model.embed_vision.embedding_projection``) or its module names
# (``model.embed_vision.patch_*``, ``model.embed_vision.multimodal_embedder.embedding_projection``), with or without
# ``model.``
_OWN_NAMES = ((re.compile(r"^(?:model\.)?(?:vision_embedder|embed_vision)\.(?=patch_|pos_)"), ""),
              (re.compile(r"^(?:model\.)?embed_vision\.(?:multimodal_embedder\.)?(?=embedding_projection\.)"),
               "multimodal_embedder."))


def vision_config(config: Any) -> Any:
    """The whole checkpoint config's vision config; a ValueError for what is not served."""
    vision = getattr(config, "vision_config", None)
    kind = getattr(vision, "model_type", None)
    if kind != VISION_TYPE:
        raise ValueError(f"vision_config.model_type={kind!r} is not supported for {ARCH}: its images are served with "
                         f"Gemma 4 Unified's embedder ({VISION_TYPE!r}); serve this checkpoint's text without images")
    if vision.output_proj_dims != vision.mm_embed_dim:
        raise ValueError(f"vision_config.output_proj_dims={vision.output_proj_dims} differs from mm_embed_dim="
                         f"{vision.mm_embed_dim}: the embedder's norm reads the patch embedding, so they must match "
                         "(transformers' model cannot load it either); fix config.json")
    return vision


class Gemma4UnifiedImageEncoder(nn.Module):
    """Gemma 4 Unified's vision embedder (:class:`specray.multimodal.ImageEncoder`): see the module docstring.
    Built from the whole checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        vision = vision_config(config)
        width, dim = (vision.patch_size * vision.pooling_kernel_size) ** 2 * 3, vision.mm_embed_dim
        self.patch_ln1 = LayerNorm(width, LAYER_NORM_EPS)
        self.patch_dense = Linear(width, dim)
        self.patch_ln2 = LayerNorm(dim, LAYER_NORM_EPS)
        self.pos_embedding = _param(vision.mm_posemb_size, 2, dim)
        self.pos_norm = LayerNorm(dim, LAYER_NORM_EPS)
        self.multimodal_embedder = nn.Module()
        self.multimodal_embedder.embedding_pre_projection_norm = Gemma4RMSNorm(dim, vision.rms_norm_eps,
                                                                               scaled=False)
        self.multimodal_embedder.embedding_projection = Linear(dim, config.text_config.hidden_size, bias=False)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Read the vision embedder's tensors (:data:`_OWN_NAMES`) among the whole checkpoint's (the text model's and
        the audio embedder's are skipped unread). A ValueError names any of ours missing."""
        missing = copy_weights(dict(self.named_parameters()), text_tensors(weights, _OWN_NAMES))
        if missing:
            saved = [m.replace("multimodal_embedder.", "embed_vision.") if m.startswith("multimodal_embedder.")
                     else "vision_embedder." + m for m in missing]
            raise ValueError(f"the checkpoint lacks {len(missing)} of {ARCH}'s vision tensor(s), e.g. {saved[:4]} "
                             "(as transformers saves them); it is not a complete checkpoint")

    def positions(self, positions: torch.Tensor) -> torch.Tensor:
        """[n, 2] (column, row) -> [n, D]: the column's row of the first table plus the row's of the second."""
        return self.pos_embedding[positions[:, 0], 0] + self.pos_embedding[positions[:, 1], 1]

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's merged patches [n, (k p)^2 * 3] and their (column, row) [n, 2] -> [n, text hidden]."""
        x = data["pixel_values"].to(self.patch_dense.weight.dtype)
        x = self.patch_ln2(self.patch_dense(self.patch_ln1(x)))
        x = self.pos_norm(x + self.positions(data["image_position_ids"].long()))
        embedder = self.multimodal_embedder
        return embedder.embedding_projection(embedder.embedding_pre_projection_norm(x))


def resized_size(height: int, width: int, patch: int, max_patches: int, window: int) -> tuple[int, int]:
    """transformers' ``get_aspect_ratio_preserving_size``: the largest (height, width) of at most ``max_patches``
    patches of ``patch`` pixels, both multiples of ``window * patch``, keeping the aspect (a side that rounds to zero
    takes one multiple, the other the aspect ratio's multiples up to the budget's longest side)."""
    budget = max_patches * patch ** 2
    factor = math.sqrt(budget / (height * width))
    side = window * patch
    new_h, new_w = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
    if new_h == 0 and new_w == 0:
        raise ValueError(f"a {height} x {width} image cannot be resized to whole {side}-pixel patches")
    longest = (max_patches // window ** 2) * side
    if new_h == 0:
        new_h, new_w = side, min(int(math.floor(width / height)) * side, longest)
    elif new_w == 0:
        new_h, new_w = min(int(math.floor(height / width)) * side, longest), side
    if new_h * new_w > budget:
        raise ValueError(f"a {height} x {width} image resized to {new_h} x {new_w} exceeds {max_patches} patches of "
                         f"{patch} pixels")
    return new_h, new_w


class Gemma4UnifiedImageProcessor(SoftTokenImages):
    """Gemma 4 Unified's host side (:class:`specray.multimodal.ImageProcessor`): transformers'
    ``Gemma4UnifiedImageProcessor``'s merged patches (made here with torch) and ``Gemma4UnifiedProcessor``'s
    expansion of ``<|image|>``."""

    arch = ARCH

    def __init__(self, settings: dict, config: Any):
        vision = vision_config(config)
        self.patch = int(settings.get("patch_size", 16))
        self.window = int(settings.get("pooling_kernel_size", 3))
        for field, theirs in (("patch_size", self.patch), ("pooling_kernel_size", self.window)):
            if theirs != getattr(vision, field):
                raise ValueError(f"the image processor's {field}={theirs} differs from vision_config.{field}="
                                 f"{getattr(vision, field)}; fix the processor config to match config.json")
        self.max_soft_tokens = int(settings.get("max_soft_tokens", 280))
        if self.max_soft_tokens not in SOFT_TOKEN_BUDGETS or self.max_soft_tokens > vision.mm_posemb_size:
            raise ValueError(f"the image processor's max_soft_tokens={self.max_soft_tokens} is not supported: use one "
                             f"of {SOFT_TOKEN_BUDGETS} (transformers' set) no larger than vision_config.mm_posemb_size="
                             f"{vision.mm_posemb_size}")
        resample = settings.get("resample", 3)
        if resample not in (3, "bicubic"):
            raise ValueError(f"the image processor's resample={resample!r} is not supported: only bicubic (3), Gemma "
                             "4's, is; fix the processor config")
        for flag, served in (("do_resize", True), ("do_rescale", True), ("do_normalize", False)):
            if bool(settings.get(flag, served)) != served:
                raise ValueError(f"the image processor's {flag}={settings[flag]} is not supported (Gemma 4 Unified "
                                 f"{'resizes and rescales every image' if served else 'does not normalize'}); set "
                                 f"{flag} to {served} in the processor config")
        self.rescale = float(settings.get("rescale_factor", 1 / 255))
        self.sliding_window = getattr(config.text_config, "sliding_window", None)
        self._soft_tokens(config)

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Gemma4UnifiedImageProcessor:
        """From the folder's ``preprocessor_config.json`` or the ``image_processor`` entry of its
        ``processor_config.json`` (what transformers 5 writes)."""
        folder = Path(folder)
        settings = image_processor_settings(folder)
        return cls(settings, config)

    def pixels(self, image: Any) -> tuple[np.ndarray, np.ndarray]:
        """One PIL image -> (``pixel_values`` [n, (k p)^2 * 3] float32, ``image_position_ids`` [n, 2] int64: each
        merged patch's column and row), n merged patches in row-major order."""
        x = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1)
        height, width = resized_size(x.shape[1], x.shape[2], self.patch, self.max_soft_tokens * self.window ** 2,
                                     self.window)
        x = bicubic_resize(x, height, width) * self.rescale  # uint8 times a float: float32, as transformers
        side = self.patch * self.window
        rows, cols = height // side, width // side
        patches = x.reshape(3, rows, side, cols, side).permute(1, 3, 2, 4, 0).reshape(rows * cols, -1)
        grid = np.stack(np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy"), axis=-1).reshape(-1, 2)
        return patches.numpy(), grid.astype(np.int64)

    def process(self, image: Any) -> ProcessedImage:
        pixels, positions = self.pixels(image)
        tokens = pixels.shape[0]
        if self.bidirectional and self.sliding_window is not None and tokens > self.sliding_window:
            raise ValueError(f"an image of {tokens} soft tokens exceeds text_config.sliding_window="
                             f"{self.sliding_window}: transformers lets its soft tokens see each other past the "
                             "window in the sliding layers, which specray's window does not; lower the image "
                             "processor's max_soft_tokens")
        return self._image(tokens, {"pixel_values": pixels, "image_position_ids": positions})

