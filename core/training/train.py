"""Train a hidden-state draft head on the target's own text, with training-time test, resumable.

Objective. At position q the head reads ``e(t[q+1])`` and a feature of q and must give the token the target
would write at q + 2, the label ``argmax p_target(. | t[..q+1])`` (``features.labels[q + 1]``). Draft step j of
serving reads, instead of the target's feature, the head's own output of step j - 1 at q - 1, and attends to
the first pass's K/V up to q - j and to steps 1..j's own K/V at q - j + 1 .. q (EAGLE-3's "training-time test").
:func:`ttt_attention` computes exactly that attention densely, so training sees what drafting will see; step j's
loss (cross-entropy over the draft vocabulary) is weighted ``step_decay ** j``.

Draft vocabulary: the ``draft_vocab_size`` most frequent labels of the training text (EAGLE-3's ``d2t``); the
head's LM head is the target's rows of them, frozen (so a shipped head need not store it).

Checkpoints (``checkpoint.pt`` in the output folder, written atomically every ``checkpoint_every`` steps and at the
end): the trainable weights, the optimizer, the step; a run started again goes on from there, with the same batch
order. Held-out samples (the last ``eval_fraction``) give per-step agreement with the target and the expected
accepted length of a chain of ``eval_steps`` drafts.
"""

from __future__ import annotations

import logging
import math
import os
import random
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from specray.models.draft_head import ChainedModules, DraftHead, eagle3_aux_layers
from specray.models.draft_head_loader import target_head_rows
from specray.models.layers import apply_rotary
from specray.training.features import FeatureStore

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


