"""ViT image encoders that vision-language families put in front of their text models: CLIP's vision model
(``clip_vision_model``) and SigLIP's (``siglip_vision_model``), as transformers' ``CLIPVisionModel`` /
``SiglipVisionModel`` compute them, for one image at a time.

Both cut the image into ``patch_size`` squares (a strided conv, CLIP's without a bias, SigLIP's with one), add a learned
embedding per position (CLIP first puts a learned class token in front of the patches and normalizes the sum with
``pre_layrnorm``) and run pre-norm encoder layers: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, the attention
bidirectional over every token of the image (multi-head, ``head_dim ** -0.5`` scale, biases on q/k/v/out), the MLP
``fc2(act(fc1(x)))``.

A family asks for *hidden states* by transformers' indices (``hidden_states[i]``: 0 the input of the first layer, i the
output of layer i - 1, negative ones counted from the end; the last one before ``post_layernorm``), and the tower is
built only as deep as the deepest it asks for, so a checkpoint's later layers, its ``post_layernorm`` and SigLIP's
pooling head are neither built nor read unless asked (:class:`VisionTower`'s ``post_norm``). Position embeddings are
not interpolated: an image must come at the config's ``image_size`` (a ValueError otherwise).

The tower is replicated (a tensor-parallel rank runs it whole); its parameters start empty and take the checkpoint's
values through :meth:`VisionTower.load_weights`, named as transformers' ``vision_model`` names them
(``embeddings.patch_embedding.weight``, ``encoder.layers.<i>.self_attn.q_proj.weight``, ...)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.classic import ACTIVATIONS
from specray.models.layers import LayerNorm, _copy, _param, materialize
from specray.models.registry import text_tensors

CLIP, SIGLIP = "clip_vision_model", "siglip_vision_model"
VISION_MODEL_TYPES = (CLIP, SIGLIP)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# an activation name a vision config or projector may give -> the function (CLIP's default is quick_gelu)
VISION_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {**ACTIVATIONS, "quick_gelu": _quick_gelu,
                                                                        "silu": F.silu}


def vision_activation(name: str, field: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation ``name`` (the config's ``field``), or a ValueError naming the supported ones."""
    if name not in VISION_ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported; use one of {sorted(VISION_ACTIVATIONS)}")
    return VISION_ACTIVATIONS[name]


