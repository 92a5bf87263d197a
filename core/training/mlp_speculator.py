"""``specray train-draft --method mlp_speculator``: IBM's MLP speculator trained on the target's own text.

At position p the speculator reads the target's last hidden state c_p (what it reads when serving:
:mod:`specray.workers.mlp_speculator_drafter`) and, teacher-forced, the tokens after it: stage k (``ttt_steps``
stages) reads ``t[p + k + 1]`` and must give the target's greedy token after ``t[..p + k + 1]``, over the answer
positions only, as the recurrent drafter's steps do (:func:`specray.training.redrafter.train_teacher_forced`: the
same batches, loss weights, loop, checkpoints and resumption). The stages are tied (IBM's ``tie_weights``: one
embedding, norm and head, a projection after the first), as wide as the target, and start from the target's own
embedding and LM head with identity projections, so the first stage's first guess reads the target's state and the
token it gave. Written in IBM's layout (float16), which ``method="mlp_speculator"`` loads.
"""

from __future__ import annotations

import torch

from specray.models.draft_head_loader import target_head_rows
from specray.models.mlp_speculator import MLPSpeculatorHead, save_mlp_speculator
from specray.training.features import FeatureStore
from specray.training.redrafter import train_teacher_forced
from specray.training.train import TrainConfig, load_trained


def build_speculator(target, target_config, config: TrainConfig) -> MLPSpeculatorHead:
    """A fresh trainable speculator (fp32) of ``ttt_steps`` stages, tied when it has more than one."""
    h, vocab = target_config.hidden_size, target_config.vocab_size
    torch.manual_seed(config.seed)
    head = MLPSpeculatorHead(h, h, vocab, config.ttt_steps, tie_weights=config.ttt_steps > 1, scale_input=False)
    with torch.no_grad():
        head.emb[0].weight.copy_(target.embed(torch.arange(vocab)).float())
        head.head[0].weight.copy_(target_head_rows(target, torch.arange(vocab)).float())
        for proj in head.proj:
            proj.weight.copy_(torch.eye(h))
    return head


def unroll(head: MLPSpeculatorHead, context: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Teacher-forced stages: stage k's logits [N, V] after reading ``tokens[:, k]``."""
    state, out = head.start(context), []
    for k in range(tokens.shape[1]):
        state = head.stage(k, state, tokens[:, k])
        out.append(head.logits(k, state))
    return out


def train_mlp_speculator(target, target_config, store: FeatureStore, prompt_lens: list[int], config: TrainConfig,
                         out_dir: str, progress: bool = True) -> dict:
    """Train (or resume) a speculator in ``out_dir``; returns each stage's held-out agreement."""
    head = build_speculator(target, target_config, config)
    return train_teacher_forced(head, lambda context, tokens: unroll(head, context, tokens), store, prompt_lens,
                                config, out_dir, progress)


def export_mlp_speculator(target, target_config, config: TrainConfig, out_dir: str, head_dir: str) -> str:
    """Write the trained speculator of ``out_dir/checkpoint.pt`` in IBM's layout (float16)."""
    save_mlp_speculator(load_trained(build_speculator, target, target_config, config, out_dir).half(), head_dir)
    return head_dir
