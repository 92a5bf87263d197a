"""Mamba models on the Llama plumbing (:mod:`specray.models.llama`: weights, paged KV for the attention layers, the
model interface), their Mamba layers (Mamba-2's: :mod:`specray.models.mamba2`; Mamba-1's: :mod:`specray.models.mamba1`)
keeping a recurrent state per request as Qwen3.5's linear attention does
(:class:`~specray.models.gated_deltanet.RecurrentModel`):

* **Bamba** (``BambaForCausalLM``): Llama's pre-norm layer whose mixer is Mamba-2 or attention (partial RoPE) as
  ``layers_block_type`` says (``attn_layer_indices``), a SwiGLU MLP in every layer. Its names: ``mamba.``,
  ``feed_forward.``, ``pre_ff_layernorm``, ``model.final_layernorm``.
* **Jamba** (``JambaForCausalLM``): Bamba's layer with Mamba-1 as its mixer, attention without RoPE, and experts
  (softmax top k, not renormalised) where ``layers_num_experts`` says.
* **Granite 4.0's hybrids** (``GraniteMoeHybridForCausalLM``: granite-4.0-h-micro / -tiny / -small): Bamba's layer
  with Granite's multipliers (embedding, residual, attention scale, logits), attention without RoPE unless
  ``position_embedding_type`` is "rope", and Granite's shared MoE (the experts beside a shared MLP), or the shared
  MLP alone where ``num_local_experts`` is 0 (the dense releases).
* **Nemotron-H** (``NemotronHForCausalLM``: Nemotron-H, NVIDIA-Nemotron-Nano-9B/12B-v2, Nemotron 3 Nano / Super): one
  mixer per layer, after its RMSNorm and before the residual: Mamba-2 ("M"), attention without RoPE ("*"), a
  squared-ReLU MLP ("-") or experts ("E") (``layers_block_type``, from ``hybrid_override_pattern``). Its releases
  name the stack ``backbone.`` with ``embeddings``, ``norm_f`` and each layer's ``mixer`` (as transformers saves
  it; its modules' ``model.`` names are read too). Its LM head is never tied to the embedding. Its experts are
  DeepSeek-V3's router over gateless squared-ReLU experts beside gateless shared experts, over a latent width
  where ``moe_latent_size`` says (Nemotron 3 Super: projected down before them and back up after). Nemotron 3's MTP
  module (``mtp.layers.0``: the fusion and an attention block; ``mtp.layers.1``: an experts block and the final norm,
  ``mtp_layers_block_type`` ["full_attention", "moe"]) is the ``mtp`` head's: the two blocks are its one layer's
  attention and MLP halves (:data:`NEMOTRON_MTP_NAMES`), reused for every draft step.
* **Mamba-2** alone (``Mamba2ForCausalLM``), **Mamba** and **Falcon-Mamba** (``MambaForCausalLM``,
  ``FalconMambaForCausalLM``: Mamba-1): Nemotron-H's stack, every layer a Mamba layer, no attention.
* **Falcon-H1** (``FalconH1ForCausalLM``: Falcon-H1 0.5B to 34B, Falcon-H1R): Mamba-2 and attention side by side in
  every layer (their outputs summed), a SwiGLU MLP, muP multipliers folded into the weights as they load; the
  Mamba-2 layer's gated norm optional (``mamba_rms_norm``) and either side of the gate (``mamba_norm_before_gate``).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
from torch import nn

from specray.models.arcee import GATELESS_STACKED, ReluSquaredMLP
from specray.models.attention import AttentionMetadata
from specray.models.gated_deltanet import RecurrentModel
from specray.models.layers import RMSNorm, materialize
from specray.models.llama import (_CHECKPOINT_NAMES, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel,
                                  _is_sparse, norm_stream)
from specray.models.mamba1 import Mamba1Mixer, check_mamba1_split
from specray.models.mamba2 import Mamba2Mixer, check_mamba2_split, mamba2_dims
from specray.models.moe import SparseMoE
from specray.parallel import PPGroup, TPGroup

RECURRENT_KINDS = ("linear_attention", "mamba")  # a layer kind whose mixer is Mamba-2
ATTENTION_KINDS = ("full_attention", "attention")


def layer_kinds(config) -> list[str]:
    """Each layer's kind, as transformers names them (``layers_block_type``; Granite's ``layer_types`` also may
    say "mamba" and "attention")."""
    kinds = list(getattr(config, "layers_block_type", None) or config.layer_types)
    if len(kinds) != config.num_hidden_layers:
        raise ValueError(f"layers_block_type has {len(kinds)} entries for num_hidden_layers="
                         f"{config.num_hidden_layers}: give one per layer")
    return kinds


class MambaHybridLayer(LlamaDecoderLayer):
    """Llama's layer (norm, mixer, norm, MLP) whose mixer is Mamba-2 in the recurrent layers (Bamba's)."""

    mamba_class: type[nn.Module] = Mamba2Mixer  # the recurrent layers' mixer (Jamba's: Mamba-1's)

    def build_mixer(self, config, tp: TPGroup, layer: int) -> None:
        kind = layer_kinds(config)[layer]
        if kind not in RECURRENT_KINDS + ATTENTION_KINDS:
            raise ValueError(f"layers_block_type[{layer}]={kind!r} is not supported for model_type="
                             f"{config.model_type!r}; one of {list(RECURRENT_KINDS + ATTENTION_KINDS)}")
        self.is_recurrent = kind in RECURRENT_KINDS
        if self.is_recurrent:
            self.mamba = self.mamba_class(config, tp)
        else:
            super().build_mixer(config, tp, layer)

    def mix(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.mamba(x, meta) if self.is_recurrent else self.self_attn(x, cos, sin, meta)


class GraniteHybridLayer(MambaHybridLayer):
    """Granite 4.0's: Granite's multipliers (the residual one here, the rest on the stack and attention), Granite's
    shared MoE, or in the dense releases its shared MLP alone (``shared_intermediate_size`` wide)."""

    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        if not _is_sparse(config, layer):
            return LlamaMLP(config, tp, config.shared_intermediate_size)
        return super().build_mlp(config, tp, layer, expert_parallel)


class JambaLayer(MambaHybridLayer):
    """Jamba's: Mamba-1 in the recurrent layers, attention without RoPE in the others, and experts (softmax top k,
    not renormalised) where ``layers_num_experts`` says, a SwiGLU MLP elsewhere."""

    mamba_class = Mamba1Mixer

    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        if config.layers_num_experts[layer] > 1:
            return SparseMoE(config, tp, expert_parallel)
        return LlamaMLP(config, tp)


class MambaHybridModel(LlamaModel):
    layer_class = MambaHybridLayer


class JambaModel(LlamaModel):
    layer_class = JambaLayer


class GraniteHybridModel(LlamaModel):
    layer_class = GraniteHybridLayer


# Bamba's names for Llama's; Granite's dense hybrids' shared MLP is the layer's MLP (its MoE ones: Granite's shared
# MoE's names, as transformers saves them)
_CHECKPOINT_NAMES["bamba"] = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.feed_forward\.", ".mlp."), (r"\.pre_ff_layernorm\.", ".post_attention_layernorm."),
    (r"^model\.final_layernorm\.", "model.norm.")))
_DENSE_GRANITE = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.shared_mlp\.(gate|up)_proj\.", r".mlp.\1_proj."), (r"\.shared_mlp\.output_linear\.", ".mlp.down_proj.")))
_CHECKPOINT_NAMES["granitemoehybrid"] = _CHECKPOINT_NAMES["granitemoeshared"]


class MambaHybridForCausalLM(RecurrentModel, LlamaForCausalLM):
    """Bamba for causal LM, sharded over ``tp`` (Mamba-2 heads split like attention heads)."""

    model_class = MambaHybridModel
    # LoRA on the attention's q/k/v/o, the MLPs (and shared MLPs, not the experts) and Mamba-2's in_proj and out_proj
    # (an adapter's B of in_proj split over the ranks by the same row ranges as the weight's); adapters name modules
    # as the checkpoint does (adapter_module renames them)
    lora_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                     "in_proj", "out_proj")

    @classmethod
    def check_split(cls, config, tp: int, pp: int) -> None:
        if cls.recurrent_layers(config):  # (a release of attention layers alone has no Mamba sizes to split)
            check_mamba2_split(config, tp)

    @classmethod
    def recurrent_layers(cls, config) -> bool:
        return any(kind in RECURRENT_KINDS for kind in layer_kinds(config))


_CHECKPOINT_NAMES["jamba"] = _CHECKPOINT_NAMES["bamba"]


class JambaForCausalLM(MambaHybridForCausalLM):
    """Jamba for causal LM (Jamba 1.5 / 1.6 / 1.7 Mini and Large, Jamba Reasoning 3B), sharded over ``tp``: the
    Mamba-1 layers' channels split over the ranks, the experts by width or whole (expert parallel). Names as
    Bamba's."""

    model_class = JambaModel

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        check_mamba1_split(config, tp)


