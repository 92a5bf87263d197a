"""LoRA adapters (vLLM's multi-LoRA): our adapted projections against transformers with the adapter merged into
the weights (PEFT's merge_and_unload), every row of a mixed batch with its own adapter or none; the engine's
greedy output with an adapter equal to the merged model's, alone and in batches mixing adapters, with every kind
of drafter; adapters checked at admission (a bad one fails its request alone); at most max_loras adapters per step;
cached prefixes never shared across adapters."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from specray.lora import LoRAConfig, LoRARequest
from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import load_model
from specray.models.lora import LoRASlots
import specray_test_checkpoints as checkpoints  # tests/checkpoints.py (registered by conftest)

TOL = 1e-4
BLOCK = 4


def _hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_gemma3_dir", "tiny_qwen3_moe_dir",
                                     "tiny_llama4_dir", "tiny_deepseek_dir", "tiny_mixtral_dir", "tiny_phi3_dir",
                                     "tiny_gemma2_dir", "tiny_olmo2_dir", "tiny_glm4_moe_dir", "tiny_smollm3_dir",
                                     "tiny_olmo3_dir", "tiny_ernie4_5_dir", "tiny_seed_oss_dir", "tiny_glm4_dir",
                                     "tiny_arcee_dir", "tiny_exaone4_dir", "tiny_starcoder2_dir", "tiny_gemma_dir",
                                     "tiny_cohere_dir", "tiny_apertus_dir", "tiny_nemotron_dir",
                                     "tiny_granitemoeshared_dir", "tiny_stablelm_parallel_dir", "tiny_phi_dir",
                                     "tiny_gptj_dir", "tiny_opt_dir", "tiny_cohere2_moe_dir", "tiny_vaultgemma_dir",
                                     "tiny_jais2_dir", "tiny_cwm_dir", "tiny_youtu_dir", "tiny_helium_dir",
                                     "tiny_hyperclovax_dir", "tiny_axk1_dir", "tiny_kolibri1_dir", "tiny_afmoe_dir",
                                     "tiny_granite_swa_dir", "tiny_granitemoe_swa_dir", "tiny_mellum_dir",
                                     "tiny_laguna_dir", "tiny_flint_dir", "tiny_nanochat_dir", "tiny_beam_dir",
                                     "tiny_gpt_neox_dir", "tiny_falcon_dir", "tiny_falcon_7b_dir", "tiny_gpt2_dir",
                                     "tiny_bloom_dir", "tiny_falcon_rw_dir", "tiny_mpt_dir", "tiny_gpt_bigcode_dir",
                                     "tiny_gpt_bigcode_mha_dir", "tiny_dbrx_dir", "tiny_persimmon_dir"])
def test_adapted_logits_match_transformers_with_the_adapter_merged(fixture, request, tmp_path):
    """Three sequences in one forward: one per adapter (all seven projections at rank 4; q, v and down of the
    last layer only at rank 8 with rsLoRA) and one with none, a prefill and decodes over a paged cache; each row's
    logits equal transformers' on the merged weights (the base model's for the row without)."""
    base = request.getfixturevalue(fixture)
    config = json.loads((base / "config.json").read_text())
    layers = config.get("num_hidden_layers", config.get("n_layer", config.get("n_layers")))  # (GPT-J's, MPT's names)
    every, some, std = checkpoints.LORA_MODULES, ("q_proj", "v_proj", "down_proj"), 0.2
    if fixture in ("tiny_deepseek_dir", "tiny_youtu_dir", "tiny_axk1_dir"):  # MLA's projections but kv_b_proj
        every = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj")
        some = ("q_b_proj", "kv_a_proj_with_mqa", "down_proj")
        std = 0.1  # its fixture's small weights keep the absorbed attention's reassociation far below TOL
    if fixture == "tiny_phi3_dir":  # its checkpoint's fused projections, as PEFT adapts them
        every, some = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), ("qkv_proj", "down_proj")
    if fixture == "tiny_glm4_dir":  # its fused gate/up, as PEFT adapts it
        every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
    if fixture in ("tiny_arcee_dir", "tiny_apertus_dir", "tiny_nemotron_dir", "tiny_jais2_dir"):  # no gate
        every = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    if fixture == "tiny_nanochat_dir":  # no gate, its MLP's own names
        every, some = ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"), ("q_proj", "v_proj", "fc2")
    if fixture == "tiny_starcoder2_dir":  # its MLP's own names, no gate
        every, some = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"), ("q_proj", "v_proj", "c_proj")
    if fixture in ("tiny_gpt2_dir", "tiny_gpt_bigcode_dir", "tiny_gpt_bigcode_mha_dir"):  # q/k/v fused as c_attn
        every, some = ("c_attn", "c_proj", "c_fc"), ("c_attn", "c_proj")
    if fixture == "tiny_mpt_dir":  # q/k/v fused as Wqkv (thirds), its own names
        every, some = ("Wqkv", "out_proj", "up_proj", "down_proj"), ("Wqkv", "down_proj")
    if fixture == "tiny_dbrx_dir":  # the attention alone: q/k/v fused as Wqkv (grouped-query rows), out_proj
        every, some = ("Wqkv", "out_proj"), ("Wqkv",)
    if fixture in ("tiny_gpt_neox_dir", "tiny_falcon_dir", "tiny_falcon_7b_dir", "tiny_bloom_dir",
                   "tiny_falcon_rw_dir", "tiny_persimmon_dir"):  # q/k/v fused head by head (or KV head by KV head)
        every = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
        some = ("query_key_value", "dense_4h_to_h")
    if fixture in ("tiny_phi_dir", "tiny_gptj_dir", "tiny_opt_dir"):  # their own names (renamed to ours)
        out, up, down = {"tiny_phi_dir": ("dense", "fc1", "fc2"), "tiny_gptj_dir": ("out_proj", "fc_in", "fc_out"),
                         "tiny_opt_dir": ("out_proj", "fc1", "fc2")}[fixture]
        every, some = ("q_proj", "k_proj", "v_proj", out, up, down), ("q_proj", "v_proj", down)
    if fixture in ("tiny_granitemoeshared_dir", "tiny_granitemoe_swa_dir"):  # its shared MLP's fused input_linear
        every = ("q_proj", "k_proj", "v_proj", "o_proj", "input_linear", "output_linear")
        some = ("q_proj", "v_proj", "output_linear")
    first = checkpoints.write_lora(base, tmp_path / "first", rank=4, alpha=8, seed=1, modules=every, std=std)
    second = checkpoints.write_lora(base, tmp_path / "second", rank=8, alpha=4, seed=2, use_rslora=True,
                                    modules=some, layers=(layers - 1,), std=std)
    refs = [_hf(checkpoints.merge_lora(base, a, tmp_path / f"merged{i}")) for i, a in enumerate((first, second))]
    refs.append(_hf(base))
    ours = load_model(base)
    slots = LoRASlots(ours, LoRAConfig(max_loras=2, max_lora_rank=8), torch.device("cpu"))
    adapters = [LoRARequest("first", 1, str(first)), LoRARequest("second", 2, str(second)), None]
    vocab = ours.config.vocab_size
    prompts = [_tokens(n, seed, vocab) for n, seed in ((9, 0), (14, 1), (6, 2))]
    cache_blocks = iter(range(64)[::-1])  # reversed: block tables not in order
    allocate_kv_cache(ours, 64, BLOCK)
    tables = [[next(cache_blocks) for _ in range(40 // BLOCK)] for _ in prompts]
    ids = [list(p) for p in prompts]
    with torch.no_grad():
        for step in range(3):
            chunks = ([(p, 0, t) for p, t in zip(prompts, tables)] if step == 0 else
                      [(s[-1:], len(s) - 1, t) for s, t in zip(ids, tables)])
            per_seq = slots.slots_for(adapters)
            ours_slots = [z for z, c in zip(per_seq, chunks) for _ in c[0]]
            slots.context.set_token_slots(torch.tensor(ours_slots))
            meta = build_attention_metadata([len(c[0]) for c in chunks], [c[1] for c in chunks],
                                            [c[2] for c in chunks], BLOCK, "cpu")
            hidden = ours(torch.tensor([t for c in chunks for t in c[0]]), meta)
            logits = ours.compute_logits(hidden).split([len(c[0]) for c in chunks])
            for i, (ref, got) in enumerate(zip(refs, logits)):
                want = ref(torch.tensor([ids[i]])).logits[0, -len(chunks[i][0]):].float()
                diff = (got - want).abs().max().item()
                assert diff < TOL, (fixture, step, i, diff)
                if step == 0 and i < 2:  # the adapter matters: the base model's logits differ
                    assert (got - refs[2](torch.tensor([ids[i]])).logits[0].float()).abs().max() > 1e-2
            for s, row in zip(ids, logits):
                s.append(int(row[-1].argmax()))


def _adapted_prefill(model, adapter, ids: list[int]) -> torch.Tensor:
    """``model``'s logits [len(ids), V] of one prefill with ``adapter`` applied to every token (one LoRA slot)."""
    slots = LoRASlots(model, LoRAConfig(max_loras=1, max_lora_rank=4), torch.device("cpu"))
    slots.context.set_token_slots(torch.tensor(slots.slots_for([LoRARequest("a", 1, str(adapter))]) * len(ids)))
    allocate_kv_cache(model, 8, BLOCK)
    meta = build_attention_metadata([len(ids)], [0], [list(range(8))[::-1]], BLOCK, "cpu")
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), meta))


