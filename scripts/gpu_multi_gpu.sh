#!/usr/bin/env bash
# The multi-GPU checks of docs/multi-gpu.md, on a machine with two or more GPUs; each
# writes its log (and bench record) under $OUT.
#
#   bash scripts/gpu_multi_gpu.sh notebook      # the fine-tune notebook's script on every GPU
#   bash scripts/gpu_multi_gpu.sh bench lora    # slothkit and HF + PEFT, one GPU and all of them
#   bash scripts/gpu_multi_gpu.sh bench qlora
#
# notebook: notebooks/llama-3-8b-finetune.py (the notebook as jupytext exports it) under
# torchrun, one process per GPU, on a tiny random Llama loaded in 4 bits (the notebook's
# default), 30 steps, the LoRA adapter saved by process 0 only.
# bench: `slothkit bench train --gpus N` on Llama-3-8B, 2 x 2048 per GPU, without
# autocast (the README's headline setting): about 6 minutes per mode on H200s.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
gpus=$(nvidia-smi -L | wc -l)
case "${1:-}" in
notebook)
    model=$(python3 -c "from slothkit.testing import build_tiny_model; print(build_tiny_model('llama', '/tmp/multi-gpu-tiny-llama'))")
    SLOTHKIT_NO_INSTALL=1 SLOTHKIT_MODEL_NAME="$model" SLOTHKIT_MAX_STEPS=30 SLOTHKIT_LEARNING_RATE=0.002 \
        SLOTHKIT_SAVE_MERGED=0 SLOTHKIT_SAVE_GGUF=0 SLOTHKIT_OUTPUT_DIR="$OUT/notebook" HF_HUB_OFFLINE=1 \
        MPLBACKEND=Agg python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" \
        notebooks/llama-3-8b-finetune.py 2>&1 | tee "$OUT/notebook-$gpus-gpus.log"
    ls -l "$OUT/notebook/lora"
    ;;
bench)
    mode=${2:?bench needs a mode: lora or qlora}
    bash scripts/gpu_bench.sh \
        "train --gpus $gpus --model llama-3-8b --mode $mode --impl slothkit,hf --no-autocast --tag ddp-$gpus-gpus-no-autocast"
    ;;
*)
    echo "usage: bash scripts/gpu_multi_gpu.sh notebook | bench lora | bench qlora" >&2
    exit 2
    ;;
esac