class GraniteMoeHybridForCausalLM(MambaHybridForCausalLM):
    """Granite 4.0's hybrids for causal LM: Bamba's with Granite's layers, its dense releases' shared MLP read as
    the layer's MLP."""

    model_class = GraniteHybridModel

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        if not getattr(hf_config, "num_local_experts", 0):
            self.renames = _DENSE_GRANITE


# ---- Nemotron-H: one mixer per layer ------------------------------------------------------------------------------

# a layer kind -> the module its mixer is (its checkpoint's ``mixer.`` renamed to it)
NEMOTRON_H_KINDS = {"linear_attention": "mamba", "full_attention": "self_attn", "mlp": "mlp", "moe": "mlp"}


class NemotronHLayer(nn.Module):
    """``x + mixer(rmsnorm(x))`` with one mixer: Mamba-2, attention (no RoPE), a squared-ReLU MLP or a mixture of
    squared-ReLU experts (:class:`~specray.models.moe.SparseMoE`: DeepSeek-V3's router, gateless experts and shared
    experts); the residual added lazily in the next norm, as Llama's layers do."""

    mamba_class: type[nn.Module] = Mamba2Mixer  # its Mamba layers' mixer (Mamba's and Falcon-Mamba's: Mamba-1's)

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__()
        kind = layer_kinds(config)[layer]
        if kind not in NEMOTRON_H_KINDS:
            raise ValueError(f"layers_block_type[{layer}]={kind!r} is not supported for model_type='nemotron_h'; "
                             f"one of {list(NEMOTRON_H_KINDS)}")
        self.kind = NEMOTRON_H_KINDS[kind]
        self.input_layernorm = self.build_norm(config)
        self.mlp = None
        if self.kind == "mamba":
            self.mamba = self.mamba_class(config, tp)
        elif self.kind == "self_attn":
            self.self_attn = LlamaDecoderLayer.attention_class(config, tp, layer)
        elif kind == "moe":
            self.mlp = SparseMoE(config, tp, expert_parallel)
        else:
            self.mlp = ReluSquaredMLP(SimpleNamespace(  # the MLP's own activation and widths
                hidden_act=config.mlp_hidden_act, mlp_bias=config.mlp_bias, hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size, model_type=config.model_type), tp)

    @staticmethod
    def build_norm(config) -> nn.Module:
        return RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H] -> the mixer's output and the stream it joins
        x, residual = norm_stream(self.input_layernorm, x, residual)
        if self.kind == "mamba":
            return self.mamba(x, meta), residual
        if self.kind == "self_attn":
            return self.self_attn(x, cos, sin, meta), residual
        return self.mlp(x), residual


