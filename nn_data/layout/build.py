"""Building a :class:`~nn_data.layout.pack_layout.PackLayout`: from the lengths, from the boundaries, or
checking one an op was given; and :class:`RankOp`, the base of the ops that run on a layout.

Shape legend
    B   rows (R with row-capacity padding); S the row length; T packed tokens; C the CP size

Which executor a layout gets is :func:`reads_host`, in one place (docs/design.md, "Layouts and executors"):
eagerly with host reads, one read of the lengths or boundaries, the checks there, a
:class:`~nn_data.layout.host.HostExecutor`; otherwise a :class:`~nn_data.layout.device.DeviceExecutor`, no
sync, device asserts. ``validate=False`` only skips the checks.

Example: lengths ``[3, 0, 5]``, S 5, m 4, eagerly -> a host executor, cu_seqlens_padded ``[0, 4, 4, 12]``;
the same with ``host_reads=False`` -> a device executor with the same boundaries and ``dest [B, S]``."""

from __future__ import annotations

import dataclasses
import math
from itertools import accumulate
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from nn_data import _checks
from nn_data.layout import checks, index
from nn_data.layout.device import PACK_FORMS, DeviceExecutor, pack_maps
from nn_data.layout.host import HostBounds, HostExecutor, check_token, host_tensor
from nn_data.layout.pack_layout import PackLayout, entered
from nn_data.layout.rules import (
    extend_last, first_final, packed_total, round_up, round_up_all, segment_bounds,
)


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """What a pack is asked for: the configuration of the layout rules, checked once when it is built.

    Args:
        m, p: the per-sequence and the packed multiple.
        fixed_total: the fixed packed length ``T`` or None (``T`` from the data); messages name it
            ``pad_full_seq_to``.
        pack_form: the device executor's pack form (``"auto"``, ``"scatter"`` or ``"gather"``,
            :func:`~nn_data.layout.device.pack_maps`).

    Example: ``PackSpec(4, 8, fixed_total=64)`` -> every sequence rounded up to 4, ``T = 64``;
    ``PackSpec(4, 8, fixed_total=60)`` raises (60 is not a multiple of 8)."""

    m: int = 1
    p: int = 1
    _: dataclasses.KW_ONLY
    fixed_total: Optional[int] = None
    pack_form: str = "auto"

    def __post_init__(self):
        if self.pack_form not in PACK_FORMS:
            raise _checks.PackingError(f"pack_form={self.pack_form!r} is invalid; expected one of {PACK_FORMS}")
        _checks.positive_int("pad_individual_seqs_to_multiple_of", self.m)
        _checks.positive_int("pad_packed_seq_to_multiple_of", self.p)
        checks.fixed_total_arg("pad_full_seq_to", self.fixed_total)
        if self.fixed_total is not None and self.fixed_total % self.p:
            raise _checks.PackingError.about("pad_full_seq_to",
                f"pad_full_seq_to={self.fixed_total} is not a multiple of "
                f"pad_packed_seq_to_multiple_of={self.p}; choose a multiple of {self.p}")


class Boundaries(NamedTuple):
    """A packed microbatch as an op receives it without a layout: its boundary tensors, ``T``, and how
    messages name them (the input of :func:`layout_from_boundaries`).

    ``cu_seqlens_padded [B+1]`` (named ``name`` in messages), ``total`` (``T``; None: the last
    boundary, which only the host read can learn), the valid boundaries ``cu_seqlens [B+1]`` or the
    lengths ``seq_lengths [B]`` when the op has them; ``total_from``: how the op learnt ``T``, for
    messages (``" (T = packed.shape[1])"``); ``valid_offsets``: the boundaries are valid-token
    offsets (the NeMo-RL drop-in's unpack of ``cu_seqlens``), which may end before ``T`` and get no hint about
    the padded ones; ``also_check``: a 0-d bool tensor the op computed on the device (True: fine) and
    a function that raises the op's precise error when it is False, read with the boundaries (one
    read: ``TokenLogProbs``' "target ids in the vocabulary").
    """

    cu_seqlens_padded: torch.Tensor
    total: Optional[int]
    cu_seqlens: Optional[torch.Tensor] = None
    seq_lengths: Optional[torch.Tensor] = None
    name: str = "cu_seqlens_padded"
    total_from: str = ""
    valid_offsets: bool = False
    also_check: Optional[tuple[torch.Tensor, Callable[[], None]]] = None


