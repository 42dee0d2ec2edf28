"""Benchmark each core op: eager vs compiled vs the reference loop, side by side in one run.

For B in {8, 64, 256} rows with B*S = 262,144 tokens (so S = 32768, 4096, 1024), C = 4,
m = 8 and a fixed pad_full_seq_to = B*S, random lengths uniform in [1, S]. Prints one
table: microseconds per call (median), GB/s of output written, host syncs per call
(counted with nn_data.diagnostics.HostSyncCounter; the compiled graph is sync-free by
construction and checked by tests/ops/test_ops_compile.py), and the ratio to the memory
floor (a clone() of as many bytes as the op writes).

    python -m profiling.bench_ops                 # the README table
    python -m profiling.bench_ops --rows 256 --reps 5 --hidden 256   # quicker
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, NamedTuple

import torch

from nn_data import PackSequences, ShardForContextParallel, UnpackSequences, UnshardFromContextParallel
from nn_data.diagnostics import HostSyncCounter
from nn_data.testing.reference import reference_pack, reference_shard, reference_unpack, reference_unshard
from profiling.timing import machine_description, time_calls


class Case(NamedTuple):
    rows: int
    seq_len: int
    total: int
    x: torch.Tensor  # [B, S] int64 ids
    lengths: torch.Tensor  # [B]
    hidden: torch.Tensor  # [1, T, H] fp32 model output to unpack


def make_case(rows: int, tokens: int, m: int, hidden: int, seed: int) -> Case:
    gen = torch.Generator().manual_seed(seed)
    seq_len = tokens // rows
    lengths = torch.randint(1, seq_len + 1, (rows,), generator=gen)
    x = torch.randint(0, 50_000, (rows, seq_len), generator=gen)
    total = rows * (-(-seq_len // m) * m)
    out = torch.randn(1, total, hidden, generator=gen)
    return Case(rows, seq_len, total, x, lengths, out)


def op_callables(case: Case, m: int, cp: int) -> dict[str, dict[str, Callable[[], object]]]:
    """For each op: ``{"reference": f, "eager": f, "compiled": f}`` closures over one case."""
    T, S = case.total, case.seq_len
    pack = PackSequences(m, pad_full_seq_to=T)
    shard = ShardForContextParallel(cp, 1)
    unshard = UnshardFromContextParallel(cp)
    unpack = UnpackSequences(S)
    r = pack(case.x, case.lengths)
    cu_pad = r.cu_seqlens_padded
    shards = torch.cat([ShardForContextParallel(cp, k)(r.packed, cu_pad) for k in range(cp)])

    def pack_shard(x, lengths):
        p = pack(x, lengths)
        return p.packed, shard(p.packed, p.cu_seqlens_padded), p.cu_seqlens_padded

    def ref_pack_shard():
        ref = reference_pack(case.x, case.lengths, m, 1, T)
        return ref.packed, reference_shard(ref.packed, ref.cu_seqlens_padded, cp, 1), ref.cu_seqlens_padded

    def compiled(fn):
        return torch.compile(fn, fullgraph=True, dynamic=False)

    c_pack_shard, c_shard, c_unshard, c_unpack = (compiled(f) for f in (pack_shard, shard, unshard, unpack))
    c_pack = compiled(lambda x, lengths: pack(x, lengths).packed)
    return {
        "pack": {
            "reference": lambda: reference_pack(case.x, case.lengths, m, 1, T),
            "eager": lambda: pack(case.x, case.lengths),
            "compiled": lambda: c_pack(case.x, case.lengths),
        },
        "shard": {
            "reference": lambda: reference_shard(r.packed, cu_pad, cp, 1),
            "eager": lambda: shard(r.packed, cu_pad),
            "compiled": lambda: c_shard(r.packed, cu_pad),
        },
        "pack+shard": {
            "reference": ref_pack_shard,
            "eager": lambda: pack_shard(case.x, case.lengths),
            "compiled": lambda: c_pack_shard(case.x, case.lengths),
        },
        "unshard": {
            "reference": lambda: reference_unshard(shards, cu_pad, cp),
            "eager": lambda: unshard(shards, cu_pad),
            "compiled": lambda: c_unshard(shards, cu_pad),
        },
        "unpack fp32": {
            "reference": lambda: reference_unpack(case.hidden, case.lengths, cu_pad, S),
            "eager": lambda: unpack(case.hidden, case.lengths, cu_pad),
            "compiled": lambda: c_unpack(case.hidden, case.lengths, cu_pad),
        },
    }


def bytes_written(op: str, case: Case, cp: int) -> int:
    T, ids = case.total, 8
    return {
        "pack": T * ids,
        "shard": T // cp * ids,
        "pack+shard": T * ids + T // cp * ids,
        "unshard": T * ids,
        "unpack fp32": case.rows * case.seq_len * case.hidden.shape[-1] * 4,
    }[op]


def count_syncs(fn: Callable[[], object]) -> int:
    with HostSyncCounter() as syncs:
        fn()
    return syncs.count


def run(rows_list, tokens: int, m: int, cp: int, hidden: int, reps: int, seed: int) -> list[dict]:
    results = []
    for rows in rows_list:
        case = make_case(rows, tokens, m, hidden, seed)
        for op, modes in op_callables(case, m, cp).items():
            nbytes = bytes_written(op, case, cp)
            floor_src = torch.empty(nbytes, dtype=torch.uint8)
            floor = time_calls(floor_src.clone, reps=reps)
            for mode, fn in modes.items():
                t = time_calls(fn, reps=reps)
                results.append(dict(
                    op=op, B=rows, S=case.seq_len, mode=mode, us=t.median_s * 1e6, first_s=t.first_s,
                    gbps=nbytes / t.median_s / 1e9, syncs=count_syncs(fn), floor_ratio=t.median_s / floor.median_s,
                ))
    return results


def print_table(results: list[dict]) -> None:
    print(f"{'op':<12} {'B':>4} {'S':>6} {'mode':<10} {'us/call':>10} {'GB/s':>7} {'syncs':>6} {'x floor':>8} {'vs ref':>7}")
    ref = {(r["op"], r["B"]): r["us"] for r in results if r["mode"] == "reference"}
    for r in results:
        speedup = ref[(r["op"], r["B"])] / r["us"]
        print(f"{r['op']:<12} {r['B']:>4} {r['S']:>6} {r['mode']:<10} {r['us']:>10.0f} {r['gbps']:>7.2f} "
              f"{r['syncs']:>6} {r['floor_ratio']:>8.2f} {speedup:>6.2f}x")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256], help="B values (default 8 64 256)")
    ap.add_argument("--tokens", type=int, default=262_144, help="B*S per case (default 262144)")
    ap.add_argument("--multiple", type=int, default=8, help="pad_individual_seqs_to_multiple_of (default 8)")
    ap.add_argument("--cp", type=int, default=4, help="context-parallel size (default 4)")
    ap.add_argument("--hidden", type=int, default=1024, help="feature dim of the unpacked fp32 output (default 1024)")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per measurement (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    print(f"machine: {machine_description()}")
    results = run(args.rows, args.tokens, args.multiple, args.cp, args.hidden, args.reps, args.seed)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_description(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
