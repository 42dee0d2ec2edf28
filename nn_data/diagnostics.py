"""Diagnostics for users, tests and benchmarks: count host-device syncs in Python code, and collectives.

On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the authoritative check;
on the CPU build there is none, so :class:`HostSyncCounter` counts the Python-level
calls that bring tensor values to the host, and those that build a tensor on a device from
Python data (``torch.tensor(3, device="cuda")`` copies from pageable host memory: on CUDA a
blocking copy, which the sync debug mode flags).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNCING_METHODS = ("item", "tolist", "__bool__", "nonzero", "__int__", "__float__", "__index__")
# Builders that copy Python data into a new tensor; counted when the tensor lands off the CPU.
_DATA_CONSTRUCTORS = ("tensor", "as_tensor", "asarray")


class HostSyncCounter:
    """Context manager counting, while it is active, the Python-level calls that read tensor
    values on the host (the ``Tensor`` methods in ``_SYNCING_METHODS`` and the function form of
    ``nonzero``) and those that build a tensor from Python data (not from a tensor) on a
    non-CPU device (``torch.tensor``, ``torch.as_tensor``, ``torch.asarray``,
    ``Tensor.new_tensor``): a host-to-device copy. Build such tensors on the device instead
    (``torch.full``, ``torch.arange``). The ``meta`` device counts, so the check runs on a
    machine without a GPU.

    Example::

        >>> with HostSyncCounter() as syncs:
        ...     _ = int(torch.tensor(2))
        ...     _ = torch.tensor(3, device="meta")
        >>> syncs.count, syncs.calls
        (2, ['__int__', 'torch.tensor'])

    Calls made from inside another counted call (``tolist`` calling ``__index__``,
    say) count once. Compiled (inductor) code does not call these methods from Python;
    read its graph instead (see ``tests/ops/test_ops_compile.py``).
    """

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
    """Context manager counting the ``torch.distributed`` collectives this process issues while it
    is active, forward and backward alike: ``count`` and ``calls`` (operator names, in order).

    It sees every collective that reaches torch's dispatcher: the functional collectives nn_data
    uses (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``) and
    ``torch.distributed.all_reduce`` / ``all_gather`` / ``barrier`` (``allreduce_``, ``allgather_``,
    ``barrier``), so it counts NeMo-RL's calls and nn_data's alike; waiting on a functional
    collective is not a second one. Example (in each rank of a group)::

        with CollectiveCounter() as coll:
            torch.distributed.all_reduce(x)
        coll.calls  # ['allreduce_']
    """

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
