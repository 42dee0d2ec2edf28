#!/usr/bin/env bash
# The README's main job: set up .venv if needed, then profile nn_data on a stream of constant-length
# (PP > 1) packed microbatches: eager vs torch.compile vs the NeMo-RL-style loop, with the default
# sizes (20 s quiet to 2 min under load on a 2-core CPU, most of it the first compile, which it announces). Prints the table and
# each target met or MISSED (exit status 0 either way: docs/testing.md); traces, summary.json and chart.png go
# to profiling/runs/<timestamp>/. Extra arguments go to the profiler, e.g.
#   bash scripts/profile.sh --threads 2 --cp-size 4
#   bash scripts/profile.sh --help
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
python -m profiling.microbatches "$@"
