"""Rollout trees against prompt-only sharing and rollouts packed end to end: real tokens per workload, a tiny
model's CPU forward + backward side by side, and the cost of finding the tree from the token ids.

    python -m profiling.bench.bench_rollout_trees                           # (a) tokens, every workload
    python -m profiling.bench.bench_rollout_trees --part wall --threads 1   # (b) CPU wall time, side by side (minutes)
    python -m profiling.bench.bench_rollout_trees --part finder             # (c) find_rollout_tree, 64 x 8K
    python -m profiling.bench.bench_rollout_trees --part all --smoke        # all three, tiny sizes (the test)

(a) **Tokens** (arithmetic on seeded workloads, no timing). *Agentic*: ``--groups`` groups (32), each a prompt
of ``P`` tokens sampled ``G`` times; the first rollout of a group runs ``k`` turns (uniform in 2-6) of 64-1,024
tokens each (uniform); every later rollout, with probability ``q``, re-samples an earlier rollout of its group
from a random turn (it shares the prompt and that rollout's turns before it, then runs its own turns up to its
``k``), else starts from the prompt. *Multi-turn SFT*: a conversation (a system prompt of ``P`` tokens, ``k``
turns) gives ``k`` samples, each a prefix of the next. Real tokens packed: end to end (``sum L``), prompt-only
(each group's prompt once: ``shared_prefix_layout``) and tree (every shared prefix once: ``tree_layout`` with
the tree ``find_rollout_tree`` finds from the tokens; the tree's tokens ``sum L - sum branch_at``). The target:
real tokens on the agentic workloads >= 1.5x fewer than prompt-only.

(b) **CPU wall time**: a tiny Llama-style model (``--hidden`` 128, ``--layers`` 2) runs one step's forward +
backward through ``PackedForward(HFCausalLMAdapter(model))`` over ``--wall-groups`` 4 agentic groups from the
high-sharing end of (a) (prompt 512-1,024, G 8-16, ``q`` 0.7; turns of 64-256 tokens, ``--wall-turn``: the
CPU's dense attention mask is ``[T, T]``), one microbatch per group, prompt-only (``prefix_lengths=,
group_ids=``) and as a tree (``parent=, branch_at=``), side by side in one run
(``bench_shared_prefix.side_by_side_lines``); printed: each mode's real tokens and median ms (p10-p90),
prompt-only / tree as a time ratio beside the real-token ratio of the timed set, and the largest
|logits tree - prompt-only| (they must agree). The target: >= 1.3x. Timings on a loaded machine mean
little: say so beside them.

(c) **Finding the tree**: ``find_rollout_tree`` on 64 rollouts of 8,192 tokens (one agentic group: a prompt of
2,048, turns re-sampled as in (a)); median of ``--reps`` calls, in ms.
"""

from __future__ import annotations

import argparse
from typing import Optional

import numpy as np
import torch

from nn_data.planning import find_rollout_tree
from profiling.bench.bench_shared_prefix import add_model_arguments, side_by_side_lines
from profiling.timing import machine_description, time_side_by_side

TOKEN_TARGET, WALL_TARGET = 1.5, 1.3
# (name, prompt range, G range, branching probability q)
AGENTIC = [(f"agentic P {p[0]}-{p[1]}, G {g[0]}-{g[1]}, q {q}", p, g, q)
           for p in ((512, 1024), (2048, 4096)) for g in ((4, 8), (8, 16)) for q in (0.3, 0.7)]


def agentic_group(rng: np.random.Generator, prompt: int, group_size: int, q: float, turns=(2, 6),
                  turn_len=(64, 1024)) -> list:
    """One group's rollouts as lists of segment ids ``(owner, turn)`` with their lengths: ``[(segments,
    lengths)]`` (module docstring). Segment ``(-1, 0)`` is the prompt."""
    out = []
    for g in range(group_size):
        k = int(rng.integers(turns[0], turns[1] + 1))
        if g and rng.random() < q:
            src_segments, src_lengths = out[int(rng.integers(0, g))]
            j = int(rng.integers(1, len(src_segments)))  # keep the prompt and the source's turns before j
            segments, lengths = list(src_segments[:j]), list(src_lengths[:j])
        else:
            segments, lengths = [(-1, 0)], [prompt]
        while len(segments) <= k:
            segments.append((g, len(segments)))
            lengths.append(int(rng.integers(turn_len[0], turn_len[1] + 1)))
        out.append((segments, lengths))
    return out


