"""SK Telecom's A.X-K2 (``AXK2ForCausalLM``): DeepSeek-V3.2 (:mod:`specray.models.deepseek_v3`: latent attention,
always with a q LoRA rank, and DeepSeek Sparse Attention's indexer in every layer, ``index_topk`` keys per query;
DeepSeek-V3's experts and shared experts; each layer's kind by ``mlp_layer_types``) on the Llama plumbing.

Where it differs from DeepSeek-V3.2:

* **Gated norms** (:class:`GatedRMSNorm`, transformers' ``AXK2GatedRMSNorm``, Megatron's ``GatedNormWrapper``): every
  layer's input norm, and a sparse layer's post-attention norm (a dense layer's is a plain RMSNorm), is RMSNorm
  followed by a low-rank gate read from its own output, ``y * sigmoid(fc2(silu(fc1(y))))`` (rank
  ``gated_norm_rank``). The checkpoint keeps the RMSNorm's weight under ``...layernorm.norm.weight`` and the gate
  under ``...layernorm.mlp.fc{1,2}.weight``; the first is read as the norm's own ``weight`` (the plumbing reads a
  layer's ``input_layernorm.weight`` for the model's dtype and device).
* **Queries and an output gate from one projection** (:class:`AXK2Attention`): there is no ``q_b_proj``;
  ``q_gate_proj`` reads the query latent both normed and not, ``[q_a_layernorm(c_q) ; c_q]`` (2 q_lora_rank wide),
  and gives each head its query (nope + rope) then a gate of ``v_head_dim`` features. Each head's attention output
  is multiplied by ``sigmoid(gate)`` before ``o_proj``. The indexer reads the normed latent, as V3.2's. The fused
  projection splits over tensor-parallel ranks by head, as ``q_b_proj`` does.
* **Routing** (:class:`AXK2MoE`): sigmoid scores, the top k of score + ``e_score_correction_bias``, renormalised
  (``norm_topk_prob``), times ``routed_scaling_factor``; grouped only where the config sets ``n_group`` and
  ``topk_group`` (A.X-K2-Light sets neither: every expert is a candidate). Grouped, the experts outside the best
  ``topk_group`` groups are masked to 0.0 rather than V3's -inf (transformers' and the reference's rule), which
  differs where a kept expert's biased score is below 0.
* ``q_a_layernorm`` and ``kv_a_layernorm`` take RMSNorm's default eps (1e-6), not ``rms_norm_eps``, as transformers'
  modules do; MLA's RoPE is on interleaved pairs (V3.2's rule), the indexer's on halves.

**MTP**: transformers' A.X-K2 has no multi-token-prediction module and its config no ``num_nextn_predict_layers``,
so the layout of a release's MTP layers is unknown: ``method="mtp"`` is refused
(:meth:`AXK2ForCausalLM.mtp_layer_parts`).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM, DeepseekV3Model, MLAttention
from specray.models.layers import ColumnParallelLinear, RMSNorm, scale_queries
from specray.models.llama import _CHECKPOINT_NAMES, LlamaMLP
from specray.models.moe import FAMILIES, MoEFamily, SparseMoE
from specray.parallel import TPGroup

# the ungrouped routing is the "scored" one (sigmoid scores, the top k of score + correction bias, renormalised with
# norm_topk_prob, times routed_scaling_factor); AXK2MoE adds the groups where the config sets them
FAMILIES["axk2"] = MoEFamily("scored", "n_routed_experts", "moe_intermediate_size", shared="shared_experts",
                             shared_width="moe_intermediate_size", normalized=True, scoring="sigmoid")
# the release's names (what transformers saves) and transformers' modules' (its own state dict) as ours: the gated
# norm's RMSNorm weight as the norm's own, its gate W_down / W_up as mlp.fc1 / mlp.fc2, the fused q_b_proj as
# q_gate_proj
_CHECKPOINT_NAMES["axk2"] = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"_layernorm\.norm\.", "_layernorm."), (r"_layernorm\.W_down\.", "_layernorm.mlp.fc1."),
    (r"_layernorm\.W_up\.", "_layernorm.mlp.fc2."), (r"\.self_attn\.q_b_proj\.", ".self_attn.q_gate_proj.")))


class GateMLP(nn.Module):
    """The gated norm's low-rank gate ``fc2(silu(fc1(y)))``, replicated on every rank (every rank gates the whole
    hidden vector; it is small)."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        one = TPGroup.single()
        self.fc1 = ColumnParallelLinear(hidden_size, rank, one)
        self.fc2 = ColumnParallelLinear(rank, hidden_size, one)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(y)))


class GatedRMSNorm(RMSNorm):
    """RMSNorm, then each feature of its output ``y`` times ``sigmoid(fc2(silu(fc1(y))))`` (float32 sigmoid, as
    transformers); with ``residual`` it adds it first, as :class:`~specray.models.layers.RMSNorm`."""

    def __init__(self, hidden_size: int, eps: float, rank: int):
        super().__init__(hidden_size, eps)
        self.mlp = GateMLP(hidden_size, rank)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        y = super()._norm(x)
        return (y * torch.sigmoid(self.mlp(y).float())).to(y.dtype)


def _gated_norm(config) -> GatedRMSNorm:
    rank = getattr(config, "gated_norm_rank", None)
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"gated_norm_rank={rank!r}: A.X-K2's gated norms need a positive int rank (16 in "
                         "transformers' default); the checkpoint's config.json is inconsistent")
    return GatedRMSNorm(config.hidden_size, config.rms_norm_eps, rank)


