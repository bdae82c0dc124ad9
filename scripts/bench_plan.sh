#!/usr/bin/env bash
# --plan against the PTD-P paper's published measurements (Narayanan et al., SC'21, arXiv 2104.04473),
# on its machine (--cluster dgx-a100: Selene, A100 80GB, 8 per node, 8 HDR ports a node). For each
# configuration the paper measured, the plan keeps its t, p, v, micro-batch and global batch (full
# recomputation, scatter/gather, no offload, as the paper's scripts ran them: NVIDIA/Megatron-LM
# examples/sc21) and predicts the step; TFLOP/s per GPU are counted as the paper counts them,
# F = 96 B s l h^2 (1 + s/6h + V/16lh) per step (its eq. 3: GEMMs, recomputation included). Then the
# plan's own choice for the same model, GPUs and batch. The engine's attention nearest the paper's
# (materialised probabilities, batched GEMMs) is --attention cublas.
# `cpu`: the plan's calibration on a machine we have: 8 grids of the CPU engine on 4 ranks (the d4 model,
# B=4, T=64, 4096 tokens a step), each step measured (the median of the step lines after the first, over
# ROUNDS rounds that alternate the grids) beside the plan's prediction on --cluster cpu (this machine
# kind's measured sgemm, memory and MPI figures), and both orders. Needs a quiet machine (minutes).
# Usage: bash scripts/bench_plan.sh [table1|table2|ablations|train|all|cpu]   (CPU build; seconds, cpu minutes)
set -u
cd "$(dirname "$0")/.."
what=${1:-all}
bin=./train_gpt_cpu
[ -x "$bin" ] || make train_gpt_cpu > /dev/null
plan() {  # n L C NH global-batch flags...: prints "step_s X_paper" (the paper's count)
    local n=$1 L=$2 C=$3 NH=$4 batch=$5
    shift 5
    local out
    out=$("$bin" --plan "$n" --cluster dgx-a100 -e "$L,$C,$NH,51200" -t 2048 -d $((batch * 2048)) --attention cublas "$@" 2>&1)
    local step
    step=$(echo "$out" | sed -n 's/^the fastest: \([0-9.e+-]*\) s per step.*/\1/p')
    if [ -z "$step" ]; then echo "- -"; return; fi
    awk -v s="$step" -v n="$n" -v l="$L" -v h="$C" -v B="$batch" 'BEGIN {
        F = 96 * B * 2048 * l * h * h * (1 + 2048 / (6 * h) + 51200 / (16 * l * h)); printf "%.4g %.0f\n", s, F / (s * n) / 1e12 }'
}
choice() {  # the plan's own configuration, as "t p v d sp ZeRO recompute B | MFU"
    "$bin" --plan "$@" 2>&1 | awk -F'|' '/^\| [0-9]/ { gsub(/ /, ""); print $2, $3, $4, $5, $6, $8, $9, $11, "|", $(NF - 1); exit }'
}
# the paper's runs: full recomputation, no offload, no SP (typing --pp-scatter-gather keeps it off), scatter/gather
fixed="--recompute full --offload none --pp-scatter-gather 1"
if [ "$what" = table1 ] || [ "$what" = all ]; then
    echo "Table 1 (weak scaling; published: the paper's TFLOP/s per GPU)"
    echo "| model | t | p | v | GPUs | batch | b | published | predicted | ratio | the plan's choice (t p v d sp ZeRO recompute b) | its MFU |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
    # name L C NH t p v n batch b published
    while read -r name L C NH t p v n batch b pub; do
        sg=$fixed
        [ "$p" = 1 ] && sg="--recompute full --offload none --pp-scatter-gather 0"  # (no pipeline: no scatter/gather, SP off)
        read -r step x <<< "$(plan "$n" "$L" "$C" "$NH" "$batch" --tp "$t" --pp "$p" --vpp "$v" -b "$b" $sg)"
        own=$(choice "$n" --cluster dgx-a100 -e "$L,$C,$NH,51200" -t 2048 -d $((batch * 2048)) --attention cublas)
        echo "| $name | $t | $p | $v | $n | $batch | $b | $pub | $x | $(awk -v a="$x" -v b="$pub" 'BEGIN { printf "%.2f", a / b }') | $own |"
    done << 'ROWS'
