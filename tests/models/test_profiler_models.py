"""Tier: pure CPU, single process (torch.compile of the data path; ``--model megatron`` makes this
process a one-rank gloo group for the run and leaves it afterwards). No timing is asserted.

The profiler with a real model (``--model hf|megatron``, profiling/microbatches/real_models.py) and the examples.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.distributed as dist

from profiling.microbatches import run as profiler
from tests.support.megatron_release import needs_megatron_models

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # megatron-core's own, when it builds a model

TINY = ["--batch-size", "16", "--max-len", "32", "--median-len", "8", "--max-tokens", "128", "--microbatches", "3",
        "--passes", "1", "--sync-steps", "1", "--trace-steps", "1", "--vocab", "64", "--hidden", "16",
        "--modes", "eager", "compiled", "--no-progress"]


@pytest.mark.parametrize("model, cp", [("hf", "2"), pytest.param("megatron", "1", marks=needs_megatron_models)])
def test_profiler_runs_a_real_model_and_reports_the_data_paths_share(model, cp, tmp_path):
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            summary = profiler.main(TINY + ["--model", model, "--cp-size", cp, "--out-dir", str(tmp_path)])
    finally:
        if dist.is_initialized():  # only if the run failed before leaving its one-rank group
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        torch._dynamo.reset()
    assert not dist.is_initialized()
    compiled = next(m for m in summary["modes"] if m["name"] == "compiled")
    assert compiled["recompiles"] == 0
    alone = summary["model_alone"]
    assert alone["mean_s"] > 0 and set(summary["data_path_share"]) == {"eager", "compiled"}
    assert compiled["syncs_per_microbatch"] == alone["syncs_per_microbatch"]  # the model's own, nothing more
    assert summary["outputs_max_abs_difference"] <= 1e-5
    text = printed.getvalue()
    assert f"model {model} alone (inputs prepared beforehand)" in text
    assert "data path's share of the mean time per microbatch: eager" in text


def test_megatron_needs_cp_size_one_and_real_models_the_data_scope(capsys):
    for argv, message in ((["--model", "megatron"], "--model=megatron needs --cp-size 1 (got 2)"),
                          (["--model", "hf", "--compile-scope", "whole"], "--compile-scope=whole with --model=hf")):
        with pytest.raises(SystemExit):
            profiler.parse_args(argv)
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("model", ["tiny", "hf"])
def test_packed_forward_example_prints_small_differences(model):
    from scripts import packed_forward_example

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        packed_forward_example.main(["--model", model, "--microbatches", "2", "--rows", "3", "--seq-len", "16"])
    rows = [line.split() for line in printed.getvalue().splitlines() if line.split() and line.split()[0].isdigit()]
    assert len(rows) == 2 and all(float(r[3]) < 1e-5 for r in rows), printed.getvalue()
