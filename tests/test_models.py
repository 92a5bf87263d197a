"""Our Llama/Qwen2 implementation against transformers on the same weights (fp32, max abs diff < 1e-4):
prefill, decode, chunked prefill at every boundary, one mixed batch (prefill chunk + decode + drafts), paged
cache with small shuffled blocks, RoPE scaling variants, sliding windows, biases; tensor-parallel shards equal
one rank."""

from __future__ import annotations

import json
import random
import shutil
import socket
import textwrap
from pathlib import Path

import pytest
import torch

from specray.models import get_model_class
from specray.models import cpu_kernels
from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache, bytes_per_block
from specray.models.llama import LlamaForCausalLM
from specray.models.loader import load_model
from specray.parallel import TPGroup
import specray_test_checkpoints as checkpoints  # tests/checkpoints.py (registered by conftest)
import specray_test_model_checks as model_checks  # tests/model_checks.py (registered by conftest)

TOL = 1e-4
BLOCK = 4
MODEL_FIXTURES = ["tiny_llama_dir", "tiny_llama_untied_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_qwen3_moe_dir",
                  "tiny_gemma2_dir", "tiny_gemma3_dir", "tiny_deepseek_dir", "tiny_llama4_dir", "tiny_mixtral_dir",
                  "tiny_phi3_dir", "tiny_granite_dir"]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1, vocab_size=300,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)


class Paged:
    """Our model over a paged cache whose block tables are small, shuffled and non-contiguous (or, with
    ``contiguous``, runs of consecutive blocks, which attention may read in place)."""

    def __init__(self, model, num_blocks: int = 160, seed: int = 0, contiguous: bool = False):
        self.model = model
        self.cache = allocate_kv_cache(model, num_blocks, BLOCK)
        self.free = list(range(num_blocks))[::-1]
        if not contiguous:
            random.Random(seed).shuffle(self.free)

    def table(self, length: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-length // BLOCK))]

    @torch.no_grad()
    def step(self, chunks: list[tuple[list[int], int, list[int]]], **meta_kw) -> list[torch.Tensor]:
        """chunks: (new token ids, start position, block table) per sequence -> logits [q, V] per sequence;
        ``meta_kw``: explicit positions or ancestor masks for build_attention_metadata."""
        ids = torch.tensor([t for c in chunks for t in c[0]])
        meta = build_attention_metadata([len(c[0]) for c in chunks], [c[1] for c in chunks],
                                        [c[2] for c in chunks], BLOCK, "cpu", **meta_kw)
        logits = self.model.compute_logits(self.model(ids, meta))
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), self.model.config.vocab_size)
        return list(logits.split([len(c[0]) for c in chunks]))


def tokens(n: int, seed: int, vocab: int = 300) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_cache_kwarg(hf, cache) -> dict:
    """transformers' cache argument: ``cache`` where the model takes it (5.24 does), else ``past_key_values``."""
    import inspect

    return {"cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values": cache}


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()  # [L, V]


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    diff = (ours - ref).abs().max().item()
    assert diff < TOL, diff


def in_memory_pair(arch: str = "llama", seed: int = 0, **overrides):
    """(ours, transformers) sharing the weights of a random tiny model built in memory."""
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama, MistralConfig, MistralForCausalLM
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                              Gemma2Config, Gemma2ForCausalLM,
                              Gemma3ForCausalLM, Gemma3TextConfig, GraniteConfig, GraniteForCausalLM, Olmo2Config,
                              Olmo2ForCausalLM,
                              Llama4ForCausalLM, Llama4TextConfig, MixtralConfig, MixtralForCausalLM, Phi3Config,
                              Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, PhimoeConfig, PhimoeForCausalLM

    classes = {"llama": (LlamaConfig, HFLlama), "mistral": (MistralConfig, MistralForCausalLM),
               "mixtral": (MixtralConfig, MixtralForCausalLM), "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
               "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
               "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM), "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
               "gemma2": (Gemma2Config, Gemma2ForCausalLM),
               "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
               "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
               "llama4": (Llama4TextConfig, Llama4ForCausalLM), "phi3": (Phi3Config, Phi3ForCausalLM),
               "granite": (GraniteConfig, GraniteForCausalLM), "olmo2": (Olmo2Config, Olmo2ForCausalLM),
               "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM), "phimoe": (PhimoeConfig, PhimoeForCausalLM)}
    cfg_cls, model_cls = classes[arch]
    config = cfg_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    hf = model_cls(config).float().eval()
    with torch.no_grad():  # q/k norms start at ones, routers at zeros: random ones, so a test sees them misapplied
        for name, param in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
            elif name.endswith(("mlp.gate.weight", "feed_forward.router.weight", "shared_expert_gate.weight")):
                param.normal_(0.0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                param.normal_(0.0, 0.1)
            elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):  # Gemma's scale by 1 + w, w from 0
                param.normal_(0.0, 0.3)
            elif arch == "olmo2" and name.endswith("norm.weight"):  # ones at init: random, so a wrong slice shows
                param.uniform_(0.5, 1.5)
            elif arch == "glm4_moe" and name.endswith("_proj.bias"):  # zeros at init: random, so a lost one shows
                param.normal_(0.0, 0.3)
        for name, buffer in hf.named_buffers():  # transformers 5 keeps the correction bias as a buffer of zeros
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    ours = get_model_class(config)(config, TPGroup.single())
    ours.load_weights(hf.state_dict().items())
    return ours, hf


@pytest.fixture(params=["batched", "own-gathered", "own-in-place"])
def contiguous(request, monkeypatch) -> bool:
    """Which attention path short queries take: the padded batch (contexts here are short), or one sequence at
    a time (as on CPU at long contexts) with shuffled blocks gathered, or consecutive blocks read in place.
    Returns whether tables should be contiguous."""
    if request.param != "batched":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    return request.param == "own-in-place"


@pytest.fixture(scope="module", params=MODEL_FIXTURES)
def pair(request):
    from transformers import AutoModelForCausalLM

    folder = request.getfixturevalue(request.param)
    return load_model(str(folder)), AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------------ the three families


def test_full_prefill(pair):
    ours, hf = pair
    paged = Paged(ours)
    for n, seed in ((12, 1), (40, 2)):  # short (padded batched path) and long (per-sequence path)
        ids = tokens(n, seed)
        close(paged.step([(ids, 0, paged.table(n))])[0], hf_logits(hf, ids))


def test_decode_after_prefill(pair, contiguous):
    ours, hf = pair
    paged = Paged(ours, contiguous=contiguous)
    ids = tokens(24, 3)
    ref = hf_logits(hf, ids)
    table = paged.table(len(ids))
    close(paged.step([(ids[:7], 0, table)])[0], ref[:7])
    for p in range(7, len(ids)):
        close(paged.step([(ids[p : p + 1], p, table)])[0], ref[p : p + 1])


def test_chunked_prefill_every_boundary(pair, contiguous):
    ours, hf = pair
    paged = Paged(ours, num_blocks=256, contiguous=contiguous)
    ids = tokens(12, 4)
    ref = hf_logits(hf, ids)
    for split in range(1, len(ids)):
        table = paged.table(len(ids))
        close(paged.step([(ids[:split], 0, table)])[0], ref[:split])
        close(paged.step([(ids[split:], split, table)])[0], ref[split:])
    # long chunks: fresh long, continued long (gathered context + mask), continued short
    ids = tokens(48, 5)
    ref = hf_logits(hf, ids)
    table = paged.table(len(ids))
    for a, b in ((0, 20), (20, 37), (37, 48)):
        close(paged.step([(ids[a:b], a, table)])[0], ref[a:b])


def test_mixed_batch_in_one_forward(pair, contiguous):
    ours, hf = pair
    paged = Paged(ours, contiguous=contiguous)
    seqs = {name: tokens(n, 10 + i) for i, (name, n) in enumerate(
        [("A", 40), ("B", 10), ("C", 14), ("D", 30), ("E", 9), ("F", 12)])}
    refs = {name: hf_logits(hf, ids) for name, ids in seqs.items()}
    tables = {name: paged.table(len(ids)) for name, ids in seqs.items()}

    def chunk(name, a, b):
        return seqs[name][a:b], a, tables[name]

    first = {"A": (0, 20), "B": (0, 9), "C": (0, 10), "F": (0, 4)}
    second = {  # one forward: long continued chunk, decode, last token + 3 drafts, fresh long and short prefills,
        "B": (9, 10), "A": (20, 40), "D": (0, 30), "C": (10, 14), "F": (4, 12), "E": (0, 9)}  # continued short
    for plan in (first, second):
        outs = paged.step([chunk(name, a, b) for name, (a, b) in plan.items()])
        for (name, (a, b)), out in zip(plan.items(), outs):
            close(out, refs[name][a:b])


def test_uniform_batches_decode_and_drafts(pair, contiguous):
    """Equal query lengths in batch order take the no-gather layout: prefill, 1 + 5 drafts, single tokens."""
    ours, hf = pair
    paged = Paged(ours, contiguous=contiguous)
    seqs = [tokens(18, 20 + i) for i in range(4)]
    refs = [hf_logits(hf, ids) for ids in seqs]
    tables = [paged.table(18) for _ in seqs]
    for a, b in ((0, 10), (10, 16), (16, 17), (17, 18)):
        outs = paged.step([(ids[a:b], a, t) for ids, t in zip(seqs, tables)])
        for out, ref in zip(outs, refs):
            close(out, ref[a:b])


# ------------------------------------------------------------------------------------------ config variants


def check_variant(ours, hf, n: int = 44, contiguous: bool = False) -> None:
    paged = Paged(ours, contiguous=contiguous)
    ids = tokens(n, 30)
    ref = hf_logits(hf, ids)
    close(paged.step([(ids, 0, paged.table(n))])[0], ref)
    table = paged.table(n)
    for a, b in ((0, 3), (3, 21), (21, 38), (38, 39), (39, 44)):
        close(paged.step([(ids[a:b], a, table)])[0], ref[a:b])


ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
                    "mscale": 0.9, "mscale_all_dim": 0.5, "truncate": False},
    "theta": {"rope_type": "default", "rope_theta": 500.0},
}


