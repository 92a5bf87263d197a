"""``specray train-draft --method redrafter``: a recurrent drafter (ReDrafter) trained on the target's own text.

At position p the drafter reads the target's last hidden state c_p (what it reads when serving:
:mod:`specray.workers.redrafter_drafter`) and, teacher-forced, the tokens after it: step j (1-based) updates the
RNN with ``E(t[p + j])`` and must give the target's greedy token after ``t[..p + j]`` (the feature store's label at
p + j), over the answer positions only; the loss is the steps' cross-entropies weighted ``step_decay ** (j - 1)``
(over the raw logits: the top-50 restriction applies when serving). The drafter starts with identity blocks, the
target's LM head over the context half of its input and zeros over the state half (its first guess: the target's
own distribution at p), and a small random RNN. The loop, checkpoints and resumption are
:func:`specray.training.train.optimize`'s; the drafter is written in Apple's layout, which ``method="redrafter"``
loads.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from specray.models.draft_head_loader import target_head_rows
from specray.models.redrafter import ReDrafterHead, save_redrafter
from specray.training.features import FeatureStore
from specray.training.train import TrainConfig, _batches, load_trained, prepare, train_module


def build_drafter(target, target_config, config: TrainConfig) -> ReDrafterHead:
    """A fresh trainable drafter (fp32), width 2H (no input projection), one residual block."""
    h, vocab = target_config.hidden_size, target_config.vocab_size
    torch.manual_seed(config.seed)
    drafter = ReDrafterHead(h, vocab, 2 * h, 1, rnn=True)
    rows = target_head_rows(target, torch.arange(vocab)).float()
    with torch.no_grad():
        for block in drafter.blocks:
            block.weight.zero_()
            block.bias.zero_()
        drafter.lm_head.weight.copy_(torch.cat([rows, torch.zeros_like(rows)], dim=1))
        for p in (drafter.rnn_u.weight, drafter.rnn_w.weight):
            torch.nn.init.normal_(p, std=0.02)
        drafter.rnn_u.bias.zero_()
    return drafter


def _load(batch: list[int], store: FeatureStore, feats, labels, prompt_lens: list[int], steps: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's answer positions p: context [N, H], the tokens t[p + 1 .. p + steps] [N, steps] (0 past the
    text) and the labels at p + 1 .. p + steps [N, steps] (-1: none)."""
    xs, ins, ys = [], [], []
    for i in batch:
        n, off = store.lengths[i], store.offsets[i]
        first = max(prompt_lens[i] - 1, 0)  # positions whose next token is part of the answer
        if first >= n - 1:
            continue
        positions = np.arange(first, n - 1)
        xs.append(torch.from_numpy(np.asarray(feats[off + first: off + n - 1], dtype=np.float32)))
        tokens = np.asarray(store.token_ids[i][:n], dtype=np.int64)
        lab = np.asarray(labels[off: off + n], dtype=np.int64)
        src = positions[:, None] + np.arange(1, steps + 1)[None, :]  # [P, steps]: p + j
        ok = src < n - 1  # the last label (after the final token) is no text
        ins.append(torch.from_numpy(np.where(ok, tokens[np.minimum(src, n - 1)], 0)))
        ys.append(torch.from_numpy(np.where(ok, lab[np.minimum(src, n - 1)], -1)))
    if not xs:
        return torch.zeros(0, store.width), torch.zeros(0, steps, dtype=torch.long), \
            torch.zeros(0, steps, dtype=torch.long)
    return torch.cat(xs), torch.cat(ins), torch.cat(ys)


