"""Gemma 3's images (``Gemma3ForConditionalGeneration``, transformers' ``models/gemma3``: Gemma 3 4B / 12B / 27B).

The text model is Gemma 3's (:mod:`specray.models.gemma3`, served through ``registry._TEXT_PARTS``); its embedding
step puts the image rows in place after scaling the tokens' embeddings by sqrt(hidden_size), so image embeddings are
not scaled, as transformers scatters them after its scaled embedding.

:class:`Gemma3ImageEncoder`: SigLIP's vision tower (:mod:`specray.models.vision_towers`, every layer and its
``post_layernorm``: transformers reads the tower's ``last_hidden_state``) then Gemma 3's projector: the patch grid
(``image_size / patch_size`` a side) averaged over square windows down to ``mm_tokens_per_image`` (a square number)
tokens, in row-major order; Gemma's RMSNorm (``1 + weight``, in float32, eps ``vision_config.layer_norm_eps``) over
each; then ``x @ mm_input_projection_weight`` ([vision hidden, text hidden], no bias).

:class:`Gemma3ImageProcessor`: transformers' image processor of the checkpoint's folder makes the pixels (one square
resize, no pan-and-scan); the placeholder a prompt holds once per image is ``<start_of_image>`` (``boi_token_index``,
what Gemma 3's chat template renders for an image part), replaced as ``Gemma3Processor`` replaces it: by the tokens of
``"\\n\\n<start_of_image>" + "<image_soft_token>" * mm_tokens_per_image + "<end_of_image>\\n\\n"``. Only the soft tokens
take embeddings (``embed_rows``), and they alone attend to each other both ways (transformers' ``token_type_ids``
mark them: every layer sees the image's later soft tokens too, a sliding layer's window still bounding the earlier
keys), so the item is ``bidirectional``. transformers splices that text before tokenizing, so Gemma's tokenizer joins
its newlines with the prompt's neighbouring ones ("\\n" + "\\n\\n" is one "\\n\\n\\n" token, as after the chat
template's ``user\\n``); :meth:`Gemma3ImageProcessor.finish_prompt` joins them the same way on an expanded prompt's
ids (as vLLM does) and narrows each item to its soft tokens, the exact set that attends both ways. It is a hook
for :func:`specray.multimodal.expand_prompt` to call after splicing; where that does not call it, the items span the
whole replacement and a chat prompt's edge newlines stay unjoined.

Refused by name: a vision tower other than SigLIP's, a ``mm_tokens_per_image`` that is not a square or does not
divide the patch grid, pan-and-scan (``do_pan_and_scan``: its crops are extra images inside one placeholder's text),
and a ``processor_config.json`` whose ``image_seq_length`` differs from ``mm_tokens_per_image``."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.gemma3 import GemmaRMSNorm
from specray.models.layers import _param
from specray.models.vision_towers import SIGLIP, VisionTower, load_tower_and_projector
from specray.multimodal import MultiModalItem, ProcessedImage

logger = logging.getLogger(__name__)

ARCH = "Gemma3ForConditionalGeneration"
MAX_NEWLINES = 31  # runs of newlines looked up in the vocabulary as one token, up to this length


def _vision_config(config: Any) -> Any:
    vision = getattr(config, "vision_config", None)
    kind = getattr(vision, "model_type", None)
    if kind != SIGLIP:
        raise ValueError(f"vision_config.model_type={kind!r} is not supported for {ARCH}: its images are served with "
                         f"SigLIP's vision tower ({SIGLIP!r}); serve this checkpoint's text alone with a release of "
                         "its text model")
    return vision


def pooling(config: Any) -> tuple[int, int]:
    """(patches a side, the averaging window's side) of ``config``'s projector; a ValueError for a token count that
    is not a square dividing the patch grid."""
    vision = _vision_config(config)
    patches = vision.image_size // vision.patch_size
    tokens = int(getattr(config, "mm_tokens_per_image", 256))
    side = math.isqrt(tokens)
    if side * side != tokens or side < 1 or patches % side:
        raise ValueError(f"mm_tokens_per_image={tokens} is not supported: it must be a square whose side divides the "
                         f"{patches} x {patches} patch grid (vision_config.image_size={vision.image_size} / patch_size="
                         f"{vision.patch_size}); the checkpoint's config is inconsistent")
    return patches, patches // side


class Gemma3ImageEncoder(nn.Module):
    """Gemma 3's SigLIP tower and projector (:class:`specray.multimodal.ImageEncoder`), built from the whole
    checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        vision = _vision_config(config)
        self.patches, self.window = pooling(config)
        self.tower = VisionTower(vision, post_norm=True)
        self.projector = nn.Module()
        self.projector.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.projector.mm_input_projection_weight = _param(vision.hidden_size, config.text_config.hidden_size)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The tower's and the projector's tensors (any layout; SigLIP's pooling head unread); a ValueError names any
        of ours missing."""
        load_tower_and_projector(self, weights, ARCH)

    @property
    def device(self) -> torch.device:
        return self.projector.mm_input_projection_weight.device

    def project(self, states: torch.Tensor) -> torch.Tensor:
        """The tower's output [B, P*P, D] -> [B, mm_tokens_per_image, text hidden]: window averages of the patch grid
        (row-major), Gemma's RMSNorm, the projection."""
        b, _, d = states.shape
        grid = states.transpose(1, 2).reshape(b, d, self.patches, self.patches)
        pooled = F.avg_pool2d(grid, self.window).flatten(2).transpose(1, 2)
        out = self.projector.mm_soft_emb_norm(pooled) @ self.projector.mm_input_projection_weight
        return out.to(states.dtype)

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's ``pixel_values`` [C, S, S] (or [1, C, S, S]) -> its embeddings [mm_tokens_per_image, H]."""
        pixels = data["pixel_values"]
        if pixels.dim() == 3:
            pixels = pixels.unsqueeze(0)
        return self.project(self.tower(pixels))[0]


class Gemma3ImageProcessor:
    """Gemma 3's host side (:class:`specray.multimodal.ImageProcessor`): see the module docstring.
    ``replacement``: the tokens of one image's text (``\\n\\n``, ``<start_of_image>``, the soft tokens,
    ``<end_of_image>``, ``\\n\\n``); ``newlines``: a run's length -> its token, for the runs of newlines the
    tokenizer has as one token."""

    def __init__(self, image_processor: Any, config: Any, replacement: list[int], newlines: dict[int, int]):
        if getattr(image_processor, "do_pan_and_scan", None):
            raise ValueError(f"do_pan_and_scan={image_processor.do_pan_and_scan!r} (the image processor's config) is "
                             f"not supported for {ARCH}: pan-and-scan's crops are extra images inside one "
                             "placeholder's text; set do_pan_and_scan to false (transformers' default) in the "
                             "checkpoint's processor config")
        self.image_processor = image_processor
        self.config = config
        pooling(config)  # the vision config and token count refused here already, by name
        self.image_token_id = int(config.boi_token_index)
        soft, tokens = int(config.image_token_index), int(getattr(config, "mm_tokens_per_image", 256))
        self.embed_rows = [i for i, t in enumerate(replacement) if t == soft]
        rows = self.embed_rows
        if len(rows) != tokens or rows != list(range(rows[0], rows[0] + tokens)):
            raise ValueError(f"the tokenizer turns one image's text into {replacement[:4]}... with "
                             f"{len(self.embed_rows)} image_token_index={soft} tokens, not one run of "
                             f"mm_tokens_per_image={tokens}; its boi/image/eoi tokens do not match config.json")
        self.replacement = replacement
        self.newlines = dict(newlines)
        self.runs = {t: n for n, t in self.newlines.items()}  # a newlines token -> its run's length

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Gemma3ImageProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        folder = Path(folder)
        tokens = int(getattr(config, "mm_tokens_per_image", 256))
        path = folder / "processor_config.json"
        saved = json.loads(path.read_text()) if path.is_file() else {}
        if saved.get("image_seq_length", tokens) != tokens:
            raise ValueError(f"{path} sets image_seq_length={saved['image_seq_length']} but config.json's "
                             f"mm_tokens_per_image={tokens}; fix processor_config.json to match config.json")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        boi, soft, eoi = tokenizer.convert_ids_to_tokens([int(config.boi_token_index), int(config.image_token_index),
                                                          int(config.eoi_token_index)])
        text = f"\n\n{boi}{soft * tokens}{eoi}\n\n"
        replacement = tokenizer.encode(text, add_special_tokens=False)
        vocab = tokenizer.get_vocab()
        newlines = {n: vocab["\n" * n] for n in range(1, MAX_NEWLINES + 1) if "\n" * n in vocab}
        return cls(AutoImageProcessor.from_pretrained(folder), config, replacement, newlines)

    def process(self, image: Any) -> ProcessedImage:
        pixels = np.asarray(self.image_processor(images=[image], return_tensors="np")["pixel_values"][0],
                            dtype=np.float32)
        return ProcessedImage(list(self.replacement), {"pixel_values": pixels}, list(self.embed_rows),
                              bidirectional=True)

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE

    def _joined(self, a: int, b: int) -> int | None:
        """The one token of newlines ``a`` then ``b`` where Gemma's tokenizer has it, else None."""
        if a in self.runs and b in self.runs:
            return self.newlines.get(self.runs[a] + self.runs[b])
        return None

    def finish_prompt(self, token_ids: list[int], items: list[MultiModalItem]
                      ) -> tuple[list[int], list[MultiModalItem]]:
        """An expanded prompt as transformers tokenizes it: the newlines at each image's edges joined with their
        neighbours where the tokenizer has the joined run as one token (``\\n`` + ``\\n\\n`` as ``\\n\\n\\n``, two
        adjacent images' ``\\n\\n`` as ``\\n\\n\\n\\n``, ...), and each item narrowed to its soft tokens (its whole
        span then takes embeddings and attends both ways). ``items`` as :func:`specray.multimodal.expand_prompt` makes
        them (each span its image's whole replacement)."""
        edges = {e for item in items for e in (item.offset, item.end - 1)}
        out: list[int] = []
        moved = [0] * len(token_ids)  # an old index -> how many tokens before it were joined away
        for i, token in enumerate(token_ids):
            moved[i] = i - len(out)
            joined = self._joined(out[-1], token) if out and (i in edges or i - 1 in edges) else None
            if joined is not None:
                out[-1] = joined
            else:
                out.append(token)
        narrowed = []
        for item in items:
            rows = item.embed_rows if item.embed_rows is not None else list(range(item.length))
            first = item.offset + rows[0]
            narrowed.append(dataclasses.replace(item, offset=first - moved[first], length=len(rows),
                                                embed_rows=None))
        return out, narrowed
