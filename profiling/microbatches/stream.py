"""The per-microbatch pipelines of ``profiling.microbatches`` (nn_data ops eager or compiled, and
NeMo-RL-style loops) over the stream that ``profiling.microbatches.plan`` plans.

Shape legend
    N   sequences in a global batch (``--batch-size``)
    B   sequences in one planned microbatch (varies); R >= B the row capacity every graph sees
    S   padded row length of the global batch (``--max-len``; constant for the stream)
    T   packed tokens per microbatch: ``pad_full_seq_to``, one run-level constant (by default; with
        ``--packed-length step`` one per step, each with its own pipeline and graph)
    C   context-parallel size; this rank's model sees ``T/C`` tokens
    H   hidden size of the model stand-in; O its output features per token

One microbatch, per mode:
    nn_data eager: the B real rows -> pack [1,T] (one host read of the lengths: the plan) -> CP shard
        [1,T/C] -> model [1,T/C,O] -> simulated all-gather [C,T/C,O] -> unshard [1,T,O] -> unpack
        [B,S,O], every op after the pack on the pack's layout (no further read)
    nn_data compiled: pad rows to R (outside the compiled region; static shapes) -> the same chain on
        the device executor -> [R,S,O]
    loop (NeMo-RL style, nn_data.testing.reference): the same chain on the B real rows, one Python
        iteration per sequence and segment, host syncs included.

The all-gather is simulated in one process by stacking this rank's model output ``C`` times
(the buffer a real all-gather fills, without the communication). Every mode computes the
same function, so their outputs are compared; positions owned by other ranks hold this
rank's values, which is fine for profiling but not a real model output.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from nn_data import PackSequences, ShardForContextParallel, UnpackSequences, UnshardFromContextParallel
from nn_data import RowPadded
from nn_data.errors import PackingError
from nn_data.pack import check_pack_args
from nn_data.testing.reference import reference_pack, reference_shard, reference_unpack, reference_unshard
from profiling.microbatches.plan import Microbatch, Stream, plan_stream  # noqa: F401  (re-exported)
from profiling.timing import CPU_INDUCTOR_OPTIONS


class ModelStandIn(nn.Module):
    """A small model on the local packed tokens: ``ids [1, T/C] -> [1, T/C, O]`` (the packed
    boundaries ``cu_seqlens_padded`` are passed too, for real models: profiling/microbatches/real_models.py).

    ``kind="linear"``: embedding ``[vocab, H]`` then a linear layer ``H -> O`` (O = 1 is a
    per-token score, like the log-probs or values an RL step unpacks). ``kind="identity"``:
    the ids themselves as ``[1, T/C, 1]`` (data movement only).
    """

    def __init__(self, kind: str, vocab: int, hidden: int, out_features: int, seed: int):
        super().__init__()
        if kind not in ("linear", "identity"):
            raise PackingError(f"--model={kind!r} is invalid; expected 'linear' or 'identity'")
        self.kind = kind
        if kind == "linear":
            gen = torch.Generator().manual_seed(seed)
            self.embed = nn.Embedding(vocab, hidden)
            self.proj = nn.Linear(hidden, out_features)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)

    def forward(self, ids: torch.Tensor, cu_seqlens_padded: torch.Tensor = None) -> torch.Tensor:
        if self.kind == "identity":
            return ids.unsqueeze(-1)  # [1, T/C, 1]
        return self.proj(self.embed(ids))  # [1, T/C, O]


def simulate_all_gather(local: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``[1, T/C, *] -> [C, T/C, *]``: this rank's output in every rank's slot (one copy, the
    buffer an all-gather writes)."""
    return local.expand(cp_size, *local.shape[1:]).contiguous()


class MicrobatchPipeline(nn.Module):
    """pack -> CP shard -> model -> simulated all-gather -> unshard -> unpack, on nn_data ops.

    ``forward(x [R, S], lengths [R], num_rows 0-d) -> [R, S, O]``: the pack's layout travels to the
    shard, the unshard and the unpack (``layout=``), so eagerly the microbatch costs the pack's one
    host read; compiled, the same code runs on the device executor. Every shape is fixed by
    ``(R, S, T, C)``, so ``torch.compile(fullgraph=True)`` compiles each part once for the stream.
    """

    def __init__(self, model: nn.Module, *, seq_len: int, total: int, multiple: int, cp_size: int, cp_rank: int):
        super().__init__()
        self.pack = PackSequences(multiple, pad_full_seq_to=total)
        self.shard = ShardForContextParallel(cp_size, cp_rank)
        self.unshard = UnshardFromContextParallel(cp_size)
        self.unpack = UnpackSequences(seq_len)
        self.model = model
        self.cp_size = cp_size

    def prepare(self, x: torch.Tensor, lengths: torch.Tensor, num_rows: torch.Tensor):
        """``x [R, S]`` -> this rank's tokens ``[1, T/C]`` and the pack's layout (the plan every later op
        runs on: eagerly no op reads the boundaries again)."""
        r = self.pack(x, lengths, num_rows)  # packed [1, T]
        return self.shard(r.packed, layout=r.layout), r.layout  # [1, T/C]

    def gather(self, out: torch.Tensor, layout) -> torch.Tensor:
        """This rank's model output ``[1, T/C, O]`` -> the packed output ``[1, T, O]`` (simulated
        all-gather, then unshard)."""
        return self.unshard(simulate_all_gather(out, self.cp_size), layout=layout)  # [1, T, O]

    def finish(self, out: torch.Tensor, layout) -> torch.Tensor:
        """This rank's model output ``[1, T/C, O]`` -> rows ``[R, S, O]``."""
        return self.unpack(self.gather(out, layout), layout=layout)  # [R, S, O]

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, num_rows: torch.Tensor) -> torch.Tensor:
        local, layout = self.prepare(x, lengths, num_rows)
        return self.finish(self.model(local, layout.cu_seqlens_padded), layout)