def reads_host(host_reads: bool, data: Optional[torch.Tensor] = None) -> bool:
    """Whether a builder reads the device once and makes a host executor: ``host_reads`` (the caller's
    choice of executor), eagerly; under ``torch.compile`` nothing is read, nor from ``data`` on the
    ``meta`` device (no values: the device executor runs). ``validate`` plays no part.
    Example: ``reads_host(True)`` is True eagerly, False while compiling; ``reads_host(False)`` is False."""
    on_meta = data is not None and data.device.type == "meta"
    return host_reads and not on_meta and not torch.compiler.is_compiling()


def layout_from_lengths(seq_lengths: torch.Tensor, row_len, spec: PackSpec, *, num_rows=None, validate: bool = True,
                        host_reads: bool = True, op: str = "PackSequences",
                        into: Optional[_checks.DeviceChecks] = None) -> PackLayout:
    """The layout of a ``[B, S, *]`` batch with lengths ``seq_lengths [B]`` (metadata already checked): a host
    executor after one read of the lengths when :func:`reads_host`, else a device executor. Example: lengths ``[3,
    0, 5]``, S 5, m 4 -> cu_seqlens ``[0, 3, 3, 8]``, cu_seqlens_padded ``[0, 4, 4, 12]``, T 12, max_seqlen 8;
    with ``fixed_total=16`` the last segment absorbs the slack: ``[0, 4, 4, 16]``, max_seqlen 12."""
    if not reads_host(host_reads, seq_lengths):
        return _lengths_on_device(seq_lengths, row_len, spec, num_rows, validate, op, into)
    if num_rows is None:
        return layout_from_read_lengths(seq_lengths.tolist(), seq_lengths, row_len, spec,  # sync: the one read
                                        validate=validate)
    both = torch.cat([seq_lengths.to(torch.int64), num_rows.to(torch.int64).view(1)]).tolist()  # sync: the one read
    return layout_from_read_lengths(both[:-1], seq_lengths, row_len, spec, both[-1], validate=validate)


def layout_from_read_lengths(lengths: list, seq_lengths: torch.Tensor, row_len: int, spec: PackSpec,
                             num_rows: Optional[int] = None, *, validate: bool = True) -> PackLayout:
    """The host-executor layout of lengths already read to the host (``lengths``: Python ints, the values of
    the ``seq_lengths [B]`` tensor, ``num_rows`` an int or None), checked when ``validate``: for
    :func:`layout_from_lengths` and a builder whose one read brought them with other values
    (:mod:`nn_data.layout.tree`); no further read. Example: ``[3, 0, 5]``, S 5, m 4 ->
    ``HostBounds([3, 0, 5], [0, 3, 3, 8], [0, 4, 4, 12], [4, 0, 8], 8, 3)``."""
    n = num_rows
    if validate:
        checks.lengths_host(lengths, row_len, n)
    rows = len(lengths)
    active = first_final(rows, n)  # rows past it are empty padding rows (checked): only their count matters
    cu = list(accumulate(lengths[:active], initial=0))
    cu_pad = list(accumulate(round_up_all(lengths[:active], spec.m), initial=0))
    natural = cu_pad[-1]
    if validate:
        checks.natural_total_host(natural, spec.m, spec.fixed_total, "pad_full_seq_to")
    total = packed_total(natural, spec.p, spec.fixed_total)
    if spec.fixed_total is None:
        checks.total_limit_host(total, f"sum(round_up(seq_lengths, {spec.m})) = {natural}, rounded up to {spec.p}")
    tail = rows - active
    cu += [cu[-1]] * tail
    cu_pad = extend_last(cu_pad + [natural] * tail, total, active) if rows else [total]
    bounds = segment_bounds(cu_pad[: active + 1], total)
    segments = [b - a for a, b in zip(bounds, bounds[1:])]  # [B'] (the active rows' segments)
    max_seqlen = max(segments)
    both = host_tensor(cu + cu_pad + [max_seqlen], torch.int32, seq_lengths.device)  # one copy: [B+1 | B+1 | 1]
    host = HostBounds(lengths, cu, cu_pad, segments + [0] * tail, max_seqlen, max(active, 1))
    return PackLayout(both[: rows + 1], both[rows + 1 : rows + 1 + len(cu_pad)], both[-1], total, rows, row_len,
                      HostExecutor(host, seq_lengths, token=object()))


