#!/usr/bin/env bash
# The calls of one training step on rank 0, against llmpar.h's sections (issue 47's measure of how far a
# reader jumps): the CPU engine built with -finstrument-functions (dev/trace/trace_hooks.c; -O1, -no-pie),
# 2 steps on a grid, the second step's calls analysed by trace.py. Default: t=2 p=2 d=2 (8 ranks) with SP,
# 1F1B, ZeRO-1 and selective recomputation on the depth-4 model; other flags replace the grid's.
# Usage: bash dev/trace/trace.sh [train_gpt flags...]
set -eu
cd "$(dirname "$0")/../.."
bin=/tmp/train_gpt_trace
dir=$(mktemp -d)
mpicc -x c -std=gnu11 -O1 -fopenmp -DLLMPAR_CPU -DLLMPAR_MPI -no-pie -g -finstrument-functions -c train_gpt.cu -o "$dir/train.o"
mpicc -std=gnu11 -O1 -c dev/trace/trace_hooks.c -o "$dir/hooks.o"
mpicc -no-pie -fopenmp "$dir/train.o" "$dir/hooks.o" -o "$bin" -lm
grid=(--tp 2 --pp 2 --sp --zero 1 --recompute selective)
ranks=8
if [ $# -gt 0 ]; then grid=("$@"); ranks=${RANKS:-8}; fi
addr() { nm "$bin" | awk -v f="$1" '$3 == f { print $1 }'; }
export TRACE_DIR=$dir TRACE_FROM=$(addr lp_step_forward_backward) TRACE_TO=$(addr lp_step_update)
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun -np "$ranks" --oversubscribe --bind-to none -x TRACE_DIR -x TRACE_FROM -x TRACE_TO -x OMP_NUM_THREADS=1 "$bin" -e d4 -b 4 -t 64 \
    -d 1024 -x 2 -v 0 -s 0 -j '' "${grid[@]}" > "$dir/run.log" 2>&1 || { tail -n 5 "$dir/run.log"; exit 1; }
echo "train_gpt ${grid[*]} on $ranks ranks, rank 0:"
python3 dev/trace/trace.py "$bin" "$dir/trace.0"
rm -rf "$dir" "$bin"
