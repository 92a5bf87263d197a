"""A.X-K2 (``AXK2ForCausalLM``): DeepSeek-V3.2's latent attention with DeepSeek Sparse Attention's indexer, every
layer's input norm (and a sparse layer's post-attention norm) a gated RMSNorm, queries and a per-feature output gate
from one ``q_gate_proj`` over the query latent normed and not, and experts routed over groups where the config sets
``n_group`` / ``topk_group`` (else over every expert); against transformers on the same random tiny weights (fp32,
max abs diff < 1e-4; the checkpoint as transformers saves it: the release's names) with ``index_topk`` 6 of a
40-token prompt, so that the selection decides the logits. Every attention path (the padded short batch, one sequence
at a time, the unabsorbed form of a chunk), the experts' sync-free path, the ungrouped routing, tensor parallel 2 and
two pipeline stages equal to one rank, and the engine: greedy with n-gram chains and trees, from graphs, equal to
transformers' ``generate``. Each distinctive part broken once (the gated norms, the output gate, the query
projection's input order, the grouping, the selection) moves the logits; the grouped router's masking equals
transformers' where V3's -inf would not; what this port does not serve (MTP, inconsistent configs) is refused by
name. The tiny model is built here (transformers' AXK2Config, random weights made visible), not in conftest."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from specray.models import axk2, cpu_kernels
from specray.models.axk2 import AXK2Attention, AXK2ForCausalLM, AXK2MoE, GatedRMSNorm
from specray.models.layers import RMSNorm
from specray.models.llama import LlamaMLP
from specray.models.loader import load_model, read_config
from specray.models.moe import sync_free_experts
from specray.parallel import TPGroup
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_ranks_match_one_rank, chunked_logits, max_diff, mutated_logits,
    prompt, reference_logits)

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
TOPK = 6  # index_topk of a 40-token prompt: most queries attend a few of their keys
# 3 layers (a dense one, then experts), V3.2's tiny latent sizes (tests/conftest.py's DSA_TINY), 16 indexer heads (with
# few, many keys score exactly 0 and the k-th pick is a tie that implementations break differently), 8 experts in 4
# groups of which 2 are kept, a gate of rank 8
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, index_n_heads=16, index_head_dim=16, index_topk=TOPK,
            gated_norm_rank=8, n_group=4, topk_group=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
            initializer_range=0.05, tie_word_embeddings=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 256, "mscale": 1.0, "mscale_all_dim": 1.0})


def build_tiny_axk2(path: Path, seed: int) -> Path:
    """transformers' AXK2ForCausalLM at :data:`TINY`'s sizes with random weights (norms, the routers, the gated
    norms' gates, the indexer's key-norm bias and the correction biases drawn away from their init, so that each
    shows), saved as transformers saves it, with conftest's tiny tokenizer."""
    from transformers import AXK2Config, AXK2ForCausalLM as HFAXK2

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path)
    config = AXK2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                        bos_token_id=None, **TINY)
    torch.manual_seed(seed)
    model = HFAXK2(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the router: zeros at init
                param.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):  # ones at init
                param.uniform_(0.5, 1.5)
            elif name.endswith(("layernorm.mlp.fc1.weight", "layernorm.mlp.fc2.weight")):  # a gate far from 1/2
                param.normal_(0.0, 0.3)
            elif name.endswith("indexer.k_norm.bias"):  # zeros at init
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_axk2_dir(tmp_path_factory) -> Path:
    return build_tiny_axk2(tmp_path_factory.mktemp("tiny_axk2"), seed=91)


