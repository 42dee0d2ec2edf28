"""Every check of the layout rules, each with one wording (``docs/design.md``, "Validation").

Shape legend
    B   rows; ``L[b]`` their lengths; S the row length; T the packed length; C the CP size

Three kinds: packed-length limits and shape checks (no data); **host checks** (``*_host``) on the Python ints
of the host executor's one read, raising :class:`~nn_data.errors.PackingError` naming the argument, the first
bad value and what would be valid; **device checks** (``*_device``), the same conditions as device asserts
naming the argument and the valid range, each added to the caller's :class:`~nn_data._checks.DeviceChecks`
(``into=``) so that a builder's checks are one check on the device. Checks that know nothing of the layout
are :mod:`nn_data._checks`'."""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from nn_data import _checks
from nn_data.errors import PackingError
from nn_data.layout.index import segment_ids
from nn_data.layout.rules import INT32_MAX


# ---- wordings ----------------------------------------------------------------------------------

def int32_limit(what: str) -> str:
    """The one wording of "``what`` does not fit int32 ``cu_seqlens``" (``what`` names the argument
    and its value, e.g. ``"pad_full_seq_to=2147483648"``)."""
    return (f"{what} exceeds {INT32_MAX} (2**31 - 1), the largest packed length or boundary that int32 "
            f"cu_seqlens can hold; the packed length must be at most {INT32_MAX}")


def segment_not_divisible(i: int, value, two_c: int) -> str:
    """The one wording of "a padded segment does not split into ``2*cp_size`` chunks"."""
    return (f"segment {i} of cu_seqlens_padded is {value} tokens long, not a multiple of "
            f"2*cp_size={two_c}; pad sequences to a multiple of {two_c} (pad_individual_seqs_to_multiple_of) "
            "and choose the packed length (pad_full_seq_to) so that the extended last segment is one too "
            "(NeMo-RL silently drops the remainder tokens of such a segment)")


def length_of(name: str, i: int, value) -> str:
    """How a message names a length: ``seq_lengths[i] = v``, or for lengths taken from ``cu_seqlens``'
    differences ``the length v of sequence i (from cu_seqlens)``."""
    return f"the length {value} of sequence {i} (from cu_seqlens)" if name == "cu_seqlens" else f"{name}[{i}] = {value}"


def length_outside(i: int, value, limit: int, limit_name: str = "S", name: str = "seq_lengths") -> str:
    """``seq_lengths[i] = v is outside [0, S=limit]``."""
    return (f"{length_of(name, i, value)} is outside [0, {limit_name}={limit}]; valid lengths are integers in "
            f"[0, {limit}]")


def _first(bad: Sequence[bool]) -> int:
    return next(i for i, b in enumerate(bad) if b)


def _folded(check: Callable) -> Callable:
    """A ``*_device`` function's conditions go into the caller's :class:`~nn_data._checks.DeviceChecks`
    (``into=``, checked once with the call's other checks), or, without one, into its own, checked once."""
    @functools.wraps(check)
    def folded(*args, into: Optional[_checks.DeviceChecks] = None, **kwargs) -> None:
        found = _checks.DeviceChecks() if into is None else into
        check(*args, into=found, **kwargs)
        if into is None:
            found.check()
    return folded


# ---- packed-length limits and shape checks (no data) -------------------------------------------

def fixed_total_arg(name: str, value) -> Optional[int]:
    """A configured packed length (``pad_full_seq_to``, ``pad_packed_seq_to``, a bucket, a bin
    budget): None or an int in ``[1, 2**31 - 1]``; ``name`` is the caller's spelling."""
    value = _checks.positive_int(name, value, allow_none=True)
    if value is not None and value > INT32_MAX:
        raise PackingError.about(name, int32_limit(f"{name}={value}"))
    return value


def packed_tensor_length(name: str, total) -> None:
    """A packed tensor's length ``T`` must fit int32 boundaries (a shape check; an unbacked ``T``
    under compile is not decided here)."""
    if guard_or_false(total > INT32_MAX):
        raise PackingError(int32_limit(f"the packed length T={int(total)} of {name}"))


def total_divisible(total: int, cp_size: int) -> None:
    """The packed length ``T`` must split into ``2*cp_size`` chunks (a shape check)."""
    if cp_size > 1 and total % (2 * cp_size):
        raise PackingError.about(
            "pad_full_seq_to", f"the packed length T={total} is not a multiple of 2*cp_size={2 * cp_size}; "
            "choose pad_full_seq_to (or the padding multiples) so that T is one")


