#!/usr/bin/env bash
# plan_gpt against the PTD-P paper's published measurements (Narayanan et al., SC'21, arXiv 2104.04473),
# on its machine (--cluster dgx-a100: Selene, A100 80GB, 8 per node, 8 HDR ports a node) and its software
# (--software megatron: dropout, pipeline sends that wait, its GEMMs' share of the A100's best fitted by
# `fit` to the selective-recomputation paper's 8 step times). For each configuration the paper measured,
# the plan keeps its t, p, v, micro-batch and global batch (full recomputation, scatter/gather, no ZeRO,
# the gradients' all-reduce overlapped or after the flush, no offload, as the paper's scripts ran them:
# NVIDIA/Megatron-LM examples/sc21) and predicts the step; TFLOP/s per GPU are counted as the paper counts them,
# F = 96 B s l h^2 (1 + s/6h + V/16lh) per step (its eq. 3: GEMMs, recomputation included). Then the
# plan's own choice for this engine (--software llmpar) on the same model, GPUs and batch. The engine's attention nearest the paper's
# (materialised probabilities, batched GEMMs) is --attention cublas.
# `cpu`: the plan's calibration on a machine we have: 9 grids of the CPU engine on 4 ranks (a 16-layer model of
# C=256, T=64, 2048 tokens a step, its transformer blocks half the work and the LM head the other half; micro-
# batches of 8 to 32, full recomputation on some), chosen so that the plan's steps form a ladder from 1x to 2.2x,
# each rung 15-20% above the one below, with three grids beside the first rung (ZeRO-3, t=4, t=2 x p=2). Each
# step measured (the median of the step lines after the first, over ROUNDS rounds that alternate the grids, each
# round starting one grid later) beside the plan's prediction on --cluster cpu (this machine's sgemm and copy rates,
# measured first by scripts/cpu_rates.sh; the cpu preset's MPI figures; a stage alone on the shared cores up to
# twice as fast) at the GEMM share that predicts the first grid (data parallelism alone, under the same sharing
# of cores and memory as the rest), the other eight predicted; then how many pairs measured more than 10% apart
# it orders alike, and the most grids it ranks in the measured order. Needs a quiet machine (~3 minutes a round
# on the CI machine's AVX-512 kind).
# `heldout`: the runs --software megatron was fitted to, beside runs of other teams (BLOOM, MT-NLG, OPT, Llama 3) it was
# never fitted to, each on its published grid: both sets' ratios, and how many published figures fall in the plan's own band.
# Usage: bash dev/plan/bench_plan.sh [fit|table1|table2|ablations|train|heldout|all|cpu]   (seconds; cpu: minutes)
set -u
cd "$(dirname "$0")/../.."
what=${1:-all}
bin=./plan_gpt      # the planner
engine=./train_gpt_cpu  # cpu: the engine whose steps it predicts
make -s plan_gpt train_gpt_cpu > /dev/null || exit 1
fastest() { sed -n 's/^the fastest: \([0-9.e+-]*\) s per step.*/\1/p'; }  # a plan's output: its fastest step, seconds
# the paper's FLOPs of a step (its eq. 3) as an awk expression of l, h and B (layers, width, sequences of 2048)
paper_flops='96 * B * 2048 * l * h * h * (1 + 2048 / (6 * h) + 51200 / (16 * l * h))'
plan() {  # n L C NH global-batch flags...: prints "step_s X_paper" (the paper's count)
    local n=$1 L=$2 C=$3 NH=$4 batch=$5
    shift 5
    local out
    out=$("$bin" --plan "$n" --cluster dgx-a100 --software "${software:-megatron}" -e "$L,$C,$NH,51200" -t 2048 -d $((batch * 2048)) --attention cublas "$@" 2>&1)
    local step
    step=$(echo "$out" | fastest)
    if [ -z "$step" ]; then echo "- -"; return; fi
    awk -v s="$step" -v n="$n" -v l="$L" -v h="$C" -v B="$batch" "BEGIN { F = $paper_flops; printf \"%.4g %.0f\\n\", s, F / (s * n) / 1e12 }"
}
choice() {  # the plan's own configuration, as "t p v cp d sp ZeRO recompute B | MFU" (the table's columns by name: cp's only
            # where a plan splits a sequence)
    "$bin" --plan "$@" 2>&1 | awk -F'|' '/^\| t \|/ { for (i = 2; i < NF; i++) { h = $i; gsub(/ /, "", h); col[h] = i } }
        /^\| [0-9]/ { gsub(/ /, ""); print $col["t"], $col["p"], $col["v"], ("cp" in col ? $col["cp"] : 1), $col["d"], $col["sp"],
                      $col["ZeRO"], $col["recompute"], $col["B"], "|", $col["MFU"]; exit }'
}
# the paper's runs: full recomputation, no offload, no SP (typing --pp-scatter-gather keeps it off), scatter/gather
fixed="--recompute full --offload none --pp-scatter-gather 1"
paper="--zero 0 --overlap 0 $fixed"  # (--DDP-impl local: the gradients all-reduced after the pipeline's flush)
# the selective-recomputation paper's Table 5 (the runs --software megatron is fitted to): name L C NH GPUs batch b p v
# recompute published-step-seconds
rows='22B 48 6144 64 8 4 4 1 1 full 1.42
22B 48 6144 64 8 4 4 1 1 selective 1.10
175B 96 12288 96 64 64 1 8 3 full 18.13
175B 96 12288 96 64 64 1 8 3 selective 13.75
530B 105 20480 128 280 280 1 35 3 full 49.05
530B 105 20480 128 280 280 1 35 3 selective 37.83
1T 128 25600 160 512 512 1 64 1 full 94.42
1T 128 25600 160 512 512 1 64 1 selective 71.49'
table5() {  # extra flags: prints "name recompute published predicted" per row
    while read -r name L C NH n batch b p v r pub; do
        local how="--recompute full --pp-scatter-gather $((p > 1))"
        [ "$r" = selective ] && how="--recompute selective --sp"
        local s
        s=$("$bin" --plan "$n" --cluster dgx-a100 --software megatron -e "$L,$C,$NH,51200" -t 2048 -d $((batch * 2048)) \
            --attention cublas --tp 8 --pp "$p" --vpp "$v" -b "$b" --zero 0 --offload none $how "$@" 2>&1 |
            fastest)
        echo "$name $r $pub ${s:--}"
    done <<< "$rows"
}
if [ "$what" = fit ] || [ "$what" = all ]; then
    # Megatron-LM's GEMMs' share of the A100's peak and its attention's cost per tile, fitted (least squares in log
    # step time) to the eight step times of the selective-recomputation paper (Korthikanti et al., arXiv 2205.05198, Table 5: full recomputation,
    # and selective recomputation with SP; t=8, d=1, b=1 but 22B's 4; configurations as calculon-ai/calculon's
    # validation files state them), then those eight at the share --software megatron carries
    echo "Megatron-LM's GEMM share and attention tile cost on an A100, fitted to the selective-recomputation paper's Table 5 (step seconds)"
    # the two together: each tile cost of attention's products (steps of 64), then the share (at most the A100's best)
    best=$(for tile in $(seq 0 64 768); do
        for share in $(seq 0.60 0.005 0.87); do
            table5 --gemm-share "$share" --attention-tile-k "$tile" |
                awk -v share="$share" -v tile="$tile" '{ e += log($4 / $3) ^ 2 } END { printf "%.4f %s %s\n", e, share, tile }'
        done
    done | sort -g | head -n 1)
    read -r err share tile <<< "$best"
    a100=$(awk '/^    {"a100",/ { gsub(/,/, ""); print $(NF - 2) }' dev/plan/plan.h)
    preset=$(awk '/^    {"megatron",/ { gsub(/,/, ""); print $14, $15 }' dev/plan/plan.h)  # (its gemm and attention_tile_k)
    echo "fitted: GEMMs at $share of the peak, $(awk -v s="$share" -v g="$a100" 'BEGIN { printf "%.3f", s / g }') of the A100's best ($a100);" \
         "attention's batched products $tile more K a tile; --software megatron carries ${preset% *} and ${preset#* }" \
         "(rms of log(predicted/published): $(awk -v e="$err" 'BEGIN { printf "%.3f", sqrt(e / 8) }'))"
    echo "| model | recompute | published s | predicted s | predicted/published |"
    echo "|---|---|---|---|---|"
    table5 | while read -r name r pub s; do
        echo "| $name | $r | $pub | $s | $(awk -v a="$s" -v b="$pub" 'BEGIN { printf "%.2f", a / b }') |"
    done
    echo