def test_an_adapter_on_a_base_kept_in_4_bits(tiny_llama_dir, tmp_path, monkeypatch):
    """An adapter over an AWQ release whose linears stay in 4 bits (a QLoRA-style adapter on a quantized base): the
    adapted logits equal transformers' with the adapter merged into the dequantized weights."""
    from specray.models import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "INT4_WEIGHTS", True)  # as on a GPU (a CPU dequantizes them by default)
    quant, ref = checkpoints.write_int(tiny_llama_dir, tmp_path / "q", "awq4-g32")
    adapter = checkpoints.write_lora(ref, tmp_path / "adapter", rank=4, alpha=8, seed=1)
    merged = _hf(checkpoints.merge_lora(ref, adapter, tmp_path / "merged"))
    ours = load_model(quant)
    assert all(m.kept is not None for name, m in ours.named_modules() if name.endswith("proj"))
    ids = _tokens(21, 3, ours.config.vocab_size)
    got = _adapted_prefill(ours, adapter, ids)
    with torch.no_grad():
        want = merged(torch.tensor([ids])).logits[0].float()
    assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_an_adapter_on_a_base_kept_in_8_bits(tiny_llama_dir, tmp_path, monkeypatch, kind):
    """An adapter over a W8A8 release whose linears stay in 8 bits (FP8 or INT8): the base's matmuls round each row
    of activations to 8 bits, the adapter's take them unrounded (as vLLM's LoRA over a quantized base does): the
    logits equal those of the dequantized release whose projections round their base matmul's input alone, and
    differ from those of a reference that rounds the adapter's input too."""
    checkpoints.skip_without_cpu_fp8(kind)
    from specray.models import cpu_kernels
    from specray.models.layers import LinearBase
    from specray.models.w8a8 import FP8, INT8, quantize_rows

    fmt = {"fp8": FP8, "int8": INT8}[kind]
    monkeypatch.setattr(cpu_kernels, f"{fmt.name}_WEIGHTS", True)  # as on a GPU (a CPU dequantizes them by default)
    write = checkpoints.write_int8 if kind == "int8" else lambda src, dst: checkpoints.write_fp8(src, dst,
                                                                                                strategy="channel")
    quant, ref = write(tiny_llama_dir, tmp_path / "q")
    adapter = checkpoints.write_lora(ref, tmp_path / "adapter", rank=4, alpha=8, seed=1)
    ours = load_model(quant)
    assert all(m.kept is not None for name, m in ours.named_modules() if name.endswith("proj"))
    ids = _tokens(21, 3, ours.config.vocab_size)
    got = _adapted_prefill(ours, adapter, ids)

    class RoundedBase:  # the base matmul over 8-bit-rounded rows of x, the dense dequantized weight
        def __init__(self, weight):
            self.weight = weight

        def matmul(self, x):
            xq, scale = quantize_rows(x, fmt)
            return (xq.float() * scale).to(x.dtype) @ self.weight.t()

    def reference(round_adapter_input: bool):
        model = load_model(ref, pack=False)
        for name, m in model.named_modules():
            if name.endswith("proj") and isinstance(m, LinearBase):
                m.kept = RoundedBase(m.weight)
                if round_adapter_input:
                    m.register_forward_pre_hook(lambda mod, args: ((lambda q: (q[0].float() * q[1]).to(
                        args[0].dtype))(quantize_rows(args[0], fmt)), *args[1:]))
        return _adapted_prefill(model, adapter, ids)

    want, rounded_both = reference(False), reference(True)
    assert (got - want).abs().max() < 0.1 * (got - rounded_both).abs().max()


def _adapter_of(base: Path, dst: Path, keep, seed: int = 3, rank: int = 4, std: float = 0.2) -> dict:
    """A PEFT adapter (rank 4, alpha 8) of every weight of ``base``'s checkpoint that ``keep(name)`` picks, written
    to ``dst`` (for names checkpoints.write_lora does not pick: a vision tower's, a linear-attention layer's);
    returns its tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(base / "model.safetensors"), "pt") as f:
        shapes = {k[: -len(".weight")]: f.get_slice(k).get_shape() for k in sorted(f.keys()) if keep(k)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out_features, in_features) in shapes.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) * std
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * std
    checkpoints.write_lora(base, dst, rank=rank, alpha=8, modules=())  # its config; the tensors follow
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return tensors


def _qwen2_5_vl_release(folder: Path, nested: bool) -> Path:
    """A tiny Qwen2.5-VL release (random weights): its text model a Qwen2 at ``model.`` beside the vision tower's
    ``visual.`` as transformers saves it, or (``nested``) under ``model.language_model.`` beside ``model.visual.``."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
                pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[0])
    torch.manual_seed(7)
    Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision)).save_pretrained(folder)
    if nested:
        file = str(folder / "model.safetensors")
        save_file({_nested(n): t for n, t in load_file(file).items()}, file, metadata={"format": "pt"})
    return folder


def _nested(name: str) -> str:
    """A Qwen2.5-VL tensor's (or its adapter's module's) name in the nested layout."""
    prefix = "base_model.model." if name.startswith("base_model.model.") else ""
    rest = name[len(prefix):]
    return prefix + ("model." + rest if rest.startswith("visual.") else
                     rest.replace("model.", "model.language_model.", 1) if rest.startswith("model.") else rest)


