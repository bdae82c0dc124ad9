#!/usr/bin/env bash
# Throughput of ./train_gpt on one GPU: ms/step, tok/s, MFU and GPU memory for GPT-2 124M (d12) and
# 350M (d24) at T=1024, with and without activation recomputation (B=128 does not fit 80 GB without it),
# printed as a markdown table. Averages skip the first 5 steps (warm-up). MFU counts the model's FLOPs,
# not the recomputed ones.
# Usage: bash scripts/bench_gpu.sh [steps]    (run from anywhere; needs `make train_gpt` done)
#        bash scripts/bench_gpu.sh emu        no GPU: a MODEL of d12 at B=64 T=1024 on an H100 per kernel, from
#                                             the CUDA emulator's counts, then of d=2 ZeRO-2 and ZeRO-3 steps with
#                                             their streams replayed (the overlap of communication; ~30 min on 2
#                                             cores; dev/cudaemu/README.md, "Counting what bounds a kernel")
#        bash scripts/bench_gpu.sh emu kernels   only the first part (~10 min); emu zero: only the second (~20 min)
#        bash scripts/bench_gpu.sh emu large     GPT-2 774M (B=16) and 1.5B (B=8) at T=1024 on an H100, MODELLED
#                                             from counts of their layers one and two at a time, per micro-batch
#                                             and per step of llm.c's tokens per GPU (65536, 131072; ~1 hour)
#        bash scripts/bench_gpu.sh emu check     every roof of single launches on an H100 and an A100, MODELLED:
#                                             two shared-memory test kernels (conflict-free, 32-way conflicted),
#                                             124M's attention, LayerNorm and classifier kernels at B=64 T=1024, under the
#                                             hazard check; registers from nvcc's report (~5 min)
set -u
cd "$(dirname "$0")/.."

