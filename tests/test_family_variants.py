"""Families served as variants of the classes we have, against transformers on the same random tiny weights (fp32,
max abs diff < 1e-4), each difference from the family it builds on shown to matter (the comparison fails without
it): SmolLM3 (Llama with NoPE layers), OLMo 3 (OLMo 2 with sliding-window layers and a RoPE per kind of layer),
ERNIE 4.5 (Llama with RoPE on interleaved pairs and biases everywhere), Seed-OSS (Llama with q/k/v biases);
the text models of Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE releases (a Qwen2, a Qwen3, a Qwen3-MoE) against the whole
multimodal model on text-only prompts, in each layout of their tensors.
Tensor-parallel ranks and pipeline stages equal one rank; the engine's greedy output, plain and with n-gram drafts,
equals transformers' ``generate``."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from specray.models import cpu_kernels
from specray.models.loader import load_model
from specray_test_model_checks import (SCHEDULES, chunked_logits, max_diff, mutated_logits,  # tests/model_checks.py
                                       prompt, run_ranks, WORKER_PRELUDE)

TOL = 1e-4
# each family's tiny model (a tests/conftest.py fixture)
FIXTURES = {"smollm3": "tiny_smollm3_dir", "olmo3": "tiny_olmo3_dir", "ernie4_5": "tiny_ernie4_5_dir",
            "seed_oss": "tiny_seed_oss_dir"}


@torch.no_grad()
def hf_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def family(request) -> tuple[str, Path, torch.Tensor]:
    """(the family, its tiny model's folder, transformers' logits [PROMPT_LEN, V] of the prompt)."""
    folder = request.getfixturevalue(FIXTURES[request.param])
    return request.param, folder, hf_logits(folder, prompt())


@pytest.mark.parametrize("path", ["batched", "own"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(family, monkeypatch, schedule, path):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps through the paged
    cache; short queries as the padded batch or one sequence at a time."""
    if path == "own":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    _, folder, reference = family
    model = load_model(str(folder))
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def _rope_everywhere(model) -> None:
    """SmolLM3's NoPE layers rotated as the others are."""
    layers = [layer.self_attn for layer in model.model.layers]
    assert [a.use_rope for a in layers] == [True, False, True, False]
    for attn in layers:
        attn.use_rope = True


def _one_rope(model) -> None:
    """OLMo 3's sliding layers rotated by the full layers' (YaRN-scaled) RoPE."""
    assert model.model.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    model.model.layer_types = ["full_attention"] * 4


def _no_window(config) -> None:
    """OLMo 3's sliding layers attending to every position."""
    config.sliding_window = None


def _rope_on_halves(model) -> None:
    """ERNIE 4.5's RoPE rotating the two halves of each head, as Llama's does."""
    for layer in model.model.layers:
        assert layer.self_attn.interleaved_rope
        layer.self_attn.interleaved_rope = False


def _no_qkv_bias(model) -> None:
    """Seed-OSS's (ERNIE 4.5's) q/k/v biases left out."""
    for layer in model.model.layers:
        layer.self_attn.qkv_proj.bias.zero_()


def _o_bias(config) -> None:
    """Seed-OSS's o_proj given a bias, as attention_bias gives Llama's."""
    config.attention_out_bias = True


# a mutation: (the family, a change to our model once loaded, or to its config before it is built)
MUTATIONS = {"smollm3-rope-everywhere": ("smollm3", _rope_everywhere, None),
             "olmo3-one-rope": ("olmo3", _one_rope, None), "olmo3-no-window": ("olmo3", None, _no_window),
             "ernie4_5-rope-on-halves": ("ernie4_5", _rope_on_halves, None),
             "ernie4_5-no-qkv-bias": ("ernie4_5", _no_qkv_bias, None),
             "seed_oss-no-qkv-bias": ("seed_oss", _no_qkv_bias, None)}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_difference_shows_in_the_logits(request, mutation):
    """With a difference from the family it builds on undone, the model is far from transformers': the comparison
    above sees each of them."""
    name, mutate, mutate_config = MUTATIONS[mutation]
    folder = request.getfixturevalue(FIXTURES[name])
    assert max_diff(mutated_logits(folder, mutate_config, mutate), hf_logits(folder, prompt())) > 1e-2


