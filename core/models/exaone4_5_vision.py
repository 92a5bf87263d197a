"""LG AI Research's EXAONE 4.5 images (``Exaone4_5_ForConditionalGeneration``: EXAONE-4.5-33B): its vision tower
with the patch merger (:class:`Exaone4_5ImageEncoder`) and its host side (:class:`Exaone4_5ImageProcessor`), the two
seams of :mod:`specray.multimodal`. The text model is EXAONE 4.0's (:mod:`specray.models.exaone4`, served through
``_TEXT_PARTS``): post-norm layers, sliding-window layers with RoPE and global ones without it; the image embeddings
replace the placeholders' rows (``meta.input_embeds``, Llama's embedding step) and every token keeps its plain
1D position (transformers' EXAONE 4.5 has no multimodal RoPE: ``rope_positions`` gives None).

The tower is Qwen2.5-VL's (:class:`~specray.models.qwen2_vl_vision.Qwen2_5_VLImageEncoder`: patches in merge-block
order, the axial 2D RoPE, RMSNorm blocks with SwiGLU MLPs, window attention but in ``fullatt_block_indexes``, the
RMSNorm merger) with grouped-query attention: the fused ``qkv`` projects to ``num_heads`` query heads and
``vision_config.num_key_value_heads`` key and value heads (``[q | k | v]``), each key/value head shared by
``num_heads / num_key_value_heads`` query heads. The host side is Qwen2-VL's image processor (transformers'
``Qwen2VLImageProcessor``, the auto class of ``exaone4_5``), ``<|image_pad|>`` (the config's ``image_token_id``)
repeated once per merged token.

The encoder is replicated on every tensor-parallel rank and reads its tensors under ``model.visual.`` or
``visual.``. Videos are not served (the seam takes images only)."""

from __future__ import annotations

from typing import Any

import torch

from specray.models.layers import apply_rotary
from specray.models.qwen2_vl_vision import (Qwen2_5_VLImageEncoder, QwenVLImageProcessor, VisionAttention, _field,
                                            segment_attention)
from specray.models.vision_towers import Linear
from specray.multimodal import MultiModalItem


def share_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """Key or value heads [N, kv_heads, D] -> [N, kv_heads * group, D]: head j serves query heads j*group to
    (j+1)*group - 1."""
    return x.repeat_interleave(group, dim=1)


class GroupedVisionAttention(VisionAttention):
    """The tower's attention with ``kv_heads`` key/value heads (grouped-query): fused ``qkv`` [q | k | v] with a bias,
    q and k rotated by the 2D RoPE in float32, each token attending within its segment."""

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__(dim, heads)
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"vision_config.num_key_value_heads={kv_heads} must divide vision_config.num_heads="
                             f"{heads} (each key/value head serves a group of query heads); the config is "
                             "inconsistent")
        self.kv_heads = kv_heads
        self.qkv = Linear(dim, (heads + 2 * kv_heads) * self.head_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        # x: [N, dim] -> [N, dim]
        n, d = x.shape[0], self.head_dim
        q, k, v = self.qkv(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = q.view(n, self.heads, d), k.view(n, self.kv_heads, d), v.view(n, self.kv_heads, d)
        q, k = (apply_rotary(p.float(), *rope).to(x.dtype) for p in (q, k))
        k, v = (share_heads(p, self.heads // self.kv_heads) for p in (k, v))
        return self.proj(segment_attention(q, k, v, lengths).reshape(n, -1))


def _plain_text_rope(config: Any) -> None:
    """EXAONE 4.5's text model takes plain 1D positions: nothing of multimodal RoPE to check."""


class Exaone4_5ImageEncoder(Qwen2_5_VLImageEncoder):
    """EXAONE 4.5's vision tower and merger: Qwen2.5-VL's with grouped-query attention in every block, built from the
    whole checkpoint's config (replicated on every rank); :meth:`encode` gives one image's [t*h*w / merge², text
    hidden size]."""

    deepstack_layers = 0
    check_text_rope = staticmethod(_plain_text_rope)

    def __init__(self, config: Any):
        super().__init__(config)
        vision = _field(config, "vision_config")
        kv_heads = _field(vision, "num_key_value_heads", self.heads)
        for block in self.blocks:
            block.attn = GroupedVisionAttention(self.dim, self.heads, kv_heads)


class Exaone4_5ImageProcessor(QwenVLImageProcessor):
    """EXAONE 4.5's host side: Qwen2-VL's (transformers' image processor of the checkpoint, the placeholder
    ``<|image_pad|>`` once per merged token) without multimodal RoPE positions."""

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None


__all__ = ["Exaone4_5ImageEncoder", "Exaone4_5ImageProcessor", "GroupedVisionAttention"]
