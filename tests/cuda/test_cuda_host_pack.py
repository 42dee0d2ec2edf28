"""Tier: GPU-only (marker ``cuda``), skipped without CUDA; ``NN_DATA_CUDA_DRY_RUN=1`` runs it on
the CPU, where the sync count is the Python-level one. Needs megatron-core (``PackedSeqParams``).

The NeMo-RL-compatible layer's eager default (host-planned packing) on a CUDA GPU: exactly one
host-device sync per packed microbatch (the read of the lengths), H2D copies included, and the
loop reference's results, CP rank 1 of 2, few and many sequences (both CP-shard forms).
"""

from __future__ import annotations

import pytest
import torch

from nn_data.nemo_rl.megatron_data import _pack_sequences_for_megatron
from nn_data.testing.coded import coded_batch
from nn_data.testing.reference import reference_pack, reference_shard
from nn_data.diagnostics import SyncCounter
from tests.cuda.stream import DEVICE, TIER

pytestmark = TIER


@pytest.mark.parametrize("rows", [5, 48])  # up to and above nn_data.layout.host.SHARD_VIEWS_MAX_SEGMENTS
def test_eager_compat_pack_syncs_once_and_equals_the_loop(rows):
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    gen = torch.Generator().manual_seed(rows)
    lengths = torch.randint(0, 20, (rows,), generator=gen)
    ids = coded_batch(lengths.tolist(), 20)
    total = rows * 24
    args = (ids.to(DEVICE), lengths.to(DEVICE), 4, 1, total, 1, 2)  # m 4, T fixed, CP rank 1 of 2
    _pack_sequences_for_megatron(*args)  # warm: PackedSeqParams imported, pinned memory pool
    with SyncCounter(DEVICE) as syncs:
        packed, local, params, cu, cu_pad = _pack_sequences_for_megatron(*args)
    assert syncs.count == 1, syncs.locations
    ref = reference_pack(ids, lengths.tolist(), 4, 1, total)
    assert torch.equal(packed.cpu(), ref.packed) and torch.equal(cu_pad.cpu(), ref.cu_seqlens_padded)
    assert torch.equal(local.cpu(), reference_shard(ref.packed, ref.cu_seqlens_padded, 2, 1))
    assert params.max_seqlen_q == ref.max_seqlen
