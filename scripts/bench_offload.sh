#!/usr/bin/env bash
# What offload costs and saves.
# The CPU engine (default): --offload nvme's ms/step, the optimizer step's share, and the peak RSS
# (/usr/bin/time -v) of the same run with the AdamW state in memory and in a file, for a new GPT-2 of
# depth MODEL (d8: 51M parameters, 390 MiB of m and v) at T=64 on one rank. The last line: the RSS
# saved as a share of the optimizer state (the issue's target: at least 80%).
# emu: the CUDA engine under the emulator with the optimizer state on the GPU, in pinned host memory
# (--offload optimizer) and in a file (--offload nvme): the GPU memory it frees, the host update's time
# measured here (real CPU work; the copies are the emulator's memcpy), and a MODEL of the update on a
# GPU machine for GPT-2 124M: the copies over PCIe 5 x16 (55 GB/s each way) beside the CPU's AdamW at
# the rate measured here, serial against overlapped as the chunked update runs them.
# Usage: bash scripts/bench_offload.sh [MODEL] [B] [steps] [offload dir]
#        bash scripts/bench_offload.sh emu [MODEL] [B] [steps]
set -u
cd "$(dirname "$0")/.."
# One run of the engine (the command in "$@") with --offload MODE: sets log, ms (ms/step) and up (the
# optimizer step's ms), or prints the table's failure row and returns 1.
run_mode() {
    local mode=$1 line
    shift
    local extra="--offload $mode"
    [ "$mode" = nvme ] && extra="$extra --offload-dir $dir"
    log=$("$@" -e "$model" -b "$B" -t 64 -x "$steps" -v 0 -s 0 -j '' $extra 2>&1)
    line=$(echo "$log" | grep "^mean of steps")
    if [ -z "$line" ]; then
        echo "| $mode | $model | $B | 64 | $(echo "$log" | grep -m1 error || echo failed) | | | |"
        return 1
    fi
    ms=$(echo "$line" | awk '{ print $7 }')
    up=$(echo "$line" | awk '{ print $11 }')
}
if [ "${1:-}" = emu ]; then
    model=${2:-d4}
    B=${3:-2}
    steps=${4:-4}
    dir=$(mktemp -d "${TMPDIR:-/tmp}/llmpar_offload.XXXXXX")
    trap 'rm -rf "$dir"' EXIT
    make -s train_gpt_emu || exit 1
    echo "CUDA engine under the emulator: ms/step are the emulator's, not a GPU's"
    echo "| offload | model | B | T | emulated ms/step | optimizer step ms | GPU master+AdamW MiB | on the host MiB |"
    echo "|---|---|---|---|---|---|---|---|"
    rate=""
    for mode in none optimizer nvme; do
        run_mode "$mode" ./train_gpt_emu || continue
        gpu=$(echo "$log" | sed -n 's/.*master+AdamW \([0-9.]*\) MiB,.*/\1/p')
        host=$(echo "$log" | sed -n 's/^offload .*(\([0-9.]*\) MiB on rank 0).*/\1/p')
        params=$(echo "$log" | sed -n 's/^model .*(\([0-9]*\) on rank 0).*/\1/p')
        [ "$mode" = optimizer ] && rate=$(awk -v p="$params" -v ms="$up" 'BEGIN { printf "%.0f", p / (ms / 1e3) }')
        echo "| $mode | $model | $B | 64 | $ms | $up | $gpu | ${host:-0} |"
    done
    [ -n "$rate" ] || exit 1
    echo
    echo "MODELLED, not measured: the update of GPT-2 124M's 124.4M parameters on one GPU with --offload optimizer,"
    echo "the copies at 55 GB/s each way (2 bytes of gradient down, 2 of weight up per parameter), in chunks of 1M"
    echo "values, the CPU's AdamW at the rate measured above ($rate parameters/s on this machine's $(nproc) cores; the"
    echo "optimizer step also holds the emulator's slow gradient-norm kernels, so the rate is a lower bound) and"
    echo "at --plan's assumed 50 GB/s of host memory per GPU (28 bytes read and written per parameter):"
    echo "| host | copies down ms | CPU AdamW ms | copies up ms | serial ms | overlapped ms (chunked) |"
    echo "|---|---|---|---|---|---|"
    for host in "this machine" "50 GB/s per GPU"; do
        r=$rate
        [ "$host" = "this machine" ] || r=$(awk 'BEGIN { printf "%.0f", 50e9 / 28 }')
        awk -v r="$r" -v host="$host" 'BEGIN {
            n = 124.4e6; chunks = 119; down = 2 * n / 55e9 * 1e3; up = down; cpu = n / r * 1e3
            serial = down + cpu + up
            slow = down > cpu ? down : cpu; slow = slow > up ? slow : up
            overlapped = slow + (down + up) / chunks   # the first chunk comes down and the last goes up alone
            printf "| %s | %.1f | %.1f | %.1f | %.1f | %.1f |\n", host, down, cpu, up, serial, overlapped }'
    done
    exit 0
fi
model=${1:-d8}
B=${2:-2}
steps=${3:-6}
dir=${4:-$(mktemp -d "${TMPDIR:-/tmp}/llmpar_offload.XXXXXX")}
if [ ! -x /usr/bin/time ]; then  # GNU time, for -v's peak RSS (Debian's time package, as .ci/run installs)
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq time > /dev/null ||
        { echo "bench_offload.sh: needs /usr/bin/time (Debian: apt-get install time)"; exit 1; }
fi
make -s train_gpt_cpu || exit 1
echo "| offload | model | B | T | ms/step | optimizer step ms | AdamW in memory MiB | peak RSS MiB |"
echo "|---|---|---|---|---|---|---|---|"
declare -A rss
state=""
for mode in none nvme; do
    run_mode "$mode" /usr/bin/time -v ./train_gpt_cpu || continue
    adamw=$(echo "$log" | sed -n 's/.*, AdamW \([0-9.]*\) MiB,.*/\1/p')
    rss[$mode]=$(echo "$log" | awk '/Maximum resident set size/ { printf "%.0f", $6 / 1024 }')
    [ "$mode" = none ] && state=$adamw
    echo "| $mode | $model | $B | 64 | $ms | $up | $adamw | ${rss[$mode]} |"
done
echo "$(echo "$log" | grep -m1 '^offload ' | sed 's/  */ /g')"
[ -n "${rss[none]:-}" ] && [ -n "${rss[nvme]:-}" ] &&
    awk -v a="${rss[none]}" -v b="${rss[nvme]}" -v s="$state" 'BEGIN { printf "RSS saved: %d MiB, %.0f%% of the %.0f MiB optimizer state\n", a - b, 100 * (a - b) / s, s }'
[ -z "${4:-}" ] && rmdir "$dir"
