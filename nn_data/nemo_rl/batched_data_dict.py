"""``BatchedDataDict``: a dict of per-sample tensors and lists, and its microbatch iterators (NeMo-RL's container,
the same method names and plan format).

Every value holds one entry per sample along dim 0; tensors with 2+ dims have the sequence along dim 1. A plan is
two attributes, one entry per global batch: ``micro_batch_indices[g]`` (``[[start, end], ...]`` row ranges of each
microbatch, relative to the chunk's first row) and ``micro_batch_lengths[g]`` (each microbatch's padded token count,
or its padded row length under dynamic batching)."""

from __future__ import annotations

from collections import UserDict
from typing import Any, Generic, Iterator, Mapping, Optional, Sequence, TypeVar, Union

import numpy as np
import torch

from nn_data.nemo_rl import batched_data_sharding as sharding
from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.extension import first_fit_decreasing

DictT = TypeVar("DictT", bound=Mapping[str, Any])


class BatchedDataDict(UserDict, Generic[DictT]):
    """A dict of per-sample values (tensors: dim 0 is the sample; lists) with a microbatch plan."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.micro_batch_indices: Optional[list] = None
        self.micro_batch_lengths: Optional[list] = None
        self.elem_counts_per_gb: Optional[list] = None

    # ---- shape and movement -------------------------------------------------------
    @property
    def size(self) -> int:
        """Samples in the batch (dim 0 of the first value; 0 when empty)."""
        if not self.data:
            return 0
        value = next(iter(self.data.values()))
        return int(value.shape[0]) if torch.is_tensor(value) else len(value)

    def to(self, device: Union[str, torch.device]) -> "BatchedDataDict":
        """Move every tensor to ``device`` in place; returns ``self``."""
        for key, value in self.data.items():
            if torch.is_tensor(value):
                self.data[key] = value.to(device)
        return self

    def get_dict(self) -> dict:
        """The underlying dict."""
        return self.data

    # ---- selection ------------------------------------------------------------------
    def slice(self, start: int, end: int) -> "SlicedDataDict":
        """Rows ``[start, end)`` of every value (views for tensors). Raises :class:`PackingError`
        when ``end`` is past a tensor's rows."""
        out = SlicedDataDict()
        for key, value in self.data.items():
            if torch.is_tensor(value) and end > value.shape[0]:
                raise PackingAssertionError(f"end: {end} is greater than the shape of the tensor: {value.shape[0]} for key: "
                                            f"{key} (slice rows [start, end) within the batch)")
            out[key] = value[start:end]
        return out

    def select_indices(self, indices: Union[Sequence[int], torch.Tensor]) -> "BatchedDataDict":
        """The rows at ``indices`` (a list or an integer tensor), in that order, as a new dict."""
        idx = torch.as_tensor(indices, dtype=torch.int64)
        out = type(self)()
        for key, value in self.data.items():
            if torch.is_tensor(value):
                out[key] = value.index_select(0, idx.to(value.device))
            elif isinstance(value, np.ndarray):
                out[key] = value[idx.numpy()]
            else:
                out[key] = [value[i] for i in idx.tolist()]  # sync: none, idx is a host tensor
        return out

    def get_batch(self, batch_idx: int, batch_size: Optional[int] = None) -> "SlicedDataDict":
        """Global batch ``batch_idx``: ``batch_size`` rows, or once a plan recorded ``elem_counts_per_gb`` that chunk's rows,
        its plan entry with it."""
        if self.elem_counts_per_gb is not None:
            counts = self.elem_counts_per_gb
            start = int(sum(counts[:batch_idx]))
            batch = self.slice(start, start + counts[batch_idx])
            batch.elem_counts_per_gb = [counts[batch_idx]]
        else:
            if batch_size is None:
                raise PackingAssertionError("get_batch needs batch_size when the dict has no per-batch plan")
            batch = self.slice(batch_size * batch_idx, batch_size * (batch_idx + 1))
        if self.micro_batch_indices is not None:
            batch.micro_batch_indices = [self.micro_batch_indices[batch_idx]]
            batch.micro_batch_lengths = [self.micro_batch_lengths[batch_idx]]
        return batch

    def truncate_tensors(self, dim: int, truncated_len: int) -> None:
        """Narrow every tensor with more than ``dim`` dims to its first ``truncated_len`` along ``dim``."""
        for key, value in self.data.items():
            if torch.is_tensor(value) and value.dim() > dim:
                self.data[key] = value.narrow(dim, 0, min(truncated_len, value.shape[dim]))

    # ---- NeMo-RL's training-loop methods (nn_data.nemo_rl.batched_data_sharding) -------------
    @classmethod
    def from_batches(cls, batches: Sequence[Mapping[str, Any]],
                     pad_value_dict: Optional[dict] = None) -> "BatchedDataDict":
        """Stack ``batches`` into one dict: lists concatenated, tensors concatenated along dim 0
        (2+ dims right-padded along dim 1 with ``pad_value_dict.get(key, 0)``)."""
        return sharding.stack_batches(cls(), batches, pad_value_dict)

    def chunk(self, rank: int, chunks: int) -> "SlicedDataDict":
        """Split ``rank`` of ``chunks`` equal consecutive splits (copies)."""
        return sharding.chunk_rows(self.data, SlicedDataDict(), rank, chunks)

    def reorder_data(self, reorded_indices: Sequence[int]) -> None:
        """In place: undo a reordering; ``reorded_indices[i]`` is the original position of row ``i``."""
        sharding.reorder_rows(self.data, reorded_indices)

    def shard_by_batch_size(self, shards: int, batch_size: Optional[int] = None, allow_uneven_shards: bool = False,
                            dynamic_batching_args: Optional[dict] = None, sequence_packing_args: Optional[dict] = None):
        """:func:`nn_data.nemo_rl.batched_data_sharding.shard_by_batch_size` of this dict, each shard a :class:`SlicedDataDict`."""
        return sharding.shard_by_batch_size(self.data, SlicedDataDict, shards, batch_size, allow_uneven_shards,
                                            dynamic_batching_args, sequence_packing_args)

    # ---- iterators ------------------------------------------------------------------
    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator["SlicedDataDict"]:
        """Consecutive microbatches of ``microbatch_size`` rows. Raises :class:`PackingError`
        unless the size divides the batch."""
        if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
            raise PackingAssertionError(f"microbatch_size={microbatch_size!r} is invalid; expected an int >= 1")
        if self.size % microbatch_size:
            raise PackingAssertionError(f"Data dict size ({self.size}) is not a multiple of the provided microbatch size "
                                        f"({microbatch_size}) (choose a microbatch size that divides it)")
        for start in range(0, self.size, microbatch_size):
            yield self.slice(start, start + microbatch_size)

    def _single_plan(self, kind: str):
        if self.micro_batch_indices is None or self.micro_batch_lengths is None:
            raise PackingAssertionError(f"no {kind} plan: call plan_{kind}() first (or get_batch() of a planned dict)")
        if len(self.micro_batch_indices) != 1:
            raise PackingAssertionError(f"the dict holds {len(self.micro_batch_indices)} planned global batches; iterate "
                                        "one of them: get_batch(i)")
        return self.micro_batch_indices[0], self.micro_batch_lengths[0]

    def make_microbatch_iterator_for_packable_sequences(self) -> Iterator["SlicedDataDict"]:
        """One microbatch per planned bin (rows ``[start, end)``), each packable within the budget."""
        indices, _ = self._single_plan("sequence_packing")
        for start, end in indices:
            yield self.slice(start, end)

    def get_microbatch_iterator_for_packable_sequences_len(self) -> tuple[int, int]:
        """``(number of packed microbatches, largest planned token count)``."""
        indices, lengths = self._single_plan("sequence_packing")
        return len(indices), max(lengths, default=0)

    def make_microbatch_iterator_with_dynamic_shapes(self, sequence_dim: int = 1) -> Iterator["SlicedDataDict"]:
        """One microbatch per planned group, every tensor cut to the group's padded row length."""
        indices, lengths = self._single_plan("dynamic_batching")
        for seqlen, (start, end) in zip(lengths, indices):
            mb = self.slice(start, end)
            mb.truncate_tensors(dim=sequence_dim, truncated_len=seqlen)
            yield mb

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        """Number of dynamic-shape microbatches."""
        return len(self._single_plan("dynamic_batching")[0])

    # ---- planners -------------------------------------------------------------------
    def _host_lengths(self, key: str) -> np.ndarray:
        if key not in self.data:
            raise PackingAssertionError(f"{key!r} not found in the data dict (keys: {list(self.data)})")
        value = self.data[key]
        values = value.tolist() if torch.is_tensor(value) else list(value)  # sync: the planner runs on the host
        return np.asarray(values, dtype=np.int64).reshape(-1)

    def _chunks(self, batch_size: Optional[int]) -> list[range]:
        size = self.size
        batch_size = size if batch_size is None else batch_size
        if batch_size < 1 or size % batch_size:
            raise PackingAssertionError(f"batch_size={batch_size} must be >= 1 and divide the data dict size ({size})")
        return [range(s, s + batch_size) for s in range(0, size, batch_size)] if size else []

    def _reordered(self, order: list, indices: list, lengths: list, counts: list) -> "BatchedDataDict":
        out = self.select_indices(order)
        out.micro_batch_indices, out.micro_batch_lengths, out.elem_counts_per_gb = indices, lengths, counts
        return out

    def plan_sequence_packing(
        self,
        max_tokens_per_microbatch: int,
        sequence_length_pad_multiple: int = 1,
        input_lengths_key: str = "input_lengths",
        batch_size: Optional[int] = None,
    ) -> tuple["BatchedDataDict", list]:
        """Bin sequences into packable microbatches with first-fit-decreasing (one host read of the lengths).

        Returns ``(planned, order)``: a reordered copy whose bins are contiguous, with the plan recorded, and ``order[i]``
        the original row of new row ``i``.

        Args:
            max_tokens_per_microbatch: no bin holds more padded tokens.
            sequence_length_pad_multiple: each sequence counts ``round_up(length, multiple)`` tokens.
            input_lengths_key: the key of the ``[B]`` lengths.
            batch_size: each global batch of this many rows is planned on its own (default: all).

        Example: lengths ``[5, 9, 3, 4, 6]``, budget 10 -> bins ``[1] [4, 3] [0, 2]`` -> order ``[1, 4, 3, 0, 2]``,
        indices ``[[[0, 1], [1, 3], [3, 5]]]``, lengths ``[[9, 10, 8]]``.

        Raises :class:`PackingError` for a padded sequence longer than the budget, a bad multiple or budget, or a
        ``batch_size`` that does not divide the batch."""
        padded = sharding.round_up_lengths(self._host_lengths(input_lengths_key), sequence_length_pad_multiple)
        order, all_indices, all_lengths, counts = [], [], [], []
        for chunk in self._chunks(batch_size):
            plan = first_fit_decreasing(padded[chunk.start:chunk.stop], max_tokens_per_microbatch)
            starts = np.cumsum([0] + [len(b) for b in plan.bins]).tolist()  # sync: none, numpy
            all_indices.append([[starts[i], starts[i + 1]] for i in range(len(plan.bins))])
            all_lengths.append(plan.loads)
            order += [chunk.start + i for b in plan.bins for i in b]
            counts.append(len(chunk))
        return self._reordered(order, all_indices, all_lengths, counts), order

    def plan_dynamic_batching(
        self,
        max_tokens_per_microbatch: int,
        sequence_length_round: int = 1,
        input_lengths_key: str = "input_lengths",
        batch_size: Optional[int] = None,
        input_key: str = "input_ids",
    ) -> tuple["BatchedDataDict", list]:
        """Group rows, shortest first, into microbatches of ``rows * padded_max_len <= budget``; ``(planned, order)`` as
        :meth:`plan_sequence_packing`.

        ``padded_max_len`` is the group's longest length rounded up to ``sequence_length_round`` (capped at the row length
        of ``input_key``). Raises :class:`PackingError` when one row alone exceeds the budget."""
        lengths = self._host_lengths(input_lengths_key)
        row_len = self.data[input_key].shape[1]
        rounded = np.minimum(sharding.round_up_lengths(lengths, sequence_length_round), row_len)
        order, all_indices, all_lengths, counts = [], [], [], []
        for chunk in self._chunks(batch_size):
            sub = np.argsort(lengths[chunk.start:chunk.stop], kind="stable").tolist()  # sync: none, numpy
            groups, group_lens = sharding.greedy_groups(rounded[chunk.start:chunk.stop][sub], max_tokens_per_microbatch,
                                                [chunk.start + i for i in sub])
            all_indices.append(groups)
            all_lengths.append(group_lens)
            order += [chunk.start + i for i in sub]
            counts.append(len(chunk))
        return self._reordered(order, all_indices, all_lengths, counts), order


class SlicedDataDict(BatchedDataDict):
    """A slice or shard of a larger :class:`BatchedDataDict` (a distinct type, same behaviour)."""

__all__ = [
    "BatchedDataDict",
    "SlicedDataDict",
]
