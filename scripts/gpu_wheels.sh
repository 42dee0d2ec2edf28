#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels the GPU machine lacks (Python 3.12, x86_64, no network
# there): megatron-core 0.16.1 and torch-tb-profiler 0.4.3. Their own needs (torch, numpy, packaging,
# pandas, tensorboard) are on that machine already, so --no-deps; never torch. Into .gpu_wheels/
# (git-ignored), which the device run carries and scripts/gpu_check.sh installs there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.gpu_wheels"
mkdir -p "$dest"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$dest" megatron-core==0.16.1 torch-tb-profiler==0.4.3
ls -l "$dest"
