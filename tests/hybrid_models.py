"""Tiny hybrid models against transformers' (linear attention: Qwen3.5, Qwen3.5-MoE, Qwen3-Next; Mamba-2: Bamba,
Granite 4.0's hybrids, Nemotron-H), and the engine's prompts for them: shared by tests/test_qwen3_5.py,
tests/test_gated_deltanet.py and tests/test_mamba_hybrids.py (registered by conftest as
``specray_test_hybrid_models``)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from specray.models.attention import build_attention_metadata
from specray.models.gated_deltanet import RecurrentBatch
from specray.models.kv_cache import allocate_kv_cache, allocate_recurrent_state
from specray.models.loader import load_model
from specray_test_engine_runs import refused_on_this_gpu  # tests/engine_runs.py (registered by conftest)
from specray_test_model_checks import WORKER_PRELUDE  # tests/model_checks.py (registered by conftest before this)

TOL = 1e-4
BLOCK = 4
LAYERS = ["linear_attention", "full_attention", "linear_attention"]
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, layer_types=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=512,
            rms_norm_eps=1e-5, initializer_range=0.1, vocab_size=300, bos_token_id=None, pad_token_id=None)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


# Mamba-2 layers: 8 heads of 16 in 2 groups of B and C (state 8); the attention layers' sizes are TINY's
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
             mamba_chunk_size=16)
_ATTN = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, initializer_range=0.1, vocab_size=300, bos_token_id=None, pad_token_id=None)
MAMBA_ARCHS = ("bamba", "granite", "granite_dense", "nemotron_h", "nemotron_h_moe", "falcon_h1", "falcon_h1_gate",
               "mamba2", "lfm2", "lfm2_moe", "lfm3", "jamba", "mamba", "falcon_mamba", "zamba2", "minimax")
# (LFM2's short convs: a recurrent state with no matrix; Mamba-1's: a state row decaying at its own rate)


def mamba_config(arch: str, **overrides):
    """A tiny config of a Mamba-2 hybrid ``arch``: Bamba (mamba, attention with partial RoPE, mamba); Granite 4.0's
    MoE hybrid (Granite's multipliers, NoPE attention, experts beside a shared MLP) or its dense one (the shared MLP
    alone, RoPE); Nemotron-H (mamba, attention, squared-ReLU MLP, mamba: one mixer per layer), and with experts too
    (mamba, experts, attention, MLP, experts, mamba: Nemotron 3's kinds, its experts over a latent width as Super's
    are)."""
    import transformers as tf

    if arch == "bamba":
        kw = dict(_ATTN, num_hidden_layers=3, attn_layer_indices=[1], rms_norm_eps=1e-5, **MAMBA)
        return tf.BambaConfig(**{**kw, **overrides})
    if arch in ("granite", "granite_dense"):
        kw = dict(_ATTN, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], rms_norm_eps=1e-5,
                  **MAMBA, intermediate_size=32, shared_intermediate_size=48, embedding_multiplier=2.0,
                  residual_multiplier=0.7, attention_multiplier=0.2, logits_scaling=3.0)
        kw.update(dict(num_local_experts=0, position_embedding_type="rope") if arch == "granite_dense" else
                  dict(num_local_experts=4, num_experts_per_tok=2))
        return tf.GraniteMoeHybridConfig(**{**kw, **overrides})
    if arch.startswith("falcon_h1"):  # every muP multiplier away from 1; the gated norm (after the gate), or the gate
        kw = dict(_ATTN, num_hidden_layers=2, rms_norm_eps=1e-5, **MAMBA, mamba_d_ssm=128, mamba_proj_bias=True,
                  projectors_bias=True, attention_bias=True, mlp_bias=True, lm_head_multiplier=0.5,
                  embedding_multiplier=2.0, mlp_multipliers=[0.8, 1.3], key_multiplier=0.7,
                  attention_out_multiplier=0.9, attention_in_multiplier=1.2, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.6],
                  ssm_in_multiplier=1.1, ssm_out_multiplier=0.75, mamba_rms_norm=arch == "falcon_h1",
                  mamba_norm_before_gate=False)
        return tf.FalconH1Config(**{**kw, **overrides})
    if arch == "lfm2":  # LFM2: short convs, attention (layer 1), its MLP width adjusted
        kw = dict(_ATTN, num_hidden_layers=3, full_attn_idxs=[1], norm_eps=1e-5, conv_L_cache=3, conv_bias=False,
                  intermediate_size=144, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                  block_auto_adjust_ff_dim=True)
        return tf.Lfm2Config(**{**kw, **overrides})
    if arch == "lfm2_moe":  # LFM2-MoE: a dense first layer, then experts (attention in layer 1)
        kw = dict(_ATTN, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], norm_eps=1e-5,
                  conv_L_cache=3, conv_bias=False, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  num_dense_layers=1, use_expert_bias=True, routed_scaling_factor=1.5, norm_topk_prob=True)
        return tf.Lfm2MoeConfig(**{**kw, **overrides})
    if arch == "lfm3":  # LFM3: short convs, a sliding and a full attention layer (each kind its RoPE: the full
        # one's proportional, half its pairs rotated), heads gated, the sandwich norms
        kw = dict(_ATTN, num_hidden_layers=4, layer_types=["conv", "sliding_attention", "full_attention", "conv"],
                  head_dim=16, sliding_window=6, norm_eps=1e-5, conv_L_cache=3, conv_bias=False, eos_token_id=None,
                  use_sandwich_norm=True, use_attention_gate=True)
        return tf.Lfm3Config(**{**kw, **overrides})
    if arch == "minimax":  # MiniMax-Text-01: lightning attention, a softmax layer, lightning; every
        # layer Mixtral's experts; DeepNorm's factors away from 1
        kw = dict(_ATTN, num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                  head_dim=16, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, block_size=8,
                  linear_attn_alpha_factor=1.3, linear_attn_beta_factor=0.7, full_attn_alpha_factor=0.9,
                  full_attn_beta_factor=1.2, mlp_alpha_factor=1.1, mlp_beta_factor=0.8,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4})
        return tf.MiniMaxConfig(**{**kw, **overrides})
    if arch == "jamba":  # Jamba: Mamba-1 and NoPE attention alternating, experts on every other layer
        kw = dict(_ATTN, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=2, mamba_dt_rank=8, mamba_conv_bias=True, mamba_proj_bias=False, rms_norm_eps=1e-5)
        return tf.JambaConfig(**{**kw, **overrides})
    if arch in ("mamba", "falcon_mamba"):  # Mamba-1 alone (Falcon-Mamba's B, C and dt normed without weights)
        kw = dict(hidden_size=64, num_hidden_layers=2, vocab_size=300, state_size=8, expand=2, conv_kernel=4,
                  time_step_rank=8, use_conv_bias=True, use_bias=False, layer_norm_epsilon=1e-5, bos_token_id=None,
                  pad_token_id=None, initializer_range=0.1)
        return (tf.MambaConfig if arch == "mamba" else tf.FalconMambaConfig)(**{**kw, **overrides})
    if arch == "zamba2":  # Zamba2: Mamba-2 layers, a shared block (its own adapters per run) at layers 1 and 3
        kinds = ["mamba", "hybrid", "mamba", "hybrid", "mamba"]
        kw = dict(hidden_size=64, num_hidden_layers=5, layers_block_type=kinds,
                  num_attention_heads=4, num_key_value_heads=4, mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8,
                  mamba_ngroups=2, intermediate_size=96, vocab_size=300, num_mem_blocks=1,
                  use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True, chunk_size=16,
                  max_position_embeddings=512, bos_token_id=None, pad_token_id=None, initializer_range=0.1)
        return tf.Zamba2Config(**{**kw, **overrides})
    if arch == "mamba2":  # Mamba-2 alone: three layers
        kw = dict(hidden_size=64, num_hidden_layers=3, vocab_size=300, num_heads=8, head_dim=16, state_size=8,
                  n_groups=2, conv_kernel=4, expand=2, layer_norm_epsilon=1e-5, chunk_size=16, bos_token_id=None,
                  pad_token_id=None, initializer_range=0.1)
        return tf.Mamba2Config(**{**kw, **overrides})
    assert arch in ("nemotron_h", "nemotron_h_moe"), arch
    kw = dict(_ATTN, num_hidden_layers=4, hybrid_override_pattern="M*-M", mamba_num_heads=8, mamba_head_dim=16,
              ssm_state_size=8, n_groups=2, conv_kernel=4, head_dim=16, layer_norm_epsilon=1e-5, chunk_size=16)
    if arch == "nemotron_h_moe":
        kw.update(num_hidden_layers=6, hybrid_override_pattern="ME*-EM", n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1,
                  routed_scaling_factor=1.5, moe_latent_size=24)  # (Nemotron 3 Super's latent experts)
    return tf.NemotronHConfig(**{**kw, **overrides})


def hf_pair(arch: str, seed: int = 0, **overrides):
    """A transformers model of ``arch`` (one of "qwen3_5", "qwen3_5_moe", "qwen3_next", or :data:`MAMBA_ARCHS`)
    with random weights everywhere (zero-centred norms, routers, gates, Mamba-2's D, dt bias, decays and conv bias
    made random so that a wrong formula shows)."""
    import transformers as tf

    if arch in MAMBA_ARCHS:
        config = mamba_config(arch, **overrides)
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("norm.weight", "layernorm.weight", "norm_f.weight")):
                    param.uniform_(0.5, 1.5)
                elif name.endswith((".D", "dt_bias", "conv1d.bias")):
                    param.normal_(0.0, 0.5)
                elif name.endswith("A_log"):
                    param.uniform_(-1.0, 1.5)
                elif "router" in name or name.endswith((".mixer.gate.weight", ".feed_forward.gate.weight")):
                    param.normal_(0.0, 0.5)
                elif "adapter_list" in name:  # (Zamba2's per-run adapters: transformers starts some at 0)
                    param.normal_(0.0, 0.1)
            for name, buffer in model.named_buffers():
                if name.endswith(("e_score_correction_bias", "expert_bias")):
                    buffer.normal_(0.0, 0.3)
        return config, model

    if arch == "olmo_hybrid":  # OLMo 3's attention layers among Gated DeltaNet ones
        kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                      "linear_attention"],
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4, vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=None, pad_token_id=None, eos_token_id=None)
        config = tf.OlmoHybridConfig(**{**kw, **overrides})
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
                elif name.endswith("dt_bias"):
                    param.normal_(0.0, 0.5)
        return config, model

    cfg_cls, model_cls = {"qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
                          "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
                          "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM)}[arch]
    kw = dict(TINY, **(MOE if arch != "qwen3_5" else {}), **overrides)
    config = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight"):  # 1 + w
                param.normal_(0.0, 0.3)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "dt_bias")):
                param.normal_(0.0, 0.5)
    return config, model


def save(path: Path, arch: str, seed: int, **overrides) -> Path:
    """A model folder the engine loads: weights, config and a tiny tokenizer (the model's vocabulary its size). Its
    embedding is tied and doubled, so that greedy decoding falls into loops now and then: n-gram drafts are then
    accepted in some steps and rejected in others (a plain random model's almost never are)."""
    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    _, hf = hf_pair(arch, seed, vocab_size=len(tok), eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
                    **overrides)
    with torch.no_grad():
        hf.get_input_embeddings().weight.mul_(2.0)
    hf.save_pretrained(path, safe_serialization=True)
    return path


class Stepper:
    """Our model over a paged cache (shuffled blocks) and a recurrent state, driven as the runner drives it: each
    sequence has a slot; a chunk with drafts leaves them pending and the next chunk replays the accepted ones."""

    def __init__(self, model, num_blocks: int = 200, slots: int = 4, max_pending: int = 4,
                 state_dtype: torch.dtype = torch.float32):
        self.model = model
        self.cache = allocate_kv_cache(model, num_blocks, BLOCK)
        self.state = allocate_recurrent_state(model, slots, max_pending, state_dtype)
        self.free = list(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist())
        self.tables: dict[int, list[int]] = {}
        self.base: dict[int, tuple[int, int]] = {}  # slot -> (committed position, pending drafts)

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int], int, int]]) -> list[torch.Tensor]:
        """chunks: (slot, token ids, start position, drafts among the last tokens) -> logits [q, V] each."""
        replay, fresh = [], []
        for slot, ids, start, drafts in chunks:
            table = self.tables.setdefault(slot, [])
            while len(table) * BLOCK < start + len(ids):
                table.append(self.free.pop())
            committed, pending = self.base.get(slot, (0, 0))
            fresh.append(start == 0)
            replay.append(0 if start == 0 else start - committed)
            assert 0 <= replay[-1] <= pending or start == 0, (start, committed, pending)
            self.base[slot] = (start + len(ids) - drafts, drafts)
        meta = build_attention_metadata([len(c[1]) for c in chunks], [c[2] for c in chunks],
                                        [self.tables[c[0]] for c in chunks], BLOCK, "cpu")
        meta.recurrent = RecurrentBatch([c[0] for c in chunks], fresh, replay, [c[3] for c in chunks])
        ids = torch.tensor([t for c in chunks for t in c[1]])
        logits = self.model.compute_logits(self.model(ids, meta))
        return list(logits.split([len(c[1]) for c in chunks]))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def ours(tmp_path: Path, arch: str, seed: int = 0, **overrides):
    _, hf = hf_pair(arch, seed, **overrides)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return load_model(tmp_path), hf


