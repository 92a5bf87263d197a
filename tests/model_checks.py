"""A model's logits over a paged cache, chunk by chunk, for the per-family tests that compare them with
transformers' (registered by conftest as ``specray_test_model_checks``)."""

from __future__ import annotations

import json
import multiprocessing
import random
import socket
import textwrap
import time
from pathlib import Path

import torch

from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache

BLOCK = 4
PROMPT_LEN = 40
# a full prefill; a chunked one (17 tokens: attended alone; 9 and 3: short queries over a context) then decode steps
SCHEDULES = {"prefill": [PROMPT_LEN], "chunked+decode": [17, 9, 3] + [1] * (PROMPT_LEN - 29)}


def prompt(seed: int = 0) -> list[int]:
    return torch.randint(0, 300, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def chunked_logits(model, ids: list[int], sizes: list[int], seed: int = 0, consecutive: bool = False) -> torch.Tensor:
    """One sequence run in chunks of ``sizes`` new tokens over a paged cache in shuffled blocks (``consecutive``:
    blocks in order, whose context attention reads as one view) on the model's device -> logits [L, V] on the CPU.
    A hybrid model's recurrent layers carry the sequence's state in slot 0 from chunk to chunk."""
    from specray.models.gated_deltanet import RecurrentBatch
    from specray.models.kv_cache import allocate_recurrent_state

    device = model.device
    allocate_kv_cache(model, 64, BLOCK)
    recurrent = allocate_recurrent_state(model, 2, 4) is not None
    needed = -(-len(ids) // BLOCK)
    table = list(range(3, 3 + needed)) if consecutive else random.Random(seed).sample(range(64), needed)
    out, start = [], 0
    for n in sizes:
        meta = build_attention_metadata([n], [start], [table], BLOCK, device)
        if recurrent:
            meta.recurrent = RecurrentBatch([0], [start == 0], [0], [0])
        out.append(model.compute_logits(model(torch.tensor(ids[start: start + n], device=device), meta)).cpu())
        start += n
    return torch.cat(out)


def mutated_logits(folder, mutate_config=None, mutate=None) -> torch.Tensor:
    """The chunked + decode schedule's logits [L, V] of the model in ``folder`` with a deliberate mistake: its config
    changed by ``mutate_config(config)`` before it is built, or the model by ``mutate(model)`` after (for the tests
    showing that a comparison with transformers sees each detail)."""
    from specray.models.loader import load_model, read_config

    config = read_config(str(folder))
    if mutate_config is not None:
        mutate_config(config)
    model = load_model(str(folder), config=config)
    if mutate is not None:
        mutate(model)
    return chunked_logits(model, prompt(), SCHEDULES["chunked+decode"])


@torch.no_grad()
def reference_logits(folder, model_class=None) -> torch.Tensor:
    """transformers' logits [L, V] of :func:`prompt` for the model in ``folder`` (fp32; ``model_class``: where
    transformers' auto class does not list it)."""
    from transformers import AutoModelForCausalLM

    hf = (model_class or AutoModelForCausalLM).from_pretrained(folder, dtype=torch.float32).eval()
    return hf(torch.tensor([prompt()])).logits[0].float()


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """``model``'s logits [len(ids), V] for one prefill of ``ids`` through a paged cache of 4-token blocks (taken in
    reverse order: a gathered table)."""
    blocks = -(-len(ids) // 4)
    allocate_kv_cache(model, blocks + 1, 4)
    meta = build_attention_metadata([len(ids)], [0], [list(range(blocks))[::-1]], 4, model.device)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids, device=model.device), meta))


def _first_tensor(out):
    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out if isinstance(out, torch.Tensor) else None


def recorded_outputs(model, run) -> list[tuple[str, torch.Tensor | None]]:
    """Every named module's first output tensor (float32, on the CPU), in call order, while ``run(model)`` runs."""
    seen: list[tuple[str, torch.Tensor | None]] = []
    hooks = [module.register_forward_hook(lambda m, args, out, name=name: seen.append(
        (name, None if _first_tensor(out) is None else _first_tensor(out).detach().float().cpu())))
        for name, module in model.named_modules() if name]
    try:
        with torch.no_grad():
            run(model)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def module_outputs(model, ids: list[int], sizes: list[int]) -> list[tuple[str, torch.Tensor | None]]:
    """Every named module's first output tensor, in call order, over the whole schedule (on the CPU)."""
    return recorded_outputs(model, lambda m: chunked_logits(m, ids, sizes))


def first_module_divergence(cpu_model, gpu_model, run, tol: float) -> str:
    """The first module call whose outputs differ by more than ``tol`` between the two models while ``run(model)``
    runs on each, with the largest magnitude of that output on the CPU."""
    for (name, a), (other, b) in zip(recorded_outputs(cpu_model, run), recorded_outputs(gpu_model, run)):
        assert name == other, (name, other)
        if a is not None and b is not None and a.shape == b.shape and max_diff(a, b) > tol:
            return f"{name}: {max_diff(a, b):.3g} (its outputs up to {a.abs().max().item():.3g})"
    return "no module's output differs"


def first_divergence(cpu_model, gpu_model, ids: list[int], sizes: list[int], tol: float) -> str:
    """The first module call whose outputs differ by more than ``tol`` between the two models over the schedule."""
    return first_module_divergence(cpu_model, gpu_model, lambda m: chunked_logits(m, ids, sizes), tol)


