"""Benchmark the ops side by side in one run: the loop, eager ops, the compat layer, compiled ops, the floor.

For B in {8, 64, 256} rows with B*S = 262,144 tokens (S = 32768, 4096, 1024), C = 4, m = 8,
pad_full_seq_to = B * round_up(S, m), lengths uniform in [1, S]. For every op and B, each mode's
calls are interleaved round by round on the CPU (so a load change on a shared machine hits them
all alike) and the median is reported:

    reference  nn_data.testing.reference: one Python iteration per sequence (NeMo-RL's way)
    nemo-rl    NeMo-RL's own _pack_sequences_for_megatron, when a caller passes it (pack+shard)
    compat     nn_data.nemo_rl.megatron_data._pack_sequences_for_megatron, eager: the NeMo-RL drop-in
               default (host-planned: one sync, a few ops; pack+shard)
    eager      the core ops (PackSequences, ShardForContextParallel, ...) eagerly, validation on: the host
               executor after one read (pack+shard: the pack's layout travels to the shard; the other
               ops read their boundaries once)
    compiled   the core ops under torch.compile(fullgraph=True, dynamic=False)
    compiled+  the same with the profiler's CPU options (C++ wrapper, memory planning) and skip_guard_eval_unsafe
               (pack+shard, CPU)
    cudagraph  (CUDA) the compiled op captured once in a torch.cuda.CUDAGraph and replayed
    floor      a clone() of as many bytes as the op writes

Columns: microseconds per call, x floor (time / the floor's), vs ref (the loop's time / this
mode's: > 1 is faster), ops per call (eager modes: aten ops dispatched, views included, counted
with a TorchDispatchMode; compiled pack+shard: fused kernels plus aten calls in a profiler trace
of one call of an untimed twin compiled with named kernels; "-" for the other compiled ops) and
host syncs per call (nn_data.diagnostics.HostSyncCounter; on CUDA also
torch.cuda.set_sync_debug_mode("warn"), after a "/"). The targets of the compat and compiled
paths are checked at the end ("target met / MISSED"). A mode that raises gives a row with
``error`` instead of figures; ``--json`` is rewritten after every op.

``--device cuda``: the inputs live on the GPU; each call is timed between two CUDA events
(median of ``--reps``, default 50), mode after mode.

    python -m profiling.bench.bench_ops                          # the README table (1 thread)
    python -m profiling.bench.bench_ops --rows 8 --ops pack+shard --reps 20
    python -m profiling.bench.bench_ops --device cuda --json bench.json

NeMo-RL's function needs megatron-bridge and NeMo-RL's own modules; a script outside the
repository that can import it calls ``main(argv, baselines={"nemo-rl": fn})``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable, NamedTuple, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nn_data import PackSequences, ShardForContextParallel, UnpackSequences, UnshardFromContextParallel
from nn_data.diagnostics import HostSyncCounter
from nn_data.nemo_rl.megatron_data import _pack_sequences_for_megatron
from nn_data.testing.reference import reference_pack, reference_shard, reference_unpack, reference_unshard
from nn_data.diagnostics import SyncCounter
from profiling.timing import CPU_INDUCTOR_OPTIONS, machine_description, reuse_freed_memory, time_calls_cuda, \
    time_side_by_side

OPS = ("pack+shard", "pack", "shard", "unshard", "unpack fp32")


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


def _compiled(fn, **options):
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options)


def _instrumented(fn):
    """A twin of ``_compiled(fn)`` whose fused kernels each record a profiler event (inductor's
    ``cpp.enable_kernel_profile``), to count them; it is not timed (recording costs time per kernel)."""
    def region(*args):  # its own code object, so its own Dynamo cache entry
        return fn(*args)

    return _compiled(region, **{"cpp.enable_kernel_profile": True})


def _tuned(fn):
    """``compiled+``: the profiler's CPU options (:data:`profiling.timing.CPU_INDUCTOR_OPTIONS`: a C++ wrapper
    around the kernels, the temporaries planned into one allocation), and only the guards that tell graphs apart
    (``skip_guard_eval_unsafe``; safe here: every call has the shapes of the first, which compiles
    under full guards)."""
    def region(*args):  # its own code object, so its own Dynamo cache entry
        return fn(*args)

    compiled, warm = _compiled(region, **CPU_INDUCTOR_OPTIONS), []

    def call(*args):
        if not warm:
            warm.append(compiled(*args))
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return compiled(*args)

    return call


def op_callables(case: Case, m: int, cp: int, rank: int, ops, baselines: dict,
                 pack_form: str = "auto") -> tuple[dict, dict]:
    """``({op: {mode: fn}}, {op: instrumented compiled fn})``: closures over one case, for the ops asked
    for; the second maps pack+shard to its kernel-counting twin. ``pack_form``: the device pack's form."""
    T, S, x, lengths = case.total, case.seq_len, case.x, case.lengths
    cuda = x.is_cuda
    pack, shard = PackSequences(m, pad_full_seq_to=T, pack_form=pack_form), ShardForContextParallel(cp, rank)
    unshard, unpack = UnshardFromContextParallel(cp), UnpackSequences(S)
    r = pack(x, lengths)
    cu_pad = r.cu_seqlens_padded
    shards = torch.cat([ShardForContextParallel(cp, k)(r.packed, cu_pad) for k in range(cp)])

    def pack_shard(x, lengths):  # the pack's layout travels to the shard: one host read in eager mode
        p = pack(x, lengths)
        return p.packed, shard(p.packed, layout=p.layout), p.cu_seqlens_padded

    def loop_pack_shard():
        ref = reference_pack(x, lengths, m, 1, T)
        return ref.packed, reference_shard(ref.packed, ref.cu_seqlens_padded, cp, rank), ref.cu_seqlens_padded

    c_pack_shard, c_shard, c_unshard, c_unpack = (_compiled(f) for f in (pack_shard, shard, unshard, unpack))
    c_pack = _compiled(lambda x, lengths: pack(x, lengths).packed)
    i_pack_shard = _instrumented(pack_shard)
    table = {
        "pack+shard": {"reference": loop_pack_shard,
                       **{k: (lambda f=f: f(x, lengths, m, 1, T, rank, cp)) for k, f in baselines.items()},
                       "compat": lambda: _pack_sequences_for_megatron(x, lengths, m, 1, T, rank, cp),
                       "eager": lambda: pack_shard(x, lengths), "compiled": lambda: c_pack_shard(x, lengths)},
        "pack": {"reference": lambda: reference_pack(x, lengths, m, 1, T), "eager": lambda: pack(x, lengths),
                 "compiled": lambda: c_pack(x, lengths)},
        "shard": {"reference": lambda: reference_shard(r.packed, cu_pad, cp, rank),
                  "eager": lambda: shard(r.packed, cu_pad), "compiled": lambda: c_shard(r.packed, cu_pad)},
        "unshard": {"reference": lambda: reference_unshard(shards, cu_pad, cp),
                    "eager": lambda: unshard(shards, cu_pad), "compiled": lambda: c_unshard(shards, cu_pad)},
        "unpack fp32": {"reference": lambda: reference_unpack(case.hidden, lengths, cu_pad, S),
                        "eager": lambda: unpack(case.hidden, lengths, cu_pad),
                        "compiled": lambda: c_unpack(case.hidden, lengths, cu_pad)},
    }
    if cuda:  # the compiled op, captured once and replayed
        for modes in table.values():
            modes["cudagraph"] = CudaGraphReplay(modes["compiled"])
    else:  # the C++ wrapper was measured on the CPU only
        t_pack_shard = _tuned(pack_shard)
        table["pack+shard"]["compiled+"] = lambda: t_pack_shard(x, lengths)
    counted = {"pack+shard": lambda: i_pack_shard(x, lengths)}
    return {op: table[op] for op in ops}, counted


