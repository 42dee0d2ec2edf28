"""Tier: pure CPU, single process (torch.distributed is not initialised; all_reduce is patched
where a group is given).

Drop-in behaviour of nn_data.nemo_rl.megatron_data for code written against NeMo-RL: helpers patched
as nn_data.nemo_rl.megatron_data.X reach the calls NeMo-RL's module makes at that level (the packed branch
is one packing call), any mapping NeMo-RL passes is read as NeMo-RL reads it
(a BatchedDataDict stand-in with NeMo-RL's methods only), NeMo-RL's error wording and classes,
process_global_batch's all-reduce and the iterators' default device.
"""

from __future__ import annotations

from collections import UserDict
from unittest import mock

import pytest
import torch

from nn_data.nemo_rl import megatron_data as md
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.errors import PackingError
from nn_data.testing.reference import reference_pack, reference_shard
from nn_data.testing.coded import coded_batch
from tests.support.megatron_config import megatron_cfg

LENGTHS, S = [5, 9, 3, 4, 6, 1], 12


def _data(cls=BatchedDataDict):
    return cls(input_ids=coded_batch(LENGTHS, S), input_lengths=torch.tensor(LENGTHS),
               sample_mask=torch.tensor([1.0, 1, 0, 1, 1, 1]), token_mask=(coded_batch(LENGTHS, S) > 0).float())


def _cfg(packing=False, dynamic=False, pp=1):
    return {"sequence_packing": {"enabled": packing}, "dynamic_batching": {"enabled": dynamic},
            "megatron_cfg": megatron_cfg(pp=pp), "make_sequence_length_divisible_by": 4}


# ---- patches of nn_data.nemo_rl.megatron_data.X reach the calls ----------------------------------------

def test_the_packed_path_is_one_packing_call_whatever_is_patched():
    """The ids, the MTP mask and the routes are packed on one layout; NeMo-RL's per-tensor helpers are
    not called (docs/nemo-rl.md lists NeMo-RL's tests that assert on those calls)."""
    data = BatchedDataDict(input_ids=coded_batch([3, 2], 4), input_lengths=torch.tensor([3, 2]),
                           routed_experts=coded_batch([3, 2], 4, (2, 3)), mtp_loss_mask=torch.ones(2, 4))
    with mock.patch("nn_data.nemo_rl.megatron_data._pack_sequences_for_megatron", wraps=md._pack_sequences_for_megatron) \
            as pack, mock.patch("nn_data.nemo_rl.megatron_data._shard_routed_experts_for_cp",
                                wraps=md._shard_routed_experts_for_cp) as shard:
        out = md.process_microbatch(data, "input_lengths", 2, pack_sequences=True)
    assert pack.call_count == 0 and shard.call_count == 0
    assert torch.equal(out.input_ids, reference_pack(data["input_ids"], [3, 2], 2).packed)
    assert torch.equal(out.mtp_loss_mask, reference_pack(data["mtp_loss_mask"], [3, 2], 2).packed)
    assert torch.equal(out.routed_experts[0, :3], data["routed_experts"][0, :3])


def test_the_packed_path_asks_the_patched_cp_getters():
    data = {"input_ids": coded_batch([3, 5], 8), "input_lengths": torch.tensor([3, 5])}
    with mock.patch("nn_data.nemo_rl.megatron_data.get_context_parallel_world_size", return_value=2), \
            mock.patch("nn_data.nemo_rl.megatron_data.get_context_parallel_rank", return_value=1):
        out = md.process_microbatch(data, "input_lengths", 4, pack_sequences=True)
    ref = reference_pack(data["input_ids"], [3, 5], 4)
    assert torch.equal(out.input_ids, ref.packed)
    assert torch.equal(out.input_ids_cp_sharded, reference_shard(ref.packed, ref.cu_seqlens_padded, 2, 1))