def check_prefill_chunks_and_decode(model, hf) -> None:
    """One prefill, the same prompt in uneven chunks (the state carried between them; a chunk long enough for the
    chunked rule), then decode steps one token at a time, two sequences batched together with different slots:
    every logit row equals transformers'."""
    a, b = tokens(29, 1), tokens(11, 2)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    whole = Stepper(model).step([(0, a[:25], 0, 0), (2, b[:9], 0, 0)])
    assert (whole[0] - ref_a[:25]).abs().max() < TOL
    assert (whole[1] - ref_b[:9]).abs().max() < TOL
    run = Stepper(model)
    got_a, got_b = [], []
    for (sa, ea), (sb, eb) in (((0, 7), (0, 3)), ((7, 8), (3, 9)), ((8, 25), (9, 10))):
        out = run.step([(1, a[sa:ea], sa, 0), (3, b[sb:eb], sb, 0)])
        got_a.append(out[0]), got_b.append(out[1])
    for pos in range(25, 29):  # decode, one token each step
        got_a.append(run.step([(1, [a[pos]], pos, 0)])[0])
    assert (torch.cat(got_a) - ref_a).abs().max() < TOL
    assert (torch.cat(got_b) - ref_b[:10]).abs().max() < TOL


def check_greedy_equals_transformers(folder: Path, outputs: list[list[int]]) -> None:
    """The engine's greedy ``outputs`` of the first three :data:`PROMPT_IDS` (several requests at once, each in its
    own state slot): every token is transformers' argmax over the whole sequence so far."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for ids, out in zip(PROMPT_IDS[:3], outputs[:3]):
        seq = list(ids)
        for _ in range(8):
            seq.append(int(hf_logits(hf, seq)[-1].argmax()))
        assert out[:8] == seq[len(ids):]


def check_ngram_replays_keep_greedy(folder: Path, plain: list[list[int]], tree: bool, monkeypatch) -> None:
    """n-gram chains, or trees of three branches (``tree``: the recurrence's tree form, each row's state from its
    parent's), from graph steps (on CPU the padded static inputs run eagerly), give ``plain``'s tokens, some drafts
    accepted (and replayed in the next chunk) and some not."""
    from specray import LLM
    from specray.models.step_graphs import StepGraphs

    replays = recorded_batches(monkeypatch)
    shapes, run = [], StepGraphs.run
    monkeypatch.setattr(StepGraphs, "run", lambda self, shape, *a, **kw: shapes.append(shape) or run(
        self, shape, *a, **kw))
    spec = {**NGRAM, "num_speculative_tokens": 6, "num_branches": 3} if tree else NGRAM
    llm = LLM(model=str(folder), max_model_len=128, speculative_config=spec, block_size=4, enforce_eager=False)
    assert generate(llm, greedy()) == plain
    assert 0 < llm.spec_stats.accepted_tokens < llm.spec_stats.draft_tokens, llm.spec_stats
    assert any(n > 0 for batch in replays for n in batch.replay), "no accepted draft was replayed"
    if refused_on_this_gpu(llm):  # experts in the suite's fp32 on a GPU: eager steps, the reason logged
        assert not shapes
    else:
        assert shapes, "no step replayed a graph"
        assert tree_graphs(llm) == branched(replays) and (branched(replays) or not tree), "a tree step eagerly"


def recorded_batches(monkeypatch) -> list:
    """Every step's RecurrentBatch from here on."""
    from specray.workers.model_runner import RecurrentSlots

    seen, real = [], RecurrentSlots.batch
    monkeypatch.setattr(RecurrentSlots, "batch", lambda self, chunks: seen.append(real(self, chunks)) or seen[-1])
    return seen


def branched(batches: list) -> bool:
    """Whether a step's drafts formed a token tree (a sequence's drafts with parents)."""
    return any(p is not None for batch in batches if batch is not None for p in batch.parents or [])


def tree_graphs(llm) -> bool:
    """Whether the engine's target replayed a graph of the recurrence's tree form (a step with token trees)."""
    return any("tree" in key for key in llm.engine.executor.worker.runner.graphs.graphs)


def check_long_prefill(model, hf, length: int = 150) -> None:
    """A ``length``-token prefill (with the chunked form's 64-token chunks: several, the last partial) and then the
    same prompt in two chunks (the state carried across them): transformers' logits."""
    from specray_test_model_checks import chunked_logits, max_diff  # tests/model_checks.py

    ids = torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert max_diff(chunked_logits(model, ids, [length]), want) < TOL
    half = length // 2 - 5
    assert max_diff(chunked_logits(model, ids, [half, length - half]), want) < TOL


def check_drafts_replayed(model, hf) -> None:
    """A verify chunk (last token + 3 drafts) leaves its drafts pending; the next chunk starts after the accepted
    ones (0, 1, 2 or all 3 in turn), whose inputs the layers replay over the committed state: logits equal
    transformers' on the accepted path, whatever was drafted and rejected; then plain tokens again."""
    seq = tokens(40, 4)
    ref = hf_logits(hf, seq)
    run = Stepper(model)
    out = run.step([(0, seq[:10], 0, 0)])[0]
    assert (out - ref[:10]).abs().max() < TOL
    pos = 10
    for accepted in (0, 1, 3, 2, 0, 3):
        drafts = seq[pos + 1: pos + 1 + accepted] + tokens(3 - accepted, 100 + pos)  # a wrong draft after them
        out = run.step([(0, [seq[pos]] + drafts, pos, 3)])[0]
        assert (out[: accepted + 1] - ref[pos: pos + accepted + 1]).abs().max() < TOL, accepted
        pos += accepted + 1
    out = run.step([(0, seq[pos: pos + 2], pos, 0)])[0]
    assert (out - ref[pos: pos + 2]).abs().max() < TOL


def check_tree_rows_match_their_paths(model, hf, seq: list[int], start: int, real: int, parents: list[int],
                                      seed: int) -> None:
    """After a prefill of ``seq[:start]``, one verify chunk of ``real`` tokens then drafts forming the tree
    ``parents`` (each draft's parent draft, -1: the last real token), every node at its depth's position and seeing
    its ancestors alone, over a shuffled block table: each row's logits equal transformers' over the row's own path
    (its recurrent layers over its ancestors' inputs, its attention over them)."""
    allocate_kv_cache(model, 64, 4)
    allocate_recurrent_state(model, 2, len(parents))
    table = torch.randperm(64, generator=torch.Generator().manual_seed(seed)).tolist()
    drafts = tokens(len(parents), seed)
    with torch.no_grad():
        meta = build_attention_metadata([start], [0], [table], 4)
        meta.recurrent = RecurrentBatch([0], [True], [0], [0])
        model(torch.tensor(seq[:start]), meta)
        q = real + len(parents)
        paths = [list(range(j + 1)) for j in range(real)]  # each row's path of new tokens (rows), oldest first
        for p in parents:
            paths.append((paths[real - 1] if p < 0 else paths[real + p]) + [len(paths)])
        ancestors = torch.zeros(q, q, dtype=torch.bool)
        for row, path in enumerate(paths):
            ancestors[row, path] = True
        positions = [start + len(path) - 1 for path in paths]
        meta = build_attention_metadata([q], [start], [table], 4, positions=positions, ancestors=[ancestors])
        meta.recurrent = RecurrentBatch([0], [False], [0], [len(parents)], parents=[parents])
        ids = seq[start: start + real] + drafts
        got = model.compute_logits(model(torch.tensor(ids), meta))
    for row, path in enumerate(paths):
        want = hf_logits(hf, seq[:start] + [ids[j] for j in path])[-1]
        assert (got[row] - want).abs().max() < TOL, (row, path)


def check_no_host_sync_in_a_step(model, no_host_sync) -> None:
    """A step with a replay, a verify chunk and a fresh prefill reads no tensor's value on the host (``no_host_sync``:
    conftest's fixture)."""
    run = Stepper(model)
    seq = tokens(24, 10)
    run.step([(0, seq[:8], 0, 0)])
    run.step([(0, seq[8:11], 8, 2)])
    with no_host_sync():
        run.step([(0, seq[10:12], 10, 1), (1, seq[:20], 0, 0)])


def check_graph_form_equals_eager(layer, q_rows: int, fill, inputs, pend: int = 5, scratch: int = 8) -> None:
    """A recurrent mixer's graph form (the batch padded to fixed shapes, a RecurrentGraphBatch) against its eager
    form, ``layer`` bound to a state of ``scratch + 1`` slots that ``fill(state)`` makes random (its histories and
    matrices): a sequence replaying drafts, a fresh one over a slot holding an old state, one with drafts, and a
    padding sequence; the same outputs for every real row, the same committed state and the same pending drafts'
    inputs and gates in each target slot; with the drafts as chains, then as token trees (the tree form of both).
    ``inputs(rows)``: the recurrence's (mixed, g, beta) for that many rows."""
    from types import SimpleNamespace

    from specray.models.kv_cache import RecurrentState

    torch.manual_seed(0)
    state = RecurrentState([layer.state_spec], scratch + 1, pend, torch.float32, "cpu").layers[0]
    fill(state)
    layer.bind_state(state)

    seqs = [(0, False, min(pend, q_rows - 1), 2, 1), (2, True, 0, q_rows, min(pend, q_rows - 1)),
            (6, False, 2, q_rows - 1, 0)]  # (slot read, fresh, replays, real rows, drafts)
    slots, fresh, replay, lens, drafts = (list(col) for col in zip(*seqs))
    mixed, g, beta = inputs(4 * q_rows)
    real = [i * q_rows + j for i, n in enumerate(lens) for j in range(n)]
    held = (state.inputs, state.gates, state.matrix)
    start = [t.clone() for t in held]
    for trees in (False, True):  # chains, then the drafts as token trees (two children per draft)
        parents = [[i // 2 - 1 for i in range(k)] if trees and k else None for k in drafts]
        batch = RecurrentBatch(slots, fresh, replay, drafts, [s + 1 for s in slots], parents=parents)
        with torch.no_grad():
            for t, old in zip(held, start):
                t.copy_(old)
            want = layer.recurrence(mixed[real], g[real], beta[real],
                                    SimpleNamespace(recurrent=batch, query_lens=lens))
            eager = [t.clone() for t in held]
            for t, old in zip(held, start):
                t.copy_(old)
            table = batch.padded(4, lens, scratch, "cpu", q_rows)
            assert table.trees == trees
            got = layer.recurrence(mixed, g, beta, SimpleNamespace(recurrent=table))
        torch.testing.assert_close(got[real], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state.matrix[batch.targets], eager[2][batch.targets], atol=1e-5, rtol=1e-5)
        for target, k in zip(batch.targets, drafts):  # the pending drafts' inputs and gates (rows past them: unread)
            torch.testing.assert_close(state.inputs[target, :k], eager[0][target, :k])
            if not layer.gates_from_conv:  # (else the held gates are never read: each row's come from its conv's)
                torch.testing.assert_close(state.gates[target, :k], eager[1][target, :k])


# prompts that repeat themselves (n-gram drafts find matches, some accepted, some not) and one that does not
PROMPT_IDS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], list(range(40, 70)), [11, 12, 11, 12, 11, 12, 13, 11, 12],
              [100, 101, 102, 103, 104, 105, 100, 101, 102, 103, 104, 105, 100, 101, 102, 103, 104, 105, 100, 101],
              [7, 7, 7, 7, 7, 7], list(range(200, 237)) + list(range(200, 210))]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def generate(llm, params) -> list[list[int]]:
    prompts = [{"prompt_token_ids": ids} for ids in PROMPT_IDS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def greedy(n: int = 24):
    from specray import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def check_eagle3_keeps_greedy(tmp_path: Path, arch: str) -> None:
    """An EAGLE-3 head drafting chains, then EAGLE-2 trees, over a tiny ``arch`` target: greedy output equals plain
    decoding's, and its drafts are accepted now and then (the test head drafts "the same token again" under the
    target's tied LM head); the trees' levels reversed (``siblings_reversed``), paths other than a tree's first are
    kept, whose pending inputs the next plan's K/V moves put in path order."""
    import specray_test_draft_heads as draft_heads  # tests/draft_heads.py (registered by conftest)
    from specray_test_engine_runs import siblings_reversed  # tests/engine_runs.py
    from specray import LLM

    folder = save(tmp_path / "target", arch, 11)
    plain = generate(LLM(model=str(folder), max_model_len=128), greedy())
    head = draft_heads.write_accepting_head(tmp_path / "head", "eagle3", folder)
    chains = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "adaptive": False}
    trees = {**chains, "num_speculative_tokens": 5, "use_dynamic_tree": True, "dynamic_tree_max_topK": 2,
             "dynamic_tree_depth": 3}
    for spec in (chains, trees):
        llm = LLM(model=str(folder), max_model_len=128, speculative_config=spec)
        runner, moves = llm.engine.executor.worker.runner, []
        if spec is trees:
            siblings_reversed(runner)
            apply = runner.apply_plan_state
            runner.apply_plan_state = lambda plan: moves.extend(plan.kv_moves) or apply(plan)
        assert generate(llm, greedy()) == plain, spec
        assert llm.spec_stats.accepted_tokens > 0, llm.spec_stats
        # (LFM3's test head is accepted about once in 125 drafts: too seldom to count on a path other than the first)
        assert spec is chains or arch == "lfm3" or moves, "every accepted path was the tree's first"


def check_prefix_caching_keeps_tokens(folder: Path) -> None:
    """Two turns of three conversations, with n-gram drafts: with prefix caching the second turn starts behind cached
    blocks (and kept recurrent states) and gives the tokens an engine without prefix caching gives."""
    from specray import LLM

    def two_turns(**kw) -> tuple[list[list[int]], int]:
        llm = LLM(model=str(folder), max_model_len=256, block_size=4, speculative_config=NGRAM, **kw)
        prompts = [[30 + 17 * c + (i * 7 + c) % 11 for i in range(9 + 3 * c)] for c in range(3)]
        answers, cached = [], 0
        for turn in range(2):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6), use_tqdm=False)
            answers += [o.outputs[0].token_ids for o in outs]
            cached += sum(o.num_cached_tokens for o in outs) if turn else 0
            prompts = [p + list(o.outputs[0].token_ids) + [3, 4] for p, o in zip(prompts, outs)]
        return answers, cached

    cached_answers, cached = two_turns(enable_prefix_caching=True)
    plain_answers, _ = two_turns(enable_prefix_caching=False)
    assert cached_answers == plain_answers and cached > 0, cached


