"""Kimi-Linear (``KimiLinearForCausalLM``: specray.models.kimi_linear, kimi_delta): Kimi Delta Attention layers (a
per-channel decay from a low-rank forget gate, short convs, a sigmoid-gated norm) among DeepSeek-V3's NoPE latent
attention, DeepSeek-V3's experts after a dense first layer, against transformers on the same random tiny weights
(fp32, max abs diff < 1e-4): one prefill long enough for several chunks of the chunked form, chunks then decode steps
with the recurrent state carried, two sequences batched, drafts replayed after verification; the chunked form equal
to the token scan; each part shown to matter (broken once, the comparison fails); the engine's greedy tokens with
n-gram chains (from graph steps) and trees equal transformers'; TP 2 equal to one rank; on a GPU, its logits equal
the CPU's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specray.models import kimi_delta
from specray.models.gated_deltanet import gated_delta_scan
from specray.models.kimi_linear import KimiLinearForCausalLM
from specray.models.loader import load_model
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    TOL, TP_WORKER, check_drafts_replayed, check_greedy_equals_transformers, check_long_prefill,
    check_lora_keeps_transformers_logits, check_lora_refused, check_ngram_replays_keep_greedy,
    check_prefill_chunks_and_decode, generate, greedy)
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_logits_on_the_gpu_equal_the_cpu, chunked_logits, max_diff, mutated_logits, prompt,
    reference_logits, run_ranks)

# layers: KDA, MLA (NoPE), KDA, KDA (the release's 1-based kda_layers / full_attn_layers); 4 KDA heads of 8 (2 a rank
# at TP 2), 4 latent-attention heads; a dense first MLP, then 8 experts in 2 groups with a shared one
KIMI = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=12, num_experts=8, num_experts_per_token=2, num_shared_experts=1, num_expert_group=2,
            topk_group=1, routed_scaling_factor=2.446, first_k_dense_replace=1, rms_norm_eps=1e-5,
            linear_attn_config=dict(head_dim=8, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 3, 4],
                                    full_attn_layers=[2]),
            initializer_range=0.1, bos_token_id=None, pad_token_id=None, eos_token_id=None)
LONG = 150  # a prefill of three 64-token chunks of the chunked form


def hf_kimi(seed: int = 0, **overrides):
    """transformers' tiny Kimi-Linear with every part made visible: norms, gated norms, A_log, dt_bias, the router
    and its correction bias random."""
    import transformers as tf

    config = tf.KimiLinearConfig(**{**dict(KIMI, vocab_size=300), **overrides})
    torch.manual_seed(seed)
    model = tf.KimiLinearForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("dt_bias"):
                param.normal_(0.0, 0.5)
            elif name.endswith("A_log"):
                param.uniform_(-1.0, 1.5)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="session")
def tiny_kimi_dir(tmp_path_factory) -> Path:
    """A model folder the engine loads (weights, config, a tiny tokenizer). The LM head is the embedding doubled, so
    greedy decoding falls into loops now and then and n-gram drafts are accepted in some steps, rejected in others."""
    from tests.conftest import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("kimi_linear")
    tok = build_tiny_tokenizer(path)
    hf = hf_kimi(0, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    with torch.no_grad():
        hf.get_input_embeddings().weight.mul_(2.0)
        hf.lm_head.weight.copy_(hf.get_input_embeddings().weight)
    hf.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def pair(tiny_kimi_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_kimi_dir, dtype=torch.float32).eval()
    return load_model(tiny_kimi_dir), hf


@pytest.fixture(scope="module")
def reference(tiny_kimi_dir):
    return reference_logits(tiny_kimi_dir)


def test_loads_both_kinds_of_layer(pair):
    from specray.models.deepseek_v3 import MLAttention
    from specray.models.moe import SparseMoE

    model, _ = pair
    assert isinstance(model, KimiLinearForCausalLM)
    layers = [layer for _, layer in model.model.stage_layers()]
    assert [hasattr(layer, "linear_attn") for layer in layers] == [True, False, True, True]
    assert isinstance(layers[1].self_attn, MLAttention)
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == [False, True, True, True]
    assert len(model.recurrent_state_specs()) == 3 and len(model.kv_cache_specs()) == 1


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_kimi_dir, reference, schedule):
    """model_checks' schedules: one prefill; chunks of 17, 9, 3 then decode steps (state in slot 0)."""
    got = chunked_logits(load_model(tiny_kimi_dir), prompt(), SCHEDULES[schedule])
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


