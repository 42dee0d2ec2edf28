#!/usr/bin/env bash
# Open profiler traces in TensorBoard with the torch-tb-profiler plugin, on 127.0.0.1 only.
#   bash scripts/tensorboard.sh                  # the newest run under profiling/runs/
#   bash scripts/tensorboard.sh RUN_DIR [PORT]   # a given run folder (default port 6006, or $PORT)
# Each mode's trace folder (eager, compiled, loop, ...) is one run in the PYTORCH_PROFILER tab.
set -euo pipefail
run=""
if [ $# -ge 1 ]; then
    [ -d "$1" ] || { echo "RUN_DIR=$1 is not a folder; pass a run folder (profiling/runs/<timestamp>)" >&2; exit 2; }
    run="$(cd "$1" && pwd)"  # absolute: setup_env.sh changes to the repository root
fi
port="${2:-${PORT:-6006}}"
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
if [ -z "$run" ]; then
    run="$(ls -1d profiling/runs/*/ 2>/dev/null | sort | tail -n 1)"
    [ -n "$run" ] || { echo "no run under profiling/runs/: run bash scripts/profile.sh first" >&2; exit 1; }
    run="${run%/}"
fi
echo "TensorBoard: http://127.0.0.1:$port/#pytorch_profiler  (run folder: $run; Ctrl-C stops it)"
exec tensorboard --logdir "$run" --host 127.0.0.1 --port "$port"
