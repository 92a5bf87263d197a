"""DeepSeek-V4's MTP module as a draft head (``method="mtp"``, :mod:`specray.models.deepseek_v4_mtp`), on the tiny V4
of ``tests/test_deepseek_v4.py`` with a module added as the release names it (``mtp.0.*``).

The reference is built from transformers' own DeepSeek-V4 modules (transformers does not run the MTP module: it drops
``mtp.*`` at load): the target's streams before its ``hc_head`` (hooked), the module's fusion of them with the next
token's embedding written out from the formula, its block as transformers' ``DeepseekV4DecoderLayer`` at layer L of a
one-layer-deeper config, its own ``DeepseekV4HyperHead`` and norm, the target's LM head. Our module's logits and
streams equal it (fp32, < 1e-4) over a prefill and over chunks and decode steps on shuffled blocks; through the
engine, greedy output equals plain decoding with chains, drafts are accepted (a module built to be often right), no
block leaks, and every first draft equals the reference's over the request's committed tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specray.models.attention import build_attention_metadata
from specray.models.draft_head_loader import load_draft_head
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import load_hf_config, load_model
import specray_test_draft_heads as draft_heads  # tests/draft_heads.py (tests/conftest.py registers it)
from specray_test_model_checks import max_diff, prompt  # tests/model_checks.py

TOL = 1e-4
SPEC = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Reference:
    """The MTP module over a whole sequence, from transformers' modules (see the module docstring)."""

    def __init__(self, folder: Path, tmp: Path, kind: str = "sliding_attention"):
        from safetensors.torch import load_file, save_file
        from transformers import AutoModelForCausalLM
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

        self.hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        config = draft_heads.deepseek_v4_mtp_config(folder, kind)
        layers = config.num_hidden_layers - 1
        deeper = AutoModelForCausalLM.from_config(config)  # its block's tensors replaced by the module's, then loaded
        deeper.save_pretrained(tmp)
        file = load_file(str(folder / "model.safetensors"))
        module = {name[len("mtp.0."):]: t for name, t in file.items() if name.startswith("mtp.0.")}
        saved = load_file(str(tmp / "model.safetensors"))
        p = f"model.layers.{layers}."
        saved.update({name: module[name[len(p):]] for name in saved if name.startswith(p)})
        save_file(saved, str(tmp / "model.safetensors"))
        self.block = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval().model.layers[layers]
        self.hc_head = DeepseekV4HyperHead(config).float()
        self.hc_head.load_state_dict({"hc_fn": module["hc_head_fn"], "hc_base": module["hc_head_base"],
                                      "hc_scale": module["hc_head_scale"]})
        self.module, self.config = module, config

    @torch.no_grad()
    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the target's streams [T, n, H], the module's streams [T - 1, n, H] and logits [T - 1, V]) at positions
        0..T-2, position p reading token ids[p + 1]."""
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

        captured = {}
        hook = self.hf.model.hc_head.register_forward_pre_hook(lambda m, args: captured.setdefault("s", args[0]))
        try:
            self.hf(torch.tensor([ids]))
        finally:
            hook.remove()
        streams = captured["s"][0]
        m, eps = self.module, self.config.rms_norm_eps
        e = F.linear(_rms(self.hf.model.embed_tokens(torch.tensor(ids[1:])), m["enorm.weight"], eps),
                     m["e_proj.weight"])
        x = F.linear(_rms(streams[:-1], m["hnorm.weight"], eps), m["h_proj.weight"]) + e[:, None]
        positions = torch.arange(len(ids) - 1)[None]
        rope = {kind: self.hf.model.rotary_emb(x, position_ids=positions, layer_type=kind)
                for kind in ("main", "compress")}
        mask = hf_v4.create_sliding_window_causal_mask(config=self.config, inputs_embeds=x[None, :, 0],
                                                       attention_mask=None, cache=None, position_ids=positions)
        out = self.block(x[None], position_embeddings=rope, position_ids=positions, attention_mask=mask,
                         input_ids=torch.tensor([ids[1:]]))[0]
        hidden = _rms(self.hc_head(out[None])[0], m["norm.weight"], eps)
        return streams, out, self.hf.lm_head(hidden)


@pytest.fixture(scope="module")
def mtp_dir(tiny_deepseek_v4_dir, tmp_path_factory) -> Path:
    return draft_heads.write_deepseek_v4_mtp(tmp_path_factory.mktemp("v4_mtp"), tiny_deepseek_v4_dir)


@pytest.fixture(scope="module")
def reference(mtp_dir, tmp_path_factory) -> Reference:
    return Reference(mtp_dir, tmp_path_factory.mktemp("v4_mtp_ref"))


def _load(folder: Path):
    model = load_model(str(folder))
    head = load_draft_head("mtp", str(folder), model, load_hf_config(str(folder)))
    return model, head


# (the lengths of the head's passes over a 30-token prompt's 29 positions)
PASSES = {"prefill": [29], "chunks-then-decode": [11, 9, 3, 1, 1, 1, 1, 1, 1]}


@pytest.mark.parametrize("passes", sorted(PASSES))
@pytest.mark.parametrize("kind", ["sliding_attention", "compressed_sparse_attention"])
def test_module_matches_the_reference(tiny_deepseek_v4_dir, mtp_dir, reference, tmp_path, passes, kind):
    """The target hands the module its streams past the last layer (aux layer L, [T, n * H]) equal to transformers'
    before its hc_head; the module's streams and logits at every position equal the reference's, in one pass or in
    chunks and one-row steps over shuffled blocks of its own paged cache. Its block's kind of attention is what its
    tensors show: a sliding layer (V4-Flash's release), or one with a compressor and an indexer."""
    from specray.models.moe import SparseMoE

    ids = prompt()[:30]
    if kind != "sliding_attention":
        mtp_dir = draft_heads.write_deepseek_v4_mtp(tmp_path / "mtp", tiny_deepseek_v4_dir, kind=kind)
        reference = Reference(mtp_dir, tmp_path / "ref", kind)
    model, head = _load(mtp_dir)
    assert head.block.self_attn.kind == kind and isinstance(head.block.mlp, SparseMoE)
    assert not head.block.mlp.hash_routed and head.aux_layers == (4,)
    table = [5, 0, 9, 3, 11, 7, 1, 13]
    allocate_kv_cache(model, 16, 4)
    allocate_kv_cache(head, 16, 4)
    ref_streams, ref_out, ref_logits = reference(ids)
    with torch.no_grad():
        hidden, aux = model(torch.tensor(ids), build_attention_metadata([30], [0], [table], 4, "cpu"),
                            aux_layers=head.aux_layers)
        n, h = head.hc_mult, head.hidden_size
        assert aux[0].shape == (30, n * h) and max_diff(aux[0].view(30, n, h), ref_streams) < TOL
        features = head.target_features(hidden, aux)
        outs, logits, start = [], [], 0
        for length in PASSES[passes]:
            meta = build_attention_metadata([length], [start], [table], 4, "cpu")
            streams, normed = head(torch.tensor(ids[start + 1: start + 1 + length]), features[start: start + length],
                                   meta)
            outs.append(streams)
            logits.append(head.draft_logits(normed))
            start += length
    assert max_diff(torch.cat(outs).view(29, n, h), ref_out) < TOL
    assert max_diff(torch.cat(logits), ref_logits) < TOL


def test_the_release_layout_loads(mtp_dir, tmp_path):
    """The module as DeepSeek-V4's release stores it (its attention, shared experts, ``e_proj`` and ``h_proj`` FP8 with
    E8M0 block scales, its routed experts FP4): its logits equal the reference's on the same weights dequantized by
    hand."""
    release, twin = sys.modules["specray_test_checkpoints"].write_v4_release(mtp_dir, tmp_path, block=16)
    _, _, want = Reference(twin, tmp_path / "ref")(prompt()[:20])
    model, head = _load(release)
    allocate_kv_cache(model, 16, 4)
    allocate_kv_cache(head, 16, 4)
    with torch.no_grad():
        meta = build_attention_metadata([20], [0], [list(range(5))], 4, "cpu")
        hidden, aux = model(torch.tensor(prompt()[:20]), meta, aux_layers=head.aux_layers)
        meta = build_attention_metadata([19], [0], [list(range(5))], 4, "cpu")
        got = head.draft_logits(head(torch.tensor(prompt()[1:20]), head.target_features(hidden, aux)[:-1], meta)[1])
    assert max_diff(got, want) < TOL


def test_each_part_shows(mtp_dir, reference):
    """The fusion's two inputs, the block and the module's own hc_head each change the logits (so the match above
    reads them all)."""
    ids = prompt()[:20]
    _, _, want = reference(ids)

    def logits(spoil) -> torch.Tensor:
        model, head = _load(mtp_dir)
        spoil(head)
        allocate_kv_cache(model, 16, 4)
        allocate_kv_cache(head, 16, 4)
        with torch.no_grad():
            hidden, aux = model(torch.tensor(ids), build_attention_metadata([20], [0], [list(range(5))], 4, "cpu"),
                                aux_layers=head.aux_layers)
            meta = build_attention_metadata([19], [0], [list(range(5))], 4, "cpu")
            return head.draft_logits(head(torch.tensor(ids[1:]), head.target_features(hidden, aux)[:-1], meta)[1])

    assert max_diff(logits(lambda head: None), want) < TOL
    for spoil in (lambda head: head.e_proj.weight.zero_(), lambda head: head.h_proj.weight.zero_(),
                  lambda head: head.block.self_attn.o_b_proj.weight.zero_(),
                  lambda head: head.hc_head.hc_base.add_(1.0)):
        assert max_diff(logits(spoil), want) > 1e-2


def test_engine_greedy_equals_plain_and_first_drafts_are_the_references(tiny_deepseek_v4_dir, tmp_path,
                                                                        no_host_sync):
    """``speculative_config={"method": "mtp"}`` on the release-style folder: greedy output equals plain decoding (four
    prompts past several windows), the module's drafts are accepted (one built to be often right) and some refused, no
    KV block leaks, and every first draft equals the reference's over the request's committed tokens (which checks the
    module's cache over accepted and rejected drafts); so it does again behind cached prefixes. The module's passes
    replay graphs as the target's steps do (on CPU: their static inputs, with no host sync). The target here is the
    accepting module's (its layers scaled down: see ``write_deepseek_v4_mtp``)."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    prompts = runs.PROMPTS[:4]
    folder = draft_heads.write_deepseek_v4_mtp(tmp_path / "mtp", tiny_deepseek_v4_dir, accepting=True)
    plain = runs.token_ids(LLM(model=str(folder), max_model_len=256, block_size=4)
                           .generate(prompts, runs.greedy(16), use_tqdm=False))
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, speculative_config=SPEC, enforce_eager=False,
              enable_prefix_caching=True)
    llm.engine.executor = rec = runs.Recorder(llm.engine.executor)
    free = llm.engine.scheduler.block_manager.num_free_blocks
    outs = llm.generate(prompts, runs.greedy(16), use_tqdm=False)
    assert runs.token_ids(outs) == plain
    first_run = list(rec.steps)
    hits = llm.engine.scheduler.prefix_cache_hits  # again, behind the first run's cached blocks (the module's rows
    assert runs.token_ids(llm.generate(prompts, runs.greedy(16), use_tqdm=False)) == plain  # for them are its own)
    assert llm.engine.scheduler.prefix_cache_hits > hits
    stats = llm.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens and stats.accepted_per_position[1] > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == free
    graphs = llm.engine.executor.worker.runner.drafter.graphs
    if not runs.refused_on_this_gpu(llm):
        graph = next(iter(graphs.graphs.values()))  # the module's passes ran from graphs
        with torch.inference_mode(), no_host_sync():
            graphs._step(graph.input_ids, graph.meta, graph.inputs)  # the forward a capture records
    reference = Reference(folder, tmp_path / "ref")
    tok = llm.get_tokenizer()
    committed = {o.request_id: tok.encode(p) for o, p in zip(outs, prompts)}
    checked = 0
    for plan, result in first_run:
        for chunk, kept, drafts in zip(plan.chunks, result.sampled_token_ids, result.draft_token_ids or []):
            if not kept:
                continue
            seq = committed[chunk.req_id] = (committed[chunk.req_id][: chunk.start_pos + chunk.num_tokens
                                                                      - chunk.num_draft_tokens] + list(kept))
            if drafts:
                assert drafts[0] == int(reference(seq)[2][-1].argmax()), (chunk.req_id, drafts)
                checked += 1
    assert checked >= 12


def test_an_fp8_cache_keeps_greedy_output(tiny_deepseek_v4_dir, tmp_path):
    """``kv_cache_dtype="fp8"``: the target's rows and the module's one byte a value; the module's drafts verified over
    it give plain decoding's tokens over it (a verify step reads the windows it closes rounded, as a later step
    does), drafts accepted and refused."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    folder = draft_heads.write_deepseek_v4_mtp(tmp_path / "mtp", tiny_deepseek_v4_dir, accepting=True)
    outs = {}
    for spec in (None, SPEC):
        with LLM(model=str(folder), max_model_len=256, block_size=4, kv_cache_dtype="fp8",
                 speculative_config=spec) as llm:
            assert llm.engine.executor.worker.runner.kv_cache.storage_dtype == torch.uint8
            outs[spec is None] = runs.token_ids(llm.generate(runs.PROMPTS[:4], runs.greedy(16), use_tqdm=False))
            stats = llm.spec_stats
    assert outs[True] == outs[False] and 0 < stats.accepted_tokens < stats.draft_tokens


