"""Tier: pure CPU, single process (the gloo all-reduce runs in
tests/multiprocess/test_megatron_distributed.py).

get_microbatch_iterator / make_processed_microbatch_iterator (packing, dynamic, fixed; the
device choice; cfg["nn_data"] options) and process_global_batch in a single process.
"""

from __future__ import annotations

import enum

import pytest
import torch

from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.errors import PackingError
from nn_data.nemo_rl.megatron_data import (
    PackOptions,
    ProcessedMicrobatch,
    get_microbatch_iterator,
    make_processed_microbatch_iterator,
    process_global_batch,
)
from nn_data.nemo_rl.megatron_data.iterators import resolve_device
from nn_data.testing.coded import coded_batch
from nn_data.testing.reference import reference_pack
from tests.support.megatron_config import megatron_cfg

LENGTHS, S = [5, 9, 3, 4, 6, 1], 12


def _data():
    return BatchedDataDict(input_ids=coded_batch(LENGTHS, S), input_lengths=torch.tensor(LENGTHS),
                           sample_mask=torch.tensor([1.0, 1, 0, 1, 1, 1]),
                           token_mask=(coded_batch(LENGTHS, S) > 0).float())


def _cfg(packing=False, dynamic=False, pp=1, nn_data=None):
    cfg = {"sequence_packing": {"enabled": packing}, "dynamic_batching": {"enabled": dynamic},
           "megatron_cfg": megatron_cfg(pp=pp), "make_sequence_length_divisible_by": 4}
    if nn_data is not None:
        cfg["nn_data"] = nn_data
    return cfg


def test_packing_iterator_yields_one_packed_microbatch_per_bin():
    planned, _ = _data().plan_sequence_packing(16, sequence_length_pad_multiple=4)
    it, n, mbs, seq_dim, padded = get_microbatch_iterator(planned, _cfg(packing=True, pp=2), 99, None)
    assert (n, mbs, seq_dim, padded) == (3, 1, 12, 16)  # PP 2: pad_full_seq_to = longest bin = 16
    seen = []
    for mb, (start, end) in zip(it, planned.micro_batch_indices[0]):
        assert isinstance(mb, ProcessedMicrobatch)
        lengths = planned["input_lengths"][start:end].tolist()
        ref = reference_pack(planned["input_ids"][start:end], lengths, 4, 1, 16)
        assert torch.equal(mb.input_ids, ref.packed) and torch.equal(mb.cu_seqlens_padded, ref.cu_seqlens_padded)
        assert mb.data_dict["input_lengths"].tolist() == lengths and mb.attention_mask is None
        seen += lengths
    assert sorted(seen) == sorted(LENGTHS)


def test_packing_iterator_without_pipeline_parallelism_has_no_fixed_length():
    planned, _ = _data().plan_sequence_packing(16, sequence_length_pad_multiple=4)
    it, n, _, _, padded = get_microbatch_iterator(planned, _cfg(packing=True), 1, None)
    assert padded == 12 and [mb.input_ids.shape[1] for mb in it] == [16, 16, 8]  # natural totals


def test_dynamic_iterator_yields_cut_rows_with_masks():
    planned, _ = _data().plan_dynamic_batching(16, sequence_length_round=4)
    it, n, mbs, seq_dim, padded = get_microbatch_iterator(planned, _cfg(dynamic=True), 2, None)
    assert (n, mbs, seq_dim, padded) == (3, 2, 12, 12)
    shapes = [(mb.input_ids.shape, mb.attention_mask.shape, mb.position_ids.shape) for mb in it]
    assert shapes == [((3, 4), (1, 1, 4, 4), (3, 4)), ((2, 8), (1, 1, 8, 8), (2, 8)),
                      ((1, 12), (1, 1, 12, 12), (1, 12))]


def test_fixed_size_iterator():
    it, n, mbs, _, padded = get_microbatch_iterator(_data(), _cfg(), 2, None)
    assert (n, mbs, padded) == (3, 2, 12)
    rows = [mb.input_ids for mb in it]
    assert torch.equal(torch.cat(rows), _data()["input_ids"]) and rows[0].shape == (2, 12)
    with pytest.raises(PackingError, match=r"mbs=0 is invalid"):
        get_microbatch_iterator(_data(), _cfg(), 0, None)


def test_iterator_moves_each_microbatch_to_the_chosen_device():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert torch.device(resolve_device()).type == expected  # default: "cuda" (NeMo-RL's string) when available
    assert resolve_device(None, {"nn_data": {"device": "meta"}}).type == "meta"
    assert resolve_device("cpu", {"nn_data": {"device": "meta"}}).type == "cpu"  # the argument wins
    it = make_processed_microbatch_iterator(iter([_data()]), _cfg(), None, 1, 1, None, None, device="cpu")
    mb = next(it)
    assert mb.input_ids.device.type == "cpu" and mb.data_dict["sample_mask"].device.type == "cpu"