def test_unpacked_path_and_iterators_call_the_patched_helpers():
    masks = (torch.zeros(1, 1, S, S, dtype=torch.bool), None, torch.zeros(6, S, dtype=torch.long))
    with mock.patch("nn_data.nemo_rl.megatron_data.get_ltor_masks_and_position_ids", return_value=masks) as ltor:
        assert md.process_microbatch(_data()).attention_mask is masks[0]
    ltor.assert_called_once()
    with mock.patch("nn_data.nemo_rl.megatron_data.process_microbatch", wraps=md.process_microbatch) as proc, \
            mock.patch("nn_data.nemo_rl.megatron_data.get_and_validate_seqlen", return_value=(1, 99)) as seqlen, \
            mock.patch("nn_data.nemo_rl.megatron_data._get_pack_sequence_parameters_for_megatron",
                       return_value=(4, 1, 16)) as params:
        planned, _ = _data().plan_sequence_packing(16, sequence_length_pad_multiple=4)
        it, n, _, seq_dim, padded = md.get_microbatch_iterator(planned, _cfg(packing=True), 1, None)
        assert [mb.input_ids.shape for mb in it] == [(1, 16)] * n
    assert (seq_dim, padded) == (99, 16) and seqlen.call_count == 1 and params.call_count == 1
    assert proc.call_count == n and proc.call_args.kwargs["model_slices_context_parallel_inputs"] is False


def test_patching_after_import_and_undoing_it():
    original = md._prepare_vlm_batch_for_megatron
    with mock.patch("nn_data.nemo_rl.megatron_data._prepare_vlm_batch_for_megatron", side_effect=RuntimeError("patched")):
        with pytest.raises(RuntimeError, match="patched"):
            md.process_microbatch(_data(), "input_lengths", pack_sequences=True, delegate_pack_to_model=True)
    assert md._prepare_vlm_batch_for_megatron is original
    out = md.process_microbatch(_data(), "input_lengths", pack_sequences=True, delegate_pack_to_model=True)
    assert out.attention_mask.shape == (6, 9)


# ---- mappings NeMo-RL passes -------------------------------------------------------------------

class ItemsOnly:
    """A mapping stand-in with only __getitem__ and items(): no __contains__, no keys()."""

    def __init__(self, **values):
        self._values = values

    def __getitem__(self, key):
        return self._values[key]

    def items(self):
        return self._values.items()


# NeMo-RL's BatchedDataDict's public methods (nemo_rl/distributed/batched_data_dict.py): a stand-in
# with these names and no more must drive every function as nn_data's own class does.
NEMO_RL_METHODS = {"from_batches", "all_gather", "chunk", "reorder_data", "shard_by_batch_size", "get_batch", "slice",
                   "repeat_interleave", "truncate_tensors", "make_microbatch_iterator_with_dynamic_shapes",
                   "get_microbatch_iterator_dynamic_shapes_len", "make_microbatch_iterator_for_packable_sequences",
                   "get_microbatch_iterator_for_packable_sequences_len", "make_microbatch_iterator", "size", "to",
                   "select_indices", "get_dict", "get_multimodal_dict"}