@dataclass
class TrainConfig:
    method: str = "eagle3"
    draft_vocab_size: int = 8192
    # draft steps unrolled in training (ReDrafter: the beam length it learns; the MLP speculator: its stages)
    ttt_steps: int = 3
    eval_steps: int = 4  # draft steps evaluated: the chain whose accepted length is estimated
    epochs: float = 4.0
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    tokens_per_batch: int = 4096  # padded tokens per optimizer step
    step_decay: float = 0.8  # loss weight of draft step j: step_decay ** j
    eval_fraction: float = 0.05
    checkpoint_every: int = 25
    init_from_target: bool = True  # start the decoder layer from the target's last layer
    medusa_num_heads: int = 4  # Medusa: the heads trained (head k predicts the token k + 2 after a position)
    # MTP: distinct modules trained (module k reads module k - 1's output and predicts the token k + 2 after a
    # position, as DeepSeek trains them; served with num_nextn_predict_layers); 1: one module reused for every draft
    # step, trained with the training-time test
    mtp_num_modules: int = 1
    dflash_block_size: int = 8  # DFlash: the block (the sampled token and block_size - 1 drafts)
    dflash_num_layers: int = 1  # DFlash: its decoder layers
    dflash_anchors: int = 16  # DFlash: blocks trained per sample per step
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in ("eagle", "eagle3", "mtp", "medusa", "redrafter", "mlp_speculator", "dflash"):
            raise ValueError(f"method={self.method!r}: train-draft trains 'eagle', 'eagle3', 'mtp', 'medusa', "
                             "'redrafter', 'mlp_speculator' or 'dflash' heads")
        if self.mtp_num_modules > 1 and self.method != "mtp":
            raise ValueError(f"mtp_num_modules={self.mtp_num_modules} is for method='mtp' (got {self.method!r})")
        if self.dflash_block_size < 2:
            raise ValueError(f"dflash_block_size={self.dflash_block_size} must be >= 2 (the sampled token and a draft)")
        for name in ("draft_vocab_size", "ttt_steps", "eval_steps", "tokens_per_batch", "checkpoint_every",
                     "medusa_num_heads", "mtp_num_modules", "dflash_num_layers", "dflash_anchors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction={self.eval_fraction} must lie in (0, 1)")
        for name in ("epochs", "lr"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{name}={value!r} must be a number > 0")


# the options that shape what a method trains: a checkpoint made with other values is another module
_SHAPING = {"medusa": ("medusa_num_heads",), "mtp": ("mtp_num_modules",), "mlp_speculator": ("ttt_steps",),
            "dflash": ("dflash_block_size", "dflash_num_layers")}


def load_checkpoint(path: str, config: TrainConfig) -> dict:
    """``path`` (a ``checkpoint.pt``) as saved, checked to hold what ``config`` trains: a checkpoint of another
    method, or of another number of heads, modules, stages or layers, is a ValueError rather than a resumption."""
    state = torch.load(path, weights_only=False)
    saved = state.get("config") or {}
    for name in ("method", *_SHAPING.get(config.method, ())):
        if name in saved and saved[name] != getattr(config, name):
            option = "--" + name.replace("_", "-")
            raise ValueError(f"{path} was trained with {name}={saved[name]!r}, not {getattr(config, name)!r}: "
                             f"run with {option} {saved[name]} to go on with it, or give another --out (or "
                             "delete its train/ folder) to train anew")
    return state


def load_trained(build, target, target_config, config: TrainConfig, out_dir: str) -> torch.nn.Module:
    """The module ``build(target, target_config, config)`` makes, with the weights trained in
    ``out_dir/checkpoint.pt`` (what the export stage writes)."""
    state = load_checkpoint(os.path.join(out_dir, CHECKPOINT), config)
    module = build(target, target_config, config)
    module.load_state_dict(state["head"])
    return module


def feature_layers(method: str, num_target_layers: int) -> list[int]:
    """The target layers a ``method`` head reads the input residual stream of ([]: the last hidden state): EAGLE-3's
    three, which DFlash reads too (the outputs of the layers before them)."""
    return list(eagle3_aux_layers(num_target_layers)) if method in ("eagle3", "dflash") else []


def head_config(target_config, method: str, draft_vocab_size: int) -> dict:
    """The head's config.json: one layer of the target's shape (public EAGLE-3 / EAGLE layout)."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size", "hidden_act", "rope_parameters", "rope_theta")
    config = {k: getattr(target_config, k) for k in keys if getattr(target_config, k, None) is not None}
    config.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False)
    if method == "eagle3":
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab_size,
                      target_hidden_size=target_config.hidden_size,
                      eagle_config={"eagle_aux_hidden_state_layer_ids":
                                    feature_layers(method, target_config.num_hidden_layers)})
    else:
        config.update(architectures=["EagleLlamaForCausalLM" if method == "eagle" else "LlamaForCausalLM"])
    return config


def draft_vocabulary(labels: np.ndarray, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent labels, ascending (fewer when the text uses fewer)."""
    counts = np.bincount(labels.astype(np.int64), minlength=vocab_size)
    top = np.argsort(-counts, kind="stable")[: min(size, int((counts > 0).sum()))]
    return torch.from_numpy(np.sort(top)).long()


def build_head(target, target_config, config: TrainConfig, vocab_ids: torch.Tensor) -> DraftHead:
    """A fresh trainable head (fp32) for ``target``; its LM head is the target's rows of ``vocab_ids`` (frozen)."""
    from transformers import LlamaConfig

    cfg = head_config(target_config, config.method, len(vocab_ids))
    llama = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "eagle_config",
                                                                        "draft_vocab_size", "target_hidden_size")})
    torch.manual_seed(config.seed)
    kwargs = {}
    if config.method == "eagle3":
        kwargs = dict(aux_layers=feature_layers("eagle3", target_config.num_hidden_layers),
                      draft_vocab_size=len(vocab_ids), target_hidden_size=target_config.hidden_size)
    head = DraftHead(config.method, llama, target, **kwargs)
    for name, p in head.named_parameters():
        p.requires_grad_(not name.startswith("lm_head."))  # the model layers build frozen (inference) parameters
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
        elif "norm" in name:
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.zeros_(p)
    if head.lm_head is not None:
        head.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids)))
        head.lm_head.weight.data.copy_(target_head_rows(target, vocab_ids))
    if config.init_from_target:
        _init_from_target_layer(head, target)
    return head


