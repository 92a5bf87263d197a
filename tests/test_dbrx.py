"""DBRX (``DbrxForCausalLM``) against transformers on the same random tiny weights (fp32, max abs diff < 1e-4): its
fused ``Wqkv`` over grouped-query heads with q/k/v clamped, LayerNorms without biases, and experts in every layer
stored fused as ``w1`` / ``v1`` / ``w2``, routed by a softmax's top k divided by their p-norm; over a prefill and
over chunks and single steps, through the experts' sync-free grouped path too (graph steps'); the engine's greedy
output under n-gram drafts equal to transformers' ``generate``; two ranks (experts split by width, or whole per rank)
and two pipeline stages equal to one rank. Each distinctive part is shown to matter (a model without it differs),
and a release's RoPE base is read where it sets it (``attn_config.rope_theta``)."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap

import pytest

from specray.models import dbrx
from specray.models.dbrx import DbrxForCausalLM
from specray.models.loader import load_model, read_config
from specray.models.moe import SparseMoE, sync_free_experts
from specray_test_model_checks import (SCHEDULES, WORKER_PRELUDE, chunked_logits, max_diff,  # tests/model_checks.py
                                       mutated_logits, prompt, reference_logits, run_ranks)

TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_dbrx_dir):
    return reference_logits(tiny_dbrx_dir)


def _edited_copy(folder, dst, edit):
    """A copy of the model in ``folder`` (the same weights) whose config.json ``edit(config)`` changed."""
    shutil.copytree(folder, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_dbrx_dir, reference, schedule):
    model = load_model(str(tiny_dbrx_dir))
    assert isinstance(model, DbrxForCausalLM) and all(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def test_the_experts_grouped_path_matches_transformers(tiny_dbrx_dir, reference):
    """The experts' sync-free path (what graph steps run: one grouped matmul per projection) gives the same logits."""
    model = load_model(str(tiny_dbrx_dir))
    with sync_free_experts():
        assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) < TOL


def test_engine_greedy_with_ngram_drafts_equals_transformers(tiny_dbrx_dir):
    sys.modules["specray_test_engine_runs"].assert_ngram_greedy_equals_transformers(tiny_dbrx_dir)


@pytest.mark.parametrize("mistake", ["no_clip_qkv", "no_weight_norm", "gate_up_swapped", "w2_untransposed"])
def test_each_part_matters(tiny_dbrx_dir, reference, monkeypatch, mistake):
    """A model without one of DBRX's parts differs from transformers: the comparisons above see each of them (the
    clamp of q/k/v, the division by the weights' norm, the fused experts' split: gate and up rows, w2 transposed)."""
    mutate_config = {"no_clip_qkv": lambda config: setattr(config.attn_config, "clip_qkv", None),
                     "no_weight_norm": lambda config: setattr(config.ffn_config, "moe_normalize_expert_weights",
                                                              None)}.get(mistake)
    if mistake == "gate_up_swapped":
        monkeypatch.setitem(dbrx.EXPERT_PARTS, "w1", ("up_proj", False))
        monkeypatch.setitem(dbrx.EXPERT_PARTS, "v1", ("gate_proj", False))
    elif mistake == "w2_untransposed":  # w2's expert rows read as down_proj's [hidden, width] rows (a reshape)
        real = dbrx.ExpertRows.__getitem__

        def reshaped(self, index):
            whole = real(self, ...)  # [hidden, width]
            return whole.t().reshape(whole.shape)[index] if self.transposed else real(self, index)

        monkeypatch.setattr(dbrx.ExpertRows, "__getitem__", reshaped)
    assert max_diff(mutated_logits(tiny_dbrx_dir, mutate_config), reference) > 1e-3


def test_weights_divided_by_another_p_norm(tiny_dbrx_dir, tmp_path):
    """moe_normalize_expert_weights=2: the chosen weights divided by their 2-norm, as transformers does (not summed to
    1), on the same weights."""
    def two(config):
        config["ffn_config"]["moe_normalize_expert_weights"] = 2.0

    folder = _edited_copy(tiny_dbrx_dir, tmp_path / "p2", two)
    ours = chunked_logits(load_model(str(folder)), prompt(), SCHEDULES["prefill"])
    assert max_diff(ours, reference_logits(folder)) < TOL
    assert max_diff(ours, reference_logits(tiny_dbrx_dir)) > 1e-3


def test_rope_base_of_a_release_is_its_attn_config_s(tiny_dbrx_dir, reference, tmp_path):
    """A release's config.json sets its RoPE base in attn_config.rope_theta alone (500000), and transformers 5 reads it
    with its default rope_parameters (base 10000): the model rotates at the release's base, the logits those of
    transformers given that base (the fixture's rope_parameters), not those of the default."""
    def release(config):
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}

    folder = _edited_copy(tiny_dbrx_dir, tmp_path / "release", release)
    ours = chunked_logits(load_model(str(folder)), prompt(), SCHEDULES["prefill"])
    assert max_diff(ours, reference) < TOL
    assert max_diff(ours, reference_logits(folder)) > 1e-3


@pytest.mark.parametrize("field,value,match", [
    ("ffn_act_fn", {"name": "gelu"}, r"ffn_config.ffn_act_fn=\{'name': 'gelu'\} is not supported for "
                                     r"model_type='dbrx'.*use \{'name': 'silu'\}"),
    ("moe_normalize_expert_weights", 0.0, r"moe_normalize_expert_weights=0.0 is not supported.* p > 0"),
])
def test_unsupported_ffn_configs_are_refused_by_name(tiny_dbrx_dir, field, value, match):
    config = read_config(str(tiny_dbrx_dir))
    setattr(config.ffn_config, field, value)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_dbrx_dir), config=config)


# one rank of two (WORKER_PRELUDE's): each folder's logits against one rank's, and what its first layer's experts hold
# on this rank (experts, width); a folder named *-ep: whole experts per rank
WORKER = WORKER_PRELUDE + textwrap.dedent("""

    result = []
    for folder in folders:
        model = load_model(folder, tp, expert_parallel=folder.endswith("-ep"), pp=pp)
        ours = logits(model)
        block = model.model.layers[model.model.stage.start].mlp
        diff = None if ours is None else (ours - logits(load_model(folder))).abs().max().item()
        result.append([list(model.model.stage), block.local_experts, block.inter_local, diff])
    del model, block  # gloo's threads end with the group only once nothing holds it
    gc.collect()
    dist.destroy_process_group()
    json.dump(result, open(f"{out}/{rank}.json", "w"))
""")


def test_two_ranks_and_two_stages_match_one_rank(tiny_dbrx_dir, tmp_path):
    """TP 2: each rank two query heads and one KV head (its rows of Wqkv), every expert at half its width or (expert
    parallel) 4 whole experts; PP 2: one layer per stage. The last rank's logits equal one rank's."""
    ep = tmp_path / "tiny-ep"
    ep.symlink_to(tiny_dbrx_dir, target_is_directory=True)
    folders = [str(tiny_dbrx_dir), str(ep)]
    for result in run_ranks(tmp_path / "tp", WORKER, 2, 1, folders):
        (layers, experts, width, diff), (_, ep_experts, ep_width, ep_diff) = result
        assert (layers, experts, width, ep_experts, ep_width) == ([0, 1], 8, 16, 4, 32), result
        assert diff < TOL and ep_diff < TOL, result
    first, last = (r[0] for r in run_ranks(tmp_path / "pp", WORKER, 2, 2, folders[:1]))
    assert first[0] == [0] and first[3] is None and last[0] == [1] and last[3] < TOL, (first, last)