def compile_pipeline(pipeline: MicrobatchPipeline, *, scope: str, mode: str | None, wrapper: str = "cpp",
                     kernel_names: bool = False):
    """``(x, lengths, num_rows) -> [R, S, O]`` through ``torch.compile(fullgraph=True, dynamic=False)``.

    ``scope="whole"`` (default): one compiled region per microbatch, model included: pack ->
    shard -> model -> all-gather -> unshard -> unpack. ``scope="data"``: three regions around the
    eagerly run model, ``prepare`` (pack, shard) | model | ``gather`` (all-gather, unshard) |
    ``unpack``, where a CP step has boundaries anyway and where ``nn_data.PackedForward`` puts them.
    Every compiled region costs a fixed amount per call (Dynamo's guard evaluation and the
    wrappers around the kernels), which at these sizes is a large part of a microbatch: one
    region pays it once. ``wrapper="cpp"`` (the profiler's default on the CPU) has inductor emit
    the code that calls the kernels in C++ (``cpp_wrapper``) instead of Python, and plans the
    graph's temporaries into one allocation (``memory_planning``); on CUDA the profiler keeps the
    Python wrapper (CUDA graphs replay the kernels there; the C++ wrapper was measured on the CPU
    only). ``kernel_names`` has every fused kernel
    record a profiler event under its name (inductor's ``cpp.enable_kernel_profile``): the traces
    then show them, at a cost on every call (about a fifth of a compiled microbatch here).
    profiling/results/main_job.md has the figures.

    The inputs' shapes, dtypes and devices are checked before any compiled region, so a bad
    input raises :class:`PackingError` as in eager mode (not a dynamo error).
    """
    from torch._inductor import list_mode_options

    if wrapper not in ("cpp", "python"):
        raise PackingError(f"--wrapper={wrapper!r} is invalid; expected 'cpp' or 'python'")
    options = dict(list_mode_options(mode, False)) if mode else {}
    options["cpp.enable_kernel_profile"] = kernel_names
    options["cpp_wrapper"] = wrapper == "cpp"
    if mode is None and wrapper == "cpp":  # one allocation per call for the temporaries (a static plan)
        options.update(CPU_INDUCTOR_OPTIONS)
    options = dict(fullgraph=True, dynamic=False, options=options)
    if scope == "whole":  # the bound forward, not the module: no nn.Module call machinery per call
        whole = torch.compile(pipeline.forward, **options)

        def run_whole(x, lengths, num_rows):
            check_pack_args(x, lengths, num_rows)  # before the compiled region
            return whole(x, lengths, num_rows)

        return run_whole
    if scope != "data":
        raise PackingError(f"--compile-scope={scope!r} is invalid; expected 'whole' or 'data'")
    prepare = torch.compile(pipeline.prepare, **options)
    gather = torch.compile(pipeline.gather, **options)
    unpack = torch.compile(pipeline.unpack, **options)

    def run(x, lengths, num_rows):
        check_pack_args(x, lengths, num_rows)  # before the compiled region
        local, layout = prepare(x, lengths, num_rows)  # [1, T/C], the plan (device index maps)
        full = gather(pipeline.model(local, layout.cu_seqlens_padded), layout)  # [1, T, O]
        return unpack(full, layout=layout)  # [R, S, O]

    return run


def loop_pipeline(model: nn.Module, mb: Microbatch, *, seq_len: int, total: int, multiple: int,
                  cp_size: int, cp_rank: int) -> torch.Tensor:
    """The NeMo-RL-style baseline on the ``B`` real rows: ``[B, S, O]``."""
    ref = reference_pack(mb.input_ids, mb.lengths, multiple, 1, total)  # packed [1, T]
    local = reference_shard(ref.packed, ref.cu_seqlens_padded, cp_size, cp_rank)  # [1, T/C]
    out = model(local, ref.cu_seqlens_padded)  # [1, T/C, O]
    full = reference_unshard(simulate_all_gather(out, cp_size), ref.cu_seqlens_padded, cp_size)  # [1, T, O]
    return reference_unpack(full, mb.lengths, ref.cu_seqlens_padded, seq_len)  # [B, S, O]