def test_seed_oss_o_proj_has_no_bias(tiny_seed_oss_dir):
    """Seed-OSS biases q/k/v (attention_bias) but not o_proj (attention_out_bias): an o_proj bias would be a
    parameter its checkpoint lacks."""
    from specray.models.loader import read_config

    config = read_config(str(tiny_seed_oss_dir))
    assert config.attention_bias and not config.attention_out_bias
    model = load_model(str(tiny_seed_oss_dir))
    assert all(layer.self_attn.o_proj.bias is None for layer in model.model.layers)
    _o_bias(config)
    with pytest.raises(ValueError, match=r"checkpoint is missing 2 weights.*o_proj\.bias"):
        load_model(str(tiny_seed_oss_dir), config=config)


def test_smollm3_no_rope_layers_of_the_wrong_length_are_named(tmp_path, tiny_smollm3_dir):
    from specray.models.loader import read_config

    config = read_config(str(tiny_smollm3_dir))
    config.no_rope_layers = [1, 0, 1]
    with pytest.raises(ValueError, match=r"no_rope_layers has 3 flags for num_hidden_layers=4"):
        load_model(str(tiny_smollm3_dir), config=config)


# ---- the text models of Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE -------------------------------------------------------

VL_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1,
               vocab_size=300, bos_token_id=None, eos_token_id=None, pad_token_id=None)
VL_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
# each release: (its head tied, the specray class and model_type of its text model, the layouts its tensors come in:
# as transformers 5 saves it, and as the releases made with transformers 4 hold it where those differ)
VL_RELEASES = {"qwen2_5_vl": (True, "qwen2_5_vl_text", ["saved", "nested"]),
               "qwen3_vl": (False, "qwen3_vl_text", ["saved"]),
               "qwen3_vl_moe": (False, "qwen3_vl_moe_text", ["saved", "experts-inputs-first"])}


def vl_release(kind: str, tie: bool):
    """A tiny multimodal release of ``kind`` (random weights, its q/k norms and router too)."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig,
                              Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)

    # multimodal RoPE's sections (t, h, w) of the 8 frequencies of a 16-wide head; Qwen3-VL's interleaved
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    if kind == "qwen2_5_vl":
        config = Qwen2_5_VLConfig(text_config={**VL_TEXT, "rope_parameters": rope},
                                  vision_config={**VL_VISION, "fullatt_block_indexes": [0]}, tie_word_embeddings=tie)
        model = Qwen2_5_VLForConditionalGeneration(config)
    else:
        text = {**VL_TEXT, "head_dim": 16, "rope_parameters": {**rope, "mrope_interleaved": True}}
        if kind == "qwen3_vl_moe":  # its text config's own default ties the head; the whole config's says not
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                        tie_word_embeddings=not tie)
        cfg_cls, cls = ((Qwen3VLConfig, Qwen3VLForConditionalGeneration) if kind == "qwen3_vl" else
                        (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration))
        model = cls(cfg_cls(text_config=text, vision_config={**VL_VISION, "deepstack_visual_indexes": [0]},
                            tie_word_embeddings=tie))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    return model.float().eval()


def relayout(folder: Path, layout: str) -> None:
    """Rewrite a saved release's tensors in another layout: ``nested``, Qwen2.5-VL's text model and vision tower
    under ``model.language_model.`` and ``model.visual.``; ``experts-inputs-first``, Qwen3-VL-MoE's fused experts as
    its releases store them ([E, H, 2I] and [E, I, H]: transformers 5 saves [E, 2I, H] and [E, H, I])."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    if layout == "nested":
        assert "model.layers.0.self_attn.q_proj.bias" in tensors and any(n.startswith("visual.") for n in tensors)
        tensors = {("model." + n if n.startswith("visual.") else
                    n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n): t
                   for n, t in tensors.items()}
    else:
        fused = [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        assert fused and tensors[fused[0]].shape[-1] in (64, 24)  # saved as [E, 2I, H] and [E, H, I]
        tensors.update({n: tensors[n].transpose(1, 2).contiguous() for n in fused})
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def vl_folders(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, object]]:
    """(release, layout) -> (its folder, transformers' whole multimodal model)."""
    folders = {}
    for seed, (kind, (tie, _, layouts)) in enumerate(sorted(VL_RELEASES.items())):
        torch.manual_seed(40 + seed)
        model = vl_release(kind, tie)
        for layout in layouts:
            folder = tmp_path_factory.mktemp(f"{kind}-{layout}")
            model.save_pretrained(folder)
            if layout != "saved":
                relayout(folder, layout)
            folders[kind, layout] = folder, model
    return folders