@pytest.mark.parametrize("nested", [False, True], ids=["text-at-model", "text-at-language_model"])
def test_a_qwen_vl_adapter_adapts_its_text_model_and_leaves_the_vision_tower_out(nested, tmp_path):
    """A PEFT adapter of a Qwen2.5-VL release names the text model's projections under either layout of the release
    (``model.layers...`` or ``model.language_model.layers...``) and here adapts the vision tower too (its attention
    and an MLP whose ``gate_proj`` shares a text projection's name): admitted against the text model's shapes, the
    vision tower's matrices left out (text never runs them), and the adapted logits equal transformers' whole
    multimodal model with the adapter merged into its weights (its vision tower's too)."""
    from safetensors.torch import save_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    from specray.lora import read_adapter
    from specray.models.lora import adapter_shapes

    base = _qwen2_5_vl_release(tmp_path / "base", nested=False)
    adapter = tmp_path / "adapter"
    tensors = _adapter_of(base, adapter, lambda k: k.endswith("proj.weight") and k.startswith("model.layers.") or
                          k in ("visual.blocks.0.attn.qkv.weight", "visual.blocks.0.mlp.gate_proj.weight"))
    text = sorted({k.split(".lora_")[0][len("base_model.model."):] for k in tensors if ".layers." in k})
    assert len(tensors) == 2 * 16 and len(text) == 14
    merged = checkpoints.merge_lora(base, adapter, tmp_path / "merged")
    if nested:  # the release and its adapter in the other layout; the reference stays the same model
        base = _qwen2_5_vl_release(tmp_path / "nested", nested=True)
        save_file({_nested(k): t for k, t in tensors.items()}, str(adapter / "adapter_model.safetensors"))
    ours = load_model(base)
    info = read_adapter(str(adapter), adapter_shapes(ours), 8)
    assert sorted(info.ranks) == text
    ids = _tokens(13, 4, ours.config.vocab_size)
    got = _adapted_prefill(ours, adapter, ids)
    with torch.no_grad():
        full = Qwen2_5_VLForConditionalGeneration.from_pretrained(merged, dtype=torch.float32).eval()
        want = full(input_ids=torch.tensor([ids])).logits[0].float()
        plain = Qwen2_5_VLForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
        assert (want - plain(input_ids=torch.tensor([ids])).logits[0].float()).abs().max() > 1e-2
    assert (got - want).abs().max() < TOL


# ---------------------------------------------------------------------------------------------- hybrid models

import specray_test_hybrid_models as hybrid  # tests/hybrid_models.py (registered by conftest)

# what an adapter of a hybrid model adapts here: every projection specray applies LoRA to (PEFT's "all-linear" but
# the routers, the shared experts' gate and the experts)
HYBRID_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                  "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "in_proj_qkvz", "in_proj_ba")


def _hybrid_adapter(base: Path, dst: Path, seed: int = 3) -> dict:
    # std 0.1: the tiny hybrids' doubled embeddings make large logits, whose float32 rounding 0.2 brings to TOL
    return _adapter_of(base, dst, lambda k: k.startswith("model.layers.") and ".experts." not in k and
                       k.endswith(".weight") and k.split(".")[-2] in HYBRID_MODULES, seed=seed, std=0.1)


def _check_adapted_hybrid(base: Path, adapter: Path, merged_dir: Path) -> None:
    """A hybrid model with ``adapter`` beside a sequence without it: a prefill, verify chunks whose drafts stay
    pending, and the next chunks replaying the accepted ones (conv inputs and gates computed under the adapter); each
    row's logits equal transformers' with the adapter merged (the base model's for the other sequence). The adapter
    passes admission first (its modules named and shaped as the model's)."""
    from specray.engine.builder import adapter_checker

    merged = _hf(checkpoints.merge_lora(base, adapter, merged_dir))
    plain = _hf(base)
    config = LoRAConfig(max_loras=1, max_lora_rank=4)
    model = load_model(base)
    adapter_checker(config, model.config).check(LoRARequest("h", 1, str(adapter)))
    slots = LoRASlots(model, config, torch.device("cpu"))
    (lora_slot,) = slots.slots_for([LoRARequest("h", 1, str(adapter))])
    run = hybrid.Stepper(model)
    a, b = hybrid.tokens(30, 1), hybrid.tokens(12, 2)
    ref_a, ref_b = hybrid.hf_logits(merged, a), hybrid.hf_logits(plain, b)
    assert (ref_a - hybrid.hf_logits(plain, a)).abs().max() > 1e-2  # the adapter matters

    def step(chunks):
        slots.context.set_token_slots(torch.tensor([lora_slot if seq == 0 else 0 for seq, ids, _, _ in chunks
                                                    for _ in ids]))
        return run.step(chunks)

    out = step([(0, a[:10], 0, 0), (1, b[:6], 0, 0)])
    assert max((out[0] - ref_a[:10]).abs().max(), (out[1] - ref_b[:6]).abs().max()) < TOL
    pos, pos_b = 10, 6
    for accepted in (1, 3, 0, 2):  # last token + 3 drafts, `accepted` of them right
        drafts = a[pos + 1: pos + 1 + accepted] + hybrid.tokens(3 - accepted, 100 + pos)
        out = step([(0, [a[pos]] + drafts, pos, 3), (1, [b[pos_b]], pos_b, 0)])
        assert (out[0][: accepted + 1] - ref_a[pos: pos + accepted + 1]).abs().max() < TOL, accepted
        assert (out[1] - ref_b[pos_b: pos_b + 1]).abs().max() < TOL
        pos, pos_b = pos + accepted + 1, pos_b + 1
    out = step([(0, a[pos: pos + 2], pos, 0)])  # plain tokens after the last replay
    assert (out[0] - ref_a[pos: pos + 2]).abs().max() < TOL


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_hybrid_adapted_logits_with_replayed_drafts(arch, tmp_path):
    """Qwen3.5 (dense), Qwen3.5-MoE (a shared expert) and Qwen3-Next (its checkpoint's fused in_proj_qkvz /
    in_proj_ba: an adapter of them has its B split as the weights are): an adapter of the gated attention's q/k/v/o
    (q_proj's rows: each head's query and output gate), the linear-attention layers' projections and out_proj, and
    the MLPs (_check_adapted_hybrid)."""
    base = hybrid.save(tmp_path / "base", arch, seed=5)
    tensors = _hybrid_adapter(base, tmp_path / "adapter")
    split, fused = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"}, {"in_proj_qkvz", "in_proj_ba"}
    adapted = set(HYBRID_MODULES) - (split if arch == "qwen3_next" else fused)  # the checkpoint's own names
    assert {k.split(".lora_")[0].rsplit(".", 1)[1] for k in tensors} == adapted
    _check_adapted_hybrid(base, tmp_path / "adapter", tmp_path / "merged")


# the checkpoint leaves a Mamba-2 hybrid's (and LFM2's) adapter adapts: attention, MLPs (LFM2's w1 / w3 / w2), the
# recurrent layers' in_proj and out_proj (not the experts, routers or conv)
RECURRENT_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "in_proj", "gate_proj", "up_proj", "down_proj",
                    "w1", "w2", "w3", "input_linear", "output_linear",  # (Granite's shared MLP: fused gate | up)
                    "qkv_proj", "output_gate")  # (MiniMax's lightning layers)


@pytest.mark.parametrize("arch", ["bamba", "granite", "granite_dense", "nemotron_h_moe", "falcon_h1", "lfm2", "lfm3",
                                  "mamba2", "jamba", "falcon_mamba", "minimax"])
def test_mamba_hybrid_adapted_logits_with_replayed_drafts(arch, tmp_path):
    """(_check_adapted_hybrid) An adapter of every projection specray adapts in Bamba, Granite 4.0's hybrids (the
    shared MLP's fused ``input_linear``: its B split into the gate and up rows, renamed), Nemotron-H (its ``backbone.``
    / ``mixer.`` names renamed by kind, shared experts too), Falcon-H1 (each B scaled by the multiplier folded into
    its weight), LFM2 and LFM3 (``out_proj`` / ``w1``.. names), MiniMax (its lightning layers' ``qkv_proj``,
    ``out_proj``, ``output_gate``), Mamba-2, Jamba and Falcon-Mamba (Mamba-1's in_proj and
    out_proj)."""
    base = hybrid.save(tmp_path / "base", arch, seed=5)
    _adapter_of(base, tmp_path / "adapter", lambda k: ".layers." in k and ".experts." not in k and k.endswith(
        ".weight") and k.split(".")[-2] in RECURRENT_LEAVES and ".block_sparse_moe." not in k, std=0.1)
    _check_adapted_hybrid(base, tmp_path / "adapter", tmp_path / "merged")


