"""Probe functions the tests run on a worker, in process or on every rank through ``collective_rpc`` /
``TargetWorker.run``: each is ``fn(worker, *args)`` and reads the worker through its public seams (the runner's
KV cache object and block tables, the model's KV specs and its forward), so the worker carries no test hooks.

The tests folder is not a package: load this file with ``importlib.util.spec_from_file_location`` under a name
outside ``sys.modules``, so that cloudpickle ships its functions by value and Ray actors run them without
importing anything from ``tests/``.
"""

from __future__ import annotations

import torch

from specray.contract import StepPlan, StepResult
from specray.models.kv_cache import slots_of
from specray.workers.model_runner import logit_rows


def execute_with_logits(worker, plan: StepPlan, draft_probs: dict | None = None
                        ) -> tuple[StepResult | None, torch.Tensor | None]:
    """``worker.execute`` plus the step's logits rows ([N, V] on CPU; None when nothing sampled), recomputed from
    the hidden states the model's forward returned (on every rank: the LM head gathers over the TP group)."""
    hidden: list[torch.Tensor] = []
    handle = worker.model.register_forward_hook(lambda _module, _args, out: hidden.append(out))
    try:
        result = worker.execute(plan, draft_probs)
    finally:
        handle.remove()
    rows = logit_rows(plan)
    if not rows:
        return result, None
    with torch.inference_mode():
        return result, worker.model.compute_logits(hidden[0][rows]).cpu()


def kv_snapshot(worker, req_id: str, num_tokens: int) -> list[torch.Tensor]:
    """Per layer on CPU, the cache of the request's first ``num_tokens`` positions read through its block table:
    k and v ``[2, num_tokens, local_kv_heads, head_dim]``, or a latent layer's ``[num_tokens, width]`` (MLA: the
    same on every rank)."""
    runner = worker.runner
    slots = slots_of(runner.block_tables[req_id], range(num_tokens), runner.block_size)
    layers = runner.kv_cache.snapshot(torch.tensor(slots, device=worker.device))  # [2, Hkv, n, D] or [n, W] each
    return [(kv.transpose(1, 2) if kv.dim() == 4 else kv).cpu() for kv in layers]


def kv_snapshots(worker, requests: list[tuple[str, int]]) -> list[torch.Tensor]:
    """:func:`kv_snapshot` of several ``(req_id, num_tokens)`` at once."""
    return [kv_snapshot(worker, req_id, n) for req_id, n in requests]


def kv_head_range(worker) -> tuple[int, int]:
    """The global KV heads the worker's rank holds: ``(start, count)`` (a latent cache: ``(0, 1)``, replicated)."""
    return getattr(worker.model.kv_cache_specs()[0], "kv_head_range", (0, 1))


def stage_layers(worker) -> list[int]:
    """The decoder layers this rank's pipeline stage holds."""
    return list(worker.model.model.stage)


def graph_shapes(worker) -> list[tuple[int, int, int]]:
    """The step shapes this rank replays from graphs (empty: none yet; None: its steps run eagerly), a tagged
    graph's (a recurrent model's tree form, multimodal RoPE) by its shape."""
    graphs = worker.runner.graphs
    return None if graphs is None else sorted(tuple(key if isinstance(key[0], int) else key[0])
                                              for key in graphs.graphs)


def graph_kinds(worker) -> tuple[bool, int]:
    """Whether this rank's target replayed a graph of the recurrent layers' tree form, and how many graphs its
    drafter's head replays (its own, or one per distinct MTP module)."""
    drafter = worker.runner.drafter
    head = [getattr(drafter, "graphs", None)] + list(getattr(drafter, "module_graphs", []))
    return (any("tree" in key for key in worker.runner.graphs.graphs),
            sum(len(g.graphs) for g in head if g is not None))


def rank(worker) -> int:
    return worker.rank


def head_share(worker) -> tuple[int, int, bool, bool] | None:
    """What of a hidden-state head the worker's rank holds (None: no head): its parameters' element count, its KV
    cache's bytes per block, whether it reads the target model itself (not a copy gathered whole), and whether its
    experts (an MTP block's) are whole per rank."""
    from specray.models.kv_cache import bytes_per_block

    head = worker.head
    if head is None:
        return None
    size = sum(p.numel() for p in head.parameters())  # and the weights packed for the CPU kernels (held apart)
    size += sum(m.packed.numel() for m in head.modules() if getattr(m, "packed", None) is not None)
    specs = head.kv_cache_specs() if hasattr(head, "kv_cache_specs") else []  # ReDrafter's has no attention
    first = head.heads[0] if hasattr(head, "heads") else head  # distinct MTP modules: the first's
    return (size, bytes_per_block(specs, worker.config.block_size, worker.dtype),
            getattr(first, "target", None) is worker.model,
            any(getattr(m, "expert_parallel", False) for m in head.modules()))


class NoisyTreeOracle:
    """A drafter for tests that knows each request's greedy continuation (``references``: req_id -> (prompt
    length, greedy output)) and proposes token trees: per level 1..branches siblings, the right token at a random
    sibling rank (so accepted paths are often not the first nodes: their K/V must move), wrong from a random depth
    on half the time. Deterministic for a seed."""

    def __init__(self, references: dict, vocab_size: int, seed: int = 0, branches: int = 3, depth: int = 4):
        import random

        self.references, self.vocab_size = references, vocab_size
        self.rng, self.branches, self.depth = random.Random(seed), branches, depth

    def propose(self, batch):
        from specray.drafters.base import Proposal

        out = []
        for d in batch:
            plen, ref = self.references[d.req_id]
            truth = list(ref[len(d.token_ids) - plen:][: self.depth])
            wrong_from = self.rng.randrange(len(truth) + 1) if self.rng.random() < 0.5 else len(truth)
            tokens, parents, parent = [], [], -1
            for level, right in enumerate(truth):
                if len(tokens) >= d.num_speculative_tokens:
                    break
                right = right if level < wrong_from else (right + 1) % self.vocab_size
                width = min(self.rng.randint(1, self.branches), d.num_speculative_tokens - len(tokens))
                rank = self.rng.randrange(width)
                siblings = [(right + 2 + j) % self.vocab_size for j in range(width)]  # wrong ones, distinct
                siblings[rank] = right
                first = len(tokens)
                tokens += siblings
                parents += [parent] * width
                parent = first + rank
            out.append(Proposal(tokens, parents=parents))
        return out

    def finish(self, req_ids) -> None:
        pass

    def shutdown(self) -> None:
        pass


def fail_next_verification(worker) -> None:
    """The driver rank's next verification raises, once (a fault in rank 0's own work after the forward that every
    rank ran); the other ranks are left as they are."""
    if worker.rank != 0:
        return
    runner = worker.runner
    verify = runner._verify_all

    def failing(*args, **kwargs):
        runner._verify_all = verify
        raise RuntimeError("injected verification fault")

    runner._verify_all = failing


def imported(_owner, module: str) -> bool:
    """Whether ``module`` has been imported in the process of the rank (or drafter actor) this runs on."""
    import sys

    return module in sys.modules


def pool_link_state(drafter, reply_timeout_s: float | None = None) -> tuple[bool, int, bool]:
    """A drafter actor's link to its shared pool: (given up, updates buffered for the pool, an exchange in flight);
    ``reply_timeout_s`` first sets how long the link waits for the pool's answers."""
    link = drafter.pool_link
    if reply_timeout_s is not None:
        link.reply_timeout_s = reply_timeout_s
    return link.failed, len(link.buffered), link.pending is not None
