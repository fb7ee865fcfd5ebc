#!/usr/bin/env bash
# Mixture-of-experts on a GPU machine in one call: the CUDA tests of the MoE kernels, the
# engine's experts and their decode, the experts' timing at two real layer shapes (16-bit
# and NF4) and the decode step's expert products,
# a profile of a training step, then `slothkit bench train` jobs; a short table last.
# Full logs go under $OUT.
#
#   bash scripts/gpu_moe.sh [bench job ...]
#   bash scripts/gpu_moe.sh "train --model qwen3-30b-a3b-12l --mode qlora --impl slothkit,hf,unsloth --no-autocast"
#
# MOE_STEPS="tests timing profile" (the default) or a subset; MOE_STEPS="" runs the jobs only.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
steps="${MOE_STEPS-tests timing profile}"

if [[ " $steps " == *" tests "* ]]; then
    echo "== tests ($(date +%T))"
    python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib -ra" -m "not real_model" \
        tests/kernels/moe tests/kernels/nf4/test_dequantize.py tests/slothkit/engine/test_experts.py \
        tests/slothkit/inference/test_decode_experts.py \
        > "$OUT/moe-tests.log" 2>&1
    tail -n 3 "$OUT/moe-tests.log"
fi
if [[ " $steps " == *" timing "* ]]; then
    for shape in qwen3-30b-a3b gpt-oss-20b; do
        echo "== experts timing, $shape ($(date +%T))"
        python3 scripts/moe_nf4_timing.py --shape "$shape" 2>&1 | tee "$OUT/moe-timing-$shape.md"
    done
    echo "== decode step's expert products, qwen3-30b-a3b ($(date +%T))"
    python3 scripts/moe_decode_timing.py --shape qwen3-30b-a3b 2>&1 | tee "$OUT/moe-decode-timing.md"
fi
if [[ " $steps " == *" profile "* ]]; then
    echo "== profile, qwen3-30b-a3b, 4 layers ($(date +%T))"
    python3 scripts/profile_train_step.py --model qwen3-30b-a3b-12l --layers 4 --modes lora,qlora --no-autocast \
        > "$OUT/moe-profile.log" 2>&1
    head -n 80 "$OUT/moe-profile.log"
fi
if [ "$#" -gt 0 ]; then
    bash scripts/gpu_bench.sh "$@"
fi
