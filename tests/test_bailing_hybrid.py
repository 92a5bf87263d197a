"""Ling 3.0 hybrid (``BailingHybridForCausalLM``: specray.models.bailing_hybrid): Kimi Delta Attention layers with a
full-rank bounded forget gate and a full-rank output gate among DeepSeek-V3's latent attention with interleaved RoPE and
a per-head output gate, DeepSeek-V3's experts after a dense first layer, against transformers on the same random tiny
weights (fp32, max abs diff < 1e-4): one prefill long enough for several chunks of the chunked form, chunks then decode
steps with the recurrent state carried, two sequences batched, drafts replayed after verification; each distinctive
part shown to matter (broken once, the comparison fails); the unbounded (softplus) forget gate; the engine's greedy
tokens with n-gram chains (from graph steps) and trees equal transformers'; TP 2 equal to one rank; on a GPU, its
logits equal the CPU's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specray.models.bailing_hybrid import BailingHybridForCausalLM
from specray.models.loader import load_model
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    TOL, TP_WORKER, check_drafts_replayed, check_greedy_equals_transformers, check_long_prefill,
    check_lora_keeps_transformers_logits, check_ngram_replays_keep_greedy, check_prefill_chunks_and_decode, generate,
    greedy)
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_logits_on_the_gpu_equal_the_cpu, chunked_logits, max_diff, mutated_logits, prompt,
    reference_logits, run_ranks)

# layers (layer_group_size 2): KDA, MLA, KDA, MLA; 4 heads of both kinds (2 a rank at TP 2), KDA heads 8 wide, the
# latent attention's RoPE 6 wide (so the two widths transformers' config keeps apart differ); a dense first MLP, then
# 8 experts in 2 groups with a shared one; a milder forget-gate bound than the release's -5, so that the state carries
# over more tokens
LING = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=6, qk_nope_head_dim=16,
            v_head_dim=12, head_dim=8, short_conv_kernel_size=4, layer_group_size=2, num_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.446,
            first_k_dense_replace=1, rms_norm_eps=1e-5, kda_lower_bound=-1.5, rope_theta=10000.0, num_mtp_layers=0,
            initializer_range=0.1, bos_token_id=None, pad_token_id=None, eos_token_id=None)
LONG = 150  # a prefill of three 64-token chunks of the chunked form


def hf_ling(seed: int = 0, **overrides):
    """transformers' tiny Ling 3.0 hybrid with every part made visible: norms, gated norms, A_log, dt_bias, the
    router and its correction bias random."""
    import transformers as tf

    config = tf.BailingHybridConfig(**{**dict(LING, vocab_size=300), **overrides})
    torch.manual_seed(seed)
    model = tf.BailingHybridForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("dt_bias"):
                param.normal_(-0.5, 0.5)
            elif name.endswith("A_log"):
                param.uniform_(-1.0, 1.5)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
            elif name.endswith("g_proj.weight"):
                param.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
    return model


def save_ling(path: Path, seed: int = 0, **overrides) -> Path:
    """A model folder the engine loads (weights, config, a tiny tokenizer). The LM head is the embedding doubled, so
    greedy decoding falls into loops now and then and n-gram drafts are accepted in some steps, rejected in others."""
    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    hf = hf_ling(seed, vocab_size=len(tok), eos_token_id=tok.eos_token_id, **overrides)
    with torch.no_grad():
        hf.get_input_embeddings().weight.mul_(2.0)
        hf.lm_head.weight.copy_(hf.get_input_embeddings().weight)
    hf.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_ling_dir(tmp_path_factory) -> Path:
    return save_ling(tmp_path_factory.mktemp("bailing_hybrid"))


@pytest.fixture(scope="module")
def pair(tiny_ling_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_ling_dir, dtype=torch.float32).eval()
    return load_model(tiny_ling_dir), hf


@pytest.fixture(scope="module")
def reference(tiny_ling_dir):
    return reference_logits(tiny_ling_dir)


def test_the_release_names_are_saved(tiny_ling_dir):
    """transformers saves the release's names (attention., dense, f_proj, q/k/v convs apart, expert_bias), which
    are what this port reads."""
    from safetensors import safe_open

    with safe_open(str(tiny_ling_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for name in ("model.word_embeddings.weight", "model.layers.0.attention.f_proj.weight",
                 "model.layers.0.attention.q_conv1d.weight", "model.layers.0.attention.dense.weight",
                 "model.layers.1.attention.g_proj.weight", "model.layers.1.mlp.gate.expert_bias"):
        assert name in names, sorted(names)


def test_loads_both_kinds_of_layer(pair):
    from specray.models.bailing_hybrid import BailingDeltaAttention, GatedLatentAttention
    from specray.models.moe import SparseMoE

    model, _ = pair
    assert isinstance(model, BailingHybridForCausalLM)
    layers = [layer for _, layer in model.model.stage_layers()]
    assert [hasattr(layer, "linear_attn") for layer in layers] == [True, False, True, False]
    assert isinstance(layers[0].linear_attn, BailingDeltaAttention)
    assert isinstance(layers[1].self_attn, GatedLatentAttention)
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == [False, True, True, True]
    assert len(model.recurrent_state_specs()) == 2 and len(model.kv_cache_specs()) == 2


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_ling_dir, reference, schedule):
    """model_checks' schedules: one prefill; chunks of 17, 9, 3 then decode steps (state in slot 0)."""
    got = chunked_logits(load_model(tiny_ling_dir), prompt(), SCHEDULES[schedule])
    assert max_diff(got, reference) < TOL