class NemoStyleDict(UserDict):
    """A BatchedDataDict written to NeMo-RL's interface (a subset of its methods), not nn_data's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.micro_batch_indices = self.micro_batch_lengths = self.elem_counts_per_gb = None

    @property
    def size(self):
        return next(iter(self.data.values())).shape[0] if self.data else 0

    def to(self, device):
        self.data = {k: v.to(device) if torch.is_tensor(v) else v for k, v in self.data.items()}
        return self

    def slice(self, start, end):
        return NemoStyleDict({k: v[start:end] for k, v in self.data.items()})

    def get_batch(self, batch_idx, batch_size=None):
        return self.slice(batch_idx * batch_size, (batch_idx + 1) * batch_size)

    def make_microbatch_iterator(self, microbatch_size):
        return (self.slice(i, i + microbatch_size) for i in range(0, self.size, microbatch_size))

    def make_microbatch_iterator_for_packable_sequences(self):
        return (self.slice(a, b) for a, b in self.micro_batch_indices[0])

    def get_microbatch_iterator_for_packable_sequences_len(self):
        return len(self.micro_batch_indices[0]), max(self.micro_batch_lengths[0])


def test_the_stand_in_has_only_nemo_rl_methods():
    own = {n for n in vars(NemoStyleDict) if not n.startswith("_")}
    assert own <= NEMO_RL_METHODS


@pytest.mark.parametrize("packing", [False, True])
def test_iterators_walk_a_nemo_rl_style_dict(packing):
    ours = _data()
    if packing:
        ours, _ = ours.plan_sequence_packing(16, sequence_length_pad_multiple=4)
    theirs = NemoStyleDict(ours.data)
    theirs.micro_batch_indices, theirs.micro_batch_lengths = ours.micro_batch_indices, ours.micro_batch_lengths
    got = md.get_microbatch_iterator(theirs, _cfg(packing=packing, pp=2), 2, None, device="cpu")
    want = md.get_microbatch_iterator(ours, _cfg(packing=packing, pp=2), 2, None, device="cpu")
    assert got[1:] == want[1:]
    for a, b in zip(got[0], want[0]):
        assert isinstance(a.data_dict, NemoStyleDict) and torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.input_ids_cp_sharded, b.input_ids_cp_sharded)
    result = md.process_global_batch(theirs, None, None, batch_idx=0, batch_size=6)
    assert result["global_valid_seqs"].item() == 5
    assert result["global_valid_toks"].item() == 4 + 8 + 3 + 5  # L - 1 per kept row


def test_get_and_validate_seqlen_reads_items_only():
    assert md.get_and_validate_seqlen(ItemsOnly(input_ids=torch.zeros(2, 7), lengths=torch.zeros(2))) == (1, 7)
    with pytest.raises(AssertionError, match=r"^Dim 1 must be the sequence dim, expected dim 1=7 but got shape "
                                             r"torch.Size\(\[2, 6\]\) for key logprobs \(input_ids.shape\[1\] = 7"):
        md.get_and_validate_seqlen(ItemsOnly(input_ids=torch.zeros(2, 7), logprobs=torch.zeros(2, 6)))
    with pytest.raises(KeyError, match="input_ids"):
        md.get_and_validate_seqlen(ItemsOnly(tokens=torch.zeros(2, 7)))


def test_process_microbatch_reads_a_plain_dict():
    data = dict(_data())
    out = md.process_microbatch(data, "input_lengths", 4, pack_sequences=True)
    assert torch.equal(out.input_ids, reference_pack(data["input_ids"], LENGTHS, 4).packed)
    with pytest.raises(AssertionError, match=r"^lens not found in data_dict \(keys: \['input_ids'"):
        md.process_microbatch(data, "lens", 4, pack_sequences=True)


# ---- NeMo-RL's messages and classes --------------------------------------------------------------

def test_pack_parameter_message_starts_with_nemo_rl_wording():
    with pytest.raises(PackingError, match=r"^make_sequence_length_divisible_by \(6\) is not a multiple of "
                                           r"minimum_pad_factor \(4\)\.\nPlease set policy\.make_sequence_length"):
        md._get_pack_sequence_parameters_for_megatron(megatron_cfg(cp=2), 6, 100)


def test_routed_experts_without_lengths_keep_nemo_rl_message_and_class():
    data = {"input_ids": coded_batch([2], 4), "routed_experts": coded_batch([2], 4, (2, 3))}
    with pytest.raises(ValueError, match=r"^routed_experts requires input_lengths when sequence packing is disabled "
                                         r"so padding rows can be repaired before router replay\."):
        md.process_microbatch(data)


# ---- process_global_batch and the iterators' device ----------------------------------------------

def test_global_batch_reduces_over_a_given_group_even_without_init():
    group = object()
    with mock.patch("torch.distributed.all_reduce") as reduce:
        out = md.process_global_batch(_data(), None, group, batch_idx=0, batch_size=3)
    reduce.assert_called_once()
    assert reduce.call_args.kwargs == {"group": group} and reduce.call_args.args[0] is not None
    assert out["global_valid_seqs"].item() == 2  # the patched reduce left the local sums
    with mock.patch("torch.distributed.all_reduce") as reduce:
        md.process_global_batch(_data(), None, None, batch_idx=0, batch_size=3)
    reduce.assert_not_called()  # no group, no torch.distributed: nothing to reduce over
    with pytest.raises(AssertionError, match=r"^sample_mask must be present in the data! \("):
        md.process_global_batch(BatchedDataDict(input_ids=torch.zeros(2, 3)), None, None, batch_idx=0, batch_size=2)


def test_iterator_moves_to_the_string_cuda_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    moved = []

    class Recorder(BatchedDataDict):
        def to(self, device):
            moved.append(device)
            return self  # stays on the CPU: only the argument is under test

    it = md.make_processed_microbatch_iterator(iter([Recorder(_data())]), _cfg(), None, 1, 1, None, None)
    next(it)
    assert moved == ["cuda"]  # NeMo-RL's exact argument