def token_ids(group: list, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [G, S], lengths [G])``: every segment its own random tokens, shared segments the same."""
    rng = np.random.default_rng(seed)
    tokens: dict = {}
    rows = []
    for segments, lengths in group:
        rows.append(np.concatenate([tokens.setdefault(s, rng.integers(1, 50000, n)) for s, n in zip(segments, lengths)]))
    lengths = np.array([len(r) for r in rows])
    ids = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids, lengths


def counts(groups: list, seed: int) -> dict:
    """Real tokens end to end, prompt-only and as the tree find_rollout_tree finds, over ``groups``."""
    flat = prompt_only = tree = 0
    for i, group in enumerate(groups):
        ids, lengths = token_ids(group, seed + i)
        prompt = group[0][1][0]
        found = find_rollout_tree(ids, lengths)
        flat += int(lengths.sum())
        prompt_only += int(lengths.sum()) - prompt * (len(lengths) - 1)
        tree += int(lengths.sum() - found.branch_at.sum())
    return {"end to end": flat, "prompt-only": prompt_only, "tree": tree}


def sft_conversation(rng: np.random.Generator, prompt: int) -> list:
    """A multi-turn SFT conversation as ``k`` samples, each the one before plus a turn (the prompt first)."""
    k = int(rng.integers(2, 7))
    lengths = [prompt] + [int(rng.integers(64, 1025)) for _ in range(k)]
    segments = [(0, t) for t in range(k + 1)]
    return [(segments[: j + 2], lengths[: j + 2]) for j in range(k)]


def token_rows(groups: int, seed: int = 0) -> list[dict]:
    rows = []
    for name, (p_lo, p_hi), (g_lo, g_hi), q in AGENTIC:
        rng = np.random.default_rng(seed)
        step = [agentic_group(rng, int(rng.integers(p_lo, p_hi + 1)), int(rng.integers(g_lo, g_hi + 1)), q)
                for _ in range(groups)]
        rows.append({"name": name, "agentic": True, **counts(step, seed)})
    for p_lo, p_hi in ((512, 1024), (2048, 4096)):
        rng = np.random.default_rng(seed)
        step = [sft_conversation(rng, int(rng.integers(p_lo, p_hi + 1))) for _ in range(groups)]
        rows.append({"name": f"multi-turn SFT P {p_lo}-{p_hi}, 2-6 turns", "agentic": False, **counts(step, seed)})
    return rows


def token_lines(rows: list[dict]) -> list[str]:
    lines = ["| workload | end to end | prompt-only | tree | prompt-only / tree | end to end / tree |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['end to end']:,} | {r['prompt-only']:,} | {r['tree']:,} | "
                     f"{r['prompt-only'] / r['tree']:.2f}x | {r['end to end'] / r['tree']:.2f}x |")
    worst = min(r["prompt-only"] / r["tree"] for r in rows if r["agentic"])
    lines.append(f"target: agentic real tokens >= {TOKEN_TARGET}x fewer than prompt-only: the least {worst:.2f}x "
                 f"{'target met' if worst >= TOKEN_TARGET else 'target MISSED'} (per workload above)")
    return lines


def wall_microbatches(args, vocab: int) -> list:
    """``--wall-groups`` agentic groups (prompt, G in the ``--wall-prompt`` / ``--wall-group-size`` ranges,
    ``--wall-q``, turns of 64 to ``--wall-turn`` tokens), seeded: ``[(ids [G, S], lengths [G], prompt,
    parent [G], branch_at [G])]``, one microbatch per group, its tree found from its tokens."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(args.wall_groups):
        prompt = int(rng.integers(args.wall_prompt[0], args.wall_prompt[1] + 1))
        size = int(rng.integers(args.wall_group_size[0], args.wall_group_size[1] + 1))
        ids, lengths = token_ids(agentic_group(rng, prompt, size, args.wall_q, turn_len=(64, args.wall_turn)), 1 + i)
        lengths_t = torch.as_tensor(lengths)
        ids = torch.as_tensor(ids % (vocab - 1) + 1) * (torch.arange(ids.shape[1]) < lengths_t[:, None])
        found = find_rollout_tree(ids, lengths)
        out.append((ids, lengths_t, prompt, torch.as_tensor(found.parent), torch.as_tensor(found.branch_at)))
    return out