def bytes_written(op: str, case: Case, cp: int) -> int:
    T, ids = case.total, 8
    return {
        "pack": T * ids,
        "shard": T // cp * ids,
        "pack+shard": T * ids + T // cp * ids,
        "unshard": T * ids,
        "unpack fp32": case.rows * case.seq_len * case.hidden.shape[-1] * 4,
    }[op]


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Optional[Callable[[], object]], compiled: bool) -> Optional[int]:
    """Aten ops of one eager call (views included), or kernels + aten calls of one call of a compiled
    twin with named kernels (None: no twin)."""
    if fn is None:
        return None
    if not compiled:
        with _AtenOps() as ops:
            fn()
        return ops.count
    fn()  # compiles
    with torch.profiler.profile() as prof:
        fn()
    skip = ("Torch-Compiled Region", "TorchDynamo", "## Call", "AOTDispatcher", "Pregraph", "aten::to")
    return sum(1 for e in prof.events() if not e.name.startswith(skip))


def count_syncs(fn: Callable[[], object], device="cpu") -> tuple[int, Optional[int]]:
    """``(Python-level host reads, CUDA syncs or None)`` of one call of ``fn``."""
    with SyncCounter(device) as cuda_syncs, HostSyncCounter() as syncs:
        fn()
    return syncs.count, (cuda_syncs.count if cuda_syncs.cuda else None)


