"""Tier: pure CPU, single process (imports megatron-core for PackedSeqParams).

nn_data.nemo_rl.megatron_data packing helpers on worked examples: values, PackedSeqParams, the
parameter table, unpacking, and every error path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nn_data import megatron_parallel
from nn_data.errors import PackingError
from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.nemo_rl.megatron_data import (
    _get_pack_sequence_parameters_for_megatron,
    _pack_sequences_for_megatron,
    _unpack_sequences_from_megatron,
    get_and_validate_seqlen,
)
from nn_data.testing.coded import PAD, coded_batch
from tests.support.megatron_config import megatron_cfg


def _pack(lengths, seq_len, *args, **kwargs):
    ids = coded_batch(lengths, seq_len)
    return ids, _pack_sequences_for_megatron(ids, torch.tensor(lengths), *args, **kwargs)


def _seq(b, n):
    return [1000 * b + t + 1 for t in range(n)]


def test_lengths_8_5_7_align_4():
    _, (packed, local, params, cu, cu_pad) = _pack([8, 5, 7], 8, 4)
    assert cu.tolist() == [0, 8, 13, 20] and cu.dtype == torch.int32
    assert cu_pad.tolist() == [0, 8, 16, 24] and cu_pad.dtype == torch.int32
    assert packed.tolist() == [_seq(0, 8) + _seq(1, 5) + [0] * 3 + _seq(2, 7) + [0]]
    assert local is packed  # CP 1: the local tensor is the packed one
    assert params.max_seqlen_q == params.max_seqlen_kv == 8


@pytest.mark.parametrize("align, bounds, max_seqlen", [(4, [0, 12, 16, 24, 28], 12), (8, [0, 16, 24, 32, 40], 16)])
def test_lengths_12_3_8_1(align, bounds, max_seqlen):
    _, (packed, _, params, cu, cu_pad) = _pack([12, 3, 8, 1], 12, align)
    assert cu.tolist() == [0, 12, 15, 23, 24]
    assert cu_pad.tolist() == bounds
    expected = [0] * bounds[-1]
    for b, n in enumerate([12, 3, 8, 1]):
        expected[bounds[b]: bounds[b] + n] = _seq(b, n)
    assert packed.tolist() == [expected]
    assert params.max_seqlen_q == max_seqlen


def test_lengths_3_0_2_nothing_padded_is_a_copy():
    _, (packed, _, params, cu, cu_pad) = _pack([3, 0, 2], 4)
    assert cu.tolist() == cu_pad.tolist() == [0, 3, 3, 5]
    assert cu_pad.data_ptr() != cu.data_ptr()  # a copy, not the same storage
    assert packed.tolist() == [_seq(0, 3) + _seq(2, 2)]
    assert params.max_seqlen_q == 3


def test_lengths_3_0_2_align_4_empty_sequence_keeps_a_zero_segment():
    _, (packed, _, params, _, cu_pad) = _pack([3, 0, 2], 4, 4)
    assert cu_pad.tolist() == [0, 4, 4, 8]
    assert packed.tolist() == [_seq(0, 3) + [0] + _seq(2, 2) + [0, 0]]
    assert params.max_seqlen_q == 4


def test_packed_multiple_extends_the_last_sequence():
    _, (packed, _, params, _, cu_pad) = _pack([8, 5, 7], 8, 1, 16)
    assert cu_pad.tolist() == [0, 8, 13, 32]
    assert packed.shape == (1, 32) and packed[0, 20:].eq(0).all()
    assert params.max_seqlen_q == 19  # 32 - 13: the extended last segment


@pytest.mark.parametrize("rank, positions", [(0, [*range(0, 4), *range(12, 16), *range(16, 22), *range(34, 40)]),
                                             (1, [*range(4, 12), *range(22, 34)])])
def test_cp2_two_sequences_of_16_pad_full_seq_to_40(rank, positions):
    _, (packed, local, params, cu, cu_pad) = _pack([16, 16], 16, 4, 4, 40, cp_rank=rank, cp_size=2)
    full = _seq(0, 16) + _seq(1, 16) + [0] * 8
    assert packed.tolist() == [full]
    assert cu.tolist() == [0, 16, 32] and cu_pad.tolist() == [0, 16, 40]
    assert local.tolist() == [[full[i] for i in positions]]  # chunks r and 2C-1-r of each segment
    assert params.max_seqlen_q == 24
    assert local.shape == (1, 20)


def test_packed_seq_params_fields_on_installed_megatron_core():
    _, (_, _, params, _, cu_pad) = _pack([8, 5, 7], 8, 4)
    assert params.qkv_format == "thd"
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(params, name) is cu_pad
    assert isinstance(params.max_seqlen_q, int) and isinstance(params.max_seqlen_kv, int)
    has_total = "total_tokens" in {f.name for f in dataclasses.fields(type(params))}
    assert has_total == ("total_tokens" in megatron_parallel.packed_seq_params_fields())
    if not has_total:  # megatron-core 0.16.1: no such field, nothing set
        assert not hasattr(params, "total_tokens")


def test_total_tokens_is_set_to_the_local_length_where_the_field_exists(monkeypatch):
    @dataclasses.dataclass
    class NewerPackedSeqParams:
        qkv_format: str = None
        cu_seqlens_q: torch.Tensor = None
        cu_seqlens_kv: torch.Tensor = None
        cu_seqlens_q_padded: torch.Tensor = None
        cu_seqlens_kv_padded: torch.Tensor = None
        max_seqlen_q: int = None
        max_seqlen_kv: int = None
        total_tokens: int = None

    monkeypatch.setattr(megatron_parallel, "packed_seq_params_class", lambda: NewerPackedSeqParams)
    _, (_, local, params, _, _) = _pack([16, 16], 16, 4, 4, 40, cp_rank=0, cp_size=2)
    assert isinstance(params, NewerPackedSeqParams)
    assert params.total_tokens == local.shape[1] == 20


def test_seq_lengths_may_be_a_list_and_int32():
    ids = coded_batch([8, 5, 7], 8)
    a = _pack_sequences_for_megatron(ids, [8, 5, 7], 4)
    b = _pack_sequences_for_megatron(ids, torch.tensor([8, 5, 7], dtype=torch.int32), 4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[4], b[4])


def test_no_sequences_and_all_empty_sequences():
    packed, local, params, cu, cu_pad = _pack_sequences_for_megatron(torch.zeros(0, 5, dtype=torch.long),
                                                                     torch.zeros(0, dtype=torch.long))
    assert packed.shape == (1, 0) and cu.tolist() == [0] and cu_pad.tolist() == [0]
    _, (packed, _, params, _, cu_pad) = _pack([0, 0], 4, 4, 1, 8)
    assert packed.tolist() == [[0] * 8] and cu_pad.tolist() == [0, 0, 8] and params.max_seqlen_q == 8


# ---- errors: NeMo-RL's asserts keep working (AssertionError), the message says more ------------

@pytest.mark.parametrize("args, kwargs, match", [
    ((4, 1, 16), {}, r"packed total .* = 24 exceeds pad_packed_seq_to=16.*silently truncates"),
    ((1, 1, None), {"cp_rank": 0, "cp_size": 2}, r"segment 1 of cu_seqlens_padded is 5 tokens long, not a multiple of 2\*cp_size=4"),
    ((4, 1, 26), {"cp_rank": 0, "cp_size": 2}, r"segment 2 of cu_seqlens_padded is 10 tokens long.*silently drops"),
    ((4, 16, 40), {}, r"pad_packed_seq_to=40 is not a multiple of pad_packed_seq_to_multiple_of=16"),
    ((0,), {}, r"pad_individual_seqs_to_multiple_of=0 is invalid"),
    ((4,), {"cp_rank": 2, "cp_size": 2}, r"cp_rank=2 is invalid; expected an int in \[0, 2\)"),
])
def test_pack_errors(args, kwargs, match):
    ids = coded_batch([8, 5, 7], 8)
    with pytest.raises(PackingError, match=match) as info:
        _pack_sequences_for_megatron(ids, torch.tensor([8, 5, 7]), *args, **kwargs)
    assert isinstance(info.value, PackingAssertionError) and isinstance(info.value, ValueError)


def test_a_core_error_leaves_the_drop_in_as_an_assertion_error_with_its_message():
    """The core raises a plain PackingError (a ValueError); the drop-in's edge re-raises it as
    PackingAssertionError, the same message, the core's error as its cause."""
    with pytest.raises(PackingAssertionError, match=r"^pad_individual_seqs_to_multiple_of=0 is invalid") as info:
        _pack_sequences_for_megatron(coded_batch([8, 5], 8), torch.tensor([8, 5]), 0)
    assert type(info.value.__cause__) is PackingError and str(info.value.__cause__) == str(info.value)


