"""Counters for the GPU checks (tests/cuda, ``bench_ops --device cuda``, ``gpu_check``).

* :class:`SyncCounter` counts host-device syncs. On CUDA it is the authoritative check,
  ``torch.cuda.set_sync_debug_mode("warn")``: every blocking copy (device to host *and* host
  to device from pageable memory, e.g. ``torch.tensor(3, device="cuda")``), ``.item()``,
  ``synchronize()`` warns, and each warning's Python location is kept. On the CPU it falls
  back to :class:`nn_data.diagnostics.HostSyncCounter` (Python-level value reads).
* :func:`forbid_syncs` is the contract itself: ``set_sync_debug_mode("error")`` on CUDA (the
  first sync raises), a zero ``HostSyncCounter`` on the CPU.
* :class:`CudaGraphCounter` counts the CUDA graphs inductor's cudagraph trees record
  (``mode="reduce-overhead"``) and replay, and the graphs inductor declined to capture
  (``counters["inductor"]["cudagraph_skips"]``). It wraps ``CUDAGraphNode._record`` and
  ``CUDAGraphNode.run_graph`` of ``torch._inductor.cudagraph_trees``: private names, present
  with the same meaning in torch 2.11 and 2.13 (a replay right after recording is not a
  ``run_graph`` call, so ``replays`` counts the steady-state calls).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from nn_data.diagnostics import HostSyncCounter

_SYNC_WORD = "synchroniz"  # "called a synchronizing CUDA operation"


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


class SyncCounter:
    """Count host-device syncs made inside the block on ``device`` (see the module docstring).

    ``count`` and ``locations`` (``"file:line"`` of each sync on CUDA; the method names on CPU)
    are set on exit. On CUDA the device is synchronised *before* the block (outside the count).
    """

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
            hits = [w for w in self._caught if _SYNC_WORD in str(w.message)]
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
    """Count inductor's CUDA-graph recordings, replays and skips inside the block.

    ``recorded``: graphs captured (one per compiled function and input-shape path);
    ``replays``: steady-state replays; ``skips``: graphs inductor refused to capture
    (``cudagraph_skips``; on the CPU every reduce-overhead graph is skipped).
    """

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