def build_draft(target, target_config, config: TrainConfig, vocab_ids: torch.Tensor) -> DraftHead | ChainedModules:
    """:func:`build_head`, or for MTP with ``mtp_num_modules`` > 1 that many fresh modules, chained (each seeded
    apart)."""
    if config.mtp_num_modules == 1:
        return build_head(target, target_config, config, vocab_ids)
    return ChainedModules([build_head(target, target_config, replace(config, seed=config.seed + k), vocab_ids)
                           for k in range(config.mtp_num_modules)])


def _init_from_target_layer(head: DraftHead, target) -> None:
    """Start the head's layer from the target's last decoder layer (its hidden-feature half, for EAGLE-3's 2H
    qkv), and its final norm from the target's."""
    src = dict(target.named_parameters())
    last = len(target.model.layers) - 1 if hasattr(target, "model") else None
    if last is None:
        return
    layer = head.layers[0]
    own = dict(layer.named_parameters())
    for name, p in own.items():
        t = src.get(f"model.layers.{last}.{name}")
        if t is None or t.data is None:
            continue
        with torch.no_grad():
            if t.shape == p.shape:
                p.copy_(t)
            elif name == "self_attn.qkv_proj.weight" and p.shape[1] == 2 * t.shape[1]:
                p[:, t.shape[1]:].copy_(t)  # the feature half; the embedding half stays small and random
    if layer.hidden_norm is not None and f"model.layers.{last}.input_layernorm.weight" in src:
        with torch.no_grad():
            layer.hidden_norm.weight.copy_(src[f"model.layers.{last}.input_layernorm.weight"])
    if head.norm is not None and "model.norm.weight" in src:
        with torch.no_grad():
            head.norm.weight.copy_(src["model.norm.weight"])


# ---------------------------------------------------------------------------------------------- the unrolled head


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], valid: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Attention of draft step j = len(keys) - 1 as serving runs it. q [B, T, Hq, D]; keys/values: per step i <= j,
    [B, T, Hkv, D] at every position; valid [B, T] (padding False). Row q attends step 0's keys at positions
    <= q - j and step i's key at q - j + i (i = 1..j). -> [B, T, Hq * D]"""
    b, t, hq, d = q.shape
    j = len(keys) - 1
    groups = hq // keys[0].shape[2]
    qh = q.transpose(1, 2)  # [B, Hq, T, D]

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(groups, dim=2).transpose(1, 2)  # [B, Hq, T, D]

    pos = torch.arange(t, device=q.device)
    allowed = (pos[None, :] <= pos[:, None] - j)[None, None] & valid[:, None, None, :]  # [B, 1, T, T]
    scores = [(qh @ heads(keys[0]).transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))]
    shifted_values = []
    for i in range(1, j + 1):
        shift = j - i  # step i's key for row q sits at q - shift
        k_i = F.pad(heads(keys[i]), (0, 0, shift, 0))[:, :, :t]
        v_i = F.pad(heads(values[i]), (0, 0, shift, 0))[:, :, :t]
        s = (qh * k_i).sum(-1, keepdim=True) * scale  # [B, Hq, T, 1]
        scores.append(s.masked_fill((pos < shift)[None, None, :, None], float("-inf")))
        shifted_values.append(v_i)
    weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = weights[..., :t] @ heads(values[0])
    for i, v_i in enumerate(shifted_values):
        out = out + weights[..., t + i : t + i + 1] * v_i
    return out.transpose(1, 2).reshape(b, t, hq * d)


