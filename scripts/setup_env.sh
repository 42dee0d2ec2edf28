#!/usr/bin/env bash
# Create (once) and activate the virtual environment of one CI job, with that job's pinned versions.
# Source it: `. scripts/setup_env.sh` (the main job's .venv), `NN_DATA_JOB=nemo-rl . scripts/setup_env.sh`.
# The jobs (docs/testing.md, "The CI jobs"): each names its Python, its venv and its constraints file.
#   main     Python 3.11  .venv          constraints.txt          torch 2.13.0 (the CPU build on this machine's disk)
#   nemo-rl  Python 3.13  .venv-nemo-rl  constraints-nemo-rl.txt  NeMo-RL's pins: torch 2.11.0, transformers 5.6.0
#   newest   Python 3.12  .venv-newest   constraints-newest.txt   the newest torch and transformers
# The newest job's pip reads its constraints file in place of the cap a machine's pip.conf may set
# (PIP_CONSTRAINT, for this script's pip alone): its torch is above that cap.
# The first time it says what it installs, step by step (a line every 30 s while pip works), and how
# long it took; afterwards it is silent, unless pyproject.toml or the pins changed since: then it says so and reinstalls nn_data
# and its extras into the same venv (seconds). NN_DATA_VENV overrides the location, NN_DATA_PYTHON the interpreter and
# NN_DATA_CONSTRAINTS the pins. NN_DATA_SETUP_HEARTBEAT_S: seconds between the lines printed while pip works (30).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${NN_DATA_JOB:-main}" in
    main) job_python=3.11 job_venv=.venv job_constraints=constraints.txt ;;
    nemo-rl) job_python=3.13 job_venv=.venv-nemo-rl job_constraints=constraints-nemo-rl.txt ;;
    newest) job_python=3.12 job_venv=.venv-newest job_constraints=constraints-newest.txt ;;
    *) echo "setup_env: NN_DATA_JOB=${NN_DATA_JOB}: no such job (main, nemo-rl, newest)" >&2; return 2 2>/dev/null || exit 2 ;;
esac
venv="${NN_DATA_VENV:-$root/$job_venv}"
constraints="${NN_DATA_CONSTRAINTS:-$root/$job_constraints}"
if [ "${NN_DATA_JOB:-main}" = newest ]; then
    export PIP_CONSTRAINT="$constraints"  # in place of a pip.conf's cap on torch (above), this shell's pip only
fi
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
        setup_say "this takes 1-4 min for .venv, about 2-4 min and a 1.4-2 GB download for the other jobs' (this project's 2-core machine, 2026-12: quiet, and .venv at load 1-6)"
        job_interpreter="${NN_DATA_PYTHON:-}"
        if [ -z "$job_interpreter" ]; then  # python3.X on PATH, else pyenv's: its shim answers "command
            # not found" while another version is pyenv's global one
            for candidate in "python$job_python" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$job_python".*/bin/python"$job_python"; do
                if "$candidate" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$job_python'.split('.')))" 2>/dev/null; then
                    job_interpreter="$candidate"; break
                fi
            done
        fi
        if [ -z "$job_interpreter" ]; then
            setup_say "no Python $job_python found for the ${NN_DATA_JOB:-main} job (set NN_DATA_PYTHON)"
            return 1 2>/dev/null || exit 1
        fi
        "$job_interpreter" -m venv "$venv"
        setup_say "1/3 upgrading pip"
        setup_pip --upgrade pip
    fi
    # torch first and pinned: on Python 3.11 the CPU build on disk, not a CUDA build from the index.
    torch_pin="$(grep '^torch==' "$constraints")"
    setup_say "2/3 installing $torch_pin first, pinned (a loose requirement would pull the newest multi-GB CUDA build)"
    setup_pip -c "$constraints" "$torch_pin"
    setup_say "3/3 installing nn_data (editable) with its test and profile extras: megatron-core, transformers, pytest, tensorboard, ..."
    setup_pip -c "$constraints" -e "$root[test,profile]"
    echo "$setup_stamp" > "$venv/.nn_data_ready"
    setup_say "ready in $((SECONDS - setup_started)) s; later runs reuse it silently"
    unset -f setup_say setup_pip
    unset setup_started torch_pin job_interpreter candidate
fi
unset setup_stamp job_python job_venv job_constraints
# shellcheck disable=SC1091
. "$venv/bin/activate"
cd "$root"
