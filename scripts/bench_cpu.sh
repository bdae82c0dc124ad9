#!/usr/bin/env bash
# CPU engine speed: ms/step, tok/s and achieved GFLOP/s of ./train_gpt_cpu for a depth-4 GPT-2 and GPT-2
# 124M at B=4, T=64 and 256, set against the fp32 sgemm rate OpenBLAS reaches here (dev/bench_sgemm.c).
# Given an llm.c checkout, also runs its CPU trainer (train_gpt2.c, built in a temporary copy, the checkout
# left untouched) on the same random 124M model file and data, at B=4 T=64, alternating with llmpar.
# Each configuration runs RUNS times, the configurations alternating, and the median is reported.
# Usage: [THREADS=2] [RUNS=3] [STEPS=4] bash scripts/bench_cpu.sh [/path/to/llm.c]
set -u
llmc=${1:-}
if [ -n "$llmc" ]; then
    llmc=$(cd "$llmc" && pwd) || exit 1   # absolute, before the cd below
    [ -f "$llmc/train_gpt2.c" ] || { echo "no train_gpt2.c in $llmc"; exit 1; }
fi
cd "$(dirname "$0")/.."
threads=${THREADS:-2}
runs=${RUNS:-3}
steps=${STEPS:-4}   # per run; the first (allocation, cold caches) is left out of the mean
[ "$steps" -ge 2 ] || { echo "STEPS must be at least 2"; exit 1; }
export OMP_NUM_THREADS=$threads
load=$(cut -d' ' -f1 /proc/loadavg)   # others' work on the machine skews every number below
make -s train_gpt_cpu || exit 1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT   # it holds a 1.5 GB checkpoint with llm.c
trap 'exit 130' INT TERM

# the yardstick: OpenBLAS sgemm at 2048^3 on the same threads and the kernels the engine runs
rates=$(bash scripts/cpu_rates.sh)
engine=$(echo "$rates" | sed -n 's/^engine //p')
kernels=$(echo "$rates" | awk '$1 == "kernels" && $2 != "n/a" { print $2 }')
sgemm=$(echo "$rates" | awk '$1 == "sgemm" { print $2 }')

# configurations: engine model B T; llm.c right after llmpar's d12 T=64, so that the two form a pair
configs=("llmpar d4 4 64" "llmpar d4 4 256" "llmpar d12 4 64" "llmpar d12 4 256")
model12=d12
if [ -n "$llmc" ]; then
    # one random 124M model file (llm.c v3 fp32) for both engines
    ./train_gpt_cpu -e d12 -x 0 -v 0 -s 0 -j "" -o "$work/m" > "$work/m.log" 2>&1 \
        || { echo "writing the 124M model failed: $(tail -n 1 "$work/m.log")"; exit 1; }
    model12=$work/m/step_00000000/model.bin
    # llm.c's main() hardcodes 40+1 steps, val loss every 10 and samples every 20: patch a copy to run
    # $steps steps and nothing else; its model, data and tokenizer paths are met with links in its cwd
    mkdir -p "$work/llmc/dev/data"
    cp -r "$llmc/train_gpt2.c" "$llmc/llmc" "$work/llmc/"
    sed -i -e "s/step <= 40;/step < $steps;/" -e 's/if (step % 10 == 0) {/if (0) {/' \
        -e 's/if (step > 0 \&\& step % 20 == 0) {/if (0) {/' "$work/llmc/train_gpt2.c"
    [ "$(grep -c -e "step < $steps;" -e 'if (0) {' "$work/llmc/train_gpt2.c")" = 3 ] \
        || { echo "llm.c's main() is not the one this script patches (steps, val, samples)"; exit 1; }
    # llm.c's own Makefile flags for the CPU build (-Ofast, OpenMP)
    (cd "$work/llmc" && cc -Ofast -march=native -fopenmp -DOMP -Wno-unused-result -I. train_gpt2.c -lm -o train_gpt2) \
        || { echo "building llm.c's train_gpt2.c failed"; exit 1; }
    ln -s "$model12" "$work/llmc/gpt2_124M.bin"
    ln -s "$PWD/dev/data/tinyshakespeare" "$work/llmc/dev/data/tinyshakespeare"
    ln -s "$PWD/gpt2_tokenizer.bin" "$work/llmc/gpt2_tokenizer.bin"
    configs=("llmpar d4 4 64" "llmpar d4 4 256" "llmpar d12 4 64" "llm.c d12 4 64" "llmpar d12 4 256")
fi

