#!/usr/bin/env bash
# Installs beside NeMo-RL: in the NeMo-RL job's venv (.venv-nemo-rl: NeMo-RL's pins, torch 2.11.0, transformers
# 5.6.0, megatron-core 0.19.2, set up by scripts/setup_env.sh), with NeMo-RL's own requirements as constraints
# (its pyproject.toml at 7ea279ab: torch==2.11.0, transformers>=5.5.0,<5.9.0), `pip install --dry-run
# "nn_data[hf,megatron]"` must resolve and would install nn_data alone: no pinned package moves.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export NN_DATA_JOB=nemo-rl
# shellcheck disable=SC1091
. "$root/scripts/setup_env.sh"
nemo_rl="$(mktemp)"
trap 'rm -f "$nemo_rl"' EXIT
printf '%s\n' "torch==2.11.0" "transformers>=5.5.0,<5.9.0" > "$nemo_rl"
before="$(python -m pip freeze --exclude-editable | sort)"
# PIP_CONSTRAINT: NeMo-RL's requirements in place of a machine's pip.conf cap (this command only)
out="$(PIP_CONSTRAINT="$nemo_rl" python -m pip install --dry-run --disable-pip-version-check "$root[hf,megatron]" 2>&1 \
    | grep -v "^WARNING: Location 'file://.*' is ignored")" || { echo "$out" >&2; echo "beside NeMo-RL: pip could not resolve" >&2; exit 1; }
would="$(echo "$out" | sed -n 's/^Would install //p')"
echo "beside NeMo-RL: $(python -m scripts.stack): would install: ${would:-nothing}"
for package in $would; do
    case "$package" in
        nn_data-* | nn-data-*) ;;
        *) echo "beside NeMo-RL: pip install \"nn_data[hf,megatron]\" would move $package" >&2; exit 1 ;;
    esac
done
[ "$before" = "$(python -m pip freeze --exclude-editable | sort)" ]  # a dry run: nothing changed
echo "beside NeMo-RL: resolves, moves no package"