def sequence_divisible(name: str, length: int, cp_size: int, where: str) -> None:
    """One sequence of ``length`` positions (``where`` says along which dim) must split into ``2*cp_size``
    zigzag chunks; NeMo-RL's per-sequence shard silently drops the remainder."""
    if cp_size > 1 and length % (2 * cp_size):
        raise PackingError(
            f"{name} has {length} positions {where}, not a multiple of 2*cp_size={2 * cp_size}; "
            f"pad it to a multiple of {2 * cp_size} first (NeMo-RL silently drops the remainder)")


def boundary_args(name: str, data: torch.Tensor, total, cu_seqlens_padded, cp_size: int, cu_seqlens=None) -> None:
    """Metadata of the boundary tensors given with the tensor ``name`` (packed length ``total``):
    1-D integer, ``cu_seqlens`` as long as ``cu_seqlens_padded``, one device, ``T`` within the int32
    limit and divisible by ``2*cp_size``."""
    _checks.check_int_vector("cu_seqlens_padded", cu_seqlens_padded)
    if cu_seqlens is not None:
        _checks.check_int_vector("cu_seqlens", cu_seqlens, cu_seqlens_padded.shape[0])
    _checks.check_same_device(**{name: data, "cu_seqlens": cu_seqlens, "cu_seqlens_padded": cu_seqlens_padded})
    packed_tensor_length(name, total)
    total_divisible(total, cp_size)


# ---- host checks: the ints the one read brought ------------------------------------------------

def lengths_host(lengths: list, row_len: int, num_rows: Optional[int] = None) -> None:
    """``0 <= L[b] <= S``; ``num_rows`` in ``[0, B]``; rows at or past ``num_rows`` have length 0."""
    if lengths and (min(lengths) < 0 or max(lengths) > row_len):
        i = _first([n < 0 or n > row_len for n in lengths])
        raise PackingError(length_outside(i, lengths[i], row_len))
    if num_rows is None:
        return
    rows = len(lengths)
    if not 0 <= num_rows <= rows:
        raise PackingError(f"num_rows={num_rows} is invalid; expected a value in [0, {rows}] (the rows of x)")
    if any(lengths[num_rows:]):
        i = num_rows + _first([n != 0 for n in lengths[num_rows:]])
        raise PackingError(f"seq_lengths[{i}] = {lengths[i]} but row {i} is a padding row (num_rows={num_rows}); "
                           "rows at or past num_rows must have length 0")


def natural_total_host(natural: int, m: int, fixed_total: Optional[int], name: str) -> None:
    """The natural total ``sum(round_up(L, m))`` must fit the fixed packed length (``name``: the
    caller's spelling of it). NeMo-RL's packer truncates the packed tensor instead."""
    if fixed_total is not None and natural > fixed_total:
        raise PackingError.about(name, f"the packed total sum(round_up(seq_lengths, {m})) = {natural} exceeds "
                                 f"{name}={fixed_total}; {name} must be at least {natural} (NeMo-RL silently "
                                 "truncates the packed tensor here and drops the tail tokens)")


SHARED_TOTAL = ("the shared-prefix packed total (each group's prompt once, then every response, each slot rounded up "
                "to m={m})")
TREE_TOTAL = "the rollout tree's packed total (each shared token once, each node's slot rounded up to m={m})"


def _total_wording(tree: bool, m: int) -> tuple:
    """(what the total is, what packs once, the planner that fits it) for a tree or a GRPO group's shared prompt."""
    if tree:
        return TREE_TOTAL.format(m=m), "each shared prefix is packed once", "plan_step_rollout_tree"
    return SHARED_TOTAL.format(m=m), "each prompt is packed once", "plan_step_shared_prefix"


def shared_total_host(natural: int, rollout_sum: int, m: int, fixed_total: Optional[int], name: str, *,
                      tree: bool = False) -> None:
    """A tree microbatch must fit the fixed packed length: ``natural`` is the slots' total ``sum(round_up(slot,
    m))``, each shared token once; the rollouts' own lengths (``rollout_sum``) are named beside it.

    Example: two rollouts of one group, P 20, L ``[30, 29]`` (sum 59), m 1 -> slots ``[20, 10, 0, 9]``,
    natural 39: ``pad_full_seq_to=32`` is refused, naming 39 and the fix."""
    if fixed_total is None or natural <= fixed_total:
        return
    what, once, planner = _total_wording(tree, m)
    raise PackingError.about(name, f"{what} = {natural} exceeds {name}={fixed_total}; {name} must be at "
                             f"least {natural} (the rollouts' own lengths sum to {rollout_sum}: {once}), "
                             f"or split the microbatch (nn_data.planning.{planner} plans microbatches that fit)")


