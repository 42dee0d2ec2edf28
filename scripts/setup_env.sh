#!/usr/bin/env bash
# Create (once) and activate the project's virtual environment in .venv, with the
# pinned versions of constraints.txt. Source it: `. scripts/setup_env.sh`.
# NN_DATA_VENV overrides the location, NN_DATA_PYTHON the interpreter (python3) and
# NN_DATA_CONSTRAINTS the pins (constraints.txt): scripts/test_mcore019.sh sets all three.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${NN_DATA_VENV:-$root/.venv}"
constraints="${NN_DATA_CONSTRAINTS:-$root/constraints.txt}"
if [ ! -f "$venv/.nn_data_ready" ]; then
    "${NN_DATA_PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # torch first and pinned: on Python 3.11 the CPU build on disk, not a CUDA build from the index.
    "$venv/bin/python" -m pip install --quiet -c "$constraints" torch==2.13.0
    "$venv/bin/python" -m pip install --quiet -c "$constraints" -e "$root[test,profile]"
    touch "$venv/.nn_data_ready"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
cd "$root"
