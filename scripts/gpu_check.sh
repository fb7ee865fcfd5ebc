#!/usr/bin/env bash
# On a GPU machine: install the wheels under .whl/, run the whole test
# suite on CUDA (the cuda-marked tests included), run the kernel benchmark, and
# print a short table last.  Full logs go under $OUT (or ./gpu-out).
#
#   bash scripts/gpu_check.sh [tests|bench|all] [pytest args; default: tests]
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"; shift || true
source scripts/gpu_env.sh

status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
    # The GPU machine reaches no package index: the real-model tests (which fetch their
    # models from PyPI on first use) run on CI's machines instead.
    python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib -ra" -m "not real_model" \
        --junitxml="$OUT/junit.xml" "${@:-tests}" 2>&1 | tee "$OUT/tests.log"
    status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    python3 -m slothkit.bench.kernels --cuda-graph --json "$OUT/kernels.json" --markdown "$OUT/kernels.md" 2>&1 \
        | tee "$OUT/bench.log" | tail -n 60
fi
echo "== summary =="
grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -n 3
exit $status