def assert_logits_on_the_gpu_equal_the_cpu(folder, sizes: list[int], tol: float = 1e-4, seed: int = 0) -> None:
    """fp32 logits of the model in ``folder`` on CUDA equal its CPU logits (the same random weights, the schedule of
    chunk ``sizes`` over a paged cache, :func:`prompt` of ``seed``); a failure names the first position and the first
    module that differ."""
    import pytest

    from specray.models.loader import load_model

    ids = prompt(seed)
    cpu, gpu = load_model(str(folder)), load_model(str(folder), device="cuda")
    want, got = chunked_logits(cpu, ids, sizes), chunked_logits(gpu, ids, sizes)
    if max_diff(got, want) > tol:
        rows = (got - want).abs().amax(-1)
        first = int((rows > tol).nonzero()[0])
        pytest.fail(f"logits differ by {max_diff(got, want):.3g}, first at position {first}; the first module: "
                    f"{first_divergence(cpu, gpu, ids, sizes, tol)}")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, equal entries counting 0 (a head scoring part of the vocabulary has -inf past it on both)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return torch.where(a == b, 0.0, (a - b).abs()).max().item()


def run_ranks(folder: Path, script: str, world: int, second: int, args: list[str], timeout: int = 300) -> list[dict]:
    """``world`` processes of ``script`` (a gloo worker) in ``folder``, each given ``rank second port folder *args``
    (``second``: the world size or the stage count, as the script reads it); each rank's JSON result
    (``folder/<rank>.json``)."""
    folder.mkdir(exist_ok=True)
    (folder / "worker.py").write_text(script)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    run_scripts(folder / "worker.py", [[str(r), str(second), port, str(folder), *args] for r in range(world)], timeout)
    return [json.loads((folder / f"{r}.json").read_text()) for r in range(world)]


# The ranks' processes fork from one server process per test session that has imported torch, transformers and
# specray's model code once: a fresh interpreter per rank would spend seconds on those imports each time.
_PRELOAD = ["torch", "torch.distributed", "transformers", "specray.models.loader", "specray.models.attention",
            "specray.models.kv_cache", "specray.models.cpu_kernels", "specray.workers.worker"]
_forkserver = None


def assert_ranks_match_one_rank(tmp_path: Path, folders: list[str], stages: int, tol: float) -> None:
    """:data:`DIFF_WORKER` over two ranks: two tensor-parallel ranks (``stages`` 1) or two pipeline stages (2), every
    folder's logits on the last stage within ``tol`` of one rank's (the first stage hands out none)."""
    results = run_ranks(tmp_path, DIFF_WORKER, 2, stages, folders)
    assert [d is None for d in results[0]["diffs"]] == [stages == 2] * len(folders), results
    assert all(d < tol for r in results for d in r["diffs"] if d is not None), results


def run_scripts(script: Path, argvs: list[list[str]], timeout: float) -> None:
    """One process per entry of ``argvs`` running ``script`` as ``__main__`` with that ``sys.argv[1:]``, all at
    once; fails unless every one exits 0 within ``timeout`` seconds."""
    global _forkserver
    if _forkserver is None:
        _forkserver = multiprocessing.get_context("forkserver")
        _forkserver.set_forkserver_preload(_PRELOAD)
    code = "import runpy, sys; sys.argv = {!r}; runpy.run_path({!r}, run_name='__main__')"
    procs = [_forkserver.Process(target=exec, args=(code.format([str(script), *argv], str(script)), {}))
             for argv in argvs]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * len(procs), f"{script}: exit codes {[p.exitcode for p in procs]}"


# the start of a gloo worker script for run_ranks (one rank of two; the rest loops over ``folders`` and writes
# ``{out}/{rank}.json``): its groups (``stages`` 1: tensor parallel, 2: two pipeline stages), and ``logits(model)``
# of two prefills (20 tokens, past a window of 8, and 7) then a step of 4 and 1 over shuffled and consecutive blocks
# (None on a stage before the last)
WORKER_PRELUDE = textwrap.dedent("""
    import gc, json, sys
    import torch, torch.distributed as dist
    from specray.models import cpu_kernels
    from specray.models.attention import build_attention_metadata as plan
    from specray.models.kv_cache import allocate_kv_cache
    from specray.models.loader import load_model
    from specray.workers.worker import join_groups

    torch.set_num_threads(1)
    rank, stages, port, out, *folders = sys.argv[1:]
    tp, pp = join_groups(torch.device("cpu"), int(rank), 2, f"tcp://127.0.0.1:{port}", int(stages))
    ids = torch.randint(0, 300, (32,), generator=torch.Generator().manual_seed(0))
    tables = [[5, 3, 9, 1, 7, 2, 8, 4, 6], [10, 11, 12, 13, 14, 15]]  # shuffled (gathered), consecutive

    @torch.no_grad()
    def logits(model):  # prefills of 20 (past a window of 8) and 7 tokens, then a step of 4 and 1
        allocate_kv_cache(model, 32, 4)
        hidden = [model(ids[:27], plan([20, 7], [0, 0], tables, 4)), model(ids[27:], plan([4, 1], [20, 7], tables, 4))]
        return None if hidden[0] is None else model.compute_logits(torch.cat(hidden))
""")

# WORKER_PRELUDE's ranks, each writing how far ``logits(model)`` of its share of each of ``folders`` is from one
# rank's (``diffs``, in order; None on a stage before the last): families' tensor-parallel and pipeline checks with
# nothing of their own, several in one launch of the ranks (a launch costs seconds)
DIFF_WORKER = WORKER_PRELUDE + textwrap.dedent("""

    diffs = []
    for folder in folders:
        model = load_model(folder, tp, pp=pp)
        ours = logits(model)
        one = None if ours is None else logits(load_model(folder))  # (equal entries count 0: -inf on both)
        diffs.append(None if ours is None else torch.where(ours == one, 0.0, (ours - one).abs()).max().item())
    del model  # gloo's threads end with the group only once nothing holds it
    gc.collect()
    dist.destroy_process_group()
    json.dump({"diffs": diffs}, open(f"{out}/{rank}.json", "w"))
""")
