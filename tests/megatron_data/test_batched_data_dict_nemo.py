"""Tier: pure CPU, single process (hypothesis property tests for the shard -> gather -> reorder trip).

BatchedDataDict's NeMo-RL training-loop methods: shard_by_batch_size (plain, uneven, dynamic
batching, sequence packing), chunk, reorder_data, from_batches; round trips and plan invariants.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict, SlicedDataDict
from nn_data.planning import Parallelism
from nn_data.planning.ffd import adjust_bin_count, ffd_ties_last
from nn_data.errors import PackingError
from nn_data.nemo_rl.megatron_data import get_microbatch_iterator
from nn_data.testing.coded import coded_batch
from tests.support.megatron_config import megatron_cfg


def _data(lengths, seq_len=12):
    n = len(lengths)
    return BatchedDataDict(input_ids=coded_batch(lengths, seq_len), input_lengths=torch.tensor(lengths),
                           sample_mask=torch.ones(n), names=[f"s{i}" for i in range(n)])


def _same(a, b):
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else list(a[key]) == list(b[key]), key


# ---- plain sharding ----------------------------------------------------------------------------

def test_shards_take_their_part_of_every_chunk():
    data = _data([1, 2, 3, 4, 5, 6, 7, 8])
    whole = data.shard_by_batch_size(2)
    assert [s["names"] for s in whole] == [["s0", "s1", "s2", "s3"], ["s4", "s5", "s6", "s7"]]
    chunked = data.shard_by_batch_size(2, batch_size=4)
    assert [s["names"] for s in chunked] == [["s0", "s1", "s4", "s5"], ["s2", "s3", "s6", "s7"]]
    assert isinstance(chunked[0], SlicedDataDict)
    assert torch.equal(chunked[1]["input_ids"], data["input_ids"][[2, 3, 6, 7]])


def test_uneven_shards_leave_the_last_one_short():
    shards = _data([1, 2, 3, 4, 5]).shard_by_batch_size(2, allow_uneven_shards=True)
    assert [s["names"] for s in shards] == [["s0", "s1", "s2"], ["s3", "s4"]]
    assert shards[1]["input_ids"].shape == (2, 12)


@pytest.mark.parametrize("kwargs, match", [
    (dict(shards=2, batch_size=2, allow_uneven_shards=True), "batch_size must be None if allow_uneven_shards"),
    (dict(shards=4), r"Batch size \(6\) is not a multiple of shards \(4\)"),
    (dict(shards=2, batch_size=4), r"Total batch size \(6\) is not a multiple of batch_size \(4\)"),
    (dict(shards=0), r"shards=0 is invalid"),
    (dict(shards=2, dynamic_batching_args={}, sequence_packing_args={}), "cannot be passed together"),
])
def test_sharding_errors(kwargs, match):
    with pytest.raises(PackingError, match=match):
        _data([1, 2, 3, 4, 5, 6]).shard_by_batch_size(**kwargs)


def test_values_of_different_sizes_are_refused():
    data = _data([1, 2])
    data["names"] = ["only one"]
    with pytest.raises(AssertionError, match=r"^Batch sizes are not the same across the rollout batch, found sizes"):
        data.shard_by_batch_size(1)


# ---- dynamic batching --------------------------------------------------------------------------

DYN = dict(max_tokens_per_microbatch=16, sequence_length_round=4, input_key="input_ids",
           input_lengths_key="input_lengths")


def test_dynamic_batching_worked_example():
    # lengths by row: 9 1 5 2 | 3 7 4 6; per chunk sorted by length, strided over 2 shards
    data = _data([9, 1, 5, 2, 3, 7, 4, 6])
    shards, order = data.shard_by_batch_size(2, batch_size=4, dynamic_batching_args=DYN)
    assert order == [1, 2, 3, 0, 4, 7, 6, 5]  # chunk 0 sorted: 1(1) 3(2) 2(5) 0(9) -> [1, 2] + [3, 0]
    assert [s["names"] for s in shards] == [["s1", "s2", "s4", "s7"], ["s3", "s0", "s6", "s5"]]
    # position j: longest of the two shards' rows, rounded to 4: chunk 0 -> 4, 12; chunk 1 -> 4, 8
    assert shards[0].micro_batch_indices == [[[0, 1], [1, 2]], [[0, 2]]]
    assert shards[0].micro_batch_lengths == [[4, 12], [8]]
    assert shards[1].micro_batch_indices == shards[0].micro_batch_indices  # every rank: same microbatches
    batch = shards[1].get_batch(0, batch_size=2)
    assert [mb["input_ids"].shape for mb in batch.make_microbatch_iterator_with_dynamic_shapes()] == [(1, 4), (1, 12)]


def test_dynamic_batching_refuses_a_row_over_the_budget():
    with pytest.raises(PackingError, match=r"got an input of padded \(4\) sequence length of 12, however max "
                                           r"microbatch size is 8 tokens"):
        _data([9, 1]).shard_by_batch_size(1, dynamic_batching_args={**DYN, "max_tokens_per_microbatch": 8})


# ---- sequence packing --------------------------------------------------------------------------

def _pack_args(budget=16, multiple=4, **extra):
    args = dict(max_tokens_per_microbatch=budget, input_key="input_ids", input_lengths_key="input_lengths",
                algorithm="modified_first_fit_decreasing", sequence_length_pad_multiple=multiple)
    return {**args, **extra}


def test_packing_worked_example():
    # padded to 4: 12 4 8 4 | 8 4 4 12; FFD (ties: last index first) per chunk, bins dealt to 2 shards
    data = _data([9, 1, 5, 2, 7, 3, 4, 12])
    shards, order = data.shard_by_batch_size(2, batch_size=4, sequence_packing_args=_pack_args())
    # chunk 0: bins [0, 3] (16), [2, 1] (12); chunk 1: bins [7, 6] (16), [4, 5] (12)
    assert [s["names"] for s in shards] == [["s0", "s3", "s7", "s6"], ["s2", "s1", "s4", "s5"]]
    assert order == [0, 3, 7, 6, 2, 1, 4, 5]
    assert shards[0].micro_batch_indices == [[[0, 2]], [[0, 2]]] and shards[0].micro_batch_lengths == [[16], [16]]
    assert shards[1].micro_batch_lengths == [[12], [12]] and shards[1].elem_counts_per_gb == [2, 2]
    it, n, _, _, padded = get_microbatch_iterator(shards[1].get_batch(1), _cfg(), 1, None)
    assert (n, padded) == (1, 12) and [mb.input_ids.shape for mb in it] == [(1, 12)]


def _cfg():
    return {"sequence_packing": {"enabled": True}, "dynamic_batching": {"enabled": False},
            "megatron_cfg": megatron_cfg(pp=2), "make_sequence_length_divisible_by": 4}


def test_largest_first_orders_each_ranks_bins_by_load():
    data = _data([12, 8, 8])  # FFD: [s0] (12), then [s2, s1] (16)
    packer, _ = data.shard_by_batch_size(1, sequence_packing_args=_pack_args())
    assert packer[0].micro_batch_lengths == [[12, 16]] and packer[0]["names"] == ["s0", "s2", "s1"]
    largest, _ = data.shard_by_batch_size(1, sequence_packing_args=_pack_args(microbatch_order="largest_first"))
    assert largest[0].micro_batch_lengths == [[16, 12]] and largest[0]["names"] == ["s2", "s1", "s0"]


def test_bin_count_is_raised_to_a_multiple_of_the_shards():
    assert ffd_ties_last([4, 4], 4).bins == [[1], [0]]
    assert adjust_bin_count([[0, 1, 2], [3]], 4) == [[0], [3], [2], [1]]
    with pytest.raises(PackingError, match=r"^Cannot create 4 bins with only 3 sequences"):
        adjust_bin_count([[0, 1, 2]], 4)


@pytest.mark.parametrize("args, match", [
    (_pack_args(algorithm="best_fit"), r"algorithm'\]='best_fit' is not one of NeMo-RL's packers"),
    (_pack_args(microbatch_order="smallest"), "microbatch_order must be 'packer' or 'largest_first'"),
    (_pack_args(budget=8), r"^Sequence length 12 exceeds bin capacity 8 \(row 0, padded to a multiple of 4"),
])
def test_packing_errors(args, match):
    with pytest.raises(PackingError, match=match):
        _data([9, 1, 5, 2]).shard_by_batch_size(2, sequence_packing_args=args)


@pytest.mark.parametrize("key, near", [("paralelism", "parallelism"), ("parallel_layout", "parallelism"),
                                       ("rolout_tree", "rollout_tree"), ("balancing", "balance")])
def test_an_unknown_packing_key_is_refused_naming_the_nearest(key, near):
    """A misspelling or the old spelling of one of nn_data's keys would plan without it (no CP alignment)."""
    args = _pack_args(algorithm="nn_data_balanced", **{key: None})
    with pytest.raises(PackingError, match=rf"sequence_packing_args has an unknown key '{key}' \(did you mean "
                                           rf"'{near}'\?\); valid keys: \[.*'sequence_length_pad_multiple'"):
        _data([9, 1, 5, 2]).shard_by_batch_size(2, sequence_packing_args=args)


