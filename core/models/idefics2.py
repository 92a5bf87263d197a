"""Idefics2 with images (``Idefics2ForConditionalGeneration``: HuggingFaceM4/idefics2-8b, -8b-base, -8b-chatty;
transformers' ``models/idefics2``).

An image is resized by transformers' image processor of the checkpoint's folder (its longest edge to at most
``size.longest_edge``, each edge at least ``size.shortest_edge``, the aspect ratio kept otherwise) and, where
``do_image_splitting`` is on, first cut into its four quarters with the whole image last (each of the five resized
alone); the crops are padded to the largest of them (``pixel_attention_mask`` marks the real pixels). Each crop goes
through a SigLIP-like vision model of native resolution (Idefics3's: a biased patch conv, a learned embedding per cell
of the ``image_size`` grid looked up by each real patch's fractional place, SigLIP's encoder layers, ``post_layernorm``;
reused from :mod:`specray.models.idefics3`) over its real patches only (transformers masks the padded ones out of every
attention, so leaving them out gives the same rows); then the connector: ``modality_projection`` (a gated MLP of the
text model's width and activation, bias-free) and the perceiver resampler (``resampler_n_latents`` learned latents,
``resampler_depth`` layers of pre-RMSNorm grouped-query cross-attention whose keys and values are the crop's projected
patches followed by the latents themselves, then a gated MLP of four times the width, a final RMSNorm):
``resampler_n_latents`` embeddings per crop.

The prompt's ``<image>`` (once per image, as the chat template renders an image part) becomes what Idefics2Processor
writes for it: ``<fake_token_around_image>``, then per crop ``image_seq_len`` ``<image>`` tokens and a
``<fake_token_around_image>``; only the ``<image>`` rows take embeddings. As the processor does on the prompt's text,
two fake tokens meeting (adjacent images) become one and a word glued to an image's closing fake token gets a space
before it (:meth:`Idefics2ImageProcessor.finish_prompt`). The text model (Mistral 7B) is served by ``LlamaForCausalLM``
from ``model.text_model.*`` and ``lm_head.*`` (``registry._TEXT_PARTS``, as Idefics3's).

Refused by name: another vision model type, unknown activations, a perceiver whose heads do not group its key/value
heads, a ``processor_config.json`` ``image_seq_len`` other than ``resampler_n_latents``, a tokenizer without the image
tokens or whose ``<image>`` is not ``image_token_id``, an image processor without the Idefics2 settings."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.idefics3 import Idefics3VisionModel, load_tower_and_connector
from specray.models.layers import RMSNorm, _param
from specray.models.vision_towers import Linear, vision_activation
from specray.multimodal import MultiModalItem, ProcessedImage

logger = logging.getLogger(__name__)

ARCH = "Idefics2ForConditionalGeneration"
VISION_TYPE = "idefics2_vision"
FAKE, IMAGE = "<fake_token_around_image>", "<image>"
SPLITS = 5  # do_image_splitting: the four quarters and the whole image
DEFAULT_SEQ_LEN = 64  # Idefics2Processor's image_seq_len when processor_config.json names none


def _vision_config(config: Any) -> Any:
    vision = getattr(config, "vision_config", None)
    kind = getattr(vision, "model_type", None)
    if kind != VISION_TYPE:
        raise ValueError(f"vision_config.model_type={kind!r} is not supported for {ARCH}: only {VISION_TYPE!r} (its "
                         "SigLIP-like vision model) is; serve the text alone with a release of its text model")
    return vision


def _perceiver_config(config: Any) -> Any:
    perceiver = getattr(config, "perceiver_config", None)
    if perceiver is None:
        raise ValueError(f"{ARCH}'s config.json has no perceiver_config (the connector's resampler); fix config.json")
    heads, kv = perceiver.resampler_n_heads, perceiver.num_key_value_heads
    if kv < 1 or heads % kv:
        raise ValueError(f"perceiver_config.num_key_value_heads={kv} does not divide perceiver_config."
                         f"resampler_n_heads={heads}: each key/value head must serve a whole group of query heads; "
                         "fix config.json")
    return perceiver


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, bias-free (the connector's ``modality_projection`` and the perceiver's MLP)."""

    def __init__(self, hidden: int, intermediate: int, out: int, act_name: str, field: str):
        super().__init__()
        self.act = vision_activation(act_name, field)
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PerceiverAttention(nn.Module):
    """The latents' queries over keys and values of ``[context; latents]`` (grouped-query heads, no biases, no
    positions, no mask: the context holds a crop's real patches only)."""

    def __init__(self, config: Any):
        super().__init__()
        hidden = config.hidden_size
        self.heads, self.kv_heads, self.head_dim = (config.resampler_n_heads, config.num_key_value_heads,
                                                    config.resampler_head_dim)
        self.q_proj = Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.heads * self.head_dim, hidden, bias=False)

    def forward(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        # latents: [L, H], context: [N, H] -> [L, H]
        both = torch.cat([context, latents])
        q = self.q_proj(latents).view(-1, self.heads, self.head_dim).transpose(0, 1)
        k, v = (p(both).view(-1, self.kv_heads, self.head_dim).transpose(0, 1) for p in (self.k_proj, self.v_proj))
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(0, 1).reshape(latents.shape[0], -1))


