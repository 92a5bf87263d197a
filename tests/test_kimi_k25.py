"""Kimi K2.5 (``Kimi_K25ForConditionalGeneration``): its text model (a DeepSeek-V3, its ``text_config``) served from the
multimodal checkpoint, the vision tower's and projector's tensors left out, the text's read under the release's names
(``language_model.model.*``, ``language_model.lm_head.*``) and transformers' module names: logits equal transformers'
composite model's on text (fp32, max abs diff < 1e-4)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from specray.models.deepseek_v3 import DeepseekV3ForCausalLM
from specray.models.loader import load_model
from specray_test_checkpoints import _int_config, _int_tensors, _quantize, split_experts  # tests/checkpoints.py
from specray_test_model_checks import SCHEDULES, chunked_logits, max_diff, prompt  # tests/model_checks.py

TOL = 1e-4
TEXT = dict(model_type="deepseek_v3", vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, max_position_embeddings=1024,
            initializer_range=0.1)
VISION = dict(num_attention_heads=2, num_hidden_layers=1, hidden_size=32, intermediate_size=64, pos_emb_height=4,
              pos_emb_width=4, pos_emb_time=2)


def release_name(name: str) -> str:
    """transformers' module name -> the release's (the text under ``language_model.``, llava's layout)."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name[len("model.language_model."):]
    return "language_model.lm_head." + name[len("lm_head."):] if name.startswith("lm_head.") else name


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(folders in the release's names and in transformers' module names, transformers' logits of the prompt)."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    config = Kimi_K25Config(text_config=TEXT, vision_config=VISION, projection_hidden_size=32,
                            tie_word_embeddings=False)
    torch.manual_seed(5)
    hf = Kimi_K25ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the router from zeros: random, so routing matters
                param.normal_(0.0, 0.5)
        reference = hf(input_ids=torch.tensor([prompt()])).logits[0].float()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    folders = {}
    for layout, rename in (("release", release_name), ("modules", lambda n: n)):
        folder = tmp_path_factory.mktemp(f"kimi_{layout}")
        config.architectures = ["Kimi_K25ForConditionalGeneration"]
        config.save_pretrained(folder)
        save_file({rename(k): v for k, v in state.items()}, str(folder / "model.safetensors"))
        folders[layout] = folder
    return folders, reference


@pytest.mark.parametrize("layout", ["release", "modules"])
def test_text_logits_match_transformers(kimi, layout):
    folders, reference = kimi
    model = load_model(str(folders[layout]))
    assert isinstance(model, DeepseekV3ForCausalLM)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) < TOL


def test_int4_experts_as_the_release_stores_them(kimi, tmp_path):
    """The release's routed experts in 4 bits (llm-compressor's pack-quantized, symmetric, groups of 32, one tensor
    per expert under ``language_model.``; attention, shared experts, the dense layer's MLP and the vision tower
    full precision, named in ``ignore`` as the release does) with the quantization config at the top of the
    multimodal config: the experts load dequantized, logits equal the model with the same experts dequantized here."""
    import json

    from safetensors.torch import load_file

    split = split_experts(kimi[0]["release"], tmp_path / "split")
    quantized, dequantized, count = {}, {}, 0
    for name, w in load_file(str(split / "model.safetensors")).items():
        if ".mlp.experts." not in name:
            quantized[name] = dequantized[name] = w
            continue
        q, scale, zero, back = _quantize(w.float(), torch.arange(w.shape[1]) // 32, 4, symmetric=True)
        quantized.update(_int_tensors("packed", name[: -len(".weight")], q, scale, zero, None, 4, False, None,
                                      w.shape))
        dequantized[name] = back.to(w.dtype)
        count += 1
    assert count == 8 * 3  # the MoE layer's experts, three projections each
    folders = {}
    for kind, tensors in (("int4", quantized), ("dequantized", dequantized)):
        folder = tmp_path / kind
        folder.mkdir()
        config = json.loads((split / "config.json").read_text())
        if kind == "int4":
            config["quantization_config"] = _int_config("packed", 4, 32, False, None) | {"ignore": [
                "re:.*lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                "re:vision_tower.*", "re:mm_projector.*"]}
        (folder / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(folder / "model.safetensors"))
        folders[kind] = folder
    assert any(n.endswith(".experts.5.down_proj.weight_packed") for n in quantized)
    model, reference = load_model(str(folders["int4"])), load_model(str(folders["dequantized"]))
    assert isinstance(model, DeepseekV3ForCausalLM)
    ids = prompt()
    assert max_diff(chunked_logits(model, ids, SCHEDULES["chunked+decode"]),
                    chunked_logits(reference, ids, SCHEDULES["chunked+decode"])) < TOL
    # the experts matter: the full-precision model's logits differ
    assert max_diff(chunked_logits(model, ids, SCHEDULES["chunked+decode"]), kimi[1]) > TOL

