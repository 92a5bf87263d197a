"""Tiny hybrid linear-attention models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) against transformers', and the engine's
prompts for them: shared by tests/test_qwen3_5.py and tests/test_gated_deltanet.py (registered by conftest as
``specray_test_hybrid_models``)."""

from __future__ import annotations

from pathlib import Path

import torch

from specray.models.attention import build_attention_metadata
from specray.models.gated_deltanet import RecurrentBatch
from specray.models.kv_cache import allocate_kv_cache, allocate_recurrent_state
from specray.models.loader import load_model

TOL = 1e-4
BLOCK = 4
LAYERS = ["linear_attention", "full_attention", "linear_attention"]
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, layer_types=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=512,
            rms_norm_eps=1e-5, initializer_range=0.1, vocab_size=300, bos_token_id=None, pad_token_id=None)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def hf_pair(arch: str, seed: int = 0, **overrides):
    """A transformers model of ``arch`` ("qwen3_5", "qwen3_5_moe", "qwen3_next") with random weights everywhere
    (zero-centred norms, routers and gates made random so that a wrong formula shows)."""
    import transformers as tf

    cfg_cls, model_cls = {"qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
                          "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
                          "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM)}[arch]
    kw = dict(TINY, **(MOE if arch != "qwen3_5" else {}), **overrides)
    config = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight"):  # 1 + w
                param.normal_(0.0, 0.3)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "dt_bias")):
                param.normal_(0.0, 0.5)
    return config, model


def save(path: Path, arch: str, seed: int, **overrides) -> Path:
    """A model folder the engine loads: weights, config and a tiny tokenizer (the model's vocabulary its size). Its
    embedding is tied and doubled, so that greedy decoding falls into loops now and then: n-gram drafts are then
    accepted in some steps and rejected in others (a plain random model's almost never are)."""
    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    _, hf = hf_pair(arch, seed, vocab_size=len(tok), eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
                    **overrides)
    with torch.no_grad():
        hf.get_input_embeddings().weight.mul_(2.0)
    hf.save_pretrained(path, safe_serialization=True)
    return path


class Stepper:
    """Our model over a paged cache (shuffled blocks) and a recurrent state, driven as the runner drives it: each
    sequence has a slot; a chunk with drafts leaves them pending and the next chunk replays the accepted ones."""

    def __init__(self, model, num_blocks: int = 200, slots: int = 4, max_pending: int = 4):
        self.model = model
        self.cache = allocate_kv_cache(model, num_blocks, BLOCK)
        self.state = allocate_recurrent_state(model, slots, max_pending)
        self.free = list(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist())
        self.tables: dict[int, list[int]] = {}
        self.base: dict[int, tuple[int, int]] = {}  # slot -> (committed position, pending drafts)

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int], int, int]]) -> list[torch.Tensor]:
        """chunks: (slot, token ids, start position, drafts among the last tokens) -> logits [q, V] each."""
        replay, fresh = [], []
        for slot, ids, start, drafts in chunks:
            table = self.tables.setdefault(slot, [])
            while len(table) * BLOCK < start + len(ids):
                table.append(self.free.pop())
            committed, pending = self.base.get(slot, (0, 0))
            fresh.append(start == 0)
            replay.append(0 if start == 0 else start - committed)
            assert 0 <= replay[-1] <= pending or start == 0, (start, committed, pending)
            self.base[slot] = (start + len(ids) - drafts, drafts)
        meta = build_attention_metadata([len(c[1]) for c in chunks], [c[2] for c in chunks],
                                        [self.tables[c[0]] for c in chunks], BLOCK, "cpu")
        meta.recurrent = RecurrentBatch([c[0] for c in chunks], fresh, replay, [c[3] for c in chunks])
        ids = torch.tensor([t for c in chunks for t in c[1]])
        logits = self.model.compute_logits(self.model(ids, meta))
        return list(logits.split([len(c[1]) for c in chunks]))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def ours(tmp_path: Path, arch: str, seed: int = 0, **overrides):
    _, hf = hf_pair(arch, seed, **overrides)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return load_model(tmp_path), hf


# prompts that repeat themselves (n-gram drafts find matches, some accepted, some not) and one that does not
PROMPT_IDS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], list(range(40, 70)), [11, 12, 11, 12, 11, 12, 13, 11, 12],
              [100, 101, 102, 103, 104, 105, 100, 101, 102, 103, 104, 105, 100, 101, 102, 103, 104, 105, 100, 101],
              [7, 7, 7, 7, 7, 7], list(range(200, 237)) + list(range(200, 210))]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def generate(llm, params) -> list[list[int]]:
    prompts = [{"prompt_token_ids": ids} for ids in PROMPT_IDS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def greedy(n: int = 24):
    from specray import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
