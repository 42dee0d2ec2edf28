"""Tier: pure CPU, single process, eager (the CUDA-graph capture and replay are the GPU check's:
tests/cuda/test_cuda_graph_staging.py).

StagedMicrobatch: a stream of microbatches (varying row counts, lengths and row lengths, an empty one)
copied into buffers allocated once: the same addresses on every microbatch, the unstaged path's values
(``PackedForward.prepare``, ``NextTokenTargets``), nothing allocated by the copies, no host sync in load +
prepare, and the model's output on the staged tensors equal to PackedForward's.
"""

from __future__ import annotations

import pytest
import torch

from nn_data import PackedForward, PackingError
from nn_data.diagnostics import Allocations, HostSyncCounter
from nn_data.models import TinyCausalLM
from nn_data.staging import STAGED, StagedMicrobatch
from tests.support.staging_values import staged_values
from nn_data.testing.coded import coded_batch

R, S, T, M = 5, 12, 64, 4
VOCAB = 53


def stream():
    """``(ids [B, S'], lengths [B])``: B in 0..R, S' in 1..S, lengths 0..S'."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for i, (rows, width) in enumerate(((3, 12), (5, 7), (0, 12), (1, 1), (4, 9), (5, 12), (2, 4))):
        lengths = torch.randint(0, width + 1, (rows,), generator=gen)
        if i == 5:
            lengths[:] = width  # a full microbatch
        ids = coded_batch(lengths.tolist(), width) % VOCAB
        out.append((ids, lengths))
    return out


@pytest.fixture(scope="module")
def packing():
    torch.manual_seed(0)
    model = TinyCausalLM(vocab=VOCAB, dim=16, heads=2, layers=1, mask_kind="dense").eval()
    return PackedForward(model, pad_individual_seqs_to_multiple_of=M, pad_full_seq_to=T, row_capacity=R)


def test_a_stream_keeps_its_addresses_and_the_unstaged_values(packing):
    stage = StagedMicrobatch(packing, S)
    addresses = stage.addresses()
    for ids, lengths in stream():
        with HostSyncCounter() as syncs:
            stage.load(ids, lengths).prepare()
        assert syncs.count == 0, syncs.calls
        assert stage.addresses() == addresses
        want = staged_values(packing, ids, lengths)
        for name in STAGED:
            got = getattr(stage, name)
            assert got.dtype == want[name].dtype or name in ("max_seqlen", "cu_seqlens_padded"), name
            assert torch.equal(got, want[name].to(got.dtype)), (name, lengths.tolist())
        assert stage.info.cu_seqlens_padded is stage.cu_seqlens_padded and stage.info.padding_mask is stage.padding_mask
        with torch.no_grad():
            assert torch.equal(stage.forward(), packing.model(*_unstaged_call(packing, ids, lengths)))


def _unstaged_call(packing, ids, lengths):
    inp = packing.prepare(ids, lengths)
    return inp.input_ids, inp.position_ids, inp.packed


def test_loading_and_copying_allocate_nothing(packing):
    stage = StagedMicrobatch(packing, S)
    values = [(ids, lengths, staged_values(packing, ids, lengths)) for ids, lengths in stream()]
    for ids, lengths, want in values:
        with Allocations() as made:
            stage.load(ids, lengths)
            stage.copy_(**want)
        assert made.sizes == [], made.sizes
        assert torch.equal(stage.rows_ids[: ids.shape[0], : ids.shape[1]], ids) and not stage.rows_ids[ids.shape[0]:].any()
        assert int(stage.num_rows) == ids.shape[0]


def test_bad_input_is_named(packing):
    with pytest.raises(PackingError, match=r"needs PackedForward\(pad_full_seq_to=T, row_capacity=R\)"):
        StagedMicrobatch(PackedForward(packing.model, pad_full_seq_to=T), S)
    stage = StagedMicrobatch(packing, S)
    with pytest.raises(PackingError, match="row_capacity"):
        stage.load(torch.zeros(R + 1, S, dtype=torch.long), torch.zeros(R + 1, dtype=torch.long))
    with pytest.raises(PackingError, match=f"rows of at most seq_len={S}"):
        stage.load(torch.zeros(2, S + 1, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(PackingError, match=r"the staged input_ids is \(1, 64\) \(R=5, T=64, C=1\)"):
        stage.copy_(input_ids=torch.zeros(1, 32, dtype=torch.long))
    with pytest.raises(PackingError, match="StagedMicrobatch stages"):
        stage.copy_(logits=torch.zeros(1))


@pytest.fixture(scope="module")
def small_packing():
    torch.manual_seed(0)
    model = TinyCausalLM(vocab=16, dim=8, heads=2, layers=1, mask_kind="dense").eval()
    return PackedForward(model, pad_individual_seqs_to_multiple_of=1, pad_full_seq_to=16, row_capacity=4)


def test_a_staged_microbatch_refuses_lengths_past_the_rows_it_was_loaded_with(small_packing):
    ids, lengths = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([6, 2])  # rows of 3 tokens, a length of 6
    with pytest.raises(PackingError, match=r"^seq_lengths\[0\] = 6 is outside \[0, S=3\]"):
        small_packing.prepare(ids, lengths)  # the unstaged path
    stage = StagedMicrobatch(small_packing, 10)  # staged rows of 10: the check must be against the 3 loaded
    with pytest.raises(RuntimeError, match=r"StagedMicrobatch.prepare: every seq_lengths value must be in \[0, S\] "
                                           r"\(S = the rows loaded: input_ids.shape\[1\] of load"):
        stage.load(ids, lengths).prepare()
    with HostSyncCounter() as syncs:  # a length that fits: still no host read
        stage.load(ids, torch.tensor([3, 2])).prepare()
    assert syncs.count == 0, syncs.calls
    unvalidated = StagedMicrobatch(small_packing, 10, validate=False)
    unvalidated.load(ids, lengths).prepare()  # validate=False: no check (the caller's choice)
    full = torch.zeros(4, 10, dtype=torch.int64)
    stage.load_rows(full, torch.tensor([10, 0, 0, 0]), torch.tensor(1)).prepare()  # rows of S: a length of S fits


def test_a_tree_microbatch_is_refused_by_name(small_packing):
    """The staged targets hold one next token per packed position; a tree's branching token has one per
    child, so StagedMicrobatch refuses a tree's keywords (GRPO groups' too), naming them and why."""
    stage = StagedMicrobatch(small_packing, 4)
    ids, lens = torch.ones(2, 4, dtype=torch.long), torch.tensor([4, 4])
    tree = dict(parent=torch.tensor([-1, 0]), branch_at=torch.tensor([0, 2]))
    with pytest.raises(PackingError, match=r"StagedMicrobatch.load serves plain microbatches; \['branch_at', "
                                           r"'parent'\] make this a tree microbatch .* one per child"):
        stage.load(ids, lens, **tree)
    with pytest.raises(PackingError, match=r"\['group_ids', 'prefix_lengths'\] make this a tree microbatch"):
        stage.load(ids, lens, prefix_lengths=torch.tensor([2, 2]), group_ids=torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="unexpected keyword argument 'parents'"):
        stage.load(ids, lens, parents=tree["parent"])
