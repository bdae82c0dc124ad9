#!/usr/bin/env bash
# The planner's plans for a fixed set of questions (this file's list), against dev/plan/plans.txt: the same
# bytes on every machine (plan_gpt is built without -march=native and without contracted multiply-adds).
# `check_plans.sh` prints the differences and fails on any; `check_plans.sh --write` rewrites the file
# after a change to the planner that is meant to change its plans.
set -u
cd "$(dirname "$0")/../.."
questions=(
    "--plan 64 -e d12 -t 1024 -d 524288"
    "--plan 16 -e d6 -t 1024 -d 65536 --moe-experts 8 --attention cublas"
    "--plan 4 --cluster cpu -e d4 -t 64 -d 4096"
    "--plan 4 -e dev/ref/tiny_model.bin -t 16 -d 512"
    "--plan 1536 --cluster dgx-a100 -e 96,12288,96,51200 -t 2048 -d 3145728 --tp 8 --pp 12 -b 1 --recompute full --offload none --pp-scatter-gather 1 --train-tokens 300e9"
    "--plan 8 --cluster dgx-a100 -e d12 -t 1024 -d 524288 --gpu-tflops 624 --gpu-gbs 4078"
    "--plan 1 -e d48 -t 1024 -d 8192 --gpu-mem 24"
    "--plan 8 -e d12 --moe-experts 64 --moe-topk 2 -t 1024 -d 524288 --gpu-mem 16"
    "--plan 128 --cluster dgx-a100 --software megatron -e 40,6144,48,51200 -t 2048 -d 1048576 --attention cublas"
    "--plan 64 -e d48 -t 1024 -d 524288 --net-gbs 5 --node-gbs 100 --latency-us 20 --node-gpus 4"
    "--plan 8 --cluster nvl72 --gpu gb200 -e d24 -t 1024 -d 262144 --zero 1 --recompute selective"
    "--plan 8 -e 12,768,12 -t 131072 -d 131072 --gpu-mem 6"
    "--plan 16384 -e 126,16384,128,128256 -t 131072 -d 16777216"
    "--plan 8 -e llama:2,64,4,2,128 -t 64 -d 4096"
)
make -s plan_gpt || exit 1
new=$(for q in "${questions[@]}"; do echo "\$ ./plan_gpt $q"; ./plan_gpt $q 2>&1; done)
if [ "${1:-}" = --write ]; then
    echo "$new" > dev/plan/plans.txt
    echo "wrote dev/plan/plans.txt (${#questions[@]} plans)"
elif diff <(echo "$new") dev/plan/plans.txt; then
    echo "     plan_gpt: ${#questions[@]} plans equal dev/plan/plans.txt, byte for byte"
else
    echo "FAIL plan_gpt's plans differ from dev/plan/plans.txt (above: < now, > stored; check_plans.sh --write after a meant change)"
    exit 1
fi
