"""Nemotron 3 Nano Omni's images (``NemotronH_Omni_Reasoning_V3``, transformers' ``models/nemotron_h_omni``): the
C-RADIO vision tower (transformers' ``models/radio``), pixel shuffle and an RMSNorm-led squared-ReLU projector turn
each image, at its own patch grid, into text embeddings of the Nemotron-H text model (``models/mamba_hybrid.py``,
served through ``registry._TEXT_PARTS``: its embedding step is Llama's, so the image rows arrive by
``meta.input_embeds``). Its audio: :mod:`specray.models.nemotron_h_omni_audio` (whose subclasses of this module's
encoder and processor the registry names); the release's video input is not served.

The tower (:class:`RadioTower`) takes an image as its flattened ``patch_size`` squares (channel-major, row-major
over the grid, as the image processor cuts them), maps each by a bias-free linear (``patch_projection``) and adds
its position embedding: the learned ``max_img_size / patch_size`` square table resampled bilinearly to a square of
the grid's longer side and cropped to the grid (CPE). The learned class and register tokens (``cls_register_token``,
without positions) go first, then pre-norm layers with per-channel layer scales, the same math as InternViT's
(:class:`specray.models.internvl.InternViTLayer` is reused under a view of the RADIO config: LayerNorms, q/k/v biases
by ``qkv_bias``, a biased output projection, a GELU MLP of ``mlp_ratio`` times the width). The prefix tokens are
dropped; where the text model has MTP layers (``num_nextn_predict_layers`` > 0) a final LayerNorm follows (Megatron's
``vision_final_layernorm``). Pixel shuffle (``downsample_ratio`` 0.5: each 2 x 2 block of the grid into one token,
InternVL's order, :func:`specray.models.internvl.pixel_shuffle`) and the projector ``linear_2(relu(linear_1(
rms_norm(x))) ** 2)`` (bias-free, the norm's eps 1e-5, computed in float32) make one embedding per ``<image>`` token.

The host side (:class:`NemotronHOmniImageProcessor`) does what transformers' image processor does (a torchvision
processor there, which specray does not depend on: done here with torch alone): the patch grid closest to the image's
own within ``[min_num_patches, max_num_patches]`` (and the context's budget), both sides even, the image (float32)
resized bicubically with antialiasing to that grid only when its size differs, rescaled and normalized as
transformers fuses them, cut into patches. The prompt's ``<image>`` becomes ``<img>``, one ``<image>`` per merged
token, ``</img>`` (``NemotronH_Omni_Reasoning_V3Processor``'s text), the ``<image>`` rows taking the embeddings.

The checkpoint is read as released (``vision_model.radio_model.model.*`` with fused ``attn.qkv``, ``mlp1.{0,1,3}``,
``vision_projector.vision_final_layernorm``) and as transformers saves it (``vision_model.embeddings.*``,
``vision_model.encoder.layer.*``, ``multi_modal_projector.*``, ``vision_final_layernorm.*``); layer scales absent
from it are ``layerscale_value`` (transformers' init; C-RADIO has none). Refused by name: another vision model type,
the SwiGLU MLP, a vision activation we lack, a ``downsample_ratio`` other than 0.5 (transformers' own split assumes
it), processor settings that disagree with the model, a resampling other than bicubic."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.internvl import InternViTLayer, pixel_shuffle
from specray.models.layers import LayerNorm, _param, materialize
from specray.models.vision_towers import Linear, copy_weights, vision_activation
from specray.multimodal import MultiModalItem, ProcessedImage, image_processor_settings, special_token_ids

logger = logging.getLogger(__name__)

ARCH = "NemotronH_Omni_Reasoning_V3"
FOLD = 2  # 1 / downsample_ratio: transformers' get_image_features splits its output by grid // 2 ** 2
PROJECTOR_EPS = 1e-5  # transformers builds the projector's RMSNorm with this eps
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
BICUBIC = 3  # PIL's (and transformers' PILImageResampling's) bicubic

# the checkpoint's names of the encoder's tensors -> ours: as released (Megatron / timm names), then as transformers
# saves them (its modules' names); a tensor none matches is not the encoder's
_RELEASED = "vision_model.radio_model.model."
_OWN_NAMES = (
    (re.compile(r"^vision_model\.radio_model\.model\.patch_generator\.embedder\."), "tower.patch_projection."),
    (re.compile(r"^vision_model\.radio_model\.model\.patch_generator\.pos_embed$"), "tower.position_embedding"),
    (re.compile(r"^vision_model\.radio_model\.model\.patch_generator\.cls_token\.token$"), "tower.cls_register_token"),
    (re.compile(r"^vision_model\.radio_model\.model\.blocks\."), "tower.layers."),
    (re.compile(r"^vision_model\.embeddings\.patch_projection\."), "tower.patch_projection."),
    (re.compile(r"^vision_model\.embeddings\.position_embedding$"), "tower.position_embedding"),
    (re.compile(r"^vision_model\.embeddings\.cls_register_token$"), "tower.cls_register_token"),
    (re.compile(r"^vision_model\.encoder\.layer\."), "tower.layers."),
    (re.compile(r"^mlp1\.0\."), "projector.layer_norm."), (re.compile(r"^mlp1\.1\."), "projector.linear_1."),
    (re.compile(r"^mlp1\.3\."), "projector.linear_2."),
    (re.compile(r"^multi_modal_projector\."), "projector."),
    (re.compile(r"^(?:vision_projector\.)?vision_final_layernorm\."), "final_norm."))
# within a layer: transformers' (and the release's) names -> InternViTLayer's
_LAYER_NAMES = (("norm1.", "layernorm_before."), ("norm2.", "layernorm_after."),
                ("attention.o_proj.", "attention.projection_layer."), ("attn.proj.", "attention.projection_layer."),
                ("layer_scale1.lambda1", "lambda_1"), ("layer_scale2.lambda1", "lambda_2"))


def _check(config: Any) -> None:
    """Refuse (ValueError naming the field) what the encoder does not implement."""
    vision = config.vision_config
    kind = getattr(vision, "model_type", None)
    if kind != "radio":
        raise ValueError(f"vision_config.model_type={kind!r} is not supported for {ARCH}: only its C-RADIO tower "
                         "('radio') is")
    if getattr(vision, "use_swiglu_ffn", False):
        raise ValueError(f"vision_config.use_swiglu_ffn=True is not supported for {ARCH}: specray builds RADIO's GELU "
                         "MLP only (the release's); use a checkpoint without the SwiGLU variant")
    vision_activation(vision.hidden_act, "vision_config.hidden_act")
    ratio = float(getattr(config, "downsample_ratio", 0.5))
    if ratio != 1 / FOLD:
        raise ValueError(f"downsample_ratio={ratio} is not supported for {ARCH}: only 0.5 (the release's) is, as "
                         "transformers' get_image_features assumes it; fix config.json")
    if vision.hidden_size % vision.num_attention_heads:
        raise ValueError(f"vision_config.hidden_size={vision.hidden_size} is not divisible by vision_config."
                         f"num_attention_heads={vision.num_attention_heads}; the vision config is inconsistent")


def _layer_view(vision: Any) -> SimpleNamespace:
    """The RADIO config as InternViTLayer reads a vision config (same math: LayerNorms, layer scales, no q/k norm)."""
    return SimpleNamespace(hidden_size=vision.hidden_size, num_attention_heads=vision.num_attention_heads,
                           attention_bias=bool(getattr(vision, "qkv_bias", True)), use_qk_norm=False,
                           norm_type="layer_norm", layer_norm_eps=vision.layer_norm_eps,
                           intermediate_size=int(vision.hidden_size * vision.mlp_ratio), hidden_act=vision.hidden_act)


class RadioTower(nn.Module):
    """C-RADIO's vision model over one image's patches (see the module's docstring); its output drops the class and
    register tokens."""

    def __init__(self, vision: Any):
        super().__init__()
        hidden, self.patch = vision.hidden_size, vision.patch_size
        self.side = vision.max_img_size // vision.patch_size  # the position table's grid side
        self.num_prefix = vision.num_cls_tokens + vision.num_registers
        self.patch_projection = Linear(getattr(vision, "num_channels", 3) * self.patch ** 2, hidden, bias=False)
        self.position_embedding = _param(1, self.side * self.side, hidden)
        self.cls_register_token = _param(self.num_prefix, hidden)
        view = _layer_view(vision)
        self.layers = nn.ModuleList(InternViTLayer(view) for _ in range(vision.num_hidden_layers))

    def positions(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """CPE: the table resampled (bilinear, in float32; up or down) to a square of the grid's longer side, cropped
        to the grid: [rows * cols, hidden]."""
        table = self.position_embedding.reshape(1, self.side, self.side, -1).permute(0, 3, 1, 2).float()
        longest = max(rows, cols)
        table = F.interpolate(table, size=(longest, longest), mode="bilinear", align_corners=False).to(dtype)
        return table[0, :, :rows, :cols].flatten(1).t()

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        # patches: [rows * cols, C * p * p] -> [rows * cols, hidden]
        x = self.patch_projection(patches.to(self.patch_projection.weight.dtype))
        x = x + self.positions(rows, cols, x.dtype)
        x = torch.cat([self.cls_register_token.to(x.dtype), x])[None]
        for layer in self.layers:
            x = layer(x)
        return x[0, self.num_prefix:]


class NemotronHOmniImageEncoder(nn.Module):
    """C-RADIO, its final LayerNorm where built, pixel shuffle and the projector (:class:`specray.multimodal.
    ImageEncoder`), built from the whole checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        _check(config)
        vision = config.vision_config
        self.layerscale = float(getattr(vision, "layerscale_value", 1.0))
        self.tower = RadioTower(vision)
        width = int(getattr(config, "vision_hidden_size", vision.hidden_size))
        if width != vision.hidden_size:
            raise ValueError(f"vision_hidden_size={width} is not vision_config.hidden_size={vision.hidden_size}: the "
                             "projector would not take the tower's features; fix config.json")
        mtp = int(getattr(config.text_config, "num_nextn_predict_layers", 0) or 0)
        self.final_norm = LayerNorm(width, vision.layer_norm_eps) if mtp > 0 else None
        merged, proj, text_hidden = width * FOLD ** 2, int(config.projector_hidden_size), config.text_config.hidden_size
        self.projector = nn.Module()
        self.projector.layer_norm = nn.Module()
        self.projector.layer_norm.weight = _param(merged)
        self.projector.linear_1, self.projector.linear_2 = Linear(merged, proj, False), Linear(proj, text_hidden, False)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Read the tower's and the projector's tensors among the whole checkpoint's (the release's fused ``qkv``
        split into q, k, v); layer scales it lacks take ``layerscale_value``. A ValueError names any other of ours
        missing."""
        params = {n: p for n, p in self.named_parameters() if n.startswith(("tower.", "final_norm.", "projector."))}
        missing = copy_weights(params, self._renamed(weights))
        scales = [n for n in missing if n.endswith(("lambda_1", "lambda_2"))]
        for name in scales:
            params[name].data.fill_(self.layerscale)
        missing = [n for n in missing if n not in scales]
        if missing:
            raise ValueError(f"the checkpoint lacks {ARCH}'s image tensor(s) {missing[:6]} (vision_model.*, "
                             "multi_modal_projector.* / mlp1.*, vision_final_layernorm.*); it does not match its "
                             "config.json's vision_config")

    def _renamed(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            for pattern, ours in _OWN_NAMES:
                if pattern.match(name):
                    break
            else:
                continue
            name = pattern.sub(ours, name, count=1)
            if name.startswith("tower.layers."):
                for theirs, mine in _LAYER_NAMES:
                    name = name.replace(theirs, mine)
                head, _, tail = name.rpartition(".attn.qkv.")
                if _:  # the release's fused q/k/v (transformers splits it in three along the outputs)
                    for part, chunk in zip("qkv", materialize(tensor).chunk(3, dim=0)):
                        yield f"{head}.attention.{part}_proj.{tail}", chunk
                    continue
            yield name, tensor

    @property
    def device(self) -> torch.device:
        return self.projector.linear_1.weight.device

    def features(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """One image's patches [rows * cols, C * p * p] -> the tower's features, pixel-shuffled:
        [rows * cols / 4, hidden * 4]."""
        x = self.tower(patches, rows, cols)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return pixel_shuffle(x.reshape(1, rows, cols, -1), FOLD)[0]

    def project(self, features: torch.Tensor) -> torch.Tensor:
        p = self.projector
        xf = features.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + PROJECTOR_EPS)
        x = (p.layer_norm.weight.float() * xf).to(features.dtype)  # the weight applied in float32, as transformers
        return p.linear_2(F.relu(p.linear_1(x)).square())

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One image's ``pixel_values`` [n, C * p * p] and ``image_grid_hw`` (rows, cols) -> its embeddings
        [n / 4, text hidden]."""
        rows, cols = (int(v) for v in data["image_grid_hw"].reshape(-1).tolist())  # (the grid sizes the sequence)
        patches = data["pixel_values"]
        if patches.shape[0] != rows * cols or rows % FOLD or cols % FOLD:
            raise ValueError(f"an image of {patches.shape[0]} patches came with image_grid_hw=({rows}, {cols}): the "
                             f"grid must hold them all, both sides multiples of {FOLD}")
        return self.project(self.features(patches, rows, cols))