def test_an_unknown_packing_key_far_from_every_key_names_the_valid_ones():
    with pytest.raises(PackingError, match=r"unknown key 'zzz'; valid keys: \['algorithm', 'balance'"):
        _data([9, 1, 5, 2]).shard_by_batch_size(2, sequence_packing_args=_pack_args(zzz=1))


def test_nemo_rls_packing_keys_pass_untouched_and_nn_datas_need_its_planner():
    """Every NeMo-RL key (``microbatch_order`` included) plans as before; an nn_data key under a NeMo-RL packer,
    which would ignore it, is refused naming the packer to choose."""
    data = _data([9, 1, 5, 2, 7, 3, 4, 12])
    args = _pack_args(microbatch_order="packer")
    shards, order = data.shard_by_batch_size(2, batch_size=4, sequence_packing_args=args)
    assert order == [0, 3, 7, 6, 2, 1, 4, 5] and args == _pack_args(microbatch_order="packer")  # not rewritten
    with pytest.raises(PackingError, match=r"sequence_packing_args\['parallelism'\] is read by nn_data's planner "
                                           r"only; set sequence_packing_args\['algorithm'\]='nn_data_balanced'"):
        data.shard_by_batch_size(2, batch_size=4, sequence_packing_args=_pack_args(parallelism=Parallelism(dp=2)))


