"""Pipeline parallelism (``pipeline_parallel_size``): the decoder layers split into consecutive stages, each on
tensor-parallel ranks of its own. Here: how layers are placed, what each stage builds and loads, and the last
stage's logits against one rank's, over gloo in separate processes (tests/test_cluster.py runs whole engines on Ray
ranks)."""

from __future__ import annotations

import json
import socket
import textwrap
from types import SimpleNamespace

import pytest
import torch

from specray.config import EngineArgs
from specray.engine.builder import check_model_split
from specray.models.layers import OtherStage
from specray.models.loader import load_model
from specray.parallel import PPGroup, stage_layers
import specray_test_model_checks as model_checks  # tests/model_checks.py (registered by conftest)

TOL = 1e-4


@pytest.mark.parametrize("num_layers,stages", [(1, 1), (2, 2), (3, 2), (8, 3), (10, 3), (30, 4), (61, 8), (5, 5)])
def test_stages_cover_every_layer_once_in_order(num_layers, stages):
    """Consecutive runs of layers covering all of them once; sizes differ by at most one, and the last stage (which
    also holds the final norm and the LM head) is never one of the larger ones."""
    ranges = [stage_layers(num_layers, s, stages) for s in range(stages)]
    assert [i for r in ranges for i in r] == list(range(num_layers))
    sizes = [len(r) for r in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes[-1] == min(sizes)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 .* num_hidden_layers=2"):
        stage_layers(2, 0, 3)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=4 .* num_hidden_layers=3"):
        check_model_split(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3), 1, 4)


def test_ranks_are_numbered_stage_by_stage():
    """Rank r of TP x PP: stage r // TP; it receives from the previous stage's rank of the same TP index and sends
    to the next one's."""
    groups = [PPGroup.of_rank(r, 2, 3) for r in range(6)]
    assert [g.stage for g in groups] == [0, 0, 1, 1, 2, 2]
    assert [g.prev_rank for g in groups] == [None, None, 0, 1, 2, 3]
    assert [g.next_rank for g in groups] == [2, 3, 4, 5, None, None]
    assert groups[0].is_first and groups[5].is_last and not groups[2].is_first and not groups[2].is_last


