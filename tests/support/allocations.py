"""Test helper (pure CPU): count the fresh tensors aten ops allocate.

Used by the log-prob tests to assert that no ``[T, V]``-sized temporary is made.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Allocations(TorchDispatchMode):
    """Element counts of every fresh (non-view, non-in-place) tensor an aten op returns."""

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
