"""Tier: pure CPU, single process.

Every bad configuration or input is refused with a message naming the argument, the value and
what would be valid (eager mode; the compiled device-side asserts are in test_ops_compile.py).
"""

from __future__ import annotations

import pytest
import torch

from nn_data import (
    PackingError,
    PackSequences,
    ShardForContextParallel,
    UnpackSequences,
    UnshardFromContextParallel,
    pad_rows,
    pad_to_row_capacity,
)

X = torch.arange(12).view(3, 4)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"pad_individual_seqs_to_multiple_of": 0}, r"pad_individual_seqs_to_multiple_of=0 is invalid; expected an int >= 1"),
        ({"pad_packed_seq_to_multiple_of": -2}, r"pad_packed_seq_to_multiple_of=-2 is invalid; expected an int >= 1"),
        ({"pad_full_seq_to": 0}, r"pad_full_seq_to=0 is invalid; expected an int >= 1 or None"),
        ({"pad_individual_seqs_to_multiple_of": 2.0}, r"pad_individual_seqs_to_multiple_of=2.0 is invalid"),
        ({"pad_packed_seq_to_multiple_of": 8, "pad_full_seq_to": 20},
         r"pad_full_seq_to=20 is not a multiple of pad_packed_seq_to_multiple_of=8; choose a multiple of 8"),
    ],
)
def test_pack_configuration_errors(kwargs, pattern):
    with pytest.raises(PackingError, match=pattern):
        PackSequences(**kwargs)


def test_core_errors_are_value_errors_only():
    """The core's PackingError is a ValueError; only the NeMo-RL drop-in's subclass is also an
    AssertionError (tests/megatron_data/test_megatron_pack.py)."""
    with pytest.raises(ValueError) as info:
        PackSequences(0)
    assert type(info.value) is PackingError and not isinstance(info.value, AssertionError)


@pytest.mark.parametrize(
    "args, pattern",
    [
        ((2, 2), r"cp_rank=2 is invalid; expected an int in \[0, 2\) for cp_size=2"),
        ((2, -1), r"cp_rank=-1 is invalid"),
        ((0, 0), r"cp_size=0 is invalid; expected an int >= 1"),
    ],
)
def test_cp_configuration_errors(args, pattern):
    with pytest.raises(PackingError, match=pattern):
        ShardForContextParallel(*args)


def test_unshard_and_unpack_configuration_errors():
    with pytest.raises(PackingError, match=r"cp_size=0 is invalid"):
        UnshardFromContextParallel(0)
    with pytest.raises(PackingError, match=r"seq_len=-1 is invalid; expected an int >= 0"):
        UnpackSequences(-1)


@pytest.mark.parametrize(
    "lengths, pattern",
    [
        (torch.tensor([[1, 2, 3]]), r"seq_lengths must be a 1-D integer tensor, got shape \(1, 3\)"),
        (torch.tensor([1.0, 2.0, 3.0]), r"seq_lengths must be a 1-D integer tensor, got shape \(3,\) and dtype torch.float32"),
        (torch.tensor([1, 2]), r"seq_lengths has 2 entries; expected 3"),
        ([1.5, 2, 3], r"seq_lengths=\[1.5, 2, 3\] is invalid: not all integers"),
        (torch.tensor([1, -2, 3]), r"seq_lengths\[1\] = -2 is outside \[0, S=4\]; valid lengths are integers in \[0, 4\]"),
        (torch.tensor([1, 2, 5]), r"seq_lengths\[2\] = 5 is outside \[0, S=4\]; valid lengths are integers in \[0, 4\]"),
    ],
)
def test_seq_lengths_errors(lengths, pattern):
    with pytest.raises(PackingError, match=pattern):
        PackSequences()(X, lengths)


def test_x_needs_two_dims():
    with pytest.raises(PackingError, match=r"x must have at least 2 dims \[B, S, \*\], got shape \(4,\)"):
        PackSequences()(torch.arange(4), torch.tensor([4]))


def test_tensors_on_different_devices():
    meta_lengths = torch.tensor([1, 2, 3], device="meta")
    with pytest.raises(PackingError, match=r"tensors must be on one device, got x on cpu, seq_lengths on meta"):
        PackSequences()(X, meta_lengths)
    with pytest.raises(PackingError, match=r"packed on cpu, seq_lengths on meta"):
        UnpackSequences(4)(X[:1], meta_lengths, torch.tensor([0, 1, 2, 4]))
    with pytest.raises(PackingError, match=r"packed on cpu, cu_seqlens_padded on meta"):
        ShardForContextParallel(2, 0)(X[:1], torch.tensor([0, 4], device="meta"))