1.7B 24 2304 24 1 1 1 32 512 16 137
3.6B 30 3072 32 2 1 1 64 512 16 138
7.5B 36 4096 32 4 1 1 128 512 16 142
18.4B 40 6144 48 8 1 1 256 1024 8 135
39.1B 48 8192 64 8 2 1 512 1536 4 138
76.1B 60 10240 80 8 4 3 1024 1792 2 140
145.6B 80 12288 96 8 8 2 1536 2304 2 148
310.1B 96 16384 128 8 16 2 1920 2160 1 155
529.6B 105 20480 128 8 35 3 2520 2520 1 163
1008B 128 25600 160 8 64 1 3072 3072 1 163
ROWS
fi
if [ "$what" = table2 ] || [ "$what" = all ]; then
    echo
    echo "Table 2 (175B and 530B: PTD-P against ZeRO-3 without model parallelism)"
    echo "| model | scheme | GPUs | batch | b | published | predicted | ratio |"
    echo "|---|---|---|---|---|---|---|---|"
    while read -r name L C NH scheme n batch b pub; do
        if [ "$scheme" = ZeRO-3 ]; then
            flags="--tp 1 --pp 1 --zero 3 -b $b --recompute full --offload none --pp-scatter-gather 0"
        else
            p=$(( name == 175 ? 12 : 35 ))
            flags="--tp 8 --pp $p -b $b $fixed"
        fi
        read -r step x <<< "$(plan "$n" "$L" "$C" "$NH" "$batch" $flags)"
        echo "| ${name}B | $scheme | $n | $batch | $b | $pub | $x | $(awk -v a="$x" -v b="$pub" 'BEGIN { printf "%.2f", a / b }') |"
    done << 'ROWS'
175 96 12288 96 ZeRO-3 384 1536 4 144
175 96 12288 96 ZeRO-3 768 1536 2 88
175 96 12288 96 ZeRO-3 1536 1536 1 44
175 96 12288 96 PTD-P 384 1536 1 153
175 96 12288 96 PTD-P 768 1536 1 149
175 96 12288 96 PTD-P 1536 1536 1 141
530 105 20480 128 ZeRO-3 640 2560 4 138
530 105 20480 128 ZeRO-3 1120 2240 2 98
530 105 20480 128 ZeRO-3 2240 2240 1 48
530 105 20480 128 PTD-P 560 2240 1 171
530 105 20480 128 PTD-P 1120 2240 1 167
530 105 20480 128 PTD-P 2240 2240 1 159
ROWS
fi
if [ "$what" = ablations ] || [ "$what" = all ]; then
    echo
    echo "The paper's ablations on GPT-3 175B, 96 GPUs (t=8, p=12, b=1; published values read off its figures 12 and 18, approximate)"
    echo "| batch | 1F1B | interleaved v=4 | interleaved/1F1B (paper) | interleaved, no scatter/gather | scatter/gather gain (paper) |"
    echo "|---|---|---|---|---|---|"
    while read -r batch pub1 pubi pubn; do
        read -r s1 x1 <<< "$(plan 96 96 12288 96 "$batch" --tp 8 --pp 12 --vpp 1 -b 1 $fixed)"
        read -r si xi <<< "$(plan 96 96 12288 96 "$batch" --tp 8 --pp 12 --vpp 4 -b 1 $fixed)"
        read -r sn xn <<< "$(plan 96 96 12288 96 "$batch" --tp 8 --pp 12 --vpp 4 -b 1 --recompute full --offload none --pp-scatter-gather 0)"
        echo "| $batch | $x1 | $xi | $(awk -v a="$xi" -v b="$x1" -v c="$pubi" -v d="$pub1" 'BEGIN { printf "%.2f (%.2f)", a / b, c / d }') | $xn | $(awk -v a="$xi" -v b="$xn" -v c="$pubi" -v d="$pubn" 'BEGIN { printf "%.2f (%.2f)", a / b, c / d }') |"
    done << 'ROWS'
