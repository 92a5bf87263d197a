"""DFlash (``method="dflash"``) through the engine, on a tiny random 6-layer target: after every step, the drafter's
K/V at committed positions and the drafts it returned equal a dense reference written out here from the method's
math (transformers' target for the hidden states, the checkpoint's tensors, plain attention over the context and
the block); greedy output equals plain greedy output (mixed batches, one request at a time, preemption, chunked
prefill, prefix caching); sampling keeps the target's distribution; the scheduler reserves the block's slots; bad
checkpoints and settings get clear errors.

Two heads: a random one (two layers, one causal with a window, one attending the block both ways: ~0 acceptance) and
one built to draft "the sampled token again" (``draft_heads.write_dflash(accepting=True)``), which the target's runs
of repeated tokens often accept, so the accepted-drafts path really runs. The target's mask token (its last id)
embeds to zero (``draft_heads.zero_mask_row``), which the accepting head relies on."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from specray import LLM, SamplingParams
from specray.models.kv_cache import slots_of
from specray.sampling import SamplingBatch, logits_to_probs
import specray_test_draft_heads as draft_heads  # tests/draft_heads.py (tests/conftest.py registers it)
from specray_test_engine_runs import PROMPTS, Recorder, check_sampled_distribution, greedy  # tests/engine_runs.py

K = 3  # drafts per step (the accepting head's block holds the sampled token and 3)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def target_dir(make_tiny_model, tmp_path_factory) -> Path:
    folder = make_tiny_model(tmp_path_factory.mktemp("dflash_target"), "llama", num_hidden_layers=6,
                             tie_word_embeddings=True)
    return draft_heads.zero_mask_row(folder)


@pytest.fixture(scope="module")
def heads(target_dir, tmp_path_factory) -> dict[str, Path]:
    return {
        # layer 0 causal in a window of 6, layer 1 attending the block both ways (the two kinds of masks)
        "random": draft_heads.write_dflash(tmp_path_factory.mktemp("dflash_random"), target_dir, num_layers=2,
                                           block_size=5, layer_types=["sliding_attention", "full_attention"],
                                           sliding_window=6),
        "accepting": draft_heads.write_dflash(tmp_path_factory.mktemp("dflash_accepting"), target_dir, num_layers=K,
                                              block_size=K + 1, accepting=True),
    }


# a token tree of 7 nodes over 3 levels: depth d + 1 from block row d + 1's top-k
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2]]


def spec(heads, kind: str, tree: bool = False, **kw) -> dict:
    extra = {"speculative_token_tree": TREE, "num_speculative_tokens": len(TREE)} if tree else {}
    return {"method": "dflash", "model": str(heads[kind]), "num_speculative_tokens": K, "adaptive": False, **extra,
            **kw}


def make_llm(target_dir, heads, kind: str, tree: bool = False, **kw) -> LLM:
    return LLM(str(target_dir), max_model_len=256, speculative_config=spec(heads, kind, tree), **kw)


@pytest.fixture(scope="module")
def plain(target_dir):
    return LLM(str(target_dir), max_model_len=256)


@pytest.fixture(scope="module")
def plain_outputs(plain):
    return [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(), use_tqdm=False)]


def free_blocks(llm) -> int:
    return llm.engine.scheduler.block_manager.num_free_blocks


# ---- the dense reference -----------------------------------------------------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D] rotated by position, the two halves of each head as the pairs (rotate-half)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions[:, None].double() * inv[None, :]  # [T, D/2]
    cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class DenseDFlash:
    """The method's math over one sequence from scratch: transformers' target for the residual streams, the
    checkpoint's tensors, attention as softmax(q k^T / sqrt(D)) v over every visible key."""

    def __init__(self, target_dir: Path, head_dir: Path):
        self.target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        raw = json.loads((head_dir / "config.json").read_text())
        self.config = AutoConfig.from_pretrained(str(head_dir))
        self.w = load_file(str(head_dir / "model.safetensors"))
        self.layer_ids = raw["dflash_config"]["target_layer_ids"]
        self.mask = raw["dflash_config"]["mask_token_id"]
        self.eps = raw["rms_norm_eps"]
        self.heads, self.kv, self.d = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
        self.theta = self.config.rope_parameters["rope_theta"]
        kinds = raw.get("layer_types") or ["full_attention"] * raw["num_hidden_layers"]
        self.causal = [kind == "sliding_attention" for kind in kinds]
        self.window = [raw.get("sliding_window") if kind == "sliding_attention" else None for kind in kinds]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.w.get(name + ".bias")
        return x @ self.w[name + ".weight"].T + (0 if bias is None else bias)

    @torch.inference_mode()
    def context(self, tokens: list[int], n: int) -> torch.Tensor:
        """c of positions 0..n-1: hidden_norm(fc(the streams after the target layers target_layer_ids))."""
        streams = self.target(torch.tensor([tokens[:n]]), output_hidden_states=True).hidden_states
        features = torch.cat([streams[j + 1][0] for j in self.layer_ids], dim=-1)
        return _rms(self._linear(features, "fc"), self.w["hidden_norm.weight"], self.eps)

    def _kv(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = f"layers.{layer}.self_attn."
        k = self._linear(x, p + "k_proj").view(len(x), self.kv, self.d)
        k = _rope(_rms(k, self.w[p + "k_norm.weight"], self.eps), positions, self.theta)
        return k, self._linear(x, p + "v_proj").view(len(x), self.kv, self.d)

    @torch.inference_mode()
    def context_kv(self, tokens: list[int], n: int) -> list[torch.Tensor]:
        """Per layer, [2, Hkv, n, D]: the K/V of positions 0..n-1 (as the paged cache lays them out)."""
        c = self.context(tokens, n)
        out = []
        for layer in range(len(self.causal)):
            k, v = self._kv(layer, c, torch.arange(n))
            out.append(torch.stack((k, v)).transpose(1, 2))
        return out

    @torch.inference_mode()
    def draft_logits(self, tokens: list[int], m: int) -> torch.Tensor:
        """After ``tokens`` (the last one just sampled, at position N), the logits [m, V] of drafts 1..m."""
        n = len(tokens) - 1
        c = self.context(tokens, n)
        embed = self.target.get_input_embeddings().weight
        x = embed[[tokens[-1]] + [self.mask] * m]  # [m + 1, H]
        block_pos, ctx_pos = torch.arange(n, n + m + 1), torch.arange(n)
        for layer, (causal, window) in enumerate(zip(self.causal, self.window)):
            p = f"layers.{layer}."
            xn = _rms(x, self.w[p + "input_layernorm.weight"], self.eps)
            q = self._linear(xn, p + "self_attn.q_proj").view(m + 1, self.heads, self.d)
            q = _rope(_rms(q, self.w[p + "self_attn.q_norm.weight"], self.eps), block_pos, self.theta)
            kc, vc = self._kv(layer, c, ctx_pos)
            kb, vb = self._kv(layer, xn, block_pos)
            k, v = torch.cat((kc, kb)), torch.cat((vc, vb))  # [n + m + 1, Hkv, D]
            key_pos = torch.cat((ctx_pos, block_pos))
            visible = torch.ones(m + 1, n + m + 1, dtype=torch.bool)
            if causal:
                visible &= key_pos[None, :] <= block_pos[:, None]
            if window is not None:
                visible &= block_pos[:, None] - key_pos[None, :] < window
            group = self.heads // self.kv
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.d)
            attn = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            a = torch.einsum("hqk,khd->qhd", attn, v).reshape(m + 1, self.heads * self.d)
            x = x + self._linear(a, p + "self_attn.o_proj")
            h = _rms(x, self.w[p + "post_attention_layernorm.weight"], self.eps)
            gate, up = self._linear(h, p + "mlp.gate_proj"), self._linear(h, p + "mlp.up_proj")
            x = x + self._linear(torch.nn.functional.silu(gate) * up, p + "mlp.down_proj")
        return self.target.lm_head(_rms(x, self.w["norm.weight"], self.eps))[1:].float()