def test_natural_total_over_pad_full_seq_to_is_refused():
    with pytest.raises(
        PackingError,
        match=r"sum\(round_up\(seq_lengths, 4\)\) = 12 exceeds pad_full_seq_to=8; pad_full_seq_to must be at least 12",
    ):
        PackSequences(4, pad_full_seq_to=8)(X, torch.tensor([3, 3, 1]))


def test_num_rows_errors():
    with pytest.raises(PackingError, match=r"num_rows=2 is invalid; expected None or a 0-d integer tensor in \[0, 3\]"):
        PackSequences()(X, torch.tensor([1, 1, 0]), 2)
    with pytest.raises(PackingError, match=r"num_rows=4 is invalid; expected a value in \[0, 3\]"):
        PackSequences()(X, torch.tensor([1, 1, 0]), torch.tensor(4))
    with pytest.raises(PackingError, match=r"seq_lengths\[2\] = 1 but row 2 is a padding row \(num_rows=2\)"):
        PackSequences()(X, torch.tensor([1, 1, 1]), torch.tensor(2))


def test_row_capacity_errors():
    with pytest.raises(PackingError, match=r"the batch has 3 rows, more than capacity=2; raise capacity to at least 3"):
        pad_to_row_capacity(X, torch.tensor([1, 2, 3]), capacity=2)
    with pytest.raises(PackingError, match=r"more than row_capacity=2; raise row_capacity to at least 3"):
        pad_to_row_capacity(X, torch.tensor([1, 2, 3]), capacity=2, name="row_capacity")
    with pytest.raises(PackingError, match=r"capacity=-1 is invalid; expected an int >= 0"):
        pad_rows(X, -1)


def test_segment_not_divisible_by_2c():
    packed = torch.arange(16).view(1, 16)
    with pytest.raises(
        PackingError, match=r"segment 0 of cu_seqlens_padded is 6 tokens long, not a multiple of 2\*cp_size=4"
    ):
        ShardForContextParallel(2, 0)(packed, torch.tensor([0, 6, 16]))


def test_extended_last_segment_not_divisible_by_2c():
    x = torch.ones(2, 8, dtype=torch.int64)
    r = PackSequences(4, pad_full_seq_to=14)(x, torch.tensor([4, 4]))  # last segment 10: not a multiple of 4
    assert r.cu_seqlens_padded.tolist() == [0, 4, 14]
    with pytest.raises(PackingError, match=r"the packed length T=14 is not a multiple of 2\*cp_size=4"):
        ShardForContextParallel(2, 0)(r.packed, r.cu_seqlens_padded)
    r = PackSequences(2, pad_full_seq_to=16)(x, torch.tensor([3, 3]))  # segments 4 and 12; 4 % 8 != 0
    with pytest.raises(PackingError, match=r"segment 0 of cu_seqlens_padded is 4 tokens long, not a multiple of 2\*cp_size=8"):
        ShardForContextParallel(4, 1)(r.packed, r.cu_seqlens_padded)
    # (With every other segment a multiple of 2C, an extended last segment that is not one
    # implies that T is not one either: the first case above.)


def test_boundaries_must_rise_from_zero_to_t():
    packed = torch.arange(8).view(1, 8)
    with pytest.raises(PackingError, match=r"cu_seqlens_padded=\[0, 4, 12\] is invalid for a packed length T=8"):
        ShardForContextParallel(2, 0)(packed, torch.tensor([0, 4, 12]))
    with pytest.raises(PackingError, match=r"it must start at 0, never decrease and end at 8"):
        UnshardFromContextParallel(2)(packed.view(2, 4), torch.tensor([0, 8, 4, 8]))


def test_shard_shape_errors():
    with pytest.raises(PackingError, match=r"packed must be \[1, T, \*\] \(a leading dim of 1\), got shape \(2, 4\)"):
        ShardForContextParallel(2, 0)(torch.zeros(2, 4), torch.tensor([0, 8]))
    with pytest.raises(PackingError, match=r"shards has shape \(3, 4\); expected \[C, T/C, \*\] with C = cp_size = 2"):
        UnshardFromContextParallel(2)(torch.zeros(3, 4), torch.tensor([0, 8]))
    with pytest.raises(PackingError, match=r"cu_seqlens_padded must be a 1-D integer tensor"):
        ShardForContextParallel(2, 0)(torch.zeros(1, 8), torch.tensor([0.0, 8.0]))


