#!/usr/bin/env bash
# What a mixture of experts costs: a MoE model against the dense model of the same active parameters
# (the same weights met by each token, so the same FLOPs per token).
#  1. The CPU engine, one rank, RUNS alternating runs of each: ms/step (the median of each run's mean) and
#     peak RSS (/usr/bin/time -v), parameters and active parameters. MoE: depth 6 (C=384, 6 heads), every
#     layer 8 experts top-2; dense: 10 layers of C=384 (a layer's active weights: 4C^2 of attention + 2 x
#     8C^2 of experts = 20C^2 against a dense layer's 12C^2, so 6 x 20 = 10 x 12).
#  2. MODELLED, not measured: the GPU step of GPT-2 124M with 8 experts top-2 on 8 GPUs of 80 GiB, and
#     with 64 experts on GPUs of 16 GiB, by the planner's machine model (dev/plan/plan.h): the fastest
#     configurations that fit, with their expert parallelism (ep), memory per GPU and all-to-alls' time
#     (EP ms) beside the compute.
#  3. With `curve`: the tinyshakespeare loss of a depth-4 MoE (8 experts, top-2) and its dense twin, STEPS
#     steps each, drawn by dev/plot.py into dev/docs/moe_loss.png.
# Usage: bash scripts/bench_moe.sh [RUNS] [STEPS]      bash scripts/bench_moe.sh curve [STEPS]
set -u
cd "$(dirname "$0")/.."
make -s train_gpt_cpu plan_gpt || exit 1
dir=$(mktemp -d "${TMPDIR:-/tmp}/llmpar_moe.XXXXXX")
trap 'rm -rf "$dir"' EXIT
if [ "${1:-}" = curve ]; then
    steps=${2:-300}
    for kind in dense moe; do
        extra=""
        [ $kind = moe ] && extra="--moe-experts 8 --moe-topk 2"
        ./train_gpt_cpu -e d4 $extra -x "$steps" -u 10 -v 25 -m 16 -s 0 -o "out/moe_curve_$kind" --overwrite > "$dir/$kind.log" 2>&1 ||
            { tail -3 "$dir/$kind.log"; exit 1; }
        grep "^val loss" "$dir/$kind.log" | tail -1 | sed "s/^/$kind: /"
    done
    python3 dev/plot.py out/moe_curve_dense out/moe_curve_moe -o dev/docs/moe_loss.png
    exit
fi
runs=${1:-3}
steps=${2:-6}
python3 dev/ref/gpt2_ref.py random-model "$dir/dense10.bin" 10 384 6 || exit 1
common="-b 4 -t 64 -x $steps -v 0 -s 0 -j ''"
echo "CPU engine, one rank, $(nproc) cores, B=4 T=64, $steps steps a run, $runs runs each (alternating); ms/step: the median of the runs' means"
echo "| model | parameters | met by a token | ms/step | peak RSS MiB |"
echo "|---|---|---|---|---|"
declare -A ms rss params active
for r in $(seq "$runs"); do
    for kind in moe dense; do
        if [ $kind = moe ]; then model="-e d6 --moe-experts 8 --moe-topk 2"; else model="-e $dir/dense10.bin"; fi
        log=$(eval /usr/bin/time -v ./train_gpt_cpu $model $common 2>&1)
        ms[$kind]+="$(echo "$log" | awk '/^mean of steps/ { print $7 }') "
        rss[$kind]+="$(echo "$log" | awk '/Maximum resident set size/ { printf "%.0f", $6 / 1024 }') "
        params[$kind]=$(echo "$log" | sed -n 's/^model .*, \([0-9]*\) parameters (.*/\1/p')
        a=$(echo "$log" | sed -n 's/.*top-2: \([0-9]*\) parameters met by each token.*/\1/p')
        active[$kind]=${a:-${params[$kind]}}
    done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
for kind in moe dense; do
    name="depth 6, 8 experts top-2"
    [ $kind = dense ] && name="10 dense layers, C=384"
    echo "| $name | ${params[$kind]} | ${active[$kind]} | $(echo "${ms[$kind]}" | median) | $(echo "${rss[$kind]}" | median) |"
done
echo
for experts in 8 64; do
    mem=80
    [ "$experts" = 64 ] && mem=16
    echo "MODELLED, not measured (plan_gpt's simulated step on its default cluster, dgx-h100): GPT-2 124M"
    echo "with $experts experts top-2 in every layer on 8 GPUs of $mem GiB, -t 1024, 524288 tokens a step; the fastest that fit:"
    ./plan_gpt -e d12 --moe-experts "$experts" --moe-topk 2 --plan 8 -t 1024 -d 524288 --gpu-mem "$mem" 2>&1 | grep '^|' | head -7
    echo
done
