#!/usr/bin/env bash
# A first run on any machine: the CPU engine trains a new depth-4 GPT-2 (16M parameters) on the
# tinyshakespeare shards shipped in dev/data, a few minutes on a laptop: the loss falls from ~10.9 to ~6,
# with validation and samples every 50 steps and a checkpoint in out/tiny at the end (run it again with
# --resume to continue it, or --overwrite to start over). Flags given to the script are added last and
# win, e.g. `bash scripts/run_tiny.sh -x 20`.
set -eu
cd "$(dirname "$0")/.."
make -s train_gpt_cpu
exec ./train_gpt_cpu -e d4 -b 4 -t 64 -x 200 -l 1e-3 -u 10 -v 50 -m 4 -s 50 -g 48 -o out/tiny "$@"
