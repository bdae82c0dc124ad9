#!/usr/bin/env bash
# Data-parallel step time and the share spent in the optimizer step (gradient all-reduce or
# reduce-scatter + AdamW + all-gather), for d = 1, 2, 4 and ZeRO 0-3, at a fixed global batch.
# (ZeRO-2/3 reduce during backward, so their optimizer step holds no gradient communication.)
# CPU engine: a d2 GPT-2 on tinyshakespeare. CUDA engine (`gpu`): GPT-2 124M; on one GPU the ranks share
# it, so this measures the MPI transport's host-staging overhead.
# Usage: bash scripts/bench_dp.sh [cpu|gpu] [steps]
set -u
cd "$(dirname "$0")/.."
engine=${1:-cpu}
steps=${2:-8}
if [ "$engine" = gpu ]; then
    bin=./train_gpt; model=d12; global_b=16; T=1024
else
    bin=./train_gpt_cpu; model=d2; global_b=8; T=64
fi
echo "| engine | d | ZeRO | ms/step | optimizer step ms | optimizer share |"
echo "|---|---|---|---|---|---|"
for d in 1 2 4; do
    for zero in 0 1 2 3; do
        [ "$d" = 1 ] && [ "$zero" != 0 ] && continue
        log=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np "$d" --oversubscribe --bind-to none \
            -x OMP_NUM_THREADS=$(( $(nproc) / d > 0 ? $(nproc) / d : 1 )) \
            "$bin" -e "$model" -b $((global_b / d)) -t "$T" -x "$steps" -v 0 -s 0 --zero "$zero" 2>&1)
        line=$(echo "$log" | grep "^mean of steps")
        if [ -z "$line" ]; then
            echo "| $engine | $d | $zero | $(echo "$log" | grep -m1 error || echo failed) | | |"
            continue
        fi
        echo "$line" | awk -v e="$engine" -v d="$d" -v z="$zero" '{ ms = $7; up = $11;
            printf "| %s | %s | %s | %.1f | %.1f | %.0f%% |\n", e, d, z, ms, up, 100 * up / ms }'
    done
done
