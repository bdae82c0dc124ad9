#!/usr/bin/env bash
# 3D parallelism on 8 ranks: t=2 (with sequence parallelism) x p=2 (1F1B) x d=2 (ZeRO-1), selective
# recomputation. `cpu` runs the CPU engine's depth-4 model on this machine (8 single-threaded ranks,
# oversubscribed: a minute or two); `gpu` the CUDA engine's GPT-2 124M on the 8 GPUs of one node.
# Only rank 0 prints; its step lines are the whole run's (the loss of the full batch), and the end reports
# the tensor-parallel traffic and the pipeline bubble. Flags after the mode are added last.
#   bash scripts/run_3d.sh cpu
#   bash scripts/run_3d.sh gpu -x 500
set -eu
cd "$(dirname "$0")/.."
# mpirun refuses to start as root (containers, cloud shells) unless these say it may
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mode=${1:-cpu}
shift || true
grid="--tp 2 --sp --pp 2 --schedule 1f1b --zero 1 --recompute selective"
case "$mode" in
cpu)
    make -s train_gpt_cpu
    exec mpirun -np 8 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 ./train_gpt_cpu $grid -e d4 -b 2 -t 64 -d 1024 -x 20 \
        -v 10 -m 2 "$@" ;;
gpu)
    gpus=$(nvidia-smi -L 2> /dev/null | wc -l)
    [ "$gpus" -ge 8 ] || { echo "run_3d.sh gpu: needs 8 GPUs on this node, nvidia-smi lists $gpus (bash scripts/run_3d.sh cpu runs the same grid on the CPU)"; exit 1; }
    make -s train_gpt
    exec mpirun -np 8 ./train_gpt $grid -e d12 -b 16 -t 1024 -d 262144 -x 100 -v 50 "$@" ;;
*)
    echo "usage: bash scripts/run_3d.sh [cpu|gpu] [flags...]"
    exit 2 ;;
esac
