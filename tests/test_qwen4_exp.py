"""Qwen4-Exp's text model (``Qwen4ExpForCausalLM``: specray.models.qwen4_exp) against transformers on the same random
tiny weights (fp32, max abs diff < 1e-4): Gated DeltaNet layers (one with a sigmoid output gate) among gated attention
whose keys a QSA indexer picks (a budget of 2 blocks of 4 keys, so that most of the 40-token prompt's queries drop some
complete blocks), Qwen3-Next's experts, two residual streams joined by gated residuals, and per-layer n-gram embeddings
(PLE) on both linear layers (the prompt holds EOS tokens, so that n-grams restart). A prefill, chunks then single
steps, two sequences batched in uneven chunks, verify chunks whose accepted drafts are replayed (the n-gram ids and the
PLE conv's history with the delta rule's state); both attention paths; the multimodal checkpoint's text part; each
distinctive part broken once; the refusals; TP 2 and two pipeline stages against one rank; the engine's greedy tokens
with n-gram chains and trees (and graph steps) equal to transformers' ``generate``. The tiny models are built here."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import specray.models.qwen4_exp as q4
from specray.models import cpu_kernels
from specray.models.loader import load_model, read_config
from specray.parallel import TPGroup
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    PP_WORKER, TP_WORKER, check_drafts_replayed, check_prefill_chunks_and_decode)
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, chunked_logits, max_diff, prompt, run_ranks)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much
EOS = 2
# linear (PLE), indexed, linear (PLE), indexed; QSA: 16 indexer heads (with few, many blocks score exactly 0 and the
# k-th pick is a tie), blocks of 4 keys, 2 of them kept; two streams; PLE's 2- and 3-grams, 2 heads each, in tables of
# primes near 97, a conv of 3 taps dilated by 3
TINY = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_conv_kernel_dim=4, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
            num_experts_per_tok=2, hc_count=2, hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=16, ngram_size=3,
            heads_per_ngram=2, ngram_vocab_size_base=97, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2,
            ple_conv_kernel_size=3, indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
            indexer_compress_ratio=4, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            tie_word_embeddings=True, bos_token_id=None, pad_token_id=None)
SEED = 0


def with_eos(ids: list[int], every: int = 13) -> list[int]:
    """``ids`` with every ``every``-th token an EOS (PLE's n-grams restart after one)."""
    return [EOS if (i + 1) % every == 0 else t for i, t in enumerate(ids)]


def build_tiny_qwen4(path: Path, seed: int = SEED, **overrides) -> Path:
    """transformers' Qwen4ExpForCausalLM at :data:`TINY`'s sizes with random weights (the zero- or one-initialised
    ones drawn away from their init: norms, routers, the PLE conv), saved as transformers saves it (the n-gram tables
    in ``split_ngram_parts`` shards), with conftest's tiny tokenizer."""
    from transformers import Qwen4ExpForCausalLM as HFQwen4, Qwen4ExpTextConfig

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path)
    config = Qwen4ExpTextConfig(**{**TINY, "vocab_size": len(tok), "eos_token_id": EOS, **overrides})
    torch.manual_seed(seed)
    model = HFQwen4(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and param.dim() == 1:
                param.uniform_(-0.5, 0.5)  # 1 + w norms (the gated norm's plain weight near 1 too)
                if "linear_attn.norm" in name:
                    param.add_(1.0)
            elif name.endswith(("mlp.gate.weight", "dt_bias")):
                param.normal_(0.0, 0.5)
            elif name.endswith("ple.conv1d.weight"):  # zeros at init
                param.normal_(0.0, 0.5)
            elif name.endswith("ngram_embedding.weight"):
                param.normal_(0.0, 1.0)
        model.get_input_embeddings().weight.mul_(2.0)  # tied: greedy decoding falls into loops n-gram drafts follow
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_qwen4_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen4(tmp_path_factory.mktemp("tiny_qwen4_exp"))


@pytest.fixture(scope="module")
def hf_qwen4(tiny_qwen4_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen4_dir, dtype=torch.float32).eval()


def eos_prompt() -> list[int]:
    return with_eos(prompt())


@pytest.fixture(scope="module")
def reference(hf_qwen4) -> torch.Tensor:
    with torch.no_grad():
        return hf_qwen4(torch.tensor([eos_prompt()])).logits[0].float()


def logits(model, schedule: str = "chunked+decode") -> torch.Tensor:
    return chunked_logits(model, eos_prompt(), SCHEDULES[schedule])


# ---- logits against transformers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["batched", "own"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_qwen4_dir, reference, monkeypatch, schedule, path):
    """A 40-token prefill, and the same prompt in chunks (17, 9, 3) then single tokens (the recurrent states in slot
    0, the K/V and the indexer's keys in shuffled blocks): every logit row equals transformers'; short queries as the
    padded batch or one sequence at a time."""
    if path == "own":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    model = load_model(str(tiny_qwen4_dir))
    assert isinstance(model, q4.Qwen4ExpForCausalLM)
    assert max_diff(logits(model, schedule), reference) < TOL


def test_batched_chunks_and_replayed_drafts_match_transformers(tiny_qwen4_dir, hf_qwen4):
    """(check_prefill_chunks_and_decode, check_drafts_replayed: tests/hybrid_models.py) two sequences batched in
    uneven chunks, then decode steps; verify chunks whose accepted drafts the next chunk replays: the n-gram ids and the
    PLE conv's history are replayed with the delta rule's state, and the indexer's keys of rejected drafts are never
    pooled."""
    model = load_model(str(tiny_qwen4_dir))
    check_prefill_chunks_and_decode(model, hf_qwen4)
    check_drafts_replayed(model, hf_qwen4)


def test_the_tiny_model_exercises_every_part(tiny_qwen4_dir):
    """The fixture has what the comparisons must see: both layer kinds, PLE on both linear layers with its tables
    read from their shards, an indexer whose budget is smaller than the prompt's complete blocks, EOS in the prompt."""
    from safetensors import safe_open

    with safe_open(str(tiny_qwen4_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight" in names
    model = load_model(str(tiny_qwen4_dir))
    layers = model.model.layers
    assert [layer.ple is not None for layer in layers] == [True, False, True, False]
    assert [hasattr(layer, "self_attn") for layer in layers] == [False, True, False, True]
    assert layers[1].self_attn.indexer.block_topk == 2 and len(prompt()) // 4 > 2
    assert EOS in eos_prompt()
    assert len(model.recurrent_state_specs()) == 6  # per linear layer: the delta rule, the PLE conv, the n-gram ids
    table = layers[2].ple.ple_embedding.ngram_embedding.weight
    with safe_open(str(tiny_qwen4_dir / "model.safetensors"), "pt") as f:
        want = torch.cat([f.get_tensor(f"model.layers.2.ple.ple_embedding.ngram_embedding.shard_{i}.weight")
                          for i in range(2)])
        assert torch.equal(layers[2].ple.ple_embedding.multipliers,
                           f.get_tensor("model.layers.2.ple.ple_embedding.layer_multipliers"))
        assert torch.equal(layers[2].ple.ple_embedding.sizes,
                           f.get_tensor("model.layers.2.ple.ple_embedding.ngram_heads_vocab_sizes"))
    assert torch.equal(table, want)


def test_each_rank_reads_its_columns_of_the_tables_shard_by_shard(tiny_qwen4_dir):
    """Under TP each rank holds, and reads from the checkpoint's unjoined row shards, only its slice of every row's
    columns (a real release's tables are far too big to replicate); a TP size that does not split the columns is
    refused by name."""
    from safetensors import safe_open

    config = read_config(str(tiny_qwen4_dir))
    name = "model.layers.2.ple.ple_embedding.ngram_embedding"
    with safe_open(str(tiny_qwen4_dir / "model.safetensors"), "pt") as f:
        whole = torch.cat([f.get_tensor(f"{name}.shard_{i}.weight") for i in range(2)])
        width = whole.shape[1] // 2
        for rank in range(2):
            table = q4.NGramEmbedding(config, 1, TPGroup(rank, 2))
            weight = table.ngram_embedding.weight
            weight.weight_loader(weight, q4.RowShards(f.get_slice(f"{name}.shard_{i}.weight") for i in range(2)))
            assert weight.shape == (whole.shape[0], width)
            assert torch.equal(weight, whole[:, rank * width: (rank + 1) * width])
        with pytest.raises(ValueError, match="rows"):  # a shard missing: the table's rows do not add up
            weight.weight_loader(weight, q4.RowShards([f.get_slice(f"{name}.shard_0.weight")]))
    config.ple_embed_dim = 8  # 2 columns per head: TP 4 cannot split them
    config.linear_num_key_heads = config.linear_num_value_heads = 4
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not split the n-gram tables' columns"):
        q4.Qwen4ExpForCausalLM.check_split(config, 4, 1)


@pytest.mark.parametrize("variant", ["sigmoid-output-gate", "release-layer-names"])
def test_config_variants_match_transformers(tmp_path, variant):
    """A sigmoid output gate on the linear layers (``output_gate_type``); the release's ``full_attention`` name for
    the indexed layers with the default layout (every fourth layer indexed, PLE on the first): transformers' logits."""
    if variant == "sigmoid-output-gate":
        folder = build_tiny_qwen4(tmp_path / "m", seed=1, output_gate_type="sigmoid")
    else:
        folder = build_tiny_qwen4(tmp_path / "m", seed=2, layer_types=None, ple_layer_ids=[1])
        config = json.loads((folder / "config.json").read_text())
        assert config["layer_types"] == ["linear_attention"] * 3 + ["indexed_attention"]
        config["layer_types"][3] = "full_attention"
        (folder / "config.json").write_text(json.dumps(config))
    ids = prompt()
    with torch.no_grad():
        from transformers import AutoModelForCausalLM
        want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    assert max_diff(chunked_logits(load_model(str(folder)), ids, SCHEDULES["chunked+decode"]), want) < TOL



def test_a_token_trees_pick_pools_each_nodes_own_path(tiny_qwen4_dir):
    """The indexer's pick for a verify chunk whose drafts form a tree (13 cached keys, then the chunk's last real
    token at position 13, two sibling drafts at 14 and a child of the first at 15): each node's row equals the pick of
    the chain along its own path (its block 3 pooled from its ancestors' keys, not its sibling's), and the pick drops
    complete blocks there (the budget is 2 of its 4)."""
    model = load_model(str(tiny_qwen4_dir))
    indexer, rotary = model.model.layers[1].self_attn.indexer, model.model.rotary_emb
    ctx, parents, positions = 13, [-1, 0, 0, 1], [13, 14, 14, 15]
    length, d = ctx + len(parents), indexer.dim
    paths = []
    for node, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [ctx + node])
    allowed = torch.zeros(1, len(parents), length, dtype=torch.bool)
    allowed[0, :, :ctx] = True
    for node, path in enumerate(paths):
        allowed[0, node, path] = True
    k_pos = torch.tensor([list(range(ctx)) + positions])
    q_pos = torch.tensor([positions])
    dropped = 0
    for seed in range(24):  # random keys and queries: picks that differ between the node's path and its sibling's
        torch.manual_seed(seed)
        keys, queries = torch.randn(1, length, d), torch.randn(1, len(parents), indexer.heads, d)
        with torch.no_grad():
            keep = indexer.select(queries, keys, allowed, q_pos, k_pos, ([ctx], [len(parents)]), rotary)
            for node, path in enumerate(paths):
                chain = list(range(ctx)) + path  # the node's keys in position order
                alone = indexer.select(queries[:, node: node + 1], keys[:, chain], torch.ones(
                    1, 1, len(chain), dtype=torch.bool), q_pos[:, node: node + 1], torch.arange(len(chain))[None],
                    None, rotary)
                want = torch.zeros(length, dtype=torch.bool)
                want[chain] = alone[0, 0]
                assert torch.equal(keep[0, node], want), (seed, node)
        dropped += int(not keep[0, 3, :ctx].all())
    assert dropped == 24  # complete blocks dropped for the deepest node


# ---- the multimodal checkpoint ---------------------------------------------------------------------------------------

def build_tiny_qwen4_multimodal(text: Path, path: Path) -> Path:
    """transformers' Qwen4ExpForConditionalGeneration holding the text model in ``text`` beside a one-layer vision
    tower, saved as transformers saves it (``model.language_model.``, ``model.visual.``, ``lm_head.``)."""
    from transformers import AutoModelForCausalLM, Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    hf_text = AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=hf_text.config.hidden_size, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                  num_position_embeddings=16)
    config = Qwen4ExpConfig(text_config=hf_text.config.to_dict(), vision_config=vision, image_token_id=300,
                            video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)
    torch.manual_seed(0)
    model = Qwen4ExpForConditionalGeneration(config).float().eval()
    model.model.language_model.load_state_dict(hf_text.model.state_dict())
    model.lm_head.load_state_dict(hf_text.lm_head.state_dict())
    model.save_pretrained(path, safe_serialization=True)
    for file in text.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, path / file.name)
    return path