def _lengths_on_device(seq_lengths, row_len, spec: PackSpec, num_rows, validate: bool, op: str,
                       into: Optional[_checks.DeviceChecks]) -> PackLayout:
    rows = seq_lengths.shape[0]
    lengths = seq_lengths.to(torch.int64)  # [B]
    cu = index.exclusive_cumsum(lengths)  # [B+1]
    cu_pad = index.exclusive_cumsum(round_up(lengths, spec.m))  # [B+1] before the slack
    natural = cu_pad[-1]
    if validate:  # one check on the device for the call (the caller's, with its own checks, when it gives one)
        found = _checks.DeviceChecks() if into is None else into
        checks.lengths_device(op, lengths, row_len, num_rows, into=found)
        checks.total_device(op, natural, packed_total(natural, spec.p), spec.fixed_total, "pad_full_seq_to",
                            into=found)
        if into is None:
            found.check()
    if spec.fixed_total is not None:
        total = spec.fixed_total
    elif seq_lengths.device.type == "meta":
        raise _checks.PackingError.about("pad_full_seq_to",
            f"{op}: seq_lengths is on the meta device (no values), so the packed length T, the padded sum of the "
            "lengths, cannot be learned from it; set pad_full_seq_to (a fixed T) to run on the meta device")
    else:
        total = int(packed_total(natural, spec.p).item())  # sync: T is data-dependent without a fixed packed length
        torch._check(total >= 0)
    cu_pad = extend_last(cu_pad, total, first_final(rows, num_rows))  # [B+1]
    if rows > 0:
        max_seqlen = (cu_pad[1:] - cu_pad[:-1]).max()
    else:  # no sequence: the packed tensor is one padding pseudo-segment [0, T]
        max_seqlen = torch.full((), total, dtype=torch.int64, device=seq_lengths.device)
    dest, gather = pack_maps(lengths, cu_pad, row_len, total, spec.pack_form)
    # every segment is round_up(L, m), the last one extended to T, a multiple of pad_full_seq_to (or of p):
    # each a multiple of gcd(m, that), known from the configuration alone (T may be an unbacked size here)
    multiple = math.gcd(spec.m, spec.fixed_total if spec.fixed_total is not None else spec.p)
    return PackLayout(cu.to(torch.int32), cu_pad.to(torch.int32), max_seqlen.to(torch.int32), total, rows, row_len,
                      DeviceExecutor(seq_lengths, dest, gather, multiple))


