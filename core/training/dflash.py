"""``specray train-draft --method dflash``: a DFlash model (:mod:`specray.models.dflash`) trained on the target's own
text, written in z-lab's ``DFlashDraftModel`` layout, which ``method="dflash"`` loads.

Per training sample, ``dflash_anchors`` anchors are drawn among its answer positions. An anchor a stands for a step
where the target has just produced ``t[a]``: its block is ``[t[a], mask x (B - 1)]`` at positions a..a+B-1, its
context the features of positions 0..a-1 (the target's residual streams entering the EAGLE-3 layers, i.e. after
layers (2, L/2, L-3) - 1, fused by ``fc`` and ``hidden_norm``), and block row i learns the target's greedy token at
a + i (the feature store's label at a + i - 1), weighted ``step_decay ** (i - 1)``. Every anchor of a sample runs in one
pass: the context's K/V once per layer, each block attending the context before its anchor and its own rows both
ways (a dense mask), as serving runs one block. The LM head and embedding are the target's (frozen); the layers start
from the target's last layer (q and k norms at one), ``fc`` small and random. The loop, checkpoints and resumption
are :func:`specray.training.train.optimize`'s.
"""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.draft_head_loader import target_head_rows
from specray.models.layers import rope_parameters
from specray.models.plain_config import PlainConfig
from specray.training.features import FeatureStore
from specray.training.train import (TrainConfig, _batches, feature_layers, load_checkpoint, load_trained, prepare,
                                    train_module)


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Attention(nn.Module):
    def __init__(self, h: int, heads: int, kv: int, d: int, eps: float):
        super().__init__()
        self.heads, self.kv, self.d = heads, kv, d
        self.q_proj, self.k_proj = nn.Linear(h, heads * d, bias=False), nn.Linear(h, kv * d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(h, kv * d, bias=False), nn.Linear(heads * d, h, bias=False)
        self.q_norm, self.k_norm = _Norm(d, eps), _Norm(d, eps)


class _MLP(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, inter, bias=False), nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, h: int, heads: int, kv: int, d: int, inter: int, eps: float):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _Norm(h, eps), _Norm(h, eps)
        self.self_attn, self.mlp = _Attention(h, heads, kv, d, eps), _MLP(h, inter)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated (rotate-half pairs) by cos, sin [T, 1, D/2]."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class DFlashTrainer(nn.Module):
    """DFlash's layers over whole training sequences (dense attention, a mask per anchor), under the checkpoint's
    own parameter names, so its state dict is the checkpoint."""

    def __init__(self, config: dict):
        super().__init__()
        h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
        d, eps = config["head_dim"], config["rms_norm_eps"]
        taps = len(config["dflash_config"]["target_layer_ids"])
        self.fc = nn.Linear(taps * h, h, bias=False)
        self.hidden_norm, self.norm = _Norm(h, eps), _Norm(h, eps)
        self.layers = nn.ModuleList([_Layer(h, heads, kv, d, config["intermediate_size"], eps)
                                     for _ in range(config["num_hidden_layers"])])
        rope = rope_parameters(PlainConfig(**config))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"train-draft --method dflash: the target's RoPE {rope.get('rope_type')!r} is not "
                             "supported (plain RoPE only)")
        self.register_buffer("inv_freq", 1.0 / rope["rope_theta"] ** (torch.arange(0, d, 2).float() / d),
                             persistent=False)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos()[:, None, :], angles.sin()[:, None, :]

    def forward(self, features: torch.Tensor, block: torch.Tensor, block_pos: torch.Tensor, visible: torch.Tensor
                ) -> torch.Tensor:
        """features [N, taps*H] of positions 0..N-1, the blocks' embeddings [R, H] at ``block_pos`` [R], ``visible``
        [R, N + R] (which context position or block row each block row attends) -> the blocks' normed hidden [R, H]."""
        c = self.hidden_norm(self.fc(features))
        cos_c, sin_c = self._rope(torch.arange(c.shape[0]))
        cos_b, sin_b = self._rope(block_pos)
        mask = visible[None, None]
        x = block
        for layer in self.layers:
            attn = layer.self_attn
            heads, kv, d = attn.heads, attn.kv, attn.d
            xn = layer.input_layernorm(x)
            q = _rotate(attn.q_norm(attn.q_proj(xn).view(-1, heads, d)), cos_b, sin_b)
            k = torch.cat((_rotate(attn.k_norm(attn.k_proj(c).view(-1, kv, d)), cos_c, sin_c),
                           _rotate(attn.k_norm(attn.k_proj(xn).view(-1, kv, d)), cos_b, sin_b)))
            v = torch.cat((attn.v_proj(c).view(-1, kv, d), attn.v_proj(xn).view(-1, kv, d)))
            a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=heads != kv)
            x = x + attn.o_proj(a[0].transpose(0, 1).reshape(-1, heads * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def dflash_config(target_config, config: TrainConfig) -> dict:
    """The checkpoint's config.json: Qwen3-style layers of the target's shape, its EAGLE-3 layers as taps (the
    streams entering them are the outputs of the layers before), the block size, and the target's last token id as
    the mask token (any fixed row of the target's embedding serves; the model learns what it means there)."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "vocab_size", "hidden_act", "rope_parameters", "rope_theta")
    out = {k: getattr(target_config, k) for k in keys if getattr(target_config, k, None) is not None}
    head_dim = (getattr(target_config, "head_dim", None)
                or target_config.hidden_size // target_config.num_attention_heads)
    taps = [layer - 1 for layer in feature_layers("dflash", target_config.num_hidden_layers)]
    out.update(architectures=["DFlashDraftModel"], model_type="qwen3", head_dim=head_dim,
               num_hidden_layers=config.dflash_num_layers, block_size=config.dflash_block_size,
               num_target_layers=target_config.num_hidden_layers, tie_word_embeddings=False,
               dflash_config={"target_layer_ids": taps, "mask_token_id": target_config.vocab_size - 1})
    return out


def build_trainer(target, target_config, config: TrainConfig) -> DFlashTrainer:
    """A fresh DFlash model (fp32): its layers the target's last layer's weights (q and k norms at one), ``fc``
    small and random, its final norm the target's."""
    torch.manual_seed(config.seed)
    model = DFlashTrainer(dflash_config(target_config, config))
    nn.init.normal_(model.fc.weight, std=0.02)
    src = {k: v.detach().float() for k, v in target.named_parameters()}
    last = f"model.layers.{target_config.num_hidden_layers - 1}."
    qkv = src.get(last + "self_attn.qkv_proj.weight")
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.self_attn
            if qkv is not None and qkv.shape[0] == attn.q_proj.weight.shape[0] + 2 * attn.k_proj.weight.shape[0]:
                q, k, v = qkv.split([attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0],
                                     attn.v_proj.weight.shape[0]])
                attn.q_proj.weight.copy_(q)
                attn.k_proj.weight.copy_(k)
                attn.v_proj.weight.copy_(v)
            for name, param in [("self_attn.o_proj.weight", attn.o_proj.weight),
                                ("mlp.down_proj.weight", layer.mlp.down_proj.weight),
                                ("input_layernorm.weight", layer.input_layernorm.weight),
                                ("post_attention_layernorm.weight", layer.post_attention_layernorm.weight)]:
                if src.get(last + name) is not None and src[last + name].shape == param.shape:
                    param.copy_(src[last + name])
            gate_up = src.get(last + "mlp.gate_up_proj.weight")
            if gate_up is not None and gate_up.shape[0] == 2 * layer.mlp.gate_proj.weight.shape[0]:
                gate, up = gate_up.chunk(2)
                layer.mlp.gate_proj.weight.copy_(gate)
                layer.mlp.up_proj.weight.copy_(up)
        if "model.norm.weight" in src:
            model.norm.weight.copy_(src["model.norm.weight"])
    return model


def _sample_rows(store: FeatureStore, i: int, feats, labels, prompt_len: int, embed: torch.Tensor, mask_id: int,
                 block: int, anchors: int, rng: np.random.Generator | None):
    """One sample's training pass: its features [N, F], the blocks' embeddings [R, H] and positions [R], the
    visibility [R, N + R], the labels [R] (-1: row 0, or past the text) and each row's place in its block [R]; None
    when the sample has no answer position to anchor at."""
    n, off = store.lengths[i], store.offsets[i]
    first, last = max(prompt_len, 1), n - 2  # anchors: answer tokens with a label after them
    if last < first:
        return None
    candidates = np.arange(first, last + 1)
    if rng is not None and len(candidates) > anchors:
        candidates = np.sort(rng.choice(candidates, anchors, replace=False))
    elif len(candidates) > anchors:
        candidates = candidates[np.linspace(0, len(candidates) - 1, anchors).astype(np.int64)]
    ids = store.token_ids[i]
    lab = np.asarray(labels[off: off + n], dtype=np.int64)
    a = torch.from_numpy(candidates)
    offset = torch.arange(block)
    pos = (a[:, None] + offset[None, :]).reshape(-1)  # [R]
    tokens = torch.full((len(candidates), block), mask_id, dtype=torch.long)
    tokens[:, 0] = torch.tensor([ids[int(x)] for x in candidates])
    label_at = pos - 1  # row i's target: the target's token after position a + i - 1
    target = torch.full_like(pos, -1)
    ok = (offset.repeat(len(candidates)) > 0) & (label_at <= n - 2)
    target[ok] = torch.from_numpy(lab)[label_at[ok]]
    rows = len(pos)
    visible = torch.zeros(rows, n + rows, dtype=torch.bool)
    visible[:, :n] = torch.arange(n)[None, :] < a.repeat_interleave(block)[:, None]  # the context before the anchor
    owner = torch.arange(len(candidates)).repeat_interleave(block)
    visible[:, n:] = owner[:, None] == owner[None, :]  # its own block, both ways
    x = torch.from_numpy(np.asarray(feats[off: off + n], dtype=np.float32))
    return x, embed[tokens.reshape(-1)], pos, visible, target, offset.repeat(len(candidates))


def _step_losses(model: DFlashTrainer, lm_head: torch.Tensor, parts, decay: float, block: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted loss of one sample's pass, and per block row (1..B-1) the hits [A, B-1] and validity."""
    x, emb, pos, visible, target, place = parts
    hidden = model(x, emb, pos, visible)
    rows = target >= 0
    logits = F.linear(hidden[rows], lm_head).float()
    weights = decay ** (place[rows] - 1).float()
    loss = (F.cross_entropy(logits, target[rows], reduction="none") * weights).sum() / weights.sum()
    hits = torch.zeros_like(target, dtype=torch.bool)
    with torch.no_grad():
        hits[rows] = logits.argmax(-1) == target[rows]
    return loss, hits.view(-1, block)[:, 1:], rows.view(-1, block)[:, 1:]


def train_dflash(target, target_config, store: FeatureStore, prompt_lens: list[int], config: TrainConfig,
                 out_dir: str, progress: bool = True) -> dict:
    """Train (or resume) a DFlash model in ``out_dir``; returns its held-out agreement per block row and the mean
    accepted length of a block's chain (drafts kept up to the first miss, plus the target's own token)."""
    feats, labels, train_ids, eval_ids, ckpt_path = prepare(store, config, out_dir)
    model = build_trainer(target, target_config, config)
    vocab = target_config.vocab_size
    lm_head = target_head_rows(target, torch.arange(vocab)).float()
    embed = target.embed(torch.arange(vocab)).detach().float()
    mask_id, block = vocab - 1, config.dflash_block_size
    # each step's anchors drawn from (seed, step): a resumed run draws what an unstopped one would have
    steps = itertools.count(load_checkpoint(ckpt_path, config)["step"] if os.path.exists(ckpt_path) else 0)

    def passes(batch_ids: list[int], draw: np.random.Generator | None):
        """(loss, hits, valid) of each sample of ``batch_ids`` that has an answer to anchor at (anchors drawn with
        ``draw``, else spread evenly)."""
        for i in batch_ids:
            parts = _sample_rows(store, i, feats, labels, prompt_lens[i], embed, mask_id, block,
                                 config.dflash_anchors, draw)
            if parts is not None:
                yield _step_losses(model, lm_head, parts, config.step_decay, block)

    def run_batch(batch_ids: list[int]) -> tuple[torch.Tensor, float]:
        losses, hit, count = [], 0, 0
        for loss, hits, valid in passes(batch_ids, np.random.default_rng([config.seed, next(steps)])):
            losses.append(loss)
            hit += int(hits[:, 0][valid[:, 0]].sum())
            count += int(valid[:, 0].sum())
        if not losses:
            return torch.zeros((), requires_grad=True), float("nan")
        return torch.stack(losses).mean(), hit / max(count, 1)

    step = train_module(model, config, train_ids, store, ckpt_path, run_batch, progress)
    sums, counts = np.zeros(block - 1), np.zeros(block - 1)
    kept, anchors = 0.0, 0
    with torch.no_grad():
        for batch_ids in _batches(eval_ids, store, config.tokens_per_batch, None):
            for _, hits, valid in passes(batch_ids, None):
                sums += (hits & valid).sum(0).numpy()
                counts += valid.sum(0).numpy()
                whole = valid.all(1)  # anchors with a label for every row: their chain's kept length
                kept += float(hits[whole].int().cumprod(1).sum())
                anchors += int(whole.sum())
    return {"agreement": [float(s / max(c, 1)) for s, c in zip(sums, counts)],
            "mean_accepted_length": 1 + kept / max(anchors, 1), "eval_anchors": anchors, "step": step,
            "train_samples": len(train_ids), "eval_samples": len(eval_ids),
            "train_tokens": int(sum(store.lengths[i] for i in train_ids))}


def export_dflash(target, target_config, config: TrainConfig, out_dir: str, head_dir: str) -> str:
    """Write the trained model of ``out_dir/checkpoint.pt`` in z-lab's layout (float16 safetensors, config.json)."""
    from safetensors.torch import save_file

    model = load_trained(build_trainer, target, target_config, config, out_dir)
    os.makedirs(head_dir, exist_ok=True)
    save_file({k: v.half().contiguous() for k, v in model.state_dict().items()},
              os.path.join(head_dir, "model.safetensors"))
    with open(os.path.join(head_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(dflash_config(target_config, config), f, indent=2)
    return head_dir
