#!/usr/bin/env bash
# The second CI job: the megatron-core-facing tests on megatron-core 0.19.2 and Python 3.12.
# Creates .venv-mcore019 once (pins: constraints-mcore019.txt; the first run downloads about
# 1.4 GB, torch's CUDA build, which runs on the CPU), then runs pytest on tests/megatron_data,
# tests/models and tests/multiprocess. Arguments go to pytest; a test path among them replaces those three.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

python312() {  # a working Python 3.12: $NN_DATA_PYTHON, python3.12, or pyenv's 3.12 (whose shim
    local candidate  # answers "command not found" while another version is pyenv's global one)
    local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
    for candidate in "${NN_DATA_PYTHON:-}" python3.12 "$pyenv_root"/versions/3.12*/bin/python3.12; do
        if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$candidate"; return
        fi
    done
    echo "test_mcore019: no Python 3.12 found (set NN_DATA_PYTHON)" >&2
    return 1
}

NN_DATA_PYTHON="$(python312)"
export NN_DATA_PYTHON NN_DATA_VENV="${NN_DATA_MCORE019_VENV:-$root/.venv-mcore019}"
export NN_DATA_CONSTRAINTS="$root/constraints-mcore019.txt"
# shellcheck disable=SC1091
. "$root/scripts/setup_env.sh"
paths=1  # the default test paths, unless an argument names a test path (tests/models, a::node id)
for arg in "$@"; do
    case "$arg" in -*) ;; *) if [ -e "${arg%%::*}" ]; then paths=0; fi ;; esac
done
if [ "$paths" -eq 1 ]; then
    set -- "$@" tests/megatron_data tests/models tests/multiprocess
fi
python -m pytest -q "$@"