def _edited_copy(folder: Path, dst: Path, edit) -> Path:
    """A copy of the model in ``folder`` (the same weights) whose config.json ``edit(config)`` changed."""
    shutil.copytree(folder, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _ungrouped(config: dict) -> None:
    config["n_group"] = config["topk_group"] = None


@pytest.fixture(scope="module")
def tiny_axk2_ungrouped_dir(tiny_axk2_dir, tmp_path_factory) -> Path:
    """The same weights routed over every expert (A.X-K2-Light's config: no n_group, no topk_group)."""
    return _edited_copy(tiny_axk2_dir, tmp_path_factory.mktemp("tiny_axk2_ungrouped") / "m", _ungrouped)


@pytest.fixture(scope="module")
def reference(tiny_axk2_dir) -> torch.Tensor:
    return reference_logits(tiny_axk2_dir)


@pytest.mark.parametrize("path", ["batched", "own", "unabsorbed"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_axk2_dir, reference, monkeypatch, schedule, path):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps over shuffled blocks;
    short queries as the padded batch or one sequence at a time, and every chunk in the unabsorbed form."""
    if path == "own":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    model = load_model(str(tiny_axk2_dir))
    assert isinstance(model, AXK2ForCausalLM)
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == [LlamaMLP, AXK2MoE, AXK2MoE]
    assert all(type(layer.input_layernorm) is GatedRMSNorm for layer in layers)
    assert [type(layer.post_attention_layernorm) for layer in layers] == [RMSNorm, GatedRMSNorm, GatedRMSNorm]
    assert all(isinstance(layer.self_attn, AXK2Attention) and layer.self_attn.attn.index_topk == TOPK
               and not hasattr(layer.self_attn, "q_b_proj") for layer in layers)
    assert all(layer.mlp.expert_groups == (4, 2) for layer in layers[1:])
    if path == "unabsorbed":
        for layer in layers:
            layer.self_attn.attn.unabsorbed_from = 1
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def test_module_reads_release_and_transformers_names():
    """The release's (and transformers' saved) names map onto the modules: the gated norm's weight, its gate's
    W_down / W_up, the fused q_b_proj; transformers' own module names too."""
    def ours(name):
        for pattern, repl in axk2._CHECKPOINT_NAMES["axk2"]:
            name = pattern.sub(repl, name)
        return name

    layer = "model.layers.3."
    assert ours(layer + "input_layernorm.norm.weight") == layer + "input_layernorm.weight"
    assert ours(layer + "post_attention_layernorm.W_down.weight") == layer + "post_attention_layernorm.mlp.fc1.weight"
    assert ours(layer + "input_layernorm.W_up.weight") == layer + "input_layernorm.mlp.fc2.weight"
    assert ours(layer + "input_layernorm.mlp.fc2.weight") == layer + "input_layernorm.mlp.fc2.weight"
    assert ours(layer + "self_attn.q_b_proj.weight") == layer + "self_attn.q_gate_proj.weight"
    assert ours(layer + "self_attn.q_gate_proj.weight") == layer + "self_attn.q_gate_proj.weight"
    assert ours(layer + "self_attn.q_a_layernorm.weight") == layer + "self_attn.q_a_layernorm.weight"


def test_the_experts_sync_free_path_matches_transformers(tiny_axk2_dir, reference):
    """The experts' sync-free path (what graph steps run) with the grouped routing gives the same logits."""
    model = load_model(str(tiny_axk2_dir))
    with sync_free_experts():
        assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) < TOL


def test_ungrouped_routing_matches_transformers(tiny_axk2_ungrouped_dir, reference):
    """Without n_group / topk_group (A.X-K2-Light), every expert is a candidate: the logits equal transformers' on
    that config, and differ from the grouped model's (the grouping changes some tokens' experts)."""
    want = reference_logits(tiny_axk2_ungrouped_dir)
    model = load_model(str(tiny_axk2_ungrouped_dir))
    assert all(layer.mlp.expert_groups is None for layer in model.model.layers[1:])
    got = chunked_logits(model, prompt(), SCHEDULES["chunked+decode"])
    assert max_diff(got, want) < TOL
    assert max_diff(got, reference) > MOVED


