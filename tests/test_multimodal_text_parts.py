"""The text models of three multimodal families, served text-only (README's (†)): Aria's (``aria_text``: Llama's
layers with experts in every layer, the top-k router logits softmaxed among themselves, and shared experts), Emu3's
(``emu3_text_model``: Llama's layers over a vocabulary holding the VQ-VAE's image codes as ordinary ids) and Llama 3.2
Vision's (``mllama_text_model``: Llama 3's layers among cross-attention layers, which transformers skips entirely for a
text-only prompt). Against transformers on the same random tiny weights (fp32, max abs diff < 1e-4) for a prefill and
for chunks + decode steps; the multimodal release's checkpoint (its text model beside the vision tower or VQ-VAE, in
the release's layout and in transformers' modules' layout) serves the logits of transformers' whole model; tensor
parallel 2 and two pipeline stages equal one rank; the engine's greedy tokens with n-gram drafts equal transformers'
``generate`` (Mllama's for the text model and for the multimodal model); each distinctive part broken once moves the
logits; what is not implemented is refused by name, and so is a prompt with ``multi_modal_data``. The tiny models are
built here, not in conftest."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specray.models.loader import load_model, read_config
from specray.models.moe import SparseMoE
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_ranks_match_one_rank, chunked_logits, max_diff, mutated_logits,
    prefill_logits, prompt, reference_logits)

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)

# ---- the tiny models -------------------------------------------------------------------------------------------------

# Aria: 2 layers, GQA, 4 experts of which 2 per token, 2 shared experts (a shared MLP twice an expert's width)
ARIA = dict(hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            moe_num_experts=4, moe_topk=2, moe_num_shared_experts=2, rms_norm_eps=1e-5, initializer_range=0.1,
            max_position_embeddings=512, tie_word_embeddings=False)

# Emu3: 2 Llama layers, GQA, its default RoPE theta (1e6); the vocabulary's last 20 ids stand for the VQ-VAE's codes
EMU3 = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-5, initializer_range=0.1, max_position_embeddings=512, tie_word_embeddings=False)
EMU3_CODES = range(300, 320)  # the tiny vocabulary's image-code ids (vocabulary_map's "<image>" is the first)

# Mllama: 5 layers of which 1 and 3 are cross-attention layers (their gates far from 0, as a release's), Llama 3's RoPE
# scaling over an original context shorter than the prompt, GQA
MLLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
              cross_attention_layers=[1, 3], rms_norm_eps=1e-5, initializer_range=0.1, max_position_embeddings=512,
              tie_word_embeddings=False,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
MLLAMA_CROSS = (1, 3)
MLLAMA_VOCAB = 320  # the tiny tokenizer's (tests/conftest.py), Mllama's vocab_size: its image token's id


def _tokenizer(path: Path):
    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    return build_tiny_tokenizer(path)


def _visible(model) -> None:
    """Norm weights away from their init of ones, routers away from small logits, so that each part shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and param.dim() == 1:
                param.uniform_(0.5, 1.5)
            elif name.endswith("mlp.router.weight"):
                param.normal_(0.0, 0.5)


def build_tiny_aria(path: Path, seed: int = 0) -> Path:
    from transformers import AriaTextConfig, AriaTextForCausalLM

    tok = _tokenizer(path)
    config = AriaTextConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            bos_token_id=None, **ARIA)
    torch.manual_seed(seed)
    model = AriaTextForCausalLM(config).float().eval()
    _visible(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _copy_tokenizer(text: Path, path: Path) -> None:
    for file in text.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, path / file.name)


