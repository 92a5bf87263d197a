"""Fuyu's images (``FuyuForCausalLM``, transformers' ``models/fuyu``: adept/fuyu-8b). Fuyu has no vision tower: the
image, resized to fit within ``size`` (1080 x 1920, only shrunk, aspect kept), normalized and padded, is cut to the
30 x 30 patches its unpadded part covers (rounded up), each patch flattened (rows, columns, channels) and sent through
one linear (``vision_embed_tokens``) into the text width. The text model is Persimmon
(:mod:`specray.models.persimmon`, served through ``registry._TEXT_PARTS``); the patch rows replace the image
placeholder tokens' embeddings (``LlamaModel.embed_step`` applies ``meta.input_embeds``).

The prompt, as ``FuyuProcessor`` makes it for one text and one image: the image first, as rows of ``|SPEAKER|``
(one per patch, the placeholder ``image_token_id`` the model scatters into) each closed by ``|NEWLINE|`` (which keeps
its own embedding), then ``<s>`` (BOS, after the image), then the text with ``<0x04>`` (the beginning of answer)
appended, the text tokenized alone without special tokens. Served forms (:class:`FuyuImageProcessor`):

* ``{"prompt_token_ids": [|SPEAKER|] + tokenizer(text + "<0x04>", add_special_tokens=False), ...}``: the expanded
  ids equal transformers' exactly;
* ``{"prompt": "|SPEAKER|" + text + "<0x04>", ...}``: the tokenizer's ids before the placeholder (its BOS, the bare
  prefix piece a sentencepiece normalizer writes) are dropped, as ``FuyuProcessor`` strips them; the text after the
  placeholder is tokenized as part of the whole string, which equals transformers' where the text starts with a
  space (a sentencepiece tokenizer then writes the same first piece: ``"|SPEAKER| " + text + "<0x04>"``).

Refused by name: more than one image in a prompt, or an image not at its start (``FuyuProcessor`` takes one image per
text and puts it first), a tokenizer without ``|SPEAKER|`` / ``|NEWLINE|`` / ``<s>``, a ``|SPEAKER|`` id other than
the config's ``image_token_id`` (transformers' forward would scatter into other rows), and an image processor whose
patch size or a config whose ``num_channels`` differs from the model's linear. ``<box>`` / ``<point>`` coordinate
rewriting (FuyuProcessor's ``transform_coordinates``) is not done: write the model's ``<0x00>``..``<0x03>`` tokens
yourself."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specray.models.vision_towers import copy_weights
from specray.multimodal import MultiModalItem, ProcessedImage, special_token_ids

ARCH = "FuyuForCausalLM"
IMAGE_TOKEN, NEWLINE_TOKEN, BOS_TOKEN = "|SPEAKER|", "|NEWLINE|", "<s>"
PREFIXES = ("vision_embed_tokens.", "model.vision_embed_tokens.")  # the release's, transformers' modules'


def _patch_width(config: Any) -> int:
    """The linear's input width: patch_size² x num_channels (refused unless three channels)."""
    if int(getattr(config, "num_channels", 3)) != 3:
        raise ValueError(f"num_channels={config.num_channels} is not supported for {ARCH}: its images are RGB "
                         "(three channels, as FuyuImageProcessor makes them); set num_channels to 3")
    return int(config.patch_size) ** 2 * 3


def _patch_size(image_processor: Any) -> tuple[int, int]:
    patch = image_processor.patch_size
    return (patch["height"], patch["width"]) if isinstance(patch, dict) else (patch.height, patch.width)


class FuyuImageEncoder(nn.Module):
    """``vision_embed_tokens``: each flattened patch [patch_size² x 3] to one text embedding."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        self.vision_embed_tokens = nn.Linear(_patch_width(config), int(config.text_config.hidden_size))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        params = dict(self.named_parameters())
        own = ((name[len(p):], tensor) for name, tensor in weights for p in PREFIXES if name.startswith(p))
        missing = copy_weights({n.removeprefix("vision_embed_tokens."): v for n, v in params.items()}, own)
        if missing:
            raise ValueError(f"the checkpoint lacks {ARCH}'s patch embedder tensors "
                             f"{['vision_embed_tokens.' + n for n in missing]}; use the release's checkpoint")

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's patches [num_patches, patch_size² x 3] -> [num_patches, hidden]."""
        return self.vision_embed_tokens(data["pixel_values"])


