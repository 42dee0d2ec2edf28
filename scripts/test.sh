#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole suite on the CPU.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
python -m pytest -q "$@"
