"""RecurrentGemma (``RecurrentGemmaForCausalLM``: Google's recurrentgemma-2b / -9b and their -it releases; the Griffin
architecture of De et al., "Griffin: Mixing Gated Linear Recurrences with Local Attention for Efficient Language
Models", 2024) on the Llama plumbing (:mod:`specray.models.llama`) with Gemma's parts (:mod:`specray.models.gemma3`).

Every layer is ``h = h + temporal(norm(h))``, then ``h = h + mlp(norm(h))`` (``(1 + w)`` RMSNorms); its temporal block
is, by ``block_types`` repeated over the layers, either

* local attention: multi-query (``num_key_value_heads``, 1 in the releases) over a sliding window of
  ``attention_window_size`` positions, RoPE on the first half of each head (``partial_rotary_factor`` 0.5), scaled by
  ``head_dim ** -0.5``, a bias on ``o_proj`` always (on q/k/v with ``attention_bias``); or
* a recurrent block: ``y = gelu_tanh(linear_y(x))``, ``u = conv(linear_x(x))`` (a depthwise causal conv of width
  ``conv1d_width`` with a bias and no activation), then the RG-LRU on u per channel c:
  ``i = sigmoid(W_i u + b_i)`` and ``r = sigmoid(W_r u + b_r)`` (block-diagonal: ``num_attention_heads`` blocks of
  ``lru_width / num_attention_heads`` channels), ``log a = -8 r softplus(recurrent_param)``,
  ``h_t = a_t h_(t-1) + sqrt(1 - a_t^2) i_t u_t`` (at position 0, where h starts from zeros: ``i_0 u_0``, no
  ``sqrt(1 - a^2)`` factor), and the block's output ``linear_out(h * y)``.

The MLP is a gated GELU (tanh) of width ``intermediate_size / 2`` with biases; the embedding is scaled by
sqrt(hidden_size) rounded to bfloat16 first (transformers keeps that factor as a bfloat16 buffer), the head is tied and
the logits soft-capped, ``cap * tanh(logits / cap)`` (``logits_soft_cap``).

The RG-LRU is a :class:`~specray.models.gated_deltanet.RecurrentMixer` (:class:`RGLRU`), Mamba-1's way
(:mod:`specray.models.mamba1`): each channel a head of one value (state [1, 1]), q = k = 1, v = u, g = log a,
beta = i sqrt(1 - a^2), all computed from the conv's output inside the recurrence (``gates_from_conv``), so replayed
drafts, token trees, graph steps and the state slots are the machinery every recurrent family shares. Which rows sit
at position 0 (no ``sqrt(1 - a^2)``) comes from the step's recurrent batch: a fresh sequence's first row
(:meth:`RGLRU.recurrence`), on the device in graph steps. Long steps on a GPU run the parallel prefix scan
(:func:`~specray.models.gated_deltanet.scanned_selective`), elsewhere the token loop.

Tensor parallelism: attention heads split (the one KV head replicated), the LRU's channels split by whole gate blocks
(``num_attention_heads`` must divide by the ranks), ``linear_out`` and ``o_proj`` reduce once. LoRA adapters adapt
every linear of the release (the attention's q/k/v/o, the recurrent block's ``linear_x``, ``linear_y`` and
``linear_out``, the MLP's); an adapter of the conv is refused by name. Refused by name: pipeline stages (not built),
and configs this file does not compute (other activations, RoPE types).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.cpu_kernels import scans_in_parallel
from specray.models.gated_deltanet import (CHUNKED_FROM, RecurrentGraphBatch, RecurrentMixer, RecurrentModel,
                                           depthwise_conv, gated_delta_scan, gated_delta_tree, rank_rows,
                                           scanned_selective)
from specray.models.gemma3 import GemmaRMSNorm
from specray.models.kv_cache import RecurrentStateSpec
from specray.models.layers import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                   RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding, apply_rotary, divide,
                                   max_positions, rope_parameters, rotary_dim)
from specray.models.llama import _CHECKPOINT_NAMES, LlamaForCausalLM, _head_dim, _kv_spec
from specray.models.qwen3_5 import HybridModel
from specray.parallel import PPGroup, TPGroup

BLOCK_TYPES = ("recurrent", "attention")


def check_config(config) -> None:
    """A ValueError naming the first setting this family's code does not compute."""
    kinds = list(config.block_types)
    bad = [k for k in kinds if k not in BLOCK_TYPES]
    if not kinds or bad:
        raise ValueError(f"block_types={kinds} is not supported for model_type='recurrent_gemma'; each entry one of "
                         f"{list(BLOCK_TYPES)}")
    act = getattr(config, "hidden_activation", None)
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={act!r} is not supported for model_type='recurrent_gemma'; the releases "
                         "use 'gelu_pytorch_tanh'")
    if config.lru_width % config.num_attention_heads:
        raise ValueError(f"lru_width={config.lru_width} must be a multiple of num_attention_heads="
                         f"{config.num_attention_heads} (the RG-LRU's gates are blocks of lru_width / heads)")
    cap = getattr(config, "logits_soft_cap", None)
    if cap is not None and not cap > 0:
        raise ValueError(f"logits_soft_cap={cap} must be a positive number, or null for no cap")


