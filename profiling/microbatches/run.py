"""Profile nn_data on a stream of constant-length (PP > 1) packed microbatches: eager vs
torch.compile (and reduce-overhead / CUDA graphs on CUDA) vs NeMo-RL-style loops.

Seeded RL global batches (lognormal lengths clipped to --max-len), one per training step, are
planned across --dp data-parallel ranks with nn_data.planning.plan_step (work-balanced; this
process runs rank 0's microbatches) under one run-level pad_full_seq_to = --max-tokens rounded up
to the layout's alignment, the length every microbatch of the run is packed to (PP > 1; with
--packed-length step, NeMo-RL's rule instead: each step's longest microbatch, a new length and
graph on most steps); rows are padded to one row capacity R outside any compiled region.
--steps N runs N global batches and reports the time per step (mean, std) and the recompiles
across steps; without it the stream is --microbatches long. Each mode runs
pack -> CP shard (one process, --cp-rank of --cp-size) -> model stand-in -> simulated
all-gather -> unshard -> unpack over the stream. Prints one table (first call, steady
median/p10/p90 per microbatch, tokens/s, profiler ops per microbatch, graphs, recompiles,
graph breaks, host syncs, peak memory), the compiled speed-ups measured in this run, and
the targets; writes TensorBoard traces per mode, summary.json and chart.png into the run
folder (profiling/runs/<timestamp>/). profiling/README.md explains every column.

    bash scripts/profile.sh                                  # set up .venv, run with the defaults
    python -m profiling.microbatches --cp-size 4 --max-tokens 32768
    python -m profiling.microbatches --device cuda   # adds reduce-overhead (CUDA graphs)
    bash scripts/tensorboard.sh                              # open the newest run's traces
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from nn_data import compile_cache
from profiling.microbatches.chart import write_chart
from profiling.microbatches.measure import (GUARD_EVAL, first_call, graph_count, measure_mode, steady_calls,
                                            steady_samples)
from profiling.microbatches.report import format_report, speedups, targets, write_summary
from profiling.microbatches.stream import ModelStandIn, Stream, make_modes, plan_stream
from profiling.microbatches.real_models import REAL_MODELS, AdapterStandIn, data_path_share, measure_model_alone
from profiling.timing import machine_description, reuse_freed_memory

RUNS = Path(__file__).resolve().parents[1] / "runs"  # profiling/runs/
ALL_MODES = ("eager", "compiled", "reduce-overhead", "loop")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m profiling.microbatches",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=512, help="sequences per global batch (default 512)")
    ap.add_argument("--max-len", type=int, default=2048, help="row length S: longest sequence (default 2048)")
    ap.add_argument("--median-len", type=int, default=256, help="median sequence length (default 256)")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the lengths (default 1.0)")
    ap.add_argument("--max-tokens", type=int, default=8192,
                    help="max tokens per microbatch; T = pad_full_seq_to = this rounded up (default 8192)")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="microbatches in the stream, from as many global batches as that takes (default 32; "
                         "not with --steps)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps: this many global batches, every microbatch of each (per-step time mean "
                         "and std, recompiles across steps)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks the step is planned over (default 1)")
    ap.add_argument("--balance", choices=("work", "tokens", "nemo-rl"), default="work",
                    help="plan_step's balance across the DP ranks (default work)")
    ap.add_argument("--packed-length", choices=("run", "step"), default="run",
                    help="run: one run-level pad_full_seq_to (default); step: NeMo-RL's rule, each step's longest "
                         "microbatch (one graph per new length)")
    ap.add_argument("--passes", type=int, default=3, help="timed passes over the stream (default 3)")
    ap.add_argument("--cp-size", type=int, default=2, help="context-parallel size C (default 2)")
    ap.add_argument("--cp-rank", type=int, default=0, help="the simulated CP rank (default 0)")
    ap.add_argument("--multiple", type=int, default=None,
                    help="pad_individual_seqs_to_multiple_of (default 2*cp-size)")
    ap.add_argument("--row-capacity", type=int, default=None, help="rows R every graph sees (default: most rows)")
    ap.add_argument("--model", choices=("linear", "identity") + REAL_MODELS, default="linear",
                    help="model stand-in: embedding + linear, identity, or a real tiny transformer through its nn_data "
                         "adapter: hf (transformers Llama) or megatron (megatron-core GPTModel, --cp-size 1) "
                         "(default linear)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary of the ids (default 4096)")
    ap.add_argument("--hidden", type=int, default=32, help="embedding width H (default 32)")
    ap.add_argument("--out-features", type=int, default=1, help="features per token unpacked, O (default 1)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--modes", nargs="+", choices=ALL_MODES, default=None,
                    help="default: eager compiled loop, plus reduce-overhead on CUDA")
    ap.add_argument("--compile-scope", choices=("whole", "data"), default=None,
                    help="one compiled region per microbatch, model included (whole; the default with the "
                         "stand-in models), or three regions around the eager model (data; the default with "
                         "--model hf|megatron)")
    ap.add_argument("--wrapper", choices=("cpp", "python"), default=None,
                    help="inductor's code around the kernels: C++ (cpp_wrapper; default on the CPU) or Python "
                         "(default on CUDA)")
    ap.add_argument("--kernel-names", action="store_true",
                    help="name every fused kernel in the traces (inductor's cpp.enable_kernel_profile; "
                         "costs time on every compiled call, so off by default)")
    ap.add_argument("--guard-eval", choices=GUARD_EVAL, default=None,
                    help="compiled modes' steady calls: evaluate only the guards that tell graphs apart "
                         "(skip-unsafe, default; the sync and trace passes keep every guard) or all (full, the "
                         "default with --packed-length step, whose graphs differ in the pipeline they were built for)")
    ap.add_argument("--compile-cache", default=None, metavar="DIR",
                    help="reuse compiled artifacts across runs: inductor's cache folder and "
                         "nn_data.compile_cache artifacts in DIR (loaded if present, saved after the run)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: 1 on the CPU, where small per-microbatch timings swing "
                         "with a second thread on a 2-core machine; torch's default on CUDA)")
    ap.add_argument("--allocator", choices=("reuse", "default"), default="reuse",
                    help="reuse: glibc keeps freed memory for reuse, as torch's CUDA caching allocator "
                         "does (no page faults on each new output; every mode alike; default); "
                         "default: glibc's own behaviour")
    ap.add_argument("--sync-steps", type=int, default=4, help="microbatches the sync count runs (default 4)")
    ap.add_argument("--trace-steps", type=int, default=3, help="microbatches traced per mode (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=None, help="run folder (default profiling/runs/<timestamp>)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return _checked(ap, ap.parse_args(argv))


def _checked(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The parsed flags with their defaults filled in; ``ap.error`` (exit 2) naming a bad flag."""
    if args.modes is None:
        args.modes = ["eager", "compiled"] + (["reduce-overhead"] if args.device.startswith("cuda") else []) + ["loop"]
    if args.multiple is None:
        args.multiple = 2 * args.cp_size
    if args.steps is not None and args.microbatches is not None:
        ap.error("--steps and --microbatches cannot both be given: --steps runs every microbatch of each step")
    if args.steps is None and args.microbatches is None:
        args.microbatches = 32
    if args.packed_length == "step" and args.model in REAL_MODELS:
        ap.error(f"--packed-length step needs a stand-in model (--model linear|identity), not {args.model}")
    if args.packed_length == "step" and args.guard_eval == "skip-unsafe":
        ap.error("--guard-eval skip-unsafe with --packed-length step: one region has a graph per packed length, and "
                 "skipping guards would run a microbatch on another length's graph; use --guard-eval full")
    if args.guard_eval is None:
        args.guard_eval = "full" if args.packed_length == "step" else "skip-unsafe"
    for name in ("batch_size", "max_len", "median_len", "max_tokens", "microbatches", "steps", "dp", "passes",
                 "cp_size", "multiple", "vocab", "hidden", "out_features", "sync_steps", "trace_steps"):
        if getattr(args, name) is None:
            continue
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid; expected an int >= 1")
    if not 0 <= args.cp_rank < args.cp_size:
        ap.error(f"--cp-rank={args.cp_rank} is invalid; expected 0 <= rank < --cp-size={args.cp_size}")
    if args.wrapper is None:
        args.wrapper = "python" if args.device.startswith("cuda") else "cpp"
    if args.compile_scope is None:
        args.compile_scope = "data" if args.model in REAL_MODELS else "whole"
    if args.model in REAL_MODELS and args.compile_scope != "data":
        ap.error(f"--compile-scope={args.compile_scope} with --model={args.model}: a real model runs eagerly between "
                 "the compiled data-path graphs; use --compile-scope data")
    if args.model == "megatron" and args.cp_size != 1:
        ap.error(f"--model=megatron needs --cp-size 1 (got {args.cp_size}): megatron-core's rotary embedding reads "
                 "the CP size from parallel_state, which one process cannot simulate")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device={args.device} but CUDA is not available (torch {torch.__version__})")
    return args


