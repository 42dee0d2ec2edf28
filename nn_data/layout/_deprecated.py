"""The layout's 0.1.x names, and the names that moved to :mod:`nn_data.layout.internal`, kept working
with a ``DeprecationWarning`` (CHANGELOG.md, 0.2.0).

``LayoutSpec(m, p, packed_length=, packed_length_name=, ...)`` is :class:`~nn_data.layout.PackSpec`
(``fixed_total=``, ``arg_name=``); ``plan_from_lengths`` is
:func:`~nn_data.layout.layout_from_lengths`; ``plan_from_boundaries(cu_seqlens_padded, total, *, op, ...)``
returned ``(layout, flag)`` and is :func:`~nn_data.layout.layout_from_boundaries` over a
:class:`~nn_data.layout.Boundaries` record.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from nn_data.layout.build import Boundaries, PackSpec, layout_from_boundaries, layout_from_lengths


def _warn(old: str, new: str) -> None:
    warnings.warn(f"nn_data.layout.{old} is deprecated (0.2.0); use nn_data.layout.{new}", DeprecationWarning,
                  stacklevel=3)


def _layout_spec(m: int = 1, p: int = 1, *, packed_length=None, packed_length_name: str = "pad_full_seq_to",
                 **rest) -> PackSpec:
    return PackSpec(m, p, fixed_total=packed_length, arg_name=packed_length_name, **rest)


def _plan_from_boundaries(cu_seqlens_padded: torch.Tensor, total, *, op: str, cu_seqlens=None, seq_lengths=None,
                          row_len=None, seq_len=None, cp_size: int = 1, validate: bool = True,
                          host_reads: bool = True, name: str = "cu_seqlens_padded", end_at_total: bool = True,
                          where: str = "", hint: bool = False, extra=None):
    flag = []
    also = None if extra is None else (extra, lambda: flag.append(False))
    bounds = Boundaries(cu_seqlens_padded, total, cu_seqlens=cu_seqlens, seq_lengths=seq_lengths, name=name,
                        total_from=where, valid_offsets=not end_at_total,
                        also_check=also)
    layout = layout_from_boundaries(bounds, op=op, cp_size=cp_size, seq_len=seq_len, row_len=row_len,
                                    validate=validate, host_reads=host_reads)
    ok = None if extra is None or layout.host is None else not flag
    return layout, ok


def _moved(name: str):
    """The object of a name that moved from the user's door to :mod:`nn_data.layout.internal` (or None)."""
    from nn_data.layout import internal

    return getattr(internal, name) if name in internal.__all__ else None


_OLD = {"LayoutSpec": ("PackSpec", _layout_spec), "plan_from_lengths": ("layout_from_lengths", layout_from_lengths),
        "plan_from_boundaries": ("layout_from_boundaries over a Boundaries record", _plan_from_boundaries)}


def __getattr__(name: str) -> Any:
    if name in _OLD:
        new, obj = _OLD[name]
        _warn(name, new)
        return obj
    moved = _moved(name)
    if moved is not None:
        warnings.warn(f"nn_data.layout.{name} is for nn_data's own use (0.2.0): nn_data.layout.internal.{name}",
                      DeprecationWarning, stacklevel=2)
        return moved
    raise AttributeError(f"module 'nn_data.layout' has no attribute {name!r}")
