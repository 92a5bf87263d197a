"""Hidden-state draft heads (EAGLE-1, EAGLE-3, DeepSeek-style MTP) at unit level, on a tiny random 6-layer Llama
in fp32 on the CPU:

* loading each public layout gives the checkpoint's tensors (q/k/v and gate/up merged), and saving then loading
  gives the same head back;
* checkpoints that do not fit the target are a ValueError that names the problem;
* the paged head, driven through :class:`HiddenStateDrafter` over shuffled block tables (chunked prefill, chains,
  a token tree, requests drafting different counts or none), gives the logits and drafts of a dense reference
  written here from the papers' math with plain torch, fed transformers' features of the target; MTP with
  ``feedback_normed`` also equals transformers' own ``MtpLayer``;
* the target's aux features at EAGLE-3's layers are transformers' ``hidden_states[i]``;
* an EAGLE-3 draft vocabulary maps to target ids (``to_target_ids``, ``full_vocab_logits``).
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specray.contract import ScheduledChunk, StepPlan
from specray.workers.head_drafter import HiddenStateDrafter
from specray.models import cpu_kernels
from specray.models.attention import build_attention_metadata
from specray.models.draft_head import DraftHead, eagle3_aux_layers
from specray.models.draft_head_loader import load_draft_head, save_draft_head
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import load_model

TOL = 1e-4
BLOCK = 4
NUM_LAYERS = 6
NUM_BLOCKS = 64
STD = 0.1  # random head weights: EAGLE-1 has no norm before the LM head, so larger ones give logits in the 100s


import specray_test_draft_heads as helpers  # tests/draft_heads.py (tests/conftest.py registers it)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


class Target:
    """The tiny target: its folder, HF config, our model and transformers' on the same weights."""

    def __init__(self, folder: Path):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.dir = folder
        self.config = AutoConfig.from_pretrained(folder)
        self.model = load_model(str(folder))
        self.hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.vocab = self.config.vocab_size
        self.hidden = self.config.hidden_size

    def load(self, method: str, folder: Path, **kw):
        return load_draft_head(method, folder, self.model, self.config, **kw)

    @torch.no_grad()
    def features(self, tokens: list[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """transformers' last hidden state (after the final norm) [n, H] and hidden_states (L + 1) x [n, H]."""
        out = self.hf.model(torch.tensor([tokens]), output_hidden_states=True)
        return out.last_hidden_state[0], tuple(h[0] for h in out.hidden_states)


@pytest.fixture(scope="module")
def target(make_tiny_model, tmp_path_factory) -> Target:
    folder = make_tiny_model(tmp_path_factory.mktemp("head_target"), "llama", seed=5, num_hidden_layers=NUM_LAYERS,
                             tie_word_embeddings=True)
    return Target(folder)


def other_target_dir(target: Target, folder: Path, **changes) -> Path:
    """A config-only folder of another target (write_random_head reads only config.json for eagle/eagle3)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((target.dir / "config.json").read_text())
    config.update(changes)
    config.pop("head_dim", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def write_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def canonical(method: str, tensors: dict[str, torch.Tensor], num_target_layers: int = NUM_LAYERS
              ) -> dict[str, torch.Tensor]:
    """A checkpoint's head tensors under one naming, written here independently of the loader: ``layers.0.*``
    (q/k/v and gate/up still separate), ``fc``/``enorm``/``hnorm``/``eh_proj``/``norm``/``lm_head``/``d2t``."""
    out = {}
    mtp_prefix = f"model.layers.{num_target_layers}."
    for name, tensor in tensors.items():
        if method == "mtp":
            if not name.startswith(mtp_prefix):
                continue
            name = name[len(mtp_prefix):]
            if name in ("embed_tokens.weight", "shared_head.head.weight"):
                continue
            if name == "shared_head.norm.weight":
                name = "norm.weight"
            elif not name.startswith(("enorm.", "hnorm.", "eh_proj.")):
                name = "layers.0." + name
        else:
            if name in ("t2d", "embed_tokens.weight"):
                continue
            name = name.replace("midlayer.", "layers.0.")
        out[name] = tensor
    return out


def expected_params(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameter names and values for a canonical checkpoint: q/k/v into qkv_proj, gate/up into gate_up_proj."""
    out = {k: v for k, v in ckpt.items() if k != "d2t"}
    a, m = "layers.0.self_attn.", "layers.0.mlp."
    out[a + "qkv_proj.weight"] = torch.cat([out.pop(f"{a}{p}_proj.weight") for p in "qkv"])
    out[m + "gate_up_proj.weight"] = torch.cat([out.pop(f"{m}{p}_proj.weight") for p in ("gate", "up")])
    return out


def assert_params_equal(head, expected: dict[str, torch.Tensor]) -> None:
    params = {k: v.detach() for k, v in head.named_parameters()}
    assert sorted(params) == sorted(expected)
    for name, value in expected.items():
        assert params[name].dtype == torch.float32, name
        assert torch.equal(params[name], value.float()), name


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    diff = (ours.float() - ref.float()).abs().max().item()
    assert diff < TOL, (diff, ref.abs().max().item())


# ------------------------------------------------------------------------------------------ loading the layouts


LAYOUT_CASES = {
    "eagle": ("eagle", {}),
    "eagle3-midlayer": ("eagle3", {}),
    "eagle3-layers0": ("eagle3", {"midlayer": False}),
    "eagle3-midlayer-no-lm-head": ("eagle3", {"with_lm_head": False}),
    "eagle3-layers0-no-lm-head-aux": ("eagle3", {"midlayer": False, "with_lm_head": False, "aux_layers": [1, 2, 4]}),
    "mtp": ("mtp", {}),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_layout_loads_the_checkpoint_tensors(target, tmp_path, case):
    """Every parameter of the loaded head is the checkpoint's tensor (merged where we merge), nothing more or less;
    an EAGLE-3 head without lm_head.weight gets the target's LM head rows of its draft ids; the head is in eval
    mode, frozen, in the target's dtype, and reads the target's layers EAGLE-3 names."""
    method, kw = LAYOUT_CASES[case]
    folder = helpers.write_random_head(tmp_path / case, method, target.dir, seed=1, **kw)
    tensors = read_tensors(folder)
    if method == "eagle3":  # the helper wrote the prefix asked for
        assert any(k.startswith("midlayer.") for k in tensors) == kw.get("midlayer", True)
    head = target.load(method, folder)
    ckpt = canonical(method, tensors)
    expected = expected_params(ckpt)
    if method == "eagle3":
        ids = torch.arange(ckpt["d2t"].shape[0]) + ckpt["d2t"]
        assert torch.equal(head.d2t, ckpt["d2t"].long())
        if not kw.get("with_lm_head", True):
            assert "lm_head.weight" not in ckpt
            expected["lm_head.weight"] = target.hf.lm_head.weight.detach()[ids]
        assert head.aux_layers == tuple(kw.get("aux_layers") or eagle3_aux_layers(NUM_LAYERS))
        assert head.draft_vocab_size == 96 and head.target_vocab_size == target.vocab
    else:
        assert head.aux_layers == () and head.lm_head is None
    assert_params_equal(head, expected)
    assert not head.training and not any(p.requires_grad for p in head.parameters())
    assert head.dtype == target.model.dtype and head.device == target.model.device
    # the target's embedding and LM head are read, never the head's own, and the head shares no storage with it
    assert not any("embed" in n for n, _ in head.named_parameters())
    target_storage = {p.untyped_storage().data_ptr() for p in target.model.parameters()}
    assert not any(p.untyped_storage().data_ptr() in target_storage for p in head.parameters())


def test_eagle_checkpoint_with_shared_tensors_and_model_prefix_loads(target, tmp_path):
    """EAGLE-1 checkpoints from the EAGLE repository carry embed_tokens (and vLLM's a lm_head) and may prefix
    names with ``model.``: the shared tensors are skipped (the head reads the target's) and the prefix stripped."""
    folder = helpers.write_random_head(tmp_path / "eagle", "eagle", target.dir, seed=2)
    tensors = read_tensors(folder)
    expected = expected_params(canonical("eagle", tensors))
    renamed = {("model." + k if k.startswith("layers.") else k): v for k, v in tensors.items()}
    renamed["embed_tokens.weight"] = torch.randn(target.vocab, target.hidden)
    renamed["lm_head.weight"] = torch.randn(target.vocab, target.hidden)
    write_tensors(folder, renamed)
    assert_params_equal(target.load("eagle", folder), expected)


@pytest.mark.parametrize("case", ["eagle", "eagle3-layers0-no-lm-head-aux", "mtp"])
def test_save_then_load_round_trip(target, tmp_path, case):
    """save_draft_head writes a folder load_draft_head reads back to the same parameters: exactly in fp32, and
    rounded to fp16 by default; an EAGLE-3 head saved without its LM head gets the target's rows back."""
    method, kw = LAYOUT_CASES[case]
    src = helpers.write_random_head(tmp_path / "src", method, target.dir, seed=3, **kw)
    head = target.load(method, src)
    config = json.loads((src / "config.json").read_text())
    before = {k: v.detach().clone() for k, v in head.named_parameters()}
    for dtype, with_lm_head in ((torch.float32, True), (torch.float16, True), (torch.float32, False)):
        if not with_lm_head and method != "eagle3":
            continue
        out = tmp_path / f"saved-{dtype}-{with_lm_head}"
        save_draft_head(head, out, config, with_lm_head=with_lm_head, dtype=dtype)
        assert json.loads((out / "config.json").read_text()) == config
        saved = read_tensors(out)
        assert ("lm_head.weight" in saved) == (method == "eagle3" and with_lm_head)
        again = target.load(method, out)
        expected = {k: v.to(dtype).float() for k, v in before.items()}
        assert_params_equal(again, expected)
        if method == "eagle3":
            assert torch.equal(again.d2t, head.d2t) and again.aux_layers == head.aux_layers


def test_mtp_save_writes_the_deepseek_layout(target, tmp_path):
    """An MTP head is saved in the layout load_draft_head reads for MTP (DeepSeek-V3's): model.layers.{L}.* with
    shared_head.norm, so it loads back from the saved folder alone."""
    src = helpers.write_random_head(tmp_path / "src", "mtp", target.dir, seed=4)
    head = target.load("mtp", src)
    save_draft_head(head, tmp_path / "out", {}, dtype=torch.float32)
    saved = read_tensors(tmp_path / "out")
    p = f"model.layers.{NUM_LAYERS}."
    assert all(k.startswith(p) for k in saved), sorted(saved)
    assert {f"{p}enorm.weight", f"{p}hnorm.weight", f"{p}eh_proj.weight", f"{p}shared_head.norm.weight",
            f"{p}self_attn.q_proj.weight", f"{p}input_layernorm.weight"} <= set(saved)
    original = {k: v for k, v in read_tensors(src).items() if k.startswith(p)}
    assert sorted(saved) == sorted(original)
    for name, value in original.items():
        assert torch.equal(saved[name], value), name
    # a head built on a one-layer config of the target's shape (as `specray train-draft` builds one) is numbered
    # by the target's layers, not its own config's
    from transformers import LlamaConfig

    config = helpers.head_config(json.loads((target.dir / "config.json").read_text()))
    config.pop("model_type")
    fresh = DraftHead("mtp", LlamaConfig(**config), target.model)
    assert fresh.config.num_hidden_layers == 1
    fresh.load_state_dict(head.state_dict())
    save_draft_head(fresh, tmp_path / "fresh", {}, dtype=torch.float32)
    assert sorted(read_tensors(tmp_path / "fresh")) == sorted(original)
    assert_params_equal(target.load("mtp", tmp_path / "fresh"), expected_params(canonical("mtp", original)))


# ------------------------------------------------------------------------------------------ bad input


def test_head_hidden_size_must_be_the_targets(target, tmp_path):
    small = other_target_dir(target, tmp_path / "small", hidden_size=32, intermediate_size=64)
    eagle = helpers.write_random_head(tmp_path / "eagle", "eagle", small)
    with pytest.raises(ValueError, match=r"eagle head's hidden_size=32 does not fit the target's hidden_size=64"):
        target.load("eagle", eagle)
    # an EAGLE-1 checkpoint whose fc does not match its own config
    eagle = helpers.write_random_head(tmp_path / "eagle2", "eagle", target.dir)
    tensors = read_tensors(eagle)
    tensors["fc.weight"] = tensors["fc.weight"][:, :96]
    write_tensors(eagle, tensors)
    with pytest.raises(ValueError, match=r"fc.weight is \(64, 96\), expected \(64, 128\)"):
        target.load("eagle", eagle)
    # MTP: the layer inside the checkpoint is narrower than the target
    mtp = helpers.write_random_head(tmp_path / "mtp", "mtp", target.dir)
    tensors = read_tensors(mtp)
    p = f"model.layers.{NUM_LAYERS}."
    tensors[p + "eh_proj.weight"] = torch.randn(32, 64)
    write_tensors(mtp, tensors)
    with pytest.raises(ValueError, match=r"eh_proj.*\(32, 64\).*hidden_size=64"):
        target.load("mtp", mtp)


def test_eagle3_fc_must_read_three_target_hidden_states(target, tmp_path):
    small = other_target_dir(target, tmp_path / "small", hidden_size=32, intermediate_size=64)
    folder = helpers.write_random_head(tmp_path / "e3", "eagle3", small)
    with pytest.raises(ValueError, match=r"eagle3 head's fc.weight is \(32, 96\).*hidden_size=64 needs \(32, 192\)"):
        target.load("eagle3", folder)
    folder = helpers.write_random_head(tmp_path / "e3b", "eagle3", target.dir)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "target_hidden_size": 128}))
    with pytest.raises(ValueError, match=r"target_hidden_size=128.*hidden_size=64"):
        target.load("eagle3", folder)
    folder = helpers.write_random_head(tmp_path / "e3c", "eagle3", target.dir, aux_layers=[2, 3, NUM_LAYERS])
    with pytest.raises(ValueError, match=rf"reads target layers \[2, 3, {NUM_LAYERS}\].*has {NUM_LAYERS}"):
        target.load("eagle3", folder)


