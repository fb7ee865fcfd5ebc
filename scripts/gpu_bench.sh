#!/usr/bin/env bash
# Several `slothkit bench` runs in a row on a GPU machine, each with its own log and
# JSON record under $OUT, and a short table of every record last.
#
#   bash scripts/gpu_bench.sh "train --model gemma-7b --mode lora --impl slothkit,hf,liger" \
#                             "context --model llama-3-8b --impl slothkit" ...
#
# Each argument is one `slothkit bench` command line without --output (an optional
# --tag NAME is added to the file names); the record and log are written as
# <n>-<kind>-<model>-<mode>[-NAME].json/.log and bundled into $OUT/bench-records.tgz
# every 15 s and after every job, so that one archive holds every record, and a run cut
# short at a time limit still returns what finished (the record lists the
# implementations it had not reached under "pending").  A job that
# fails does not stop the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh

runs=$(mktemp -d)
n=0
for job in "$@"; do
    n=$((n + 1))
    read -r -a words <<< "$job"
    kind=${words[0]}
    model=$(sed -n 's/.*--model \([^ ]*\).*/\1/p' <<< "$job"); model=${model:-llama-3-8b}
    mode=$(sed -n 's/.*--mode \([^ ]*\).*/\1/p' <<< "$job"); mode=${mode:-lora}
    tag=$(sed -n 's/.*--tag \([^ ]*\).*/\1/p' <<< "$job")
    job=$(sed 's/ --tag [^ ]*//' <<< "$job")
    name="$n-$kind-$model-$mode${tag:+-$tag}"
    echo "== [$n/$#] slothkit bench $job  ($(date +%T))"
    start=$SECONDS
    python3 -m slothkit.cli bench $job --output "$runs/$name.json" > "$runs/$name.log" 2>&1 &
    pid=$!
    # The record is rewritten after each implementation; bundle it every 15 s, so that a
    # run killed at a time limit still brings back the implementations that finished.
    while kill -0 "$pid" 2>/dev/null; do
        sleep 15
        tar czf "$OUT/bench-records.tgz" -C "$runs" . 2>/dev/null
    done
    wait "$pid"
    echo "   exit $? after $((SECONDS - start)) s"
    grep -E "^\|" "$runs/$name.log" | head -n 12
    grep -E "longest|skipped|error" "$runs/$name.log" | head -n 6
    tar czf "$OUT/bench-records.tgz" -C "$runs" .
done
echo "== done $(date +%T)"