class AXK2Attention(MLAttention):
    """DeepSeek-V3.2's latent attention with its indexer, queries and a per-feature output gate from
    ``q_gate_proj`` over ``[q_a_layernorm(c_q) ; c_q]`` (see the module docstring), over ``tp``."""

    def __init__(self, config, tp: TPGroup, layer: int):
        if not config.q_lora_rank:
            raise ValueError(f"q_lora_rank={config.q_lora_rank!r}: A.X-K2's q_gate_proj and indexer read the query "
                             "latent, so it needs a positive q_lora_rank; the checkpoint's config.json is "
                             "inconsistent")
        super().__init__(config, tp, layer)
        del self.q_b_proj  # its queries come from q_gate_proj
        self.interleave = True  # MLA's RoPE on interleaved pairs, as V3.2's (transformers' AXK2 always does)
        # per head: its query (nope + rope) then its gate (v), so a split by head keeps each head's rows whole
        self.q_gate_proj = ColumnParallelLinear(2 * config.q_lora_rank, config.num_attention_heads
                                                * (self.nope + self.rope + self.v_dim), tp)

    def gate(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Each head's output [T, Hl, v] times the sigmoid of its gate [T, Hl, v] (float32, as transformers)."""
        return (out * torch.sigmoid(gate.float())).to(out.dtype)

    def head_outputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
                     ) -> torch.Tensor:
        """Each of this rank's heads' gated attention output [T, Hl, v], before ``o_proj``."""
        t, hl = x.shape[0], self.num_heads
        compressed = self.q_a_proj(x)
        q_latent = self.q_a_layernorm(compressed)  # [T, q_lora_rank]: what the indexer reads too
        qg = self.q_gate_proj(torch.cat((q_latent, compressed), dim=-1)).view(t, hl, -1)
        q, gate = qg.split([self.nope + self.rope, self.v_dim], dim=-1)
        if self.query_scaling is not None:
            q = scale_queries(q.reshape(t, -1), meta.positions, self.query_scaling).view(t, hl, -1)
        return self.gate(self.attend_queries(x, q, q_latent, cos, sin, meta), gate)


class AXK2MoE(SparseMoE):
    """DeepSeek-V3's experts and shared experts; routed over every expert, or (``n_group`` and ``topk_group`` set)
    over the experts of the best ``topk_group`` groups, the others' biased scores taken as 0.0 (module docstring)."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False):
        super().__init__(config, tp, expert_parallel)
        n_group, topk_group = getattr(config, "n_group", None), getattr(config, "topk_group", None)
        if (n_group is None) != (topk_group is None):
            raise ValueError(f"n_group={n_group!r}, topk_group={topk_group!r}: A.X-K2 routes by groups with both set "
                             "or over every expert with both null; set both or neither in config.json")
        if n_group is not None and (not 0 < topk_group <= n_group or self.num_experts % n_group
                                    or self.num_experts // n_group < 2):
            raise ValueError(f"n_routed_experts={self.num_experts}, n_group={n_group}, topk_group={topk_group}: the "
                             "experts must split into n_group groups of at least 2 (a group's worth is its two best "
                             "scores) and 0 < topk_group <= n_group")
        self.expert_groups = None if n_group is None else (int(n_group), int(topk_group))

    def route(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.expert_groups is None:
            return super().route(x, token_ids)  # the "scored" routing over every expert
        router = self.router_module
        t, e = x.shape[0], self.num_experts
        g, keep = self.expert_groups
        scores = torch.sigmoid(F.linear(x.float(), router.weight.float()))  # [T, E]
        choice = (scores + router.e_score_correction_bias.float()).view(t, g, e // g)
        worth = choice.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        groups = worth.topk(keep, dim=-1, sorted=False).indices
        allowed = torch.zeros_like(worth, dtype=torch.bool).scatter_(1, groups, True)
        # 0.0, not -inf: a masked expert outranks a kept one whose biased score is negative, as in transformers
        choice = choice.masked_fill(~allowed[:, :, None], 0.0).view(t, e)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [T, k] (unsorted: transformers' tie order)
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.routed_scaling_factor).to(x.dtype), ids


class AXK2DecoderLayer(DeepseekV3DecoderLayer):
    """V3.2's layer (Llama's pre-norm forward) with gated norms: the input norm always, the post-attention norm on a
    sparse layer."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        nn.Module.__init__(self)
        kinds = list(getattr(config, "mlp_layer_types", None) or [])
        if len(kinds) != config.num_hidden_layers or not set(kinds) <= {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types={kinds!r}: A.X-K2 needs one 'dense' or 'sparse' per layer "
                             f"(num_hidden_layers={config.num_hidden_layers}); fix config.json")
        sparse = kinds[layer] == "sparse"
        self.self_attn = AXK2Attention(config, tp, layer)
        self.mlp = AXK2MoE(config, tp, expert_parallel) if sparse else LlamaMLP(config, tp)
        self.input_layernorm = _gated_norm(config)
        self.post_attention_layernorm = (_gated_norm(config) if sparse
                                         else RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.residual_multiplier = 1.0


class AXK2Model(DeepseekV3Model):
    layer_class = AXK2DecoderLayer


class AXK2ForCausalLM(DeepseekV3ForCausalLM):
    """A.X-K2 for causal LM, sharded over ``tp`` (experts by width, or whole with expert parallelism) and ``pp``."""

    # every projection applied as a linear (q_gate_proj in place of q_b_proj; kv_b_proj is read as W_UK and W_UV; the
    # gated norms' gates are not adapted)
    lora_modules = ("q_a_proj", "q_gate_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj")
    model_class = AXK2Model

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        raise ValueError("speculative_config method='mtp' is not supported for model_type='axk2': transformers' "
                         "A.X-K2 has no multi-token-prediction module (its config no num_nextn_predict_layers), so "
                         "the layout of a release's MTP layers is unknown; use a drafter that needs no MTP layers "
                         "(ngram, suffix, lookahead, draft_model, or an EAGLE head trained for it)")