def build_tiny_aria_multimodal(text: Path, path: Path) -> Path:
    """AriaForConditionalGeneration holding ``text``'s model beside a one-layer Idefics3 vision tower and the
    projector, saved as transformers saves it (the release's names: ``language_model.model.``,
    ``language_model.lm_head.``, ``vision_tower.``, ``multi_modal_projector.``)."""
    from transformers import AriaConfig, AriaForConditionalGeneration, AutoModelForCausalLM

    hf_text = AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
    vision = dict(model_type="idefics3_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = AriaConfig(text_config=hf_text.config.to_dict(), vision_config=vision,
                        projector_patch_to_query_dict={4: 2}, image_token_index=300, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AriaForConditionalGeneration(config).float().eval()
    model.model.language_model.load_state_dict(hf_text.model.state_dict())
    model.lm_head.load_state_dict(hf_text.lm_head.state_dict())
    model.save_pretrained(path, safe_serialization=True)
    _copy_tokenizer(text, path)
    return path


def build_tiny_emu3(path: Path, seed: int = 0) -> Path:
    from transformers import Emu3ForCausalLM, Emu3TextConfig

    tok = _tokenizer(path)
    config = Emu3TextConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            bos_token_id=tok.pad_token_id, **EMU3)
    torch.manual_seed(seed)
    model = Emu3ForCausalLM(config).float().eval()
    _visible(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_emu3_multimodal(text: Path, path: Path) -> Path:
    """Emu3ForConditionalGeneration holding ``text``'s model beside a tiny VQ-VAE, saved as transformers saves it
    (the release's names: ``text_model.model.``, ``text_model.lm_head.``, ``vqmodel.``)."""
    from transformers import Emu3Config, Emu3ForCausalLM, Emu3ForConditionalGeneration

    hf_text = Emu3ForCausalLM.from_pretrained(text, dtype=torch.float32)
    vq = dict(codebook_size=len(EMU3_CODES), embed_dim=4, latent_channels=4, base_channels=32,
              channel_multiplier=[1, 2], num_res_blocks=1, attn_resolutions=[], hidden_size=32,
              temporal_downsample_factor=2)
    codes = {f"<|visual token {i:06d}|>": token for i, token in enumerate(EMU3_CODES)}
    config = Emu3Config(text_config=hf_text.config.to_dict(), vq_config=vq,
                        vocabulary_map={"<image>": EMU3_CODES[0], **codes}, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Emu3ForConditionalGeneration(config).float().eval()
    model.model.text_model.load_state_dict(hf_text.model.state_dict())
    model.lm_head.load_state_dict(hf_text.lm_head.state_dict())
    model.save_pretrained(path, safe_serialization=True)
    _copy_tokenizer(text, path)
    return path


def build_tiny_mllama(path: Path, seed: int = 0) -> Path:
    from transformers import MllamaForCausalLM, MllamaTextConfig

    tok = _tokenizer(path)
    config = MllamaTextConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                              bos_token_id=tok.pad_token_id, **MLLAMA)
    torch.manual_seed(seed)
    model = MllamaForCausalLM(config).float().eval()
    _visible(model)
    with torch.no_grad():  # zeros at init: a release's are trained away from 0
        for name, param in model.named_parameters():
            if name.endswith("cross_attn_attn_gate"):
                param.fill_(0.7)
            elif name.endswith("cross_attn_mlp_gate"):
                param.fill_(-0.9)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_mllama_multimodal(text: Path, path: Path) -> Path:
    """MllamaForConditionalGeneration holding ``text``'s model beside a two-layer vision model and the projector,
    saved as transformers saves it (the release's names: ``language_model.model.``, ``language_model.lm_head.``,
    ``vision_model.``, ``multi_modal_projector.``)."""
    from transformers import MllamaConfig, MllamaForCausalLM, MllamaForConditionalGeneration

    hf_text = MllamaForCausalLM.from_pretrained(text, dtype=torch.float32)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_global_layers=1, attention_heads=2, intermediate_size=64,
                  vision_output_dim=64, image_size=28, patch_size=14, max_num_tiles=2, intermediate_layers_indices=[0],
                  supported_aspect_ratios=[[1, 1], [1, 2]])
    config = MllamaConfig(text_config=hf_text.config.to_dict(), vision_config=vision,
                          image_token_index=hf_text.config.vocab_size)
    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(config).float().eval()
    model.model.language_model.load_state_dict(hf_text.model.state_dict())
    model.lm_head.load_state_dict(hf_text.lm_head.state_dict())
    model.save_pretrained(path, safe_serialization=True)
    _copy_tokenizer(text, path)
    return path


def _hf_class(family: str):
    """transformers' class of a tiny text model (its auto class lists no text-only class for Emu3's config)."""
    import transformers

    return {"aria": transformers.AriaTextForCausalLM, "emu3": transformers.Emu3ForCausalLM,
            "mllama": transformers.MllamaForCausalLM, "mllama_mm": transformers.MllamaForConditionalGeneration}[family]


@pytest.fixture(scope="session")
def tiny_aria_dir(tmp_path_factory) -> Path:
    return build_tiny_aria(tmp_path_factory.mktemp("tiny_aria"))


@pytest.fixture(scope="module")
def aria_reference(tiny_aria_dir) -> torch.Tensor:
    return reference_logits(tiny_aria_dir)


