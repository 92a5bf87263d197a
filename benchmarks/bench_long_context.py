"""Decode steps at long contexts (SmolLM2-135M, fp32, CPU threads): the padded batch that gathers every context
from the paged cache, against attending one sequence at a time with contexts read in place (the default on CPU
from ``OWN_MIN_CONTEXT``), with block tables placed by the block manager (consecutive) or shuffled (gathered).
The cache holds random values; attention's cost does not depend on them.

    python benchmarks/bench_long_context.py --threads 2 --batch 16 --contexts 256,512,1024,2048
"""

import argparse
import random
import sys
from pathlib import Path

import torch

from specray.default_model import default_model_path
from specray.models import cpu_kernels
from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import load_model
from specray.kv_blocks import BlockPool

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run standalone
from bench_forward import timeit  # noqa: E402

BS = 16


class Table:
    def __init__(self):
        self.block_ids = []


def tables_for(batch: int, context: int, num_blocks: int, shuffled: bool) -> list[list[int]]:
    """Tables grown as decoding grows them: a prefill of a quarter of the context each, then block by block in
    turn (the manager keeps them contiguous); or the same sizes from a shuffled pool."""
    bm, owners = BlockPool(num_blocks, BS), [Table() for _ in range(batch)]
    for slots in [context // 4] + list(range(context // 4 + BS, context + BS + 1, BS)):
        for o in owners:
            bm.allocate(o, min(slots, context + BS))
    if shuffled:
        pool = list(range(num_blocks))
        random.Random(0).shuffle(pool)
        return [[pool.pop() for _ in o.block_ids] for o in owners]
    return [o.block_ids for o in owners]


@torch.inference_mode()
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--contexts", default="256,512,1024,2048")
    parser.add_argument("--queries", default="1,5")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    model = load_model(default_model_path())
    num_blocks = args.batch * (max(contexts) // BS + 2) + 8
    cache = allocate_kv_cache(model, num_blocks, BS)
    for i in range(cache.num_layers):
        cache.layer(i).normal_()
    own_min = cpu_kernels.OWN_MIN_CONTEXT
    print(f"batch {args.batch}, ms per decode step (median of {args.repeats})\n")
    print("| context | tokens/seq | padded batch, gathered | one at a time, shuffled blocks (gathered) "
          "| one at a time, manager's blocks (in place) |\n|---|---|---|---|---|")
    for context in contexts:
        placed = tables_for(args.batch, context, num_blocks, shuffled=False)
        shuffled = tables_for(args.batch, context, num_blocks, shuffled=True)
        for q in (int(x) for x in args.queries.split(",")):
            ids = torch.randint(0, 1000, (args.batch * q,))
            row = []
            for tables, threshold in ((placed, 1 << 30), (shuffled, 0), (placed, 0)):
                cpu_kernels.OWN_MIN_CONTEXT = threshold
                meta = build_attention_metadata([q] * args.batch, [context] * args.batch, tables, BS)
                row.append(timeit(lambda: model.compute_logits(model(ids, meta)), args.repeats, warm=1))
            cpu_kernels.OWN_MIN_CONTEXT = own_min
            print(f"| {context} | {q} | " + " | ".join(f"{t:.0f}" for t in row) + " |", flush=True)


if __name__ == "__main__":
    main()
