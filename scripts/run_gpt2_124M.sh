#!/usr/bin/env bash
# GPT-2 124M from scratch on the GPUs of one node (CUDA engine, data parallel, ZeRO-1 with 2 or more):
# 16 x 1024 tokens per GPU and micro-batch, TOKENS per step (a multiple of 16384 x GPUs; accumulation makes
# up the rest), AdamW at 6e-4 after WARMUP steps, cosine decay to 6e-5, validation every 250 steps, a
# sample every 500 and a checkpoint every 1000 and at the end in out/gpt2_124M (run again with --resume
# to continue, --overwrite to start over).
# The defaults are a short demonstration on the tinyshakespeare shards in dev/data (one micro-batch per GPU,
# 200 steps, which overfit them). GPT-2's recipe on larger shards in llm.c's format, e.g. on 8 GPUs:
#   TRAIN='fineweb10B/*train*.bin' VAL='fineweb10B/*val*.bin' TOKENS=524288 STEPS=18865 WARMUP=700 \
#     bash scripts/run_gpt2_124M.sh
# GPUS overrides the count nvidia-smi gives. Flags given to the script are added last and win.
# `make plan_gpt && ./plan_gpt --plan N -e d12 -d TOKENS` shows other ways to run it (dev/plan).
set -eu
cd "$(dirname "$0")/.."
# mpirun refuses to start as root (containers, cloud shells) unless these say it may
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
make -s train_gpt
gpus=${GPUS:-$(nvidia-smi -L 2> /dev/null | wc -l)}
[ "$gpus" -ge 1 ] || { echo "run_gpt2_124M.sh: no GPU found (set GPUS to override)"; exit 1; }
tokens=${TOKENS:-$((16 * 1024 * gpus))}
[ $((tokens % (16 * 1024 * gpus))) = 0 ] || { echo "run_gpt2_124M.sh: TOKENS=$tokens is not a multiple of 16384 x $gpus GPUs"; exit 1; }
exec mpirun -np "$gpus" ./train_gpt -e d12 -b 16 -t 1024 -d "$tokens" -x "${STEPS:-200}" -l 6e-4 -u "${WARMUP:-20}" -q 0.1 \
    -v 250 -s 500 -n 1000 --zero $([ "$gpus" -gt 1 ] && echo 1 || echo 0) -o out/gpt2_124M \
    -i "${TRAIN:-dev/data/tinyshakespeare/tiny_shakespeare_train.bin}" -j "${VAL:-dev/data/tinyshakespeare/tiny_shakespeare_val.bin}" "$@"