12 82 119 107
24 109 134 120
36 122 141 127
48 130 143 130
60 135 146 131
ROWS
    echo
    echo "Tensor parallelism inside a node and across nodes: 162B (32 layers, h 20480), 64 GPUs, b=1, batch 128"
    echo "| t | p | predicted TFLOP/s |"
    echo "|---|---|---|"
    for tp in 2,32 4,16 8,8 16,4 32,2; do
        read -r step x <<< "$(plan 64 32 20480 128 128 --tp "${tp%,*}" --pp "${tp#*,}" -b 1 $fixed)"
        echo "| ${tp%,*} | ${tp#*,} | $x |"
    done
fi
if [ "$what" = train ] || [ "$what" = all ]; then
    echo
    echo "Time to train (the paper: GPT-3 175B, 300B tokens, 1024 GPUs, ~34 days; 1T, 450B tokens, 3072 GPUs, ~84 days)"
    "$bin" --plan 1024 --cluster dgx-a100 -e 96,12288,96,51200 -t 2048 -d $((1536 * 2048)) --attention cublas --train-tokens 300e9 | grep -E "^the fastest|^time to train|^  mpirun"
    "$bin" --plan 3072 --cluster dgx-a100 -e 128,25600,160,51200 -t 2048 -d $((3072 * 2048)) --attention cublas --train-tokens 450e9 | grep -E "^the fastest|^time to train|^  mpirun"
fi
if [ "$what" = cpu ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    rounds=${ROUNDS:-2}
    grids=("--tp 1 --pp 1 --zero 0" "--tp 1 --pp 1 --zero 1" "--tp 1 --pp 1 --zero 3" "--tp 2 --pp 1 --zero 0" "--tp 4 --pp 1 --zero 0"
           "--tp 1 --pp 2 --zero 0" "--tp 1 --pp 4 --zero 0" "--tp 2 --pp 2 --zero 0")
    declare -A ms
    for r in $(seq "$rounds"); do
        for g in "${grids[@]}"; do
            out=$(mpirun -np 4 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "$bin" -e d4 -b 4 -t 64 -d 4096 -x 4 -v 0 -s 0 $g 2>&1)
            ms[$g]+="$(echo "$out" | awk -F'|' '/^step [2-9]/ { sub(/ ms.*/, "", $5); print $5 }' | tr '\n' ' ')"
        done
    done
    echo "The CPU engine on 4 ranks of 2 cores (d4, B=4, T=64, 4096 tokens a step; ZeRO as given, no recomputation): measured and --plan --cluster cpu"
    echo "| grid | measured ms/step (median) | plan ms/step | plan / measured |"
    echo "|---|---|---|---|"
    for g in "${grids[@]}"; do
        measured=$(echo "${ms[$g]}" | tr ' ' '\n' | grep . | sort -g | awk '{ v[NR] = $1 } END { print NR ? v[int((NR + 1) / 2)] : "-" }')
        sg="--pp-scatter-gather 0"
        case "$g" in *"--tp 2 --pp 2"*) sg="--pp-scatter-gather 1";; esac
        planned=$("$bin" --plan 4 --cluster cpu -e d4 -t 64 -d 4096 -b 4 --vpp 1 --recompute none --offload none $sg $g 2>&1 |
            sed -n 's/^the fastest: \([0-9.e+-]*\) s per step.*/\1/p' | awk '{ printf "%.0f", $1 * 1000 }')
        echo "| $g | $measured | $planned | $(awk -v a="$planned" -v b="$measured" 'BEGIN { printf "%.2f", a / b }') |"
    done
fi
