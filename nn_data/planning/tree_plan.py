"""The step plan over rollout trees: each tree in one microbatch where it fits, every shared node charged once
per microbatch it lands in. The one planner of both spellings: :func:`plan_step_rollout_tree` and the GRPO
groups' :func:`~nn_data.planning.shared_prefix_plan.plan_step_shared_prefix` (the depth-1 tree) call
:func:`plan_trees`.

Vocabulary
    n   rollouts of the step; ``L[b]`` their lengths; ``parent[b]`` (an earlier rollout, or -1) and
        ``branch_at[b]`` (the tokens ``b`` shares with it): the tree (``nn_data.layout.tree_layout``)
    m   ``parallelism.pad_multiple``; T ``pad_full_seq_to``; h ``hidden_size``
    item    what the planner places whole: a tree, or a part of a tree too large for one microbatch

A microbatch packs the tree of its rollouts (:func:`subtree`) as ``tree_layout`` lays it out, so a set of
rollouts costs

    need = sum over its nodes of round_up(node, m)
    work = sum over its nodes starting at position d, n tokens long, of (d + n)^2 - d^2 + 6hn

A tree whose need is above T is split by first-fit-decreasing of its rollouts' own tokens (:func:`tree_items`);
a part's cost grows by what each rollout adds to it, never by re-packing the part. The items are placed by
:func:`~nn_data.planning.step.place`, so :func:`~nn_data.planning.plan_step`'s guarantees hold
(docs/planning.md, "Rollout trees").

Example: lengths ``[10, 12, 9]``, parent ``[-1, 0, 1]``, branch_at ``[0, 6, 8]``, m 1: nodes ``[0,6)
[6,10)`` of rollout 0, ``[6,8) [8,12)`` of 1, ``[8,9)`` of 2: need ``6 + 4 + 2 + 4 + 1 = 17`` (31 end to
end); with T 16 the tree is split (own tokens 10, 6, 1): ``[0, 1]`` (``6 + 4 + 6 = 16``) and ``[2]`` (9,
re-rooted)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from nn_data.errors import PackingError
from nn_data.layout import round_up
from nn_data.planning.alignment import Parallelism
from nn_data.planning.step import StepPlan, check_args, first_over, host_ints, host_lengths, imbalance_bound, place

#: ``shared_tokens``' diagonal: a rollout shares every token with itself (above any length).
EVERY = np.iinfo(np.int64).max


def subtree(parent, branch_at, rows) -> tuple[np.ndarray, np.ndarray]:
    """``(parent, branch_at)`` of the rollouts ``rows`` (ascending) alone, indices into ``rows``: each one's parent the
    earlier rollout of ``rows`` it shares the most tokens with by the tree (the smallest index among equals, so
    that every branch point exceeds its parent's), with that count, or -1 and 0.

    Example: parent ``[-1, 0, 1, 0]``, branch_at ``[0, 6, 8, 4]``, rows ``[0, 2]`` -> ``[-1, 0]``, ``[0, 6]``
    (rollout 2 shares 6 tokens of rollout 0 through rollout 1); rows ``[2, 3]`` -> ``[-1, 0]``, ``[0, 4]``
    (siblings through their absent parent); a GRPO group without its first rollout: its next one leads."""
    rows = [int(r) for r in rows]
    root: dict = {}
    for b in _closure(parent, branch_at, rows):  # ascending: a parent's root is known before its child's
        root[b] = root[int(parent[b])] if int(parent[b]) >= 0 else b
    trees: dict = {}  # root -> (the positions in rows of its rollouts, its closure)
    for i, r in enumerate(rows):
        trees.setdefault(root[r], ([], []))[0].append(i)
    for b in root:
        if root[b] in trees:
            trees[root[b]][1].append(b)
    out_parent, out_at = np.full(len(rows), -1, dtype=np.int64), np.zeros(len(rows), dtype=np.int64)
    for places, members in trees.values():  # one table per tree: rollouts of two trees share nothing
        at = {b: i for i, b in enumerate(members)}
        idx = np.asarray([at[rows[i]] for i in places], dtype=np.int64)
        sub_parent, sub_at = _parents(shared_tokens(parent, branch_at, members)[np.ix_(idx, idx)])
        places = np.asarray(places, dtype=np.int64)
        out_parent[places] = np.where(sub_parent >= 0, places[sub_parent], -1)
        out_at[places] = sub_at
    return out_parent, out_at


def _parents(shared: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(parent, branch_at)`` from ``shared [k, k]`` (tokens each pair shares, rows in order): each row's first
    earlier row of the most shared tokens, if it shares any. Example: ``[[9,6,4],[6,9,4],[4,4,9]]`` ->
    ``[-1, 0, 0]``, ``[0, 6, 4]``."""
    k = shared.shape[0]
    earlier = np.where(np.tri(k, k, -1, dtype=bool), shared, -1)  # [k, k] only the rows before each
    most = earlier.max(axis=1, initial=-1)  # [k]
    best = earlier.argmax(axis=1) if k else np.zeros(0, dtype=np.int64)  # [k] the first of the most
    return np.where(most > 0, best, -1).astype(np.int64), np.maximum(most, 0).astype(np.int64)


def _closure(parent, branch_at, rows) -> list:
    """``rows`` and every ancestor of theirs, ascending (after refusing a parent that is not earlier).
    Example: parent ``[-1, 0, 1, 0]``, rows ``[2, 3]`` -> ``[0, 1, 2, 3]``."""
    seen, todo = set(), list(rows)
    while todo:  # host ints: each rollout once
        b = todo.pop()
        if b in seen:
            continue
        seen.add(b)
        p = int(parent[b])
        check_parent(b, p)  # each step goes to an earlier rollout: the walk ends
        if p >= 0:
            todo.append(p)
    return sorted(seen)


def shared_tokens(parent, branch_at, members: list) -> np.ndarray:
    """``[k, k]`` the tokens each pair of ``members`` (ascending, every parent a member or -1) shares by the tree; a
    member with itself :data:`EVERY`. A child shares with every other earlier rollout what its parent does, at most
    its own ``branch_at``: one row per member, O(k^2).

    Example: parent ``[-1, 0, 1, 0]``, branch_at ``[0, 6, 8, 4]``, members ``[0, 1, 2, 3]`` -> rollout 2
    shares ``[6, 8, EVERY, 4]``."""
    k = len(members)
    at = {b: i for i, b in enumerate(members)}
    shared = np.zeros((k, k), dtype=np.int64)  # [k, k] roots share nothing
    for i, b in enumerate(members):  # host ints: one numpy row per member
        p = int(parent[b])
        if p >= 0:
            row = np.minimum(shared[at[p], :i], int(branch_at[b]))  # [i] with its parent: min(EVERY, branch_at)
            shared[i, :i], shared[:i, i] = row, row
        shared[i, i] = EVERY
    return shared


def check_parent(b: int, p: int) -> None:
    """:class:`PackingError` unless rollout ``b``'s parent ``p`` is an earlier rollout or -1."""
    if not -1 <= p < b:
        raise PackingError(f"parent[{b}] = {p} is invalid; rollout {b}'s parent must be an earlier rollout, in "
                           f"[0, {b}), or -1 for none")


def _cost(lengths: np.ndarray, parent: np.ndarray, branch_at: np.ndarray, extra, multiple: int,
          hidden: int) -> tuple[int, int, float]:
    """``(packed tokens, real tokens, work)`` of the tree ``(parent, branch_at)`` of rollouts of ``lengths [k]`` as
    ``tree_layout`` packs it; ``extra [k]`` or None: a split of each rollout's own tokens besides its children's
    (the GRPO spelling's prompt slot). The cut points are keyed ``owner * width + position``, sorted, each gap
    between two of one owner a node. Example: L ``[10, 12, 9]``, parent ``[-1, 0, 1]``, branch_at ``[0, 6, 8]``, m
    1 -> points ``0 6 10 | 6 8 12 | 8 9`` -> nodes ``6 4 2 4 1``: 17 tokens."""
    k = lengths.size
    mine = np.arange(k)
    owner = np.concatenate([parent, mine, mine] + ([mine] if extra is not None else []))  # [3k or 4k]
    point = np.concatenate([branch_at, branch_at, lengths] + ([extra] if extra is not None else []))
    keep = owner >= 0
    owner, point = owner[keep], point[keep]
    keep = (point >= branch_at[owner]) & (point <= lengths[owner])  # a cut inside its owner's own tokens
    width = int(lengths.max(initial=0)) + 1
    key = np.unique(owner[keep] * width + point[keep])  # [points] sorted by owner, then position
    same = key[1:] // width == key[:-1] // width  # [points - 1] a gap inside one owner: a node
    tokens = int(round_up(np.diff(key)[same], multiple).sum())
    own = lengths - branch_at  # [k]
    work = float((lengths * lengths - branch_at * branch_at).sum()) + 6.0 * hidden * float(own.sum())
    return tokens, int(own.sum()), work


class _Forest:
    """The step's trees for the planner: each rollout's tree (its root), each tree's :func:`shared_tokens` table
    (built once, when first asked) and the costs of sets of one tree's rollouts (each computed once)."""

    def __init__(self, lengths, parent, branch_at, extra, *, multiple: int, hidden: int):
        self.lengths, self.parent, self.branch_at, self.extra = lengths, parent, branch_at, extra
        self.multiple, self.hidden = multiple, hidden
        self.root = np.arange(lengths.size)  # [n]
        for b in np.flatnonzero(parent >= 0).tolist():  # sync: none, numpy host data; parents come first
            self.root[b] = self.root[parent[b]]
        order = np.argsort(self.root, kind="stable")  # [n] tree by tree, each ascending
        cuts = np.flatnonzero(np.diff(self.root[order])) + 1  # e.g. root [0 0 2 0] -> order [0 1 3 2] -> [3]
        # sync: none, numpy host data (each tree's rollouts as Python ints)
        self.trees = {int(rows[0]): rows.tolist() for rows in np.split(order, cuts)} if lengths.size else {}
        self.index = np.zeros(lengths.size, dtype=np.int64)  # [n] each rollout's place in its tree
        for rows in self.trees.values():
            self.index[rows] = np.arange(len(rows))
        self.tables: dict = {}
        self.known: dict = {}  # (rollouts of one tree, ascending) -> (tokens, real, work)

    def table(self, root: int) -> np.ndarray:
        """The tree of ``root``'s :func:`shared_tokens` ``[k, k]``."""
        if root not in self.tables:
            self.tables[root] = shared_tokens(self.parent, self.branch_at, self.trees[root])
        return self.tables[root]

    def cost(self, rows: list) -> tuple:
        """The cost (:func:`_cost`) of ``rows`` (ascending, all of one tree) on :func:`subtree`'s tree of them."""
        key = tuple(rows)
        if key not in self.known:
            idx = self.index[rows]
            sub_parent, sub_at = _parents(self.table(int(self.root[rows[0]]))[np.ix_(idx, idx)])
            extra = None if self.extra is None else self.extra[rows]
            self.known[key] = _cost(self.lengths[rows], sub_parent, sub_at, extra, self.multiple, self.hidden)
        return self.known[key]

    def merged(self, items: list) -> tuple:
        """The cost of a microbatch of ``items`` (each of one tree): per tree the cost of its rollouts there."""
        trees: dict = {}
        for rows in items:
            trees.setdefault(int(self.root[rows[0]]), []).append(rows)
        costs = [self.cost(parts[0] if len(parts) == 1 else sorted(b for rows in parts for b in rows))
                 for parts in trees.values()]
        return sum(c[0] for c in costs), sum(c[1] for c in costs), sum((c[2] for c in costs), 0.0)

    def first_fit(self, rows: list, own: np.ndarray, total: int) -> list:
        """A tree too large for ``total`` split by first-fit-decreasing of its rollouts' ``own`` tokens, each part's
        cost grown one rollout at a time (:meth:`_grown`: what the rollout adds to a part's tree)."""
        table = self.table(int(self.root[rows[0]]))  # [k, k]
        most = np.where(np.eye(len(rows), dtype=bool), 0, table).max(axis=1)  # [k] the most b shares with another
        floor = round_up(self.lengths[rows] - most, self.multiple).tolist()  # sync: none; b adds at least this
        shared = table.tolist()  # sync: none, numpy host data
        parts: list = []  # [rollouts, places in the tree, (tokens, real, work)]
        for b in sorted(rows, key=lambda b: -int(own[b])):  # stable: ties in index order
            i = int(self.index[b])
            for part in parts:
                if part[2][0] + floor[i] > total:
                    continue
                grown = self._grown(shared, part, b, i, limit=total)
                if grown[0] <= total:
                    part[0].append(b), part[1].append(i)
                    part[2] = grown
                    break
            else:
                parts.append([[b], [i], self._grown(shared, [[], [], (0, 0, 0.0)], b, i)])
        for members, _, cost in parts:
            self.known[tuple(sorted(members))] = cost
        return [sorted(part[0]) for part in parts]

    def _grown(self, shared: list, part: list, b: int, i: int, limit: Optional[int] = None) -> tuple:
        """``(tokens, real, work)`` of ``part`` with rollout ``b`` (place ``i``) added (only the tokens, a lower bound,
        past ``limit``): ``b``'s own ``[d, L)`` is new, ``d`` the most it shares with a member ``x``, and ``x``'s node
        holding depth ``d`` is cut there unless a node ends there. Example (m 1): a part of L ``[10]``; adding L 12
        sharing 6: ``[0,10)`` becomes ``[0,6) [6,10)``, plus ``[6,12)``: 10 + 6 tokens."""
        m, lengths, extra = self.multiple, self.lengths, self.extra
        rollouts, places, (tokens, real, work) = part
        d, x, at, mine = 0, -1, -1, shared[i]
        for member, slot in zip(rollouts, places):
            if mine[slot] > d:
                d, x, at = mine[slot], member, slot
        n = int(lengths[b])
        ends = sorted({d, n} | ({int(extra[b])} if extra is not None and d < int(extra[b]) < n else set()))
        tokens += sum(round_up(e - s, m) for s, e in zip(ends, ends[1:]))
        if limit is not None and tokens > limit:
            return tokens, -1, -1.0  # a cut only adds tokens: it does not fit
        if x >= 0:
            path = shared[at]
            cuts = {0, int(lengths[x])} | {path[place] for place in places if place != at}
            if d not in cuts and extra is not None:
                cuts |= {int(extra[r]) for r, place in zip(rollouts, places) if int(extra[r]) <= path[place]}
            if d not in cuts:
                lo, hi = max(c for c in cuts if c < d), min(c for c in cuts if c > d)
                tokens += round_up(d - lo, m) + round_up(hi - d, m) - round_up(hi - lo, m)
        return tokens, real + n - d, work + float(n * n - d * d) + 6.0 * self.hidden * (n - d)


def tree_items(forest: _Forest, own: np.ndarray, *, total: int, ranks: int) -> list:
    """What the planner places whole, each a list of rollout indices (ascending): a tree whose cost fits ``total``; a
    larger one split by first-fit-decreasing of its rollouts' ``own`` padded tokens into parts
    (:meth:`_Forest.first_fit`); fewer items than ``ranks``: :func:`split_for_idle_ranks`.

    Example (a GRPO group, prompt 8, responses ``[2, 4, 1]``, m 1, T 12): parts ``[1]`` (12) and ``[0, 2]``
    (11), the prompt in each."""
    items = []
    real = np.bincount(forest.root, weights=forest.lengths - forest.branch_at, minlength=forest.root.size)  # [n]
    for root, rows in forest.trees.items():  # a tree's real tokens (its own tokens, each once) bound its need
        fits = real[root] <= total and forest.cost(rows)[0] <= total
        items += [rows] if fits else forest.first_fit(rows, own, total)
    return sorted(split_for_idle_ranks(items, own, ranks=ranks), key=lambda rows: rows[0])


def split_for_idle_ranks(members: list, own: np.ndarray, *, ranks: int) -> list:
    """Fewer items than ranks would leave ranks idle: the item with the most ``own`` tokens (of those with two
    rollouts or more) is halved, what its halves share packed in both, until every rank can have one. The
    halves: its rollouts by own tokens, longest first, each to the half with fewer tokens (then rollouts).
    Example: one GRPO group, responses ``[5, 1, 4, 2]``, 2 ranks -> ``[0, 1]`` (6) and ``[2, 3]`` (6)."""
    members = [list(rows) for rows in members]
    while len(members) < ranks:
        size = [int(own[rows].sum()) if len(rows) > 1 else -1 for rows in members]
        widest = max(range(len(members)), key=size.__getitem__, default=-1)
        if widest < 0 or size[widest] < 0:
            break
        halves, load = ([], []), [0, 0]
        for b in sorted(members[widest], key=lambda b: (-int(own[b]), b)):
            side = 0 if (load[0], len(halves[0])) <= (load[1], len(halves[1])) else 1  # fewer tokens, then rollouts
            halves[side].append(b)
            load[side] += int(own[b])
        members[widest:widest + 1] = [sorted(halves[0]), sorted(halves[1])]
    return members


def plan_trees(lengths: np.ndarray, parent: np.ndarray, branch_at: np.ndarray, parallelism: Parallelism, *,
               total: int, balance: str, hidden_size: int, microbatches_per_rank: Optional[int],
               extra: Optional[np.ndarray] = None, order=None) -> StepPlan:
    """The planner of both spellings, on a checked tree (host arrays): the items (:func:`tree_items`) placed by
    :func:`~nn_data.planning.step.place`, each microbatch's rollouts ordered by ``order(items)`` (default
    ascending), its costs by :func:`_cost` with ``extra`` (the GRPO spelling's prompt lengths)."""
    m = parallelism.pad_multiple
    forest = _Forest(lengths, parent, branch_at, extra, multiple=m, hidden=hidden_size)
    start = branch_at if extra is None else np.maximum(branch_at, extra)
    own = round_up(lengths - start, m)  # [n] each rollout's own tokens, padded (a GRPO rollout's response)
    items = tree_items(forest, own, total=total, ranks=parallelism.dp)
    costs = [forest.merged([rows]) for rows in items]
    work = np.asarray([c[2] for c in costs], dtype=np.float64)
    placed, steps = place(np.asarray([c[0] for c in costs], dtype=np.int64), work, total=total, dp=parallelism.dp,
                          balance=balance, given=microbatches_per_rank)
    order = order or (lambda parts: sorted(b for rows in parts for b in rows))
    ranks = [[order([items[j] for j in mb]) for mb in rank] for rank in placed]
    mb_costs = [[forest.merged([items[j] for j in mb]) for mb in rank] for rank in placed]
    return StepPlan(pad_full_seq_to=total, ranks=ranks, microbatch_tokens=[[c[0] for c in r] for r in mb_costs],
                    microbatch_work=[[c[2] for c in r] for r in mb_costs],
                    real_tokens=sum(c[1] for r in mb_costs for c in r), balance=balance, steps=steps,
                    imbalance_bound=imbalance_bound(work, parallelism.dp))


def check_tree(lengths: np.ndarray, parent: np.ndarray, branch_at: np.ndarray) -> None:
    """The tree's fields (one int per rollout; a parent earlier, a branch point as ``tree_layout`` takes)."""
    n = lengths.size
    for name, arr in (("parent", parent), ("branch_at", branch_at)):
        if arr.size != n:
            raise PackingError(f"{name} has {arr.size} entries for {n} rollouts (lengths); expected one per rollout")
    for b in range(n):
        p, a = int(parent[b]), int(branch_at[b])
        check_parent(b, p)
        lo, hi = (int(branch_at[p]), min(int(lengths[p]), int(lengths[b]))) if p >= 0 else (-1, 0)
        if (p < 0 and a != 0) or (p >= 0 and not lo < a <= hi):
            raise PackingError(f"branch_at[{b}] = {a} is invalid for parent[{b}] = {p}: a root shares nothing (0), a "
                               f"child more than its parent shares and at most both have (here ({lo}, {hi}])")


def plan_step_rollout_tree(lengths, parallelism: Parallelism, *, parent, branch_at, pad_full_seq_to: int,
                           microbatches_per_rank: Optional[int] = None, balance: str = "work",
                           hidden_size: int = 4096) -> StepPlan:
    """Plan one step's rollout trees as :func:`~nn_data.planning.plan_step` does, each tree kept together where
    it fits and every node charged once per microbatch it lands in (module docstring).

    Args:
        parent, branch_at: ``[n]`` each, the tree (``nn_data.layout.tree_layout``'s fields).

    The :class:`StepPlan`'s ``ranks[r][j]`` lists rollout indices ascending (pack each microbatch with
    :func:`subtree`'s tree of its rollouts); ``microbatch_tokens``, ``microbatch_work`` and ``real_tokens`` are
    the trees'. Raises :class:`PackingError` for everything :func:`plan_step` or ``tree_layout`` refuses, and a
    rollout longer (padded) than ``pad_full_seq_to``."""
    check_args(parallelism, balance, hidden_size, microbatches_per_rank)
    total = parallelism.check_fixed_total(pad_full_seq_to)
    arr = host_lengths(lengths)
    up, at = host_ints(parent, "parent").astype(np.int64), host_ints(branch_at, "branch_at").astype(np.int64)
    check_tree(arr, up, at)
    m = parallelism.pad_multiple
    i = first_over(round_up(arr, m), total)
    if i is not None:
        raise PackingError(f"lengths[{i}] = {int(arr[i])} takes {int(round_up(arr[i], m))} tokens alone (padded to a "
                           f"multiple of {m}), more than pad_full_seq_to={total}; raise pad_full_seq_to")
    return plan_trees(arr, up, at, parallelism, total=total, balance=balance, hidden_size=hidden_size,
                      microbatches_per_rank=microbatches_per_rank)