def test_multimodal_checkpoint_serves_its_text_model(tiny_qwen4_dir, reference, tmp_path, caplog):
    """Qwen4ExpForConditionalGeneration's checkpoint (model_type qwen4_exp): the text model is built from its
    text_config and reads its own tensors alone (the vision tower's are never offered); its logits equal the text
    model's in transformers."""
    from safetensors import safe_open

    folder = build_tiny_qwen4_multimodal(tiny_qwen4_dir, tmp_path / "mm")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(n.startswith("model.visual.") for n in names)
    assert "model.language_model.layers.1.self_attn.indexer.index_qk_proj.weight" in names
    config = read_config(str(folder))
    assert config.model_type == "qwen4_exp" and config.architectures == ["Qwen4ExpForConditionalGeneration"]
    with caplog.at_level("WARNING", logger="specray.models.llama"):
        model = load_model(str(folder))
    assert isinstance(model, q4.Qwen4ExpForCausalLM) and model.config.model_type == "qwen4_exp_text"
    assert "ignoring checkpoint tensor" not in caplog.text
    assert max_diff(logits(model, "prefill"), reference) < TOL


# ---- each distinctive part, broken on purpose ------------------------------------------------------------------------

def _layers(model, kind: str):
    return [layer for layer in model.model.layers if layer.layer_type == kind]


