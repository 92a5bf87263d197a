"""LLaVA's images (``LlavaForConditionalGeneration``, transformers' ``models/llava``: LLaVA 1.5 and the releases that
reuse its layout): a CLIP or SigLIP vision tower (:mod:`specray.models.vision_towers`) whose hidden states at
``vision_feature_layer`` (one index, or several whose states are concatenated feature-wise; transformers' indices, the
default -2: the output of the last layer but one) become, through the two-layer ``multi_modal_projector``
(``linear_2(act(linear_1(x)))``, biases by ``multimodal_projector_bias``), one text embedding per image token.
``vision_feature_select_strategy`` "default" drops each image's first token (CLIP's class token; SigLIP's first patch,
as transformers drops it), "full" keeps every token.

The text model is whatever ``text_config`` names (Llama, Mistral, Qwen2, ...), served by its own class through
``registry._TEXT_PARTS``; :class:`LlavaImageEncoder` (vision tower and projector) and :class:`LlavaImageProcessor`
(transformers' image processor; the prompt's ``image_token_index`` placeholder expanded to one token per embedding,
as ``LlavaProcessor`` expands it) are this family's seams of :mod:`specray.multimodal`. A Granite text model
(granite-vision-3.x, a LLaVA-NeXT) scales the image rows as its tokens' (``LlamaModel.embed_step``: transformers'
Granite multiplies the whole merged ``inputs_embeds`` by ``embedding_multiplier``), and the whole model's plain
``lm_head`` does not divide by its ``logits_scaling`` (``registry._TEXT_CONFIG_FIXES``). The
checkpoint's own tensors are read in each layout: the releases' (``vision_tower.vision_model.*``,
``multi_modal_projector.*``, llava-hf/llava-1.5-7b-hf), what transformers 5 saves (``vision_tower.*``: its vision
models have no ``vision_model`` level) and transformers' modules' (``model.vision_tower.*``,
``model.multi_modal_projector.*``).

Pixtral-12B (``mistral-community/pixtral-12b``: ``vision_config.model_type`` "pixtral") puts Pixtral's tower
(:mod:`specray.models.pixtral_vision`: one image at its own size, transformers' ``image_sizes`` path) before the same
two linears, every patch kept (the "full" strategy; "default" refused), one feature layer; its processor is Mistral
3's (:class:`specray.models.mistral3.Mistral3Processor`, ``spatial_merge_size`` 1: PixtralProcessor's ``[IMG]`` rows
closed by ``[IMG_BREAK]`` / ``[IMG_END]``, the embeddings on the ``[IMG]`` rows only).

Refused by name: a vision tower other than CLIP's, SigLIP's or Pixtral's, another select strategy, feature layers out
of range, unknown activations, and a ``processor_config.json`` whose token count disagrees with the model's
(transformers' forward would refuse that prompt)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specray.models.mistral3 import Mistral3Processor
from specray.models.pixtral_vision import PIXTRAL, PixtralVisionModel
from specray.models.vision_towers import (CLIP, VISION_MODEL_TYPES, Linear, VisionTower, load_tower_and_projector,
                                          feature_indices, vision_activation)
from specray.multimodal import MultiModalItem, ProcessedImage

logger = logging.getLogger(__name__)

ARCH = "LlavaForConditionalGeneration"
STRATEGIES = ("default", "full")


def _vision_config(config: Any) -> Any:
    vision = getattr(config, "vision_config", None)
    kind = getattr(vision, "model_type", None)
    if kind not in VISION_MODEL_TYPES + (PIXTRAL,):
        raise ValueError(f"vision_config.model_type={kind!r} is not supported for {ARCH}: its images are served with "
                         f"the vision towers {list(VISION_MODEL_TYPES + (PIXTRAL,))} (CLIP's, SigLIP's, Pixtral's); "
                         "serve this checkpoint's text alone with a release of its text model, or one with a "
                         "supported vision tower")
    return vision


def _strategy(config: Any) -> str:
    strategy = getattr(config, "vision_feature_select_strategy", "default")
    if strategy not in STRATEGIES:
        raise ValueError(f"vision_feature_select_strategy={strategy!r} is not supported for {ARCH}; one of "
                         f"{list(STRATEGIES)} ('default' drops each image's first token, 'full' keeps it)")
    if strategy != "full" and _is_pixtral(config):
        raise ValueError(f"vision_feature_select_strategy={strategy!r} is not supported for {ARCH} with a Pixtral "
                         "tower (it would drop the first patch of the batch, leaving the [IMG] rows one short): set "
                         "it to 'full', as Pixtral-12B's config.json does")
    return strategy


def _is_pixtral(config: Any) -> bool:
    """Pixtral-12B's layout: a Pixtral tower (one image at its own size, ``image_sizes``) before LLaVA's projector;
    its processor is Mistral 3's (PixtralProcessor's ``[IMG]`` rows closed by ``[IMG_BREAK]`` / ``[IMG_END]``)."""
    return getattr(getattr(config, "vision_config", None), "model_type", None) == PIXTRAL


def _pixtral_depth(config: Any) -> int:
    """Pixtral-12B's ``vision_feature_layer`` (one transformers hidden-state index) as the tower layers to run."""
    layers = getattr(config, "vision_feature_layer", -2)
    indices = feature_indices(layers, config.vision_config.num_hidden_layers, "vision_feature_layer")
    if len(indices) != 1:
        raise ValueError(f"vision_feature_layer={layers!r} is not supported for {ARCH} with a Pixtral tower: one "
                         "hidden-state index only (Pixtral-12B's is -1)")
    return indices[0]


