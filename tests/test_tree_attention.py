"""Token trees of drafts through paged attention, against transformers on each root-to-node path (fp32).

A request's new tokens in one step: ``n`` ordinary tokens (a prefill chunk, or the last kept token) at slot
indices and positions ``s .. s+n-1``, then draft nodes. Node ``i`` is written to slot index ``s + n + i`` but gets
the RoPE position of its depth, ``P + depth`` (``P = s + n - 1``: the last ordinary token is the root), and sees
the cached context, the ordinary tokens, its ancestors and itself. Its logits must equal transformers' last
logits on ``prefix + path to the node``.

Covered: random trees (shuffled and consecutive block tables) in one step with plain chains, a decode token and
prefill chunks (fresh and continued) of other sequences, on the padded short batch and one sequence at a time
(forced by ``SHORT_QUERY_MAX = 0`` or by ``reads_in_place``: contexts read in place or gathered); the K/V a node
wrote (at its depth's RoPE) serving the next step once its path is kept; a 64-node tree (past
``SHORT_QUERY_MAX``) with and without cached context; sliding windows (Mistral, Qwen2 layer types), which
compare key positions, not slots; GQA (2 and 4 query heads per KV head).
"""

from __future__ import annotations

import random

import pytest
import torch

from specray.models import attention, cpu_kernels
from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import CAUSAL, allocate_kv_cache, slots_of
from specray.models.llama import LlamaForCausalLM
from specray.parallel import TPGroup

TOL = 1e-4  # max abs diff, relative to the logits' scale (when it exceeds 1)
BLOCK = 4
VOCAB = 100
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1, vocab_size=VOCAB,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager")
PATHS = ["batched", "own-max0", "own-reads-in-place"]


# ------------------------------------------------------------------------------------------ trees


def tree_structure(parents: list[int]) -> tuple[list[int], list[set[int]]]:
    """Per node its depth (a child of the root, ``-1``, has depth 1) and its ancestor nodes (the root and the
    ordinary tokens excluded). Parents come before their children."""
    depths: list[int] = []
    ancestors: list[set[int]] = []
    for i, p in enumerate(parents):
        assert -1 <= p < i, f"node {i}: parent {p} must be -1 (the root) or an earlier node"
        depths.append(1 if p < 0 else depths[p] + 1)
        ancestors.append(set() if p < 0 else ancestors[p] | {p})
    return depths, ancestors


def tree_inputs(start: int, n: int, parents: list[int]) -> tuple[list[int], torch.Tensor]:
    """The positions [n + N] and the ancestor mask [n + N, n + N] of a chunk of ``n`` ordinary tokens from slot
    index ``start`` followed by the tree's ``N`` nodes: ordinary tokens causal among themselves, a node's row
    sees every ordinary token, its ancestors and itself."""
    depths, ancestors = tree_structure(parents)
    root = start + n - 1
    positions = list(range(start, start + n)) + [root + d for d in depths]
    q = n + len(parents)
    mask = torch.zeros(q, q, dtype=torch.bool)
    mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    for i, anc in enumerate(ancestors):
        mask[n + i, :n] = True
        mask[n + i, n + i] = True
        for a in anc:
            mask[n + i, n + a] = True
    return positions, mask