@_folded
def shared_total_device(op: str, slot_lengths: torch.Tensor, m: int, fixed_total: Optional[int], name: str, *,
                        into: _checks.DeviceChecks, tree: bool = False) -> None:
    """:func:`shared_total_host` as a device assert: the value is not known without a read, so the message
    says how to compute it and the fix."""
    if fixed_total is None:
        return
    what, _, planner = _total_wording(tree, m)
    need = ("sum(round_up(slot, m)) over the tree's nodes (each shared prefix once)" if tree else
            "sum(round_up(P, m)) over the groups + sum(round_up(L - P, m)) over the rollouts")
    natural = ((slot_lengths + m - 1) // m * m).sum()  # sum(round_up(slot, m)): slots [20, 10, 0, 9], m 4 -> 48
    into.add(natural <= fixed_total, f"nn_data.{op}: {what} exceeds {name}="
             f"{fixed_total}; raise {name} to at least {need}, or split the microbatch "
             f"(nn_data.planning.{planner} plans microbatches that fit; an eager call names "
                          "the value)")


def total_limit_host(total: int, what: str) -> None:
    """A packed length learned from the data must fit int32 boundaries (``what`` says how it was made)."""
    if total > INT32_MAX:
        raise PackingError(int32_limit(f"the packed total {total} of seq_lengths ({what})"))


def segments_host(segments: list, cp_size: int) -> None:
    """With ``cp_size > 1`` every segment (the extended last one and the ``B = 0`` pseudo-segment
    too) must split into ``2*cp_size`` chunks."""
    if cp_size == 1:
        return
    two_c = 2 * cp_size
    if any(n % two_c for n in segments):
        i = _first([n % two_c != 0 for n in segments])
        raise PackingError.about("pad_full_seq_to", segment_not_divisible(i, segments[i], two_c))


def boundaries_host(values: list, total: int, name: str = "cu_seqlens_padded", *, end_at_total: bool = True,
                    where: str = "", hint: bool = False) -> None:
    """Boundaries lie in ``[0, T]``, start at 0, never decrease and end at ``T`` (``end_at_total=False``:
    at most ``T``; the unpadded offsets NeMo-RL's unpack accepts). ``[T]`` alone is ``B = 0``'s
    pseudo-segment. ``where`` says where ``T`` comes from (``" (T = packed.shape[1])"``); ``hint``
    names the likely mistake (unpadded boundaries where the padded ones belong)."""
    outside = [v < 0 or v > total for v in values]
    detail = ""
    if any(outside):
        i = _first(outside)
        detail = f": {name}[{i}] = {values[i]} is outside [0, T={total}]"
    bounds = [0, values[0]] if len(values) == 1 else values
    rises = bounds[0] == 0 and all(a <= b for a, b in zip(bounds, bounds[1:]))
    ends = bounds[-1] == total if end_at_total else bounds[-1] <= total
    if detail or not (rises and ends):
        end = f"end at {total}" if end_at_total else f"end at most at {total}"
        likely = " (cu_seqlens, the unpadded boundaries, passed where cu_seqlens_padded belongs?)" if hint else ""
        raise PackingError(f"{name}={values} is invalid for a packed length T={total}{where}{detail}; it must start "
                           f"at 0, never decrease and {end}{likely}")


def fit_host(lengths: list, segments: list, name: str = "seq_lengths", bounds_name: str = "cu_seqlens_padded") -> None:
    """Each sequence fits its padded segment: ``0 <= L[b] <= segment b``. ``name="cu_seqlens"``: the
    lengths are ``cu_seqlens``' differences."""
    bad = [n < 0 or n > seg for n, seg in zip(lengths, segments)]
    if any(bad):
        i = _first(bad)
        raise PackingError(f"{length_of(name, i, lengths[i])} does not fit its segment of {bounds_name} "
                           f"({segments[i]} long); valid lengths are in [0, the segment's length]")


def row_length_host(lengths: list, seq_len: int, name: str = "seq_lengths") -> None:
    """Every length fits the output rows: ``L[b] <= seq_len``."""
    bad = [n < 0 or n > seq_len for n in lengths]
    if any(bad):
        i = _first(bad)
        raise PackingError(length_outside(i, lengths[i], seq_len, "seq_len", name))


def prefix_lengths_host(lengths: list, prefixes: list, groups: list, leader: list, mismatch: Optional[list],
                        num_rows: Optional[int] = None) -> None:
    """A shared-prefix microbatch (:mod:`nn_data.layout.tree`), on the ints of its one read:
    ``0 <= P[b] <= L[b]``; every rollout of a group (equal ``group_ids``) has the prefix length and, when
    ``input_ids`` were given (``mismatch [B]``: its prompt tokens differ from its leader's), the prompt
    tokens of the group's first rollout ``leader[b]``. Rows at or past ``num_rows`` (empty padding rows)
    join no group."""
    bad = [not 0 <= p <= n for p, n in zip(prefixes, lengths)]
    if any(bad):
        i = _first(bad)
        raise PackingError(f"{length_of('prefix_lengths', i, prefixes[i])} is outside [0, seq_lengths[{i}]="
                           f"{lengths[i]}]; a rollout's prompt (prefix) is at most the rollout's length")
    real = len(lengths) if num_rows is None else num_rows
    for i in range(real):  # host ints: the error path reads nothing more
        j = leader[i]
        if prefixes[i] != prefixes[j]:
            raise PackingError(
                f"prefix_lengths[{i}] = {prefixes[i]} but rollout {j} of the same group (group_ids[{i}] = "
                f"group_ids[{j}] = {groups[i]}) has prefix_lengths[{j}] = {prefixes[j]}; the rollouts of one group "
                "share one prompt: give them one prefix length, or different group_ids")
        if mismatch is not None and mismatch[i]:
            raise PackingError(
                f"input_ids[{i}, :{prefixes[i]}] differs from input_ids[{j}, :{prefixes[j]}], the prompt of rollout "
                f"{j} of the same group (group_ids[{i}] = group_ids[{j}] = {groups[i]}); the rollouts of one group "
                "share one prompt: give rollouts with different prompts different group_ids")


# ---- device checks: the same conditions as device asserts --------------------------------------

@_folded
def lengths_device(op: str, lengths: torch.Tensor, row_len, num_rows: Optional[torch.Tensor], *,
                   row_len_name: str = "x.shape[1], the row length", into: _checks.DeviceChecks) -> None:
    """:func:`lengths_host` as device asserts (``S`` and ``B`` named, never formatted: they may be
    symbolic sizes under compile); ``row_len_name`` says what ``S`` is (a ``[R, S]`` buffer's caller: the
    width of the rows it loaded)."""
    rows = lengths.shape[0]
    if rows:
        into.add(((lengths >= 0) & (lengths <= row_len)).all(), f"nn_data.{op}: every seq_lengths "
                              f"value must be in [0, S] (S = {row_len_name})")
    if num_rows is None:
        return
    n = num_rows.to(torch.int64)
    into.add((n >= 0) & (n <= rows),
                          f"nn_data.{op}: num_rows must be in [0, B] (B = x.shape[0], the rows)")
    if rows:
        tail = (lengths * (torch.arange(rows, device=lengths.device) >= n)).sum()
        into.add(tail == 0, f"nn_data.{op}: rows at or past num_rows must have length 0")


@_folded
def total_device(op: str, natural: torch.Tensor, total, fixed_total: Optional[int], name: str, *,
                 into: _checks.DeviceChecks) -> None:
    """:func:`natural_total_host` and :func:`total_limit_host` as device asserts (``total`` is
    ``round_up(natural, p)`` as a tensor when ``fixed_total`` is None)."""
    if fixed_total is not None:
        into.add(natural <= fixed_total, f"nn_data.{op}: the packed total sum(round_up(seq_lengths, "
                              f"m)) exceeds {name}={fixed_total}")
    else:
        into.add(total <= INT32_MAX, f"nn_data.{op}: " + int32_limit("the packed total of seq_lengths"))


@_folded
def boundaries_device(op: str, cu_seqlens_padded: torch.Tensor, total, cp_size: int = 1, *,
                      name: str = "cu_seqlens_padded", end_at_total: bool = True, into: _checks.DeviceChecks) -> None:
    """:func:`boundaries_host` and :func:`segments_host` as device asserts."""
    bounds = cu_seqlens_padded.to(torch.int64)
    if bounds.shape[0] == 1:  # B = 0: [T] is the pseudo-segment [0, T]
        bounds = torch.cat([bounds.new_zeros(1), bounds])
    seg = bounds[1:] - bounds[:-1]  # [B']
    inside = ((cu_seqlens_padded >= 0) & (cu_seqlens_padded <= total)).all()
    ends = bounds[-1] == total if end_at_total else bounds[-1] <= total
    end = "end at T" if end_at_total else "end at most at T"
    into.add(inside & (bounds[0] == 0) & (seg >= 0).all() & ends,
                          f"nn_data.{op}: every boundary of {name} must lie in [0, T]; {name} must start at 0, "
                          f"never decrease and {end}")
    if cp_size > 1:
        into.add((seg % (2 * cp_size) == 0).all(),
                              f"nn_data.{op}: every segment of {name} must be a multiple of 2*cp_size={2 * cp_size}")


@_folded
def segments_device(op: str, cu_seqlens_padded: torch.Tensor, cp_size: int, *, into: _checks.DeviceChecks) -> None:
    """:func:`segments_host` as a device assert (the boundaries themselves already checked where they were
    built). Example: cu_seqlens_padded ``[0, 16, 40]``, C 2 -> segments ``[16, 24]``, both multiples of 4."""
    if cp_size == 1:
        return
    bounds = cu_seqlens_padded.to(torch.int64)
    seg = bounds[1:] - bounds[:-1] if bounds.shape[0] > 1 else bounds  # [B'] ([T] alone: B = 0's pseudo-segment)
    into.add((seg % (2 * cp_size) == 0).all(),
             f"nn_data.{op}: every segment of cu_seqlens_padded must be a multiple of 2*cp_size={2 * cp_size}")


@_folded
def fit_device(op: str, lengths: torch.Tensor, segments: torch.Tensor, seq_len=None, *,
               into: _checks.DeviceChecks) -> None:
    """:func:`fit_host` (and, with ``seq_len``, :func:`row_length_host`) as device asserts; ``seq_len``
    may be a symbolic size, named and never formatted."""
    ok = ((lengths >= 0) & (lengths <= segments)).all()
    into.add(ok, f"nn_data.{op}: each sequence must fit its padded segment")
    if seq_len is not None:
        row_length_device(op, lengths, seq_len, into=into)


def target_ids(ids: torch.Tensor, bounds: torch.Tensor, lengths: torch.Tensor, total, vocab: int) -> torch.Tensor:
    """``[T]`` bool: the packed positions whose token is some position's target (a valid token) and lies
    outside ``[0, vocab)``; ``bounds [B'+1]`` and ``lengths [B']`` as :func:`~nn_data.layout.index.packed_segments`
    gives them. Device arithmetic, no read: the caller folds ``.any()`` into its one read
    (:func:`target_ids_host`) or asserts it on the device (:func:`target_ids_device`)."""
    seg = segment_ids(bounds, total)  # [T]
    is_target = torch.arange(total, device=ids.device) - bounds[seg] < lengths[seg]  # [T]: a valid token
    return is_target & ((ids < 0) | (ids >= vocab))


def target_ids_host(bad: torch.Tensor, ids: torch.Tensor, vocab: int) -> None:
    """Raise for the first bad target id (error path: reads the device again)."""
    i = _checks.first_index(bad)
    value = int(ids[i])  # sync: error path
    raise PackingError(f"packed token id {value} at position {i} is outside the vocabulary [0, {vocab}) of the logits")


@_folded
def target_ids_device(op: str, bad: torch.Tensor, vocab: int, *, into: _checks.DeviceChecks) -> None:
    into.add(~bad.any(), f"nn_data.{op}: token ids must be in [0, vocab={vocab})")


@_folded
def prefix_lengths_device(op: str, lengths: torch.Tensor, prefixes: torch.Tensor, leader: torch.Tensor,
                          mismatch: Optional[torch.Tensor], real: torch.Tensor, *,
                          into: _checks.DeviceChecks) -> None:
    """:func:`prefix_lengths_host` as device asserts (``real [B]`` bool: the rows before ``num_rows``)."""
    if lengths.shape[0] == 0:
        return
    into.add(((prefixes >= 0) & (prefixes <= lengths)).all(),
                          f"nn_data.{op}: every prefix_lengths value must be in [0, seq_lengths[b]]")
    into.add(((prefixes == prefixes[leader]) | ~real).all(),
                          f"nn_data.{op}: the rollouts of one group (equal group_ids) must have equal prefix_lengths")
    if mismatch is not None:
        into.add(~(mismatch & real).any(), f"nn_data.{op}: the rollouts of one group (equal group_ids) "
                              "must share their prompt tokens input_ids[b, :prefix_lengths[b]]")


@_folded
def row_length_device(op: str, lengths: torch.Tensor, seq_len, *, into: _checks.DeviceChecks) -> None:
    """:func:`row_length_host` as a device assert (``seq_len`` named, never formatted)."""
    into.add((lengths <= seq_len).all(),
                          f"nn_data.{op}: seq_lengths must be in [0, seq_len] (the row length S of the output)")


def tree_host(lengths: list, parent: list, branch_at: list, mismatch: Optional[list], num_rows: Optional[int],
              used: int, capacity: int) -> None:
    """A rollout tree (:mod:`nn_data.layout.tree_nodes`), on the ints of its one read: each rollout's
    ``parent`` an earlier rollout or -1 (so no cycle), a root's ``branch_at`` 0, a child's in
    ``(branch_at[parent], min(L[parent], L[b])]``, its shared tokens equal to its parent's (``mismatch``),
    padding rows (at or past ``num_rows``) roots; the tree fits ``node_capacity`` slots."""
    real = len(lengths) if num_rows is None else num_rows
    for i, (p, a) in enumerate(zip(parent, branch_at)):  # host ints: the error path reads nothing more
        if not -1 <= p < (i if i < real else 0):
            valid = f"an earlier rollout, in [0, {i}), or -1 for none" if i < real else "-1 (a padding row)"
            raise PackingError(f"parent[{i}] = {p} is invalid; rollout {i}'s parent must be {valid} (a parent comes "
                               "before its children, so the tree has no cycle)")
        if p == -1 and a != 0:
            raise PackingError(f"branch_at[{i}] = {a} but parent[{i}] = -1: a rollout without a parent shares no "
                               "token; give it branch_at 0")
        if p >= 0 and not branch_at[p] < a <= min(lengths[p], lengths[i]):
            raise PackingError(
                f"branch_at[{i}] = {a} is outside (branch_at[{p}] = {branch_at[p]}, min(seq_lengths[{p}], "
                f"seq_lengths[{i}]) = {min(lengths[p], lengths[i])}]: rollout {i} shares at most the tokens it and its "
                f"parent {p} both have, and more than {p} shares with its own parent (else name that ancestor)")
        if mismatch is not None and mismatch[i]:
            raise PackingError(f"input_ids[{i}, :{a}] differs from input_ids[{p}, :{a}]: rollout {i} must share its "
                               f"first branch_at[{i}] = {a} tokens with its parent {p} (parent[{i}])")
    if used > capacity:
        raise PackingError(f"node_capacity={capacity} is too small for this tree: it needs {used} node slots "
                           "(each rollout takes 1 + max(its split points, 1)); at most 3B - 2 are ever needed")


@_folded
def tree_device(op: str, lengths: torch.Tensor, parent: torch.Tensor, branch_at: torch.Tensor,
                mismatch: Optional[torch.Tensor], real: torch.Tensor, used: torch.Tensor, capacity: int, *,
                into: _checks.DeviceChecks) -> None:
    """:func:`tree_host` as device asserts (the rollout is not named: that would read the device)."""
    rows = lengths.shape[0]
    if rows == 0:
        return
    index = torch.arange(rows, device=lengths.device)
    up = parent.clamp(0, rows - 1)  # [B] in range for the reads below; the assert names a parent outside
    into.add(((parent >= -1) & (parent < index) & (real | (parent == -1))).all(),
                          f"nn_data.{op}: every parent must be an earlier rollout or -1 (padding rows: -1)")
    root_ok = (parent >= 0) | (branch_at == 0)
    child_ok = (parent < 0) | ((branch_at > branch_at[up]) & (branch_at <= torch.minimum(lengths[up], lengths)))
    into.add((root_ok & child_ok).all(), f"nn_data.{op}: every branch_at must be 0 for a root, else in "
                          "(branch_at[parent], min(seq_lengths[parent], seq_lengths[b])]")
    if mismatch is not None:
        into.add(~mismatch.any(), f"nn_data.{op}: every rollout must share its first branch_at tokens "
                              "of input_ids with its parent")
    into.add(used <= capacity, f"nn_data.{op}: node_capacity={capacity} is too small for this tree")
