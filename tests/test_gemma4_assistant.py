"""Gemma 4's assistant (``method="gemma4_assistant"``: transformers' ``Gemma4AssistantForCausalLM``, the MTP drafter
Google releases beside each Gemma 4) drafting for a tiny random Gemma 4 target: every draft the worker proposes equals
transformers' assistant run by hand as its ``SinglePositionMultiTokenCandidateGenerator`` runs it right after a
prefill of the committed sequence (with ``lm_head`` and with the centroid-masked head); greedy output equals plain
decoding token for token with drafts accepted; seeded sampling keeps the target's distribution; the refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from specray import LLM
from specray_test_engine_runs import Recorder  # tests/engine_runs.py (registered by conftest)

SLIDING, FULL = "sliding_attention", "full_attention"
K = 3  # drafts per step
# the target: 6 layers, sliding (heads of 16, 2 KV heads, a window of 4) and full (heads of 32, one KV head, k = v) in
# turn, the last two KV-shared (so the assistant reads layers 2 and 3, not the last ones)
TARGET = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
              layer_types=[SLIDING, FULL] * 3, sliding_window=4, num_kv_shared_layers=2, enable_moe_block=False,
              hidden_size_per_layer_input=0, final_logit_softcapping=30.0, max_position_embeddings=1024,
              rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=None,
              rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                               FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                      "rope_theta": 10000.0}})
# the assistant: 2 layers (sliding, then full) of its own width, with the target's head sizes (it reads their K/V)
ASSISTANT = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                 attention_k_eq_v=True, layer_types=[SLIDING, FULL], sliding_window=4, hidden_size_per_layer_input=0,
                 vocab_size_per_layer_input=0, enable_moe_block=False, use_double_wide_mlp=False,
                 max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.2,
                 rope_parameters=TARGET["rope_parameters"])
ORDERED = dict(use_ordered_embeddings=True, num_centroids=8, centroid_intermediate_top_k=2)  # 40 tokens a cluster


def _randomize_norms(model) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)


def save_target(path: Path, seed: int = 40, **overrides) -> Path:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    config = Gemma4TextConfig(**{**TARGET, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                                 "pad_token_id": tok.pad_token_id, **overrides})
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(config).float().eval()
    _randomize_norms(model)
    with torch.no_grad():  # a large embedding: the tied head then often gives the token just read (runs to draft)
        model.get_input_embeddings().weight.mul_(2.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def save_assistant(path: Path, vocab_size: int, seed: int = 7, backbone: int = 64, accepting_from: Path | None = None,
                   **overrides) -> Path:
    """A random assistant in transformers' layout (``overrides``: its text config's, or ORDERED's keys);
    ``accepting_from`` (the target's folder): one whose drafts the
    target often keeps. Its ``pre_projection`` copies the embedding of the token it reads into the residual stream,
    its layers add a little (their post-norms small), and its LM head is the target's embedding: it drafts "that
    token again", which the target's runs of repeated tokens accept. Nothing in it knows the continuation."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    text = {**ASSISTANT, "vocab_size": vocab_size, **{k: v for k, v in overrides.items() if k not in ORDERED}}
    if accepting_from is not None:
        text.update(hidden_size=backbone)
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=backbone,
                                   **{k: v for k, v in overrides.items() if k in ORDERED})
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(config).float().eval()
    _randomize_norms(model)
    with torch.no_grad():
        if config.use_ordered_embeddings:
            model.masked_embedding.token_ordering.copy_(torch.randperm(vocab_size))
        if accepting_from is not None:
            from safetensors.torch import load_file

            embedding = load_file(str(accepting_from / "model.safetensors"))["model.embed_tokens.weight"]
            model.lm_head.weight.copy_(embedding)  # tied: the assistant's own embedding too
            model.pre_projection.weight.zero_()
            model.pre_projection.weight[:, :backbone].copy_(torch.eye(backbone))
            for layer in model.model.layers:
                layer.post_attention_layernorm.weight.fill_(0.05)
                layer.post_feedforward_layernorm.weight.fill_(0.05)
                layer.layer_scalar.fill_(1.0)
            model.model.norm.weight.fill_(1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_target(tmp_path_factory.mktemp("g4a_target"))


@pytest.fixture(scope="module")
def vocab(target_dir) -> int:
    return json.loads((target_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def assistants(target_dir, vocab, tmp_path_factory) -> dict[str, Path]:
    return {"random": save_assistant(tmp_path_factory.mktemp("g4a_random"), vocab),
            "ordered": save_assistant(tmp_path_factory.mktemp("g4a_ordered"), vocab, seed=8, **ORDERED),
            "accepting": save_assistant(tmp_path_factory.mktemp("g4a_accepting"), vocab, accepting_from=target_dir)}


def spec(folder: Path, k: int = K, **extra) -> dict:
    return {"method": "gemma4_assistant", "model": str(folder), "num_speculative_tokens": k, "adaptive": False,
            **extra}


def reference_drafts(hf_target, assistant, seq: list[int], k: int) -> list[int]:
    """transformers' candidates for the committed ``seq`` (its last token the one the target just sampled): the target
    run over ``seq[:-1]`` from scratch (its hidden states and its "store" layers' K/V), then the candidate generator's
    first drafting round, as ``generate`` runs it right after the prefill."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    assistant.generation_config.num_assistant_tokens = k
    generator = SinglePositionMultiTokenCandidateGenerator(assistant, hf_target.get_input_embeddings(),
                                                           GenerationConfig(max_length=4096))
    with torch.no_grad():
        out = hf_target(torch.tensor([seq[:-1]]), output_hidden_states=True, return_shared_kv_states=True)
        ids = torch.tensor([seq])
        candidates, _ = generator.get_candidates(ids, {"attention_mask": torch.ones_like(ids)}, out,
                                                 is_first_iteration=False, n_last_matches=0)
    return candidates[0, len(seq):].tolist()


@pytest.mark.parametrize("kind", ["random", "ordered", "accepting", "random-graphs", "accepting-graphs"])
def test_every_draft_equals_transformers_candidate_generator(target_dir, assistants, kind):
    """Each step's drafts (after a prefill, and after every verification, drafts accepted or not) equal transformers'
    assistant's over the committed sequence, run as the candidate generator runs it right after a prefill of that
    sequence. Right after a prefill that is what ``generate`` does. Later, ``generate`` would differ after a rejected
    draft: it cuts the target's K/V to the committed length, which then still holds the rejected draft's K/V at the
    sampled token's position P, and its assistant attends it (its sliding layers also see the target's own window
    cache); ours attends the committed keys before P only, as it does after a prefill. "-graphs": the draft steps
    (and the target's) from graphs (on CPU their padded static inputs, eagerly)."""
    from transformers import Gemma4AssistantForCausalLM

    kind, _, graphs = kind.partition("-")
    check_drafts_equal_transformers(target_dir, assistants[kind], Gemma4AssistantForCausalLM, kind == "accepting",
                                    graphs=bool(graphs))


def check_drafts_equal_transformers(target_dir: Path, assistant_dir: Path, assistant_class, accepting: bool,
                                    graphs: bool = False) -> None:
    """Every step's drafts of three greedy requests equal :func:`reference_drafts` of transformers' assistant
    (``assistant_class``) over the committed sequence; with an ``accepting`` assistant some are accepted too; with
    ``graphs`` the draft steps replay one (three requests padded to 4)."""
    from transformers import AutoModelForCausalLM

    runs = sys.modules["specray_test_engine_runs"]
    prompts = runs.PROMPTS[:3]
    llm = LLM(str(target_dir), max_model_len=128, speculative_config=spec(assistant_dir), enforce_eager=not graphs)
    llm.engine.executor = rec = Recorder(llm.engine.executor)
    drafter, replays = llm.engine.executor.worker.runner.drafter, []
    assert (drafter.graphs is None) != graphs
    if graphs:
        run = drafter.graphs.run
        drafter.graphs.run = lambda shape, *a, **k: replays.append(shape.batch) or run(shape, *a, **k)
    outs = llm.generate(prompts, runs.greedy(10), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    assistant = assistant_class.from_pretrained(str(assistant_dir), dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    committed = {o.request_id: tok.encode(p) for o, p in zip(outs, prompts)}
    checked, after_accepted, draft_steps = 0, 0, 0
    for plan, result in rec.steps:
        draft_steps += max((len(d) for d in result.draft_token_ids or [] if d), default=0)  # the round's steps
        for chunk, kept, drafts in zip(plan.chunks, result.sampled_token_ids, result.draft_token_ids or []):
            if not kept:
                continue
            seq = committed[chunk.req_id] = committed[chunk.req_id][: chunk.start_pos + chunk.num_tokens
                                                                   - chunk.num_draft_tokens] + list(kept)
            if drafts:
                assert drafts == reference_drafts(hf, assistant, seq, K)[: len(drafts)], (chunk.req_id, seq)
                checked += 1
                after_accepted += len(kept) > 1
    assert checked >= 3 * len(prompts)
    if accepting:
        assert after_accepted > 0 and llm.spec_stats.accepted_tokens > 0, llm.spec_stats
    assert not graphs or len(replays) == draft_steps and 4 in replays, replays  # every step; 3 requests padded to 4


def test_a_draft_step_from_a_graph_syncs_nothing(target_dir, assistants, no_host_sync):
    """A draft step of three requests (padded to 4) replayed from a graph reads no tensor's value on the host (a
    capture fails on one): their tokens, features and positions go in as device tensors."""
    runs = sys.modules["specray_test_engine_runs"]
    llm = LLM(str(target_dir), max_model_len=128, speculative_config=spec(assistants["random"]), enforce_eager=False)
    llm.generate(runs.PROMPTS[:3], runs.greedy(4), use_tqdm=False)
    drafter = llm.engine.executor.worker.runner.drafter
    graphs, device = drafter.graphs, drafter.head.device
    drafter.head.bind_target_kv()
    starts, tables = [4, 5, 6], [[0]] * 3  # queries at positions 5, 6, 7 over block 0 (any values serve here)
    shape = graphs.shape([1] * 3, starts, decode=True)
    tokens, pos = torch.tensor([3, 4, 5], device=device), torch.tensor([5, 6, 7], device=device)
    feature = torch.randn(3, drafter.head.pre_projection.weight.shape[1] - drafter.head.target.config.hidden_size,
                          device=device)
    with torch.inference_mode():
        graphs.run(shape, tokens, [1] * 3, starts, tables, (feature, pos))  # captured here unless it was already
        with no_host_sync():
            graphs.run(shape, tokens, [1] * 3, starts, tables, (feature, pos))
    assert shape.batch == 4 and shape in graphs.graphs


def test_greedy_batch_equals_plain_decoding(target_dir, assistants):
    """A batch of 8 prompts with per-request draft caps (none, 1, the engine's) and max_tokens edges: greedy output with
    the assistant (one that drafts nothing the target keeps, one whose drafts are often kept, and that one beside
    n-gram trees, whose accepted paths it skips until their K/V move; and with the target's steps from graphs, the
    GPU's default, which on CPU run their static inputs eagerly) equals plain decoding token for token, and every KV
    block is free again afterwards."""
    runs = sys.modules["specray_test_engine_runs"]
    mixed = [runs.greedy(), runs.greedy(num_speculative_tokens=0), runs.greedy(1), runs.greedy(2), runs.greedy(3),
             runs.greedy(num_speculative_tokens=1), runs.greedy(logprobs=2), runs.greedy(7)]
    plain = runs.token_ids(LLM(str(target_dir), max_model_len=128).generate(runs.PROMPTS, mixed, use_tqdm=False))
    trees = {"method": "ngram", "num_branches": 3, "prompt_lookup_min": 1}  # a lookup beside it, proposing trees
    for kind, extra, engine in (("random", {}, {}), ("accepting", {}, {}), ("accepting", {"combine_with": trees}, {}),
                                ("accepting", {}, {"enforce_eager": False})):  # the target's steps from graphs
        llm = LLM(str(target_dir), max_model_len=128, speculative_config=spec(assistants[kind], **extra), **engine)
        free = llm.engine.scheduler.block_manager.num_free_blocks
        assert runs.token_ids(llm.generate(runs.PROMPTS, mixed, use_tqdm=False)) == plain, kind
        stats = llm.spec_stats
        assert stats.draft_tokens > 0 and llm.engine.scheduler.block_manager.num_free_blocks == free, (kind, stats)
        if kind == "accepting":
            assert 0 < stats.accepted_tokens < stats.draft_tokens, stats


def repeating_prompt(plain: LLM) -> list[int]:
    """A prompt after which the target's greedy token is the prompt's own last token (what the accepting assistant
    drafts): a prompt and the first part of its greedy output, up to a token the target then repeats."""
    runs = sys.modules["specray_test_engine_runs"]
    tok = plain.get_tokenizer()
    for text in runs.PROMPTS:
        seq = tok.encode(text)
        seq += plain.generate({"prompt_token_ids": seq}, runs.greedy(24), use_tqdm=False)[0].outputs[0].token_ids
        found = next((j for j in range(len(seq) - 1) if seq[j] == seq[j + 1]), None)
        if found is not None:
            return seq[: found + 1]
    raise AssertionError("the target repeats no token: the accepting assistant would find nothing to draft")


def test_sampled_output_keeps_the_target_distribution(target_dir, assistants):
    """Seeded sampled requests (temperature 0.7, top-k 3) whose chains the accepting assistant draws from its q: the
    first three tokens' joint frequencies fit the target's p(x0) p(x1 | x0) p(x2 | x0 x1) (chi-square, the helpers of
    tests/test_hidden_state_drafters.py; a p-value under the threshold is decided by a second test on fresh seeds),
    and the same test fails against the target's distribution at temperature 1."""
    check_sampled_distribution_kept(target_dir, assistants["accepting"])


def check_sampled_distribution_kept(target_dir: Path, assistant_dir: Path) -> None:
    """Seeded sampled requests drafted by the assistant in ``assistant_dir``: the first three tokens' joint frequencies
    fit the target's at temperature 0.7 (a p-value under the threshold decided by a second test on fresh seeds) and
    not its distribution at temperature 1."""
    from tests.test_hidden_state_drafters import sampled_pvalue, triples_of

    prompt = repeating_prompt(LLM(str(target_dir), max_model_len=128))
    triples = triples_of(target_dir, prompt)
    expected = triples[0.7]

    def engine() -> LLM:
        return LLM(str(target_dir), max_model_len=128, max_num_seqs=64, speculative_config=spec(assistant_dir))

    pvalue = sampled_pvalue(None, None, "gemma4_assistant", prompt, expected, engine=engine)
    if pvalue <= 1e-3:
        pvalue = sampled_pvalue(None, None, "gemma4_assistant", prompt, expected, n=2400, first_seed=800,
                                engine=engine)
    assert pvalue > 1e-3
    assert sampled_pvalue(None, None, "gemma4_assistant", prompt, triples[1.0], engine=engine) < 1e-3


@pytest.fixture(scope="module")
def mismatched(vocab, tmp_path_factory) -> dict[str, Path]:
    """Assistants trained for another Gemma 4: another width, another vocabulary, other KV heads."""
    return {"backbone": save_assistant(tmp_path_factory.mktemp("g4a_narrow"), vocab, backbone=32),
            "vocab": save_assistant(tmp_path_factory.mktemp("g4a_vocab"), vocab + 8),
            "heads": save_assistant(tmp_path_factory.mktemp("g4a_heads"), vocab, num_key_value_heads=1)}


@pytest.mark.parametrize("case, match", [
    ("llama", "the target's model_type is 'llama'"),
    ("backbone", "backbone_hidden_size=32 does not match the target's hidden_size=64"),
    ("vocab", r"vocab_size=\d+ does not match the target's vocab_size"),
    ("heads", r"\(head_dim, num_key_value_heads\)=\(16, 1\) but the target's layer 2"),
    ("tp", "tensor_parallel_size=2: the assistant attends the target's K/V of every head"),
    ("tree", "use_dynamic_tree"),
    ("mtp", "use method='gemma4_assistant' with it"),
    ("no-model", "method='gemma4_assistant' needs the assistant's checkpoint folder"),
])
def test_refusals_name_the_field(target_dir, assistants, mismatched, make_tiny_model, tmp_path, case, match):
    """A non-Gemma-4 target, an assistant for another Gemma 4 (width, vocabulary, KV heads), tensor parallelism, a
    tree option, the assistant given to method='mtp', and no checkpoint: each a ValueError naming the field, before
    any worker starts."""
    model, config = str(target_dir), spec(assistants["random"])
    kwargs = {}
    if case == "llama":
        model = str(make_tiny_model(tmp_path / "llama", "llama"))
    elif case in mismatched:
        config = spec(mismatched[case])
    elif case == "tp":
        kwargs["tensor_parallel_size"] = 2
    elif case == "tree":
        config = spec(assistants["random"], use_dynamic_tree=True)
    elif case == "mtp":
        config = {**config, "method": "mtp"}
    elif case == "no-model":
        config = {k: v for k, v in config.items() if k != "model"}
    with pytest.raises(ValueError, match=match):
        LLM(model, max_model_len=128, speculative_config=config, **kwargs)
