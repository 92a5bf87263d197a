"""``specray train-draft --method medusa``: Medusa heads trained on the target's own text.

Head k reads the target's last hidden state at position p (what the heads read when serving:
:mod:`specray.workers.medusa_drafter`) and learns the target's greedy token at p + 2 + k (the feature store's
label at p + 1 + k: the target's argmax after position p + 1 + k, teacher-forced), over the answer positions
only. Each head is a residual SiLU block (started at zero, so that it begins as the identity) and its own LM head
(started as the target's); the loss is the heads' cross-entropies weighted by ``step_decay ** k``. The loop,
checkpoints and resumption are :func:`specray.training.train.optimize`'s; the heads are written in FasterDecoding's
layout (``medusa_lm_head.safetensors``), which ``method="medusa"`` loads.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from specray.models.draft_head_loader import target_head_rows
from specray.models.medusa import MedusaHeads, save_medusa_heads
from specray.training.features import FeatureStore
from specray.training.train import TrainConfig, _batches, load_trained, prepare, train_module


def build_heads(target, target_config, config: TrainConfig) -> MedusaHeads:
    """Fresh trainable heads (fp32): zero blocks, each LM head the target's."""
    h, vocab = target_config.hidden_size, target_config.vocab_size
    heads = MedusaHeads(config.medusa_num_heads, 1, h, vocab)
    rows = target_head_rows(target, torch.arange(vocab)).float()
    with torch.no_grad():
        for blocks, lm_head in zip(heads.blocks, heads.lm_heads):
            for block in blocks:
                block.weight.zero_()
                block.bias.zero_()
            lm_head.weight.copy_(rows)
    return heads


def _load(batch: list[int], store: FeatureStore, feats, labels, prompt_lens: list[int], num_heads: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's positions: features [N, H], and per head the label [N, K] (-1: none, or not an answer)."""
    xs, ys = [], []
    for i in batch:
        n, off = store.lengths[i], store.offsets[i]
        first = max(prompt_lens[i] - 1, 0)  # positions whose next token is part of the answer
        if first >= n - 1:
            continue
        x = np.asarray(feats[off + first: off + n - 1], dtype=np.float32)  # positions first .. n - 2
        lab = np.asarray(labels[off: off + n], dtype=np.int64)
        y = np.full((n - 1 - first, num_heads), -1, dtype=np.int64)
        for k in range(num_heads):
            src = np.arange(first, n - 1) + 1 + k  # the label at p + 1 + k: the token p + 2 + k
            ok = src < n - 1  # the last label (after the final token) is no text
            y[ok, k] = lab[src[ok]]
        xs.append(torch.from_numpy(x))
        ys.append(torch.from_numpy(y))
    if not xs:
        return torch.zeros(0, store.width), torch.zeros(0, num_heads, dtype=torch.long)
    return torch.cat(xs), torch.cat(ys)


def _losses(heads: MedusaHeads, x: torch.Tensor, y: torch.Tensor, decay: float) -> tuple[torch.Tensor, list[float]]:
    """The weighted loss and each head's top-1 agreement with the target."""
    if x.shape[0] == 0:
        return torch.zeros((), requires_grad=True), [float("nan")] * heads.num_heads
    logits = heads(x)  # [N, K, V]
    loss, accs = torch.zeros(()), []
    for k in range(heads.num_heads):
        rows = y[:, k] >= 0
        if rows.any():
            loss = loss + decay ** k * F.cross_entropy(logits[rows, k], y[rows, k])
        with torch.no_grad():
            accs.append(float((logits[rows, k].argmax(-1) == y[rows, k]).float().mean()) if rows.any()
                        else float("nan"))
    return loss, accs


def train_medusa(target, target_config, store: FeatureStore, prompt_lens: list[int], config: TrainConfig,
                 out_dir: str, progress: bool = True) -> dict:
    """Train (or resume) Medusa heads in ``out_dir``; returns each head's held-out agreement."""
    feats, labels, train_ids, eval_ids, ckpt_path = prepare(store, config, out_dir)
    heads = build_heads(target, target_config, config)

    def run_batch(batch_ids: list[int]) -> tuple[torch.Tensor, float]:
        loss, accs = _losses(heads, *_load(batch_ids, store, feats, labels, prompt_lens, heads.num_heads),
                             config.step_decay)
        return loss, accs[0]

    step = train_module(heads, config, train_ids, store, ckpt_path, run_batch, progress)
    sums, counts = np.zeros(heads.num_heads), np.zeros(heads.num_heads)
    with torch.no_grad():
        for batch_ids in _batches(eval_ids, store, config.tokens_per_batch, None):
            x, y = _load(batch_ids, store, feats, labels, prompt_lens, heads.num_heads)
            if x.shape[0] == 0:
                continue
            hits = heads(x).argmax(-1) == y  # [N, K]
            valid = y >= 0
            sums += (hits & valid).sum(0).numpy()
            counts += valid.sum(0).numpy()
    return {"agreement": [float(s / max(c, 1)) for s, c in zip(sums, counts)], "step": step,
            "eval_positions": int(counts[0]), "train_samples": len(train_ids), "eval_samples": len(eval_ids),
            "train_tokens": int(sum(store.lengths[i] for i in train_ids))}


def export_medusa(target, target_config, config: TrainConfig, out_dir: str, head_dir: str) -> str:
    """Write the trained heads of ``out_dir/checkpoint.pt`` in FasterDecoding's layout (float16)."""
    heads = load_trained(build_heads, target, target_config, config, out_dir).half()
    save_medusa_heads(heads, head_dir, "medusa", extra_config={"hidden_size": target_config.hidden_size,
                                                               "vocab_size": target_config.vocab_size})
    return head_dir