def test_grouped_router_masks_to_zero_as_transformers():
    """The grouped routing on its own against transformers' AXK2TopkRouter, with correction biases negative enough
    that some kept experts' biased scores fall below 0: the same experts and weights; V3's rule (the other groups
    masked to -inf) picks others for some tokens, so the comparison sees the 0.0."""
    from types import SimpleNamespace

    from transformers import AXK2Config
    from transformers.models.axk2.modeling_axk2 import AXK2TopkRouter

    fields = {k: TINY[k] for k in ("hidden_size", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                                   "moe_intermediate_size", "n_shared_experts")}
    hf = AXK2TopkRouter(AXK2Config(**fields, routed_scaling_factor=2.5))
    ours = AXK2MoE(SimpleNamespace(model_type="axk2", hidden_act="silu", norm_topk_prob=True,
                                   routed_scaling_factor=2.5, **fields), TPGroup.single())
    torch.manual_seed(5)
    with torch.no_grad():
        hf.weight.normal_(0.0, 0.5)
        hf.e_score_correction_bias.normal_(-0.6, 0.3)
        ours.router_module.weight.copy_(hf.weight)
        ours.router_module.e_score_correction_bias.copy_(hf.e_score_correction_bias)
        x = torch.randn(256, TINY["hidden_size"])
        _, want_w, want_ids = hf(x)
        got_w, got_ids = ours.route(x)
        # V3's rule on the same scores: the experts outside the kept groups at -inf
        scores = torch.sigmoid(x @ hf.weight.t())
        choice = (scores + hf.e_score_correction_bias).view(256, 4, 2)
        kept = choice.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
        allowed = torch.zeros(256, 4, dtype=torch.bool).scatter_(1, kept, True)
        v3_ids = choice.masked_fill(~allowed[:, :, None], float("-inf")).view(256, 8).topk(2, dim=-1).indices

    def by_token(ids, weights):
        order = ids.argsort(dim=-1)
        return ids.gather(1, order), weights.gather(1, order)

    (want_ids, want_w), (got_ids, got_w) = by_token(want_ids, want_w), by_token(got_ids, got_w)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)
    assert (v3_ids.sort(dim=-1).values != want_ids).any(dim=-1).sum() > 0


# ---- each distinctive part, broken on purpose ------------------------------------------------------------------------

def _plain_norms(monkeypatch) -> None:
    """The gated norms without their gates (plain RMSNorms)."""
    monkeypatch.setattr(GatedRMSNorm, "_norm", RMSNorm._norm)


def _no_output_gate(monkeypatch) -> None:
    monkeypatch.setattr(AXK2Attention, "gate", lambda self, out, gate: out)


def _latent_halves_swapped(model) -> None:
    """q_gate_proj reading ``[c_q ; q_a_layernorm(c_q)]`` instead of ``[q_a_layernorm(c_q) ; c_q]``."""
    for layer in model.model.layers:
        w = layer.self_attn.q_gate_proj.weight
        half = w.shape[1] // 2
        w.data.copy_(torch.cat((w[:, half:], w[:, :half]), dim=1))


def _no_selection(config) -> None:
    """Every key attended (the indexer keeping more than any context holds)."""
    config.index_topk = 1024


def _ungrouped_config(config) -> None:
    config.n_group = config.topk_group = None


MUTATIONS = {"gated-norms-ungated": (_plain_norms, None, None), "no-output-gate": (_no_output_gate, None, None),
             "q-latent-halves-swapped": (None, None, _latent_halves_swapped),
             "no-grouping": (None, _ungrouped_config, None), "no-selection": (None, _no_selection, None)}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_logits(tiny_axk2_dir, reference, monkeypatch, mutation):
    """Each distinctive part broken once (the gated norms' gates, the attention's output gate, the order of the query
    projection's input halves, the expert groups, the indexer's selection): the logits move by more than a hundred
    times the tolerance."""
    patch, mutate_config, mutate = MUTATIONS[mutation]
    if patch is not None:
        patch(monkeypatch)
    assert max_diff(mutated_logits(tiny_axk2_dir, mutate_config, mutate), reference) > MOVED


# ---- LoRA ------------------------------------------------------------------------------------------------------------