def worker_kv(engine, req_id: str, n: int) -> list[torch.Tensor]:
    runner = engine.executor.worker.runner
    slots = slots_of(runner.block_tables[req_id], range(n), runner.block_size)
    return [t.cpu() for t in runner.drafter.kv_cache.snapshot(torch.tensor(slots))]


@pytest.mark.parametrize("kind", ["random", "accepting", "random-graphs", "accepting-graphs"])
def test_drafts_and_kv_equal_the_dense_reference(target_dir, heads, kind):
    """After every step, for every running request: the drafter's K/V at its committed positions (all but those it
    holds while it drafts nothing) equals the dense reference's, and its drafts are the reference's argmax (a near tie
    may go either way), with the reference's probabilities as their scores; a sampled request's q, kept for its
    verification, is its warpers over the reference's logits, and each draft lies in q's support. Small blocks, a pool
    that preempts and a budget that chunks prefills: checked after non-final prefill chunks, after preemption, and
    (the accepting head) after steps that accepted drafts. "-graphs": decodes' passes from graphs (``enforce_eager``
    False: on CPU the padded static inputs run eagerly), every row through the layers in the fixed form."""
    kind, _, graphs = kind.partition("-")
    llm = make_llm(target_dir, heads, kind, block_size=4, num_kv_blocks=28, max_num_batched_tokens=16,
                   max_num_seqs=4, enforce_eager=not graphs)
    engine = llm.engine
    engine.executor = rec = Recorder(engine.executor)
    replays = []
    if graphs:  # each pass from a graph: its batch
        run = engine.executor.worker.runner.drafter.graphs.run
        engine.executor.worker.runner.drafter.graphs.run = lambda shape, *a, **k: replays.append(shape.batch) or run(
            shape, *a, **k)
    dense = DenseDFlash(target_dir, heads[kind])
    tok = llm.get_tokenizer()
    params = [greedy(20), SamplingParams(temperature=0.8, top_k=5, max_tokens=20, ignore_eos=True, seed=1),
              greedy(20), SamplingParams(temperature=1.3, top_p=0.9, min_p=0.01, max_tokens=20, ignore_eos=True)]
    for prompt, sp in zip(PROMPTS[3:7], params):
        engine.add_request(tok.encode(prompt), sp)
    drafter = engine.executor.worker.runner.drafter
    checked = {"kv": 0, "drafts": 0, "drawn": 0, "after a chunked prefill": 0, "after preemption": 0,
               "after acceptance": 0}
    while engine.has_unfinished_requests():
        engine.step()
        drafts, scores, chunks = rec.last_by_request()
        for req in engine.scheduler.running:
            n = req.num_computed_tokens
            if n == 0 or req.req_id not in drafts:
                continue
            held = drafter.held.get(req.req_id)
            written = n if held is None else held.start
            for got, want in zip(worker_kv(engine, req.req_id, written), dense.context_kv(req.all_token_ids, written)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            checked["kv"] += 1
            mine = drafts[req.req_id]
            if not mine:
                continue
            assert n == req.num_tokens - 1 and len(mine) <= K
            logits = dense.draft_logits(req.all_token_ids, len(mine))
            if req.sampling_params.greedy:
                for i, token in enumerate(mine):
                    best = int(logits[i].argmax())
                    assert token == best or logits[i, best] - logits[i, token] < 1e-4, (i, mine, best)
                    assert scores[req.req_id][i] == pytest.approx(float(logits[i].softmax(-1)[token]), abs=1e-5)
            else:
                assert not scores[req.req_id]  # drawn: no scores to size the chain by
                q = drafter.q_of(req.req_id, mine).cpu()
                want = logits_to_probs(logits, SamplingBatch.build([req.sampling_params] * len(mine),
                                                                   [None] * len(mine), "cpu"))
                torch.testing.assert_close(q, want, atol=1e-5, rtol=1e-4)
                assert all(q[i, t] > 0 for i, t in enumerate(mine))
                checked["drawn"] += 1
            chunk, kept = chunks[req.req_id]
            checked["drafts"] += 1
            checked["after a chunked prefill"] += chunk.start_pos > 0 and chunk.num_draft_tokens == 0 and \
                chunk.num_tokens > 1
            checked["after preemption"] += req.num_preemptions > 0
            checked["after acceptance"] += len(kept) > 1
    assert engine.scheduler.num_preemptions > 0
    needed = [k for k in checked if k != "after acceptance" or kind == "accepting"]
    assert all(checked[k] for k in needed) and checked["drafts"] >= 10, checked
    assert not graphs or len(replays) >= 10 and max(replays) > 1, replays
    assert free_blocks(llm) == 28


def test_graph_passes_keep_greedy_output_and_run_without_a_host_sync(target_dir, heads, plain_outputs, no_host_sync):
    """With graphs asked for: the accepting head's decode passes replay them, its greedy output plain's; a pass's
    inputs load into a graph and the head runs on them with no host sync (a capture fails on one)."""
    from specray.models.attention import build_attention_metadata
    from specray.models.dflash import block_ancestors

    llm = make_llm(target_dir, heads, "accepting", enforce_eager=False, block_size=4)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], greedy(), use_tqdm=False)]
    assert got == plain_outputs[:3] and llm.spec_stats.accepted_tokens > 0
    drafter = llm.engine.executor.worker.runner.drafter
    graphs = drafter.graphs
    (b, q, blocks), graph = next((k, g) for k, g in graphs.graphs.items() if k[0] > 1)
    star = block_ancestors(2, K + 1, graphs.device)  # two context rows, then the block
    pad = torch.zeros(q, q, dtype=torch.bool, device=graphs.device)
    pad[: K + 3, : K + 3] = star
    pad[K + 3:] = True  # (padding rows: anything)
    start = blocks * 4 - q  # the graph's context: every sequence over the same blocks (their values do not matter)
    meta = build_attention_metadata([q] * b, [start] * b, [list(range(blocks))] * b, 4, graphs.device,
                                    positions=list(range(start, start + q)) * b, ancestors=[pad] * b,
                                    read_in_place=False)
    ids = torch.zeros(b * q, dtype=torch.long, device=graphs.device)
    rows = torch.randn(b * q, drafter.head.hidden_size, device=graphs.device)
    flags = torch.zeros(b * q, 1, dtype=torch.bool, device=graphs.device)
    with torch.inference_mode(), no_host_sync():
        graphs._load(graph, meta, ids, (rows, flags))
        drafter.head.forward_rows(graph.inputs[0], graph.input_ids, graph.inputs[1], graph.meta)