class FuyuImageProcessor:
    """Fuyu's host side: transformers' ``FuyuImageProcessorPil`` (resize, normalize, pad; its numpy patchify, equal
    to the torchvision backend's unfold) and ``FuyuProcessor``'s prompt: ``|SPEAKER|`` rows closed by ``|NEWLINE|``,
    then ``<s>``; the embeddings on the ``|SPEAKER|`` rows only."""

    def __init__(self, image_processor: Any, ids: list[int], prefix_ids: set[int]):
        self.image_processor = image_processor
        self.image_token_id, self.newline_id, self.bos_id = ids
        self.prefix_ids = prefix_ids  # what a tokenizer writes before a prompt's first token (BOS, "▁")

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> FuyuImageProcessor:
        from transformers import AutoTokenizer
        from transformers.models.fuyu.image_processing_pil_fuyu import FuyuImageProcessorPil

        folder = Path(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = special_token_ids(tokenizer, [IMAGE_TOKEN, NEWLINE_TOKEN, BOS_TOKEN], folder, "FuyuProcessor")
        if getattr(config, "image_token_id", None) != ids[0]:
            raise ValueError(f"image_token_id={getattr(config, 'image_token_id', None)} of {ARCH}'s config is not "
                             f"the tokenizer's {IMAGE_TOKEN!r} ({ids[0]}), which FuyuProcessor writes per patch; set "
                             f"image_token_id to {ids[0]}")
        image_processor = FuyuImageProcessorPil.from_pretrained(folder)
        patch = _patch_size(image_processor)
        if patch != (int(config.patch_size),) * 2:
            raise ValueError(f"the image processor's patch_size={patch} of {folder} differs from the config's "
                             f"patch_size={config.patch_size} (vision_embed_tokens' input); save the release's "
                             "preprocessor_config.json")
        _patch_width(config)
        prefix = {tokenizer.convert_tokens_to_ids(t) for t in (tokenizer.bos_token, "\u2581") if t is not None}
        prefix.discard(getattr(tokenizer, "unk_token_id", None))
        prefix.discard(None)
        return cls(image_processor, ids, prefix)

    def process(self, image: Any) -> ProcessedImage:
        ip = self.image_processor
        out = ip(images=[image], return_tensors=None)
        padded = np.asarray(out["images"][0][0], dtype=np.float32)  # [3, H, W], padded to ``size``
        ph, pw = self.patch
        height = min(padded.shape[-2], math.ceil(out["image_unpadded_heights"][0][0] / ph) * ph)
        width = min(padded.shape[-1], math.ceil(out["image_unpadded_widths"][0][0] / pw) * pw)
        if height % ph or width % pw:
            raise ValueError(f"an image of {height} x {width} (not padded: do_pad false) is not a whole number of "
                             f"{ph} x {pw} patches; set do_pad true in the image processor's settings")
        patches = np.ascontiguousarray(ip.patchify_image(padded[:, :height, :width][None]), dtype=np.float32)
        rows, cols = height // ph, width // pw
        line = [self.image_token_id] * cols + [self.newline_id]
        replacement = line * rows + [self.bos_id]
        embed_rows = [r * (cols + 1) + c for r in range(rows) for c in range(cols)]
        return ProcessedImage(replacement, {"pixel_values": patches.reshape(rows * cols, -1)}, embed_rows)

    @property
    def patch(self) -> tuple[int, int]:
        return _patch_size(self.image_processor)

    def finish_prompt(self, token_ids: list[int], items: list[MultiModalItem]
                      ) -> tuple[list[int], list[MultiModalItem]]:
        """The image must be the prompt's only one and come first; the tokenizer's BOS or bare prefix piece before
        its placeholder are dropped (FuyuProcessor's BOS follows the image)."""
        if len(items) != 1:
            raise ValueError(f"a {ARCH} prompt holds {len(items)} images; FuyuProcessor takes one image per prompt: "
                             "send one")
        item = items[0]
        head = token_ids[:item.offset]
        if any(t not in self.prefix_ids for t in head) or len(head) > 2:
            raise ValueError(f"a {ARCH} prompt's image placeholder {IMAGE_TOKEN!r} must come first (FuyuProcessor puts "
                             f"the image before the text): write {IMAGE_TOKEN!r} + text + '<0x04>'")
        item.offset -= len(head)
        return token_ids[len(head):], items

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain (partial) RoPE