def tokens_per_image(config: Any, height: int, width: int) -> int:
    """The embeddings (and placeholder tokens) of one image of ``height`` x ``width`` pixels: its patches, CLIP's
    class token, less the first token under the "default" strategy."""
    vision = _vision_config(config)
    patch = vision.patch_size
    extra = int(vision.model_type == CLIP) - int(_strategy(config) == "default")
    return (height // patch) * (width // patch) + extra


class LlavaImageEncoder(nn.Module):
    """LLaVA's vision tower and projector (:class:`specray.multimodal.ImageEncoder`), built from the whole checkpoint's
    config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        vision = _vision_config(config)
        self.strategy = _strategy(config)
        self.pixtral = _is_pixtral(config)
        if self.pixtral:  # Pixtral-12B: one image at its own size, every patch kept (the "full" strategy)
            self.indices = [_pixtral_depth(config)]
            self.tower = PixtralVisionModel(vision, depth=self.indices[0])
        else:
            self.indices = feature_indices(getattr(config, "vision_feature_layer", -2), vision.num_hidden_layers,
                                           "vision_feature_layer")
            self.tower = VisionTower(vision, depth=max(self.indices))
        text_hidden = config.text_config.hidden_size
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        self.projector = nn.Module()
        self.projector.linear_1 = Linear(vision.hidden_size * len(self.indices), text_hidden, bias)
        self.projector.linear_2 = Linear(text_hidden, text_hidden, bias)
        self.act = vision_activation(getattr(config, "projector_hidden_act", "gelu"), "projector_hidden_act")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The tower's tensors (layers past the deepest feature layer, ``post_layernorm`` and SigLIP's head unread)
        and the projector's, in either layout; a ValueError names any of ours missing."""
        load_tower_and_projector(self, weights, ARCH, " (multimodal_projector_bias, vision_feature_layer)")

    @property
    def device(self) -> torch.device:
        return self.projector.linear_1.weight.device

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The tower's selected hidden states of ``pixel_values`` [B, C, S, S], before the projector: [B, N, D * k]
        (Pixtral's: one image [1, C, H, W], its patches row-major)."""
        if self.pixtral:
            return self.tower(pixel_values)[0][None]
        states = self.tower.hidden_states(pixel_values, self.indices)
        if self.strategy == "default":
            states = [s[:, 1:] for s in states]
        return torch.cat(states, dim=-1)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return self.projector.linear_2(self.act(self.projector.linear_1(features)))

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's ``pixel_values`` [C, S, S] (or [1, C, S, S]) -> its embeddings [tokens, text hidden size]."""
        pixels = data["pixel_values"]
        if pixels.dim() == 3:
            pixels = pixels.unsqueeze(0)
        return self.project(self.features(pixels))[0]


class LlavaImageProcessor:
    """LLaVA's host side (:class:`specray.multimodal.ImageProcessor`): transformers' image processor of the
    checkpoint's folder (CLIP's, LLaVA's padding one, SigLIP's) makes the pixels; the placeholder
    (``image_token_index``) becomes :func:`tokens_per_image` copies of itself, each taking one embedding."""

    def __init__(self, image_processor: Any, config: Any):
        self.image_processor = image_processor
        self.config = config
        self.image_token_id = int(config.image_token_index)
        tokens_per_image(config, 1, 1)  # the vision config and strategy refused here already, by name

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> LlavaImageProcessor | Mistral3Processor:
        from transformers import AutoImageProcessor

        folder = Path(folder)
        if _is_pixtral(config):  # Pixtral-12B's prompt expansion is PixtralProcessor's, as Mistral 3 serves it
            _strategy(config)
            return Mistral3Processor.from_pretrained(folder, config)
        _check_processor_config(folder, config)
        return cls(AutoImageProcessor.from_pretrained(folder), config)

    def process(self, image: Any) -> ProcessedImage:
        pixels = np.asarray(self.image_processor(images=[image], return_tensors="np")["pixel_values"][0],
                            dtype=np.float32)
        count = tokens_per_image(self.config, *pixels.shape[-2:])
        return ProcessedImage([self.image_token_id] * count, {"pixel_values": pixels})

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE


def _check_processor_config(folder: Path, config: Any) -> None:
    """A ``processor_config.json`` (LlavaProcessor's) must expand the placeholder to as many tokens as the model
    has embeddings per image; one that names no patch size (older releases) is not read."""
    path = folder / "processor_config.json"
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    patch = saved.get("patch_size")
    if patch is None:
        return
    vision = _vision_config(config)
    strategy = saved.get("vision_feature_select_strategy") or _strategy(config)
    theirs = int(saved.get("num_additional_image_tokens", 0)) - int(strategy == "default")
    ours = int(vision.model_type == CLIP) - int(_strategy(config) == "default")
    if patch != vision.patch_size or theirs != ours:
        raise ValueError(f"{path} (patch_size={patch}, num_additional_image_tokens="
                         f"{saved.get('num_additional_image_tokens', 0)}, vision_feature_select_strategy="
                         f"{strategy!r}) expands an image to another number of tokens than the model embeds "
                         f"(vision_config.patch_size={vision.patch_size}, {vision.model_type}, "
                         f"vision_feature_select_strategy={_strategy(config)!r}); fix processor_config.json to match "
                         "config.json")
