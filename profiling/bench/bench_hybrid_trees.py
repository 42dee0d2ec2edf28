"""Hybrid models on rollout trees: the work of the packed tree against each rollout alone (torch's flop counter,
deterministic) and its CPU forward + backward time.

    python -m profiling.bench.bench_hybrid_trees                       # (a) flop ratios, every kind, both trees
    python -m profiling.bench.bench_hybrid_trees --part wall --threads 1   # (b) CPU time, tree vs each rollout alone

(a) **Work**: ``torch.utils.flop_counter.FlopCounterMode`` over one forward of
``PackedForward(HFCausalLMAdapter(model), verify="off")(ids, L, parent=, branch_at=)`` (the packing check
proves the model first, outside the counter) divided by the forwards of every rollout
alone (``model(input_ids=ids[b:b+1, :L[b]])``), beside the token ratio r (the tree's tokens over ``sum L``), for
tiny float32 models (``nn_data.models.tiny_hf``: hidden 64, 2 layers; Mamba-2 every layer a mixer) on
:func:`grpo_group` (a 192-token prompt, 8 rollouts of 12-24) and :func:`two_level` (that prompt, 2 first turns of
32, each with 4 second turns of 12-24). The target: flops <= 1.35 r + 0.02.

(b) **CPU wall time**: forward + backward of a token loss over a GRPO group (``--prompt`` 512, ``--group`` 8,
rollouts of ``--rollout`` ~128 tokens) through the packed tree and through each rollout alone, interleaved
(profiling.timing), tiny Qwen3-Next (no MoE) and Mamba-2, float32. Printed: median ms (p10-p90) of each and the
ratio. To set this beside another checkout of nn_data (e.g. the per-path mixers before), run the same command
with ``PYTHONPATH`` pointing at that checkout, alternating runs.
"""

from __future__ import annotations

import argparse
import warnings

import torch

KINDS = ("llama", "lfm2", "qwen3_next", "mamba2")


def grpo_group(prompt: int = 192, group: int = 8, low: int = 12, high: int = 24, seed: int = 0):
    """``(lengths, parent, branch_at)`` of a GRPO group as a depth-1 tree: rollout 0 holds the prompt."""
    gen = torch.Generator().manual_seed(seed)
    own = torch.randint(low, high + 1, (group,), generator=gen)
    lengths = prompt + own
    parent = torch.tensor([-1] + [0] * (group - 1))
    branch_at = torch.tensor([0] + [prompt] * (group - 1))
    return lengths, parent, branch_at


def two_level(prompt: int = 192, first: int = 32, turns: int = 2, fan: int = 4, low: int = 12, high: int = 24,
              seed: int = 0):
    """``(lengths, parent, branch_at)``: ``turns`` first turns of ``first`` tokens after the prompt (rollout 0
    and the next ``turns - 1`` branch at the prompt), each continued by ``fan`` second turns of ``low``-``high``
    tokens (the first of them the first turn's own rollout)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, parent, branch_at = [], [], []
    for t in range(turns):
        for f in range(fan):
            second = int(torch.randint(low, high + 1, (1,), generator=gen))
            lengths.append(prompt + first + second)
            if f == 0:
                parent.append(-1 if t == 0 else 0)
                branch_at.append(0 if t == 0 else prompt)
            else:
                parent.append(t * fan)
                branch_at.append(prompt + first)
    return torch.tensor(lengths), torch.tensor(parent), torch.tensor(branch_at)


def tree_ids(lengths, parent, branch_at, vocab: int, seed: int = 0) -> torch.Tensor:
    """``[B, S]`` random tokens, each rollout's first ``branch_at`` its parent's, 0 past its length."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (lengths.shape[0], int(lengths.max())), generator=gen)
    for b in range(lengths.shape[0]):
        if parent[b] >= 0:
            ids[b, : branch_at[b]] = ids[parent[b], : branch_at[b]]
    return torch.where(torch.arange(ids.shape[1]) < lengths[:, None], ids, 0)


def flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    # grad mode on (a forward's flops are the same): under no_grad, torch's module tracker (the counter's) fails
    # on a no-grad view of a parameter handed to a submodule, as transformers 5.25's hub-kernel layers are
    with counter:
        fn()
    return counter.get_total_flops()


def work_ratio(kind: str, tree) -> tuple:
    """``(token ratio, flop ratio)`` of the packed tree against every rollout alone."""
    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.models.tiny_hf import tiny_hf_model
    from nn_data.packed_forward import PackedForward

    lengths, parent, branch_at = tree
    model = tiny_hf_model(kind, moe=False)
    ids = tree_ids(lengths, parent, branch_at, model.config.vocab_size)
    adapter = HFCausalLMAdapter(model)
    # the packing check proves the model once, outside the counter; the counted forward runs without it (the
    # counter's module hooks are an edit the check's fingerprint sees, and the check's no-grad runs are not the
    # forward's work)
    PackedForward(adapter)(ids, lengths, parent=parent, branch_at=branch_at)
    counted = PackedForward(adapter, verify="off")
    packed = flops(lambda: counted(ids, lengths, parent=parent, branch_at=branch_at))
    alone = flops(lambda: [model(input_ids=ids[b : b + 1, :n], use_cache=False) for b, n in
                           enumerate(lengths.tolist())])
    tokens = int(lengths.sum() - branch_at.sum())
    return tokens / int(lengths.sum()), packed / alone


def work_lines() -> list:
    lines = ["model | tokens r (GRPO / two-level) | flops (GRPO / two-level) | bound 1.35 r + 0.02",
             "--- | --- | --- | ---"]
    for kind in KINDS:
        (r1, f1), (r2, f2) = work_ratio(kind, grpo_group()), work_ratio(kind, two_level())
        lines.append(f"{kind} | {r1:.3f} / {r2:.3f} | {f1:.3f} / {f2:.3f} | {1.35 * r1 + 0.02:.3f} / "
                     f"{1.35 * r2 + 0.02:.3f}")
    return lines


def wall_lines(kinds, prompt: int, group: int, rollout: int, reps: int) -> list:
    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.models.tiny_hf import tiny_hf_model
    from nn_data.packed_forward import PackedForward
    from profiling.timing import machine_description, time_side_by_side

    lines = [machine_description()]
    tree = grpo_group(prompt, group, rollout - rollout // 8, rollout + rollout // 8)
    lengths, parent, branch_at = tree
    for kind in kinds:
        model = tiny_hf_model(kind, moe=False).train()
        ids = tree_ids(*tree, model.config.vocab_size)
        wrapped = PackedForward(HFCausalLMAdapter(model))

        def packed():
            out = wrapped(ids, lengths, parent=parent, branch_at=branch_at)
            out.float().square().mean().backward()

        def alone():
            total = sum(model(input_ids=ids[b : b + 1, :n], use_cache=False).logits.float().square().mean()
                        for b, n in enumerate(lengths.tolist()))
            total.backward()

        times = time_side_by_side({"tree": packed, "alone": alone}, reps=reps)
        spans = (f"{name} {t.median_s * 1e3:.1f} ms ({t.p10_s * 1e3:.1f}-{t.p90_s * 1e3:.1f})"
                 for name, t in times.items())
        lines.append(f"{kind}: " + ", ".join(spans)
                     + f", alone / tree {times['alone'].median_s / times['tree'].median_s:.2f}x")
    return lines


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("work", "wall"), default="work")
    parser.add_argument("--kinds", nargs="+", default=["qwen3_next", "mamba2"])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--rollout", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    lines = work_lines() if args.part == "work" else wall_lines(args.kinds, args.prompt, args.group, args.rollout,
                                                                 args.reps)
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    main()
