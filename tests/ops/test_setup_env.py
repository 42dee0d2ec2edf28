"""Tier: pure CPU (bash runs scripts/setup_env.sh against a stand-in venv whose python is a script: no
pip, nothing installed).

The set-up script's progress while pip is quiet: a line every NN_DATA_SETUP_HEARTBEAT_S seconds (30 by
default), pip's own lines kept, pip's failure stops the script before the venv is stamped ready.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_PIP = """#!/usr/bin/env bash
sleep "$FAKE_PIP_S"
echo "pip says: $*" >&2
exit "$FAKE_PIP_RC"
"""


def _run(tmp_path: Path, rc: int) -> subprocess.CompletedProcess:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PIP)
    (venv / "bin" / "python").chmod(0o755)
    (venv / "bin" / "activate").write_text("")  # sourced at the end: nothing to activate here
    (venv / ".nn_data_ready").write_text("an older stamp\n")  # the update path: no `python3 -m venv`
    env = {**os.environ, "NN_DATA_VENV": str(venv), "NN_DATA_SETUP_HEARTBEAT_S": "1", "FAKE_PIP_S": "2.5",
           "FAKE_PIP_RC": str(rc)}
    return subprocess.run(["bash", "-c", f". {ROOT / 'scripts' / 'setup_env.sh'}"], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_quiet_install_prints_a_line_per_interval_and_stamps_the_venv(tmp_path):
    run = _run(tmp_path, rc=0)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert any("changed since" in line and "updating it" in line for line in lines), run.stderr
    heartbeats = [line for line in lines if line.startswith("setup_env:     still installing, ")]
    assert len(heartbeats) >= 2 * 2, run.stderr  # two pip calls of 2.5 s, a line each second
    assert sum("pip says: " in line for line in lines) == 2 and "ready in" in run.stderr
    assert (tmp_path / "venv" / ".nn_data_ready").read_text() != "an older stamp\n"


def test_a_failing_pip_stops_the_set_up_before_the_stamp(tmp_path):
    run = _run(tmp_path, rc=3)
    assert run.returncode == 3, run.stderr
    assert "pip says: " in run.stderr and "ready in" not in run.stderr
    assert (tmp_path / "venv" / ".nn_data_ready").read_text() == "an older stamp\n"
