"""Pack a padded batch ``[B, S, *]`` into Megatron's THD layout ``[1, T, *]``.

Shape legend
    B   sequences (rows) of the input batch; R >= B rows after row padding
    S   padded row length of the input batch
    T   packed tokens: ``pad_full_seq_to`` when set (a Python int), else
        ``round_up(sum(round_up(L, m)), p)`` learned with one host sync
    *   trailing feature dims (none for ids and masks, ``[layers, topk]`` for
        routed experts)

The layout (:class:`~nn_data.layout.PackLayout`) is computed once per batch from
``seq_lengths`` and reused for every tensor of that batch: one scatter or gather each.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from nn_data import _checks
from nn_data._index import exclusive_cumsum, round_up
from nn_data.layout import PackLayout, build_layout, pack_with_layout


class PackResult(NamedTuple):
    """What :class:`PackSequences` returns.

    ``packed [1, T, *]``, ``cu_seqlens [B+1]`` int32, ``cu_seqlens_padded [B+1]`` int32,
    ``max_seqlen`` (0-d int32: the longest padded segment, the extended last one
    included) and the reusable ``layout``.
    """

    packed: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: torch.Tensor
    layout: PackLayout


class PackSequences(nn.Module):
    """Pack ``x [B, S, *]`` with per-row lengths into ``[1, T, *]`` (``docs/design.md``, "Packed layout").

    Configuration: ``m`` (``pad_individual_seqs_to_multiple_of``), ``p``
    (``pad_packed_seq_to_multiple_of``), ``pad_full_seq_to`` (the constant ``T``; the last real
    segment absorbs the slack), ``validate`` (the data checks: eager one host sync, compiled
    device asserts; ``False`` skips them).

    ``forward(x [B, S, *], seq_lengths [B] int, num_rows=None) -> PackResult``; ``num_rows`` (0-d
    int tensor) counts the real rows of a batch padded to a row capacity
    (:func:`nn_data.pad_to_row_capacity`). With ``pad_full_seq_to`` set, output shapes depend
    only on ``(B, S, T, *)``; without it ``T`` is learned with one host sync. Under
    ``torch.compile`` ``S`` may be a symbolic size (:func:`nn_data.rows.with_dynamic_row_length`):
    one graph serves every row length.

    Example::

        >>> pack = PackSequences(pad_individual_seqs_to_multiple_of=4)
        >>> r = pack(torch.tensor([[1, 2, 3, 0, 0], [0] * 5, [4, 5, 6, 7, 8]]), torch.tensor([3, 0, 5]))
        >>> r.cu_seqlens_padded
        tensor([ 0,  4,  4, 12], dtype=torch.int32)
        >>> r.packed
        tensor([[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]])

    Raises :class:`~nn_data.errors.PackingError`: a multiple or ``pad_full_seq_to`` below 1, or
    ``pad_full_seq_to`` not a multiple of ``p`` (``__init__``); ``x`` with fewer than 2 dims,
    ``seq_lengths`` not ``[B]`` integer, tensors on different devices (call); lengths outside
    ``[0, S]``, a packed total above ``pad_full_seq_to``, tokens in rows past ``num_rows``
    (validation step).
    """

    def __init__(
        self,
        pad_individual_seqs_to_multiple_of: int = 1,
        pad_packed_seq_to_multiple_of: int = 1,
        pad_full_seq_to: Optional[int] = None,
        *,
        validate: bool = True,
    ):
        super().__init__()
        self.m = _checks.positive_int("pad_individual_seqs_to_multiple_of", pad_individual_seqs_to_multiple_of)
        self.p = _checks.positive_int("pad_packed_seq_to_multiple_of", pad_packed_seq_to_multiple_of)
        self.pad_full_seq_to = _checks.check_int32(
            "pad_full_seq_to", _checks.positive_int("pad_full_seq_to", pad_full_seq_to, allow_none=True))
        if self.pad_full_seq_to is not None and self.pad_full_seq_to % self.p:
            raise _checks.PackingError(
                f"pad_full_seq_to={self.pad_full_seq_to} is not a multiple of "
                f"pad_packed_seq_to_multiple_of={self.p}; choose a multiple of {self.p}"
            )
        self.validate = bool(validate)

    def extra_repr(self) -> str:
        return f"m={self.m}, p={self.p}, pad_full_seq_to={self.pad_full_seq_to}, validate={self.validate}"

    def forward(
        self, x: torch.Tensor, seq_lengths: torch.Tensor, num_rows: Optional[torch.Tensor] = None
    ) -> PackResult:
        check_pack_args(x, seq_lengths, num_rows)
        rows, row_len = x.shape[0], x.shape[1]
        lengths = seq_lengths.to(torch.int64)  # [B]
        cu = exclusive_cumsum(lengths)  # [B+1]
        cu_pad = exclusive_cumsum(round_up(lengths, self.m))  # [B+1] before the slack
        total = self._packed_total(lengths, cu_pad[-1], row_len, num_rows)
        # Entries from the last real row on become the packed total ("extend last").
        # lengths [3,0,5], m 4, T 16 -> [0,4,4,12] -> [0,4,4,16]; with a padding row
        # (num_rows 3 of 4) -> [0,4,4,12,12] -> [0,4,4,16,16].
        first_final = rows if num_rows is None else num_rows.to(torch.int64).clamp(min(1, rows), rows)
        idx = torch.arange(rows + 1, device=x.device)
        cu_pad = torch.where(idx >= first_final, total, cu_pad)  # [B+1]
        layout = build_layout(lengths, cu_pad, row_len, total)
        if rows > 0:
            max_seqlen = (cu_pad[1:] - cu_pad[:-1]).max()
        else:  # no sequence: the packed tensor is one padding pseudo-segment [0, T]
            max_seqlen = torch.full((), total, dtype=torch.int64, device=x.device)
        return PackResult(
            packed=pack_with_layout(layout, x, 0),
            cu_seqlens=cu.to(torch.int32),
            cu_seqlens_padded=cu_pad.to(torch.int32),
            max_seqlen=max_seqlen.to(torch.int32),
            layout=layout,
        )

    def _packed_total(self, lengths, natural_total, row_len: int, num_rows):
        """``T`` as a Python int (static, or learned with the call's one sync), after the checks."""
        pad_full_seq_to = self.pad_full_seq_to
        if torch.compiler.is_compiling():
            if self.validate:
                _device_checks(lengths, natural_total, row_len, num_rows, pad_full_seq_to, self.p)
            if pad_full_seq_to is not None:
                return pad_full_seq_to
            total = int(round_up(natural_total, self.p).item())  # sync: T is data-dependent without pad_full_seq_to
            torch._check(total >= 0)
            return total
        if self.validate:
            return _host_checks(lengths, natural_total, row_len, num_rows, pad_full_seq_to, self.m, self.p)
        if pad_full_seq_to is not None:
            return pad_full_seq_to
        return int(round_up(natural_total, self.p).item())  # sync: T is data-dependent without pad_full_seq_to


def check_pack_args(x, seq_lengths, num_rows=None) -> None:
    """The metadata checks of :class:`PackSequences` (shapes, dtypes, devices; no data).

    Entry points that compile the op themselves call this *before* their compiled region, so a
    bad argument raises :class:`~nn_data.errors.PackingError` there, as in eager mode.
    """
    _checks.check_min_dims("x", x, 2, "[B, S, *]")
    _checks.check_int_vector("seq_lengths", seq_lengths, x.shape[0])
    _checks.check_num_rows(num_rows, x.shape[0])
    _checks.check_same_device(x=x, seq_lengths=seq_lengths, num_rows=num_rows)


def _stats(lengths, natural_total, num_rows):
    """One small tensor with everything the host check needs: ``[min, max, total, tail, n]``."""
    rows = lengths.shape[0]
    if rows == 0:
        zero = natural_total.new_zeros(())
        lo = hi = zero
    else:
        lo, hi = lengths.min(), lengths.max()
    if num_rows is None:
        n = natural_total.new_full((), rows)
        tail = natural_total.new_zeros(())
    else:
        n = num_rows.to(torch.int64)
        tail = (lengths * (torch.arange(rows, device=lengths.device) >= n)).sum()
    return torch.stack([lo, hi, natural_total, tail, n])


def _host_checks(lengths, natural_total, row_len, num_rows, pad_full_seq_to, m, p) -> int:
    """The eager validation step: one sync, then a precise message. Returns ``T``."""
    lo, hi, nat, tail, n = _stats(lengths, natural_total, num_rows).tolist()  # sync: the one validation step
    rows = lengths.shape[0]
    if lo < 0 or hi > row_len:
        _checks.raise_length_outside((lengths < 0) | (lengths > row_len), lengths, row_len)
    if not 0 <= n <= rows:
        raise _checks.PackingError(f"num_rows={n} is invalid; expected a value in [0, {rows}] (the rows of x)")
    if tail:
        mask = (lengths != 0) & (torch.arange(rows, device=lengths.device) >= n)
        _checks.raise_first(mask, lengths, "seq_lengths[{i}] = {v} but row {i} is a padding row "
                            f"(num_rows={n}); rows at or past num_rows must have length 0")
    if pad_full_seq_to is not None and nat > pad_full_seq_to:
        raise _checks.PackingError(
            f"the packed total sum(round_up(seq_lengths, {m})) = {nat} exceeds pad_full_seq_to={pad_full_seq_to}; "
            f"pad_full_seq_to must be at least {nat} (NeMo-RL would silently truncate here)"
        )
    if pad_full_seq_to is not None:
        return pad_full_seq_to
    total = round_up(nat, p)
    if total > _checks.INT32_MAX:
        raise _checks.PackingError(_checks.int32_limit(
            f"the packed total round_up(sum(round_up(seq_lengths, {m})), {p}) = {total} of seq_lengths"))
    return total


def _device_checks(lengths, natural_total, row_len, num_rows, pad_full_seq_to, p: int) -> None:
    """The compiled validation: device-side asserts, no host sync. The messages name ``S`` and ``B``
    without their values (they may be symbolic sizes: one graph serves every row length)."""
    rows = lengths.shape[0]
    if rows:
        _checks.device_assert(
            ((lengths >= 0) & (lengths <= row_len)).all(),
            "nn_data.PackSequences: every seq_lengths value must be in [0, S] (S = x.shape[1], the row length)",
        )
    if num_rows is not None:
        n = num_rows.to(torch.int64)
        _checks.device_assert((n >= 0) & (n <= rows),
                              "nn_data.PackSequences: num_rows must be in [0, B] (B = x.shape[0], the rows)")
        if rows:
            tail = (lengths * (torch.arange(rows, device=lengths.device) >= n)).sum()
            _checks.device_assert(tail == 0, "nn_data.PackSequences: rows at or past num_rows must have length 0")
    if pad_full_seq_to is not None:
        _checks.device_assert(
            natural_total <= pad_full_seq_to,
            f"nn_data.PackSequences: the packed total sum(round_up(seq_lengths, m)) exceeds pad_full_seq_to={pad_full_seq_to}",
        )
    else:
        _checks.device_assert(round_up(natural_total, p) <= _checks.INT32_MAX, "nn_data.PackSequences: "
                              + _checks.int32_limit("the packed total of seq_lengths"))
