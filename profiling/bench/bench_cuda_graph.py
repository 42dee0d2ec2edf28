"""Benchmark a captured CUDA graph of the data path + model forward against the eager path, per microbatch.

The tiny model (``nn_data.models.TinyCausalLM``, dense document mask) on a stream of microbatches of
``--rows`` B = 64 row capacity (every microbatch 1..B rows, lengths 0..S, one empty microbatch), packed to
``T = B * S``. Modes, interleaved microbatch by microbatch (``profiling.timing.time_side_by_side``: the
device synchronised around every call, so each figure is one microbatch's wall time):

    eager    PackedForward.prepare (the host-planned layout: one host sync) + the model's forward
    staged   StagedMicrobatch.load + prepare (the device executor, no host read) + the forward, eagerly
    graph    (CUDA) StagedMicrobatch.load + one torch.cuda.CUDAGraph replay of prepare + forward,
             captured once on the first microbatch

Every mode's output on every microbatch is compared with the eager one (``max_abs_difference``), and the
graph's steady state is checked for host syncs (``torch.cuda.set_sync_debug_mode``) and new allocations
(the CUDA caching allocator's allocation count). ``--json`` writes the figures for ``profiling.gpu_check``.

    python -m profiling.bench.bench_cuda_graph --device cuda --json graphs.json      # B = 64, S = 32
    python -m profiling.bench.bench_cuda_graph --rows 6 --seq-len 8 --microbatches 6 # the CPU dry run
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

import torch

from nn_data import PackedForward
from nn_data.diagnostics import SyncCounter
from nn_data.models import TinyCausalLM
from nn_data.staging import StagedMicrobatch
from profiling.timing import machine_description, time_side_by_side

VOCAB = 97


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m profiling.bench.bench_cuda_graph", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=64, help="row capacity B (default 64)")
    ap.add_argument("--seq-len", type=int, default=32, help="row length S (default 32); T = B * S")
    ap.add_argument("--multiple", type=int, default=8, help="pad_individual_seqs_to_multiple_of (default 8)")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--passes", type=int, default=3, help="timed passes over the stream (default 3)")
    ap.add_argument("--json", default=None, help="write the figures here")
    return ap.parse_args(argv)


def make_stream(rows: int, seq_len: int, count: int, device, seed: int = 0) -> list:
    """``count`` microbatches ``(ids [B, S], lengths [B])`` on ``device``, B in 1..rows (the third: 0)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        b = 0 if i == 2 else int(torch.randint(1, rows + 1, (1,), generator=gen))
        lengths = torch.randint(0, seq_len + 1, (b,), generator=gen)
        ids = torch.randint(1, VOCAB, (b, seq_len), generator=gen)
        ids = torch.where(torch.arange(seq_len) < lengths[:, None], ids, 0)
        out.append((ids.to(device), lengths.to(device)))
    return out


def capture(stage: StagedMicrobatch, first) -> tuple:
    """``(graph, static output)``: ``stage.prepare()`` + the forward captured once, after warm-up
    calls on a side stream (CUDA's rule for capture)."""
    stage.load(*first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            stage.prepare().forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = stage.prepare().forward()
    return graph, out


class Modes:
    """The modes of the module docstring over one stream; each call runs the next microbatch."""

    def __init__(self, args, device):
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.model = TinyCausalLM(vocab=VOCAB, dim=args.dim, heads=4, layers=args.layers, mask_kind="dense")
        self.model = self.model.to(self.device).eval()
        total = args.rows * -(-args.seq_len // args.multiple) * args.multiple
        self.packing = PackedForward(self.model, pad_individual_seqs_to_multiple_of=args.multiple,
                                     pad_full_seq_to=total, row_capacity=args.rows)
        self.stage = StagedMicrobatch(self.packing, args.seq_len, device=self.device)
        self.stream = make_stream(args.rows, args.seq_len, args.microbatches, self.device)
        self.total, self.at = total, {}
        self.graph = self.static = None
        if self.device.type == "cuda":
            self.graph, self.static = capture(self.stage, self.stream[0])

    def _next(self, mode: str):
        i = self.at.get(mode, 0)
        self.at[mode] = i + 1
        return self.stream[i % len(self.stream)]

    @torch.no_grad()
    def eager(self, mb=None):
        ids, lengths = mb or self._next("eager")
        inp = self.packing.prepare(ids, lengths)
        return self.model(inp.input_ids, inp.position_ids, inp.packed)

    @torch.no_grad()
    def staged(self, mb=None):
        return self.stage.load(*(mb or self._next("staged"))).prepare().forward()

    def replay(self, mb=None):
        self.stage.load(*(mb or self._next("graph")))
        self.graph.replay()
        return self.static

    def callables(self) -> dict:
        fns = {"eager": self.eager, "staged": self.staged}
        if self.graph is not None:
            fns["graph"] = self.replay
        return fns


def steady_state(modes: Modes) -> dict:
    """Over the whole stream: each mode's largest difference from eager; for the graph, the host syncs
    and new CUDA allocations of load + replay."""
    out = {name: 0.0 for name in modes.callables() if name != "eager"}
    for mb in modes.stream:
        want = modes.eager(mb)
        for name, fn in modes.callables().items():
            if name != "eager":
                out[name] = max(out[name], float((fn(mb) - want).abs().max()))
    found = {"max_abs_difference": out}
    if modes.graph is not None:
        results = torch.empty((len(modes.stream), *modes.static.shape), dtype=modes.static.dtype, device=modes.device)
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        with SyncCounter(modes.device) as syncs:
            for i, mb in enumerate(modes.stream):
                results[i].copy_(modes.replay(mb))
        torch.cuda.synchronize()
        found.update(graph_syncs=syncs.count, graph_sync_locations=syncs.locations,
                     graph_new_allocations=torch.cuda.memory_stats()["allocation.all.allocated"] - before)
        found["max_abs_difference"]["graph (steady state)"] = max(
            float((results[i] - modes.eager(mb)).abs().max()) for i, mb in enumerate(modes.stream))
    return found


def main(argv=None) -> dict:
    args = parse_args(argv)
    modes = Modes(args, args.device)
    checked = steady_state(modes)
    reps = args.passes * len(modes.stream)
    timings = time_side_by_side(modes.callables(), warmup=len(modes.stream), reps=reps, device=modes.device)
    rows = [dict(mode=name, median_us=t.median_s * 1e6, p10_us=t.p10_s * 1e6, p90_us=t.p90_s * 1e6,
                 first_s=t.first_s) for name, t in timings.items()]
    speedup: Optional[float] = None
    if "graph" in timings:
        speedup = timings["eager"].median_s / timings["graph"].median_s
    result = dict(machine=machine_description(), device=str(modes.device), rows=args.rows, seq_len=args.seq_len,
                  total=modes.total, microbatches=len(modes.stream), reps=reps, timings=rows,
                  graph_vs_eager_speedup=speedup, **checked)
    print(f"{machine_description()}; B = {args.rows}, S = {args.seq_len}, T = {modes.total}, "
          f"{len(modes.stream)} microbatches x {args.passes} passes")
    for row in rows:
        print(f"  {row['mode']:<8} median {row['median_us']:10.1f} us per microbatch "
              f"(p10 {row['p10_us']:.1f}, p90 {row['p90_us']:.1f})")
    if speedup is not None:
        print(f"  graph replay vs eager: {speedup:.2f}x faster; steady state {checked['graph_syncs']} host syncs, "
              f"{checked['graph_new_allocations']} new allocations")
    print(f"  max |difference| from eager: {checked['max_abs_difference']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