def wall_lines(args) -> list[str]:
    from nn_data.models.tiny_hf import tiny_hf_model

    model = tiny_hf_model("llama", hidden=args.hidden, layers=args.layers, ffn=2 * args.hidden)
    groups = wall_microbatches(args, model.config.vocab_size)
    modes = {"prompt-only": [(ids, n, dict(prefix_lengths=torch.full(n.shape, p), group_ids=torch.zeros_like(n)))
                             for ids, n, p, _, _ in groups],
             "tree": [(ids, n, dict(parent=parent, branch_at=at)) for ids, n, _, parent, at in groups]}
    real = {"prompt-only": sum(int(n.sum()) - p * (len(n) - 1) for _, n, p, _, _ in groups),
            "tree": sum(int((n - at).sum()) for _, n, _, _, at in groups)}
    timed, speedup = side_by_side_lines(model, modes, real, reps=args.reps)
    rollouts = sum(len(n) for _, n, _, _, _ in groups)
    lines = [f"wall: {args.wall_groups} agentic groups, one microbatch each, {rollouts} rollouts (prompt "
             f"{args.wall_prompt[0]}-{args.wall_prompt[1]}, G {args.wall_group_size[0]}-{args.wall_group_size[1]}, "
             f"turns 64-{args.wall_turn}, q {args.wall_q}), tiny llama hidden {args.hidden}, {args.layers} layers, "
             f"{torch.get_num_threads()} thread(s), forward + backward of the whole set"] + timed
    if not args.smoke:
        lines.append(f"target: forward + backward >= {WALL_TARGET}x faster as a tree: {speedup:.2f}x "
                     f"{'target met' if speedup >= WALL_TARGET else 'target MISSED'}")
    return lines


def finder_lines(args) -> list[str]:
    rng = np.random.default_rng(2)
    rows, length = (8, 512) if args.smoke else (64, 8192)
    group = agentic_group(rng, length // 4, rows, 0.7, turns=(6, 6), turn_len=(length // 8, length // 8))
    ids, lengths = token_ids(group, 2)
    ids, lengths = ids[:, :length], np.minimum(lengths, length)
    found = find_rollout_tree(ids, lengths)
    timing = time_side_by_side({"find": lambda: find_rollout_tree(ids, lengths)}, warmup=0, reps=args.reps)["find"]
    shared = int(found.branch_at.sum())
    return [f"find_rollout_tree: {rows} rollouts of {length:,} tokens ({shared:,} shared tokens found): median "
            f"{timing.median_s * 1e3:.1f} ms over {args.reps} calls (p10-p90 {timing.p10_s * 1e3:.1f}-"
            f"{timing.p90_s * 1e3:.1f})"]


def main(argv: Optional[list] = None) -> list[str]:
    ap = argparse.ArgumentParser(prog="python -m profiling.bench.bench_rollout_trees", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("tokens", "wall", "finder", "all"), default="tokens")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the test's run)")
    ap.add_argument("--groups", type=int, default=32, help="(a) groups (or conversations) per workload")
    ap.add_argument("--wall-groups", type=int, default=4, help="(b) agentic groups timed, one microbatch each")
    ap.add_argument("--wall-prompt", type=int, nargs=2, default=(512, 1024), help="(b) prompt length range")
    ap.add_argument("--wall-group-size", type=int, nargs=2, default=(8, 16), help="(b) G range")
    ap.add_argument("--wall-q", type=float, default=0.7, help="(b) branching probability")
    ap.add_argument("--wall-turn", type=int, default=256, help="(b) the longest turn (dense attention on a CPU)")
    add_model_arguments(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.groups, args.wall_groups, args.wall_prompt, args.wall_group_size = 2, 2, (32, 48), (3, 4)
        args.wall_turn = 72
        args.hidden, args.layers, args.reps = 32, 1, 2
    torch.set_num_threads(args.threads)
    lines = [f"machine: {machine_description()}"]
    if args.part in ("tokens", "all"):
        lines += token_lines(token_rows(args.groups))
    if args.part in ("wall", "all"):
        lines += wall_lines(args)
    if args.part in ("finder", "all"):
        lines += finder_lines(args)
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    main()
