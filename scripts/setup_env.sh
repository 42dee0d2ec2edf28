#!/usr/bin/env bash
# Create (once) and activate the project's virtual environment in .venv, with the
# pinned versions of constraints.txt. Source it: `. scripts/setup_env.sh`.
# The first time it says what it installs, step by step (a line every 30 s while pip works), and how
# long it took; afterwards it is silent, unless pyproject.toml or the pins changed since: then it says so and reinstalls nn_data
# and its extras into the same venv (seconds). NN_DATA_VENV overrides the location, NN_DATA_PYTHON the interpreter (python3) and
# NN_DATA_CONSTRAINTS the pins (constraints.txt): scripts/test_mcore019.sh sets all three.
# NN_DATA_SETUP_HEARTBEAT_S: seconds between the lines printed while pip works (30).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${NN_DATA_VENV:-$root/.venv}"
constraints="${NN_DATA_CONSTRAINTS:-$root/constraints.txt}"
# the venv is current while it was made from these two files: their digest is its stamp
setup_stamp="$(cat "$root/pyproject.toml" "$constraints" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$venv/.nn_data_ready" ] || [ "$(cat "$venv/.nn_data_ready")" != "$setup_stamp" ]; then
    setup_started=$SECONDS
    setup_say() { echo "setup_env: $*" >&2; }
    setup_pip() {  # quiet pip; the one line a machine's pip.conf may repeat per package (an absent
        # file:// index: "WARNING: Location 'file:///...' is ignored") is dropped, every other line kept;
        # pip says nothing for minutes, so a line every 30 s says it is still at work
        ( "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --progress-bar off "$@" 2>&1 \
            | { grep -v "^WARNING: Location 'file://.*' is ignored: it is neither a file nor a directory.$" || true; } >&2 ) &
        local setup_pid=$! setup_waited=0
        while kill -0 "$setup_pid" 2>/dev/null; do
            sleep 1
            setup_waited=$((setup_waited + 1))
            if [ $((setup_waited % ${NN_DATA_SETUP_HEARTBEAT_S:-30})) -eq 0 ]; then
                setup_say "    still installing, ${setup_waited} s so far"
            fi
        done
        wait "$setup_pid"
    }
    if [ -f "$venv/.nn_data_ready" ]; then
        setup_say "pyproject.toml or $(basename "$constraints") changed since ${venv#"$root"/} was made: updating it"
    else
        setup_say "first run: creating ${venv#"$root"/} with the pins of $(basename "$constraints")"
        setup_say "this takes 1-4 min for .venv, about 2-3 min and a 1.4 GB download for .venv-mcore019 (this project's 2-core machine, 2026-12-02: quiet, and .venv at load 1-6)"
        "${NN_DATA_PYTHON:-python3}" -m venv "$venv"
        setup_say "1/3 upgrading pip"
        setup_pip --upgrade pip
    fi
    # torch first and pinned: on Python 3.11 the CPU build on disk, not a CUDA build from the index.
    setup_say "2/3 installing torch==2.13.0 first, pinned (a loose requirement would pull the newest multi-GB CUDA build)"
    setup_pip -c "$constraints" torch==2.13.0
    setup_say "3/3 installing nn_data (editable) with its test and profile extras: megatron-core, transformers, pytest, tensorboard, ..."
    setup_pip -c "$constraints" -e "$root[test,profile]"
    echo "$setup_stamp" > "$venv/.nn_data_ready"
    setup_say "ready in $((SECONDS - setup_started)) s; later runs reuse it silently"
    unset -f setup_say setup_pip
    unset setup_started
fi
unset setup_stamp
# shellcheck disable=SC1091
. "$venv/bin/activate"
cd "$root"