def unroll(head: DraftHead | ChainedModules, next_ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor,
           steps: int) -> list[torch.Tensor]:
    """The head's normed output [B, T, H] of each of ``steps`` draft steps, teacher-forced on the tokens.
    next_ids [B, T]: t[q + 1]; features [B, T, F*H]: the target's (EAGLE-3: the three layers' residual streams).
    Distinct MTP modules: :func:`unroll_modules` (one step per module)."""
    if isinstance(head, ChainedModules):
        return unroll_modules(head, next_ids, features, valid)
    return [hidden for _, hidden in _unrolled(head, next_ids, features, valid, steps)]


def unroll_modules(modules: ChainedModules, next_ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor
                   ) -> list[torch.Tensor]:
    """Distinct MTP modules teacher-forced, as DeepSeek trains them and serving runs them over committed positions:
    module k at q reads t[q + 1 + k] and module k - 1's output at q (module 0: the target's feature), attending
    causally to its own K/V. Module k's normed output is returned placed at q + k, where step k of
    :func:`unroll` puts the draft made k positions after its root (so the same labels and chain estimate apply)."""
    t = next_ids.shape[1]
    feature, outs = features, []
    for k, module in enumerate(modules.heads):
        ids = F.pad(next_ids[:, k:], (0, k))  # t[q + 1 + k]; past the end 0 (those rows have no label)
        [(feature, hidden)] = _unrolled(module, ids, feature, valid, 1)
        outs.append(F.pad(hidden, (0, 0, k, 0))[:, :t])
    return outs


