"""Benchmark step planners side by side: padding, microbatches per rank, work imbalance, plan time.

For every length distribution and batch size, one step's sequences are planned onto ``dp``
data-parallel ranks in microbatches of at most ``T = pad_full_seq_to`` padded tokens by:

    work        nn_data.planning.plan_step(balance="work"): the least-loaded rank (by work) with
                room, first fit inside it (the default)
    tokens      plan_step(balance="tokens"): the same, balancing padded tokens
    nemo-rl     plan_step(balance="nemo-rl"): NeMo-RL's plan as nn_data reproduces it (first-fit-
                decreasing bins, the count raised to a multiple of dp, dealt round-robin)
    NeMo-RL ffd / NeMo-RL mffd   NeMo-RL's own FirstFitDecreasingPacker / ModifiedFirstFitDecreasingPacker
                (min_bin_count = bin_count_multiple = dp, as its shard_by_batch_size makes them),
                bins dealt round-robin; only with ``--nemo-rl PATH`` (a NeMo-RL checkout: its
                ``nemo_rl/data/packing/algorithms.py`` is loaded from there, nothing is copied)

Columns: ``mb/rank`` microbatches per rank (the same on every rank; checked for every plan with
nn_data.planning.evaluate_plan, with every sequence exactly once and every microbatch within T);
``padding`` 1 - real tokens / (dp x mb/rank x T); ``imbalance`` the ranks' work max / mean (a
sequence's work is L * (L + 6 * hidden), hidden 4096); ``bound`` a lower bound of the imbalance any
plan can reach (StepPlan.imbalance_bound: the longest sequence alone, or the j*dp + 1 longest
putting j + 1 on one rank, over the mean); ``mb imbalance`` the largest,
over ranks, of a rank's heaviest microbatch work / its mean; ``plan ms`` the median wall time of
a plan (profiling.timing.time_calls, 1 thread). Padding, counts and imbalances are deterministic
(seeded lengths); plan times depend on the machine and its load.

Distributions (lengths in [1, S], S the row length): ``lognormal`` median S/8, sigma 1 (RL
rollouts: most short, a long tail, some cut at S); ``bimodal`` 75 % lognormal median S/32,
sigma 0.5, 25 % uniform in [S/2, S] (short answers and long reasoning); ``uniform`` in [1, S].
Sizes: ``small`` (64, 128, 256 sequences, dp 8, S 8192, T 16384) and ``large`` (4096, 16384,
65536 sequences, dp 64, S 32768, T 65536); CP 2, so each sequence pads to a multiple of 4.

    python -m profiling.bench.bench_planner                                  # every case, nn_data's modes
    python -m profiling.bench.bench_planner --nemo-rl /path/to/RL            # and NeMo-RL's packers
    python -m profiling.bench.bench_planner --sizes small --json planner.json --markdown planner.md

The targets (padding never worse than NeMo-RL's default packer, modified FFD, else nn_data's
nemo-rl mode; work imbalance <= 1.02 wherever the bound allows it; 65,536 sequences planned in
under 2 s) are checked at the end ("target met / MISSED").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from nn_data.planning import Parallelism, evaluate_plan, plan_step
from profiling.timing import machine_description, time_calls

SIZES = {"small": dict(counts=(64, 128, 256), dp=8, row_len=8192, total=16384),
         "large": dict(counts=(4096, 16384, 65536), dp=64, row_len=32768, total=65536)}
DISTRIBUTIONS = ("lognormal", "bimodal", "uniform")
NN_DATA_MODES = ("work", "tokens", "nemo-rl")
HIDDEN = 4096


def sample(distribution: str, n: int, row_len: int, seed: int, *, sigma: float = 1.0) -> np.ndarray:
    """``n`` seeded lengths in ``[1, row_len]`` (module docstring); ``sigma``: the lognormal's (1 in this
    benchmark; bench_shared_prefix draws responses "about 512" with a smaller one)."""
    rng = np.random.default_rng(seed)
    if distribution == "lognormal":
        raw = rng.lognormal(np.log(row_len / 8), sigma, n)
    elif distribution == "bimodal":
        long = rng.random(n) < 0.25
        raw = np.where(long, rng.uniform(row_len / 2, row_len, n), rng.lognormal(np.log(row_len / 32), 0.5, n))
    elif distribution == "uniform":
        raw = rng.uniform(1, row_len, n)
    elif distribution == "few_long":  # bench_dynamic_cp's: 1 in 32 long, the rest short
        raw = rng.lognormal(np.log(row_len / 64), 0.7, n)
        picked = rng.choice(n, max(1, n // 32), replace=False)
        raw[picked] = rng.uniform(row_len / 2, row_len, picked.size)
    else:
        raise ValueError(f"distribution {distribution!r} is unknown; expected one of {DISTRIBUTIONS + ('few_long',)}")
    return np.clip(np.rint(raw), 1, row_len).astype(np.int64)


def load_nemo_rl_packers(checkout: str) -> dict:
    """``{"NeMo-RL ffd": fn, "NeMo-RL mffd": fn}`` from a NeMo-RL checkout's packing algorithms module,
    loaded by path (its imports are the standard library's); ``fn(padded, capacity, dp) -> bins``."""
    path = Path(checkout) / "nemo_rl" / "data" / "packing" / "algorithms.py"
    if not path.exists():
        raise FileNotFoundError(f"--nemo-rl {checkout}: {path} does not exist (expected a NeMo-RL checkout)")
    spec = importlib.util.spec_from_file_location("nemo_rl_packing_algorithms", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def packer(algorithm: str) -> Callable:
        def pack(padded: list, capacity: int, dp: int) -> list:
            return module.get_packer(algorithm, bin_capacity=capacity, min_bin_count=dp, bin_count_multiple=dp).pack(padded)
        return pack

    return {"NeMo-RL ffd": packer("first_fit_decreasing"), "NeMo-RL mffd": packer("modified_first_fit_decreasing")}


def _planners(lengths: np.ndarray, parallelism: Parallelism, total: int, packers: dict) -> dict:
    """``{mode: () -> StepPlan}`` for nn_data's modes and each external packer (bins dealt round-robin)."""
    out = {mode: (lambda mode=mode: plan_step(lengths, parallelism, pad_full_seq_to=total, balance=mode,
                                              hidden_size=HIDDEN)) for mode in NN_DATA_MODES}
    padded = (-(-lengths // parallelism.pad_multiple) * parallelism.pad_multiple).tolist()
    for name, pack in packers.items():
        def run(pack=pack, name=name):
            bins = pack(padded, total, parallelism.dp)
            ranks = [bins[r::parallelism.dp] for r in range(parallelism.dp)]
            return evaluate_plan(ranks, lengths, parallelism, pad_full_seq_to=total, hidden_size=HIDDEN, balance=name)
        out[name] = run
    return out


def _reps(reps: int, n: int, mode: str) -> int:
    """Timed plans: ``reps`` up to 4096 sequences; above, a fifth (at least 3) for nn_data's modes and
    one for the external packers (NeMo-RL's first-fit-decreasing takes O(n x bins): ~20 s at 65,536)."""
    if n <= 4096:
        return reps
    return max(3, reps // 5) if mode in NN_DATA_MODES else 1


def measure_case(distribution: str, n: int, size: dict, packers: dict, seed: int, reps: int) -> list[dict]:
    """One row per planner for one (distribution, n): the plan's figures and its median plan time."""
    lengths = sample(distribution, n, size["row_len"], seed)
    parallelism = Parallelism(dp=size["dp"], cp=2)
    rows = []
    for mode, planner in _planners(lengths, parallelism, size["total"], packers).items():
        row = dict(distribution=distribution, n=n, dp=parallelism.dp, T=size["total"], mode=mode)
        try:
            plan = planner()
            timing = time_calls(planner, warmup=1 if n <= 4096 else 0, reps=_reps(reps, n, mode))
        except Exception as err:  # a planner that refuses the case: its row says why
            rows.append({**row, "error": f"{type(err).__name__}: {err}"})
            continue
        rows.append({**row, "microbatches_per_rank": plan.microbatches_per_rank,
                     "padding_fraction": plan.padding_fraction, "work_imbalance": plan.work_imbalance,
                     "bound": plan.imbalance_bound,
                     "microbatch_imbalance": plan.microbatch_imbalance, "plan_ms": timing.median_s * 1e3})
    return rows


def format_rows(rows: list[dict]) -> str:
    head = (f"{'distribution':<10} {'n':>6} {'dp':>3} {'T':>6} {'mode':<13} {'mb/rank':>7} {'padding':>8} "
            f"{'imbalance':>9} {'bound':>6} {'mb imbalance':>12} {'plan ms':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lead = f"{r['distribution']:<10} {r['n']:>6} {r['dp']:>3} {r['T']:>6} {r['mode']:<13}"
        if "error" in r:
            lines.append(f"{lead} error: {r['error'][:80]}")
            continue
        lines.append(f"{lead} {r['microbatches_per_rank']:>7} {r['padding_fraction']:>8.2%} {r['work_imbalance']:>9.4f} "
                     f"{r['bound']:>6.3f} {r['microbatch_imbalance']:>12.3f} {r['plan_ms']:>9.2f}")
    return "\n".join(lines)


def format_markdown(rows: list[dict]) -> str:
    lines = ["| distribution | n | dp | mode | mb/rank | padding | imbalance | bound | mb imbalance | plan ms |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['distribution']} | {r['n']} | {r['dp']} | {r['mode']} | error | | | | | |")
            continue
        lines.append(f"| {r['distribution']} | {r['n']} | {r['dp']} | {r['mode']} | {r['microbatches_per_rank']} | "
                     f"{r['padding_fraction']:.2%} | {r['work_imbalance']:.4f} | {r['bound']:.3f} | "
                     f"{r['microbatch_imbalance']:.3f} | {r['plan_ms']:.1f} |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[tuple[str, Optional[bool]]]:
    """The issue's targets per case, each met (True), missed (False) or not run (None)."""
    checks = []
    cases = sorted({(r["distribution"], r["n"]) for r in rows}, key=lambda c: (DISTRIBUTIONS.index(c[0]), c[1]))
    for distribution, n in cases:
        by_mode = {r["mode"]: r for r in rows if (r["distribution"], r["n"]) == (distribution, n) and "error" not in r}
        work = by_mode.get("work")
        if work is None:
            checks.append((f"{distribution} n={n}: work mode planned", False))
            continue
        default = by_mode.get("NeMo-RL mffd", by_mode.get("nemo-rl"))
        name = "NeMo-RL mffd" if "NeMo-RL mffd" in by_mode else "nemo-rl mode"
        checks.append((f"{distribution} n={n}: padding {work['padding_fraction']:.2%} <= {name}'s "
                       f"{default['padding_fraction']:.2%}", work["padding_fraction"] <= default["padding_fraction"] + 1e-12))
        limit = max(1.02, work["bound"])
        checks.append((f"{distribution} n={n}: work imbalance {work['work_imbalance']:.4f} <= max(1.02, bound "
                       f"{work['bound']:.3f})", work["work_imbalance"] <= limit))
        if n >= 65536:
            checks.append((f"{distribution} n={n}: planned in {work['plan_ms'] / 1e3:.2f} s < 2 s", work["plan_ms"] < 2000))
    return checks


def main(argv=None, packers: Optional[dict] = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m profiling.bench.bench_planner",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", choices=tuple(SIZES), default=list(SIZES))
    ap.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    ap.add_argument("--counts", nargs="+", type=int, default=None, help="batch sizes (default: each size's own)")
    ap.add_argument("--nemo-rl", default=None, metavar="PATH", help="a NeMo-RL checkout: add its FFD and MFFD packers")
    ap.add_argument("--reps", type=int, default=20,
                    help="timed plans per case up to 4096 sequences (above: a fifth, at least 3; NeMo-RL's packers 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--markdown", default=None, help="also write the table as markdown to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    packers = dict(packers or {})
    if args.nemo_rl:
        packers.update(load_nemo_rl_packers(args.nemo_rl))
    print(f"machine: {machine_description()}; hidden {HIDDEN}; seed {args.seed}")
    rows = []
    for size_name in args.sizes:
        size = SIZES[size_name]
        for distribution in args.distributions:
            for n in args.counts or size["counts"]:
                rows += measure_case(distribution, n, size, packers, args.seed, args.reps)
    print(format_rows(rows))
    checks = targets(rows)
    for text, ok in checks:
        print(f"target {'met' if ok else ('not run' if ok is None else 'MISSED')}: {text}")
    per_item = {r["n"]: r["plan_ms"] / (r["n"] * math.log2(r["n"])) for r in rows if r.get("mode") == "work"
                and r.get("plan_ms") and r["distribution"] == args.distributions[0]}
    if per_item:
        print("plan time / (n log2 n), work mode, " + args.distributions[0] + ": "
              + ", ".join(f"n={n}: {v * 1e3:.2f} us" for n, v in sorted(per_item.items())))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_description(), "rows": rows,
                                               "targets": [{"target": t, "met": ok} for t, ok in checks]}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(rows) + "\n")
    return rows


if __name__ == "__main__":
    main()