@pytest.mark.parametrize("lengths, match", [([8, 9, 7], r"seq_lengths\[1\] = 9 is outside \[0, S=8\]"),
                                            ([8, -1, 7], r"seq_lengths\[1\] = -1 is outside")])
def test_pack_rejects_lengths_outside_the_row(lengths, match):
    with pytest.raises(PackingError, match=match):
        _pack_sequences_for_megatron(coded_batch([8, 5, 7], 8), torch.tensor(lengths), 4)


def test_pack_rejects_a_lengths_vector_of_the_wrong_size():
    with pytest.raises(PackingError, match=r"seq_lengths has 2 entries; expected 3"):
        _pack_sequences_for_megatron(coded_batch([8, 5, 7], 8), torch.tensor([8, 5]), 4)


# ---- the parameter table ----------------------------------------------------------------------

@pytest.mark.parametrize("cfg, m, max_len, expected", [
    (megatron_cfg(), 1, 100, (1, 1, None)),
    (megatron_cfg(tp=2, sp=True), 4, 100, (4, 1, None)),
    (megatron_cfg(tp=2, sp=False), 3, 100, (3, 1, None)),
    (megatron_cfg(cp=2), 4, 100, (4, 1, None)),
    (megatron_cfg(pp=2), 1, 1000, (1, 1, 1000)),
    (megatron_cfg(fp8="tensorwise"), 1, 100, (1, 16, None)),
    (megatron_cfg(fp8="blockwise"), 1, 100, (1, 128, None)),
    (megatron_cfg(fp8="mxfp8"), 1, 100, (1, 32, None)),
    (megatron_cfg(fp8="tensorwise", cp=2, pp=2), 4, 1000, (4, 64, 1024)),
    (megatron_cfg(fp8="blockwise", tp=2, sp=True, cp=2, pp=2), 8, 1000, (8, 1024, 1024)),
    (megatron_cfg(dispatcher="flex", backend="hybridep"), 1, 100, (1, 128, None)),
    (megatron_cfg(fp8="mxfp8", dispatcher="flex", backend="hybridep", tp=2, sp=True), 2, 100, (2, 256, None)),
    (megatron_cfg(dispatcher="flex", backend="deepep"), 1, 100, (1, 1, None)),
    (megatron_cfg(dispatcher="alltoall", backend="hybridep"), 1, 100, (1, 1, None)),
    (megatron_cfg(pp=4, cp=2), 4, 37, (4, 1, 37)),
])
def test_pack_parameter_table(cfg, m, max_len, expected):
    assert _get_pack_sequence_parameters_for_megatron(cfg, m, max_len) == expected