@pytest.fixture(scope="session")
def tiny_emu3_dir(tmp_path_factory) -> Path:
    return build_tiny_emu3(tmp_path_factory.mktemp("tiny_emu3"))


@pytest.fixture(scope="module")
def emu3_reference(tiny_emu3_dir) -> torch.Tensor:
    return reference_logits(tiny_emu3_dir, _hf_class("emu3"))


@pytest.fixture(scope="session")
def tiny_mllama_dir(tmp_path_factory) -> Path:
    return build_tiny_mllama(tmp_path_factory.mktemp("tiny_mllama"))


@pytest.fixture(scope="module")
def mllama_reference(tiny_mllama_dir) -> torch.Tensor:
    return reference_logits(tiny_mllama_dir, _hf_class("mllama"))


@pytest.fixture(scope="session")
def tiny_mllama_mm_dir(tiny_mllama_dir, tmp_path_factory) -> Path:
    return build_tiny_mllama_multimodal(tiny_mllama_dir, tmp_path_factory.mktemp("tiny_mllama_mm") / "m")


# ---- Aria ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_aria_logits_match_transformers(tiny_aria_dir, aria_reference, schedule):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps; the release's fused
    ``fc1`` / ``fc2`` expert tensors ([E, H, 2I], [E, I, H]) read into every layer's experts, the shared MLP twice an
    expert's width."""
    from specray.models.aria import AriaTextForCausalLM

    model = load_model(str(tiny_aria_dir))
    assert isinstance(model, AriaTextForCausalLM)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers)
    assert model.model.layers[0].mlp.shared.down_proj.weight.shape[-1] == 2 * ARIA["intermediate_size"]
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), aria_reference) < TOL


def test_aria_experts_sync_free_path_matches_transformers(tiny_aria_dir, aria_reference):
    """The experts' sync-free path (what graph steps run: grouped matmuls over the fused experts) gives the same
    logits."""
    from specray.models.moe import sync_free_experts

    model = load_model(str(tiny_aria_dir))
    with sync_free_experts():
        assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), aria_reference) < TOL


def _aria_softmax_over_all(monkeypatch) -> None:
    """The chosen experts weighted by their share of a softmax over every expert (not renormalised)."""
    def route(self, x, token_ids=None):
        probs = F.softmax(F.linear(x, self.router_module.weight), dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return weights.to(x.dtype), ids
    monkeypatch.setattr(SparseMoE, "route", route)


def _aria_no_shared(model) -> None:
    for layer in model.model.layers:
        layer.mlp.shared.partial = lambda x: torch.zeros_like(x)


def _aria_top1(config) -> None:
    config.moe_topk = 1


ARIA_MUTATIONS = {"softmax-over-all-experts": (_aria_softmax_over_all, None, None),
                  "no-shared-experts": (None, None, _aria_no_shared),
                  "one-expert-per-token": (None, _aria_top1, None)}


@pytest.mark.parametrize("mutation", sorted(ARIA_MUTATIONS))
def test_aria_each_part_shows_in_the_logits(tiny_aria_dir, aria_reference, monkeypatch, mutation):
    """The router's weights (a softmax over the chosen logits alone), the shared experts and the top k, each broken
    once: the logits move by more than a hundred times the tolerance."""
    patch, mutate_config, mutate = ARIA_MUTATIONS[mutation]
    if patch is not None:
        patch(monkeypatch)
    assert max_diff(mutated_logits(tiny_aria_dir, mutate_config, mutate), aria_reference) > MOVED


@pytest.fixture(scope="module")
def tiny_aria_multimodal_dir(tiny_aria_dir, tmp_path_factory) -> Path:
    return build_tiny_aria_multimodal(tiny_aria_dir, tmp_path_factory.mktemp("tiny_aria_mm") / "m")


def _modules_layout(folder: Path, path: Path, renames: tuple[tuple[str, str], ...]) -> Path:
    """``folder``'s checkpoint with its tensors renamed as transformers' modules name them: the first of ``renames``
    (release prefix, modules' prefix) a name starts with, else ``model.`` before it (a tower's)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, path)
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {}
    for name, tensor in tensors.items():
        ours = next((modules + name[len(release):] for release, modules in renames if name.startswith(release)),
                    "model." + name)
        renamed[ours] = tensor
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_aria_multimodal_checkpoint_serves_its_text_model(tiny_aria_multimodal_dir, aria_reference, tmp_path,
                                                          caplog):
    """AriaForConditionalGeneration's checkpoint (model type aria, the text model under ``language_model.``, beside
    ``vision_tower.`` and ``multi_modal_projector.``), and the same tensors in transformers' modules' layout: the
    text model is built from its text_config, reads its own tensors alone, and its logits equal transformers' whole
    model's for the text prompt (and the text model's)."""
    from transformers import AriaForConditionalGeneration

    folder = tiny_aria_multimodal_dir
    config = read_config(str(folder))
    assert config.model_type == "aria" and config.architectures == ["AriaForConditionalGeneration"]
    whole = reference_logits(folder, AriaForConditionalGeneration)
    assert max_diff(whole, aria_reference) < TOL
    renames = (("language_model.lm_head.", "lm_head."), ("language_model.model.", "model.language_model."))
    for source in (folder, _modules_layout(folder, tmp_path / "modules", renames)):
        with caplog.at_level("WARNING", logger="specray.models.llama"):
            model = load_model(str(source))
        assert model.config.model_type == "aria_text"
        assert "ignoring checkpoint tensor" not in caplog.text
        assert max_diff(prefill_logits(model, prompt()), whole) < TOL


@pytest.mark.parametrize("field,value,match", [
    ("mlp_bias", True, r"mlp_bias=True is not supported for model_type='aria_text'"),
    ("moe_num_shared_experts", 0, r"moe_num_shared_experts=0: Aria's MoE layers have at least one shared expert"),
    ("hidden_act", "gelu", r"hidden_act='gelu' is not supported for experts"),
])
def test_aria_unsupported_settings_are_refused_by_name(tiny_aria_dir, field, value, match):
    config = read_config(str(tiny_aria_dir))
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_aria_dir), config=config)


# ---- Emu3 ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_emu3_logits_match_transformers(tiny_emu3_dir, emu3_reference, schedule):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps."""
    from specray.models.emu3 import Emu3ForCausalLM

    model = load_model(str(tiny_emu3_dir))
    assert type(model) is Emu3ForCausalLM
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), emu3_reference) < TOL


