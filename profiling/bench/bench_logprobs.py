"""Token log-probs from CP-sharded packed logits: nn_data's NeMo-RL drop-in, NeMo-RL's own function and the naive gather, side by side.

    python -m profiling.bench.bench_logprobs [--cp 2] [--vocab 32000] [--tokens 8192] [--rows 8] [--nemo-rl /path/to/RL]

Spawns ``--cp x --tp`` ranks over gloo on 127.0.0.1 (one thread each; TP inner, as NeMo-RL lays
its groups out). Every rank holds its zigzag shard of the packed logits ``[1, T/C, V/TP]``
(float32) of ``--rows`` sequences packed to ``T = --tokens`` (lengths drawn in ``[S/4, S]``,
``S = T/B``, segments padded to ``2C``, the last one to ``T``) and the full packed ids. Paths:

* ``drop-in``: ``nn_data.nemo_rl.model_utils.from_parallel_logits_to_logprobs_packed_sequences`` (NeMo-RL's
  signature and results, ``validate=False``; ``chunk_size=None``, which chunks by 256 tokens);
* ``TokenLogProbs``: nn_data's own op (its convention: ``[B, S]``, zeros past each length);
* ``naive`` (TP 1): all-gather the logits ``[1, T, V]``, log-softmax, take the next tokens, unpack;
* ``nemo-rl`` and ``nemo-rl chunked`` (``chunk_size=--chunk``), with ``--nemo-rl PATH``: NeMo-RL's
  own function imported from that checkout (nothing of it is in this repository). Its backward
  under CP builds an index with ``pin_memory`` and ``.cuda()``; on a machine without CUDA both are
  made no-ops for its calls (the index stays on the CPU, where its gradient is).

Modes: ``forward`` (``inference_only=True`` under ``torch.no_grad``, as NeMo-RL's log-prob pass) and
``forward+backward`` (a weighted sum, backward to the local logits). For each path and mode: the
median wall time (``profiling.timing.time_side_by_side``: paths interleaved, max over ranks; each
call starts with a barrier) and the median CPU time of the same calls (the process's own, so time
spent waiting in a collective for a rank that other jobs delay is not counted: the steadier figure
on a loaded machine), the peak of bytes allocated during one call (profiler allocator events,
inputs excluded, the logits' gradient included), host syncs (``HostSyncCounter``: NeMo-RL's ``.item()``
reads) and collectives (``CollectiveCounter``) of one call. Before timing it checks the drop-in
against the naive path and NeMo-RL on the same float32 inputs (max |difference|, values on every
position and gradients), and, on a float64 copy with ``--check-vocab`` columns, against the naive
path at 1e-10 (NeMo-RL computes in float32 whatever the input, so its float64 difference is ~1e-7).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.machinery
import importlib.util
import json
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from nn_data import GatherFromContextParallel, PackSequences, TokenLogProbs
from nn_data.nemo_rl import model_utils
from nn_data.diagnostics import CollectiveCounter, HostSyncCounter
from nn_data.groups import group_info
from nn_data.testing.dist import free_port, init_gloo
from nn_data.unpack import unpack_sequences
from profiling.timing import cpu_time_call, machine_description, time_side_by_side

MiB = 2**20
MODES = ("forward", "forward+backward")


def import_nemo_rl(checkout: str):
    """NeMo-RL's ``nemo_rl.distributed.model_utils`` from the checkout at ``checkout`` (its package is
    registered under its own name; nothing else of the checkout is imported)."""
    spec = importlib.machinery.PathFinder.find_spec("nemo_rl", [checkout])
    if spec is None:
        raise SystemExit(f"--nemo-rl {checkout}: no nemo_rl package there")
    package = importlib.util.module_from_spec(spec)
    sys.modules["nemo_rl"] = package
    spec.loader.exec_module(package)
    return importlib.import_module("nemo_rl.distributed.model_utils")


def send_max_over_ranks(results: dict, rank: int, out_queue) -> None:
    """Each figure's maximum over the ranks (the slowest rank, the largest peak and difference) to
    ``out_queue`` from rank 0, keys joined by ``|``; then leave the process group."""
    keys = sorted(results)
    vec = torch.tensor([float(results[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    if rank == 0:
        out_queue.put({"|".join(k): v for k, v in zip(keys, vec.tolist())})  # sync: none, CPU figures
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(rank_main, report, args) -> dict:
    """Spawn ``args.cp * args.tp`` processes of ``rank_main(rank, args, port, queue)`` (rank 0 puts the
    figures, max over ranks, on the queue), print ``report(args, figures, machine)`` and write the
    figures to ``args.json`` if given; returns them."""
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, port, q)) for r in range(args.cp * args.tp)]
    for p in procs:
        p.start()
    res = q.get()
    for p in procs:
        p.join()
    torch.set_num_threads(args.threads)
    print(report(args, res, machine_description()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": res}, f, indent=1)
    return res


@contextlib.contextmanager
def nemo_cpu_shim():
    """Without CUDA: ``torch.tensor(..., pin_memory=True)`` pins nothing and ``Tensor.cuda()`` is the
    identity, for NeMo-RL's CP all-gather backward (its index move) while NeMo-RL's code runs."""
    if torch.cuda.is_available():
        yield
        return
    original_tensor, original_cuda = torch.tensor, torch.Tensor.cuda

    def tensor(*args, pin_memory=False, **kwargs):
        return original_tensor(*args, **kwargs)

    torch.tensor, torch.Tensor.cuda = tensor, lambda self, *a, **k: self  # sync: none, a CPU stand-in
    try:
        yield
    finally:
        torch.tensor, torch.Tensor.cuda = original_tensor, original_cuda  # sync: none, restores them


def naive_logprobs(x, ids, cu_pad, seq_len, cp_group):
    """NeMo-RL's layout the plain way: gather ``[1, T, V]``, log-softmax, next tokens, unpack to ``[B, S-1]``."""
    full = GatherFromContextParallel(cp_group, grad_mode="sum", validate=False, host_reads=False)(x, cu_pad)[0]  # [T, V]
    lp = torch.log_softmax(full.float() if full.dtype != torch.float64 else full, dim=-1)  # [T, V]
    picked = lp.gather(1, ids[0].roll(-1)[:, None]).squeeze(1)  # [T]; a segment's last position is never kept
    cu = cu_pad.to(torch.int64)
    lengths = (cu[1:] - cu[:-1] - 1).clamp(0, seq_len - 1)  # [B]
    return unpack_sequences(picked[None], lengths, cu_pad, seq_len - 1, 0, validate=False,
                            host_reads=False)  # [B, S-1]


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


