"""Medusa heads: the public checkpoint layouts, their checks, and medusa_choices (the engine's greedy identity,
preemption, stop strings and distribution tests run Medusa in tests/test_hidden_state_drafters.py)."""

from __future__ import annotations

import json

import pytest
import torch

from specray import LLM, SamplingParams
from specray.drafters.hidden_state import DEFAULT_MEDUSA_CHOICES, MedusaOptions
from specray.models.loader import load_hf_config
from specray.models.medusa import MedusaHeads, load_medusa_heads, save_medusa_heads


import specray_test_draft_heads as draft_heads  # tests/draft_heads.py (tests/conftest.py registers it)


@pytest.fixture(scope="module")
def target_dir(make_tiny_model, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("medusa_target"), "llama", num_hidden_layers=2)


@pytest.mark.parametrize("layout", ["medusa", "vllm"])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_both_layouts_load_what_was_written(target_dir, tmp_path, layout, num_layers):
    folder = draft_heads.write_medusa_heads(tmp_path / "heads", target_dir, num_heads=3, num_layers=num_layers,
                                            layout=layout)
    names = json.loads((folder / "config.json").read_text())
    assert ("medusa_num_heads" in names) == (layout == "medusa") and ("num_heads" in names) == (layout == "vllm")
    heads = load_medusa_heads(str(folder), load_hf_config(str(target_dir)), torch.float32, "cpu")
    assert (heads.num_heads, heads.num_layers) == (3, num_layers)
    # the same tensors read back by hand, and the heads' math: x + SiLU(W x + b) per block, then the LM head
    from safetensors.torch import load_file

    raw = load_file(str(next(folder.glob("*.safetensors"))))
    x = torch.randn(5, heads.lm_heads[0].weight.shape[1])
    for k in range(3):
        h = x
        for j in range(num_layers):
            w, b = ((raw[f"{k}.{j}.linear.weight"], raw[f"{k}.{j}.linear.bias"]) if layout == "medusa" else
                    (raw[f"blocks.{k}.layers.{j}.weight"], raw[f"blocks.{k}.layers.{j}.bias"]))
            h = h + torch.nn.functional.silu(h @ w.T + b)
        lm = raw[f"{k}.{num_layers}.weight"] if layout == "medusa" else raw[f"lm_heads.{k}.weight"]
        torch.testing.assert_close(heads(x)[:, k], h @ lm.T)


def test_prefixed_names_and_a_pt_file_load(target_dir, tmp_path):
    config = load_hf_config(str(target_dir))
    heads = MedusaHeads(2, 1, config.hidden_size, config.vocab_size)
    folder = tmp_path / "pt"
    save_medusa_heads(heads, folder)
    from safetensors.torch import load_file

    state = {f"medusa_head.{k}": v for k, v in load_file(str(folder / "medusa_lm_head.safetensors")).items()}
    (folder / "medusa_lm_head.safetensors").unlink()
    torch.save(state, folder / "medusa_lm_head.pt")
    loaded = load_medusa_heads(str(folder), config, torch.float32, "cpu")
    x = torch.randn(3, config.hidden_size)
    torch.testing.assert_close(loaded(x), heads(x))


def test_heads_for_another_model_are_refused(target_dir, tmp_path):
    config = load_hf_config(str(target_dir))
    save_medusa_heads(MedusaHeads(2, 1, config.hidden_size * 2, config.vocab_size), tmp_path / "wide")
    with pytest.raises(ValueError, match="trained for another model"):
        load_medusa_heads(str(tmp_path / "wide"), config, torch.float32, "cpu")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no .*safetensors"):
        load_medusa_heads(str(tmp_path / "empty"), config, torch.float32, "cpu")
    from safetensors.torch import save_file

    save_file({"0.0.linear.weight": torch.zeros(2, 2)}, str(tmp_path / "empty" / "x.safetensors"))
    with pytest.raises(ValueError, match="no LM heads"):
        load_medusa_heads(str(tmp_path / "empty"), config, torch.float32, "cpu")


