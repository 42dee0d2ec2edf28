"""Tier: pure CPU, single process (CP ranks are simulated by patching nn_data.nemo_rl.megatron_data's
get_context_parallel_rank / get_context_parallel_world_size, NeMo-RL's patch points). Newer
megatron-core PackedSeqParams fields are simulated with a stand-in class.

NeMo-RL HEAD's arguments: model_slices_context_parallel_inputs (the model gets the full THD row),
delegate_mtp_loss_mask_to_model, the media-token validity mask, get_packed_seq_cp_partition_indices,
and the host-sync budget of those paths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from nn_data.nemo_rl import megatron_data as md
from nn_data import megatron_parallel
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.diagnostics import HostSyncCounter
from nn_data.errors import PackingError
from nn_data.testing.reference import reference_pack, reference_shard
from nn_data.testing.coded import coded_batch

LENGTHS, S, M, FULL = [12, 3, 8, 1], 12, 4, 40  # padded segments 12, 4, 8, 16 (the last absorbs the slack)


def _batch(routed=True, mtp=True, media=True):
    data = BatchedDataDict(input_ids=coded_batch(LENGTHS, S), input_lengths=torch.tensor(LENGTHS))
    if routed:
        data["routed_experts"] = coded_batch(LENGTHS, S, (2, 3))
    if mtp:
        data["mtp_loss_mask"] = (coded_batch(LENGTHS, S) % 3 != 0).float()
    if media:
        data["media_token_validity_mask"] = coded_batch(LENGTHS, S) % 2 == 1
    return data


@pytest.fixture
def cp(monkeypatch):
    def set_cp(rank, size=2):
        monkeypatch.setattr(md, "get_context_parallel_rank", lambda: rank)
        monkeypatch.setattr(md, "get_context_parallel_world_size", lambda: size)
    return set_cp


@dataclasses.dataclass
class NewerPackedSeqParams:
    """Field names of a megatron-core newer than 0.16.1 (total_tokens, pad_between_seqs, ...)."""

    qkv_format: str = None
    cu_seqlens_q: Any = None
    cu_seqlens_kv: Any = None
    cu_seqlens_q_padded: Any = None
    cu_seqlens_kv_padded: Any = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    local_cp_size: int = None
    cp_group: Any = None
    total_tokens: int = None
    seq_idx: Any = None
    pad_between_seqs: bool = None


@pytest.fixture
def newer_mcore(monkeypatch):
    monkeypatch.setattr(megatron_parallel, "packed_seq_params_class", lambda: NewerPackedSeqParams)
    yield


def _process(data, **kw):
    return md.process_microbatch(data, "input_lengths", M, 1, FULL, pack_sequences=True, **kw)


# ---- model_slices_context_parallel_inputs ----------------------------------------------------

@pytest.mark.parametrize("rank", [0, 1])
def test_model_slicing_hands_the_model_the_full_row(cp, rank):
    cp(rank)
    data = _batch()
    out = _process(data, model_slices_context_parallel_inputs=True)
    ref = reference_pack(data["input_ids"], LENGTHS, M, 1, FULL)
    assert torch.equal(out.input_ids, ref.packed) and out.input_ids_cp_sharded is out.input_ids  # [1, T]
    mtp = reference_pack(data["mtp_loss_mask"], LENGTHS, M, 1, FULL).packed
    assert torch.equal(out.mtp_loss_mask, mtp)  # full, lined up with the full ids
    media = reference_pack(data["media_token_validity_mask"].long(), LENGTHS, M, 1, FULL).packed.bool()
    assert out.media_token_validity_mask.dtype == torch.bool and torch.equal(out.media_token_validity_mask, media)
    routes = reference_pack(data["routed_experts"], LENGTHS, M, 1, FULL, fill=torch.arange(3)).packed
    assert torch.equal(out.routed_experts, routes)  # routes stay CP-local: the model's own partition
    assert torch.equal(out.routed_experts_cp_sharded, reference_shard(routes, ref.cu_seqlens_padded, 2, rank))
    params = out.packed_seq_params
    assert torch.equal(params.cu_seqlens_q, ref.cu_seqlens) and torch.equal(params.cu_seqlens_kv, ref.cu_seqlens)
    assert torch.equal(params.cu_seqlens_q_padded, ref.cu_seqlens_padded) and params.max_seqlen_q == 16
    if "total_tokens" in megatron_parallel.packed_seq_params_fields():  # megatron-core 0.17 and newer
        assert params.total_tokens == FULL and params.pad_between_seqs is True  # the full row, padding inside
    else:  # 0.16.x: the field is detected, not assumed
        assert not hasattr(params, "total_tokens")


def test_without_model_slicing_everything_is_cp_local(cp):
    cp(1)
    data = _batch()
    out = _process(data)
    ref = reference_pack(data["input_ids"], LENGTHS, M, 1, FULL)
    local = reference_shard(ref.packed, ref.cu_seqlens_padded, 2, 1)
    assert torch.equal(out.input_ids_cp_sharded, local) and out.input_ids_cp_sharded.shape == (1, 20)
    media = reference_pack(data["media_token_validity_mask"].long(), LENGTHS, M, 1, FULL).packed.bool()
    assert torch.equal(out.media_token_validity_mask, reference_shard(media, ref.cu_seqlens_padded, 2, 1))
    assert torch.equal(out.packed_seq_params.cu_seqlens_q, ref.cu_seqlens_padded)  # one boundary set


@pytest.mark.parametrize("model_slices, total", [(True, 40), (False, 20)])
def test_newer_fields_are_filled_where_megatron_core_has_them(cp, newer_mcore, model_slices, total):
    cp(0)
    out = _process(_batch(), model_slices_context_parallel_inputs=model_slices)
    assert out.packed_seq_params.total_tokens == total  # full row for the model, else the local shard
    assert out.packed_seq_params.pad_between_seqs is (True if model_slices else None)


@pytest.mark.parametrize("lengths, multiple, expected", [([3], 4, True), ([4], 4, False), ([4, 4], 4, False)])
def test_pad_between_seqs_marks_any_padding(cp, newer_mcore, lengths, multiple, expected):
    cp(0)
    data = BatchedDataDict(input_ids=coded_batch(lengths, 4), input_lengths=torch.tensor(lengths))
    out = md.process_microbatch(data, "input_lengths", multiple, pack_sequences=True,
                                model_slices_context_parallel_inputs=True)
    assert out.packed_seq_params.pad_between_seqs is expected


def test_model_slicing_shards_routes_and_identities_by_the_partition_indices(cp, monkeypatch):
    """With the model slicing CP itself, the routes' CP share is the full row at the model's own indices
    (get_packed_seq_cp_partition_indices of the microbatch's PackedSeqParams), and the R3 verifier matches
    each of this rank's valid tokens to its source row and position."""
    cp(1)
    monkeypatch.setenv("NN_DATA_R3_VERIFY", "1")
    checked = []
    real_verify = md._verify_r3_trace_cp_token_alignment
    monkeypatch.setattr(md, "_verify_r3_trace_cp_token_alignment", lambda **kw: checked.append(real_verify(**kw)))
    out = _process(_batch(), model_slices_context_parallel_inputs=True)
    index = md.get_packed_seq_cp_partition_indices(out.packed_seq_params, total_tokens=FULL, cp_size=2, cp_rank=1,
                                                   device=out.input_ids.device)
    assert checked == [12]  # rank 1's valid tokens, each matched to its source row and position
    assert out.routed_experts_cp_sharded.shape == (1, 20, 2, 3)
    assert torch.equal(out.routed_experts_cp_sharded, out.routed_experts.index_select(1, index))


# ---- get_packed_seq_cp_partition_indices ------------------------------------------------------

def _params(bounds):
    b = torch.tensor(bounds, dtype=torch.int32)
    return NewerPackedSeqParams(cu_seqlens_q=b, cu_seqlens_q_padded=b)


@pytest.mark.parametrize("rank, expected", [(0, [0, 3, 4, 7]), (1, [1, 2, 5, 6])])
def test_partition_indices_worked_example(rank, expected):
    got = md.get_packed_seq_cp_partition_indices(_params([0, 4, 8]), total_tokens=8, cp_size=2, cp_rank=rank,
                                                 device="cpu")
    assert got.tolist() == expected and got.dtype == torch.int64


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_partition_indices_equal_the_loop_shard_of_positions(cp_size):
    gen = torch.Generator().manual_seed(cp_size)
    for _ in range(5):
        segs = (torch.randint(0, 4, (5,), generator=gen) * 2 * cp_size).tolist()
        bounds = [0] + torch.tensor(segs).cumsum(0).tolist()
        positions = torch.arange(bounds[-1]).view(1, -1)
        for rank in range(cp_size):
            got = md.get_packed_seq_cp_partition_indices(_params(bounds), total_tokens=bounds[-1], cp_size=cp_size,
                                                         cp_rank=rank, device="cpu")
            assert torch.equal(got, reference_shard(positions, bounds, cp_size, rank)[0])


class _Group:
    def size(self):
        return 2

    def rank(self):
        return 0


@pytest.mark.parametrize("kw, match", [
    (dict(cp_rank=2), r"cp_rank=2 is invalid; expected an int in \[0, 2\)"),
    (dict(total_tokens=6), r"the packed length T=6 is not a multiple of 2\*cp_size=4"),
    (dict(cp_rank=1, cp_group=_Group()), r"group has rank 0 and size 2, but rank 1 and size 2 were requested"),
])
def test_partition_indices_errors(kw, match):
    args = {**dict(total_tokens=8, cp_size=2, cp_rank=0, device="cpu"), **kw}
    with pytest.raises(PackingError, match=match):
        md.get_packed_seq_cp_partition_indices(_params([0, 4, 8]), **args)
    with pytest.raises(ValueError, match=r"segment 0 of cu_seqlens_padded is 2 tokens long"):
        md.get_packed_seq_cp_partition_indices(_params([0, 2, 8]), total_tokens=8, cp_size=2, cp_rank=0, device="cpu")


# ---- delegate_pack_to_model and the MTP mask; the media mask on the other paths ---------------

def test_self_packing_model_must_claim_the_mtp_mask():
    data = _batch(routed=False, media=False)
    with pytest.raises(AssertionError, match=r"^MTP training requires a self-packing VLM that advertises "
                                             r"model_owns_mtp_loss_mask_packing \(the batch has an mtp_loss_mask"):
        _process(data, delegate_pack_to_model=True)
    out = _process(data, delegate_pack_to_model=True, delegate_mtp_loss_mask_to_model=True)
    assert out.mtp_loss_mask.shape == out.input_ids_cp_sharded.shape == (4, 16)
    assert torch.equal(out.mtp_loss_mask[:, :12], data["mtp_loss_mask"] * out.attention_mask[:, :12])
    assert out.mtp_loss_mask[:, 12:].eq(0).all()
    assert _process(_batch(routed=False, mtp=False, media=False), delegate_pack_to_model=True).mtp_loss_mask is None


def test_self_packing_model_refuses_the_media_mask():
    with pytest.raises(NotImplementedError, match="media_token_validity_mask is not supported for models that pack"):
        _process(_batch(routed=False, mtp=False), delegate_pack_to_model=True)


def test_unpacked_path_passes_the_media_mask_as_bool():
    data = _batch(routed=False)
    data["media_token_validity_mask"] = data["media_token_validity_mask"].long()
    out = md.process_microbatch(data)
    assert out.media_token_validity_mask.dtype == torch.bool
    assert torch.equal(out.media_token_validity_mask, data["media_token_validity_mask"].bool())


# ---- one host sync per microbatch on every packed path ----------------------------------------

@pytest.mark.parametrize("model_slices", [False, True])
def test_every_tensor_of_a_microbatch_costs_one_sync(cp, monkeypatch, model_slices):
    monkeypatch.delenv("NN_DATA_R3_VERIFY", raising=False)
    cp(1)
    data = _batch()
    _process(data, model_slices_context_parallel_inputs=model_slices)  # warm caches
    with HostSyncCounter() as counter:
        for _ in range(3):
            _process(data, model_slices_context_parallel_inputs=model_slices)
    assert counter.count == 3, counter.calls


@pytest.mark.parametrize("model_slices", [False, True])
def test_every_tensor_of_a_microbatch_rides_one_graph_run(cp, monkeypatch, model_slices):
    from nn_data.nemo_rl.megatron_data import packed

    cp(0)
    runs = []
    real = packed.pack_microbatch  # process_microbatch's one explicit packing call

    def recorded(*args, **kw):
        runs.append(sorted(k for k, v in kw["extras"].items() if v is not None))
        return real(*args, **kw)

    monkeypatch.setattr(packed, "pack_microbatch", recorded)
    _process(_batch(), model_slices_context_parallel_inputs=model_slices)
    assert runs == [["media_token_validity_mask", "mtp_loss_mask", "routed_experts"]]  # ids + all companions, once
