"""Benchmark dynamic-CP planners side by side: modelled step over the ideal, rounds, padding, CP collectives, plan time.

For every length distribution, step size and pool of ``R`` ranks (DP x CP), one step's sequences are
planned at ``tokens_per_rank`` tokens per rank by:

    nn_data          nn_data.planning.plan_step_dynamic_cp with its default cost model (CPCost: L (L + 6h) / c
                     plus the CP collectives), every rank one static shape
    nn_data (L^2/c)  the same planner given megatron-core's cost model (AttentionOnlyCost)
    megatron-core    megatron-core's BalancedCPScheduler (pipeline_parallel/hybrid_cp_schedule.py, the
                     installed release, run on the CPU: it only asks its group for size()), whose
                     groups run one sequence per microbatch over 2**ceil(log2(L / tokens_per_rank)) ranks
    static CP        nn_data.planning.plan_step over dp = R / cp ranks with the smallest static cp that
                     holds the longest sequence, microbatches of cp * tokens_per_rank tokens

Columns: ``step/ideal`` under each cost model (``nn_data``: CPCost, ``mcore``: L^2 / c), each
planner's step modelled the way it runs: nn_data's rounds as their critical path (no barrier between
rounds: a block starts when the last of its ranks is done; ``round sum`` is the sum over rounds of the
slowest block, the bound with a barrier after every round, DynamicCPPlan.step_over_ideal; ``with
padding`` adds what each rank's padding positions cost under nn_data's model, 6h each: the linear layers
run on them; megatron-core pads nothing); megatron-core's groups as the sum over groups (it puts a barrier after each) of the slowest
rank's microbatches, each microbatch's collectives counted at its own L / c tokens per rank; static
CP as the slowest data-parallel rank's microbatches, each paying the collectives. The ideal is the
same for all: every sequence's work at its smallest CP size (with its share of that size's
collectives) spread over all R ranks (DynamicCPPlan.ideal_cost). ``rounds/rank``: microbatches per
rank (the most any rank runs); ``padding``: 1 - real tokens / (R x rounds x tokens_per_rank) for
the static shapes (megatron-core pads nothing: its microbatches have L / c tokens, a new shape
each); ``shapes/rank``: the distinct local microbatch lengths a rank runs (what a compiled or
CUDA-graphed step needs graphs for); ``CP rounds``: the most microbatches any rank runs in a group
of more than one rank (each runs the CP collectives of every layer); ``plan ms`` / ``cpu ms``: the
median wall time and CPU time of one plan (profiling.timing, 1 thread; on a shared machine the wall
time also holds other processes' work, so the 1 s target is checked on the CPU time). Everything but
the plan times is deterministic.

Distributions (lengths in [1, S], S = 65,536): ``lognormal`` median S/8, sigma 1; ``bimodal`` 75 %
lognormal median S/32, sigma 0.5, 25 % uniform in [S/2, S]; ``uniform`` in [1, S]; ``few_long``
lognormal median S/64, sigma 0.7, and n/32 (at least one) uniform in [S/2, S]. tokens_per_rank =
16,384 (megatron-core's suggested max_seqlen_per_dp_cp_rank: the longest sequence / its CP size 4).
``small``: 64, 128, 256 sequences on 8 and 16 ranks; ``large``: 4096, 16384 and 65536 sequences on
64 ranks (megatron-core's scheduler is left out there: it rescans every sequence per placement).

    python -m profiling.bench.bench_dynamic_cp                      # every case
    python -m profiling.bench.bench_dynamic_cp --sizes small --json dcp.json --markdown dcp.md

The issue's targets are checked at the end ("target met / MISSED"): nn_data's step/ideal <= 1.02 and
never above megatron-core's under either cost model, rounds <= the token lower bound + 1, 65,536
sequences planned in under 1 s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from nn_data.planning import AttentionOnlyCost, CPCost, Parallelism, plan_step, plan_step_dynamic_cp
from profiling.bench.bench_planner import sample as planner_sample
from profiling.timing import cpu_time_call, machine_description, spread, time_calls

ROW_LEN = 65536
TOKENS_PER_RANK = 16384
HIDDEN = 4096
SIZES = {"small": dict(counts=(64, 128, 256), ranks=(8, 16)), "large": dict(counts=(4096, 16384, 65536), ranks=(64,))}
DISTRIBUTIONS = ("lognormal", "bimodal", "uniform", "few_long")
MODELS = {"nn_data": CPCost(hidden_size=HIDDEN), "mcore": AttentionOnlyCost()}
PLANNERS = ("nn_data", "nn_data (L^2/c)", "megatron-core", "static CP")
MEGATRON_UP_TO = 4096  # megatron-core's scheduler is quadratic: only steps up to this many sequences


def sample(distribution: str, n: int, row_len: int = ROW_LEN, seed: int = 0) -> np.ndarray:
    """``n`` seeded lengths in ``[1, row_len]`` (module docstring): bench_planner's distributions."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution {distribution!r} is unknown; expected one of {DISTRIBUTIONS}")
    return planner_sample(distribution, n, row_len, seed)