def make_inputs(args, cp_rank: int, tp_rank: int, vocab: int, dtype):
    """Packed ids, boundaries and this rank's logits shard (the same full logits on every rank)."""
    seq_len = args.tokens // args.rows
    gen = torch.Generator().manual_seed(1234)
    lengths = torch.randint(seq_len // 4, seq_len + 1, (args.rows,), generator=gen)
    ids = torch.randint(0, vocab, (args.rows, seq_len), generator=gen)
    r = PackSequences(2 * args.cp, 2 * args.cp, args.tokens)(ids, lengths)
    cols = vocab // args.tp
    full = torch.randn(1, args.tokens, cols, generator=torch.Generator().manual_seed(7 + tp_rank), dtype=dtype)
    local = model_utils._get_tokens_on_this_cp_rank(full, cp_rank, args.cp) if args.cp > 1 else full
    del full  # each rank keeps only its shard
    weight = torch.randn(args.rows, seq_len, generator=gen, dtype=dtype)
    return r, seq_len, local.contiguous(), weight


def build_paths(args, r, seq_len, cp, tp, nemo, cols):
    ids, cu, cu_pad = r.packed, r.cu_seqlens, r.cu_seqlens_padded
    vocab = (tp.rank * cols, (tp.rank + 1) * cols, tp.group)
    op = TokenLogProbs(seq_len, cp_group=cp.group, tp_group=tp.group, chunk_tokens=args.chunk, validate=False,
                       host_reads=False)
    paths = {
        "drop-in": lambda x, inf: model_utils.from_parallel_logits_to_logprobs_packed_sequences(
            x, ids, cu_pad, seq_len, *vocab, inference_only=inf, cp_group=cp.group, validate=False),
        "TokenLogProbs": lambda x, inf: op(x, ids, cu, cu_pad),
    }
    if tp.size == 1:
        paths["naive"] = lambda x, inf: naive_logprobs(x, ids, cu_pad, seq_len, cp.group)
    if nemo is not None:
        fn = nemo.from_parallel_logits_to_logprobs_packed_sequences
        paths["nemo-rl"] = lambda x, inf: fn(x, ids, cu_pad, seq_len, *vocab, inference_only=inf, cp_group=cp.group)
        paths["nemo-rl chunked"] = lambda x, inf: fn(x, ids, cu_pad, seq_len, *vocab, inference_only=inf,
                                                     cp_group=cp.group, chunk_size=args.chunk)
    return {k: v for k, v in paths.items() if not args.paths or k in args.paths}


def call(path_fn, local, weight, mode, name):
    """One call of a path in a mode (the weights cut to its output's width)."""
    shim = nemo_cpu_shim() if name.startswith("nemo-rl") else contextlib.nullcontext()
    with shim:
        if mode == "forward":
            with torch.no_grad():
                return path_fn(local, True)
        x = local.detach().requires_grad_()  # a leaf sharing local's storage: nothing copied
        out = path_fn(x, False)
        (out * weight[:, : out.shape[1]]).sum().backward()  # allocates x.grad [1, T/C, V/TP], counted
        return out.detach(), x.grad


def equality(paths, local, weight, against=("naive", "nemo-rl", "nemo-rl chunked")):
    """Max |difference| of the drop-in's values and gradients against the other NeMo-RL-layout paths."""
    out, grad = call(paths["drop-in"], local, weight, "forward+backward", "drop-in")
    found = {}
    for name in against:
        if name in paths:
            o, g = call(paths[name], local, weight, "forward+backward", name)
            found[name] = ((out - o).abs().max().item(), (grad - g).abs().max().item())
    return found


def rank_main(rank, args, port, out_queue):
    torch.set_num_threads(args.threads)
    init_gloo(rank, args.cp * args.tp, port)
    tp_groups = [dist.new_group([c * args.tp + t for t in range(args.tp)]) for c in range(args.cp)]
    cp_groups = [dist.new_group([c * args.tp + t for c in range(args.cp)]) for t in range(args.tp)]
    tp, cp = group_info(tp_groups[rank // args.tp]), group_info(cp_groups[rank % args.tp])  # size-1 groups too
    nemo = import_nemo_rl(args.nemo_rl) if args.nemo_rl else None
    results = {}
    # float64 check, smaller vocabulary: the drop-in equals the naive path (NeMo-RL's layout) to 1e-10
    r, seq_len, local, weight = make_inputs(args, cp.rank, tp.rank, args.check_vocab, torch.float64)
    paths = build_paths(args, r, seq_len, cp, tp, nemo, args.check_vocab // args.tp)
    for name, (dv, dg) in equality(paths, local, weight).items():
        results[("f64", name, "values")], results[("f64", name, "grads")] = dv, dg
    r, seq_len, local, weight = make_inputs(args, cp.rank, tp.rank, args.vocab, torch.float32)
    paths = build_paths(args, r, seq_len, cp, tp, nemo, args.vocab // args.tp)
    for name, (dv, dg) in equality(paths, local, weight).items():
        results[("f32", name, "values")], results[("f32", name, "grads")] = dv, dg
    for mode in MODES:
        for name, fn in paths.items():
            call(fn, local, weight, mode, name)  # warm-up
            dist.barrier()
            results[(mode, name, "peak")] = peak_allocated(lambda: call(fn, local, weight, mode, name))
            with HostSyncCounter() as syncs, CollectiveCounter() as coll:
                call(fn, local, weight, mode, name)
            results[(mode, name, "syncs")], results[(mode, name, "collectives")] = syncs.count, coll.count
        cpu = {name: [] for name in paths}

        def barrier_then_call(fn, name):
            dist.barrier()
            cpu[name].append(cpu_time_call(lambda: call(fn, local, weight, mode, name)))

        timed = time_side_by_side({name: functools.partial(barrier_then_call, fn, name) for name, fn in paths.items()},
                                  warmup=0, reps=args.repeats)
        for name, t in timed.items():
            results[(mode, name, "time")] = t.median_s
            results[(mode, name, "cpu")] = statistics.median(cpu[name][1:])  # the timed rounds
    send_max_over_ranks(results, rank, out_queue)


def report(args, res, machine: str) -> str:
    names = [n for n in ("drop-in", "TokenLogProbs", "naive", "nemo-rl", "nemo-rl chunked")
             if f"forward|{n}|time" in res]
    lines = [
        f"C={args.cp} x TP={args.tp} ranks over gloo, B={args.rows}, T={args.tokens}, S=T/B={args.tokens // args.rows}, "
        f"V={args.vocab}, float32 logits, {args.threads} thread(s) per rank, chunk={args.chunk}, median of {args.repeats}",
        f"machine: {machine}",
        f"local logits [1, T/C, V/TP] = {args.tokens // args.cp * args.vocab // args.tp * 4 / MiB:.0f} MiB",
        "",
        "| mode | path | time (ms) | drop-in speed-up | CPU time (ms) | CPU ratio | peak allocated (MiB) "
        "| host syncs | collectives |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in MODES:
        base, cpu_base = res[f"{mode}|drop-in|time"], res[f"{mode}|drop-in|cpu"]
        for n in names:
            t, c = res[f"{mode}|{n}|time"], res[f"{mode}|{n}|cpu"]
            lines.append(f"| {mode} | {n} | {1000 * t:.1f} | {t / base:.2f}x | {1000 * c:.1f} | {c / cpu_base:.2f}x | "
                         f"{res[f'{mode}|{n}|peak'] / MiB:.1f} | {res[f'{mode}|{n}|syncs']:.0f} | "
                         f"{res[f'{mode}|{n}|collectives']:.0f} |")
    lines.append("")
    for dtype in ("f64", "f32"):
        for n in names:
            if f"{dtype}|{n}|values" in res:
                lines.append(f"{dtype} (V={args.check_vocab if dtype == 'f64' else args.vocab}): drop-in vs {n}: "
                             f"values {res[f'{dtype}|{n}|values']:.1e}, gradients {res[f'{dtype}|{n}|grads']:.1e}")
    if "forward|nemo-rl|time" in res:
        lines += targets(res)
    return "\n".join(lines)


def targets(res) -> list[str]:
    fwd = lambda n, k="time": res[f"forward|{n}|{k}"]  # noqa: E731
    checks = [
        ("forward >= 2.5x NeMo-RL's default path", fwd("nemo-rl") / fwd("drop-in"), 2.5, ">="),
        ("forward >= 1.4x NeMo-RL's chunked mode", fwd("nemo-rl chunked") / fwd("drop-in"), 1.4, ">="),
        ("forward peak <= 1/30 of NeMo-RL's default", fwd("nemo-rl", "peak") / max(fwd("drop-in", "peak"), 1), 30, ">="),
        ("host syncs == 0 (forward and backward)", res["forward|drop-in|syncs"] + res["forward+backward|drop-in|syncs"], 0, "=="),
    ]
    if "f64|naive|values" in res:  # the naive path is the float64 oracle here (NeMo-RL computes in float32)
        checks.append(("float64 values and gradients vs naive <= 1e-10",
                       max(res["f64|naive|values"], res["f64|naive|grads"]), 1e-10, "<="))
    out = ["", "targets:"]
    for what, value, bound, op in checks:
        ok = {">=": value >= bound, "==": value == bound, "<=": value <= bound}[op]
        out.append(f"- {what}: {value:.3g} ({'met' if ok else 'MISSED'})")
    return out


def main(argv=None) -> dict:
    """Run the benchmark (``argv``: the command line's arguments); returns the raw figures, max over ranks."""
    ap = argparse.ArgumentParser(prog="python -m profiling.bench.bench_logprobs", description=__doc__.split("\n")[0])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=8192, help="T, the packed length (pad_full_seq_to)")
    ap.add_argument("--rows", type=int, default=8, help="B, sequences per microbatch")
    ap.add_argument("--chunk", type=int, default=256, help="NeMo-RL's chunk_size for its chunked mode")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--check-vocab", type=int, default=1024, help="V of the float64 equality check")
    ap.add_argument("--nemo-rl", help="a NeMo-RL checkout: also time its own function")
    ap.add_argument("--paths", nargs="*", help="only these paths (drop-in always runs)")
    ap.add_argument("--json", help="also write the raw figures here")
    args = ap.parse_args(argv)
    if args.paths and "drop-in" not in args.paths:
        args.paths.append("drop-in")
    return run_ranks(rank_main, report, args)


if __name__ == "__main__":
    main()