def test_unpack_data_errors():
    packed = torch.arange(8).view(1, 8)
    cu = torch.tensor([0, 4, 8])
    with pytest.raises(PackingError, match=r"seq_lengths\[1\] = 6 is outside \[0, seq_len=5\]"):
        UnpackSequences(5)(packed, torch.tensor([2, 6]), cu)
    with pytest.raises(PackingError, match=r"seq_lengths\[0\] = 5 does not fit its segment of cu_seqlens_padded"):
        UnpackSequences(5)(packed, torch.tensor([5, 1]), cu)
    with pytest.raises(PackingError, match=r"cu_seqlens_padded has 2 entries; expected 3"):
        UnpackSequences(5)(packed, torch.tensor([1, 1]), torch.tensor([0, 8]))


def test_pack_with_layout_shape_mismatch():
    r = PackSequences()(X, torch.tensor([1, 2, 3]))
    with pytest.raises(PackingError, match=r"the layout was built for \[B, S\] = \[3, 4\], so x must be \[3, 4, \*\]"):
        r.layout.pack(torch.zeros(3, 5))


INT32_LIMIT = r"exceeds 2147483647 \(2\*\*31 - 1\), the largest packed length or boundary that int32 cu_seqlens can hold"


def test_packed_lengths_int32_boundaries_cannot_hold_are_refused():
    with pytest.raises(PackingError, match=r"pad_full_seq_to=2147483648 " + INT32_LIMIT):
        PackSequences(pad_full_seq_to=2**31)
    assert PackSequences(pad_full_seq_to=2**31 - 1).pad_full_seq_to == 2**31 - 1  # the limit itself is fine
    with pytest.raises(PackingError, match=r"the packed total 2147483648 of seq_lengths \(sum\(round_up\(seq_lengths, 1\)\) "
                                           r"= 6, rounded up to 2147483648\) " + INT32_LIMIT):  # a data-dependent T
        PackSequences(pad_packed_seq_to_multiple_of=2**31)(X, torch.tensor([1, 2, 3]))
    huge = torch.empty(1, 2**31, device="meta")  # a packed tensor too long for int32 boundaries
    with pytest.raises(PackingError, match=r"the packed length T=2147483648 of packed " + INT32_LIMIT):
        ShardForContextParallel(2, 0)(huge, torch.tensor([0, 2**31], device="meta"))
    with pytest.raises(PackingError, match=r"the packed length T=2147483648 of packed " + INT32_LIMIT):
        UnpackSequences(4)(huge, torch.tensor([1], device="meta"), torch.tensor([0, 2**31], device="meta"))


def test_packed_forward_refuses_a_packed_length_over_int32():
    from nn_data import PackedForward

    with pytest.raises(PackingError, match=r"pad_full_seq_to=4294967296 " + INT32_LIMIT):
        PackedForward(torch.nn.Identity(), pad_full_seq_to=2**32)


def test_unpack_boundaries_rise_from_zero_to_t():
    # Packed with m = 4 into T = 40: cu_seqlens [0, 5, 12], cu_seqlens_padded [0, 8, 40].
    x = torch.arange(1, 17).view(2, 8)
    lengths = torch.tensor([5, 7])
    r = PackSequences(4, pad_full_seq_to=40)(x, lengths)
    unpack = UnpackSequences(8)
    with pytest.raises(PackingError, match=r"cu_seqlens_padded=\[0, 5, 12\] is invalid for a packed length T=40 "
                       r"\(T = packed.shape\[1\]\); it must start at 0, never decrease and end at 40 \(cu_seqlens, "
                       r"the unpadded boundaries, passed where cu_seqlens_padded belongs\?\)"):
        unpack(r.packed, lengths, r.cu_seqlens)
    with pytest.raises(PackingError, match=r"cu_seqlens_padded=\[0, 8, 32\] is invalid for a packed length T=40"):
        unpack(r.packed, lengths, torch.tensor([0, 8, 32]))  # ends before T
    with pytest.raises(PackingError, match=r"cu_seqlens_padded=\[4, 8, 40\] is invalid"):
        unpack(r.packed, torch.tensor([4, 7]), torch.tensor([4, 8, 40]))  # does not start at 0
    with pytest.raises(PackingError, match=r"cu_seqlens_padded=\[0, 20, 12, 40\] is invalid"):
        UnpackSequences(8)(r.packed, torch.tensor([5, 0, 7]), torch.tensor([0, 20, 12, 40]))  # decreases
    with pytest.raises(PackingError, match=r"seq_lengths\[1\] = 7 does not fit its segment of cu_seqlens_padded"):
        unpack(r.packed, lengths, torch.tensor([0, 36, 40]))  # segment 1 is 4 long
    assert torch.equal(unpack(r.packed, lengths, r.cu_seqlens_padded), torch.where(torch.arange(8) < lengths[:, None], x, 0))
    # No sequence: [T] is the padding pseudo-segment [0, T]; any other single boundary is refused.
    assert UnpackSequences(8)(r.packed, torch.zeros(0, dtype=torch.int64), torch.tensor([40])).shape == (0, 8)
    with pytest.raises(PackingError, match=r"cu_seqlens_padded=\[32\] is invalid for a packed length T=40"):
        UnpackSequences(8)(r.packed, torch.zeros(0, dtype=torch.int64), torch.tensor([32]))