@pytest.mark.parametrize("kind,layout", [(k, layout) for k, (_, _, layouts) in sorted(VL_RELEASES.items())
                                         for layout in layouts])
def test_vl_release_serves_its_text_model(vl_folders, kind, layout):
    """The text model of a Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE release, in each layout its tensors come in, loads as
    the Qwen2 / Qwen3 / Qwen3-MoE it is (its head tied as the whole config says), and its logits on a text-only
    prompt, with plain RoPE, equal those of transformers' whole multimodal model, whose multimodal RoPE gives each
    position's three ids the same value: a prefill, and chunks then decode steps through the paged cache."""
    from specray.models.llama import LlamaForCausalLM
    from specray.models.loader import load_hf_config

    folder, full = vl_folders[kind, layout]
    tie, text_type, _ = VL_RELEASES[kind]
    model = load_model(str(folder))
    assert type(model) is LlamaForCausalLM and model.tie_word_embeddings == tie
    assert load_hf_config(str(folder)).model_type == text_type
    with torch.no_grad():
        reference = full(input_ids=torch.tensor([prompt()])).logits[0].float()
    for schedule in SCHEDULES.values():
        assert max_diff(chunked_logits(model, prompt(), schedule), reference) < TOL


def test_exaone4_5_release_serves_its_text_model(tiny_exaone4_dir, tmp_path):
    """EXAONE 4.5 (``Exaone4_5_ForConditionalGeneration``): its EXAONE 4.0 text model (sliding layers with RoPE, a
    global one without) loads as that family from under ``model.language_model.``, the vision tower and an MTP
    module left unread, and its logits on a text-only prompt equal transformers' whole multimodal model's: a prefill,
    and chunks then decode steps."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Exaone4_5_Config, Exaone4_5_ForConditionalGeneration

    from specray.models.loader import load_hf_config

    text = AutoConfig.from_pretrained(tiny_exaone4_dir).to_dict()
    torch.manual_seed(5)
    full = Exaone4_5_ForConditionalGeneration(Exaone4_5_Config(text_config=text, vision_config=VL_VISION,
                                                               tie_word_embeddings=False)).float().eval()
    with torch.no_grad():
        for name, param in full.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    full.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert any(n.startswith("model.visual.") for n in tensors) and "lm_head.weight" in tensors
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)  # (a release's MTP module: not the text model's)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(str(tmp_path))
    assert load_hf_config(str(tmp_path)).model_type == "exaone4"
    with torch.no_grad():
        reference = full(input_ids=torch.tensor([prompt()])).logits[0].float()
    for schedule in SCHEDULES.values():
        assert max_diff(chunked_logits(model, prompt(), schedule), reference) < TOL


def test_vl_release_greedy_with_ngram_drafts_equals_plain_and_transformers(vl_folders, tiny_llama_dir):
    """The engine serves a Qwen3-VL-MoE release's text (as released: experts inputs first): greedy tokens with and
    without n-gram drafts equal transformers' ``generate`` on the whole multimodal model (the tokenizer borrowed;
    token-id prompts); a prompt or a chat message carrying an image is refused."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    folder, full = vl_folders["qwen3_vl_moe", "experts-inputs-first"]
    prompts = [{"prompt_token_ids": prompt(seed)[:n]} for seed, n in ((1, 12), (2, 5), (3, 20))]
    text_only = {"image": 0}  # its images are served too (tests/test_qwen3_vl_images.py); this folder has no processor
    plain = LLM(str(folder), max_model_len=128, tokenizer=str(tiny_llama_dir), limit_mm_per_prompt=text_only)
    plain_ids = runs.token_ids(plain.generate(prompts, runs.greedy(12), use_tqdm=False))
    for p, ours in zip(prompts, plain_ids):
        ids = torch.tensor([p["prompt_token_ids"]])
        out = full.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
        assert out[0, ids.shape[1]:].tolist() == ours
    spec = LLM(str(folder), max_model_len=128, tokenizer=str(tiny_llama_dir), speculative_config=NGRAM,
               limit_mm_per_prompt=text_only)
    assert runs.token_ids(spec.generate(prompts, runs.greedy(12), use_tqdm=False)) == plain_ids
    # images are refused, not dropped (the OpenAI server's 400 is tests/test_openai_server.py's)
    with pytest.raises(ValueError, match="this model reads text only"):
        plain.generate({**prompts[0], "multi_modal_data": {"image": "cat.png"}}, runs.greedy(2), use_tqdm=False)
    image = {"type": "image_url", "image_url": {"url": "cat.png"}}
    with pytest.raises(ValueError, match="this model reads text only"):
        plain.chat([{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}], runs.greedy(2))