def layout_from_boundaries(bounds: Boundaries, *, op: str, cp_size: int = 1, seq_len=None, row_len=None,
                           validate: bool = True, host_reads: bool = True) -> PackLayout:
    """The layout of a packed microbatch from its :class:`Boundaries` (metadata already checked), for an op that
    receives boundaries rather than a layout. On the host the boundaries, the lengths and ``also_check``'s flag
    come in one read, which is also the validation (rising from 0 to ``T``, every segment splitting into ``2C``
    chunks, each sequence fitting its segment, ``seq_len`` and ``row_len``); on the device the same checks are
    device asserts and ``also_check`` is the caller's to assert.

    Example: cu_seqlens_padded ``[0, 16, 40]``, T 40, C 2 -> segments ``[16, 24]``, both multiples of 4."""
    total = bounds.total
    if not reads_host(host_reads, bounds.cu_seqlens_padded):
        if total is None:
            raise _checks.PackingError(f"{op}: T is the last boundary here, which only the host read can learn")
        if validate:
            _device_boundary_checks(op, bounds, seq_len, row_len, cp_size)
        rows = bounds.cu_seqlens_padded.shape[0] - 1
        return PackLayout(bounds.cu_seqlens, bounds.cu_seqlens_padded, None, total, rows, row_len,
                          DeviceExecutor(bounds.seq_lengths))
    parts = [t for t in (bounds.cu_seqlens_padded, bounds.cu_seqlens, bounds.seq_lengths) if t is not None]
    flags = [] if bounds.also_check is None else [bounds.also_check[0].to(torch.int64).view(1)]
    values = torch.cat([t.to(torch.int64) for t in parts] + flags).tolist()  # sync: the one host read (and check)
    sizes = [t.shape[0] for t in parts]
    cu_pad, *rest = [values[a:a + n] for a, n in zip(accumulate(sizes, initial=0), sizes)]
    total = cu_pad[-1] if total is None else total
    if validate:
        checks.boundaries_host(cu_pad, total, bounds.name, end_at_total=not bounds.valid_offsets,
                               where=bounds.total_from, hint=not bounds.valid_offsets and bounds.total_from != "")
    edges = segment_bounds(cu_pad, total)  # [0, 16, 40] -> segments [16, 24]; [T] (B = 0) -> [T]
    segments = [b - a for a, b in zip(edges, edges[1:])]
    cu = rest.pop(0) if bounds.cu_seqlens is not None else None
    lengths = rest.pop(0) if bounds.seq_lengths is not None else None
    if validate:
        checks.segments_host(segments, cp_size)
        _check_lengths_host(lengths, cu, segments, bounds.name, seq_len, row_len)
    if lengths is None and cu is not None:
        lengths = [b - a for a, b in zip(cu, cu[1:])]
    if validate and bounds.also_check is not None and not values[-1]:
        bounds.also_check[1]()  # raises the op's own message, after the layout's checks
    host = HostBounds(lengths, cu, cu_pad, segments, max(segments), len(segments))
    return PackLayout(bounds.cu_seqlens, bounds.cu_seqlens_padded, None, total, len(cu_pad) - 1, row_len,
                      HostExecutor(host, bounds.seq_lengths))


def _check_lengths_host(lengths, cu, segments: list, bounds_name: str, seq_len, row_len) -> None:
    """Host checks of the lengths an op has (``seq_lengths``, or ``cu_seqlens``' differences)."""
    name = "seq_lengths"
    if lengths is None and cu is not None:
        lengths, name = [b - a for a, b in zip(cu, cu[1:])], "cu_seqlens"
    if lengths is None:
        return
    if row_len is not None:
        checks.lengths_host(lengths, row_len)
    if seq_len is not None:
        checks.row_length_host(lengths, seq_len, name)
    checks.fit_host(lengths, segments, name, bounds_name)


def _device_boundary_checks(op: str, bounds: Boundaries, seq_len, row_len, cp_size: int) -> None:
    """:func:`layout_from_boundaries`' checks as device asserts, one check on the device."""
    found = _checks.DeviceChecks()
    _boundary_checks_into(found, op, bounds, seq_len, row_len, cp_size)
    found.check()


def _boundary_checks_into(found: _checks.DeviceChecks, op: str, bounds: Boundaries, seq_len, row_len,
                          cp_size: int) -> None:
    cu_pad = bounds.cu_seqlens_padded
    checks.boundaries_device(op, cu_pad, bounds.total, cp_size, name=bounds.name,
                             end_at_total=not bounds.valid_offsets, into=found)
    lengths = bounds.seq_lengths
    if lengths is None and bounds.cu_seqlens is not None:
        cu = bounds.cu_seqlens.to(torch.int64)
        lengths = cu[1:] - cu[:-1]
    if lengths is None or cu_pad.shape[0] < 2:
        return
    edges = cu_pad.to(torch.int64)
    checks.fit_device(op, lengths.to(torch.int64), edges[1:] - edges[:-1], seq_len, into=found)
    if row_len is not None:
        checks.lengths_device(op, lengths.to(torch.int64), row_len, None, into=found)


