"""Swiss AI's Apertus 1.5 text model (``Apertus1p5TextForCausalLM``, model type ``apertus1p5_text``; the text model of
``Apertus1p5ForConditionalGeneration``, served through ``registry._TEXT_PARTS``): Apertus
(:mod:`specray.models.apertus`) with a vocabulary extended by discrete visual and audio codes and an LM head that may
be pruned to the vocabulary's first ``output_vocab_size`` ids (the text tokens). The embedding keeps every id (a prompt
may hold any), the head scores only the kept ones; :meth:`Apertus1p5ForCausalLM.compute_logits` hands out logits over
the whole vocabulary with the pruned ids at ``-inf``, so that every engine check, sampler, grammar mask and drafter
sees one width and a pruned id is never sampled nor accepted as a draft (transformers' head cannot produce it either).

The multimodal release's vision and audio tokenizers (``model.vision_tokenizer.``, ``model.audio_tokenizer.``) turn
pixels and waveforms into those codes; they are not read: a text-only engine never runs them."""

from __future__ import annotations

import torch

from specray.models.apertus import ApertusDecoderLayer, ApertusForCausalLM, ApertusModel
from specray.models.layers import RMSNorm, widen_to_vocab
from specray.models.llama import _CHECKPOINT_NAMES, LlamaAttention
from specray.parallel import PPGroup, TPGroup


def output_vocab_size(config) -> int:
    """How many ids the LM head scores: ``output_vocab_size``, or the whole ``vocab_size`` where it is unset."""
    kept = getattr(config, "output_vocab_size", None)
    if kept is None:
        return config.vocab_size
    if not isinstance(kept, int) or not 1 <= kept <= config.vocab_size:
        raise ValueError(f"output_vocab_size={kept!r} must be an int in [1, vocab_size={config.vocab_size}] (the LM "
                         "head's rows: the vocabulary's first ids), or null for an unpruned head")
    return kept


class Apertus1p5Attention(LlamaAttention):
    """Apertus's attention: Llama's with Qwen3's RMSNorm over each query and key head (which Llama's attention turns
    on for the ``apertus`` model type; this one's is ``apertus1p5_text``)."""

    def __init__(self, config, tp: TPGroup, layer: int, input_size: int | None = None):
        super().__init__(config, tp, layer, input_size)
        if self.q_norm is None:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)


class Apertus1p5DecoderLayer(ApertusDecoderLayer):
    attention_class = Apertus1p5Attention


class Apertus1p5Model(ApertusModel):
    layer_class = Apertus1p5DecoderLayer


class Apertus1p5ForCausalLM(ApertusForCausalLM):
    """Apertus 1.5's text model for causal LM, sharded over ``tp`` and ``pp`` as Apertus is; its head has
    ``output_vocab_size`` rows (split over the TP ranks as any head's)."""

    model_class = Apertus1p5Model

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        kept = output_vocab_size(hf_config)
        if kept < hf_config.vocab_size and getattr(hf_config, "tie_word_embeddings", False):
            raise ValueError(f"tie_word_embeddings=True with output_vocab_size={kept} < vocab_size="
                             f"{hf_config.vocab_size}: a pruned LM head cannot be the embedding (transformers keeps it "
                             "a tensor of its own); set tie_word_embeddings to false, or output_vocab_size to null")
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.renames = _CHECKPOINT_NAMES["apertus"]  # its norms' names, as Apertus's release names them

    @classmethod
    def head_rows(cls, hf_config) -> int:
        return output_vocab_size(hf_config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, V] float32: the head's output_vocab_size scores, the pruned ids' -inf past them
        return widen_to_vocab(super().compute_logits(hidden), self.config.vocab_size)