fi
if [ "$what" = table1 ] || [ "$what" = all ]; then
    echo "Table 1 (weak scaling; published: the paper's TFLOP/s per GPU)"
    echo "| model | t | p | v | GPUs | batch | b | published | predicted | ratio | the plan's choice (t p v cp d sp ZeRO recompute b) | its MFU |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
    pairs_file=$(mktemp)
    # name L C NH t p v n batch b published DDP (the script's --DDP-impl)
    while read -r name L C NH t p v n batch b pub ddp; do
        sg=$fixed
        [ "$p" = 1 ] && sg="--recompute full --offload none --pp-scatter-gather 0"  # (no pipeline: no scatter/gather, SP off)
        [ "$ddp" = local ] && sg="$sg --overlap 0"
        read -r step x <<< "$(plan "$n" "$L" "$C" "$NH" "$batch" --tp "$t" --pp "$p" --vpp "$v" -b "$b" --zero 0 $sg)"
        own=$(choice "$n" --cluster dgx-a100 -e "$L,$C,$NH,51200" -t 2048 -d $((batch * 2048)) --attention cublas)
        echo "| $name | $t | $p | $v | $n | $batch | $b | $pub | $x | $(awk -v a="$x" -v b="$pub" 'BEGIN { printf "%.2f", a / b }') | $own |"
        echo "$pub $x" >> "$pairs_file"
    done << 'ROWS'