# a gloo rank of a TP 2 check: each folder's model sharded and whole, on prefills, a verify chunk of 2 drafts beside a
# decode and the next chunk after 1 accepted draft (replayed); writes each folder's max abs logit difference and the
# first recurrent layer's heads on this rank
TP_WORKER = textwrap.dedent("""
    import gc, json, sys
    import torch, torch.distributed as dist
    from specray.models.attention import build_attention_metadata
    from specray.models.gated_deltanet import RecurrentBatch
    from specray.models.kv_cache import allocate_kv_cache, allocate_recurrent_state
    from specray.models.loader import load_model
    from specray.parallel import TPGroup

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    import torch.distributed.nn  # noqa: F401  before init: see join_tp_group (workers/worker.py)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    @torch.no_grad()
    def run(model):
        allocate_kv_cache(model, 32, 4)
        allocate_recurrent_state(model, 2, 3)
        ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
        t1, t2 = [5, 3, 9, 1, 7, 2, 8, 4, 6], [10, 11, 12, 13, 14, 15]
        rows = []
        # (query lens, starts, slots, fresh, replay, drafts, tokens): prefills; a verify chunk of 2 drafts beside a
        # decode; then the next chunk after 1 accepted draft (replayed)
        for lens, starts, fresh, replay, drafts, toks in (
                ([20, 7], [0, 0], [True, True], [0, 0], [0, 0], ids[:20] + ids[20:27]),
                ([3, 1], [20, 7], [False, False], [0, 0], [2, 0], ids[27:30] + ids[30:31]),
                ([2, 1], [22, 8], [False, False], [1, 0], [0, 0], ids[28:30] + ids[31:32])):
            meta = build_attention_metadata(lens, starts, [t1, t2], 4)
            meta.recurrent = RecurrentBatch([1, 0], fresh, replay, drafts)
            rows.append(model.compute_logits(model(torch.tensor(toks), meta)))
        return torch.cat(rows)

    result = {}
    for folder in sys.argv[5:]:
        model = load_model(folder, TPGroup.from_world())
        heads = model.recurrent_state_specs()[0].num_heads
        ours, one = run(model), run(load_model(folder))  # (equal entries count 0: -inf on both)
        result[folder] = [torch.where(ours == one, 0.0, (ours - one).abs()).max().item(), heads]
    del model
    gc.collect()
    dist.destroy_process_group()
    json.dump(result, open(f"{out}/{rank}.json", "w"))
""")


