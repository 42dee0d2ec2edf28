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


def test_the_wall_part_times_several_groups_and_states_their_token_ratio():
    """--part wall --smoke: 2 agentic groups, one microbatch each, prompt-only and tree side by side; the printed
    real tokens are the groups' own (prompt-only: each prompt once; tree: every shared token once), their
    ratio stands beside the time ratio, and the two modes' logits agree (float32)."""
    import argparse
    import re

    lines = bench.main(["--part", "wall", "--smoke"])
    args = argparse.Namespace(wall_groups=2, wall_prompt=(32, 48), wall_group_size=(3, 4), wall_q=0.7, wall_turn=72)
    groups = bench.wall_microbatches(args, vocab=97)
    assert len(groups) == 2 and all(int(at.max()) > 0 for _, _, _, _, at in groups)  # every group shares tokens
    want = {"prompt-only": sum(int(n.sum()) - p * (len(n) - 1) for _, n, p, _, _ in groups),
            "tree": sum(int((n - at).sum()) for _, n, _, _, at in groups)}
    tokens = {m.group(1): int(m.group(2).replace(",", "")) for line in lines
              if (m := re.match(r"^  (prompt-only|tree)\s+([0-9,]+) tokens", line))}
    assert tokens == want
    summary = re.search(r"prompt-only / tree: [0-9.]+x time, ([0-9.]+)x real tokens; max \|logits tree - "
                        r"prompt-only\| ([0-9.e+-]+)$", lines[-1])
    assert summary and abs(float(summary.group(1)) - want["prompt-only"] / want["tree"]) <= 0.005
    assert float(summary.group(2)) < 1e-5