def test_engine_arguments_for_pipeline_stages():
    """Several stages mean several processes (the Ray backend by default); a size below 1 is a ValueError naming
    the field."""
    assert EngineArgs(model="m", pipeline_parallel_size=2).executor_backend == "ray"
    assert EngineArgs(model="m", pipeline_parallel_size=2, tensor_parallel_size=2).world_size == 4
    with pytest.raises(ValueError, match="pipeline_parallel_size=0 must be an int >= 1"):
        EngineArgs(model="m", pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 needs several processes"):
        EngineArgs(model="m", pipeline_parallel_size=2, distributed_executor_backend="uni")


@pytest.mark.parametrize("tied", [False, True])
def test_each_stage_builds_and_loads_only_its_part(make_tiny_model, tmp_path, tied):
    """A stage holds its own layers' weights and KV specs: the embedding on the first stage, the final norm and the
    LM head on the last (tied: the last stage's head is loaded from the embedding's tensor), the other stages'
    modules empty placeholders. Loading reads the same checkpoint and finds nothing missing."""
    folder = make_tiny_model(tmp_path / "m", "llama", seed=3, num_hidden_layers=3, tie_word_embeddings=tied)
    whole = load_model(folder, pack=False)
    first = load_model(folder, pack=False, pp=PPGroup(0, 2, None, 1))
    last = load_model(folder, pack=False, pp=PPGroup(1, 2, 0, None))
    assert [isinstance(layer, OtherStage) for layer in first.model.layers] == [False, False, True]
    assert [isinstance(layer, OtherStage) for layer in last.model.layers] == [True, True, False]
    assert isinstance(first.lm_head, OtherStage) and isinstance(first.model.norm, OtherStage)
    assert isinstance(last.model.embed_tokens, OtherStage)
    assert len(first.kv_cache_specs()) == 2 and len(last.kv_cache_specs()) == 1
    torch.testing.assert_close(last.lm_head.weight, whole.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(first.model.embed_tokens.weight, whole.model.embed_tokens.weight, rtol=0, atol=0)
    params = dict(whole.named_parameters(remove_duplicate=False))
    for part in (first, last):
        for name, p in part.named_parameters():
            torch.testing.assert_close(p, params[name], rtol=0, atol=0)
    count = sum(p.numel() for p in whole.parameters())
    assert sum(p.numel() for p in first.parameters()) + sum(p.numel() for p in last.parameters()) == (
        count + (whole.lm_head.weight.numel() if tied else 0))  # tied: each end holds its own copy


PP_WORKER = textwrap.dedent("""
    import gc, json, sys
    import torch, torch.distributed as dist
    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import allocate_kv_cache
    from specray.models.layers import OtherStage
    from specray.models.loader import load_model
    from specray.workers.worker import join_groups

    rank, world, stages, port, out = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                      sys.argv[5])
    folders = sys.argv[6:]
    torch.set_num_threads(1)
    tp, pp = join_groups(torch.device("cpu"), rank, world, f"tcp://127.0.0.1:{port}", stages)

    @torch.no_grad()
    def run(model, aux_layers):
        # a prefill of two sequences (one in shuffled blocks), then a step of 4 and 1 tokens: the last stage's logits
        # and the residual streams entering aux_layers (every stage hands on those of its layers)
        allocate_kv_cache(model, 32, 4)
        ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
        t1, t2 = [5, 3, 9, 1, 7, 2, 8, 4, 6], [10, 11, 12, 13, 14, 15]
        out1 = model(torch.tensor(ids[:27]), build_attention_metadata([20, 7], [0, 0], [t1, t2], 4), aux_layers)
        out2 = model(torch.tensor(ids[27:32]), build_attention_metadata([4, 1], [20, 7], [t1, t2], 4), aux_layers)
        if out1 is None:
            return None
        (h1, a1), (h2, a2) = out1, out2
        return [model.compute_logits(torch.cat([h1, h2]))] + [torch.cat(pair) for pair in zip(a1, a2)]

    result = {}
    for folder in folders:  # a folder named *-ep: a mixture of experts split by whole experts
        model = load_model(folder, tp, expert_parallel=folder.endswith("-ep"), pp=pp)
        num_layers = len(model.model.layers)
        aux_layers = (num_layers - 1, 0, num_layers // 2, 0)  # out of order, repeated, across the stages
        outputs = run(model, aux_layers)
        entry = {"stage": pp.stage, "tp": [tp.rank, tp.size], "kv_layers": len(model.kv_cache_specs()),
                 "layers": [i for i, m in enumerate(model.model.layers) if not isinstance(m, OtherStage)]}
        if outputs is not None:
            one_rank = run(load_model(folder), aux_layers)
            entry["diff"] = max((a - b).abs().max().item() for a, b in zip(outputs, one_rank, strict=True))
        result[folder] = entry
    del model
    gc.collect()
    dist.destroy_process_group()
    json.dump(result, open(f"{out}/{rank}.json", "w"))
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_stages(tmp_path, folders: list[str], tp: int, stages: int) -> list[dict]:
    script = tmp_path / "worker.py"
    script.write_text(PP_WORKER)
    world, port = tp * stages, str(free_port())
    model_checks.run_scripts(script, [[str(r), str(world), str(stages), port, str(tmp_path), *folders]
                                      for r in range(world)], 300)
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]


def check_stages(results: list[dict], folders: list[str], tp: int, stages: int) -> None:
    """Each stage's ranks hold its layers (all of them once over the stages), and every rank of the last stage has
    one rank's logits and residual streams."""
    for folder in folders:
        entries = [r[folder] for r in results]
        per_stage = [entries[s * tp]["layers"] for s in range(stages)]
        assert [i for layers in per_stage for i in layers] == list(range(len(sum(per_stage, []))))
        for rank, entry in enumerate(entries):
            assert entry["stage"] == rank // tp and entry["tp"] == [rank % tp, tp], (folder, rank, entry)
            assert entry["layers"] == per_stage[entry["stage"]] and entry["kv_layers"] == len(entry["layers"])
            assert ("diff" in entry) == (entry["stage"] == stages - 1), (folder, rank)
            assert entry.get("diff", 0.0) < TOL, (folder, rank, entry)


def test_two_stages_match_one_rank_for_every_family(make_tiny_model, tmp_path, tiny_gemma3_dir, tiny_qwen3_moe_dir,
                                                   tiny_deepseek_dir, tiny_llama4_dir, tiny_mixtral_dir,
                                                   tiny_qwen2_moe_dir, tiny_phi3_dir, tiny_gemma2_dir,
                                                   tiny_granite_dir, tiny_olmo2_dir, tiny_glm4_moe_dir):
    """PP 2 over gloo: Llama untied and Qwen2 tied (the last stage's head loaded from the embedding), Qwen3-MoE's 3
    layers (2 + 1), Gemma 3 (one tensor handed on: the residual stream), DeepSeek-V3's latent cache and experts,
    Llama-4's chunked and NoPE layers, GLM-4.5's: the last stage's logits equal one rank's."""
    folders = [make_tiny_model(tmp_path / "llama", "llama", seed=11, num_hidden_layers=4, tie_word_embeddings=False),
               make_tiny_model(tmp_path / "qwen2", "qwen2", seed=12, num_hidden_layers=3, tie_word_embeddings=True),
               tiny_qwen3_moe_dir, tiny_gemma3_dir, tiny_deepseek_dir, tiny_llama4_dir, tiny_mixtral_dir,
               tiny_qwen2_moe_dir, tiny_phi3_dir, tiny_gemma2_dir, tiny_granite_dir, tiny_olmo2_dir, tiny_glm4_moe_dir]
    folders = [str(f) for f in folders]
    check_stages(run_stages(tmp_path, folders, 1, 2), folders, 1, 2)


def test_stages_of_tensor_parallel_ranks_match_one_rank(make_tiny_model, tmp_path, tiny_deepseek_dir):
    """PP 2 x TP 2 (four processes, a tensor-parallel group per stage) and PP 3 over four layers (1 + 2 + 1): Llama,
    and DeepSeek-V3 with its experts whole per rank (expert parallel within each stage)."""
    llama = str(make_tiny_model(tmp_path / "llama", "llama", seed=13, num_hidden_layers=4, tie_word_embeddings=True))
    deepseek_ep = tmp_path / "deepseek-ep"
    deepseek_ep.symlink_to(tiny_deepseek_dir, target_is_directory=True)
    folders = [llama, str(deepseek_ep)]
    (tmp_path / "tp").mkdir()
    check_stages(run_stages(tmp_path / "tp", folders, 2, 2), folders, 2, 2)
    (tmp_path / "pp3").mkdir()
    results = run_stages(tmp_path / "pp3", [llama], 1, 3)
    check_stages(results, [llama], 1, 3)
    assert [r[llama]["layers"] for r in results] == [[0], [1, 2], [3]]


def test_a_stage_reads_only_its_own_tensors_of_an_fp8_release(make_tiny_model, tmp_path, monkeypatch):
    """An FP8 release over two stages: each stage dequantizes only its own layers' weights (the others' are not
    read), and holds the same values as the whole model loaded from the same files."""
    import specray.models.fp8 as fp8
    import specray_test_checkpoints as checkpoints

    folder = make_tiny_model(tmp_path / "m", "llama", seed=4, num_hidden_layers=4, tie_word_embeddings=True)
    release, _ = checkpoints.write_fp8(folder, tmp_path / "q")
    calls = []
    original = fp8.dequantize
    monkeypatch.setattr(fp8, "dequantize", lambda *a: calls.append(1) or original(*a))
    whole = load_model(release, pack=False)
    per_model = len(calls)
    params = dict(whole.named_parameters(remove_duplicate=False))
    for stage in (PPGroup(0, 2, None, 1), PPGroup(1, 2, 0, None)):
        calls.clear()
        part = load_model(release, pack=False, pp=stage)
        other = f"model.layers.{3 - 3 * stage.stage}.mlp.up_proj.weight"  # the last layer, or the first
        assert 0 < len(calls) < per_model and not part.reads_weight(other)
        for name, p in part.named_parameters():
            torch.testing.assert_close(p, params[name], rtol=0, atol=0)
    assert per_model == 4 * 7  # every layer's seven projections
