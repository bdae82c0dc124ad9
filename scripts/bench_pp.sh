#!/usr/bin/env bash
# Pipeline bubble, measured against the schedule simulator's prediction, for each schedule at p = 2 and 4:
# the driver times every chunk's forward and backward (synchronised) and the whole forward-backward of a
# step; measured bubble = step's forward-backward time / the busiest stage's compute - 1. The simulator
# runs the same schedule with unit costs ((p-1)/m for 1F1B and GPipe, (p-1)/(v m) interleaved) and with the
# measured per-chunk costs.
# CPU engine: a d4 GPT-2 at B=1, T=64 on tinyshakespeare (its LM head outweighs its layers). CUDA engine (`gpu`): GPT-2 124M at T=1024; on one
# GPU the p ranks share it (and the MPI transport), so their compute overlaps on the card and the
# measured figure mixes the bubble with that contention.
# Usage: bash scripts/bench_pp.sh [cpu|gpu] [micro-batches] [steps]
set -u
cd "$(dirname "$0")/.."
engine=${1:-cpu}
m=${2:-8}
steps=${3:-6}
if [ "$engine" = gpu ]; then
    bin=./train_gpt; model=d12; B=4; T=1024
else
    bin=./train_gpt_cpu; model=d4; B=1; T=64
fi
echo "| engine | p | v | schedule | m | ms/step | bubble measured | simulated (measured costs) | simulated (unit costs) |"
echo "|---|---|---|---|---|---|---|---|---|"
for p in 2 4; do
    for sched in gpipe 1f1b interleaved; do
        v=1
        [ "$sched" = interleaved ] && v=2
        log=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np "$p" --oversubscribe --bind-to none \
            -x OMP_NUM_THREADS=$(( $(nproc) / p > 0 ? $(nproc) / p : 1 )) \
            "$bin" -e "$model" -b "$B" -t "$T" -d $((m * B * T)) -x "$steps" -v 0 -s 0 --comm mpi \
            --pp "$p" --vpp "$v" --schedule "$sched" 2>&1)
        mean=$(echo "$log" | grep "^mean of steps" | awk '{ print $7 }')
        line=$(echo "$log" | grep "^pipeline bubble")
        if [ -z "$mean" ] || [ -z "$line" ]; then
            echo "| $engine | $p | $v | $sched | $m | $(echo "$log" | grep -m1 error || echo failed) | | | |"
            continue
        fi
        measured=$(echo "$line" | sed 's/.*measured \([0-9.-]*%\).*/\1/')
        simulated=$(echo "$line" | sed 's/.*measured costs \([0-9.-]*%\).*/\1/')
        unit=$(echo "$line" | sed 's/.*unit costs \([0-9.-]*%\).*/\1/')
        echo "| $engine | $p | $v | $sched | $m | $mean | $measured | $simulated | $unit |"
    done
done