1.7B 24 2304 24 1 1 1 32 512 16 137 torch
3.6B 30 3072 32 2 1 1 64 512 16 138 torch
7.5B 36 4096 32 4 1 1 128 512 16 142 torch
18.4B 40 6144 48 8 1 1 256 1024 8 135 torch
39.1B 48 8192 64 8 2 1 512 1536 4 138 local
76.1B 60 10240 80 8 4 3 1024 1792 2 140 local
145.6B 80 12288 96 8 8 2 1536 2304 2 148 local
310.1B 96 16384 128 8 16 2 1920 2160 1 155 local
529.6B 105 20480 128 8 35 3 2520 2520 1 163 local
1008B 128 25600 160 8 64 1 3072 3072 1 163 local
ROWS
    # the order: the pairs of rows the paper measured more than 5% apart, ordered alike? and Spearman's rank correlation
    awk '{ p[NR] = $1; q[NR] = $2 } END {
        for (i = 1; i <= NR; i++) for (j = i + 1; j <= NR; j++)
            if (p[i] > 1.05 * p[j] || p[j] > 1.05 * p[i]) { far++; alike += (p[i] < p[j]) == (q[i] < q[j]) }
        for (i = 1; i <= NR; i++) { rp[i] = rq[i] = 1
            for (j = 1; j <= NR; j++) { rp[i] += (p[j] < p[i]) + 0.5 * (j != i && p[j] == p[i]); rq[i] += (q[j] < q[i]) + 0.5 * (j != i && q[j] == q[i]) } }
        for (i = 1; i <= NR; i++) { mp += rp[i] / NR; mq += rq[i] / NR }
        for (i = 1; i <= NR; i++) { c += (rp[i] - mp) * (rq[i] - mq); vp += (rp[i] - mp) ^ 2; vq += (rq[i] - mq) ^ 2 }
        printf "the order: of the %d pairs of rows published more than 5%% apart, %d predicted in the same order; Spearman rank correlation %.2f\n", far, alike, c / sqrt(vp * vq) }' "$pairs_file"
    rm -f "$pairs_file"
