#!/usr/bin/env bash
# Create (once) and activate the project's virtual environment in .venv, with the
# pinned versions of constraints.txt. Source it: `. scripts/setup_env.sh`.
# NN_DATA_VENV overrides the location.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${NN_DATA_VENV:-$root/.venv}"
if [ ! -f "$venv/.nn_data_ready" ]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # torch first and pinned: the CPU build on disk, not a CUDA build from the index.
    "$venv/bin/python" -m pip install --quiet -c "$root/constraints.txt" torch==2.13.0
    "$venv/bin/python" -m pip install --quiet -c "$root/constraints.txt" -e "$root[test,profile]"
    touch "$venv/.nn_data_ready"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
cd "$root"
