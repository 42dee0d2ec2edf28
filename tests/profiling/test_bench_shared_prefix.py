"""Tier: pure CPU, single process. profiling/bench/bench_shared_prefix.py: the token part end to end with tiny
sizes, and its figures against arithmetic done by hand."""

from __future__ import annotations

import numpy as np
import pytest

from profiling.bench import bench_shared_prefix


def test_the_token_part_runs_and_reports_the_target():
    lines = bench_shared_prefix.main(["--part", "tokens", "--smoke"])
    assert sum(line.startswith("| P ") or line.startswith("| mixed") for line in lines) == len(bench_shared_prefix.STEPS)
    assert any(line.startswith("target: P 2048, G 8") and line.endswith("target met") for line in lines)


def test_the_figures_are_the_arithmetic_of_one_group():
    """Prompt 2,048, G 8, responses 512, one rank of T 8192: end to end 20,480 tokens and attention 8 x 2,560^2;
    shared 2,048 + 8 x 512 = 6,144 tokens and attention 2,048^2 + 8 x (2,560^2 - 2,048^2)."""
    from nn_data.planning import Parallelism

    row = bench_shared_prefix.compare(np.full(8, 2560), np.full(8, 2048), np.zeros(8, dtype=int),
                                      Parallelism(dp=1), total=8192, hidden=16)
    e, s = row["end to end"], row["shared"]
    assert (e["real"], s["real"], e["packed"], s["packed"], s["prompts"]) == (20480, 6144, 24576, 8192, 1)
    assert e["attention"] == pytest.approx(8 * 2560**2, rel=1e-12)
    assert s["attention"] == pytest.approx(2048**2 + 8 * (2560**2 - 2048**2), rel=1e-12)


def test_the_steps_are_seeded_and_groups_share_their_prompt():
    a = bench_shared_prefix.grpo_step("mixed", "mixed", (512, 1.0), groups=6, seed=3)
    b = bench_shared_prefix.grpo_step("mixed", "mixed", (512, 1.0), groups=6, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    lengths, prefix, group = a
    assert ((lengths - prefix) >= 128).all() and ((lengths - prefix) <= 4096).all()
    for g in set(group.tolist()):
        assert len(set(prefix[group == g].tolist())) == 1 and 256 <= prefix[group == g][0] <= 4096


def test_the_wall_part_runs_both_modes_on_the_same_rollouts_and_they_agree():
    """--part wall --smoke: a tiny Llama-style model's forward + backward, end to end and shared, side by side;
    the logits agree (float32: a softmax over other key orders rounds ~1e-7 differently) and the token counts
    are the step's (end to end every rollout whole; shared each of the 2 prompts of 24 tokens once)."""
    import re

    lines = bench_shared_prefix.main(["--part", "wall", "--smoke"])
    ids, lengths, prefix, _ = bench_shared_prefix.wall_microbatch(groups=2, prompt=24, group_size=3,
                                                                  response_median=8, vocab=97)
    tokens = {m.group(1): int(m.group(2).replace(",", "")) for line in lines
              if (m := re.match(r"^  (end to end|shared)\s+([0-9,]+) tokens", line))}
    assert tokens == {"end to end": int(lengths.sum()), "shared": int((lengths - prefix).sum()) + 2 * 24}
    error = float(re.search(r"max \|logits shared - end to end\| ([0-9.e+-]+)$", lines[-1]).group(1))
    assert error < 1e-5
    assert bool((ids[:3, :24] == ids[0, :24]).all()) and not bool((ids[3, :24] == ids[0, :24]).all())