def block_kind(config, layer: int) -> str:
    """Layer ``layer``'s temporal block: ``block_types`` repeated over the layers."""
    return config.block_types[layer % len(config.block_types)]


class RGLRU(RecurrentMixer):
    """A recurrent block over this rank's channels (module docstring): ``linear_y``, ``linear_x``, the conv, the
    RG-LRU (its checkpoint's ``rg_lru.`` parameters held here) and ``linear_out``."""

    delta_rule = False
    gates_from_conv = True
    conv_activation = False
    gate_scale = 8.0  # log a = -gate_scale * r * softplus(recurrent_param)
    _first: torch.Tensor | None = None  # per sequence of the step running: whether its first row is position 0

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        lru, h = config.lru_width, config.hidden_size
        self.heads = divide(config.num_attention_heads, tp.size, "num_attention_heads (the RG-LRU's gate blocks)")
        self.block = lru // config.num_attention_heads
        self.width = self.heads * self.block
        self.kernel = config.conv1d_width
        self.linear_y = ColumnParallelLinear(h, lru, tp, bias=True)
        self.linear_x = ColumnParallelLinear(h, lru, tp, bias=True)
        self.conv1d = depthwise_conv(tp, self.width, self.kernel, True)
        self.input_gate_weight = rank_rows(tp, self.heads, self.block, self.block)
        self.input_gate_bias = rank_rows(tp, self.heads, self.block)
        self.recurrent_gate_weight = rank_rows(tp, self.heads, self.block, self.block)
        self.recurrent_gate_bias = rank_rows(tp, self.heads, self.block)
        self.recurrent_param = rank_rows(tp, self.width)
        self.linear_out = RowParallelLinear(lru, h, tp, bias=True)

    @property
    def state_spec(self) -> RecurrentStateSpec:
        # each channel a head of one value: its state [1, 1]
        return RecurrentStateSpec(conv_dim=self.width, conv_width=self.kernel - 1, num_heads=self.width, key_dim=1,
                                  value_dim=1)

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        # x: [T, H] -> [T, H] (meta.recurrent: see RecurrentMixer.recurrence)
        t = x.shape[0]
        y = F.gelu(self.linear_y(x), approximate="tanh")
        unused = x.new_zeros(t, self.width, dtype=torch.float32)  # the gates come from the conv's output
        h = self.recurrence(self.linear_x(x), unused, unused, meta).reshape(t, -1)  # [T, C] float32
        return self.linear_out(h.to(x.dtype) * y)

    def recurrence(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta) -> torch.Tensor:
        """:meth:`RecurrentMixer.recurrence`, with each sequence's freshness at hand for :meth:`_heads_and_gates`
        (a fresh sequence's first row is position 0: a host list made a tensor, or the graph table's row)."""
        batch = meta.recurrent
        if isinstance(batch, RecurrentGraphBatch):
            self._first = batch.table[2].bool()
        elif batch is not None:
            self._first = torch.tensor(batch.fresh, dtype=torch.bool).to(mixed.device, non_blocking=True)
        try:
            return super().recurrence(mixed, g, beta, meta)
        finally:
            self._first = None

    def _gate(self, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # u: [B, L, heads, block] -> sigmoid(u W + b) per block, [B, L, C]
        out = torch.einsum("blhi,hij->blhj", u, weight.float()) + bias.float()
        return torch.sigmoid(out).flatten(2)

    def _input_gate(self, blocks: torch.Tensor) -> torch.Tensor:
        return self._gate(blocks, self.input_gate_weight, self.input_gate_bias)

    @staticmethod
    def _normaliser(log_a: torch.Tensor) -> torch.Tensor:
        """sqrt(1 - a^2), the input's scale past position 0."""
        return torch.sqrt(1.0 - torch.exp(2.0 * log_a))

    def _heads_and_gates(self, conv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """conv [B, L, C] -> q = k = 1 [B, L, C, 1], v = u [B, L, C, 1], g = log a and beta = i sqrt(1 - a^2) (i at
        a fresh sequence's first row) [B, L, C], float32."""
        b, length, c = conv.shape
        u = conv.float()
        blocks = u.view(b, length, self.heads, self.block)
        i = self._input_gate(blocks)
        r = self._gate(blocks, self.recurrent_gate_weight, self.recurrent_gate_bias)
        log_a = -self.gate_scale * r * F.softplus(self.recurrent_param.float())
        scale = self._normaliser(log_a)
        first = self._first_rows(b, length, conv.device)
        if first is not None:
            scale = torch.where(first[..., None], torch.ones((), device=conv.device), scale)
        ones = u.new_ones(()).expand(b, length, c, 1)
        return ones, ones, u[..., None], log_a, i * scale

    def _first_rows(self, b: int, length: int, device: torch.device) -> torch.Tensor | None:
        """[B, L] bool: the rows at position 0 (a fresh sequence's row 0), or None outside a step."""
        if self._first is None:
            return None
        assert self._first.shape[0] == b, (self._first.shape, b)
        row0 = torch.arange(length, device=device) == 0
        return self._first[:, None] & row0[None, :]

    def _decay_by(self) -> torch.Tensor:
        return torch.ones(self.width, 1, device=self.recurrent_param.device)

    def _rule(self, q, k, v, g, beta, state, keep_at):
        if q.shape[1] >= CHUNKED_FROM and scans_in_parallel(q.device):  # (the same results either way)
            return scanned_selective(q, k, v, g, beta, state, keep_at, decay_by=self._decay_by())
        return gated_delta_scan(q, k, v, g, beta, state, keep_at, delta=False)

    def _tree_rule(self, q, k, v, g, beta, state, parent_rows, keep):
        return gated_delta_tree(q, k, v, g, beta, state, parent_rows, keep, delta=False)


class LocalAttention(nn.Module):
    """Multi-query attention over a sliding window (module docstring), RoPE on each head's first
    ``partial_rotary_factor``; ``o_proj`` always biased."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__()
        head_dim = _head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, tp, bias=bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, tp, bias=True)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.attn = PagedAttention(self.num_heads, _kv_spec(config, layer, self.qkv_proj), head_dim ** -0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, R/2] -> [T, H]
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        qk = qkv[:, : q_size + kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rotary(qk, cos, sin)
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(qk[:, : self.num_heads], qk[:, self.num_heads:], v, meta))


class RecurrentGemmaMLP(nn.Module):
    """Gated GELU (tanh) of width ``intermediate_size / 2``, every projection biased."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        inter = config.intermediate_size // 2
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], tp, bias=True)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, tp, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class RecurrentGemmaLayer(nn.Module):
    """``h = h + temporal(norm(h))``, then ``h = h + mlp(norm(h))``; the temporal block is ``self_attn`` (local
    attention) or ``temporal_block`` (:class:`RGLRU`)."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__()
        self.is_recurrent = block_kind(config, layer) == "recurrent"
        if self.is_recurrent:
            self.temporal_block = RGLRU(config, tp)
        else:
            self.self_attn = LocalAttention(config, tp, layer)
        self.mlp = RecurrentGemmaMLP(config, tp)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: the residual stream [T, H] -> the next layer's
        h = self.input_layernorm(x)
        x = x + (self.temporal_block(h, meta) if self.is_recurrent else self.self_attn(h, cos, sin, meta))
        return x + self.mlp(self.post_attention_layernorm(x))


class RecurrentGemmaModel(HybridModel):
    """The decoder stack: Qwen3.5's hybrid stack's forward (:class:`~specray.models.qwen3_5.HybridModel`) over
    Griffin's layers, Gemma's scaled embedding and final norm."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        check_config(config)
        self.build_stage(config, pp, lambda i: RecurrentGemmaLayer(config, tp, i),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))
        # sqrt(hidden_size) as transformers holds it: a bfloat16 number (2560: 50.5, not 50.596...)
        # (on the host: the model may be built on the meta device, as LoRA's admission check builds it)
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5, dtype=torch.bfloat16, device="cpu"))
        rope = rope_parameters(config, partial=True)
        self.rotary_emb = RotaryEmbedding(rotary_dim(_head_dim(config), rope), rope, max_positions(config))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)