def _emu3_llama_theta(config) -> None:
    """Llama's RoPE theta (1e4) in place of Emu3's (1e6)."""
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 10000.0}


def _emu3_no_gqa(model) -> None:
    """Each query head reading the first KV head (no grouping)."""
    for layer in model.model.layers:
        attn = layer.self_attn
        qkv = attn.qkv_proj.weight.data
        k = qkv[attn.qkv_proj.q_size: attn.qkv_proj.q_size + attn.qkv_proj.kv_size]
        k[attn.head_dim:] = k[: attn.head_dim].clone()


EMU3_MUTATIONS = {"llama-rope-theta": (None, _emu3_llama_theta, None), "one-kv-head": (None, None, _emu3_no_gqa)}


@pytest.mark.parametrize("mutation", sorted(EMU3_MUTATIONS))
def test_emu3_each_part_shows_in_the_logits(tiny_emu3_dir, emu3_reference, monkeypatch, mutation):
    """Emu3's RoPE theta and its grouped KV heads, each broken once: the logits move."""
    patch, mutate_config, mutate = EMU3_MUTATIONS[mutation]
    if patch is not None:
        patch(monkeypatch)
    assert max_diff(mutated_logits(tiny_emu3_dir, mutate_config, mutate), emu3_reference) > MOVED


@pytest.fixture(scope="module")
def tiny_emu3_multimodal_dir(tiny_emu3_dir, tmp_path_factory) -> Path:
    return build_tiny_emu3_multimodal(tiny_emu3_dir, tmp_path_factory.mktemp("tiny_emu3_mm") / "m")


