#!/usr/bin/env bash
# Throughput of ./train_gpt on one GPU: ms/step, tok/s, MFU and GPU memory for GPT-2 124M (d12) and
# 350M (d24) at T=1024, with and without activation recomputation (B=128 does not fit 80 GB without it),
# printed as a markdown table. Averages skip the first 5 steps (warm-up). MFU counts the model's FLOPs,
# not the recomputed ones.
# Usage: bash scripts/bench_gpu.sh [steps]    (run from anywhere; needs `make train_gpt` done)
#        bash scripts/bench_gpu.sh emu        no GPU: a MODEL of d12 at B=64 T=1024 on an H100 per kernel, from
#                                             the CUDA emulator's counts, for this code and the code before issue 16,
#                                             then of d=2 ZeRO-2 and ZeRO-3 steps with their streams replayed (the
#                                             overlap of communication; ~45 min on 2 cores; dev/cudaemu/README.md,
#                                             "Counting bytes and FLOPs")
#        bash scripts/bench_gpu.sh emu kernels   only the first part (~25 min); emu zero: only the second (~20 min)
#        bash scripts/bench_gpu.sh emu large     GPT-2 774M (B=16) and 1.5B (B=8) at T=1024 on an H100, MODELLED
#                                             from counts of their layers one and two at a time, per micro-batch
#                                             and per step of llm.c's tokens per GPU (65536, 131072; ~40 min)
set -u
cd "$(dirname "$0")/.."

# emu: train_gpt_emu_prof counts step 2 of a 2-step run of GPT-2 124M at T=1024, B=1 and B=2 (the emulator
# costs minutes a step); dev/cudaemu/roofline.py fits each launch's counts in B and models B=64 on an H100.
# Then 2 data-parallel ranks at T=256 with ZeRO-2 and ZeRO-3 (rank 0 counted, rank 1 the uncounted build),
# modelled at B=256 and B=16 per GPU over NVLink (300 GB/s) and between nodes (40 GB/s): serial, and with
# the streams replayed (what overlapping the reductions and gathers with compute buys).
# "Before" is the parent of issue 16's first GPU commit (97ffb10), built with this emulator. The counts
# stay in out/bench_gpu_emu/ (roofline.py can be run on them again).
if [ "${1:-}" = emu ]; then
    part=${2:-all}
    before=$(git rev-parse 97ffb10^) || exit 1
    counts=out/bench_gpu_emu
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    mkdir -p "$counts" "$tmp/before/dev/cudaemu"
    echo "building train_gpt_emu_prof ..." >&2
    make -s train_gpt_emu_prof train_gpt_emu || exit 1
    if [ $part = large ]; then
        # No dN preset has 774M's or 1.5B's width at one or two layers: dev/ref/gpt2_ref.py writes such models
        # (GPT-2's initialisation); roofline.py extrapolates each launch's counts in B, then in depth.
        # B fits 80 GB on one GPU; the tokens per GPU per step are those of llm.c's runs (scripts/run_gpt2_774M.sh:
        # 524288 on 8 GPUs; run_gpt2_1558M.sh: 1048576 on 8), reached by accumulating micro-batches
        for shape in "36 1280 20 16 65536" "48 1600 25 8 131072"; do
            set -- $shape
            files=()
            for l in 1 2; do
                python3 dev/ref/gpt2_ref.py random-model "$tmp/model.bin" $l $2 $3 || exit 1
                for b in 1 2; do
                    echo "counting GPT-2 d$1's layers: L=$l C=$2 B=$b T=1024, 2 steps ..." >&2
                    f=$counts/d$1-L$l-$b
                    if ! CUDAEMU_PROFILE=$f.tsv CUDAEMU_PROFILE_SKIP=2 ./train_gpt_emu_prof -e "$tmp/model.bin" -b $b -t 1024 -x 2 -v 0 -s 0 \
                         > "$f.log" 2>&1; then
                        tail -n 5 "$f.log" >&2
                        exit 1
                    fi
                    files+=("$f.tsv")
                done
            done
            echo
            python3 dev/cudaemu/roofline.py --batch $4 --seq 1024 --measured 1 2 --layers 1 2 --model $1 $2 50304 \
                --accum $(($5 / ($4 * 1024))) --run "d$1" "${files[@]}"
        done
        exit
    fi
    echo "building train_gpt_emu_prof for the code before issue 16, ${before:0:7} ..." >&2
    git show "$before:llmpar.h" > "$tmp/before/llmpar.h" && git show "$before:train_gpt.cu" > "$tmp/before/train_gpt.cu" || exit 1
    cp Makefile "$tmp/before/" && cp dev/cudaemu/cudaemu.h dev/cudaemu/cudaemu.cpp "$tmp/before/dev/cudaemu/"
    if ! make -s -C "$tmp/before" train_gpt_emu_prof train_gpt_emu > "$tmp/build.log" 2>&1; then
        echo "the code before issue 16 (${before:0:7}) does not build with this emulator:" >&2
        cat "$tmp/build.log" >&2
        exit 1
    fi
    runs=()
    for v in now before; do
        [ $part = zero ] && break
        bin=./train_gpt_emu_prof
        [ $v = before ] && bin=$tmp/before/train_gpt_emu_prof
        for b in 1 2; do
            echo "counting $v, d12 B=$b T=1024, 2 steps ..." >&2
            if ! CUDAEMU_PROFILE=$counts/$v-$b.tsv CUDAEMU_PROFILE_SKIP=2 $bin -e d12 -b $b -t 1024 -x 2 -v 0 -s 0 > "$counts/$v-$b.log" 2>&1; then
                tail -n 5 "$counts/$v-$b.log" >&2
                exit 1
            fi
        done
        label=$v
        [ $v = before ] && label="before (${before:0:7})"
        runs+=(--run "$label" "$counts/$v-1.tsv" "$counts/$v-2.tsv")
    done
    [ $part = zero ] || python3 dev/cudaemu/roofline.py --batch 64 --seq 1024 --measured 1 2 --model 12 768 50304 "${runs[@]}"
    [ $part = kernels ] && exit
    runs=()
    for v in now before; do
        dir=.
        [ $v = before ] && dir=$tmp/before
        for z in 2 3; do
            for b in 1 2; do
                echo "counting $v, d12 B=$b T=256 on 2 ranks, ZeRO-$z, 2 steps ..." >&2
                args="-e d12 -b $b -t 256 -x 2 -v 0 -s 0 --zero $z"
                if ! mpirun -np 1 -x CUDAEMU_PROFILE=$counts/$v-z$z-$b.tsv -x CUDAEMU_PROFILE_SKIP=2 $dir/train_gpt_emu_prof $args \
                     : -np 1 $dir/train_gpt_emu $args > "$counts/$v-z$z-$b.log" 2>&1; then
                    tail -n 5 "$counts/$v-z$z-$b.log" >&2
                    exit 1
                fi
            done
            label="$v ZeRO-$z"
            [ $v = before ] && label="before (${before:0:7}) ZeRO-$z"
            runs+=(--run "$label" "$counts/$v-z$z-1.tsv" "$counts/$v-z$z-2.tsv")
        done
    done
    for b in 256 16; do
        echo
        python3 dev/cudaemu/roofline.py --batch $b --seq 256 --measured 1 2 --model 12 768 50304 --link 300 40 --overlap "${runs[@]}"
    done
    exit
