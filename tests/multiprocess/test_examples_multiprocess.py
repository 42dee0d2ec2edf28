"""Tier: CPU multi-process over gloo (the example spawns its ranks itself on 127.0.0.1).

``python -m scripts.packed_forward_example --cp N`` runs for a CP size that is not a power of two
(N = 3: ``--multiple 8`` becomes 12) and prints packed == alone. Every N from 1 to 8 is checked
without spawning in tests/ops/test_packed_forward.py. ``python -m scripts.pipeline_example --vpp 2``
(megatron-core's interleaved schedule) prints PP = 2 x VPP = 2 equal to PP = 1 and to each sequence
alone.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.megatron_release import needs_megatron_models

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cp", [3])
def test_packed_forward_example_runs_with_cp(cp):
    run = subprocess.run([sys.executable, "-m", "scripts.packed_forward_example", "--cp", str(cp), "--microbatches", "2",
                          "--rows", "3", "--seq-len", "16", "--dim", "16", "--layers", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert f"C = {cp}" in run.stdout and len(rows) == 2, run.stdout
    assert all(float(r[3]) < 1e-5 for r in rows), run.stdout  # max |packed - alone|


@needs_megatron_models
def test_pipeline_example_runs_the_interleaved_schedule():
    run = subprocess.run([sys.executable, "-m", "scripts.pipeline_example", "--vpp", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "interleaved 1F1B, 2 virtual stages per rank: megatron-core's forward_backward_pipelining_with_interleaving" in out
    assert "8 microbatches packed to T = 112 (float64)" in out, out
    assert "losses   PP=2 vs PP=1: max |diff| 0.0e+00 (bit for bit: True)" in out, out
    assert out.count("gradients PP=2 vs PP=1: max |diff| 0.0e+00 (bit for bit: True)") == 2, out
    alone = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines()
             if "vs alone" in line or "vs each sequence alone" in line]
    assert len(alone) == 2 and max(alone) < 1e-12, out