def megatron_scheduler():
    """megatron-core's ``BalancedCPScheduler`` class, or the reason it is not available (a string)."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TransformerEngine/Apex missing: the scheduler needs neither
            from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError as err:
        return f"megatron-core's BalancedCPScheduler is not importable here ({err}); its column is skipped"
    return BalancedCPScheduler


class _PoolSize:
    """What ``BalancedCPScheduler`` asks of its data-and-context-parallel group: its size."""

    def __init__(self, ranks: int):
        self.ranks = ranks

    def size(self) -> int:
        return self.ranks


def megatron_groups(scheduler, lengths: np.ndarray, ranks: int, tokens_per_rank: int) -> list:
    """megatron-core's grouping: ``groups[g][r]`` the sequence ids rank ``r`` runs in group ``g``."""
    planner = scheduler(max_seq_len_per_rank=tokens_per_rank, dp_cp_group=_PoolSize(ranks))
    _, sample_ids = planner.get_groups_and_subsamples([(i, int(n)) for i, n in enumerate(lengths)], None)
    return sample_ids


def evaluate_groups(groups: list, lengths: np.ndarray, ranks: int, cost) -> dict:
    """A megatron-core grouping's modelled step (module docstring) and counts; checks every sequence
    runs in exactly one group, on the ranks of one CP group."""
    step, microbatches, cp_rounds, shapes, seen = 0.0, [0] * ranks, [0] * ranks, [set() for _ in range(ranks)], []
    for group in groups:
        holders: dict = {}
        for r in range(ranks):
            for i in group[r]:
                holders.setdefault(i, []).append(r)
        times = [0.0] * ranks
        for i, members in holders.items():
            c = len(members)
            local = -(-int(lengths[i]) // c)
            each = float(cost.sequence(np.asarray([lengths[i]]), c)[0]) + float(cost.block(c, local))
            for r in members:
                times[r] += each
                microbatches[r] += 1
                cp_rounds[r] += c > 1
                shapes[r].add(local)
        step += max(times)
        seen += list(holders)
    assert sorted(seen) == list(range(len(lengths))), "megatron-core's grouping lost or repeated a sequence"
    return dict(step=step, padded=step, rounds=max(microbatches), cp_rounds=max(cp_rounds),
                shapes=max(len(s) for s in shapes), padding=None)


def static_cp(lengths: np.ndarray, ranks: int, tokens_per_rank: int):
    """``(cp, StepPlan)``: nn_data's static-CP plan, the smallest power-of-two cp that holds the
    longest sequence (padded to 2 cp) in cp * tokens_per_rank tokens."""
    cp = 1
    while cp < ranks and -(-int(lengths.max()) // (2 * cp)) * 2 * cp > cp * tokens_per_rank:
        cp *= 2
    parallelism = Parallelism(dp=ranks // cp, cp=cp)
    return cp, plan_step(lengths, parallelism, pad_full_seq_to=cp * tokens_per_rank, hidden_size=HIDDEN)


def _padding(cost, tokens: float) -> float:
    """What ``tokens`` positions of padding cost a rank under ``cost`` (0 for a model without ``padding``)."""
    padding = getattr(cost, "padding", None)
    return float(padding(tokens)) if callable(padding) else 0.0


def evaluate_static(cp: int, plan, lengths: np.ndarray, tokens_per_rank: int, cost) -> dict:
    """The static-CP plan's modelled step: its slowest data-parallel rank, every microbatch paying the
    collectives of its cp ranks (``padded``: and its padding positions)."""
    def microbatch(mb) -> float:
        return float(np.sum(cost.sequence(lengths[list(mb)], cp))) + float(cost.block(cp, tokens_per_rank))

    per_rank = [sum(microbatch(mb) for mb in rank) for rank in plan.ranks]
    padded = [sum(microbatch(mb) + _padding(cost, tokens_per_rank - float(lengths[list(mb)].sum()) / cp) for mb in rank)
              for rank in plan.ranks]
    k = plan.microbatches_per_rank
    return dict(step=max(per_rank), padded=max(padded), rounds=k, cp_rounds=k if cp > 1 else 0, shapes=1,
                padding=plan.padding_fraction)


def evaluate_dynamic(plan, lengths: np.ndarray, cost) -> dict:
    """A dynamic-CP plan's modelled step under ``cost``: the critical path (no barrier between rounds, as
    nn_data runs it), and the sum over rounds of the slowest block (``round_sum``, the issue's figure)."""
    def block_cost(b, padded: bool) -> float:
        pad = _padding(cost, plan.tokens_per_rank - float(lengths[list(b.sequences)].sum()) / b.size) if padded else 0.0
        if not b.sequences:
            return pad
        return float(np.sum(cost.sequence(lengths[list(b.sequences)], b.size))) + float(cost.block(
            b.size, plan.tokens_per_rank)) + pad

    out = {}
    for padded in (False, True):
        finish = [0.0] * plan.ranks
        for blocks in plan.rounds:
            for b in blocks:
                end = max(finish[b.start:b.start + b.size]) + block_cost(b, padded)
                finish[b.start:b.start + b.size] = [end] * b.size
        out["padded" if padded else "step"] = max(finish)
    round_sum = sum(max(block_cost(b, False) for b in blocks) for blocks in plan.rounds)
    return dict(out, round_sum=round_sum, rounds=plan.rounds_per_rank, cp_rounds=plan.cp_collective_rounds,
                shapes=1, padding=plan.padding_fraction, lower_bound=plan.token_lower_bound)


def measure_case(distribution: str, n: int, ranks: int, scheduler, seed: int, reps: int) -> list[dict]:
    """One row per planner for one (distribution, n, R): its figures under both cost models."""
    lengths = sample(distribution, n, ROW_LEN, seed)
    parallelism = Parallelism(dp=ranks)
    ideal = {name: plan_step_dynamic_cp(lengths, parallelism, tokens_per_rank=TOKENS_PER_RANK, cost=model).ideal_cost
             for name, model in MODELS.items()}
    planners = {
        "nn_data": lambda: plan_step_dynamic_cp(lengths, parallelism, tokens_per_rank=TOKENS_PER_RANK, cost=MODELS["nn_data"]),
        "nn_data (L^2/c)": lambda: plan_step_dynamic_cp(lengths, parallelism, tokens_per_rank=TOKENS_PER_RANK,
                                                        cost=MODELS["mcore"]),
        "static CP": lambda: static_cp(lengths, ranks, TOKENS_PER_RANK),
    }
    if not isinstance(scheduler, str) and n <= MEGATRON_UP_TO:
        planners["megatron-core"] = lambda: megatron_groups(scheduler, lengths, ranks, TOKENS_PER_RANK)
    rows = []
    for name in PLANNERS:
        row = dict(distribution=distribution, n=n, ranks=ranks, planner=name)
        if name not in planners:
            rows.append({**row, "error": scheduler if isinstance(scheduler, str) else f"not run above {MEGATRON_UP_TO}"})
            continue
        planned = planners[name]()
        count = reps if n <= 4096 else max(3, reps // 5)
        timing = time_calls(planners[name], warmup=1 if n <= 4096 else 0, reps=count)
        cpu = spread([cpu_time_call(planners[name]) for _ in range(count)])[0]
        for model_name, model in MODELS.items():
            if name == "megatron-core":
                figures = evaluate_groups(planned, lengths, ranks, model)
            elif name == "static CP":
                figures = evaluate_static(*planned, lengths, TOKENS_PER_RANK, model)
            else:
                figures = evaluate_dynamic(planned, lengths, model)
            row[f"step_over_ideal_{model_name}"] = figures.pop("step") / ideal[model_name]
            row[f"padded_over_ideal_{model_name}"] = figures.pop("padded") / ideal[model_name]
            if "round_sum" in figures:
                row[f"round_sum_over_ideal_{model_name}"] = figures.pop("round_sum") / ideal[model_name]
            row.update(figures)
        rows.append({**row, "plan_ms": timing.median_s * 1e3, "plan_cpu_ms": cpu * 1e3})
    return rows


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_rows(rows: list[dict], markdown: bool = False) -> str:
    names = ["distribution", "n", "R", "planner", "step/ideal nn_data", "round sum", "with padding", "step/ideal mcore",
             "round sum", "rounds/rank", "padding", "shapes/rank", "CP rounds", "plan ms", "cpu ms"]
    widths = (10, 6, 3, 16, 18, 9, 12, 16, 9, 11, 8, 11, 9, 9, 8)
    lines = (["| " + " | ".join(names) + " |", "| " + " | ".join(["---"] * len(names)) + " |"] if markdown else
             [" ".join(f"{h:>{w}}" for h, w in zip(names, widths))])
    for r in rows:
        cells = [r["distribution"], str(r["n"]), str(r["ranks"]), r["planner"]]
        if "error" in r:
            cells += [f"skipped: {r['error'][:90]}"] + [""] * 10
        else:
            cells += [f"{r['step_over_ideal_nn_data']:.4f}", _cell(r.get("round_sum_over_ideal_nn_data"), ".4f"),
                      f"{r['padded_over_ideal_nn_data']:.4f}",
                      f"{r['step_over_ideal_mcore']:.4f}", _cell(r.get("round_sum_over_ideal_mcore"), ".4f"),
                      str(r["rounds"]), _cell(r["padding"], ".2%"), str(r["shapes"]), str(r["cp_rounds"]),
                      f"{r['plan_ms']:.1f}", f"{r['plan_cpu_ms']:.1f}"]
        if markdown:
            lines.append("| " + " | ".join(cells) + " |")
        else:
            lines.append(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[tuple[str, Optional[bool]]]:
    """The issue's targets per case, each met (True), missed (False) or not run (None)."""
    checks = []
    cases = sorted({(r["distribution"], r["n"], r["ranks"]) for r in rows},
                   key=lambda c: (c[2], DISTRIBUTIONS.index(c[0]), c[1]))
    for distribution, n, ranks in cases:
        by = {r["planner"]: r for r in rows if (r["distribution"], r["n"], r["ranks"]) == (distribution, n, ranks)}
        case = f"{distribution} n={n} R={ranks}"
        mine, attention, mcore = by["nn_data"], by["nn_data (L^2/c)"], by.get("megatron-core", {})
        soi, round_sum = mine["step_over_ideal_nn_data"], mine["round_sum_over_ideal_nn_data"]
        checks.append((f"{case}: step/ideal {soi:.4f} <= 1.02", soi <= 1.02))
        checks.append((f"{case}: round sum/ideal {round_sum:.4f} <= 1.02", round_sum <= 1.02))
        checks.append((f"{case}: rounds {mine['rounds']} <= lower bound {mine['lower_bound']} + 1",
                       mine["rounds"] <= mine["lower_bound"] + 1))
        for model, plan in (("nn_data", mine), ("mcore", attention)):
            key = f"step_over_ideal_{model}"
            if key not in mcore:
                checks.append((f"{case}: megatron-core under {model}'s model not run", None))
                continue
            checks.append((f"{case}: under {model}'s model {plan[key]:.4f} <= megatron-core's {mcore[key]:.4f}",
                           plan[key] <= mcore[key] + 1e-12))
        if n >= 65536:  # CPU time: on a shared machine the wall time also holds other processes' work
            checks.append((f"{case}: planned in {mine['plan_cpu_ms'] / 1e3:.2f} s of CPU time < 1 s (wall "
                           f"{mine['plan_ms'] / 1e3:.2f} s)", mine["plan_cpu_ms"] < 1000))
    return checks


def main(argv=None, scheduler=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m profiling.bench.bench_dynamic_cp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", choices=tuple(SIZES), default=list(SIZES))
    ap.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    ap.add_argument("--counts", nargs="+", type=int, default=None, help="sequences per step (default: each size's own)")
    ap.add_argument("--reps", type=int, default=10, help="timed plans per case up to 4096 sequences (above: a fifth)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--markdown", default=None, help="also write the table as markdown to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    scheduler = scheduler if scheduler is not None else megatron_scheduler()
    version = _megatron_version()
    print(f"machine: {machine_description()}; hidden {HIDDEN}; S {ROW_LEN}; tokens_per_rank {TOKENS_PER_RANK}; "
          f"seed {args.seed}; megatron-core {version}")
    if isinstance(scheduler, str):
        print(f"note: {scheduler}")
    rows = []
    for size in args.sizes:
        for ranks in SIZES[size]["ranks"]:
            for distribution in args.distributions:
                for n in args.counts or SIZES[size]["counts"]:
                    rows += measure_case(distribution, n, ranks, scheduler, args.seed, args.reps)
    print(format_rows(rows))
    checks = targets(rows)
    for text, ok in checks:
        print(f"target {'met' if ok else ('not run' if ok is None else 'MISSED')}: {text}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_description(), "megatron_core": version, "rows": rows,
                                               "targets": [{"target": t, "met": ok} for t, ok in checks]}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(format_rows(rows, markdown=True) + "\n")
    return rows


def _megatron_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
