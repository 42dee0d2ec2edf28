"""Unpack model outputs from the packed layout back to per-sequence rows.

Shape legend
    B   sequences (rows)
    S   row length of the output (``seq_len``: a Python int, or a symbolic size under compile)
    T   packed tokens
    *   trailing feature dims (e.g. vocab ``V`` for logits)

``out[b, s] = packed[0, cu_seqlens_padded[b] + s]`` for ``s < L[b]``, ``fill_value`` elsewhere: always the
*padded* offsets (``docs/design.md``, "Unpacking"). Given ``layout=`` nothing is read."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from nn_data import _checks
from nn_data.layout import Boundaries, PackLayout, layout_from_boundaries
from nn_data.layout.internal import checks, take_layout


class UnpackSequences(nn.Module):
    """``[1, T, *] -> [B, S, *]``: the inverse of packing on the valid tokens.

    ``UnpackSequences(seq_len, *, fill_value=0, validate=True, host_reads=True)``;
    ``forward(packed [1, T, *], seq_lengths [B] int = None, cu_seqlens_padded [B+1] int = None,
    seq_len=None, *, layout=None) -> [B, S, *]`` with ``S = seq_len`` (the call's, else the configured one).
    Pass the lengths and boundaries, or the pack's ``layout`` (given as well, they must be the very tensors the
    layout holds).

    Example: packed ``[[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]]``, lengths ``[3, 0, 5]``,
    cu_seqlens_padded ``[0, 4, 4, 12]``, seq_len 5 ->
    ``[[1, 2, 3, 0, 0], [0, 0, 0, 0, 0], [4, 5, 6, 7, 8]]``.

    Raises :class:`~nn_data.errors.PackingError`: ``seq_len < 0`` (``__init__``); ``packed`` not ``[1, T, *]``,
    ``seq_lengths`` not 1-D integer, ``cu_seqlens_padded`` without ``B+1`` entries, tensors on different devices
    (call); a length outside ``[0, seq_len]`` or longer than its padded segment, boundaries that do not rise from
    0 to ``T`` (validation)."""

    def __init__(self, seq_len: int, *, fill_value=0, validate: bool = True, host_reads: bool = True):
        super().__init__()
        _checks.row_length("seq_len", seq_len)
        self.seq_len, self.fill_value = seq_len, fill_value
        self.validate, self.host_reads = bool(validate), bool(host_reads)

    def extra_repr(self) -> str:
        return (f"seq_len={self.seq_len}, fill_value={self.fill_value}, validate={self.validate}, "
                f"host_reads={self.host_reads}")

    def forward(self, packed: torch.Tensor, seq_lengths: Optional[torch.Tensor] = None,
                cu_seqlens_padded: Optional[torch.Tensor] = None, seq_len=None, *,
                layout: Optional[PackLayout] = None) -> torch.Tensor:
        """``seq_len`` (optional) overrides the configured row length for this call: inside a
        compiled region pass ``x.shape[1]`` of the packed batch, so one graph serves every ``S``
        (a changed int attribute of the module would recompile)."""
        seq_len = self.seq_len if seq_len is None else seq_len
        return unpack_sequences(packed, seq_lengths, cu_seqlens_padded, seq_len, self.fill_value, self.validate,
                                layout=layout, host_reads=self.host_reads)


def unpack_sequences(
    packed: torch.Tensor,
    seq_lengths: Optional[torch.Tensor],
    cu_seqlens_padded: Optional[torch.Tensor],
    seq_len: int,
    fill_value=0,
    validate: bool = True,
    *,
    layout: Optional[PackLayout] = None,
    host_reads: bool = True,
) -> torch.Tensor:
    """Functional form of :class:`UnpackSequences`: ``[1, T, *] -> [B, S, *]``. ``seq_len`` is a
    Python int, or a symbolic size (``x.shape[1]``) inside a compiled region."""
    _checks.check_packed("packed", packed)
    total = packed.shape[1]
    if layout is not None:
        if seq_lengths is not None:
            _checks.check_int_vector("seq_lengths", seq_lengths)
        layout = take_layout(layout, total, op="UnpackSequences", seq_len=seq_len, validate=validate,
                             data=("packed", packed), cu_seqlens_padded=cu_seqlens_padded, seq_lengths=seq_lengths)
        checks.packed_tensor_length("packed", total)
        _checks.check_same_device(packed=packed, layout=layout.cu_seqlens_padded)
        return layout.unpack(packed, seq_len, fill_value)
    check_unpack_args(packed, seq_lengths, cu_seqlens_padded)
    bounds = Boundaries(cu_seqlens_padded, total, seq_lengths=seq_lengths, total_from=" (T = packed.shape[1])")
    layout = layout_from_boundaries(bounds, op="UnpackSequences", seq_len=seq_len, validate=validate,
                                    host_reads=host_reads)
    return layout.unpack(packed, seq_len, fill_value)


def check_unpack_args(packed, seq_lengths, cu_seqlens_padded) -> None:
    """The metadata checks of :class:`UnpackSequences` (shapes, dtypes, devices; no data), for
    entry points to call before their compiled region."""
    _checks.check_packed("packed", packed)
    if seq_lengths is None or cu_seqlens_padded is None:
        raise _checks.PackingError("UnpackSequences needs seq_lengths and cu_seqlens_padded, or layout= (the "
                                   "pack's PackResult.layout)")
    _checks.check_int_vector("seq_lengths", seq_lengths)
    _checks.check_boundaries_for("seq_lengths", seq_lengths, "cu_seqlens_padded", cu_seqlens_padded)
    _checks.check_same_device(packed=packed, seq_lengths=seq_lengths, cu_seqlens_padded=cu_seqlens_padded)
    checks.packed_tensor_length("packed", packed.shape[1])
