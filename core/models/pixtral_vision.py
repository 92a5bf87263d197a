"""Pixtral's vision encoder (``model_type: pixtral``, transformers' ``PixtralVisionModel``): the image tower of
Mistral 3 (Mistral Small 3.1 / 3.2, Devstral and Magistral with vision, :mod:`specray.models.mistral3`) and of
Pixtral-12B, for one image at a time at its own size.

The image (its height and width multiples of ``patch_size``, as the processor resizes it) is cut into
``patch_size`` squares by a bias-free strided conv; the patches, row by row, are normalized (``ln_pre``, an RMSNorm)
and run through pre-norm layers: ``x + attn(attention_norm(x))`` then ``x + mlp(ffn_norm(x))``, both norms RMSNorms
(eps 1e-5), the MLP SwiGLU-shaped (``down(act(gate(x)) * up(x))``, ``hidden_act`` the gate's activation) and the
attention bidirectional over the image's patches (no biases, ``head_dim ** -0.5`` scale). No position embedding is
learned: queries and keys take a 2D RoPE over the patch grid. Of a head's ``head_dim / 2`` rotation pairs (rotated
as halves, Llama's way), the first quarter of the head turns by the patch's row times the even-indexed frequencies of
``rope_theta`` and the second quarter by its column times the odd-indexed ones.

Attention stays within an image because each image runs alone (transformers runs a batch of images as one sequence
with a block-diagonal mask: the same result). A family asks for transformers' hidden states by index (``0``: the
normed patches, ``i``: layer ``i``'s output); the tower is built only as deep as asked, its later layers neither built
nor read. Its parameters start empty and take the checkpoint's values by transformers' names (``patch_conv.weight``,
``ln_pre.weight``, ``transformer.layers.<i>.attention.q_proj.weight``, ``...feed_forward.gate_proj.weight``, ...)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import RMSNorm, _copy, _param, apply_rotary, materialize
from specray.models.vision_towers import Linear, patch_rows, vision_activation

PIXTRAL = "pixtral"
NORM_EPS = 1e-5  # every norm of the tower (transformers fixes it; the config has no field for it)
_LAYER = re.compile(r"^transformer\.layers\.(\d+)\.")


def rope_theta(config: Any) -> float:
    """The vision RoPE's base: ``rope_parameters["rope_theta"]`` (or an older config's ``rope_theta``); a ValueError
    for a RoPE type other than Pixtral's axial one."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    kind = params.get("rope_type", params.get("type", "axial"))
    if kind != "axial":
        raise ValueError(f"vision_config.rope_parameters.rope_type={kind!r} is not supported: Pixtral's vision tower "
                         "rotates by patch row and column ('axial'); fix the checkpoint's vision_config")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class PixtralAttention(nn.Module):
    """Bidirectional self-attention over one image's patches with the 2D RoPE on queries and keys."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj = Linear(hidden, hidden, bias=False), Linear(hidden, hidden, bias=False)
        self.v_proj, self.o_proj = Linear(hidden, hidden, bias=False), Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [N, C]; cos, sin: [N, 1, head_dim / 2] -> [N, C]
        n = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(n, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(n, self.heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.heads, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class PixtralMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, no biases."""

    def __init__(self, hidden: int, intermediate: int, act):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj, self.act = Linear(intermediate, hidden, bias=False), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralLayer(nn.Module):
    """``x + attention(attention_norm(x))``, then ``x + feed_forward(ffn_norm(x))``."""

    def __init__(self, config: Any, act):
        super().__init__()
        hidden = config.hidden_size
        self.attention_norm, self.ffn_norm = RMSNorm(hidden, NORM_EPS), RMSNorm(hidden, NORM_EPS)
        self.attention = PixtralAttention(hidden, config.num_attention_heads)
        self.feed_forward = PixtralMLP(hidden, config.intermediate_size, act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralVisionModel(nn.Module):
    """Pixtral's vision tower (``config``: its vision config) as deep as ``depth`` layers (None: all of them).
    :meth:`forward` gives one image's hidden state after the last layer built (transformers' ``hidden_states[depth]``)
    and its patch grid."""

    def __init__(self, config: Any, depth: int | None = None):
        super().__init__()
        kind = getattr(config, "model_type", None)
        if kind != PIXTRAL:
            raise ValueError(f"vision_config.model_type={kind!r} is not supported here; this encoder is Pixtral's "
                             f"({PIXTRAL!r})")
        hidden, heads = config.hidden_size, config.num_attention_heads
        if hidden % heads or (hidden // heads) % 4:
            raise ValueError(f"vision_config.hidden_size={hidden} over num_attention_heads={heads} must give a "
                             "head size that is a multiple of 4 (the 2D RoPE turns a quarter of it per axis); the "
                             "checkpoint's vision config is inconsistent")
        self.num_layers = config.num_hidden_layers
        depth = self.num_layers if depth is None else depth
        if not 0 <= depth <= self.num_layers:
            raise ValueError(f"a vision tower of {depth} layers was asked of vision_config.num_hidden_layers="
                             f"{self.num_layers}")
        self.patch_size = config.patch_size
        if not isinstance(self.patch_size, int):
            raise ValueError(f"vision_config.patch_size={self.patch_size!r} is not supported: Pixtral's patches are "
                             "squares (give one int)")
        channels = getattr(config, "num_channels", 3)
        self.patch_conv = nn.Module()
        self.patch_conv.weight = _param(hidden, channels, self.patch_size, self.patch_size)
        self.ln_pre = RMSNorm(hidden, NORM_EPS)
        act = vision_activation(config.hidden_act, "vision_config.hidden_act")
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(PixtralLayer(config, act) for _ in range(depth))
        head_dim = hidden // heads
        # the RoPE's frequencies, in float32 as transformers computes them: rows turn by the even-indexed ones,
        # columns by the odd-indexed ones
        inv_freq = 1.0 / (rope_theta(config) ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq_rows", inv_freq[0::2].clone(), persistent=False)
        self.register_buffer("inv_freq_cols", inv_freq[1::2].clone(), persistent=False)

    def rotary(self, rows: int, cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [rows * cols, 1, head_dim / 2] of a ``rows`` x ``cols`` patch grid, row-major."""
        device = self.inv_freq_rows.device
        r = torch.arange(rows, device=device, dtype=torch.float32)[:, None] * self.inv_freq_rows
        c = torch.arange(cols, device=device, dtype=torch.float32)[:, None] * self.inv_freq_cols
        angles = torch.cat([r[:, None].expand(rows, cols, -1), c[None].expand(rows, cols, -1)], dim=-1)
        angles = angles.reshape(rows * cols, 1, -1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        # pixel_values: [C, H, W] (or [1, C, H, W]) -> [rows * cols, hidden] row-major, (rows, cols)
        if pixel_values.dim() == 3:
            pixel_values = pixel_values[None]
        if pixel_values.dim() != 4 or pixel_values.shape[0] != 1:
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}: the Pixtral tower takes one image "
                             "[C, H, W] at a time")
        weight = self.patch_conv.weight
        rows, cols = pixel_values.shape[-2] // self.patch_size, pixel_values.shape[-1] // self.patch_size
        x = self.ln_pre(patch_rows(pixel_values, weight, None)[0])
        cos, sin = self.rotary(rows, cols, x.dtype)
        for layer in self.transformer.layers:
            x = layer(x, cos, sin)
        return x, (rows, cols)

    def load_weights(self, weights: Iterable[tuple[str, Any]], what: str = "the Pixtral vision tower") -> None:
        """Copy ``weights`` ((name, tensor) pairs named as transformers' ``PixtralVisionModel`` names them) into the
        tower; layers past those built are skipped. A ValueError names a tensor it does not know (a quantized
        tower's scales) and those of its own parameters no tensor came for (``what``: how errors name the tower)."""
        params = dict(self.named_parameters())
        loaded, unknown = set(), []
        for name, tensor in weights:
            if name in params:
                _copy(params[name], materialize(tensor))
                loaded.add(name)
                continue
            layer = _LAYER.match(name)
            if layer is None or int(layer.group(1)) < len(self.transformer.layers):
                unknown.append(name)
        if unknown:
            raise ValueError(f"the checkpoint holds {len(unknown)} tensor(s) of {what} that it does not read: "
                             f"{unknown[:6]}; only an unquantized Pixtral tower is supported")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of {what}: {missing[:6]}; it does not "
                             "match its config.json's vision_config")