def patch_grid(height: int, width: int, patch: int, merge: int, least: int, most: int) -> tuple[int, int]:
    """The (rows, cols) patch grid transformers' processor resizes an image to: ``round(side / patch + 0.5)`` on
    each side (one past its own grid; where the side is exact, the even one of it and one past it), scaled down to at
    most ``most`` patches, up to at least ``least``, then each side made a multiple of ``merge`` (rounded up while
    within ``most``, else down)."""
    rows, cols = round(height / patch + 0.5), round(width / patch + 0.5)  # (Python's round: half to even)
    shrink = min(math.sqrt(most / (rows * cols)), 1.0)
    rows, cols = math.floor(shrink * rows), math.floor(shrink * cols)
    if most > least and rows * cols < least:
        grow = math.sqrt(least / (rows * cols))
        rows, cols = math.ceil(grow * rows), math.ceil(grow * cols)
    if rows % merge:
        up = rows + merge - rows % merge
        rows = up if up * cols <= most else max(merge, rows - rows % merge)
    if cols % merge:
        up = cols + merge - cols % merge
        cols = up if rows * up <= most else max(merge, cols - cols % merge)
    return rows, cols



class NemotronHOmniImageProcessor:
    """Nemotron 3 Nano Omni's host side (:class:`specray.multimodal.ImageProcessor`): transformers' image
    processor's patches (done here with torch, see the module's docstring) and its processor's ``<img>``,
    ``<image>`` x n, ``</img>`` for the ``<image>`` placeholder."""

    def __init__(self, settings: dict, config: Any, image_token_id: int, start_id: int, end_id: int):
        vision = config.vision_config
        self.patch = int(settings.get("patch_size", 16))
        ratio = float(settings.get("downsample_ratio", 0.5))
        if self.patch != vision.patch_size or ratio != float(config.downsample_ratio):
            raise ValueError(f"the image processor's patch_size={self.patch}, downsample_ratio={ratio} disagree with "
                             f"the model's ({vision.patch_size}, {config.downsample_ratio}): the prompt would hold "
                             "another number of <image> tokens than the model embeds; fix preprocessor_config.json")
        resample = settings.get("resample", BICUBIC)
        if resample not in (BICUBIC, "bicubic"):
            raise ValueError(f"the image processor's resample={resample!r} is not supported for {ARCH}: only bicubic "
                             f"({BICUBIC}, the release's) is; fix preprocessor_config.json")
        self.least = int(settings.get("min_num_patches", 1024))
        self.most = int(settings.get("max_num_patches", 13312))
        self.context = int(settings.get("max_model_len", 16384))
        self.rescale = float(settings.get("rescale_factor", 1 / 255)) if settings.get("do_rescale", True) else None
        mean = settings.get("image_mean", settings.get("norm_mean", CLIP_MEAN))
        std = settings.get("image_std", settings.get("norm_std", CLIP_STD))
        self.normalize = settings.get("do_normalize", True)
        self.mean, self.std = [float(v) for v in mean], [float(v) for v in std]
        self.image_token_id, self.start_id, self.end_id = image_token_id, start_id, end_id

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> NemotronHOmniImageProcessor:
        """From the folder's ``preprocessor_config.json`` (or the ``image_processor`` of its
        ``processor_config.json``) and tokenizer (``<image>``, ``<img>``, ``</img>``)."""
        from transformers import AutoTokenizer

        folder = Path(folder)
        _check(config)
        settings = image_processor_settings(folder)
        tok = AutoTokenizer.from_pretrained(folder)
        ids = special_token_ids(tok, [getattr(tok, attr, None) or default for attr, default in
                                      (("image_token", "<image>"), ("image_start_token", "<img>"),
                                       ("image_end_token", "</img>"))], folder, f"{ARCH}'s processor")
        if ids[0] != int(config.image_token_id):
            raise ValueError(f"the tokenizer's image token is id {ids[0]} but image_token_id={config.image_token_id}: "
                             "transformers fills image_token_id's rows with the image; fix config.json or the "
                             "tokenizer")
        return cls(settings, config, *ids)

    def budget(self, num_images: int = 1) -> int:
        """The patches an image may take in a call of ``num_images`` (transformers gives all of a call's images the
        context's budget, clamped to ``[min_num_patches, max_num_patches]``; one at a time here)."""
        merge = FOLD
        most = max((self.context - 4) * merge ** 2, self.least * num_images)
        if self.most:
            most = min(most, self.most)
        return max(most, self.least)

    def pixels(self, image: Any) -> tuple[np.ndarray, tuple[int, int]]:
        """One PIL image -> its patches [rows * cols, 3 * p * p] (float32) and its grid (rows, cols)."""
        x = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1)
        height, width = x.shape[-2:]
        rows, cols = patch_grid(height, width, self.patch, FOLD, self.least, self.budget())
        x = x.to(torch.float32)[None]
        if (height, width) != (rows * self.patch, cols * self.patch):
            x = F.interpolate(x, size=[rows * self.patch, cols * self.patch], mode="bicubic", align_corners=False,
                              antialias=True)
        x = x[0]
        if self.normalize:  # transformers folds the rescale into the mean and std
            scale = 1.0 if self.rescale is None else 1.0 / self.rescale
            mean = (torch.tensor(self.mean) * scale).view(-1, 1, 1)
            std = (torch.tensor(self.std) * scale).view(-1, 1, 1)
            x = (x - mean) / std
        elif self.rescale is not None:
            x = x * self.rescale
        p = self.patch
        x = x.reshape(3, rows, p, cols, p).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3 * p * p)
        return x.numpy(), (rows, cols)

    def process(self, image: Any) -> ProcessedImage:
        patches, (rows, cols) = self.pixels(image)
        count = rows * cols // FOLD ** 2
        replacement = [self.start_id] + [self.image_token_id] * count + [self.end_id]
        data = {"pixel_values": patches, "image_grid_hw": np.array([rows, cols], dtype=np.int64)}
        return ProcessedImage(replacement, data, embed_rows=list(range(1, count + 1)))

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain positions (Nemotron-H's attention layers have no RoPE)
