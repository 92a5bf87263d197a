"""Meta's Llama 3.2 Vision text model (``MllamaForCausalLM``, model type ``mllama_text_model``; the text model of
``MllamaForConditionalGeneration``, served through ``registry._TEXT_PARTS``): Llama 3's layers (RoPE with its
``llama3`` scaling, GQA, SwiGLU) with cross-attention layers interleaved at ``cross_attention_layers``.

A cross-attention layer attends the vision tower's states of the request's images, through tanh-gated attention and a
tanh-gated MLP. With no image, transformers skips such a layer entirely: its text model runs a cross-attention layer
only when it is given vision states or holds them cached, and a text-only prompt (to ``MllamaForCausalLM`` or to
``MllamaForConditionalGeneration``, in a forward or through ``generate``) has neither, so the layer's attention, its
MLP and its norms never run and the residual stream passes it unchanged. A text-only engine does exactly that: a
cross-attention layer is :class:`SkippedCrossAttentionLayer` (an identity with no parameters and no KV cache), and its
tensors are not read. Images are refused, as for every multimodal release served text-only; so is the image token
(``<|image|>``, an id past ``vocab_size``) in a prompt, by the engine's vocabulary check.

The embedding has ``vocab_size + 8`` rows (the image token's and seven more: transformers' layout), the LM head
``vocab_size``; transformers never ties them. The multimodal release keeps the text model under
``language_model.model.`` and ``language_model.lm_head.`` (transformers' modules: ``model.language_model.`` and
``lm_head.``) beside ``vision_model.`` and ``multi_modal_projector.``, which are not read."""

from __future__ import annotations

import torch
from torch import nn

from specray.models.kv_cache import KVCache, KVCacheSpec
from specray.models.layers import VocabParallelEmbedding
from specray.models.llama import LlamaForCausalLM, LlamaModel, _layer_index
from specray.parallel import PPGroup, TPGroup

EXTRA_EMBEDDINGS = 8  # the embedding's rows past vocab_size (transformers' MllamaTextModel)


def cross_attention_layers(config) -> frozenset[int]:
    """The config's ``cross_attention_layers`` as a set of layer indices, or a ValueError naming what is wrong."""
    layers = getattr(config, "cross_attention_layers", None)
    if layers is None:
        raise ValueError("cross_attention_layers is missing from config.json: Mllama's text config lists its "
                         "cross-attention layers (transformers' default: [3, 8, 13, 18, 23, 28, 33, 38]); give the "
                         "list")
    n = config.num_hidden_layers
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in layers):
        raise ValueError(f"cross_attention_layers={list(layers)!r}: each must be a layer index in [0, "
                         f"num_hidden_layers={n})")
    if len(set(layers)) >= n:
        raise ValueError(f"cross_attention_layers={list(layers)!r} leaves no self-attention layer of "
                         f"num_hidden_layers={n}: a text-only model needs at least one")
    return frozenset(layers)


def check_mllama_config(config) -> None:
    """Refuse what Mllama's text model could set that Llama's layers here would read otherwise than transformers."""
    window = getattr(config, "sliding_window", None)
    if window is not None:  # Llama's class would honour it; transformers' Mllama has no window
        raise ValueError(f"sliding_window={window!r} is not supported for model_type={config.model_type!r}: Mllama's "
                         "self-attention attends every earlier token (transformers ignores the field); remove it from "
                         "config.json or set it to null")
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and head_dim * config.num_attention_heads != config.hidden_size:
        raise ValueError(f"head_dim={head_dim} is not supported for model_type={config.model_type!r}: Mllama's heads "
                         f"are hidden_size / num_attention_heads = {config.hidden_size // config.num_attention_heads} "
                         "wide (transformers ignores the field); remove it from config.json")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(config, field, False):
            raise ValueError(f"{field}=True is not supported for model_type={config.model_type!r}: Mllama's "
                             "projections have no biases (transformers ignores the field); set it to false")
    cross_attention_layers(config)


class SkippedCrossAttentionLayer(nn.Module):
    """A cross-attention layer of a text-only request: transformers skips it, so the stream passes unchanged."""

    mlp = None  # (no MLP runs: the Llama plumbing's checks for experts find none)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta) -> tuple[torch.Tensor, torch.Tensor | None]:
        return x, residual


class MllamaTextModel(LlamaModel):
    """Llama's stack with the cross-attention layers skipped and an embedding of ``vocab_size + 8`` rows."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        self.cross_layers = cross_attention_layers(config)
        self.tp_group = tp  # (what build_stage builds the embedding over)
        super().__init__(config, tp, expert_parallel, pp)

    def build_stage(self, config, pp, layer, embed, norm) -> None:
        super().build_stage(config, pp, lambda i: SkippedCrossAttentionLayer() if i in self.cross_layers else layer(i),
                            lambda: VocabParallelEmbedding(config.vocab_size + EXTRA_EMBEDDINGS, config.hidden_size,
                                                           self.tp_group), norm)

    def attention_layers(self) -> list[nn.Module]:
        """This stage's self-attention layers, in order (the ones holding a KV cache)."""
        return [layer for i, layer in self.stage_layers() if i not in self.cross_layers]


class MllamaForCausalLM(LlamaForCausalLM):
    """Mllama's text model for causal LM, sharded over ``tp`` and ``pp``: Llama's class over
    :class:`MllamaTextModel`."""

    model_class = MllamaTextModel
    may_tie = False  # transformers never ties the head ([vocab_size]) to the embedding ([vocab_size + 8])

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        check_mllama_config(hf_config)
        super().__init__(hf_config, tp, expert_parallel, pp)

    def _a_norm(self) -> torch.Tensor:
        layers = self.model.attention_layers()
        if layers:
            return layers[0].input_layernorm.weight
        return next(self.parameters())  # a pipeline stage of cross-attention layers alone: its head or embedding

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [layer.self_attn.attn.kv_spec for layer in self.model.attention_layers()]

    def bind_kv_cache(self, cache: KVCache) -> None:
        assert cache.specs == self.kv_cache_specs(), "the cache was allocated for another model's specs"
        for j, layer in enumerate(self.model.attention_layers()):
            layer.self_attn.attn.bind_cache(cache.layer(j), cache.block_size, cache.fp8)
        self.kv_cache_allocated = True

    def _skipped_layer(self, name: str) -> bool:
        return _layer_index(self._our_name(name)) in self.model.cross_layers

    def _unfused(self, weights):
        # a cross-attention layer's tensors (its attention, gates, MLP and norms) are never used text-only
        return super()._unfused((name, t) for name, t in weights if not self._skipped_layer(name))

    def reads_weight(self, name: str) -> bool:
        return not self._skipped_layer(name) and super().reads_weight(name)