def test_a_checkpoint_of_another_method_names_the_method_to_use(target, tmp_path):
    """An EAGLE-3 head given as EAGLE-1 (or the reverse) names the method that reads it, not only the sizes; a Medusa,
    DFlash, ... checkpoint given to another hidden-state method is refused by its config.json before anything loads
    (it read as a Llama layer of hidden_size 4096, or an EAGLE-3 head without d2t)."""
    from specray.drafters.hidden_state import DFlashOptions, EagleOptions, MTPOptions

    e3 = helpers.write_random_head(tmp_path / "e3", "eagle3", target.dir)
    with pytest.raises(ValueError, match=r"fc.weight is \(64, 192\), expected \(64, 128\): an EAGLE-3 head.*"
                                         r"use method='eagle3'"):
        target.load("eagle", e3)
    e1 = helpers.write_random_head(tmp_path / "e1", "eagle", target.dir)
    with pytest.raises(ValueError, match=r"needs \(64, 192\): an EAGLE-1 head's fc .*use method='eagle' with it"):
        target.load("eagle3", e1)
    medusa, dflash = tmp_path / "medusa", tmp_path / "dflash"
    for folder, config in ((medusa, {"medusa_num_heads": 4, "medusa_num_layers": 1}),
                           (dflash, {"model_type": "qwen3", "dflash_config": {"target_layer_ids": [1]}})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    for method in ("eagle", "eagle3"):
        with pytest.raises(ValueError, match=rf"model='{medusa}' is Medusa heads, not a checkpoint of method="
                                             rf"'{method}' \(its config.json gives medusa_num_heads\): use "
                                             "method='medusa' with it"):
            EagleOptions(model=str(medusa)).checkpoint(method, str(target.dir))
    with pytest.raises(ValueError, match=r"is a DFlash model.*use method='dflash' with it \(method='mtp' reads"):
        MTPOptions(model=str(dflash)).checkpoint("mtp", str(target.dir))
    with pytest.raises(ValueError, match=r"is Medusa heads, not a checkpoint of method='dflash'"):
        DFlashOptions(model=str(medusa)).checkpoint("dflash", str(target.dir))
    assert EagleOptions(model=str(e3)).checkpoint("eagle3", str(target.dir)) == str(e3)


def test_a_head_folder_without_weights_names_speculative_config_model(target, tmp_path):
    """A head's folder holding its config.json only: the error names the option, not "model folder" (the target's
    word), for EAGLE's heads (read on the driver) and DFlash's."""
    from specray.drafters.hidden_state import DFlashOptions, EagleOptions, worker_config

    folder = tmp_path / "e3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(helpers.head_config(json.loads((target.dir / "config.json")
                                                                                  .read_text()))))
    with pytest.raises(ValueError, match=rf"^speculative_config.model folder '{folder}' has no weights"):
        worker_config("eagle3", EagleOptions(model=str(folder)), str(target.dir))
    with pytest.raises(ValueError, match=rf"^speculative_config.model folder '{folder}' has no weights"):
        DFlashOptions(model=str(folder)).check_draft_count(3)