def path_to(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def random_tree(rng: random.Random, size: int, max_depth: int, max_branch: int) -> list[int]:
    """Parents of a random tree of ``size`` nodes (depth <= max_depth, children per node <= max_branch), in a
    random order where parents still precede children (not BFS, not DFS)."""
    parents, depths, children = [], [], {-1: 0}
    while len(parents) < size:
        open_ = [p for p in [-1, *range(len(parents))]
                 if children[p] < max_branch and (p < 0 or depths[p] < max_depth)]
        p = rng.choice(open_)
        children[p] += 1
        children[len(parents)] = 0
        depths.append(1 if p < 0 else depths[p] + 1)
        parents.append(p)
    # a random topological order: repeatedly pick any node whose parent is placed
    order, placed, left = [], {-1}, list(range(size))
    while left:
        ready = [i for i in left if parents[i] in placed]
        i = rng.choice(ready)
        order.append(i)
        placed.add(i)
        left.remove(i)
    new = {old: k for k, old in enumerate(order)}
    return [-1 if parents[old] < 0 else new[parents[old]] for old in order]


def deep_tree(rng: random.Random, size: int, depth: int, max_branch: int) -> list[int]:
    """A random tree of exactly ``depth`` levels: a chain of ``depth`` nodes first, then random nodes."""
    parents = [-1] + list(range(depth - 1))
    depths = list(range(1, depth + 1))
    children = {-1: 1, **{i: 1 for i in range(depth - 1)}, depth - 1: 0}
    while len(parents) < size:
        p = rng.choice([p for p in [-1, *range(len(parents))]
                        if children[p] < max_branch and (p < 0 or depths[p] < depth)])
        children[p] += 1
        children[len(parents)] = 0
        depths.append(1 if p < 0 else depths[p] + 1)
        parents.append(p)
    return parents


def test_tree_helper_on_a_fixed_tree():
    #        root
    #       /    \
    #      0      1
    #     / \     |
    #    2   3    4
    #    |
    #    5
    parents = [-1, -1, 0, 0, 1, 2]
    depths, ancestors = tree_structure(parents)
    assert depths == [1, 1, 2, 2, 2, 3]
    assert ancestors == [set(), set(), {0}, {0}, {1}, {0, 2}]
    positions, mask = tree_inputs(start=10, n=2, parents=parents)
    assert positions == [10, 11, 12, 12, 13, 13, 13, 14]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],  # node 0
        [1, 1, 0, 1, 0, 0, 0, 0],  # node 1
        [1, 1, 1, 0, 1, 0, 0, 0],  # node 2: node 0
        [1, 1, 1, 0, 0, 1, 0, 0],  # node 3: node 0
        [1, 1, 0, 1, 0, 0, 1, 0],  # node 4: node 1
        [1, 1, 1, 0, 1, 0, 0, 1],  # node 5: nodes 0, 2
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert path_to(parents, 5) == [0, 2, 5]
    rng = random.Random(0)
    for _ in range(20):
        tree = random_tree(rng, rng.randint(1, 12), 4, 3)
        depths, _ = tree_structure(tree)
        assert max(depths) <= 4 and all(tree.count(p) <= 3 for p in [-1, *range(len(tree))])


# ------------------------------------------------------------------------------------------ models


