#!/usr/bin/env bash
# Run a command beside N busy processes, as on a shared, loaded machine (issue 54):
#
#   bash scripts/under_load.sh N COMMAND [ARGS...]
#
# N burners (a python3 busy loop each, one core's worth of pure CPU, NOT niced: they compete with the command as
# another user's jobs would) start first and are killed when the command ends, when it fails, and on Ctrl-C / TERM
# (a trap on EXIT INT TERM; bash runs it once its foreground command has returned); each burner also ends by itself
# the moment this script is gone (it spins on "is my parent still this script?"), so not even a `kill -9` of the
# script leaves one behind. The command's exit code is this script's. N = 0 runs the command alone.
# `bash scripts/test.sh --under-load N` runs the test command through it.
set -uo pipefail
if [ $# -lt 2 ] || ! [[ "$1" =~ ^[0-9]+$ ]]; then
    echo "usage: bash scripts/under_load.sh N COMMAND [ARGS...]   (N busy processes beside COMMAND)" >&2
    exit 2
fi
n=$1
shift
burners=()
stop_burners() {
    local pid
    for pid in "${burners[@]}"; do
        kill "$pid" 2>/dev/null
    done
    for pid in "${burners[@]}"; do
        wait "$pid" 2>/dev/null
    done
    burners=()
}
trap 'stop_burners' EXIT
trap 'stop_burners; exit 130' INT
trap 'stop_burners; exit 143' TERM
for _ in $(seq 1 "$n"); do
    python3 -c 'import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    pass' "$$" &
    burners+=($!)
done
echo "== under load: $n busy process(es) beside the command (pids ${burners[*]:-none}) ==" >&2
status=0
"$@" || status=$?
stop_burners
echo "== under load: the $n busy process(es) ended; the command exited $status ==" >&2
exit "$status"