def test_emu3_multimodal_checkpoint_serves_its_text_model(tiny_emu3_multimodal_dir, emu3_reference, tmp_path,
                                                          caplog):
    """Emu3ForConditionalGeneration's checkpoint (model type emu3, the text model under ``text_model.``, beside the
    VQ-VAE's ``vqmodel.``), and the same tensors in transformers' modules' layout: the text model reads its own
    tensors alone; its logits equal transformers' whole model's for a text prompt and for a prompt of image-code ids
    (ordinary vocabulary ids to the text model: what an image becomes once the VQ-VAE has encoded it)."""
    from transformers import Emu3ForConditionalGeneration

    folder = tiny_emu3_multimodal_dir
    config = read_config(str(folder))
    assert config.model_type == "emu3" and config.architectures == ["Emu3ForConditionalGeneration"]
    codes = [EMU3_CODES[1 + i % 19] for i in range(12)] + prompt()[:12]
    hf = Emu3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        whole = [hf(torch.tensor([ids])).logits[0] for ids in (prompt(), codes)]
    assert max_diff(whole[0], emu3_reference) < TOL
    renames = (("text_model.lm_head.", "lm_head."), ("text_model.model.", "model.text_model."))
    for source in (folder, _modules_layout(folder, tmp_path / "modules", renames)):
        with caplog.at_level("WARNING", logger="specray.models.llama"):
            model = load_model(str(source))
        assert model.config.model_type == "emu3_text_model"
        assert "ignoring checkpoint tensor" not in caplog.text
        for ids, want in zip((prompt(), codes), whole):
            assert max_diff(prefill_logits(model, ids), want) < TOL


def test_emu3_sliding_window_is_refused_by_name(tiny_emu3_dir):
    config = read_config(str(tiny_emu3_dir))
    config.sliding_window = 8
    with pytest.raises(ValueError, match=r"sliding_window=8 is not supported for model_type='emu3_text_model'"):
        load_model(str(tiny_emu3_dir), config=config)


# ---- Mllama ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_mllama_logits_match_transformers(tiny_mllama_dir, mllama_reference, schedule):
    """Every position's logits equal transformers' for a text-only prompt, for a prefill and for chunks + decode
    steps: the cross-attention layers skipped (no parameters, no KV cache), the embedding of vocab_size + 8 rows,
    Llama 3's RoPE scaling."""
    from specray.models.mllama import MllamaForCausalLM, SkippedCrossAttentionLayer

    model = load_model(str(tiny_mllama_dir))
    assert type(model) is MllamaForCausalLM
    layers = model.model.layers
    assert [i for i, layer in enumerate(layers) if isinstance(layer, SkippedCrossAttentionLayer)] == list(MLLAMA_CROSS)
    assert not any(name.startswith(("model.layers.1.", "model.layers.3.")) for name, _ in model.named_parameters())
    assert len(model.kv_cache_specs()) == MLLAMA["num_hidden_layers"] - len(MLLAMA_CROSS)
    assert model.model.embed_tokens.weight.shape[0] == model.config.vocab_size + 8
    assert model.lm_head.weight.shape[0] == model.config.vocab_size
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), mllama_reference) < TOL


class _CrossMLPRun(torch.nn.Module):
    """A cross-attention layer as if its attention gave 0 and its MLP still ran: the stream plus tanh(mlp gate) times
    the MLP of the normed stream (what the layer would do were it gated to zero rather than skipped)."""

    def __init__(self, tensors: dict[str, torch.Tensor], prefix: str, eps: float):
        super().__init__()
        self.t = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        self.eps = eps

    def forward(self, x, residual, cos, sin, meta):
        t = self.t
        stream = x if residual is None else x + residual
        h = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + self.eps) * t["post_attention_layernorm.weight"]
        mlp = F.linear(F.silu(F.linear(h, t["mlp.gate_proj.weight"])) * F.linear(h, t["mlp.up_proj.weight"]),
                       t["mlp.down_proj.weight"])
        return stream + torch.tanh(t["cross_attn_mlp_gate"]) * mlp, None


def _mllama_cross_mlp_run(folder):
    def mutate(model):
        from safetensors.torch import load_file

        tensors = load_file(str(folder / "model.safetensors"))
        for i in MLLAMA_CROSS:
            model.model.layers[i] = _CrossMLPRun(tensors, f"model.layers.{i}.", MLLAMA["rms_norm_eps"])
    return mutate


def _mllama_no_rope_scaling(config) -> None:
    config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}


@pytest.mark.parametrize("mutation", ["cross-layer-mlp-run", "no-llama3-rope-scaling"])
def test_mllama_each_part_shows_in_the_logits(tiny_mllama_dir, mllama_reference, mutation):
    """A cross-attention layer gated to zero but its MLP still run (instead of skipped), and Llama 3's RoPE scaling
    left out: the logits move by more than a hundred times the tolerance."""
    if mutation == "cross-layer-mlp-run":
        got = mutated_logits(tiny_mllama_dir, None, _mllama_cross_mlp_run(tiny_mllama_dir))
    else:
        got = mutated_logits(tiny_mllama_dir, _mllama_no_rope_scaling, None)
    assert max_diff(got, mllama_reference) > MOVED


