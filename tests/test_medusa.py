"""Medusa heads: the public checkpoint layouts, their checks, and medusa_choices (the engine's greedy identity,
preemption, stop strings and distribution tests run Medusa in tests/test_hidden_state_drafters.py)."""

from __future__ import annotations

import json

import pytest
import torch

from specray import LLM
from specray.drafters.hidden_state import DEFAULT_MEDUSA_CHOICES, MedusaOptions
from specray.models.loader import load_hf_config
from specray.models.medusa import MedusaHeads, load_medusa_heads, save_medusa_heads


import specray_test_draft_heads as draft_heads  # tests/draft_heads.py (tests/conftest.py registers it)


@pytest.fixture(scope="module")
def target_dir(make_tiny_model, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("medusa_target"), "llama", num_hidden_layers=2)


@pytest.mark.parametrize("layout", ["medusa", "vllm"])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_both_layouts_load_what_was_written(target_dir, tmp_path, layout, num_layers):
    folder = draft_heads.write_medusa_heads(tmp_path / "heads", target_dir, num_heads=3, num_layers=num_layers,
                                            layout=layout)
    names = json.loads((folder / "config.json").read_text())
    assert ("medusa_num_heads" in names) == (layout == "medusa") and ("num_heads" in names) == (layout == "vllm")
    heads = load_medusa_heads(str(folder), load_hf_config(str(target_dir)), torch.float32, "cpu")
    assert (heads.num_heads, heads.num_layers) == (3, num_layers)
    # the same tensors read back by hand, and the heads' math: x + SiLU(W x + b) per block, then the LM head
    from safetensors.torch import load_file

    raw = load_file(str(next(folder.glob("*.safetensors"))))
    x = torch.randn(5, heads.lm_heads[0].weight.shape[1])
    for k in range(3):
        h = x
        for j in range(num_layers):
            w, b = ((raw[f"{k}.{j}.linear.weight"], raw[f"{k}.{j}.linear.bias"]) if layout == "medusa" else
                    (raw[f"blocks.{k}.layers.{j}.weight"], raw[f"blocks.{k}.layers.{j}.bias"]))
            h = h + torch.nn.functional.silu(h @ w.T + b)
        lm = raw[f"{k}.{num_layers}.weight"] if layout == "medusa" else raw[f"lm_heads.{k}.weight"]
        torch.testing.assert_close(heads(x)[:, k], h @ lm.T)


def test_prefixed_names_and_a_pt_file_load(target_dir, tmp_path):
    config = load_hf_config(str(target_dir))
    heads = MedusaHeads(2, 1, config.hidden_size, config.vocab_size)
    folder = tmp_path / "pt"
    save_medusa_heads(heads, folder)
    from safetensors.torch import load_file

    state = {f"medusa_head.{k}": v for k, v in load_file(str(folder / "medusa_lm_head.safetensors")).items()}
    (folder / "medusa_lm_head.safetensors").unlink()
    torch.save(state, folder / "medusa_lm_head.pt")
    loaded = load_medusa_heads(str(folder), config, torch.float32, "cpu")
    x = torch.randn(3, config.hidden_size)
    torch.testing.assert_close(loaded(x), heads(x))


def test_heads_for_another_model_are_refused(target_dir, tmp_path):
    config = load_hf_config(str(target_dir))
    save_medusa_heads(MedusaHeads(2, 1, config.hidden_size * 2, config.vocab_size), tmp_path / "wide")
    with pytest.raises(ValueError, match="trained for another model"):
        load_medusa_heads(str(tmp_path / "wide"), config, torch.float32, "cpu")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no .*safetensors"):
        load_medusa_heads(str(tmp_path / "empty"), config, torch.float32, "cpu")
    from safetensors.torch import save_file

    save_file({"0.0.linear.weight": torch.zeros(2, 2)}, str(tmp_path / "empty" / "x.safetensors"))
    with pytest.raises(ValueError, match="no LM heads"):
        load_medusa_heads(str(tmp_path / "empty"), config, torch.float32, "cpu")


def test_medusa_choices_are_checked_and_ordered():
    assert MedusaOptions(model="m").tree() == [list(c) for c in DEFAULT_MEDUSA_CHOICES]
    given = [[0], [1], [0, 0], [0, 1]]
    assert MedusaOptions(model="m", medusa_choices=given).tree() == given  # every path after its prefix: as given
    assert MedusaOptions(model="m", medusa_choices=[[0, 0], [1], [0]]).tree() == [[0], [1], [0, 0]]
    for bad, why in [([[0, 1]], "without their parent"), ([[0], [0]], "twice"), ([], "non-empty"),
                     ([[0], [-1]], "non-empty list"), ("0,1", "non-empty list"), ([[0], [True]], "non-empty list")]:
        with pytest.raises(ValueError, match=why):
            MedusaOptions(model="m", medusa_choices=bad)
    with pytest.raises(ValueError, match="needs the heads' checkpoint"):
        MedusaOptions()


def test_a_tree_deeper_than_the_heads_is_refused(target_dir, tmp_path):
    folder = draft_heads.write_medusa_heads(tmp_path / "two", target_dir, num_heads=2)
    with pytest.raises(ValueError, match="3 levels deep but the checkpoint has 2 heads"):
        LLM(str(target_dir), speculative_config={"method": "medusa", "model": str(folder),
                                                 "medusa_choices": [[0], [0, 0], [0, 0, 0]]})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_drafted_token_ids_survive_the_heads_dtype(dtype):
    """A GPU model's heads run in bf16 or fp16, which hold integers exactly only up to 256 or 2048: the drafts'
    token ids must reach the host exact (vocabularies run to 49k-256k)."""
    from specray.contract import ScheduledChunk, StepPlan
    from specray.workers.medusa_drafter import MedusaDrafter

    vocab, peaks = 50000, (40001, 30003)

    class Heads:
        num_heads, tp = 2, None

        def __call__(self, hidden):
            logits = torch.zeros(hidden.shape[0], self.num_heads, vocab, dtype=dtype)
            for k, token in enumerate(peaks):
                logits[:, k, token] = 20.0
            return logits

    drafter = MedusaDrafter(Heads(), [[0], [0, 0]])
    plan = StepPlan(0, chunks=[ScheduledChunk("r", [5], start_pos=3, num_next_drafts=2)])
    [drafted] = drafter.draft(plan, {}, torch.zeros(1, 8, dtype=dtype), [], {0: [7]}, {})
    assert drafted.token_ids == list(peaks) and drafted.parents == [-1, 0]
