"""How the cost of all of SmolLM2-135M's matmuls depends on the row count (tokens in a step) on this CPU: the raw
``W @ x^T`` at every width, ``specray.models.layers.linear`` on dense weights (each width run as
``padded_rows(width)`` rows), and ``linear`` on oneDNN-packed weights (what ``load_model`` uses on CPU). Widths
are interleaved over the repeats and the medians printed.

    python benchmarks/bench_rows.py --threads 2 --max-rows 32 --repeats 7
"""

import argparse
import statistics
import time

import torch

from specray.default_model import default_model_path
from specray.models.cpu_kernels import pack_weight, padded_rows
from specray.models.layers import linear
from specray.models.loader import load_model


def weights(model) -> list[torch.Tensor]:
    """Every 2-D weight a decode step multiplies by (the embedding is the tied LM head)."""
    return [p for p in model.parameters() if p.dim() == 2]


@torch.inference_mode()
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ws = weights(load_model(default_model_path(), pack=False))
    packed = [pack_weight(w) for w in ws]
    xs = {k: torch.randn(args.max_rows, k) for k in {w.shape[1] for w in ws}}

    def raw(m):
        for w in ws:
            torch.mm(w, xs[w.shape[1]][:m].t())

    def ours(m):
        for w in ws:
            linear(xs[w.shape[1]][:m], w)

    def onednn(m):
        for w, p in zip(ws, packed):
            linear(xs[w.shape[1]][:m], None, packed=p)

    fns = (raw, ours, onednn)
    times = {(m, f): [] for m in range(1, args.max_rows + 1) for f in fns}
    for _ in range(args.repeats):
        for m, f in times:
            start = time.perf_counter()
            f(m)
            times[m, f].append(time.perf_counter() - start)
    print("| rows | W @ x^T ms | linear, dense ms (runs as) | linear, packed ms |\n|---|---|---|---|")
    for m in range(1, args.max_rows + 1):
        med = [statistics.median(times[m, f]) * 1e3 for f in fns]
        print(f"| {m} | {med[0]:.1f} | {med[1]:.1f} ({padded_rows(m)}) | {med[2]:.1f} |")


if __name__ == "__main__":
    main()
