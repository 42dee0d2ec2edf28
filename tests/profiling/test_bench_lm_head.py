"""Tier: pure CPU (no process spawned; the benchmark's ``--help`` runs in tests/profiling/test_layout.py).

profiling/bench/bench_lm_head.py's computed table of the logits' memory the fused head removes, and its
targets section read from a result dict: the figures a user reads off it are arithmetic, checked here.
"""

from __future__ import annotations

import argparse

from profiling.bench import bench_lm_head


def test_the_memory_table_at_gpu_sizes_is_the_logits_bytes_per_rank():
    args = argparse.Namespace(table_tokens=262_144, table_vocab=152_064, table_tp=4, table_cp=[2, 8], chunk=256)
    lines = bench_lm_head.memory_table(args)
    # C 2: 131,072 tokens x 38,016 columns x 2 bytes = 9.28 GiB of bf16 logits; C 8: 2.32 GiB; one chunk 37 MiB
    assert "| 2 | 131,072 | 9.28 | 9.28 | 18.56 | 37 + 1.0 |" in lines
    assert "| 8 | 32,768 | 2.32 | 2.32 | 4.64 | 37 + 0.2 |" in lines


def test_targets_compare_the_fused_path_with_the_unfused_one():
    res = {"weight grad|bytes|": 100.0, "forward|fused|syncs": 0, "f64|fused vs unfused|values": 1e-15,
           "f64|fused vs unfused|hidden": 2e-15, "f64|fused vs unfused|weight": 3e-11}
    for path, peak, time in (("fused", 150.0, 1.3), ("unfused", 900.0, 1.0)):
        res.update({f"forward+backward|{path}|peak": peak, f"forward+backward|{path}|time": time,
                    f"forward+backward|{path}|cpu": time, f"forward+backward|{path}|syncs": 0})
    text = "\n".join(bench_lm_head.targets(res))
    assert "1/16 of the unfused path's (less the weight gradient both): 16 (met)" in text  # (900-100)/(150-100)
    assert "wall time <= 1.15x the unfused path's: 1.3 (MISSED)" in text
    assert "float64 values and both gradients, fused vs unfused, <= 1e-10: 3e-11 (met)" in text
    assert "entropy" not in text  # those paths did not run


def test_targets_with_entropy_and_top_8_compare_with_both_unfused_paths():
    res = {"weight grad|bytes|": 100.0, "forward|fused|syncs": 0}
    for path, peak, time in (("fused", 150.0, 1.1), ("unfused", 900.0, 1.0), ("fused +entropy+top8", 160.0, 1.25),
                             ("unfused +entropy+top8", 1000.0, 1.2)):
        res.update({f"forward+backward|{path}|peak": peak, f"forward+backward|{path}|time": time,
                    f"forward+backward|{path}|cpu": time, f"forward+backward|{path}|syncs": 0})
    text = "\n".join(bench_lm_head.targets(res))
    assert "wall time <= 1.15x the unfused path's: 1.1 (met)" in text
    assert "less the weight gradient): 15 (MISSED)" in text  # (1000-100)/(160-100)
    assert "with entropy + top-8: forward+backward wall time <= 1.3x the unfused path's (log-prob only): 1.25 (met)" \
        in text
    assert "vs the unfused path with them: 1.04 (met)" in text
