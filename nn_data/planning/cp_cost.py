"""What a dynamic-CP round costs: the modelled time of one block of ranks, and the ideal it is measured against.

Vocabulary
    L   a sequence's length (real tokens); ``need`` its padded length for its CP size
    c   a block's CP size: the ranks its sequences are sharded over (a power of two)
    tpr ``tokens_per_rank``: every rank's microbatch holds exactly this many tokens
    h   the model's hidden size; costs are in units of ``h`` multiply-adds of one decoder layer

A cost model is any object with ``sequence(lengths: np.ndarray, c) -> np.ndarray`` (each rank's time on each
sequence sharded over ``c`` ranks), ``block(c, tokens_per_rank) -> float`` (the CP collectives, 0 for ``c =
1``) and optionally ``padding(tokens) -> float``. A block's time is its sequences' plus its block time, the
same on every rank of it. :class:`CPCost` is the default; :class:`AttentionOnlyCost` is megatron-core's
``BalancedCPScheduler`` model, ``L^2 / c``. Example (``h = 16``, ``tpr = 64``): a sequence of 100 tokens over
``c = 2`` ranks costs ``100 * (100 + 96) / 2 = 9800`` per rank; the block adds ``2**21 + 512 * 1 * 64 =
2,129,920`` under :class:`CPCost`'s defaults, 0 under :class:`AttentionOnlyCost`."""

from __future__ import annotations

import dataclasses

import numpy as np

from nn_data.errors import PackingError


@dataclasses.dataclass(frozen=True)
class CPCost:
    """``sequence = L (L + 6 h) / c`` (:func:`nn_data.planning.sequence_work` over ``c`` ranks) and ``block =
    latency + per_token * (c - 1) * tpr`` for ``c > 1``: the keys and values a rank of the block receives,
    nothing overlapped.

    Args:
        hidden_size: ``h``.
        per_token: the cost of one token received (512: ``h`` bytes of bf16 GQA keys and values each way at
            400 GB/s against 600 TFLOP/s, forward and backward).
        latency: the collectives' fixed cost per block (``2**21``: ~30 us per layer at ``h = 4096``).

    Estimates, not measurements: pass your own, or any object with the module docstring's methods, as ``cost=``."""

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