def test_adapted_logits_match_transformers_with_the_adapter_merged(tiny_axk2_dir, tmp_path):
    """An adapter of every projection applied as a linear (PEFT's names on transformers' modules: q_gate_proj, not the
    release's q_b_proj), its prefill's logits equal transformers' on the merged weights, and differ from the base's."""
    from safetensors.torch import load_file, save_file

    from specray.lora import LoRAConfig, LoRARequest
    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import allocate_kv_cache
    from specray.models.lora import LoRASlots

    checkpoints = sys.modules["specray_test_checkpoints"]
    every = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter = checkpoints.write_lora(tiny_axk2_dir, tmp_path / "adapter", modules=every, std=0.1)
    merged = checkpoints.merge_lora(tiny_axk2_dir, adapter, tmp_path / "merged")  # on the checkpoint's names
    peft = tmp_path / "peft"  # as PEFT names it, trained on transformers' model
    shutil.copytree(adapter, peft)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({k.replace(".q_b_proj.", ".q_gate_proj."): v for k, v in tensors.items()},
              str(peft / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = [m.replace("q_b_proj", "q_gate_proj") for m in config["target_modules"]]
    (peft / "adapter_config.json").write_text(json.dumps(config))

    model = load_model(str(tiny_axk2_dir))
    slots = LoRASlots(model, LoRAConfig(max_loras=1, max_lora_rank=4), torch.device("cpu"))
    assert {name.rsplit(".", 1)[-1] for name in slots.layers} == {
        "q_a_proj", "q_gate_proj", "kv_a_proj_with_mqa", "o_proj", "gate_up_proj", "down_proj"}
    ids = prompt()[:20]
    slots.context.set_token_slots(torch.tensor(slots.slots_for([LoRARequest("a", 1, str(peft))]) * len(ids)))
    allocate_kv_cache(model, 8, 4)
    meta = build_attention_metadata([len(ids)], [0], [list(range(8))[::-1]], 4, "cpu")
    with torch.no_grad():
        got = model.compute_logits(model(torch.tensor(ids), meta))
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        want, base = (AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
                      for f in (merged, tiny_axk2_dir))
    assert max_diff(got, want) < TOL and max_diff(got, base) > MOVED


# ---- what is refused -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,match", [
    ("topk_group", None, r"n_group=4, topk_group=None: A.X-K2 routes by groups with both set"),
    ("n_group", 3, r"n_routed_experts=8, n_group=3, topk_group=2: the experts must split"),
    ("mlp_layer_types", ["dense", "moe", "sparse"], r"mlp_layer_types=\['dense', 'moe', 'sparse'\]: A.X-K2 needs one"),
    ("gated_norm_rank", None, r"gated_norm_rank=None: A.X-K2's gated norms need a positive int rank"),
    ("q_lora_rank", None, r"q_lora_rank=None: A.X-K2's q_gate_proj and indexer read the query latent"),
], ids=["topk_group", "n_group", "mlp_layer_types", "gated_norm_rank", "q_lora_rank"])
def test_inconsistent_configs_are_refused_by_name(tiny_axk2_dir, field, value, match):
    config = read_config(str(tiny_axk2_dir))
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_axk2_dir), config=config)


def test_mtp_is_refused(tiny_axk2_dir):
    """transformers' A.X-K2 has no MTP module, so no layout of a release's MTP layers to follow: the ``mtp`` head's
    block is refused by name (and this checkpoint, like transformers', has no MTP layer at all)."""
    from specray import LLM

    config = read_config(str(tiny_axk2_dir))
    with pytest.raises(ValueError, match=r"method='mtp' is not supported for model_type='axk2'"):
        AXK2ForCausalLM.mtp_layer_parts(config, TPGroup.single())
    with pytest.raises(ValueError, match=r"has no MTP layer"):
        LLM(model=str(tiny_axk2_dir), max_model_len=64, block_size=4,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})


# ---- ranks and stages ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2], ids=["tp2", "pp2"])
def test_two_ranks_match_one_rank(tiny_axk2_dir, tiny_axk2_ungrouped_dir, tmp_path, stages):
    """Two tensor-parallel ranks (each half the heads, their q_gate_proj rows and the experts' width; the latents,
    the indexer, the gates of the norms and the router replicated) or two pipeline stages: the last rank's logits
    equal one rank's, grouped and not."""
    folders = [str(tiny_axk2_dir), str(tiny_axk2_ungrouped_dir)]
    assert_ranks_match_one_rank(tmp_path, folders, stages, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------


def test_engine_greedy_equals_transformers_with_drafts_and_graphs(tiny_axk2_dir, no_host_sync):
    """``specray.LLM``'s greedy tokens equal transformers' ``generate``; so do they with n-gram chains verified
    eagerly and n-gram trees from graphs (on CPU their padded static inputs; the gates, the selection and the grouped
    routing sync nothing with the host)."""
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_drafts_and_graphs_equal_transformers(tiny_axk2_dir, no_host_sync, 12)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_axk2_dir, schedule):
    """tests/test_device_parity.py's check for this file's fixture (that file's list cannot reach a fixture defined
    here): fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(tiny_axk2_dir, SCHEDULES[schedule])