# the checkpoint's names onto ours: the attention's under self_attn, the RG-LRU's parameters on the block itself
_CHECKPOINT_NAMES["recurrent_gemma"] = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.temporal_block\.([qkvo]_proj)\.", r".self_attn.\1."),
    (r"\.temporal_block\.conv_1d\.", ".temporal_block.conv1d."),
    (r"\.temporal_block\.rg_lru\.", ".temporal_block."), (r"\.temporal_pre_norm\.", ".input_layernorm."),
    (r"\.channel_pre_norm\.", ".post_attention_layernorm."), (r"\.mlp_block\.", ".mlp."),
    (r"^model\.final_norm\.", "model.norm.")))



class RecurrentGemmaForCausalLM(RecurrentModel, LlamaForCausalLM):
    """RecurrentGemma for causal LM, sharded over ``tp`` (module docstring)."""

    model_class = RecurrentGemmaModel
    stage_width = 1
    one_stage = "not built or checked yet"
    # LoRA on every linear (checkpoint names; the attention's under temporal_block there, renamed as its weights
    # are): applied to the layer's tokens, linear_x's before the conv as its weight is; not the conv (conv_1d)
    lora_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                     "linear_x", "linear_y", "linear_out")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.final_logit_softcapping = getattr(hf_config, "logits_soft_cap", None)

    @classmethod
    def recurrent_layers(cls, config) -> bool:
        return any(block_kind(config, i) == "recurrent" for i in range(config.num_hidden_layers))

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        check_config(config)
        divide(config.num_attention_heads, tp, "num_attention_heads")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)
