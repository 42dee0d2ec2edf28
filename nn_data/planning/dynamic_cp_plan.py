"""Dynamic context parallelism: one step's sequences planned over the whole DP x CP pool of ranks.

Vocabulary
    R       ranks of the pool: ``parallelism.dp * parallelism.cp`` (megatron-core's data-and-context-parallel group)
    tpr     ``tokens_per_rank``: every rank's microbatch holds exactly this many tokens, every round
    c       a sequence's CP size: the ranks it is sharded over (zigzag), a power of two
    round   one microbatch on every rank: a partition of ``range(R)`` into **blocks** of ``c`` ranks
            starting at a multiple of ``c`` (megatron-core's hybrid groups: ``ranks[s : s + c]``)
    K       rounds, the same on every rank

:func:`plan_step_dynamic_cp` puts every sequence in exactly one block of one round, padded by
:class:`~nn_data.planning.Parallelism`'s rule for ``c``, each block packed to exactly ``c * tpr`` tokens: one
static shape per rank for the whole run (docs/dynamic-cp.md, "The plan"). A block's modelled time is its
sequences' cost plus its CP collectives (:mod:`nn_data.planning.cp_cost`); ``critical_path_over_ideal``, which
the planner minimises, is the step without a barrier between rounds over the ideal. The algorithm:
:mod:`nn_data.planning.cp_rounds`. Host code; a plan is plain data and pickles.

Example: 8 ranks, ``tpr = 4096``, lengths ``[30000, 9000, 7000, 3000, 2500, 1200, 800, 500]``
(2 rounds is the fewest their tokens allow): the 30000-token sequence needs all 8 ranks' tokens
(``c = 8``) and runs alone in round 0; round 1 is two blocks of 4 ranks, ``[9000, 2500]`` and
``[7000, 3000, 1200, 800, 500]`` (each sequence needs ``c >= 2``, or rides along), 1.022 x the ideal."""

from __future__ import annotations

import bisect
import dataclasses
import math

import numpy as np

from nn_data.errors import PackingError
from nn_data.layout import round_up
from nn_data.planning import cp_rounds
from nn_data.planning.alignment import Parallelism
from nn_data.planning.cp_cost import cost_model
from nn_data.planning.step import host_lengths, plan_step


#: Packed rounds more than this factor (and one round) above the token lower bound are packed again with
#: long sequences sharing larger blocks (nn_data.planning.cp_rounds.packed_rounds' ``promote``).
PROMOTE_ABOVE = 1.01


@dataclasses.dataclass(frozen=True)
class CPBlock:
    """``size`` ranks ``start .. start + size - 1`` (``start % size == 0``) running ``sequences`` (indices into the
    step's lengths, in packing order) sharded over all of them: ``tokens`` padded tokens (``<= size *
    tokens_per_rank``), ``cost`` its modelled time; an empty block is one rank running a microbatch of padding."""

    start: int
    size: int
    sequences: tuple
    tokens: int
    cost: float

    @property
    def ranks(self) -> range:
        return range(self.start, self.start + self.size)


