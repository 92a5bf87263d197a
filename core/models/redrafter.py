"""ReDrafter's recurrent drafter (Cheng et al., 2024, Apple's "Recurrent Drafter"): a small RNN over the target's
embeddings, conditioned on the target's last hidden state, that proposes beams of draft tokens by beam search.

With ``c`` the target's hidden state at the position whose logits gave the token ``g0`` it just sampled::

    s_0 = 0
    s_t = SiLU(W E(g_{t-1}) + U s_{t-1})        (rnn; without it: s_t = E(g_{t-1}) + s_{t-1})
    log q(g_t | g_0..g_{t-1}) = log_softmax(top50(LMHead(proj([c, s_t]))))

``E`` is the target's embedding, ``proj`` an optional linear map from 2H to the drafter's width (``exit_dim``),
``LMHead`` ``num_draft_layers`` residual blocks ``x + SiLU(A x + a)`` and a linear map to the vocabulary. The logits
are restricted to their 50 largest (the rest at -5e4), as the reference drafter's are. There is no attention: no
KV cache and no pass over earlier positions.

Checkpoint (Apple's ``recurrent_drafting`` layout, read by :func:`load_redrafter` and written by
:func:`save_redrafter`): ``config.json`` with ``model_type`` ``recurrent_drafting_drafter``, ``hidden_size``,
``vocab_size``, ``exit_dim``, ``num_draft_layers``, ``rnn``; tensors ``input_proj.{weight,bias}`` (when 2H differs
from ``exit_dim``), ``lm_head.{j}.linear.{weight,bias}`` for block j, ``lm_head.{num_draft_layers}.weight``,
``rnn_u.{weight,bias}``, ``rnn_w.weight``. Names may carry a ``drafter.`` prefix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specray.models.layers import gather_vocab, materialize, shard_vocab_rows, vocab_shard
from specray.models.loader import head_config, head_tensors, load_frozen
from specray.parallel import TPGroup

MODEL_TYPE = "recurrent_drafting_drafter"
TOP_K = 50  # the drafter's logits kept per row (the reference's top-k warp)
MASKED = -5e4  # the logit of the others


class ReDrafterHead(nn.Module):
    """``step(state, embedded)`` advances the RNN; ``log_probs(context, state)`` gives log q over the vocabulary."""

    aux_layers: tuple[int, ...] = ()  # reads the last hidden state only

    def __init__(self, hidden_size: int, vocab_size: int, exit_dim: int, num_draft_layers: int, rnn: bool,
                 tp: TPGroup | None = None):
        super().__init__()
        self.hidden_size, self.vocab_size, self.rnn = hidden_size, vocab_size, rnn
        # over a target's tensor-parallel ranks: this rank's rows of the LM head (its logits all-gathered), the rest
        # whole, the embeddings read from the target's own split embedding
        self.tp = tp or TPGroup.single()
        self.input_proj = nn.Linear(2 * hidden_size, exit_dim) if exit_dim != 2 * hidden_size else None
        self.blocks = nn.ModuleList(nn.Linear(exit_dim, exit_dim) for _ in range(num_draft_layers))
        self.lm_head = nn.Linear(exit_dim, vocab_shard(self.tp, vocab_size)[1], bias=False)
        self.rnn_u = nn.Linear(hidden_size, hidden_size) if rnn else None
        self.rnn_w = nn.Linear(hidden_size, hidden_size, bias=False) if rnn else None
        self._target = ()  # (the target,) once bound: a tuple, not a submodule, so its weights are never ours

    def bind(self, target) -> "ReDrafterHead":
        """Read token embeddings from ``target`` (a CausalLM, or its whole embedding over TP ranks)."""
        self._target = (target,)
        return self

    @property
    def target(self):
        """What the drafter reads token embeddings from (None until bound)."""
        return self._target[0] if self._target else None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [...] -> [..., H] (the target embeds a flat row of ids)."""
        return self._target[0].embed(token_ids.reshape(-1)).view(*token_ids.shape, -1)

    def step(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """s_t from s_{t-1} [..., H] and E(g_{t-1}) [..., H]."""
        if not self.rnn:
            return embedded + state
        return nn.functional.silu(self.rnn_w(embedded) + self.rnn_u(state))

    def logits(self, context: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The drafter's raw logits [..., V] float32 given the target's hidden state ``context`` and the RNN state."""
        x = torch.cat((context, state), dim=-1)
        if self.input_proj is not None:
            x = self.input_proj(x)
        for block in self.blocks:
            x = x + nn.functional.silu(block(x))
        return gather_vocab(self.lm_head(x), self.tp, self.vocab_size).float()

    def log_probs(self, context: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """log q [..., V] float32: :meth:`logits` restricted to their top 50."""
        logits = self.logits(context, state)
        kth = logits.topk(min(TOP_K, logits.shape[-1]), dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, MASKED).log_softmax(dim=-1)

    def kv_cache_specs(self) -> list:
        return []  # no attention: nothing cached


def load_redrafter(path: str | os.PathLike | None, target_config, dtype: torch.dtype,
                   device: torch.device | str, target=None, tp: TPGroup | None = None) -> ReDrafterHead:
    """The drafter in ``path`` (a folder with ``config.json``, or a hub id), checked against the target's sizes,
    reading its token embeddings from ``target``; with ``tp``, this rank's share (its rows of the LM head)."""
    if path is None:
        raise ValueError("speculative_config.model is required for method='redrafter': the drafter's checkpoint folder")
    folder, tensors = head_tensors(path, "redrafter", ("*.bin",))
    config = head_config(folder, "redrafter", MODEL_TYPE, "a ReDrafter checkpoint (Apple's recurrent_drafting layout)")
    h, v = target_config.hidden_size, target_config.vocab_size
    if (config.get("hidden_size"), config.get("vocab_size")) != (h, v):
        raise ValueError(f"the redrafter has hidden_size={config.get('hidden_size')}, vocab_size="
                         f"{config.get('vocab_size')} but the target has hidden_size={h}, vocab_size={v}: the drafter "
                         "was trained for another model")
    with torch.device(device):
        module = ReDrafterHead(h, v, int(config["exit_dim"]), int(config["num_draft_layers"]),
                               bool(config.get("rnn", False)), tp).to(dtype)
    state = {}
    for name, tensor in tensors.items():
        ours = _ours(name.removeprefix("drafter."), module)
        state[ours] = (shard_vocab_rows(tensor, module.tp, v) if ours == "lm_head.weight" else materialize(tensor)
                       ).to(dtype)
    load_frozen(module, state, f"the redrafter checkpoint {str(folder)!r} does not fit its config.json ({config})")
    return module.bind(target) if target is not None else module


def _ours(name: str, module: ReDrafterHead) -> str:
    """A checkpoint name -> ours (``lm_head.{j}.linear.*`` -> ``blocks.{j}.*``, the last ``lm_head.{L}`` ->
    ``lm_head``); names we do not know pass through (and are reported as unexpected)."""
    parts = name.split(".")
    if parts[0] == "lm_head" and len(parts) >= 3 and parts[1].isdigit():
        if int(parts[1]) == len(module.blocks):
            return "lm_head." + parts[-1]
        return f"blocks.{parts[1]}.{parts[-1]}"
    return name


def save_redrafter(head: ReDrafterHead, folder: str | os.PathLike, extra_config: dict[str, Any] | None = None) -> None:
    """Write ``head`` in Apple's layout: ``config.json`` and ``model.safetensors``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in head.state_dict().items():
        parts = name.split(".")
        if parts[0] == "blocks":
            name = f"lm_head.{parts[1]}.linear.{parts[2]}"
        elif parts[0] == "lm_head":
            name = f"lm_head.{len(head.blocks)}.{parts[1]}"
        tensors[name] = tensor.contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    exit_dim = head.lm_head.weight.shape[1]
    config = {"model_type": MODEL_TYPE, "hidden_size": head.hidden_size, "vocab_size": head.vocab_size,
              "exit_dim": exit_dim, "num_draft_layers": len(head.blocks), "rnn": head.rnn, **(extra_config or {})}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
