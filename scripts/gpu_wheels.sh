#!/usr/bin/env bash
# Download the wheels a GPU machine's run needs into .whl/<set>/ (docs/gpu-runs.md), for its
# Python (3.12), on a machine with a registry.  The unsloth wheel is rebuilt without its
# top-level studio/ folder (a web UI of about 25 MB that training does not import), so
# that .whl/base and .whl/unsloth together stay under the 64 MiB one call carries.
#
#   bash scripts/gpu_wheels.sh base unsloth      # or: trl116, gguf
set -euo pipefail
cd "$(dirname "$0")/.."
download=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64)
for set in "$@"; do
    mkdir -p ".whl/$set"
    case "$set" in
        base) "${download[@]}" -d .whl/base bitsandbytes==0.50.2 liger-kernel==0.8.5 dill multiprocess xxhash ;;
        trl116) "${download[@]}" -d .whl/trl116 trl==1.16.0 datasets==5.2.0 ;;
        gguf) "${download[@]}" -d .whl/gguf gguf llama-cpp-python ;;
        unsloth)
            "${download[@]}" -d .whl/unsloth unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5
            wheel=$(ls .whl/unsloth/unsloth-2026.10.9-*.whl)
            # (a count, not grep -q: an early exit of grep would fail the pipe under pipefail)
            if [ "$(unzip -Z1 "$wheel" | grep -c '^studio/' || true)" -gt 0 ]; then
                work=$(mktemp -d)
                unzip -q "$wheel" -d "$work"
                rm -rf "$work/studio"
                sed -i '/^studio\//d' "$work"/unsloth-*.dist-info/RECORD
                rm "$wheel"
                (cd "$work" && zip -q -r "$OLDPWD/$wheel" .)
                rm -rf "$work"
            fi
            ;;
        *) echo "unknown wheel set '$set': base, unsloth, trl116 or gguf" >&2; exit 2 ;;
    esac
    du -sh ".whl/$set"
done
