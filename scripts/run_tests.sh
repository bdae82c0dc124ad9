#!/usr/bin/env bash
# `make test`: tiers 1-3 on the CPU build (./test_gpt_cpu), two steps of each CPU run script, the docs'
# links, the data path (scripts/test_data_path.sh: prepare.py's shards train, plot.py draws them, the README's
# own-text block runs as written), Hugging Face export and import (scripts/test_hf.sh), then tier 4:
# on the CUDA build (./test_gpt) when a GPU is present, else on the CUDA emulator (./test_gpt_emu, after
# the emulator's own tests). With nvcc but no GPU, both CUDA binaries are still built (for sm_90; the engine
# without MPI for sm_80), so the CUDA code keeps compiling warning-free and tier 1 checks ./train_gpt's
# "no GPU" error.
# `run_tests.sh emu` (make test-emu): the emulated tier alone. Prints the totals last.
set -u
cd "$(dirname "$0")/.."
passed=0
failed=0
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # mpirun refuses root unless told
jobs=$(nproc 2> /dev/null || echo 1)  # a make of several binaries builds them side by side, one a core

timed() {  # timed COMMAND...: run a check of this script's and say how long it took, for the time budget
    local start=$SECONDS
    "$@"
    echo "     ($1 took $((SECONDS - start)) s; make test at $SECONDS s)"
}

run_tier() {  # run a test binary, echo its output and its time, add its closing "N passed, N failed" to the totals
    local log start=$SECONDS
    log=$(mktemp)
    "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    echo "     ($* took $((SECONDS - start)) s; make test at $SECONDS s)"
    add_totals "$log" "$rc" "$*"
}