class Linear(nn.Module):
    """A replicated linear ``x W^T + b`` of empty parameters (the checkpoint fills them)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Conv1x1(nn.Module):
    """A pointwise ``nn.Conv1d`` / ``nn.Conv2d`` (weight [out, in, 1(, 1)], a bias) applied to the channels of [..., in]
    (as the linear it is: no TF32 convolution on a GPU)."""

    def __init__(self, width_in: int, width_out: int, dims: int = 1):
        super().__init__()
        self.weight, self.bias = _param(width_out, width_in, *(1,) * dims), _param(width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.reshape(self.weight.shape[:2]), self.bias)


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention over one image's tokens, biases on every projection."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"vision_config.hidden_size={hidden} is not divisible by vision_config."
                             f"num_attention_heads={heads}; the checkpoint's vision config is inconsistent")
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj, self.v_proj = Linear(hidden, hidden), Linear(hidden, hidden), Linear(hidden, hidden)
        self.out_proj = Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, N, C] -> [B, N, C]
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fc1, self.fc2, self.act = Linear(hidden, intermediate), Linear(intermediate, hidden), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: Any, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1, self.layer_norm2 = LayerNorm(hidden, eps), LayerNorm(hidden, eps)
        self.self_attn = VisionAttention(hidden, config.num_attention_heads)
        self.mlp = VisionMLP(hidden, config.intermediate_size, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


def patch_rows(pixel_values: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """pixel_values [B, C, H, W] through a patch embedding's conv weight [out, C, p, p] whose stride is its kernel
    -> [B, (H // p) * (W // p), out], patches row-major (a conv's output flattened). Written as the linear it is: one
    matmul, and in fp32 on CUDA full fp32 products where cuDNN's conv would take TF32's."""
    b, c, h, w = pixel_values.shape
    p = weight.shape[-1]
    rows, cols = h // p, w // p
    x = pixel_values[..., : rows * p, : cols * p].reshape(b, c, rows, p, cols, p).permute(0, 2, 4, 1, 3, 5)
    return F.linear(x.reshape(b, rows * cols, c * p * p).to(weight.dtype), weight.reshape(weight.shape[0], -1), bias)


class VisionEmbeddings(nn.Module):
    """Patches (a conv of stride ``patch_size``) plus a learned embedding per position; CLIP's with a class token
    first (``class_embedding``) and a bias-free conv."""

    def __init__(self, config: Any, class_token: bool):
        super().__init__()
        hidden, patch, channels = config.hidden_size, config.patch_size, getattr(config, "num_channels", 3)
        self.image_size, self.patch_size = config.image_size, patch
        self.num_patches = (config.image_size // patch) ** 2
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = _param(hidden, channels, patch, patch)
        self.patch_embedding.bias = None if class_token else _param(hidden)
        self.class_embedding = _param(hidden) if class_token else None
        self.position_embedding = nn.Module()
        self.position_embedding.weight = _param(self.num_patches + int(class_token), hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [B, C, S, S] -> [B, N, hidden] (N: the patches, the class token first where there is one)
        height, width = pixel_values.shape[-2:]
        if (height, width) != (self.image_size, self.image_size):
            raise ValueError(f"an image of {height}x{width} pixels reached a vision tower of vision_config.image_size="
                             f"{self.image_size} (position embeddings are not interpolated); the image processor "
                             "must resize images to that size (its size / crop_size)")
        x = patch_rows(pixel_values, self.patch_embedding.weight, self.patch_embedding.bias)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


def feature_indices(layers: int | Sequence[int], num_layers: int, field: str) -> list[int]:
    """transformers' hidden-state indices ``layers`` (one or several; negative ones from the end) as non-negative
    ones into the ``num_layers + 1`` hidden states; a ValueError naming ``field`` for one out of range."""
    wanted = [layers] if isinstance(layers, int) else list(layers)
    if not wanted or any(not isinstance(i, int) or not -(num_layers + 1) <= i <= num_layers for i in wanted):
        raise ValueError(f"{field}={layers!r} must be a hidden-state index or a non-empty list of them, each in "
                         f"[-{num_layers + 1}, {num_layers}] (vision_config.num_hidden_layers={num_layers})")
    return [i % (num_layers + 1) for i in wanted]


def copy_weights(params: dict[str, nn.Parameter], weights: Iterable[tuple[str, Any]]) -> list[str]:
    """Copy each of ``weights`` ((name, tensor) pairs) that ``params`` names into that parameter (the rest are
    skipped unread); returns the names of ``params`` no tensor came for, sorted."""
    loaded = set()
    for name, tensor in weights:
        if name in params:
            _copy(params[name], materialize(tensor))
            loaded.add(name)
    return sorted(set(params) - loaded)


def load_audio_parts(module: nn.Module, weights: Iterable[tuple[str, Any]], arch: str) -> None:
    """An audio-language release's ``audio_tower.*`` and ``multi_modal_projector.*`` tensors (under ``model.`` in
    transformers' layout) into ``module``'s parameters of those names; a ValueError names any that did not come."""
    wanted = ("audio_tower.", "multi_modal_projector.")
    missing = copy_weights(dict(module.named_parameters()), (
        (name.removeprefix("model."), t) for name, t in weights if name.removeprefix("model.").startswith(wanted)))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of {arch}'s audio encoder or projector: "
                         f"{missing[:6]} (under model.); it does not match its config.json")


class VisionTower(nn.Module):
    """CLIP's or SigLIP's vision model (``config``: its vision config) as deep as ``depth`` encoder layers (None:
    all), with its ``post_layernorm`` where ``post_norm``. :meth:`hidden_states` hands out transformers' hidden states
    by index; :meth:`forward` the last layer's output, post-normed where built so."""

    def __init__(self, config: Any, depth: int | None = None, post_norm: bool = False):
        super().__init__()
        kind = getattr(config, "model_type", None)
        if kind not in VISION_MODEL_TYPES:
            raise ValueError(f"vision_config.model_type={kind!r} is not supported here; the vision towers served are "
                             f"{list(VISION_MODEL_TYPES)} (CLIP's and SigLIP's vision models)")
        self.kind, self.num_layers = kind, config.num_hidden_layers
        depth = self.num_layers if depth is None else depth
        if not 0 <= depth <= self.num_layers:
            raise ValueError(f"a vision tower of {depth} layers was asked of vision_config.num_hidden_layers="
                             f"{self.num_layers}")
        act = vision_activation(config.hidden_act, "vision_config.hidden_act")
        self.embeddings = VisionEmbeddings(config, class_token=kind == CLIP)
        self.pre_layrnorm = LayerNorm(config.hidden_size, config.layer_norm_eps) if kind == CLIP else None
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionEncoderLayer(config, act) for _ in range(depth))
        self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps) if post_norm else None

    @property
    def num_tokens(self) -> int:
        """Tokens per image: its patches, and CLIP's class token."""
        return self.embeddings.position_embedding.weight.shape[0]

    def hidden_states(self, pixel_values: torch.Tensor, indices: Iterable[int]) -> list[torch.Tensor]:
        """transformers' ``hidden_states[i]`` for each of ``indices`` (non-negative, :func:`feature_indices`) of
        ``pixel_values`` [B, C, S, S]: each [B, N, hidden]. Runs the layers up to the deepest asked."""
        indices = list(indices)
        built = len(self.encoder.layers)
        assert max(indices) <= built, (indices, built)  # the tower is built as deep as its family asks
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers[: max(indices)], start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in indices]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.hidden_states(pixel_values, [len(self.encoder.layers)])[0]
        return x if self.post_layernorm is None else self.post_layernorm(x)

    def load_weights(self, weights: Iterable[tuple[str, Any]], what: str = "the vision tower") -> set[str]:
        """Copy ``weights`` ((name, tensor) pairs named as transformers' ``vision_model`` names its tensors) into
        the tower; names of layers or parts it was not built with are skipped. Returns the names loaded; a ValueError
        names those of its own parameters no tensor came for (``what``: how the error names the tower)."""
        params = dict(self.named_parameters())
        missing = copy_weights(params, weights)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of {what}: {missing[:6]}; it does not "
                             "match its config.json's vision_config")
        return set(params)