class Mode(NamedTuple):
    """One way to run a microbatch: ``step(mb) -> [B, S, O]`` (real rows only). ``first_calls``: the
    calls before its steady state, timed together as its first call: 2 for ``reduce-overhead`` on
    CUDA (inductor's CUDA graphs run the first call as a warm-up and record on the second), else 1."""

    name: str
    step: Callable[[Microbatch], torch.Tensor]
    compiled: bool
    first_calls: int = 1


class RowBuffers:
    """The static-shape modes' inputs: one ``[R, S]`` ids buffer, one ``[R]`` lengths buffer and the
    0-d row count, refilled for every microbatch (as CUDA graphs' static inputs are), instead of a
    fresh padded batch per microbatch. Only the ``B`` real rows are copied: rows past them keep older
    ids, which nothing reads (their length is 0; every op masks or discards tokens past a length).
    Nothing is copied from the host: the row count is written on the device (``fill_``), as
    :func:`nn_data.pad_to_row_capacity` does (``torch.tensor(B, device="cuda")`` would be a blocking
    copy from pageable memory: a host sync in every microbatch).
    """

    def __init__(self, capacity: int, seq_len: int, device):
        self.x = torch.zeros(capacity, seq_len, dtype=torch.int64, device=device)  # [R, S]
        self.lengths = torch.zeros(capacity, dtype=torch.int64, device=device)  # [R]
        self.num_rows = torch.zeros((), dtype=torch.int64, device=device)  # B

    def fill(self, mb: Microbatch) -> RowPadded:
        rows = mb.lengths.shape[0]
        if rows > self.x.shape[0]:
            raise PackingError(f"a microbatch has {rows} rows, more than the row capacity {self.x.shape[0]}")
        self.x[:rows].copy_(mb.input_ids)
        self.lengths[:rows].copy_(mb.lengths)
        self.lengths[rows:].zero_()
        self.num_rows.fill_(rows)  # written on the device: no copy from the host
        return RowPadded(self.x, self.lengths, self.num_rows)


def make_modes(names, stream: Stream, model: nn.Module, *, cp_size: int, cp_rank: int,
               compile_scope: str = "whole", wrapper: str = "cpp", kernel_names: bool = False) -> list[Mode]:
    """Build the requested modes: ``eager``, ``compiled`` (inductor, default mode),
    ``reduce-overhead`` (inductor with CUDA graphs on CUDA) and ``loop``. Compiled modes
    use ``fullgraph=True, dynamic=False`` (:func:`compile_pipeline`): static graphs compiled
    on the first microbatch and reused for the stream; one pipeline (and graph) per packed length
    ``T`` in the stream (one with a run-level ``T``)."""
    dims = dict(seq_len=stream.seq_len, multiple=stream.multiple, cp_size=cp_size)
    pipelines = {t: MicrobatchPipeline(model, cp_rank=cp_rank, total=t, **dims)
                 for t in sorted({mb.total or stream.total for mb in stream.microbatches})}
    capacity = stream.row_capacity

    def with_rows(fns: dict, mark_step=False):
        buffers = RowBuffers(capacity, stream.seq_len, stream.microbatches[0].input_ids.device)

        def step(mb: Microbatch) -> torch.Tensor:
            padded = buffers.fill(mb)  # [R, S], outside the graph
            if mark_step:  # a new CUDA-graph step: the previous outputs may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            return fns[mb.total or stream.total](padded.x, padded.seq_lengths, padded.num_rows)[: mb.lengths.shape[0]]
        return step

    modes = []
    for name in names:
        if name == "eager":  # the B real rows, as the loop: the row capacity is the compiled graphs' static shape
            modes.append(Mode(name, lambda mb: pipelines[mb.total or stream.total](mb.input_ids, mb.lengths, None),
                              False))
        elif name in ("compiled", "reduce-overhead"):
            mode = None if name == "compiled" else "reduce-overhead"
            fns = {t: compile_pipeline(p, scope=compile_scope, mode=mode, wrapper=wrapper, kernel_names=kernel_names)
                   for t, p in pipelines.items()}
            records = mode is not None and stream.microbatches[0].input_ids.device.type == "cuda"
            modes.append(Mode(name, with_rows(fns, mark_step=mode is not None), True, first_calls=2 if records else 1))
        elif name == "loop":
            modes.append(Mode(name, lambda mb: loop_pipeline(model, mb, cp_rank=cp_rank, total=mb.total or stream.total,
                                                             **dims), False))
        else:
            raise PackingError(f"mode {name!r} is unknown; expected eager, compiled, reduce-overhead or loop")
    return modes
