"""Qwen3.5's and Qwen3.5-MoE's images (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``):
Qwen3-VL's vision tower and patch merger without DeepStack (:class:`Qwen3_5ImageEncoder`), and Qwen3-VL's host side
(:class:`Qwen3_5ImageProcessor`: transformers' image processor, ``<|image_pad|>`` once per merged token between
``<|vision_start|>`` and ``<|vision_end|>``, the multimodal RoPE positions of a still image, which are Qwen3.5's
``get_rope_index``'s too).

What differs from Qwen3-VL (:mod:`specray.models.qwen3_vl_vision`):

* the tower has no DeepStack mergers (transformers' Qwen3.5 vision model deletes them and its config has no
  ``deepstack_visual_indexes``): ``encode`` gives the final merger's embeddings alone (``deepstack_layers = 0``);
  a ``deepstack_visual_indexes`` left in a config is not read, as transformers does not;
* the text models are the hybrid ones of :mod:`specray.models.qwen3_5` (Gated DeltaNet and gated attention), whose
  embedding step takes the image rows (``meta.input_embeds``) and whose attention layers rotate their partial RoPE
  (the first ``partial_rotary_factor`` of each head) by the interleaved multimodal positions (``meta.rope_positions``;
  ``mrope_section`` splits the rotated frequencies, 11 / 11 / 10 of 32 in the releases). The linear layers read no
  positions, so a prefill chunk splitting an image's span carries their recurrent state as any chunk does.

The encoder is replicated on every tensor-parallel rank and reads its tensors under ``model.visual.`` (the releases'
names) or ``visual.``. Videos: Qwen3-VL's (:mod:`specray.models.qwen3_vl_video`,
the same processor; this tower over ``pixel_values_videos`` / ``video_grid_thw``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from specray.models.qwen3_vl_vision import Qwen3VLImageEncoder, Qwen3VLImageProcessor


class Qwen3_5ImageEncoder(Qwen3VLImageEncoder):
    """Qwen3.5's vision tower and patch merger (Qwen3-VL's, no DeepStack), built from the whole checkpoint's config
    (replicated on every rank); :meth:`encode` gives one image's [t*h*w / merge², text hidden size]."""

    deepstack_layers = 0
    release = "Qwen3.5"

    def __init__(self, config: Any):
        super().__init__(config)
        # transformers' Qwen3.5 tower has no DeepStack mergers, whatever the vision config lists
        self.deepstack, self.deepstack_layers = [], 0
        self.deepstack_merger_list = nn.ModuleList()

    @staticmethod
    def check_split(config: Any, tp: int, pp: int) -> None:
        """Any split serves images: only the first stage takes the image rows in, and nothing else of them follows
        (no DeepStack); each rank holds the encoder whole."""


class Qwen3_5ImageProcessor(Qwen3VLImageProcessor):
    """Qwen3.5's host side: Qwen3-VL's (transformers' image processor of the checkpoint, ``<|image_pad|>`` once per
    merged token, the multimodal RoPE positions of still images, one frame each)."""
