"""The base of the ops that run on a layout, and how such an op gets the layout of its call.

An op of nn_data is given either the pack's layout (``layout=``, :class:`~nn_data.layout.PackLayout`:
nothing is read) or the boundaries ``cu_seqlens_padded`` (the layout is built from them: one read
eagerly, which is also the validation; ``docs/design.md``, "Layouts and executors").
"""

from __future__ import annotations

import torch
from torch import nn

from nn_data import _checks
from nn_data.layout import checks
from nn_data.layout.build import Boundaries, layout_from_boundaries, take_layout
from nn_data.layout.pack_layout import PackLayout


class RankOp(nn.Module):
    """Base of the stateless ops configured with a CP size and rank (checked), ``validate`` and
    ``host_reads`` (``False``: never read the device; the checks become device asserts)."""

    def __init__(self, cp_size: int, cp_rank: int, *, validate: bool = True, host_reads: bool = True):
        super().__init__()
        _checks.check_cp(cp_size, cp_rank)
        self.cp_size, self.cp_rank, self.validate, self.host_reads = cp_size, cp_rank, bool(validate), bool(host_reads)

    def extra_repr(self) -> str:
        return (f"cp_size={self.cp_size}, cp_rank={self.cp_rank}, validate={self.validate}, "
                f"host_reads={self.host_reads}")

    def layout_for(self, name: str, data: torch.Tensor, total, cu_seqlens_padded, layout, **kw) -> PackLayout:
        """The layout this call runs on: the one given (checked against this op's ``C``; no read), or
        one built from ``cu_seqlens_padded`` (one read eagerly: the validation)."""
        return op_layout(type(self).__name__, name, data, total, self.cp_size, cu_seqlens_padded, layout,
                         validate=self.validate, host_reads=self.host_reads, **kw)


def op_layout(op: str, name: str, data: torch.Tensor, total, cp_size: int, cu_seqlens_padded, layout, *,
              validate: bool, host_reads: bool, cu_seqlens=None, **kw) -> PackLayout:
    """The layout of an op that takes ``cu_seqlens_padded`` or ``layout=`` (see :meth:`RankOp.layout_for`)."""
    if layout is not None:
        checks.packed_tensor_length(name, total)
        checks.total_divisible(total, cp_size)
        given = {k: v for k, v in (("cu_seqlens_padded", cu_seqlens_padded), ("cu_seqlens", cu_seqlens))}
        return take_layout(layout, total, op=op, cp_size=cp_size, validate=validate, seq_len=kw.get("seq_len"),
                           data=(name, data), **given)
    if cu_seqlens_padded is None:
        raise _checks.PackingError(f"{op} needs cu_seqlens_padded or layout= (the pack's PackResult.layout)")
    checks.boundary_args(name, data, total, cu_seqlens_padded, cp_size, cu_seqlens)
    bounds = Boundaries(cu_seqlens_padded, total, cu_seqlens=cu_seqlens)
    return layout_from_boundaries(bounds, op=op, cp_size=cp_size, validate=validate, host_reads=host_reads, **kw)