def describe_stream(stream: Stream) -> dict:
    in_order = [mb.lengths.shape[0] for mb in stream.microbatches]  # sequences per microbatch, as streamed
    rows = sorted(in_order)
    tokens = [mb.tokens for mb in stream.microbatches]
    totals = sorted({mb.total for mb in stream.microbatches})
    plans = stream.plans[:stream.steps]
    return dict(
        microbatches=len(stream.microbatches), global_batches=stream.global_batches, S=stream.seq_len,
        T=stream.total, R=stream.row_capacity, multiple=stream.multiple,
        rows_min=rows[0], rows_median=rows[len(rows) // 2], rows_max=rows[-1], rows_per_microbatch=in_order,
        mean_real_tokens=sum(tokens) / len(tokens),
        fill_of_T=sum(tokens) / sum(mb.total for mb in stream.microbatches),
        steps=stream.steps, packed_length=stream.packed_length, packed_lengths=totals,
        step_plans=list(stream.plans),
        work_imbalance_max=max(p["work_imbalance"] for p in plans) if plans else None,
        microbatches_per_rank=[p["microbatches_per_rank"] for p in plans],
    )


def check_outputs(modes, stream: Stream, count: int = 2) -> float:
    """Largest |difference| between each mode's output and the first mode's, on ``count`` microbatches.
    Raises ``RuntimeError`` when a mode disagrees (shape, or beyond float tolerance)."""
    worst = 0.0
    with torch.no_grad():
        for mb in stream.microbatches[:count]:
            outs = [(m.name, m.step(mb).clone()) for m in modes]
            ref_name, ref = outs[0]
            for name, out in outs[1:]:
                if out.shape != ref.shape or not torch.allclose(out.float(), ref.float(), rtol=1e-4, atol=1e-5):
                    raise RuntimeError(f"mode {name!r} disagrees with {ref_name!r} on a microbatch "
                                       f"(shapes {tuple(out.shape)} vs {tuple(ref.shape)})")
                worst = max(worst, float((out.float() - ref.float()).abs().max()))  # sync: check, untimed
    return worst


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    threads = args.threads if args.threads else (1 if device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    reuse = args.allocator == "reuse" and reuse_freed_memory()
    torch._dynamo.reset()
    counters.clear()
    if args.compile_cache:  # before anything compiles: inductor reads its cache folder lazily
        compile_cache.use_dir(args.compile_cache)
        compile_cache.load(compile_cache.artifacts_path(args.compile_cache))
    load = os.getloadavg()
    machine = machine_description()
    print(f"machine: {machine}")
    print(f"load average (1/5/15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; compiled: --compile-scope "
          f"{args.compile_scope}, --wrapper {args.wrapper}, --guard-eval {args.guard_eval}; allocator "
          f"{'reuse (mallopt)' if reuse else 'default'}")
    if load[0] > 0.5 * (os.cpu_count() or 1):
        print("note: the load average is high for this machine: other processes may be loading the CPU, so "
              "timings are noisy; with more than one thread, inductor's OpenMP kernels stall while other "
              "processes hold the cores (--threads 1 gives steadier figures then)")
    stream, info = _plan(args, device)
    lengths = "/".join(str(t) for t in info["packed_lengths"])
    torch.manual_seed(args.seed)
    if args.model in REAL_MODELS:
        model = AdapterStandIn(args.model, args.vocab, args.hidden, args.out_features, args.seed,
                               cp_size=args.cp_size, cp_rank=args.cp_rank).to(device).eval()
    else:
        model = ModelStandIn(args.model, args.vocab, args.hidden, args.out_features, args.seed).to(device).eval()
    modes = make_modes(args.modes, stream, model, cp_size=args.cp_size, cp_rank=args.cp_rank,
                       compile_scope=args.compile_scope, wrapper=args.wrapper, kernel_names=args.kernel_names)
    run_dir = Path(args.out_dir) if args.out_dir else RUNS / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    limit = max(torch._dynamo.config.recompile_limit, 4 * len(info["packed_lengths"]))  # one graph per T
    with torch._dynamo.config.patch(recompile_limit=limit):
        results = _measure_all(modes, stream, args, device, run_dir)
    if args.compile_cache:
        saved = compile_cache.save(compile_cache.artifacts_path(args.compile_cache))
        print(f"compile cache: {args.compile_cache} ({'saved' if saved else 'nothing new to save'})")
    with torch._dynamo.config.patch(recompile_limit=limit):
        max_diff = check_outputs(modes, stream)
    ratios = speedups(results)
    alone = share = None
    if args.model in REAL_MODELS:  # the model's own time, to read off the data path's share of a step
        alone = measure_model_alone(model, stream, cp_size=args.cp_size, cp_rank=args.cp_rank, passes=args.passes)
        share = data_path_share(results, alone)
    checks = targets(results, ratios, model_syncs=alone["syncs_per_microbatch"] if alone else 0.0,
                     steps=info["steps"], packed_lengths=len(info["packed_lengths"]))
    print()
    print(format_report(results, ratios, checks))
    print(f"outputs agree across modes (max |difference| {max_diff:.2e})")
    if alone:
        print(f"model {args.model} alone (inputs prepared beforehand): mean {alone['mean_s'] * 1e3:.2f} ms, median "
              f"{alone['median_s'] * 1e3:.2f} ms, {alone['syncs_per_microbatch']:.1f} host syncs per microbatch")
        print("data path's share of the mean time per microbatch: "
              + ", ".join(f"{name} {value:.1%}" for name, value in share.items()))
    header = dict(machine=machine, load_average=list(load), device=str(device), threads=torch.get_num_threads(),
                  allocator_reuse=reuse,
                  torch=torch.__version__, args=vars(args), stream=info, run_dir=str(run_dir),
                  outputs_max_abs_difference=max_diff, time=time.strftime("%Y-%m-%d %H:%M:%S"),
                  model_alone=alone, data_path_share=share)
    summary = write_summary(str(run_dir / "summary.json"), header=header, results=results, ratios=ratios, checks=checks)
    subtitle = (f"{machine}, load {load[0]:.1f}\nS={info['S']} T={lengths} R={info['R']} C={args.cp_size}; a stream "
                f"of {info['microbatches']} microbatches ({info['steps']} complete step(s)), timed {args.passes} times: "
                f"{max(info['steps'] * args.passes - 1, 0)} timed steps, the first (compiling) left out")
    write_chart(str(run_dir / "chart.png"), results, subtitle, rows=info["rows_per_microbatch"], passes=args.passes,
                ratios=ratios, step_of=[mb.step for mb in stream.microbatches])
    print(f"run folder: {run_dir} (summary.json, chart.png, one trace folder per mode)")
    print(f"traces: bash scripts/tensorboard.sh {run_dir}")
    if hasattr(model, "close"):
        model.close()
    return summary


def _plan(args, device) -> tuple:
    """The stream (``profiling.microbatches.plan.plan_stream``) and its description, printed."""
    stream = plan_stream(
        microbatches=args.microbatches, batch_size=args.batch_size, max_len=args.max_len, median=args.median_len,
        sigma=args.sigma, vocab=args.vocab, max_tokens=args.max_tokens, cp_size=args.cp_size,
        multiple=args.multiple, seed=args.seed, device=device, row_capacity=args.row_capacity,
        steps=args.steps, dp=args.dp, balance=args.balance, packed_length=args.packed_length,
    )
    info = describe_stream(stream)
    print(f"stream: {info['microbatches']} microbatches from {info['global_batches']} global batch(es) of "
          f"{args.batch_size} ({info['steps']} complete step(s); plan_step over dp={args.dp}, balance "
          f"{args.balance}, work imbalance <= {info['work_imbalance_max']:.3f}); S={info['S']} "
          f"T={'/'.join(str(t) for t in info['packed_lengths'])} ({args.packed_length}-level) R={info['R']} "
          f"m={info['multiple']} C={args.cp_size} rank={args.cp_rank}; rows per microbatch {info['rows_min']}-"
          f"{info['rows_max']} (median {info['rows_median']}); real tokens {info['fill_of_T']:.0%} of T; device "
          f"{device}")
    return stream, info


def _measure_all(modes, stream: Stream, args, device, run_dir: Path) -> list:
    """Each mode's first call, the interleaved steady passes, then each mode's sync and trace passes."""
    firsts = {mode.name: first_call(mode, stream, device) for mode in modes}
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=steady_calls(len(modes), stream, args.passes), desc="timed microbatches, all modes",
                        unit="mb", file=sys.stderr, leave=True)
    before = graph_count()
    try:
        samples = steady_samples(modes, stream, args.passes, device, args.guard_eval, progress)
    finally:
        if progress is not None:
            progress.close()
    steady_graphs = graph_count() - before
    return [measure_mode(mode, stream, first=firsts[mode.name], samples=samples[mode.name],
                         steady_graphs=steady_graphs, sync_steps=args.sync_steps, trace_steps=args.trace_steps,
                         device=device, run_dir=str(run_dir)) for mode in modes]

