"""Kimi K2.5's / K2.6's images (``Kimi_K25ForConditionalGeneration``, the release's own code
``KimiK25ForConditionalGeneration``): the MoonViT vision tower and the patch-merging projector
(:class:`KimiK25ImageEncoder`) and the host side (:class:`KimiK25ImageProcessor`), the two seams of
:mod:`specray.multimodal`. The text model is DeepSeek-V3's (:mod:`specray.models.deepseek_v3`, its ``text_config``,
served through ``_TEXT_PARTS``); image rows reach it through ``LlamaModel.embed_step`` (``meta.with_input_embeds``)
and it takes plain positions (no multimodal RoPE).

Pixels (transformers' ``Kimi_K25ImageProcessor``, a torchvision-only processor, done here with torch alone): the
image is scaled down (never up) so that it holds at most ``max_patches`` patches of ``patch_size`` pixels and at most
``size["max_height"]`` patches along each side (``navit_resize``: the scale is the smallest of 1, the square root of
the patch budget over the image's whole-patch count, and each side's limit), resized bicubically with antialiasing on
uint8 (what torchvision does on a CPU), zero-padded right and bottom to multiples of ``merge_size * patch_size``,
rescaled and normalized in float32 ((x - 255 mean) / (255 std), transformers' fused form) and cut into patches in
raster order: ``pixel_values`` [h*w, C, P, P] and ``image_grid_thw`` [[1, h, w]]. The prompt's ``<|media_pad|>``
(the config's ``image_token_id``) becomes ``h*w / merge²`` of itself, every one taking an embedding. The settings
come from ``preprocessor_config.json`` in transformers' keys or in the release's ``media_proc_cfg`` (``in_patch_limit``,
``patch_limit_on_one_side``, ``merge_kernel_size``; a ``fixed_output_tokens`` is refused); either way the pixels are
transformers' (torchvision's resize), not those of the release's own processor code.

The tower (transformers' ``Kimi_K25VisionModel``): a biased conv of stride ``patch_size`` per patch, plus the learned
``pos_emb_height`` x ``pos_emb_width`` position table resampled bicubically (unaligned corners, as
``F.interpolate``) to the image's patch grid (an image adds no temporal term); pre-norm LayerNorm blocks (eps 1e-5)
whose attention (biased q, k, v and output, held here as Qwen2-VL's fused ``qkv``) is bidirectional over the image's
patches and turns q and k by a 2D RoPE whose frequencies (``head_dim / 4`` of them, ``rope_theta``) each take the
patch's column then its row on consecutive pairs of the half-split rotation (transformers' ``recomposition`` of
GLM-4V's axial rotary); an ``fc1 -> act -> fc2`` MLP; ``final_layernorm``. Each ``merge`` block of patches
(row-major within the block) is gathered into one token, whose ``merge²`` patches the projector normalizes one by one
(``pre_norm``), concatenates, and maps ``in_proj -> GELU (exact) -> out_proj`` into the text model's width.

Weights are read under transformers' module names (``model.vision_tower.*``, ``model.mm_projector.*``) or the
release's (``vision_tower.encoder.blocks.<i>.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}``, ``vision_tower.patch_embed.*``
with ``pos_emb.weight``, ``mm_projector.proj.{0,2}``: the fused ``wqkv``'s q and k rows permuted from the release's
interleaved-pair rotation to the half-split one, as transformers' conversion does), and as transformers'
``save_pretrained`` writes them back (the release's, but ``vision_tower.encoder.patch_embed.*`` and
``model.mm_projector.pre_norm.*``). Sizes come from transformers' vision-config fields (whose defaults are the
release's); where the release's own names stand beside them (``vt_hidden_size``, ``init_pos_emb_height``, ...) they
must agree, and its part kinds (``merge_type``, ``mm_projector_type``, ``pos_emb_type``, ``projector_hidden_act``)
must be the ones built here (a ValueError naming the field otherwise). The encoder is replicated on
every tensor-parallel rank and sets ``deepstack_layers = 0``. Videos (several frames, the temporal table) are not
served (the seam takes images only)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import LayerNorm, _base_inv_freq, _param
from specray.models.qwen2_vl_vision import PlainMLP, VisionBlock, _field
from specray.models.vision_towers import Linear, copy_weights, vision_activation
from specray.multimodal import MultiModalItem, ProcessedImage, image_processor_settings

NORM_EPS = 1e-5  # the tower's LayerNorms (fixed in transformers' modules)
# transformers' module names, and the release's (its text under language_model.: not ours)
_MODULES = re.compile(r"^model\.(vision_tower|mm_projector)\.(.+)$")
_RELEASE = re.compile(r"^(vision_tower|mm_projector)\.(.+)$")
_RELEASE_RENAMES = ((re.compile(r"^encoder\.blocks\.(\d+)\.norm0\."), r"layers.\1.norm1."),
                    (re.compile(r"^encoder\.blocks\.(\d+)\.norm1\."), r"layers.\1.norm2."),
                    (re.compile(r"^encoder\.blocks\.(\d+)\.mlp\.fc0\."), r"layers.\1.mlp.fc1."),
                    (re.compile(r"^encoder\.blocks\.(\d+)\.mlp\.fc1\."), r"layers.\1.mlp.fc2."),
                    (re.compile(r"^encoder\.blocks\.(\d+)\.wo\."), r"layers.\1.attn.proj."),
                    (re.compile(r"^encoder\.blocks\.(\d+)\.wqkv\."), r"layers.\1.attn.qkv."),
                    (re.compile(r"^encoder\.final_layernorm\."), "final_layernorm."),
                    (re.compile(r"^encoder\.patch_embed\."), "patch_embed."),  # (transformers' save_pretrained)
                    (re.compile(r"^patch_embed\.pos_emb\.weight$"), "patch_embed.pos_emb.position_embeddings"),
                    (re.compile(r"^proj\.0\."), "in_proj."), (re.compile(r"^proj\.2\."), "out_proj."))


# transformers' vision-config field -> the release's own name for it (the release's config.json as its code reads it)
_RELEASE_FIELDS = {"hidden_size": "vt_hidden_size", "intermediate_size": "vt_intermediate_size",
                   "num_hidden_layers": "vt_num_hidden_layers", "num_attention_heads": "vt_num_attention_heads",
                   "pos_emb_height": "init_pos_emb_height", "pos_emb_width": "init_pos_emb_width"}
# the release's choices of parts (its config's names) -> the one built here
_RELEASE_KINDS = {"merge_type": "sd2_tpool", "mm_projector_type": "patchmerger", "pos_emb_type": "divided_fixed",
                  "projector_hidden_act": "gelu"}


def check_release_fields(vision: Any) -> None:
    """A vision config holding the release's own names (``vt_hidden_size``, ``init_pos_emb_height``, ...) beside
    transformers' (which transformers reads, their defaults being the release's sizes) must agree with them, and
    name the parts built here; a ValueError naming the field otherwise."""
    for ours, theirs in _RELEASE_FIELDS.items():
        value = _field(vision, theirs)
        if value is not None and value != _field(vision, ours):
            raise ValueError(f"vision_config.{theirs}={value} (the release's name) differs from vision_config.{ours}="
                             f"{_field(vision, ours)} (transformers', which it reads); set {ours} to {value}")
    for field, built in _RELEASE_KINDS.items():
        value = _field(vision, field)
        if value is not None and value != built:
            raise ValueError(f"vision_config.{field}={value!r} is not supported; Kimi K2.5's tower is built with "
                             f"{built!r} only")


def release_qk_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """A q or k projection's rows (weight [D, in] or bias [D]) from the release's rotation of interleaved pairs to
    the half-split one transformers' modules (and ours) use: per head, rows (2j, 2j+1) -> (j, j + head_dim / 2)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def vision_rope(h: int, w: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's 2D RoPE for one image's patches in raster order: cos, sin [h*w, 1, head_dim / 2] (float32),
    frequency j turning the pair (column * f_j, row * f_j) at rotation slots 2j, 2j + 1."""
    rows = torch.arange(h, device=device)[:, None].expand(h, w).flatten().float()
    cols = torch.arange(w, device=device)[None, :].expand(h, w).flatten().float()
    inv_freq = _base_inv_freq(theta, head_dim // 2).to(device)  # [head_dim / 4]
    angles = torch.stack((cols[:, None] * inv_freq, rows[:, None] * inv_freq), dim=-1).flatten(1)
    return angles.cos()[:, None], angles.sin()[:, None]


def merge_blocks(x: torch.Tensor, h: int, w: int, kh: int, kw: int) -> torch.Tensor:
    """[h*w, D] patches in raster order -> [h*w / (kh*kw), kh*kw, D]: each merge block's patches (row-major within
    it), the blocks row-major."""
    return x.view(h // kh, kh, w // kw, kw, -1).permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), kh * kw, -1)


class KimiK25Projector(nn.Module):
    """Each merge block's patches normed one by one (``pre_norm``), concatenated, ``in_proj -> GELU -> out_proj``."""

    def __init__(self, dim: int, unit: int, out: int, eps: float):
        super().__init__()
        self.pre_norm = LayerNorm(dim, eps)
        self.in_proj, self.out_proj = Linear(dim * unit, dim * unit), Linear(dim * unit, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, unit, dim] -> [N, out]
        n = x.shape[0]
        x = self.pre_norm(x.reshape(-1, x.shape[-1])).reshape(n, -1)
        return self.out_proj(F.gelu(self.in_proj(x)))


