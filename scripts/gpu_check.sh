#!/usr/bin/env bash
# The GPU proof: the CUDA test tier, the op benchmark, the profiler's main job and the CUDA-graph
# benchmark on one CUDA GPU,
# a PASS/FAIL line per check; every figure in profiling/gpu_runs/<timestamp>/ (profiling/README.md,
# "The GPU check"; recorded figures: profiling/results/gpu.md). Flags go to
# `python -m profiling.gpu_check` (--help lists them).
#   bash scripts/gpu_check.sh                    # GPU machine: its own python3 (or $PYTHON), no venv
#   bash scripts/gpu_check.sh --export "$OUT"    # ... and copy results.json, summary.txt, gpu_run.tar.gz
#   bash scripts/gpu_check.sh --dry-run          # CPU, tiny sizes, in the project venv (CI runs this)
# On the GPU machine the wheels that scripts/gpu_wheels.sh put in .gpu_wheels/ (megatron-core,
# torch-tb-profiler) are installed with pip --no-index --no-deps --target into a folder on
# PYTHONPATH: never a venv, never torch. Without them the steps needing them say "skipped: ...".
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for arg in "$@"; do
    if [ "$arg" = "--dry-run" ]; then
        # shellcheck disable=SC1091
        . "$root/scripts/setup_env.sh"  # the project venv, as the tests use it (CI built it already)
        export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
        exec python -m profiling.gpu_check "$@"
    fi
done
cd "$root"
python="${PYTHON:-python3}"
if ! "$python" -c "import torch" 2>/dev/null; then
    echo "gpu_check: $python has no torch. On a GPU machine run it with the python3 that has the machine's" >&2
    echo "gpu_check: CUDA torch (PYTHON=/path/to/python3 bash scripts/gpu_check.sh); on this project's CPU" >&2
    echo "gpu_check: machines run 'bash scripts/gpu_check.sh --dry-run' (it uses the project's .venv)." >&2
    exit 2
fi
site="${NN_DATA_GPU_SITE:-/tmp/nn_data_gpu_site}"
if compgen -G ".gpu_wheels/*.whl" > /dev/null; then
    for whl in .gpu_wheels/*.whl; do
        if [ "$(basename "$whl" | cut -d- -f1)" = "torch" ]; then
            echo "gpu_check: refusing to install $whl: the machine's own torch is used" >&2
            exit 2
        fi
    done
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        .gpu_wheels/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_check: installed $(ls .gpu_wheels | tr '\n' ' ')into $site"
else
    echo "gpu_check: no wheels in .gpu_wheels/ (bash scripts/gpu_wheels.sh makes them)"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m profiling.gpu_check "$@"
