"""Shared-prefix packing against rollouts packed end to end: tokens and modelled work per GRPO step, and a
tiny model's CPU forward + backward on the same rollouts.

    python -m profiling.bench.bench_shared_prefix                          # (a) tokens and work, every step
    python -m profiling.bench.bench_shared_prefix --markdown profiling/results/shared_prefix.md
    python -m profiling.bench.bench_shared_prefix --part wall --threads 1  # (b) CPU wall time, side by side
    python -m profiling.bench.bench_shared_prefix --part all --smoke       # both, tiny sizes (the test's run)

(a) **Tokens and work** (pure arithmetic, deterministic: seeded lengths, no timing). Each step holds
``--groups`` GRPO groups (32) of ``G`` rollouts that share a prompt of ``P`` tokens; responses are
lognormal (bench_planner.sample: median 512, sigma 1, at most 4,096, here at least 128; "~512" and
"~128": sigma 0.25 around 512 or 128). The step is planned on 8 data-parallel ranks, CP 2 (each slot
padded to a multiple of 4), ``T = 16384``, twice: every rollout packed whole (``plan_step``: end to end)
and each group's prompt once per microbatch (``plan_step_shared_prefix``: shared). Printed for each:
real tokens (unpadded, what the layers run on), padded tokens (each sequence, or slot, rounded up to
the multiple) and packed positions (``dp x microbatches x T``, what the step computes on); the
modelled attention work (``sequence_work``'s ``L^2`` per sequence, twice its causal query-key pairs:
a rollout end to end ``L^2``, a shared prompt ``P^2``, a response of ``R = L - P`` tokens, whose queries
see the prompt's keys and causally their own, ``2RP + R^2 = L^2 - P^2``; the linear layers go with the
real tokens) and the step's work (the slowest
rank, with the linear term of hidden size 4096: what the ranks wait for); the prompts packed (groups,
plus the copies of a group split over microbatches). The target: >= 3x fewer real tokens at prompt
2,048 / G 8 / responses ~512.

(b) **CPU wall time**: a tiny Llama-style model (``nn_data.models.tiny_hf``, ``--hidden``, ``--layers``)
runs forward + backward through ``PackedForward(HFCausalLMAdapter(model))`` on one microbatch of
``--wall-groups`` groups (prompt ``--wall-prompt`` 512, G 8, responses ~128), end to end
(``(ids, lengths)``) and shared (``(ids, lengths, prefix_lengths=, group_ids=)``), side by side in one run
(profiling.timing.time_side_by_side), ``--threads`` 1; printed: median ms (p10-p90), end to end / shared,
and the largest |logits shared - end to end| (the two must agree); the target: >= 2x. Timings on a loaded machine mean
little: record them from a quiet one.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from nn_data.planning import Parallelism, plan_step, plan_step_shared_prefix
from profiling.bench.bench_planner import sample
from profiling.timing import machine_description, time_side_by_side

HIDDEN, TOTAL, MAX_RESPONSE = 4096, 16384, 4096
PARALLELISM = Parallelism(dp=8, cp=2)
TARGET = ("P 2048, G 8, responses ~512", 3.0)  # the step whose real tokens must shrink >= 3x
WALL_TARGET = 2.0  # (b): forward + backward at prompt 512 / G 8 / responses ~128, end to end / shared
# (name, prompt length or "mixed" (uniform in [256, 4096] per group), G or "mixed" (4, 8 or 16 per group),
#  the responses' (median, sigma)); the grid: prompts 256-4,096 x G 4-16, lognormal responses 128-4,096.
STEPS = [(TARGET[0], 2048, 8, (512, 0.25)), ("P 512, G 8, responses ~128", 512, 8, (128, 0.25))]
STEPS += [(f"P {p}, G {g}, lognormal responses", p, g, (512, 1.0)) for p in (256, 1024, 2048, 4096) for g in (4, 8, 16)]
STEPS += [("mixed P 256-4096, G 4-16, lognormal responses", "mixed", "mixed", (512, 1.0))]


def grpo_step(prompt, group_size, responses: tuple, *, groups: int, seed: int):
    """``(lengths, prefix_lengths, group_ids)`` of one seeded step of ``groups`` groups (module docstring);
    responses lognormal with ``responses = (median, sigma)``, in ``[min(128, median), 4096]``."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(256, 4097, groups) if prompt == "mixed" else np.full(groups, prompt)
    sizes = rng.choice([4, 8, 16], groups) if group_size == "mixed" else np.full(groups, group_size)
    median, sigma = responses
    n = int(sizes.sum())
    drawn = sample("lognormal", n, 8 * median, seed, sigma=sigma)  # median (8 * median) / 8
    response = np.clip(drawn, min(128, median), MAX_RESPONSE)
    prefix = np.repeat(prompts, sizes).astype(np.int64)
    return prefix + response, prefix, np.repeat(np.arange(groups), sizes)