class KimiK25ImageEncoder(nn.Module):
    """Kimi K2.5's MoonViT tower and projector, built from the whole checkpoint's config (replicated on every rank);
    :meth:`encode` gives one image's embeddings [h*w / merge², text hidden size] (module docstring)."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        vision, text = _field(config, "vision_config"), _field(config, "text_config")
        if vision is None or text is None:
            raise ValueError("the checkpoint's config lacks vision_config or text_config; it is not a Kimi K2.5 "
                             "release")
        check_release_fields(vision)
        dim, heads = _field(vision, "hidden_size", 1152), _field(vision, "num_attention_heads", 16)
        self.patch_size = _field(vision, "patch_size", 14)
        kernel = _field(vision, "merge_kernel_size", (2, 2))
        kernel = [kernel, kernel] if isinstance(kernel, int) else list(kernel)
        if len(kernel) != 2 or any(not isinstance(k, int) or k < 1 for k in kernel):
            raise ValueError(f"vision_config.merge_kernel_size={kernel!r} must be two positive ints (rows, columns)")
        self.kernel = tuple(kernel)
        side_h, side_w = _field(vision, "pos_emb_height", 64), _field(vision, "pos_emb_width", 64)
        if side_h != side_w:
            raise ValueError(f"vision_config.pos_emb_height={side_h} differs from pos_emb_width={side_w}: "
                             "transformers resamples the position table as a square of pos_emb_height; a release's "
                             "table is square, fix the config")
        rope = _field(vision, "rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type={rope.get('rope_type')!r} is not supported; "
                             "Kimi K2.5's tower rotates by the axial 2D RoPE ('axial') only")
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        projected = _field(config, "projection_hidden_size", 1152)
        if projected != dim:
            raise ValueError(f"projection_hidden_size={projected} differs from vision_config.hidden_size={dim}: the "
                             "projector's pre_norm normalizes each patch of the tower's width; fix the config")
        act = vision_activation(_field(vision, "hidden_act", "gelu_pytorch_tanh"), "vision_config.hidden_act")
        self.dim, self.heads, self.side = dim, heads, side_h
        self.vision_tower = nn.Module()
        embed = self.vision_tower.patch_embed = nn.Module()
        embed.proj = nn.Module()
        embed.proj.weight = _param(dim, 3, self.patch_size, self.patch_size)
        embed.proj.bias = _param(dim)
        embed.pos_emb = nn.Module()
        embed.pos_emb.position_embeddings = _param(side_h, side_w, dim)
        width = _field(vision, "intermediate_size", 4304)
        self.vision_tower.layers = nn.ModuleList(
            VisionBlock(dim, heads, lambda d: LayerNorm(d, NORM_EPS), PlainMLP(dim, width, act))
            for _ in range(_field(vision, "num_hidden_layers", 27)))
        self.vision_tower.final_layernorm = LayerNorm(dim, NORM_EPS)
        self.mm_projector = KimiK25Projector(dim, kernel[0] * kernel[1], _field(text, "hidden_size"),
                                             float(_field(config, "projection_layer_norm_eps", 1e-5)))

    def _own(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The tower's and projector's tensors under our names: transformers' q/k/v fused into ``qkv``, the
        release's renamed and its ``wqkv`` q and k rows permuted to the half-split rotation."""
        parts: dict[str, dict[str, Any]] = {}
        for name, tensor in weights:
            if (m := _MODULES.match(name)) is not None:
                module, rest = m.groups()
                qkv = re.match(r"^(layers\.\d+\.attn)\.([qkv])_proj\.(weight|bias)$", rest)
                if module == "vision_tower" and qkv is not None:
                    parts.setdefault(f"vision_tower.{qkv[1]}.qkv.{qkv[3]}", {})[qkv[2]] = tensor
                    continue
                yield f"{module}.{rest}", tensor
            elif (m := _RELEASE.match(name)) is not None:
                module, rest = m.groups()
                for pattern, target in _RELEASE_RENAMES:
                    rest = pattern.sub(target, rest)
                if re.search(r"\.attn\.qkv\.(weight|bias)$", rest):
                    q, k, v = torch.as_tensor(tensor).chunk(3, dim=0)
                    tensor = torch.cat((release_qk_to_halves(q, self.heads), release_qk_to_halves(k, self.heads), v))
                yield f"{module}.{rest}", tensor
        for name, qkv in parts.items():
            if set(qkv) == {"q", "k", "v"}:
                yield name, torch.cat([torch.as_tensor(qkv[p]) for p in "qkv"])

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy the tower's and the projector's tensors among ``weights`` (the whole checkpoint's); a ValueError
        names any of its own tensors that did not come."""
        missing = copy_weights(dict(self.named_parameters()), self._own(weights))
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of the vision tower or projector: "
                             f"{['model.' + n for n in missing[:6]]}; it does not match its config.json's "
                             "vision_config")

    def _grid(self, data: dict[str, Any]) -> tuple[int, int]:
        """The image's (patch rows, patch columns), checked against its pixels (one host read per image)."""
        pixels = data["pixel_values"]
        grid = tuple(int(g) for g in torch.as_tensor(data["image_grid_thw"]).reshape(-1).tolist())
        t, h, w = grid if len(grid) == 3 else (0, 0, 0)
        kh, kw = self.kernel
        p = self.patch_size
        if t != 1 or h % kh or w % kw or tuple(pixels.shape) != (h * w, 3, p, p):
            raise ValueError(f"an image of pixel_values {tuple(pixels.shape)} and image_grid_thw {grid} does not fit "
                             f"this vision tower (one frame of [rows*columns, 3, {p}, {p}] patches, rows and columns "
                             f"multiples of merge_kernel_size={list(self.kernel)}); process images with "
                             "KimiK25ImageProcessor")
        return h, w

    def position_embeddings(self, h: int, w: int) -> torch.Tensor:
        """The learned table resampled bicubically (unaligned corners) to the image's grid: [h*w, dim]."""
        table = self.vision_tower.patch_embed.pos_emb.position_embeddings
        if (h, w) == (self.side, self.side):
            return table.reshape(h * w, -1)
        grid = table.permute(2, 0, 1)[None].float()
        out = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)
        return out[0].flatten(1).t().to(table.dtype)

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's ``pixel_values`` [h*w, 3, P, P] and ``image_grid_thw`` [1, 3] -> [h*w / merge², out]."""
        h, w = self._grid(data)
        tower = self.vision_tower
        proj = tower.patch_embed.proj
        x = F.linear(data["pixel_values"].to(proj.weight.dtype).flatten(1), proj.weight.flatten(1), proj.bias)
        x = x + self.position_embeddings(h, w).to(x.dtype)
        rope = vision_rope(h, w, self.dim // self.heads, self.rope_theta, x.device)
        for block in tower.layers:
            x = block(x, rope, [h * w])
        x = tower.final_layernorm(x)
        return self.mm_projector(merge_blocks(x, h, w, *self.kernel))


def navit_size(height: int, width: int, patch: int, merge: int, max_patches: int,
               max_side: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """transformers' ``navit_resize``: ((resized height, width), (padded height, width)) of an image."""
    whole = max(1.0, height // patch) * max(1.0, width // patch)
    scale = min(1.0, math.sqrt(max_patches / whole), max_side * patch / height, max_side * patch / width)
    new_h = min(max(1, int(height * scale)), max_side * patch)
    new_w = min(max(1, int(width * scale)), max_side * patch)
    factor = merge * patch
    return (new_h, new_w), (-(-new_h // factor) * factor, -(-new_w // factor) * factor)


def _resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's bicubic antialiased resize of a uint8 [C, H, W] image on a CPU (natively in uint8)."""
    if tuple(image.shape[-2:]) == (height, width):
        return image
    return F.interpolate(image[None].contiguous(), size=[height, width], mode="bicubic", align_corners=False,
                         antialias=True)[0]


class KimiK25ImageProcessor:
    """Kimi K2.5's host side (:class:`specray.multimodal.ImageProcessor`): transformers' ``Kimi_K25ImageProcessor``'s
    pixels (made here with torch, see the module docstring) and ``Kimi_K25Processor``'s expansion of
    ``<|media_pad|>``."""

    def __init__(self, settings: dict, config: Any):
        size = settings.get("size") or {"max_height": 512, "max_width": 512}
        if size.get("max_height") is None or size.get("max_height") != size.get("max_width"):
            raise ValueError(f"the image processor's size={size} must hold max_height and max_width, equal (the most "
                             "patches along a side); fix preprocessor_config.json")
        resample = settings.get("resample", 3)
        if resample not in (3, "bicubic"):
            raise ValueError(f"the image processor's resample={resample!r} is not supported: only bicubic (3), Kimi "
                             "K2.5's, is; fix preprocessor_config.json")
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if not settings.get(flag, True):
                raise ValueError(f"the image processor's {flag}=False is not supported (Kimi K2.5 resizes, rescales "
                                 "and normalizes every image); fix preprocessor_config.json")
        vision = _field(config, "vision_config") or {}
        kernel = _field(vision, "merge_kernel_size", (2, 2))
        kernel = [kernel, kernel] if isinstance(kernel, int) else list(kernel)
        self.patch = int(settings.get("patch_size", 14))
        self.merge = int(settings.get("merge_size", 2))
        if self.patch != _field(vision, "patch_size", 14) or kernel != [self.merge, self.merge]:
            raise ValueError(f"the image processor's patch_size={self.patch}, merge_size={self.merge} disagree with "
                             f"vision_config's patch_size={_field(vision, 'patch_size', 14)}, merge_kernel_size="
                             f"{kernel}: the prompt would hold another number of tokens than the tower embeds; fix "
                             "preprocessor_config.json")
        self.max_side = int(size["max_height"])
        self.max_patches = int(settings.get("max_patches", 16384))
        rescale = float(settings.get("rescale_factor", 1 / 255))
        # transformers' fused rescale and normalize: (x - mean / rescale) / (std / rescale), float32
        self.mean = torch.tensor([float(v) for v in settings.get("image_mean", [0.5] * 3)]) * (1.0 / rescale)
        self.std = torch.tensor([float(v) for v in settings.get("image_std", [0.5] * 3)]) * (1.0 / rescale)
        token = _field(config, "image_token_id", _field(config, "media_placeholder_token_id"))
        if token is None:
            raise ValueError("the checkpoint's config has no image_token_id (the <|media_pad|> token's id); set it")
        self.image_token_id = int(token)

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> KimiK25ImageProcessor:
        """From the folder's ``preprocessor_config.json`` (or the ``image_processor`` entry of its
        ``processor_config.json``: what transformers 5 writes); the release's ``media_proc_cfg`` is read as the
        same settings (``in_patch_limit``, ``patch_limit_on_one_side``, ``merge_kernel_size``)."""
        folder = Path(folder)
        settings = image_processor_settings(folder)
        media = settings.get("media_proc_cfg")
        if media is not None:
            if media.get("fixed_output_tokens") is not None:
                raise ValueError(f"media_proc_cfg.fixed_output_tokens={media['fixed_output_tokens']} is not "
                                 "supported (transformers' Kimi K2.5 processor sizes each image by its patches); "
                                 "set it to null")
            settings = {"size": {"max_height": media.get("patch_limit_on_one_side", 512),
                                 "max_width": media.get("patch_limit_on_one_side", 512)},
                        "max_patches": media.get("in_patch_limit", 16384),
                        "patch_size": media.get("patch_size", 14), "merge_size": media.get("merge_kernel_size", 2),
                        "image_mean": media.get("image_mean", [0.5] * 3),
                        "image_std": media.get("image_std", [0.5] * 3)}
        return cls(settings, config)

    def pixels(self, image: Any) -> tuple[np.ndarray, np.ndarray]:
        """One PIL image -> (``pixel_values`` [h*w, 3, P, P] float32, ``image_grid_thw`` [[1, h, w]] int64)."""
        x = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1)
        (new_h, new_w), (pad_h, pad_w) = navit_size(x.shape[1], x.shape[2], self.patch, self.merge,
                                                    self.max_patches, self.max_side)
        x = _resize(x, new_h, new_w)
        x = F.pad(x, (0, pad_w - new_w, 0, pad_h - new_h))
        x = x.to(torch.float32).sub_(self.mean[:, None, None]).div_(self.std[:, None, None])
        p, rows, cols = self.patch, pad_h // self.patch, pad_w // self.patch
        patches = x.view(3, rows, p, cols, p).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, p, p)
        return patches.numpy(), np.array([[1, rows, cols]], dtype=np.int64)

    def process(self, image: Any) -> ProcessedImage:
        pixels, grid = self.pixels(image)
        tokens = int(grid.prod()) // (self.merge * self.merge)
        return ProcessedImage([self.image_token_id] * tokens, {"pixel_values": pixels, "image_grid_thw": grid})

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE

