"""MiniMax-M3's text model (``MiniMaxM3VLForCausalLM``, model_type ``minimax_m3_vl_text``): Gemma-style norms (1 + w)
with q/k normed per head, partial RoPE, a dense first layer and then experts (M2's sigmoid routing scaled, a shared
MLP, every MLP GPT-OSS's clamped SwiGLU), and block-sparse attention picked by a lightning indexer on the
``minimax_m3_sparse`` layers; against transformers on the same random tiny weights (fp32, max abs diff < 1e-4; the
checkpoint as transformers saves it) with ``index_topk_blocks`` 3 of 4-token blocks over a 40-token prompt, so that
the pick decides the logits. Both attention paths (the padded short batch, one sequence at a time) and the pick's
slices, a token tree's nodes equal to their paths run plainly, tensor parallel 2, expert parallel 2 and two pipeline
stages equal to one rank, the multimodal checkpoint's text part in the release's names, and the engine: greedy with
n-gram chains and trees, from graphs, equal to transformers' ``generate`` (an FP8 cache runs). Each distinctive part
broken once moves the logits; what this port would have to guess is refused by name. The tiny model is built here
(transformers' config and class, random weights made visible), not in conftest."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from specray.models import cpu_kernels, minimax_m3
from specray.models.loader import load_model, read_config
from specray.models.minimax_m3 import (BlockSparseAttention, MiniMaxM3ForCausalLM, MiniMaxM3SparseMoE,
                                       SwigluOaiMLP, UnitOffsetRMSNorm)
from specray_test_model_checks import (DIFF_WORKER, SCHEDULES, WORKER_PRELUDE,  # tests/model_checks.py
                                       chunked_logits, max_diff, mutated_logits, prompt, reference_logits, run_ranks)

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
# 3 layers: a dense one with full attention, then two sparse-attention layers with experts; heads of 16, half rotated;
# 2 indexer heads (one per KV head) keeping 3 blocks of 4 key positions, the query's own always; 8 experts (top 2)
# beside a shared MLP; the SwiGLU clamped at 1 (so the clamp bites on these weights) with its own sigmoid gain
TINY = dict(hidden_size=64, intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=48,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            mlp_layer_types=["dense", "sparse", "sparse"],
            layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
            num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0, swiglu_limit=1.0,
            swiglu_alpha=1.5, index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=3,
            index_local_blocks=1, max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1,
            tie_word_embeddings=False)


def build_tiny_minimax_m3(path: Path, seed: int) -> Path:
    """transformers' MiniMaxM3VLForCausalLM at :data:`TINY`'s sizes with random weights (every norm's weight, zeros
    at init, the routers and the correction biases drawn away from their init, so that each shows), saved as
    transformers saves it, with conftest's tiny tokenizer."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path)
    config = MiniMaxM3VLTextConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                   bos_token_id=None, **TINY)
    torch.manual_seed(seed)
    model = MiniMaxM3VLForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the router
                param.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):  # zeros at init (1 + w): the layers', q/k's, the indexer's, final
                param.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_minimax_m3_dir(tmp_path_factory) -> Path:
    # seed 131: no query's 3rd and 4th best block scores lie within 5e-3 of each other (where two exact
    # implementations might pick differently)
    return build_tiny_minimax_m3(tmp_path_factory.mktemp("tiny_minimax_m3"), seed=131)


@pytest.fixture(scope="module")
def reference(tiny_minimax_m3_dir) -> torch.Tensor:
    return reference_logits(tiny_minimax_m3_dir)


@pytest.mark.parametrize("path", ["batched", "own", "own-consecutive", "sliced"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_minimax_m3_dir, reference, monkeypatch, schedule, path):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps over shuffled
    blocks; short queries as the padded batch or one sequence at a time (over blocks in order too, whose K/V and
    indexer keys are read as one view), and (sliced) the pick one indexer head per pass and one query per slice (a
    long context's way)."""
    if path != "batched":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    if path == "sliced":
        monkeypatch.setattr(minimax_m3, "INDEX_SCORE_ELEMENTS", 1)
    model = load_model(str(tiny_minimax_m3_dir))
    assert isinstance(model, MiniMaxM3ForCausalLM)
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == [SwigluOaiMLP, MiniMaxM3SparseMoE, MiniMaxM3SparseMoE]
    assert [type(layer.self_attn.attn) is BlockSparseAttention for layer in layers] == [False, True, True]
    assert all(type(layer.self_attn.q_norm) is UnitOffsetRMSNorm and layer.self_attn.q_norm.weight.shape == (16,)
               for layer in layers)  # per head
    assert type(model.model.norm) is UnitOffsetRMSNorm
    assert model.model.rotary_emb.head_dim == 8  # rotates half of each 16-wide head
    assert all(type(layer.mlp.shared_experts) is SwigluOaiMLP for layer in layers[1:])
    logits = chunked_logits(model, prompt(), SCHEDULES[schedule], consecutive=path == "own-consecutive")
    assert max_diff(logits, reference) < TOL


@pytest.mark.parametrize("index_dim", [6, 8, 16])
def test_the_indexer_rotates_as_transformers_at_any_width(index_dim):
    """The indexer's heads rotated as transformers' ``apply_rotary_pos_emb`` does with the layer's cos/sin cut to
    their width: narrower than the rotated part (6), as wide (8), wider (16: the first 8 rotated, as the release's)."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import apply_rotary_pos_emb

    half = torch.rand(5, 1, 4)  # 5 tokens, a rotated width of 8
    cos, sin = half.cos(), half.sin()
    x = torch.randn(5, 3, index_dim)
    full_cos, full_sin = (torch.cat((c, c), dim=-1)[:, 0][None, :, :index_dim] for c in (cos, sin))
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], full_cos, full_sin)
    assert max_diff(minimax_m3._rotate_as_transformers(x, cos, sin), want[0].transpose(0, 1)) < 1e-6


@torch.no_grad()
def _steps(model, steps: list[tuple[list[int], int, list[int] | None, torch.Tensor | None]]) -> list[torch.Tensor]:
    """One sequence's steps (its new tokens, their start slot, their positions or None, an ancestor mask or None)
    over a paged cache of shuffled 4-token blocks -> each step's logits [q, V]."""
    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import allocate_kv_cache

    allocate_kv_cache(model, 32, 4)
    table = [17, 3, 25, 9, 30, 1, 12, 22, 6, 28, 14]
    out = []
    for ids, start, positions, ancestors in steps:
        meta = build_attention_metadata([len(ids)], [start], [table], 4, positions=positions,
                                        ancestors=None if ancestors is None else [ancestors])
        out.append(model.compute_logits(model(torch.tensor(ids), meta)))
    return out


@pytest.mark.parametrize("path", ["batched", "own"])
def test_a_token_trees_nodes_pick_blocks_by_position(tiny_minimax_m3_dir, monkeypatch, path):
    """A tree verified in one step (three siblings at position 30, then a chain of three below the first: slots 30
    to 35, positions 30 to 33) gives each node the logits of its path run as a plain sequence: the indexer's blocks
    are of key positions, not slots (the first child sits in block 7 by position, 8 by slot), and a node sees its
    ancestors alone."""
    if path == "own":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    ids = prompt()
    context, chain = ids[:30], ids[30:34]
    siblings = [(chain[0] + 1) % 300, (chain[0] + 2) % 300]
    nodes = [chain[0], *siblings, *chain[1:]]
    parents = [-1, -1, -1, 0, 3, 4]
    ancestors = torch.eye(6, dtype=torch.bool)
    for i, parent in enumerate(parents):
        while parent >= 0:
            ancestors[i, parent] = True
            parent = parents[parent]
    model = load_model(str(tiny_minimax_m3_dir))
    tree = _steps(model, [(context, 0, None, None), (nodes, 30, [30, 30, 30, 31, 32, 33], ancestors)])[1]
    plain = _steps(model, [(context + chain, 0, None, None)])[0][30:]
    assert max_diff(tree[[0, 3, 4, 5]], plain) < TOL
    for row, token in ((1, siblings[0]), (2, siblings[1])):
        assert max_diff(tree[row], _steps(model, [(context + [token], 0, None, None)])[0][30]) < TOL


def _config(**fields):
    def mutate(config) -> None:
        for name, value in fields.items():
            setattr(config, name, value)
    return mutate


def _plain_norms(model) -> None:
    """Every norm scaling by its weight w instead of 1 + w."""
    for module in model.modules():
        if isinstance(module, UnitOffsetRMSNorm):
            module.weight.data -= 1.0


class _AllHeads(nn.Module):
    """A per-head q/k norm applied as M2's: over all of a token's heads at once (its weight the same per head)."""

    def __init__(self, norm: UnitOffsetRMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]
        xf = x.float().flatten(1)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf.view(x.shape) * (1.0 + self.weight.float())).to(x.dtype)


def _all_head_norms(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.q_norm = _AllHeads(layer.self_attn.q_norm)
        layer.self_attn.k_norm = _AllHeads(layer.self_attn.k_norm)


def _no_correction_bias(model) -> None:
    for layer in model.model.layers[1:]:
        layer.mlp.router_module.e_score_correction_bias.data.zero_()


def _silu_shared(model) -> None:
    """The shared MLP as SparseMoE's default shared expert computes: silu(gate) * up."""
    for layer in model.model.layers[1:]:
        shared = layer.mlp.shared_experts
        shared._hidden = lambda x, shared=shared: (lambda g, u: torch.nn.functional.silu(g) * u)(
            *shared.gate_up_proj(x).chunk(2, dim=-1))


MUTATIONS = {
    "norms-not-unit-offset": (None, _plain_norms),
    "qk-norms-over-all-heads": (None, _all_head_norms),
    "whole-head-rope": (_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 1.0}, rotary_dim=16), None),
    "no-block-pick": (_config(index_topk_blocks=1024), None),
    "no-local-block": (_config(index_local_blocks=0), None),
    "blocks-of-8": (_config(index_block_size=8), None),
    "swiglu-unclamped": (_config(swiglu_limit=1e9), None),
    "swiglu-alpha-default": (_config(swiglu_alpha=None), None),
    "routed-unscaled": (_config(routed_scaling_factor=1.0), None),
    "no-correction-bias": (None, _no_correction_bias),
    "shared-silu": (None, _silu_shared),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_difference_shows_in_the_logits(tiny_minimax_m3_dir, reference, mutation):
    assert max_diff(mutated_logits(tiny_minimax_m3_dir, *MUTATIONS[mutation]), reference) > MOVED


@pytest.mark.parametrize("field,value,match", [
    ("rotary_dim", 12, r"rotary_dim=12 but rope_parameters' partial_rotary_factor rotates 8 of head_dim=16 .*"
                       r"partial_rotary_factor to 0.75"),
    ("layer_types", ["full_attention", "sliding_attention", "full_attention"],
     r"layer_types=.* one of \['full_attention', 'minimax_m3_sparse'\]"),
    ("mlp_layer_types", ["dense", "sparse"], r"mlp_layer_types=.*one entry per layer \(num_hidden_layers=3\)"),
    ("index_n_heads", 3, r"index_n_heads=3 must divide num_attention_heads=4"),
    ("index_local_blocks", 4, r"index_local_blocks=4, index_topk_blocks=3"),
    ("scoring_func", "softmax", r"scoring_func='softmax' is not supported .* use 'sigmoid'"),
])
def test_what_would_be_guessed_is_refused_by_name(tiny_minimax_m3_dir, field, value, match):
    config = read_config(str(tiny_minimax_m3_dir))
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_minimax_m3_dir), config=config)


def test_the_mtp_drafter_is_refused(tiny_minimax_m3_dir):
    with pytest.raises(ValueError, match=r"multi-token-prediction module is not supported.*'ngram'"):
        MiniMaxM3ForCausalLM.mtp_layer_parts(read_config(str(tiny_minimax_m3_dir)), None)


VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=2,
              temporal_patch_size=1, spatial_merge_size=1, image_size=8)


@pytest.fixture(scope="module")
def multimodal_dir(tiny_minimax_m3_dir, tmp_path_factory) -> Path:
    """The multimodal checkpoint (transformers' MiniMaxM3SparseForConditionalGeneration, a tiny vision tower) around
    the tiny text model's weights, saved as transformers saves it: the release's names (``language_model.model.``,
    ``block_sparse_moe``, the experts' ``w1`` / ``w3`` / ``w2``, ``index_q_proj``, the MLPs' gate and up apart)."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (MiniMaxM3SparseForConditionalGeneration,
                                                                         MiniMaxM3VLForCausalLM)

    text = MiniMaxM3VLForCausalLM.from_pretrained(tiny_minimax_m3_dir, dtype=torch.float32)
    config = MiniMaxM3VLConfig(text_config=text.config.to_dict(), vision_config=VISION, projector_hidden_size=32)
    whole = MiniMaxM3SparseForConditionalGeneration(config).float()
    whole.model.language_model.load_state_dict(text.model.state_dict())
    whole.lm_head.load_state_dict(text.lm_head.state_dict())
    folder = tmp_path_factory.mktemp("tiny_minimax_m3_vl")
    whole.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_minimax_m3_dir / name, folder / name)
    return folder


@pytest.mark.parametrize("architecture", ["MiniMaxM3SparseForConditionalGeneration",
                                          "MiniMaxM3VLForConditionalGeneration"])
def test_multimodal_checkpoint_serves_its_text_model(multimodal_dir, reference, tmp_path, architecture):
    """The multimodal checkpoint's text model (its vision tower and projectors not read), under transformers' class
    name and the release's, gives the text model's logits."""
    from safetensors import safe_open

    with safe_open(str(multimodal_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"language_model.lm_head.weight", "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight",
            "language_model.model.layers.1.self_attn.index_q_proj.weight",
            "language_model.model.layers.0.mlp.gate_proj.weight"} <= names
    folder = tmp_path / "m"
    shutil.copytree(multimodal_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = [architecture]
    (folder / "config.json").write_text(json.dumps(config))
    model = load_model(str(folder))
    assert isinstance(model, MiniMaxM3ForCausalLM)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) < TOL


# one rank of two (WORKER_PRELUDE's): each folder's logits split by width and (expert parallel) by whole experts,
# against one rank's; and what this rank holds (query heads, the first sparse layer's experts and their width)
WORKER = WORKER_PRELUDE + textwrap.dedent("""

    result = []
    for folder in folders:
        one = logits(load_model(folder))
        for ep in (False, True):
            model = load_model(folder, tp, expert_parallel=ep, pp=pp)
            block = model.model.layers[1].mlp
            held = [model.model.layers[1].self_attn.num_heads, block.local_experts, block.inter_local]
            result.append([held, (logits(model) - one).abs().max().item()])
    del model, block  # gloo's threads end with the group only once nothing holds it
    gc.collect()
    dist.destroy_process_group()
    json.dump(result, open(f"{out}/{rank}.json", "w"))
""")


def test_tensor_and_expert_parallel_ranks_match_one_rank(tiny_minimax_m3_dir, tmp_path):
    """Two ranks, each two query heads and one KV head (the indexer, its keys and pick replicated), the experts at
    half their width and the dense and shared MLPs split, or (expert parallel) 4 whole experts each: every rank's
    logits, over a prefill long enough to attend on its own and a short batch, equal one rank's."""
    for result in run_ranks(tmp_path, WORKER, 2, 1, [str(tiny_minimax_m3_dir)]):
        (tp_held, tp_diff), (ep_held, ep_diff) = result
        assert tp_held == [2, 8, 16] and ep_held == [2, 4, 32], result
        assert tp_diff < TOL and ep_diff < TOL, result


def test_two_pipeline_stages_match_one_rank(tiny_minimax_m3_dir, tmp_path):
    """Two stages (the dense layer and the first sparse one, then the last, each stage's cache its own layers' K/V
    and indexer keys): the last stage's logits equal one rank's."""
    results = run_ranks(tmp_path, DIFF_WORKER, 2, 2, [str(tiny_minimax_m3_dir)])
    assert results[0]["diffs"] == [None] and results[1]["diffs"][0] < TOL, results



def test_engine_greedy_with_drafts_and_graphs_equals_transformers(tiny_minimax_m3_dir, no_host_sync):
    """``specray.LLM``'s greedy tokens equal transformers' ``generate`` (the outputs run past three blocks of the
    indexer, so its pick shapes them); so do they with n-gram chains and trees verified (a tree's nodes in blocks
    of their positions) and from graphs, whose forward syncs nothing with the host; over an FP8 cache (the indexer's
    keys in it too) the run completes."""
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_drafts_and_graphs_equal_transformers(tiny_minimax_m3_dir, no_host_sync, 16, fp8=True)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_minimax_m3_dir, schedule):
    """tests/test_device_parity.py's check for this file's fixture (that file's list cannot reach a fixture defined
    here): fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(tiny_minimax_m3_dir, SCHEDULES[schedule])
