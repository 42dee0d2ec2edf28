"""Shared-prefix packing: each group's prompt packed once, then its responses.

Shape legend
    B   rollouts (rows of the batch; R with row-capacity padding); S their row length
    2B  slots: slot ``2b`` is rollout ``b``'s prompt (empty unless ``b`` leads its group), slot ``2b+1``
        its response
    T   packed tokens; C context-parallel size
    *   trailing feature dims

A shared-prefix microbatch is an ordinary :class:`~nn_data.layout.pack_layout.PackLayout` over ``2B``
slots (``docs/ops.md``, "Shared-prefix packing"): rollouts ``input_ids [B, S]`` with lengths ``L``,
prefix (prompt) lengths ``P`` and ``group_ids g``; ``leader[b]`` is the first rollout of ``b``'s group
(the smallest index with ``g[leader[b]] == g[b]``). Slot ``2b`` holds ``input_ids[b, :P[b]]`` when
``leader[b] == b`` (else nothing), slot ``2b+1`` holds ``input_ids[b, P[b]:L[b]]``. The caller's
:class:`~nn_data.layout.build.PackSpec` lays the slots out (each rounded up to ``m``, a fixed ``T``,
"extend last"), so shard, unshard, local places and the padding mask are the slot layout's own; with
groups contiguous in the batch each group's prompt comes right before its responses.

Example: groups ``[7, 7, 9]``, P ``[2, 2, 1]``, L ``[4, 3, 3]``, m 1 -> slot lengths ``[2,2, 0,1, 1,2]``,
cu_seqlens_padded ``[0, 2, 4, 4, 5, 6, 8]``, packed ``[p0 p0 r0 r0 | r1 | p2 | r2 r2]``; positions
``[0,1, 2,3, 2, 0, 1,2]``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from nn_data import _checks
from nn_data.layout import checks, index
from nn_data.layout.build import PackSpec, layout_from_lengths, layout_from_read_lengths, reads_host
from nn_data.layout.device import GatherMaps, gather_pack
from nn_data.layout.pack_layout import PackLayout
from nn_data.layout.rules import Fill, round_up_all
from nn_data.masks import PrefixRule

OP = "shared_prefix_layout"


class SharedPrefixLayout(NamedTuple):
    """A shared-prefix microbatch's layout: ``layout`` the slots' :class:`PackLayout` (``2B`` rows),
    ``seq_lengths [B]``, ``prefix_lengths [B]``, ``leader [B]`` (int64, on the data's device),
    ``row_len`` S, ``maps`` (:class:`~nn_data.layout.device.GatherMaps`: where each packed position
    reads the flat rollouts ``[B*S]``, the pack's one gather),
    ``host_lengths``: the rollout lengths as Python ints when the builder read them (else None).
    """

    layout: PackLayout
    seq_lengths: torch.Tensor
    prefix_lengths: torch.Tensor
    leader: torch.Tensor
    row_len: int
    maps: GatherMaps
    host_lengths: Optional[list] = None

    @property
    def total(self) -> int:
        """T, the packed length."""
        return self.layout.total

    @property
    def rows(self) -> int:
        """B, the rollouts."""
        return self.seq_lengths.shape[0]

    def pack(self, x: torch.Tensor, fill: Fill = 0) -> torch.Tensor:
        """``x [B, S, *] -> [1, T, *]``: every group's prompt once (read from its leader's row), then
        each rollout's response; padding gets ``fill`` (as :meth:`PackLayout.pack`). One gather."""
        _checks.check_min_dims("x", x, 2, "[B, S, *]")
        if x.shape[0] != self.rows or guard_or_false(x.shape[1] != self.row_len):
            raise _checks.PackingError(f"x has shape {_checks.dims(x)}; the shared-prefix layout was built for "
                                       f"[B, S] = [{int(self.rows)}, {int(self.row_len)}], so x must be "
                                       f"[{int(self.rows)}, {int(self.row_len)}, *]")
        if guard_or_false(x.shape[0] * x.shape[1] == 0):  # no rollout token: all padding
            x = x.new_zeros((1, 1, *x.shape[2:]))  # one row to gather from; every position is fill
            return gather_pack(x, GatherMaps(self.maps.source * 0, self.maps.valid), fill)
        return gather_pack(x, self.maps, fill)

    def segment_ids(self) -> torch.Tensor:
        """``[T]`` int64: the slot of every packed position (:meth:`PackLayout.segment_ids`)."""
        return self.layout.segment_ids()

    def positions(self) -> torch.Tensor:
        """``[T]`` int64 position ids: a prompt's tokens ``0..P-1``, a response's ``P..L-1`` (what each
        rollout has alone). Padding keeps counting from its slot's start (at most ``T + S``: finite
        for rotary embeddings). Example: see the module docstring."""
        tables = self._slot_tables()
        seg, offset = self._offsets()
        return tables.base[seg] + offset  # [T]

    def prefix_rule(self) -> PrefixRule:
        """The :class:`~nn_data.masks.PrefixRule` for the document masks (``prefix=``): each response's
        context is its leader's prompt slot (itself when ``P = 0``); the visible keys are the prompt
        slots' real tokens."""
        tables = self._slot_tables()
        seg, offset = self._offsets()
        prompt_slot = seg % 2 == 0
        visible = prompt_slot & (offset < tables.length[seg])  # [T]: a real prompt token
        return PrefixRule(tables.context[seg], visible, tables.base[seg] + offset)

    def unpack(self, packed: torch.Tensor, seq_len=None, fill=0) -> torch.Tensor:
        """``[1, T, *] -> [B, S, *]`` (``S = seq_len``, default the row length): rollout ``b``'s row as if
        it had been packed alone, its prompt read from its leader's prompt slot, its response from its
        own slot; ``fill`` at ``s >= L[b]``. One gather (its backward sums a shared prompt's rows)."""
        _checks.check_packed("packed", packed)
        seq_len = self.row_len if seq_len is None else seq_len
        self.check_rows(seq_len)
        rows, total, trailing = self.rows, packed.shape[1], packed.shape[2:]
        if guard_or_false(total == 0):  # nothing to read: all fill
            out = packed.new_full((rows, seq_len, *trailing), fill)
            return out + packed.sum().to(out.dtype) if packed.requires_grad else out
        where, keep = self.row_places(seq_len)  # [B, S] each
        out = packed[0].index_select(0, where.clamp(0, total - 1).reshape(-1))  # [B*S, *]
        out = out.view(rows, seq_len, *trailing)  # [B, S, *]
        return out.masked_fill(~keep.view(rows, seq_len, *([1] * len(trailing))), fill)

    def row_places(self, seq_len) -> tuple[torch.Tensor, torch.Tensor]:
        """``(where, keep)``, both ``[B, S]``: the packed position holding token ``s`` of rollout ``b``
        (unclamped), and ``s < L[b]``.

        Example (the module docstring's batch): slot starts ``[0, 2, 4, 4, 5, 6]``, S 4 -> rollout 1
        (leader 0, P 2): ``[0, 1, 4, 5]`` (the prompt from slot 0, the response from slot 3 at 4),
        keep ``[T, T, T, F]``.
        """
        lengths, prefix, leader = self.seq_lengths, self.prefix_lengths, self.leader
        starts = self.layout.bounds()[:-1]  # [2B] slot starts ([0] alone when B = 0)
        s = torch.arange(seq_len, device=lengths.device)  # [S]
        rollout = torch.arange(self.rows, device=lengths.device)  # [B]
        prompt_start = starts[2 * leader][:, None]  # [B, 1]
        response_start = (starts[2 * rollout + 1] - prefix)[:, None]  # [B, 1]: where response token P would be
        where = torch.where(s < prefix[:, None], prompt_start + s, response_start + s)  # [B, S]
        return where, s < lengths[:, None]

    def boundary_places(self, cp_size: int = 1, cp_rank: int = 0) -> "BoundaryPlaces":
        """Where each rollout's prompt-to-response score lies (:class:`BoundaryPlaces`, ``[B]`` each): the
        last prompt position (its leader's) scores the response's first token, once per rollout.

        Example (the module docstring's batch, C 1): last ``[1, 1, 5]``, first ``[2, 4, 6]``, has
        ``[T, T, T]``; with C 2 the places come from the zigzag inverse of the slot layout.
        """
        rows, total = self.rows, self.total
        lengths, prefix, leader = self.seq_lengths, self.prefix_lengths, self.leader
        starts = self.layout.bounds()[:-1]  # [2B] slot starts ([0] alone when B = 0)
        rollout = torch.arange(rows, device=lengths.device)  # [B]
        hi = max(total - 1, 0)
        last = (starts[2 * leader] + prefix - 1).clamp(0, hi)  # [B]
        first = starts[2 * rollout + 1].clamp(0, hi)  # [B]
        has = (prefix > 0) & (lengths > prefix) & (total > 0)  # [B]
        if cp_size == 1 or total == 0:
            return BoundaryPlaces(last, first, has, last, torch.ones_like(has))
        # zigzag_inverse: the place of every packed position in the rank-major stack [C * T/C]
        place = index.zigzag_inverse(self.layout.bounds(), total, cp_size)[last]  # [B]
        local_total = total // cp_size
        return BoundaryPlaces(last, first, has, place % local_total, place // local_total == cp_rank)

    def shard(self, packed: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
        """This CP rank's zigzag shard ``[1, T, *] -> [1, T/C, *]``, every slot split into ``2C`` chunks
        (:meth:`PackLayout.shard`)."""
        return self.layout.shard(packed, cp_size, cp_rank)

    def unshard(self, shards: torch.Tensor, cp_size: int) -> torch.Tensor:
        """Every rank's shard ``[C, T/C, *]`` back to ``[1, T, *]`` (:meth:`PackLayout.unshard`)."""
        return self.layout.unshard(shards, cp_size)

    def local_places(self, cp_size: int = 1, cp_rank: int = 0) -> index.ZigzagLocal:
        """This CP rank's packed positions and slots (:meth:`PackLayout.local_places`)."""
        return self.layout.local_places(cp_size, cp_rank)

    def padding_mask(self, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
        """``[1, T/C]`` bool, True at padding (:meth:`PackLayout.padding_mask`)."""
        return self.layout.padding_mask(cp_size, cp_rank)

    def _offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot, offset)`` of every packed position, ``[T]`` each."""
        seg = self.layout.segment_ids()  # [T]
        return seg, torch.arange(self.total, device=seg.device) - self.layout.bounds()[seg]

    def _slot_tables(self) -> "SlotTables":
        return slot_tables(self.seq_lengths, self.prefix_lengths, self.leader, self.row_len)

    def check_rows(self, seq_len) -> None:
        """Every rollout fits rows of ``seq_len`` (nothing is cut off): the builder's ints, or a device assert."""
        if self.host_lengths is not None and self.layout.on_host:  # the executor's rule: its ints
            checks.row_length_host(self.host_lengths, seq_len)
        elif self.rows:
            checks.row_length_device("SharedPrefixLayout.unpack", self.seq_lengths, seq_len)


class BoundaryPlaces(NamedTuple):
    """Each rollout's boundary score, ``[B]`` each: ``last`` the packed position of its prompt's last token
    (its leader's prompt slot), ``first`` that of its response's first token (the target), ``has``: the
    rollout has both (``P > 0`` and ``L > P``); ``local``: the place of ``last`` in this CP rank's shard,
    ``owned``: this rank holds it (positions clamped into ``[0, T)``)."""

    last: torch.Tensor
    first: torch.Tensor
    has: torch.Tensor
    local: torch.Tensor
    owned: torch.Tensor


class SlotTables(NamedTuple):
    """Per-slot tables, ``[2B+1]`` each (one trailing 0 entry, which the ``B = 0`` pseudo-segment reads):
    ``length`` (tokens), ``read`` (the flat rollout position ``b*S + s`` of the slot's first token),
    ``base`` (its rollout position: 0 for a prompt, ``P`` for a response), ``context`` (the slot whose
    prompt it may see: its leader's prompt slot for a response with ``P > 0``, else itself).

    Example: groups ``[7, 7]``, P ``[2, 2]``, L ``[4, 3]``, S 4 -> length ``[2, 2, 0, 1, 0]``, read
    ``[0, 2, 4, 6, 0]``, base ``[0, 2, 0, 2, 0]``, context ``[0, 0, 2, 0, 0]``.
    """

    length: torch.Tensor
    read: torch.Tensor
    base: torch.Tensor
    context: torch.Tensor


def slot_tables(lengths: torch.Tensor, prefix: torch.Tensor, leader: torch.Tensor, row_len) -> SlotTables:
    rows = lengths.shape[0]
    rollout = torch.arange(rows, device=lengths.device)  # [B]
    zero = torch.zeros_like(prefix)

    def slots(prompt, response):  # [B] and [B] -> [2B+1]: interleaved, one trailing 0
        both = torch.stack([prompt, response], dim=1).reshape(2 * rows)  # [2B]
        return torch.cat([both, both.new_zeros(1)])

    prompt_length = torch.where(leader == rollout, prefix, zero)  # [B]: only a group's leader packs its prompt
    own_context = 2 * rollout + 1
    return SlotTables(length=slots(prompt_length, lengths - prefix),
                      read=slots(rollout * row_len, rollout * row_len + prefix),
                      base=slots(zero, prefix),
                      context=slots(2 * rollout, torch.where(prefix > 0, 2 * leader, own_context)))


def leaders(group_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: the first rollout of each rollout's group (a ``[B, B]`` comparison; B is small).

    Example: group_ids ``[7, 9, 7, 9, 4]`` -> ``[0, 1, 0, 1, 4]``.
    """
    rows = group_ids.shape[0]
    rollout = torch.arange(rows, device=group_ids.device)  # [B]
    if rows == 0:
        return rollout
    same = group_ids[:, None] == group_ids[None, :]  # [B, B]
    return torch.where(same, rollout[None, :], rows).amin(dim=1)  # [B]


def prompt_mismatch(input_ids: torch.Tensor, prefix: torch.Tensor, leader: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: rollout ``b``'s first ``min(P[b], P[leader[b]])`` tokens differ from its leader's."""
    ids = input_ids.flatten(2) if input_ids.dim() > 2 else input_ids.unsqueeze(2)  # [B, S, F]
    s = torch.arange(ids.shape[1], device=ids.device)  # [S]
    inside = s[None, :] < torch.minimum(prefix, prefix[leader])[:, None]  # [B, S]
    differs = (ids != ids[leader]).any(dim=2)  # [B, S]
    return (differs & inside).any(dim=1)


def shared_prefix_layout(seq_lengths: torch.Tensor, prefix_lengths: torch.Tensor, group_ids: torch.Tensor, *,
                         row_len: int, spec: PackSpec, input_ids: Optional[torch.Tensor] = None, num_rows=None,
                         validate: bool = True, host_reads: bool = True) -> SharedPrefixLayout:
    """The :class:`SharedPrefixLayout` of rollouts ``[B, S]`` with ``seq_lengths [B]``, ``prefix_lengths
    [B]`` (each rollout's prompt) and ``group_ids [B]`` (rollouts of one group share one prompt).

    ``input_ids [B, S, *]`` (optional): checked to share each group's prompt tokens. ``num_rows`` (a 0-d
    integer tensor): rows at or past it are padding rows (length 0, no group). Eager with ``host_reads``
    (the slots get a host executor), **one** host read (the lengths, the prefix lengths, the group ids, the
    leaders, the slot lengths and the prompt comparison together), then, with ``validate``
    (``docs/design.md``, "Validation"), :class:`~nn_data.errors.PackingError` naming the argument and
    value; otherwise (compiled, or ``host_reads=False``) a device executor, device asserts when ``validate``,
    no read (with a fixed ``T``).
    """
    rows = _check_args(seq_lengths, prefix_lengths, group_ids, row_len, input_ids, num_rows)
    lengths, prefix, groups = (t.to(torch.int64) for t in (seq_lengths, prefix_lengths, group_ids))
    leader = leaders(groups)
    tables = slot_tables(lengths, prefix, leader, row_len)
    slot_lengths = tables.length[: 2 * rows]  # [2B]
    mismatch = prompt_mismatch(input_ids, prefix, leader) if validate and input_ids is not None else None
    slot_rows = None if num_rows is None else 2 * num_rows.to(torch.int64)
    host_lengths = None
    if reads_host(host_reads, lengths):
        layout, host_lengths = _on_host(lengths, prefix, groups, leader, slot_lengths, mismatch, num_rows, row_len,
                                        spec, validate)
    else:
        if validate:
            real = torch.arange(rows, device=lengths.device) < (rows if num_rows is None else num_rows)  # [B]
            checks.lengths_device(OP, lengths, row_len, num_rows)
            checks.prefix_lengths_device(OP, lengths, prefix, leader, mismatch, real)
            checks.shared_total_device(OP, slot_lengths, spec.m, spec.fixed_total, "pad_full_seq_to")
        layout = layout_from_lengths(slot_lengths, row_len, spec, num_rows=slot_rows, validate=validate,
                                     host_reads=False, op=OP)
    seg = layout.segment_ids()  # [T]
    offset = torch.arange(layout.total, device=seg.device) - layout.bounds()[seg]  # [T]
    source = (tables.read[seg] + offset).clamp(max=rows * row_len - 1).clamp(min=0)  # [T] into [B*S]
    maps = GatherMaps(source, offset < tables.length[seg])
    return SharedPrefixLayout(layout, lengths, prefix, leader, row_len, maps, host_lengths)


def _on_host(lengths, prefix, groups, leader, slot_lengths, mismatch, num_rows, row_len, spec, validate):
    """The one read and (when ``validate``) every check on its ints, then the slots' host layout."""
    rows = lengths.shape[0]
    parts = [lengths, prefix, groups, leader, slot_lengths]
    if mismatch is not None:
        parts.append(mismatch.to(torch.int64))
    if num_rows is not None:
        parts.append(num_rows.to(torch.int64).view(1))
    values = torch.cat(parts).tolist()  # sync: the one host read of the shared-prefix layout (and its checks)
    ints = [values[i * rows:(i + 1) * rows] for i in range(4)]
    slots = values[4 * rows:6 * rows]
    flags = values[6 * rows:7 * rows] if mismatch is not None else None
    n = values[-1] if num_rows is not None else None
    if validate:
        checks.lengths_host(ints[0], row_len, n)
        checks.prefix_lengths_host(ints[0], ints[1], ints[2], ints[3], flags, n)
        checks.shared_total_host(sum(round_up_all(slots, spec.m)), sum(ints[0]), spec.m, spec.fixed_total,
                                 "pad_full_seq_to")
    layout = layout_from_read_lengths(slots, slot_lengths, row_len, spec, None if n is None else 2 * n,
                                      validate=validate)
    return layout, ints[0]


def _check_args(seq_lengths, prefix_lengths, group_ids, row_len, input_ids, num_rows) -> int:
    """Metadata (free): three 1-D integer tensors of ``B`` entries on one device, ``S`` an int, ``input_ids``
    ``[B, S, *]``, ``num_rows`` a 0-d integer tensor. Returns B."""
    _checks.check_int_vector("seq_lengths", seq_lengths)
    rows = seq_lengths.shape[0]
    why = f" (one per rollout: seq_lengths has {int(rows)})"
    _checks.check_int_vector("prefix_lengths", prefix_lengths, rows, why)
    _checks.check_int_vector("group_ids", group_ids, rows, why)
    if not isinstance(row_len, torch.SymInt):
        _checks.row_length("row_len", row_len)
    _checks.check_num_rows(num_rows, rows)
    if input_ids is not None:
        _checks.check_min_dims("input_ids", input_ids, 2, "[B, S, *]")
        if input_ids.shape[0] != rows or guard_or_false(input_ids.shape[1] != row_len):
            raise _checks.PackingError(f"input_ids has shape {_checks.dims(input_ids)}; expected [B, S, *] = "
                                       f"[{int(rows)}, {int(row_len)}, *] (B from seq_lengths, S = row_len)")
    _checks.check_same_device(seq_lengths=seq_lengths, prefix_lengths=prefix_lengths, group_ids=group_ids,
                              input_ids=input_ids)
    return rows
