"""Tier: pure CPU, single process (one compile test with aot_eager counts graphs across steps).

The run-level fixed packed length (cfg["nn_data"]["pad_full_seq_to"], PackOptions.pad_full_seq_to;
run_fixed_total) through the NeMo-RL layer, and shard_by_batch_size's "nn_data_balanced" plan
(nn_data.planning.plan_step).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from nn_data.errors import PackingError
from nn_data.nemo_rl.megatron_data import PackOptions, _pack_sequences_for_megatron, get_microbatch_iterator
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.nemo_rl.megatron_data.graph import reset_compiled
from nn_data.planning import Parallelism, plan_step
from nn_data.testing.coded import coded_batch
from nn_data.testing.reference import reference_pack
from tests.support.megatron_config import megatron_cfg

S = 16


def _cfg(pp=2, cp=1, nn_data=None, m=4):
    cfg = {"sequence_packing": {"enabled": True}, "dynamic_batching": {"enabled": False},
           "megatron_cfg": megatron_cfg(pp=pp, cp=cp), "make_sequence_length_divisible_by": m}
    if nn_data is not None:
        cfg["nn_data"] = nn_data
    return cfg


def _step(lengths, budget=24):
    data = BatchedDataDict(input_ids=coded_batch(lengths, S), input_lengths=torch.tensor(lengths))
    planned, _ = data.plan_sequence_packing(budget, sequence_length_pad_multiple=4)
    return planned


def test_pack_options_carry_the_run_level_length_and_its_rule():
    assert PackOptions.from_cfg({"nn_data": {"pad_full_seq_to": 64}}) == PackOptions(pad_full_seq_to=64)
    options = PackOptions(pad_full_seq_to=64)
    assert options.fixed_total(None) == 64 and options.fixed_total(40) == 64
    assert PackOptions().fixed_total(40) == 40 and PackOptions().fixed_total(None) is None
    with pytest.raises(PackingError, match=r"^pad_packed_seq_to=72 exceeds the run-level packed length "
                                           r"pad_full_seq_to=64 \(cfg\['nn_data'\]\['pad_full_seq_to'\] or "
                                           r"PackOptions\); raise it to at least 72$"):
        options.fixed_total(72, "pad_packed_seq_to")
    with pytest.raises(PackingError, match=r"^pad_full_seq_to=0 is invalid; expected an int >= 1 or None$"):
        PackOptions(pad_full_seq_to=0)
    with pytest.raises(PackingError, match=r"^pad_full_seq_to=64 and buckets='pow2' cannot both be set"):
        PackOptions(pad_full_seq_to=64, buckets="pow2")


def test_the_compat_pack_pads_to_the_run_level_length():
    ids, lengths = coded_batch([5, 3], 8), torch.tensor([5, 3])
    packed, _, params, _, cu_pad = _pack_sequences_for_megatron(ids, lengths, 4, options=PackOptions(pad_full_seq_to=32))
    assert packed.shape == (1, 32) and cu_pad.tolist() == [0, 8, 32]
    assert torch.equal(packed, reference_pack(ids, [5, 3], 4, 1, 32).packed)
    with pytest.raises(PackingError, match=r"^pad_packed_seq_to=40 exceeds the run-level packed length"):
        _pack_sequences_for_megatron(ids, lengths, 4, 1, 40, options=PackOptions(pad_full_seq_to=32))


def test_every_step_gets_the_run_level_length_under_pp():
    steps = [_step([5, 9, 3, 4, 6, 1]), _step([16, 2, 2]), _step([1])]
    nemo = [get_microbatch_iterator(s, _cfg(), 1, None)[4] for s in steps]
    assert nemo == [24, 24, 4]  # NeMo-RL: the step's longest bin, a new packed length per step
    for step in steps:
        it, n, _, _, padded = get_microbatch_iterator(step, _cfg(nn_data={"pad_full_seq_to": 32}), 1, None)
        assert padded == 32
        for mb, (start, end) in zip(it, step.micro_batch_indices[0]):
            ref = reference_pack(step["input_ids"][start:end], step["input_lengths"][start:end].tolist(), 4, 1, 32)
            assert torch.equal(mb.input_ids, ref.packed) and torch.equal(mb.cu_seqlens_padded, ref.cu_seqlens_padded)
    # PP = 1: the run-level length also fixes the shape (NeMo-RL: each microbatch's own total)
    assert get_microbatch_iterator(steps[0], _cfg(pp=1, nn_data={"pad_full_seq_to": 32}), 1, None)[4] == 32
    assert get_microbatch_iterator(steps[0], _cfg(pp=1), 1, None)[4] == S


def test_a_microbatch_longer_than_the_run_level_length_is_refused():
    with pytest.raises(PackingError, match=r"^a planned microbatch holds 24 padded tokens, more than the run-level "
                                           r"cfg\['nn_data'\]\['pad_full_seq_to'\]=16; plan the step with "
                                           r"max_tokens_per_microbatch <= 16 or raise pad_full_seq_to to at least 24$"):
        get_microbatch_iterator(_step([5, 9, 3, 4, 6, 1]), _cfg(nn_data={"pad_full_seq_to": 16}), 1, None)


def test_an_unaligned_run_level_length_is_refused_naming_the_layout():
    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['pad_full_seq_to'\]=30 is not a multiple of 4, the "
                                           r"alignment of this parallelism \(cp=2: sequence_multiple 4, packed_multiple 1\); "
                                           r"choose a multiple of 4, e\.g\. 32$"):
        get_microbatch_iterator(_step([5, 9, 3]), _cfg(cp=2, nn_data={"pad_full_seq_to": 30}), 1, None)


@pytest.mark.compile
def test_a_compiled_stream_keeps_one_graph_across_steps():
    """Three steps with different longest bins: NeMo-RL's step-level length gives one graph per
    length, the run-level length one graph for the run."""
    steps = [_step([5, 9, 3, 4, 6, 1]), _step([16, 2, 2]), _step([1, 1])]
    graphs = {}
    for name, section in (("step", {}), ("run", {"pad_full_seq_to": 32})):
        torch._dynamo.reset()
        reset_compiled()
        counter = CompileCounterWithBackend("aot_eager")
        cfg = _cfg(nn_data={"compile": True, "row_capacity": 8, "backend": counter, **section})
        for step in steps:
            for mb in get_microbatch_iterator(step, cfg, 1, None)[0]:
                assert mb.input_ids.shape[1] == (32 if name == "run" else mb.input_ids.shape[1])
        graphs[name] = counter.frame_count
    torch._dynamo.reset()
    reset_compiled()
    assert graphs == {"step": 2, "run": 1}  # step-level lengths 24, 24, 4


# ---- shard_by_batch_size(..., algorithm="nn_data_balanced") -----------------------------------------

def _pack_args(**extra):
    return {"max_tokens_per_microbatch": 32, "input_key": "input_ids", "input_lengths_key": "input_lengths",
            "algorithm": "nn_data_balanced", "sequence_length_pad_multiple": 4, **extra}


LENGTHS = [16, 3, 12, 1, 7, 9, 2, 5, 16, 4, 11, 6]


def _data(lengths=LENGTHS):
    return BatchedDataDict(input_ids=coded_batch(lengths, S), input_lengths=torch.tensor(lengths),
                           names=[f"s{i}" for i in range(len(lengths))])


def test_balanced_sharding_is_plan_step_with_the_same_plan_attributes():
    shards, order = _data().shard_by_batch_size(2, batch_size=6, sequence_packing_args=_pack_args(hidden_size=2))
    parallelism = Parallelism(dp=2, make_sequence_length_divisible_by=4)
    plans = [plan_step(LENGTHS[c:c + 6], parallelism, pad_full_seq_to=32, hidden_size=2) for c in (0, 6)]
    assert sorted(order) == list(range(12))
    for r, shard in enumerate(shards):
        rows = [c * 6 + i for c, plan in enumerate(plans) for mb in plan.ranks[r] for i in mb]
        assert shard["names"] == [f"s{i}" for i in rows]
        assert shard.micro_batch_lengths == [plan.microbatch_tokens[r] for plan in plans]
        assert [len(c) for c in shard.micro_batch_indices] == [plan.microbatches_per_rank for plan in plans]
        assert shard.elem_counts_per_gb == [sum(map(len, plan.ranks[r])) for plan in plans]
        for g, plan in enumerate(plans):
            batch = shard.get_batch(g)
            for (start, end), mb in zip(batch.micro_batch_indices[0], plan.ranks[r]):
                assert batch["input_lengths"][start:end].tolist() == [LENGTHS[g * 6 + i] for i in mb]
    assert order == [c * 6 + i for r in range(2) for c, plan in enumerate(plans) for mb in plan.ranks[r] for i in mb]


def test_balanced_sharding_round_trips_through_the_iterator_and_reorder():
    shards, order = _data().shard_by_batch_size(3, sequence_packing_args=_pack_args(microbatch_order="largest_first"))
    assert len({len(s.micro_batch_indices[0]) for s in shards}) == 1  # the same count on every rank
    for shard in shards:
        assert shard.micro_batch_lengths[0] == sorted(shard.micro_batch_lengths[0], reverse=True)
        it, n, _, _, padded = get_microbatch_iterator(shard.get_batch(0), _cfg(nn_data={"pad_full_seq_to": 32}), 1, None)
        assert padded == 32 and [mb.input_ids.shape for mb in it] == [(1, 32)] * n
    merged = BatchedDataDict.from_batches(shards)
    merged.reorder_data(order)
    assert merged["names"] == [f"s{i}" for i in range(12)] and merged["input_lengths"].tolist() == LENGTHS


def test_balanced_sharding_takes_a_parallelism():
    parallelism = Parallelism(dp=2, cp=2)
    shards, _ = _data().shard_by_batch_size(2, sequence_packing_args=_pack_args(parallelism=parallelism))
    assert all(load % 4 == 0 for s in shards for load in s.micro_batch_lengths[0])


@pytest.mark.parametrize("extra, match", [
    (dict(parallelism=Parallelism(dp=4)), r"parallelism'\]=Parallelism\(dp=4.* is invalid; expected a "
                                                 r"Parallelism with dp=2 \(the shards\)"),
    (dict(parallelism=Parallelism(dp=2, make_sequence_length_divisible_by=8)),
     r"pads sequences to a multiple of 8, but sequence_length_pad_multiple=4; give one value"),
    (dict(parallelism=Parallelism(dp=2, cp=4)), r"make_sequence_length_divisible_by \(4\) is not a multiple of "
                                                       r"minimum_pad_factor \(8\)"),
    (dict(parallelism=Parallelism(dp=2, fp8_recipe="tensorwise")),
     r"^max_tokens_per_microbatch=32 is not a multiple of 16"),
    (dict(balance="rows"), r"^balance='rows' is invalid"),
    (dict(microbatches_per_rank=1), r"^microbatches_per_rank=1 cannot hold the step"),
])
def test_balanced_sharding_refusals(extra, match):
    args = _pack_args(**extra)
    if "parallelism" in extra and extra["parallelism"].fp8_recipe:
        args["max_tokens_per_microbatch"] = 40
        match = match.replace("=32", "=40")
    with pytest.raises(PackingError, match=match):
        _data().shard_by_batch_size(2, sequence_packing_args=args)
