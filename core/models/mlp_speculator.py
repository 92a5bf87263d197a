"""IBM's MLP speculator (Wertheimer et al., 2024, "Accelerating Production LLMs with Combined Token/Embedding
Speculators"; vLLM's ``mlp_speculator``): ``n_predict`` small MLP stages, each predicting one token further from the
stage before's state and the token that stage picked, conditioned at the start on the target's last hidden state.

With ``c`` the target's hidden state (after its final norm) at the position whose logits gave the token ``g_0`` it
just sampled, ``w_s = 0.5 ** (0.5 / n_predict)`` and ``w_e = sqrt((1 - w_s ** 2) * inner_dim / 2)``::

    s_0 = c                                   (scale_input: s_0 = norm(c) / sqrt(2), a norm without weights)
    s_k = GELU(LN_k(P_k s_{k-1} + (w_e / w_s) E_k(g_{k-1})))     k = 1 .. n_predict
    log q(g_k | g_0 .. g_{k-1}) = log_softmax(H_k s_k)

``LN`` is an RMS-style norm (``x / sqrt(mean(x^2) + 1e-6)``) with a weight and a bias; ``E_k`` the stage's own
embedding of the vocabulary (not the target's), ``P_k`` a bias-free map (the first from the target's width
``emb_dim``, the others from ``inner_dim``), ``H_k`` a bias-free map to the vocabulary. With ``tie_weights`` every
stage shares one embedding, one norm and one head, and every stage after the first one projection. There is no
attention: no KV cache, no pass over earlier positions.

Checkpoint (IBM's layout, as vLLM reads it: :func:`load_mlp_speculator`; :func:`save_mlp_speculator` writes it):
``config.json`` with ``model_type`` ``mlp_speculator``, ``emb_dim``, ``inner_dim`` (0: ``emb_dim``), ``vocab_size``,
``n_predict``, ``tie_weights``, ``scale_input``; tensors ``emb.{k}.weight``, ``proj.{k}.weight``, ``head.{k}.weight``,
``ln.{k}.weight``, ``ln.{k}.bias`` per stage (tied: stage 0's, and ``proj.1``), names possibly prefixed
``speculator.``. ``top_k_tokens_per_head`` and ``n_candidates`` (IBM's candidate trees) are not read.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specray.models.layers import gather_vocab, materialize, shard_vocab_rows, vocab_shard
from specray.models.loader import head_config, head_tensors, load_frozen
from specray.parallel import TPGroup

MODEL_TYPE = "mlp_speculator"
EPS = 1e-6  # the stages' norms' (the reference's)


class _Norm(nn.Module):
    """``x / sqrt(mean(x^2) + eps)``, then ``weight * x + bias`` when it has them (the stages' norms; the input's has
    none)."""

    def __init__(self, width: int, affine: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width)) if affine else None
        self.bias = nn.Parameter(torch.zeros(width)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        return x if self.weight is None else self.weight * x + self.bias


class MLPSpeculatorHead(nn.Module):
    """``start(context)`` gives s_0; ``stage(k, state, tokens)`` gives s_{k+1}; ``logits(k, state)`` the stage's
    logits over the vocabulary (float32)."""

    aux_layers: tuple[int, ...] = ()  # reads the last hidden state only

    def __init__(self, emb_dim: int, inner_dim: int, vocab_size: int, n_predict: int, tie_weights: bool,
                 scale_input: bool, tp: TPGroup | None = None):
        super().__init__()
        self.emb_dim, self.inner_dim, self.vocab_size, self.n_predict = emb_dim, inner_dim, vocab_size, n_predict
        self.tie_weights, self.scale_input = tie_weights, scale_input
        # over a target's tensor-parallel ranks: this rank's rows of each head (its logits all-gathered), the rest
        # whole (the stages' own embeddings too: a lookup of whole rows)
        self.tp = tp or TPGroup.single()
        distinct = 1 if tie_weights else n_predict
        self.emb = nn.ModuleList(nn.Embedding(vocab_size, inner_dim) for _ in range(distinct))
        self.proj = nn.ModuleList(nn.Linear(emb_dim if k == 0 else inner_dim, inner_dim, bias=False)
                                  for k in range(2 if tie_weights and n_predict > 1 else distinct))
        self.head = nn.ModuleList(nn.Linear(inner_dim, vocab_shard(self.tp, vocab_size)[1], bias=False)
                                  for _ in range(distinct))
        self.ln = nn.ModuleList(_Norm(inner_dim, affine=True) for _ in range(distinct))
        self.ln0 = _Norm(emb_dim, affine=False) if scale_input else None
        state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_scale = math.sqrt((1 - state_weight ** 2) * (inner_dim / 2)) / state_weight

    def _of(self, modules: nn.ModuleList, k: int) -> nn.Module:
        return modules[min(k, len(modules) - 1)]  # tied: stage 0's (the projection: stage 1's from then on)

    def start(self, context: torch.Tensor) -> torch.Tensor:
        """s_0 from the target's hidden state [..., emb_dim]."""
        return context if self.ln0 is None else self.ln0(context) / math.sqrt(2)

    def stage(self, k: int, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """s_{k+1} [..., inner_dim] from s_k [..., width] and the tokens g_k [...] stage k reads."""
        x = self._of(self.proj, k)(state) + self.emb_scale * self._of(self.emb, k)(tokens)
        return nn.functional.gelu(self._of(self.ln, k)(x))

    def logits(self, k: int, state: torch.Tensor) -> torch.Tensor:
        """Stage k's logits [..., V] float32 from its state s_{k+1}."""
        return gather_vocab(self._of(self.head, k)(state), self.tp, self.vocab_size).float()

    def kv_cache_specs(self) -> list:
        return []  # no attention: nothing cached


def read_mlp_speculator_config(folder: Path) -> dict[str, Any]:
    """The checkpoint's config.json, checked (a ValueError naming the file otherwise)."""
    config = head_config(folder, "mlp_speculator", MODEL_TYPE, "an MLP speculator checkpoint (IBM's layout)")
    n = config.get("n_predict")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{str(folder / 'config.json')!r} gives n_predict={n!r}: it must be an int >= 1 (the "
                         "stages)")
    return config


def load_mlp_speculator(path: str | os.PathLike | None, target_config, dtype: torch.dtype,
                        device: torch.device | str, tp: TPGroup | None = None) -> MLPSpeculatorHead:
    """The speculator in ``path`` (a folder with ``config.json``, or a hub id), checked against the target's sizes;
    with ``tp``, this rank's share (its rows of each head)."""
    if path is None:
        raise ValueError("speculative_config.model is required for method='mlp_speculator': the speculator's "
                         "checkpoint folder")
    folder, tensors = head_tensors(path, "mlp_speculator", ("*.bin", "*.pt"))
    config = read_mlp_speculator_config(folder)
    h, v = target_config.hidden_size, target_config.vocab_size
    if (config.get("emb_dim"), config.get("vocab_size")) != (h, v):
        raise ValueError(f"the mlp_speculator has emb_dim={config.get('emb_dim')}, vocab_size="
                         f"{config.get('vocab_size')} but the target has hidden_size={h}, vocab_size={v}: the "
                         "speculator was trained for another model")
    inner = int(config.get("inner_dim") or h)
    with torch.device(device):
        module = MLPSpeculatorHead(h, inner, v, int(config["n_predict"]), bool(config.get("tie_weights", False)),
                                   bool(config.get("scale_input", False)), tp).to(dtype)
    state = {}
    for name, tensor in tensors.items():
        name = _ours(name.removeprefix("speculator."), module)
        state[name] = (shard_vocab_rows(tensor, module.tp, v) if name.startswith("head.") else materialize(tensor)
                       ).to(dtype)
    load_frozen(module, state, f"the mlp_speculator checkpoint {str(folder)!r} does not fit its config.json "
                               f"({config})")
    return module


def _ours(name: str, module: MLPSpeculatorHead) -> str:
    """A checkpoint name -> ours: with tied weights a stage's shared tensor, under whichever stage's index it was
    written (once or for every stage), is stage 0's (a projection after the first: stage 1's)."""
    parts = name.split(".")
    if module.tie_weights and len(parts) == 3 and parts[1].isdigit() and parts[0] in ("emb", "proj", "head", "ln"):
        parts[1] = str(min(int(parts[1]), 1)) if parts[0] == "proj" else "0"
    return ".".join(parts)


def save_mlp_speculator(head: MLPSpeculatorHead, folder: str | os.PathLike) -> None:
    """Write ``head`` (whole, one rank) in IBM's layout: ``config.json`` and ``model.safetensors``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": MODEL_TYPE, "emb_dim": head.emb_dim,
        "inner_dim": head.inner_dim, "vocab_size": head.vocab_size, "n_predict": head.n_predict,
        "tie_weights": head.tie_weights, "scale_input": head.scale_input,
        "top_k_tokens_per_head": [1] * head.n_predict, "n_candidates": 1}))
    save_file({name: t.detach().contiguous() for name, t in head.state_dict().items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
