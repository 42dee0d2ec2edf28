"""Tier: pure CPU, single process, hypothesis.

The compat layer's host-planned eager pack (the plan's host executor, nn_data.layout.host) against
the loop reference and the device-planned graph, its aten-op count and its one host sync.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.hypothesis_profiles import examples
from nn_data.diagnostics import HostSyncCounter
from nn_data.errors import PackingError
from nn_data.nemo_rl.megatron_data import _pack_sequences_for_megatron
from nn_data.nemo_rl.megatron_data.dispatch import pack_microbatch
from nn_data.nemo_rl.megatron_data.graph import ROUTES, as_dicts
from nn_data.nemo_rl.megatron_data.options import PackOptions, nemo_rl_spec
from nn_data.layout import PackSpec
from nn_data.packed_sides import PackingSide
from nn_data.layout import host
from nn_data.testing.reference import reference_pack, reference_shard
from nn_data.testing.coded import PAD, coded_batch

SETTINGS = settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])


class AtenOps(TorchDispatchMode):
    """Counts every aten op dispatched while active (views and factory functions included)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@st.composite
def cases(draw):
    cp_size = draw(st.sampled_from([1, 2, 3, 4]))
    unit = 2 * cp_size if cp_size > 1 else 1
    m = unit * draw(st.integers(1, 3))
    p = unit * draw(st.sampled_from([1, 2]))
    seq_len = draw(st.integers(1, 14))
    lengths = draw(st.lists(st.integers(0, seq_len), min_size=0, max_size=40))
    natural = sum(-(-n // m) * m for n in lengths)
    pad_full = None
    if draw(st.booleans()) or not lengths:
        pad_full = max(p, -(-natural // p) * p + p * draw(st.integers(0, 3)))
    return lengths, seq_len, m, p, pad_full, cp_size, draw(st.integers(0, cp_size - 1))


def _extras(lengths, seq_len):
    ids = coded_batch(lengths, seq_len)
    return ids, dict(mtp_loss_mask=(ids % 3 == 0).float(), routed_experts=coded_batch(lengths, seq_len, (2, 3)),
                     token_identity=torch.stack([ids, -ids, ids * 2], dim=-1), media_token_validity_mask=ids % 2 == 0)


@SETTINGS
@given(cases(), st.sampled_from([0, 1000]))
def test_host_path_equals_the_reference_and_the_device_graph(case, views_max):
    lengths, seq_len, m, p, pad_full, cp_size, rank = case
    ids, extras = _extras(lengths, seq_len)
    spec = nemo_rl_spec(m, p, fixed_total=pad_full, cp_rank=rank, cp_size=cp_size, name="pad_full_seq_to")
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    with mock.patch.object(host, "SHARD_VIEWS_MAX_SEGMENTS", views_max):  # both shard forms
        out = pack_microbatch(ids, lengths_t, spec=spec, cp_rank=rank, options=PackOptions(), extras=extras)
    layout = out.layout
    ref = reference_pack(ids, lengths, m, p, pad_full)
    assert torch.equal(out.full["input_ids"], ref.packed)
    assert torch.equal(layout.cu_seqlens, ref.cu_seqlens) and torch.equal(layout.cu_seqlens_padded, ref.cu_seqlens_padded)
    assert layout.total == ref.packed.shape[1] and layout.host.cu_pad == ref.cu_seqlens_padded.tolist()
    assert layout.host.max_seqlen == ref.max_seqlen and layout.host.cu[-1] == sum(lengths)
    if ref.packed.shape[1] and lengths:
        assert torch.equal(out.local["input_ids"], reference_shard(ref.packed, ref.cu_seqlens_padded, cp_size, rank))
    if layout.total:  # the device-executor graph (the compiled path's, run eagerly) agrees tensor by tensor
        graph = PackingSide(PackSpec(m, p, fixed_total=layout.total), cp_size, rank, routes=ROUTES,
                            validate=False, host_reads=False)(ids, lengths_t, None, **extras)
        assert not graph.layout.on_host
        for side, ours in zip(("full", "local"), (out.full, out.local)):
            theirs = dict(zip(("full", "local"), as_dicts(graph)))[side]
            assert set(ours) == set(theirs), side
            for name in ours:
                assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), (side, name)
    topk = extras["routed_experts"].shape[-1]
    pad_rows = ref.packed[0] == 0  # coded ids are never 0: these are the packed padding positions
    assert torch.equal(out.full["routed_experts"][0][pad_rows], torch.arange(topk).expand(int(pad_rows.sum()), 2, topk))


@pytest.mark.parametrize("rows", [8, 64, 256])
def test_compat_eager_pack_and_shard_is_a_few_aten_ops_and_one_sync(rows):
    seq_len = 64
    gen = torch.Generator().manual_seed(rows)
    lengths = torch.randint(1, seq_len + 1, (rows,), generator=gen)
    ids = torch.randint(1, 50_000, (rows, seq_len), generator=gen)
    args = (ids, lengths, 8, 1, rows * seq_len, 1, 4)  # m 8, T = B*S, CP rank 1 of 4
    _pack_sequences_for_megatron(*args)  # imports PackedSeqParams once
    with AtenOps() as ops, HostSyncCounter() as syncs:
        packed, local, _, _, cu_pad = _pack_sequences_for_megatron(*args)
    assert len(ops.ops) <= 30, ops.ops
    assert syncs.count == 1, syncs.calls
    ref = reference_pack(ids, lengths, 8, 1, rows * seq_len)
    assert torch.equal(packed, ref.packed)
    assert torch.equal(local, reference_shard(ref.packed, ref.cu_seqlens_padded, 4, 1))


def test_no_sequence_and_no_token():
    ids = torch.zeros(0, 5, dtype=torch.int64)
    packed, local, params, cu, cu_pad = _pack_sequences_for_megatron(ids, torch.zeros(0, dtype=torch.int64), 4, 1,
                                                                    16, cp_rank=1, cp_size=2)
    assert packed.shape == (1, 16) and local.shape == (1, 8) and not packed.any() and not local.any()
    assert cu.tolist() == [0] and cu_pad.tolist() == [16]
    empty = coded_batch([0, 0], 3)  # two empty rows, nothing to pad to: T = 0
    packed, local, params, cu, cu_pad = _pack_sequences_for_megatron(empty, torch.tensor([0, 0]), 4, 1, None, 0, 2)
    assert packed.shape == (1, 0) and local.shape == (1, 0) and cu_pad.tolist() == [0, 0, 0]
    assert params.max_seqlen_q == 0


def test_invalid_input_raises_the_device_planners_messages():
    ids = coded_batch([3, 5], 5)
    with pytest.raises(PackingError, match=r"seq_lengths\[1\] = 6 is outside \[0, S=5\]"):
        _pack_sequences_for_megatron(ids, torch.tensor([3, 6]), 4)
    with pytest.raises(PackingError, match="exceeds pad_packed_seq_to=8"):
        _pack_sequences_for_megatron(ids, torch.tensor([3, 5]), 4, 1, 8)
    with pytest.raises(PackingError, match="segment 1 of cu_seqlens_padded is 6 tokens long"):
        _pack_sequences_for_megatron(ids, torch.tensor([3, 5]), 2, 1, 10, cp_rank=0, cp_size=2)
    with pytest.raises(PackingError, match=r"mtp_loss_mask has shape .*; it must be \[B, S, \*\]"):
        spec = nemo_rl_spec(4, 1, fixed_total=None, cp_rank=0, cp_size=1, name="pad_full_seq_to")
        pack_microbatch(ids, torch.tensor([3, 5]), spec=spec, cp_rank=0, options=PackOptions(),
                        extras={"mtp_loss_mask": torch.zeros(2, 4)})
    assert PAD not in _pack_sequences_for_megatron(ids, torch.tensor([3, 5]), 4)[0]