def _unrolled(head: DraftHead, next_ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor, steps: int
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`unroll`'s steps, each as (feedback, normed) [B, T, H]."""
    b, t = next_ids.shape
    layer = head.layers[0]
    attn = layer.self_attn
    with torch.no_grad():
        e = head.target.embed(next_ids.reshape(-1)).view(b, t, -1).float()
    if head.layout.aux_features:
        feature = head.fc(features)
    else:
        feature = features
    cos, sin = head.rotary_emb(torch.arange(t, device=next_ids.device), e.dtype)  # [T, 1, D/2]
    keys, values, outs = [], [], []
    for _ in range(steps):
        x, residual = head.fuse(e, feature)
        qkv = attn.qkv_proj(x.reshape(b * t, -1)).view(b, t, -1)
        q = qkv[..., : attn.qkv_proj.q_size].view(b, t, attn.num_heads, attn.head_dim)
        k = qkv[..., attn.qkv_proj.q_size : attn.qkv_proj.q_size + attn.qkv_proj.kv_size]
        v = qkv[..., attn.qkv_proj.q_size + attn.qkv_proj.kv_size :].view(b, t, attn.num_kv_heads, attn.head_dim)
        k = k.view(b, t, attn.num_kv_heads, attn.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys.append(k)
        values.append(v)
        a = ttt_attention(q, keys, values, valid, attn.attn.scale)
        out = layer.after_attention(attn.o_proj(a.reshape(b * t, -1)), residual.reshape(b * t, -1)).view(b, t, -1)
        feedback, hidden = head.finish(out)
        outs.append((feedback, hidden))
        feature = F.pad(feedback, (0, 0, 1, 0))[:, :t]  # step j + 1 at q reads step j's output at q - 1
    return outs


# ---------------------------------------------------------------------------------------------- data


@dataclass
class _Batch:
    next_ids: torch.Tensor  # [B, T]
    features: torch.Tensor  # [B, T, F*H]
    labels: torch.Tensor  # [B, T]: the target's label for the head at q (its argmax at q + 1), -1: none
    valid: torch.Tensor  # [B, T]
    answer: torch.Tensor  # [B, T]: q drafts inside the answer (q + 1 >= the prompt's length)


def _batches(indices: list[int], store: FeatureStore, tokens_per_batch: int, rng: random.Random | None
             ) -> list[list[int]]:
    order = sorted(indices, key=lambda i: store.lengths[i])
    batches, current, longest = [], [], 0
    for i in order:
        longest_next = max(longest, store.lengths[i])
        if current and longest_next * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current, longest_next = [], store.lengths[i]
        current.append(i)
        longest = longest_next
    if current:
        batches.append(current)
    if rng is not None:
        rng.shuffle(batches)
    return batches


def _load(batch: list[int], store: FeatureStore, feats: np.ndarray, labels: np.ndarray, prompt_lens: list[int]
          ) -> _Batch:
    t = max(store.lengths[i] for i in batch) - 1  # positions q = 0 .. n - 2 read t[q + 1]
    b = len(batch)
    next_ids = torch.zeros(b, t, dtype=torch.long)
    features = torch.zeros(b, t, store.width)
    lab = torch.full((b, t), -1, dtype=torch.long)
    valid = torch.zeros(b, t, dtype=torch.bool)
    answer = torch.zeros(b, t, dtype=torch.bool)
    for r, i in enumerate(batch):
        n, off = store.lengths[i], store.offsets[i]
        ids = store.token_ids[i]
        next_ids[r, : n - 1] = torch.tensor(ids[1:n])
        features[r, : n - 1] = torch.from_numpy(np.asarray(feats[off : off + n - 1], dtype=np.float32))
        valid[r, : n - 1] = True
        lab[r, : n - 2] = torch.from_numpy(np.asarray(labels[off + 1 : off + n - 1], dtype=np.int64))
        answer[r, max(prompt_lens[i] - 1, 0) : n - 1] = True
    return _Batch(next_ids, features, lab, valid, answer)


# ---------------------------------------------------------------------------------------------- training


def _losses(head: DraftHead | ChainedModules, batch: _Batch, steps: int, t2d: torch.Tensor, decay: float
            ) -> tuple[torch.Tensor, list[float], list[torch.Tensor]]:
    """The weighted loss, per-step agreement on the answer positions, and per step a [B, T] bool of where the
    head's draft equals the target's label (for the chain estimate). Distinct MTP modules: a step per module."""
    outs = unroll(head, batch.next_ids, batch.features, batch.valid, steps)
    if isinstance(head, ChainedModules):
        head = head.heads[0]  # every module's logits: the target's LM head
    loss = torch.zeros(())
    accs, correct = [], []
    t = batch.next_ids.shape[1]
    pos = torch.arange(t)
    for j, hidden in enumerate(outs):
        rows = (batch.labels >= 0) & (pos[None, :] >= j)
        logits = head.lm_head(hidden) if head.lm_head is not None else head.target.compute_logits(
            hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:2], -1)
        # the label's class: its place in the draft vocabulary (EAGLE-3's own LM head), else the target id itself
        target_ids = batch.labels.clamp(min=0) if head.lm_head is None else t2d[batch.labels.clamp(min=0)]
        in_vocab = rows & (target_ids >= 0)
        if in_vocab.any():
            loss = loss + decay ** j * F.cross_entropy(logits[in_vocab].float(), target_ids[in_vocab])
        with torch.no_grad():
            hit = (head.to_target_ids(logits.argmax(-1)) == batch.labels) & rows
            counted = rows & batch.answer
            accs.append(float(hit[counted].float().mean()) if counted.any() else float("nan"))
            correct.append(hit)
    return loss, accs, correct


def chain_accepted(correct: list[torch.Tensor], batch: _Batch) -> tuple[float, int]:
    """Sum over answer positions R of the drafts a chain from R keeps (d1 = step 0 at R, d2 = step 1 at R + 1,
    ...: all right up to the first miss), and the count of positions."""
    t = batch.next_ids.shape[1]
    alive = batch.answer & (batch.labels >= 0)
    kept = torch.zeros_like(batch.labels, dtype=torch.float32)
    run = torch.ones_like(alive)
    for j, hits in enumerate(correct):
        run = run & F.pad(hits, (0, j), value=False)[:, j : j + t]  # step j's draft made from R sits at R + j
        kept = kept + run.float()
    return float(kept[alive].sum()), int(alive.sum())


def prepare(store: FeatureStore, config: TrainConfig, out_dir: str):
    """What every method's training starts from: ``out_dir`` made, the seed set, the features and labels, the
    train and held-out sample ids (the last ``eval_fraction`` of the samples), and the checkpoint's path."""
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(config.seed)
    n = len(store.lengths)
    n_eval = max(1, int(n * config.eval_fraction))
    return (store.features(), store.labels(), list(range(n - n_eval)), list(range(n - n_eval, n)),
            os.path.join(out_dir, CHECKPOINT))


def train(target, target_config, store: FeatureStore, prompt_lens: list[int], config: TrainConfig, out_dir: str,
          progress: bool = True) -> dict:
    """Train (or resume) a head in ``out_dir``; returns the held-out metrics. The trained head is
    ``out_dir/checkpoint.pt``; :func:`export` writes it in the public layout."""
    feats, labels, train_ids, eval_ids, ckpt_path = prepare(store, config, out_dir)
    state = load_checkpoint(ckpt_path, config) if os.path.exists(ckpt_path) else None
    if state is not None:
        vocab_ids = state["vocab_ids"]
    else:
        train_tokens = np.concatenate([np.asarray(labels[store.offsets[i] : store.offsets[i] + store.lengths[i]])
                                       for i in train_ids])
        vocab_ids = draft_vocabulary(train_tokens, config.draft_vocab_size, target_config.vocab_size)
    head = build_draft(target, target_config, config, vocab_ids)
    t2d = torch.full((target_config.vocab_size,), -1, dtype=torch.long)
    t2d[vocab_ids] = torch.arange(len(vocab_ids))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    step = 0
    if state is not None:
        head.load_state_dict(state["head"], strict=False)
        opt.load_state_dict(state["opt"])
        step = state["step"]
        logger.info("resuming %s at step %d", ckpt_path, step)
    head.train()

    def run_batch(batch_ids: list[int]) -> tuple[torch.Tensor, float]:
        loss, accs, _ = _losses(head, _load(batch_ids, store, feats, labels, prompt_lens), config.ttt_steps, t2d,
                                config.step_decay)
        return loss, accs[0]

    step = optimize(params, opt, config, train_ids, store, step, run_batch,
                    lambda s: _save(ckpt_path, head, opt, s, vocab_ids, config), progress)
    metrics = evaluate(head, store, eval_ids, feats, labels, prompt_lens, config, t2d)
    metrics.update(step=step, train_samples=len(train_ids), eval_samples=len(eval_ids),
                   train_tokens=int(sum(store.lengths[i] for i in train_ids)))
    if getattr(head, "lm_head", None) is not None:  # EAGLE-3's own vocabulary (the others: the target's whole one)
        metrics["draft_vocab_size"] = len(vocab_ids)
    return metrics


def optimize(params: list[torch.Tensor], opt, config: TrainConfig, train_ids: list[int], store: FeatureStore,
             step: int, run_batch, save, progress: bool = True) -> int:
    """The training loop every method shares: epochs of token-budgeted batches (shuffled per epoch by seed), linear
    warmup then cosine decay, gradient clipping, a checkpoint every ``checkpoint_every`` steps and at the end,
    resumable from ``step``. ``run_batch(batch_ids) -> (loss, first agreement)``; ``save(step)``. Returns the step
    reached."""
    per_epoch = len(_batches(train_ids, store, config.tokens_per_batch, None))
    total_steps = max(1, int(per_epoch * config.epochs))

    def lr_at(s: int) -> float:
        if s < config.warmup_steps:
            return config.lr * (s + 1) / config.warmup_steps
        frac = (s - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
        return config.lr * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=step, desc=f"train-draft {config.method}", unit="step")
    while step < total_steps:
        epoch, within = divmod(step, per_epoch)
        order = _batches(train_ids, store, config.tokens_per_batch, random.Random(config.seed * 7919 + epoch))
        for batch_ids in order[within:]:
            if step >= total_steps:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            loss, acc0 = run_batch(batch_ids)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc0=f"{acc0:.3f}")
            if step % config.checkpoint_every == 0 or step == total_steps:
                save(step)
    if bar is not None:
        bar.close()
    return step


