"""MiniMax-M2 (``MiniMaxM2ForCausalLM``: MiniMax-M2, M2.1), on the Llama plumbing (:mod:`specray.models.llama`: paged KV
per layer, pipeline stages, weight loading, the model interface). Where it differs from the Llama family:

* the queries and the keys are RMS-normed over all their heads at once before RoPE, as OLMo 2's are
  (:class:`~specray.models.olmo2.Olmo2Attention`: under tensor parallelism the mean square summed over the ranks);
  RoPE rotates the first ``rotary_dim`` features of each head (partial RoPE);
* every layer's MLP is a mixture of experts (:mod:`specray.models.moe`, the ``minimax_m2`` row: sigmoid scores, the
  top k of score + ``e_score_correction_bias``, the chosen scores renormalised; no shared expert), split by width or
  (``expert_parallel``) by whole experts;
* the release names the experts' block ``block_sparse_moe`` (its experts' ``w1``, ``w3``, ``w2``, and the correction
  bias on the block), as Mixtral's release does.

Its multi-token-prediction module is the ``mtp`` drafter's in DeepSeek-V3's layout (``model.layers.{L}``: ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm``, a block of this family's: :meth:`MiniMaxM2ForCausalLM.mtp_layer_parts`),
as a vLLM port reads it (not upstream vLLM's); the shared embedding and LM head are the target's.
"""

from __future__ import annotations

from torch import nn

from specray.models.layers import RMSNorm
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.models.moe import SparseMoE
from specray.models.olmo2 import Olmo2Attention
from specray.parallel import TPGroup


class MiniMaxM2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        nn.Module.__init__(self)
        self.self_attn = Olmo2Attention(config, tp, layer)
        self.mlp = SparseMoE(config, tp, expert_parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MiniMaxM2Model(LlamaModel):
    layer_class = MiniMaxM2DecoderLayer


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    """MiniMax-M2 for causal LM, sharded over ``tp`` (heads; experts by width, or whole with ``expert_parallel``)
    and ``pp``."""

    model_class = MiniMaxM2Model
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj")  # the experts are fused tensors, not linears

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        """The MTP module's block: this family's attention (q and k normed over all heads, partial RoPE) and
        experts, split over ``tp`` as the target's layers are."""
        return Olmo2Attention(config, tp, config.num_hidden_layers), SparseMoE(config, tp, expert_parallel)