# ---- tensor parallel ranks and pipeline stages over gloo -------------------------------------------------------------

# one rank of two: argv is its rank, the stages (1: tensor parallel), the rendezvous port, the result's folder and the
# model folders; it writes {folder: [its layers, the diff of its logits to one rank's, or None before the last stage]}
WORKER = WORKER_PRELUDE + textwrap.dedent("""

    result = {}
    for folder in folders:
        model = load_model(folder, tp, pp=pp)
        one = logits(load_model(folder))
        mine = [logits(model)]
        cpu_kernels.OWN_MIN_CONTEXT = 0  # the decode step attends one sequence at a time too (every rank runs it)
        mine.append(logits(model))
        cpu_kernels.OWN_MIN_CONTEXT = 1 << 30
        diff = None if mine[0] is None else max((m - one).abs().max().item() for m in mine)
        result[folder] = [list(model.model.stage), diff]
    del model  # gloo's threads end with the group only once nothing holds it
    gc.collect()
    dist.destroy_process_group()
    json.dump(result, open(f"{out}/{rank}.json", "w"))
""")


def _ranks(tmp_path: Path, folders: list[str], stages: int) -> list[dict]:
    """Two ranks over gloo: tensor parallel (``stages`` 1) or two pipeline stages of one rank each."""
    return run_ranks(tmp_path, WORKER, 2, stages, folders)


def test_tensor_parallel_ranks_and_pipeline_stages_match_one_rank(request, tmp_path, vl_folders):
    """TP 2 (each rank half the query and KV heads, half the MLP width and vocabulary; OLMo 3's q/k norms summed over
    the ranks; Qwen3-VL-MoE's experts, stored inputs first, split by width): every rank's logits equal one rank's;
    PP 2 (the layers split in two, OLMo 3's stage handing on its layer output and residual): the last stage's equal
    one rank's."""
    folders = {name: str(request.getfixturevalue(fixture)) for name, fixture in FIXTURES.items()}
    folders.update({f"{kind}-{layout}": str(vl_folders[kind, layout][0]) for kind, layout in
                    (("qwen2_5_vl", "nested"), ("qwen3_vl", "saved"), ("qwen3_vl_moe", "experts-inputs-first"))})
    for result in _ranks(tmp_path / "tp", list(folders.values()), 1):
        for name, folder in folders.items():
            layers, diff = result[folder]
            assert diff is not None and diff < TOL, (name, result[folder])
    first, last = _ranks(tmp_path / "pp", list(folders.values()), 2)
    for name, folder in folders.items():
        (first_layers, none), (last_layers, diff) = first[folder], last[folder]
        assert none is None and first_layers and last_layers and first_layers[-1] + 1 == last_layers[0], name
        assert diff < TOL, (name, diff)


# ---- the engine ----------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_engine_greedy_with_ngram_drafts_equals_plain_and_transformers(request, name):
    """``specray.LLM``'s greedy tokens equal transformers' ``generate`` token for token, and so do they with n-gram
    drafts verified (prefix caching on, the second run starting from cached blocks)."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    folder = request.getfixturevalue(FIXTURES[name])
    prompts = runs.PROMPTS[:4]
    plain = LLM(model=str(folder), max_model_len=256)
    plain_ids = runs.token_ids(plain.generate(prompts, runs.greedy(16), use_tqdm=False))
    runs.assert_transformers_generates(folder, plain.get_tokenizer(), prompts, plain_ids)
    spec = LLM(model=str(folder), max_model_len=256, speculative_config=NGRAM, enable_prefix_caching=True,
               block_size=4)
    assert runs.token_ids(spec.generate(prompts, runs.greedy(16), use_tqdm=False)) == plain_ids
    again = spec.generate(prompts, runs.greedy(16), use_tqdm=False)
    assert runs.token_ids(again) == plain_ids
    assert all(o.num_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > 4)