def test_fp8_disabled_needs_no_packed_multiple():
    cfg = megatron_cfg()
    cfg["fp8_cfg"] = {"enabled": False, "fp8_recipe": "blockwise"}
    assert _get_pack_sequence_parameters_for_megatron(cfg, 1, 100) == (1, 1, None)


@pytest.mark.parametrize("cfg, m, factor", [(megatron_cfg(cp=2), 6, 4), (megatron_cfg(tp=2, sp=True), 3, 2),
                                            (megatron_cfg(tp=2, sp=True, cp=2), 4, 8)])
def test_pack_parameter_minimum_pad_factor(cfg, m, factor):
    with pytest.raises(AssertionError, match=rf"\({m}\) is not a multiple of minimum_pad_factor \({factor}\)\.\nPlease set"):
        _get_pack_sequence_parameters_for_megatron(cfg, m, 100)


# ---- unpacking --------------------------------------------------------------------------------

def test_unpack_uses_padded_offsets_with_cp1_and_multiple_4():
    lengths = [3, 0, 5]
    ids, (packed, _, _, cu, cu_pad) = _pack(lengths, 5, 4)
    logits = torch.stack([packed[0].float(), -packed[0].float()], dim=-1)[None]  # [1, T, 2]
    out = _unpack_sequences_from_megatron(logits, torch.tensor(lengths), cu, cu_pad, 3, 5)
    valid = ids != PAD
    assert out.shape == (3, 5, 2) and out.dtype == torch.float32
    assert torch.equal(out[..., 0], torch.where(valid, ids, 0).float())
    assert torch.equal(out[..., 1], -torch.where(valid, ids, 0).float())


def test_unpack_without_padded_bounds_uses_cu_seqlens():
    ids, (packed, _, _, cu, _) = _pack([3, 1, 2], 3)
    out = _unpack_sequences_from_megatron(packed[..., None], torch.tensor([3, 1, 2]), cu, None, 3, 4)
    assert out[..., 0].tolist() == [_seq(0, 3) + [0], _seq(1, 1) + [0] * 3, _seq(2, 2) + [0, 0]]