fi
if [ "$what" = table2 ] || [ "$what" = all ]; then
    echo
    echo "Table 2 (175B and 530B: PTD-P against ZeRO-3 without model parallelism)"
    echo "| model | scheme | GPUs | batch | b | published | predicted | ratio |"
    echo "|---|---|---|---|---|---|---|---|"
    while read -r name L C NH scheme n batch b pub; do
        software=megatron
        if [ "$scheme" = ZeRO-3 ]; then  # (DeepSpeed's ZeRO-3, which Megatron-LM has not)
            software=deepspeed
            flags="--tp 1 --pp 1 --zero 3 -b $b --recompute full --offload none --pp-scatter-gather 0"
        else
            p=$(( name == 175 ? 12 : 35 ))
            flags="--tp 8 --pp $p -b $b --zero 0 --overlap 0 $fixed"
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
        read -r s1 x1 <<< "$(plan 96 96 12288 96 "$batch" --tp 8 --pp 12 --vpp 1 -b 1 $paper)"
        read -r si xi <<< "$(plan 96 96 12288 96 "$batch" --tp 8 --pp 12 --vpp 4 -b 1 $paper)"
        read -r sn xn <<< "$(plan 96 96 12288 96 "$batch" --tp 8 --pp 12 --vpp 4 -b 1 --zero 0 --overlap 0 --recompute full --offload none --pp-scatter-gather 0)"
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
        read -r step x <<< "$(plan 64 32 20480 128 128 --tp "${tp%,*}" --pp "${tp#*,}" -b 1 $paper)"
        echo "| ${tp%,*} | ${tp#*,} | $x |"
    done
fi
if [ "$what" = train ] || [ "$what" = all ]; then
    echo
    echo "Time to train (the paper: GPT-3 175B, 300B tokens, 1024 GPUs, ~34 days; 1T, 450B tokens, 3072 GPUs, ~84 days)"
    # Megatron-LM's fastest of its own settings then (t=8, no ZeRO, gradients all-reduced after the flush, full
    # recomputation, scatter/gather; p, v and b chosen by the plan), and this engine's own choice
    # The PTD-P paper's software (2021, the PyTorch 20.12 container) against the selective-recomputation paper's
    # (2022), which --software megatron is fitted to: both papers ran the same pipelines for 530B (t 8, p 35, v 3,
    # b 1, 280 micro-batches a pipeline) and 1T (t 8, p 64, b 1, 512), the 2021 runs with d 9 and 6 beside them.
    # Their steps, the 2021 ones from Table 1's TFLOP/s by the paper's count, set one slowdown (it holds the 2021
    # runs' gradient all-reduce too, which the plan prices already: under 1% of those steps), which --software
    # megatron-2021 carries as its pace (the A100's FLOP/s and HBM as the 2021 software reached them)
    paper_step() { awk -v l="$1" -v h="$2" -v B="$3" "BEGIN { print $paper_flops / ($3 * 163e12) }"; }  # (both at 163 TFLOP/s, B GPUs)
    read -r slow530 slow1t slow <<< "$(awk -v a="$(paper_step 105 20480 2520)" -v b="$(paper_step 128 25600 3072)" \
        'BEGIN { printf "%.3f %.3f %.3f\n", a / 49.05, b / 94.42, (a / 49.05 + b / 94.42) / 2 }')"
    pace=$(awk '/^#define LP_PACE_2021/ { gsub(/[()]/, ""); print $NF }' dev/plan/plan.h)
    for sw in "megatron --tp 8 $paper" "megatron-2021 --tp 8 $paper" llmpar; do
        case "$sw" in
            megatron-2021*) echo "Megatron-LM 2021: the slowdown ${slow}x (530B ${slow530}x, 1T ${slow1t}x); --software megatron-2021 runs at 1/$pace of the A100" ;;
            megatron*) echo "Megatron-LM as fitted to the 2022 runs" ;;
            *) echo "this engine's own choice" ;;
        esac
        "$bin" --plan 1024 --cluster dgx-a100 --software $sw -e 96,12288,96,51200 -t 2048 -d $((1536 * 2048)) --attention cublas --train-tokens 300e9 |
            grep -E "^the fastest|^time to train|^  mpirun"
        "$bin" --plan 3072 --cluster dgx-a100 --software $sw -e 128,25600,160,51200 -t 2048 -d $((3072 * 2048)) --attention cublas --train-tokens 450e9 |
            grep -E "^the fastest|^time to train|^  mpirun"
    done
