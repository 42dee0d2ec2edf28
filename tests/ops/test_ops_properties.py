"""Tier: pure CPU, single process, eager mode (hypothesis).

Property tests: the ops on both executors (host and device, every form) equal the loop reference.

Random B (0..16), S, lengths (0 and S included), multiples m and p, pad_full_seq_to,
C in {1, 2, 3, 4, 8} and every rank, trailing dims [B,S] and [B,S,3,2], int and float.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import hypothesis_profiles
from tests.support.hypothesis_profiles import examples
from nn_data.layout import device, host
from nn_data import (
    PackSequences,
    ShardForContextParallel,
    UnpackSequences,
    UnshardFromContextParallel,
    pad_to_row_capacity,
)
from nn_data.testing.reference import reference_pack, reference_shard, reference_unpack
from nn_data.testing.coded import coded_batch, valid_mask

SETTINGS = settings(max_examples=examples(150), deadline=None)


def _round_up(x, m):
    return -(-x // m) * m


@st.composite
def cases(draw):
    """A batch plus a configuration whose segments split evenly over C ranks."""
    cp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    rows = draw(st.integers(0, 16))
    seq_len = draw(st.integers(0, 24))
    lengths = draw(st.lists(st.integers(0, seq_len), min_size=rows, max_size=rows))
    if cp == 1:
        m, p = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    else:  # zigzag needs every segment, the extended last one too, to be a multiple of 2C
        m, p = 2 * cp * draw(st.integers(1, 3)), 2 * cp * draw(st.integers(1, 2))
    natural = sum(_round_up(n, m) for n in lengths)
    full = None
    if draw(st.booleans()):
        step = p * 2 * cp // math.gcd(p, 2 * cp)
        full = _round_up(natural + draw(st.integers(0, 40)), step) or step
    trailing = draw(st.sampled_from([(), (3, 2)]))
    dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.float32]))
    return dict(cp=cp, lengths=lengths, seq_len=seq_len, m=m, p=p, full=full, trailing=trailing, dtype=dtype)


@contextlib.contextmanager
def executor(name: str):
    """Run the ops on one executor and form (``docs/design.md``, "Layouts and executors"):
    ``host`` (eager default: one host read, split/cat views), ``host-index`` (the host executor's
    index_select form of shard and unshard), ``device-scatter`` / ``device-gather`` (``host_reads=False``:
    index maps on the device, the scatter or the gather form of pack (``pack_form=``) and unpack forced).
    Yields ``(host_reads, pack_form)``."""
    saved = (device.UNPACK_SCATTER_MIN_RATIO, host.SHARD_VIEWS_MAX_SEGMENTS)
    form = name.split("-")[1] if name.startswith("device") else "auto"
    device.UNPACK_SCATTER_MIN_RATIO = {"auto": saved[0], "scatter": 0, "gather": 10**9}[form]
    host.SHARD_VIEWS_MAX_SEGMENTS = 0 if name == "host-index" else saved[1]
    try:
        yield not name.startswith("device"), form
    finally:
        device.UNPACK_SCATTER_MIN_RATIO, host.SHARD_VIEWS_MAX_SEGMENTS = saved


EXECUTORS = ["host", "host-index", "device-scatter", "device-gather"]


@SETTINGS
@given(cases(), st.sampled_from(EXECUTORS), st.booleans())
def test_pack_shard_unshard_unpack_match_reference_on_both_executors(case, name, travel):
    """Every op on every executor equals the loop reference; ``travel``: the later ops get the pack's
    layout (no read), else the boundaries (read once each)."""
    lengths = torch.tensor(case["lengths"], dtype=torch.int64)
    x = coded_batch(case["lengths"], case["seq_len"], case["trailing"], case["dtype"])
    cp, m, p, full, seq_len = case["cp"], case["m"], case["p"], case["full"], case["seq_len"]
    with executor(name) as (host_reads, form):
        r = PackSequences(m, p, full, host_reads=host_reads, pack_form=form)(x, lengths)
        on = dict(layout=r.layout) if travel else dict(cu_seqlens_padded=r.cu_seqlens_padded)
        shards = [ShardForContextParallel(cp, k, host_reads=host_reads)(r.packed, **on) for k in range(cp)]
        restored = UnshardFromContextParallel(cp, host_reads=host_reads)(torch.cat(shards), **on)
        unpack_on = dict(layout=r.layout) if travel else dict(seq_lengths=lengths, cu_seqlens_padded=r.cu_seqlens_padded)
        out = UnpackSequences(seq_len, host_reads=host_reads)(r.packed, **unpack_on)
    assert (r.layout.host is not None) == host_reads
    if not host_reads and x.shape[0] * x.shape[1] and r.packed.shape[1]:
        assert (r.layout.executor.dest is not None) == (name == "device-scatter")
    ref = reference_pack(x, case["lengths"], m, p, full)
    assert torch.equal(r.packed, ref.packed)
    assert torch.equal(r.cu_seqlens, ref.cu_seqlens)
    assert torch.equal(r.cu_seqlens_padded, ref.cu_seqlens_padded)
    assert r.max_seqlen.item() == ref.max_seqlen
    bounds = ref.cu_seqlens_padded.tolist() if len(case["lengths"]) else [0, ref.packed.shape[1]]
    want_seg = [b for b in range(len(bounds) - 1) for _ in range(bounds[b + 1] - bounds[b])]
    want_pos = [t for b in range(len(bounds) - 1) for t in range(bounds[b + 1] - bounds[b])]
    assert r.layout.segment_ids().tolist() == want_seg and r.layout.positions().tolist() == want_pos
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, reference_shard(ref.packed, ref.cu_seqlens_padded, cp, rank))
    assert torch.equal(restored, r.packed)
    assert torch.equal(out, reference_unpack(ref.packed, case["lengths"], ref.cu_seqlens_padded, seq_len))
    keep = valid_mask(case["lengths"], seq_len).view(*out.shape[:2], *([1] * len(case["trailing"])))
    assert torch.equal(out, torch.where(keep, x, torch.zeros_like(x)))


@SETTINGS
@given(cases())
def test_every_valid_token_on_exactly_one_rank_once(case):
    lengths = torch.tensor(case["lengths"], dtype=torch.int64)
    x = coded_batch(case["lengths"], case["seq_len"], case["trailing"], torch.int64)
    cp = case["cp"]
    r = PackSequences(case["m"], case["p"], case["full"])(x, lengths)
    on_ranks = torch.cat([ShardForContextParallel(cp, k)(r.packed, r.cu_seqlens_padded).flatten() for k in range(cp)])
    expected = x[valid_mask(case["lengths"], case["seq_len"])].flatten()  # codes of the valid tokens
    assert torch.equal(torch.sort(on_ranks[on_ranks != 0]).values, torch.sort(expected).values)
    assert (on_ranks >= 0).all(), "an input padding value leaked into a shard"


@SETTINGS
@given(cases(), st.integers(0, 5))
def test_row_capacity_padding_changes_nothing_in_real_rows(case, extra_rows):
    lengths = torch.tensor(case["lengths"], dtype=torch.int64)
    x = coded_batch(case["lengths"], case["seq_len"], case["trailing"], case["dtype"])
    pack = PackSequences(case["m"], case["p"], case["full"])
    plain = pack(x, lengths)
    rows = x.shape[0]
    padded = pad_to_row_capacity(x, lengths, rows + extra_rows)
    r = pack(padded.x, padded.seq_lengths, padded.num_rows)
    assert torch.equal(r.packed, plain.packed)
    assert torch.equal(r.cu_seqlens[: rows + 1], plain.cu_seqlens)
    if rows:
        assert torch.equal(r.cu_seqlens_padded[: rows + 1], plain.cu_seqlens_padded)
        assert (r.cu_seqlens_padded[rows:] == plain.cu_seqlens_padded[-1]).all()
    assert r.max_seqlen.item() == plain.max_seqlen.item()
    out = UnpackSequences(case["seq_len"])(r.packed, padded.seq_lengths, r.cu_seqlens_padded)
    assert torch.equal(out[:rows], UnpackSequences(case["seq_len"])(plain.packed, lengths, plain.cu_seqlens_padded))
    assert not out[rows:].any()


@pytest.mark.parametrize("form", EXECUTORS)
@pytest.mark.parametrize("seq_len", [0, 5])
def test_unpack_of_a_batch_without_rows_in_every_form(form, seq_len):
    # The case a random draw found: lengths = [], seq_len = 0, scatter form (an IndexError before).
    packed = torch.arange(8).view(1, 8)
    no_lengths = torch.zeros(0, dtype=torch.int64)
    for total, bounds in ((8, [8]), (0, [0])):
        with executor(form) as (host_reads, _):
            out = UnpackSequences(seq_len, host_reads=host_reads)(packed[:, :total], no_lengths, torch.tensor(bounds))
        assert out.shape == (0, seq_len) and out.dtype == packed.dtype


def _token_source_reference(bounds, lengths, seq_len, total, shift):
    """Position by position: the last row started at or before ``t`` owns it; a token while its offset is below
    ``min(L, S) - shift`` and ``t`` is before the next row's start; its place ``b*S + offset + shift``."""
    source, valid = [], []
    for t in range(total):
        owners = [b for b in range(len(lengths)) if min(bounds[b], total) <= t]
        if not owners:
            source.append(None), valid.append(False)
            continue
        b = owners[-1]
        offset = t - bounds[b]
        valid.append(offset < min(lengths[b], seq_len) - shift and t < bounds[b + 1])
        source.append(b * seq_len + offset + shift)
    return source, valid


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 12)), max_size=8), st.integers(0, 10),
       st.integers(0, 20), st.sampled_from([0, 1]))
