"""What a dynamic-CP round costs: the modelled time of one block of ranks, and the ideal it is measured against.

Vocabulary
    L   a sequence's length (real tokens); ``need`` its padded length for its CP size
    c   a block's CP size: the ranks its sequences are sharded over (a power of two)
    tpr ``tokens_per_rank``: every rank's microbatch holds exactly this many tokens
    h   the model's hidden size; costs are in units of ``h`` multiply-adds of one decoder layer

A cost model is any object with two methods (the planner and the benchmark call nothing else but
an optional third, ``padding(tokens) -> float``: what ``tokens`` positions of padding cost a rank,
which the planner weighs against an extra round):

* ``sequence(lengths: np.ndarray, c: int) -> np.ndarray``: the time each rank of a block of
  ``c`` ranks spends on each sequence sharded over it (float64);
* ``block(c: int, tokens_per_rank: int) -> float``: the time a block of ``c`` ranks spends on
  top of its sequences, whatever they are (0 for ``c = 1``): the CP collectives.

A block's time is the sum of its sequences' times plus its block time; every rank of the block
takes it (the zigzag split gives each rank the same share of every sequence's work).

:class:`CPCost` (the default) is nn_data's step work ``L (L + 6 h)`` split over ``c`` ranks plus
the exposed cost of the CP collectives; :class:`AttentionOnlyCost` is megatron-core's
``BalancedCPScheduler`` work model, ``L^2 / c``. Example (``h = 16``, ``tpr = 64``): a sequence of
100 tokens over ``c = 2`` ranks costs ``100 * (100 + 96) / 2 = 9800`` per rank; the block adds
``2**21 + 512 * 1 * 64 = 2,129,920`` under :class:`CPCost`'s defaults, 0 under
:class:`AttentionOnlyCost`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from nn_data.errors import PackingError


@dataclasses.dataclass(frozen=True)
class CPCost:
    """``sequence = L (L + 6 h) / c`` and ``block = latency + per_token * (c - 1) * tpr`` for ``c > 1``.

    The compute term is :func:`nn_data.planning.sequence_work` (attention ``~L^2``, the linear
    layers ``~6 h L``) divided over the ``c`` ranks. The communication term models what a rank of a
    block of ``c`` waits for, per layer, forward and backward, with nothing overlapped (nn_data's
    attention all-gathers keys and values before it runs, and reduce-scatters their gradients):

    * ``per_token`` (512 by default) per token received: each rank receives the other ``c - 1``
      ranks' ``tpr`` tokens of keys and values. With grouped-query attention of ``h / 4`` key/value
      dims in bf16 that is ``h`` bytes per token each way; at 400 GB/s (NVLink-class) against
      600 TFLOP/s of bf16 compute one token costs as long as ``~750 h`` multiply-adds forward, and
      fwd + bwd (twice the bytes, three times the compute) ``~500``: 512.
    * ``latency`` (``2**21`` by default) per block: the collectives' fixed cost, ~30 us per layer
      (fwd + bwd) on the same machine, in units of ``h = 4096`` multiply-adds.

    These are estimates, not measurements; pass your own (``CPCost(per_token=..., latency=...)``),
    or any object with the two methods of the module docstring, as ``cost=``.
    """

    hidden_size: int = 4096
    per_token: float = 512.0
    latency: float = float(2**21)

    def sequence(self, lengths, c: int) -> np.ndarray:
        arr = np.asarray(lengths, dtype=np.float64)
        return arr * (arr + 6.0 * self.hidden_size) / c

    def block(self, c: int, tokens_per_rank: int) -> float:
        return 0.0 if c == 1 else self.latency + self.per_token * (c - 1) * tokens_per_rank

    def padding(self, tokens: int) -> float:
        """What ``tokens`` positions of padding cost a rank: the linear layers run on them (``6 h``
        each; padding attends only within its own segment, which this leaves out)."""
        return 6.0 * self.hidden_size * tokens


@dataclasses.dataclass(frozen=True)
class AttentionOnlyCost:
    """megatron-core's ``BalancedCPScheduler`` work model: ``L^2 / c`` per rank, nothing for the
    linear layers or the collectives (its ``get_total_workload``)."""

    def sequence(self, lengths, c: int) -> np.ndarray:
        arr = np.asarray(lengths, dtype=np.float64)
        return arr * arr / c

    def block(self, c: int, tokens_per_rank: int) -> float:
        return 0.0


def cost_model(cost, hidden_size: int):
    """``cost``, or :class:`CPCost` with ``hidden_size`` when None, checked (:func:`check_cost`)."""
    cost = CPCost(hidden_size=hidden_size) if cost is None else cost
    check_cost(cost)
    return cost


def check_cost(cost) -> None:
    """:class:`~nn_data.errors.PackingError` naming ``cost`` when it lacks ``sequence`` or ``block``."""
    missing = [name for name in ("sequence", "block") if not callable(getattr(cost, name, None))]
    if missing:
        raise PackingError(f"cost={cost!r} is invalid; a cost model needs methods sequence(lengths, c) and "
                           f"block(c, tokens_per_rank) (missing {missing}); e.g. nn_data.planning.CPCost()")