def test_chunked_form_equals_the_scan():
    """The chunked form's outputs and kept states (host lists and device positions, -1 keeping the state given)
    equal the token scan's, with strong per-channel decays and padding rows (g = 0, beta = 0)."""
    gen = torch.Generator().manual_seed(0)
    b, length, h, dk, dv = 3, 150, 2, 8, 6
    q = torch.nn.functional.normalize(torch.randn(b, length, h, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, length, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, length, h, dv, generator=gen)
    g = -torch.rand(b, length, h, dk, generator=gen) * 3
    beta = torch.rand(b, length, h, generator=gen)
    g[2, 100:], beta[2, 100:] = 0.0, 0.0  # a shorter sequence's padding
    state = torch.randn(b, h, dk, dv, generator=gen)
    for keep in ([149, 70, 99], torch.tensor([5, -1, 130])):
        want = gated_delta_scan(q, k, v, g, beta, state, keep)
        got = kimi_delta.chunked_kimi_delta(q, k, v, g, beta, state, keep)
        assert max_diff(got[0], want[0]) < 1e-4 and max_diff(got[1], want[1]) < 1e-4


# ---- each part shown to matter ---------------------------------------------------------------------------------------

def _kda_layers(model):
    return [layer.linear_attn for _, layer in model.model.stage_layers() if hasattr(layer, "linear_attn")]


def _per_head_decay(model):  # each head's channels decayed by their mean: Gated DeltaNet's per-head scalar
    for attn in _kda_layers(model):
        real = attn._heads_and_gates

        def averaged(conv, real=real, attn=attn):
            q, k, v, g, beta = real(conv)
            g = g.view(*g.shape[:2], attn.heads, attn.dk)
            return q, k, v, g.mean(-1, keepdim=True).expand_as(g).reshape(*g.shape[:2], -1), beta
        attn._heads_and_gates = averaged


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


def _rope(model):  # the latent attention rotated by RoPE (DeepSeek-V3's), not NoPE
    from specray.models.layers import RotaryEmbedding, rope_parameters

    stack = model.model
    rotary = RotaryEmbedding(stack.half_rope * 2, rope_parameters(model.config, partial=True), 512)

    def tables(meta, dtype):
        rotary.ensure(meta.max_position + 1)
        pair = rotary(meta.positions, dtype)
        return lambda layer: pair
    stack.rope_tables = tables


@pytest.mark.parametrize("mutate", [_per_head_decay, _no_dt_bias, _no_conv_history, _silu_gated_norm, _rope],
                         ids=["per-channel-decay", "forget-gate", "conv", "gated-norm", "nope"])
def test_each_part_shows(tiny_kimi_dir, reference, mutate):
    """Broken once (a per-head decay, the forget gate without dt_bias, convs without history, a silu-gated norm,
    RoPE on the latent attention), the chunked + decode logits leave transformers' by far more than the tolerance."""
    assert max_diff(mutated_logits(tiny_kimi_dir, mutate=mutate), reference) > 100 * TOL


def test_layer_kinds_come_from_the_config(tiny_kimi_dir):
    """The kinds read 0-based (the release's lists are 1-based) put KDA where the checkpoint has latent attention:
    the weights do not fit, and loading says so."""
    from specray.models.loader import read_config

    config = read_config(str(tiny_kimi_dir))
    config.layer_types = ["full_attention", "linear_attention", "linear_attention", "linear_attention"]
    with pytest.raises(ValueError, match="does not fit|missing"):
        load_model(str(tiny_kimi_dir), config=config)
    config.layer_types = ["linear_attention", "bogus", "linear_attention", "linear_attention"]
    with pytest.raises(ValueError, match="layer_types="):
        load_model(str(tiny_kimi_dir), config=config)


# ---- the engine ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_greedy(tiny_kimi_dir):
    from specray import LLM

    outs = generate(LLM(model=str(tiny_kimi_dir), max_model_len=128), greedy())
    check_greedy_equals_transformers(tiny_kimi_dir, outs)
    return outs


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_ngram_greedy_equals_transformers(tiny_kimi_dir, plain_greedy, tree, monkeypatch):
    """Plain greedy equals transformers' (the fixture); n-gram chains and trees from graph steps (the trees' in the
    recurrence's tree form) give the same tokens, with drafts accepted and replayed (tests/hybrid_models.py)."""
    check_ngram_replays_keep_greedy(tiny_kimi_dir, plain_greedy, tree, monkeypatch)


def test_two_ranks_match_one(tiny_kimi_dir, tmp_path):
    """TP 2 over gloo (tests/hybrid_models.py's TP_WORKER: prefills, a verify chunk, the replay after it): the KDA
    heads (2 a rank), the latent-attention heads and the experts split; logits equal one rank's."""
    for r, result in enumerate(run_ranks(tmp_path / "ranks", TP_WORKER, 2, 2, [str(tiny_kimi_dir)], timeout=300)):
        for folder, (diff, heads) in result.items():
            assert diff < TOL and heads == 2, (r, folder, diff, heads)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_kimi_dir, schedule):
    """fp32 logits on CUDA equal the CPU's (model_checks' schedules: the prefill runs the chunked form)."""
    assert_logits_on_the_gpu_equal_the_cpu(tiny_kimi_dir, SCHEDULES[schedule])


# ---------------------------------------------------------------------------------------------- LoRA


def test_lora_adapted_logits_match_transformers_with_the_adapter_merged(tiny_kimi_dir, tmp_path):
    """LoRA on the latent attention's projections (DeepSeek-V3's), a KDA layer's q/k/v (parts of in_proj_qkv, each
    its own A), o_proj, b_proj and low-rank gates f_a / g_a / g_b, the dense MLP (its checkpoint's
    ``block_sparse_moe.gate_proj`` ...) and the shared experts; kv_b_proj (read as W_UK and W_UV) is refused, and
    so is f_b_proj (applied to the conv's output)."""
    leaves = ("q_proj", "k_proj", "v_proj", "o_proj", "kv_a_proj_with_mqa", "b_proj", "f_a_proj", "g_a_proj",
              "g_b_proj", "gate_proj", "up_proj", "down_proj")
    check_lora_keeps_transformers_logits(tiny_kimi_dir, tmp_path, leaves, "kv_b_proj")
    check_lora_refused(tiny_kimi_dir, tmp_path, "f_b_proj")
