"""Cohere Compass's images (``CohereCompassForConditionalGeneration``: North-Micro-Vision): its vision tower with the
patch merger and the DeepStack mergers (:class:`CohereCompassImageEncoder`) and its host side
(:class:`CohereCompassImageProcessor`), the two seams of :mod:`specray.multimodal`. transformers builds the release
from Qwen3-VL's pieces, which specray has (:mod:`specray.models.qwen3_vl_vision`):

* the tower is Qwen3-VL's, unchanged (patch embedding with a bias, the learned position table resampled bilinearly,
  the axial 2D RoPE, LayerNorm blocks, the merger, DeepStack mergers after ``deepstack_visual_indexes``):
  :class:`CohereCompassImageEncoder` is :class:`~specray.models.qwen3_vl_vision.Qwen3VLImageEncoder` with the text
  model's checks of Compass (below);
* the host side is Qwen3-VL's (transformers' ``CohereCompassImageProcessorPil`` is Qwen2-VL's image processor; the
  placeholder ``<|IMAGE_PAD|>``, the config's ``image_token_id``, once per merged token between ``<|VISION_START|>``
  and ``<|VISION_END|>``; Qwen3-VL's ``get_rope_index`` positions);
* the text model is Cohere Compass's (:mod:`specray.models.cohere_compass`: Command R7B's parallel layers, RoPE per
  kind of layer), which takes the image rows (``meta.input_embeds``), the DeepStack features after its first layers
  (``llama.add_deepstack``) and the three position ids per token (``meta.rope_positions``): each kind with RoPE
  rotates them interleaved over its ``mrope_section`` ([24, 20, 20] where it names none), a NoPE kind not at all.

The encoder is replicated on every tensor-parallel rank and reads its tensors under ``model.visual.`` or
``visual.``; DeepStack layers must lie on the first pipeline stage (Qwen3-VL's ``check_split``). Videos are not
served (the seam takes images only)."""

from __future__ import annotations

from typing import Any

from specray.models.cohere_compass import kind_mrope, kind_ropes
from specray.models.layers import mrope_axes
from specray.models.llama import _head_dim
from specray.models.plain_config import PlainConfig
from specray.models.qwen2_vl_vision import _field
from specray.models.qwen3_vl_vision import Qwen3VLImageEncoder, Qwen3VLImageProcessor


def check_compass_text_rope(config: Any, release: str = "Cohere Compass") -> None:
    """Each kind of the text model's layers with RoPE must take image positions as transformers rotates them: its
    ``mrope_section`` (or the default [24, 20, 20]) interleaved over the head's frequencies; a ValueError names the
    kind and the field where the sections do not split them."""
    text = _field(config, "text_config") or config
    text = PlainConfig(**text) if isinstance(text, dict) else text
    for kind, rope in kind_ropes(text).items():
        if rope is None:
            continue
        try:
            mrope_axes(kind_mrope(rope), _head_dim(text))
        except ValueError as err:
            raise ValueError(f"text_config.rope_parameters[{kind!r}]: {err} ({release} rotates image positions "
                             "over each kind's interleaved sections, [24, 20, 20] where mrope_section is not "
                             "given)") from None


class CohereCompassImageEncoder(Qwen3VLImageEncoder):
    """Cohere Compass's vision tower, patch merger and DeepStack mergers: Qwen3-VL's, built from the whole
    checkpoint's config (replicated on every rank); :meth:`encode` gives one image's [1 + k, t*h*w / merge², text
    hidden size]."""

    release = "Cohere Compass"
    check_text_rope = staticmethod(check_compass_text_rope)


class CohereCompassImageProcessor(Qwen3VLImageProcessor):
    """Cohere Compass's host side: Qwen3-VL's (transformers' image processor of the checkpoint, ``<|IMAGE_PAD|>``
    once per merged token, Qwen3-VL's multimodal RoPE positions for still images)."""


__all__ = ["CohereCompassImageEncoder", "CohereCompassImageProcessor", "check_compass_text_rope"]
