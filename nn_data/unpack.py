"""Unpack model outputs from the packed layout back to per-sequence rows.

Shape legend
    B   sequences (rows)
    S   row length of the output (``seq_len``, a Python int)
    T   packed tokens
    *   trailing feature dims (e.g. vocab ``V`` for logits)

``out[b, s] = packed[0, cu_seqlens_padded[b] + s]`` for ``s < L[b]``, ``fill_value``
elsewhere (``docs/design.md``, "Unpacking"). The offsets are always the *padded* ones: NeMo-RL's
``_unpack_sequences_from_megatron`` reads ``cu_seqlens`` when CP is 1, which is
wrong whenever sequences were padded to a multiple ``m > 1``.

Two forms, chosen from the static shapes (never from data; a symbolic size takes the gather form):

* **gather** (default): every output position ``(b, s)`` reads ``packed[cu_seqlens_padded[b] + s]``
  (clamped) and is masked: ``B*S`` indexed loads.
* **scatter** (``B*S >= 4T`` on static sizes: an output that is mostly fill, e.g. rows padded
  to a row capacity): the output is filled once, then each of the ``T`` packed positions is
  written to its row and column (padding positions to a discard slot): a fill of ``B*S`` plus
  ``T`` indexed stores.

Measured compiled on this project's 2-core CPU (1 thread), fp32 ``[B, S, 1]`` outputs, gather
vs scatter form: ``B*S = T`` 476 vs 1035 us; ``B*S = 2T`` 321 vs 502; ``4T`` 321 vs 292;
``8T`` 336 vs 201; the profiler's stream (``[78, 2048, 1]`` from ``T = 8192``, ``B*S`` about
``20T``) 305 vs 186. Hence the threshold ``4T``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from nn_data import _checks
from nn_data._index import segment_ids

#: ``B*S / T`` from which the output is built in the scatter form (see the module docstring).
UNPACK_SCATTER_MIN_RATIO = 4


class UnpackSequences(nn.Module):
    """``[1, T, *] -> [B, S, *]``: the inverse of packing on the valid tokens.

    ``UnpackSequences(seq_len, *, fill_value=0, validate=True)``;
    ``forward(packed [1, T, *], seq_lengths [B] int, cu_seqlens_padded [B+1] int) -> [B, S, *]``
    with ``S = seq_len``. One gather over ``[B, S]`` indices and a masked fill, or for a mostly-fill
    output one fill and a scatter of the ``T`` packed positions (module docstring).

    Example: packed ``[[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]]``, lengths ``[3, 0, 5]``,
    cu_seqlens_padded ``[0, 4, 4, 12]``, seq_len 5 ->
    ``[[1, 2, 3, 0, 0], [0, 0, 0, 0, 0], [4, 5, 6, 7, 8]]``.

    Raises :class:`~nn_data.errors.PackingError`: ``seq_len < 0`` (``__init__``);
    ``packed`` not ``[1, T, *]``, ``seq_lengths`` not 1-D integer, ``cu_seqlens_padded``
    without ``B+1`` entries, tensors on different devices (call); a length outside
    ``[0, seq_len]``, longer than its padded segment, or a boundary of ``cu_seqlens_padded``
    outside ``[0, T]`` (validation step: eager one sync, compiled device asserts).
    """

    def __init__(self, seq_len: int, *, fill_value=0, validate: bool = True):
        super().__init__()
        _checks.row_length("seq_len", seq_len)
        self.seq_len, self.fill_value, self.validate = seq_len, fill_value, bool(validate)

    def extra_repr(self) -> str:
        return f"seq_len={self.seq_len}, fill_value={self.fill_value}, validate={self.validate}"

    def forward(
        self, packed: torch.Tensor, seq_lengths: torch.Tensor, cu_seqlens_padded: torch.Tensor, seq_len=None
    ) -> torch.Tensor:
        """``seq_len`` (optional) overrides the configured row length for this call: inside a
        compiled region pass ``x.shape[1]`` of the packed batch, so one graph serves every ``S``
        (a changed int attribute of the module would recompile)."""
        seq_len = self.seq_len if seq_len is None else seq_len
        return unpack_sequences(packed, seq_lengths, cu_seqlens_padded, seq_len, self.fill_value, self.validate)


def unpack_sequences(
    packed: torch.Tensor,
    seq_lengths: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    seq_len: int,
    fill_value=0,
    validate: bool = True,
    *,
    offsets: str = "padded",
) -> torch.Tensor:
    """Functional form of :class:`UnpackSequences`: ``[1, T, *] -> [B, S, *]``. ``seq_len`` is a
    Python int, or a symbolic size (``x.shape[1]``) inside a compiled region.

    ``offsets="unpadded"`` (the NeMo-RL layer only, where NeMo-RL's contract lets
    ``_unpack_sequences_from_megatron`` read ``cu_seqlens`` without padded boundaries): the
    boundaries may end before ``T``; everything else is checked the same."""
    if offsets not in ("padded", "unpadded"):
        raise _checks.PackingError(f"offsets={offsets!r} is invalid; expected 'padded' or 'unpadded'")
    check_unpack_args(packed, seq_lengths, cu_seqlens_padded)
    rows, total, trailing = seq_lengths.shape[0], packed.shape[1], packed.shape[2:]
    lengths = seq_lengths.to(torch.int64)  # [B]
    starts = cu_seqlens_padded[:-1].to(torch.int64)  # [B]
    if validate:
        _check(lengths, cu_seqlens_padded.to(torch.int64), total, seq_len, offsets)
    if guard_or_false(rows == 0):  # no row to write: [0, S, *] made from packed, so autograd reaches it
        return packed[0, :0].unsqueeze(1).expand(0, seq_len, *trailing).clone()  # [0, *] -> [0, 1, *] -> [0, S, *]
    if guard_or_false(total == 0):  # nothing to read: all fill
        out = packed.new_full((rows, seq_len, *trailing), fill_value)
        # + the sum of the empty packed tensor (exactly 0) keeps a backward through an empty microbatch
        return out + packed.sum().to(out.dtype) if packed.requires_grad else out
    if statically_known_true(rows * seq_len >= UNPACK_SCATTER_MIN_RATIO * total):
        return _unpack_scatter(packed, lengths, cu_seqlens_padded.to(torch.int64), seq_len, fill_value)
    # lengths [3,0,5], starts [0,4,4], S 5 -> index rows [0..4], [4..8], [4..8];
    # valid [T,T,T,F,F], [F]*5, [T]*5.
    s = torch.arange(seq_len, device=packed.device)  # [S]
    index = (starts[:, None] + s).clamp(0, total - 1)  # [B, S]
    valid = s < lengths[:, None]  # [B, S]
    out = packed[0].index_select(0, index.reshape(-1))  # [B*S, *]
    out = out.view(rows, seq_len, *trailing)  # [B, S, *]
    keep = valid.view(rows, seq_len, *([1] * len(trailing)))  # [B, S, 1...]
    return out.masked_fill_(~keep, fill_value)


def _unpack_scatter(packed, lengths, bounds, seq_len: int, fill_value) -> torch.Tensor:
    """The scatter form: fill ``[B*S + 1, *]`` once, then write each packed position to its place.

    Example: bounds ``[0, 4, 4, 12]``, lengths ``[3, 0, 5]``, S 5: segments of the 12 positions
    ``[0,0,0,0,2,...,2]``, offsets ``[0,1,2,3,0,...,7]``; valid where ``0 <= offset < min(L, S)``
    -> destinations ``[0, 1, 2, 15, 10, 11, 12, 13, 14, 15, 15, 15]`` (15 = B*S, the discard slot).
    """
    rows, total, trailing = lengths.shape[0], packed.shape[1], packed.shape[2:]
    seg = segment_ids(bounds, total)  # [T]
    offset = torch.arange(total, device=packed.device) - bounds[seg]  # [T]
    valid = (offset >= 0) & (offset < lengths[seg]) & (offset < seq_len)  # [T]
    dest = torch.where(valid, seg * seq_len + offset, rows * seq_len)  # [T] into [B*S + 1]
    out = packed.new_full((rows * seq_len + 1, *trailing), fill_value)  # row B*S: the discard slot
    out.index_put_((dest,), packed[0])
    return out[: rows * seq_len].view(rows, seq_len, *trailing)  # [B, S, *]


def check_unpack_args(packed, seq_lengths, cu_seqlens_padded) -> None:
    """The metadata checks of :class:`UnpackSequences` (shapes, dtypes, devices; no data), for
    entry points to call before their compiled region."""
    _checks.check_packed("packed", packed)
    _checks.check_int_vector("seq_lengths", seq_lengths)
    _checks.check_int_vector("cu_seqlens_padded", cu_seqlens_padded, seq_lengths.shape[0] + 1)
    _checks.check_same_device(packed=packed, seq_lengths=seq_lengths, cu_seqlens_padded=cu_seqlens_padded)
    _checks.check_packed_length("packed", packed.shape[1])


def _check(lengths: torch.Tensor, cu_pad: torch.Tensor, total: int, seq_len: int, offsets: str) -> None:
    """The validation step: ``0 <= L[b] <= seq_len``; every boundary in ``[0, T]``; the boundaries
    start at 0, never decrease and end at ``T`` (``offsets="unpadded"``: at most ``T``); each
    sequence fits its segment. ``[T]`` (no sequence) is the padding pseudo-segment ``[0, T]``.

    Example: lengths ``[25, 94]`` with ``cu_seqlens [0, 25, 119]`` passed where ``T = 128`` wants
    ``cu_seqlens_padded [0, 32, 128]``: the end 119 is not ``T``, refused.
    """
    name = "cu_seqlens_padded" if offsets == "padded" else "cu_seqlens"
    bounds = cu_pad if cu_pad.shape[0] > 1 else torch.cat([cu_pad.new_zeros(1), cu_pad])  # [B'+1]
    seg_len = bounds[1:] - bounds[:-1]  # [B']
    ok_len = (lengths >= 0) & (lengths <= seq_len)  # [B]
    ok_fit = lengths <= seg_len[: lengths.shape[0]]  # [B]
    ok_in = (cu_pad >= 0) & (cu_pad <= total)  # [B+1]: every boundary inside [0, T]
    ends = bounds[-1] == total if offsets == "padded" else bounds[-1] <= total
    ok_rise = (bounds[0] == 0) & (seg_len >= 0).all() & ends
    if torch.compiler.is_compiling():
        _checks.device_assert(
            ok_len.all(), "nn_data.UnpackSequences: seq_lengths must be in [0, seq_len] (the row length of the output)"
        )
        _checks.device_assert(
            (ok_fit.all() & ok_in.all() & ok_rise),
            f"nn_data.UnpackSequences: each sequence must fit its padded segment and every boundary of {name} "
            f"must lie in [0, T]; {name} must start at 0, never decrease and end at "
            + ("T" if offsets == "padded" else "most T"),
        )
        return
    flags = torch.stack([ok_len.all(), ok_fit.all(), ok_in.all(), ok_rise]).tolist()  # sync: the one validation step
    all_len, all_fit, all_in, rise = flags
    if not all_in:
        _checks.raise_first(~ok_in, cu_pad, name + "[{i}] = {v} is outside [0, T="
                            f"{total}] (T = packed.shape[1]); every boundary must lie in [0, {total}]")
    if not rise:
        end = f"end at {total}" if offsets == "padded" else f"end at most at {total}"
        raise _checks.PackingError(
            f"{name}={cu_pad.tolist()} is invalid for a packed length T={total} (T = packed.shape[1]); "  # sync: error path
            f"it must start at 0, never decrease and {end}"
            + (" (cu_seqlens, the unpadded boundaries, passed where cu_seqlens_padded belongs?)"
               if offsets == "padded" else "")
        )
    if not all_len:
        _checks.raise_length_outside(~ok_len, lengths, seq_len, "seq_len")
    if not all_fit:
        _checks.raise_first(
            ~ok_fit, lengths,
            "seq_lengths[{i}] = {v} does not fit its segment of " + name + " (the length must satisfy "
            f"L[b] <= {name}[b+1] - {name}[b])",
        )