def make_pair(arch: str = "llama", seed: int = 0, **overrides):
    """(ours, transformers, eager attention) sharing the weights of a random tiny model."""
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama, MistralConfig, MistralForCausalLM
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = {"llama": (LlamaConfig, HFLlama), "mistral": (MistralConfig, MistralForCausalLM),
                          "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = cfg_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    hf = model_cls(config).float().eval()
    assert hf.config._attn_implementation == "eager"
    ours = LlamaForCausalLM(config, TPGroup.single())
    ours.load_weights(hf.state_dict().items())
    return ours, hf


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama", seed=1)  # 4 query heads over 2 KV heads (GQA)


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()  # [L, V]


def close(ours: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    tol = TOL * max(1.0, ref.abs().max().item())
    diff = (ours - ref).abs().max().item()
    assert diff < tol, f"{what}: max abs diff {diff:.3g} (tolerance {tol:.3g})"


class Paged:
    """Our model over a paged cache: block tables shuffled (non-consecutive) or consecutive runs."""

    def __init__(self, model, num_blocks: int = 96, seed: int = 0, consecutive: bool = False):
        self.model = model
        self.cache = allocate_kv_cache(model, num_blocks, BLOCK)
        self.free = list(range(num_blocks))[::-1]
        if not consecutive:
            random.Random(seed).shuffle(self.free)

    def table(self, length: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-length // BLOCK))]

    @torch.no_grad()
    def step(self, chunks: list[tuple[list[int], int, list[int]]], **meta_kw):
        """chunks: (new token ids, start slot index, block table) -> (logits [q, V] per sequence, the plan)."""
        ids = torch.tensor([t for c in chunks for t in c[0]])
        meta = build_attention_metadata([len(c[0]) for c in chunks], [c[1] for c in chunks],
                                        [c[2] for c in chunks], BLOCK, "cpu", **meta_kw)
        logits = self.model.compute_logits(self.model(ids, meta))
        return list(logits.split([len(c[0]) for c in chunks])), meta


@pytest.fixture(params=PATHS)
def path(request, monkeypatch) -> str:
    """Where short queries attend: the padded batch (the default at these short contexts), or one sequence at a
    time, forced by ``SHORT_QUERY_MAX = 0`` or by ``reads_in_place`` saying so (as on CPU at long contexts)."""
    if request.param == "own-max0":
        monkeypatch.setattr(attention, "SHORT_QUERY_MAX", 0)
    elif request.param == "own-reads-in-place":
        monkeypatch.setattr(cpu_kernels, "reads_in_place", lambda device, context_lens: True)
    return request.param


def consecutive(blocks: list[int]) -> bool:
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def check_plan(meta, path: str, tables: list[list[int]], query_lens: list[int], layout: str) -> None:
    """The step took the path asked for; on the own path, each continued sequence reads its context in place
    exactly when its blocks are consecutive, else gathers them (some do on shuffled tables, none on
    consecutive ones)."""
    short_ids = [] if meta.short is None else meta.short.seq_ids
    own = {seq.seq_id: seq for seq in meta.own}
    if path == "batched":
        assert short_ids == [i for i, q in enumerate(query_lens) if q <= attention.SHORT_QUERY_MAX]
    else:
        assert meta.short is None and sorted(own) == list(range(len(query_lens)))
    for i, seq in own.items():
        if seq.fresh:
            assert seq.first_slot is None and seq.block_index is None
        else:
            used = tables[i][: -(-seq.context_len // BLOCK)]
            assert (seq.first_slot is not None) == consecutive(used) == (seq.block_index is None), (i, used)
    if path != "batched":
        gathered = [seq.block_index is not None for seq in meta.own]
        assert any(gathered) if layout == "shuffled" else not any(gathered)


class Tree:
    """One request bringing ``n`` ordinary tokens from slot index ``start`` and a token tree."""

    def __init__(self, ids: list[int], start: int, n: int, parents: list[int], node_ids: list[int]):
        self.ids, self.start, self.n, self.parents, self.node_ids = ids, start, n, parents, node_ids
        self.positions, self.mask = tree_inputs(start, n, parents)

    @property
    def prefix(self) -> list[int]:  # the cached context and the ordinary tokens
        return self.ids[: self.start + self.n]

    @property
    def new_ids(self) -> list[int]:
        return self.ids[self.start : self.start + self.n] + self.node_ids

    @property
    def length(self) -> int:  # slot indices the step uses
        return self.start + self.n + len(self.parents)

    def path_ids(self, node: int) -> list[int]:
        return self.prefix + [self.node_ids[j] for j in path_to(self.parents, node)]

    def references(self, hf) -> torch.Tensor:
        """[n + N, V]: transformers' logits of the ordinary tokens and, per node, the last logits of prefix +
        path to it (one forward per leaf fills every node on its path)."""
        rows: list[torch.Tensor | None] = [None] * len(self.parents)
        is_parent = set(self.parents)
        leaves = [i for i in range(len(self.parents)) if i not in is_parent]
        ordinary = None
        for leaf in leaves:
            path = path_to(self.parents, leaf)
            ref = hf_logits(hf, self.path_ids(leaf))
            base = len(self.prefix)
            ordinary = ref[self.start : base] if ordinary is None else ordinary
            for k, node in enumerate(path):
                if rows[node] is None:
                    rows[node] = ref[base + k]
        assert all(r is not None for r in rows)
        return torch.cat([ordinary, torch.stack(rows)])

    def check(self, out: torch.Tensor, hf, what: str) -> None:
        ref = self.references(hf)
        close(out[: self.n], ref[: self.n], f"{what}: ordinary tokens")
        depths, _ = tree_structure(self.parents)
        for i, depth in enumerate(depths):
            close(out[self.n + i], ref[self.n + i], f"{what}: node {i} (depth {depth})")


def keep_path_and_decode(paged: Paged, hf, tree: Tree, table: list[int], node: int, next_id: int) -> None:
    """Keep the path to ``node``: move its nodes' K/V (written at their depth's RoPE position) to the slot
    indices following the ordinary tokens, then decode one more token; equal to transformers on path + token."""
    path = path_to(tree.parents, node)
    base = tree.start + tree.n
    src = slots_of(table, [base + j for j in path], BLOCK)
    dst = slots_of(table, range(base, base + len(path)), BLOCK)
    paged.cache.copy_slots(torch.tensor(src), torch.tensor(dst))
    ids = tree.path_ids(node) + [next_id]
    (out,), _ = paged.step([([next_id], base + len(path), table)])
    close(out, hf_logits(hf, ids)[-1:], f"decode after keeping the path to node {node}")


# ------------------------------------------------------------------------------------------ random trees, mixed


@pytest.mark.parametrize("layout", ["shuffled", "consecutive"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_trees_mixed_with_chains_and_prefills(llama, path, layout, seed):
    """One step: two trees (after the last kept token, after a 3-token prefill chunk), a chain of last token + 4
    drafts, a decode token, a fresh prefill and a long continued prefill chunk. Every node equals transformers
    on prefix + its path, the ordinary tokens and the chains equal transformers on their prefixes."""
    ours, hf = llama
    rng = random.Random(100 + seed)
    paged = Paged(ours, seed=seed, consecutive=layout == "consecutive")
    # trees: depth <= 4, branching <= 3, at most 12 nodes (with the ordinary tokens, a short query)
    t1 = Tree(tokens(14, rng), start=13, n=1, parents=random_tree(rng, rng.randint(5, 12), 4, 3), node_ids=[])
    t2 = Tree(tokens(12, rng), start=9, n=3, parents=random_tree(rng, rng.randint(5, 12), 4, 3), node_ids=[])
    for t in (t1, t2):
        t.node_ids = tokens(len(t.parents), rng)
    chain, dec, fresh, long_ = tokens(16, rng), tokens(8, rng), tokens(7, rng), tokens(30, rng)
    tables = {"t1": paged.table(t1.length), "chain": paged.table(16), "long": paged.table(30),
              "t2": paged.table(t2.length), "dec": paged.table(8), "fresh": paged.table(7)}

    # prefill of each prefix (the long chunk goes through the own path, the rest the step's path)
    plan = [(t1.ids[: t1.start], 0, tables["t1"]), (chain[:11], 0, tables["chain"]), (long_[:10], 0, tables["long"]),
            (t2.ids[: t2.start], 0, tables["t2"]), (dec[:7], 0, tables["dec"])]
    outs, _ = paged.step(plan)
    for (ids, _, _), out, full in zip(plan, outs, (t1.ids, chain, long_, t2.ids, dec)):
        close(out, hf_logits(hf, full[: len(ids)]), "prefill")

    # the tree step, in one forward
    names = ["chain", "t1", "long", "fresh", "t2", "dec"]
    chunks = [(chain[11:16], 11, tables["chain"]), (t1.new_ids, t1.start, tables["t1"]),
              (long_[10:30], 10, tables["long"]), (fresh, 0, tables["fresh"]), (t2.new_ids, t2.start, tables["t2"]),
              (dec[7:8], 7, tables["dec"])]
    positions = (list(range(11, 16)) + t1.positions + list(range(10, 30)) + list(range(7)) + t2.positions + [7])
    ancestors = [None, t1.mask, None, None, t2.mask, None]
    outs, meta = paged.step(chunks, positions=positions, ancestors=ancestors)
    check_plan(meta, path, [tables[n] for n in names], [len(c[0]) for c in chunks], layout)
    if path == "batched":
        assert meta.short.seq_ids == [0, 1, 3, 4, 5]  # the trees share the padded batch with the chains
    out = dict(zip(names, outs))
    t1.check(out["t1"], hf, "tree 1")
    t2.check(out["t2"], hf, "tree 2")
    close(out["chain"], hf_logits(hf, chain)[11:16], "chain")
    close(out["long"], hf_logits(hf, long_)[10:30], "long prefill chunk")
    close(out["fresh"], hf_logits(hf, fresh), "fresh prefill")
    close(out["dec"], hf_logits(hf, dec)[7:8], "decode")

    # the K/V the nodes wrote serve the next step once a path is kept (the deepest leaf's, a shallow node's)
    for t, name in ((t1, "t1"), (t2, "t2")):
        depths, _ = tree_structure(t.parents)
        node = max(range(len(depths)), key=lambda i: (depths[i], i)) if t is t1 else len(t.parents) - 1
        keep_path_and_decode(paged, hf, t, tables[name], node, rng.randrange(VOCAB))


# ------------------------------------------------------------------------------------------ a 64-node tree


@pytest.mark.parametrize("layout", ["shuffled", "consecutive"])
def test_64_node_tree_takes_the_own_path(llama, layout):
    """A 64-node tree of depth 6 (past SHORT_QUERY_MAX: attended on its own) after a cached context, and one as
    part of a fresh prefill, beside a short chain in the padded batch."""
    ours, hf = llama
    rng = random.Random(7)
    paged = Paged(ours, seed=3, consecutive=layout == "consecutive")
    parents = deep_tree(rng, 64, depth=6, max_branch=3)
    depths, _ = tree_structure(parents)
    assert len(parents) == 64 > attention.SHORT_QUERY_MAX and max(depths) == 6
    cached = Tree(tokens(19, rng), start=17, n=2, parents=parents, node_ids=tokens(64, rng))
    fresh = Tree(tokens(5, rng), start=0, n=5, parents=parents, node_ids=tokens(64, rng))
    chain = tokens(12, rng)
    tc, tf, tch = paged.table(cached.length), paged.table(fresh.length), paged.table(12)
    paged.step([(cached.ids[:17], 0, tc), (chain[:9], 0, tch)])
    chunks = [(chain[9:12], 9, tch), (cached.new_ids, 17, tc), (fresh.new_ids, 0, tf)]
    outs, meta = paged.step(chunks, positions=list(range(9, 12)) + cached.positions + fresh.positions,
                            ancestors=[None, cached.mask, fresh.mask])
    assert meta.short.seq_ids == [0] and [s.seq_id for s in meta.own] == [1, 2]
    check_plan(meta, "batched", [tch, tc, tf], [len(c[0]) for c in chunks], layout)
    assert meta.own[1].fresh and meta.own_mask(1, 2, CAUSAL).shape == (69, 69)
    close(outs[0], hf_logits(hf, chain)[9:12], "chain")
    cached.check(outs[1], hf, "64-node tree after a cached context")
    fresh.check(outs[2], hf, "64-node tree in a fresh prefill")


# ------------------------------------------------------------------------------------------ sliding windows


WINDOWS = {
    # every layer a window of 3, smaller than the tree's depth: deep nodes lose their first ancestors too
    "mistral-window3-gqa4": ("mistral", dict(sliding_window=3, num_key_value_heads=1)),
    # Qwen2: layer 0 full, layer 1 a window of 5
    "qwen2-window5-layer1": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
}


@pytest.mark.parametrize("layout", ["shuffled", "consecutive"])
@pytest.mark.parametrize("name", sorted(WINDOWS))
def test_sliding_window_compares_positions_not_slots(path, layout, name):
    """Trees whose nodes sit many slots past their positions (a wide first level, BFS order): each node sees the
    keys within the window of its position P + depth (not of its slot), as transformers on prefix + path."""
    arch, overrides = WINDOWS[name]
    ours, hf = make_pair(arch, seed=11, **overrides)
    window = overrides["sliding_window"]
    assert window in [spec.mask_kind.window for spec in ours.kv_cache_specs()]
    rng = random.Random(5)
    paged = Paged(ours, seed=4, consecutive=layout == "consecutive")
    # BFS: three children of the root, two under the first, then a chain down to depth 4
    parents = [-1, -1, -1, 0, 0, 1, 3, 6, 2]
    wide = Tree(tokens(17, rng), start=14, n=3, parents=parents, node_ids=tokens(len(parents), rng))
    rand = Tree(tokens(11, rng), start=10, n=1, parents=random_tree(rng, 12, 4, 3), node_ids=[])
    rand.node_ids = tokens(12, rng)
    for t in (wide, rand):  # some node's slot index lies at least a window past its position
        slots = range(t.start, t.start + len(t.positions))
        assert max(s - p for s, p in zip(slots, t.positions)) >= window
    chain = tokens(15, rng)
    tw, tr, tch = paged.table(wide.length), paged.table(rand.length), paged.table(15)
    outs, _ = paged.step([(wide.ids[:14], 0, tw), (rand.ids[:10], 0, tr), (chain[:10], 0, tch)])
    close(outs[0], hf_logits(hf, wide.ids[:14]), "prefill")
    chunks = [(wide.new_ids, 14, tw), (chain[10:15], 10, tch), (rand.new_ids, 10, tr)]
    outs, meta = paged.step(chunks, positions=wide.positions + list(range(10, 15)) + rand.positions,
                            ancestors=[wide.mask, None, rand.mask])
    check_plan(meta, path, [tw, tch, tr], [len(c[0]) for c in chunks], layout)
    wide.check(outs[0], hf, f"{name}: wide tree")
    close(outs[1], hf_logits(hf, chain)[10:15], f"{name}: chain")
    rand.check(outs[2], hf, f"{name}: random tree")