@pytest.mark.parametrize("name", sorted(ROPE_VARIANTS))
def test_rope_scaling_variants(name):
    params = {"rope_theta": 10000.0, **ROPE_VARIANTS[name]}
    check_variant(*in_memory_pair("llama", seed=5, rope_parameters=params))


def test_yarn_takes_the_configs_own_original_length_first():
    """A config's own original_max_position_embeddings (beside a YaRN rope_scaling without one) is the pretrained
    length, as transformers' standardize_rope_params takes it over the max_position_embeddings a fresh config fills
    rope_parameters with (we rotated by that: far from transformers' logits)."""
    from transformers import LlamaConfig

    def kwargs():  # (transformers' model fills in the dict it is given)
        return {**TINY, "original_max_position_embeddings": 16,
                "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}

    config = LlamaConfig(**kwargs())  # as read from a config.json: rope_parameters hold the 1024 of max_position...
    assert config.rope_parameters["original_max_position_embeddings"] == 1024
    _, hf = in_memory_pair("llama", seed=5, **kwargs())
    ours = LlamaForCausalLM(config, TPGroup.single())
    ours.load_weights(hf.state_dict().items())
    check_variant(ours, hf)


def test_dynamic_ntk_rope_matches_token_by_token_past_max_position():
    from transformers import DynamicCache

    params = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    ours, hf = in_memory_pair("llama", seed=6, max_position_embeddings=16, rope_parameters=params)
    ids = tokens(30, 31)
    paged = Paged(ours)
    close(paged.step([(ids[:16], 0, paged.table(16))])[0], hf_logits(hf, ids[:16]))  # within: plain RoPE
    cache, table = DynamicCache(config=hf.config), paged.table(len(ids))
    with torch.no_grad():
        for p, t in enumerate(ids):  # transformers rescales as the sequence grows: compare step by step
            ref = hf(torch.tensor([[t]]), position_ids=torch.tensor([[p]]), **hf_cache_kwarg(hf, cache)).logits[0]
            close(paged.step([([t], p, table)])[0], ref)


def test_mistral_sliding_window(contiguous):
    ours, hf = in_memory_pair("mistral", seed=7, sliding_window=5)
    assert all(spec.mask_kind.window == 5 for spec in ours.kv_cache_specs())
    check_variant(ours, hf, contiguous=contiguous)


def test_qwen3_sliding_window_layers(contiguous):
    ours, hf = in_memory_pair("qwen3", seed=9, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                              head_dim=24)
    assert [spec.mask_kind.window for spec in ours.kv_cache_specs()] == [None, 6]
    check_variant(ours, hf, contiguous=contiguous)


MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[1],
           head_dim=24)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_matches_transformers(contiguous, norm_topk_prob):
    """Qwen3-MoE: layer 0 sparse (8 experts, top 2), layer 1 dense (mlp_only_layers); a full prefill and a prefill
    chunked at odd boundaries give transformers' logits; the router picks transformers' experts."""
    ours, hf = in_memory_pair("qwen3_moe", seed=6, norm_topk_prob=norm_topk_prob, **MOE)
    from specray.models.moe import SparseMoE

    assert isinstance(ours.model.layers[0].mlp, SparseMoE) and not isinstance(ours.model.layers[1].mlp, SparseMoE)
    check_variant(ours, hf, contiguous=contiguous)
    check_router(ours, hf, 0, MOE["num_experts"], seed=2)


def check_router(ours, hf, layer: int, num_experts: int, seed: int) -> None:
    """Our router of ``layer`` picks transformers' experts, every one of them for some token, with its weights."""
    x = torch.randn(30, TINY["hidden_size"], generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        _, weights, ids = hf.model.layers[layer].mlp.gate(x)
        our_weights, our_ids = ours.model.layers[layer].mlp.route(x)
    assert torch.equal(our_ids, ids) and len(set(ids.flatten().tolist())) == num_experts
    close(our_weights, weights)


def check_unordered_router(ours, hf, layer: int = 1) -> torch.Tensor:
    """Our router of ``layer`` picks transformers' experts for each token, in any order (DeepSeek's top k comes
    unsorted), with their weights; returns transformers' ids, sorted per token."""
    x = torch.randn(40, TINY["hidden_size"], generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, weights, ids = hf.model.layers[layer].mlp.gate(x)
        our_weights, our_ids = ours.model.layers[layer].mlp.route(x)
    order, our_order = ids.sort(-1), our_ids.sort(-1)
    assert torch.equal(our_order.values, order.values)
    close(our_weights.gather(1, our_order.indices), weights.gather(1, order.indices))
    return order.values


MIXTRAL = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)


@pytest.mark.parametrize("window", [None, 6])
def test_mixtral_matches_transformers(contiguous, window):
    """Mixtral: every layer sparse (8 experts, top 2, always renormalised), optionally a sliding window on every
    layer: a full prefill and a chunked one give transformers' logits; the router picks transformers' experts."""
    ours, hf = in_memory_pair("mixtral", seed=9, sliding_window=window, **MIXTRAL)
    from specray.models.moe import SparseMoE

    assert all(isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers)
    check_variant(ours, hf, contiguous=contiguous)
    check_router(ours, hf, 1, MIXTRAL["num_local_experts"], seed=3)


QWEN2_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 decoder_sparse_step=1, mlp_only_layers=[1])


PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
                 "short_factor": [1.0, 1.2, 1.9, 2.8, 4.1, 6.0, 7.5, 9.0],
                 "long_factor": [1.1, 2.0, 4.5, 8.0, 13.0, 21.0, 30.0, 41.0]}