def test_mllama_multimodal_checkpoint_serves_its_text_model(tiny_mllama_mm_dir, mllama_reference, tmp_path, caplog):
    """MllamaForConditionalGeneration's checkpoint (model type mllama, the text model under ``language_model.``,
    beside ``vision_model.`` and ``multi_modal_projector.``), and the same tensors in transformers' modules' layout:
    the text model reads its own tensors alone (not the cross-attention layers'), and its logits equal transformers'
    whole model's for a text prompt."""
    folder = tiny_mllama_mm_dir
    config = read_config(str(folder))
    assert config.model_type == "mllama" and config.architectures == ["MllamaForConditionalGeneration"]
    whole = reference_logits(folder, _hf_class("mllama_mm"))
    assert max_diff(whole, mllama_reference) < TOL
    renames = (("language_model.lm_head.", "lm_head."), ("language_model.model.", "model.language_model."))
    for source in (folder, _modules_layout(folder, tmp_path / "modules", renames)):
        with caplog.at_level("WARNING", logger="specray.models.llama"):
            model = load_model(str(source))
        assert model.config.model_type == "mllama_text_model"
        assert "ignoring checkpoint tensor" not in caplog.text
        assert not any(model.reads_weight(f"model.layers.{i}.{part}.weight") for i in MLLAMA_CROSS
                       for part in ("cross_attn.q_proj", "mlp.up_proj", "input_layernorm"))
        assert model.reads_weight("model.layers.2.mlp.up_proj.weight")
        assert max_diff(prefill_logits(model, prompt()), whole) < TOL


@pytest.mark.parametrize("field,value,match", [
    ("cross_attention_layers", [1, 5], r"cross_attention_layers=\[1, 5\]: each must be a layer index in \[0, "),
    ("cross_attention_layers", list(range(5)), r"leaves no self-attention layer"),
    ("sliding_window", 8, r"sliding_window=8 is not supported for model_type='mllama_text_model'"),
    ("head_dim", 8, r"head_dim=8 is not supported for model_type='mllama_text_model'"),
    ("attention_bias", True, r"attention_bias=True is not supported for model_type='mllama_text_model'"),
], ids=["out-of-range", "no-self-attention", "sliding_window", "head_dim", "attention_bias"])
def test_mllama_unsupported_settings_are_refused_by_name(tiny_mllama_dir, field, value, match):
    config = read_config(str(tiny_mllama_dir))
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_mllama_dir), config=config)


# ---- every family ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2], ids=["tp2", "pp2"])
def test_two_ranks_match_one_rank(tiny_aria_dir, tiny_emu3_dir, tiny_mllama_dir, tmp_path, stages):
    """Two tensor-parallel ranks (heads, the experts' and the shared MLP's width split; the router replicated) or two
    pipeline stages (Mllama's: a skipped cross-attention layer on each): the last rank's logits equal one rank's, for
    each family in one launch of the ranks."""
    folders = [str(tiny_aria_dir), str(tiny_emu3_dir), str(tiny_mllama_dir)]
    assert_ranks_match_one_rank(tmp_path, folders, stages, TOL)


@pytest.mark.parametrize("family", ["aria", "emu3", "mllama", "mllama_mm"])
def test_engine_greedy_equals_transformers_with_ngram_drafts(request, family):
    """``specray.LLM`` with n-gram drafts gives transformers' greedy ``generate`` tokens, some drafts accepted
    (Mllama's: transformers' text model and its whole multimodal model, each on its own checkpoint); a prompt with
    ``multi_modal_data`` is refused (text only), and so is Mllama's image token in a prompt."""
    from specray import SamplingParams

    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    folder = request.getfixturevalue(f"tiny_{family}_dir")
    llm = runs.assert_ngram_greedy_equals_transformers(folder, _hf_class(family), max_tokens=12)
    with pytest.raises(ValueError, match="this model reads text only"):
        llm.generate([{"prompt": "Hello", "multi_modal_data": {"image": object()}}], SamplingParams(max_tokens=2),
                     use_tqdm=False)
    if family.startswith("mllama"):  # the image token (vocab_size: an embedding row past the vocabulary)
        image_token = llm.engine.vocab_size
        assert image_token == MLLAMA_VOCAB
        with pytest.raises(ValueError, match=rf"prompt_token_ids contains \[{image_token}\] outside the vocabulary"):
            llm.generate([{"prompt_token_ids": [5, image_token, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)
