"""Rollout trees: every shared prefix packed once, at any depth; the GRPO shared prompt is the depth-1 tree.

Shape legend
    B   rollouts (rows of the batch; R with row-capacity padding); S their row length
    N   node slots (``node_capacity``: ``2B`` for the shared-prompt spelling, ``3B - 2`` by default)
    T   packed tokens; C context-parallel size
    *   trailing feature dims

A tree microbatch is an ordinary :class:`~nn_data.layout.pack_layout.PackLayout` over ``N`` node slots: each
rollout's own tokens ``[branch_at[b], L[b])`` are split where its children branch into nodes
(:mod:`nn_data.layout.tree_nodes`), each node one slot, packed once, ancestors before descendants
(docs/ops.md, "Rollout trees").

The shared-prompt case (:func:`shared_prefix_layout`) is the depth-1 tree in ``2B`` slots: slot ``2b`` is
rollout ``b``'s prompt (empty unless ``b`` leads its group), ``2b+1`` its response. Example: groups ``[7, 7,
9]``, P ``[2, 2, 1]``, L ``[4, 3, 3]``, m 1 -> parent ``[-1, 0, -1]``, branch_at ``[0, 2, 0]``, slot lengths
``[2,2, 0,1, 1,2]``, cu_seqlens_padded ``[0, 2, 4, 4, 5, 6, 8]``, packed ``[p0 p0 r0 r0 | r1 | p2 | r2 r2]``;
positions ``[0,1, 2,3, 2, 0, 1,2]``."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from nn_data import _checks
from nn_data.layout import checks, index, tree_nodes
from nn_data.layout.build import PackSpec, layout_from_lengths, layout_from_read_lengths, reads_host
from nn_data.layout.device import GatherMaps, gather_pack
from nn_data.layout.pack_layout import PackLayout
from nn_data.layout.rules import Fill, round_up_all
from nn_data.masks import PrefixRule

OP = "tree_layout"


class TreeLayout(NamedTuple):
    """A tree microbatch's layout: ``layout`` the node slots' :class:`PackLayout` (``N`` rows), ``seq_lengths``,
    ``parent``, ``branch_at`` (``[B]`` int64), ``row_len`` S, ``maps`` (:class:`~nn_data.layout.device.GatherMaps`:
    the pack's one gather from the flat rollouts ``[B*S]``), ``nodes`` (:class:`~nn_data.layout.tree_nodes.NodeTables`),
    ``paths`` (:class:`~nn_data.layout.tree_nodes.Paths`), ``host_lengths`` / ``host_begins``: the rollout lengths
    and each slot's place in its rollout as Python ints when the builder read them (else None)."""

    layout: PackLayout
    seq_lengths: torch.Tensor
    parent: torch.Tensor
    branch_at: torch.Tensor
    row_len: int
    maps: GatherMaps
    nodes: tree_nodes.NodeTables
    paths: tree_nodes.Paths
    host_lengths: Optional[list] = None
    host_begins: Optional[list] = None

    @property
    def total(self) -> int:
        """T, the packed length."""
        return self.layout.total

    @property
    def rows(self) -> int:
        """B, the rollouts."""
        return self.seq_lengths.shape[0]

    def pack(self, x: torch.Tensor, fill: Fill = 0) -> torch.Tensor:
        """``x [B, S, *] -> [1, T, *]``: every node once (read from its rollout's row), padding ``fill``
        (as :meth:`PackLayout.pack`). One gather."""
        _checks.check_min_dims("x", x, 2, "[B, S, *]")
        if x.shape[0] != self.rows or guard_or_false(x.shape[1] != self.row_len):
            raise _checks.PackingError(f"x has shape {_checks.dims(x)}; the tree layout was built for "
                                       f"[B, S] = [{int(self.rows)}, {int(self.row_len)}], so x must be "
                                       f"[{int(self.rows)}, {int(self.row_len)}, *]")
        if guard_or_false(x.shape[0] * x.shape[1] == 0):  # no rollout token: all padding
            x = x.new_zeros((1, 1, *x.shape[2:]))  # one row to gather from; every position is fill
            return gather_pack(x, GatherMaps(self.maps.source * 0, self.maps.valid), fill)
        return gather_pack(x, self.maps, fill)

    def segment_ids(self) -> torch.Tensor:
        """``[T]`` int64: the node slot of every packed position (:meth:`PackLayout.segment_ids`)."""
        return self.layout.segment_ids()

    def positions(self) -> torch.Tensor:
        """``[T]`` int64 position ids: each token's position in its rollout (what it has alone). Padding
        keeps counting from its slot's start (at most ``T + S``: finite for rotary embeddings)."""
        seg, offset = self._offsets()
        return self.nodes.begin[seg] + offset  # [T]

    def prefix_rule(self) -> PrefixRule:
        """The :class:`~nn_data.masks.PrefixRule` for the document masks (``prefix=``): each packed
        position's rollout, whether it is a real token, its position, and the ``[B+1, B+1]`` shared-token
        table."""
        seg, offset = self._offsets()
        return PrefixRule(self.nodes.owner[seg], offset < self.nodes.length[seg], self.nodes.begin[seg] + offset,
                          tree_nodes.shared_table(self.paths))

    def unpack(self, packed: torch.Tensor, seq_len=None, fill=0) -> torch.Tensor:
        """``[1, T, *] -> [B, S, *]`` (``S = seq_len``, default the row length): rollout ``b``'s row as if
        it had been packed alone, read from its path's nodes; ``fill`` at ``s >= L[b]``. One gather (its
        backward sums a shared node's rows)."""
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

    def places(self, rollout: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(where, slot)``, shaped as ``position [M, K]``: the packed position holding token ``position``
        of rollout ``rollout [M]`` (read from the node of its path that holds it; unclamped), and that
        node's slot. Positions below 0 read token 0."""
        position = position.clamp(min=0)
        owner = tree_nodes.owners(self.paths.ancestor[rollout], self.branch_at, position)  # [M, K]
        slot = tree_nodes.node_of(self.nodes, owner, position, self.row_len)  # [M, K]
        return self.layout.bounds()[slot] + position - self.nodes.begin[slot], slot

    def row_places(self, seq_len) -> tuple[torch.Tensor, torch.Tensor]:
        """``(where, keep)``, both ``[B, S]``: the packed position holding token ``s`` of rollout ``b``
        (unclamped), and ``s < L[b]``.

        Example (the module docstring's batch): slot starts ``[0, 2, 4, 4, 5, 6]``, S 4 -> rollout 1
        (parent 0, branch_at 2): ``[0, 1, 4, 5]`` (its first 2 tokens from slot 0, then its own slot 3 at
        4), keep ``[T, T, T, F]``.
        """
        lengths = self.seq_lengths
        s = torch.arange(seq_len, device=lengths.device)  # [S]
        if self.rows == 0:
            return s.expand(0, seq_len), s.expand(0, seq_len) < 0
        rollout = torch.arange(self.rows, device=lengths.device)  # [B]
        where, _ = self.places(rollout, s.expand(self.rows, seq_len))  # [B, S]
        return where, s < lengths[:, None]

    def boundary_places(self, cp_size: int = 1, cp_rank: int = 0) -> "BoundaryPlaces":
        """Where each node's first token is scored (:class:`BoundaryPlaces`, ``[N]`` each): from the token before it on
        its path, in its parent node (one extra row per branch).

        Example (the module docstring's batch, C 1): slot 1 (rollout 0's response) ``last`` 1, ``first`` 2;
        slot 3 (rollout 1's) ``last`` 1, ``first`` 4; ``has`` only for slots 1, 3 and 5 (the others empty
        or at position 0); with C 2 the places come from the zigzag inverse of the slot layout."""
        total, nodes = self.total, self.nodes
        slots = nodes.owner.shape[0] - 1  # N
        owner, begin = nodes.owner[:slots], nodes.begin[:slots]  # [N]
        hi = max(total - 1, 0)
        first = self.layout.bounds()[:slots].clamp(0, hi)  # [N]
        if self.rows == 0:
            has = owner < 0
            return BoundaryPlaces(first, first, has, first, ~has)
        rollout = owner.clamp(max=self.rows - 1)
        last = self.places(rollout, (begin - 1)[:, None])[0][:, 0].clamp(0, hi)  # [N]
        has = (owner < self.rows) & (begin > 0) & (nodes.length[:slots] > 0) & (total > 0)  # [N]
        if cp_size == 1 or total == 0:
            return BoundaryPlaces(last, first, has, last, torch.ones_like(has))
        # zigzag_inverse: the place of every packed position in the rank-major stack [C * T/C]
        place = index.zigzag_inverse(self.layout.bounds(), total, cp_size)[last]  # [N]
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

    def check_rows(self, seq_len) -> None:
        """Every rollout fits rows of ``seq_len`` (nothing is cut off): the builder's ints, or a device assert."""
        if self.host_lengths is not None and self.layout.on_host:  # the executor's rule: its ints
            checks.row_length_host(self.host_lengths, seq_len)
        elif self.rows:
            checks.row_length_device("TreeLayout.unpack", self.seq_lengths, seq_len)


class BoundaryPlaces(NamedTuple):
    """Each node's boundary score, ``[N]`` each: ``last`` the packed position of the token before the node's first on
    its path, ``first`` that of its first token, ``has`` (non-empty, not at position 0); ``local`` the place of
    ``last`` in this rank's shard, ``owned`` this rank holds it."""

    last: torch.Tensor
    first: torch.Tensor
    has: torch.Tensor
    local: torch.Tensor
    owned: torch.Tensor


def tree_layout(seq_lengths: torch.Tensor, parent: torch.Tensor, branch_at: torch.Tensor, *, row_len: int,
                spec: PackSpec, input_ids: Optional[torch.Tensor] = None, num_rows=None,
                node_capacity: Optional[int] = None, validate: bool = True, host_reads: bool = True) -> TreeLayout:
    """The :class:`TreeLayout` of rollouts ``[B, S]`` with ``seq_lengths [B]``, ``parent [B]`` (an earlier rollout
    whose first ``branch_at[b]`` tokens rollout ``b`` shares, or -1) and ``branch_at [B]``.

    Args:
        input_ids: ``[B, S, *]`` (optional), checked to hold each shared token equal to its parent's.
        num_rows: a 0-d integer tensor; rows at or past it are padding rows (length 0, roots).
        node_capacity: a Python int, default ``max(3B - 2, 2B)`` (always enough).

    Eager with ``host_reads``: one host read, then with ``validate`` a :class:`~nn_data.errors.PackingError`
    naming the rollout, the field and its value (docs/design.md, "Validation"); otherwise a device executor
    and device asserts. The index maps read ``parent`` clamped, so they stay in range even unvalidated.

    Example: L ``[5, 4]``, parent ``[-1, 0]``, branch_at ``[0, 3]``, m 1 -> N 4 slots ``[0,3) [3,5) | [] [3,4)``
    of rollouts 0, 0, 1, 1; packed ``[x0 x1 x2 | x3 x4 | y3]``, positions ``[0,1,2, 3,4, 3]``."""
    rows = _check_args(seq_lengths, {"parent": parent, "branch_at": branch_at}, row_len, input_ids, num_rows)
    capacity = max(3 * rows - 2, 2 * rows) if node_capacity is None else node_capacity
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2 * rows:
        raise _checks.PackingError(f"node_capacity={node_capacity!r} is invalid; expected an int >= 2B = "
                                   f"{2 * rows} (or None: 3B - 2, always enough)")
    lengths, given, at = (t.to(torch.int64) for t in (seq_lengths, parent, branch_at))
    up = given.clamp(max=max(rows - 1, 0))  # [B] a parent past the rollouts reads none (the checks see ``given``)
    mismatch = None
    if validate and input_ids is not None and rows:
        mismatch = tree_nodes.prefix_mismatch(input_ids, at, up.clamp(min=0)) & (up >= 0)
    return _build(lengths, up, at, torch.zeros_like(at), row_len, spec, capacity, num_rows, validate, host_reads,
                  tree_checks=(mismatch, given))


def shared_prefix_layout(seq_lengths: torch.Tensor, prefix_lengths: torch.Tensor, group_ids: torch.Tensor, *,
                         row_len: int, spec: PackSpec, input_ids: Optional[torch.Tensor] = None, num_rows=None,
                         validate: bool = True, host_reads: bool = True) -> TreeLayout:
    """The depth-1 :class:`TreeLayout` (GRPO groups converted to the tree): ``seq_lengths [B]``, ``prefix_lengths
    [B]`` (each rollout's prompt), ``group_ids [B]``; each rollout's parent is its group's first rollout,
    ``branch_at`` its prompt length; ``2B`` slots. ``input_ids`` and ``num_rows`` and the validation as
    :func:`tree_layout`, in the group's words."""
    rows = _check_args(seq_lengths, {"prefix_lengths": prefix_lengths, "group_ids": group_ids}, row_len, input_ids,
                       num_rows)
    lengths, prefix, groups = (t.to(torch.int64) for t in (seq_lengths, prefix_lengths, group_ids))
    leader = tree_nodes.leaders(groups)
    rollout = torch.arange(rows, device=lengths.device)  # [B]
    parent = torch.where((leader != rollout) & (prefix > 0), leader, -1)  # [B]
    branch_at = torch.where(parent >= 0, prefix, 0)  # [B]
    extra = torch.where(leader == rollout, prefix, 0)  # [B]: a leader's prompt is a node even without a follower
    mismatch = None
    if validate and input_ids is not None and rows:
        mismatch = tree_nodes.prefix_mismatch(input_ids, torch.minimum(prefix, prefix[leader]), leader)
    return _build(lengths, parent, branch_at, extra, row_len, spec, 2 * rows, num_rows, validate, host_reads,
                  group_checks=(prefix, groups, leader, mismatch))


def _build(lengths, parent, branch_at, extra, row_len, spec, capacity, num_rows, validate, host_reads, *,
           tree_checks=None, group_checks=None) -> TreeLayout:
    """The layout, after the checks of one spelling (``tree_checks``: the tree's mismatch flags and its parents
    as given, ``parent`` those clamped into the rollouts; ``group_checks``: the shared-prompt spelling's prefix lengths, groups, leaders and mismatch flags)."""
    rows = lengths.shape[0]
    nodes = tree_nodes.node_tables(lengths, parent, branch_at, extra, row_len, capacity)
    slot_lengths = nodes.length[:capacity]  # [N]
    slot_rows = None  # the slot where the padding rows' slots begin (a 0-d tensor, no read)
    if num_rows is not None:
        slot_rows = nodes.offsets.index_select(0, num_rows.to(torch.int64).clamp(0, rows).view(1)).view(())
    host_lengths = host_begins = None
    if reads_host(host_reads, lengths):
        given = parent if tree_checks is None else tree_checks[1]
        layout, host_lengths, host_begins = _on_host(lengths, given, branch_at, nodes, slot_lengths, slot_rows,
                                                     num_rows, row_len, spec, validate, tree_checks, group_checks)
    else:
        op = OP if group_checks is None else "shared_prefix_layout"
        if validate:
            real = torch.arange(rows, device=lengths.device) < (rows if num_rows is None else num_rows)  # [B]
            found = _checks.DeviceChecks()  # the microbatch's checks, checked once below
            checks.lengths_device(op, lengths, row_len, num_rows, into=found)
            if group_checks is not None:
                prefix, _, leader, mismatch = group_checks
                checks.prefix_lengths_device(op, lengths, prefix, leader, mismatch, real, into=found)
            else:
                checks.tree_device(op, lengths, tree_checks[1], branch_at, tree_checks[0], real, nodes.used,
                                   capacity, into=found)
            checks.shared_total_device(op, slot_lengths, spec.m, spec.fixed_total, "pad_full_seq_to", into=found,
                                       tree=group_checks is None)
        layout = layout_from_lengths(slot_lengths, row_len, spec, num_rows=slot_rows, validate=validate,
                                     host_reads=False, op=op, into=found if validate else None)
        if validate:
            found.check()  # the rollouts' checks, then the slots' layout's: one check on the device
    seg = layout.segment_ids()  # [T]
    offset = torch.arange(layout.total, device=seg.device) - layout.bounds()[seg]  # [T]
    read = nodes.owner.clamp(max=max(rows - 1, 0)) * row_len + nodes.begin  # [N+1]: a node's first token in [B*S]
    source = (read[seg] + offset).clamp(max=rows * row_len - 1).clamp(min=0)  # [T] into [B*S]
    maps = GatherMaps(source, offset < nodes.length[seg])
    path = tree_nodes.paths(parent, branch_at)
    return TreeLayout(layout, lengths, parent, branch_at, row_len, maps, nodes, path, host_lengths, host_begins)


def _on_host(lengths, parent, branch_at, nodes, slot_lengths, slot_rows, num_rows, row_len, spec, validate,
             tree_checks, group_checks):
    """The one read and (when ``validate``) every check on its ints, then the slots' host layout, the rollout
    lengths and the slots' begins (0 for a slot of no rollout) as ints."""
    rows, slots = lengths.shape[0], slot_lengths.shape[0]
    flags = tree_checks[0] if tree_checks is not None else group_checks[3]
    begins = torch.where(nodes.owner[:slots] < rows, nodes.begin[:slots], 0)  # [N]
    parts = [lengths, parent, branch_at, slot_lengths, begins, nodes.used.view(1)]
    if group_checks is not None:
        parts += [group_checks[0], group_checks[1], group_checks[2]]
    if flags is not None:
        parts.append(flags.to(torch.int64))
    if num_rows is not None:
        parts += [num_rows.to(torch.int64).view(1), slot_rows.view(1)]
    values = torch.cat(parts).tolist()  # sync: the one host read of the tree layout (and its checks)
    cursor = [0]

    def read(n):  # the next n values of the read
        cursor[0] += n
        return values[cursor[0] - n:cursor[0]]

    ints = [read(rows) for _ in range(3)]
    slot_ints, begin_ints, used = read(slots), read(slots), read(1)[0]
    group_ints = [read(rows) for _ in range(3)] if group_checks is not None else None
    flag_ints = read(rows) if flags is not None else None
    n, n_slots = read(2) if num_rows is not None else (None, None)
    if validate:
        checks.lengths_host(ints[0], row_len, n)
        if group_ints is not None:
            checks.prefix_lengths_host(ints[0], group_ints[0], group_ints[1], group_ints[2], flag_ints, n)
        else:
            checks.tree_host(ints[0], ints[1], ints[2], flag_ints, n, used, slots)
        checks.shared_total_host(sum(round_up_all(slot_ints, spec.m)), sum(ints[0]), spec.m, spec.fixed_total,
                                 "pad_full_seq_to", tree=group_checks is None)
    layout = layout_from_read_lengths(slot_ints, slot_lengths, row_len, spec, n_slots, validate=validate)
    return layout, ints[0], begin_ints


def _check_args(seq_lengths, fields: dict, row_len, input_ids, num_rows) -> int:
    """Metadata (free): ``seq_lengths`` and each of ``fields`` 1-D integer tensors of ``B`` entries on one
    device, ``S`` an int, ``input_ids`` ``[B, S, *]``, ``num_rows`` a 0-d integer tensor. Returns B."""
    _checks.check_int_vector("seq_lengths", seq_lengths)
    rows = seq_lengths.shape[0]
    why = f" (one per rollout: seq_lengths has {int(rows)})"
    for name, t in fields.items():
        _checks.check_int_vector(name, t, rows, why)
    if not isinstance(row_len, torch.SymInt):
        _checks.row_length("row_len", row_len)
    _checks.check_num_rows(num_rows, rows)
    if input_ids is not None:
        _checks.check_min_dims("input_ids", input_ids, 2, "[B, S, *]")
        if input_ids.shape[0] != rows or guard_or_false(input_ids.shape[1] != row_len):
            raise _checks.PackingError(f"input_ids has shape {_checks.dims(input_ids)}; expected [B, S, *] = "
                                       f"[{int(rows)}, {int(row_len)}, *] (B from seq_lengths, S = row_len)")
    _checks.check_same_device(seq_lengths=seq_lengths, input_ids=input_ids, **fields)
    return rows
