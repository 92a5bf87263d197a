"""JetMoE (``JetMoeForCausalLM``): a mixture of attention heads (a top-k router per token picking expert query and
output projections over shared K/V, the query heads of choice j attending over KV head h as transformers' ``repeat``
pairs them) and a mixture of SwiGLU experts with a router of its own, both with a bias; the layers' norms at eps 1e-6,
the final norm at ``rms_norm_eps``. Against transformers on the same random tiny weights (fp32, max abs diff < 1e-4):
a prefill and chunks + decode steps on both short-query attention paths, the experts' sync-free path, two
tensor-parallel ranks and two pipeline stages equal to one rank, and the engine's greedy tokens with n-gram chains and
trees from graphs equal to transformers' ``generate``. Each distinctive part broken once moves the logits; settings not
implemented are refused by name. The tiny model is built here (transformers' JetMoeConfig, random weights made
visible), not in conftest."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from specray.models import cpu_kernels
from specray.models.jetmoe import JetMoeAttention, JetMoeForCausalLM, JetMoeMLP, MixtureOfAttentionHeads
from specray.models.kv_cache import FullAttentionSpec
from specray.models.layers import RMSNorm
from specray.models.loader import load_model, read_config
from specray.models.moe import sync_free_experts
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_ranks_match_one_rank, chunked_logits, max_diff, mutated_logits,
    prompt, reference_logits)

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
SEED = 0
# 3 layers; 2 KV heads of 16 (two ranks split them), 4 attention experts and 4 MLP experts, top 2 (4 query heads a
# layer); a final-norm eps far from the layers' 1e-6, so that the layers' eps shows
TINY = dict(hidden_size=64, num_hidden_layers=3, num_key_value_heads=2, kv_channels=16, intermediate_size=32,
            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=0.5,
            initializer_range=0.05, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def build_tiny_jetmoe(path: Path, seed: int) -> Path:
    """transformers' JetMoeForCausalLM at :data:`TINY`'s sizes with random weights (the routers, biases and norms drawn
    away from their init, so that each shows), saved as transformers saves it, with conftest's tiny tokenizer."""
    from transformers import JetMoeConfig, JetMoeForCausalLM as HFJetMoe

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path)
    config = JetMoeConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          bos_token_id=None, **TINY)
    torch.manual_seed(seed)
    model = HFJetMoe(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("router.layer.weight"):  # routers far apart from one token to the next
                param.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):  # ones at init
                param.uniform_(0.5, 1.5)
            elif name.endswith(("mlp.bias", "experts.bias")):  # zeros at init
                param.normal_(0.0, 0.1)
            elif name.endswith(("input_linear.weight", "output_linear.weight")):
                param.normal_(0.0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_jetmoe_dir(tmp_path_factory) -> Path:
    return build_tiny_jetmoe(tmp_path_factory.mktemp("tiny_jetmoe"), seed=SEED)


@pytest.fixture(scope="module")
def reference(tiny_jetmoe_dir) -> torch.Tensor:
    return reference_logits(tiny_jetmoe_dir)


@pytest.mark.parametrize("path", ["batched", "own"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_jetmoe_dir, reference, monkeypatch, schedule, path):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps over shuffled blocks;
    short queries as the padded batch or one sequence at a time."""
    if path == "own":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    model = load_model(str(tiny_jetmoe_dir))
    assert isinstance(model, JetMoeForCausalLM)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn, JetMoeAttention) and isinstance(layer.mlp, JetMoeMLP)
    assert layer.self_attn.num_heads == 4 and layer.self_attn.attn.groups == 2
    assert model.kv_cache_specs() == [FullAttentionSpec(num_kv_heads=2, head_dim=16)] * 3
    assert layer.input_layernorm.eps == 1e-6 and model.model.norm.eps == 0.5
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def test_the_experts_sync_free_path_matches_transformers(tiny_jetmoe_dir, reference):
    """The MLP experts' sync-free path (what graph steps run) gives the same logits."""
    model = load_model(str(tiny_jetmoe_dir))
    with sync_free_experts():
        assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) < TOL


# ---- each distinctive part, broken on purpose ------------------------------------------------------------------------

def _attns(model) -> list[JetMoeAttention]:
    return [layer.self_attn for layer in model.model.layers]


def _moa_unrouted(monkeypatch) -> None:
    """Every token's attention takes experts 0 .. k-1, weighted as the router would weigh its own choice."""
    route = MixtureOfAttentionHeads.route

    def fixed(self, x):
        weights, ids = route(self, x)
        return weights, torch.arange(self.top_k, device=x.device).expand_as(ids)
    monkeypatch.setattr(MixtureOfAttentionHeads, "route", fixed)


def _moa_unweighted(monkeypatch) -> None:
    """The chosen attention experts' outputs summed with equal weights."""
    route = MixtureOfAttentionHeads.route

    def even(self, x):
        weights, ids = route(self, x)
        return torch.full_like(weights, 1.0 / self.top_k), ids
    monkeypatch.setattr(MixtureOfAttentionHeads, "route", even)


def _heads_interleaved(model) -> None:
    """Query heads grouped choice by choice before attending (head j * Hkv + h read as grouped with KV head
    (j * Hkv + h) // k): the interleaved pairing (repeat_interleave) in place of transformers' repeat."""
    for a in _attns(model):
        inner, hkv, k = a.attn.forward, a.num_kv_heads, a.top_k

        def choice_major(q, key, v, meta, inner=inner, hkv=hkv, k=k):
            t, d = q.shape[0], q.shape[-1]
            out = inner(q.reshape(t, hkv, k, d).transpose(1, 2).reshape(t, -1, d), key, v, meta)
            return out.view(t, k, hkv, d).transpose(1, 2).reshape(t, -1)
        a.attn.forward = choice_major


def _no_moa_bias(model) -> None:
    for a in _attns(model):
        a.experts.bias.data.zero_()


def _no_mlp_bias(model) -> None:
    for layer in model.model.layers:
        layer.mlp.bias.data.zero_()


def _mlp_softmax_over_all(model) -> None:
    """The MLP's router as Qwen3-MoE's: a softmax over every expert, the top k not renormalised."""
    for layer in model.model.layers:
        layer.mlp.family = dataclasses.replace(layer.mlp.family, routing="softmax")


def _layers_take_config_eps(model) -> None:
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            assert isinstance(norm, RMSNorm)
            norm.eps = model.config.rms_norm_eps


def _final_norm_default_eps(model) -> None:
    model.model.norm.eps = 1e-6


MUTATIONS = {"moa-unrouted": (_moa_unrouted, None), "moa-unweighted": (_moa_unweighted, None),
             "heads-interleaved": (None, _heads_interleaved), "no-moa-bias": (None, _no_moa_bias),
             "no-mlp-bias": (None, _no_mlp_bias), "mlp-softmax-over-all": (None, _mlp_softmax_over_all),
             "layers-take-config-eps": (None, _layers_take_config_eps),
             "final-norm-default-eps": (None, _final_norm_default_eps)}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_logits(tiny_jetmoe_dir, reference, monkeypatch, mutation):
    """Each distinctive part broken once (the MoA's routing and its weights, the query heads' pairing with the KV
    heads, both biases, the MLP's top-k softmax, the layers' fixed eps and the final norm's config eps): the logits
    move by more than a hundred times the tolerance."""
    patch, mutate = MUTATIONS[mutation]
    if patch is not None:
        patch(monkeypatch)
    assert max_diff(mutated_logits(tiny_jetmoe_dir, None, mutate), reference) > MOVED


# ---- what is refused -------------------------------------------------------------------------------------------------

def _set(field, value):
    def edit(config):
        setattr(config, field, value)
    return edit


@pytest.mark.parametrize("edit,match", [
    (_set("activation_function", "gelu"), r"activation_function='gelu' is not supported for model_type='jetmoe'"),
    (_set("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]}),
     r"quantization_config=.* is not supported for model_type='jetmoe'"),
    (_set("num_attention_heads", 2), r"num_attention_heads=2: JetMoE's query heads are .* = 4"),
], ids=["activation_function", "quantization_config", "num_attention_heads"])
def test_unsupported_settings_are_refused_by_name(tiny_jetmoe_dir, edit, match):
    config = read_config(str(tiny_jetmoe_dir))
    edit(config)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_jetmoe_dir), config=config)


def test_lora_is_refused(tiny_jetmoe_dir):
    from specray import LLM

    with pytest.raises(ValueError, match=r"enable_lora: LoRA adapters are not applied to jetmoe models"):
        LLM(model=str(tiny_jetmoe_dir), max_model_len=64, block_size=4, enable_lora=True)


# ---- ranks and stages ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2], ids=["tp2", "pp2"])
def test_two_ranks_match_one_rank(tiny_jetmoe_dir, tmp_path, stages):
    """Two tensor-parallel ranks (each one KV head, its rows of every attention expert's query projection and columns
    of its output projection, half the MLP experts' width; routers and biases replicated) or two pipeline stages:
    the last rank's logits equal one rank's."""
    assert_ranks_match_one_rank(tmp_path, [str(tiny_jetmoe_dir)], stages, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

def test_engine_greedy_equals_transformers_with_drafts_and_graphs(tiny_jetmoe_dir, no_host_sync):
    """``specray.LLM``'s greedy tokens equal transformers' ``generate``; so do they with n-gram chains verified
    eagerly and n-gram trees from graphs (on CPU their padded static inputs; both routers sync nothing with the
    host)."""
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_drafts_and_graphs_equal_transformers(tiny_jetmoe_dir, no_host_sync, 12)