class PerceiverLayer(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_latents_norm, self.input_context_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.self_attn = PerceiverAttention(config)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, 4 * hidden, hidden, config.hidden_act, "perceiver_config.hidden_act")

    def forward(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        latents = latents + self.self_attn(self.input_latents_norm(latents), self.input_context_norm(context))
        return latents + self.mlp(self.post_attention_layernorm(latents))


class PerceiverResampler(nn.Module):
    """``resampler_n_latents`` learned latents through ``resampler_depth`` cross-attention layers, then RMSNorm."""

    def __init__(self, config: Any):
        super().__init__()
        self.latents = _param(config.resampler_n_latents, config.hidden_size)
        self.layers = nn.ModuleList(PerceiverLayer(config) for _ in range(config.resampler_depth))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        latents = self.latents
        for layer in self.layers:
            latents = layer(latents, context)
        return self.norm(latents)


class Idefics2ImageEncoder(nn.Module):
    """The vision model, ``modality_projection`` and the perceiver resampler (:class:`specray.multimodal.ImageEncoder`),
    built from the whole checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        vision, perceiver, text = _vision_config(config), _perceiver_config(config), config.text_config
        if perceiver.hidden_size != text.hidden_size:
            raise ValueError(f"perceiver_config.hidden_size={perceiver.hidden_size} differs from text_config."
                             f"hidden_size={text.hidden_size}: the resampler works at the text model's width; fix "
                             "config.json")
        self.patch_size = vision.patch_size
        self.tower = Idefics3VisionModel(vision)
        self.connector = nn.Module()
        self.connector.modality_projection = GatedMLP(vision.hidden_size, text.intermediate_size, text.hidden_size,
                                                      text.hidden_act, "text_config.hidden_act")
        self.connector.perceiver_resampler = PerceiverResampler(perceiver)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_tower_and_connector(self, weights, "vision_config / perceiver_config")

    @property
    def device(self) -> torch.device:
        return self.connector.perceiver_resampler.latents.device

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's crops ``pixel_values`` [crops, C, H, W] (padded to the largest, the whole image last) and
        ``pixel_attention_mask`` [crops, H, W] -> its embeddings [crops * resampler_n_latents, text hidden size]."""
        pixels = data["pixel_values"]
        mask = data.get("pixel_attention_mask")
        if pixels.dim() == 3:
            pixels = pixels.unsqueeze(0)
            mask = None if mask is None else mask.unsqueeze(0)
        p = self.patch_size
        if mask is None:
            grids = [(pixels.shape[-2] // p, pixels.shape[-1] // p)] * pixels.shape[0]
        else:  # a patch is real where all its pixels are (transformers' rule); the real ones fill the top left
            patches = mask.bool()[:, : mask.shape[1] // p * p, : mask.shape[2] // p * p]
            patches = patches.unflatten(1, (-1, p)).unflatten(3, (-1, p)).all(dim=4).all(dim=2)
            grids = torch.stack([patches[:, :, 0].sum(1), patches[:, 0, :].sum(1)], 1).tolist()  # once per image
        rows = []
        for crop, (h, w) in zip(pixels, grids):
            if h == 0 or w == 0:
                raise ValueError(f"a crop of {tuple(crop.shape[-2:])} pixels holds no whole {p}x{p} patch")
            features = self.tower(crop[None, :, : h * p, : w * p])[0]
            rows.append(self.connector.perceiver_resampler(self.connector.modality_projection(features)))
        return torch.cat(rows)


class Idefics2ImageProcessor:
    """Idefics2's host side (:class:`specray.multimodal.ImageProcessor`): transformers' image processor of the
    checkpoint's folder resizes, splits, normalizes and pads the crops; the ``<image>`` placeholder becomes
    ``<fake_token_around_image>`` and, per crop, ``image_seq_len`` ``<image>`` tokens and a fake token."""

    def __init__(self, image_processor: Any, tokenizer: Any, config: Any, seq_len: int):
        _vision_config(config)
        latents = _perceiver_config(config).resampler_n_latents
        if seq_len != latents:
            raise ValueError(f"processor_config.json's image_seq_len={seq_len} disagrees with perceiver_config."
                             f"resampler_n_latents={latents} (the embeddings per crop): the prompt would hold another "
                             "number of <image> tokens; fix processor_config.json")
        splitting = getattr(image_processor, "do_image_splitting", None)
        if not isinstance(splitting, bool):
            raise ValueError(f"the image processor ({type(image_processor).__name__}) has do_image_splitting="
                             f"{splitting!r}; use the release's Idefics2 image processor (preprocessor_config.json)")
        names = (getattr(tokenizer, "image_boundary_token", FAKE), getattr(tokenizer, "image_token", IMAGE))
        if names != (FAKE, IMAGE):
            raise ValueError(f"the tokenizer names its image tokens {list(names)}, not {[FAKE, IMAGE]}: only the "
                             "release's tokens are supported")
        unk = getattr(tokenizer, "unk_token_id", None)
        for token in (FAKE, IMAGE):
            found = tokenizer.convert_tokens_to_ids(token)
            if found is None or found == unk or len(tokenizer.encode(token, add_special_tokens=False)) != 1:
                raise ValueError(f"the tokenizer has no {token} token, which the processor writes for each image; "
                                 "use the release's tokenizer")
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE))
        if self.image_token_id != int(config.image_token_id):
            raise ValueError(f"the tokenizer's {IMAGE} is id {self.image_token_id} but image_token_id="
                             f"{config.image_token_id}: transformers fills image_token_id's rows with the image; fix "
                             "config.json or the tokenizer")
        self.fake_token_id = int(tokenizer.convert_tokens_to_ids(FAKE))
        self.image_processor, self.tokenizer, self.seq_len = image_processor, tokenizer, seq_len
        self.crops = SPLITS if splitting else 1
        self.replacement = tokenizer.encode(FAKE + (IMAGE * seq_len + FAKE) * self.crops, add_special_tokens=False)
        self.embed_rows = [i for i, t in enumerate(self.replacement) if t == self.image_token_id]
        self.special = set(getattr(tokenizer, "all_special_ids", ())) | set(
            getattr(tokenizer, "added_tokens_encoder", {}).values())

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Idefics2ImageProcessor:
        """From the folder's image processor (``preprocessor_config.json``), tokenizer and ``processor_config.json``
        (``image_seq_len``)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        folder = Path(folder)
        path = folder / "processor_config.json"
        saved = json.loads(path.read_text()) if path.is_file() else {}
        return cls(AutoImageProcessor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), config,
                   int(saved.get("image_seq_len", DEFAULT_SEQ_LEN)))

    def process(self, image: Any) -> ProcessedImage:
        out = self.image_processor(images=[[image]], return_tensors="np", do_pad=True)
        pixels = np.asarray(out["pixel_values"][0], dtype=np.float32)
        mask = np.asarray(out["pixel_attention_mask"][0], dtype=np.int64)
        assert pixels.shape[0] == self.crops, (pixels.shape, self.crops)
        return ProcessedImage(list(self.replacement), {"pixel_values": pixels, "pixel_attention_mask": mask},
                              list(self.embed_rows))

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE

    def _spaced(self, segment: list[int]) -> list[int]:
        """A run of text tokens right after an image's closing fake token, as transformers tokenizes it: with a
        space put before it where its text starts with neither whitespace nor ``<``."""
        text = self.tokenizer.decode([self.fake_token_id, *segment], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
        assert text.startswith(FAKE), text
        text = text[len(FAKE):]
        if not text or text[0].isspace() or text[0] == "<":
            return segment
        return self.tokenizer.encode(f"{FAKE} {text}", add_special_tokens=False)[1:]

    def finish_prompt(self, token_ids: list[int], items: list[MultiModalItem]
                      ) -> tuple[list[int], list[MultiModalItem]]:
        """The expanded prompt as Idefics2Processor writes it: a fake token meeting another one at an image's edge
        (adjacent images) dropped, and the text glued after an image spaced off (:meth:`_spaced`); items moved."""
        out: list[int] = []
        moved: list[MultiModalItem] = []
        i = 0
        for item in items:
            out.extend(token_ids[i:item.offset])
            span = token_ids[item.offset:item.end]
            rows = item.embed_rows
            if out and out[-1] == self.fake_token_id and span and span[0] == self.fake_token_id:
                span, rows = span[1:], [r - 1 for r in rows]
            moved.append(replace(item, offset=len(out), length=len(span), embed_rows=rows))
            out.extend(span)
            i = item.end
            if i < len(token_ids) and token_ids[i] == self.fake_token_id and not any(
                    other.offset == i for other in items):
                i += 1  # a literal fake token after the image's closing one
            stop = i
            while stop < len(token_ids) and token_ids[stop] not in self.special:
                stop += 1
            if stop > i:
                out.extend(self._spaced(token_ids[i:stop]))
                i = stop
        out.extend(token_ids[i:])
        return out, moved