def test_cfg_nn_data_section_becomes_pack_options(monkeypatch):
    from nn_data.nemo_rl import megatron_data

    captured = []
    real = megatron_data.process_microbatch
    monkeypatch.setattr(megatron_data, "process_microbatch",
                        lambda **kw: captured.append(kw["options"]) or real(**kw))
    planned, _ = _data().plan_sequence_packing(16, sequence_length_pad_multiple=4)
    cfg = _cfg(packing=True, nn_data={"buckets": [32, 64], "device": "cpu"})
    it, *_ = get_microbatch_iterator(planned, cfg, 1, None)
    assert [mb.input_ids.shape[1] for mb in it] == [32, 32, 32]  # every T rounded up to the 32 bucket
    assert captured[0] == PackOptions(buckets=(32, 64))
    with pytest.raises(PackingError, match=r"buckets='auto' is invalid"):
        PackOptions(buckets="auto")


@pytest.mark.parametrize("key, near", [("compiled", "compile"), ("rollout_trees", "rollout_tree"),
                                       ("kv_capcity", "kv_capacity"), ("pad_full_seq", "pad_full_seq_to")])
def test_an_unknown_nn_data_key_is_refused_naming_the_nearest(key, near):
    with pytest.raises(PackingError, match=rf"cfg\['nn_data'\] has an unknown key '{key}' \(did you mean '{near}'\?\);"
                                           r" valid keys: \['backend', 'buckets', 'compile', 'device', "):
        PackOptions.from_cfg({"nn_data": {"device": "cpu", key: 1}})


def test_nemo_rls_own_cfg_keys_pass_untouched():
    """Only ``cfg["nn_data"]`` is nn_data's: the rest of NeMo-RL's policy config is read as NeMo-RL reads it."""
    planned, _ = _data().plan_sequence_packing(16, sequence_length_pad_multiple=4)
    cfg = _cfg(packing=True, nn_data={"device": "cpu"})
    cfg["a_key_only_nemo_rl_knows"] = {"anything": 1}
    cfg["sequence_packing"]["another_one"] = 2
    it, *_ = get_microbatch_iterator(planned, cfg, 1, None)
    assert len(list(it)) == 3 and PackOptions.from_cfg(cfg) == PackOptions() == PackOptions.from_cfg({})


class LossType(enum.Enum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class Loss:
    def __init__(self, loss_type):
        self.loss_type = loss_type


def test_process_global_batch_without_distributed():
    data = _data()
    out = process_global_batch(data, Loss(LossType.TOKEN_LEVEL), None, batch_idx=1, batch_size=3)
    assert out["batch"]["input_lengths"].tolist() == [4, 6, 1]
    assert out["global_valid_seqs"].item() == 3.0
    assert out["global_valid_toks"].item() == (4 - 1) + (6 - 1) + 0  # token_mask[:, 1:] on the kept rows
    del data["token_mask"]
    out = process_global_batch(data, Loss(LossType.SEQUENCE_LEVEL), None, batch_idx=0, batch_size=3)
    assert out["global_valid_seqs"].item() == 2.0 and out["global_valid_toks"].item() == 2.0 * 12


def test_process_global_batch_errors():
    data = _data()
    del data["token_mask"]
    with pytest.raises(AssertionError, match="token_mask must be present in the data when using token-level loss"):
        process_global_batch(data, Loss(LossType.TOKEN_LEVEL), None, batch_idx=0, batch_size=3)
    del data["sample_mask"]
    with pytest.raises(AssertionError, match="sample_mask must be present in the data"):
        process_global_batch(data, object(), None, batch_idx=0, batch_size=3)


@pytest.mark.parametrize("packing", [True, False])
def test_a_configured_cp_size_the_groups_do_not_have_is_refused_naming_both(packing):
    """cfg says CP 2, parallel_state was never initialised and no pg_collection= was given: refused when the
    iterator is made, naming the configured size and the groups' (before: every rank ran unsharded as CP
    rank 0 of 1)."""
    from types import SimpleNamespace
    from unittest import mock

    data, _ = _data().plan_sequence_packing(16, sequence_length_pad_multiple=4)
    cfg = _cfg(packing=packing)
    cfg["megatron_cfg"]["context_parallel_size"] = 2
    message = (r"^cfg\['megatron_cfg'\]\['context_parallel_size'\]=2 but the context-parallel group has 1 rank "
               r"\(megatron-core's parallel_state is not initialised and no pg_collection= was given\); initialise "
               r"parallel_state with context_parallel_size=2, or pass pg_collection=")
    with pytest.raises(PackingError, match=message):
        get_microbatch_iterator(data, cfg, 2, None)
    with pytest.raises(PackingError, match=message):
        make_processed_microbatch_iterator(iter([]), cfg, None, 1, 1, None, None)
    with pytest.raises(PackingError, match=r"=2 but the context-parallel group has 1 rank \(pg_collection.cp\)"):
        get_microbatch_iterator(data, cfg, 2, None, pg_collection=SimpleNamespace(cp=None))
    with mock.patch("nn_data.nemo_rl.megatron_data.get_context_parallel_world_size", return_value=2), \
            mock.patch("nn_data.nemo_rl.megatron_data.get_context_parallel_rank", return_value=1):
        get_microbatch_iterator(data, cfg, 2, None)  # groups of 2 (as parallel_state would say): accepted