def test_the_module_whole_on_the_driver_reads_a_gathered_target(mtp_dir):
    """``draft_tensor_parallel_size=1`` over a split target: the module is whole on the driver rank and reads the
    target's embedding and LM head gathered whole (``WholeTarget``); its logits equal those over the target itself."""
    from specray.workers.head_drafter import WholeTarget

    model = load_model(str(mtp_dir))
    whole = WholeTarget(model, model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach())
    ids = prompt()[:12]
    allocate_kv_cache(model, 8, 4)
    with torch.no_grad():
        hidden, aux = model(torch.tensor(ids), build_attention_metadata([12], [0], [[0, 1, 2]], 4, "cpu"),
                            aux_layers=(4,))
    outs = []
    for target in (model, whole):
        head = load_draft_head("mtp", str(mtp_dir), target, load_hf_config(str(mtp_dir)))
        allocate_kv_cache(head, 8, 4)
        with torch.no_grad():
            meta = build_attention_metadata([11], [0], [[0, 1, 2]], 4, "cpu")
            outs.append(head.draft_logits(head(torch.tensor(ids[1:]), aux[0][:-1], meta)[1]))
    assert max_diff(outs[0], outs[1]) < TOL


def test_the_module_splits_over_ranks_as_a_target_layer(mtp_dir):
    """Each of two ranks holds half the query heads, sinks and output groups of the module's block (its output
    against one rank's: tests/test_hidden_state_drafters.py, the MTP heads split over two ranks)."""
    from specray.models.deepseek_v4_mtp import DeepseekV4MTP
    from specray.parallel import TPGroup

    model = load_model(str(mtp_dir))
    head = DeepseekV4MTP(load_hf_config(str(mtp_dir)), model, TPGroup(1, 2))
    attn = head.block.self_attn
    assert (attn.num_heads, attn.sinks.shape[0], attn.groups) == (2, 2, 1)


