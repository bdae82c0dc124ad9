#!/usr/bin/env bash
# GPT-2 124M from scratch on the GPUs of one node (CUDA engine, data parallel, ZeRO-1): 16 x 1024 tokens
# per GPU and micro-batch, TOKENS per step (gradient accumulation makes up the rest), AdamW at 6e-4 with
# 700 warmup steps and cosine decay to 6e-5, validation every 250 steps, a sample every 500 and a
# checkpoint every 1000 in out/gpt2_124M (continue with --resume). The defaults train on the
# tinyshakespeare shards in dev/data, which 200 steps of 64K tokens overfit; for a real run point TRAIN
# and VAL at larger shards in llm.c's format and raise TOKENS and STEPS, e.g.
#   TRAIN='fineweb10B/*train*.bin' VAL='fineweb10B/*val*.bin' TOKENS=524288 STEPS=18865 bash scripts/run_gpt2_124M.sh
# Flags given to the script are added last and win. `./train_gpt --plan N -e d12 -d TOKENS` shows other ways.
set -eu
cd "$(dirname "$0")/.."
make -s train_gpt
gpus=${GPUS:-$(nvidia-smi -L 2> /dev/null | wc -l)}
[ "$gpus" -ge 1 ] || { echo "run_gpt2_124M.sh: no GPU found (set GPUS to override)"; exit 1; }
exec mpirun -np "$gpus" ./train_gpt -e d12 -b 16 -t 1024 -d "${TOKENS:-65536}" -x "${STEPS:-200}" -l 6e-4 -u 700 -q 0.1 \
    -v 250 -s 500 -n 1000 --zero $([ "$gpus" -gt 1 ] && echo 1 || echo 0) -o out/gpt2_124M \
    -i "${TRAIN:-dev/data/tinyshakespeare/tiny_shakespeare_train.bin}" -j "${VAL:-dev/data/tinyshakespeare/tiny_shakespeare_val.bin}" "$@"
