#!/usr/bin/env bash
# The GPU session's protocol: what a lent GPU machine runs, in one device call of at most 8 minutes on a
# freshly started machine, the most valuable measurement first. Each step has its own time limit (the
# budget column; they sum to 480 s) and runs under `timeout -k`, in a process group of its own, sent SIGTERM
# with everything it started when its time is up and SIGKILL 5 s later (train_gpt finishes its step on
# SIGTERM), so a hang costs that step alone; before each timing no process of ours may hold the GPU. Writes gpu_check.md (and ncu_step.csv) into $OUT when set (the device tool), else here; its figures
# go into dev/gpu_results.md and the model's calibration (dev/docs/figures.md).
#   1 machine   the GPU, driver, nvcc, cuDNN, Open MPI
#   2 build     train_gpt (with cuDNN where cudnn-frontend's headers were carried: `make cudnn-frontend`),
#               test_gpt and llm.c's train_gpt2cu (its source carried in .llmc/, with its cuDNN attention too),
#               for this GPU's architecture alone, side by side
#   3 ncu       Nsight Compute over one step of GPT-2 124M (B=64, T=1024, flash): each lp_ kernel's
#               time, executed instructions and achieved occupancy into ncu_step.csv, written before
#               anything later can run out of time
#   4 steps     GPT-2 124M, B=64, T=1024, 10 steps each: --attention flash, cublas, cudnn, then llm.c's
#               train_gpt2cu with the same settings; the median step's tokens/s of each and its ratio to llm.c's
#   5 kernels   ./test_gpt tier4_: every kernel against its CPU loop on the hardware (the attention kernels too)
#   6 hangs     the hang-prone test alone (test_stop_signal: a signal ends a run at a step's end)
# Usage, through the device tool (the carried folders are ignored by git, never committed):
#   run: bash scripts/gpu_check.sh     carry: .cudnn-frontend .llmc
#   bash scripts/gpu_check.sh --dry-run   here, without a GPU: stand-ins for nvidia-smi, ncu and the runs; prints
#                                         the protocol with its budget (make test runs it)
# .llmc/: llm.c's Makefile, train_gpt2.cu and llmc/ at commit f1e2ace, e.g. `mkdir .llmc && git --git-dir=LLMC.git
# archive f1e2ace Makefile train_gpt2.cu llmc | tar -x -C .llmc`.
set -u
cd "$(dirname "$0")/.."
dry=0
[ "${1:-}" = --dry-run ] && dry=1
out=${OUT:-.}
report=$out/gpu_check.md
run124="-e d12 -b 64 -t 1024"  # (llmpar's and llm.c's flags agree here)
train=dev/data/tinyshakespeare/tiny_shakespeare_train.bin
data="-i $train -j '' -v 0 -s 0"  # no val (its shard is smaller than one batch of 64 x 1024)
# llm.c: -v 0 would divide by zero; its val loader needs a shard of a batch or more, so the train shard, 1 batch
llmc_data="-i $train -j $train -v 1000 -m 1 -s 1000 -g 0"

if [ $dry = 1 ]; then  # stand-ins: an H100 that runs nothing, an ncu that writes its CSV, runs that print steps
    stand=$(mktemp -d)
    cat > "$stand/nvidia-smi" << 'EOF'
#!/bin/sh
case "$*" in *compute_cap*) echo 9.0 ;; *query-compute-apps*) ;; *) echo "NVIDIA H100 80GB HBM3, 81559 MiB, 580.00 (stand-in)" ;; esac
EOF
    cat > "$stand/ncu" << 'EOF'
#!/bin/sh
while [ $# -gt 0 ]; do [ "$1" = --log-file ] && { shift; echo '"ID","Kernel Name"' > "$1"; echo '"1","lp_stand_in"' >> "$1"; }; shift; done
EOF
    chmod +x "$stand/nvidia-smi" "$stand/ncu"
    export PATH="$stand:$PATH"
fi

budget_total=0
# step BUDGET_S TITLE COMMAND...: a section of the report. The command runs under timeout, whose process group
# it and what it starts share: SIGTERM to all at its budget, SIGKILL 5 s later; with --dry-run it is printed.
step() {
    local limit=$1 title=$2
    shift 2
    budget_total=$((budget_total + limit))
    echo "## $title (budget $limit s; $budget_total s so far)"
    echo '```'
    if [ $dry = 1 ]; then
        echo "would run: $*"
    else
        local start=$(date +%s)
        timeout -k 5 "$limit" "$@"
        local rc=$?
        [ $rc = 124 ] || [ $rc = 137 ] && echo "STOPPED after $limit s"
        echo "exit $rc, $(($(date +%s) - start)) s"
    fi
    echo '```'
}

# Before a timing: no process of ours on the GPU (a step that ran out of time may have left one).
gpu_idle() {
    pkill -9 -x train_gpt 2> /dev/null
    pkill -9 -x train_gpt2cu 2> /dev/null
    local apps
    apps=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2> /dev/null)
    [ -z "$apps" ] || echo "GPU NOT IDLE: $apps"
}

