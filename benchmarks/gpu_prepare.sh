#!/usr/bin/env bash
# Prepares, on this machine, what a lent GPU machine's image lacks for benchmarks/gpu_check.sh, and prints the
# command to run there: the packages the image does not have at our versions (transformers, gguf, llguidance,
# jsonschema and its three dependencies, PyAV; no Ray, which is 79 MB) unzipped from their wheels into one folder and
# xz'd (.gpu/site.tar.xz, 32 MB: the wheels themselves are 51 MB, over one call's 64 MiB beside the working tree), and
# the dummy model folders of the real-size section (.dummy/: config and tokenizer, 3.4 MB each; xz'd together into
# .gpu/dummy.tar.xz, 0.5 MB). Both folders are git-ignored here (.git/info/exclude); .gpu travels with the device
# call's `carry`. The default model's GGUF (90 MB
# compressed) does not fit one call beside them: its section is skipped there unless carried in parts
# (docs/experiments). Run from the repository root with the venv active (the default model installed: the dummy
# folders take its tokenizer).
set -eu
for folder in .whl .gpu .dummy; do
  grep -qx "/$folder/" .git/info/exclude || echo "/$folder/" >> .git/info/exclude
done
platforms=()
for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do platforms+=(--platform "manylinux_${n}_x86_64"); done
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
for pkg in transformers gguf llguidance jsonschema jsonschema-specifications referencing rpds-py av; do
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "$pkg==$(version "$pkg")"
done
site=$(mktemp -d)
for wheel in .whl/*.whl; do unzip -q -o "$wheel" -d "$site/site"; done
mkdir -p .gpu && tar cf - -C "$site" site | xz -6 -T0 > .gpu/site.tar.xz && rm -rf "$site"
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
tar cf - .dummy | xz -6 -T0 > .gpu/dummy.tar.xz
du -sh .gpu/*.tar.xz
cat <<'EOF'
# the device call (carry: [".gpu"]). The suite alone took 344 s on an H200 with 16 workers (2026-11-30,
# every test but Ray's); SUITE_FIRST may name the test files added since the last GPU run, run before the rest:
tar xJf .gpu/site.tar.xz -C /tmp && tar xJf .gpu/dummy.tar.xz -C /tmp && export PYTHONPATH=/tmp/site || exit 4
python3 -m pip install -q --no-deps --no-build-isolation --ignore-requires-python -e . >/dev/null 2>&1 || exit 3
CHECKS="suite" DUMMY=/tmp/.dummy WORKERS=16 SUITE_S=410 BENCH_S=100 bash benchmarks/gpu_check.sh 2>&1
EOF
