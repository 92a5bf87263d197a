"""PaliGemma's images (``PaliGemmaForConditionalGeneration``, transformers' ``models/paligemma``: google/paligemma-3b-*
(a Gemma text model) and google/paligemma2-3b / 10b / 28b-* (a Gemma 2 one)).

The text model is Gemma's or Gemma 2's (:mod:`specray.models.gemma`, :mod:`specray.models.gemma2`, served through
``registry._TEXT_PARTS``); their embedding step scales the tokens' embeddings by sqrt(hidden_size) and then puts the
image rows in place unscaled, as transformers does (its scaled word embedding scales the tokens only; transformers 5
no longer divides the image features by sqrt(hidden_size) first, and the older division was undone by the old model's
scaling of the whole input, so the rows reach the first layer unscaled either way). transformers counts PaliGemma's
positions from 1; RoPE and the masks see only differences of positions, so our 0-based ones give the same logits.

:class:`PaliGemmaImageEncoder`: SigLIP's vision tower (:mod:`specray.models.vision_towers`, every layer and its
``post_layernorm``: transformers reads the tower's ``last_hidden_state``) then one linear with bias
(``multi_modal_projector.linear``: vision hidden -> ``projection_dim``, the text model's hidden size); one embedding
per patch, ``(image_size / patch_size)^2`` an image.

:class:`PaliGemmaImageProcessor`: transformers' image processor of the folder (SigLIP's, PIL backend: one square
resize) makes the pixels; the placeholder ``<image>`` (``image_token_index``) becomes ``image_seq_length`` copies of
itself. PaliGemmaProcessor then writes the prompt as ``<image>...<image>`` + ``<bos>`` + the text + ``"\\n"`` (the
``<bos>`` right after the last image's tokens, no other ``<bos>``) and marks every prompt token as the *prefix*
(``token_type_ids`` 0): the whole prompt attends both ways in the first forward, and only the generated tokens
(the suffix) attend causally. :meth:`PaliGemmaImageProcessor.finish_prompt` (the seam's hook, called after splicing)
does the same on our ids: drops a leading ``<bos>`` (the tokenizer's), puts one after the last image's tokens,
appends the newline (joined with a run of newlines ending the prompt where the vocabulary has the longer run), and
makes the prompt's images ONE item spanning the whole prompt, ``bidirectional`` (the scheduler computes it in one step,
the runner lets its tokens see each other), its embedding rows the images' tokens, its tensors every image's pixels.
Its hash covers the prompt's tokens too: a prefix cached for one prompt was computed attending to that prompt's later
tokens, so another prompt with the same image must not reuse it.

Refused by name: a vision tower other than SigLIP's, a text model other than Gemma's or Gemma 2's, a
``projection_dim`` other than the text hidden size, an image processor whose ``image_seq_length`` or image size
differs from the tower's, a Gemma 2 prompt longer than ``sliding_window`` (transformers lets a prefix token see the
whole prefix in sliding layers too, beyond the window; we do not), and a prompt whose text precedes an image (the
prefix-wide span would have to start before it: put the images first, as PaliGemma's prompts do)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specray.models.vision_towers import SIGLIP, Linear, VisionTower, load_tower_and_projector
from specray.multimodal import IMAGE, MultiModalItem, ProcessedImage, item_hash

ARCH = "PaliGemmaForConditionalGeneration"
TEXT_MODELS = ("gemma", "gemma2")
MAX_NEWLINES = 31  # runs of newlines looked up in the vocabulary as one token, up to this length


def _check(config: Any) -> int:
    """The image's tokens (``(image_size / patch_size)^2``); a ValueError for what we do not serve."""
    vision = getattr(config, "vision_config", None)
    kind = getattr(vision, "model_type", None)
    if kind != SIGLIP:
        raise ValueError(f"vision_config.model_type={kind!r} is not supported for {ARCH}: its images are served with "
                         f"SigLIP's vision tower ({SIGLIP!r}); serve this checkpoint's text alone with a release of "
                         "its text model")
    text = getattr(getattr(config, "text_config", None), "model_type", None)
    if text not in TEXT_MODELS:
        raise ValueError(f"text_config.model_type={text!r} is not supported for {ARCH}: its images are served before "
                         f"the text models {list(TEXT_MODELS)} (PaliGemma's Gemma, PaliGemma 2's Gemma 2)")
    hidden = config.text_config.hidden_size
    projection = getattr(config, "projection_dim", None) or getattr(vision, "projection_dim", None) or hidden
    if projection != hidden:
        raise ValueError(f"projection_dim={projection} is not supported for {ARCH}: the projector must give the text "
                         f"model's text_config.hidden_size={hidden} (transformers would fail to place the image "
                         "features); fix config.json")
    if vision.image_size % vision.patch_size:
        raise ValueError(f"vision_config.image_size={vision.image_size} is not a multiple of vision_config.patch_size="
                         f"{vision.patch_size}")
    return (vision.image_size // vision.patch_size) ** 2


class PaliGemmaImageEncoder(nn.Module):
    """PaliGemma's SigLIP tower and linear projector (:class:`specray.multimodal.ImageEncoder`), built from the whole
    checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        self.tokens = _check(config)
        vision = config.vision_config
        self.tower = VisionTower(vision, post_norm=True)
        self.projector = nn.Module()
        self.projector.linear = Linear(vision.hidden_size, config.text_config.hidden_size, bias=True)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The tower's and the projector's tensors (any layout; SigLIP's pooling head unread); a ValueError names any
        of ours missing."""
        load_tower_and_projector(self, weights, ARCH)

    @property
    def device(self) -> torch.device:
        return self.projector.linear.weight.device

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """An item's ``pixel_values`` [n, C, S, S] (or one image's [C, S, S]) -> their embeddings
        [n * tokens, text hidden], image after image."""
        pixels = data["pixel_values"]
        if pixels.dim() == 3:
            pixels = pixels.unsqueeze(0)
        return self.projector.linear(self.tower(pixels)).flatten(0, 1)


class PaliGemmaImageProcessor:
    """PaliGemma's host side (:class:`specray.multimodal.ImageProcessor`): see the module docstring."""

    def __init__(self, image_processor: Any, config: Any, bos: int, newlines: dict[int, int]):
        self.tokens = _check(config)
        theirs = getattr(image_processor, "image_seq_length", None)
        if theirs is not None and int(theirs) != self.tokens:
            raise ValueError(f"the image processor's image_seq_length={theirs} differs from the tower's "
                             f"{self.tokens} patches (vision_config.image_size / patch_size, squared): fix "
                             "preprocessor_config.json to match config.json")
        self.image_processor, self.config = image_processor, config
        self.image_token_id = int(config.image_token_index)
        self.size = int(config.vision_config.image_size)
        self.bos, self.newlines = bos, dict(newlines)
        self.runs = {t: n for n, t in self.newlines.items()}  # a newlines token -> its run's length
        text = config.text_config
        self.window = getattr(text, "sliding_window", None) if text.model_type == "gemma2" else None

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> PaliGemmaImageProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        folder = Path(folder)
        _check(config)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if tokenizer.bos_token_id is None:
            raise ValueError(f"the tokenizer of {folder} has no bos_token: {ARCH}'s prompts put <bos> after the "
                             "image tokens; use the release's tokenizer")
        vocab = tokenizer.get_vocab()
        newlines = {n: vocab["\n" * n] for n in range(1, MAX_NEWLINES + 1) if "\n" * n in vocab}
        if 1 not in newlines:
            raise ValueError(f"the tokenizer of {folder} has no '\\n' token: {ARCH}'s prompts end with one")
        return cls(AutoImageProcessor.from_pretrained(folder), config, int(tokenizer.bos_token_id), newlines)

    def process(self, image: Any) -> ProcessedImage:
        pixels = np.asarray(self.image_processor(images=[image], return_tensors="np")["pixel_values"][0],
                            dtype=np.float32)
        if pixels.shape[-2:] != (self.size, self.size):
            raise ValueError(f"the image processor made {pixels.shape[-2:]} pixels; {ARCH}'s tower takes "
                             f"vision_config.image_size={self.size}: fix preprocessor_config.json (size)")
        return ProcessedImage([self.image_token_id] * self.tokens, {"pixel_values": pixels}, bidirectional=True)

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE

    def finish_prompt(self, token_ids: list[int], items: list[MultiModalItem]
                      ) -> tuple[list[int], list[MultiModalItem]]:
        """The expanded prompt as PaliGemmaProcessor writes it (see the module docstring) and its images as one
        bidirectional item spanning it. ``items``: :func:`specray.multimodal.expand_prompt`'s, one per image."""
        images = [item for item in items if item.modality == IMAGE]
        if not images:
            return token_ids, items
        if len(images) != len(items):
            raise ValueError(f"{ARCH} takes images only, no videos")
        ids = list(token_ids)
        shift = 0
        if ids and ids[0] == self.bos:  # the tokenizer's <bos>: PaliGemmaProcessor tokenizes without one
            ids, shift = ids[1:], 1
        first, end = images[0].offset - shift, images[-1].end - shift
        if first != 0:
            raise ValueError(f"the prompt holds {first} token(s) before its first image: {ARCH} serves prompts whose "
                             "images come first (<image>...<image>, then the text), as PaliGemma's prompts are written")
        if any(a.end != b.offset for a, b in zip(images, images[1:])):
            raise ValueError(f"the prompt has text between its images: {ARCH} serves prompts whose images come first, "
                             "one after another (<image><image>..., then the text)")
        rest = ids[end:]
        if rest[:1] != [self.bos]:  # PaliGemmaProcessor puts <bos> right after the last image's tokens
            rest = [self.bos] + rest
        run = self.runs.get(rest[-1], 0) if len(rest) > 1 else 0
        if run and run + 1 in self.newlines:  # the closing newline joins a run of newlines ending the text
            rest[-1] = self.newlines[run + 1]
        else:
            rest.append(self.newlines[1])
        out = ids[:end] + rest
        if self.window is not None and len(out) > self.window:
            raise ValueError(f"the prompt takes {len(out)} tokens, more than text_config.sliding_window={self.window}: "
                             f"{ARCH} (Gemma 2) lets each prompt token see the whole prompt in its sliding layers too, "
                             "which is not served; shorten the prompt or use fewer images")
        data = {"pixel_values": np.concatenate([item.data["pixel_values"][None] if item.data["pixel_values"].ndim == 3
                                                else item.data["pixel_values"] for item in images])}
        digest = item_hash(IMAGE, {**data, "prompt": np.asarray(out, dtype=np.int64)})
        whole = dataclasses.replace(images[0], offset=0, length=len(out), hash=digest, data=data,
                                    embed_rows=list(range(end)), bidirectional=True)
        return out, [whole]