class NemotronHModel(LlamaModel):
    layer_class = NemotronHLayer


# Nemotron 3's MTP module (its release's mtp.*) in the mtp head's names: block 0's norm and mixer are the layer's
# attention half, block 1's its MLP half (experts), block 1's final_layernorm the head's norm
NEMOTRON_MTP_NAMES = (("layers.0.enorm.", "enorm."), ("layers.0.hnorm.", "hnorm."), ("layers.0.eh_proj.", "eh_proj."),
                      ("layers.0.norm.", "layers.0.input_layernorm."), ("layers.0.mixer.", "layers.0.self_attn."),
                      ("layers.1.norm.", "layers.0.post_attention_layernorm."), ("layers.1.mixer.", "layers.0.mlp."),
                      ("layers.1.final_layernorm.", "norm."))
NEMOTRON_MTP_BLOCKS = ["full_attention", "moe"]


class NemotronHForCausalLM(RecurrentModel, LlamaForCausalLM):
    """Nemotron-H for causal LM, sharded over ``tp``: its releases' ``backbone.`` names (and transformers'
    ``model.``), each layer's ``mixer`` named for its kind."""

    model_class = NemotronHModel
    lora_modules = MambaHybridForCausalLM.lora_modules  # (its mixers' names renamed by kind: adapter_module)
    stacked = GATELESS_STACKED  # its MLPs' up_proj stands alone
    may_tie = False  # its LM head is its own whatever tie_word_embeddings says (transformers' has no tied weights)

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        kinds = [NEMOTRON_H_KINDS.get(k, k) for k in layer_kinds(hf_config)]
        self.renames = tuple((re.compile(pattern), ours) for pattern, ours in (
            (r"^backbone\.", "model."), (r"^model\.embeddings\.", "model.embed_tokens."),
            (r"^model\.norm_f\.", "model.norm."), (r"(\.layers\.\d+)\.norm\.", r"\1.input_layernorm."),
            (r"\.layers\.(\d+)\.mixer\.", lambda m: f".layers.{m[1]}.{kinds[int(m[1])]}.")))

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        check_mamba2_split(config, tp)

    skipped = ("mtp.",)  # the release's MTP module: the mtp drafter's
    mtp_names = NEMOTRON_MTP_NAMES  # the MTP module is the release's mtp.* (DeepSeek's layout is the default)

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        """The MTP module's two blocks as one layer's halves: attention without RoPE, and the stack's experts
        (Nemotron 3 Super's ``mtp_layers_block_type``; another pattern is refused)."""
        blocks = list(getattr(config, "mtp_layers_block_type", None) or NEMOTRON_MTP_BLOCKS)
        if blocks != NEMOTRON_MTP_BLOCKS:
            raise ValueError(f"mtp_layers_block_type={blocks}: specray reads Nemotron-H's MTP module as "
                             f"{NEMOTRON_MTP_BLOCKS} (an attention block, then an experts block); use another "
                             "speculative method for this model")
        return LlamaDecoderLayer.attention_class(config, tp, 0), SparseMoE(config, tp, expert_parallel)