# two pipeline stages of the target (2 + 2 layers): the last one hands the module the streams past the last layer,
# and the module there (the last stage holding the embedding for it) drafts from them; both against one rank
STAGES = """
from dataclasses import replace

from specray.models.draft_head_loader import load_draft_head
from specray.models.loader import load_hf_config

folder = folders[0]
config = load_hf_config(folder)
pp = replace(pp, last_stage_embeds=True)
result = {}
with torch.no_grad():
    for group in (pp, None):
        model = load_model(folder, tp, pp=group) if group is not None else load_model(folder)
        allocate_kv_cache(model, 32, 4)
        step = model(ids[:20], plan([20], [0], tables[:1], 4), aux_layers=(config.num_hidden_layers,))
        if step is None:
            break
        head = load_draft_head("mtp", folder, model, config)
        allocate_kv_cache(head, 32, 4)
        hidden, aux = step
        normed = head(ids[1:20], head.target_features(hidden, aux)[:19], plan([19], [0], tables[:1], 4))[1]
        result["stage" if group is not None else "one"] = (aux[0].tolist(), normed.tolist())
if result:
    (streams, normed), (streams1, normed1) = result["stage"], result["one"]
    result = {"streams": (torch.tensor(streams) - torch.tensor(streams1)).abs().max().item(),
              "normed": (torch.tensor(normed) - torch.tensor(normed1)).abs().max().item()}
del model
gc.collect()
dist.destroy_process_group()
json.dump(result, open(f"{out}/{rank}.json", "w"))
"""


