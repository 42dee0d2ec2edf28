"""Row capacity: run microbatches with ``B <= R`` rows through ops compiled for ``R`` rows.

Shape legend
    B   real rows of a microbatch
    R   the fixed row capacity the compiled ops see
    S   padded row length
    *   trailing feature dims

The batch is padded *outside* the compiled region with empty rows (length 0) up to ``R``, the real row count
travelling as a 0-d tensor; empty rows change nothing in the real rows' results (docs/design.md, "Row
capacity"):

    >>> padded = pad_to_row_capacity(input_ids, seq_lengths, capacity=64)
    >>> out = compiled_pack(padded.x, padded.seq_lengths, padded.num_rows)"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_true

from nn_data import _checks
from nn_data.errors import PackingError


class RowPadded(NamedTuple):
    """``x [R, S, *]``, ``seq_lengths [R]`` (zeros past the real rows), ``num_rows`` (0-d int64)."""

    x: torch.Tensor
    seq_lengths: torch.Tensor
    num_rows: torch.Tensor


def pad_rows(t: torch.Tensor, capacity: int, fill=0, *, name: str = "capacity") -> torch.Tensor:
    """Append rows of ``fill`` to ``t [B, *]`` until it has ``capacity`` rows: ``[R, *]``. Raises
    :class:`PackingError` for more than ``capacity`` rows, naming the capacity as ``name`` (e.g. ``row_capacity``)."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise PackingError(f"{name}={capacity!r} is invalid; expected an int >= 0")
    _checks.check_min_dims("t", t, 1, "[B, *]")
    rows = t.shape[0]
    _checks.check_row_capacity(rows, capacity, name)
    # one pass over the batch; a concatenation, not a fill of out[rows:] (torch 2.11's inductor cannot vectorise
    # that masked fill on the CPU: CppCompileError)
    return row_major(torch.cat([t, t.new_full((capacity - rows, *t.shape[1:]), fill)]))


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides ``stride[i] = prod(shape[i+1:])``, also when a dim is 0: torch gives an empty tensor a
    size-1 dim's strides, and a graph compiled with a symbolic ``S`` guards ``stride(0) == S``. Others (and a
    symbolic-size tensor) come back as is. Example: ``[8, 0, 4, 2]`` -> strides ``(0, 8, 2, 1)``."""
    if t.dim() == 0 or guard_or_true(t.numel() != 0):  # an unbacked S: not known empty
        return t
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    return t.as_strided(t.shape, tuple(reversed(strides)))


def pad_to_row_capacity(x: torch.Tensor, seq_lengths: torch.Tensor, capacity: int, *,
                        name: str = "capacity") -> RowPadded:
    """Pad ``x [B, S, *]`` and ``seq_lengths [B]`` with empty rows to ``capacity`` rows: a :class:`RowPadded` with
    ``num_rows = B`` as a 0-d int64 tensor (for :class:`~nn_data.PackSequences`); pad the batch's other tensors with
    :func:`pad_rows`.

    Example: ``x [3, 8]``, lengths ``[5, 0, 8]``, capacity 4 -> ``x [4, 8]`` (last row
    zeros), lengths ``[5, 0, 8, 0]``, num_rows ``tensor(3)``.

    Raises :class:`PackingError` if ``B > capacity`` (naming the capacity as ``name``), or ``seq_lengths`` is not a
    1-D integer tensor of ``B`` entries."""
    _checks.check_min_dims("x", x, 2, "[B, S, *]")
    _checks.check_int_vector("seq_lengths", seq_lengths, x.shape[0])
    # torch.full writes the count on the device; torch.tensor(int, device=...) would copy it from
    # host memory (on CUDA a blocking copy from pageable memory: a sync).
    num_rows = torch.full((), x.shape[0], dtype=torch.int64, device=x.device)
    return RowPadded(pad_rows(x, capacity, name=name), pad_rows(seq_lengths, capacity, name=name), num_rows)


def with_dynamic_row_length(t: torch.Tensor) -> torch.Tensor:
    """``t [B, S, *]`` with its row length ``S`` (dim 1) marked *unbacked* for ``torch.compile``: a graph compiled
    from it serves every ``S``, ``0`` and ``1`` included. Call it outside the compiled region on every tensor of
    the batch with an ``S`` dim, each call; an empty tensor comes back with row-major strides (:func:`row_major`).
    No effect outside ``torch.compile``.

    Example::

        >>> compiled = torch.compile(PackSequences(8, pad_full_seq_to=4096), fullgraph=True)
        >>> p = pad_to_row_capacity(input_ids, seq_lengths, capacity=64)
        >>> r = compiled(with_dynamic_row_length(p.x), p.seq_lengths, p.num_rows)  # one graph, any S"""
    _checks.check_min_dims("t", t, 2, "[B, S, *]")
    t = row_major(t)
    torch._dynamo.decorators.mark_unbacked(t, 1)
    return t
