"""Tier: pure CPU, single process. profiling/bench/bench_rollout_trees.py: every part end to end with tiny
sizes, and its token counts against arithmetic done by hand."""

from __future__ import annotations

from profiling.bench import bench_rollout_trees as bench


def test_every_part_runs_at_tiny_sizes():
    lines = bench.main(["--part", "all", "--smoke"])
    assert sum(line.startswith("| agentic") for line in lines) == len(bench.AGENTIC)
    assert sum(line.startswith("| multi-turn SFT") for line in lines) == 2
    assert any(line.startswith("target: agentic real tokens") for line in lines)
    assert any(line.startswith("  prompt-only / tree:") for line in lines)
    assert any(line.startswith("find_rollout_tree: 8 rollouts") for line in lines)


def test_the_counts_are_the_arithmetic_of_one_group():
    """A prompt of 100, rollout 0 with turns 10 and 20, rollout 1 re-sampling rollout 0 after its first turn
    (own turn 5), rollout 2 from the prompt (own turn 7): end to end 130 + 115 + 107; prompt-only the prompt
    once: 352 - 200; the tree also shares rollout 0's first turn: 152 - 10."""
    group = [([(-1, 0), (0, 1), (0, 2)], [100, 10, 20]), ([(-1, 0), (0, 1), (1, 2)], [100, 10, 5]),
             ([(-1, 0), (2, 1)], [100, 7])]
    assert bench.counts([group], seed=0) == {"end to end": 352, "prompt-only": 152, "tree": 142}


def test_sft_samples_are_prefixes_of_the_next():
    import numpy as np

    samples = bench.sft_conversation(np.random.default_rng(0), 300)
    for (seg_a, len_a), (seg_b, len_b) in zip(samples, samples[1:]):
        assert seg_b[: len(seg_a)] == seg_a and len_b[: len(len_a)] == len_a and len(seg_b) == len(seg_a) + 1
