#!/usr/bin/env bash
# Prepares, on this machine, what a lent GPU machine's image lacks for benchmarks/gpu_check.sh, and prints the
# command to run there: the wheels of the packages the image does not have at our versions (.whl/, 17 MB:
# transformers, gguf, llguidance, jsonschema and its three dependencies; no Ray, which is 79 MB) and the dummy model
# folders of the real-size section (.dummy/: config and tokenizer, 7 MB). Both folders are git-ignored here
# (.git/info/exclude) and travel with the device call's `carry`. The default model's GGUF (90 MB compressed) does
# not fit one call beside them: its section is skipped there unless carried in parts (docs/experiments).
# Run from the repository root with the venv active (the default model installed: the dummy folders take its
# tokenizer).
set -eu
for folder in .whl .dummy; do
  grep -qx "/$folder/" .git/info/exclude || echo "/$folder/" >> .git/info/exclude
done
platforms=()
for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do platforms+=(--platform "manylinux_${n}_x86_64"); done
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
for pkg in transformers gguf llguidance jsonschema jsonschema-specifications referencing rpds-py; do
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "$pkg==$(version "$pkg")"
done
python benchmarks/dummy_model.py --shape llama3-8b --out .dummy/llama3-8b >/dev/null
python benchmarks/dummy_model.py --shape llama3-8b --quantization awq --out .dummy/llama3-8b-awq >/dev/null
python benchmarks/dummy_model.py --shape llama3-8b --quantization fp8-dynamic --out .dummy/llama3-8b-fp8 >/dev/null
python benchmarks/dummy_model.py --shape llama3-8b --quantization int8-w8a8 --out .dummy/llama3-8b-int8 >/dev/null
python benchmarks/dummy_model.py --shape llama3-8b --quantization fp8-block --out .dummy/llama3-8b-fp8-block >/dev/null
python benchmarks/dummy_model.py --shape qwen3-30b-a3b --quantization fp8-block --out .dummy/qwen3-30b-a3b-fp8-block \
  >/dev/null
python benchmarks/dummy_model.py --shape qwen3-30b-a3b --out .dummy/qwen3-30b-a3b >/dev/null
python benchmarks/dummy_model.py --shape deepseek-v2-lite --out .dummy/deepseek-v2-lite >/dev/null
python benchmarks/dummy_model.py --shape deepseek-v4-flash-4l --out .dummy/deepseek-v4-flash-4l >/dev/null
du -sh .whl .dummy
cat <<'EOF'
# the device call (carry: [".whl", ".dummy"]). Two calls on one warm machine (it goes back 30 s after a call):
# CHECKS="suite" (204 s on an H200 with 15 workers, 2026-11-27) then CHECKS="w8a8 real-size" (the 8-bit linears'
# rows first, then experts' rows; the Llama rows and cost curves after them do not fit the rest of a 15-minute
# session):
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit; python3 -m pip install -q --no-deps --no-build-isolation \
  --ignore-requires-python -e . >/dev/null 2>&1 || exit 3; CHECKS="suite real-size" DUMMY=.dummy WORKERS=15 \
  SUITE_S=240 BENCH_S=100 OUT=/tmp/check bash benchmarks/gpu_check.sh 2>&1; tar czf $OUT/check.tgz -C /tmp check
EOF
