"""Tier: pure CPU, single process (hypothesis for the round trips). The oracle below re-derives NeMo-RL's
documented results with Python loops (it shares no code with the module it checks).

nn_data.nemo_rl.huggingface_common (NeMo-RL's nemo_rl.models.huggingface.common helpers) against a loop oracle
of NeMo-RL's results, with and without the host read, and its refusals.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nn_data.diagnostics import HostSyncCounter
from nn_data.errors import PackingError
from nn_data.nemo_rl.huggingface_common import FlashAttentionKwargs, get_flash_attention_kwargs, pack_sequences, unpack_tensor
from nn_data.testing.coded import coded_batch
from tests.support.hypothesis_profiles import examples


def oracle_pack(ids: torch.Tensor, lengths: list, sizes: list, pad: int, min_seq_len: int):
    """NeMo-RL's packed rows, row by row in Python: the group's sequences back to back, padded with ``pad``
    (positions 0) to ``max(longest row, min_seq_len)``; the document-causal mask of each row."""
    rows, start = [], 0
    for n in sizes:
        rows.append([(b, lengths[b]) for b in range(start, start + n)])
        start += n
    total = max([sum(n for _, n in row) for row in rows] + [min_seq_len])
    out_ids = torch.full((len(rows), total), pad, dtype=ids.dtype)
    out_pos = torch.zeros(len(rows), total, dtype=torch.int64)
    mask = torch.zeros(len(rows), total, total, dtype=torch.bool)
    for r, row in enumerate(rows):
        at = 0
        for b, n in row:
            out_ids[r, at : at + n] = ids[b, :n]
            out_pos[r, at : at + n] = torch.arange(n)
            mask[r, at : at + n, at : at + n] = torch.ones(n, n, dtype=torch.bool).tril()
            at += n
    return out_ids, out_pos, mask


@st.composite
def batches(draw):
    seq_len = draw(st.integers(0, 9))
    lengths = draw(st.lists(st.integers(0, seq_len), min_size=0, max_size=6))
    cuts = sorted(draw(st.lists(st.integers(0, len(lengths)), max_size=2)))
    bounds = [0, *cuts, len(lengths)]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    return lengths, seq_len, sizes, draw(st.integers(0, 12))


@settings(max_examples=examples(60))
@given(batches())
def test_pack_sequences_gives_nemo_rls_rows(case):
    """Rows, position ids and masks of any grouping, with the host read (NeMo-RL's T) and with the same
    T given as pad_full_seq_to (no read)."""
    lengths, seq_len, sizes, min_seq_len = case
    ids = coded_batch(lengths, seq_len)
    want = oracle_pack(ids, lengths, sizes, -1, min_seq_len)
    got = pack_sequences(ids, torch.tensor(lengths, dtype=torch.int64), sizes, padding_value=-1,
                         min_seq_len=min_seq_len)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    total = want[0].shape[1]
    if total:
        fixed = pack_sequences(ids, torch.tensor(lengths, dtype=torch.int64), sizes, padding_value=-1,
                               min_seq_len=min_seq_len, pad_full_seq_to=total)
        for w, g in zip(want, fixed):
            assert torch.equal(w, g)


def test_nemo_rls_docstring_example():
    ids = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 0], [6, 0, 0, 0], [7, 8, 9, 9], [8, 7, 0, 0], [6, 0, 0, 0],
                        [5, 4, 3, 0]])
    packed, positions, mask = pack_sequences(ids, torch.tensor([2, 3, 1, 4, 2, 1, 3]), [3, 4], padding_value=-1)
    assert packed.tolist() == [[1, 2, 3, 4, 5, 6, -1, -1, -1, -1], [7, 8, 9, 9, 8, 7, 6, 5, 4, 3]]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0, 0, 0, 0], [0, 1, 2, 3, 0, 1, 0, 0, 1, 2]]
    assert mask[0, 2].tolist() == [False, False, True] + [False] * 7  # sequence 2 sees only itself
    assert not mask[0, 6:].any()  # padding: no query


def test_a_fixed_packed_length_reads_nothing():
    ids, lengths = coded_batch([5, 0, 7], 8), torch.tensor([5, 0, 7])
    with HostSyncCounter() as syncs:
        packed, positions, mask = pack_sequences(ids, lengths, [3], return_attention_mask=False, min_seq_len=16,
                                                 pad_full_seq_to=16)
        flash = get_flash_attention_kwargs(lengths, max_seqlen=16)
        rows = unpack_tensor(packed.unsqueeze(-1), lengths, max_seqlen=8)
    assert syncs.count == 0, syncs.calls
    assert packed.shape == (1, 16) and mask is None and flash.max_seqlen_q == 16
    assert torch.equal(rows[..., 0], torch.where(ids == -7, 0, ids))
    with HostSyncCounter() as syncs:  # NeMo-RL's rule: T and the width depend on the lengths
        pack_sequences(ids, lengths, [3])
        get_flash_attention_kwargs(lengths)
    assert syncs.calls == ["tolist", "tolist"]


@settings(max_examples=examples(40))
@given(st.lists(st.integers(0, 6), max_size=5), st.integers(0, 3), st.sampled_from([(), (3,)]))
def test_unpack_tensor_undoes_the_pack(lengths, slack, trailing):
    """NeMo-RL's unpack of logits ``[1, T, V]`` (and, here, of ``[1, T]`` too): ``[B, max L, *]``, 0 past L."""
    seq_len = max(lengths, default=0)
    rows = coded_batch(lengths, seq_len, trailing, dtype=torch.float32)  # [B, S, *]
    total = sum(lengths) + slack
    flat = [rows[b, :n] for b, n in enumerate(lengths)]
    tensor = torch.cat(flat + [torch.full((slack, *trailing), -1.0)]).unsqueeze(0) if total else \
        torch.zeros(1, 0, *trailing)
    got = unpack_tensor(tensor, torch.tensor(lengths, dtype=torch.int64))
    want = torch.where(rows == -7 / 8, 0.0, rows)
    assert got.shape == want.shape and torch.equal(got, want)
    if seq_len:
        wider = unpack_tensor(tensor, torch.tensor(lengths, dtype=torch.int64), max_seqlen=seq_len + 2)
        assert torch.equal(wider[:, :seq_len], want) and not wider[:, seq_len:].any()


def test_flash_attention_kwargs():
    kw = get_flash_attention_kwargs(torch.tensor([2, 3, 1]))
    assert isinstance(kw, FlashAttentionKwargs) and kw.max_seqlen_q == kw.max_seqlen_k == 3
    assert kw.cu_seqlens_q.dtype == torch.int32 and kw.cu_seqlens_q.tolist() == [0, 2, 5, 6]
    assert kw.cu_seqlens_k is not kw.cu_seqlens_q and torch.equal(kw.cu_seqlens_k, kw.cu_seqlens_q)
    assert get_flash_attention_kwargs(torch.tensor([2, 3, 1]), max_seqlen=64).max_seqlen_q == 64
    empty = get_flash_attention_kwargs(torch.zeros(0, dtype=torch.int64))
    assert empty.cu_seqlens_q.tolist() == [0] and empty.max_seqlen_q == 0


def test_refusals_name_the_argument():
    ids, lengths = coded_batch([5, 3], 6), torch.tensor([5, 3])
    with pytest.raises(PackingError, match=r"packed_sequence_size=\[1\] is invalid; .* summing to B = "
                                           r"input_ids.shape\[0\] = 2"):
        pack_sequences(ids, lengths, [1])
    with pytest.raises(PackingError, match=r"pad_full_seq_to=4 is below min_seq_len=8"):
        pack_sequences(ids, lengths, [2], min_seq_len=8, pad_full_seq_to=4)
    with pytest.raises(PackingError, match=r"seq_lengths\[0\] = 7"):
        pack_sequences(ids, torch.tensor([7, 3]), [2])
    with pytest.raises(RuntimeError, match=r"exceeds pad_full_seq_to=4"):  # device assert: no read to name the value
        pack_sequences(ids, lengths, [2], pad_full_seq_to=4)
    with pytest.raises(PackingError, match=r"exceeds tensor.shape\[1\]=7"):
        unpack_tensor(torch.zeros(1, 7, 2), lengths)
    with pytest.raises(PackingError, match=r"tensor must be"):
        unpack_tensor(torch.zeros(2, 8), lengths)
    with pytest.raises(PackingError, match=r"input_lengths"):
        get_flash_attention_kwargs(torch.tensor([1.5]))
