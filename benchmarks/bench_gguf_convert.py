"""Converting a GGUF: wall time, peak memory (the process's maximum resident set) and bytes on disk for a shard
size and a storage dtype.

The conversion (``specray.models.loader.convert_gguf``) writes safetensors shards of about ``GGUF_SHARD_BYTES``
(float32, or the dtype ``SPECRAY_GGUF_DTYPE`` names) and holds one shard (plus a layer) at a time. Each run converts
the GGUF afresh, in a child process of its own (peak memory is per process), into an empty cache folder, at each
``--dtype`` and ``--shard-mb`` in turn (rows alternate over ``--rounds``), and prints one row per run: dtype, shard
size, seconds, peak RSS, the shards written and their bytes on disk. The default model's GGUF
(SmolLM2-135M-Instruct, Q4_1) unless ``--gguf``:

    PYTHONSAFEPATH=1 python benchmarks/bench_gguf_convert.py --shard-mb 2048,64 --rounds 2
    PYTHONSAFEPATH=1 python benchmarks/bench_gguf_convert.py --shard-mb 2048 --dtype float32,bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, os, resource, sys, time
from pathlib import Path
from specray.models import loader
loader.GGUF_SHARD_BYTES = int(sys.argv[2])
start = time.perf_counter()
folder = loader.convert_gguf(Path(sys.argv[1]))
seconds = time.perf_counter() - start
shards = sorted(folder.glob("*.safetensors"))
print(json.dumps({"seconds": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "shards": len(shards), "disk_mb": sum(p.stat().st_size for p in shards) / 2**20}))
"""


def convert_once(gguf: Path, shard_bytes: int, dtype: str = "float32") -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "SPECRAY_CACHE_DIR": cache, "SPECRAY_GGUF_DTYPE": dtype}
        out = subprocess.run([sys.executable, "-c", CHILD, str(gguf), str(shard_bytes)], env=env, check=True,
                             capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=None, help="a .gguf file (default: the default model's)")
    parser.add_argument("--shard-mb", default="2048,64", help="comma list of shard sizes in MiB")
    parser.add_argument("--dtype", default="float32", help="comma list of storage dtypes (SPECRAY_GGUF_DTYPE)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.gguf is None:
        from specray.default_model import default_model_path

        gguf = Path(default_model_path())
    else:
        gguf = Path(args.gguf)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    print(f"# {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB), {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, commit {commit}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| dtype | shard MiB | round | seconds | peak RSS MiB | shards | on disk MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        for dtype in args.dtype.split(","):
            for mb in (int(m) for m in args.shard_mb.split(",")):
                row = convert_once(gguf, mb << 20, dtype)
                print(f"| {dtype} | {mb} | {r + 1} | {row['seconds']:.1f} | {row['peak_rss_mb']:.0f} | "
                      f"{row['shards']} | {row['disk_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
