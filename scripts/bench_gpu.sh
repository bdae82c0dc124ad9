#!/usr/bin/env bash
# Throughput of ./train_gpt on one GPU: ms/step, tok/s, MFU and GPU memory for GPT-2 124M (d12) and
# 350M (d24) at T=1024, with and without activation recomputation (B=128 does not fit 80 GB without it),
# printed as a markdown table. Averages skip the first 5 steps (warm-up). MFU counts the model's FLOPs,
# not the recomputed ones.
# Usage: bash scripts/bench_gpu.sh [steps]    (run from anywhere; needs `make train_gpt` done)
set -u
cd "$(dirname "$0")/.."
steps=${1:-25}
data=dev/data/tinyshakespeare/tiny_shakespeare_train.bin
echo "| model | B | T | recompute | ms/step | tok/s | MFU | GPU MiB |"
echo "|---|---|---|---|---|---|---|---|"
for cfg in "d12 16 none" "d12 64 none" "d12 64 selective" "d12 64 full" "d12 128 none" "d12 128 full" "d24 32 none" \
           "d24 32 full"; do
    set -- $cfg
    log=$(./train_gpt -e "$1" -b "$2" -t 1024 --recompute "$3" -x "$steps" -u 10 -v 0 -s 0 -i "$data" 2>&1)
    if ! echo "$log" | grep -q "^step $steps/"; then
        err=$(echo "$log" | grep -m1 "error" || echo "failed")
        echo "| $1 | $2 | 1024 | $3 | $err | | | |"
        continue
    fi
    echo "$log" | awk -F'|' -v m="$1" -v b="$2" -v r="$3" '
        /^GPU memory in use:/ { split($0, w, " "); mem = w[5] }
        /^step / { n++; if (n > 5) { split($5, a, " "); ms += a[1]; split($6, t, " "); tok += t[1];
                   split($7, u, " "); sub("%", "", u[2]); mfu += u[2]; k++ } }
        END { printf "| %s | %s | 1024 | %s | %.1f | %.0f | %.1f%% | %s |\n", m, b, r, ms / k, tok / k, mfu / k, mem }'
done
