"""Model types transformers serves through another family's class (:mod:`specray.models.aliases`): EXAONE 3.0 / 3.5,
InternLM3 and IQuest-Coder (Llama), Sarvam's 105B (DeepSeek-V3) and 30B (GLM-4.5). Tiny random models built with each
config class through transformers' ``AutoModelForCausalLM`` and saved three ways: transformers' default save (the
release's tensor names, as conversion_mapping.py writes them back, with the family's class as ``architectures``), the
same with the release's ``architectures`` (and EXAONE's GPT-2-style config keys), and transformers' module names
(``save_original_format=False``: fused experts). Each loads to transformers' logits (fp32, max abs diff < 1e-4) over a
prefill and over chunks and single steps; the engine's greedy output with n-gram drafts equals transformers'
``generate``; two tensor-parallel ranks equal one; the parts the aliases carry (renames, the split of Sarvam's fused
q/k/v, its config's settings) each move the logits when broken; an unserved setting is refused by name."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from specray.models import aliases
from specray.models.loader import load_model
from specray_test_model_checks import (DIFF_WORKER, SCHEDULES, chunked_logits, max_diff,  # tests/model_checks.py
                                       mutated_logits, prompt, reference_logits, run_ranks)

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=1024, initializer_range=0.1)
# kind -> (transformers' config class, its fields, the release's architecture, our class, a tensor only the release's
# names have)
KINDS = {
    # EXAONE 3.5 2.4B ties its head; Llama 3's RoPE scaling, as EXAONE 3.5's
    "exaone": ("ExaoneConfig", dict(COMMON, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}), "ExaoneForCausalLM", aliases.ExaoneForCausalLM,
        "transformer.h.0.attn.attention.out_proj.weight"),
    # biases on q/k/v, o and the MLP (qkv_bias = bias = True)
    "internlm3": ("InternLM3Config", dict(COMMON, head_dim=16, qkv_bias=True, bias=True), "InternLM3ForCausalLM",
                  aliases.InternLM3ForCausalLM, "model.layers.0.self_attn.o_proj.bias"),
    # head_dim apart from hidden_size / heads
    "iquestcoder": ("IQuestCoderConfig", dict(COMMON, head_dim=32, tie_word_embeddings=False),
                    "IQuestCoderForCausalLM", aliases.IQuestCoderForCausalLM, "model.layers.1.self_attn.q_proj.weight"),
    # latent attention without a query rank (Sarvam's), interleaved RoPE, a dense layer then grouped-sigmoid experts
    "sarvam_mla": ("SarvamMLAConfig", dict(COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                           moe_intermediate_size=32, kv_lora_rank=16, qk_nope_head_dim=16,
                                           qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5,
                                           initializer_range=0.05, tie_word_embeddings=False),
                   "SarvamMLAForCausalLM", aliases.SarvamMLAForCausalLM, "model.layers.1.mlp.experts.3.up_proj.weight"),
    # GQA with q/k/v biases and q/k norms, RoPE over the whole head, a dense layer then experts with a shared one
    "sarvam_moe": ("SarvamMoEConfig", dict(COMMON, num_hidden_layers=3, head_dim=16, use_qkv_bias=True,
                                           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                           moe_intermediate_size=32, first_k_dense_replace=1,
                                           tie_word_embeddings=False),
                   "SarvamMoEForCausalLM", aliases.SarvamMoEForCausalLM,
                   "model.layers.1.attention.query_key_value.bias"),
}
# transformers' default save; the release's architectures (and config keys); transformers' module names
LAYOUTS = ("saved", "release", "modules")
# EXAONE's release config keys (its config class's attribute_map)
EXAONE_KEYS = {"num_hidden_layers": "num_layers", "rms_norm_eps": "layer_norm_epsilon",
               "hidden_act": "activation_function"}


def build_alias(root: Path, kind: str, seed: int) -> dict[str, Path]:
    """transformers' tiny ``kind`` with random weights (norms, biases and correction biases drawn away from their
    init), saved in each of :data:`LAYOUTS`, with conftest's tiny tokenizer: layout -> folder."""
    import transformers
    from transformers import AutoModelForCausalLM

    from tests.conftest import build_tiny_tokenizer

    config_name, fields, release_arch, _, release_tensor = KINDS[kind]
    folders = {layout: root / layout for layout in LAYOUTS}
    tok = build_tiny_tokenizer(folders["saved"])
    config = getattr(transformers, config_name)(vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                                pad_token_id=tok.pad_token_id, bos_token_id=None, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(folders["saved"])
    model.save_pretrained(folders["modules"], save_original_format=False)
    shutil.copytree(folders["saved"], folders["release"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folders["saved"] / name, folders["modules"])
    from safetensors import safe_open
    with safe_open(folders["saved"] / "model.safetensors", "pt") as f:
        assert release_tensor in f.keys(), sorted(f.keys())  # transformers wrote the release's names back
    path = folders["release"] / "config.json"
    cfg = json.loads(path.read_text())
    cfg["architectures"] = [release_arch]
    if kind == "exaone":
        cfg = {EXAONE_KEYS.get(k, k): v for k, v in cfg.items()}
    path.write_text(json.dumps(cfg, indent=2))
    return folders


SEEDS = {"exaone": 1, "internlm3": 2, "iquestcoder": 3, "sarvam_mla": 4, "sarvam_moe": 5}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (layout -> folder, transformers' logits of the prompt), built once per kind as asked."""
    built = {}

    def get(kind):
        if kind not in built:
            folders = build_alias(tmp_path_factory.mktemp(kind), kind, SEEDS[kind])
            built[kind] = folders, reference_logits(folders["saved"])
        return built[kind]
    return get


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers(tiny, kind, layout):
    """Every layout of every kind loads into our class for it (by the release's architecture, or by model type
    where transformers' save names the family's class) and gives transformers' logits over a prefill and over chunks
    and single steps."""
    folders, want = tiny(kind)
    model = load_model(str(folders[layout]))
    assert type(model) is KINDS[kind][3]
    schedules = sorted(SCHEDULES) if layout == "release" else ["chunked+decode"]
    for schedule in schedules:
        assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), want) < TOL, schedule


def _exaone_norms_swapped(model):
    model.renames = tuple((p, {".input_layernorm.": ".post_attention_layernorm.",
                               ".post_attention_layernorm.": ".input_layernorm."}.get(o, o)) for p, o in model.renames)


def _reload(folder, mutate_model):
    def mutate(model):
        mutate_model(model)
        from specray.models.loader import iter_weights, resolve_model
        model.load_weights(iter_weights(resolve_model(str(folder))))
    return mutate


def _swap_kv_split(model):
    (q, k, v), = model.fused.values()
    model.fused = {".query_key_value.": (q, v, k)}


# kind -> (a config edit or None, a model edit or None): each breaks one part the alias carries
MUTATIONS = {
    "exaone: ln_1 / ln_2 renamed the wrong way": ("exaone", None, _exaone_norms_swapped),
    "internlm3: no MLP biases (its bias field unread)": (
        "internlm3", lambda c: setattr(c, "mlp_bias", False), None),
    "sarvam_mla: RoPE on halves, not interleaved pairs": ("sarvam_mla", lambda c: setattr(c, "rope_interleave", False),
                                                          None),
    "sarvam_moe: q/k/v rows split as q/v/k": ("sarvam_moe", None, _swap_kv_split),
    "sarvam_moe: GLM's half-head RoPE": (
        "sarvam_moe", lambda c: c.rope_parameters.update(partial_rotary_factor=0.5), None),
    "sarvam_moe: no q/k norms": ("sarvam_moe", lambda c: setattr(c, "use_qk_norm", False), None),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_logits(tiny, mutation):
    kind, mutate_config, mutate = MUTATIONS[mutation]
    folders, want = tiny(kind)
    folder = folders["release"]
    if mutate is not None:  # a model edit before the weights are read again
        mutate = _reload(folder, mutate)
    assert max_diff(mutated_logits(folder, mutate_config, mutate), want) > MOVED


def test_an_unserved_activation_is_refused_by_name(tiny, tmp_path):
    """transformers' Llama would run EXAONE's ``activation_function`` gelu; our Llama runs silu alone and says so."""
    folders, _ = tiny("exaone")
    folder = shutil.copytree(folders["release"], tmp_path / "gelu")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["activation_function"] = "gelu"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        load_model(str(folder))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_engine_greedy_with_ngram_drafts_equals_transformers(tiny, kind):
    folders, _ = tiny(kind)
    sys.modules["specray_test_engine_runs"].assert_ngram_greedy_equals_transformers(folders["release"])


def test_two_ranks_match_one_rank(tiny, tmp_path):
    """Two tensor-parallel ranks (heads, widths and experts split; Sarvam's fused q/k/v split before its shard is
    taken) give one rank's logits, over the release layouts."""
    folders = [str(tiny(kind)[0]["release"]) for kind in ("exaone", "internlm3", "sarvam_mla", "sarvam_moe")]
    results = run_ranks(tmp_path, DIFF_WORKER, 2, 1, folders)
    assert all(d is not None and d < TOL for r in results for d in r["diffs"]), results