fi
if [ "$what" = heldout ] || [ "$what" = all ]; then
    # The hold-out discipline: the runs --software megatron was fitted to (Table 5 above, its GEMM share and attention tile
    # cost), the runs the planner was checked against while it was built (the PTD-P paper's: `table1`, `table2`), and
    # runs of other teams it was never fitted to nor changed for (each with its source: dev/plan/README.md). Each run
    # on its published grid and cluster; TFLOP/s per GPU by the PTD-P paper's count with the run's vocabulary, as these
    # reports count them; the band is the software's (its calibration set's spread): inside when the published figure
    # lies within it.
    echo
    echo "Fitted (--software megatron's two numbers): the selective-recomputation paper's Table 5, predicted/published step"
    table5 | awk '{ r = $4 / $3; lo = NR == 1 || r < lo ? r : lo; hi = NR == 1 || r > hi ? r : hi; printf "%s %s %.2f; ", $1, $2, r }
                  END { printf "\nfitted: %d runs, predicted/published step %.2f-%.2f\n", NR, lo, hi }'
    echo
    echo "Held out (other teams' runs, not fitted to): the plan on the published grid against the published TFLOP/s per GPU"
    echo "| run | software | GPUs | grid | published | predicted | predicted/published | its band | inside | outside its calibration |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
    inside=0 total=0 near=0
    # (Llama 3 405B ran without activation checkpointing, Grattafiori et al. 2024, section 3.3.2, in 80 GB, Meta's FSDP
    # sharding gradients and optimizer states beside its pipeline; Megatron-LM's count of that grid is 82-108 GiB, its
    # fp32 gradients whole: its rows lift the memory check, --gpu-mem 160, to price the published grid's throughput)
    # name|software|GPUs|-e|T|batch (sequences)|grid|machine|published TFLOP/s per GPU|its count: "ptdp L C V" (the PTD-P
    # paper's, recomputation counted) or "model" (the model's FLOPs: MFU times the peak)
    while IFS='|' read -r name sw n model T batch grid machine pub count; do
        out=$("$bin" --plan "$n" --software "$sw" $machine -e "$model" -t "$T" -d $((batch * T)) $grid 2>&1)
        step=$(echo "$out" | fastest)
        if [ "${count%% *}" = ptdp ]; then
            read -r _ L C V <<< "$count"
            x=$(awk -v s="$step" -v n="$n" -v l="$L" -v h="$C" -v B="$batch" -v V="$V" \
                'BEGIN { printf "%.0f", 96 * B * 2048 * l * h * h * (1 + 2048 / (6 * h) + V / (16 * l * h)) / (s * n) / 1e12 }')
        else
            x=$(echo "$out" | sed -n 's/^the fastest: .*(model FLOPs: \([0-9.e+]*\) per token).*/\1/p' |
                awk -v s="$step" -v n="$n" -v tokens=$((batch * T)) '{ printf "%.0f", $1 * tokens / (s * n) / 1e12 }')
        fi
        band=$(echo "$out" | sed -n 's/^its band: [^(]*(.* were \([0-9.]*\)-\([0-9.]*\)x.*/\1 \2/p')
        read -r blo bhi <<< "$band"
        flags=$(echo "$out" | sed -n 's/^outside its calibration: \([^ ]*\) .*/\1/p')
        chosen=$(echo "$out" | awk -F'|' '/^\| [0-9]/ { gsub(/ /, ""); print "v " $4 ", sp " $6 ", ZeRO " $8 ", " $9; exit }')
        read -r ratio low high in <<< "$(awk -v x="$x" -v p="$pub" -v a="$blo" -v b="$bhi" 'BEGIN {
            r = x / p; printf "%.2f %.0f %.0f %d\n", r, x / b, x / a, (r >= a && r <= b) }')"
        total=$((total + 1)) inside=$((inside + in))
        near=$((near + $(awk -v r="$ratio" 'BEGIN { print (r >= 0.8 && r <= 1.25) }')))
        echo "| $name | $sw | $n | $grid ($chosen) | $pub | $x | $ratio | $low-$high | $([ "$in" = 1 ] && echo yes || echo no) | ${flags:--} |"
    done << 'ROWS'