def _no_selection(config) -> None:
    """Every complete block kept (a budget past any context)."""
    config.indexer_budget = 1024


def _no_ple(model) -> None:
    for layer in model.model.layers:
        layer.ple = None


def _ngrams_across_eos(monkeypatch) -> None:
    """n-grams that do not restart after an EOS."""
    monkeypatch.setattr(q4.NGramEmbedding, "restarts_at_eos", False)


def _ple_conv_undilated(model) -> None:
    """The PLE conv's taps on adjacent tokens (no dilation)."""
    for layer in _layers(model, "linear_attention"):
        w = layer.ple.conv1d.weight.data
        taps = w[:, :: layer.ple.dilation].clone()
        w.zero_()
        w[:, -taps.shape[1]:] = taps


def _pooled_keys_unnormed(model) -> None:
    for layer in _layers(model, "indexed_attention"):
        layer.self_attn.indexer.k_layernorm = torch.nn.Identity()


def _pooled_keys_at_query_rope(monkeypatch) -> None:
    """The pooled keys rotated at position 0 rather than at their block's first position."""
    real = q4._rotate_as_transformers

    def at_zero(x, cos, sin):
        if x.dim() == 4:  # the pooled keys [N, Q, B, Di]
            return real(x, torch.ones_like(cos), torch.zeros_like(sin))
        return real(x, cos, sin)

    monkeypatch.setattr(q4, "_rotate_as_transformers", at_zero)


