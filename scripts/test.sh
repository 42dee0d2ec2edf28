#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole suite on the CPU (the main CI job).
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/test_job.sh" main "$@"