def compare(lengths, prefix, group_ids, parallelism: Parallelism = PARALLELISM, total: int = TOTAL,
            hidden: int = HIDDEN) -> dict:
    """The two plans' figures (module docstring) for one step."""
    plans = {"end to end": plan_step(lengths, parallelism, pad_full_seq_to=total, hidden_size=hidden),
             "shared": plan_step_shared_prefix(lengths, parallelism, group_ids=group_ids, prefix_lengths=prefix,
                                               pad_full_seq_to=total, hidden_size=hidden)}
    row = {"rollouts": len(lengths), "groups": len(set(np.asarray(group_ids).tolist()))}
    for name, plan in plans.items():
        work = float(sum(plan.rank_work))
        row[name] = {
            "real": plan.real_tokens,
            "padded": int(sum(sum(rank) for rank in plan.microbatch_tokens)),
            "packed": parallelism.dp * plan.microbatches_per_rank * total,
            "attention": work - 6.0 * hidden * plan.real_tokens,  # the linear term is 6h per real token
            "step_work": max(plan.rank_work, default=0.0),
            "prompts": sum(len({int(group_ids[b]) for b in mb}) for rank in plan.ranks for mb in rank),
        }
    return row


def token_rows(groups: int) -> list[dict]:
    rows = []
    for seed, (name, prompt, size, responses) in enumerate(STEPS):
        row = compare(*grpo_step(prompt, size, responses, groups=groups, seed=seed))
        rows.append({"step": name, **row})
    return rows


def _ratio(row: dict, key: str) -> float:
    shared = row["shared"][key]
    return row["end to end"][key] / shared if shared else float("inf")


def format_markdown(rows: list[dict]) -> str:
    head = ("| step | rollouts (groups) | real tokens: end to end / shared | padded | packed (dp x mb x T) | "
            "attention work | step work (slowest rank) | prompts packed |\n| --- | ---: | ---: | ---: | ---: | ---: "
            "| ---: | ---: |")
    lines = [head]
    for r in rows:
        e, s = r["end to end"], r["shared"]
        lines.append(f"| {r['step']} | {r['rollouts']} ({r['groups']}) | {e['real']:,} / {s['real']:,} "
                     f"(**{_ratio(r, 'real'):.2f}x**) | {e['padded']:,} / {s['padded']:,} ({_ratio(r, 'padded'):.2f}x) "
                     f"| {e['packed']:,} / {s['packed']:,} ({_ratio(r, 'packed'):.2f}x) "
                     f"| {_ratio(r, 'attention'):.2f}x "
                     f"| {_ratio(r, 'step_work'):.2f}x | {s['prompts']} |")
    return "\n".join(lines)


def token_targets(rows: list[dict]) -> list[str]:
    name, floor = TARGET
    row = next((r for r in rows if r["step"] == name), None)
    if row is None:
        return []
    met = _ratio(row, "real") >= floor
    return [f"target: {name}: {_ratio(row, 'real'):.2f}x fewer real tokens (>= {floor}x) "
            f"{'target met' if met else 'target MISSED'}"]


def wall_microbatch(*, groups: int, prompt: int, group_size: int, response_median: int, vocab: int, seed: int = 0):
    """``(ids [B, S], lengths [B], prefix_lengths [B], group_ids [B])``: each group's rollouts share their
    prompt's tokens; responses ~``response_median`` (sigma 0.25), random tokens, seeded."""
    lengths, prefix, gid = grpo_step(prompt, group_size, (response_median, 0.25), groups=groups, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    width = int(lengths.max())
    ids = torch.randint(1, vocab, (len(lengths), width), generator=gen)
    prompts = torch.randint(1, vocab, (groups, prompt), generator=gen)  # [groups, P]
    group = torch.as_tensor(gid)
    ids[:, :prompt] = prompts[group]  # [B, P]: every rollout starts with its group's prompt
    lengths_t = torch.as_tensor(lengths)
    ids = torch.where(torch.arange(width) < lengths_t[:, None], ids, 0)
    return ids, lengths_t, torch.as_tensor(prefix), group


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The wall part's tiny model (``--hidden``, ``--layers``), repetitions and threads."""
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)


def forward_backward(model, microbatches: list):
    """A callable that runs one step's forward + backward through ``PackedForward(HFCausalLMAdapter(model))``
    over ``microbatches`` (``[(ids [B, S], lengths [B], call kwargs)]``, each its own call, as a planner's
    microbatches: the keywords say how it is packed), returning each one's ``[B, S, V]`` logits (detached)."""
    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.packed_forward import PackedForward

    wrapped = PackedForward(HFCausalLMAdapter(model))

    def step():
        model.zero_grad(set_to_none=True)
        outs = []
        for ids, lengths, call in microbatches:
            out = wrapped(ids, lengths, **call)  # [B, S, V]
            valid = (torch.arange(ids.shape[1]) < lengths[:, None]).unsqueeze(-1)  # [B, S, 1]
            (out * valid).square().mean().backward()
            outs.append(out.detach())
        return outs

    return step


