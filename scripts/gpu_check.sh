#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, run the whole test
# suite on CUDA (the cuda-marked tests included), run the kernel benchmark, and
# print a short table last.  Full logs go under $OUT (or ./gpu-out).
#
#   bash scripts/gpu_check.sh [tests|bench|all] [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"; shift || true
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# The GPU image has no registry: packages travel as wheels in .whl/.
site=/tmp/site; mkdir -p "$site"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || exit 1
fi
# slothkit_kernels is the kernels/ folder under another name (see pyproject.toml).
ln -sfn "$PWD/kernels" "$site/slothkit_kernels"
export PYTHONPATH="$site:$PWD"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"

status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib -ra" \
        --junitxml="$OUT/junit.xml" "$@" tests 2>&1 | tee "$OUT/tests.log"
    status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    python3 -m slothkit_kernels.bench --cuda-graph --json "$OUT/kernels.json" --markdown "$OUT/kernels.md" 2>&1 \
        | tee "$OUT/bench.log" | tail -n 60
fi
echo "== summary =="
grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -n 3
exit $status
