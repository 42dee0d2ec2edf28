"""Diagnostics for users, tests and benchmarks, every counter in one home: host-device syncs in Python
code (:class:`HostSyncCounter`) and on CUDA (:class:`SyncCounter`, :func:`forbid_syncs`), collectives
(:class:`CollectiveCounter`), fresh allocations (:class:`Allocations`), the graphs and recompiles of
``torch.compile`` (:class:`GraphCounter`) and inductor's CUDA graphs (:class:`CudaGraphCounter`).

On CUDA ``torch.cuda.set_sync_debug_mode("error")`` is the authoritative check; on the CPU build
:class:`HostSyncCounter` counts the Python-level calls that read tensor values on the host or copy Python
data to a device."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNCING_METHODS = ("item", "tolist", "__bool__", "nonzero", "__int__", "__float__", "__index__")
# Builders that copy Python data into a new tensor; counted when the tensor lands off the CPU.
_DATA_CONSTRUCTORS = ("tensor", "as_tensor", "asarray")


class HostSyncCounter:
    """Context manager counting the Python-level calls that read tensor values on the host (``_SYNCING_METHODS``
    and ``nonzero``) and those that build a tensor from Python data on a non-CPU device (a host-to-device copy:
    build it on the device instead). The ``meta`` device counts, so the check runs without a GPU; nested counted
    calls count once; compiled code is read from its graph instead.

    Example::

        >>> with HostSyncCounter() as syncs:
        ...     _ = int(torch.tensor(2))
        ...     _ = torch.tensor(3, device="meta")
        >>> syncs.count, syncs.calls
        (2, ['__int__', 'torch.tensor'])"""

    def __init__(self):
        self.count = 0
        self.calls: list[str] = []  # the name of each counted call, in order
        self._saved: dict[str, object] = {}
        self._depth = 0

    def _wrap(self, name: str, original):
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.count += 1
                self.calls.append(name)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def _wrap_constructor(self, name: str, original):
        def counted(*args, **kwargs):
            self._depth += 1
            try:
                out = original(*args, **kwargs)
            finally:
                self._depth -= 1
            data = args[1] if name == "Tensor.new_tensor" and len(args) > 1 else (args[0] if args else None)
            if (self._depth == 0 and isinstance(out, torch.Tensor) and out.device.type != "cpu"
                    and not isinstance(data, torch.Tensor)):
                self.count += 1
                self.calls.append(name)
            return out

        return counted

    def __enter__(self) -> "HostSyncCounter":
        for name in _SYNCING_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        self._saved["Tensor.new_tensor"] = torch.Tensor.new_tensor
        torch.Tensor.new_tensor = self._wrap_constructor("Tensor.new_tensor", torch.Tensor.new_tensor)
        self._saved["torch.nonzero"] = torch.nonzero  # sync: none, the counter wraps this function
        torch.nonzero = self._wrap("torch.nonzero", torch.nonzero)  # sync: none, the counter wraps it
        for name in _DATA_CONSTRUCTORS:
            self._saved[f"torch.{name}"] = getattr(torch, name)
            setattr(torch, name, self._wrap_constructor(f"torch.{name}", getattr(torch, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            if name.startswith("torch."):
                setattr(torch, name[len("torch."):], original)  # sync: none, restores a wrapped function
            else:
                setattr(torch.Tensor, name.removeprefix("Tensor."), original)
        self._saved.clear()


# torch.distributed's operator namespaces: c10d (dist.all_reduce, ...) and the functional collectives.
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")  # bookkeeping of a functional collective


class CollectiveCounter(TorchDispatchMode):
    """Context manager counting the ``torch.distributed`` collectives this process issues, forward and backward:
    ``count`` and ``calls`` (operator names, in order). It sees every collective that reaches the dispatcher,
    functional or not (NeMo-RL's calls and nn_data's alike); waiting on one is not a second.

    Example (in each rank of a group)::

        with CollectiveCounter() as coll:
            torch.distributed.all_reduce(x)
        coll.calls  # ['allreduce_']"""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    @property
    def count(self) -> int:
        return len(self.calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func._schema.name.partition("::")
        if namespace in _COLLECTIVE_NAMESPACES and name not in _NOT_COLLECTIVES:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


# ---- torch.compile: graphs and recompiles ---------------------------------------------------------
# GraphCounter reads dynamo's counters["stats"]["unique_graphs"] and its compile-start callback, whose compile
# id "frame/n" says which compilation of a frame this is (n >= 1: a recompile); alike in torch 2.11 and 2.13.

class GraphCounter:
    """Count what ``torch.compile`` compiles inside the block, with any backend: ``graphs`` (handed to the backend),
    ``compiles`` (frames dynamo compiled) and ``recompiles`` (compiled again because every earlier compilation's
    guards failed; why: ``TORCH_LOGS=recompiles``).

    Example (docs/compile-contract.md)::

        with GraphCounter() as counted:
            for input_ids, seq_lengths in stream:
                wrapped(input_ids, seq_lengths)
        counted.graphs, counted.recompiles  # (2, 0): PackedForward(compile_packing=True, ...) over any stream"""

    def __init__(self):
        self.graphs = 0
        self.compiles = 0
        self.recompiles = 0

    def _started(self, args) -> None:
        from torch._dynamo.callback import CallbackTrigger
        from torch._guards import CompileId

        if args.callback_trigger != CallbackTrigger.DYNAMO:  # a deferred backward, a CUDA-graph recording
            return
        self.compiles += 1
        compile_id = CompileId.from_string(args.compile_id)
        if compile_id is not None and (compile_id.frame_compile_id or 0) > 0:
            self.recompiles += 1

    def __enter__(self) -> "GraphCounter":
        from torch._dynamo.callback import callback_handler
        from torch._dynamo.utils import counters

        self._before = int(counters["stats"]["unique_graphs"])
        callback_handler.register_start_callback(self._started)
        return self

    def __exit__(self, *exc) -> None:
        from torch._dynamo.callback import callback_handler
        from torch._dynamo.utils import counters

        callback_handler.remove_start_callback(self._started)
        self.graphs = int(counters["stats"]["unique_graphs"]) - self._before


# ---- CUDA: the sync debug mode and inductor's CUDA graphs (CPU fallbacks where there is none) ----
# CudaGraphCounter wraps torch._inductor.cudagraph_trees.CUDAGraphNode._record and .run_graph: private names,
# alike in torch 2.11 and 2.13 (a replay right after recording is no run_graph call: replays is the steady state).

_SYNC_WORD = "synchroniz"  # each sync: "called a synchronizing CUDA operation"
# set_sync_debug_mode's first call in a process warns once, "Synchronization debug mode is a prototype
# feature and does not yet detect all synchronizing operations": a notice, not a sync.
_MODE_NOTICE = "debug mode is a prototype feature"


def cuda_sync_warnings(caught) -> list:
    """The warnings among ``caught`` (``warnings.catch_warnings(record=True)``) that report a host-device sync
    under ``torch.cuda.set_sync_debug_mode("warn")``, less the notice the debug mode prints on its first use.

    Example::

        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
        ...                   "synchronizing operations")
        ...     warnings.warn("called a synchronizing CUDA operation")
        >>> [str(w.message) for w in cuda_sync_warnings(caught)]
        ['called a synchronizing CUDA operation']"""
    return [w for w in caught if _SYNC_WORD in str(w.message) and _MODE_NOTICE not in str(w.message)]


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


class SyncCounter:
    """Count host-device syncs made inside the block on ``device``: on CUDA every warning of
    ``set_sync_debug_mode("warn")`` (blocking copies both ways, ``.item()``, ``synchronize()``), on the CPU
    :class:`HostSyncCounter`'s calls. ``count`` and ``locations`` (``"file:line"`` on CUDA, the method names on
    the CPU) are set on exit; on CUDA the device is synchronised before the block."""

    def __init__(self, device):
        self.cuda = _is_cuda(device)
        self.count = 0
        self.locations: list[str] = []
        self._stack = None

    def __enter__(self) -> "SyncCounter":
        self._stack = contextlib.ExitStack()
        if self.cuda:
            torch.cuda.synchronize()
            self._caught = self._stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            self._stack.callback(torch.cuda.set_sync_debug_mode, previous)
        else:
            self._host = self._stack.enter_context(HostSyncCounter())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        if self.cuda:
            hits = cuda_sync_warnings(self._caught)
            self.locations = [f"{w.filename}:{w.lineno}" for w in hits]
        else:
            self.locations = list(self._host.calls)
        self.count = len(self.locations)


@contextlib.contextmanager
def forbid_syncs(device):
    """Raise on the first host-device sync in the block (CUDA: ``set_sync_debug_mode("error")``,
    a ``RuntimeError``); on the CPU, raise ``AssertionError`` at the end if ``HostSyncCounter``
    counted any."""
    if _is_cuda(device):
        torch.cuda.synchronize()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return
    with HostSyncCounter() as syncs:
        yield
    assert syncs.count == 0, f"{syncs.count} host syncs: {syncs.calls}"


class CudaGraphCounter:
    """Count inductor's CUDA-graph recordings (``recorded``: one per compiled function and input-shape path), steady
    ``replays`` and ``skips`` (graphs it refused to capture; on the CPU every reduce-overhead graph) in the block."""

    def __init__(self):
        self.recorded = 0
        self.replays = 0
        self.skips = 0

    def __enter__(self) -> "CudaGraphCounter":
        from torch._dynamo.utils import counters
        from torch._inductor import cudagraph_trees

        node = cudagraph_trees.CUDAGraphNode
        self._node, self._saved = node, (node._record, node.run_graph)
        self._skips_before = int(counters["inductor"]["cudagraph_skips"])
        record, run_graph = self._saved
        counter = self

        def counted_record(self_, *args, **kwargs):
            counter.recorded += 1
            return record(self_, *args, **kwargs)

        def counted_run_graph(self_, *args, **kwargs):
            counter.replays += 1
            return run_graph(self_, *args, **kwargs)

        node._record, node.run_graph = counted_record, counted_run_graph
        return self

    def __exit__(self, *exc) -> None:
        from torch._dynamo.utils import counters

        self._node._record, self._node.run_graph = self._saved
        self.skips = int(counters["inductor"]["cudagraph_skips"]) - self._skips_before


# ---- allocations ---------------------------------------------------------------------------------

class Allocations(TorchDispatchMode):
    """Element counts of every fresh (non-view, non-in-place) tensor an aten op returns, in ``sizes``
    (the log-prob tests assert that no ``[T, V]``-sized temporary is made)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.sizes.append(t.numel())
        return out