def _tail_dropped(monkeypatch) -> None:
    """Only the picked blocks attended: the positions past the last complete block dropped."""
    real = q4.QSAIndexer.select

    def select(self, queries, keys, allowed, q_pos, k_pos, chunks, rotary):
        keep = real(self, queries, keys, allowed, q_pos, k_pos, chunks, rotary)
        tail = k_pos[:, None] >= (q_pos[..., None] + 1) // self.ratio * self.ratio
        return keep & ~(tail & (q_pos[..., None] >= self.ratio))

    monkeypatch.setattr(q4.QSAIndexer, "select", select)


def _streams_written_evenly(monkeypatch) -> None:
    """Each block's output added to every stream with weight 1."""
    monkeypatch.setattr(q4.GatedResidual, "write", staticmethod(
        lambda streams, out, weights: streams + out.repeat(1, weights.shape[1])))


def _one_stream_read(monkeypatch) -> None:
    """A block reading the first stream's normed activations alone (no learned mix)."""
    def forward(self, streams):
        normed = self.hc_norm(streams)
        mixed = normed[:, : self.h]
        if self.block_inject_weight is None:
            return mixed
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.n)

    monkeypatch.setattr(q4.GatedResidual, "forward", forward)


MUTATIONS = {"no-selection": (None, _no_selection, None),
             "no-ple": (None, None, _no_ple),
             "ngrams-across-eos": (_ngrams_across_eos, None, None),
             "ple-conv-undilated": (None, None, _ple_conv_undilated),
             "pooled-keys-unnormed": (None, None, _pooled_keys_unnormed),
             "pooled-keys-unrotated": (_pooled_keys_at_query_rope, None, None),
             "tail-dropped": (_tail_dropped, None, None),
             "streams-written-evenly": (_streams_written_evenly, None, None),
             "one-stream-read": (_one_stream_read, None, None)}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_logits(tiny_qwen4_dir, reference, monkeypatch, mutation):
    """Each distinctive part broken once (the indexer's selection, its pooled keys' norm and RoPE, the tail it always
    keeps, PLE, its EOS restarts and dilated conv, the gated residual's per-stream weights and mix): the logits move
    by more than a hundred times the tolerance."""
    patch, mutate_config, mutate = MUTATIONS[mutation]
    if patch is not None:
        patch(monkeypatch)
    config = read_config(str(tiny_qwen4_dir))
    if mutate_config is not None:
        mutate_config(config)
    model = load_model(str(tiny_qwen4_dir), config=config)
    if mutate is not None:
        mutate(model)
    assert max_diff(logits(model), reference) > MOVED