def take_layout(layout: PackLayout, total, *, op: str, cp_size: int = 1, seq_len=None, validate: bool = True,
                data: Optional[tuple] = None, **given) -> PackLayout:
    """A layout an op was given (``layout=``): no host read. ``given``: the boundary tensors the caller passed as
    well, each the very tensor the layout holds; ``T``, the ``2C`` chunks and ``seq_len`` are checked on the
    layout (free on a host layout's ints, device asserts otherwise); ``data`` (``(name, tensor)``) is refused when
    the host executor packed it on another layout (:func:`~nn_data.layout.host.check_token`)."""
    if not isinstance(layout, PackLayout):
        raise _checks.PackingError(f"layout must be a PackLayout (PackResult.layout), got {type(layout).__name__}")
    if guard_or_false(layout.total != total):  # known to differ (symbolic sizes: no guard otherwise)
        raise _checks.PackingError(_other_total(layout.total, int(total)))
    if data is not None:
        check_token(data[0], data[1], layout)
    layout = entered(layout)  # the door: a host layout entering a traced region runs there on the device
    for name, tensor in given.items():
        if tensor is not None and tensor is not getattr(layout, name):
            raise _checks.PackingError(
                f"{name} is not the tensor the layout holds; pass layout= alone, or layout.{name} (the same object)")
    if not validate:
        return layout
    if layout.on_host:
        checks.segments_host(layout.host.segments, cp_size)
        if seq_len is not None and layout.host.lengths is not None:
            checks.row_length_host(layout.host.lengths, seq_len)
        return layout
    found = _checks.DeviceChecks()  # the boundaries were checked where the layout was built: their split into 2C
    if cp_size > 1 and not _aligned(layout, 2 * cp_size):
        checks.segments_device(op, layout.cu_seqlens_padded, cp_size, into=found)
    if seq_len is not None and not _fits_rows(layout, seq_len):
        checks.row_length_device(op, layout.lengths(), seq_len, into=found)
    found.check()
    return layout


def _fits_rows(layout: PackLayout, seq_len) -> bool:
    """Whether rows of ``seq_len`` are known, from shapes alone, to hold every length of a device layout: its
    builder checked the lengths against its row length ``S`` (a pack's ``x.shape[1]``), and ``seq_len >= S``.
    Example: a pack of ``[B, 2048]`` rows unpacked to ``seq_len`` 2048: nothing to check on the device."""
    return layout.row_len is not None and statically_known_true(seq_len >= layout.row_len)


def _aligned(layout: PackLayout, multiple: int) -> bool:
    """Whether every segment of a device layout is known, from its builder's configuration alone, to be a
    multiple of ``multiple`` (no check on the device needed). Example: m 4, pad_full_seq_to 64, C 2 -> gcd 4:
    aligned; m 2 -> gcd 2: checked."""
    return getattr(layout.executor, "multiple", 1) % multiple == 0


def _other_total(expected: int, got: int) -> str:
    """The message for a tensor whose length is not the layout's ``T``; a whole fraction ``T/C`` is most
    likely a context-parallel shard. Example: T 16, got 8 -> "... (T/2: a context-parallel shard? ...)"."""
    message = f"the layout was built for T={expected} packed positions but the tensor given with it has T={got}"
    if got and expected % got == 0 and expected > got:
        return (message + f" = T/{expected // got}: a context-parallel shard? Gather it first "
                "(GatherFromContextParallel, or UnshardFromContextParallel of every rank's shard); otherwise pass "
                "the layout of this very microbatch")
    return message + "; pass the layout of this very microbatch"


# ---- the ops on a layout: given the pack's layout (no read) or the boundaries (one read, the validation) ----

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
