"""Draft heads that read the target's hidden states: EAGLE-1, EAGLE-3 and DeepSeek-style MTP, one module.

A head is one decoder layer of the target's family that, at position p, reads the next token's embedding
``e(t[p+1])`` and a feature of position p, and predicts the token after: ``t[p+2]``. Its first pass runs over the
positions the target just committed, with the target's own features; each later draft step runs one position
further with the feature the head itself produced (``feedback``) and the token it just drafted.

What differs between the papers is configuration (:class:`HeadLayout`), not a class each:

============  =====================================  ====================================  ==========================
layout        feature of a target position           fusion with the token's embedding      logits
============  =====================================  ====================================  ==========================
``eagle``     the target's last hidden state         ``fc(cat(e, h))`` into the layer,      the target's LM head on
              (after its final norm)                 which has no input norm                the layer's output
``eagle3``    ``fc(cat(aux))``: the residual stream  the layer's qkv reads                  ``lm_head(norm(out))`` over
              entering three target layers           ``cat(input_layernorm(e),              a draft vocabulary, mapped
              (2, L/2, L-3)                          hidden_norm(h))`` (2H wide)            to target ids by ``d2t``
``mtp``       the target's last hidden state         ``eh_proj(cat(enorm(e), hnorm(h)))``   the target's LM head on
                                                     into a full block                      ``norm(out)``
============  =====================================  ====================================  ==========================

DeepSeek-V3's MTP with K distinct modules (``num_nextn_predict_layers``) is :class:`ChainedModules`: K ``mtp``
heads where module k at position p reads module k-1's output at p (the target's feature for module 0) and the
token k + 1 after ``t[p+1]``, as the paper trains them and transformers' ``MtpModel`` runs them; one module reused
for every draft step (TensorRT-LLM's "MTP-Eagle") is the plain ``mtp`` head.

The head's attention caches K/V per target position in a paged cache laid out on the target's block tables
(:meth:`kv_cache_specs`; the runner allocates it beside the target's), so rewind and preemption need nothing of
their own. The embedding and (except EAGLE-3's) the LM head are the target's, read through its
:class:`~specray.models.interface.CausalLM` interface, never copied.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.kv_cache import KVCache, KVCacheSpec
from specray.models.layers import (ColumnParallelLinear, ParallelLMHead, RMSNorm, RotaryEmbedding, materialize,
                                   rope_parameters, rotary_dim, splits_heads)
from specray.models.llama import (_STACKED, LlamaAttention, LlamaMLP, _map_name, checkpoint_names, expected_keys,
                                  load_param)
from specray.models.moe import EXPERT_PARAMS, SparseMoE, is_expert_tensor
from specray.parallel import TPGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadLayout:
    """How one kind of head reads the target (see the module docstring's table)."""

    name: str
    aux_features: bool  # the target's residual stream at three layers (EAGLE-3), else its last hidden state
    fusion: str  # "fc" (EAGLE-1), "split" (EAGLE-3), "eh_proj" (MTP)
    final_norm: bool  # a norm before the LM head
    own_lm_head: bool  # an LM head over a draft vocabulary of its own


LAYOUTS = {
    "eagle": HeadLayout("eagle", aux_features=False, fusion="fc", final_norm=False, own_lm_head=False),
    "eagle3": HeadLayout("eagle3", aux_features=True, fusion="split", final_norm=True, own_lm_head=True),
    "mtp": HeadLayout("mtp", aux_features=False, fusion="eh_proj", final_norm=True, own_lm_head=False),
}


def eagle3_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers whose input residual stream EAGLE-3 reads (as the EAGLE repository and vLLM do)."""
    if num_target_layers < 3:
        raise ValueError(f"num_hidden_layers={num_target_layers}: EAGLE-3's features (which DFlash reads too) are the "
                         "target's layers 2, L // 2 and L - 3, so the target needs 3 layers or more; for this one, "
                         "use a method that reads the last hidden state (eagle, mtp, medusa)")
    return (2, num_target_layers // 2, num_target_layers - 3)


class ReadsTarget(nn.Module):
    """A drafter's model that reads a target it does not own: the target sits in ``_target``, a tuple, so it is not a
    submodule and its weights are never the drafter's; the drafter's own weights give its dtype and device."""

    _target: tuple

    @property
    def target(self):
        return self._target[0]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device


class HeadLayer(nn.Module):
    """One decoder layer of the Llama family whose attention reads ``input_size`` features (2H for EAGLE-3); or,
    given ``parts``, the target family's own attention and MLP (an MTP module's block: DeepSeek's latent attention
    and experts; Qwen3.5's gated attention), with ``norm`` the family's RMSNorm (Qwen3.5's ``1 + w``), which
    takes a residual as :class:`RMSNorm` does."""

    def __init__(self, config, tp: TPGroup, input_size: int, input_norm: bool, hidden_norm: bool,
                 parts: tuple[nn.Module, nn.Module] | None = None, norm: type[nn.Module] = RMSNorm):
        super().__init__()
        h, eps = config.hidden_size, norm_eps(config)
        self.input_layernorm = norm(h, eps) if input_norm else None
        self.hidden_norm = norm(h, eps) if hidden_norm else None
        self.self_attn = LlamaAttention(config, tp, 0, input_size=input_size) if parts is None else parts[0]
        self.post_attention_layernorm = norm(h, eps)
        self.mlp = LlamaMLP(config, tp) if parts is None else parts[1]

    def forward(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: the attention's input [T, input_size]; residual [T, H] -> the layer's output [T, H] (pre-norm)
        return self.after_attention(self.self_attn(x, cos, sin, meta), residual)

    def after_attention(self, a: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # a: the attention's output after o_proj [T, H] -> the layer's output [T, H] (pre-norm)
        x, residual = self.post_attention_layernorm(a, residual)
        return self.mlp(x) + residual


class DraftHead(ReadsTarget):
    """A hidden-state draft head over ``target`` (see the module docstring). ``config`` is the head's own
    HF-style config (hidden size, heads, MLP width, RoPE), ``draft_vocab_size`` EAGLE-3's draft vocabulary.
    Build it under the target's device and dtype; it holds no reference to the target's parameters."""

    def __init__(self, layout: HeadLayout | str, config, target, *, aux_layers: Sequence[int] = (),
                 draft_vocab_size: int | None = None, fc_bias: bool = False, feedback_normed: bool = False,
                 target_hidden_size: int | None = None, tp: TPGroup | None = None, expert_parallel: bool = False):
        super().__init__()
        self.layout = LAYOUTS[layout] if isinstance(layout, str) else layout
        self.config = config
        self._target = (target,)  # a tuple: not a submodule, so its weights are never ours
        h = config.hidden_size
        th = target_hidden_size or h
        self.hidden_size = h
        self.aux_layers = tuple(aux_layers) if self.layout.aux_features else ()
        if self.layout.aux_features and len(self.aux_layers) == 0:
            raise ValueError(f"a {self.layout.name} head reads target layers: give aux_layers")
        family = _family(config)  # the model class of the config's architecture, None for a plain head config
        feature = getattr(family, "mtp_feature_layers", None) if self.layout.fusion == "eh_proj" else None
        if feature is not None:  # an MTP layer reading another stream than the last hidden state (ERNIE 4.5's)
            self.aux_layers = tuple(feature(config))
        self.feedback_normed = feedback_normed  # MTP as transformers runs it: the normed output feeds the next step
        # the ranks the layer is split over as a target layer is (heads column-wise, o_proj/down_proj row-wise, the
        # draft vocabulary's LM head by rows), reading the target's own split embedding and LM head; one rank: the
        # head whole (on the driver rank of a split target, reading them gathered whole)
        self.tp = tp = tp or TPGroup.single()
        whole = TPGroup.single()  # the fusion's projection and the norms: replicated (they are H x 2H at most)
        check_split(self.layout.name, config.num_attention_heads, getattr(config, "num_key_value_heads", None),
                    tp.size)
        self.stacked = getattr(family, "stacked", _STACKED)  # checkpoint names its parameters merge
        fusion = self.layout.fusion
        # an MTP head's norms are its family's (Qwen3.5's scale by 1 + w); EAGLE heads' are Llama's
        norm = getattr(family, "mtp_norm", RMSNorm) if fusion == "eh_proj" else RMSNorm
        if fusion == "fc":
            self.fc = ColumnParallelLinear(2 * h, h, whole, bias=fc_bias)
            self.layers = nn.ModuleList([HeadLayer(config, tp, h, input_norm=False, hidden_norm=False)])
        elif fusion == "eh_proj":
            self.enorm = norm(h, norm_eps(config))
            self.hnorm = norm(h, norm_eps(config))
            self.eh_proj = ColumnParallelLinear(2 * h, h, whole)
            parts = getattr(family, "mtp_layer_parts", None)  # the target family's block (DeepSeek's)
            self.layers = nn.ModuleList([HeadLayer(config, tp, h, input_norm=True, hidden_norm=False,
                                                   parts=None if parts is None else
                                                   parts(config, tp, expert_parallel), norm=norm)])
        elif fusion == "split":
            self.fc = ColumnParallelLinear(len(self.aux_layers) * th, h, whole, bias=fc_bias)
            self.layers = nn.ModuleList([HeadLayer(config, tp, 2 * h, input_norm=True, hidden_norm=True)])
        else:
            raise ValueError(f"unknown head fusion {fusion!r}")
        self.norm = norm(h, norm_eps(config)) if self.layout.final_norm else None
        self.target_vocab_size = target.vocab_size
        if self.layout.own_lm_head:
            vd = draft_vocab_size or target.vocab_size
            self.draft_vocab_size = vd
            self.lm_head = ParallelLMHead(vd, h, tp)  # rows split over the ranks, logits all-gathered
            # draft id d is target id d + d2t[d] (the EAGLE repository's buffer)
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        else:
            self.draft_vocab_size = target.vocab_size
            self.lm_head = None
        # the head's layer rotates what its family's layers rotate: GLM-4.5's MTP block (and any head whose config
        # has a partial_rotary_factor) the first part of each head only, as the target's stack does
        rope = rope_parameters(config, getattr(family, "mtp_layer_type", None) if fusion == "eh_proj" else None,
                               partial=True)  # an MTP layer of a stack with a RoPE per kind of layer: its kind's
        head_dim = config.head_dim if getattr(config, "head_dim", None) else h // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(rotary_dim(head_dim, rope), rope, config.max_position_embeddings)
        self.kv_cache_bound = False

    # ------------------------------------------------------------------------------------------ reading the target

    def target_features(self, hidden: torch.Tensor, aux: Sequence[torch.Tensor]) -> torch.Tensor:
        """The feature of each target position the head reads: [T, H] from the target's last hidden states [T, H]
        (or, EAGLE-3, its residual stream at ``aux_layers``, each [T, H_target], fused by ``fc``)."""
        if self.layout.aux_features:
            return self.fc(torch.cat(list(aux), dim=-1))
        return aux[0] if self.aux_layers else hidden  # (an MTP layer reading its family's stream)

    # ------------------------------------------------------------------------------------------ forward

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] (the token after each position), features [T, H] (the target's, or the head's own
        feedback) -> (feedback [T, H] for the next draft step, hidden [T, H] for :meth:`draft_logits`)."""
        if not self.kv_cache_bound:
            raise ValueError("the draft head's KV cache is not allocated: allocate_kv_cache(head, ...) first")
        # (a row whose token is an image's takes the target's embedding of it: ``meta.input_embeds``)
        x, residual = self.fuse(meta.with_input_embeds(self.target.embed(input_ids).to(features.dtype)), features)
        self.rotary_emb.ensure(meta.max_position + 1)
        if meta.rope_positions is not None:  # multimodal RoPE (a config's mrope_section): the target's ids
            cos, sin = self.rotary_emb.multimodal(meta.rope_positions, x.dtype)
        else:
            cos, sin = self.rotary_emb(meta.positions, x.dtype)
        return self.finish(self.layers[0](x, residual, cos, sin, meta))

    def fuse(self, e: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings and features [..., H] -> (the layer's attention input, its residual)."""
        layer = self.layers[0]
        fusion = self.layout.fusion
        if fusion == "fc":
            residual = self.fc(torch.cat((e, features), dim=-1))
            return residual, residual
        if fusion == "eh_proj":
            residual = self.eh_proj(torch.cat((self.enorm(e), self.hnorm(features)), dim=-1))
            return layer.input_layernorm(residual), residual
        return torch.cat((layer.input_layernorm(e), layer.hidden_norm(features)), dim=-1), features

    def finish(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output -> (feedback for the next draft step, hidden for :meth:`draft_logits`)."""
        hidden = out if self.norm is None else self.norm(out)
        return (hidden if self.feedback_normed else out), hidden

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V_draft] float32: over the draft vocabulary (EAGLE-3's own head; map its
        argmax with :meth:`to_target_ids`), else the target's full vocabulary."""
        if self.lm_head is None:
            return self.target.compute_logits(hidden)
        return self.lm_head(hidden).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (identity without a draft vocabulary)."""
        if self.lm_head is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def full_vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V_target] float32, -inf outside the draft vocabulary (for tests; drafting
        reads :meth:`draft_logits`)."""
        return self.full_vocab(self.draft_logits(hidden))

    def full_vocab(self, values: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """Rows over the draft vocabulary [..., V_draft] (logits; or probabilities with ``fill`` 0) -> over the
        target's [..., V_target], ``fill`` outside the draft vocabulary."""
        if self.lm_head is None:
            return values
        full = values.new_full((*values.shape[:-1], self.target_vocab_size), fill)
        ids = self.to_target_ids(torch.arange(self.draft_vocab_size, device=values.device))
        return full.index_copy_(-1, ids, values)

    # ------------------------------------------------------------------------------------------ KV cache

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [layer.self_attn.attn.kv_spec for layer in self.layers]

    def bind_kv_cache(self, cache: KVCache) -> None:
        assert cache.specs == self.kv_cache_specs(), "the cache was allocated for another model's specs"
        self.bind_layers([cache.layer(i) for i in range(len(self.layers))], cache.block_size, cache.fp8)

    def bind_layers(self, layers: list[torch.Tensor], block_size: int, fp8: torch.dtype | None = None) -> None:
        """Bind each of this head's layers to its part of a cache (one tensor per layer; ``fp8``: stored in that
        FP8 format)."""
        for layer, tensor in zip(self.layers, layers, strict=True):
            layer.self_attn.attn.bind_cache(tensor, block_size, fp8)
        self.kv_cache_bound = True

    # ------------------------------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Tensors named as this module names them (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ...,
        ``d2t``); :func:`specray.models.draft_head_loader.load_draft_head` maps the public layouts to these."""
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        moe = {f"layers.{i}.mlp.": layer.mlp for i, layer in enumerate(self.layers) if isinstance(layer.mlp, SparseMoE)}
        for name, tensor in weights:
            if moe and is_expert_tensor("." + name):
                prefix = name[: name.index("mlp.") + len("mlp.")]
                loaded.update(prefix + key for key in moe[prefix].load_expert_tensor("." + name, tensor))
                continue
            target, shard = _map_name(name, self.stacked)
            if target in buffers and target == "d2t":
                value = materialize(tensor).to(torch.long)
                if value.shape != buffers[target].shape:
                    raise ValueError(f"d2t has {tuple(value.shape)} entries but the head's draft vocabulary is "
                                     f"{self.draft_vocab_size}")
                buffers[target].copy_(value)
                loaded.add(target)
                continue
            param = params.get(target)
            if param is None:
                raise ValueError(f"draft head checkpoint tensor {name!r} has no place in a {self.layout.name} head")
            loaded.add(load_param(param, target, tensor, shard))
        expected = expected_keys(n for n in params if not n.endswith(EXPERT_PARAMS))
        for prefix, block in moe.items():
            expected.update(prefix + key for key in block.expected_keys())
        if self.lm_head is not None:
            expected.add("d2t")
        missing = checkpoint_names(expected - loaded, self.stacked)
        if missing:
            raise ValueError(f"the {self.layout.name} head checkpoint is missing {len(missing)} weights, e.g. "
                             f"{missing[:5]}")

    def state_for_saving(self) -> dict[str, torch.Tensor]:
        """This head's weights under public names (q/k/v and gate/up split), for safetensors."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.state_dict().items():
            if name.endswith("inv_freq") or "rotary_emb" in name:
                continue
            out.update(_split_merged(self, name, tensor.detach()))
        return out


class ChainedModules(nn.Module):
    """DeepSeek-V3's multi-token prediction with distinct modules: ``modules[k]`` (an ``mtp`` :class:`DraftHead`)
    at position p reads ``modules[k-1]``'s output at p (module 0: the target's last hidden state) and the token
    ``t[p+1+k]``, and predicts ``t[p+2+k]``. Drafting after the target committed ``t[N]`` runs every module at the
    same last position N - 1, module k with draft k as its token: draft k + 1 (a chain of at most
    ``num_modules``). Each module has its own attention layer in one paged cache, on the target's block tables."""

    def __init__(self, modules: Sequence[DraftHead]):
        super().__init__()
        if not modules or any(m.layout.name != "mtp" for m in modules):
            raise ValueError("ChainedModules takes one or more mtp heads")
        self.heads = nn.ModuleList(modules)
        self.layout = modules[0].layout
        self.tp = modules[0].tp
        self.aux_layers: tuple[int, ...] = modules[0].aux_layers  # (the stream its family's modules read, if any)

    @property
    def num_modules(self) -> int:
        return len(self.heads)

    @property
    def dtype(self) -> torch.dtype:
        return self.heads[0].dtype

    @property
    def device(self) -> torch.device:
        return self.heads[0].device

    @property
    def target(self):
        return self.heads[0].target  # every module's: the target it drafts for

    def target_features(self, hidden: torch.Tensor, aux: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.heads[0].target_features(hidden, aux)

    def module(self, k: int, input_ids: torch.Tensor, features: torch.Tensor, meta: AttentionMetadata
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Module k over rows: (its output for module k + 1, the normed hidden for :meth:`draft_logits`)."""
        return self.heads[k](input_ids, features, meta)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.heads[0].draft_logits(hidden)  # every module's: the target's shared head

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def full_vocab(self, values: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        return values  # the target's own head: its vocabulary already

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [spec for head in self.heads for spec in head.kv_cache_specs()]

    def bind_kv_cache(self, cache: KVCache) -> None:
        assert cache.specs == self.kv_cache_specs(), "the cache was allocated for another model's specs"
        for k, head in enumerate(self.heads):
            head.bind_layers([cache.layer(k)], cache.block_size, cache.fp8)


def check_split(method: str, num_heads: int, num_kv_heads: int | None, tp_size: int) -> None:
    """A head split over ``tp_size`` ranks splits its attention heads as a target layer does: a ValueError naming
    the way out (the head whole on the driver rank) when they do not divide."""
    kv = num_kv_heads or num_heads
    if tp_size > 1 and not splits_heads(num_heads, kv, tp_size):
        raise ValueError(f"the {method} head's num_attention_heads={num_heads} and num_key_value_heads={kv} do not "
                         f"split over tensor_parallel_size={tp_size}: set "
                         "speculative_config.draft_tensor_parallel_size=1 (the head whole on the driver rank)")


def norm_eps(config) -> float:
    """The head's norms' epsilon: its config's ``rms_norm_eps`` (Nemotron-H's: ``layer_norm_epsilon``)."""
    eps = getattr(config, "rms_norm_eps", None)
    return eps if eps is not None else config.layer_norm_epsilon


def _family(config):
    """Our model class for ``config``'s architecture (None when it names none we serve: a draft head's own)."""
    from specray.models.registry import get_model_class

    try:
        return get_model_class(config)
    except ValueError:
        return None


def _split_merged(head: DraftHead, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our merged qkv / gate_up tensors back into the checkpoint's separate ones."""
    if ".qkv_proj." in name:
        attn = head.layers[0].self_attn.qkv_proj
        q, k, v = tensor.split([attn.q_size, attn.kv_size, attn.kv_size], dim=0)
        return {name.replace(".qkv_proj.", f".{p}_proj."): t.contiguous() for p, t in zip("qkv", (q, k, v))}
    if ".gate_up_proj." in name:
        gate, up = tensor.chunk(2, dim=0)
        return {name.replace(".gate_up_proj.", ".gate_proj."): gate.contiguous(),
                name.replace(".gate_up_proj.", ".up_proj."): up.contiguous()}
    return {name: tensor.contiguous()}