def test_a_layout_an_op_is_given_must_be_the_microbatchs_own():
    r = PackSequences(4, pad_full_seq_to=16)(torch.ones(2, 8, dtype=torch.int64), torch.tensor([4, 4]))
    other = PackSequences(4, pad_full_seq_to=16)(torch.ones(2, 8, dtype=torch.int64), torch.tensor([4, 4]))
    with pytest.raises(PackingError, match=r"cu_seqlens_padded is not the tensor the layout holds; pass layout= "
                                           r"alone, or layout.cu_seqlens_padded"):
        ShardForContextParallel(2, 0)(r.packed, other.cu_seqlens_padded, layout=r.layout)
    with pytest.raises(PackingError, match=r"the layout was built for T=16 packed positions but the tensor given "
                                           r"with it has T=8"):
        ShardForContextParallel(2, 0)(r.packed[:, :8], layout=r.layout)
    with pytest.raises(PackingError, match=r"seq_lengths is not the tensor the layout holds"):
        UnpackSequences(8)(r.packed, torch.tensor([4, 4]), layout=r.layout)
    with pytest.raises(PackingError, match=r"layout must be a PackLayout \(PackResult.layout\), got tuple"):
        UnshardFromContextParallel(2)(r.packed.view(2, 8), layout=tuple(r.layout))
    with pytest.raises(PackingError, match=r"ShardForContextParallel needs cu_seqlens_padded or layout="):
        ShardForContextParallel(2, 0)(r.packed)
    with pytest.raises(PackingError, match=r"UnpackSequences needs seq_lengths and cu_seqlens_padded, or layout="):
        UnpackSequences(8)(r.packed)
    with pytest.raises(PackingError, match=r"segment 0 of cu_seqlens_padded is 4 tokens long, not a multiple of "
                                           r"2\*cp_size=8"):  # the op's own C, checked on the travelling layout
        ShardForContextParallel(4, 0)(r.packed, layout=r.layout)
    with pytest.raises(PackingError, match=r"seq_lengths\[0\] = 4 is outside \[0, seq_len=3\]"):
        UnpackSequences(3)(r.packed, layout=r.layout)


def test_a_layout_built_from_boundaries_cannot_pack():
    from nn_data.layout import Boundaries, layout_from_boundaries

    layout = layout_from_boundaries(Boundaries(torch.tensor([0, 8]), 8), op="test")
    with pytest.raises(PackingError, match=r"this layout was built from boundaries without a row length S"):
        layout.pack(torch.zeros(1, 8))


def test_ops_that_need_both_boundaries_say_so():
    from nn_data import NextTokenTargets, TokenLogProbs
    from nn_data.layout import Boundaries, layout_from_boundaries

    ids = torch.ones(1, 8, dtype=torch.int64)
    with pytest.raises(PackingError, match=r"NextTokenTargets needs cu_seqlens and cu_seqlens_padded, or layout="):
        NextTokenTargets()(ids)
    with pytest.raises(PackingError, match=r"TokenLogProbs needs cu_seqlens and cu_seqlens_padded, or layout="):
        TokenLogProbs(4)(torch.zeros(1, 8, 3), ids)
    shard_only = layout_from_boundaries(Boundaries(torch.tensor([0, 8]), 8), op="test")  # no cu_seqlens in it
    with pytest.raises(PackingError, match=r"TokenLogProbs needs a layout with cu_seqlens \(PackResult.layout\)"):
        TokenLogProbs(4)(torch.zeros(1, 8, 3), ids, layout=shard_only)
    with pytest.raises(PackingError, match=r"test: T is the last boundary here, which only the host read can learn"):
        layout_from_boundaries(Boundaries(torch.tensor([0, 8]), None), op="test", host_reads=False)


