"""Tier: CPU multi-process over gloo (the benchmark spawns 2 ranks on 127.0.0.1).

profiling/bench/bench_logprobs.py end to end with tiny sizes: every path runs in both modes, the drop-in
equals the naive path in float64, spends no host sync and one all-gather (plus one reduce-scatter
in backward), and ``--nemo-rl`` imports a checkout's ``nemo_rl`` package (here a stand-in package
whose function is nn_data's own, so the targets section prints). No timing is asserted.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from profiling.bench import bench_logprobs

pytestmark = pytest.mark.multiprocess

TINY = ["--tokens", "64", "--rows", "4", "--vocab", "64", "--check-vocab", "32", "--repeats", "1", "--chunk", "8"]


def _run(argv):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        res = bench_logprobs.main(argv)
    return res, printed.getvalue()


def test_every_path_runs_and_the_drop_in_matches_the_naive_path(tmp_path):
    package = tmp_path / "checkout" / "nemo_rl" / "distributed"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "model_utils.py").write_text(
        "from nn_data.nemo_rl.model_utils import from_parallel_logits_to_logprobs_packed_sequences  # a stand-in\n")
    res, text = _run(TINY + ["--nemo-rl", str(tmp_path / "checkout")])
    for mode in bench_logprobs.MODES:
        for path in ("drop-in", "TokenLogProbs", "naive", "nemo-rl", "nemo-rl chunked"):
            assert res[f"{mode}|{path}|time"] > 0 and res[f"{mode}|{path}|cpu"] >= 0 and f"| {mode} | {path} |" in text
    assert res["forward|drop-in|syncs"] == 0 and res["forward+backward|drop-in|syncs"] == 0
    assert res["forward|drop-in|collectives"] == 1  # the CP all-gather of [1, T/C] values
    assert res["forward+backward|drop-in|collectives"] == 2  # and the reduce-scatter of its gradient
    assert res["f64|naive|values"] <= 1e-10 and res["f64|naive|grads"] <= 1e-10
    assert res["f64|nemo-rl|values"] == 0  # the stand-in is nn_data's function itself
    assert "targets:" in text and "host syncs == 0 (forward and backward): 0 (met)" in text


def test_a_folder_without_nemo_rl_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no nemo_rl package there"):
        bench_logprobs.import_nemo_rl(str(tmp_path))