# a rank of a two-stage pipeline check (TP 1 each): each folder's stage layers and, on the last stage, the max abs
# difference of its logits from one rank's over the same steps as TP_WORKER's
PP_WORKER = WORKER_PRELUDE + textwrap.dedent("""
    from specray.models.gated_deltanet import RecurrentBatch
    from specray.models.kv_cache import allocate_recurrent_state

    @torch.no_grad()
    def run(model):  # prefills, a verify chunk of 2 drafts beside a decode, the next chunk after 1 accepted
        allocate_kv_cache(model, 32, 4)
        allocate_recurrent_state(model, 2, 3)
        t1, t2, rows = [5, 3, 9, 1, 7, 2, 8, 4, 6], [10, 11, 12, 13, 14, 15], []
        for lens, starts, fresh, replay, drafts, toks in (
                ([20, 7], [0, 0], [True, True], [0, 0], [0, 0], ids[:27].tolist()),
                ([3, 1], [20, 7], [False, False], [0, 0], [2, 0], ids[27:31].tolist()),
                ([2, 1], [22, 8], [False, False], [1, 0], [0, 0], ids[28:30].tolist() + ids[31:32].tolist())):
            meta = plan(lens, starts, [t1, t2], 4)
            meta.recurrent = RecurrentBatch([1, 0], fresh, replay, drafts)
            hidden = model(torch.tensor(toks), meta)
            rows.append(None if hidden is None else model.compute_logits(hidden))
        return None if rows[0] is None else torch.cat(rows)

    result = {}
    for folder in folders:
        model = load_model(folder, tp, pp=pp)
        mine = run(model)
        result[folder] = [list(model.model.stage), None if mine is None else
                          (mine - run(load_model(folder))).abs().max().item()]
    del model
    gc.collect()
    dist.destroy_process_group()
    json.dump(result, open(f"{out}/{rank}.json", "w"))
""")