# ---- what is refused -------------------------------------------------------------------------------------------------

def _set(**fields):
    def edit(config):
        for field, value in fields.items():
            setattr(config, field, value)
    return edit


@pytest.mark.parametrize("edit,match", [
    (_set(layer_types=["linear_attention", "sliding_attention", "linear_attention", "indexed_attention"]),
     r"layer_types=\['linear_attention', 'sliding_attention'.* each one of"),
    (_set(indexer_budget=None), r"indexer_budget=None: the indexed_attention layers need every QSA field"),
    (_set(indexer_kv_heads=2), r"indexer_kv_heads=2: .* one key head"),
    (_set(indexer_budget=6), r"indexer_budget=6 is not a multiple of indexer_compress_ratio=4"),
    (_set(indexer_head_dim=4), r"indexer_head_dim=4 is narrower than the 8 features"),
    (_set(output_gate_type="gelu"), r"output_gate_type='gelu'.*'silu' or 'sigmoid'"),
    (_set(ple_embed_dim=18), r"ple_embed_dim=18, .* a multiple of its 4 n-gram heads"),
    (_set(eos_token_id=None), r"eos_token_id=None: PLE's n-grams restart after an EOS"),
    (_set(ple_layer_ids=[0, 3]), r"ple_layer_ids=\[0, 3\]: ids are one-indexed"),
], ids=["layer_types", "qsa-missing", "indexer_kv_heads", "indexer_budget", "indexer_head_dim", "output_gate_type",
        "ple_embed_dim", "eos_token_id", "ple_layer_ids"])
def test_inconsistent_configs_are_refused_by_name(tiny_qwen4_dir, edit, match):
    config = read_config(str(tiny_qwen4_dir))
    edit(config)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_qwen4_dir), config=config)


@pytest.mark.parametrize("kw, match", [
    (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1}),
     r"method='mtp' .* not supported for model_type='qwen4_exp_text'"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3"),
    (dict(enable_lora=True), r"enable_lora: LoRA adapters are not applied to qwen4_exp_text"),
])
def test_engine_refusals(tiny_qwen4_dir, kw, match):
    """No MTP layer is read; a TP size that does not split the linear layers' heads; LoRA (no adaptable module)."""
    from specray import LLM

    with pytest.raises(ValueError, match=match):
        LLM(model=str(tiny_qwen4_dir), max_model_len=128, **kw)


# ---- tensor parallelism and pipeline stages ---------------------------------------------------------------------

def test_tensor_parallel_shards_match_one_rank(tiny_qwen4_dir, tmp_path):
    """TP 2 over gloo: the attention, linear heads and the experts split, the indexers, gated residuals and PLE
    replicated; prefills, a verify chunk and the replay after it equal one rank's."""
    folder = str(tiny_qwen4_dir)
    for r, result in enumerate(run_ranks(tmp_path, TP_WORKER, 2, 2, [folder], timeout=240)):
        diff, heads = result[folder]
        assert diff < TOL, (r, diff)
        assert heads == TINY["linear_num_value_heads"] // 2


def test_pipeline_stages_match_one_rank(tiny_qwen4_dir, tmp_path):
    """Two pipeline stages (the streams handed on, each stage keeping its own layers' states and K/V): the last
    stage's logits equal one rank's."""
    folder = str(tiny_qwen4_dir)
    first, last = run_ranks(tmp_path, PP_WORKER, 2, 2, [folder], timeout=240)
    (first_layers, none), (last_layers, diff) = first[folder], last[folder]
    assert none is None and first_layers + last_layers == list(range(TINY["num_hidden_layers"]))
    assert diff < TOL, diff


# ---- the engine ------------------------------------------------------------------------------------------------------

def test_engine_greedy_equals_transformers_with_drafts_and_graphs(tiny_qwen4_dir, no_host_sync):
    """``specray.LLM``'s greedy tokens equal transformers' ``generate``; so do they with n-gram chains verified
    eagerly and n-gram trees (each tree node's n-gram ids, PLE conv and pooled index keys along its own path) beside
    chain steps from graphs, whose forward syncs nothing with the host."""
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_drafts_and_graphs_equal_transformers(tiny_qwen4_dir, no_host_sync, 12)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_qwen4_dir, schedule):
    """fp32 logits on CUDA equal the CPU's (tests/test_device_parity.py's check for this file's fixture)."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(tiny_qwen4_dir, SCHEDULES[schedule])