class Mamba2ForCausalLM(NemotronHForCausalLM):
    """Mamba-2 alone (``Mamba2ForCausalLM``: Mamba-Codestral-7B, the mamba2 checkpoints): Nemotron-H's stack with
    every layer Mamba-2 and the same names; no paged layer at all (the blocks are bookkeeping only); its LM head
    tied where ``tie_word_embeddings`` says. transformers keeps its residual stream in float32
    (``residual_in_fp32``); this stack keeps it in the model's dtype, the same in a float32 model."""

    may_tie = True


class Mamba1Layer(NemotronHLayer):
    mamba_class = Mamba1Mixer


class Mamba1Model(LlamaModel):
    layer_class = Mamba1Layer

    @staticmethod
    def rope_head_dim(config) -> int:
        return 2  # no attention layer reads the tables (the config names no heads)


class Mamba1ForCausalLM(Mamba2ForCausalLM):
    """Mamba-1 alone (``MambaForCausalLM``: the mamba checkpoints; ``FalconMambaForCausalLM``: Falcon-Mamba-7B, its
    B, C and dt normed without weights): Mamba-2's stack and names with Mamba-1 in every layer."""

    model_class = Mamba1Model

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        check_mamba1_split(config, tp)


# ---- Falcon-H1: attention and Mamba-2 side by side in every layer -------------------------------------------------


