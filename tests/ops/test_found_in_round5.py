"""Tier: pure CPU, one process (the import-path walk runs one fresh interpreter).

What the fifth round of checks found (issue 34's findings 5, 6 and 10), each a test that failed before its
fix: a staged microbatch that took lengths longer than the rows it was loaded with, ``PackLayout``'s
methods that ran another microbatch's packed tensor, and import paths CHANGELOG.md promises.
"""

from __future__ import annotations

import pytest
import torch

from nn_data import PackedForward, PackSequences, PackingError
from nn_data.diagnostics import HostSyncCounter
from nn_data.models import TinyCausalLM
from nn_data.staging import StagedMicrobatch


@pytest.fixture(scope="module")
def packing():
    torch.manual_seed(0)
    model = TinyCausalLM(vocab=16, dim=8, heads=2, layers=1, mask_kind="dense").eval()
    return PackedForward(model, pad_individual_seqs_to_multiple_of=1, pad_full_seq_to=16, row_capacity=4)


def test_a_staged_microbatch_refuses_lengths_past_the_rows_it_was_loaded_with(packing):
    ids, lengths = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([6, 2])  # rows of 3 tokens, a length of 6
    with pytest.raises(PackingError, match=r"^seq_lengths\[0\] = 6 is outside \[0, S=3\]"):
        packing.prepare(ids, lengths)  # the unstaged path
    stage = StagedMicrobatch(packing, 10)  # staged rows of 10: the check must be against the 3 loaded
    with pytest.raises(RuntimeError, match=r"StagedMicrobatch.prepare: every seq_lengths value must be in \[0, S\] "
                                           r"\(S = the rows loaded: input_ids.shape\[1\] of load"):
        stage.load(ids, lengths).prepare()
    with HostSyncCounter() as syncs:  # a length that fits: still no host read
        stage.load(ids, torch.tensor([3, 2])).prepare()
    assert syncs.count == 0, syncs.calls
    unvalidated = StagedMicrobatch(packing, 10, validate=False)
    unvalidated.load(ids, lengths).prepare()  # validate=False: no check (the caller's choice)
    full = torch.zeros(4, 10, dtype=torch.int64)
    stage.load_rows(full, torch.tensor([10, 0, 0, 0]), torch.tensor(1)).prepare()  # rows of S: a length of S fits


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