fi
steps=${1:-25}
data=dev/data/tinyshakespeare/tiny_shakespeare_train.bin
echo "| model | B | T | recompute | ms/step | tok/s | MFU | GPU MiB |"
echo "|---|---|---|---|---|---|---|---|"
for cfg in "d12 16 none" "d12 64 none" "d12 64 selective" "d12 64 full" "d12 128 none" "d12 128 full" "d24 32 none" \
           "d24 32 full"; do
    set -- $cfg
    log=$(./train_gpt -e "$1" -b "$2" -t 1024 --recompute "$3" -x "$steps" -u 10 -v 0 -s 0 -i "$data" 2>&1)
    if ! echo "$log" | grep -q "^step $steps/"; then
        err=$(echo "$log" | grep -m1 "error" || echo "failed")
        echo "| $1 | $2 | 1024 | $3 | $err | | | |"
        continue
    fi
    echo "$log" | awk -F'|' -v m="$1" -v b="$2" -v r="$3" '
        /^GPU memory in use:/ { split($0, w, " "); mem = w[5] }
        /^step / { n++; if (n > 5) { split($5, a, " "); ms += a[1]; split($6, t, " "); tok += t[1];
                   split($7, u, " "); sub("%", "", u[2]); mfu += u[2]; k++ } }
        END { printf "| %s | %s | 1024 | %s | %.1f | %.0f | %.1f%% | %s |\n", m, b, r, ms / k, tok / k, mfu / k, mem }'
done