# ---- greedy output -----------------------------------------------------------------------------------------------

MIXED = [greedy(), greedy(num_speculative_tokens=0), greedy(1), greedy(2), greedy(3), greedy(num_speculative_tokens=1),
         greedy(logprobs=2), greedy(7)]


@pytest.mark.parametrize("kind,tree", [("random", False), ("accepting", False), ("random", True),
                                       ("accepting", True)], ids=["random", "accepting", "random-tree",
                                                                  "accepting-tree"])
def test_greedy_batch_with_mixed_caps_and_max_tokens_equals_plain(target_dir, heads, plain, kind, tree):
    """Eight requests at once, with per-request draft caps (none, 1), max_tokens that leave no room for a draft, and
    logprobs: token for token the plain engine's output and logprobs; every block back in the pool. Chains and
    token trees."""
    want = plain.generate(PROMPTS, MIXED, use_tqdm=False)
    llm = make_llm(target_dir, heads, kind, tree)
    got = llm.generate(PROMPTS, MIXED, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        if w.outputs[0].logprobs:
            for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
                assert lw.keys() == lg.keys()
                assert all(lw[t].logprob == pytest.approx(lg[t].logprob, abs=1e-4) for t in lw)
    stats = llm.spec_stats
    # the accepting head's drafts are often kept: a third of a chain's, more than one token in two trees (whose
    # nodes beside the kept path count as drafts too)
    kept = stats.accepted_tokens > (stats.drafts // 2 if tree else stats.draft_tokens // 3)
    assert stats.draft_tokens > 0 and (kind == "random" or kept), stats
    assert free_blocks(llm) == llm.engine.scheduler.block_manager.num_blocks


@pytest.mark.parametrize("kw", [dict(num_kv_blocks=24, block_size=4, max_num_seqs=4),
                                dict(max_num_batched_tokens=8, long_prefill_token_threshold=5),
                                dict(enable_prefix_caching=True)],
                         ids=["preemption", "chunked-prefill", "prefix-caching"])
def test_greedy_under_preemption_chunked_prefill_and_prefix_caching(target_dir, heads, plain_outputs, kw):
    llm = make_llm(target_dir, heads, "accepting", **kw)
    prompts = PROMPTS + PROMPTS[:3] if kw.get("enable_prefix_caching") else PROMPTS
    want = plain_outputs + plain_outputs[:3] if kw.get("enable_prefix_caching") else plain_outputs
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    assert got == want
    assert llm.spec_stats.accepted_tokens > 0
    if "num_kv_blocks" in kw:
        assert llm.engine.scheduler.num_preemptions > 0
    assert free_blocks(llm) == llm.engine.scheduler.block_manager.num_blocks


def test_one_request_at_a_time_and_the_adaptive_policy_keep_greedy_output(target_dir, heads, plain_outputs):
    llm = LLM(str(target_dir), max_model_len=256,
              speculative_config={"method": "dflash", "model": str(heads["accepting"]), "num_speculative_tokens": K})
    got = [llm.generate([p], greedy(), use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert got == plain_outputs
    assert llm.spec_stats.accepted_tokens > 0


def test_tree_drafts_equal_the_dense_reference(target_dir, heads):
    """A token tree's nodes: node [i0, .., id] holds the id-th best token of block row d + 1 (the block one row per
    level), with its probability there as its score, for a greedy request; a sampled request's tree is drawn from q,
    its warpers over the same rows (kept for verification, one row per node that has children), each node's token
    in the support of the q it was drawn from. Checked after every step, under preemption and chunked prefill."""
    llm = make_llm(target_dir, heads, "accepting", tree=True, block_size=4, num_kv_blocks=40,
                   max_num_batched_tokens=16, max_num_seqs=4)
    engine = llm.engine
    engine.executor = rec = Recorder(engine.executor)
    dense = DenseDFlash(target_dir, heads["accepting"])
    drafter = engine.executor.worker.runner.drafter
    tok = llm.get_tokenizer()
    params = [greedy(20), SamplingParams(temperature=0.9, top_k=4, max_tokens=20, ignore_eos=True, seed=2),
              greedy(20), greedy(20)]
    for prompt, sp in zip(PROMPTS[2:6], params):
        engine.add_request(tok.encode(prompt), sp)
    levels = max(len(c) for c in TREE)
    checked = {"greedy": 0, "drawn": 0, "after acceptance": 0}
    while engine.has_unfinished_requests():
        engine.step()
        drafts, scores, chunks = rec.last_by_request()
        for req in engine.scheduler.running:
            mine = drafts.get(req.req_id)
            if not mine:
                continue
            logits = dense.draft_logits(req.all_token_ids, levels)
            probs, best = logits.softmax(-1), logits.argsort(-1, descending=True)
            if req.sampling_params.greedy:
                for node, token in enumerate(mine):
                    path = TREE[node]
                    want = int(best[len(path) - 1, path[-1]])
                    row = logits[len(path) - 1]
                    assert token == want or abs(row[want] - row[token]) < 1e-4, (node, mine, want)
                    assert scores[req.req_id][node] == pytest.approx(float(probs[len(path) - 1, token]), abs=1e-5)
                checked["greedy"] += 1
            else:
                q = logits_to_probs(logits, SamplingBatch.build([req.sampling_params] * levels, [None] * levels,
                                                                "cpu"))
                drawn = drafter.q[req.req_id]
                assert drawn.tokens == mine
                for node, token in enumerate(mine):  # each node drawn from its level's q
                    assert q[len(TREE[node]) - 1, token] > 0, (node, mine)
                checked["drawn"] += 1
            checked["after acceptance"] += len(chunks[req.req_id][1]) > 1
    assert all(checked.values()), checked


def test_sampled_tree_keeps_the_target_distribution(target_dir, heads, plain):
    """Sampled requests' trees drawn from q (each node's children without replacement from its level's q) and
    verified against it: the first three tokens fit the target's distribution, and not the target's at T=1."""
    prompt = plain.get_tokenizer().encode(PROMPTS[4])
    prompt += plain.generate({"prompt_token_ids": prompt}, greedy(3), use_tqdm=False)[0].outputs[0].token_ids
    check_sampled_distribution(make_llm(target_dir, heads, "accepting", tree=True, max_num_seqs=64), target_dir,
                               prompt, max_tokens=6)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_async_scheduling_keeps_drafts_and_acceptance(target_dir, heads, plain_outputs, tree):
    """``async_scheduling``: the block's drafts still come back with each step's result, so the same drafts are
    verified and kept as without it, and greedy output equals plain."""
    runs = {}
    for on in (False, True):
        llm = make_llm(target_dir, heads, "accepting", tree, async_scheduling=on)
        outs = llm.generate(PROMPTS[:6], greedy(16), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [t[:16] for t in plain_outputs[:6]]
        stats = llm.spec_stats
        runs[on] = (stats.drafts, stats.draft_tokens, stats.accepted_tokens)
    assert runs[False] == runs[True] and runs[True][2] > 0, runs


def test_combined_with_a_lookup_keeps_greedy_output(target_dir, heads, plain_outputs):
    """``combine_with``: an n-gram lookup beside DFlash, each step each request verifying the proposal the policy
    prices higher (chains of either, or the lookup's trees); greedy output equals plain, drafts kept."""
    llm = LLM(str(target_dir), max_model_len=256, speculative_config=spec(heads, "accepting", adaptive=True,
                                                                          combine_with="ngram"))
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)] == plain_outputs
    assert llm.spec_stats.accepted_tokens > 0
    assert free_blocks(llm) == llm.engine.scheduler.block_manager.num_blocks


def test_greedy_on_a_linear_attention_target_equals_plain(tmp_path):
    """Over a hybrid target (Qwen3.5: Gated DeltaNet layers keeping a recurrent state per request, replayed over the
    accepted drafts), DFlash reads the verify pass's residual streams as over any target: greedy output equals plain
    decoding, with drafts accepted."""
    target = draft_heads.zero_mask_row(draft_heads.write_tiny_hybrid(tmp_path / "qwen3_5", "qwen3_5"))
    head = draft_heads.write_dflash(tmp_path / "dflash", target, num_layers=K, block_size=K + 1,
                                    target_layer_ids=[0, 2], accepting=True)
    prompts = PROMPTS[:4]
    want = [o.outputs[0].token_ids for o in LLM(str(target), max_model_len=256).generate(prompts, greedy(30),
                                                                                           use_tqdm=False)]
    llm = LLM(str(target), max_model_len=256, speculative_config={
        "method": "dflash", "model": str(head), "num_speculative_tokens": K, "adaptive": False})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(30), use_tqdm=False)] == want
    assert llm.spec_stats.accepted_tokens > 0, llm.spec_stats


def test_the_scheduler_reserves_the_block_past_the_verified_drafts(target_dir, heads):
    """A block of m drafts writes the sampled token's position and the m after it: with every draft accepted (a
    target made to emit token 0 always, a head that always drafts it), the block starts right after the last
    verified draft, so the scheduler holds m + 1 slots past the drafts (a chain's drafting: m - 1). Every step
    accepts all K drafts, and no write lands outside a request's blocks (they would raise)."""
    from safetensors.torch import save_file

    folder = target_dir.parent / "always_zero"
    if not folder.exists():
        import shutil

        shutil.copytree(target_dir, folder)
        weights = load_file(str(folder / "model.safetensors"))
        weights["model.norm.weight"].zero_()  # every logit 0: the argmax is token 0
        save_file(weights, str(folder / "model.safetensors"))
    head = draft_heads.write_dflash(folder.parent / "zero_head", folder, block_size=K + 1, always_token_zero=True)
    llm = LLM(str(folder), max_model_len=256, block_size=4, speculative_config={
        "method": "dflash", "model": str(head), "num_speculative_tokens": K, "adaptive": False})
    scheduler = llm.engine.scheduler
    assert scheduler._lookahead_slots(K) == K + 1
    out = llm.generate(PROMPTS[:4], greedy(30), use_tqdm=False)
    assert all(o.outputs[0].token_ids == [0] * 30 for o in out)
    stats = llm.spec_stats
    assert stats.accepted_tokens == stats.draft_tokens > 0, stats
    assert free_blocks(llm) == scheduler.block_manager.num_blocks


# ---- sampling ----------------------------------------------------------------------------------------------------

def test_sampled_output_keeps_the_target_distribution(target_dir, heads, plain):
    """Seeded sampled requests after a prompt that ends in a run: the drafts are drawn from q (each block position's
    own), verified against it by rejection sampling; the first three tokens' joint frequencies fit the target's
    p(x0) p(x1 | x0) p(x2 | x0 x1), and (a negative control) not the target's at T=1."""
    prompt = plain.get_tokenizer().encode(PROMPTS[4])
    prompt += plain.generate({"prompt_token_ids": prompt}, greedy(3), use_tqdm=False)[0].outputs[0].token_ids
    check_sampled_distribution(make_llm(target_dir, heads, "accepting", max_num_seqs=64), target_dir, prompt)


# ---- settings and checkpoints ------------------------------------------------------------------------------------

def test_settings_and_checkpoints_are_checked(target_dir, heads, tmp_path):
    from specray.config import SpeculativeConfig
    from specray.drafters import registry

    unset = SpeculativeConfig.from_any({"method": "dflash", "model": str(heads["accepting"])})
    registry.check(unset)  # left unset: the block's K drafts (5 was refused here, a count the user never gave)
    assert unset.num_speculative_tokens == K
    with pytest.raises(ValueError, match=r"num_speculative_tokens=4: the DFlash checkpoint .* blocks of 4"):
        LLM(str(target_dir), speculative_config=spec(heads, "accepting", num_speculative_tokens=4))
    with pytest.raises(ValueError, match=r"speculative_token_tree goes 4 levels deep but the DFlash checkpoint .* "
                                         r"blocks of 4"):
        LLM(str(target_dir), speculative_config=spec(heads, "accepting", speculative_token_tree=[[0], [0, 0],
                                                                                              [0, 0, 0], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"speculative_token_tree has paths without their parent path"):
        LLM(str(target_dir), speculative_config=spec(heads, "accepting", speculative_token_tree=[[0], [1, 0]]))
    with pytest.raises(ValueError, match=r"method='dflash' needs the DFlash checkpoint"):
        LLM(str(target_dir), speculative_config={"method": "dflash", "num_speculative_tokens": 3})
    deep = draft_heads.write_dflash(tmp_path / "deep", target_dir, target_layer_ids=[0, 5])
    with pytest.raises(ValueError, match=r"target_layer_ids=\[0, 5\] name layer 5 of a target with 6 layers"):
        LLM(str(target_dir), speculative_config={"method": "dflash", "model": str(deep), "num_speculative_tokens": 3})
    v2 = draft_heads.write_dflash(tmp_path / "v2", target_dir)
    config = json.loads((v2 / "config.json").read_text())
    config["dflash_config"]["conv_kernel_size"] = 4
    (v2 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"DFlash-2's convolutions and candidate selector are not supported"):
        LLM(str(target_dir), speculative_config={"method": "dflash", "model": str(v2), "num_speculative_tokens": 3})
    narrow = draft_heads.write_dflash(tmp_path / "narrow", target_dir, layer_types=["full_attention"] * 2,
                                      sliding_window=2)
    config = json.loads((narrow / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "sliding_attention"]
    config["is_causal"] = False
    (narrow / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"sliding_window=2 is narrower than its block of 5"):
        LLM(str(target_dir), speculative_config={"method": "dflash", "model": str(narrow), "num_speculative_tokens": 3})