def test_hybrid_engine_with_an_adapter_and_ngram_drafts_equals_the_merged_model(tmp_path):
    """The engine over a Qwen3.5 with enable_lora: requests with the adapter and without, in one batch, with n-gram
    drafts (some accepted, some rejected: replays under the adapter) give the merged model's and the base model's
    plain greedy tokens; an adapter of the linear layers' conv1d is refused at admission, naming it, and the engine
    serves on."""
    from safetensors.torch import save_file

    from specray import LLM

    base = hybrid.save(tmp_path / "base", "qwen3_5", seed=0)
    adapter = tmp_path / "adapter"
    tensors = _hybrid_adapter(base, adapter, seed=4)
    merged = checkpoints.merge_lora(base, adapter, tmp_path / "merged")
    prompts = [{"prompt_token_ids": ids} for ids in hybrid.PROMPT_IDS]
    expected = []
    for folder in (merged, base):
        with LLM(model=str(folder), max_model_len=128) as llm:
            expected.append(runs.token_ids(llm.generate(prompts, hybrid.greedy(), use_tqdm=False)))
    assert expected[0] != expected[1]
    conv = tmp_path / "conv"
    conv.mkdir()
    shutil.copy(adapter / "adapter_config.json", conv)
    save_file({**tensors, "base_model.model.model.layers.0.linear_attn.conv1d.lora_A.weight": torch.zeros(4, 1, 4),
               "base_model.model.model.layers.0.linear_attn.conv1d.lora_B.weight": torch.zeros(80, 4, 1)},
              str(conv / "adapter_model.safetensors"))
    lora = LoRARequest("h", 1, str(adapter))
    which = [lora if i % 2 == 0 else None for i in range(len(prompts))]
    want = [expected[0 if r is not None else 1][i] for i, r in enumerate(which)]
    with LLM(model=str(base), max_model_len=128, enable_lora=True, max_lora_rank=4,
             speculative_config=hybrid.NGRAM) as llm:
        assert runs.token_ids(llm.generate(prompts, hybrid.greedy(), use_tqdm=False, lora_request=which)) == want
        stats = llm.spec_stats
        assert 0 < stats.accepted_tokens < stats.draft_tokens, stats
        with pytest.raises(ValueError, match="conv1d', which specray does not apply LoRA to"):
            llm.generate(prompts[:1], hybrid.greedy(), use_tqdm=False, lora_request=LoRARequest("c", 2, str(conv)))
        outs = llm.generate(prompts[:1], hybrid.greedy(), use_tqdm=False, lora_request=lora)
        assert runs.token_ids(outs) == expected[0][:1]