def _time_modes(modes: dict, reps: int, cuda: bool) -> tuple[dict, dict]:
    """``({mode: Timing}, {mode: error text})``: CUDA mode after mode between events; CPU side by
    side (a mode that raises is then timed alone, to tell which one it was)."""
    timings, errors = {}, {}
    groups = [{k: f} for k, f in modes.items()] if cuda else [modes]
    for group in groups:
        try:
            timings.update({k: time_calls_cuda(f, reps=reps) for k, f in group.items()} if cuda
                           else time_side_by_side(group, reps=reps))
        except Exception as error:  # noqa: BLE001 - reported in the row, the other modes still run
            if len(group) > 1:
                more_t, more_e = _time_modes_one_by_one(group, reps)
                timings.update(more_t)
                errors.update(more_e)
            else:
                errors.update({k: f"{type(error).__name__}: {error}"[:500] for k in group})
    return timings, errors


def _time_modes_one_by_one(modes: dict, reps: int) -> tuple[dict, dict]:
    timings, errors = {}, {}
    for k, f in modes.items():
        try:
            timings.update(time_side_by_side({k: f}, reps=reps))
        except Exception as error:  # noqa: BLE001
            errors[k] = f"{type(error).__name__}: {error}"[:500]
    return timings, errors


def run(rows_list, tokens: int, m: int, cp: int, rank: int, hidden: int, reps: int, seed: int, ops=OPS,
        baselines: Optional[dict] = None, device="cpu", on_op: Optional[Callable[[list], None]] = None,
        pack_form: str = "auto") -> list[dict]:
    """One row per op, B and mode (``floor`` included); ``on_op(results)`` after each op."""
    cuda = torch.device(device).type == "cuda"
    results = []
    for rows in rows_list:
        case = make_case(rows, tokens, m, hidden, seed, device)
        table, counted = op_callables(case, m, cp, rank, ops, baselines or {}, pack_form)
        for op, modes in table.items():
            nbytes = bytes_written(op, case, cp)
            modes["floor"] = torch.empty(nbytes, dtype=torch.uint8, device=device).clone
            timings, errors = _time_modes(modes, reps, cuda)
            ref = timings.get("reference")
            for mode, fn in modes.items():
                row = dict(op=op, B=rows, S=case.seq_len, mode=mode, device=str(device), reps=reps)
                if mode in errors:
                    results.append(dict(row, error=errors[mode]))
                    continue
                t, compiled = timings[mode], mode.startswith("compiled") or mode == "cudagraph"
                try:
                    syncs, cuda_syncs = count_syncs(fn, device)
                    n_ops = count_ops(counted.get(op) if compiled else fn, compiled) if not cuda else None
                except Exception as error:  # noqa: BLE001
                    results.append(dict(row, error=f"{type(error).__name__}: {error}"[:500]))
                    continue
                results.append(dict(
                    row, us=t.median_s * 1e6, p10_us=t.p10_s * 1e6, p90_us=t.p90_s * 1e6, first_s=t.first_s,
                    gbps=nbytes / t.median_s / 1e9, floor_ratio=t.median_s / timings["floor"].median_s
                    if "floor" in timings else float("nan"),
                    vs_loop=ref.median_s / t.median_s if ref else float("nan"), ops=n_ops, syncs=syncs,
                    cuda_syncs=cuda_syncs, captures=getattr(fn, "captures", None),
                ))
            if on_op is not None:
                on_op(results)
    return results


def print_table(results: list[dict]) -> None:
    print(f"{'op':<12} {'B':>4} {'S':>6} {'mode':<9} {'us/call':>9} {'x floor':>8} {'vs ref':>8} {'ops':>5} {'syncs':>6}")
    for r in results:
        if "error" in r:
            print(f"{r['op']:<12} {r['B']:>4} {r['S']:>6} {r['mode']:<9} error: {r['error']}")
            continue
        syncs = f"{r['syncs']}" + ("" if r.get("cuda_syncs") is None else f"/{r['cuda_syncs']}")
        print(f"{r['op']:<12} {r['B']:>4} {r['S']:>6} {r['mode']:<9} {r['us']:>9.0f} {r['floor_ratio']:>8.2f} "
              f"{r['vs_loop']:>7.2f}x {'-' if r['ops'] is None else r['ops']:>5} {syncs:>6}")


