#!/usr/bin/env bash
# `make test`: tiers 1-3 on the CPU build (./test_gpt_cpu), two steps of each CPU run script, the data path
# (scripts/test_data_path.sh: prepare.py's shards train, plot.py draws them), then tier 4:
# on the CUDA build (./test_gpt) when a GPU is present, else on the CUDA emulator (./test_gpt_emu, after
# the emulator's own tests). With nvcc but no GPU, both CUDA binaries are still built, so the CUDA code
# keeps compiling warning-free and tier 1 checks ./train_gpt's "no GPU" error.
# `run_tests.sh emu` (make test-emu): the emulated tier alone. Prints the totals last.
set -u
cd "$(dirname "$0")/.."
passed=0
failed=0
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # mpirun refuses root unless told

run_tier() {  # run a test binary, echo its output, add its closing "N passed, N failed" to the totals
    local log
    log=$(mktemp)
    "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    local line
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$log" | tail -n 1)
    rm -f "$log"
    if [ -z "$line" ]; then
        echo "FAIL $* ended without a summary (exit $rc)"
        failed=$((failed + 1))
        return
    fi
    passed=$((passed + ${line%% passed*}))
    local f=${line#*passed, }
    failed=$((failed + ${f%% failed*}))
}

# tier 4 on the CUDA emulator: the emulator's own tests, then the CUDA engine's
emulated_tier() {
    if ! make -s train_gpt_cpu train_gpt_emu test_gpt_emu dev/cudaemu/test_cudaemu; then
        echo "FAIL the emulated CUDA build (make train_gpt_emu test_gpt_emu)"
        failed=$((failed + 1))
        return
    fi
    echo "tier 4 on the CUDA emulator (dev/cudaemu): the emulator's own tests"
    run_tier dev/cudaemu/test_cudaemu
    run_tier ./test_gpt_emu
}

if [ "${1:-}" = emu ]; then
    emulated_tier
    echo "$passed passed, $failed failed"
    [ "$failed" = 0 ]
    exit
fi

has_gpu=0
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi > /dev/null 2>&1; then has_gpu=1; fi
if command -v nvcc > /dev/null 2>&1; then
    echo "building the CUDA engine (train_gpt, test_gpt) ..."
    if ! make -s train_gpt test_gpt; then
        echo "FAIL the CUDA build"
        failed=$((failed + 1))
    fi
else
    echo "skip: nvcc not found, the CUDA build is not checked"
fi

# without MPI each engine is a single-rank program; both must keep compiling (warnings are errors); the
# CPU one here also without a BLAS: its plain-loop matmuls
if ${CC:-cc} -x c -std=gnu11 -O1 -fopenmp -DLLMPAR_CPU -Wall -Wextra -Werror train_gpt.cu -o /tmp/llmpar_nompi_$$ -lm; then
    passed=$((passed + 1))
else
    echo "FAIL the CPU engine builds without MPI"
    failed=$((failed + 1))
fi
if command -v nvcc > /dev/null 2>&1; then
    if nvcc -O1 -std=c++17 -arch=sm_90 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror,-fopenmp train_gpt.cu \
        -o /tmp/llmpar_nompi_$$ -lcublasLt -lcublas; then
        passed=$((passed + 1))
    else
        echo "FAIL the CUDA engine builds without MPI"
        failed=$((failed + 1))
    fi
fi
rm -f /tmp/llmpar_nompi_$$

run_tier ./test_gpt_cpu

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
# the user's data path: text -> shards (dev/data/prepare.py) -> two steps -> plot (skips without tiktoken)
run_tier bash scripts/test_data_path.sh
if [ "$has_gpu" = 1 ] && [ -x ./test_gpt ]; then
    run_tier ./test_gpt
elif command -v nvcc > /dev/null 2>&1; then
    emulated_tier
else
    echo "skip: tier 4 (no GPU here, and no CUDA toolkit headers for the emulator)"
fi
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