def side_by_side_lines(model, modes: dict, real: dict, *, reps: int) -> tuple[list[str], float]:
    """Time ``modes`` (name -> its microbatches, as :func:`forward_backward`; the first the baseline, the
    second the packing under test, over the same rollouts) side by side in one run
    (profiling.timing.time_side_by_side). ``(lines, speedup)``: per mode its real tokens (``real``) and
    median ms (p10-p90); then baseline / other as a time ratio beside the token ratio, and the largest
    |logits other - baseline| over the rollouts' tokens (they must agree)."""
    fns = {name: forward_backward(model, batches) for name, batches in modes.items()}
    outs = {name: fn() for name, fn in fns.items()}
    base, other = list(modes)
    error = 0.0
    for (ids, lengths, _), a, b in zip(modes[base], outs[base], outs[other]):
        valid = (torch.arange(ids.shape[1]) < lengths[:, None]).unsqueeze(-1)  # [B, S, 1]
        error = max(error, float(((b - a) * valid).abs().max()))
    timings = time_side_by_side(fns, warmup=1, reps=reps)
    lines = [f"  {name:<11} {real[name]:>7,} tokens  {t.median_s * 1e3:9.1f} ms  "
             f"(p10-p90 {t.p10_s * 1e3:.1f}-{t.p90_s * 1e3:.1f})" for name, t in timings.items()]
    speedup = timings[base].median_s / timings[other].median_s
    lines.append(f"  {base} / {other}: {speedup:.2f}x time, {real[base] / max(real[other], 1):.2f}x real tokens; "
                 f"max |logits {other} - {base}| {error:.1e}")
    return lines, speedup


def wall_lines(args) -> list[str]:
    from nn_data.models.tiny_hf import tiny_hf_model

    model = tiny_hf_model("llama", hidden=args.hidden, layers=args.layers, ffn=2 * args.hidden)
    ids, lengths, prefix, group = wall_microbatch(groups=args.wall_groups, prompt=args.wall_prompt,
                                                  group_size=args.wall_group_size, response_median=args.wall_response,
                                                  vocab=model.config.vocab_size)
    modes = {"end to end": [(ids, lengths, {})],
             "shared": [(ids, lengths, dict(prefix_lengths=prefix, group_ids=group))]}
    real = {"end to end": int(lengths.sum()),
            "shared": int((lengths - prefix).sum()) + args.wall_prompt * args.wall_groups}
    timed, speedup = side_by_side_lines(model, modes, real, reps=args.reps)
    lines = [f"wall: {len(lengths)} rollouts ({args.wall_groups} groups, prompt {args.wall_prompt}, G "
             f"{args.wall_group_size}, responses ~{args.wall_response}), tiny llama hidden {args.hidden}, "
             f"{args.layers} layers, {torch.get_num_threads()} thread(s), forward + backward"] + timed
    if not args.smoke:  # the target is at the default sizes
        lines.append(f"target: forward + backward >= {WALL_TARGET}x faster shared: {speedup:.2f}x "
                     f"{'target met' if speedup >= WALL_TARGET else 'target MISSED'}")
    return lines


def main(argv: Optional[list] = None) -> list[str]:
    ap = argparse.ArgumentParser(prog="python -m profiling.bench.bench_shared_prefix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("tokens", "wall", "all"), default="tokens")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the test's run)")
    ap.add_argument("--groups", type=int, default=32, help="(a) groups per step")
    ap.add_argument("--markdown", default=None, help="(a) also write the table to this file")
    ap.add_argument("--wall-groups", type=int, default=1)
    ap.add_argument("--wall-prompt", type=int, default=512)
    ap.add_argument("--wall-group-size", type=int, default=8)
    ap.add_argument("--wall-response", type=int, default=128)
    add_model_arguments(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.groups, args.wall_groups, args.wall_prompt, args.wall_group_size = 8, 2, 24, 3  # a group per rank
        args.wall_response, args.hidden, args.layers, args.reps = 8, 32, 1, 1
    torch.set_num_threads(args.threads)
    lines = [machine_description()]
    if args.part in ("tokens", "all"):
        rows = token_rows(args.groups)
        table = format_markdown(rows)
        lines += table.splitlines() + token_targets(rows)
        if args.markdown:
            Path(args.markdown).write_text(table + "\n")
    if args.part in ("wall", "all"):
        lines += wall_lines(args)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