def targets(results: list[dict]) -> list[str]:
    """The targets, one line each: compat eager pack+shard <= 30 ops, one sync and not slower than the
    loop (nor than NeMo-RL's own where measured); the core ops eager: pack+shard one sync and not slower
    than NeMo-RL's own, unshard and unpack not slower than the loop; compiled pack+shard within 3x the
    floor, and not slower than the loop at B = 8."""
    lines = []
    by = {(r["op"], r["B"], r["mode"]): r for r in results if "error" not in r}
    for (op, rows, mode), r in sorted(by.items()):
        checks = _target_checks(op, rows, mode, r, by)
        for what, ok in checks:
            lines.append(f"target {'met' if ok else 'MISSED'}: {mode} {op} B={rows}: {what} "
                         f"({r['us']:.0f} us, {r['floor_ratio']:.2f}x floor, {r['vs_loop']:.2f}x vs loop, "
                         f"{r['ops']} ops, {r['syncs']} syncs)")
    return lines


def _target_checks(op: str, rows: int, mode: str, r: dict, by: dict) -> list:
    nemo_rl = by.get((op, rows, "nemo-rl"))
    if op == "pack+shard" and mode == "compat":
        checks = [("1 host sync", r["syncs"] == 1), ("not slower than the loop", r["vs_loop"] >= 1.0)]
        if r["ops"] is not None:
            checks.insert(0, ("<= 30 aten ops", r["ops"] <= 30))
        if nemo_rl is not None:
            checks.append(("not slower than NeMo-RL", r["us"] <= nemo_rl["us"]))
        return checks
    if op == "pack+shard" and mode == "eager":
        checks = [("1 host sync (the pack's layout travels to the shard)", r["syncs"] == 1)]
        return checks + ([("not slower than NeMo-RL", r["us"] <= nemo_rl["us"])] if nemo_rl is not None else [])
    if op in ("unshard", "unpack fp32") and mode == "eager":
        return [("not slower than the loop", r["vs_loop"] >= 1.0)]
    if op == "pack+shard" and mode == "compiled":
        checks = [("within 3x the floor", r["floor_ratio"] <= 3.0), ("0 host syncs", r["syncs"] == 0)]
        return checks + ([("not slower than the loop", r["vs_loop"] >= 1.0)] if rows == 8 else [])
    return []


def main(argv=None, baselines: Optional[dict] = None) -> list[dict]:
    """Run the benchmark; ``baselines`` adds pack+shard modes with NeMo-RL's signature
    ``f(input_ids, seq_lengths, m, p, pad_packed_seq_to, cp_rank, cp_size)``."""
    ap = argparse.ArgumentParser(prog="python -m profiling.bench.bench_ops",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256], help="B values (default 8 64 256)")
    ap.add_argument("--tokens", type=int, default=262_144, help="B*S per case (default 262144)")
    ap.add_argument("--multiple", type=int, default=8, help="pad_individual_seqs_to_multiple_of (default 8)")
    ap.add_argument("--cp", type=int, default=4, help="context-parallel size (default 4)")
    ap.add_argument("--rank", type=int, default=1, help="the CP rank that shards (default 1)")
    ap.add_argument("--hidden", type=int, default=1024, help="feature dim of the unpacked fp32 output (default 1024)")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds per measurement (default 30; 50 on CUDA)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady on a shared 2-core VM)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="ops to measure (default all)")
    ap.add_argument("--allocator", choices=("reuse", "default"), default="reuse",
                    help="reuse: glibc keeps freed memory (no page faults on new outputs, as torch's "
                         "CUDA caching allocator; default); default: glibc's own behaviour")
    ap.add_argument("--pack-form", choices=("auto", "scatter", "gather"), default="auto",
                    help="the device pack's form (PackSequences(pack_form=); default auto: the shape rule)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the rows to this JSON file (rewritten after every op)")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        ap.error(f"--device={args.device} but CUDA is not available (torch {torch.__version__})")
    reps = args.reps or (50 if cuda else 30)
    torch.set_num_threads(args.threads)
    reuse = args.allocator == "reuse" and reuse_freed_memory()
    load = os.getloadavg()
    print(f"machine: {machine_description()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"pack form {args.pack_form}; allocator {'reuse (mallopt)' if reuse else 'default'}")

    def write_json(results, lines=None):  # after every op: a run cut short keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine_description(), "load": load, "args": vars(args), "results": results,
                           "targets": lines}, f, indent=1)

    results = run(args.rows, args.tokens, args.multiple, args.cp, args.rank, args.hidden, reps, args.seed,
                  args.ops, baselines, args.device, on_op=write_json, pack_form=args.pack_form)
    print_table(results)
    lines = targets(results)
    print("\n".join(lines))
    write_json(results, lines)
    return results


if __name__ == "__main__":
    main()
