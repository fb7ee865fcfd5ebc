#!/usr/bin/env bash
# The decode measurements of docs/inference.md in one command: the captured step of a
# model profiled bf16 + LoRA, merged and NF4 + LoRA at batch 1 (scripts/profile_decode.py,
# with the whole generate call broken down), then `slothkit bench generate` for the same
# three at batch 1 and 8 (scripts/gpu_bench.sh), and a short table of both last.  The
# profiles' records and logs are bundled into $OUT/decode-profiles.tgz (a GPU machine
# returns only a few files), the bench's into $OUT/bench-records.tgz, the table is
# $OUT/decode-summary.md.
#
#   bash scripts/gpu_decode.sh [model]        # default llama-3-8b
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
model="${1:-llama-3-8b}"
root=$PWD
profile_dir=$(mktemp -d)
profiles=(lora "lora --merged" qlora)
for mode in "${profiles[@]}"; do
    name="profile-$model-${mode// --/-}"
    echo "== profile_decode $model $mode  ($(date +%T))"
    # From /tmp: with a wheel installed, the checkout's slothkit/ must not shadow it.
    (cd /tmp && python3 "$root/scripts/profile_decode.py" --model "$model" --mode $mode \
        --json "$profile_dir/$name.json") > "$profile_dir/$name.log" 2>&1 || echo "   failed: see $name.log in decode-profiles.tgz"
    grep -E "^graph replay|^generate" "$profile_dir/$name.log"
    tar czf "$OUT/decode-profiles.tgz" -C "$profile_dir" .
done
bash scripts/gpu_bench.sh \
    "generate --model $model --mode lora --batch 1,8 --new-tokens 128 --impl slothkit,slothkit-merged" \
    "generate --model $model --mode qlora --batch 1,8 --new-tokens 128 --impl slothkit"
python3 - "$profile_dir" "$model" <<'EOF' | tee "$OUT/decode-summary.md"
import json, pathlib, sys

out, model = pathlib.Path(sys.argv[1]), sys.argv[2]
print(f"\n| {model}, batch 1 | replay ms | floor ms (copy) | kernels | kernel ms | generate tokens/s | ms a token beyond a replay |")
print("|---|---|---|---|---|---|---|")
for path in sorted(out.glob(f"profile-{model}-*.json")):
    r = json.loads(path.read_text())
    g = r.get("generate", {})
    print(
        f"| {path.stem.removeprefix(f'profile-{model}-')} | {r['step_ms']:.2f} | {r['bandwidth_floor_ms']:.2f}"
        f" ({r['floor_bandwidth_tbs']} TB/s) | {r['kernels_per_step']:.0f} | {r['kernel_ms_per_step']:.2f}"
        f" | {g.get('tokens_per_s', float('nan')):.1f} | {g.get('per_token_beyond_replay_ms', float('nan')):.3f} |"
    )
EOF
