"""Diagnostics for users, tests and benchmarks: count host-device syncs in Python code.

On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the authoritative check;
on the CPU build there is none, so :class:`HostSyncCounter` counts the Python-level
calls that bring tensor values to the host.
"""

from __future__ import annotations

import torch

_SYNCING_METHODS = ("item", "tolist", "__bool__", "nonzero", "__int__", "__float__", "__index__")


class HostSyncCounter:
    """Context manager counting the Python-level calls that read tensor values on the host
    (the ``Tensor`` methods in ``_SYNCING_METHODS`` and the function form of ``nonzero``)
    made while it is active.

    Example::

        >>> with HostSyncCounter() as syncs:
        ...     _ = int(torch.tensor(2))
        >>> syncs.count
        1

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

    def __enter__(self) -> "HostSyncCounter":
        for name in _SYNCING_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        self._saved["torch.nonzero"] = torch.nonzero  # sync: none, the counter wraps this function
        torch.nonzero = self._wrap("torch.nonzero", torch.nonzero)  # sync: none, the counter wraps it
        return self

    def __exit__(self, *exc) -> None:
        torch.nonzero = self._saved.pop("torch.nonzero")  # sync: none, restores the wrapped function
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
