"""Benchmark each core op: eager vs compiled vs the reference loop, side by side in one run.

For B in {8, 64, 256} rows with B*S = 262,144 tokens (so S = 32768, 4096, 1024), C = 4,
m = 8 and a fixed pad_full_seq_to = B*S, random lengths uniform in [1, S]. Prints one
table: microseconds per call (median), GB/s of output written, host syncs per call
(counted with nn_data.diagnostics.HostSyncCounter; the compiled graph is sync-free by
construction and checked by tests/ops/test_ops_compile.py), and the ratio to the memory
floor (a clone() of as many bytes as the op writes; its own row, mode ``floor``).

``--device cuda``: the inputs live on the GPU; each call is timed between two CUDA events
(median of ``--reps``, default 50); a ``cudagraph`` mode replays the compiled op captured once
in a ``torch.cuda.CUDAGraph`` (one capture per op and B); syncs are also counted with
``torch.cuda.set_sync_debug_mode("warn")`` (H2D copies included), shown after a ``/``.

    python -m profiling.bench_ops                 # the README table
    python -m profiling.bench_ops --rows 256 --reps 5 --hidden 256   # quicker
    python -m profiling.bench_ops --device cuda --json bench.json    # the GPU figures
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, NamedTuple, Optional

import torch

from nn_data import PackSequences, ShardForContextParallel, UnpackSequences, UnshardFromContextParallel
from nn_data.diagnostics import HostSyncCounter
from nn_data.testing.reference import reference_pack, reference_shard, reference_unpack, reference_unshard
from profiling.cuda_counters import SyncCounter
from profiling.timing import machine_description, time_calls, time_calls_cuda

OPS = ("pack", "shard", "pack+shard", "unshard", "unpack fp32")


class Case(NamedTuple):
    rows: int
    seq_len: int
    total: int
    x: torch.Tensor  # [B, S] int64 ids
    lengths: torch.Tensor  # [B]
    hidden: torch.Tensor  # [1, T, H] fp32 model output to unpack


def make_case(rows: int, tokens: int, m: int, hidden: int, seed: int, device="cpu") -> Case:
    gen = torch.Generator().manual_seed(seed)
    seq_len = tokens // rows
    lengths = torch.randint(1, seq_len + 1, (rows,), generator=gen)
    x = torch.randint(0, 50_000, (rows, seq_len), generator=gen)
    total = rows * (-(-seq_len // m) * m)
    out = torch.randn(1, total, hidden, generator=gen)
    return Case(rows, seq_len, total, x.to(device), lengths.to(device), out.to(device))


class CudaGraphReplay:
    """``fn`` captured once in a ``torch.cuda.CUDAGraph`` on the first call (after two warm-up
    calls on a side stream), replayed on every call after it."""

    def __init__(self, fn: Callable[[], object]):
        self.fn, self.graph, self.captures = fn, None, 0

    def __call__(self):
        if self.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.fn()
            self.captures += 1
        self.graph.replay()


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
    table = {
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
    if case.x.is_cuda:  # the compiled op, captured once and replayed
        for modes in table.values():
            modes["cudagraph"] = CudaGraphReplay(modes["compiled"])
    return table


def bytes_written(op: str, case: Case, cp: int) -> int:
    T, ids = case.total, 8
    return {
        "pack": T * ids,
        "shard": T // cp * ids,
        "pack+shard": T * ids + T // cp * ids,
        "unshard": T * ids,
        "unpack fp32": case.rows * case.seq_len * case.hidden.shape[-1] * 4,
    }[op]


def count_syncs(fn: Callable[[], object], device="cpu") -> tuple[int, Optional[int]]:
    """``(Python-level host reads, CUDA syncs or None)`` of one call of ``fn``."""
    with SyncCounter(device) as cuda_syncs, HostSyncCounter() as syncs:
        fn()
    return syncs.count, (cuda_syncs.count if cuda_syncs.cuda else None)


def run(rows_list, tokens: int, m: int, cp: int, hidden: int, reps: int, seed: int, device="cpu",
        ops=OPS, on_op: Optional[Callable[[list], None]] = None) -> list[dict]:
    """One row per op, B and mode (``floor`` included). A mode that raises (a capture that
    syncs, say) gives a row with ``error`` instead of figures. ``on_op(results)`` after each op."""
    cuda = torch.device(device).type == "cuda"
    timer = (lambda fn: time_calls_cuda(fn, reps=reps)) if cuda else (lambda fn: time_calls(fn, reps=reps))
    results = []
    for rows in rows_list:
        case = make_case(rows, tokens, m, hidden, seed, device)
        for op, modes in op_callables(case, m, cp).items():
            if op not in ops:
                continue
            nbytes = bytes_written(op, case, cp)
            modes["floor"] = torch.empty(nbytes, dtype=torch.uint8, device=device).clone
            floor = timer(modes["floor"])
            for mode, fn in modes.items():
                row = dict(op=op, B=rows, S=case.seq_len, mode=mode, device=str(device), reps=reps)
                try:
                    t = floor if mode == "floor" else timer(fn)
                    syncs, cuda_syncs = count_syncs(fn, device)
                except Exception as error:  # noqa: BLE001 - reported in the row, the other modes still run
                    results.append(dict(row, error=f"{type(error).__name__}: {error}"[:500]))
                    continue
                results.append(dict(
                    row, us=t.median_s * 1e6, p10_us=t.p10_s * 1e6, p90_us=t.p90_s * 1e6, first_s=t.first_s,
                    gbps=nbytes / t.median_s / 1e9, syncs=syncs, cuda_syncs=cuda_syncs,
                    floor_ratio=t.median_s / floor.median_s, captures=getattr(fn, "captures", None),
                ))
            if on_op is not None:
                on_op(results)
    return results


def print_table(results: list[dict]) -> None:
    print(f"{'op':<12} {'B':>4} {'S':>6} {'mode':<10} {'us/call':>10} {'GB/s':>7} {'syncs':>6} {'x floor':>8} "
          f"{'vs ref':>7}")
    ref = {(r["op"], r["B"]): r.get("us", float("nan")) for r in results if r["mode"] == "reference"}
    for r in results:
        if "error" in r:
            print(f"{r['op']:<12} {r['B']:>4} {r['S']:>6} {r['mode']:<10} error: {r['error']}")
            continue
        speedup = ref[(r["op"], r["B"])] / r["us"]
        syncs = f"{r['syncs']}" + ("" if r.get("cuda_syncs") is None else f"/{r['cuda_syncs']}")
        print(f"{r['op']:<12} {r['B']:>4} {r['S']:>6} {r['mode']:<10} {r['us']:>10.1f} {r['gbps']:>7.2f} "
              f"{syncs:>6} {r['floor_ratio']:>8.2f} {speedup:>6.2f}x")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256], help="B values (default 8 64 256)")
    ap.add_argument("--tokens", type=int, default=262_144, help="B*S per case (default 262144)")
    ap.add_argument("--multiple", type=int, default=8, help="pad_individual_seqs_to_multiple_of (default 8)")
    ap.add_argument("--cp", type=int, default=4, help="context-parallel size (default 4)")
    ap.add_argument("--hidden", type=int, default=1024, help="feature dim of the unpacked fp32 output (default 1024)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per measurement (default 10; 50 on CUDA)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="ops to run (default all)")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        ap.error(f"--device={args.device} but CUDA is not available (torch {torch.__version__})")
    reps = args.reps or (50 if cuda else 10)
    print(f"machine: {machine_description()}")
    def write_json(results):  # after every op: a run cut short keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine_description(), "results": results}, f, indent=1)

    results = run(args.rows, args.tokens, args.multiple, args.cp, args.hidden, reps, args.seed, args.device,
                  args.ops, on_op=write_json)
    print_table(results)
    write_json(results)


if __name__ == "__main__":
    main()
