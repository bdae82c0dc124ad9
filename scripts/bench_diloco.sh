#!/usr/bin/env bash
# Replicas that train apart against plain data parallelism, on 4 ranks of the CPU engine on tinyshakespeare
# (issue 51): the same tokens (4 replicas x b x t per step, the same steps and learning-rate schedule), each
# mode's val loss at the end (the whole val set), its gap to plain data parallelism's, and the data-parallel
# bytes each rank sent per step (the end report's line; as ring collectives send them).
#   plain   gradients all-reduced every step
#   diloco  --diloco 10 (outer lr 0.7, Nesterov 0.9, DiLoCo's): fp32 weights all-reduced once every 10 steps
#   gossip  --gossip 1 (a ring) and --gossip 2 (hops 1 and 2): fp32 weights sent to K neighbours every step
# Usage: bash scripts/bench_diloco.sh [steps] [model] [b]   (defaults 400, a 2-layer C=64 model, 2)
# The CPU engine runs 4 ranks here, on however many cores there are: on 2 shared cores the default takes ~10-20
# minutes. Prefix with nice on a shared machine.
set -u
cd "$(dirname "$0")/.."
steps=${1:-400}
model=${2:-2,64,4}
b=${3:-2}
T=64
run() {  # $1: flags; prints "val_loss MiB_per_step ratio", or the error line
    local log
    log=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 4 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 \
        ./train_gpt_cpu -e "$model" -b "$b" -t "$T" -x "$steps" -v "$steps" -m 0 -s 0 -l 1e-3 -u 20 $1 2>&1)
    local val bytes
    val=$(echo "$log" | grep "^val loss" | tail -n 1 | awk '{ print $3 }')
    bytes=$(echo "$log" | grep "^data-parallel bytes sent" | sed -E 's/.*rank: ([0-9.]+) MiB.*: ([0-9.]+) MiB, ([0-9.]+)x this/\1 \2 \3/')
    if [ -z "$val" ] || [ -z "$bytes" ]; then
        echo "failed: $(echo "$log" | grep -m1 'error' || echo "$log" | tail -n 1)"
        return
    fi
    echo "$val $bytes"
}
echo "4 ranks, model $model, b=$b t=$T, $steps steps ($((4 * b * T * steps)) tokens), lr 1e-3 cosine to 1e-4"
echo
echo "| mode | val loss | vs plain DP | DP MiB sent per step and rank | fewer bytes than plain DP |"
echo "|---|---|---|---|---|"
plain=""
for mode in "plain|" "diloco H=10|--diloco 10" "gossip K=1|--gossip 1" "gossip K=2|--gossip 2"; do
    name=${mode%%|*}
    flags=${mode#*|}
    result=$(run "$flags")
    case "$result" in failed*) echo "| $name | $result | | | |"; continue ;; esac
    set -- $result
    [ -z "$plain" ] && plain=$1
    awk -v n="$name" -v v="$1" -v p="$plain" -v s="$2" -v x="$4" \
        'BEGIN { printf "| %s | %.4f | %+.1f%% | %.4f | %.2fx |\n", n, v, 100 * (v - p) / p, s, x }'
done