BLOOM-176B|deepspeed|384|70,14336,112,250880|2048|2048|--tp 4 --pp 12 -b 2 --zero 1 --recompute full --pp-scatter-gather 1 --offload none --attention cublas|--cluster dgx-a100 --net-gbs 5.75|150|ptdp 70 14336 250880
MT-NLG 530B|deepspeed|2240|105,20480,128,50257|2048|1920|--tp 8 --pp 35 -b 1 --zero 1 --recompute full --pp-scatter-gather 1 --offload none --attention cublas|--cluster dgx-a100|126|ptdp 105 20480 50257
MT-NLG 530B|deepspeed|2800|105,20480,128,50257|2048|1920|--tp 8 --pp 35 -b 1 --zero 1 --recompute full --pp-scatter-gather 1 --offload none --attention cublas|--cluster dgx-a100|121|ptdp 105 20480 50257
MT-NLG 530B|deepspeed|3360|105,20480,128,50257|2048|1920|--tp 8 --pp 35 -b 1 --zero 1 --recompute full --pp-scatter-gather 1 --offload none --attention cublas|--cluster dgx-a100|113|ptdp 105 20480 50257
OPT-175B|deepspeed|992|96,12288,96,50272|2048|992|--tp 8 --pp 1 --zero 3 --recompute full --offload none --attention cublas|--cluster dgx-a100|147|ptdp 96 12288 50272
Llama 3 405B|megatron|8192|llama3-405b|8192|2048|--tp 8 --pp 16 -b 1 --recompute none --attention flash|--cluster dgx-h100 --gpu-mem 160|430|model
Llama 3 405B|megatron|16384|llama3-405b|8192|2048|--tp 8 --pp 16 -b 1 --recompute none --attention flash|--cluster dgx-h100 --gpu-mem 160|400|model
ROWS
    echo "held out: $total runs, $near within 0.8-1.25 of the published throughput, $inside inside the plan's own band"
