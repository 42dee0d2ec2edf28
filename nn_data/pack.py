"""Pack a padded batch ``[B, S, *]`` into Megatron's THD layout ``[1, T, *]``.

Shape legend
    B   sequences (rows) of the input batch; R >= B rows after row padding
    S   padded row length of the input batch
    T   packed tokens: ``pad_full_seq_to`` when set (a Python int), else
        ``round_up(sum(round_up(L, m)), p)``
    C   context-parallel size; a rank holds ``T/C`` tokens
    *   trailing feature dims (none for ids and masks, ``[layers, topk]`` for
        routed experts)

The layout (:class:`~nn_data.layout.PackLayout`) is built once per batch and reused by every later op of the
microbatch (``layout=``)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from nn_data import _checks
from nn_data.layout import PackLayout, PackSpec, layout_from_lengths


class PackResult(NamedTuple):
    """What :class:`PackSequences` returns: ``packed [1, T, *]``, ``cu_seqlens [B+1]`` and ``cu_seqlens_padded [B+1]``
    int32, ``max_seqlen`` (0-d int32, the longest padded segment) and the reusable ``layout`` (``layout=`` of the
    later ops)."""

    packed: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: torch.Tensor
    layout: PackLayout


class PackSequences(nn.Module):
    """Pack ``x [B, S, *]`` with per-row lengths into ``[1, T, *]`` (``docs/design.md``, "Packed layout").

    Args:
        pad_individual_seqs_to_multiple_of: ``m``; pad_packed_seq_to_multiple_of: ``p``.
        pad_full_seq_to: the constant ``T`` (the last real segment absorbs the slack).
        validate: the data checks (``False`` skips them and nothing else).
        host_reads: ``True``: eagerly, a host executor after one read of the lengths; ``False``: a device
            executor, never a read (under ``torch.compile`` always a device executor).
        pack_form: the device executor's pack form (:class:`~nn_data.layout.PackSpec`).

    ``forward(x [B, S, *], seq_lengths [B] int, num_rows=None) -> PackResult``; ``seq_lengths`` a tensor or a
    sequence of ints; ``num_rows`` (0-d int tensor) counts the real rows of a batch padded to a row capacity
    (:func:`nn_data.pad_to_row_capacity`). Under ``torch.compile`` ``S`` may be symbolic
    (:func:`nn_data.rows.with_dynamic_row_length`).

    Example::

        >>> pack = PackSequences(pad_individual_seqs_to_multiple_of=4)
        >>> r = pack(torch.tensor([[1, 2, 3, 0, 0], [0] * 5, [4, 5, 6, 7, 8]]), torch.tensor([3, 0, 5]))
        >>> r.cu_seqlens_padded
        tensor([ 0,  4,  4, 12], dtype=torch.int32)
        >>> r.packed
        tensor([[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]])

    Raises :class:`~nn_data.errors.PackingError`: a multiple or ``pad_full_seq_to`` below 1,
    ``pad_full_seq_to`` not a multiple of ``p`` or above ``2**31 - 1`` (``__init__``); ``x`` with fewer
    than 2 dims, ``seq_lengths`` not ``[B]`` integer, tensors on different devices (call); lengths
    outside ``[0, S]``, a packed total above ``pad_full_seq_to`` (or, without it, above ``2**31 - 1``),
    tokens in rows past ``num_rows`` (validation)."""

    def __init__(
        self,
        pad_individual_seqs_to_multiple_of: int = 1,
        pad_packed_seq_to_multiple_of: int = 1,
        pad_full_seq_to: Optional[int] = None,
        *,
        validate: bool = True,
        host_reads: bool = True,
        pack_form: str = "auto",
    ):
        super().__init__()
        self.spec = PackSpec(pad_individual_seqs_to_multiple_of, pad_packed_seq_to_multiple_of,
                             fixed_total=pad_full_seq_to, pack_form=pack_form)
        self.validate, self.host_reads = bool(validate), bool(host_reads)

    @property
    def m(self) -> int:
        return self.spec.m

    @property
    def p(self) -> int:
        return self.spec.p

    @property
    def pad_full_seq_to(self) -> Optional[int]:
        return self.spec.fixed_total

    def extra_repr(self) -> str:
        return (f"m={self.m}, p={self.p}, pad_full_seq_to={self.pad_full_seq_to}, validate={self.validate}, "
                f"host_reads={self.host_reads}")

    def forward(
        self, x: torch.Tensor, seq_lengths: torch.Tensor, num_rows: Optional[torch.Tensor] = None
    ) -> PackResult:
        if not isinstance(seq_lengths, torch.Tensor) and isinstance(x, torch.Tensor):
            # a list, tuple or numpy array of ints (host data, never rounded): one copy to x's device
            seq_lengths = _checks.as_int_vector("seq_lengths", seq_lengths, x.shape[0]).to(x.device)
        check_pack_args(x, seq_lengths, num_rows)
        layout = layout_from_lengths(seq_lengths, x.shape[1], self.spec, num_rows=num_rows, validate=self.validate,
                                     host_reads=self.host_reads)
        return PackResult(layout.pack(x), layout.cu_seqlens, layout.cu_seqlens_padded, layout.max_seqlen, layout)


def check_pack_args(x, seq_lengths, num_rows=None) -> None:
    """The metadata checks of :class:`PackSequences` (shapes, dtypes, devices; no data), for entry points to call
    before their own compiled region so that a bad argument raises there."""
    _checks.check_min_dims("x", x, 2, "[B, S, *]")
    _checks.check_int_vector("seq_lengths", seq_lengths, x.shape[0])
    _checks.check_num_rows(num_rows, x.shape[0])
    _checks.check_same_device(x=x, seq_lengths=seq_lengths, num_rows=num_rows)
