"""LoRA adapters on the hybrid families whose layers mix attention with a recurrence: OLMo Hybrid
(specray.models.olmo_hybrid), RecurrentGemma (recurrent_gemma), Zamba2 (zamba2) and Zamba (zamba). Each adapter of
every projection the family adapts (PEFT's names for the transformers model) keeps a request's logits equal to
transformers' on the merged weights, over a prefill, verify chunks whose drafts stay pending and the replays after
them, beside a request without it (``check_lora_keeps_transformers_logits``); what is not adapted is refused at
admission by name (a conv; Zamba's and Zamba2's shared transformer blocks, whose one set of weights transformers runs
as a module of its own in each hybrid layer, so that PEFT gives each run an adapter of its own)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specray_test_hybrid_models import (  # tests/hybrid_models.py
    TOL, TP_WORKER, check_lora_keeps_transformers_logits, check_lora_refused, save)
from specray_test_model_checks import run_ranks  # tests/model_checks.py

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check_refused_by_name(base: Path, tmp_path: Path, suffix: str, refused: str) -> None:
    """An adapter of the checkpoint tensor ending ``suffix`` (a conv: not a 2-D weight, or any module) is refused at
    admission, the refusal naming the module ``refused`` (its tail)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    import specray_test_checkpoints as checkpoints  # tests/checkpoints.py (registered by conftest)
    from specray.engine.builder import adapter_checker
    from specray.lora import LoRAConfig, LoRARequest
    from specray.models.loader import load_model

    with safe_open(str(base / "model.safetensors"), "pt") as f:
        name = next(k for k in sorted(f.keys()) if k.endswith(suffix))
        shape = f.get_slice(name).get_shape()
    module = f"base_model.model.{name[: -len('.weight')]}"
    dst = tmp_path / "refused"
    checkpoints.write_lora(base, dst, rank=4, alpha=8, modules=())
    save_file({f"{module}.lora_A.weight": torch.randn(4, shape[-1]) * 0.1,
               f"{module}.lora_B.weight": torch.randn(shape[0], 4) * 0.1}, str(dst / "adapter_model.safetensors"))
    checker = adapter_checker(LoRAConfig(max_loras=1, max_lora_rank=4), load_model(base).config)
    with pytest.raises(ValueError, match=f"{refused}', which specray does not apply LoRA to"):
        checker.check(LoRARequest("r", 5, str(dst)))


# ---- OLMo Hybrid: attention's and the linear layers' q/k/v/o, g/a/b, the MLPs -------------------------------------

OLMO_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "g_proj", "a_proj",
               "b_proj")


@pytest.fixture(scope="module")
def olmo_dir(tmp_path_factory) -> Path:
    return save(tmp_path_factory.mktemp("lora_olmo_hybrid"), "olmo_hybrid", 31)


def test_olmo_hybrid_adapters_keep_transformers_logits(olmo_dir, tmp_path):
    """Every linear of both kinds of layer adapted at once (the linear layers' q, k and v: parts of one merged
    projection, each its own A); the convs refused by name."""
    check_lora_keeps_transformers_logits(olmo_dir, tmp_path, OLMO_LEAVES, None)
    check_refused_by_name(olmo_dir, tmp_path, ".linear_attn.q_conv1d.weight", "conv1d_q")


# ---- RecurrentGemma: the attention's q/k/v/o, the recurrent block's linear_x / linear_y / linear_out, the MLP --------

RG_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "linear_x", "linear_y",
             "linear_out")


@pytest.fixture(scope="module")
def rg_dir(tmp_path_factory) -> Path:
    from tests.test_recurrent_gemma import build_rg

    return build_rg(tmp_path_factory.mktemp("lora_recurrent_gemma"), seed=7)


def test_recurrent_gemma_adapters_keep_transformers_logits(rg_dir, tmp_path):
    """Every linear adapted at once (linear_x's adapter before the conv and the RG-LRU, as its merged weight is); the
    conv refused by name."""
    check_lora_keeps_transformers_logits(rg_dir, tmp_path, RG_LEAVES, None)
    check_refused_by_name(rg_dir, tmp_path, ".temporal_block.conv_1d.weight", "conv1d")


# ---- Zamba2 and Zamba: each layer's own projections; the shared block's refused ------------------------------------

ZAMBA_LEAVES = ("in_proj", "out_proj", "linear")


@pytest.fixture(scope="module")
def zamba2_dir(tmp_path_factory) -> Path:
    return save(tmp_path_factory.mktemp("lora_zamba2"), "zamba2", 33)


@pytest.fixture(scope="module")
def zamba_dir(tmp_path_factory) -> Path:
    from tests.test_zamba import build_zamba

    return build_zamba(tmp_path_factory.mktemp("lora_zamba"), seed=8)