fi
if [ "$what" = cpu ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    rounds=${ROUNDS:-2}
    # this machine's rates (the cpu preset's are the CI machine's AVX2 kind): a rank's quarter of sgemm on both
    # cores and of the memory bandwidth both cores reach copying
    rates=$(OMP_NUM_THREADS=2 bash scripts/cpu_rates.sh)
    sgemm=$(echo "$rates" | awk '$1 == "sgemm" { print $2 }') copy=$(echo "$rates" | awk '$1 == "copy" { print $2 }')
    [ "$sgemm" != n/a ] || { echo "bench_plan.sh cpu: no sgemm rate (OpenBLAS)"; exit 1; }
    machine="--cluster cpu --gpu-tflops $(awk -v s="$sgemm" 'BEGIN { print s / 4 / 1000 }') --gpu-gbs $(awk -v c="$copy" 'BEGIN { print c / 4 }')"
    echo "this machine: sgemm on both cores $sgemm GFLOP/s, copying $copy GB/s: the plan's rank $machine"
    model="-e 16,256,4 -t 64 -d 2048"
    grids=("--tp 1 --pp 1 --zero 0 -b 8" "--tp 1 --pp 1 --zero 3 -b 8" "--tp 4 --pp 1 --zero 0 -b 8" "--tp 2 --pp 2 --zero 0 -b 8"
           "--tp 1 --pp 1 --zero 0 -b 8 --recompute full" "--tp 1 --pp 4 --zero 0 -b 8 --recompute full"
           "--tp 1 --pp 4 --zero 0 -b 16 --recompute full" "--tp 1 --pp 4 --zero 0 -b 32" "--tp 1 --pp 4 --zero 0 -b 32 --recompute full")
    median() { tr ' ' '\n' | grep . | sort -g | awk '{ v[NR] = $1 } END { print NR ? v[int((NR + 1) / 2)] : "-" }'; }
    steps() { awk -F'|' '/^step [2-9]/ { sub(/ ms.*/, "", $5); print $5 }' | tr '\n' ' '; }
    declare -A ms
    for r in $(seq "$rounds"); do
        for i in "${!grids[@]}"; do  # each round starts one grid later: none always runs first (or after the same one)
            g=${grids[$(((i + r - 1) % ${#grids[@]}))]}
            out=$(mpirun -np 4 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "$engine" $model -x 4 -v 0 -s 0 $g 2>&1)
            ms[$g]+="$(echo "$out" | steps)"
        done
    done
    # the calibration: the first grid (data parallelism alone, 4 ranks on the 2 cores, measured in the same rounds
    # as the others, so under the same sharing of cores and memory): the GEMM share whose plan for it is its
    # measured step; the other eight are predicted with that share
    base=$(echo "${ms[${grids[0]}]}" | median)
    share=$(for x in $(seq 0.20 0.01 1.00); do
        "$bin" --plan 4 $machine $model --vpp 1 --offload none --pp-scatter-gather 0 --recompute none \
            ${grids[0]} --gemm-share "$x" 2>&1 | fastest | awk -v x="$x" -v m="$base" '{ d = $1 * 1000 - m; print (d < 0 ? -d : d), x }'
    done | sort -g | head -n 1 | cut -d' ' -f2)
    preset=$(awk '/^    {"cpu", 145.5e9/ { gsub(/,/, ""); print $(NF - 2) }' dev/plan/plan.h)
    echo "the calibration, ${grids[0]} on 4 ranks: $base ms a step, the plan's at a GEMM share of $share (the cpu preset carries $preset)"
    echo
    echo "The CPU engine on 4 ranks of 2 cores (L=16, C=256, NH=4, T=64, 2048 tokens a step): measured and --plan $machine --gemm-share $share"
    echo "| grid | measured ms/step (median; fastest-slowest) | plan ms/step | plan / measured |"
    echo "|---|---|---|---|"
    declare -A planned measured
    for g in "${grids[@]}"; do
        measured[$g]=$(echo "${ms[$g]}" | median)
        sg="--pp-scatter-gather 0"
        case "$g" in *"--tp 2 --pp 2"*) sg="--pp-scatter-gather 1";; esac
        case "$g" in *recompute*) ;; *) sg="$sg --recompute none";; esac
        planned[$g]=$("$bin" --plan 4 $machine --gemm-share "$share" $model --vpp 1 --offload none $sg $g 2>&1 |
            fastest | awk '{ printf "%.0f", $1 * 1000 }')
        spread=$(echo "${ms[$g]}" | tr ' ' '\n' | grep . | sort -g | sed -n '1p;$p' | tr '\n' ' ' | awk '{ printf "%.0f-%.0f", $1, $2 }')
        echo "| $g | ${measured[$g]} ($spread) | ${planned[$g]} | $(awk -v a="${planned[$g]}" -v b="${measured[$g]}" 'BEGIN { printf "%.2f", a / b }') |"
    done
    # the order: every pair of grids measured more than 10% apart (the noise of a few rounds is less), ordered alike?
    pairs=0 alike=0
    for ((i = 0; i < ${#grids[@]}; i++)); do
        for ((j = i + 1; j < ${#grids[@]}; j++)); do
            a=${grids[$i]} b=${grids[$j]}
            read -r far same <<< "$(awk -v ma="${measured[$a]}" -v mb="${measured[$b]}" -v pa="${planned[$a]}" -v pb="${planned[$b]}" \
                'BEGIN { far = ma > 1.1 * mb || mb > 1.1 * ma; print far, far && (ma < mb) == (pa < pb) }')"
            pairs=$((pairs + far)) alike=$((alike + same))
        done
    done
    echo "pairs of grids measured more than 10% apart: $pairs, the plan orders $alike of them alike"
    # the most grids the plan ranks in the measured order: the longest run of grids, taken in the plan's order,
    # whose measured steps rise too
    chain=$(for g in "${grids[@]}"; do echo "${planned[$g]} ${measured[$g]}"; done | sort -g |
        awk '{ m[NR] = $2; best[NR] = 1; for (i = 1; i < NR; i++) if (m[i] < m[NR] && best[i] + 1 > best[NR]) best[NR] = best[i] + 1
               if (best[NR] > top) top = best[NR] } END { print top }')
    echo "the most grids the plan ranks in the measured order: $chain of ${#grids[@]}"
fi
