"""ModernBERT's decoder (``ModernBertDecoderForCausalLM``, model type ``modernbert-decoder``: the Ettin decoders,
jhu-clsp/ettin-decoder-17m to 1b), on the Llama plumbing (:mod:`specray.models.llama`). Where it differs from Llama:

* global and local layers as ``layer_types`` says (transformers' config expands ``global_attn_every_n_layers``: a
  global layer every third); a local layer's queries see the last ``sliding_window`` = ``local_attention // 2``
  positions, themselves included (a sliding-window cache spec), and each kind rotates by its own RoPE
  (``rope_parameters[kind]``: ``global_rope_theta`` 160k, ``local_rope_theta`` 10k;
  :class:`~specray.models.olmo3.RopePerKind`);
* LayerNorms (``norm_eps``, a bias only where ``norm_bias``: none in the releases): one after the token embedding
  (``embeddings.norm``), before each block, and after the last layer; the first layer's attention reads the stream
  unnormed (transformers' ``attn_norm`` is an identity there);
* q/k/v and the output projection ``Wo`` (biases where ``attention_bias``); a checkpoint with q/k/v fused in thirds
  (``attn.Wqkv``, ModernBERT's encoder layout) is split at load too; scores scaled by ``head_dim ** -0.5``;
* a GeGLU MLP: ``Wi`` holds [input; gate] rows, ``Wo(act(input) * gate)`` with ``hidden_activation`` (exact GELU in
  the releases), biases where ``mlp_bias``;
* a prediction head before the vocabulary: ``norm(act(dense(h)))`` (``lm_head.dense`` with a bias where
  ``classifier_bias``, ``classifier_activation``, ``lm_head.norm``), then ``decoder`` (tied to the token embedding,
  a bias where ``decoder_bias``).

LoRA: on q/k/v, the attention's ``Wo`` and the MLP's ``Wo``; an adapter of the fused ``Wi`` (or ``Wqkv``) or of the
prediction head is refused at admission (no such adaptable projection).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.classic import ACTIVATIONS, llama_view
from specray.models.layers import LayerNorm, VocabParallelEmbedding, _param, materialize, on_stage, other_stage_prefixes
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from specray.models.olmo3 import RopePerKind
from specray.models.opt import StreamSum
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^lm_head\.", "prediction_head."), (r"^decoder\.", "lm_head."),
    (r"^model\.embeddings\.tok_embeddings\.", "model.embed_tokens."),
    (r"^model\.embeddings\.norm\.", "model.embed_norm."),
    (r"^model\.final_norm\.", "model.norm."), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.mlp_norm\.", ".post_attention_layernorm."), (r"\.attn\.Wo\.", ".self_attn.o_proj."),
    (r"\.attn\.", ".self_attn."), (r"\.mlp\.Wo\.", ".mlp.down_proj.")))


def _activation(field: str, name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported for model_type='modernbert-decoder'; one of "
                         f"{sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def layer_norm(config) -> LayerNorm:
    """A LayerNorm over the hidden size at ``norm_eps``, with a bias where ``norm_bias``."""
    return LayerNorm(config.hidden_size, config.norm_eps, bias=bool(config.norm_bias))


class GeGLUMLP(LlamaMLP):
    """``down(act(gate) * up)`` (the checkpoint's ``Wi`` rows [input; gate] as our gate and up), the config's
    ``hidden_activation``."""

    def __init__(self, config, tp: TPGroup):
        super().__init__(llama_view(config, hidden_act="silu"), tp)  # (the projections; the activation: the config's)
        self.act = _activation("hidden_activation", config.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class ModernBertDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with LayerNorms and the GeGLU MLP; layer 0 reads the stream unnormed."""

    mlp_class = GeGLUMLP
    build_norm = staticmethod(layer_norm)

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__(config, tp, layer, expert_parallel)
        if layer == 0:
            self.input_layernorm = StreamSum()


class ModernBertDecoderModel(RopePerKind, LlamaModel):
    """The stack: the token embedding LayerNormed, a RoPE table per kind of layer, a LayerNorm after the last layer."""

    layer_class = ModernBertDecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        self.build_ropes(config)
        self.build_stage(config, pp, lambda i: self.layer_class(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: layer_norm(config))
        self.embed_norm = on_stage(self.pp.holds_embedding, lambda: layer_norm(config))

    def embed_step(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # input_ids: [T] -> [T, H]
        return self.embed_norm(self.embed(input_ids))


class PredictionHead(nn.Module):
    """``norm(act(dense(h)))``, replicated on every rank of the last stage (a bias on ``dense`` where
    ``classifier_bias``)."""

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.dense = nn.Module()
        self.dense.weight = _param(hidden, hidden)
        self.dense.bias = _param(hidden) if config.classifier_bias else None
        self.act = _activation("classifier_activation", config.classifier_activation)
        self.norm = layer_norm(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, H] -> [N, H]
        return self.norm(self.act(F.linear(x, self.dense.weight, self.dense.bias)))


def _checked(config) -> None:
    kinds = list(config.layer_types)
    if "sliding_attention" in kinds and not (isinstance(config.local_attention, int) and config.local_attention >= 2):
        raise ValueError(f"local_attention={config.local_attention!r} with sliding_attention layers: ModernBERT's "
                         "local layers need a window (local_attention >= 2: they see local_attention // 2 positions)")
    for kind in sorted(set(kinds)):
        rope = (config.rope_parameters or {}).get(kind) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters[{kind!r}] rope_type={rope.get('rope_type')!r} is not supported for "
                             "model_type='modernbert-decoder' (the releases rotate by plain RoPE); use 'default'")


class ModernBertDecoderForCausalLM(LlamaForCausalLM):
    """ModernBERT's decoder for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = ModernBertDecoderModel
    # LoRA on q/k/v and both Wo (our names; adapters name the checkpoint's, renamed as the weights are)
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        _checked(hf_config)
        config = llama_view(hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None,
                            sliding_window=hf_config.local_attention // 2 if hf_config.local_attention else None,
                            attention_bias=bool(hf_config.attention_bias), mlp_bias=bool(hf_config.mlp_bias),
                            hidden_act=hf_config.hidden_activation, lm_head_bias=bool(hf_config.decoder_bias),
                            tie_word_embeddings=getattr(hf_config, "tie_word_embeddings", True))
        super().__init__(config, tp, expert_parallel, pp)
        self.prediction_head = on_stage(self.pp.is_last, lambda: PredictionHead(config))
        self.other_stage = other_stage_prefixes(self)
        self.renames = _RENAMES

    def _a_norm(self) -> torch.Tensor:
        return self.model.layers[self.model.stage.start].post_attention_layernorm.weight  # (layer 0 has no input norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, V] (through the prediction head first)
        return super().compute_logits(self.prediction_head(hidden))

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            if ".attn.Wqkv." in name:  # [3 H, ...]: q, k, v in turn
                yield from ((name.replace(".Wqkv.", f".{p}_proj."), part)
                            for p, part in zip("qkv", materialize(tensor).chunk(3)))
            elif ".mlp.Wi." in name:  # [2 I, ...]: the activated rows, then the gate's
                yield from ((name.replace(".Wi.", f".{p}_proj."), part)
                            for p, part in zip(("gate", "up"), materialize(tensor).chunk(2)))
            else:
                yield name, tensor
