#!/usr/bin/env bash
# This CPU's yardsticks (dev/bench_sgemm.c) on OMP_NUM_THREADS threads: OpenBLAS's fp32 sgemm at 2048^3 on the
# kernels the CPU engine runs (OpenBLAS's choice, or the better set lp_blas_init asks for), and the memory
# bandwidth of the threads copying at once. Prints "engine E" (the engine's own line), "kernels K", "sgemm X"
# (GFLOP/s) and "copy Y" (GB/s, read and written), "n/a" where no OpenBLAS is found. Used by bench_cpu.sh and
# dev/plan/bench_plan.sh cpu.
# Usage: OMP_NUM_THREADS=2 bash scripts/cpu_rates.sh
set -u
cd "$(dirname "$0")/.."
make -s train_gpt_cpu || exit 1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
blas=$(pkg-config --cflags --libs openblas 2> /dev/null)
if [ -z "$blas" ] && [ -f /usr/include/x86_64-linux-gnu/openblas-openmp/cblas.h ]; then
    blas="-I/usr/include/x86_64-linux-gnu/openblas-openmp -L/usr/lib/x86_64-linux-gnu/openblas-openmp -lopenblas"
fi
engine=$(./train_gpt_cpu -e d1 -x 0 -v 0 -s 0 -j "" 2>&1 | sed -n 's/^engine *//p')
kernels=$(echo "$engine" | sed -n 's/.* on its \([A-Za-z0-9]*\) kernels.*/\1/p')
echo "engine $engine"
echo "kernels ${kernels:-n/a}"
if [ -n "$blas" ] && cc -O3 -march=native -fopenmp dev/bench_sgemm.c $blas -o "$work/bench_sgemm" 2> "$work/cc.log"; then
    env ${kernels:+OPENBLAS_CORETYPE=$kernels} "$work/bench_sgemm" |
        awk '/^sgemm/ { s = $(NF - 1) } /^copy/ { c = $(NF - 1) } END { print "sgemm", s ? s : "n/a"; print "copy", c ? c : "n/a" }'
else
    echo "no OpenBLAS found (pkg-config openblas, libopenblas-openmp-dev): no yardstick" >&2
    printf 'sgemm n/a\ncopy n/a\n'
fi
