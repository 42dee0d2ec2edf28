"""Tier: pure CPU, single process. profiling/bench/bench_hf_mixers.py end to end with tiny sizes: every
mode runs, nn_data's packed forward equals each sequence alone and transformers' packed row does not."""

from __future__ import annotations

import re

from profiling.bench import bench_hf_mixers


def test_the_benchmark_runs_and_reports_each_modes_error():
    lines = bench_hf_mixers.main(["--kinds", "mamba2", "lfm2", "--seqs", "3", "--max-len", "12", "--hidden", "32",
                                  "--layers", "2", "--reps", "1"])
    errors = {}
    for kind in ("mamba2", "lfm2"):
        block = lines[lines.index(next(line for line in lines if line.startswith(kind))):][1:4]
        for line in block:
            name = line.split()[0]
            errors[kind, name] = float(re.search(r"alone\| ([0-9.e+-]+)$", line).group(1))
    assert errors["mamba2", "nn_data"] < 1e-4 and errors["lfm2", "nn_data"] < 1e-4
    assert errors["mamba2", "alone"] == 0.0 and errors["mamba2", "packed_row"] > 1e-3