def test_medusa_choices_are_checked_and_ordered():
    assert MedusaOptions(model="m").tree() == [list(c) for c in DEFAULT_MEDUSA_CHOICES]
    given = [[0], [1], [0, 0], [0, 1]]
    assert MedusaOptions(model="m", medusa_choices=given).tree() == given  # every path after its prefix: as given
    assert MedusaOptions(model="m", medusa_choices=[[0, 0], [1], [0]]).tree() == [[0], [1], [0, 0]]
    for bad, why in [([[0, 1]], "without their parent"), ([[0], [0]], "twice"), ([], "non-empty"),
                     ([[0], [-1]], "non-empty list"), ("0,1", "non-empty list"), ([[0], [True]], "non-empty list")]:
        with pytest.raises(ValueError, match=why):
            MedusaOptions(model="m", medusa_choices=bad)
    with pytest.raises(ValueError, match="needs the heads' checkpoint"):
        MedusaOptions()


def test_a_tree_deeper_than_the_heads_is_refused(target_dir, tmp_path):
    folder = draft_heads.write_medusa_heads(tmp_path / "two", target_dir, num_heads=2)
    with pytest.raises(ValueError, match="3 levels deep but the checkpoint has 2 heads"):
        LLM(str(target_dir), speculative_config={"method": "medusa", "model": str(folder),
                                                 "medusa_choices": [[0], [0, 0], [0, 0, 0]]})