def test_two_pipeline_stages_hand_the_module_the_last_streams(mtp_dir, tmp_path):
    """PP 2 over gloo: the last stage's streams past the last layer and the module's output there equal one rank's."""
    from specray_test_model_checks import WORKER_PRELUDE, run_ranks  # tests/model_checks.py

    first, last = run_ranks(tmp_path / "ranks", WORKER_PRELUDE + STAGES, 2, 2, [str(mtp_dir)])
    assert first == {} and last["streams"] < TOL and last["normed"] < TOL, (first, last)


def test_what_it_cannot_do_is_refused(tiny_deepseek_v4_dir, mtp_dir):
    from specray import LLM

    with pytest.raises(ValueError, match=r"has no MTP module \(mtp\.0\.\*\)"):
        LLM(model=str(tiny_deepseek_v4_dir), max_model_len=256, block_size=4, speculative_config=SPEC)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=2: DeepSeek-V4 releases keep one MTP module"):
        LLM(model=str(mtp_dir), max_model_len=256, block_size=4,
            speculative_config={**SPEC, "num_nextn_predict_layers": 2})
    with pytest.raises(ValueError, match=r"method='eagle' \(a head reading the target's hidden states\) is not "
                                         r"supported for model_type='deepseek_v4': use its MTP module"):
        LLM(model=str(mtp_dir), max_model_len=256, block_size=4,
            speculative_config={"method": "eagle", "model": str(mtp_dir), "num_speculative_tokens": 2})
