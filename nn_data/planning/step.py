"""One training step's plan across data-parallel ranks: which sequences each rank packs into which microbatch.

Vocabulary
    n   sequences of the step (a global batch); ``L[i]`` their lengths
    D   data-parallel ranks (``parallelism.dp``); k microbatches per rank, the same on every rank
    T   ``pad_full_seq_to``: every microbatch's padded total is at most T, and is packed to T
    m   ``parallelism.pad_multiple``: each sequence takes ``round_up(L, m)`` tokens of a microbatch
    work[i] = L[i] * (L[i] + 6 * hidden_size): attention plus linear layers, in ``hidden_size`` multiply-adds

:func:`plan_step` puts every sequence in exactly one microbatch of one rank, every microbatch ``<= T``, ``k``
microbatches on every rank (docs/planning.md, "plan_step"). Host code on Python ints: O(n log n).

Example: lengths ``[300, 20, 200, 100, 40, 250]``, ``Parallelism(dp=2)``, T 512,
``balance="work"`` with ``hidden_size=16``: k = 1 (910 tokens fit 2 x 512); longest first, each
on the rank with less work: 300 -> r0, 250 -> r1, 200 -> r1, 100, 40, 20 -> r0, so rank 0 holds
``[0, 3, 4, 1]`` (460 tokens, work 146,160) and rank 1 ``[5, 2]`` (450 tokens, 145,700): work
imbalance 1.0016. NeMo-RL's deal (bins ``[300, 200]``, ``[250, 100, 40, 20]``): 1.22."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np
import torch

from nn_data.layout import round_up
from nn_data.layout.internal import INT32_MAX
from nn_data.errors import PackingError
from nn_data.planning.alignment import Parallelism
from nn_data.planning.balance import bins_to_ranks, greedy_assignment, refine, spread
from nn_data.planning.ffd import adjust_bin_count, ffd_ties_last, first_fit_decreasing

BALANCE_MODES = ("work", "tokens", "nemo-rl")
# A plan whose ranks' loads differ by more than this is refined (balance.refine), at most
# REFINE_ROUNDS moves or swaps per rank; below it the greedy is already as even as the weights allow.
REFINE_ABOVE = 1.005
REFINE_ROUNDS = 4
# A greedy plan that leaves a sequence without room is retried with it first, up to RETRIES times
# and while the retries' sequences stay under RETRY_ITEMS (one try at 65,536 sequences).
RETRIES = 8
RETRY_ITEMS = 1 << 16


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """:func:`plan_step`'s result: ``ranks[r][j]`` the sequence indices of microbatch ``j`` on rank ``r``,
    ``microbatch_tokens[r][j]`` its padded total, ``microbatch_work[r][j]`` its work, ``real_tokens`` the step's
    unpadded tokens, ``balance`` the mode, ``steps`` the planner's heap pops and tree nodes (the complexity test),
    ``imbalance_bound`` (:func:`imbalance_bound`)."""

    pad_full_seq_to: int
    ranks: list
    microbatch_tokens: list
    microbatch_work: list
    real_tokens: int
    balance: str
    steps: int = 0
    imbalance_bound: float = 1.0

    @property
    def microbatches_per_rank(self) -> int:
        return len(self.ranks[0]) if self.ranks else 0

    @property
    def padding_fraction(self) -> float:
        """``1 - real tokens / (microbatches on all ranks x T)``: the share of the step's packed
        positions that hold padding (0 for an empty step)."""
        slots = len(self.ranks) * self.microbatches_per_rank * self.pad_full_seq_to
        return 1.0 - self.real_tokens / slots if slots else 0.0

    @property
    def rank_work(self) -> list:
        return [float(sum(w)) for w in self.microbatch_work]

    @property
    def work_imbalance(self) -> float:
        """Max over ranks of their work / the mean (1.0: every rank waits for none)."""
        return _imbalance(self.rank_work)

    @property
    def microbatch_imbalance(self) -> float:
        """Max over ranks of (its heaviest microbatch's work / its mean microbatch work)."""
        return max((_imbalance(w) for w in self.microbatch_work), default=1.0)


def _imbalance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if len(values) else 0.0
    return max(values) / mean if mean > 0 else 1.0


def sequence_work(lengths, hidden_size: int = 4096) -> np.ndarray:
    """``L * (L + 6 * hidden_size)`` per sequence, as float64. Example: ``[1000], 4096 -> [2.5576e7]``."""
    arr = np.asarray(lengths, dtype=np.float64)
    return arr * (arr + 6.0 * hidden_size)


def imbalance_bound(work, ranks: int) -> float:
    """A lower bound of the work imbalance of every plan of sequences with these ``work`` values on
    ``ranks`` ranks (capacity aside): the mean, and for each ``j >= 0``, the ``j*D + 1`` heaviest
    sequences put at least ``j + 1`` on one rank, which holds at least the lightest ``j + 1`` of
    them; over the mean. ``j = 0`` is the heaviest sequence alone.

    Example: work ``[9, 8, 5, 4, 2]`` on 2 ranks, mean 14: ``j = 0``: 9; ``j = 1``: the 3 heaviest
    put 2 on a rank, >= 8 + 5 = 13; ``j = 2``: the 5 put 3 on a rank, >= 5 + 4 + 2 = 11 -> 1.0.
    On 4 ranks (mean 7): 9, then 4 + 2 = 6 -> 9 / 7.
    """
    w = np.sort(np.asarray(work, dtype=np.float64))[::-1]
    if w.size == 0 or w.sum() <= 0:
        return 1.0
    mean = w.sum() / ranks
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    j = np.arange((w.size - 1) // ranks + 1)
    last = j * ranks  # index of the (j*D + 1)-th heaviest; the window is its j + 1 lightest
    windows = prefix[last + 1] - prefix[last - j]
    return max(1.0, float(windows.max()) / mean)


def host_ints(values, name: str, expected: str = "a 1-D sequence of ints, one per rollout") -> np.ndarray:
    """``values`` (a list, tuple, numpy array or tensor of ints) as a 1-D numpy array of their own dtype;
    :class:`PackingError` naming ``name``, the value and ``expected`` otherwise (nothing is rounded)."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()  # sync: the planner runs on the host, once per step
    arr = np.asarray(values)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)) or arr.dtype == np.bool_:
        raise PackingError(f"{name}={short_repr(values)} is invalid; expected {expected}")
    return arr


def host_lengths(lengths, name: str = "lengths") -> np.ndarray:
    """``lengths`` (a list, tuple, numpy array or tensor of ints >= 0) as a 1-D int64 numpy array;
    :class:`PackingError` naming ``name`` and the first bad entry otherwise (nothing is rounded)."""
    arr = host_ints(lengths, name, "a 1-D sequence of ints >= 0 (nothing is rounded or truncated)")
    big = np.flatnonzero(arr > INT32_MAX)  # compared in the given dtype: an unsigned 2**63 does not wrap
    if big.size:
        i = int(big[0])
        raise PackingError(f"{name}[{i}] = {int(arr[i])} is invalid; a length above {INT32_MAX} cannot fit the "
                           "int32 boundaries of a packed microbatch")
    arr = arr.astype(np.int64)
    negative = np.flatnonzero(arr < 0)
    if negative.size:
        i = int(negative[0])
        raise PackingError(f"{name}[{i}] = {int(arr[i])} is invalid; every length must be an int >= 0")
    return arr


def first_over(need: np.ndarray, total: int) -> Optional[int]:
    """The first rollout whose padded tokens alone ``need [n]`` exceed the microbatch's ``total``, or None.
    Example: need ``[8, 24, 40]``, total 16 -> 1."""
    over = np.flatnonzero(need > total)
    return int(over[0]) if over.size else None


def short_repr(value) -> str:
    """``repr(value)``, cut to 80 characters for a message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_args(parallelism, balance, hidden_size, microbatches_per_rank) -> None:
    if not isinstance(parallelism, Parallelism):
        raise PackingError(f"parallelism={parallelism!r} is invalid; expected a nn_data.planning.Parallelism")
    if balance not in BALANCE_MODES:
        raise PackingError(f"balance={balance!r} is invalid; expected one of {list(BALANCE_MODES)}")
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise PackingError(f"hidden_size={hidden_size!r} is invalid; expected an int >= 1 (the model's hidden size)")
    k = microbatches_per_rank
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise PackingError(f"microbatches_per_rank={k!r} is invalid; expected None or an int >= 1")


def plan_step(lengths, parallelism: Parallelism, *, pad_full_seq_to: int, microbatches_per_rank: Optional[int] = None,
              balance: str = "work", hidden_size: int = 4096) -> StepPlan:
    """Plan one step's sequences onto ``parallelism.dp`` ranks in microbatches of at most ``pad_full_seq_to``
    padded tokens (module docstring).

    Args:
        balance: ``"work"`` (default) balances the ranks' work, ``"tokens"`` their padded tokens
            (:mod:`nn_data.planning.balance`); ``"nemo-rl"`` is NeMo-RL's first-fit-decreasing deal, for parity.
        hidden_size: the work's linear term.
        microbatches_per_rank: ``k``, or None: the smallest the planner finds (never above
            first-fit-decreasing's ``ceil(bins / dp)``).

    Raises :class:`PackingError` naming the argument for a ``pad_full_seq_to`` that is not a multiple of
    ``parallelism.total_multiple`` or above int32, a sequence longer than it after padding, a
    ``microbatches_per_rank`` too small, bad lengths, ``balance``, ``hidden_size`` or ``parallelism``."""
    check_args(parallelism, balance, hidden_size, microbatches_per_rank)
    total = parallelism.check_fixed_total(pad_full_seq_to)
    arr = host_lengths(lengths)
    need = round_up(arr, parallelism.pad_multiple)
    i = first_over(need, total)
    if i is not None:
        raise PackingError(f"lengths[{i}] = {int(arr[i])} (padded to {int(need[i])}, a multiple of "
                           f"{parallelism.pad_multiple}) is longer than pad_full_seq_to={total}; raise pad_full_seq_to "
                           f"to at least {parallelism.round_fixed_total(int(need[i]))}")
    work = sequence_work(arr, hidden_size)
    ranks, steps = place(need, work, total=total, dp=parallelism.dp, balance=balance, given=microbatches_per_rank)
    return plan_of(ranks, arr, need, work, total, balance, steps)


def place(need: np.ndarray, work: np.ndarray, *, total: int, dp: int, balance: str, given: Optional[int]):
    """``(ranks, steps)``: items of padded sizes ``need`` and work ``work`` on ``dp`` ranks of microbatches of at
    most ``total`` tokens, by ``balance`` (:func:`plan_step`'s rules; an item is a sequence there, a group or a
    part of one in :func:`~nn_data.planning.shared_prefix_plan.plan_step_shared_prefix`)."""
    if balance == "nemo-rl":
        return _nemo_rl_deal(need, total, dp, given)
    return _balanced(need, work if balance == "work" else need.astype(np.float64), total, dp, given)


def plan_of(ranks: list, arr: np.ndarray, need: np.ndarray, work: np.ndarray, total: int, balance: str,
            steps: int) -> StepPlan:
    """The :class:`StepPlan` of ``ranks`` (indices into ``need`` / ``work``); ``arr``: the real tokens."""
    need_of, work_of = need.tolist(), work.tolist()  # sync: none, numpy on the host
    return StepPlan(
        pad_full_seq_to=total, ranks=ranks,
        microbatch_tokens=[[sum(need_of[i] for i in mb) for mb in rank] for rank in ranks],
        microbatch_work=[[math.fsum(work_of[i] for i in mb) for mb in rank] for rank in ranks],
        real_tokens=int(arr.sum()), balance=balance, steps=steps, imbalance_bound=imbalance_bound(work, len(ranks)),
    )


def evaluate_plan(ranks: list, lengths, parallelism: Parallelism, *, pad_full_seq_to: int, hidden_size: int = 4096,
                  balance: str = "given") -> StepPlan:
    """The :class:`StepPlan` of ``ranks`` made by another planner (a benchmark's NeMo-RL packer), after checking
    :func:`plan_step`'s guarantees on it; raises :class:`PackingError` naming the first broken one."""
    total = parallelism.check_fixed_total(pad_full_seq_to)
    arr = host_lengths(lengths)
    need = round_up(arr, parallelism.pad_multiple)
    counts = sorted({len(rank) for rank in ranks})
    if len(ranks) != parallelism.dp or len(counts) > 1:
        raise PackingError(f"the plan has {len(ranks)} ranks with {counts} microbatches; expected dp={parallelism.dp} "
                           "ranks with one count")
    seen = sorted(i for rank in ranks for mb in rank for i in mb)
    if seen != list(range(arr.size)):
        raise PackingError(f"the plan holds {len(seen)} sequence slots for {arr.size} sequences; each must be in "
                           "exactly one microbatch")
    plan = plan_of([[list(mb) for mb in rank] for rank in ranks], arr, need, sequence_work(arr, hidden_size),
                    total, balance, 0)
    over = [t for rank in plan.microbatch_tokens for t in rank if t > total]
    if over:
        raise PackingError(f"a microbatch holds {over[0]} padded tokens, more than pad_full_seq_to={total}")
    return plan


def _too_small(k: int, needed: int, need_total: int, dp: int, total: int) -> PackingError:
    return PackingError(f"microbatches_per_rank={k} cannot hold the step: {need_total} padded tokens on dp={dp} ranks "
                        f"of pad_full_seq_to={total} need at least {needed} microbatches per rank here; pass "
                        f"microbatches_per_rank >= {needed} (or None: the smallest that fits)")


def _balanced(need: np.ndarray, weight: np.ndarray, total: int, dp: int, given: Optional[int]):
    """``(ranks, steps)`` for ``balance="work"`` / ``"tokens"``: the greedy at the fewest
    microbatches that could hold the step, then at first-fit-decreasing's count, then FFD's bins."""
    n, need_total = int(need.size), int(need.sum())
    if n == 0:
        return [[[] for _ in range(given or 0)] for _ in range(dp)], 0
    lower = max(1, -(-need_total // (dp * total)))
    if given is not None and given < lower:
        raise _too_small(given, lower, need_total, dp, total)
    order = np.argsort(-need, kind="stable").tolist()  # sync: none, numpy on the host
    need_of, weight_of = need.tolist(), weight.tolist()  # sync: none, numpy on the host
    ranks, steps = _assign(order, need, need_of, weight_of, total, dp, given, lower)
    if dp > 1 and _imbalance([math.fsum(weight_of[i] for mb in rank for i in mb) for rank in ranks]) > REFINE_ABOVE:
        steps += refine(ranks, need_of, weight_of, total, rounds=REFINE_ROUNDS * dp)
    return ranks, steps


def _greedy(order: list, need_of, weight_of, total: int, dp: int, k: int):
    """The greedy, retried with each sequence that found no room moved to the front (at most
    ``RETRIES`` plans, fewer for large steps: the work stays O(n log n)); ``(ranks or None, steps)``."""
    order, steps = list(order), 0
    for _ in range(max(1, min(RETRIES, RETRY_ITEMS // len(order)))):
        found = greedy_assignment(order, need_of, weight_of, total, dp, k)
        steps += found.steps
        if found.ranks is not None:
            return found.ranks, steps
        order.remove(found.failed)
        order.insert(0, found.failed)
    return None, steps


def _assign(order, need, need_of, weight_of, total, dp, given, lower):
    """The greedy at the fewest microbatches that could hold the step (or the given count), then at
    first-fit-decreasing's count, then FFD's bins dealt by weight; ``(ranks, steps)``."""
    first = given if given is not None else lower
    ranks, steps = _greedy(order, need_of, weight_of, total, dp, first)
    if ranks is not None:
        return ranks, steps
    ffd = first_fit_decreasing(need, total)
    ffd_k = -(-len(ffd.bins) // dp)
    steps += ffd.steps
    if given is None and ffd_k > first:
        ranks, more = _greedy(order, need_of, weight_of, total, dp, ffd_k)
        if ranks is not None:
            return ranks, steps + more
    k = ffd_k if given is None else given
    if k < ffd_k:  # the given count: a plan with fewer microbatches spread to it, else refused
        fewer, more = _assign(order, need, need_of, weight_of, total, dp, None, lower)
        if len(fewer[0]) > given:
            raise _too_small(given, len(fewer[0]), int(need.sum()), dp, total)
        return [spread(rank, given) for rank in fewer], steps + more
    bin_weight = [math.fsum(weight_of[i] for i in b) for b in ffd.bins]
    return bins_to_ranks(ffd.bins, bin_weight, dp, k), steps


def _nemo_rl_deal(need: np.ndarray, total: int, dp: int, given: Optional[int]):
    """``(ranks, steps)``, NeMo-RL's plan: FFD bins (ties last index first), the count raised to a multiple of ``dp``
    (or to ``dp * microbatches_per_rank``), bin ``j`` to rank ``j % dp``."""
    n = int(need.size)
    if n == 0:
        return [[[] for _ in range(given or 0)] for _ in range(dp)], 0
    ffd = ffd_ties_last(need, total)
    if given is not None and len(ffd.bins) > dp * given:
        raise _too_small(given, -(-len(ffd.bins) // dp), int(need.sum()), dp, total)
    bins = adjust_bin_count(ffd.bins, dp, target=None if given is None else dp * given)
    return [bins[r::dp] for r in range(dp)], ffd.steps
