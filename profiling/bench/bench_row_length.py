"""How should a compiled data path serve a stream whose row length ``S`` varies? Three ways,
side by side in one run, on the same microbatches:

    static     ``torch.compile(dynamic=False)``: one graph per distinct ``S`` (the speed reference;
               each new ``S`` recompiles, and ``fullgraph=True`` stops at the recompile limit)
    dynamic    ``S`` a symbolic size (``mark_unbacked(x, 1)``, what nn_data's entry points do):
               one graph for every ``S``, ``S = 0`` and ``1`` included
    capacity   rows padded to a fixed length capacity ``S_cap`` outside the graph: one static
               graph, but every tensor the graph reads or writes is ``S_cap`` long

Shape legend
    R   row capacity (rows the graphs see); B <= R real rows per microbatch
    S   row length of a microbatch (varies); S_cap = ``--max-len``
    T   packed length (``pad_full_seq_to``)
    O   features of the model stand-in's output per token

One microbatch: pad rows to ``R`` -> compiled pack ``[R, S] -> [1, T]`` -> model stand-in (eager,
``[1, T] -> [1, T, O]``) -> compiled unpack ``[1, T, O] -> [R, S, O]``. Run:
``python -m profiling.bench.bench_row_length`` (``--help`` for the sizes).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch._inductor.config
from torch._dynamo.testing import CompileCounterWithBackend

from nn_data import PackSequences, pad_to_row_capacity
from nn_data.rows import with_dynamic_row_length
from nn_data.unpack import unpack_sequences
from profiling.timing import machine_description, spread, timed_call, timed_result


def make_stream(args) -> list:
    """``(input_ids [B, S], lengths [B])`` microbatches: ``S`` cycles through 12 values in
    ``[S_cap/8, S_cap]``, lengths lognormal (median ``S/4``) in ``[1, S]``, rows while they fit ``T``."""
    rng = np.random.default_rng(args.seed)
    values = np.linspace(args.max_len // 8, args.max_len, 12).astype(int)
    stream = []
    for i in range(args.microbatches):
        seq_len = int(values[i % len(values)])
        lengths = []
        while len(lengths) < args.rows:
            n = int(np.clip(np.rint(rng.lognormal(np.log(seq_len / 4), 1.0)), 1, seq_len))
            if sum(-(-v // args.multiple) * args.multiple for v in lengths + [n]) > args.total:
                break
            lengths.append(n)
        lens = torch.tensor(lengths, dtype=torch.int64)
        ids = torch.from_numpy(rng.integers(1, 1000, size=(len(lengths), seq_len)))
        stream.append((torch.where(torch.arange(seq_len) < lens[:, None], ids, 0), lens))
    return stream


def build(args, mode: str):
    """``step(ids, lengths) -> [B, S, O]`` for ``mode``, and the list of compile counters."""
    pack = PackSequences(args.multiple, pad_full_seq_to=args.total)
    weight = torch.randn(1000, args.out_features, generator=torch.Generator().manual_seed(0))

    def prepare(x, lengths, num_rows):
        r = pack(x, lengths, num_rows)
        return r.packed, r.cu_seqlens_padded

    def finish(out, lengths, cu_pad, like):
        return unpack_sequences(out, lengths, cu_pad, like.shape[1])  # [R, S, O]

    counters = [CompileCounterWithBackend("inductor") for _ in range(2)]
    options = dict(fullgraph=True, dynamic=False if mode != "dynamic" else None)
    prepare_c = torch.compile(prepare, backend=counters[0], **options)
    finish_c = torch.compile(finish, backend=counters[1], **options)

    def step(ids, lengths):
        rows, seq_len = ids.shape
        if mode == "capacity":
            ids = torch.nn.functional.pad(ids, (0, args.max_len - seq_len))  # [B, S_cap]
        p = pad_to_row_capacity(ids, lengths, args.rows)
        x = with_dynamic_row_length(p.x) if mode == "dynamic" else p.x
        packed, cu_pad = prepare_c(x, p.seq_lengths, p.num_rows)
        out = weight[packed]  # the model stand-in, eager: [1, T, O]
        return finish_c(out, p.seq_lengths, cu_pad, x)[:rows, :seq_len]  # [B, S, O]

    return step, counters


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m profiling.bench.bench_row_length",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16, help="row capacity R")
    ap.add_argument("--max-len", type=int, default=512, help="largest S, and S_cap")
    ap.add_argument("--total", type=int, default=4096, help="T = pad_full_seq_to")
    ap.add_argument("--multiple", type=int, default=8)
    ap.add_argument("--out-features", type=int, default=64, help="O")
    ap.add_argument("--microbatches", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3, help="timed passes over the stream")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # static mode needs one graph per S
    torch._inductor.config.fx_graph_cache = False  # every mode compiles cold: first passes compare
    stream = make_stream(args)
    modes = ("static", "dynamic", "capacity")
    print(f"# {machine_description()}; R={args.rows}, S_cap={args.max_len}, T={args.total}, O={args.out_features}, "
          f"{len(stream)} microbatches, {len({ids.shape[1] for ids, _ in stream})} distinct S")
    steps, first_pass, graphs, reference = {}, {}, {}, None
    torch._dynamo.reset()
    for mode in modes:  # first pass: compiles as it goes; every mode must give the same rows
        steps[mode], counters = build(args, mode)  # its own modules and backends: no graph is shared
        outs, first_pass[mode] = timed_result(lambda: [steps[mode](ids, lens) for ids, lens in stream])
        graphs[mode] = sum(c.frame_count for c in counters)
        reference = reference or outs
        assert all(torch.equal(a, b) for a, b in zip(outs, reference)), f"{mode} disagrees with static"
    samples = {mode: [] for mode in modes}
    for rep in range(args.reps):  # interleaved, so that machine noise hits every mode alike
        for i, (ids, lens) in enumerate(stream):
            for k in range(len(modes)):
                mode = modes[(i + rep + k) % len(modes)]
                samples[mode].append(timed_call(lambda: steps[mode](ids, lens)))
    base = spread(samples["static"])[0]
    print("| mode | graphs | first pass, compiles included (s) | median ms / microbatch | p10 | p90 | vs static |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode in modes:
        med, p10, p90 = spread(samples[mode])
        print(f"| {mode} | {graphs[mode]} | {first_pass[mode]:.1f} | {med * 1e3:.2f} | {p10 * 1e3:.2f} | "
              f"{p90 * 1e3:.2f} | {med / base:.2f}x |")
    mean_s = sum(ids.shape[1] for ids, _ in stream) / len(stream)
    print(f"# unpacked output per microbatch: dynamic/static R x S x O (mean S {mean_s:.0f}), capacity "
          f"R x S_cap x O ({args.max_len}): {args.max_len / mean_s:.2f}x the elements")


if __name__ == "__main__":
    main()