def test_token_ids_outside_the_vocabulary_on_a_travelling_layout_are_a_device_assert():
    from nn_data import TokenLogProbs

    r = PackSequences(pad_full_seq_to=8)(torch.tensor([[1, 2, 9, 0]]), torch.tensor([3]))
    with pytest.raises(RuntimeError, match=r"nn_data.TokenLogProbs: token ids must be in \[0, vocab=3\)"):
        TokenLogProbs(4)(torch.zeros(1, 8, 3), r.packed, layout=r.layout)  # no read: the check is on the device
    with pytest.raises(PackingError, match=r"packed token id 9 at position 2 is outside the vocabulary \[0, 3\)"):
        TokenLogProbs(4)(torch.zeros(1, 8, 3), r.packed, r.cu_seqlens, r.cu_seqlens_padded)  # the one read


@pytest.mark.parametrize("host_reads", [True, False])
def test_pack_layout_methods_refuse_another_microbatchs_packed_tensor(host_reads):
    pack = PackSequences(4, pad_full_seq_to=16, host_reads=host_reads)
    a = pack(torch.arange(1, 11).view(2, 5), torch.tensor([3, 5]))
    b = pack(torch.arange(11, 21).view(2, 5), torch.tensor([5, 2]))
    if a.layout.token is None:  # only the host executor's tensors carry a token
        assert not host_reads
        return
    other = r"^packed was packed on another microbatch's layout"
    with pytest.raises(PackingError, match=other):
        b.layout.unpack(a.packed, 5)
    with pytest.raises(PackingError, match=other):
        b.layout.shard(a.packed, 2, 1)
    with pytest.raises(PackingError, match=other):
        b.layout.shard(a.packed, 1, 0)
    shards = a.layout.shard(a.packed, 2, 0)
    with pytest.raises(PackingError, match=r"^shards was packed on another microbatch's layout"):
        b.layout.unshard(shards, 2)
    assert torch.equal(a.layout.unpack(a.packed, 5), torch.arange(1, 11).view(2, 5) * (torch.arange(5) < torch.tensor(
        [[3], [5]])))  # its own layout still runs


def test_another_microbatchs_layout_of_the_same_length_is_refused():
    pack = PackSequences(4, pad_full_seq_to=16)
    a = pack(torch.arange(1, 11).view(2, 5), torch.tensor([3, 5]))
    b = pack(torch.arange(11, 21).view(2, 5), torch.tensor([5, 2]))
    with pytest.raises(PackingError, match=r"^packed was packed on another microbatch's layout"):
        UnpackSequences(seq_len=5)(a.packed, layout=b.layout)
    with pytest.raises(PackingError, match=r"^packed was packed on another microbatch's layout"):
        ShardForContextParallel(2, 0)(a.packed, layout=b.layout)
    from nn_data import NextTokenTargets

    with pytest.raises(PackingError, match=r"^packed_ids was packed on another microbatch's layout"):
        NextTokenTargets()(a.packed, layout=b.layout)
    assert UnpackSequences(seq_len=5)(a.packed, layout=a.layout)[0].tolist() == [1, 2, 3, 0, 0]


def test_a_cp_shard_given_to_unpack_is_named_as_one():
    r = PackSequences(4, pad_full_seq_to=16)(torch.arange(1, 11).view(2, 5), torch.tensor([3, 5]))
    local = ShardForContextParallel(2, 1)(r.packed, layout=r.layout)
    with pytest.raises(PackingError, match=r"has T=8 = T/2: a context-parallel shard\? Gather it first "
                                           r"\(GatherFromContextParallel, or UnshardFromContextParallel"):
        UnpackSequences(seq_len=5)(local, layout=r.layout)


def test_swapped_lengths_and_boundaries_are_named_as_swapped():
    r = PackSequences(4)(torch.arange(1, 11).view(2, 5), torch.tensor([3, 5]))
    with pytest.raises(PackingError, match=r"^cu_seqlens_padded has 2 entries; expected 4 \(B \+ 1 for the B = 3 "
                                           r"entries of seq_lengths\); seq_lengths has one entry more than "
                                           r"cu_seqlens_padded: were the two swapped\?$"):
        UnpackSequences(5)(r.packed, r.cu_seqlens_padded, torch.tensor([3, 5]))