# A run's tokens/s: the median over its steps after the first two (warm-up), llmpar's or llm.c's line.
tokens_s() {
    sed -n 's/.*| *\([0-9.]*\) tok\/s.*/\1/p' | tail -n +3 | sort -n | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print "-" }'
}

build() {
    local cc cudnn=0 jobs
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d .)
    jobs=$(nproc)
    [ -f .cudnn-frontend/include/cudnn_frontend.h ] && ls /usr/include/cudnn.h /usr/local/cuda/include/cudnn.h > /dev/null 2>&1 && cudnn=1
    echo "sm_$cc; cuDNN attention: $([ $cudnn = 1 ] && echo yes || echo "no (no .cudnn-frontend or no cudnn.h)")"
    make -s -j"$jobs" train_gpt test_gpt USE_CUDNN=$cudnn CUDA_ARCH="-gencode arch=compute_$cc,code=sm_$cc" &
    local ours=$!
    if [ -f .llmc/train_gpt2.cu ]; then
        [ $cudnn = 1 ] && ln -sfn ../.cudnn-frontend .llmc/cudnn-frontend  # (llm.c's Makefile looks there first)
        # llm.c at f1e2ace predates CUDA 13, whose cudaMemAdvise takes a cudaMemLocation (its one compile error there)
        nvcc --version | grep -q 'release 1[3-9]' && sed -i 's/cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId)/cudaMemAdviseSetPreferredLocation, cudaMemLocation{cudaMemLocationTypeHost, 0})/' \
            .llmc/llmc/cuda_utils.cuh
        # llm.c links NVML (-lnvidia-ml): the driver's libnvidia-ml.so.1, through a link of the name ld looks for
        local nvml
        nvml=$(ldconfig -p | awk '/libnvidia-ml.so.1 / { print $NF; exit }')
        [ -n "$nvml" ] && mkdir -p /tmp/nvml && ln -sf "$nvml" /tmp/nvml/libnvidia-ml.so && export LIBRARY_PATH=/tmp/nvml:${LIBRARY_PATH:-}
        make -s -C .llmc -j"$jobs" train_gpt2cu USE_CUDNN=$cudnn NO_MULTI_GPU=1 GPU_COMPUTE_CAPABILITY="$cc" \
            CUDNN_FRONTEND_PATH="$PWD/.cudnn-frontend/include" > /tmp/llmc_build.log 2>&1 || { echo "llm.c's build failed:"; tail -n 5 /tmp/llmc_build.log; }
    else
        echo "no .llmc/: llm.c is not measured beside"
    fi
    wait $ours || echo "BUILD FAILED"
}

steps() {
    local name cmd rate llmc=-
    declare -A rates
    for name in flash cublas cudnn llm.c; do
        if [ "$name" = llm.c ]; then
            [ -x .llmc/train_gpt2cu ] || [ $dry = 1 ] || continue
            cmd=".llmc/train_gpt2cu $run124 $llmc_data -x 10 -d 65536 -n 0"
        else
            cmd="./train_gpt $run124 $data -x 10 --attention $name"
        fi
        gpu_idle
        rm -f /tmp/step_$name.log
        step 25 "GPT-2 124M, B=64, T=1024: $name" bash -c "$cmd > /tmp/step_$name.log 2>&1; tail -n 4 /tmp/step_$name.log"
        rate=$([ -f /tmp/step_$name.log ] && tokens_s < /tmp/step_$name.log)
        rates[$name]=${rate:--}
        [ "$name" = llm.c ] && llmc=${rate:--}
    done
    echo "| attention | tokens/s (median of steps 3-10) | / llm.c |"
    echo "|---|---|---|"
    for name in flash cublas cudnn llm.c; do
        [ -n "${rates[$name]:-}" ] || continue
        echo "| $name | ${rates[$name]} | $(awk -v a="${rates[$name]}" -v b="$llmc" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.3f", a / b; else print "-" }') |"
    done
}

main() {
    echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ)$([ $dry = 1 ] && echo " (dry run: stand-ins, nothing run)")"
    step 10 "machine" bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvcc --version | tail -n 1;
        grep -h "define CUDNN_M[AI]" /usr/include/cudnn_version.h /usr/local/cuda/include/cudnn_version.h 2> /dev/null | tr "\n" " "; echo;
        echo "mpicc: $(command -v mpicc || echo none)"'
    step 200 "build, for this GPU alone" build
    gpu_idle
    step 80 "Nsight Compute over one step of 124M, flash (ncu_step.csv)" bash -c "ncu --clock-control none --csv --log-file $out/ncu_step.csv \
        -k regex:lp_ --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active \
        ./train_gpt $run124 $data -x 1 --attention flash > /dev/null; echo \"\$(grep -c '\"lp_' $out/ncu_step.csv) rows\""
    steps
    step 60 "the kernels against their CPU loops (tier4_kernel_tests, tier4_attention_kernels)" ./test_gpt tier4_
    gpu_idle
    step 30 "the hang-prone test alone" ./test_gpt test_stop_signal
    gpu_idle
    echo "budget: $budget_total s of 480"
    [ $budget_total -le 480 ]
}

main 2>&1 | tee "$report"
rc=${PIPESTATUS[0]}
[ $dry = 1 ] && rm -rf "$stand"
exit "$rc"
