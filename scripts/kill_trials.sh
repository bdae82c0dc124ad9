#!/usr/bin/env bash
# Kill trials: start a CPU-engine run that checkpoints every step under the supervisor
# (scripts/train_resilient.sh), kill -9 one of its ranks at a random moment (often inside a save), let the
# supervisor relaunch it with --resume, and compare its final model.bin with an uninterrupted run's, byte
# for byte. Prints a table and the totals.
#   bash scripts/kill_trials.sh [TRIALS=10] [RANKS=1]     # RANKS 4: d=4 ZeRO-1 under mpirun
set -u
cd "$(dirname "$0")/.."
trials=${1:-10}
ranks=${2:-1}
make -s train_gpt_cpu || exit 1
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
steps=12
args="-e d2 -b 4 -t 64 -x $steps -n 1 -v 0 -s 0 -l 1e-3 -u 2"
[ "$ranks" -gt 1 ] && args="$args --zero 1"
launch() {  # launch DIR: the run under the supervisor, in the background; its pid in $run_pid
    local dir=$1
    if [ "$ranks" = 1 ]; then
        OMP_NUM_THREADS=1 scripts/train_resilient.sh ./train_gpt_cpu $args -o "$dir" > "$dir.log" 2>&1 &
    else
        scripts/train_resilient.sh mpirun -np "$ranks" --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 ./train_gpt_cpu $args \
            -o "$dir" > "$dir.log" 2>&1 &
    fi
    run_pid=$!
}
work=$(mktemp -d)
launch "$work/ref"
wait "$run_pid" || { echo "the uninterrupted run failed: $(tail -n 1 "$work/ref.log")"; exit 1; }
ref=$(printf "%s/ref/step_%08d/model.bin" "$work" "$steps")
start=$(date +%s.%N)
launch "$work/timing"
wait "$run_pid"
run_s=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
echo "uninterrupted: $steps steps in ${run_s} s ($ranks rank(s)); killing each trial at a random moment in it"
printf "%-6s %-10s %-12s %-9s %s\n" trial "killed at" "restarts" "resumed" "final model.bin"
same=0
for t in $(seq 1 "$trials"); do
    dir="$work/t$t"
    kill_at=$(awk -v s="$RANDOM" -v r="$run_s" 'BEGIN { srand(s); printf "%.2f", 0.1 + rand() * r * 0.9 }')
    launch "$dir"
    sleep "$kill_at"
    victim=$(pgrep -f "^\./train_gpt_cpu .* -o $dir\$" | shuf -n 1)  # a rank, not mpirun
    [ -n "$victim" ] && kill -9 "$victim"
    wait "$run_pid"
    restarts=$(grep -c "; restart " "$dir/restarts.log" 2> /dev/null)
    from=$(grep -o 'resumed from [^ ]*' "$dir.log" | sed 's|.*/step_0*||')
    final=$(printf "%s/step_%08d/model.bin" "$dir" "$steps")
    if cmp -s "$final" "$ref"; then verdict=identical; same=$((same + 1)); else verdict=DIFFERS; fi
    printf "%-6s %-10s %-12s %-9s %s\n" "$t" "${kill_at} s" "${restarts:-0}" "${from:-start}" "$verdict"
done
echo "$same of $trials trials ended with the uninterrupted run's model.bin, byte for byte"
rm -rf "$work"
[ "$same" = "$trials" ]