def test_long_prefill_runs_several_chunks(pair):
    """(check_long_prefill, tests/hybrid_models.py: 150 tokens, three chunks of the chunked form; then 70 + 80)"""
    check_long_prefill(*pair, LONG)


def test_prefill_chunks_and_decode_batched(pair):
    """(check_prefill_chunks_and_decode, tests/hybrid_models.py: two sequences in their own slots)"""
    check_prefill_chunks_and_decode(*pair)


def test_drafts_are_replayed_as_accepted(pair):
    """(check_drafts_replayed, tests/hybrid_models.py)"""
    check_drafts_replayed(*pair)


def test_the_unbounded_forget_gate(tmp_path):
    """kda_safe_gate off: Kimi's -exp(A_log) softplus(f + dt_bias) gate, in a prefill and in chunks + decode."""
    folder = save_ling(tmp_path, 1, kda_safe_gate=False)
    want = reference_logits(folder)
    for schedule in SCHEDULES.values():
        assert max_diff(chunked_logits(load_model(folder), prompt(), schedule), want) < TOL


# ---- each part shown to matter ---------------------------------------------------------------------------------------

def _kda_layers(model):
    return [layer.linear_attn for _, layer in model.model.stage_layers() if hasattr(layer, "linear_attn")]


def _mla_layers(model):
    return [layer.self_attn for _, layer in model.model.stage_layers() if not hasattr(layer, "linear_attn")]


def _per_head_decay(model):  # each head's channels decayed by their mean: Gated DeltaNet's per-head scalar
    for attn in _kda_layers(model):
        real = attn._heads_and_gates

        def averaged(conv, real=real, attn=attn):
            q, k, v, g, beta = real(conv)
            g = g.view(*g.shape[:2], attn.heads, attn.dk)
            return q, k, v, g.mean(-1, keepdim=True).expand_as(g).reshape(*g.shape[:2], -1), beta
        attn._heads_and_gates = averaged


def _unbounded_gate(model):  # Kimi's softplus forget gate in place of the bounded sigmoid one
    for attn in _kda_layers(model):
        attn.safe_gate = False


def _release_bound(model):  # the release's bound (-5) in place of the config's
    for attn in _kda_layers(model):
        attn.lower_bound = -5.0


def _no_dt_bias(model):  # the forget gate without its bias
    for attn in _kda_layers(model):
        attn.dt_bias.data.zero_()


def _no_conv_history(model):  # the q/k/v convs reading the newest input only
    for attn in _kda_layers(model):
        attn.conv1d.weight.data[: attn.qkv_channels, :-1] = 0.0


def _silu_gated_norm(model):  # Qwen3-Next's silu gate in the output norm
    for attn in _kda_layers(model):
        norm = attn.o_norm

        def silu_gated(x, gate, norm=norm):
            xf = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)
            return (norm.weight.float() * xf * torch.nn.functional.silu(gate.float())).to(x.dtype)
        norm.forward = silu_gated


def _no_attention_gate(model):  # the latent attention without its per-head output gate
    for attn in _mla_layers(model):
        attn.g_proj.weight.data.fill_(0.0)  # sigmoid(0) = 1/2 on every head
        attn.o_proj.weight.data.mul_(2.0)