@pytest.mark.parametrize("arch", ["zamba2", "zamba"])
def test_zamba_adapters_keep_transformers_logits(arch, zamba2_dir, zamba_dir, tmp_path):
    """The Mamba layers' and the hybrid layers' mixers (in_proj: Mamba-2's z | xBC | dt, Zamba's interleaved x / z
    rows de-interleaved as the weight's) and out_proj, and the hybrid layers' linear, adapted at once; the shared
    block's projections refused by name (q_proj here, gate_up_proj / down_proj and Zamba2's own per-run adapters
    below)."""
    folder = zamba2_dir if arch == "zamba2" else zamba_dir
    check_lora_keeps_transformers_logits(folder, tmp_path, ZAMBA_LEAVES, "q_proj")
    check_lora_refused(folder, tmp_path, "gate_up_proj" if arch == "zamba2" else "down_proj")
    if arch == "zamba2":
        check_refused_by_name(folder, tmp_path, ".linear_q_adapter_list.0.0.weight", "linear_q_adapter_list.0.0")


# ---- tensor parallelism: two ranks' adapted logits equal one rank's ------------------------------------------------

# TP_WORKER's steps (prefills, a verify chunk beside a decode, the replay after it) with the first sequence adapted;
# each folder's entry: the largest difference from one rank's logits, and how far the adapter moves one rank's
_LORA_EDITS = (
    ("def run(model):", "def run(model, lora):"),
    ("        rows.append(model.compute_logits(",
     "        lora[0].context.set_token_slots(torch.tensor([lora[1]] * lens[0] + [0] * lens[1]))\n"
     "        rows.append(model.compute_logits("),
    ("for folder in sys.argv[5:]:",
     "from specray.lora import LoRAConfig, LoRARequest\n"
     "from specray.models.lora import LoRASlots\n\n"
     "def adapted(model, adapter):\n"
     "    slots = LoRASlots(model, LoRAConfig(max_loras=1, max_lora_rank=4), torch.device('cpu'))\n"
     "    return slots, slots.slots_for([LoRARequest('a', 1, adapter)])[0]\n\n"
     "for folder, adapter in (a.split('::') for a in sys.argv[5:]):"),
    ("    ours, one = run(model), run(load_model(folder))",
     "    ours = run(model, adapted(model, adapter))\n"
     "    single = load_model(folder)\n"
     "    one = run(single, adapted(single, adapter))\n"
     "    plain = load_model(folder)\n"
     "    heads = (one - run(plain, (adapted(plain, adapter)[0], 0))).abs().max().item()"))


def _lora_worker() -> str:
    script = TP_WORKER
    for old, new in _LORA_EDITS:
        assert script.count(old) == 1, old
        script = script.replace(old, new)
    return script


def write_adapter(base: Path, dst: Path, leaves: tuple[str, ...]) -> Path:
    """A rank-4 adapter (alpha 8) of every checkpoint projection of the decoder layers whose leaf is in ``leaves``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    import specray_test_checkpoints as checkpoints  # tests/checkpoints.py (registered by conftest)

    g = torch.Generator().manual_seed(11)
    tensors = {}
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        for key in sorted(f.keys()):
            if key.startswith("model.layers.") and key.endswith(".weight") and key.split(".")[-2] in leaves:
                out_features, in_features = f.get_slice(key).get_shape()
                module = f"base_model.model.{key[: -len('.weight')]}"
                tensors[f"{module}.lora_A.weight"] = torch.randn(4, in_features, generator=g) * 0.1
                tensors[f"{module}.lora_B.weight"] = torch.randn(out_features, 4, generator=g) * 0.1
    checkpoints.write_lora(base, dst, rank=4, alpha=8, modules=())
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def test_two_ranks_equal_one_rank(olmo_dir, rg_dir, zamba2_dir, zamba_dir, tmp_path):
    """TP 2 over gloo with each family's adapter: B split as each projection's rows are (the merged q/k/v parts,
    Mamba-2's in_proj parts, Zamba's de-interleaved x / z halves), A as a row-parallel weight's columns; the adapted
    sequence's and the plain one's logits equal one rank's (and the adapter moves them)."""
    cases = [(olmo_dir, OLMO_LEAVES), (rg_dir, RG_LEAVES), (zamba2_dir, ZAMBA_LEAVES), (zamba_dir, ZAMBA_LEAVES)]
    args = [f"{folder}::{write_adapter(folder, tmp_path / f'adapter{i}', leaves)}"
            for i, (folder, leaves) in enumerate(cases)]
    results = run_ranks(tmp_path / "tp", _lora_worker(), 2, 2, args)
    for folder, _ in cases:
        diff, moved = results[0][str(folder)]
        assert diff < TOL and moved > 1e-2, (folder, diff, moved)