# emu: train_gpt_emu_prof counts step 2 of a 2-step run of GPT-2 124M at T=1024, B=1 and B=2 (the emulator
# costs minutes a step); dev/cudaemu/roofline.py fits each launch's counts in B and models B=64 on an H100,
# each kernel at the largest of its roofs (dev/cudaemu/README.md), its registers from nvcc's report.
# Then 2 data-parallel ranks at T=256 with ZeRO-2 and ZeRO-3 (rank 0 counted, rank 1 the uncounted build),
# modelled at B=256 and B=16 per GPU over NVLink (300 GB/s) and between nodes (40 GB/s): serial, and with
# the streams replayed (what overlapping the reductions and gathers with compute buys). The counts stay in
# out/bench_gpu_emu/ (roofline.py can be run on them again).
if [ "${1:-}" = emu ]; then
    part=${2:-all}
    counts=out/bench_gpu_emu
    mkdir -p "$counts"
    # nvcc -Xptxas -v's report per architecture: each kernel's registers per thread (sm_90: H100, sm_80: A100);
    # and the machine code itself with its source lines (nvdisasm -gi; dev/cudaemu/nvdisasm.sh finds one),
    # from which dev/cudaemu/sass.py finds the instructions each kernel executes
    nvdisasm=$(bash dev/cudaemu/nvdisasm.sh || true)
    ptxas=() sass=()
    for arch in 90 80; do
        if nvcc -O3 -std=c++17 -arch=sm_$arch -cubin -lineinfo -Xptxas -v -o "$counts/train_gpt.sm_$arch.cubin" -x cu train_gpt.cu \
            > "$counts/ptxas_sm$arch.txt" 2>&1; then
            ptxas+=("$counts/ptxas_sm$arch.txt")
            [ -n "$nvdisasm" ] && "$nvdisasm" -gi -c "$counts/train_gpt.sm_$arch.cubin" > "$counts/train_gpt.sm_$arch.sass" &&
                sass+=("$counts/train_gpt.sm_$arch.sass")
        else
            echo "nvcc for sm_$arch failed (registers unknown: occupancy from threads and shared memory alone):" >&2
            tail -n 3 "$counts/ptxas_sm$arch.txt" >&2
        fi
    done
    [ ${#sass[@]} = 2 ] || echo "no nvdisasm: the issue and latency roofs count only the instructions the emulator sees" >&2
    regs=()
    [ ${#ptxas[@]} = 2 ] && regs=(--ptxas "${ptxas[0]}")
    [ ${#sass[@]} = 2 ] && regs+=(--sass "${sass[0]}")
    if [ $part = check ]; then
        # dev/cudaemu/model_check counts each launch once (attention of both paths on one head, modelled at 64 x 12; the
        # shared-memory kernels at 16 times their grid, two waves); roofline.py check prints every roof
        make -s dev/cudaemu/model_check || exit 1
        echo "counting dev/cudaemu/model_check's launches under the hazard check ..." >&2
        if ! CUDAEMU_HAZARDS=1 CUDAEMU_PROFILE=$counts/check.tsv dev/cudaemu/model_check > "$counts/check.log" 2>&1; then
            tail -n 3 "$counts/check.log" >&2
            exit 1
        fi
        echo "no shared-memory hazard in any of them (CUDAEMU_HAZARDS=1)"
        echo
        [ ${#ptxas[@]} = 2 ] && regs=(--ptxas "${ptxas[@]}")
        [ ${#sass[@]} = 2 ] && regs+=(--sass "${sass[@]}")
        exec python3 dev/cudaemu/roofline.py check "$counts/check.tsv" --gpu H100 A100 ${regs[@]+"${regs[@]}"} \
            --scale 'shared_conflict=16' --scale 'attention=768' --scale '^cublasLt=768' \
            --scale 'classifier=64'
    fi
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
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
                --accum $(($5 / ($4 * 1024))) ${regs[@]+"${regs[@]}"} --run "d$1" "${files[@]}"
        done
        exit
    fi
    if [ $part != zero ]; then
        for b in 1 2; do
            echo "counting d12 B=$b T=1024, 2 steps ..." >&2
            if ! CUDAEMU_PROFILE=$counts/d12-$b.tsv CUDAEMU_PROFILE_SKIP=2 ./train_gpt_emu_prof -e d12 -b $b -t 1024 -x 2 -v 0 -s 0 \
                 > "$counts/d12-$b.log" 2>&1; then
                tail -n 5 "$counts/d12-$b.log" >&2
                exit 1
            fi
        done
        python3 dev/cudaemu/roofline.py --batch 64 --seq 1024 --measured 1 2 --model 12 768 50304 ${regs[@]+"${regs[@]}"} \
            --run d12 "$counts/d12-1.tsv" "$counts/d12-2.tsv"
        [ $part = kernels ] && exit
    fi
    runs=()
    for z in 2 3; do
        for b in 1 2; do
            echo "counting d12 B=$b T=256 on 2 ranks, ZeRO-$z, 2 steps ..." >&2
            args="-e d12 -b $b -t 256 -x 2 -v 0 -s 0 --zero $z"
            if ! mpirun -np 1 -x CUDAEMU_PROFILE=$counts/z$z-$b.tsv -x CUDAEMU_PROFILE_SKIP=2 ./train_gpt_emu_prof $args \
                 : -np 1 ./train_gpt_emu $args > "$counts/z$z-$b.log" 2>&1; then
                tail -n 5 "$counts/z$z-$b.log" >&2
                exit 1
            fi
        done
        runs+=(--run "ZeRO-$z" "$counts/z$z-1.tsv" "$counts/z$z-2.tsv")
    done
    for b in 256 16; do
        echo
        python3 dev/cudaemu/roofline.py --batch $b --seq 256 --measured 1 2 --model 12 768 50304 --link 300 40 --overlap \
            ${regs[@]+"${regs[@]}"} "${runs[@]}"
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