@pytest.mark.parametrize("lengths, batch, match", [
    ([3, 0, 5], 2, r"seq_lengths has 3 entries; expected 2"),
    ([3, 0, 6], 3, r"seq_lengths\[2\] = 6 is outside \[0, seq_len=5\]"),
    ([5, 0, 5], 3, r"seq_lengths\[0\] = 5 does not fit its segment"),
])
def test_unpack_errors(lengths, batch, match):
    packed = torch.zeros(1, 12, 2)
    cu_pad = torch.tensor([0, 4, 4, 12], dtype=torch.int32)
    with pytest.raises(PackingError, match=match):
        _unpack_sequences_from_megatron(packed, torch.tensor(lengths), cu_pad, cu_pad, batch, 5)


# ---- get_and_validate_seqlen ------------------------------------------------------------------

def test_get_and_validate_seqlen():
    data = {"input_ids": torch.zeros(2, 7), "token_mask": torch.zeros(2, 7), "input_lengths": torch.zeros(2),
            "names": ["a", "b"]}
    assert get_and_validate_seqlen(data) == (1, 7)
    data["logprobs"] = torch.zeros(2, 6)
    with pytest.raises(AssertionError, match=r"Dim 1 must be the sequence dim, expected dim 1=7 but got shape torch.Size\(\[2, 6\]\) for key logprobs"):
        get_and_validate_seqlen(data)


# ---- round-3 refusals: int32 boundaries, devices, unpack boundaries ---------------------------

INT32_LIMIT = (r"exceeds 2147483647 \(2\*\*31 - 1\), the largest packed length or boundary that int32 "
               r"cu_seqlens can hold")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-switch"])
def test_packed_lengths_int32_boundaries_cannot_hold_are_refused(compiled):
    from nn_data.nemo_rl.megatron_data import PackOptions

    ids, lengths = coded_batch([8, 5, 7], 8), torch.tensor([8, 5, 7])
    kw = {"options": PackOptions(compile=True, backend="aot_eager")} if compiled else {}
    with pytest.raises(PackingError, match=r"pad_packed_seq_to=2147483648 " + INT32_LIMIT):  # NeMo-RL: torch's overflow
        _pack_sequences_for_megatron(ids, lengths, 1, 1, 2**31, **kw)
    with pytest.raises(PackingError, match=r"the packed total 2147483648 of seq_lengths .* " + INT32_LIMIT):
        _pack_sequences_for_megatron(ids, lengths, 1, 2**31, **kw)


def test_int32_limit_in_the_other_entry_points():
    from nn_data.nemo_rl.megatron_data import PackOptions, _prepare_vlm_batch_for_megatron, get_packed_seq_cp_partition_indices
    from nn_data.nemo_rl.batched_data_dict import BatchedDataDict

    with pytest.raises(PackingError, match=r"buckets entry=4294967296 " + INT32_LIMIT):
        PackOptions(buckets=[4096, 2**32])
    with pytest.raises(PackingError, match=r"pad_full_seq_to=2147483648 " + INT32_LIMIT):
        _prepare_vlm_batch_for_megatron(coded_batch([3, 5], 8), torch.tensor([3, 5]), 4, pad_full_seq_to=2**31)
    params = megatron_parallel.make_packed_seq_params(torch.tensor([0, 8], dtype=torch.int32), 8, None)
    with pytest.raises(PackingError, match=r"total_tokens=2147483648 " + INT32_LIMIT):
        get_packed_seq_cp_partition_indices(params, total_tokens=2**31, cp_size=2, cp_rank=0, device="cpu")
    data = BatchedDataDict(input_ids=coded_batch([3, 5], 8), input_lengths=torch.tensor([3, 5]))
    args = {"input_key": "input_ids", "input_lengths_key": "input_lengths", "algorithm": "first_fit_decreasing",
            "sequence_length_pad_multiple": 1, "max_tokens_per_microbatch": 2**31}
    with pytest.raises(PackingError, match=r"max_tokens_per_microbatch=2147483648 " + INT32_LIMIT):
        data.shard_by_batch_size(1, sequence_packing_args=args)
    with pytest.raises(PackingError, match=r"max_tokens_per_microbatch=2147483648 " + INT32_LIMIT):
        data.plan_sequence_packing(2**31, 1, "input_lengths")


def test_lengths_on_a_device_without_values_name_both_devices():
    ids, lengths = coded_batch([8, 5, 7], 8), torch.tensor([8, 5, 7])
    with pytest.raises(PackingError, match=r"seq_lengths is on meta but input_ids is on cpu"):
        _pack_sequences_for_megatron(ids, lengths.to("meta"), 4)
    packed, _, _, cu, cu_pad = _pack_sequences_for_megatron(ids, lengths, 4)
    with pytest.raises(PackingError, match=r"seq_lengths is on meta but output_tensor is on cpu"):
        _unpack_sequences_from_megatron(packed, lengths.to("meta"), cu, cu_pad, 3, 8)
    with pytest.raises(PackingError, match=r"cu_seqlens_padded is on meta but output_tensor is on cpu"):
        _unpack_sequences_from_megatron(packed, lengths, cu, cu_pad.to("meta"), 3, 8)