def test_token_source_places_each_token_of_any_boundaries(rows, seq_len, slack, shift):
    # Segments of any padded length, lengths above it or above S included (cut there), empty rows, a tail.
    from nn_data.layout.index import token_source

    lengths = [n for n, _ in rows]
    bounds = [0]
    for _, width in rows:
        bounds.append(bounds[-1] + width)
    total = bounds[-1] + slack
    source, valid = token_source(torch.tensor(bounds), torch.tensor(lengths, dtype=torch.int64), seq_len, total,
                                 shift)
    want_source, want_valid = _token_source_reference(bounds, lengths, seq_len, total, shift)
    assert valid.tolist() == want_valid
    assert [s for s, v in zip(source.tolist(), want_valid) if v] == [s for s, v in zip(want_source, want_valid) if v]


def test_the_suite_draws_deterministic_examples_without_a_database():
    """The ``ci`` profile (the default; tests/support/hypothesis_profiles.py): the same examples on every
    run and machine, nothing read from or written to ``.hypothesis/``."""
    if hypothesis_profiles.profile_name() != "ci":
        pytest.skip("NN_DATA_HYPOTHESIS_PROFILE selects the exploration profile")
    for s in (settings.default, SETTINGS):
        assert s.derandomize and s.database is None
    assert examples(150) == 150