@torch.no_grad()
def evaluate(head: DraftHead, store: FeatureStore, eval_ids: list[int], feats, labels, prompt_lens, config: TrainConfig,
             t2d: torch.Tensor) -> dict:
    """Held-out agreement with the target per draft step (answer positions, teacher-forced: step j's accuracy
    given steps < j right), and a chain's mean accepted length (drafts kept + the target's own token)."""
    head.eval()
    steps = getattr(head, "num_modules", config.eval_steps)  # distinct MTP modules: a chain of one draft each
    sums = [0.0] * steps
    counts = [0] * steps
    kept, positions = 0.0, 0
    for batch_ids in _batches(eval_ids, store, config.tokens_per_batch, None):
        batch = _load(batch_ids, store, feats, labels, prompt_lens)
        _, accs, correct = _losses(head, batch, steps, t2d, config.step_decay)
        t = batch.next_ids.shape[1]
        pos = torch.arange(t)
        for j in range(steps):
            rows = (batch.labels >= 0) & (pos[None, :] >= j) & batch.answer
            sums[j] += float(correct[j][rows].float().sum())
            counts[j] += int(rows.sum())
        k, c = chain_accepted(correct, batch)
        kept += k
        positions += c
    head.train()
    return {"agreement": [s / max(c, 1) for s, c in zip(sums, counts)],
            "mean_accepted_length": 1 + kept / max(positions, 1), "eval_positions": positions}