@dataclasses.dataclass(frozen=True)
class DynamicCPPlan:
    """:func:`plan_step_dynamic_cp`'s result: ``rounds[k]`` round ``k``'s blocks by ``start`` (a partition of
    ``range(ranks)``), ``tokens_per_rank``, ``ranks`` (R), ``lengths`` (Python ints), ``sequence_multiples[c]`` (the
    multiple a sequence of CP size ``c`` pads to), ``ideal_cost``, ``step_cost`` and ``token_lower_bound`` (the
    fewest rounds the padded tokens allow)."""

    rounds: list
    tokens_per_rank: int
    ranks: int
    lengths: tuple
    sequence_multiples: dict
    ideal_cost: float
    step_cost: float
    token_lower_bound: int

    @property
    def rounds_per_rank(self) -> int:
        return len(self.rounds)

    @property
    def step_over_ideal(self) -> float:
        """The modelled step (the sum over rounds of each round's slowest block) over the ideal."""
        return self.step_cost / self.ideal_cost if self.ideal_cost > 0 else 1.0

    @property
    def critical_path_cost(self) -> float:
        """The modelled step without a barrier between rounds (what the data path runs: a block starts
        when the last of its ranks has finished its previous round): the latest finish over the ranks.
        At most ``step_cost``; equal when every round's slowest block spans the pool."""
        finish = [0.0] * self.ranks
        for blocks in self.rounds:
            for b in blocks:
                end = max(finish[b.start:b.start + b.size]) + b.cost
                finish[b.start:b.start + b.size] = [end] * b.size
        return max(finish, default=0.0)

    @property
    def critical_path_over_ideal(self) -> float:
        return self.critical_path_cost / self.ideal_cost if self.ideal_cost > 0 else 1.0

    @property
    def padding_fraction(self) -> float:
        """``1 - real tokens / (R x K x tokens_per_rank)``: the share of the step's positions that pad."""
        slots = self.ranks * len(self.rounds) * self.tokens_per_rank
        return 1.0 - sum(self.lengths) / slots if slots else 0.0

    def padded_length(self, i: int, c: int) -> int:
        """Sequence ``i``'s tokens in a block of ``c`` ranks: its length rounded up to ``sequence_multiples[c]``."""
        return round_up(self.lengths[i], self.sequence_multiples[c])

    def block_of(self, rank: int, k: int) -> CPBlock:
        """The block rank ``rank`` (its rank in the pool) runs in round ``k``."""
        blocks = self.rounds[k]
        return blocks[bisect.bisect_right([b.start for b in blocks], rank) - 1]

    def blocks_of(self, rank: int) -> list:
        """Rank ``rank``'s block in every round: its K microbatches."""
        return [self.block_of(rank, k) for k in range(len(self.rounds))]

    def sequences_of(self, rank: int) -> list:
        """The sequences rank ``rank`` needs (its blocks'), ascending: what a driver sends it."""
        return sorted({i for b in self.blocks_of(rank) for i in b.sequences})

    @property
    def cp_sizes(self) -> list:
        """The CP size of each sequence (the size of its block)."""
        out = [0] * len(self.lengths)
        for blocks in self.rounds:
            for b in blocks:
                for i in b.sequences:
                    out[i] = b.size
        return out

    @property
    def group_sizes(self) -> list:
        """The block sizes above 1 the plan uses, ascending: the CP groups each rank needs."""
        return sorted({b.size for blocks in self.rounds for b in blocks if b.size > 1})

    @property
    def max_sequences(self) -> int:
        """The most sequences any block holds (a row capacity that fits every round)."""
        return max((len(b.sequences) for blocks in self.rounds for b in blocks), default=0)

    @property
    def cp_collective_rounds(self) -> int:
        """The most rounds any rank runs in a block of more than one rank (each such round runs the
        CP collectives of every layer); the static-CP equivalent is every microbatch."""
        return max((sum(self.block_of(r, k).size > 1 for k in range(len(self.rounds))) for r in range(self.ranks)),
                   default=0)


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def cp_sizes_allowed(ranks: int, min_cp) -> list:
    """The CP sizes a plan over ``ranks`` may use: the powers of two from ``min_cp`` to ``ranks``
    (megatron-core's hybrid groups: 2 .. R/2 and the whole pool, and 1: no group); for a pool that is
    not a power of two only ``min_cp = ranks``. Raises :class:`PackingError` naming ``min_cp``."""
    if isinstance(min_cp, bool) or not isinstance(min_cp, int) or not 1 <= min_cp <= ranks:
        raise PackingError(f"min_cp={min_cp!r} is invalid; expected an int in [1, {ranks}] (the pool's ranks)")
    if not _power_of_two(ranks):
        if min_cp != ranks:
            raise PackingError(
                f"the pool has {ranks} ranks (dp * cp), not a power of two: CP groups of 2, 4, ... ranks cannot tile "
                f"it (megatron-core creates them only for powers of two); use a power-of-two pool, or min_cp={ranks} "
                f"(every sequence over all {ranks} ranks: static CP)")
        return [ranks]
    if not _power_of_two(min_cp):
        raise PackingError(f"min_cp={min_cp} is invalid; expected a power of two (the CP group sizes are)")
    return [1 << e for e in range(min_cp.bit_length() - 1, ranks.bit_length())]


