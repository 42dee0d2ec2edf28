"""The profiler's workload: seeded RL global batches (one per training step), each planned across the
data-parallel ranks with nn_data.planning.plan_step; this process runs DP rank 0's microbatches.

Shape legend
    N   sequences in a global batch (``--batch-size``); B sequences in one microbatch (varies)
    S   padded row length of the global batch (``--max-len``; constant for the stream)
    T   packed tokens per microbatch: one run-level ``pad_full_seq_to`` (``--packed-length run``,
        the default), or NeMo-RL's step-level rule (``step``: each step's longest microbatch on
        this rank, rounded up to the packed multiple: a new T, so a new graph, on most steps)
    R   the row capacity every graph sees (the most rows of any microbatch, unless given)

The run-level T is ``--max-tokens`` rounded up to the parallelism's alignment
(:meth:`nn_data.planning.Parallelism.round_fixed_total`) and is the plan's hard capacity,
so every microbatch of every step fits it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from nn_data.errors import PackingError
from nn_data.planning import Parallelism, plan_step


class Microbatch(NamedTuple):
    input_ids: torch.Tensor  # [B, S] int64, 0 past each length
    lengths: torch.Tensor  # [B] int64
    step: int = 0  # the training step (global batch) it belongs to
    total: int = 0  # T it is packed to

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())  # sync: host-side bookkeeping, outside every timed call


class Stream(NamedTuple):
    """The planned stream: microbatches plus the constants every graph is built for."""

    microbatches: list  # of Microbatch, on the target device
    seq_len: int  # S
    total: int  # T = pad_full_seq_to (run-level; with --packed-length step, the largest)
    row_capacity: int  # R
    multiple: int  # m = pad_individual_seqs_to_multiple_of
    global_batches: int  # global batches (steps) planned to fill the stream
    steps: int = 1  # complete steps in the stream
    plans: tuple = ()  # per step: dict(microbatches_per_rank, padding_fraction, work_imbalance, T)
    packed_length: str = "run"


def sample_lengths(rng: np.random.Generator, n: int, max_len: int, median: int, sigma: float) -> np.ndarray:
    """``n`` lengths from a lognormal with the given median, rounded and clipped to ``[1, max_len]``
    (RL rollouts: most responses short, a long tail, some cut at the generation limit)."""
    raw = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(raw), 1, max_len).astype(np.int64)


def make_global_batch(rng: np.random.Generator, n: int, max_len: int, median: int, sigma: float, vocab: int):
    """``(input_ids [N, S], lengths [N])``: random ids in ``[1, vocab)``, 0 past each length."""
    lengths = torch.from_numpy(sample_lengths(rng, n, max_len, median, sigma))
    ids = torch.from_numpy(rng.integers(1, vocab, size=(n, max_len), dtype=np.int64))
    return torch.where(torch.arange(max_len) < lengths[:, None], ids, 0), lengths  # [N, S], [N]


def stream_layout(cp_size: int, multiple: int, dp: int) -> Parallelism:
    """The profiled run's parallelism; :class:`PackingError` naming ``--multiple`` when it is not a multiple
    of the parallelism's per-sequence multiple (``2 * cp_size`` under CP)."""
    unit = Parallelism(dp=dp, cp=cp_size).sequence_multiple
    if multiple % unit:
        raise PackingError(f"--multiple={multiple} is not a multiple of 2*cp_size={unit}; use a multiple of {unit}")
    return Parallelism(dp=dp, cp=cp_size, make_sequence_length_divisible_by=multiple)


def plan_stream(*, microbatches: Optional[int], batch_size: int, max_len: int, median: int, sigma: float, vocab: int,
                max_tokens: int, cp_size: int, multiple: int, seed: int, device: torch.device,
                row_capacity: Optional[int] = None, steps: Optional[int] = None, dp: int = 1,
                balance: str = "work", packed_length: str = "run") -> Stream:
    """Plan seeded global batches with :func:`nn_data.planning.plan_step` onto ``dp`` ranks and keep
    rank 0's microbatches: ``steps`` global batches when given, else as many as fill ``microbatches``
    (the stream cut there). Raises :class:`PackingError` for a ``multiple`` that is not a multiple of
    ``2 * cp_size`` (CP > 1), a ``max_len`` above ``max_tokens``, or a ``row_capacity`` below the
    rows of a microbatch."""
    parallelism = stream_layout(cp_size, multiple, dp)
    total = parallelism.round_fixed_total(max_tokens)
    if max_len > max_tokens:
        raise PackingError(f"--max-len={max_len} exceeds --max-tokens={max_tokens}: a full-length sequence "
                           "would not fit any microbatch; raise --max-tokens or lower --max-len")
    if packed_length not in ("run", "step"):
        raise PackingError(f"--packed-length={packed_length!r} is invalid; expected 'run' or 'step'")
    rng = np.random.default_rng(seed)
    stream, plans = [], []
    while (len(plans) < steps) if steps is not None else (len(stream) < microbatches):
        ids, lengths = make_global_batch(rng, batch_size, max_len, median, sigma, vocab)
        plan = plan_step(lengths, parallelism, pad_full_seq_to=total, balance=balance)
        step_total = total if packed_length == "run" else parallelism.round_fixed_total(max(plan.microbatch_tokens[0]))
        plans.append(dict(microbatches_per_rank=plan.microbatches_per_rank, padding_fraction=plan.padding_fraction,
                          work_imbalance=plan.work_imbalance, T=step_total))
        for rows in plan.ranks[0]:
            index = torch.tensor(rows, dtype=torch.int64)
            stream.append(Microbatch(ids.index_select(0, index).contiguous().to(device),
                                     lengths.index_select(0, index).to(device), len(plans) - 1, step_total))
    complete = len(plans)
    if steps is None and len(stream) > microbatches:
        stream, complete = stream[:microbatches], len(plans) - 1  # the last step is cut
    most_rows = max(mb.lengths.shape[0] for mb in stream)
    capacity = most_rows if row_capacity is None else row_capacity
    if capacity < most_rows:
        raise PackingError(f"--row-capacity={capacity} is below the {most_rows} rows of the largest "
                           f"microbatch; use at least {most_rows} (or leave it unset)")
    return Stream(stream, max_len, max(mb.total for mb in stream), capacity, multiple, len(plans),
                  max(complete, 1) if steps is None else steps, tuple(plans), packed_length)