def test_unpack_checks_the_boundaries_nemo_rl_reads_unchecked():
    lengths = [25, 94, 20]
    ids, (packed, _, _, cu, cu_pad) = _pack(lengths, 100, 8, 1, 160)  # cu_pad [0, 32, 128, 160]
    out = _unpack_sequences_from_megatron(packed, torch.tensor(lengths), cu, cu_pad, 3, 100)
    assert torch.equal(out, torch.where(torch.arange(100) < torch.tensor(lengths)[:, None], ids, 0))
    with pytest.raises(PackingError, match=r"cu_seqlens_padded=\[0, 25, 119, 139\] is invalid for a packed length "
                                           r"T=160 .*it must start at 0, never decrease and end at 160"):
        _unpack_sequences_from_megatron(packed, torch.tensor(lengths), cu, cu, 3, 100)  # unpadded where padded belongs
    with pytest.raises(PackingError, match=r"seq_lengths\[1\] = 94 does not fit its segment of cu_seqlens_padded"):
        _unpack_sequences_from_megatron(packed, torch.tensor(lengths), cu, torch.tensor([0, 32, 100, 160]), 3, 100)
    # Without cu_seqlens_padded NeMo-RL's contract reads the unpadded offsets: they may end before T.
    ids, (packed, _, _, cu, _) = _pack([3, 1, 2], 3, 1, 1, 16)  # T = 16, cu [0, 3, 4, 6]
    out = _unpack_sequences_from_megatron(packed, torch.tensor([3, 1, 2]), cu, None, 3, 3)
    assert torch.equal(out, torch.where(ids != PAD, ids, 0))
    with pytest.raises(PackingError, match=r"cu_seqlens=\[0, 4, 3, 6\] is invalid for a packed length T=16"):
        _unpack_sequences_from_megatron(packed, torch.tensor([3, 0, 2]), torch.tensor([0, 4, 3, 6]), None, 3, 3)


def test_pack_microbatch_packs_only_the_companions_it_knows_and_configs_are_checked_uncached_too():
    from nn_data.nemo_rl.megatron_data.dispatch import pack_microbatch
    from nn_data.nemo_rl.megatron_data.options import PackOptions, nemo_rl_spec

    kw = dict(fixed_total=None, cp_rank=0, cp_size=1, name="pad_full_seq_to")
    spec = nemo_rl_spec(4, 1, **kw)
    assert nemo_rl_spec(4, 1, **kw) is spec  # checked once, then reused
    with pytest.raises(PackingError, match=r"pack_microbatch packs \('mtp_loss_mask', 'routed_experts', "
                                           r"'token_identity', 'media_token_validity_mask'\) with the ids; got "
                                           r"\['labels'\]"):
        pack_microbatch(coded_batch([3], 4), torch.tensor([3]), spec=spec, cp_rank=0, options=PackOptions(),
                        extras={"labels": torch.zeros(1, 4)})
    for bad in (True, [4]):  # a bool is not 1; an unhashable argument is checked without the cache
        with pytest.raises(PackingError, match=r"pad_individual_seqs_to_multiple_of=.* is invalid; expected an int "
                                               r">= 1"):
            nemo_rl_spec(bad, 1, **kw)


def test_unpack_with_unpadded_offsets_allows_boundaries_ending_before_t():
    """Without cu_seqlens_padded, NeMo-RL's contract lets cu_seqlens stand in: they may end before T; every
    other boundary check holds."""
    packed = torch.arange(1, 11).view(1, 10)  # two sequences of 3 and 4, then 3 padding positions
    out = _unpack_sequences_from_megatron(packed, torch.tensor([3, 4]), torch.tensor([0, 3, 7]), None, 2, 4)
    assert out.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    with pytest.raises(PackingError, match=r"cu_seqlens=\[0, 3, 12\] is invalid|cu_seqlens\[2\] = 12 is outside"):
        _unpack_sequences_from_megatron(packed, torch.tensor([3, 4]), torch.tensor([0, 3, 12]), None, 2, 4)
    with pytest.raises(PackingError, match=r"cu_seqlens=\[0, 5, 3\] is invalid for a packed length T=10 .* end at "
                       r"most at 10"):
        _unpack_sequences_from_megatron(packed, torch.tensor([3, 0]), torch.tensor([0, 5, 3]), None, 2, 4)