def test_qwen3_next_fused_linear_projections_are_admitted_with_their_shapes(tmp_path):
    """Qwen3-Next's checkpoint fuses its linear layers' projections per key-head group (in_proj_qkvz, in_proj_ba),
    which specray splits as they load: an adapter of them is admitted with their fused shapes (its B split as the
    weights are when it loads: the logits test above), a B of another width refused, naming the module."""
    from specray.lora import read_adapter
    from specray.models.lora import adapter_shapes

    model, hf = hybrid.ours(tmp_path / "base", "qwen3_next")
    shapes = adapter_shapes(model)
    fused = tmp_path / "fused"
    tensors = _adapter_of(tmp_path / "base", fused, lambda k: k.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")))
    info = read_adapter(str(fused), shapes, 4)
    assert {m.rsplit(".", 1)[1] for m in info.ranks} == {"in_proj_qkvz", "in_proj_ba"}
    qkvz = next(k for k in tensors if k.endswith("in_proj_qkvz.lora_B.weight"))
    assert tensors[qkvz].shape[0] == shapes[qkvz.split("base_model.model.")[1].split(".lora_B")[0]][0]
    from safetensors.torch import save_file

    save_file({**tensors, qkvz: tensors[qkvz][:-1]}, str(fused / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"in_proj_qkvz.lora_B has shape .* output features"):
        read_adapter(str(fused), shapes, 4)


_Q, _V = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"


def _written(folder: Path, config: dict, ranks: dict[str, int], extra: dict | None = None) -> str:
    """An adapter folder of ``config`` (over r=4, alpha 8, target_modules q and v) whose tensors adapt each module
    of ``ranks`` (as PEFT names them under ``base_model.model.``) at its rank, with ``extra`` tensors (name ->
    shape)."""
    from safetensors.torch import save_file

    folder.mkdir()
    tensors = {f"base_model.model.{k}": torch.zeros(shape) for k, shape in (extra or {}).items()}
    for module, rank in ranks.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.zeros(rank, 8)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(8, rank)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **config}
    (folder / "adapter_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return str(folder)


@pytest.mark.parametrize("config, ranks, extra, refusal", [
    ({}, {_Q: 8}, None, r"q_proj's LoRA matrices have rank 8, but its adapter_config.json gives it r=4"),
    ({"r": None}, {_Q: 8}, None, "adapter_config.json has no r"),
    ({"rank_pattern": {"v_proj": 8}}, {_Q: 4, _V: 8}, None, None),  # PEFT's per-module ranks
    ({"rank_pattern": {"v_proj": 8}}, {_Q: 8, _V: 8}, None, "q_proj's .* rank 8, .* r=4"),
    ({"target_modules": ["q_proj"]}, {_Q: 4, _V: 4}, None, r"of 'model.layers.0.self_attn.v_proj', which its "
                                                           r"target_modules=\['q_proj'\] does not name"),
    ({"target_modules": r".*\.q_proj"}, {_Q: 4, _V: 4}, None, "v_proj', which its target_modules"),
    ({"target_modules": r".*\.(q_proj|v_proj)"}, {_Q: 4, _V: 4}, None, None),
    ({"target_modules": [_Q, "v_proj"]}, {_Q: 4, _V: 4}, None, None),  # a whole name, or its last parts
    ({"target_modules": "all-linear"}, {_Q: 4, _V: 4}, None, None),
    ({"target_modules": "(q_proj"}, {_Q: 4}, None, "target_modules holds '\\(q_proj', not a regular expression"),
    ({}, {_Q: 4}, {f"{_Q}.lora_B.bias": [8]}, r"lora_B.bias' is a LoRA bias; trained LoRA biases \(lora_bias\)"),
    ({"lora_bias": True}, {_Q: 4}, None, r"lora_bias=True; trained LoRA biases \(lora_bias\) are not supported"),
], ids=["r-below-the-rank", "no-r", "rank_pattern", "rank_pattern-r-below", "outside-the-list", "outside-the-regex",
        "in-the-regex", "full-name", "all-linear", "bad-regex", "bias-tensor", "lora_bias"])
def test_an_adapter_config_must_describe_its_tensors(config, ranks, extra, refusal, tmp_path):
    """PEFT's config says which modules an adapter adapts (target_modules: names or their last parts, a regular
    expression of the whole name, all-linear) at which rank (r, rank_pattern's per-module r): an adapter whose
    tensors it does not describe is refused (scaled by alpha / r, a rank other than r would change its outputs),
    as one with trained LoRA biases is."""
    from specray.lora import read_adapter

    path = _written(tmp_path / "a", config, ranks, extra)
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            read_adapter(path, None, 16)
        return
    info = read_adapter(path, None, 16)
    assert info.ranks == ranks


def test_an_adapter_s_tensors_without_prefix_or_with_their_adapter_s_name_are_its_modules(tmp_path):
    """PEFT's tensor names without ``base_model.model.`` or with the adapter's name (``lora_A.default.weight``)
    name the same modules, which target_modules covers as it does the plain names."""
    from safetensors.torch import save_file

    from specray.lora import read_adapter

    path = _written(tmp_path / "a", {"target_modules": ["q_proj"]}, {})
    save_file({f"{_Q}.lora_A.default.weight": torch.zeros(4, 8), f"{_Q}.lora_B.default.weight": torch.zeros(8, 4)},
              str(tmp_path / "a" / "adapter_model.safetensors"))
    assert read_adapter(path, None, 16).ranks == {_Q: 4}


# ---------------------------------------------------------------------------------------------- the engine

import specray_test_engine_runs as runs  # tests/engine_runs.py (registered by conftest)
import specray_test_draft_heads as draft_heads  # tests/draft_heads.py

from specray import LLM


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """Two adapters of the tiny llama (every projection at rank 4; q, v and down at rank 8 with rsLoRA) and the
    greedy token ids of every prompt under each (the merged model's) and under none (the base model's)."""
    root = tmp_path_factory.mktemp("lora")
    first = checkpoints.write_lora(tiny_llama_dir, root / "first", rank=4, alpha=8, seed=1)
    second = checkpoints.write_lora(tiny_llama_dir, root / "second", rank=8, alpha=4, seed=2, use_rslora=True,
                                    modules=("q_proj", "v_proj", "down_proj"))
    requests = [LoRARequest("first", 1, str(first)), LoRARequest("second", 2, str(second)), None]
    expected = {}
    for i, folder in enumerate((checkpoints.merge_lora(tiny_llama_dir, first, root / "merged_first"),
                                checkpoints.merge_lora(tiny_llama_dir, second, root / "merged_second"),
                                tiny_llama_dir)):
        with LLM(model=str(folder), max_model_len=256) as llm:
            expected[i] = runs.token_ids(llm.generate(runs.PROMPTS, runs.greedy(), use_tqdm=False))
    for i in (0, 1):
        assert expected[i] != expected[2]  # each adapter changes what the model says
    return requests, expected


def _mixed(adapters):
    """Each prompt's adapter (first, second, none, first, ...) and its expected greedy tokens."""
    requests, expected = adapters
    which = [i % 3 for i in range(len(runs.PROMPTS))]
    return [requests[w] for w in which], [expected[w][p] for p, w in enumerate(which)]


@pytest.mark.parametrize("kind", ("plain", *draft_heads.DRAFTER_KINDS))
def test_greedy_output_with_adapters_equals_the_merged_models(kind, adapters, tiny_llama_dir, tiny_draft_dir,
                                                                tmp_path):
    """One batch mixing both adapters and the base model, with every kind of drafter (host lookups, a draft model
    that knows no adapter, a head that reads the adapted target's hidden states): each request's greedy tokens equal
    its own model's (the adapter merged into the weights), at batch 1 for the plain engine too."""
    config = None if kind == "plain" else draft_heads.speculative_config(kind, tiny_llama_dir, tiny_draft_dir, tmp_path)
    lora, expected = _mixed(adapters)
    with LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=config, enable_lora=True,
             max_loras=2, max_lora_rank=8) as llm:
        outs = llm.generate(runs.PROMPTS, runs.greedy(), use_tqdm=False, lora_request=lora)
        assert runs.token_ids(outs) == expected
        if kind == "plain":
            alone = [llm.generate([p], runs.greedy(), use_tqdm=False, lora_request=r)[0].outputs[0].token_ids
                     for p, r in zip(runs.PROMPTS, lora)]
            assert alone == expected


def test_adapters_of_a_multimodal_release_serve_its_text_model(adapters, tiny_llama_dir, tmp_path):
    """An adapter trained on a multimodal release (Gemma 3's or Llama-4's ...ForConditionalGeneration) names the text
    model's modules under its language model (``language_model.model.layers...``, or transformers' newer
    ``model.language_model.layers...``) and may adapt the vision tower and projector too: its text modules apply to
    the text model (the same outputs as the adapter under the text model's own names), the other towers' matrices
    are left out (text never runs them)."""
    from safetensors.torch import load_file, save_file

    requests, expected = adapters
    renamed = []
    for i, prefix in enumerate(("language_model.model.", "model.language_model.")):
        folder = tmp_path / f"mm{i}"
        shutil.copytree(requests[0].lora_path, folder)
        state = load_file(str(folder / "adapter_model.safetensors"))
        state = {k.replace("base_model.model.model.", f"base_model.model.{prefix}"): v for k, v in state.items()}
        for tower in ("vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
                      "model.multi_modal_projector.mm_input_projection"):
            state[f"base_model.model.{tower}.lora_A.weight"] = torch.ones(4, 7)
            state[f"base_model.model.{tower}.lora_B.weight"] = torch.ones(5, 4)
        save_file(state, str(folder / "adapter_model.safetensors"))
        renamed.append(LoRARequest(f"mm{i}", 10 + i, str(folder)))
    with LLM(model=str(tiny_llama_dir), max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        for request in renamed:
            outs = llm.generate(runs.PROMPTS, runs.greedy(), use_tqdm=False, lora_request=request)
            assert runs.token_ids(outs) == expected[0]


def test_one_adapter_slot_serves_several_adapters_in_turn(adapters, tiny_llama_dir):
    """max_loras=1: requests of the other adapter wait while one adapter's run (the base model's requests join any
    step), the slot is reloaded between them, and every output equals its own model's; with prefix caching on,
    the same prompt under another adapter never starts from the first one's cached blocks."""
    lora, expected = _mixed(adapters)
    with LLM(model=str(tiny_llama_dir), max_model_len=256, enable_lora=True, max_loras=1, max_lora_rank=8,
             enable_prefix_caching=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        for _ in range(2):  # the second round finds every prompt's blocks cached, under its own adapter only
            assert runs.token_ids(llm.generate(runs.PROMPTS, runs.greedy(), use_tqdm=False,
                                               lora_request=lora)) == expected
        requests, _ = adapters
        same = [requests[0], requests[1], None]
        outs = llm.generate([runs.PROMPTS[3]] * 3, runs.greedy(), use_tqdm=False, lora_request=same)
        assert runs.token_ids(outs) == [adapters[1][i][3] for i in range(3)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_adapted_steps_from_graphs_equal_eager_steps(adapters, tiny_llama_dir, async_scheduling):
    """enforce_eager=False: decode and verify steps run on the graphs' static inputs (on CPU without capture), the
    rows' adapter slots among them, padding rows in no adapter's slot: the same outputs; with async scheduling (the
    next step planned while this one computes) too."""
    lora, expected = _mixed(adapters)
    with LLM(model=str(tiny_llama_dir), max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8,
             enforce_eager=False, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
             async_scheduling=async_scheduling) as llm:
        assert runs.token_ids(llm.generate(runs.PROMPTS, runs.greedy(), use_tqdm=False, lora_request=lora)) == expected


def test_bad_adapters_are_refused_at_admission(adapters, tiny_llama_dir, make_tiny_model, tmp_path):
    """What cannot serve is a ValueError naming the fix, raised before anything runs, and the engine serves on."""
    requests, expected = adapters
    narrower = make_tiny_model(tmp_path / "narrower", "llama", hidden_size=32, intermediate_size=64,
                               num_attention_heads=2, num_key_value_heads=1)
    foreign = checkpoints.write_lora(narrower, tmp_path / "foreign")
    pickled, foreign_bin = _as_bin(Path(requests[0].lora_path), tmp_path / "pickled"), _as_bin(foreign, tmp_path / "fb")
    dora = checkpoints.write_lora(tiny_llama_dir, tmp_path / "dora", config_extra={"use_dora": True})
    big = checkpoints.write_lora(tiny_llama_dir, tmp_path / "big", rank=32)
    head = checkpoints.write_lora(tiny_llama_dir, tmp_path / "head", modules=("q_proj",))
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(head / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    save_file(tensors, str(head / "adapter_model.safetensors"))
    # a header that reads but data cut short, a NaN (it would reach the step's other rows and the KV cache), ints
    cut, nan, ints = (Path(shutil.copytree(requests[0].lora_path, tmp_path / name)) for name in ("cut", "nan", "ints"))
    weights = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(weights[: len(weights) - 64])
    tensors = load_file(str(nan / "adapter_model.safetensors"))
    save_file({k: v if i else v * float("nan") for i, (k, v) in enumerate(tensors.items())},
              str(nan / "adapter_model.safetensors"))
    save_file({k: v.to(torch.int32) for k, v in tensors.items()}, str(ints / "adapter_model.safetensors"))
    deeper = Path(shutil.copytree(requests[0].lora_path, tmp_path / "deeper"))  # a layer past the model's last
    save_file({k.replace(".layers.1.", ".layers.7."): v for k, v in tensors.items()},
              str(deeper / "adapter_model.safetensors"))
    with LLM(model=str(tiny_llama_dir), max_model_len=256) as llm:
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.generate(["Hello"], runs.greedy(), use_tqdm=False, lora_request=requests[0])
    # an adapter that cannot be read is named by the request's name for it (a server's "model")
    cases = [(LoRARequest("none", 5, str(tmp_path / "missing")), "^lora_request='none': .*adapter_config.json"),
             (LoRARequest("dora", 6, str(dora)), "DoRA"),
             (LoRARequest("big", 7, str(big)), "max_lora_rank >= 32"),
             (LoRARequest("head", 8, str(head)), "lm_head"),
             (LoRARequest("foreign", 9, str(foreign)), "features: is the adapter for another base model"),
             (LoRARequest("foreign.bin", 10, str(foreign_bin)), "features: is the adapter for another base model"),
             (LoRARequest("cut", 12, str(cut)), "cannot be read whole"),
             (LoRARequest("nan", 13, str(nan)), "NaN or infinite values"),
             (LoRARequest("ints", 14, str(ints)), "dtype torch.int32"),
             (LoRARequest("deeper", 15, str(deeper)), "layers.7.mlp.down_proj', but this model's decoder layers are "
                                                        "model.layers.0 to model.layers.1: is the adapter for another"),
             (LoRARequest("again", 1, str(big)), "already names")]
    with LLM(model=str(tiny_llama_dir), max_model_len=256, enable_lora=True, max_lora_rank=8) as llm:
        llm.generate(["Hello"], runs.greedy(), use_tqdm=False, lora_request=requests[0])
        for bad, match in cases:
            with pytest.raises(ValueError, match=match):
                llm.generate(runs.PROMPTS[:2], runs.greedy(), use_tqdm=False, lora_request=[requests[0], bad])
        with pytest.raises(ValueError, match="one LoRARequest"):
            llm.generate(runs.PROMPTS[:2], runs.greedy(), use_tqdm=False, lora_request=[requests[0]])
        outs = llm.generate(runs.PROMPTS[:1], runs.greedy(), use_tqdm=False, lora_request=requests[0])
        assert runs.token_ids(outs) == [expected[0][0]]
        outs = llm.generate(runs.PROMPTS[:1], runs.greedy(), use_tqdm=False,  # the same adapter, pickled (.bin)
                            lora_request=LoRARequest("pickled", 11, str(pickled)))
        assert runs.token_ids(outs) == [expected[0][0]]
        assert not llm.engine.scheduler.has_unfinished_requests()
        assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.scheduler.config.num_blocks


def _as_bin(adapter: Path, dst: Path) -> Path:
    """``adapter`` with its tensors pickled (adapter_model.bin, PEFT's older layout)."""
    import shutil

    from safetensors.torch import load_file

    dst.mkdir(parents=True)
    shutil.copy(adapter / "adapter_config.json", dst)
    torch.save(load_file(str(adapter / "adapter_model.safetensors")), dst / "adapter_model.bin")
    return dst


def test_deepseek_adapters_of_its_latent_weights_are_refused_by_name(tiny_deepseek_dir, tmp_path):
    """DeepSeek-V3 reads kv_b_proj's weight as W_UK and W_UV (never applied as a linear): an adapter of it is refused
    at admission, naming it, while one of its other projections serves (greedy output of the merged model)."""
    every = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj")
    good = checkpoints.write_lora(tiny_deepseek_dir, tmp_path / "good", modules=every, std=0.1)
    latent = checkpoints.write_lora(tiny_deepseek_dir, tmp_path / "latent", modules=("kv_b_proj",), std=0.1)
    with LLM(model=str(checkpoints.merge_lora(tiny_deepseek_dir, good, tmp_path / "merged")), max_model_len=128) as llm:
        want = runs.token_ids(llm.generate(runs.PROMPTS[:3], runs.greedy(), use_tqdm=False))
    with LLM(model=str(tiny_deepseek_dir), max_model_len=128, enable_lora=True) as llm:
        got = llm.generate(runs.PROMPTS[:3], runs.greedy(), use_tqdm=False, lora_request=LoRARequest("g", 1, str(good)))
        assert runs.token_ids(got) == want
        with pytest.raises(ValueError, match="kv_b_proj', which specray does not apply LoRA to"):
            llm.generate(["Hello"], runs.greedy(), use_tqdm=False, lora_request=LoRARequest("l", 2, str(latent)))
    with pytest.raises(ValueError, match="max_loras"):
        LLM(model=str(tiny_deepseek_dir), max_model_len=128, enable_lora=True, max_loras=0)


# ---------------------------------------------------------------------------------------------- the server

def _http(url: str, body: dict | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class _Recording:
    """An in-process OpenAI app over ``llm``'s engine whose client records what each request brought the engine
    (its adapter) and the tokens it got."""

    def __init__(self, llm, config, **app_kwargs):
        from specray.cluster.openai_app import AsyncEngineClient, build_openai_app
        from specray.engine.async_engine import AsyncLLMEngine

        seen = self.seen = []

        class Client(AsyncEngineClient):
            def generate(self, prompt_token_ids, params, prompt=None, req_id=None, multimodal=None):
                outputs = super().generate(prompt_token_ids, params, prompt, req_id)

                async def recorded():
                    tokens = []
                    async for out in outputs:
                        ids = out.outputs[0].token_ids
                        tokens = tokens + ids if params.output_kind == "delta" else list(ids)
                        if out.finished:
                            seen.append((params.lora_request, tokens))
                        yield out
                return recorded()

        self.app = build_openai_app(Client(AsyncLLMEngine(llm.engine)), config, **app_kwargs)

    def __enter__(self) -> str:
        import socket
        import threading
        import time

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _complete(base: str, model: str, prompt: str) -> tuple[int, dict]:
    return _http(base + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                            "ignore_eos": True})


def test_server_serves_adapters_under_their_names(adapters, tiny_llama_dir):
    """vLLM's --lora-modules: /v1/models lists each adapter with its base model as parent and its folder as root;
    a completion or chat whose model names an adapter runs with it (greedy tokens of the merged model) and answers
    under its name; the base model's name runs without; an unknown name is a 404."""
    pytest.importorskip("ray")  # the server's modules import Ray and FastAPI (a GPU image may lack them)
    from specray.cluster.openai_app import ServerConfig

    requests, expected = adapters
    prompt = runs.PROMPTS[0]
    with LLM(model=str(tiny_llama_dir), max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        served = tuple(replace_base(r, "tiny") for r in requests[:2])
        recording = _Recording(llm, ServerConfig("tiny", None, lora_modules=served))
        with recording as base:
            status, models = _http(base + "/v1/models")
            assert status == 200
            assert [(m["id"], m.get("parent"), m.get("root")) for m in models["data"]] == [
                ("tiny", None, None), ("first", "tiny", requests[0].lora_path),
                ("second", "tiny", requests[1].lora_path)]
            assert _http(base + "/v1/models/second")[1]["parent"] == "tiny"
            for name, want in (("first", expected[0][0]), ("second", expected[1][0]), ("tiny", expected[2][0])):
                status, body = _complete(base, name, prompt)
                assert status == 200 and body["model"] == name
                lora = None if name == "tiny" else served[0 if name == "first" else 1]
                assert recording.seen.pop() == (lora, want)
            status, body = _http(base + "/v1/chat/completions", {"model": "second", "max_tokens": 4,
                                                                  "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200 and body["model"] == "second"
            status, body = _http(base + "/v1/completions", {"model": "third", "prompt": "hi", "max_tokens": 2})
            assert status == 404 and body["error"]["code"] == "model_not_found"


def test_server_loads_adapters_from_a_folder_when_asked(adapters, tiny_llama_dir, tmp_path):
    """Ray Serve LLM's dynamic_lora_loading_path: "<model>:<name>" runs with the adapter folder <name> of the
    folder, one put there after the server started too; /v1/models lists the folder's adapters as they are; a
    name with no folder, or one that is not a plain folder name, is a 404."""
    pytest.importorskip("ray")  # the server's modules import Ray and FastAPI (a GPU image may lack them)
    import shutil

    from specray.cluster.openai_app import ServerConfig

    requests, expected = adapters
    folder = tmp_path / "adapters"
    folder.mkdir()
    shutil.copytree(requests[0].lora_path, folder / "first")
    prompt = runs.PROMPTS[0]
    with LLM(model=str(tiny_llama_dir), max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        recording = _Recording(llm, ServerConfig("tiny", None, lora_dir=str(folder)))
        with recording as base:
            assert [m["id"] for m in _http(base + "/v1/models")[1]["data"]] == ["tiny", "tiny:first"]
            status, body = _complete(base, "tiny:first", prompt)
            assert status == 200 and body["model"] == "tiny:first"
            assert recording.seen.pop()[1] == expected[0][0]
            for missing in ("tiny:second", "tiny:..", "other:first", "tiny:first/../first"):
                status, body = _complete(base, missing, prompt)
                assert status == 404 and body["error"]["code"] == "model_not_found", missing
            shutil.copytree(requests[1].lora_path, folder / "second")  # added while serving
            status, body = _complete(base, "tiny:second", prompt)
            assert status == 200 and recording.seen.pop()[1] == expected[1][0]
            assert [m["id"] for m in _http(base + "/v1/models")[1]["data"]] == ["tiny", "tiny:first", "tiny:second"]
            assert _http(base + "/v1/models/tiny:second")[1]["parent"] == "tiny"
            checkpoints.write_lora(tiny_llama_dir, folder / "big", rank=16)  # above max_lora_rank=8
            status, body = _complete(base, "tiny:big", prompt)
            message = body["error"]["message"]  # naming the adapter, never the server's folder
            assert status == 400 and "max_lora_rank >= 16" in message and "'big'" in message, message
            assert str(folder) not in message and str(tmp_path) not in message, message
            status, body = _complete(base, "tiny:first", prompt)  # the server serves on
            assert status == 200 and recording.seen.pop()[1] == expected[0][0]
            from specray.cluster.bench_serve import benchmark  # a load test over several adapters, in turn

            summary = benchmark(base_url=base, model=["tiny", "tiny:first", "tiny:second"], prompts=[prompt],
                                num_requests=6, concurrency=3, max_tokens=4)
            assert summary["completed"] == 6
            assert sorted(lora.lora_name if lora else "tiny" for lora, _ in recording.seen[-6:]) == sorted(
                ["tiny", "tiny:first", "tiny:second"] * 2)


def replace_base(request: LoRARequest, base: str) -> LoRARequest:
    from dataclasses import replace

    return replace(request, base_model_name=base)


def test_serve_args_read_lora_modules(adapters, tiny_llama_dir, tmp_path):
    """`specray serve --lora-modules a=PATH '{"name": "b", "path": PATH}'` turns enable_lora on and serves both
    (ids 1 and 2, the served model their parent); a missing folder, a duplicate name or a rank above
    --max-lora-rank stop the server before Ray starts."""
    pytest.importorskip("ray")  # the server's modules import Ray and FastAPI (a GPU image may lack them)
    from specray.cluster.cli import build_parser, serve_app_args
    from specray.cluster.serve import ServeArgs

    requests, _ = adapters
    first, second = requests[0].lora_path, requests[1].lora_path
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--served-model-name", "base",
                                      "--lora-modules", f"a={first}", json.dumps({"name": "b", "path": second}),
                                      "--max-loras", "2", "--max-lora-rank", "8"])
    parsed = ServeArgs.from_dict(serve_app_args(args))
    assert parsed.engine_args().enable_lora and parsed.engine_args().max_loras == 2
    assert parsed.server_config(8).lora_modules == (LoRARequest("a", 1, first, "base"),
                                                    LoRARequest("b", 2, second, "base"))
    model = str(tiny_llama_dir)
    with pytest.raises(ValueError, match="adapter_config.json"):
        ServeArgs.from_dict({"model": model, "lora_modules": [f"a={tmp_path}"]})
    with pytest.raises(ValueError, match="already served"):
        ServeArgs.from_dict({"model": model, "lora_modules": {"a": first, "base": second},
                             "served_model_name": "base"})
    with pytest.raises(ValueError, match="max_lora_rank >= 8"):
        ServeArgs.from_dict({"model": model, "lora_modules": [f"b={second}"], "max_lora_rank": 4})
    with pytest.raises(ValueError, match=r"'name=path' or \{'name': \.\.\., 'path': \.\.\.\}$"):
        ServeArgs.from_dict({"model": model, "lora_modules": ["nameless"]})
    dynamic = ServeArgs.from_dict({"model": model, "dynamic_lora_loading_path": str(tmp_path),
                                   "served_model_name": "base"})
    assert dynamic.engine_args().enable_lora and dynamic.server_config(8).lora_dir == str(tmp_path.resolve())
    with pytest.raises(ValueError, match="is not a folder"):
        ServeArgs.from_dict({"model": model, "dynamic_lora_loading_path": str(tmp_path / "none")})


def test_metrics_count_each_adapter_s_requests(adapters, tiny_llama_dir):
    """`specray_lora_requests{adapter, state}`: each adapter's engine requests, running and waiting (from the
    scheduler); an adapter with none left reads 0, and one unloaded at runtime with none left has no series."""
    from specray import SamplingParams
    from specray.cluster.metrics import ServerMetrics, engine_state

    requests, _ = adapters
    with LLM(model=str(tiny_llama_dir), max_model_len=256, enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        engine = llm.engine
        for lora in (requests[0], requests[0], requests[1], None):
            engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, lora_request=lora))
        engine.step()  # adapter 1's two and the base request run; adapter 2's waits (max_loras=1)
        state = engine_state(engine)
        assert state["lora_requests"] == {"first": {"running": 2, "waiting": 0},
                                          "second": {"running": 0, "waiting": 1}}
        metrics = ServerMetrics("tiny")
        metrics.record_engine_state(state)
        while engine.has_unfinished_requests():
            engine.step()
        metrics.record_engine_state(engine_state(engine))
        text = metrics.render().decode()
        for name in ("first", "second"):
            for which in ("running", "waiting"):
                assert f'specray_lora_requests{{adapter="{name}",model="tiny",state="{which}"}} 0.0' in text
        metrics.record_engine_state(engine_state(engine), unloaded={"first"})
        text = metrics.render().decode()
        assert 'adapter="first"' not in text and 'adapter="second",model="tiny",state="waiting"} 0.0' in text
        metrics.record_engine_state(engine_state(engine), unloaded={"first"})  # gone: nothing left to drop
    with LLM(model=str(tiny_llama_dir), max_model_len=256) as llm:
        assert engine_state(llm.engine)["lora_requests"] == {}


def _post_text(url: str, body: dict) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_runtime_lora_updating_loads_and_unloads_adapters(adapters, tiny_llama_dir, tmp_path, monkeypatch):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (--enable-runtime-lora-updating, or its
    VLLM_ALLOW_RUNTIME_LORA_UPDATING): a loaded adapter serves under its name (the merged model's greedy tokens),
    load_inplace replaces it, an unloaded one is a 404; a taken name, a second load or a bad folder is a 400; the
    routes exist only when asked for."""
    pytest.importorskip("ray")  # the server's modules import Ray and FastAPI (a GPU image may lack them)
    from specray.cluster.openai_app import ServerConfig
    from specray.cluster.serve import ServeArgs

    requests, expected = adapters
    prompt = runs.PROMPTS[0]
    with LLM(model=str(tiny_llama_dir), max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        recording = _Recording(llm, ServerConfig("tiny", None, runtime_lora_updating=True, max_lora_rank=8))
        with recording as base:
            load, unload = base + "/v1/load_lora_adapter", base + "/v1/unload_lora_adapter"
            assert _post_text(load, {"lora_name": "mine", "lora_path": requests[0].lora_path}) == (
                200, "Success: LoRA adapter 'mine' added successfully.")
            assert "mine" in [m["id"] for m in _http(base + "/v1/models")[1]["data"]]
            assert _complete(base, "mine", prompt)[0] == 200 and recording.seen.pop()[1] == expected[0][0]
            status, text = _post_text(load, {"lora_name": "mine", "lora_path": requests[1].lora_path})
            assert status == 400 and "already been loaded" in text
            assert _post_text(load, {"lora_name": "mine", "lora_path": requests[1].lora_path,
                                     "load_inplace": True})[0] == 200
            assert _complete(base, "mine", prompt)[0] == 200 and recording.seen.pop()[1] == expected[1][0]
            for body, match in (({"lora_name": "tiny", "lora_path": requests[0].lora_path}, "already served"),
                                ({"lora_name": "x", "lora_path": str(tmp_path)}, "adapter_config.json")):
                status, text = _post_text(load, body)
                assert status == 400 and match in text, text
            serving = recording.app.state.serving
            assert asyncio.run(serving._unloaded_adapters()) == set()
            assert _post_text(unload, {"lora_name": "mine"})[0] == 200
            assert asyncio.run(serving._unloaded_adapters()) == {"mine"}  # its metrics series go (below)
            assert _complete(base, "mine", prompt)[0] == 404
            status, text = _post_text(unload, {"lora_name": "mine"})
            assert status == 404 and "lora_not_found" in text
    with LLM(model=str(tiny_llama_dir), max_model_len=256, enable_lora=True) as llm:
        with _Recording(llm, ServerConfig("tiny", None)) as base:  # not asked for: no such route
            assert _post_text(base + "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})[0] == 404
    model = str(tiny_llama_dir)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    parsed = ServeArgs.from_dict({"model": model})
    assert parsed.server_config(8).runtime_lora_updating and parsed.engine_args().enable_lora


def test_replicas_share_the_adapters_loaded_at_runtime(adapters, tiny_llama_dir):
    """Several ingress replicas (two apps here, each over an engine of its own) over one adapter registry: an adapter
    loaded through one serves through the other under the same id, replaced in place through the other, unloaded
    through the first is a 404 on both (and the other's next metrics scrape drops its series); while the registry is
    down, naming a runtime adapter is a 503 to retry and the base model still serves."""
    pytest.importorskip("ray")  # the server's modules import Ray and FastAPI (a GPU image may lack them)
    from specray.cluster.openai_app import ServerConfig
    from specray.cluster.serve import SharedRuntimeAdapters, SpecrayAdapterRegistry
    from specray_test_fakes import FakeDeploymentHandle

    requests, expected = adapters
    prompt = runs.PROMPTS[0]
    handle = FakeDeploymentHandle(SpecrayAdapterRegistry())
    config = ServerConfig("tiny", None, runtime_lora_updating=True, max_lora_rank=8)
    kw = dict(model=str(tiny_llama_dir), max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
    with LLM(**kw) as one, LLM(**kw) as two:
        first = _Recording(one, config, runtime_adapters=SharedRuntimeAdapters(handle))
        second = _Recording(two, config, runtime_adapters=SharedRuntimeAdapters(handle))
        with first as a, second as b:
            assert _post_text(a + "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": requests[0].lora_path})[
                0] == 200
            assert "mine" in [m["id"] for m in _http(b + "/v1/models")[1]["data"]]
            assert _complete(b, "mine", prompt)[0] == 200
            lora, tokens = second.seen.pop()
            assert tokens == expected[0][0] and lora.lora_path == requests[0].lora_path
            assert _complete(a, "mine", prompt)[0] == 200 and first.seen.pop()[0] == lora  # the same id
            status, text = _post_text(b + "/v1/load_lora_adapter", {"lora_name": "mine",
                                                                   "lora_path": requests[1].lora_path})
            assert status == 400 and "already been loaded" in text
            assert _post_text(b + "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": requests[1].lora_path,
                                                            "load_inplace": True})[0] == 200
            assert _complete(a, "mine", prompt)[0] == 200 and first.seen.pop()[1] == expected[1][0]
            replica_b = second.app.state.serving
            assert asyncio.run(replica_b._unloaded_adapters()) == set()  # a scrape of b's sees it loaded
            assert _post_text(a + "/v1/unload_lora_adapter", {"lora_name": "mine"})[0] == 200
            assert _complete(b, "mine", prompt)[0] == 404 and _complete(a, "mine", prompt)[0] == 404
            assert asyncio.run(replica_b._unloaded_adapters()) == {"mine"}  # b's next scrape drops its series
            handle.down = True
            status, body = _complete(b, "other", prompt)
            assert status == 503 and body["error"]["code"] == "adapter_registry_unavailable"
            assert _complete(b, "tiny", prompt)[0] == 200  # the base model never asks the registry
            handle.down = False


def test_several_replicas_get_one_adapter_registry(tiny_llama_dir):
    """With runtime LoRA updating and several replicas, the app binds one registry deployment (one replica) to the
    ingress; with one replica, none (the ingress keeps its own)."""
    pytest.importorskip("ray")  # the server's modules import Ray and FastAPI (a GPU image may lack them)
    from specray.cluster.serve import build_app

    def shared(num_replicas: int) -> dict[str, str]:
        bound = build_app({"model": str(tiny_llama_dir), "enable_runtime_lora_updating": True,
                           "num_replicas": num_replicas})._bound_deployment
        return {key: app._bound_deployment.name for key, app in bound.init_kwargs.items()}

    assert shared(2)["runtime_adapters"] == "SpecrayAdapterRegistry"
    assert "runtime_adapters" not in shared(1)
