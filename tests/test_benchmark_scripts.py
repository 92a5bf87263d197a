"""The benchmark scripts' options: a bad one is refused (exit 2, the flag named) before any model or tokenizer
loads, rather than crashing mid-table or measuring something other than it names."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, argv, says", [
    ("bench_prefix_cache", ["--workloads", "multi-turn,bogus"], "--workloads multi-turn,bogus: unknown ['bogus']"),
    ("bench_prefix_cache", ["--requests", "0"], "--requests 0: give 1 or more"),
    ("bench_prefix_cache", ["--rounds", "0"], "--rounds 0: give 1 or more"),
    ("bench_prefix_cache", ["--turns", "7"], "--turns 7: the conversation has 6 turns"),
    ("bench_overhead", ["--steps", "0"], "--steps, --prompt-len, --max-tokens and -k take 1 or more"),
    ("bench_overhead", ["--batch", "0"], "--batch 0: give a comma list of batch sizes >= 1"),
    ("bench_overhead", ["--device-ms", "-1"], "--device-ms -1.0: give 0"),
    ("bench_overhead", ["--async-scheduling", "maybe"], "--async-scheduling maybe: expected a comma list of off, on"),
    ("bench_overhead", ["--ngram-index", "rust"], "--ngram-index rust: expected c or python"),
    ("bench_overhead", ["--methods", "ngram,bogus"], "speculative_config.method='bogus' is unknown"),
    ("bench_offline", ["--batches", "1,3"], "--batches 1,3: give a comma list of 1 or 8"),  # (3 ran batch 1)
    ("bench_offline", ["--modes", "eagr"], "--modes eagr: give a comma list of eager, graphs"),
    ("bench_offline", ["--kinds", "open-ended,bogus"], "--kinds open-ended,bogus: unknown ['bogus']"),
    ("bench_offline", ["--spec", "x=notjson"], "--spec x=notjson: give NAME=JSON"),
    ("bench_offline", ["--repeats", "0"], "--repeats 0: give 1 or more"),
])
def test_bad_options_are_refused_before_anything_runs(capsys, name, argv, says):
    with pytest.raises(SystemExit) as exit_:
        _script(name).main(argv)
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and says in captured.err and "|" not in captured.out


def test_replay_answers_are_kept_per_max_tokens():
    """bench_replay's --answers file never hands a run answers recorded at another --max-tokens."""
    sys.path.insert(0, str(BENCHMARKS))  # (bench_replay imports bench_offline)
    try:
        key = _script("bench_replay").answers_key
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert key("open-ended", 8) != key("open-ended", 128) and "open-ended" not in {key("open-ended", 8)}