def _nope(model):  # Kimi-Linear's NoPE latent attention: a rotation by 0
    stack = model.model

    def tables(meta, dtype):
        cos = torch.ones(meta.positions.shape[0], 1, stack.rotary_emb.head_dim // 2, dtype=dtype)
        return lambda layer: (cos, torch.zeros_like(cos))
    stack.rope_tables = tables


def _rope_on_halves(model):  # RoPE on halves, not interleaved pairs
    for attn in _mla_layers(model):
        attn.interleave = False


MUTATIONS = [_per_head_decay, _unbounded_gate, _release_bound, _no_dt_bias, _no_conv_history, _silu_gated_norm,
             _no_attention_gate, _nope, _rope_on_halves]


@pytest.mark.parametrize("mutate", MUTATIONS, ids=["per-channel-decay", "bounded-gate", "lower-bound", "forget-bias",
                                                   "conv", "gated-norm", "attention-gate", "rope", "interleave"])
def test_each_part_shows(tiny_ling_dir, reference, mutate):
    """Broken once (a per-head decay, Kimi's unbounded gate, another bound, the forget gate without dt_bias, convs
    without history, a silu-gated norm, the latent attention ungated, NoPE, RoPE on halves), the chunked + decode
    logits leave transformers' by far more than the tolerance."""
    assert max_diff(mutated_logits(tiny_ling_dir, mutate=mutate), reference) > 100 * TOL


def test_config_refusals(tiny_ling_dir):
    """Layer kinds that are not the model's, a positive forget-gate bound: actionable ValueErrors; kinds moved by
    one put KDA where the checkpoint has latent attention, and loading says the weights do not fit."""
    from specray.models.loader import read_config

    config = read_config(str(tiny_ling_dir))
    config.layer_types = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="does not fit|missing"):
        load_model(str(tiny_ling_dir), config=config)
    config = read_config(str(tiny_ling_dir))
    config.layer_types = ["linear_attention", "bogus", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer_group_size"):
        load_model(str(tiny_ling_dir), config=config)
    config = read_config(str(tiny_ling_dir))
    config.kda_lower_bound = 1.0
    with pytest.raises(ValueError, match="kda_lower_bound"):
        load_model(str(tiny_ling_dir), config=config)
    with pytest.raises(ValueError, match="ngram"):
        BailingHybridForCausalLM.mtp_layer_parts(config, None)


# ---- the engine ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_greedy(tiny_ling_dir):
    from specray import LLM

    outs = generate(LLM(model=str(tiny_ling_dir), max_model_len=128), greedy())
    check_greedy_equals_transformers(tiny_ling_dir, outs)
    return outs


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_ngram_greedy_equals_transformers(tiny_ling_dir, plain_greedy, tree, monkeypatch):
    """Plain greedy equals transformers' (the fixture); n-gram chains and trees from graph steps (the trees' in the
    recurrence's tree form) give the same tokens, with drafts accepted and replayed (tests/hybrid_models.py)."""
    check_ngram_replays_keep_greedy(tiny_ling_dir, plain_greedy, tree, monkeypatch)


def test_two_ranks_match_one(tiny_ling_dir, tmp_path):
    """TP 2 over gloo (tests/hybrid_models.py's TP_WORKER: prefills, a verify chunk, the replay after it): the KDA
    heads (2 a rank), the latent-attention heads and the experts split; logits equal one rank's."""
    for r, result in enumerate(run_ranks(tmp_path / "ranks", TP_WORKER, 2, 2, [str(tiny_ling_dir)], timeout=300)):
        for folder, (diff, heads) in result.items():
            assert diff < TOL and heads == 2, (r, folder, diff, heads)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_ling_dir, schedule):
    """fp32 logits on CUDA equal the CPU's (model_checks' schedules: the prefill runs the chunked form)."""
    assert_logits_on_the_gpu_equal_the_cpu(tiny_ling_dir, SCHEDULES[schedule])


# ---------------------------------------------------------------------------------------------- LoRA


def test_lora_adapted_logits_match_transformers_with_the_adapter_merged(tiny_ling_dir, tmp_path):
    """LoRA on the release's names: the latent attention's q_proj, kv_a_proj_with_mqa, its output gate g_proj and
    ``dense`` (o_proj), a KDA layer's q/k/v (parts of in_proj_qkv), ``dense``, b_proj and the full-rank gates f_proj
    and g_proj, the dense MLP and the shared experts; kv_b_proj (read as W_UK and W_UV) is refused by name."""
    leaves = ("q_proj", "k_proj", "v_proj", "dense", "kv_a_proj_with_mqa", "b_proj", "f_proj", "g_proj",
              "gate_proj", "up_proj", "down_proj")
    check_lora_keeps_transformers_logits(tiny_ling_dir, tmp_path, leaves, "kv_b_proj")