run() {  # run ENGINE MODEL B T: prints "ms/step params L C peak-RSS-MiB", or nothing (and why, on stderr) if it failed
    local engine=$1 model=$2 B=$3 T=$4 log out
    if [ "$engine" = llm.c ]; then
        # its peak RSS from GNU time when installed (llmpar prints its own)
        log=$(cd "$work/llmc" && if [ -x /usr/bin/time ]; then /usr/bin/time -f "peak RSS %M KiB" ./train_gpt2 2>&1; else ./train_gpt2 2>&1; fi)
        # "step N: train loss L (took X ms)"; all steps but the first, like llmpar's mean
        out=$(echo "$log" | awk '/^num_parameters:/ { N = $2 } /^num_layers:/ { L = $2 } /^channels:/ { C = $2 }
            /^peak RSS/ { rss = $3 / 1024 } /^step [0-9]+: train loss/ && $2 != "0:" { s += $7; n++ }
            END { if (n) printf "%.1f %s %s %s %s\n", s / n, N, L, C, rss ? sprintf("%.0f", rss) : "n/a" }')
    else
        [ "$model" = d12 ] && model=$model12
        log=$(./train_gpt_cpu -e "$model" -b "$B" -t "$T" -x "$steps" -v 0 -s 0 -j "" 2>&1)
        # "model  L=.. C=.. ..., N parameters (...)" and "mean of steps after the first: X ms/step, ..."
        out=$(echo "$log" | awk '/^model / { for (k = 1; k < NF; k++) { if ($k ~ /^L=/) L = substr($k, 3)
                                                                if ($k ~ /^C=/) C = substr($k, 3)
                                                                if ($(k + 1) == "parameters") N = $k } }
            /^mean of steps after the first/ { ms = $7 } /^peak host memory/ { rss = $(NF - 1) }
            END { if (ms != "") print ms, N, L, C, rss }')
    fi
    if [ -n "$out" ]; then echo "$out"; else echo "$engine $model B=$B T=$T failed: $(echo "$log" | tail -n 1)" >&2; fi
}
median() { sort -g | awk '{ a[NR] = $1 } END { if (NR) print NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

touch "$work/results"   # lines: config-index run ms/step params L C peak-RSS-MiB
for r in $(seq 1 "$runs"); do
    for i in "${!configs[@]}"; do
        out=$(run ${configs[$i]})
        [ -n "$out" ] && echo "$i $r $out" >> "$work/results"
    done
done

echo "date: $(date '+%Y-%m-%d %H:%M') (llmpar $(git rev-parse --short HEAD 2> /dev/null)$(git diff --quiet HEAD 2> /dev/null || echo ', uncommitted changes'))"
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) cores; load average before the runs: $load"
echo "threads: $threads, runs: $runs (median), steps per run: $steps (mean of all but the first)"
echo "engine: $engine"
echo "sgemm 2048^3 fp32 (OpenBLAS${kernels:+, its $kernels kernels}): $sgemm GFLOP/s"
echo
echo "| engine | model | B | T | ms/step | tok/s | GFLOP/s | % of sgemm | peak RSS MiB |"
echo "|---|---|---|---|---|---|---|---|---|"
for i in "${!configs[@]}"; do
    set -- ${configs[$i]}
    ms=$(awk -v i="$i" '$1 == i { print $3 }' "$work/results" | median)
    if [ -z "$ms" ]; then echo "| $1 | $2 | $3 | $4 | failed | | | | |"; continue; fi
    # model FLOPs per step = 6*N*B*T (the matmuls, forward and backward; N parameters, the tied LM head counted
    # once) + 6*L*C*B*T^2 (attention scores and weighted sum: 4*T*C per token and layer forward, x3 with
    # backward, halved for the causal mask)
    awk -v i="$i" -v e="$1" -v m="$2" -v B="$3" -v T="$4" -v ms="$ms" -v sg="$sgemm" '$1 == i { N = $4; L = $5; C = $6; rss = $7; exit }
        END { gf = (6 * N * B * T + 6 * L * C * B * T * T) / (ms / 1000) / 1e9
              pct = sg == "n/a" ? "n/a" : sprintf("%.1f%%", 100 * gf / sg)
              printf "| %s | %s | %s | %s | %.1f | %.0f | %.1f | %s | %s |\n", e, m, B, T, ms, B * T * 1000 / ms, gf, pct, rss }' "$work/results"
done
if [ -n "$llmc" ]; then
    # pairs: llm.c's run r (config 3) over llmpar's d12 T=64 run r (config 2), the run just before it
    ratio=$(awk '$1 == 2 { p[$2] = $3 } $1 == 3 { c[$2] = $3 } END { for (r in c) if (r in p) print c[r] / p[r] }' \
        "$work/results" | median)
    n=$(awk '$1 == 2 { p[$2] = 1 } $1 == 3 && ($2 in p) { n++ } END { print n + 0 }' "$work/results")
    echo
    [ -n "$ratio" ] && ratio=$(printf "%.2f" "$ratio")
    echo "ratio llm.c/llmpar ms/step, 124M B=4 T=64, median of $n alternating pairs: ${ratio:-n/a} (above 1: llmpar faster)"
fi
