"""Tier: pure CPU, single process. profiling/bench/bench_hybrid_trees.py's wall part end to end with tiny sizes
(its work part is tests/models/test_tree_models.py's flop bound)."""

from __future__ import annotations

import re

from profiling.bench import bench_hybrid_trees


def test_the_wall_part_runs_and_reports_both_modes():
    lines = bench_hybrid_trees.main(["--part", "wall", "--kinds", "mamba2", "lfm2", "--prompt", "16", "--group",
                                     "2", "--rollout", "8", "--reps", "1"])
    for kind in ("mamba2", "lfm2"):
        line = next(line for line in lines if line.startswith(kind))
        assert re.search(r"tree [0-9.]+ ms .*alone [0-9.]+ ms .*alone / tree [0-9.]+x$", line), line