@pytest.mark.parametrize("bad", ["past-the-end", "negative", "wrong-length", "missing"])
def test_eagle3_d2t_must_map_into_the_target_vocabulary(target, tmp_path, bad):
    folder = helpers.write_random_head(tmp_path / "e3", "eagle3", target.dir)
    tensors = read_tensors(folder)
    d2t = tensors["d2t"].clone()
    if bad == "past-the-end":
        d2t[-1] = target.vocab - (len(d2t) - 1)  # draft id 95 -> target id V
        match = rf"d2t maps draft ids outside the target's vocabulary \[0, {target.vocab}\)"
    elif bad == "negative":
        d2t[3] = -4  # draft id 3 -> target id -1
        match = r"outside the target's vocabulary"
    elif bad == "wrong-length":
        d2t = d2t[:-1]
        match = r"d2t has 95 entries but draft_vocab_size=96"
    else:
        d2t = None
        match = r"no d2t"
    if d2t is None:
        del tensors["d2t"]
    else:
        tensors["d2t"] = d2t
    write_tensors(folder, tensors)
    with pytest.raises(ValueError, match=match):
        target.load("eagle3", folder)


@pytest.mark.parametrize("method,missing,named", [
    ("eagle", "layers.0.mlp.down_proj.weight", "layers.0.mlp.down_proj.weight"),
    ("eagle", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.k_proj.weight"),
    ("eagle3", "midlayer.hidden_norm.weight", "layers.0.hidden_norm.weight"),
    ("eagle3", "norm.weight", "norm.weight"),
    ("mtp", f"model.layers.{NUM_LAYERS}.hnorm.weight", "hnorm.weight"),
    ("mtp", f"model.layers.{NUM_LAYERS}.mlp.up_proj.weight", "layers.0.mlp.up_proj.weight"),
])
def test_missing_weights_are_named(target, tmp_path, method, missing, named):
    folder = helpers.write_random_head(tmp_path / method, method, target.dir)
    tensors = read_tensors(folder)
    del tensors[missing]
    write_tensors(folder, tensors)
    with pytest.raises(ValueError, match=rf"{method} head checkpoint is missing 1 weights.*{named}"):
        target.load(method, folder)


def test_unexpected_tensor_is_named(target, tmp_path):
    folder = helpers.write_random_head(tmp_path / "e", "eagle", target.dir)
    tensors = read_tensors(folder)
    tensors["layers.1.mlp.down_proj.weight"] = tensors["layers.0.mlp.down_proj.weight"].clone()
    write_tensors(folder, tensors)
    with pytest.raises(ValueError, match=r"'layers.1.mlp.down_proj.weight' has no place in a eagle head"):
        target.load("eagle", folder)


def test_mtp_needs_a_checkpoint_with_mtp_layers(target):
    with pytest.raises(ValueError, match=rf"has no MTP layer \(model.layers.{NUM_LAYERS}.\*\).*num_nextn_predict"):
        target.load("mtp", target.dir)


def test_a_path_and_a_known_method_are_required(target):
    for method in ("eagle", "eagle3", "mtp"):
        with pytest.raises(ValueError, match=rf"speculative_config.model is required for method='{method}'"):
            target.load(method, None)
    with pytest.raises(ValueError, match=r"method='medusa' has no draft head layout"):
        target.load("medusa", target.dir)


# ------------------------------------------------------------------------------------------ the dense reference
# Each head written from its paper's equations with plain torch over the whole sequence: full causal attention,
# RoPE computed here, no cache. A "row" at position p reads the token after p and a feature of p.


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D] rotated by position (rotate-half layout, as Llama's checkpoints are laid out)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * inv_freq[None]  # [T, D/2]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1)[:, None], torch.cat((angles.sin(), angles.sin()), -1)[:, None]
    rotated = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    return x * cos + rotated * sin


class DenseHead:
    """One head's forward over a whole sequence of rows, from its canonical checkpoint tensors."""

    def __init__(self, method: str, ckpt: dict[str, torch.Tensor], target: Target, feedback_normed: bool = False,
                 lm_head: torch.Tensor | None = None):
        self.method = method
        self.w = {k: v.float() for k, v in ckpt.items()}
        c = target.config
        self.eps = c.rms_norm_eps
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.theta = c.rope_parameters["rope_theta"]
        self.embed = target.hf.model.embed_tokens.weight.detach()
        self.target_lm_head = target.hf.lm_head.weight.detach()
        self.lm_head = lm_head if lm_head is not None else self.w.get("lm_head.weight")  # EAGLE-3's own
        self.feedback_normed = feedback_normed

    def target_feature(self, last_hidden: torch.Tensor, hidden_states, aux_layers) -> torch.Tensor:
        """EAGLE-1 and MTP read the target's last hidden state (after its final norm); EAGLE-3 fuses the residual
        stream entering three target layers with fc."""
        if self.method != "eagle3":
            return last_hidden
        return F.linear(torch.cat([hidden_states[i] for i in aux_layers], -1), self.w["fc.weight"],
                        self.w.get("fc.bias"))

    def layer(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        w, p = self.w, "layers.0."
        t, d = x.shape[0], self.head_dim
        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(t, self.heads, d), positions, self.theta)
        k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(t, self.kv_heads, d), positions, self.theta)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, self.kv_heads, d)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / d**0.5
        causal = positions[None, :] <= positions[:, None]  # [t, s]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hts,shd->thd", probs, v).reshape(t, self.heads * d)
        h = residual + attn @ w[p + "self_attn.o_proj.weight"].T
        m = rms(h, w[p + "post_attention_layernorm.weight"], self.eps)
        mlp = (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T))
        return h + mlp @ w[p + "mlp.down_proj.weight"].T

    def __call__(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """rows -> (feedback [R, H], logits [R, V or V_draft])."""
        w, e = self.w, self.embed[tokens]
        if self.method == "eagle":  # EAGLE-1: fc(cat(e, f)) enters a layer without input norm
            residual = F.linear(torch.cat((e, features), -1), w["fc.weight"], w.get("fc.bias"))
            x = residual
        elif self.method == "eagle3":  # EAGLE-3: attention reads cat(norm(e), norm(f)); the residual is f
            residual = features
            x = torch.cat((rms(e, w["layers.0.input_layernorm.weight"], self.eps),
                           rms(features, w["layers.0.hidden_norm.weight"], self.eps)), -1)
        else:  # MTP (DeepSeek-V3): eh_proj(cat(enorm(e), hnorm(h))) into a full block
            residual = torch.cat((rms(e, w["enorm.weight"], self.eps), rms(features, w["hnorm.weight"], self.eps)),
                                 -1) @ w["eh_proj.weight"].T
            x = rms(residual, w["layers.0.input_layernorm.weight"], self.eps)
        out = self.layer(x, residual, positions)
        if self.method == "eagle":
            return out, out @ self.target_lm_head.T
        normed = rms(out, w["norm.weight"], self.eps)
        if self.method == "eagle3":
            return out, normed @ self.lm_head.T
        return (normed if self.feedback_normed else out), normed @ self.target_lm_head.T

    def to_target(self, draft_id: int) -> int:
        return draft_id + int(self.w["d2t"][draft_id]) if self.method == "eagle3" else draft_id


class TransformersMtp:
    """transformers' MtpLayer (through MtpModel, built for the tiny Llama) with the checkpoint's MTP weights: it
    feeds its normed output to the next step. It numbers rows by the token's position (p + 1), we by the
    feature's (p); RoPE attention sees only differences."""

    def __init__(self, target: Target, tensors: dict[str, torch.Tensor]):
        from transformers.modeling_layers import MtpModel

        main = copy.deepcopy(target.hf)
        main.config.num_mtp_layers = 1
        self.mtp = MtpModel(main, 1).float().eval()
        p = f"model.layers.{NUM_LAYERS}."
        state = {}
        for name, tensor in tensors.items():
            if not name.startswith(p) or name[len(p):] in ("embed_tokens.weight", "shared_head.head.weight"):
                continue
            name = name[len(p):]
            if name.startswith(("enorm.", "hnorm.", "eh_proj.")):
                state["layers.0." + name] = tensor
            elif name.startswith("shared_head.norm."):
                state["layers.0.post_norm." + name[len("shared_head.norm."):]] = tensor
            else:
                state["layers.0.mtp_block." + name] = tensor
        missing, unexpected = self.mtp.load_state_dict(state, strict=False)
        assert unexpected == [] and set(missing) <= {"embed_tokens.weight", "shared_head.weight"}, (missing, unexpected)
        # the shared embedding and head are the target's
        assert torch.equal(self.mtp.embed_tokens.weight, target.hf.model.embed_tokens.weight)
        assert torch.equal(self.mtp.shared_head.weight, target.hf.lm_head.weight)
        self.feedback_normed = True

    @torch.no_grad()
    def __call__(self, tokens, features, positions):
        out = self.mtp.forward_layer(0, features[None], (positions + 1)[None], None, input_ids=tokens[None])[0]
        return out, self.mtp.shared_head(out)

    def to_target(self, draft_id: int) -> int:
        return draft_id


@torch.no_grad()
def reference_drafts(ref, sequence: list[int], features: torch.Tensor, num_drafts: int
                     ) -> tuple[list[int], list[torch.Tensor]]:
    """Drafts and the logits behind each, recomputing every row from scratch at every step: first-pass rows at
    positions 0..n-1 (token sequence[p+1], the target's feature of p), then one row per draft step with the drafted
    token and the previous row's feedback feature."""
    n = len(sequence) - 1
    tokens, feats, positions = list(sequence[1:]), [features[p] for p in range(n)], list(range(n))
    drafts, logits = [], []
    for step in range(num_drafts):
        feedback, out = ref(torch.tensor(tokens), torch.stack(feats), torch.tensor(positions))
        logits.append(out[-1])
        drafts.append(ref.to_target(int(out[-1].argmax())))
        tokens.append(drafts[-1])
        feats.append(feedback[-1])
        positions.append(n + step)
    return drafts, logits


# ------------------------------------------------------------------------------------------ paged head vs reference


class Run:
    """A HiddenStateDrafter over shuffled block tables, fed plans as the runner would, with the target's rows made
    from transformers' features of each request's committed tokens (NaN in rows no committed position owns: a
    rejected draft, or a tree node off the accepted path, must never be read)."""

    def __init__(self, head, target: Target, seed: int, step_graphs: bool = False):
        self.head, self.target = head, target
        self.drafter = HiddenStateDrafter(head, NUM_BLOCKS, BLOCK, step_graphs=step_graphs)
        free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(free)
        self.tables = {"A": free[:12], "B": free[12:24]}  # 48 positions each, non-consecutive blocks
        assert any(b - a != 1 for a, b in zip(self.tables["A"], self.tables["A"][1:]))
        self.committed: dict[str, list[int]] = {"A": [], "B": []}  # committed tokens, the last sampled one too
        self.calls: list[torch.Tensor] = []
        draft_logits = head.draft_logits

        def recording(hidden):
            out = draft_logits(hidden)
            self.calls.append(out.detach().clone())
            return out

        head.draft_logits = recording  # an instance attribute: the drafter's calls go through it

    def step(self, chunks: list[ScheduledChunk], kept: dict[int, list[int]], paths: dict[int, list[int]]
             ) -> tuple[list[list[int]], list[torch.Tensor]]:
        rows: list[tuple[str, int] | None] = []  # per plan row: the (request, position) whose feature it holds
        for i, chunk in enumerate(chunks):
            real = chunk.num_tokens - chunk.num_draft_tokens
            known = self.committed[chunk.req_id]
            assert chunk.start_pos <= len(known), "bad test plan"
            assert known[chunk.start_pos:] == chunk.token_ids[: len(known) - chunk.start_pos], "bad test plan"
            known = known[: chunk.start_pos] + chunk.token_ids[:real]
            rows += [(chunk.req_id, chunk.start_pos + r) for r in range(real)]
            depth = {}
            if chunk.sample:
                path = paths.get(i) or list(range(len(kept[i]) - 1))
                assert [chunk.token_ids[real + n] for n in path] == kept[i][:-1], "bad test plan"
                depth = {node: d + 1 for d, node in enumerate(path)}
                known = known + kept[i]
            rows += [(chunk.req_id, chunk.start_pos + real - 1 + depth[n]) if n in depth else None
                     for n in range(chunk.num_draft_tokens)]
            self.committed[chunk.req_id] = known
        features = {}
        for req, tokens in self.committed.items():
            if tokens:
                features[req] = self.target.features(tokens)
        h = self.target.hidden
        hidden = torch.full((len(rows), h), float("nan"))
        aux = [torch.full((len(rows), h), float("nan")) for _ in self.head.aux_layers]
        for r, owner in enumerate(rows):
            if owner is None:
                continue
            req, pos = owner
            last, states = features[req]
            hidden[r] = last[pos]
            for a, layer in zip(aux, self.head.aux_layers):
                a[r] = states[layer][pos]
        plan = StepPlan(step_id=0, chunks=chunks)
        self.calls.clear()
        with torch.inference_mode():
            made = self.drafter.draft(plan, self.tables, hidden, aux, kept, paths)
            drafts = [[] if d is None else d.token_ids for d in made]
        return drafts, list(self.calls)


def chain(req, token_ids, start, drafts=0, next_drafts=0, sample=True, next_token_id=None):
    return ScheduledChunk(req, list(token_ids), start, num_draft_tokens=drafts, sample=sample,
                          num_next_drafts=next_drafts, next_token_id=next_token_id)


def check_step(run: Run, refs, chunks, kept, paths=None) -> list[list[int]]:
    """One plan through the drafter; each drafting request's drafts and every draft step's logits equal each
    reference's, recomputed from the request's committed tokens."""
    paths = paths or {}
    drafts, calls = run.step(chunks, kept, paths)
    assert len(drafts) == len(chunks)
    wanted = [c.num_next_drafts if c.sample else 0 for c in chunks]
    assert [len(d) for d in drafts] == wanted
    assert len(calls) == max(wanted)
    for i, chunk in enumerate(chunks):
        if not wanted[i]:
            continue
        sequence = run.committed[chunk.req_id]
        for ref in refs:
            last, states = run.target.features(sequence[:-1])
            feats = ref.target_feature(last, states, run.head.aux_layers) if hasattr(ref, "target_feature") else last
            ref_drafts, ref_logits = reference_drafts(ref, sequence, feats, wanted[i])
            assert drafts[i] == ref_drafts, (chunk.req_id, type(ref).__name__)
            for step in range(wanted[i]):
                # the drafter's call `step` holds a row per request still drafting, in plan order
                live = [j for j in range(len(chunks)) if wanted[j] > step]
                close(calls[step][live.index(i)], ref_logits[step])
    return drafts


def run_scenario(run: Run, refs, seed: int, check=None, limit: int | None = None) -> None:
    """Five plans over two requests: A's prompt in three chunks (the last samples and drafts 4), then chains; B's
    prompt in one, then a chain with one accepted draft, a token tree whose accepted path is nodes 1 and 2, a
    chain with none accepted and no drafts asked for, and a plain decode drafting 5. Requests in one plan draft
    different counts, so rows leave the draft loop at different steps."""
    vocab = run.target.vocab
    g = torch.Generator().manual_seed(seed)
    check = check or check_step

    def step(run, refs, chunks, kept, paths=None):  # the scenario's draft counts, at most ``limit``
        for c in chunks:
            c.num_next_drafts = min(c.num_next_drafts, limit or c.num_next_drafts)
        return check(run, refs, chunks, kept, paths)

    def toks(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    a, b = toks(14), toks(9)
    # plan 1: A's first prompt chunk (no drafts; it reads the next prompt token) + B's whole prompt
    d = step(run, refs, [chain("A", a[:5], 0, sample=False, next_token_id=a[5]), chain("B", b, 0, next_drafts=3)],
                   {1: toks(1)})
    db = d[1]
    # plan 2: A's second chunk + B verifies 3 drafts, keeps 1 and its own token
    last_b = run.committed["B"][-1]
    d = step(run, refs, [chain("A", a[5:11], 5, sample=False, next_token_id=a[11]),
                               chain("B", [last_b] + db, 9, drafts=3, next_drafts=2)], {1: db[:1] + toks(1)})
    db = d[1]
    # plan 3: A's last chunk samples; B verifies a tree: nodes 0 (root's child), 1 (root's child), 2 (child of 1),
    # 3 (child of 0); the accepted path is 1 -> 2
    last_b, start_b = run.committed["B"][-1], len(run.committed["B"]) - 1
    nodes = [toks(1)[0], db[0], db[1], toks(1)[0]]
    tree = ScheduledChunk("B", [last_b] + nodes, start_b, num_draft_tokens=4, draft_parents=[-1, -1, 1, 0],
                          num_next_drafts=3)
    d = step(run, refs, [chain("A", a[11:], 11, next_drafts=4), tree], {0: toks(1), 1: [db[0], db[1]] + toks(1)},
                   {1: [1, 2]})
    da, db = d
    # plan 4: B verifies 2 drafts, keeps none and drafts nothing (only its K/V); A keeps all 3 of 3 verified drafts
    last_a, start_a = run.committed["A"][-1], len(run.committed["A"]) - 1
    last_b, start_b = run.committed["B"][-1], len(run.committed["B"]) - 1
    d = step(run, refs, [chain("B", [last_b] + db[:2], start_b, drafts=2, next_drafts=0),
                               chain("A", [last_a] + da[:3], start_a, drafts=3, next_drafts=3)],
                   {0: toks(1), 1: da[:3] + toks(1)})
    da = d[1]
    # plan 5: A keeps 2 of 3 and drafts 1; B decodes without drafts and drafts 5 (reading plan 4's K/V)
    last_a, start_a = run.committed["A"][-1], len(run.committed["A"]) - 1
    last_b, start_b = run.committed["B"][-1], len(run.committed["B"]) - 1
    step(run, refs, [chain("A", [last_a] + da, start_a, drafts=3, next_drafts=1),
                           chain("B", [last_b], start_b, next_drafts=5)], {0: da[:2] + toks(1), 1: toks(1)})


DRAFT_CASES = {
    "eagle": ("eagle", {}, {}),
    "eagle3": ("eagle3", {}, {}),
    "eagle3-target-lm-head-aux": ("eagle3", {"midlayer": False, "with_lm_head": False, "aux_layers": [1, 2, 4]}, {}),
    "mtp": ("mtp", {}, {}),
    "mtp-feedback-normed": ("mtp", {}, {"feedback_normed": True}),
    # short queries one sequence at a time with shuffled blocks gathered (as on CPU at long contexts), not the
    # padded batch these short contexts take otherwise
    "eagle3-per-sequence-attention": ("eagle3", {}, {}),
}


@pytest.mark.parametrize("case", list(DRAFT_CASES))
def test_paged_head_drafts_as_the_dense_reference(target, tmp_path, monkeypatch, case):
    method, write_kw, load_kw = DRAFT_CASES[case]
    if case.endswith("per-sequence-attention"):
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    folder = helpers.write_random_head(tmp_path / case, method, target.dir, seed=7, std=STD, **write_kw)
    head = target.load(method, folder, **load_kw)
    tensors = read_tensors(folder)
    ckpt = canonical(method, tensors)
    lm_head = None
    if method == "eagle3" and "lm_head.weight" not in ckpt:
        lm_head = target.hf.lm_head.weight.detach()[torch.arange(len(ckpt["d2t"])) + ckpt["d2t"]]
    refs = [DenseHead(method, ckpt, target, feedback_normed=load_kw.get("feedback_normed", False), lm_head=lm_head)]
    if load_kw.get("feedback_normed"):
        refs.append(TransformersMtp(target, tensors))
    run_scenario(Run(head, target, seed=11), refs, seed=13)


class TransformersMtpChain:
    """transformers' ``MtpModel`` with M layers (DeepSeek's sequential modules) over a whole sequence from scratch:
    layer k reads layer k-1's normed output and the tokens one further, the last row's token being the draft layer
    k-1 just made (its ``forward`` with no cache)."""

    def __init__(self, target: Target, tensors: dict[str, torch.Tensor], num_modules: int):
        from transformers.modeling_layers import MtpModel

        main = copy.deepcopy(target.hf)
        main.config.num_mtp_layers = num_modules
        self.mtp = MtpModel(main, num_modules).float().eval()
        state = {}
        for k in range(num_modules):
            p = f"model.layers.{NUM_LAYERS + k}."
            for name, tensor in tensors.items():
                if not name.startswith(p) or name[len(p):] in ("embed_tokens.weight", "shared_head.head.weight"):
                    continue
                name = name[len(p):]
                if name.startswith(("enorm.", "hnorm.", "eh_proj.")):
                    state[f"layers.{k}.{name}"] = tensor
                elif name.startswith("shared_head.norm."):
                    state[f"layers.{k}.post_norm." + name[len("shared_head.norm."):]] = tensor
                else:
                    state[f"layers.{k}.mtp_block.{name}"] = tensor
        missing, unexpected = self.mtp.load_state_dict(state, strict=False)
        assert unexpected == [] and set(missing) <= {"embed_tokens.weight", "shared_head.weight"}, (missing, unexpected)

    @torch.no_grad()
    def drafts(self, sequence: list[int], features: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """``sequence`` t_0..t_N, ``features`` the target's last hidden states of positions 0..N-1 -> the M drafts
        and each layer's logits at the last position [M, V]."""
        n = len(sequence) - 1
        tokens, logits, _ = self.mtp(input_ids=torch.tensor([sequence[1:]]), last_hidden_states=features[None, :n],
                                     attention_mask=None, position_ids=torch.arange(1, n + 1)[None], mtp_cache=None)
        return tokens[0].tolist(), logits[0]


def check_chained_step(run: Run, refs, chunks, kept, paths=None) -> list[list[int]]:
    """One plan through the drafter of chained MTP modules: every module runs over every first-pass row (one
    draft_logits call each, a row per request in the pass); each drafting request's drafts and every module's
    logits at its last position equal transformers' ``MtpModel`` over its committed sequence from scratch."""
    paths = paths or {}
    drafts, calls = run.step(chunks, kept, paths)
    wanted = [c.num_next_drafts if c.sample else 0 for c in chunks]
    assert [len(d) for d in drafts] == wanted
    in_pass = [i for i, c in enumerate(chunks) if (c.sample and c.num_next_drafts) or c.next_token_id is not None]
    if in_pass:
        assert len(calls) == run.head.num_modules and all(len(c) == len(in_pass) for c in calls)
    for i, chunk in enumerate(chunks):
        if not wanted[i]:
            continue
        sequence = run.committed[chunk.req_id]
        last, _ = run.target.features(sequence[:-1])
        for ref in refs:
            ref_drafts, ref_logits = ref.drafts(sequence, last)
            assert drafts[i] == ref_drafts[: wanted[i]], (chunk.req_id, drafts[i], ref_drafts)
            for k, call in enumerate(calls):
                close(call[in_pass.index(i)], ref_logits[k])
    return drafts


@pytest.mark.parametrize("num_modules, graphs", [(2, False), (3, False), (2, True)], ids=["2", "3", "2-graphs"])
def test_chained_mtp_modules_draft_as_transformers_mtp_model(target, tmp_path, num_modules, graphs):
    """DeepSeek's distinct MTP modules, paged: drafts and every module's logits equal transformers' MtpModel with
    num_modules layers over the committed sequence from scratch at every step. Three modules through the scenario
    above (chunked prefill, accepted drafts, a tree's accepted path, a request that drafts nothing for a step,
    requests drafting different counts); two through a short one of chains (all, some and none accepted, a step
    without drafts, a chunked prefill beside), also with each module's passes from graphs of its own (on CPU their
    padded static inputs, eagerly)."""
    folder = helpers.write_random_head(tmp_path / "mtp", "mtp", target.dir, seed=7, std=STD, num_modules=3)
    head = target.load("mtp", folder, feedback_normed=True, num_modules=num_modules)
    assert head.num_modules == num_modules and len(head.kv_cache_specs()) == num_modules
    refs = [TransformersMtpChain(target, read_tensors(folder), num_modules)]
    run = Run(head, target, seed=11, step_graphs=graphs)
    replays = []
    for g in run.drafter.module_graphs:
        g.run = (lambda run_graph: lambda shape, *a, **k: replays.append(shape) or run_graph(shape, *a, **k))(g.run)
    if num_modules == 3:
        run_scenario(run, refs, seed=13, check=check_chained_step, limit=num_modules)
        return
    g = torch.Generator().manual_seed(5)

    def toks(n):
        return torch.randint(0, target.vocab, (n,), generator=g).tolist()

    def last(req):
        return run.committed[req][-1], len(run.committed[req]) - 1

    a, b = toks(11), toks(7)
    d = check_chained_step(run, refs, [chain("B", b, 0, next_drafts=2),
                                       chain("A", a[:6], 0, sample=False, next_token_id=a[6])], {0: toks(1)})[0]
    for keep, nxt in ((2, 2), (1, 0), (0, 2)):  # all kept, one kept (then no drafts), none kept
        tok, start = last("B")
        chunks = [chain("B", [tok] + d, start, drafts=len(d), next_drafts=nxt)]
        if keep == 1:
            chunks.append(chain("A", a[6:], 6, next_drafts=2))
        d = check_chained_step(run, refs, chunks, {0: d[:keep] + toks(1), 1: toks(1)})[0]
        if nxt == 0:
            (tok, start), d = last("B"), []
            check_chained_step(run, refs, [chain("B", [tok], start, next_drafts=2)], {0: toks(1)})
            d = check_chained_step(run, refs, [chain("B", [last("B")[0]], last("B")[1], next_drafts=2)],
                                   {0: toks(1)})[0]
    assert (len(run.drafter.module_graphs) == 2 and len(replays) >= 6) if graphs else not replays, replays


def test_chained_mtp_modules_need_the_checkpoints_modules(target, tmp_path):
    folder = helpers.write_random_head(tmp_path / "mtp", "mtp", target.dir, seed=7, std=STD, num_modules=2)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=3 but the checkpoint .* has 2 MTP module"):
        target.load("mtp", folder, num_modules=3)
    with pytest.raises(ValueError, match="method='mtp' only"):
        target.load("eagle", helpers.write_random_head(tmp_path / "e", "eagle", target.dir), num_modules=2)


def test_mtp_feedback_normed_changes_the_later_drafts_only(target, tmp_path):
    """The first draft reads the target's feature either way; later ones differ with the feedback (a check that
    the flag reaches the head: both are compared with their references above)."""
    folder = helpers.write_random_head(tmp_path / "mtp", "mtp", target.dir, seed=7, std=STD)
    outs = []
    for normed in (False, True):
        run = Run(target.load("mtp", folder, feedback_normed=normed), target, seed=11)
        b = torch.randint(0, target.vocab, (9,), generator=torch.Generator().manual_seed(3)).tolist()
        _, calls = run.step([chain("B", b, 0, next_drafts=3)], {0: [5]}, {})
        outs.append(calls)
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    assert (outs[0][1] - outs[1][1]).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------ features and vocabulary


def test_target_aux_features_are_transformers_hidden_states(target, tmp_path):
    """The layers an EAGLE-3 head reads (the default 2, L/2, L-3, or the config's eagle_aux_hidden_state_layer_ids)
    are the residual stream transformers reports as hidden_states[i], through a chunked prefill on shuffled blocks."""
    default = target.load("eagle3", helpers.write_random_head(tmp_path / "d", "eagle3", target.dir))
    custom = target.load("eagle3", helpers.write_random_head(tmp_path / "c", "eagle3", target.dir, aux_layers=[0, 4, 5]))
    assert default.aux_layers == (2, NUM_LAYERS // 2, NUM_LAYERS - 3) and custom.aux_layers == (0, 4, 5)
    ids = torch.randint(0, target.vocab, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    last, states = target.features(ids)
    model = load_model(str(target.dir))  # a model of our own: the module's target has no cache bound here
    allocate_kv_cache(model, 16, BLOCK)
    table = [9, 2, 14, 5]
    layers = default.aux_layers + custom.aux_layers
    for a, b in ((0, 8), (8, 13)):
        meta = build_attention_metadata([b - a], [a], [table], BLOCK)
        with torch.no_grad():
            hidden, aux = model(torch.tensor(ids[a:b]), meta, aux_layers=layers)
        close(hidden, last[a:b])
        for layer, got in zip(layers, aux):
            close(got, states[layer][a:b])


def test_draft_vocabulary_maps_to_target_ids(target, tmp_path):
    folder = helpers.write_random_head(tmp_path / "e3", "eagle3", target.dir, seed=9, draft_vocab_size=40)
    head = target.load("eagle3", folder)
    d2t = read_tensors(folder)["d2t"]
    ids = torch.arange(40) + d2t  # the target ids of the draft vocabulary, sorted and distinct here
    assert len(set(ids.tolist())) == 40 and int(d2t.abs().sum()) > 0
    assert torch.equal(head.to_target_ids(torch.tensor([0, 39, 7, 7])), ids[[0, 39, 7, 7]])
    hidden = torch.randn(5, target.hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        draft = head.draft_logits(hidden)
        full = head.full_vocab_logits(hidden)
    assert draft.shape == (5, 40) and full.shape == (5, target.vocab) and full.dtype == torch.float32
    assert torch.equal(full[:, ids], draft)
    outside = torch.ones(target.vocab, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(full[:, outside]).all() and torch.isfinite(full[:, ids]).all()
    assert torch.equal(full.argmax(-1), head.to_target_ids(draft.argmax(-1)))
    # without a draft vocabulary both are the identity over the target's logits
    eagle = target.load("eagle", helpers.write_random_head(tmp_path / "e1", "eagle", target.dir))
    assert torch.equal(eagle.to_target_ids(torch.tensor([3, 1])), torch.tensor([3, 1]))
    with torch.no_grad():
        assert torch.equal(eagle.full_vocab_logits(hidden), target.model.compute_logits(hidden))


def test_a_head_whose_heads_do_not_split_names_the_way_out(target):
    """Split over the target's ranks, a head's attention heads must divide as a target layer's do; else the error
    says to keep the head whole on the driver rank. Checked before any layer is built (no process group needed)."""
    from transformers import LlamaConfig

    from specray.parallel import TPGroup

    config = LlamaConfig(hidden_size=48, intermediate_size=96, num_attention_heads=3, num_key_value_heads=3,
                         vocab_size=target.model.vocab_size)
    with pytest.raises(ValueError, match=r"num_attention_heads=3 .* tensor_parallel_size=2: set "
                                         r"speculative_config.draft_tensor_parallel_size=1"):
        DraftHead("eagle", config, target.model, tp=TPGroup(0, 2))


def test_an_unseeded_requests_draft_stream_is_seeded_alike_on_every_rank():
    """The ranks of a split head draw an unseeded request's drafts from a stream seeded from the engine's seed and
    the request's id: the same on every rank, apart per request and per engine seed."""
    from specray.workers.head_drafter import shared_stream_seed

    assert shared_stream_seed(0, "7") == shared_stream_seed(0, "7")
    assert len({shared_stream_seed(0, "7"), shared_stream_seed(0, "8"), shared_stream_seed(1, "7")}) == 3
    assert 0 <= shared_stream_seed(0, "7") < 1 << 64
