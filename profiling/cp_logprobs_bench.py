"""Token log-probs from CP-sharded packed logits: nn_data vs the naive path, side by side in one run.

    python -m profiling.cp_logprobs_bench [--cp 2] [--vocab 32000] [--rows 8] [--seq-len 512]

Spawns ``--cp`` ranks over gloo on 127.0.0.1 (one thread each). Every rank holds its
zigzag shard of the packed logits ``[1, T/C, V]`` (float32) and the full packed ids.
Two paths produce the same ``[B, S]`` log-probs (NeMo-RL's layout; checked equal):

* ``nn_data``: :class:`nn_data.TokenLogProbs`: each rank's next-token log-probs on its
  shard (chunked log-sum-exp), one all-gather of ``[1, T/C]`` values, unpack to ``[B, S]``;
* ``naive``: all-gather the logits to ``[1, T, V]`` (:class:`nn_data.GatherFromContextParallel`),
  unpack to ``[B, S, V]`` (:class:`nn_data.UnpackSequences`), log-softmax, take each next
  token, prepend the zero column.

For each path, in inference (``torch.no_grad``) and training (forward + backward of a
weighted sum) mode, it reports the peak of bytes allocated during the call (max over
ranks; from the profiler's allocator events, so kernels' internal temporaries count; the
inputs are not included, the logits' gradient is) and the median wall time (max over
ranks, separate runs without the profiler, paths interleaved).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from nn_data import (
    GatherFromContextParallel,
    PackSequences,
    TokenLogProbs,
    UnpackSequences,
)
from nn_data.testing.dist import free_port, init_gloo

MiB = 2**20


def naive_logprobs(local, ids, cu, cu_pad, lengths, seq_len, group):
    """Gather ``[1, T, V]``, unpack ``[B, S, V]``, log-softmax, pick the next tokens, prepend zeros."""
    full = GatherFromContextParallel(group, validate=False)(local, cu_pad)  # [1, T, V]
    rows = UnpackSequences(seq_len, validate=False)(full, lengths, cu_pad)  # [B, S, V]
    row_ids = UnpackSequences(seq_len, validate=False)(ids, lengths, cu_pad)  # [B, S]
    lp = torch.log_softmax(rows[:, :-1], dim=-1).gather(2, row_ids[:, 1:, None]).squeeze(2)  # [B, S-1]
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)  # [B, S]
    return lp * (torch.arange(seq_len) < lengths[:, None])


def peak_allocated(fn) -> int:
    """Peak of bytes allocated (net) while ``fn`` runs, from the profiler's allocator events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
    cur = best = 0
    for _, size in sorted(events):
        cur += size
        best = max(best, cur)
    return best


def make_inputs(args, rank):
    gen = torch.Generator().manual_seed(1234)
    lengths = torch.randint(args.seq_len // 4, args.seq_len + 1, (args.rows,), generator=gen)
    ids = torch.randint(0, args.vocab, (args.rows, args.seq_len), generator=gen)
    total = args.rows * args.seq_len  # pad_full_seq_to: the static capacity
    r = PackSequences(2 * args.cp, 2 * args.cp, total)(ids, lengths)
    local = torch.randn(1, total // args.cp, args.vocab, generator=torch.Generator().manual_seed(rank))
    weight = torch.randn(args.rows, args.seq_len, generator=gen)
    return r, lengths, local, weight


def rank_main(rank, args, port, out_queue):
    torch.set_num_threads(args.threads)
    init_gloo(rank, args.cp, port)
    group = dist.group.WORLD
    r, lengths, local, weight = make_inputs(args, rank)
    ids, cu, cu_pad = r.packed, r.cu_seqlens, r.cu_seqlens_padded
    op = TokenLogProbs(args.seq_len, cp_group=group, chunk_tokens=args.chunk, validate=False)
    paths = {
        "nn_data": lambda x: op(x, ids, cu, cu_pad),
        "naive": lambda x: naive_logprobs(x, ids, cu, cu_pad, lengths, args.seq_len, group),
    }
    with torch.no_grad():
        a, b = paths["nn_data"](local), paths["naive"](local)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    def call(path, mode):
        if mode == "inference":
            with torch.no_grad():
                paths[path](local)
            return
        x = local.detach().requires_grad_()  # a leaf sharing local's storage: nothing copied
        (paths[path](x) * weight).sum().backward()  # allocates x.grad [1, T/C, V], counted

    results = {}
    for mode in ("inference", "training"):
        for path in paths:
            call(path, mode)  # warm-up
            dist.barrier()
            results[(path, mode, "peak")] = peak_allocated(lambda: call(path, mode))
        times = {p: [] for p in paths}
        for _ in range(args.repeats):
            for path in paths:  # interleaved, so load drift hits both paths alike
                dist.barrier()
                t = time.perf_counter()
                call(path, mode)
                times[path].append(time.perf_counter() - t)
        for path in paths:
            results[(path, mode, "time")] = statistics.median(times[path])
    # max over ranks
    keys = sorted(results)
    vec = torch.tensor([float(results[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    if rank == 0:
        out_queue.put({"|".join(k): v for k, v in zip(keys, vec.tolist())})
    dist.barrier()
    dist.destroy_process_group()


def report(args, res):
    total = args.rows * args.seq_len
    fp32 = 4
    sizes = {
        "local logits [1,T/C,V]": total // args.cp * args.vocab * fp32,
        "gathered logits [1,T,V]": total * args.vocab * fp32,
        "unpacked logits [B,S,V]": args.rows * args.seq_len * args.vocab * fp32,
    }
    lines = [
        f"C={args.cp} ranks over gloo, B={args.rows}, S={args.seq_len}, T=pad_full_seq_to={total}, "
        f"V={args.vocab}, float32 logits, {args.threads} thread(s) per rank, chunk_tokens={args.chunk}, "
        f"median of {args.repeats}",
        f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "sizes: " + ", ".join(f"{k} = {v / MiB:.0f} MiB" for k, v in sizes.items()),
        "",
        "| mode | path | peak allocated (MiB) | time (ms) |",
        "| --- | --- | ---: | ---: |",
    ]
    for mode in ("inference", "training"):
        for path in ("nn_data", "naive"):
            peak, t = res[f"{path}|{mode}|peak"], res[f"{path}|{mode}|time"]
            lines.append(f"| {mode} | {path} | {peak / MiB:.1f} | {1000 * t:.1f} |")
        ratio_m = res[f"naive|{mode}|peak"] / max(res[f"nn_data|{mode}|peak"], 1)
        ratio_t = res[f"naive|{mode}|time"] / res[f"nn_data|{mode}|time"]
        lines.append(f"| {mode} | naive / nn_data | {ratio_m:.1f}x | {ratio_t:.1f}x |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the raw figures here")
    args = ap.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, port, q)) for r in range(args.cp)]
    for p in procs:
        p.start()
    res = q.get()
    for p in procs:
        p.join()
    print(report(args, res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
