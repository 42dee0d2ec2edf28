"""Run a small causal transformer on packed (and, with --cp, context-parallel) tokens with
nn_data.PackedForward, and compare every sequence with running it alone.

    python -m scripts.packed_forward_example              # one process, CPU
    python -m scripts.packed_forward_example --cp 2       # two ranks over gloo on 127.0.0.1

Prints, for each microbatch, the largest difference between the packed outputs and the
per-sequence outputs, and the time of both paths (wall clock on this machine, after one
untimed warm-up call). The packed path runs all T = pad_full_seq_to positions, padding
included, with a dense [T/C, T] attention mask: it shows exactness, not speed.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from nn_data.models import TinyCausalLM
from nn_data.packed_forward import PackedForward
from nn_data.testing.dist import free_port, init_gloo


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def make_batches(args, gen: torch.Generator):
    """Microbatches of random lengths (zero-length rows included) and a constant pad_full_seq_to."""
    multiple = max(args.multiple, 2 * args.cp)
    full = _round_up(args.rows * _round_up(args.seq_len, multiple), multiple)
    for _ in range(args.microbatches):
        rows = int(torch.randint(1, args.rows + 1, (), generator=gen))
        lengths = torch.randint(0, args.seq_len + 1, (rows,), generator=gen)
        ids = torch.randint(1, args.vocab, (rows, args.seq_len), generator=gen)
        yield torch.where(torch.arange(args.seq_len) < lengths[:, None], ids, 0), lengths, multiple, full


def run(args, rank: int = 0, group=None) -> None:
    torch.manual_seed(args.seed)
    model = TinyCausalLM(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers).eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{'mb':>3} {'rows':>4} {'tokens':>6} {'T':>5} {'max |packed - alone|':>21} {'packed ms':>10} {'alone ms':>9}")
    for i, (ids, lengths, multiple, full) in enumerate(make_batches(args, gen)):
        packed = PackedForward(model, pad_individual_seqs_to_multiple_of=multiple, pad_full_seq_to=full,
                               cp_group=group)
        with torch.no_grad():
            if i == 0:  # warm-up (first-call allocations, gloo connection set-up), not timed
                packed(ids, lengths)
                model.forward_single(ids[:1, :1])
            start = time.perf_counter()
            out = packed(ids, lengths)
            t_packed = time.perf_counter() - start
            start = time.perf_counter()
            worst = 0.0
            for b, n in enumerate(lengths.tolist()):
                if n:
                    alone = model.forward_single(ids[b : b + 1, :n])[0]
                    worst = max(worst, (out[b, :n] - alone).abs().max().item())
            t_alone = time.perf_counter() - start
        say(f"{i:>3} {len(lengths):>4} {int(lengths.sum()):>6} {full:>5} {worst:>21.2e} "
            f"{t_packed * 1e3:>10.1f} {t_alone * 1e3:>9.1f}")
    say("the 'alone' column runs each sequence separately; 'packed' includes the CP collectives" if group else
        "the 'alone' column runs each sequence separately")


def _rank_main(rank: int, args, port: int) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    init_gloo(rank, args.cp, port)
    try:
        run(args, rank, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks to spawn (gloo, CPU); default 1")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8, help="most sequences per microbatch")
    ap.add_argument("--seq-len", type=int, default=64, help="row length S")
    ap.add_argument("--multiple", type=int, default=8, help="pad_individual_seqs_to_multiple_of (raised to 2*cp)")
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cp == 1:
        run(args)
        return
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(args, free_port()), nprocs=args.cp, join=True)


if __name__ == "__main__":
    main()
