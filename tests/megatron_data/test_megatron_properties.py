"""Tier: pure CPU, single process, hypothesis.

Property tests: ``_pack_sequences_for_megatron`` equals the loop reference (docs/design.md) on every
rank, and ``_unpack_sequences_from_megatron(pack(x)) == x`` on the valid tokens for every multiple.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_profiles import examples
from nn_data.nemo_rl.megatron_data import PackOptions, _pack_sequences_for_megatron, _unpack_sequences_from_megatron
from nn_data.testing.coded import PAD, coded_batch
from nn_data.testing.reference import reference_pack, reference_shard

SETTINGS = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def pack_cases(draw):
    cp_size = draw(st.sampled_from([1, 1, 2, 3]))
    unit = 2 * cp_size if cp_size > 1 else 1  # every segment must split into 2C chunks
    m = unit * draw(st.integers(1, 3))
    p = unit * draw(st.sampled_from([1, 1, 2, 4]))
    seq_len = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(0, seq_len), min_size=1, max_size=6))
    natural = sum(-(-n // m) * m for n in lengths)
    pad_full = None
    if draw(st.booleans()):
        pad_full = -(-natural // p) * p + p * draw(st.integers(0, 3))
        pad_full = pad_full or p  # an all-empty batch still needs a positive target
    return lengths, seq_len, m, p, pad_full, cp_size


@SETTINGS
@given(pack_cases())
def test_pack_matches_the_reference_on_every_rank(case):
    lengths, seq_len, m, p, pad_full, cp_size = case
    ids = coded_batch(lengths, seq_len)
    ref = reference_pack(ids, lengths, m, p, pad_full)
    for rank in range(cp_size):
        packed, local, params, cu, cu_pad = _pack_sequences_for_megatron(
            ids, torch.tensor(lengths), m, p, pad_full, cp_rank=rank, cp_size=cp_size)
        assert torch.equal(packed, ref.packed)
        assert torch.equal(cu, ref.cu_seqlens) and torch.equal(cu_pad, ref.cu_seqlens_padded)
        assert params.max_seqlen_q == params.max_seqlen_kv == ref.max_seqlen
        if cp_size == 1:
            assert torch.equal(local, packed)
        elif packed.shape[1]:
            assert torch.equal(local, reference_shard(ref.packed, ref.cu_seqlens_padded, cp_size, rank))
        assert local.shape[1] * cp_size == packed.shape[1]


@SETTINGS
@given(pack_cases(), st.integers(1, 3))
def test_unpack_of_pack_is_identity_on_valid_tokens(case, features):
    lengths, seq_len, m, p, pad_full, _ = case
    ids = coded_batch(lengths, seq_len)
    x = torch.stack([ids * (f + 1) for f in range(features)], dim=-1).float()  # [B, S, F] model "outputs"
    packed, _, _, cu, cu_pad = _pack_sequences_for_megatron(x, torch.tensor(lengths), m, p, pad_full)
    out = _unpack_sequences_from_megatron(packed, torch.tensor(lengths), cu, cu_pad, len(lengths), seq_len)
    valid = (ids != PAD)[..., None]
    assert torch.equal(out, torch.where(valid, x, 0.0))


@SETTINGS
@given(pack_cases(), st.sampled_from([(32, 64), (16, 48, 96, 192), "pow2"]))
def test_buckets_only_lengthen_the_last_segment(case, buckets):
    lengths, seq_len, m, p, _, cp_size = case
    ids = coded_batch(lengths, seq_len)
    unit = 2 * cp_size if cp_size > 1 else 1
    if buckets != "pow2":  # make the buckets legal for this case: multiples of lcm(p, 2C)
        import math

        step = math.lcm(p, unit)
        buckets = tuple(-(-b // step) * step for b in buckets) + (step * 64,)
    packed, local, params, cu, cu_pad = _pack_sequences_for_megatron(
        ids, torch.tensor(lengths), m, p, None, cp_rank=cp_size - 1, cp_size=cp_size,
        options=PackOptions(buckets=buckets))
    total = packed.shape[1]
    ref = reference_pack(ids, lengths, m, p, total)  # same as pad_full_seq_to = the bucket
    assert torch.equal(packed, ref.packed) and torch.equal(cu_pad, ref.cu_seqlens_padded)
    assert params.max_seqlen_q == ref.max_seqlen
    natural = reference_pack(ids, lengths, m, p).packed.shape[1]
    assert total >= natural
    if buckets == "pow2":
        import math

        step = math.lcm(p, unit)
        assert total % step == 0 and (total // step) & (total // step - 1) == 0
    else:
        assert total == min(b for b in buckets if b >= natural)