def parallelism_for(parallelism: Parallelism, c: int) -> Parallelism:
    """``parallelism`` with CP size ``c`` over the same pool (``dp = R / c``): Parallelism's rule for a
    sequence sharded over ``c`` ranks. The run's ``make_sequence_length_divisible_by``, if any, is
    kept when it is a multiple of that rule, else raised to their least common multiple."""
    pool = parallelism.dp * parallelism.cp
    bare = dataclasses.replace(parallelism, dp=max(1, pool // c), cp=c, make_sequence_length_divisible_by=None)
    m = parallelism.make_sequence_length_divisible_by
    return bare if m is None else dataclasses.replace(bare, make_sequence_length_divisible_by=math.lcm(
        m, bare.sequence_multiple))


def check_tokens_per_rank(parallelism: Parallelism, sizes: list, tokens_per_rank) -> None:
    """``tokens_per_rank`` such that ``c * tokens_per_rank`` is a valid fixed packed length for every
    allowed ``c`` (a multiple of Parallelism's ``total_multiple`` for ``c``, within int32), else
    :class:`PackingError` naming ``tokens_per_rank`` and the multiple it must be."""
    tpr = tokens_per_rank
    if isinstance(tpr, bool) or not isinstance(tpr, int) or tpr < 1:
        raise PackingError(f"tokens_per_rank={tpr!r} is invalid; expected an int >= 1 (each rank's tokens per round)")
    unit = 1
    for c in sizes:
        total = parallelism_for(parallelism, c).total_multiple
        unit = math.lcm(unit, total // math.gcd(total, c))
    if tpr % unit:
        raise PackingError(
            f"tokens_per_rank={tpr} is not a multiple of {unit}, the alignment of one rank's share of a block for "
            f"every CP size {sizes} ({parallelism_for(parallelism, sizes[-1]).describe()} for c={sizes[-1]}); choose a "
            f"multiple of {unit}, e.g. {round_up(tpr, unit)}")
    for c in sizes:
        parallelism_for(parallelism, c).check_fixed_total(c * tpr, f"tokens_per_rank * c = {tpr} * {c}")


def _check_args(parallelism, hidden_size) -> None:
    if not isinstance(parallelism, Parallelism):
        raise PackingError(f"parallelism={parallelism!r} is invalid; expected a nn_data.planning.Parallelism")
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise PackingError(f"hidden_size={hidden_size!r} is invalid; expected an int >= 1 (the model's hidden size)")


def plan_step_dynamic_cp(lengths, parallelism: Parallelism, *, tokens_per_rank: int, min_cp: int = 1,
                         hidden_size: int = 4096, cost=None) -> DynamicCPPlan:
    """Plan one step's sequences over the ``parallelism.dp * parallelism.cp`` ranks of the pool in rounds of
    aligned power-of-two blocks, each rank ``tokens_per_rank`` tokens per round (module docstring).

    Args:
        min_cp: the smallest CP size a sequence may get (1: a sequence that fits one rank runs without CP).
        cost: the cost model (:mod:`nn_data.planning.cp_cost`; None: ``CPCost(hidden_size=hidden_size)``).

    Of its candidate plans (:mod:`nn_data.planning.cp_rounds`) it keeps the one with the shortest modelled
    critical path, each extra round counted at ``cost.padding(tokens_per_rank)``. Raises :class:`PackingError`
    naming the argument for a sequence longer than ``R * tokens_per_rank`` after padding, a pool that is not a
    power of two (unless ``min_cp = R``), ``tokens_per_rank`` not a multiple of the alignment, a bad ``min_cp``,
    ``parallelism``, ``hidden_size``, ``cost`` or lengths."""
    _check_args(parallelism, hidden_size)
    cost = cost_model(cost, hidden_size)
    ranks = parallelism.dp * parallelism.cp
    sizes = cp_sizes_allowed(ranks, min_cp)
    check_tokens_per_rank(parallelism, sizes, tokens_per_rank)
    arr = host_lengths(lengths)
    multiples = {c: parallelism_for(parallelism, c).pad_multiple for c in sizes}
    if arr.size == 0:
        return DynamicCPPlan(rounds=[], tokens_per_rank=tokens_per_rank, ranks=ranks, lengths=(),
                             sequence_multiples=multiples, ideal_cost=0.0, step_cost=0.0, token_lower_bound=0)
    costs, ideal = _costs(arr, sizes, multiples, tokens_per_rank, cost, ranks)
    lower = max(1, -(-int(sum(costs.need[j][i] for i, j in enumerate(costs.c_min))) // (ranks * tokens_per_rank)))
    common = dict(tokens_per_rank=tokens_per_rank, ranks=ranks, lengths=tuple(arr.tolist()),  # sync: none, numpy
                  sequence_multiples=multiples, ideal_cost=ideal, token_lower_bound=lower)
    padding = getattr(cost, "padding", None)
    per_round = float(padding(tokens_per_rank)) if callable(padding) else 0.0
    static = lambda: _static_rounds(costs, arr, parallelism, tokens_per_rank, hidden_size)  # noqa: E731
    best, best_score = None, float("inf")
    for found in _candidates(costs, ranks, lower, static):
        # the modelled critical path, each round counted at what a round of padding costs every rank
        score = _critical_path(found, ranks, costs.sizes) + per_round * len(found)
        if score < best_score:
            best, best_score = found, score
    return _plan_of(costs, best, ranks, common)


def _critical_path(found: list, ranks: int, sizes: list) -> float:
    """:attr:`DynamicCPPlan.critical_path_cost` of ``(time, blocks)`` rounds, each laid out as the plan lays it."""
    finish = [0.0] * ranks
    for _, blocks in found:
        block_sizes = [sizes[j] for j, _, _ in blocks]
        for start, b in cp_rounds.laid_out(block_sizes, ranks):
            if b < 0:
                continue
            size = block_sizes[b]
            end = max(finish[start:start + size]) + blocks[b][2]
            finish[start:start + size] = [end] * size
    return max(finish)


def _costs(arr: np.ndarray, sizes: list, multiples: dict, tpr: int, cost, ranks: int):
    """The tables of :class:`cp_rounds.Costs` and the ideal; refuses a sequence too long for the pool."""
    need = [round_up(arr, multiples[c]) for c in sizes]
    seq = [np.asarray(cost.sequence(arr, c), dtype=np.float64).reshape(arr.shape) for c in sizes]
    extra = [float(cost.block(c, tpr)) for c in sizes]
    fits = np.stack([need[j] <= c * tpr for j, c in enumerate(sizes)])  # [sizes, n]
    too_long = np.flatnonzero(~fits[-1])
    if too_long.size:
        i, c = int(too_long[0]), sizes[-1]
        raise PackingError(f"lengths[{i}] = {int(arr[i])} (padded to {int(need[-1][i])}, a multiple of {multiples[c]}) "
                           f"is longer than the pool holds in one round: {c} ranks x tokens_per_rank={tpr} = {c * tpr}"
                           f"; raise tokens_per_rank to at least {-(-int(need[-1][i]) // c)} (a multiple of the alignment)")
    c_min = np.argmax(fits, axis=0)  # [n]: the first size that holds each sequence
    # The ideal: each sequence's rank-time at its best size >= c_min, with its share of the block cost.
    rank_time = np.stack([c * seq[j] + need[j] * (extra[j] / tpr) for j, c in enumerate(sizes)])  # [sizes, n]
    rank_time = np.where(np.arange(len(sizes))[:, None] >= c_min[None, :], rank_time, np.inf)
    ideal = float(rank_time.min(axis=0).sum()) / ranks
    order = np.lexsort((np.arange(arr.size), -arr))  # longest first, ties by index
    rank_of = np.empty(arr.size, dtype=np.int64)
    rank_of[order] = np.arange(arr.size)
    as_lists = [c_min.tolist(), order.tolist(), rank_of.tolist()]  # sync: none, numpy arrays on the host
    return cp_rounds.Costs(sizes, [n.tolist() for n in need], [s.tolist() for s in seq], extra,  # sync: none, numpy
                           [c * tpr for c in sizes], *as_lists), ideal


def _candidates(costs, ranks: int, lower: int, static):
    """Each candidate plan's rounds as ``(time, blocks)`` lists, blocks ``(size index, sequences, load)``: packed
    rounds; packed with long sequences in larger blocks (one and two sizes up) when they need more rounds than the
    lower bound + 1 and :data:`PROMOTE_ABOVE` times it; for small steps, equal runs of tokens and static CP's plan."""
    for promote in range(len(costs.sizes)):
        packed = cp_rounds.packed_rounds(costs, ranks, promote)
        yield [cp_rounds.balanced_round(costs, blocks, ranks) for blocks in packed]
        if len(packed) <= max(lower + 1, lower * PROMOTE_ABOVE) or promote == 2:
            break
    if len(costs.order) <= cp_rounds.CHUNKED_UP_TO:
        for k in (lower, lower + 1):
            found = cp_rounds.chunked_rounds(costs, k)
            if found is not None:
                yield found
    if len(costs.order) <= cp_rounds.STATIC_UP_TO:
        yield [cp_rounds.with_loads(costs, found) for found in static()]


def _static_rounds(costs, arr: np.ndarray, parallelism: Parallelism, tokens_per_rank: int, hidden_size: int) -> list:
    """Static CP as rounds: every block the smallest size that holds every sequence, planned by
    :func:`~nn_data.planning.plan_step`; round ``k`` is every group's microbatch ``k``."""
    j = max(costs.c_min)
    c = costs.sizes[j]
    groups = parallelism.dp * parallelism.cp // c
    plan = plan_step(arr, dataclasses.replace(parallelism_for(parallelism, c), dp=groups, cp=c), pad_full_seq_to=c * tokens_per_rank,
                     hidden_size=hidden_size)
    out = []
    for k in range(plan.microbatches_per_rank):
        blocks = [(j, list(plan.ranks[g][k])) for g in range(groups) if plan.ranks[g][k]]
        out.append((max((cp_rounds.load(costs, jj, items) for jj, items in blocks), default=0.0), blocks))
    return out


def _plan_of(costs, found: list, ranks: int, common: dict) -> DynamicCPPlan:
    """The plan of ``(time, blocks)`` rounds: each laid out largest block first (aligned)."""
    rounds = []
    for _, blocks in found:
        laid = cp_rounds.laid_out([costs.sizes[j] for j, _, _ in blocks], ranks)
        rounds.append([_block(costs, blocks, start, b) for start, b in laid])
    return DynamicCPPlan(rounds=rounds, step_cost=float(sum(time for time, _ in found)), **common)


def _block(costs, blocks: list, start: int, b: int) -> CPBlock:
    if b < 0:
        return CPBlock(start=start, size=1, sequences=(), tokens=0, cost=0.0)
    j, items, load = blocks[b]
    need = costs.need[j]
    return CPBlock(start=start, size=costs.sizes[j], sequences=tuple(sorted(items)), tokens=sum(need[i] for i in items),
                   cost=float(load))
