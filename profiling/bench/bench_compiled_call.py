"""Where one compiled call's time goes: a per-call breakdown of the compiled data path beside the eager path.

Two subjects, each eager and compiled (``torch.compile(fullgraph=True, dynamic=False)`` as the benchmarks
compile; ``PackedForward`` its own ``compile_packing=True``), pack+shard also ``compiled+`` (the same with the
profiler's CPU options, :data:`profiling.timing.CPU_INDUCTOR_OPTIONS`: a C++ wrapper, memory planning; every
guard still evaluated), 1 thread:

    pack+shard      PackSequences -> ShardForContextParallel (the layout travels), B x S ids, C ranks
    PackedForward   the whole wrapper (CP 1, row capacity B, pad_full_seq_to T) around an embedding + linear

For each: the median wall time per call (calls interleaved side by side), then ``torch.profiler`` over
``--calls`` calls, its CPU rows per call folded into the parts of a compiled call:

    guards      Dynamo's cache lookup (guard evaluation): "TorchDynamo Cache Lookup"
    wrapper     the compiled region's own time (its rows' self time: the wrapper code and the kernels it
                calls without a row of their own, i.e. inductor's fused C++ kernels)
    checks      the ``nn_data::device_check`` custom-op calls (the data checks)
    aten        aten calls the wrapper makes (extern kernels: index ops, cumsum, ...), allocations excluded
    alloc       allocations (``aten::empty*``)
    other       everything else (Python outside the region, argument checks)

and the exact counts of one steady call (load-proof, unlike the times):

    frames      Python frames the call runs (``sys.setprofile`` "call" events: wrappers, checks, the custom op)
    modules     ``nn.Module`` calls among them (a backend's compiled graph module not counted)
    guards      Dynamo's leaf guards over the compiled frames' cache entries (what the cache lookup evaluates)

Run: ``python -m profiling.bench.bench_compiled_call [--rows 8] [--seq-len 4096] [--cp 2] [--json PATH]``.
Figures: ``profiling/results/compiled_call.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Callable

import torch
from torch import nn

from nn_data import PackedForward, PackSequences, ShardForContextParallel
from nn_data.packed_sides import PackingSide, UnpackingSide
from profiling.bench.bench_ops import make_case
from profiling.timing import CPU_INDUCTOR_OPTIONS, machine_description, time_side_by_side

PARTS = ("guards", "wrapper", "checks", "aten", "alloc", "other")
_REGION = ("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph", "inductor_wrapper")


def part_of(name: str) -> str:
    """Which part of a compiled call a profiler row belongs to (:data:`PARTS`)."""
    if name.startswith("TorchDynamo Cache Lookup"):
        return "guards"
    if name.startswith(_REGION) or name.startswith("Torch-Compiled"):
        return "wrapper"
    if name.startswith("nn_data::device_check"):
        return "checks"
    if name.startswith(("aten::empty", "aten::resize_")):
        return "alloc"
    if name.startswith("aten::"):
        return "aten"
    return "other"


def breakdown(fn: Callable[[], object], calls: int) -> dict:
    """Per-call microseconds of each part (self CPU time of the profiler's rows), the total, and the
    number of calls per call of each kind of row worth naming (custom ops, allocations)."""
    for _ in range(3):
        fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    parts, counts = defaultdict(float), defaultdict(float)
    for row in prof.key_averages():
        part = part_of(row.key)
        parts[part] += row.self_cpu_time_total / calls
        counts[part] += row.count / calls
    return {"us": {p: round(parts[p], 1) for p in PARTS}, "calls": {p: round(counts[p], 1) for p in PARTS},
            "profiled_us": round(sum(parts.values()), 1)}


def call_counts(fn: Callable[[], object], code_objects=()) -> dict:
    """Exact counts of one steady call of ``fn``: the Python ``frames`` it runs, the ``nn.Module`` calls among them
    (``modules``) and the leaf ``guards`` of every cache entry of ``code_objects`` (the compiled frames)."""
    fn()
    frames, modules = [], []

    def hook(frame, event, arg):
        if event != "call":
            return
        frames.append(frame.f_code)
        module = frame.f_locals.get("self") if frame.f_code is nn.Module._call_impl.__code__ else None
        if isinstance(module, nn.Module) and not isinstance(module, torch.fx.GraphModule):
            modules.append(type(module).__name__)

    torch._dynamo.eval_frame.skip_code(hook.__code__)  # it runs inside compiled calls: never compile it
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)

    def leaves(manager) -> int:
        return len(manager.get_leaf_guards()) + sum(leaves(child) for child in manager.get_child_managers())

    entries = [e for code in code_objects for e in torch._dynamo.eval_frame._debug_get_cache_entry_list(code)]
    return {"frames": len(frames) - 1, "modules": len(modules),  # - 1: fn's own frame
            "guards": sum(leaves(e.guard_manager.root) for e in entries)}


class _Model(nn.Module):
    """An embedding and a linear layer per token: the main job's stand-in, in PackedForward's contract."""

    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Embedding(50_000, 32), nn.Linear(32, 1)

    def forward(self, input_ids, position_ids, packed):
        return self.out(self.embed(input_ids))  # [1, T/C, 1]


def callables(rows: int, seq_len: int, cp: int, m: int) -> tuple:
    """``({(subject, mode): fn}, {(subject, mode): code objects})`` for the subjects above, one case (seed 0): the
    callables and the code objects Dynamo compiles for each compiled one (whose guards :func:`call_counts` counts)."""
    case = make_case(rows, rows * seq_len, m, 1, 0)
    x, lengths, T = case.x, case.lengths, case.total
    pack, shard = PackSequences(m, pad_full_seq_to=T), ShardForContextParallel(cp, 0)

    def pack_shard(x, lengths):
        p = pack(x, lengths)
        return p.packed, shard(p.packed, layout=p.layout), p.cu_seqlens_padded

    def pack_shard_plus(x, lengths):  # its own code object, so its own Dynamo cache entry
        return pack_shard(x, lengths)

    c_pack_shard = torch.compile(pack_shard, fullgraph=True, dynamic=False)
    c_plus = torch.compile(pack_shard_plus, fullgraph=True, dynamic=False, options=CPU_INDUCTOR_OPTIONS)
    torch.manual_seed(0)
    model = _Model()
    kwargs = dict(pad_individual_seqs_to_multiple_of=m, pad_full_seq_to=T, row_capacity=rows, verify=False)
    eager_fw, compiled_fw = PackedForward(model, **kwargs), PackedForward(model, compile_packing=True, **kwargs)
    frames = {("pack+shard", "compiled"): (pack_shard.__code__,),
              ("pack+shard", "compiled+"): (pack_shard_plus.__code__,),
              ("PackedForward", "compiled"): (PackingSide.forward.__code__, UnpackingSide.forward.__code__,
                                              nn.Module._call_impl.__code__)}
    with torch.no_grad():
        fns = {("pack+shard", "eager"): lambda: pack_shard(x, lengths),
               ("pack+shard", "compiled"): lambda: c_pack_shard(x, lengths),
               ("pack+shard", "compiled+"): lambda: c_plus(x, lengths),
               ("PackedForward", "eager"): lambda: eager_fw(x, lengths),
               ("PackedForward", "compiled"): lambda: compiled_fw(x, lengths)}
    return fns, frames


def run(rows: int, seq_len: int, cp: int, m: int, calls: int, reps: int) -> dict:
    fns, frames = callables(rows, seq_len, cp, m)
    results = {"machine": machine_description(), "rows": rows, "seq_len": seq_len, "cp": cp, "subjects": {}}
    with torch.no_grad():
        for fn in fns.values():  # compile outside the timings
            fn()
        for subject in ("pack+shard", "PackedForward"):
            modes = {mode: fn for (s, mode), fn in fns.items() if s == subject}
            times = time_side_by_side(modes, warmup=3, reps=reps)
            results["subjects"][subject] = {
                mode: {"median_us": round(times[mode].median_s * 1e6, 1), **breakdown(fn, calls),
                       "counts": call_counts(fn, frames.get((subject, mode), ()))}
                for mode, fn in modes.items()}
    return results


def print_results(results: dict) -> None:
    print(results["machine"])
    print(f"B {results['rows']}, S {results['seq_len']}, C {results['cp']}: per call, us (calls per call)")
    print(f"{'subject':14} {'mode':9} {'median':>7} " + " ".join(f"{p:>13}" for p in PARTS))
    for subject, modes in results["subjects"].items():
        for mode, r in modes.items():
            cells = " ".join(f"{r['us'][p]:7.1f} ({r['calls'][p]:3.0f})" for p in PARTS)
            counts = ", ".join(f"{k} {v}" for k, v in r["counts"].items())
            print(f"{subject:14} {mode:9} {r['median_us']:7.1f} {cells}  [{counts}]")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--multiple", type=int, default=4)
    parser.add_argument("--calls", type=int, default=200, help="profiled calls per callable")
    parser.add_argument("--reps", type=int, default=200, help="timed calls per callable (interleaved)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = run(args.rows, args.seq_len, args.cp, args.multiple, args.calls, args.reps)
    print_results(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