# a tower-and-projector release's own tensors (LLaVA's, Aya Vision's, Gemma 3's, PaliGemma's) -> ours
# (``tower.<the vision model's name>``, ``projector.<name>``): the releases' (``vision_tower.vision_model.``), what
# transformers 5 saves (``vision_tower.``, its vision model flattened) and its modules' (``model.vision_tower.``,
# ``model.multi_modal_projector.``)
TOWER_AND_PROJECTOR = ((re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?"), "tower."),
                       (re.compile(r"^(?:model\.)?multi_modal_projector\."), "projector."))


def load_tower_and_projector(encoder: nn.Module, weights: Iterable[tuple[str, Any]], arch: str,
                             check: str = "") -> None:
    """Read ``encoder.tower``'s and ``encoder.projector``'s tensors among the whole checkpoint's (either layout: the
    text model's, and the tower's unread ones, are skipped); a ValueError names any of theirs missing (``check``:
    the config fields the projector's shape comes from)."""
    ours = list(text_tensors(weights, TOWER_AND_PROJECTOR))
    encoder.tower.load_weights([(n[len("tower."):], t) for n, t in ours if n.startswith("tower.")],
                               f"{arch}'s vision tower (vision_tower.*)")
    missing = copy_weights({n: p for n, p in encoder.named_parameters() if n.startswith("projector.")}, ours)
    if missing:
        raise ValueError(f"the checkpoint lacks {arch}'s projector tensor(s) {missing} (multi_modal_projector.*); it "
                         f"does not match its config.json{check}")