@settings(max_examples=examples(40), deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=24), shards=st.integers(1, 4),
       chunks=st.integers(1, 3), budget=st.sampled_from([12, 16, 24]), multiple=st.sampled_from([1, 4]))
def test_packing_plan_invariants_and_round_trip(lengths, shards, chunks, budget, multiple):
    rows = len(lengths) // (shards * chunks) * shards * chunks
    if rows == 0:
        return
    data = _data(lengths[:rows])
    try:
        args = _pack_args(budget, multiple)
        out, order = data.shard_by_batch_size(shards, rows // chunks, sequence_packing_args=args)
    except PackingError as err:  # only when a chunk has fewer sequences than ranks need bins
        assert "Cannot create" in str(err)
        return
    assert sorted(order) == list(range(rows))
    padded = [-(-n // multiple) * multiple for n in lengths[:rows]]
    for shard in out:
        assert [len(c) for c in shard.micro_batch_indices] == [len(c) for c in out[0].micro_batch_indices]
        for g in range(chunks):
            batch = shard.get_batch(g)
            for (start, end), load in zip(batch.micro_batch_indices[0], batch.micro_batch_lengths[0]):
                mine = batch["input_lengths"][start:end].tolist()
                assert load == sum(-(-n // multiple) * multiple for n in mine) <= budget and end > start
    per_chunk = [len(c) for c in out[0].micro_batch_indices]  # microbatches per chunk, same on every rank
    assert all(n >= 1 for n in per_chunk) and sum(per_chunk) * shards <= rows  # no empty bin
    assert sorted(sum((s.micro_batch_lengths[g] for s in out for g in range(chunks)), [])) == sorted(
        sum(padded[i] for i in order[k:k + n]) for k, n in _bins_in_order(out, chunks))
    gathered = BatchedDataDict.from_batches(out)
    gathered.reorder_data(order)
    _same(gathered, data)


def _bins_in_order(out, chunks):
    """(offset into the flattened sorted order, rows) of every bin, shard after shard."""
    spans, offset = [], 0
    for shard in out:
        for g in range(chunks):
            for start, end in shard.micro_batch_indices[g]:
                spans.append((offset + start, end - start))
            offset += shard.micro_batch_indices[g][-1][1]
    return spans


# ---- chunk, reorder_data, from_batches ---------------------------------------------------------

def test_chunk_returns_copies_of_one_split():
    data = _data([1, 2, 3, 4])
    part = data.chunk(3, 4)  # NeMo-RL refuses ranks >= B // chunks; every rank < chunks is served here
    assert part["names"] == ["s3"] and torch.equal(part["input_ids"], data["input_ids"][3:])
    part["input_ids"][0, 0] = -1
    assert data["input_ids"][3, 0] != -1
    with pytest.raises(AssertionError, match=r"^batch size \(4\) is not a multiple of chunks \(3\)"):
        data.chunk(0, 3)
    with pytest.raises(AssertionError, match=r"^index OOB: not enough splits for this rank"):
        data.chunk(4, 4)


def test_reorder_data_restores_the_original_order():
    data = _data([3, 1, 2])
    data.reorder_data([2, 0, 1])  # current row 0 was originally row 2, ...
    assert data["names"] == ["s1", "s2", "s0"] and data["input_lengths"].tolist() == [1, 2, 3]
    with pytest.raises(PackingError, match=r"reorder_data got 2 indices for a batch of 3 rows"):
        data.reorder_data([0, 1])


def test_from_batches_pads_along_the_sequence_dim():
    a = BatchedDataDict(ids=torch.tensor([[1, 2]]), routes=torch.ones(1, 2, 3), n=torch.tensor([2]), tag=["a"])
    b = BatchedDataDict(ids=torch.tensor([[3, 4, 5]]), routes=torch.ones(1, 3, 3), n=torch.tensor([3]), tag=["b"])
    out = BatchedDataDict.from_batches([a, BatchedDataDict(), b], pad_value_dict={"ids": -1})
    assert out["ids"].tolist() == [[1, 2, -1], [3, 4, 5]] and out["n"].tolist() == [2, 3] and out["tag"] == ["a", "b"]
    assert out["routes"].shape == (2, 3, 3) and out["routes"][0, 2].eq(0).all()
    with pytest.raises(KeyError, match=r"Key 'n' is missing from non-empty batches \[1\]"):
        BatchedDataDict.from_batches([a, BatchedDataDict(ids=torch.tensor([[1]]))])
    with pytest.raises(PackingError, match=r"its tensors have dims \[1, 2\]"):
        BatchedDataDict.from_batches([{"x": torch.ones(2)}, {"x": torch.ones(1, 2)}])
    with pytest.raises(NotImplementedError, match="Attempted to stack for unsupported type"):
        BatchedDataDict.from_batches([{"x": (1, 2)}])
