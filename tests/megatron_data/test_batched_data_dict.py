"""Tier: pure CPU, single process.

BatchedDataDict: slicing, batches, the three microbatch iterators, and the two planners
(first-fit-decreasing packing in O(n log n); dynamic batching).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict, SlicedDataDict
from nn_data.errors import PackingError
from nn_data.planning.ffd import first_fit_decreasing


def _data(lengths, seq_len=16):
    n = len(lengths)
    return BatchedDataDict(
        input_ids=torch.arange(n * seq_len).view(n, seq_len),
        input_lengths=torch.tensor(lengths),
        sample_mask=torch.ones(n),
        names=[f"s{i}" for i in range(n)],
    )


def test_size_to_slice_and_select():
    data = _data([5, 9, 3, 4, 6])
    assert data.size == 5 and BatchedDataDict().size == 0
    assert data.to("cpu") is data and data["input_ids"].device.type == "cpu"
    part = data.slice(1, 3)
    assert isinstance(part, SlicedDataDict) and part["names"] == ["s1", "s2"]
    assert torch.equal(part["input_ids"], data["input_ids"][1:3])
    picked = data.select_indices([4, 0])
    assert picked["names"] == ["s4", "s0"] and picked["input_lengths"].tolist() == [6, 5]
    assert picked.select_indices(torch.tensor([1]))["names"] == ["s0"]
    with pytest.raises(PackingError, match=r"end: 9 is greater than the shape of the tensor: 5 for key: input_ids"):
        data.slice(0, 9)


def test_get_batch_and_fixed_microbatches():
    data = _data([5, 9, 3, 4, 6, 1])
    batch = data.get_batch(batch_idx=1, batch_size=3)
    assert batch["names"] == ["s3", "s4", "s5"]
    assert [mb["names"] for mb in batch.make_microbatch_iterator(1)] == [["s3"], ["s4"], ["s5"]]
    with pytest.raises(PackingError, match=r"Data dict size \(6\) is not a multiple of the provided microbatch size \(4\)"):
        list(data.make_microbatch_iterator(4))
    with pytest.raises(PackingError, match="get_batch needs batch_size"):
        data.get_batch(0)


def test_truncate_tensors_cuts_only_the_sequence_dim():
    data = _data([5, 9])
    data.truncate_tensors(dim=1, truncated_len=4)
    assert data["input_ids"].shape == (2, 4) and data["input_lengths"].shape == (2,)


def test_packing_plan_worked_example():
    planned, order = _data([5, 9, 3, 4, 6]).plan_sequence_packing(10)
    assert order == [1, 4, 3, 0, 2]
    assert planned["names"] == ["s1", "s4", "s3", "s0", "s2"]
    assert planned.micro_batch_indices == [[[0, 1], [1, 3], [3, 5]]]
    assert planned.micro_batch_lengths == [[9, 10, 8]]
    assert planned.get_microbatch_iterator_for_packable_sequences_len() == (3, 10)
    assert [mb["names"] for mb in planned.make_microbatch_iterator_for_packable_sequences()] == [
        ["s1"], ["s4", "s3"], ["s0", "s2"]]


def test_packing_plan_pads_each_sequence_to_the_multiple():
    planned, _ = _data([5, 9, 3, 4, 6]).plan_sequence_packing(16, sequence_length_pad_multiple=4)
    # padded lengths 8, 12, 4, 4, 8 -> FFD: 12+4 | 8+8 | 4
    assert planned.micro_batch_lengths == [[16, 16, 4]]
    assert [mb["input_lengths"].tolist() for mb in planned.make_microbatch_iterator_for_packable_sequences()] == [
        [9, 3], [5, 6], [4]]


def test_packing_plan_per_global_batch_and_get_batch():
    data = _data([5, 9, 3, 4, 6, 1, 2, 8])
    planned, order = data.plan_sequence_packing(10, batch_size=4)
    assert sorted(order[:4]) == [0, 1, 2, 3] and sorted(order[4:]) == [4, 5, 6, 7]
    assert planned.elem_counts_per_gb == [4, 4]
    second = planned.get_batch(1)
    assert sorted(second["names"]) == ["s4", "s5", "s6", "s7"]
    n, longest = second.get_microbatch_iterator_for_packable_sequences_len()
    mbs = list(second.make_microbatch_iterator_for_packable_sequences())
    assert len(mbs) == n and all(int(mb["input_lengths"].sum()) <= 10 for mb in mbs)
    with pytest.raises(PackingError, match="holds 2 planned global batches; iterate one of them"):
        list(planned.make_microbatch_iterator_for_packable_sequences())


@pytest.mark.parametrize("call, match", [
    (lambda d: d.plan_sequence_packing(8),
     r"sequence 1 is 9 tokens long \(after padding\), outside \[0, max_tokens_per_microbatch=8\]"),
    (lambda d: d.plan_sequence_packing(16, sequence_length_pad_multiple=0),
     "sequence_length_pad_multiple=0 is invalid"),
    (lambda d: d.plan_sequence_packing(0), "max_tokens_per_microbatch=0 is invalid"),
    (lambda d: d.plan_sequence_packing(16, batch_size=2),
     r"batch_size=2 must be >= 1 and divide the data dict size \(5\)"),
    (lambda d: d.plan_sequence_packing(16, input_lengths_key="lens"), r"'lens' not found in the data dict"),
    (lambda d: list(d.make_microbatch_iterator_for_packable_sequences()), r"no sequence_packing plan"),
    (lambda d: d.get_microbatch_iterator_dynamic_shapes_len(), r"no dynamic_batching plan"),
])
def test_planner_errors(call, match):
    with pytest.raises(PackingError, match=match):
        call(_data([5, 9, 3, 4, 6]))


def _naive_ffd(lengths, capacity):
    """The textbook O(n * bins) first-fit-decreasing loop."""
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, r in enumerate(room):
            if r >= lengths[i]:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


@settings(max_examples=examples(80), deadline=None)
@given(st.lists(st.integers(0, 40), max_size=60), st.integers(40, 100))
def test_ffd_places_every_sequence_once_within_budget_as_the_textbook_loop(lengths, capacity):
    plan = first_fit_decreasing(lengths, capacity)
    flat = sorted(i for b in plan.bins for i in b)
    assert flat == list(range(len(lengths)))  # every sequence in exactly one bin
    assert all(sum(lengths[i] for i in b) == load <= capacity for b, load in zip(plan.bins, plan.loads))
    assert plan.bins == _naive_ffd(lengths, capacity)


def test_ffd_cost_is_n_log_n():
    rng = np.random.default_rng(0)
    for n in (1_000, 16_000):
        lengths = rng.integers(1, 64, n)
        plan = first_fit_decreasing(lengths, 64)  # small bins: the textbook loop would be quadratic here
        assert len(plan.bins) > n // 64
        assert plan.steps <= 2 * n * (math.ceil(math.log2(n)) + 1)


def test_dynamic_batching_plan_and_iterator():
    data = _data([5, 9, 3, 4, 6, 1], seq_len=12)
    planned, order = data.plan_dynamic_batching(16, sequence_length_round=4)
    # shortest first: 1, 3, 4, 5, 6, 9 -> rounded 4, 4, 4, 8, 8, 12; groups rows * max <= 16
    assert order == [5, 2, 3, 0, 4, 1]
    assert planned.micro_batch_indices == [[[0, 3], [3, 5], [5, 6]]]
    assert planned.micro_batch_lengths == [[4, 8, 12]]
    assert planned.get_microbatch_iterator_dynamic_shapes_len() == 3
    mbs = list(planned.make_microbatch_iterator_with_dynamic_shapes())
    assert [mb["input_ids"].shape for mb in mbs] == [(3, 4), (2, 8), (1, 12)]
    assert [mb["names"] for mb in mbs] == [["s5", "s2", "s3"], ["s0", "s4"], ["s1"]]
    with pytest.raises(PackingError, match=r"row 1 needs 12 tokens \(rounded\), more than "
                                           r"max_tokens_per_microbatch=10"):
        data.plan_dynamic_batching(10, sequence_length_round=4)