def unroll(drafter: ReDrafterHead, embed, context: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Teacher-forced drafting: per step j, the raw logits [N, V] after reading ``tokens[:, :j + 1]``."""
    with torch.no_grad():
        embedded = embed(tokens).float()  # [N, steps, H]: the target's embedding, frozen
    state = torch.zeros_like(context)
    out = []
    for j in range(tokens.shape[1]):
        state = drafter.step(state, embedded[:, j])
        out.append(drafter.logits(context, state))
    return out


def _losses(steps: list[torch.Tensor], y: torch.Tensor, decay: float) -> tuple[torch.Tensor, list[float]]:
    """The weighted loss over the teacher-forced steps' logits and each step's top-1 agreement with the target."""
    if y.shape[0] == 0:
        return torch.zeros((), requires_grad=True), [float("nan")] * y.shape[1]
    loss, accs = torch.zeros(()), []
    for j, logits in enumerate(steps):
        rows = y[:, j] >= 0
        if rows.any():
            loss = loss + decay ** j * F.cross_entropy(logits[rows], y[rows, j])
        with torch.no_grad():
            accs.append(float((logits[rows].argmax(-1) == y[rows, j]).float().mean()) if rows.any() else float("nan"))
    return loss, accs


def train_teacher_forced(drafter: torch.nn.Module, unrolled, store: FeatureStore, prompt_lens: list[int],
                         config: TrainConfig, out_dir: str, progress: bool = True) -> dict:
    """Train (or resume) in ``out_dir`` a drafter that reads the target's last hidden state at a position and,
    teacher-forced, the ``ttt_steps`` tokens after it (ReDrafter's, the MLP speculator's): ``unrolled(context,
    tokens)`` gives each step's raw logits; returns each step's held-out agreement and the accepted length of one
    greedy chain."""
    feats, labels, train_ids, eval_ids, ckpt_path = prepare(store, config, out_dir)
    steps = config.ttt_steps

    def run_batch(batch_ids: list[int]) -> tuple[torch.Tensor, float]:
        context, tokens, y = _load(batch_ids, store, feats, labels, prompt_lens, steps)
        logits = unrolled(context, tokens) if context.shape[0] else []
        loss, accs = _losses(logits, y, config.step_decay)
        return loss, accs[0]

    step = train_module(drafter, config, train_ids, store, ckpt_path, run_batch, progress)
    sums, counts, chains = np.zeros(steps), np.zeros(steps), []
    with torch.no_grad():
        for batch_ids in _batches(eval_ids, store, config.tokens_per_batch, None):
            context, tokens, y = _load(batch_ids, store, feats, labels, prompt_lens, steps)
            if context.shape[0] == 0:
                continue
            hits = torch.stack([logits.argmax(-1) for logits in unrolled(context, tokens)], dim=1) == y  # [N, steps]
            valid = y >= 0
            sums += (hits & valid).sum(0).numpy()
            counts += valid.sum(0).numpy()
            whole = valid.all(1)  # positions with all steps in the text: accepted length of one greedy chain
            chains.append(hits[whole].int().cumprod(1).sum(1).float())
    accepted = float(torch.cat(chains).mean()) + 1 if chains and sum(len(c) for c in chains) else float("nan")
    return {"agreement": [float(s / max(c, 1)) for s, c in zip(sums, counts)], "step": step,
            "expected_accepted_length_one_beam": accepted, "eval_positions": int(counts[0]),
            "train_samples": len(train_ids), "eval_samples": len(eval_ids),
            "train_tokens": int(sum(store.lengths[i] for i in train_ids))}


def train_redrafter(target, target_config, store: FeatureStore, prompt_lens: list[int], config: TrainConfig,
                    out_dir: str, progress: bool = True) -> dict:
    """Train (or resume) a recurrent drafter in ``out_dir``; returns each step's held-out agreement."""
    drafter = build_drafter(target, target_config, config)
    return train_teacher_forced(drafter, lambda context, tokens: unroll(drafter, target.embed, context, tokens),
                                store, prompt_lens, config, out_dir, progress)


def export_redrafter(target, target_config, config: TrainConfig, out_dir: str, head_dir: str) -> str:
    """Write the trained drafter of ``out_dir/checkpoint.pt`` in Apple's layout (float16)."""
    save_redrafter(load_trained(build_drafter, target, target_config, config, out_dir).half(), head_dir)
    return head_dir
