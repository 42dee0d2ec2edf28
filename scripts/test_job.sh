#!/usr/bin/env bash
# One CI job: set up its venv if needed (scripts/setup_env.sh, which names each job's Python, venv and
# pins), then run its tests on the CPU. `bash scripts/test_job.sh JOB [pytest arguments]`:
#   main     the whole suite                                  (Python 3.11, torch 2.13.0, transformers 5.24.0)
#   nemo-rl  the whole suite on NeMo-RL's pins                (Python 3.13, torch 2.11.0, transformers 5.6.0)
#   newest   the single-process tiers: tests/ops, tests/models, tests/automodel, tests/megatron_data,
#            tests/planning                                   (Python 3.12, torch 2.15.0, transformers 5.25.0)
# Arguments go to pytest; a test path among them replaces the job's own (`bash scripts/test_job.sh nemo-rl
# tests/models -x`). The job's time is printed at the end.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
job="${1:?usage: bash scripts/test_job.sh main|nemo-rl|newest [pytest arguments]}"
shift
case "$job" in
    main | nemo-rl) job_paths=(tests) job_marks=() ;;
    newest) job_paths=(tests/ops tests/models tests/automodel tests/megatron_data tests/planning)
        job_marks=(-m "not multiprocess") ;;
    *) echo "test_job: $job: no such job (main, nemo-rl, newest)" >&2; exit 2 ;;
esac
started=$SECONDS
export NN_DATA_JOB="$job"
# shellcheck disable=SC1091
. "$root/scripts/setup_env.sh"
for arg in "$@"; do  # a test path among the arguments (tests/models, a::node id) replaces the job's
    case "$arg" in -*) ;; *) if [ -e "${arg%%::*}" ]; then job_paths=() job_marks=(); fi ;; esac
done
echo "test_job: $job: $(cd "$root" && python -m scripts.stack)"
status=0
python -m pytest -q "${job_marks[@]}" "$@" "${job_paths[@]}" || status=$?
echo "test_job: $job took $((SECONDS - started)) s (set-up included; exit status $status)"
exit "$status"
