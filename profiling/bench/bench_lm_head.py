"""Token log-probs from hidden states without logits: nn_data's fused head against the unfused path (the
output layer's logits, then log-probs) and NeMo-RL's, side by side.

    python -m profiling.bench.bench_lm_head [--cp 2] [--tp 1] [--tokens 8192] [--vocab 65536] [--hidden 1024]
                                            [--rows 8] [--chunk 256] [--nemo-rl /path/to/RL]

Spawns ``--cp x --tp`` ranks over gloo on 127.0.0.1 (one thread each, TP inner). Every rank holds its
zigzag shard of the packed hidden states, sequence-first and contiguous as megatron-core hands them,
``[T/C, 1, H]`` (float32; a transposed view of ``[1, T/C, H]`` instead sends NeMo-RL's fused matmul down
torch's batched path, 15x slower on the CPU) of ``--rows`` sequences packed to
``T = --tokens`` (lengths drawn in ``[S/4, S]``, ``S = T/B``), its vocabulary rows of the output weight
``[V/TP, H]`` and the full packed ids. Paths (each computes the head and the log-probs):

* ``fused``: ``nn_data.TokenLogProbsFromHidden`` (``validate=False``, ``chunk_tokens=--chunk``);
* ``unfused``: the logits ``hidden @ weight.T``, then ``nn_data.TokenLogProbs`` (chunked log-softmax);
* ``fused +entropy+top8``: ``TokenLogProbsFromHidden.outputs`` with the log-probs, the entropy, the top-8
  log-probs and ids and the argmax (one pass; the loss weighs the log-probs, the entropy and the top-8
  log-probs); ``unfused +entropy+top8``: the logits, then ``TokenLogProbs.outputs`` with the same outputs;
* ``drop-in fused``: ``nn_data.nemo_rl.model_utils.from_parallel_hidden_states_to_logprobs_packed_sequences``
  (NeMo-RL's conventions, ``chunk_size=--chunk``); ``drop-in unfused``: the logits, then the unfused
  drop-in ``from_parallel_logits_to_logprobs_packed_sequences``;
* with ``--nemo-rl PATH`` (NeMo-RL's own module from that checkout; nothing of it is in this repository):
  ``nemo-rl unfused``, the logits then its ``from_parallel_logits_to_logprobs_packed_sequences`` (its
  default ``chunk_size=None``), and at CP 1 ``nemo-rl fused``, its ``from_parallel_hidden_states_to_logprobs``
  (it refuses CP).

Modes: ``forward`` (``inference_only`` under ``torch.no_grad``) and ``forward+backward`` (a weighted sum,
backward to the hidden states and the weight). For each: the median wall time (``profiling.timing``:
paths interleaved, max over ranks, a barrier before each call) and the median CPU time of the same
calls (glibc told to keep freed memory, ``profiling.timing.reuse_freed_memory``), the peak of bytes allocated during one call (profiler allocator events; inputs excluded,
gradients included) and the same peak less the weight's gradient (``[V/TP, H]`` float32, allocated alike by
every path, and in training it lives in the optimizer's gradient buffer), host syncs and collectives.
Before timing: float64 equality (``--check-*`` sizes) of the fused paths against the unfused ones
(values, both gradients) and, with ``--nemo-rl``, float32 differences against NeMo-RL's. Last, the
computed table of the logits' memory the fused path removes at GPU sizes (``--table-*``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics

import torch
import torch.distributed as dist

from nn_data import PackSequences, TokenLogProbs, TokenLogProbsFromHidden
from nn_data.diagnostics import CollectiveCounter, HostSyncCounter
from nn_data.groups import group_info
from nn_data.nemo_rl import model_utils
from nn_data.testing.dist import init_gloo
from nn_data.testing.reference import reference_shard
from profiling.bench.bench_logprobs import (import_nemo_rl, nemo_cpu_shim, peak_allocated, run_ranks,
                                            send_max_over_ranks)
from profiling.timing import cpu_time_call, reuse_freed_memory, time_side_by_side

MiB, GiB = 2**20, 2**30
MODES = ("forward", "forward+backward")


class Inputs:
    """One rank's data: the pack, its hidden-state shard, its weight rows, the loss weights by shape."""

    def __init__(self, args, cp, tp, vocab: int, hidden: int, dtype):
        self.seq_len = args.tokens // args.rows
        gen = torch.Generator().manual_seed(1234)
        lengths = torch.randint(self.seq_len // 4, self.seq_len + 1, (args.rows,), generator=gen)
        ids = torch.randint(0, vocab, (args.rows, self.seq_len), generator=gen)
        self.pack = PackSequences(2 * args.cp, 2 * args.cp, args.tokens)(ids, lengths)
        full = torch.randn(1, args.tokens, hidden, generator=torch.Generator().manual_seed(7), dtype=dtype)
        shard = reference_shard(full, self.pack.cu_seqlens_padded.tolist(), args.cp, cp.rank)  # [1, T/C, H]
        # [T/C, 1, H], sequence-first with the strides megatron-core's tensors have: a transposed view
        # counts as contiguous (its size-1 dim's stride is ignored) yet sends a [T, 1, H] @ [H, V]
        # matmul down torch's batched (bmm) path, ~10x slower on the CPU; clone lays it out afresh.
        self.hidden = shard[0].unsqueeze(1).clone(memory_format=torch.contiguous_format)
        del full, shard  # each rank keeps only its shard
        rows = vocab // args.tp
        weight_gen = torch.Generator().manual_seed(11 + tp.rank)
        self.weight = (torch.randn(rows, hidden, generator=weight_gen, dtype=dtype) / hidden**0.5).contiguous()
        self.vocab = (tp.rank * rows, (tp.rank + 1) * rows)
        self._weights = {}

    def loss_weight(self, out: torch.Tensor) -> torch.Tensor:
        if out.shape not in self._weights:
            gen = torch.Generator().manual_seed(99)
            self._weights[out.shape] = torch.randn(out.shape, generator=gen, dtype=out.dtype)
        return self._weights[out.shape]


def build_paths(args, inp: Inputs, cp, tp, nemo) -> dict:
    """``{name: fn(hidden, weight, inference_only) -> log-probs}``."""
    r, seq_len, vocab = inp.pack, inp.seq_len, inp.vocab
    groups = dict(cp_group=cp.group, tp_group=tp.group)
    fused = TokenLogProbsFromHidden(seq_len, chunk_tokens=args.chunk, validate=False, host_reads=False, **groups)
    unfused = TokenLogProbs(seq_len, chunk_tokens=args.chunk, validate=False, host_reads=False, **groups)
    packed = (r.packed, r.cu_seqlens_padded, seq_len, *vocab, tp.group)
    logits = lambda h, w: (h.squeeze(1) @ w.T)[None]  # noqa: E731  the output layer: [T/C, 1, H] -> [1, T/C, V/TP]
    every = dict(entropy=True, top_k=8, argmax=True)
    paths = {
        "fused": lambda h, w, inf: fused(h, w, r.packed, layout=r.layout),
        "unfused": lambda h, w, inf: unfused(logits(h, w), r.packed, layout=r.layout),
        "fused +entropy+top8": lambda h, w, inf: _stacked(fused.outputs(h, w, r.packed, layout=r.layout, **every)),
        "unfused +entropy+top8": lambda h, w, inf: _stacked(unfused.outputs(logits(h, w), r.packed, layout=r.layout,
                                                                            **every)),
        "drop-in fused": lambda h, w, inf: model_utils.from_parallel_hidden_states_to_logprobs_packed_sequences(
            h, w, *packed, inference_only=inf, cp_group=cp.group, chunk_size=args.chunk, validate=False),
        "drop-in unfused": lambda h, w, inf: model_utils.from_parallel_logits_to_logprobs_packed_sequences(
            logits(h, w), *packed, inference_only=inf, cp_group=cp.group, validate=False),
    }
    if nemo is not None:
        paths["nemo-rl unfused"] = lambda h, w, inf: nemo.from_parallel_logits_to_logprobs_packed_sequences(
            logits(h, w), *packed, inference_only=inf, cp_group=cp.group)
        if args.cp == 1:  # NeMo-RL's fusion refuses CP
            paths["nemo-rl fused"] = lambda h, w, inf: nemo.from_parallel_hidden_states_to_logprobs(
                h, w, None, r.packed, *vocab, tp.group, inference_only=inf, chunk_size=args.chunk)
    return {k: v for k, v in paths.items() if not args.paths or k in args.paths}


def _stacked(out) -> torch.Tensor:
    """The differentiable outputs side by side, ``[B, S, 2 + 8]`` (the argmax is computed, not weighed)."""
    return torch.cat([out.logprobs[..., None], out.entropy[..., None], out.topk_logprobs], dim=-1)


def call(fn, inp: Inputs, mode: str, name: str):
    """One call of a path in a mode: ``(values, d hidden, d weight)`` (no gradients in forward mode)."""
    shim = nemo_cpu_shim() if name.startswith("nemo-rl") else contextlib.nullcontext()
    with shim:
        if mode == "forward":
            with torch.no_grad():
                return fn(inp.hidden, inp.weight, True), None, None
        h, w = inp.hidden.detach().requires_grad_(), inp.weight.detach().requires_grad_()  # leaves, no copy
        out = fn(h, w, False)
        (out * inp.loss_weight(out)).sum().backward()
        return out.detach(), h.grad, w.grad


def differences(paths, inp, pairs) -> dict:
    """``{(a, b): (values, d hidden, d weight)}``: the max |difference| of each pair of paths."""
    found, cache = {}, {}
    for a, b in pairs:
        if a in paths and b in paths:
            ra = cache.setdefault(a, call(paths[a], inp, "forward+backward", a))
            rb = cache.setdefault(b, call(paths[b], inp, "forward+backward", b))
            found[(a, b)] = tuple(float((x - y).abs().max()) for x, y in zip(ra, rb))
    return found


PAIRS = (("fused", "unfused"), ("fused +entropy+top8", "unfused +entropy+top8"), ("drop-in fused", "drop-in unfused"),
         ("drop-in fused", "nemo-rl unfused"))


def rank_main(rank, args, port, out_queue):
    torch.set_num_threads(args.threads)
    reuse_freed_memory()  # as torch's caching allocator on CUDA: every path alike
    init_gloo(rank, args.cp * args.tp, port)
    tp_groups = [dist.new_group([c * args.tp + t for t in range(args.tp)]) for c in range(args.cp)]
    cp_groups = [dist.new_group([c * args.tp + t for c in range(args.cp)]) for t in range(args.tp)]
    tp, cp = group_info(tp_groups[rank // args.tp]), group_info(cp_groups[rank % args.tp])
    nemo = import_nemo_rl(args.nemo_rl) if args.nemo_rl else None
    results = {}
    small = Inputs(args, cp, tp, args.check_vocab, args.check_hidden, torch.float64)
    for (a, b), diffs in differences(build_paths(args, small, cp, tp, nemo), small, PAIRS[:3]).items():
        for what, d in zip(("values", "hidden", "weight"), diffs):
            results[("f64", f"{a} vs {b}", what)] = d
    inp = Inputs(args, cp, tp, args.vocab, args.hidden, torch.float32)
    paths = build_paths(args, inp, cp, tp, nemo)
    for (a, b), diffs in differences(paths, inp, PAIRS[3:]).items():
        for what, d in zip(("values", "hidden", "weight"), diffs):
            results[("f32", f"{a} vs {b}", what)] = d
    for mode in MODES:
        for name, fn in paths.items():
            call(fn, inp, mode, name)  # warm-up
            dist.barrier()
            results[(mode, name, "peak")] = peak_allocated(lambda: call(fn, inp, mode, name))
            with HostSyncCounter() as syncs, CollectiveCounter() as coll:
                call(fn, inp, mode, name)
            results[(mode, name, "syncs")], results[(mode, name, "collectives")] = syncs.count, coll.count
        cpu = {name: [] for name in paths}

        def barrier_then_call(fn, name):
            dist.barrier()
            cpu[name].append(cpu_time_call(lambda: call(fn, inp, mode, name)))

        timed = time_side_by_side({n: functools.partial(barrier_then_call, fn, n) for n, fn in paths.items()},
                                  warmup=0, reps=args.repeats)
        for name, t in timed.items():
            results[(mode, name, "time")] = t.median_s
            results[(mode, name, "cpu")] = statistics.median(cpu[name][1:])  # the timed rounds
    results[("weight grad", "bytes", "")] = inp.weight.numel() * inp.weight.element_size()
    send_max_over_ranks(results, rank, out_queue)


def report(args, res, machine: str) -> str:
    names = [n for n in ("fused", "unfused", "fused +entropy+top8", "unfused +entropy+top8", "drop-in fused",
                         "drop-in unfused", "nemo-rl unfused", "nemo-rl fused")
             if f"forward|{n}|time" in res]
    grad_w = res["weight grad|bytes|"]
    lines = [
        f"C={args.cp} x TP={args.tp} ranks over gloo, B={args.rows}, T={args.tokens}, V={args.vocab}, H={args.hidden}, "
        f"float32, {args.threads} thread(s) per rank, chunk={args.chunk}, median of {args.repeats}",
        f"machine: {machine}",
        f"local logits [T/C, V/TP] = {args.tokens // args.cp * args.vocab // args.tp * 4 / MiB:.0f} MiB; "
        f"weight gradient [V/TP, H] = {grad_w / MiB:.0f} MiB",
        "",
        "| mode | path | time (ms) | vs unfused | CPU time (ms) | CPU vs unfused | peak (MiB) | peak less the weight "
        "gradient (MiB) | host syncs | collectives |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in MODES:
        base, cpu_base = res[f"{mode}|unfused|time"], res[f"{mode}|unfused|cpu"]
        for n in names:
            t, c, peak = res[f"{mode}|{n}|time"], res[f"{mode}|{n}|cpu"], res[f"{mode}|{n}|peak"]
            less = peak - grad_w if mode == "forward+backward" else peak
            lines.append(f"| {mode} | {n} | {1000 * t:.0f} | {t / base:.2f}x | {1000 * c:.0f} | {c / cpu_base:.2f}x | "
                         f"{peak / MiB:.1f} | {less / MiB:.1f} | {res[f'{mode}|{n}|syncs']:.0f} | "
                         f"{res[f'{mode}|{n}|collectives']:.0f} |")
    lines.append("")
    for key in sorted(k for k in res if k.startswith(("f64|", "f32|")) and k.endswith("|values")):
        dtype, pair, _ = key.split("|")
        sizes = f"V={args.check_vocab}, H={args.check_hidden}" if dtype == "f64" else f"V={args.vocab}, H={args.hidden}"
        lines.append(f"{dtype} ({sizes}): {pair}: values {res[key]:.1e}, d hidden {res[f'{dtype}|{pair}|hidden']:.1e}, "
                     f"d weight {res[f'{dtype}|{pair}|weight']:.1e}")
    return "\n".join(lines + targets(res) + [""] + memory_table(args))


def targets(res) -> list:
    fb = lambda n, k: res[f"forward+backward|{n}|{k}"]  # noqa: E731
    grad_w = res["weight grad|bytes|"]
    checks = [
        ("forward+backward peak <= 1/16 of the unfused path's (less the weight gradient both)",
         (fb("unfused", "peak") - grad_w) / max(fb("fused", "peak") - grad_w, 1), 16, ">="),
        ("forward+backward wall time <= 1.15x the unfused path's", fb("fused", "time") / fb("unfused", "time"), 1.15, "<="),
        ("forward+backward CPU time <= 1.15x the unfused path's", fb("fused", "cpu") / fb("unfused", "cpu"), 1.15, "<="),
        ("host syncs == 0 (forward and backward)", res["forward|fused|syncs"] + fb("fused", "syncs"), 0, "=="),
    ]
    every, every_base = "fused +entropy+top8", "unfused +entropy+top8"
    if f"forward+backward|{every}|time" in res:
        checks += [
            ("with entropy + top-8: forward+backward peak <= 1/16 of the unfused path's with them (less the weight "
             "gradient)", (fb(every_base, "peak") - grad_w) / max(fb(every, "peak") - grad_w, 1), 16, ">="),
            ("with entropy + top-8: forward+backward wall time <= 1.3x the unfused path's (log-prob only)",
             fb(every, "time") / fb("unfused", "time"), 1.3, "<="),
            ("with entropy + top-8: forward+backward CPU time <= 1.3x the unfused path's (log-prob only)",
             fb(every, "cpu") / fb("unfused", "cpu"), 1.3, "<="),
            ("with entropy + top-8: forward+backward wall time vs the unfused path with them",
             fb(every, "time") / fb(every_base, "time"), 1.3, "<="),
        ]
    for pair in ("fused vs unfused", "fused +entropy+top8 vs unfused +entropy+top8"):
        if f"f64|{pair}|values" not in res:
            continue
        worst = max(res[f"f64|{pair}|{w}"] for w in ("values", "hidden", "weight"))
        checks.append((f"float64 values and both gradients, {pair}, <= 1e-10", worst, 1e-10, "<="))
    out = ["", "targets:"]
    for what, value, bound, op in checks:
        ok = {">=": value >= bound, "==": value == bound, "<=": value <= bound}[op]
        out.append(f"- {what}: {value:.3g} ({'met' if ok else 'MISSED'})")
    return out


def memory_table(args) -> list:
    """The logits' memory per rank that the fused head removes, at GPU sizes (computed, not measured)."""
    t, v, tp = args.table_tokens, args.table_vocab, args.table_tp
    cols = v // tp
    lines = [f"Logits memory per rank the fused head removes (computed): T={t:,}, V={v:,}, TP={tp}, bf16 logits, "
             f"chunk {args.chunk} tokens",
             "",
             "| C | tokens per rank | bf16 logits kept for backward (GiB) | their gradient, bf16 (GiB) | float32 copy "
             "of the logits (GiB) | fused head: one float32 chunk (MiB) + per-token values (MiB) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in args.table_cp:
        n = t // c
        bf16 = n * cols * 2
        lines.append(f"| {c} | {n:,} | {bf16 / GiB:.2f} | {bf16 / GiB:.2f} | {2 * bf16 / GiB:.2f} | "
                     f"{args.chunk * cols * 4 / MiB:.0f} + {n * 2 * 4 / MiB:.1f} |")
    return lines


def main(argv=None) -> dict:
    """Run the benchmark (``argv``: the command line's arguments); returns the raw figures, max over ranks."""
    ap = argparse.ArgumentParser(prog="python -m profiling.bench.bench_lm_head", description=__doc__.split("\n")[0])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8192, help="T, the packed length (pad_full_seq_to)")
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8, help="B, sequences per microbatch")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per chunk (chunk_size of the drop-in)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check-vocab", type=int, default=512, help="V of the float64 equality check")
    ap.add_argument("--check-hidden", type=int, default=64, help="H of the float64 equality check")
    ap.add_argument("--nemo-rl", help="a NeMo-RL checkout: also time its own functions")
    ap.add_argument("--paths", nargs="*", help="only these paths (fused and unfused always run)")
    ap.add_argument("--table-tokens", type=int, default=262_144)
    ap.add_argument("--table-vocab", type=int, default=152_064)
    ap.add_argument("--table-tp", type=int, default=4)
    ap.add_argument("--table-cp", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--json", help="also write the raw figures here")
    args = ap.parse_args(argv)
    if args.paths:
        args.paths = sorted(set(args.paths) | {"fused", "unfused"})
    return run_ranks(rank_main, report, args)


if __name__ == "__main__":
    main()