class FalconH1Layer(LlamaDecoderLayer):
    """Llama's layer whose mixer is Mamba-2 and attention side by side, their outputs summed (Falcon-H1's
    multipliers are folded into the weights as they load: :meth:`FalconH1ForCausalLM._unfused`)."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__(config, tp, layer, expert_parallel)
        self.mamba = Mamba2Mixer(config, tp)

    def mix(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.mamba(x, meta) + self.self_attn(x, cos, sin, meta)


class FalconH1Model(LlamaModel):
    layer_class = FalconH1Layer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__(config, tp, expert_parallel, pp)
        self.embedding_multiplier = float(config.embedding_multiplier)


_CHECKPOINT_NAMES["falcon_h1"] = _CHECKPOINT_NAMES["bamba"]


class FalconH1ForCausalLM(RecurrentModel, LlamaForCausalLM):
    """Falcon-H1 (``FalconH1ForCausalLM``) for causal LM, sharded over ``tp``: every layer's Mamba-2 heads and
    attention heads split over the ranks. Its muP multipliers scale linear maps, so each is folded into the weights
    it scales as the checkpoint loads (no work per step): ``ssm_in_multiplier`` and the per-part
    ``ssm_multipliers`` (z, x, B, C, dt) into ``in_proj``, ``ssm_out_multiplier`` into ``out_proj``,
    ``attention_in_multiplier`` into q/k/v, ``key_multiplier`` into k, ``attention_out_multiplier`` into o,
    ``mlp_multipliers`` into the gate and down projections; the embedding's multiplier scales the embedding's output
    and ``lm_head_multiplier`` the logits. Names as Bamba's."""

    model_class = FalconH1Model
    lora_modules = MambaHybridForCausalLM.lora_modules  # each adapter's B scaled as its weight is (fold_adapter)

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.logits_scaling = 1.0 / float(hf_config.lm_head_multiplier)
        c, d = hf_config, mamba2_dims(hf_config)
        z, x, b, cc, dt = (float(m) for m in c.ssm_multipliers)
        gn = d.groups * d.state
        mup = torch.cat([torch.full((n,), m) for n, m in ((d.inner, z), (d.inner, x), (gn, b), (gn, cc),
                                                            (d.heads, dt))])
        gate, down = (float(m) for m in c.mlp_multipliers)
        attn_in, key = float(c.attention_in_multiplier), float(c.key_multiplier)
        ssm_out, attn_out = float(c.ssm_out_multiplier), float(c.attention_out_multiplier)
        # (a checkpoint name's piece, its weight's factor, its bias's factor): a scalar, or the rows' mup vector
        self.folds = (
            (".mamba.in_proj.", mup * float(c.ssm_in_multiplier), mup), (".mamba.out_proj.", ssm_out, ssm_out),
            (".self_attn.q_proj.", attn_in, 1.0), (".self_attn.v_proj.", attn_in, 1.0),
            (".self_attn.k_proj.", attn_in * key, key), (".self_attn.o_proj.", attn_out, attn_out),
            (".feed_forward.gate_proj.", gate, gate), (".feed_forward.down_proj.", down, down))

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        check_mamba2_split(config, tp)

    def _fold(self, name: str, tensor):
        """A checkpoint tensor ``name`` times the multiplier folded into it (a weight's rows, or its bias), if any."""
        for piece, weight_factor, bias_factor in self.folds:
            if piece in name and name.endswith((".weight", ".bias")):
                factor = weight_factor if name.endswith(".weight") else bias_factor
                if isinstance(factor, torch.Tensor) or factor != 1.0:
                    value = materialize(tensor)
                    if isinstance(factor, torch.Tensor):  # the mup vector, built on the host: to the tensor's device
                        factor = factor.to(value.device)
                    scale = factor[:, None] if isinstance(factor, torch.Tensor) and value.dim() == 2 else factor
                    return (value.float() * scale).to(value.dtype)
                break
        return tensor

    def _unfused(self, weights):
        for name, tensor in super()._unfused(weights):
            yield name, self._fold(name, tensor)

    def fold_adapter(self, module: str, lora_b: torch.Tensor) -> torch.Tensor:
        """An adapter's B of checkpoint module ``module`` scaled as that module's weight is (B A adds to the weight,
        so the rows of B take the weight's factor; A is shared)."""
        return self._fold(f"{module}.weight", lora_b)