add_totals() {  # add_totals LOG RC NAME: add the closing "N passed, N failed" of NAME's output LOG (removed) to the totals
    local line
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$1" | tail -n 1)
    rm -f "$1"
    if [ -z "$line" ]; then
        echo "FAIL $3 ended without a summary (exit $2)"
        failed=$((failed + 1))
        return
    fi
    passed=$((passed + ${line%% passed*}))
    local f=${line#*passed, }
    failed=$((failed + ${f%% failed*}))
}

# the library's usage example (dev/examples/train_loop.cu): `example_trains NAME COMMAND...` runs it and
# counts one check: it trains, its loss falling by at least 1 nat from its first step to its last. Its
# output stays in example_out.
example_trains() {
    local name=$1 out summary
    shift
    out=$("$@" 2>&1)
    example_out=$out
    if summary=$(awk '/^step [0-9]+\/[0-9]+ \| loss / { if (!n++) first = $5; last = $5 }
                      END { printf "loss %s -> %s over %d steps", first, last, n; exit !(n > 1 && first ~ /^[0-9.]+$/ && last ~ /^[0-9.]+$/ && last < first - 1.0) }' <<< "$out"); then
        echo "     the example ($name): $summary"
        passed=$((passed + 1))
    else
        echo "$out"
        echo "FAIL the example ($name) trains: its loss falls by at least 1 nat ($summary)"
        failed=$((failed + 1))
    fi
}

# the library from two files (dev/examples/two_files_*.cu): `example_two_files NAME COMMAND...` counts one
# check: it trains, and its second file prints the val loss once before training and once after (rank 0
# alone: lp_rank is one variable in both files), the second at least 1 nat below the first
example_two_files() {
    local name=$1 out summary
    shift
    out=$("$@" 2>&1)
    if summary=$(awk '/^step [0-9]+\/[0-9]+ \| loss / { n++ } /^val loss / { v[k++] = $3 }
                      END { printf "val loss %s -> %s over %d steps", v[0], v[1], n; exit !(n > 1 && k == 2 && v[1] ~ /^[0-9.]+$/ && v[1] < v[0] - 1.0) }' <<< "$out"); then
        echo "     the example from two files ($name): $summary"
        passed=$((passed + 1))
    else
        echo "$out"
        echo "FAIL the example from two files ($name): steps, then two val losses (printed once each) falling by at least 1 nat"
        failed=$((failed + 1))
    fi
}

# llmpar.h's rule: a program that includes it, and defines LLMPAR_IMPLEMENTATION in none of its files, does
# not link (the functions and globals are declared, never defined). One check: the two-file example without its define.
example_needs_implementation() {
    local out bin=/tmp/llmpar_nodef_$$
    if out=$(sed '/^#define LLMPAR_IMPLEMENTATION/d' dev/examples/two_files_main.cu | ${CC:-cc} -x c -std=gnu11 -O0 -fopenmp \
        -DLLMPAR_CPU -Idev/examples - dev/examples/two_files_eval.cu -o $bin -lm 2>&1); then
        echo "FAIL the two-file example links without LLMPAR_IMPLEMENTATION"
        failed=$((failed + 1))
    elif grep -qE "undefined (reference to|symbol:) .?lp_process_init" <<< "$out"; then
        echo "     the example from two files without LLMPAR_IMPLEMENTATION: no link (lp_process_init undefined)"
        passed=$((passed + 1))
    else
        echo "$out" | tail -n 5
        echo "FAIL the two-file example without LLMPAR_IMPLEMENTATION fails to link, for the undefined lp_process_init"
        failed=$((failed + 1))
    fi
    rm -f $bin
}

# the GPU model's depth extrapolation (scripts/bench_gpu.sh emu large): a small GPT-2 counted at 1 and 2
# layers and extrapolated to 3 by roofline.py --layers must model every launch as the direct count at 3
# layers does. One check (skipped without numpy, as the data path's checks skip without their packages).
model_extrapolates() {
    local dir l b pid ok=1
    if ! python3 -c "import numpy" > /dev/null 2>&1; then
        echo "skip: the GPU model's depth check (dev/ref/gpt2_ref.py needs Python's numpy)"
        return
    fi
    if ! make -s train_gpt_emu_prof; then
        echo "FAIL the counting build (make train_gpt_emu_prof)"
        failed=$((failed + 1))
        return
    fi
    dir=$(mktemp -d)
    local pids=()
    for l in 1 2 3; do
        python3 dev/ref/gpt2_ref.py random-model "$dir/L$l.bin" $l 64 2 || ok=0
        for b in 1 2; do  # (the six counts side by side: each one process, its kernels on one core)
            CUDAEMU_PROFILE=$dir/L$l-$b.tsv CUDAEMU_PROFILE_SKIP=2 ./train_gpt_emu_prof -e "$dir/L$l.bin" -b $b -t 64 -x 2 -v 0 \
                -s 0 > "$dir/L$l-$b.log" 2>&1 &
            pids+=($!)
        done
    done
    for pid in "${pids[@]}"; do wait "$pid" || ok=0; done
    rows() { grep -E '^\| (lp_|cublasLt|cudaMem)' | sort; }
    if [ $ok = 1 ]; then
        python3 dev/cudaemu/roofline.py --batch 8 --seq 64 --measured 1 2 --model 3 64 50304 --run x "$dir/L3-1.tsv" \
            "$dir/L3-2.tsv" | rows > "$dir/direct"
        python3 dev/cudaemu/roofline.py --batch 8 --seq 64 --measured 1 2 --layers 1 2 --model 3 64 50304 --run x \
            "$dir/L1-1.tsv" "$dir/L1-2.tsv" "$dir/L2-1.tsv" "$dir/L2-2.tsv" | rows > "$dir/depth"
    fi
    if [ $ok = 1 ] && [ -s "$dir/direct" ] && cmp -s "$dir/direct" "$dir/depth"; then
        echo "     the GPU model: 3 layers extrapolated from counts at 1 and 2 equal the direct count ($(wc -l < "$dir/direct") launch rows)"
        passed=$((passed + 1))
    else
        diff "$dir/direct" "$dir/depth" | head -n 10
        echo "FAIL the GPU model's depth extrapolation (roofline.py --layers) equals a direct count"
        failed=$((failed + 1))
    fi
    rm -rf "$dir"
}

# the GPU model's count of every instruction (dev/cudaemu/sass.py): its solver on a SASS listing written by
# hand, whose blocks' runs are known. One check (skipped without numpy).
sass_solves() {
    if ! python3 -c "import numpy" > /dev/null 2>&1; then
        echo "skip: the GPU model's SASS check (dev/cudaemu/sass.py needs Python's numpy)"
        return
    fi
    if python3 dev/cudaemu/sass.py --test; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
    fi
}

# the hazard check (dev/cudaemu/README.md) over every kernel of training steps: one rank with selective
# recomputation, two with --tp 2, two with ZeRO-2, one rank of the Llama family (grouped-query flash attention,
# RoPE, RMSNorm, SwiGLU), two with --cp 2 (the flash kernels on the ring's blocks), side by side; each run must
# end. One check (where the counting binary built).
kernels_hazard_free() {
    local ok=1 dir grid np k pids=()
    [ -x ./train_gpt_emu_prof ] || return
    dir=$(mktemp -d)
    for grid in "1 --recompute selective" "2 --tp 2" "2 -z 2" "1 -e llama:d2" "2 --cp 2"; do
        set -- $grid
        np=$1
        shift
        mpirun -np "$np" --oversubscribe --bind-to none -x CUDAEMU_HAZARDS=1 -x OMP_NUM_THREADS=1 ./train_gpt_emu_prof \
            -e d2 -b 2 -t 64 -x 2 -v 1 -s 0 "$@" > "$dir/${#pids[@]}.log" 2>&1 &
        pids+=($!)
    done
    for k in "${!pids[@]}"; do
        wait "${pids[$k]}"
        grep -q "^step 2/2 " "$dir/$k.log" || { tail -n 3 "$dir/$k.log"; ok=0; }
    done
    rm -rf "$dir"
    if [ $ok = 1 ]; then
        echo "     the hazard check: no shared-memory hazard in the kernels of training steps (1 rank, --tp 2, ZeRO-2, a Llama, --cp 2)"
        passed=$((passed + 1))
    else
        echo "FAIL the hazard check finds a shared-memory hazard, or the runs under it did not end"
        failed=$((failed + 1))
    fi
}

# tier 4 on the CUDA emulator: the emulator's own tests, then the CUDA engine's
emulated_tier() {
    # every emulated build at once, side by side, the examples' and the counting one's too (the makes below then
    # find them built, or build a failed one again to show its errors)
    make -s -j"$jobs" -k train_gpt_cpu train_gpt_emu train_gpt_emu_hooks test_gpt_emu dev/cudaemu/test_cudaemu \
        dev/examples/train_loop_emu dev/examples/two_files_emu train_gpt_emu_prof test_gpt_fp16_emu train_gpt_fp16_emu_hooks \
        > /dev/null 2>&1
    if ! make -s -j"$jobs" train_gpt_cpu train_gpt_emu train_gpt_emu_hooks test_gpt_emu dev/cudaemu/test_cudaemu; then
        echo "FAIL the emulated CUDA build (make train_gpt_emu train_gpt_emu_hooks test_gpt_emu)"
        failed=$((failed + 1))
        return
    fi
    echo "tier 4 on the CUDA emulator (dev/cudaemu): the emulator's own tests (its build done at $SECONDS s)"
    run_tier dev/cudaemu/test_cudaemu
    # the CUDA engine's tests but the kernels', then the kernels' (tier4_*: one process, on one core) beside
    # the two emulated examples (each one process too)
    run_tier ./test_gpt_emu -tier4_
    local kernels_out kernels_pid kernels_rc two_files_out pid
    kernels_out=$(mktemp)
    ./test_gpt_emu tier4_ > "$kernels_out" 2>&1 &
    kernels_pid=$!
    if make -s -j"$jobs" dev/examples/train_loop_emu dev/examples/two_files_emu; then
        two_files_out=$(mktemp)
        dev/examples/two_files_emu 12 > "$two_files_out" 2>&1 &
        pid=$!
        example_trains "CUDA emulated, 12 steps" dev/examples/train_loop_emu 12
        wait $pid
        example_two_files "CUDA emulated, 12 steps" cat "$two_files_out"
        rm -f "$two_files_out"
    else
        echo "FAIL the library examples build under the emulator (make dev/examples/train_loop_emu two_files_emu)"
        failed=$((failed + 1))
    fi
    wait $kernels_pid
    kernels_rc=$?
    cat "$kernels_out"
    add_totals "$kernels_out" "$kernels_rc" "./test_gpt_emu tier4_"
    echo "     (the emulated examples and ./test_gpt_emu tier4_ done at $SECONDS s)"
    run_tier bash scripts/test_hf.sh ./train_gpt_emu  # a random transformers Llama on the CUDA engine
    # the fp16 build (make train_gpt_fp16's sources with LLMPAR_FP16): its kernels, steps and runs, on its engine
    # with the tests' hooks (train_gpt_fp16_emu without them differs by LLMPAR_TEST_HOOKS alone: not built twice)
    if make -s -j"$jobs" test_gpt_fp16_emu train_gpt_fp16_emu_hooks; then
        run_tier ./test_gpt_fp16_emu
    else
        echo "FAIL the emulated fp16 build (make test_gpt_fp16_emu train_gpt_fp16_emu_hooks)"
        failed=$((failed + 1))
    fi
    timed model_extrapolates
    timed sass_solves
    timed kernels_hazard_free
}

if [ "${1:-}" = emu ]; then
    emulated_tier
    echo "$passed passed, $failed failed"
    [ "$failed" = 0 ]
    exit
fi

has_gpu=0
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi > /dev/null 2>&1; then has_gpu=1; fi
# The builds all at once, side by side: the engines without MPI (below) in the background, each one compiler,
# and one make of the CUDA and the CPU engines (the CUDA one first: llmpar_cudnn.o, then train_gpt, is the
# longest chain), with -k, so it goes on past a failed build and make -q then says which failed
nompi=$(mktemp -d)
# without MPI each engine is a single-rank program; both must keep compiling (warnings are errors); the
# CPU one here also without a BLAS: its plain-loop matmuls
${CC:-cc} -x c -std=gnu11 -O1 -fopenmp -DLLMPAR_CPU -Wall -Wextra -Werror train_gpt.cu -o "$nompi/cpu" -lm > "$nompi/cpu.log" 2>&1 &
nompi_cpu=$!
cuda=()
if command -v nvcc > /dev/null 2>&1; then
    # with cuDNN's attention (llmpar_cudnn.cpp) where cudnn-frontend's headers are here (`make cudnn-frontend`,
    # which .ci/run does) and the toolkit has cuDNN: it compiles everywhere, and runs on a GPU only
    cudnn=0
    [ -f .cudnn-frontend/include/cudnn_frontend.h ] && [ -f "$(dirname "$(dirname "$(command -v nvcc)")")/include/cudnn.h" ] && cudnn=1
    echo "building the CUDA engine (train_gpt$([ $cudnn = 1 ] && echo " with cuDNN's attention"), test_gpt) ..."
    cuda=(USE_CUDNN=$cudnn train_gpt test_gpt)
    # the tests' build (train_gpt_hooks: tier 4's offload test) only where tier 4 runs on the GPU; without one
    # the CUDA code is only compiled, so each architecture once: sm_90 here, sm_80 by the build without MPI
    nompi_arch=sm_90
    if [ "$has_gpu" = 1 ]; then
        cuda+=(train_gpt_hooks)
    else
        cuda+=(CUDA_ARCH="-gencode arch=compute_90,code=sm_90")
        nompi_arch=sm_80
    fi
    # (in fp16, LLMPAR_FP16: so the fp16 engine keeps compiling warning-free too, in the same compile)
    nvcc -O1 -std=c++17 -arch=$nompi_arch -DLLMPAR_FP16 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Wno-missing-field-initializers,-Werror,-fopenmp \
        train_gpt.cu -o "$nompi/cuda" -lcublasLt -lcublas > "$nompi/cuda.log" 2>&1 &
    nompi_cuda=$!
else
    echo "skip: nvcc not found, the CUDA build is not checked"
fi
echo "building the CPU engine (train_gpt_cpu, its tests' build train_gpt_cpu_hooks, test_gpt_cpu) and the planner (plan_gpt) ..."
cpu=(train_gpt_cpu train_gpt_cpu_hooks test_gpt_cpu plan_gpt)
make -s -j"$jobs" -k "${cuda[@]}" "${cpu[@]}"
if ! make -q "${cpu[@]}"; then
    echo "FAIL the CPU build"
    wait
    rm -rf "$nompi"
    echo "$passed passed, $((failed + 1)) failed"
    exit 1
fi
if [ ${#cuda[@]} -gt 0 ] && ! make -q "${cuda[@]}"; then
    echo "FAIL the CUDA build"
    failed=$((failed + 1))
fi
if wait $nompi_cpu; then
    passed=$((passed + 1))
else
    cat "$nompi/cpu.log"
    echo "FAIL the CPU engine builds without MPI"
    failed=$((failed + 1))
fi
if [ ${#cuda[@]} -gt 0 ]; then
    if wait $nompi_cuda; then
        passed=$((passed + 1))
    else
        cat "$nompi/cuda.log"
        echo "FAIL the CUDA engine builds without MPI (in fp16)"
        failed=$((failed + 1))
    fi
fi
rm -rf "$nompi"

echo "     (the builds took $SECONDS s)"
run_tier ./test_gpt_cpu

# the GPU session's protocol (scripts/gpu_check.sh) as a dry run against stand-ins: its steps in order (Nsight
# Compute first after the build, then the timed steps beside llm.c's, the kernels, the hang-prone test last),
# each with its budget, the budgets summing to at most 480 s. One check.
dry=$(OUT=$(mktemp -d) bash scripts/gpu_check.sh --dry-run 2>&1)
order=$(grep '^## ' <<< "$dry" | sed 's/ (budget.*//' | tr '\n' '/')
total=$(sed -n 's/^budget: \([0-9]*\) s of 480$/\1/p' <<< "$dry")
if [ "$order" = "## machine/## build, for this GPU alone/## Nsight Compute over one step of 124M, flash (ncu_step.csv)/## GPT-2 124M, B=64, T=1024: flash/## GPT-2 124M, B=64, T=1024: cublas/## GPT-2 124M, B=64, T=1024: cudnn/## GPT-2 124M, B=64, T=1024: llm.c/## the kernels against their CPU loops (tier4_kernel_tests, tier4_attention_kernels)/## the hang-prone test alone/" ] &&
    [ -n "$total" ] && [ "$total" -le 480 ]; then
    echo "     the GPU protocol's dry run: 9 steps in order, $total s of budget (at most 480)"
    passed=$((passed + 1))
else
    echo "$dry"
    echo "FAIL the GPU protocol's dry run (scripts/gpu_check.sh --dry-run): its steps in order, a budget of at most 480 s"
    failed=$((failed + 1))
fi

# the planner's plans, byte for byte as stored (dev/plan/plans.txt; the same on every machine)
if bash dev/plan/check_plans.sh; then
    passed=$((passed + 1))
else
    failed=$((failed + 1))
fi

echo "     (the GPU protocol's dry run and the stored plans done at $SECONDS s)"
# the run scripts still run (two steps each, into a temporary directory)
smoke_dir=$(mktemp -d)
for run in "run_tiny.sh" "run_3d.sh cpu"; do
    if [ "$run" != run_tiny.sh ] && ! command -v mpirun > /dev/null 2>&1; then
        echo "skip: scripts/$run (mpirun not found)"
        continue
    fi
    if bash scripts/$run -x 2 -v 1 -s 0 -o "$smoke_dir/${run%% *}" < /dev/null 2>&1 | grep -q "^step 2/2 "; then
        passed=$((passed + 1))
    else
        echo "FAIL scripts/$run does not train two steps"
        failed=$((failed + 1))
    fi
done
rm -rf "$smoke_dir"
# the library's usage example: one process without mpirun, with MPI and without (plain cc); data-parallel
# under mpirun; under nvcc compiled (and run on a GPU). The emulated tier runs its CUDA build. Each run
# is followed by the same of the example from two files.
# The loop in the usage block at the top of llmpar.h (its indented lines) is the example's main, verbatim.
usage=$(sed -n '/^Use as a library/,/^\*\//p' llmpar.h | grep '^    ')
if [ -n "$usage" ] && [ "$usage" = "$(sed -n '/^int main/,/^}/p' dev/examples/train_loop.cu | grep -v '^    return 0;$' | grep '^    ')" ]; then
    passed=$((passed + 1))
else
    echo "FAIL the usage loop at the top of llmpar.h is dev/examples/train_loop.cu's main, verbatim"
    failed=$((failed + 1))
fi
if make -s -j"$jobs" dev/examples/train_loop_cpu dev/examples/train_loop_nompi dev/examples/two_files_cpu dev/examples/two_files_nompi; then
    example_trains "CPU, one process" dev/examples/train_loop_cpu 20
    one_process=$example_out
    example_two_files "CPU with LLMPAR_NO_WATCHDOG and LLMPAR_NO_REEXEC, one process" dev/examples/two_files_cpu 20
    example_trains "CPU without MPI" dev/examples/train_loop_nompi 20
    example_two_files "CPU without MPI" dev/examples/two_files_nompi 20
    if command -v mpicc > /dev/null 2>&1 && command -v mpirun > /dev/null 2>&1; then
        example_trains "CPU, a 2 x 2 x 2 grid: t=2 d=2 p=2" mpirun -np 8 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 \
            dev/examples/train_loop_cpu 20 2 2
        example_trains "CPU, t=2 p=2" mpirun -np 4 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 dev/examples/train_loop_cpu 20 2 2
        # the same batches as one process (d = 1): the same losses and norms, step for step, to 1e-3
        if paste <(grep '^step' <<< "$one_process") <(grep '^step' <<< "$example_out") | awk -F' [|] ' '
               { split($2, a, " "); split($3, b, " "); split($4, c, " "); split($5, e, " "); n++
                 if ((a[2] - c[2]) ^ 2 > 1e-6 || (b[2] - e[2]) ^ 2 > 1e-6) bad++ } END { exit !(n == 20 && !bad) }'; then
            echo "     the example on t=2 p=2: the one-process losses and norms, 20 steps"
            passed=$((passed + 1))
        else
            echo "FAIL the example on t=2 p=2 prints the one-process losses and norms (1e-3)"
            failed=$((failed + 1))
        fi
        example_two_files "CPU with the opt-outs, 2 ranks (each alone; rank 0 prints)" mpirun -np 2 --oversubscribe --bind-to none \
            -x OMP_NUM_THREADS=1 dev/examples/two_files_cpu 20
    fi
else
    echo "FAIL the library examples build (make dev/examples/train_loop_cpu train_loop_nompi two_files_cpu two_files_nompi)"
    failed=$((failed + 1))
fi
echo "     (the run scripts and the CPU examples done at $SECONDS s)"
timed example_needs_implementation
if command -v nvcc > /dev/null 2>&1; then
    arch=()  # without a GPU they are only compiled: one architecture checks that (a third of the time)
    [ "$has_gpu" = 1 ] || arch=(CUDA_ARCH="-gencode arch=compute_90,code=sm_90")
    if ! make -s -j"$jobs" dev/examples/train_loop dev/examples/two_files "${arch[@]}"; then
        echo "FAIL the library examples build with nvcc (make dev/examples/train_loop two_files)"
        failed=$((failed + 1))
    elif [ "$has_gpu" = 1 ]; then
        example_trains "CUDA" dev/examples/train_loop 20
        example_two_files "CUDA" dev/examples/two_files 20
    else
        passed=$((passed + 1))  # they compile; no GPU here to run them
    fi
fi
echo "     (the nvcc examples built at $SECONDS s)"
# the README's and dev/docs' relative links name files and headings that exist (dev/docs/check_links.py)
if python3 dev/docs/check_links.py; then
    passed=$((passed + 1))
else
    echo "FAIL a link of README.md or dev/docs/*.md names a missing file or heading"
    failed=$((failed + 1))
fi
# the user's data path: text -> shards (dev/data/prepare.py) -> two steps -> plot (skips without tiktoken)
run_tier bash scripts/test_data_path.sh
# Hugging Face GPT-2 both ways (dev/hf/export.py, import.py): logits, round trips, the tokenizer files, bad input
run_tier bash scripts/test_hf.sh
if [ "$has_gpu" = 1 ] && [ -x ./test_gpt ]; then
    run_tier ./test_gpt
    run_tier bash scripts/test_hf.sh ./train_gpt  # a random transformers Llama on the CUDA engine
elif command -v nvcc > /dev/null 2>&1; then
    emulated_tier
else
    echo "skip: tier 4 (no GPU here, and no CUDA toolkit headers for the emulator)"
fi
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
