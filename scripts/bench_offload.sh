#!/usr/bin/env bash
# What --offload nvme costs and saves on the CPU engine: ms/step, the optimizer step's share, and the
# peak RSS (/usr/bin/time -v) of the same run with the AdamW state in memory and in a file, for a new
# GPT-2 of depth MODEL (d8: 51M parameters, 390 MiB of m and v) at T=64 on one rank. The last line: the
# RSS saved as a share of the optimizer state (the issue's target: at least 80%).
# Usage: bash scripts/bench_offload.sh [MODEL] [B] [steps] [offload dir]
set -u
cd "$(dirname "$0")/.."
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
    extra=""
    [ "$mode" = nvme ] && extra="--offload nvme --offload-dir $dir"
    log=$(/usr/bin/time -v ./train_gpt_cpu -e "$model" -b "$B" -t 64 -x "$steps" -v 0 -s 0 -j '' $extra 2>&1)
    line=$(echo "$log" | grep "^mean of steps")
    if [ -z "$line" ]; then
        echo "| $mode | $model | $B | 64 | $(echo "$log" | grep -m1 error || echo failed) | | | |"
        continue
    fi
    ms=$(echo "$line" | awk '{ print $7 }')
    up=$(echo "$line" | awk '{ print $11 }')
    adamw=$(echo "$log" | sed -n 's/.*, AdamW \([0-9.]*\) MiB,.*/\1/p')
    rss[$mode]=$(echo "$log" | awk '/Maximum resident set size/ { printf "%.0f", $6 / 1024 }')
    [ "$mode" = none ] && state=$adamw
    echo "| $mode | $model | $B | 64 | $ms | $up | $adamw | ${rss[$mode]} |"
done
echo "$(echo "$log" | grep -m1 '^offload ' | sed 's/  */ /g')"
[ -n "${rss[none]:-}" ] && [ -n "${rss[nvme]:-}" ] &&
    awk -v a="${rss[none]}" -v b="${rss[nvme]}" -v s="$state" 'BEGIN { printf "RSS saved: %d MiB, %.0f%% of the %.0f MiB optimizer state\n", a - b, 100 * (a - b) / s, s }'
[ -z "${4:-}" ] && rmdir "$dir"