PHI3_VARIANTS = {
    "plain": {},
    "window": dict(sliding_window=6),
    "partial": dict(rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "longrope": dict(max_position_embeddings=4096, original_max_position_embeddings=64, rope_parameters=PHI3_LONGROPE,
                     max_model_len=64),
    "longrope-partial": dict(max_position_embeddings=512, original_max_position_embeddings=64, max_model_len=64,
                             rope_parameters={**PHI3_LONGROPE, "short_factor": PHI3_LONGROPE["short_factor"][:4],
                                              "long_factor": PHI3_LONGROPE["long_factor"][:4],
                                              "partial_rotary_factor": 0.5}),
}


def test_phimoe_longrope_scales_cos_sin_by_its_mscales():
    """Phi-3.5-MoE's LongRoPE scales cos and sin by the release's ``short_mscale`` / ``long_mscale`` (1.243 in
    Phi-3.5-MoE-instruct, not the sqrt(1 + ln s / ln L0) = 1.190 Phi-3 computes): transformers' logits with the short
    factors, and the long factors' scale where the model serves past the pretrained length."""
    import math

    from specray.models.layers import _longrope_inv_freq

    rope = {**PHI3_LONGROPE, "short_mscale": 1.3, "long_mscale": 1.7, "original_max_position_embeddings": 64}
    ours, hf = in_memory_pair("phimoe", seed=22, num_local_experts=4, max_position_embeddings=4096,
                              original_max_position_embeddings=64, max_model_len=64, rope_parameters=rope)
    check_variant(ours, hf)
    assert _longrope_inv_freq({**rope, "max_model_len": 128}, 16, 4096)[1] == 1.7
    assert _longrope_inv_freq({**PHI3_LONGROPE, "original_max_position_embeddings": 64}, 16, 4096)[1] == \
        pytest.approx(math.sqrt(1 + math.log(64) / math.log(64)))


@pytest.mark.parametrize("variant", sorted(PHI3_VARIANTS))
def test_phi3_matches_transformers(contiguous, variant):
    """Phi-3 (its checkpoint's fused qkv_proj and gate_up_proj split as they load): plain, a sliding window, partial
    RoPE (Phi-4-mini's: half of each head rotated), LongRoPE's short factors with its attention scale, and both
    together give transformers' logits on a full and a chunked prefill."""
    ours, hf = in_memory_pair("phi3", seed=21, **PHI3_VARIANTS[variant])
    assert any(".qkv_proj." in n for n in hf.state_dict()) and any(".gate_up_proj." in n for n in hf.state_dict())
    check_variant(ours, hf, contiguous=contiguous)


@pytest.mark.parametrize("variant", ["longrope", "longrope-partial"])
def test_phi3_longrope_serving_past_the_pretrained_length_uses_the_long_factors(variant):
    """Served for sequences longer than ``original_max_position_embeddings`` (``max_model_len`` 64 > 12), LongRoPE
    rotates every position with its long factors: transformers' logits for a prompt longer than 12 tokens (which
    it rotates with them), and not for one within 12 (rotated with the short ones there)."""
    overrides = {**PHI3_VARIANTS[variant], "original_max_position_embeddings": 12, "max_model_len": 64}
    ours, hf = in_memory_pair("phi3", seed=22, **overrides)
    check_variant(ours, hf)
    paged, ids = Paged(ours), tokens(10, 33)
    assert (paged.step([(ids, 0, paged.table(10))])[0] - hf_logits(hf, ids)).abs().max() > 1e-3


GRANITE = dict(embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0)


@pytest.mark.parametrize("multipliers", ["granite", "ones"])
def test_granite_matches_transformers(contiguous, multipliers):
    """Granite: the embedding, the attention's scale, each block's output into the residual stream and the logits
    scaled by its config's multipliers (Granite 3.0's values, and all ones), on a full and a chunked prefill."""
    chosen = GRANITE if multipliers == "granite" else dict.fromkeys(GRANITE, 1.0)
    check_variant(*in_memory_pair("granite", seed=25, **chosen), contiguous=contiguous)


def test_olmo2_matches_transformers(contiguous):
    """OLMo 2: post-norm layers (each block's output normed before it joins the stream) and q/k RMS-normed over all
    heads at once (random norm weights, so a per-head norm or a wrong slice shows); a full and a chunked prefill."""
    check_variant(*in_memory_pair("olmo2", seed=26), contiguous=contiguous)


def test_phi3_checkpoint_that_does_not_fit_its_config_is_named():
    ours, hf = in_memory_pair("phi3", seed=23)
    state = dict(hf.state_dict())
    name = "model.layers.1.self_attn.qkv_proj.weight"
    state[name] = state[name][:-4]
    with pytest.raises(ValueError, match=rf"{name} has 124 rows where its config's heads and widths make 128"):
        ours.load_weights(state.items())


@pytest.mark.parametrize("qkv_bias,norm_topk_prob", [(True, False), (False, True)])
def test_qwen2_moe_matches_transformers(contiguous, qkv_bias, norm_topk_prob):
    """Qwen2-MoE: layer 0 sparse (8 experts, top 2) with a shared expert scaled by its per-token sigmoid gate, layer 1
    dense; q/k/v biases as the config says: a full prefill and a chunked one give transformers' logits."""
    ours, hf = in_memory_pair("qwen2_moe", seed=10, qkv_bias=qkv_bias, norm_topk_prob=norm_topk_prob, **QWEN2_MOE)
    from specray.models.moe import SparseMoE

    assert isinstance(ours.model.layers[0].mlp, SparseMoE) and not isinstance(ours.model.layers[1].mlp, SparseMoE)
    assert (ours.model.layers[0].self_attn.qkv_proj.bias is not None) == qkv_bias
    check_variant(ours, hf, contiguous=contiguous)


def test_qwen3_moe_loads_per_expert_and_fused_checkpoints(tmp_path):
    """HF checkpoints name each expert's projections (``mlp.experts.{e}.gate_proj.weight``); transformers 5 keeps
    them fused (``mlp.experts.gate_up_proj`` [E, 2I, H]): both load to the same model; a missing expert is named."""
    ours, hf = in_memory_pair("qwen3_moe", seed=6, **MOE)
    state = hf.state_dict()
    per_expert = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name[: -len("gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                per_expert[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :inter]
                per_expert[f"{prefix}{e}.up_proj.weight"] = tensor[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(tensor.shape[0]):
                per_expert[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = tensor[e]
        else:
            per_expert[name] = tensor
    assert any(".experts.7.up_proj." in n for n in per_expert)
    again = LlamaForCausalLM(ours.config, TPGroup.single())
    again.load_weights(per_expert.items())
    for (name, a), (_, b) in zip(ours.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name
    missing = {n: t for n, t in per_expert.items() if ".experts.3.down_proj." not in n}
    with pytest.raises(ValueError, match=r"missing 1 weights.*w2:3"):
        LlamaForCausalLM(ours.config, TPGroup.single()).load_weights(missing.items())


def test_qwen3_moe_experts_must_split_over_the_ranks():
    from specray.models.moe import SparseMoE
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(**{**TINY, **MOE, "num_experts": 6, "moe_intermediate_size": 30})
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by tensor_parallel_size=4"):
        SparseMoE(config, TPGroup(rank=0, size=4), expert_parallel=True)
    with pytest.raises(ValueError, match="moe_intermediate_size=30 is not divisible by tensor_parallel_size=4"):
        SparseMoE(config, TPGroup(rank=0, size=4))
    # more experts a token than there are: named at build (it was torch's 'selected index k out of range' at the
    # first forward)
    config = Qwen3MoeConfig(**{**TINY, **MOE, "num_experts": 4, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 must be between 1 and the 4 experts \(num_experts\)"):
        SparseMoE(config, TPGroup.single())


GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
             layer_types=["sliding_attention", "full_attention"],
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}})


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_gemma3_matches_transformers(contiguous, softcap):
    """Gemma 3 text: (1 + w) norms around attention and MLP, q/k norms, a scaled embedding, query_pre_attn_scalar,
    a sliding layer (window 6, local RoPE) beside a global one (linear-scaled RoPE), tied embeddings, and final
    logit softcapping; a full prefill and a chunked one against transformers."""
    ours, hf = in_memory_pair("gemma3", seed=10, final_logit_softcapping=softcap, **GEMMA)
    from specray.models.gemma3 import Gemma3ForCausalLM

    assert isinstance(ours, Gemma3ForCausalLM) and ours.tie_word_embeddings
    assert [spec.mask_kind.window for spec in ours.kv_cache_specs()] == [6, None]
    check_variant(ours, hf, contiguous=contiguous)


def test_gemma3_unsupported_settings_are_named():
    from transformers import Gemma3TextConfig

    from specray.models.gemma3 import Gemma3ForCausalLM

    for bad, match in (({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
                       ({"hidden_activation": "relu"}, "hidden_activation='relu'"),
                       ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
                       # flat settings, to which transformers' config adds its per-kind defaults (then rotating by
                       # those; we rotated every kind by the flat ones)
                       ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                        r"rope_parameters mixes settings per kind of layer \(\['full_attention', "
                        r"'sliding_attention'\]\) with settings for every layer \(\['factor', 'rope_theta', "
                        r"'rope_type'\]\)")):
        with pytest.raises(ValueError, match=match):
            Gemma3ForCausalLM(Gemma3TextConfig(**{**TINY, **GEMMA, **bad}))


GEMMA2 = dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=6)
GEMMA2_CAPS = dict(attn_logit_softcapping=1.0, final_logit_softcapping=2.0)
NO_CAPS = dict(attn_logit_softcapping=None, final_logit_softcapping=None)


@pytest.mark.parametrize("caps", ["both", "attention", "final", "none"])
def test_gemma2_matches_transformers(contiguous, caps):
    """Gemma 2 (sliding, full, sliding layers; a window of 6) with either soft cap alone, both, none: a full prefill
    of 44 tokens (past the window) and a chunked one give transformers' logits."""
    chosen = {"both": GEMMA2_CAPS, "attention": {**NO_CAPS, "attn_logit_softcapping": 1.0},
              "final": {**NO_CAPS, "final_logit_softcapping": 2.0}, "none": NO_CAPS}[caps]
    ours, hf = in_memory_pair("gemma2", seed=22, **GEMMA2, **chosen)
    assert [spec.mask_kind.window for spec in ours.kv_cache_specs()] == [6, None, 6]
    assert all(layer.self_attn.q_norm is None for layer in ours.model.layers)
    check_variant(ours, hf, contiguous=contiguous)


def test_gemma2_ignoring_a_cap_would_fail(contiguous):
    """The caps matter here: our model with either one dropped is far from transformers' (so the test above would
    fail if a cap were ignored), and with both kept equals it."""
    ours, hf = in_memory_pair("gemma2", seed=22, **GEMMA2, **GEMMA2_CAPS)
    paged = Paged(ours, contiguous=contiguous)
    ids = tokens(30, 7)
    ref = hf_logits(hf, ids)
    close(paged.step([(ids, 0, paged.table(len(ids)))])[0], ref)
    for layer in ours.model.layers:
        layer.self_attn.attn.softcap = None
    assert (paged.step([(ids, 0, paged.table(len(ids)))])[0] - ref).abs().max() > 0.1
    for layer in ours.model.layers:
        layer.self_attn.attn.softcap = GEMMA2_CAPS["attn_logit_softcapping"]
    ours.final_logit_softcapping = None
    assert (paged.step([(ids, 0, paged.table(len(ids)))])[0] - ref).abs().max() > 0.1


def test_explicit_attention_with_a_soft_cap_is_sdpa_with_capped_scores():
    """GQA (query head h reads KV head h // G, as SDPA's ``enable_gqa``), a bool mask, an additive one and
    ``is_causal``: under a cap too large to bite it equals SDPA; under a small one, the scores' definition."""
    import torch.nn.functional as F

    from specray.models.attention import explicit_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 8, generator=gen) * 2 for h in (6, 2, 2))
    bool_mask = torch.rand(2, 1, 5, 5, generator=gen) > 0.3
    bool_mask[..., 0] = True  # every row sees a key
    additive = torch.zeros(5, 5).masked_fill(~bool_mask[0, 0], float("-inf"))
    for mask, causal in ((bool_mask, False), (additive, False), (None, True), (None, False)):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=0.3, enable_gqa=True)
        got = explicit_attention(q, k, v, mask, 0.3, 1e6, is_causal=causal)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    kr, vr = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    scores = (2.0 * torch.tanh(q @ kr.transpose(-1, -2) * 0.3 / 2.0)).masked_fill(~bool_mask, float("-inf"))
    torch.testing.assert_close(explicit_attention(q, k, v, bool_mask, 0.3, 2.0), scores.softmax(-1) @ vr)


def test_softcapped_forward_has_no_host_sync(tiny_gemma2_dir, no_host_sync):
    """One forward over both attention paths (a fresh prefill of 20 on its own, a decode and 3 drafts in the
    padded batch) with soft caps asks the host for no tensor's value (on a GPU: no sync, as a graph's capture
    needs)."""
    paged = Paged(load_model(str(tiny_gemma2_dir)))
    t1, t2 = paged.table(20), paged.table(8)
    paged.step([(tokens(4, 1), 0, t2)])
    meta, ids = build_attention_metadata([20, 4], [0, 4], [t1, t2], BLOCK, "cpu"), torch.tensor(tokens(24, 2))
    with torch.inference_mode(), no_host_sync():
        paged.model(ids, meta)


@pytest.mark.parametrize("bad,match", [
    ({"attn_logit_softcapping": -1.0}, r"attn_logit_softcapping=-1.0 must be a positive number, or null"),
    ({"hidden_activation": "relu"}, "hidden_activation='relu' is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, r"layer_types\[1\]")])
def test_gemma2_unsupported_settings_are_named(bad, match):
    from transformers import Gemma2Config

    from specray.models.gemma2 import Gemma2ForCausalLM

    with pytest.raises(ValueError, match=match):
        Gemma2ForCausalLM(Gemma2Config(**{**TINY, **GEMMA2, **bad}))


DEEPSEEK = dict(initializer_range=0.05, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
                num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
                routed_scaling_factor=2.5,
                kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                num_key_value_heads=4, rope_interleave=True,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                                 "mscale": 1.0, "mscale_all_dim": 1.0})


DEEPSEEK_V2 = {k: v for k, v in DEEPSEEK.items() if k not in ("n_group", "topk_group", "rope_interleave")}


@pytest.mark.parametrize("variant", ["lite", "group-limited"])
def test_deepseek_v2_matches_transformers(contiguous, variant):
    """DeepSeek-V2 (V2-Lite: a plain q_proj and the greedy top k; V2: q LoRA and the top k from the best group):
    DeepSeek-V3's latent attention with its RoPE pairs interleaved (V2 rotates them as complex numbers), YaRN with
    mscale, a dense first layer then MoE layers whose router takes the top k of a softmax over every expert, times
    routed_scaling_factor, unnormalised; a full prefill and a chunked one against transformers; the router picks
    transformers' experts with its weights."""
    extra = {"lite": dict(q_lora_rank=None, topk_method="greedy"),
             "group-limited": dict(topk_method="group_limited_greedy", n_group=4, topk_group=1)}[variant]
    ours, hf = in_memory_pair("deepseek_v2", seed=13, **{**DEEPSEEK_V2, **extra})
    check_variant(ours, hf, contiguous=contiguous)
    chosen = check_unordered_router(ours, hf)
    if variant == "group-limited":  # one group of two allowed: the greedy top 2 differ for some tokens
        hf.model.layers[1].mlp.gate.topk_method = "greedy"
        x = torch.randn(40, TINY["hidden_size"], generator=torch.Generator().manual_seed(4))  # the same tokens
        with torch.no_grad():
            assert not torch.equal(hf.model.layers[1].mlp.gate(x)[2].sort(-1).values, chosen)


@pytest.mark.parametrize("variant", ["q-lora", "no-q-lora", "not-interleaved", "unabsorbed prefill"])
def test_deepseek_v3_matches_transformers(contiguous, variant):
    """DeepSeek-V3: MLA over a latent paged cache (q LoRA or a plain q_proj, interleaved RoPE pairs or not, YaRN with
    mscale), weight-absorbed, or unabsorbed for every sequence attended on its own (prefill chunks; at this size the
    threshold is 112 new tokens, so the other variants run absorbed throughout), a dense first layer then MoE layers
    (grouped sigmoid router with the correction bias, shared experts, routed scaling); a full prefill and a chunked
    one against transformers; the router picks transformers' experts."""
    from specray.models.deepseek_v3 import LatentAttention, unabsorbed_threshold

    extra = {"no-q-lora": {"q_lora_rank": None}, "not-interleaved": {"rope_interleave": False}}.get(variant, {})
    ours, hf = in_memory_pair("deepseek_v3", seed=12, **{**DEEPSEEK, **extra})
    layers = [m for m in ours.modules() if isinstance(m, LatentAttention)]
    assert [m.unabsorbed_from for m in layers] == [unabsorbed_threshold(16, 16, 12)] * 3 == [112] * 3
    calls = []
    if variant == "unabsorbed prefill":
        for m in layers:
            m.unabsorbed_from = 1
            m._unabsorbed = lambda *args, run=m._unabsorbed: calls.append(1) or run(*args)
    from specray.models.kv_cache import MLAAttentionSpec
    from specray.models.moe import SparseMoE

    assert all(spec == MLAAttentionSpec(16, 8) for spec in ours.kv_cache_specs())
    assert [isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers] == [False, True, True]
    check_variant(ours, hf, contiguous=contiguous)
    assert bool(calls) == (variant == "unabsorbed prefill")
    check_unordered_router(ours, hf)


def test_deepseek_v3_without_shared_experts_matches_transformers():
    """n_shared_experts=0: no shared MLP (transformers builds one 0 wide; ours was one expert wide, and loading
    transformers' empty tensors into it failed: 'start (0) + length (32) exceeds dimension size (0)')."""
    ours, hf = in_memory_pair("deepseek_v3", seed=12, **{**DEEPSEEK, "n_shared_experts": 0})
    assert all(getattr(layer.mlp, "shared_experts", None) is None for layer in ours.model.layers)
    ids = tokens(12, 3)
    paged = Paged(ours)
    close(paged.step([(ids, 0, paged.table(len(ids)))])[0], hf_logits(hf, ids))


# GLM-4.5 at a tiny size: a dense first layer, then experts under DeepSeek-V3's grouped router; q/k/v biases, q/k
# norms, a head_dim apart from hidden_size / heads, half of each head rotated (the config's default)
GLM4_MOE = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                topk_group=2, n_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=2.5, head_dim=24,
                attention_bias=True, use_qk_norm=True)
GLM4_MOE_VARIANTS = {
    "glm-4.5": {},
    # GLM-4.5-Air's shape of it: no q/k norms, one group (the plain top k of the biased scores), more shared width
    "air": dict(use_qk_norm=False, n_group=1, topk_group=1, n_shared_experts=2),
    "not-renormalised": dict(norm_topk_prob=False, partial_rotary_factor=0.75),
}


def interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over interleaved pairs (GLM-4's dense models' layout) of the first 2 * cos.shape[-1] features."""
    r = 2 * cos.shape[-1]
    x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., r:]), dim=-1)


@pytest.mark.parametrize("variant", list(GLM4_MOE_VARIANTS))
def test_glm4_moe_matches_transformers(contiguous, variant):
    """GLM-4.5: grouped-query attention with q/k/v biases (none on o_proj), optional q/k norms and partial RoPE in the
    rotate-half layout, a dense first layer then MoE layers (DeepSeek-V3's sigmoid router with the correction bias over
    groups, shared experts, routed scaling); a full prefill and a chunked one against transformers; the router picks
    transformers' experts with their weights."""
    from specray.models.glm4_moe import Glm4MoeAttention, Glm4MoeForCausalLM
    from specray.models.kv_cache import FullAttentionSpec
    from specray.models.moe import SparseMoE

    extra = dict(GLM4_MOE_VARIANTS[variant])
    factor = extra.pop("partial_rotary_factor", 0.5)
    ours, hf = in_memory_pair("glm4_moe", seed=28, **{**GLM4_MOE, **extra},
                              rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": factor})
    assert type(ours) is Glm4MoeForCausalLM
    assert [isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers] == [False, True, True]
    assert all(isinstance(layer.self_attn, Glm4MoeAttention) and layer.self_attn.o_proj.bias is None
               and (layer.self_attn.q_norm is None) == (variant == "air") for layer in ours.model.layers)
    assert ours.model.rotary_emb.head_dim == int(24 * factor)
    assert all(spec == FullAttentionSpec(num_kv_heads=2, head_dim=24) for spec in ours.kv_cache_specs())
    check_variant(ours, hf, contiguous=contiguous)
    check_unordered_router(ours, hf)


def test_glm4_moe_test_fails_without_the_correction_bias_or_the_partial_half_split_rope(monkeypatch):
    """The comparison above can fail: our model with the routers' correction bias zeroed, with every feature of each
    head rotated, or with the rotated part's pairs interleaved, each differs from transformers."""
    from specray.models import llama
    from specray.models.layers import RotaryEmbedding, rope_parameters

    ours, hf = in_memory_pair("glm4_moe", seed=28, **GLM4_MOE)
    check_variant(ours, hf)
    for layer in ours.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.data.zero_()
    with pytest.raises(AssertionError):
        check_variant(ours, hf)
    ours, hf = in_memory_pair("glm4_moe", seed=28, **GLM4_MOE)
    whole = RotaryEmbedding(24, rope_parameters(hf.config, partial=True), hf.config.max_position_embeddings)
    ours.model.rotary_emb, half = whole, ours.model.rotary_emb
    with pytest.raises(AssertionError):
        check_variant(ours, hf)
    ours.model.rotary_emb = half
    monkeypatch.setattr(llama, "apply_rotary", interleaved_rotary)
    with pytest.raises(AssertionError):
        check_variant(ours, hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_and_rmsnorm_equal_transformers_bit_for_bit(dtype):
    """Our RoPE rotation (the halves as a dimension of two, cos and sin broadcast over it) and RMSNorm (one
    ``F.rms_norm``, the weight's multiply after) give transformers' Llama values bit for bit on the CPU in each dtype:
    the forms with fewer kernels change no value."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from specray.models.layers import RMSNorm, apply_rotary

    gen = torch.Generator().manual_seed(0)
    t, heads, d, width = 9, 4, 64, 96
    q, k = (torch.randn(t, heads, d, generator=gen).to(dtype) for _ in range(2))
    freqs = torch.randn(t, d // 2, generator=gen) * 5
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    # transformers': q, k [B, H, T, D] and the cos / sin of the whole head [B, T, D]
    want = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], torch.cat((cos, cos), -1)[None],
                                torch.cat((sin, sin), -1)[None])
    for ours, theirs in zip((q, k), want):
        assert torch.equal(apply_rotary(ours, cos[:, None], sin[:, None]), theirs[0].transpose(0, 1))
    x = torch.randn(t, width, generator=gen).mul(3).to(dtype)
    norm, reference = RMSNorm(width, 1e-6).to(dtype), LlamaRMSNorm(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=gen))
        reference.weight.copy_(norm.weight)
    assert torch.equal(norm(x), reference(x))


LLAMA4 = dict(num_hidden_layers=4, head_dim=16, no_rope_layers=[1, 1, 1, 0], attention_chunk_size=8,
              interleave_moe_layer_step=2, num_local_experts=4, num_experts_per_tok=1, intermediate_size=32,
              intermediate_size_mlp=64, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def test_llama4_and_gemma2_lengths_and_caps_of_zero_are_named():
    """Settings of 0 that would divide by zero or give NaN logits: Llama-4's chunk size and temperature-tuning floor,
    Gemma 2's final soft cap."""
    from transformers import Gemma2Config, Llama4TextConfig

    for cls, base, bad, match in (
            (Llama4TextConfig, LLAMA4, {"attention_chunk_size": 0}, "attention_chunk_size=0 must be a positive"),
            (Llama4TextConfig, LLAMA4, {"floor_scale": 0}, "floor_scale=0 must be a positive number"),
            (Gemma2Config, GEMMA2, {"final_logit_softcapping": 0.0}, "final_logit_softcapping=0.0 must be a positive")):
        config = cls(**{**TINY, **base, **bad})
        with pytest.raises(ValueError, match=match):
            get_model_class(config)(config, TPGroup.single())


@pytest.mark.parametrize("variant", ["qk-norm", "no-qk-norm", "top-2"])
def test_llama4_matches_transformers(contiguous, variant):
    """Llama-4 text: chunked local attention on the RoPE layers (chunks of 8), interleaved-pair llama3 RoPE, q/k L2
    norms, a NoPE layer with attention temperature tuning (floor_scale 4: the scale steps within the prompt),
    dense and MoE layers interleaved (sigmoid router scaling the experts' input, a shared expert); a full prefill
    and a chunked one against transformers; the router picks transformers' experts."""
    extra = {"no-qk-norm": {"use_qk_norm": False}, "top-2": {"num_experts_per_tok": 2}}.get(variant, {})
    ours, hf = in_memory_pair("llama4", seed=17, **{**LLAMA4, **extra})
    from specray.models.moe import SparseMoE

    assert [spec.mask_kind.chunk for spec in ours.kv_cache_specs()] == [8, 8, 8, None]
    assert [isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers] == [False, True, False, True]
    check_variant(ours, hf, contiguous=contiguous)
    x = torch.randn(30, TINY["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        scores, _ = hf.model.layers[1].feed_forward.router(x)  # [T, E]: sigmoid at the chosen, 0 elsewhere
        weights, ids = ours.model.layers[1].mlp.route(x)
    chosen = torch.zeros_like(scores).scatter_(1, ids, weights)
    close(chosen, scores)


def test_qwen2_sliding_window_layers(contiguous):
    ours, hf = in_memory_pair("qwen2", seed=8, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert [spec.mask_kind.window for spec in ours.kv_cache_specs()] == [None, 6]
    check_variant(ours, hf, contiguous=contiguous)


@pytest.mark.parametrize("arch,kind", [("qwen3", "chunked_attention"), ("qwen2", "linear_attention")])
def test_a_layer_kind_qwen_does_not_have_is_named(arch, kind):
    """A layer_types entry other than full or sliding attention (transformers fails on it) is refused by name; it
    was attended as a full layer."""
    from transformers import Qwen2Config, Qwen3Config

    config = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch](
        **{**TINY, "use_sliding_window": True, "sliding_window": 5, "layer_types": ["sliding_attention", kind]})
    with pytest.raises(ValueError, match=rf"layer_types\[1\]='{kind}' is not supported for model_type='{arch}'"):
        get_model_class(config)(config, TPGroup.single())


def test_attention_plan_reads_consecutive_blocks_in_place(monkeypatch):
    """Short queries go to the padded batch at short contexts and one at a time at long ones (on CPU); a
    sequence whose blocks are consecutive is read as one view, any other is gathered."""
    plan = build_attention_metadata([1, 3], [40, 30], [list(range(3, 14)), [20, 22, 21, 23, 24, 25, 26, 27, 28]], 4)
    assert plan.short is not None and plan.short.num_seqs == 2 and not plan.own
    monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 30)
    plan = build_attention_metadata([1, 3, 20], [40, 30, 0], [list(range(3, 14)), [20, 22, 21, 23, 24, 25, 26, 27, 28],
                                                             [30, 31, 32, 33, 34]], 4)
    assert plan.short is None and [s.token_start for s in plan.own] == [0, 1, 4]
    assert plan.own[0].first_slot == 12 and plan.own[0].block_index is None
    assert plan.own[1].first_slot is None and plan.own[1].block_index.tolist() == [20, 22, 21, 23, 24, 25, 26, 27, 28]
    assert plan.own[2].fresh and plan.own[2].first_slot is None and plan.own[2].block_index is None
    assert not build_attention_metadata([1], [40], [list(range(11))], 4, "meta").own  # batched off the CPU
    monkeypatch.undo()  # the default threshold: the longest context decides (the padded batch pads to it)
    mixed = build_attention_metadata([1, 1], [cpu_kernels.OWN_MIN_CONTEXT, 10], [list(range(200)), [300, 301, 302]], 4)
    assert mixed.short is None and len(mixed.own) == 2


def test_llama_biases_and_explicit_head_dim():
    ours, hf = in_memory_pair("llama", seed=9, attention_bias=True, mlp_bias=True, head_dim=32,
                              tie_word_embeddings=False)
    assert ours.model.layers[0].self_attn.o_proj.bias is not None
    check_variant(ours, hf)


def test_kv_heads_that_do_not_group_the_query_heads_are_named():
    """4 query heads over 3 KV heads: a ValueError naming both fields and the counts that fit (an AssertionError
    '(4, 3)' from the attention layer before)."""
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not a multiple of num_key_value_heads=3.*"
                                         r"one of \[1, 2, 4\]"):
        LlamaForCausalLM(LlamaConfig(**{**TINY, "num_key_value_heads": 3}), TPGroup.single())


# ------------------------------------------------------------------------------------------ KV cache and masks


def test_kv_cache_spec_bytes_per_block_and_groups():
    """Each spec's bytes per block; the cache sums them over layers and shares one tensor per slot shape."""
    from specray.models.kv_cache import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCache, MLAAttentionSpec,
                                         SlidingWindowSpec)

    full = FullAttentionSpec(num_kv_heads=2, head_dim=16, kv_head_start=2)
    window = SlidingWindowSpec(num_kv_heads=2, head_dim=16, sliding_window=8)
    chunked = ChunkedLocalAttentionSpec(num_kv_heads=2, head_dim=16, attention_chunk_size=32)
    mla = MLAAttentionSpec(kv_lora_rank=512, qk_rope_head_dim=64)
    assert full.bytes_per_block(16, torch.float32) == 2 * 2 * 16 * 16 * 4  # (k, v) * Hkv * bs * D * fp32
    assert window.bytes_per_block(16, torch.bfloat16) == chunked.bytes_per_block(16, torch.bfloat16) == 2 * 2 * 16 * 16 * 2
    assert mla.bytes_per_block(16, torch.bfloat16) == 16 * (512 + 64) * 2  # one latent + rope key, no v
    assert full.kv_head_range == (2, 2) and window.mask_kind.window == 8 and chunked.mask_kind.chunk == 32
    specs = [full, window, mla, chunked, full]  # a draft head's extra layer is one more full spec
    assert bytes_per_block(specs, 4, torch.float32) == sum(x.bytes_per_block(4, torch.float32) for x in specs)
    cache = KVCache(specs, 3, 4, torch.float32, "cpu")
    assert cache.bytes_per_block() == bytes_per_block(specs, 4, torch.float32)
    assert cache.layer(0).shape == (2, 2, 12, 16) and cache.layer(2).shape == (12, 576)
    storages = {cache.layer(i).untyped_storage().data_ptr() for i in range(5)}
    assert len(storages) == 2  # attention layers share one tensor, the latent layer has its own


def test_copy_slots_moves_every_layers_kv_and_decode_goes_on(contiguous):
    """A chain's K/V moved to other blocks in one call (every layer) equals the original, and decoding from the
    new block table still matches transformers; overlapping moves read every source before writing."""
    from specray.models.kv_cache import slots_of

    ours, hf = in_memory_pair("llama", seed=3)
    paged = Paged(ours, contiguous=contiguous)
    ids = tokens(20, 40)
    ref = hf_logits(hf, ids)
    old = paged.table(20)
    close(paged.step([(ids[:13], 0, old)])[0], ref[:13])
    new = paged.table(20)
    src, dst = (torch.tensor(slots_of(t, range(13), BLOCK)) for t in (old, new))
    before = paged.cache.snapshot(src)
    paged.cache.copy_slots(src, dst)
    for a, b in zip(before, paged.cache.snapshot(dst)):
        assert torch.equal(a, b) and a.shape == (2, 2, 13, 16)  # [(k, v), Hkv, n, D]
    for p in range(13, 20):
        close(paged.step([(ids[p : p + 1], p, new)])[0], ref[p : p + 1])
    layer0 = paged.cache.layer(0).clone()
    shift_src, shift_dst = torch.arange(0, 8), torch.arange(2, 10)
    paged.cache.copy_slots(shift_src, shift_dst)
    layer0[:, :, 2:10] = layer0[:, :, 0:8].clone()
    assert torch.equal(paged.cache.layer(0), layer0)


def dense_attention(q, k, v, allowed, scale):
    # q: [n, Hq, D]; k, v: [m, Hkv, D]; allowed: [n, m] bool -> [n, Hq*D]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = torch.einsum("nhd,mhd->hnm", q, k) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hnm,mhd->nhd", probs, v).reshape(q.shape[0], -1)


@pytest.mark.parametrize("kind", ["chunked", "window"])
def test_local_masks_match_a_dense_reference(contiguous, kind):
    """Chunked-local (and sliding-window) attention over a paged cache, prefill then a mixed step (decode, last
    token + drafts, a long continued chunk), equals dense attention under the mask written out by hand."""
    from specray.models.attention import PagedAttention
    from specray.models.kv_cache import ChunkedLocalAttentionSpec, KVCache, SlidingWindowSpec

    spec = (ChunkedLocalAttentionSpec(num_kv_heads=2, head_dim=8, attention_chunk_size=5) if kind == "chunked"
            else SlidingWindowSpec(num_kv_heads=2, head_dim=8, sliding_window=6))

    def allowed(qp: int, kp: int) -> bool:
        local = kp // 5 == qp // 5 if kind == "chunked" else kp > qp - 6
        return kp <= qp and local

    attn = PagedAttention(4, spec, 8**-0.5)
    free = list(range(64)) if contiguous else random.Random(1).sample(range(64), 64)
    cache = KVCache([spec], 64, BLOCK, torch.float32, "cpu")
    attn.bind_cache(cache.layer(0), BLOCK)
    gen = torch.Generator().manual_seed(0)
    lens = [24, 11, 40]
    full = [(torch.randn(n, 4, 8, generator=gen), torch.randn(n, 2, 8, generator=gen),
             torch.randn(n, 2, 8, generator=gen)) for n in lens]  # q, k, v of every position
    tables = [[free.pop() for _ in range(-(-n // BLOCK))] for n in lens]
    for step in ([(0, 9), (0, 7), (0, 12)], [(9, 10), (7, 11), (12, 40)]):  # prefill, then decode/drafts/long
        meta = build_attention_metadata([b - a for a, b in step], [a for a, _ in step], tables, BLOCK)
        q, k, v = (torch.cat([full[i][j][a:b] for i, (a, b) in enumerate(step)]) for j in range(3))
        outs = attn(q, k, v, meta).split([b - a for a, b in step])
        for (a, b), out, (fq, fk, fv) in zip(step, outs, full):
            mask = torch.tensor([[allowed(qp, kp) for kp in range(b)] for qp in range(a, b)])
            torch.testing.assert_close(out, dense_attention(fq[a:b], fk[:b], fv[:b], mask, 8**-0.5))


def test_ancestor_mask_equal_to_causal_keeps_the_logits(contiguous):
    """An explicit per-sequence ancestor mask that equals causal reproduces the causal logits, on the padded
    short path (last token + drafts) and one sequence at a time (a long chunk, a fresh prefill)."""
    ours, hf = in_memory_pair("llama", seed=4)
    paged = Paged(ours, contiguous=contiguous)
    a, b = tokens(30, 50), tokens(22, 51)
    refs = hf_logits(hf, a), hf_logits(hf, b)
    ta, tb = paged.table(30), paged.table(22)

    def causal(n):
        return torch.ones(n, n, dtype=torch.bool).tril()

    outs = paged.step([(a[:8], 0, ta), (b, 0, tb)], ancestors=[causal(8), causal(22)])
    close(outs[0], refs[0][:8])
    close(outs[1], refs[1])
    outs = paged.step([(a[8:14], 8, ta)], ancestors=[causal(6)])  # last token + 5 drafts
    close(outs[0], refs[0][8:14])
    outs = paged.step([(a[14:30], 14, ta)], ancestors=[causal(16)])
    close(outs[0], refs[0][14:30])


def test_ancestor_mask_with_siblings_matches_each_branch(contiguous):
    """Two children of one token at the same position (a tree of drafts): with an ancestor mask, each sees the
    context, its parent and itself, and its logits equal transformers' on its own branch as a chain."""
    ours, hf = in_memory_pair("llama", seed=6)
    paged = Paged(ours, contiguous=contiguous)
    ids, chain = tokens(12, 52), tokens(16, 53)
    other = (ids[10] + 1) % 300
    table, chain_table = paged.table(13), paged.table(16)
    paged.step([(ids[:9], 0, table), (chain[:10], 0, chain_table)])
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    out_chain, out = paged.step([(chain[10:16], 10, chain_table), ([ids[9], ids[10], other], 9, table)],
                                positions=list(range(10, 16)) + [9, 10, 10], ancestors=[None, tree])
    close(out[:2], hf_logits(hf, ids[:11])[9:11])
    close(out[2:], hf_logits(hf, ids[:10] + [other])[10:])
    close(out_chain, hf_logits(hf, chain)[10:16])  # a plain chain beside the tree, in the same padded batch


def test_positions_apart_from_slots_match_transformers(contiguous):
    """Tokens written to slots in shuffled order, each with its own RoPE position (masks compare positions,
    not slots): each row's logits equal transformers' at that token's position, short and long chunks."""
    ours, hf = in_memory_pair("qwen2", seed=5)
    paged = Paged(ours, contiguous=contiguous)
    ids = tokens(40, 60)
    ref = hf_logits(hf, ids)
    table = paged.table(40)
    rng = random.Random(0)
    for a, b in ((0, 10), (10, 16), (16, 36), (36, 37)):
        order = list(range(a, b))
        rng.shuffle(order)
        out = paged.step([([ids[p] for p in order], a, table)], positions=order)[0]
        close(out, ref[order])


# ------------------------------------------------------------------------------------------ the model interface


def test_aux_layers_equal_transformers_hidden_states(contiguous):
    """forward(..., aux_layers) returns the residual stream entering those layers, equal to transformers'
    output_hidden_states[i], over a chunked prefill; the final hidden states are unchanged by asking."""
    from specray.models.interface import CausalLM

    ours, hf = in_memory_pair("llama", seed=10, num_hidden_layers=6)
    assert isinstance(ours, CausalLM)
    num_layers = 6
    aux_layers = (2, num_layers // 2, num_layers - 3, 0, 5)
    paged = Paged(ours, contiguous=contiguous)
    ids = tokens(30, 70)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # (L + 1) x [1, n, H]
        assert torch.equal(ours.embed(torch.tensor(ids)), ref[0][0])
    table = paged.table(30)
    for a, b in ((0, 20), (20, 26), (26, 27)):
        meta = build_attention_metadata([b - a], [a], [table], BLOCK)
        with torch.no_grad():
            hidden, aux = ours(torch.tensor(ids[a:b]), meta, aux_layers=aux_layers)
        assert len(aux) == len(aux_layers)
        for i, got in zip(aux_layers, aux):
            close(got, ref[i][0, a:b])
        close(ours.compute_logits(hidden), hf_logits(hf, ids)[a:b])
    with pytest.raises(ValueError, match="aux_layers"):
        ours(torch.tensor(ids[:1]), build_attention_metadata([1], [0], [table], BLOCK), aux_layers=(6,))


# ------------------------------------------------------------------------------------------ plumbing


def test_registry():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, XLNetConfig

    for cfg in (LlamaConfig(), MistralConfig(), Qwen2Config(architectures=["Qwen2ForCausalLM"]),
                Qwen3Config(architectures=["Qwen3ForCausalLM"]), Qwen3Config()):
        assert get_model_class(cfg) is LlamaForCausalLM
    from transformers import DeepseekV3Config, Gemma3TextConfig, Llama4TextConfig, Qwen3MoeConfig

    from specray.models.deepseek_v3 import DeepseekV3ForCausalLM
    from specray.models.gemma3 import Gemma3ForCausalLM
    from specray.models.llama4 import Llama4ForCausalLM

    assert get_model_class(DeepseekV3Config()) is DeepseekV3ForCausalLM
    assert get_model_class(Llama4TextConfig()) is Llama4ForCausalLM

    assert get_model_class(Qwen3MoeConfig()) is LlamaForCausalLM
    assert get_model_class(Gemma3TextConfig()) is Gemma3ForCausalLM
    assert get_model_class(Gemma3TextConfig(architectures=["Gemma3ForCausalLM"])) is Gemma3ForCausalLM
    from transformers import Gemma2Config, Phi3Config

    from specray.models.gemma2 import Gemma2ForCausalLM

    assert get_model_class(Gemma2Config()) is Gemma2ForCausalLM
    assert get_model_class(Gemma2Config(architectures=["Gemma2ForCausalLM"])) is Gemma2ForCausalLM
    assert get_model_class(Phi3Config()) is LlamaForCausalLM
    from transformers import GraniteConfig

    assert get_model_class(GraniteConfig()) is LlamaForCausalLM
    from transformers import Glm4MoeConfig

    from specray.models.glm4_moe import Glm4MoeForCausalLM

    assert get_model_class(Glm4MoeConfig()) is Glm4MoeForCausalLM
    assert get_model_class(Glm4MoeConfig(architectures=["Glm4MoeForCausalLM"])) is Glm4MoeForCausalLM
    with pytest.raises(ValueError, match="XLNetLMHeadModel.*LlamaForCausalLM"):
        get_model_class(XLNetConfig(architectures=["XLNetLMHeadModel"]))


def test_kv_cache_sizing_and_errors():
    ours, _ = in_memory_pair("llama")
    with pytest.raises(ValueError, match="allocate_kv_cache"):
        ours(torch.tensor([1, 2]), build_attention_metadata([2], [0], [[0]], 4))
    per_block = bytes_per_block(ours.kv_cache_specs(), 16, torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # layers * (k, v) * bs * Hkv * D * fp32
    assert allocate_kv_cache(ours, 3, 16).bytes_per_block() == per_block
    assert ours.model.layers[0].self_attn.attn.k_cache.shape == (2, 3 * 16, 16)  # [Hkv, num_blocks * block_size, D]
    with pytest.raises(ValueError, match="block table has 1 blocks"):
        build_attention_metadata([5], [0], [[0]], 4)
    with pytest.raises(ValueError, match="equal length"):
        build_attention_metadata([5, 1], [0], [[0, 1]], 4)


def test_missing_weight_is_reported():
    ours, hf = in_memory_pair("llama")
    state = {k: v for k, v in hf.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match="up_proj"):
        ours.load_weights(state.items())


@pytest.mark.parametrize("smaller,match", [
    ({"num_key_value_heads": 1}, r"shape \(32, 64\) does not fit parameter of shape \(16, 64\)"),  # k_proj's rows
    ({"intermediate_size": 96}, r"shape \(128, 64\) does not fit parameter of shape \(96, 64\)"),  # gate_proj's
    ({"head_dim": 8}, r"shape \(64, 64\) does not fit parameter of shape \(32, 64\)")],  # q_proj's rows
    ids=["kv_heads", "intermediate_size", "head_dim"])
def test_a_checkpoint_wider_than_its_config_is_refused(smaller, match):
    """A config with fewer KV heads, a narrower MLP or a smaller head_dim than the checkpoint's tensors: refused (the
    projections read the first rows / columns of the larger tensors and served a wrong model)."""
    from transformers import LlamaConfig

    _, hf = in_memory_pair("llama")
    ours = LlamaForCausalLM(LlamaConfig(**{**TINY, **smaller}), TPGroup.single())
    with pytest.raises(ValueError, match=match):
        ours.load_weights(hf.state_dict().items())


def test_experts_wider_than_the_config_are_refused():
    """Qwen3-MoE's experts 32 wide read by a config saying 16: refused (their first 16 rows were read)."""
    from transformers import Qwen3MoeConfig

    _, hf = in_memory_pair("qwen3_moe", seed=6, **MOE)
    config = Qwen3MoeConfig(**{**TINY, **MOE, "moe_intermediate_size": 16})
    with pytest.raises(ValueError, match=r"shape \(32, 64\) does not fit an expert's gate_proj of "
                                         r"moe_intermediate_size=16"):
        get_model_class(config)(config, TPGroup.single()).load_weights(hf.state_dict().items())


# ------------------------------------------------------------------------------------------ tensor parallel

TP_WORKER = textwrap.dedent("""
    import gc, json, os, sys
    import torch, torch.distributed as dist
    from specray.models import cpu_kernels
    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import allocate_kv_cache
    from specray.models.loader import load_model
    from specray.parallel import TPGroup

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    folders = sys.argv[5:]
    torch.set_num_threads(1)
    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    threads_before = threads()
    cpu_kernels.FP8_EXPERTS = True  # FP8 releases' experts kept in FP8, as on a GPU
    cpu_kernels.INT4_WEIGHTS = True  # 4-bit releases' linears kept in 4 bits, as on a GPU
    import torch.distributed.nn  # noqa: F401  before init: see join_tp_group (workers/worker.py)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    @torch.no_grad()
    def run(model):
        allocate_kv_cache(model, 32, 4)
        ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
        t1, t2 = [5, 3, 9, 1, 7, 2, 8, 4, 6], [10, 11, 12, 13, 14, 15]  # shuffled (gathered), consecutive
        meta = build_attention_metadata([20, 7], [0, 0], [t1, t2], 4)
        h1 = model(torch.tensor(ids[:20] + ids[20:27]), meta)
        meta = build_attention_metadata([4, 1], [20, 7], [t1, t2], 4)
        h2 = model(torch.tensor(ids[27:31] + ids[31:32]), meta)
        return model.compute_logits(torch.cat([h1, h2]))

    def rounded_per_rank(model):
        # a model's 8-bit row-parallel linears computed as `world` ranks compute their shares, by hand: each share of
        # a row's input rounded to the format over that share's own scale, the shares' products summed
        from specray.models.layers import RowParallelLinear
        from specray.models.w8a8 import W8A8Linear, quantize_rows

        def shares(kept):
            def matmul(x):
                out = 0
                for xs, ws in zip(x.chunk(world, -1), kept.weight.chunk(world, -1)):
                    xq, s = quantize_rows(xs, kept.fmt, kept.input_scale)  # (a static release's scale)
                    out = out + (xq.float() * s) @ (ws.float() * kept.scale.reshape(-1, 1)).t()
                return out.to(x.dtype)
            return matmul

        for m in model.modules():
            if isinstance(m, RowParallelLinear) and isinstance(m.kept, W8A8Linear):
                m.kept.matmul = shares(m.kept)
        return model

    result = {}
    for folder in folders:  # a folder named *-ep: a mixture of experts split by whole experts
        # a dense llama-*-rows release's linears kept in 8 bits (W8A8), as on a GPU
        # (and one quantized to FP8 as it loads: vLLM's online quantization="fp8")
        online = "fp8" if folder.endswith("-online-fp8") else None
        cpu_kernels.FP8_WEIGHTS = cpu_kernels.INT8_WEIGHTS = "llama-" in folder and folder.endswith(("-rows", "-fp8"))
        model = load_model(folder, TPGroup.from_world(), expert_parallel=folder.endswith("-ep"), quantization=online)
        kv_heads = getattr(model.kv_cache_specs()[0], "num_kv_heads", 1)  # MLA: one latent, replicated
        one_rank = run(rounded_per_rank(load_model(folder, quantization=online)))
        diff = (run(model) - one_rank).abs().max().item()
        cpu_kernels.OWN_MIN_CONTEXT = 0  # the decode step attends one sequence at a time (in place where it can)
        own_diff = (run(model) - one_rank).abs().max().item()
        cpu_kernels.OWN_MIN_CONTEXT = 1 << 30
        fp8 = any(getattr(m, "fp8_block", None) for m in model.modules())  # experts kept in float8
        int4 = any(getattr(m, "kept", None) is not None for m in model.modules())  # linears kept quantized
        int4_experts = any(getattr(m, "int4_group", None) for m in model.modules())  # experts kept in 4 bits
        result[folder] = [max(diff, own_diff), model.lm_head.weight.shape[0], kv_heads, fp8, int4, int4_experts]
    # While anything holds the process group (the model's layers), destroy_process_group leaves gloo's threads
    # running into interpreter shutdown, where one still freeing a collective's tensors aborts the process.
    del model
    gc.collect()
    dist.destroy_process_group()
    result["threads"] = [threads_before, threads()]  # gloo's threads joined: none left behind
    json.dump(result, open(f"{out}/{rank}.json", "w"))
""")


def save_tiny(path: Path, arch: str, seed: int, **overrides) -> str:
    _, hf = in_memory_pair(arch, seed=seed, **overrides)
    hf.save_pretrained(path)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


W8A8_TOL = 0.05  # a rank's share of a row-parallel input rounded a step apart from one rank's (a wrong scale: ~0.3)


def test_tensor_parallel_shards_match_one_rank(tmp_path):
    """TP 2 over gloo: KV heads split (2 KV heads) and replicated (1 KV head), odd vocab sizes (padded shards),
    biases in q/k/v, o_proj (row parallel, added once) and the MLP, Qwen3's q/k norms over each head (replicated),
    Qwen3-MoE's experts split by width and (expert parallel) by whole experts, Gemma 3's sandwich layers and two
    RoPEs, DeepSeek-V3's latent attention split by head (the latent replicated) and its experts both ways, Llama-4's
    chunked and NoPE layers and its experts both ways, Mixtral's experts whole per rank, Gemma 2's soft-capped
    attention (one KV head, replicated), OLMo 2's q/k norms over all heads (summed over the ranks), Phi-3's fused
    projections split into each rank's heads and widths (with partial LongRoPE), GLM-4.5's biased q/k/v with q/k
    norms and partial RoPE and its experts both ways, GPTQ and AWQ releases (AWQ's kept in 4 bits; an AWQ mixture's
    experts kept in 4 bits whole per rank, dequantized where split into partial groups), a row-scaled FP8 release
    kept in FP8 (also with static activation scales), an INT8 W8A8 one in INT8, a block-scaled FP8 one kept in FP8
    (each rank's share whole blocks) and a full-precision one quantized to FP8 by the ranks as they load (each rank
    rounding its share of a row-parallel input, as one rank does it by hand) and a mixture's experts scaled by row
    kept in FP8 split by width, tied and untied heads;
    decode attention both as the padded batch and one sequence at a time."""
    folders = [save_tiny(tmp_path / "llama", "llama", 11, vocab_size=323, attention_bias=True, mlp_bias=True),
               save_tiny(tmp_path / "qwen2", "qwen2", 12, vocab_size=321, num_key_value_heads=1,
                         tie_word_embeddings=True),
               save_tiny(tmp_path / "qwen3", "qwen3", 13, vocab_size=321, head_dim=24),
               save_tiny(tmp_path / "qwen3moe", "qwen3_moe", 14, vocab_size=321, **MOE),
               save_tiny(tmp_path / "qwen3moe-ep", "qwen3_moe", 14, vocab_size=321, **MOE),
               save_tiny(tmp_path / "gemma3", "gemma3", 15, vocab_size=321, **GEMMA),
               save_tiny(tmp_path / "deepseek", "deepseek_v3", 16, vocab_size=321, **DEEPSEEK),
               save_tiny(tmp_path / "deepseek-ep", "deepseek_v3", 16, vocab_size=321, **DEEPSEEK),
               save_tiny(tmp_path / "llama4", "llama4", 17, vocab_size=321, **LLAMA4),
               save_tiny(tmp_path / "llama4-ep", "llama4", 17, vocab_size=321, **LLAMA4),
               save_tiny(tmp_path / "mixtral-ep", "mixtral", 18, vocab_size=321, **MIXTRAL),
               save_tiny(tmp_path / "qwen2moe", "qwen2_moe", 19, vocab_size=321, **QWEN2_MOE),
               save_tiny(tmp_path / "phi3", "phi3", 20, vocab_size=321, **PHI3_VARIANTS["longrope-partial"]),
               save_tiny(tmp_path / "gemma2", "gemma2", 23, vocab_size=321, num_key_value_heads=1, **GEMMA2,
                         **GEMMA2_CAPS),
               save_tiny(tmp_path / "granite", "granite", 24, vocab_size=321, **GRANITE),
               save_tiny(tmp_path / "olmo2", "olmo2", 27, vocab_size=321),
               save_tiny(tmp_path / "deepseek-v2-ep", "deepseek_v2", 25, vocab_size=321, **DEEPSEEK_V2,
                         topk_method="group_limited_greedy", n_group=4, topk_group=1),
               save_tiny(tmp_path / "glm4moe", "glm4_moe", 28, vocab_size=321, **GLM4_MOE),
               save_tiny(tmp_path / "glm4moe-ep", "glm4_moe", 28, vocab_size=321, **GLM4_MOE)]
    # FP8 releases with one tensor per expert: the experts kept in float8, split by width and whole; scaled by block,
    # or by row
    fp8 = [str(checkpoints.write_fp8(checkpoints.split_experts(Path(folders[i]), tmp_path / f"{name}-split"),
                                     tmp_path / f"{name}-q", strategy=strategy)[0].rename(tmp_path / name))
           for i, name, strategy in ((6, "deepseek-fp8", None), (3, "qwen3moe-fp8-ep", None),
                                     (3, "qwen3moe-fp8-rows", "channel"))]
    folders += fp8
    # an act-order GPTQ release (dequantized at load, then split) and an AWQ one (each rank keeps its rows' or its
    # columns' groups in 4 bits)
    folders += [str(checkpoints.write_int(Path(folders[0]), tmp_path / f"llama-{scheme}", scheme)[0])
                for scheme in ("gptq4-act-order-v2", "awq4-g32")]
    # a row-scaled FP8 release, its linears kept in FP8 (W8A8): each rank rounds its share of a row-parallel linear's
    # input over its own scale (as vLLM's ranks do), which the one-rank model's row-parallel linears do by hand here
    fp8_rows = str(checkpoints.write_fp8(Path(folders[0]), tmp_path / "llama-fp8-q", strategy="channel")[0].rename(
        tmp_path / "llama-fp8-rows"))
    int8_rows = str(checkpoints.write_int8(Path(folders[0]), tmp_path / "llama-int8-q")[0].rename(
        tmp_path / "llama-int8-rows"))
    # and one with static activation scales: every rank rounds its share of a row over the release's one scale
    static_rows = str(checkpoints.write_fp8(Path(folders[0]), tmp_path / "llama-fp8s-q", strategy="tensor",
                                            static=0.02)[0].rename(tmp_path / "llama-fp8-static-rows"))
    online_fp8 = shutil.copytree(folders[0], tmp_path / "llama-online-fp8")  # quantized by the ranks as they load
    # a block-scaled one (blocks of 16 rows by 32 columns), its linears kept in FP8: each rank's share whole blocks
    block_rows = str(checkpoints.write_fp8(Path(folders[0]), tmp_path / "llama-fp8b-q", [16, 32])[0].rename(
        tmp_path / "llama-fp8-block-rows"))
    w8a8 = (fp8_rows, int8_rows, static_rows, str(online_fp8), block_rows)
    if not checkpoints.cpu_fp8_runs():  # (this torch's CPU FP8 matmul takes no per-row scales: no row-scaled FP8)
        w8a8 = (int8_rows, block_rows)
    folders += list(w8a8)
    # an AWQ mixture of experts: split by width, each rank's 16 of the 32-wide experts are not whole 32-column groups
    # (dequantized at load); whole experts per rank keep them in 4 bits
    moe_split = checkpoints.split_experts(Path(folders[3]), tmp_path / "qwen3moe-split")
    folders += [str(checkpoints.write_int(moe_split, tmp_path / f"q-{name}", "awq4-g32")[0].rename(tmp_path / name))
                for name in ("qwen3moe-awq4", "qwen3moe-awq4-ep")]
    script = tmp_path / "worker.py"
    script.write_text(TP_WORKER)
    port, world = str(free_port()), 2
    model_checks.run_scripts(script, [[str(r), str(world), port, str(tmp_path), *folders] for r in range(world)], 240)
    for r in range(world):
        result = json.loads((tmp_path / f"{r}.json").read_text())
        before, after = result.pop("threads")
        assert after == before, f"rank {r}: {after - before} threads outlive destroy_process_group"
        assert set(result) == set(folders)
        for folder, (diff, vocab_rows, kv_heads, fp8_experts, int4, int4_experts) in result.items():
            # (8-bit activations: float32's last bits may round an input a step the other way on one side)
            assert diff < (W8A8_TOL if folder in w8a8 else TOL), (r, folder, diff)
            assert fp8_experts == (folder in fp8), folder
            assert int4 == ("awq4" in folder or folder in w8a8), folder
            assert int4_experts == folder.endswith("awq4-ep"), folder
            assert vocab_rows == (162 if "llama" in folder and "llama4" not in folder else 161)  # half the vocab
            assert kv_heads == 1


# ---- the CPU small-row matmul path ---------------------------------------------------------------------------------


def test_padded_rows_picks_a_fast_width_at_least_m():
    from specray.models.cpu_kernels import FAST_ROWS, SMALL_BATCH_ROWS, padded_rows

    for m in range(1, SMALL_BATCH_ROWS + 1):
        rows = padded_rows(m)
        assert rows >= m and (rows in FAST_ROWS or rows % 8 == 0), (m, rows)
        assert rows < m + 8, (m, rows)
    assert [padded_rows(m) for m in (1, 3, 7, 10, 17)] == [2, 4, 8, 16, 24]
    assert padded_rows(SMALL_BATCH_ROWS + 1) == SMALL_BATCH_ROWS + 1


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 12, 17, 128, 129])
def test_small_row_linear_equals_f_linear(rows, monkeypatch):
    """The padded path (for these tiny weights too: SMALL_WEIGHT lowered) equals F.linear."""
    import torch.nn.functional as F

    from specray.models import cpu_kernels
    from specray.models.layers import linear

    monkeypatch.setattr(cpu_kernels, "SMALL_WEIGHT", 0)
    padded = []
    monkeypatch.setattr(cpu_kernels, "padded_rows", lambda m, rule=cpu_kernels.padded_rows: padded.append(m) or rule(m))
    gen = torch.Generator().manual_seed(rows)
    x, w, bias = (torch.randn(*s, generator=gen) for s in ((rows, 48), (40, 48), (40,)))
    for b in (None, bias):
        y = linear(x, w, b)
        assert y.shape == (rows, 40) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert padded == ([rows] * 2 if rows <= cpu_kernels.SMALL_BATCH_ROWS else [])  # the path under test ran


def test_load_model_packs_cpu_fp32_linears_and_keeps_the_logits(request, monkeypatch):
    """On CPU in fp32 the linears run from oneDNN's blocked copy (dense weights freed, the LM head's kept for the
    tied embedding); the logits equal the dense model's. Weights under SMALL_WEIGHT values stay dense (those of
    the tiny models here, until it is lowered)."""
    from specray.models import cpu_kernels
    from specray.models.cpu_kernels import can_pack
    from specray.models.layers import LinearBase

    folder = str(request.getfixturevalue(MODEL_FIXTURES[0]))
    assert all(m.packed is None for m in load_model(folder).modules() if isinstance(m, LinearBase))
    monkeypatch.setattr(cpu_kernels, "SMALL_WEIGHT", 0)
    packed, dense = load_model(folder), load_model(folder, pack=False)
    assert can_pack("cpu", "float32")
    linears = [m for m in packed.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.packed is not None for m in linears)
    assert all(m.weight is None for m in linears if m is not packed.lm_head)
    assert packed.lm_head.weight is not None and packed.dtype == torch.float32
    assert all(m.packed is None and m.weight is not None for m in dense.modules() if isinstance(m, LinearBase))
    for rows in (1, 6, 40):
        ids = tokens(rows, rows)
        a, b = Paged(packed), Paged(dense)
        torch.testing.assert_close(a.step([(ids, 0, a.table(rows))])[0], b.step([(ids, 0, b.table(rows))])[0],
                                   rtol=1e-4, atol=1e-4)


def test_loading_weights_into_a_packed_model_is_refused(tiny_llama_dir, monkeypatch):
    from specray.models import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "SMALL_WEIGHT", 0)
    model = load_model(str(tiny_llama_dir))
    with pytest.raises(ValueError, match="packed"):
        model.load_weights([])


def test_splits_heads_is_the_rule_qkv_sharding_follows():
    """The server checks head splits before Ray starts with ``splits_heads``; it must accept exactly the
    tensor-parallel sizes QKVParallelLinear can shard."""
    from specray.models.layers import QKVParallelLinear, splits_heads
    from specray.parallel import TPGroup

    for heads, kv in [(4, 4), (4, 2), (8, 2), (9, 3), (9, 9), (6, 1)]:
        for tp in range(1, 10):
            try:
                QKVParallelLinear(8, 2, heads, kv, TPGroup(0, tp))
                shardable = True
            except ValueError:
                shardable = False
            assert splits_heads(heads, kv, tp) == shardable, (heads, kv, tp)


def multimodal_release(kind: str, tie: bool):
    """(a tiny multimodal model as released, the class we serve its text with, the text config's model_type)."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Llama4Config,
                              Llama4ForConditionalGeneration, Mistral3Config, Mistral3ForConditionalGeneration,
                              PixtralVisionConfig, SiglipVisionConfig)

    from specray.models.gemma3 import Gemma3ForCausalLM
    from specray.models.llama4 import Llama4ForCausalLM

    if kind == "llama4":
        vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                      image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                      projector_output_dim=32)
        config = Llama4Config(text_config={**TINY, **LLAMA4, "vocab_size": 300}, vision_config=vision,
                              tie_word_embeddings=tie)
        return Llama4ForConditionalGeneration(config), Llama4ForCausalLM, "llama4_text"
    if kind == "gemma3":
        vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=16, patch_size=8).to_dict()
        config = Gemma3Config(text_config={**TINY, **GEMMA, "num_key_value_heads": 1, "vocab_size": 300},
                              vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                              tie_word_embeddings=tie)
        return Gemma3ForConditionalGeneration(config), Gemma3ForCausalLM, "gemma3_text"
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=16, patch_size=8, head_dim=8).to_dict()
    text = {**TINY, "model_type": "mistral", "sliding_window": None, "tie_word_embeddings": not tie}
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=299, tie_word_embeddings=tie)
    return Mistral3ForConditionalGeneration(config), LlamaForCausalLM, "mistral"


@pytest.mark.parametrize("kind,tie", [("llama4", False), ("gemma3", True), ("mistral3", True), ("mistral3", False)])
def test_multimodal_checkpoint_serves_its_text_model(tmp_path, tiny_llama_dir, kind, tie):
    """Llama-4, Gemma 3 4B/12B/27B and Mistral 3 (Mistral Small 3.1 / 3.2, Devstral, Magistral) are released as
    ``...ForConditionalGeneration``: the text model's tensors under ``language_model.`` beside a vision tower.
    specray loads the text model (config and tensors; its head tied as the whole model's config says, as
    transformers ties it, here against the text config's own flag for Mistral 3), whose logits equal transformers'
    for a text-only prompt; the engine reads the text config, and greedy output runs (the tokenizer borrowed)."""
    from specray import LLM, SamplingParams
    from specray.models.loader import load_hf_config

    torch.manual_seed(3)
    full, ours_class, text_type = multimodal_release(kind, tie)
    full = full.float().eval()
    full.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), pack=False)
    assert type(ours) is ours_class and ours.tie_word_embeddings == tie
    assert load_hf_config(str(tmp_path)).model_type == text_type
    ids = tokens(40, 6)
    with torch.no_grad():
        text_model = full.language_model if kind == "llama4" else full  # Llama-4's asks for images' outputs
        ref = text_model(input_ids=torch.tensor([ids])).logits[0].float()
    paged = Paged(ours)
    close(paged.step([(ids, 0, paged.table(40))])[0], ref)
    out = LLM(str(tmp_path), max_model_len=128, tokenizer=str(tiny_llama_dir)).generate(
        {"prompt_token_ids": ids[:12]}, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6

@pytest.mark.parametrize("fixture", ["tiny_deepseek_dir", "tiny_mistral4_dir", "tiny_minicpm3_dir"])
def test_latent_norms_take_transformers_fixed_epsilon(request, fixture, tmp_path):
    """transformers builds the latent attention's q / kv norms at its RMSNorm's default epsilon whatever rms_norm_eps
    says (the other norms read it): with rms_norm_eps far from that default, our logits still equal transformers'."""
    folder = tmp_path / "eps"
    shutil.copytree(request.getfixturevalue(fixture), folder)
    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = 0.05
    (folder / "config.json").write_text(json.dumps(config))
    import transformers

    ids = model_checks.prompt()
    got = model_checks.chunked_logits(load_model(str(folder)), ids, [len(ids)])
    theirs = transformers.Mistral4ForCausalLM if fixture == "tiny_mistral4_dir" else None  # (no auto class has it)
    assert model_checks.max_diff(got, model_checks.reference_logits(folder, theirs)) < 1e-4
