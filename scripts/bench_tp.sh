#!/usr/bin/env bash
# Tensor-parallel step time for t = 1, 2, 4 (with and without --sp) at a fixed batch, and the TP traffic
# per step and rank the driver counts (all-reduce / reduce-scatter / all-gather MiB).
# CPU engine: a d4 GPT-2 on tinyshakespeare (4 heads, so t up to 4). CUDA engine (`gpu`): GPT-2 124M; on one
# GPU the ranks share it, so collectives go over the MPI transport through host memory and the table
# shows that transport's cost, not NCCL's. With `gpu nccl` on a node of at least 4 GPUs: NCCL.
# Usage: bash scripts/bench_tp.sh [cpu|gpu] [mpi|nccl] [steps]
set -u
cd "$(dirname "$0")/.."
engine=${1:-cpu}
comm=${2:-auto}
steps=${3:-8}
if [ "$engine" = gpu ]; then
    bin=./train_gpt; model=d12; B=8; T=1024
else
    bin=./train_gpt_cpu; model=d4; B=8; T=64
fi
[ "$comm" = mpi ] || [ "$comm" = nccl ] || comm=auto
echo "| engine | comm | t | SP | ms/step | tok/s | TP all-reduce MiB | reduce-scatter MiB | all-gather MiB |"
echo "|---|---|---|---|---|---|---|---|---|"
for t in 1 2 4; do
    for sp in 0 1; do
        [ "$t" = 1 ] && [ "$sp" = 1 ] && continue
        flags="--tp $t"
        [ "$sp" = 1 ] && flags="$flags --sp"
        log=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np "$t" --oversubscribe --bind-to none \
            -x OMP_NUM_THREADS=$(( $(nproc) / t > 0 ? $(nproc) / t : 1 )) \
            "$bin" -e "$model" -b "$B" -t "$T" -x "$steps" -v 0 -s 0 --comm "$comm" $flags 2>&1)
        mean=$(echo "$log" | grep "^mean of steps" | awk '{ print $7 }')
        if [ -z "$mean" ]; then
            echo "| $engine | $comm | $t | $sp | $(echo "$log" | grep -m1 error || echo failed) | | | | |"
            continue
        fi
        traffic=$(echo "$log" | grep "^tensor-parallel traffic" | sed 's/[(),]/ /g' | awk '{ print $9, $13, $17 }')
        [ -z "$traffic" ] && traffic="0 0 0"
        echo "$mean $traffic" | awk -v e="$engine" -v c="$comm" -v t="$t" -v sp="$sp" -v tok=$((B * T)) '{
            printf "| %s | %s | %s | %s | %.1f | %.0f | %s | %s | %s |\n", e, c, t, sp ? "yes" : "no", $1, tok / ($1 / 1000), $2, $3, $4 }'
    done
done
