#!/usr/bin/env bash
# Load this machine like a busy laptop: one busy process at normal priority per N cores
# (N is the first argument, default 1), until killed. Each is a shell spinning on one
# core, as a compiler or a browser tab would; it stops with this script (Ctrl-C, or
# `kill PID`). To run the default suite beside it (docs/testing.md):
#   bash scripts/busy.sh 2 & busy=$!; bash scripts/test.sh; kill $busy
set -euo pipefail
per=${1:-1}
if ! [[ $per =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 [N]  (one busy process per N cores; default 1)" >&2
    exit 2
fi
cores=$(getconf _NPROCESSORS_ONLN)
count=$((cores / per > 0 ? cores / per : 1))
pids=()
stop() {
    trap - EXIT INT TERM
    kill "${pids[@]}" 2>/dev/null || true
    exit 0
}
trap stop EXIT INT TERM
for _ in $(seq "$count"); do
    (trap - EXIT INT TERM; while :; do :; done) &
    pids+=("$!")
done
echo "busy.sh: $count busy process(es) on $cores cores (pid $$; stop with: kill $$)" >&2
wait