# ---- LoRA ------------------------------------------------------------------------------------------------------------

def check_lora_keeps_transformers_logits(base: Path, tmp_path: Path, leaves: tuple[str, ...],
                                         refused: str | None) -> None:
    """An adapter (rank 4, alpha 8) of every checkpoint projection whose leaf is in ``leaves`` (not the experts'):
    admitted, then a prefill, verify chunks whose drafts stay pending and the next chunks replaying the accepted ones
    beside a sequence without it, each row's logits equal to transformers' with the adapter merged (PEFT's
    merge_and_unload; the base model's for the other row). An adapter of ``refused`` is refused at admission, by
    name."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    import specray_test_checkpoints as checkpoints  # tests/checkpoints.py (registered by conftest)
    from specray.engine.builder import adapter_checker
    from specray.lora import LoRAConfig, LoRARequest
    from specray.models.lora import LoRASlots

    def write(dst: Path, picked: tuple[str, ...]) -> set[str]:
        with safe_open(str(base / "model.safetensors"), "pt") as f:
            shapes = {k[: -len(".weight")]: f.get_slice(k).get_shape() for k in sorted(f.keys())
                      if k.startswith("model.layers.") and k.endswith(".weight") and ".experts." not in k
                      and k.split(".")[-2] in picked}
        g = torch.Generator().manual_seed(3)
        tensors = {}
        for module, (out_features, in_features) in shapes.items():
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(4, in_features, generator=g) * 0.1
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_features, 4, generator=g) * 0.1
        checkpoints.write_lora(base, dst, rank=4, alpha=8, modules=())  # its config; the tensors follow
        save_file(tensors, str(dst / "adapter_model.safetensors"))
        return {m.rsplit(".", 1)[1] for m in shapes}

    def hf(folder: Path):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    assert write(tmp_path / "adapter", leaves) == set(leaves)  # every leaf named is in the checkpoint
    merged, plain = hf(checkpoints.merge_lora(base, tmp_path / "adapter", tmp_path / "merged")), hf(base)
    config = LoRAConfig(max_loras=1, max_lora_rank=4)
    model = load_model(base)
    checker = adapter_checker(config, model.config)
    request = LoRARequest("a", 1, str(tmp_path / "adapter"))
    checker.check(request)
    if refused is not None:  # (None: every linear of the family takes adapters; its refusals are checked apart)
        write(tmp_path / "refused", (refused,))
        with pytest.raises(ValueError, match=f"{refused}', which specray does not apply LoRA to"):
            checker.check(LoRARequest("r", 2, str(tmp_path / "refused")))
    slots = LoRASlots(model, config, torch.device("cpu"))
    (slot,) = slots.slots_for([request])
    run = Stepper(model)
    a, b = tokens(30, 1), tokens(12, 2)
    ref_a, ref_b = hf_logits(merged, a), hf_logits(plain, b)
    assert (ref_a - hf_logits(plain, a)).abs().max() > 1e-2  # the adapter matters

    def step(chunks):
        slots.context.set_token_slots(torch.tensor([slot if seq == 0 else 0 for seq, ids, _, _ in chunks
                                                    for _ in ids]))
        return run.step(chunks)

    out = step([(0, a[:10], 0, 0), (1, b[:6], 0, 0)])
    assert max((out[0] - ref_a[:10]).abs().max(), (out[1] - ref_b[:6]).abs().max()) < 1e-4
    pos, pos_b = 10, 6
    for accepted in (1, 3, 0, 2):  # last token + 3 drafts, `accepted` of them right
        drafts = a[pos + 1: pos + 1 + accepted] + tokens(3 - accepted, 100 + pos)
        out = step([(0, [a[pos]] + drafts, pos, 3), (1, [b[pos_b]], pos_b, 0)])
        assert (out[0][: accepted + 1] - ref_a[pos: pos + accepted + 1]).abs().max() < 1e-4, accepted
        assert (out[1] - ref_b[pos_b: pos_b + 1]).abs().max() < 1e-4
        pos, pos_b = pos + accepted + 1, pos_b + 1
    out = step([(0, a[pos: pos + 2], pos, 0)])  # decodes after the last replay
    assert (out[0] - ref_a[pos: pos + 2]).abs().max() < 1e-4


def check_lora_refused(base: Path, tmp_path: Path, refused: str) -> None:
    """An adapter of ``refused`` alone is refused at admission, naming it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    import specray_test_checkpoints as checkpoints  # tests/checkpoints.py (registered by conftest)
    from specray.engine.builder import adapter_checker
    from specray.lora import LoRAConfig, LoRARequest

    with safe_open(str(base / "model.safetensors"), "pt") as f:
        name = next(k for k in sorted(f.keys()) if k.endswith(f".{refused}.weight"))
        out_features, in_features = f.get_slice(name).get_shape()
    module = f"base_model.model.{name[: -len('.weight')]}"
    dst = tmp_path / f"refused_{refused}"
    checkpoints.write_lora(base, dst, rank=4, alpha=8, modules=())
    save_file({f"{module}.lora_A.weight": torch.randn(4, in_features) * 0.1,
               f"{module}.lora_B.weight": torch.randn(out_features, 4) * 0.1}, str(dst / "adapter_model.safetensors"))
    checker = adapter_checker(LoRAConfig(max_loras=1, max_lora_rank=4), load_model(base).config)
    with pytest.raises(ValueError, match=f"{refused}', which specray does not apply LoRA to"):
        checker.check(LoRARequest("r", 3, str(dst)))