def test_a_tree_asking_past_the_heads_vocabulary_is_refused():
    """A tree option asking a node for more of its best tokens than the head's vocabulary holds (Medusa's
    medusa_choices, DFlash's tree, EAGLE-2's dynamic_tree_max_topK, a static speculative_token_tree, the MLP
    speculator's top_k_tokens_per_head) is a ValueError naming it when the drafter is built; it was accepted, then
    every step's top-k failed and every request lost its drafts."""
    from types import SimpleNamespace

    from specray.models.medusa import MedusaHeads
    from specray.models.mlp_speculator import MLPSpeculatorHead
    from specray.workers.head_drafter import HiddenStateDrafter, StaticShape, TreeShape
    from specray.workers.medusa_drafter import MedusaDrafter
    from specray.workers.mlp_speculator_drafter import MLPSpeculatorDrafter

    vocab = "but the head drafts from a vocabulary of 16: give at most 16 per node"
    assert MedusaDrafter(MedusaHeads(2, 1, 8, 16), [[0], [15], [0, 0]]).top_k == 16
    with pytest.raises(ValueError, match=rf"medusa_choices asks a node for its 17 best tokens {vocab}"):
        MedusaDrafter(MedusaHeads(2, 1, 8, 16), [[0], [16]])
    MLPSpeculatorDrafter(MLPSpeculatorHead(8, 8, 16, 2, False, False), candidates=([16, 1], 2))
    with pytest.raises(ValueError, match=rf"top_k_tokens_per_head asks a node for its 17 best tokens {vocab}"):
        MLPSpeculatorDrafter(MLPSpeculatorHead(8, 8, 16, 2, False, False), candidates=([17, 1], 2))
    head = SimpleNamespace(tp=None, draft_vocab_size=16)  # (EAGLE-3's draft vocabulary; refused before any cache)
    with pytest.raises(ValueError, match=rf"dynamic_tree_max_topK asks a node for its 17 best tokens {vocab}"):
        HiddenStateDrafter(head, 4, 4, TreeShape(17, 2))
    with pytest.raises(ValueError, match=rf"speculative_token_tree asks a node for its 21 best tokens {vocab}"):
        HiddenStateDrafter(head, 4, 4, StaticShape([[0], [20]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_drafted_token_ids_survive_the_heads_dtype(dtype):
    """A GPU model's heads run in bf16 or fp16, which hold integers exactly only up to 256 or 2048: the drafts'
    token ids must reach the host exact (vocabularies run to 49k-256k)."""
    from specray.contract import ScheduledChunk, StepPlan
    from specray.workers.medusa_drafter import MedusaDrafter

    vocab, peaks = 50000, (40001, 30003)

    class Heads:
        num_heads, tp, vocab_size = 2, None, vocab

        def __call__(self, hidden):
            logits = torch.zeros(hidden.shape[0], self.num_heads, vocab, dtype=dtype)
            for k, token in enumerate(peaks):
                logits[:, k, token] = 20.0
            return logits

    drafter = MedusaDrafter(Heads(), [[0], [0, 0]])
    plan = StepPlan(0, chunks=[ScheduledChunk("r", [5], start_pos=3, num_next_drafts=2)])
    [drafted] = drafter.draft(plan, {}, torch.zeros(1, 8, dtype=dtype), [], {0: [7]}, {})
    assert drafted.token_ids == list(peaks) and drafted.parents == [-1, 0]


# ---- a sampled request's tree drawn from q ------------------------------------------------------------------------

HIDDEN, VOCAB = 16, 40
CHOICES = [list(c) for c in DEFAULT_MEDUSA_CHOICES]  # 4 children at the root, 4 levels


def random_heads(seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(4, 1, HIDDEN, VOCAB)
    with torch.no_grad():
        for w in heads.parameters():
            w.mul_(8.0)  # peaked enough that a head's top-k and its draws differ only sometimes
    return heads


def draft_for(drafter, params: dict, hidden: torch.Tensor, n: int = len(CHOICES)):
    """One step in which every request of ``params`` (one committed token each, its hidden row in ``hidden``) asks
    for ``n`` drafts -> {request id: Drafted}."""
    from specray.contract import ScheduledChunk, StepPlan

    ids = list(params)
    plan = StepPlan(0, chunks=[ScheduledChunk(rid, [5], start_pos=3, num_next_drafts=n) for rid in ids])
    made = drafter.draft(plan, {}, hidden, [], {i: [7] for i in range(len(ids))}, {}, params)
    return dict(zip(ids, made))


def warped(heads: MedusaHeads, hidden: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Each head's q for one request: its warpers over the head's logits [K, V]."""
    from specray.sampling import SamplingBatch, logits_to_probs

    with torch.no_grad():
        logits = heads(hidden[None])[0]
    return logits_to_probs(logits, SamplingBatch.build([sp] * len(logits), [None] * len(logits), "cpu"))


def top_k_tree(heads: MedusaHeads, hidden: torch.Tensor) -> list[int]:
    with torch.no_grad():
        probs = torch.softmax(heads(hidden[None])[0], dim=-1)
    return [int(probs[len(c) - 1].topk(4).indices[c[-1]]) for c in CHOICES]


def test_a_sampled_requests_tree_is_drawn_from_each_heads_q_and_hands_that_q_to_verification():
    """Beside a greedy request (the heads' top-k tree, scored, no q), a sampled one's tree has medusa_choices' shape,
    no scores, distinct siblings, each token with mass under the q of its depth's head; the q rows for verification
    are the heads' warped distributions (row 0 head 0's, a node's row head depth(node)'s, a leaf's zero). Seeded,
    the same tree comes back; over seeds, the drawn trees are not the top-k one every time."""
    from specray.workers.medusa_drafter import MedusaDrafter

    heads = random_heads()
    hidden = torch.randn(2, HIDDEN)
    parents = MedusaDrafter(heads, CHOICES).parents
    differ = 0
    for seed in range(20):
        sp = SamplingParams(temperature=1.0, seed=seed)
        drafter = MedusaDrafter(heads, CHOICES)
        made = draft_for(drafter, {"g": SamplingParams(temperature=0.0), "s": sp}, hidden)
        assert made["g"].token_ids == top_k_tree(heads, hidden[0]) and len(made["g"].scores) == len(CHOICES)
        assert drafter.q_of("g", made["g"].token_ids, made["g"].parents) is None
        tree = made["s"]
        assert tree.parents == parents and tree.scores is None
        q = drafter.q_of("s", tree.token_ids, tree.parents)
        heads_q = warped(heads, hidden[1], sp)
        for row in range(len(CHOICES) + 1):
            kids = [n for n, p in enumerate(parents) if p == row - 1]
            want = heads_q[0 if row == 0 else len(CHOICES[row - 1])] if kids else torch.zeros(VOCAB)
            torch.testing.assert_close(q[row], want)
            tokens = [tree.token_ids[n] for n in kids]
            assert len(set(tokens)) == len(tokens) and all(q[row, t] > 0 for t in tokens), (row, tokens)
        again = draft_for(MedusaDrafter(heads, CHOICES), {"g": SamplingParams(temperature=0.0), "s": sp}, hidden)
        assert again["s"].token_ids == tree.token_ids  # the request's own draft stream
        differ += tree.token_ids != top_k_tree(heads, hidden[1])
    assert 0 < differ < 20, differ


def test_nodes_past_q_support_are_dropped_with_their_subtrees_and_a_cut_tree_reads_its_nodes_rows():
    """Top-k 2: the root's third and fourth children (and nothing under them) have no mass, so they are dropped and
    the rest keeps medusa_choices' shape. The engine cuts a tree to a prefix (its policy) and the scheduler to the
    first nodes no deeper than a depth (max_tokens): q_of gives the rows of the nodes each kept."""
    from specray.tree import DraftTree, trim_tree
    from specray.workers.medusa_drafter import MedusaDrafter

    heads, hidden = random_heads(1), torch.randn(1, HIDDEN)
    drafter = MedusaDrafter(heads, CHOICES)
    tree = draft_for(drafter, {"s": SamplingParams(temperature=1.0, top_k=2, seed=3)}, hidden)["s"]
    kept = [c for c in CHOICES if max(c) < 2]
    index = {tuple(c): i for i, c in enumerate(kept)}
    assert tree.parents == [index[tuple(c[:-1])] if len(c) > 1 else -1 for c in kept]
    q = drafter.q_of("s", tree.token_ids, tree.parents)
    assert q.shape == (len(kept) + 1, VOCAB) and all(int((row > 0).sum()) in (0, 2) for row in q)
    torch.testing.assert_close(drafter.q_of("s", tree.token_ids[:3], tree.parents[:3]), q[:4])
    shallow = trim_tree(DraftTree(tree.token_ids, tree.parents), 3, max_depth=1)  # nodes 0 and 2: not a prefix
    assert shallow.parents == [-1, -1]
    torch.testing.assert_close(drafter.q_of("s", shallow.token_ids, shallow.parents), q[[0, 1, 3]])
    with pytest.raises(AssertionError):
        drafter.q_of("s", tree.token_ids[::-1], tree.parents)  # not what was drawn


def test_every_rank_of_a_split_head_draws_the_same_tree_and_only_the_driver_keeps_q():
    """An unseeded request on a head split over ranks: each rank's drafter draws from a stream seeded by the engine's
    seed and the request's id alone, so the trees agree; only the driver (which verifies) keeps q."""
    from types import SimpleNamespace

    from specray.workers.medusa_drafter import MedusaDrafter

    heads, hidden = random_heads(2), torch.randn(1, HIDDEN)
    sp = SamplingParams(temperature=1.0)
    trees = []
    for driver, seed in ((True, 7), (False, 7), (True, 8)):
        drafter = MedusaDrafter(heads, CHOICES, driver=driver, seed=seed)
        drafter.tp = SimpleNamespace(size=2)  # split: the heads' logits are all-gathered, the draws are each rank's
        torch.manual_seed(len(trees))  # the process's own stream differs per rank
        trees.append(draft_for(drafter, {"r": sp}, hidden)["r"].token_ids)
        assert (drafter.q_of("r", trees[-1], None) is not None) == driver
    assert trees[0] == trees[1] and trees[2] != trees[0]
