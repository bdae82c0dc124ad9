#!/usr/bin/env bash
# The supervisor: run a training command and, when it fails (a rank killed, a node lost, an error),
# relaunch it with --resume from the newest complete checkpoint in its -o DIR. It gives up after MAX
# restarts, or when two launches in a row end without a new checkpoint (a failure a relaunch cannot fix:
# a bad flag, a run that keeps diverging). Each restart is logged on stderr and in DIR/restarts.log.
#   scripts/train_resilient.sh [-r MAX] COMMAND...          MAX restarts [3]
#   scripts/train_resilient.sh -r 10 mpirun -np 8 ./train_gpt -o runs/gpt2 -n 500 --ckpt-minutes 60
# A relaunch adds --resume once a checkpoint exists and drops --overwrite. Exits with the command's last
# status. Ctrl-C or a TERM stops the run and the supervisor, with no relaunch: the command is sent a USR1,
# on which train_gpt saves a checkpoint at the end of its step and exits (mpirun passes USR1 on to the
# ranks; a TERM it would answer by killing them).
set -u
max=3
if [ "${1:-}" = "-r" ]; then
    max=${2:-}
    shift 2 || true
fi
case "$max" in '' | *[!0-9]*) echo "train_resilient.sh: -r needs a number of restarts" >&2; exit 2 ;; esac
[ $# -gt 0 ] || { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
cmd=("$@")
dir=""
for ((i = 0; i + 1 < ${#cmd[@]}; i++)); do [ "${cmd[i]}" = "-o" ] && dir=${cmd[i + 1]}; done
[ -n "$dir" ] || { echo "train_resilient.sh: the command needs -o DIR, where its checkpoints go" >&2; exit 2; }

log() {
    echo "train_resilient.sh: $*" >&2
    mkdir -p "$dir" && echo "$(date '+%Y-%m-%d %H:%M:%S') $*" >> "$dir/restarts.log"
}
newest() { ls -d "$dir"/step_*[0-9] 2> /dev/null | sort | tail -n 1; }  # complete ones only: not step_N.tmp

stop=0
child=0
trap 'stop=1; [ "$child" -gt 0 ] && kill -USR1 "$child" 2> /dev/null' INT TERM
run() {  # the command in the background, so a signal reaches it; its exit status in $rc
    "$@" &
    child=$!
    wait "$child"
    rc=$?
    while kill -0 "$child" 2> /dev/null; do wait "$child"; rc=$?; done  # a trap interrupted the first wait
    child=0
}

restarts=0
stalled=0
before=$(newest)
run "${cmd[@]}"
while [ "$rc" -ne 0 ]; do
    [ "$stop" = 1 ] && { log "stopped by a signal (exit $rc); no relaunch"; exit "$rc"; }
    now=$(newest)
    if [ "$now" = "$before" ]; then stalled=$((stalled + 1)); else stalled=0; fi
    if [ "$stalled" -ge 2 ]; then
        log "exit $rc again with no new checkpoint since the last launch: giving up (see the run's last error)"
        exit "$rc"
    fi
    if [ "$restarts" -ge "$max" ]; then
        log "exit $rc after $max restart(s): giving up"
        exit "$rc"
    fi
    restarts=$((restarts + 1))
    before=$now
    next=()
    for a in "${cmd[@]}"; do [ "$a" = "--overwrite" ] || [ "$a" = "--resume" ] || next+=("$a"); done
    if [ -n "$now" ]; then
        next+=(--resume)
        log "exit $rc; restart $restarts of $max, resuming from $(basename "$now")"
    else
        log "exit $rc; restart $restarts of $max, from the start (no checkpoint yet)"
    fi
    run "${next[@]}"
done
[ "$restarts" -gt 0 ] && log "the run ended well after $restarts restart(s)"
exit 0