def _save(path: str, head: DraftHead | ChainedModules, opt, step: int, vocab_ids: torch.Tensor,
          config: TrainConfig) -> None:
    trainable = {k: v for k, v in head.state_dict().items() if not k.startswith("lm_head") and "rotary" not in k}
    tmp = path + ".tmp"
    torch.save({"head": trainable, "opt": opt.state_dict(), "step": step, "vocab_ids": vocab_ids,
                "config": asdict(config)}, tmp)
    os.replace(tmp, path)


def export(target, target_config, config: TrainConfig, out_dir: str, head_dir: str) -> str:
    """Write the trained head of ``out_dir/checkpoint.pt`` as a public-layout checkpoint folder (float16, without
    the LM head rows it shares with the target)."""
    from specray.models.draft_head_loader import save_draft_head

    state = load_checkpoint(os.path.join(out_dir, CHECKPOINT), config)
    head = build_draft(target, target_config, config, state["vocab_ids"])
    head.load_state_dict(state["head"], strict=False)
    card = head_config(target_config, config.method, len(state["vocab_ids"]))
    if config.method == "mtp":
        card["num_nextn_predict_layers"] = config.mtp_num_modules  # (serving reads the modules from the weights)
    save_draft_head(head, head_dir, card, with_lm_head=False)
    return head_dir


def train_module(module: torch.nn.Module, config: TrainConfig, train_ids: list[int], store: FeatureStore,
                 ckpt_path: str, run_batch, progress: bool = True) -> int:
    """A whole trainable module (Medusa's heads, a recurrent drafter) through :func:`optimize`: AdamW over all its
    parameters, resumed from ``ckpt_path`` when it exists (weights, optimizer, step), checkpointed there atomically.
    Returns the step reached; the module is left in eval mode."""
    params = list(module.parameters())
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    step = 0
    if os.path.exists(ckpt_path):
        state = load_checkpoint(ckpt_path, config)
        module.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        logger.info("resuming %s at step %d", ckpt_path, step)
    module.train()

    def save(s: int) -> None:
        tmp = ckpt_path + ".tmp"
        torch.save({"head": module.state_dict(), "opt": opt.state_dict(), "step": s, "config": asdict(config)}, tmp)
        os.replace(tmp, ckpt_path)

    step = optimize(params, opt, config, train_ids, store, step, run_batch, save, progress)
    module.eval()
    return step
