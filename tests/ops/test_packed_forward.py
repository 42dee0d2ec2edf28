"""Tier: pure CPU, single process (eager, plus torch.compile with the aot_eager backend).

PackedForward on one process: a real attention model run on packed tokens gives, for every
sequence, the output of running that sequence alone; the packing side compiles once per stream.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from nn_data import PackingError, PackSequences
from nn_data.masks import document_causal_mask
from nn_data.models import TinyCausalLM
from nn_data.packed_forward import PackedForward, _check_cp_config

VOCAB, S = 53, 14


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyCausalLM(vocab=VOCAB, dim=32, heads=4, layers=2).eval()


def _batch(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), S), generator=gen)
    lens = torch.tensor(lengths, dtype=torch.int64)
    return torch.where(torch.arange(S) < lens[:, None], ids, 0), lens


def _assert_matches_alone(model, ids, lens, out):
    for b, n in enumerate(lens.tolist()):
        if n:
            alone = model.forward_single(ids[b : b + 1, :n])[0]  # [n, V]
            torch.testing.assert_close(out[b, :n], alone, rtol=1e-5, atol=2e-6)
        assert not out[b, n:].any(), "outputs past a row's length must be 0"


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("full", [None, 160], ids=["natural-T", "pad_full_seq_to"])
@pytest.mark.parametrize("lengths", [[5, 0, 14, 3], [14], [0, 0, 7], [1, 2, 3, 4, 5, 6]])
def test_packed_forward_equals_each_sequence_alone(model, m, full, lengths):
    ids, lens = _batch(lengths)
    with torch.no_grad():
        out = PackedForward(model, pad_individual_seqs_to_multiple_of=m, pad_full_seq_to=full)(ids, lens)
    assert out.shape == (len(lengths), S, VOCAB)
    _assert_matches_alone(model, ids, lens, out)


def test_gradients_flow_to_the_model(model):
    ids, lens = _batch([4, 9])
    out = PackedForward(model, pad_individual_seqs_to_multiple_of=8, pad_full_seq_to=32)(ids, lens)
    out[0, :4].sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    model.zero_grad()


@pytest.mark.compile
def test_compiled_packing_compiles_once_over_a_stream(model):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    wrapped = PackedForward(model, pad_individual_seqs_to_multiple_of=8, pad_full_seq_to=96, row_capacity=6,
                            compile_packing=True, compile_kwargs={"backend": counter})
    eager = PackedForward(model, pad_individual_seqs_to_multiple_of=8, pad_full_seq_to=96)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for step in range(12):
            rows = 1 + step % 6
            ids, lens = _batch(torch.randint(0, S + 1, (rows,), generator=gen).tolist(), seed=step)
            out = wrapped(ids, lens)
            torch.testing.assert_close(out, eager(ids, lens), rtol=0, atol=0)
            if step < 3:
                _assert_matches_alone(model, ids, lens, out)
    assert counter.frame_count == 2  # one graph for the packing side, one for the unpacking side
    torch._dynamo.reset()


def test_packed_seq_params_for_megatron_models():
    seen = {}

    def probe(input_ids, position_ids, packed):
        seen["info"] = packed
        return input_ids[..., None].float()

    ids, lens = _batch([3, 6])
    out = PackedForward(probe, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=16,
                        make_packed_seq_params=True)(ids, lens)
    torch.testing.assert_close(out[..., 0], torch.where(ids > 0, ids, 0).float())
    info = seen["info"]
    params = info.packed_seq_params
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 16
    assert info.cu_seqlens_padded.tolist() == [0, 4, 16]
    for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert torch.equal(getattr(params, field), info.cu_seqlens_padded)
    assert info.query_index.tolist() == list(range(16)) and info.gather is None
    assert info.segment_ids.tolist() == [0] * 4 + [1] * 12


def test_position_ids_restart_per_sequence():
    seen = {}

    def probe(input_ids, position_ids, packed):
        seen["pos"] = position_ids
        return input_ids[..., None].float()

    ids, lens = _batch([3, 0, 5])
    PackedForward(probe, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=16)(ids, lens)
    assert seen["pos"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def test_document_causal_mask_example():
    mask = document_causal_mask(torch.tensor([1, 2]), torch.tensor([0, 0, 1, 1]))
    assert mask.tolist() == [[True, True, False, False], [False, False, True, False]]


def test_configuration_errors():
    with pytest.raises(PackingError, match=r"with cp_size=2, pad_individual_seqs_to_multiple_of=3 and "
                                           r"pad_full_seq_to=40 must be multiples of 2\*cp_size=4"):
        _check_cp_config(2, PackSequences(3, 1, 40))
    with pytest.raises(PackingError, match=r"pad_packed_seq_to_multiple_of=1 must be multiples of 2\*cp_size=4"):
        _check_cp_config(2, PackSequences(4, 1, None))
    _check_cp_config(2, PackSequences(4, 1, 40))  # fine
    with pytest.raises(PackingError, match=r"input_ids must be a \[B, S\] tensor, got \(5,\)"):
        PackedForward(lambda *a: a[0])(torch.arange(5), torch.tensor([5]))
    with pytest.raises(PackingError, match=r"row_capacity=0 is invalid"):
        PackedForward(lambda *a: a[0], row_capacity=0)


def test_more_rows_than_row_capacity_names_row_capacity(model):
    ids, lens = _batch([3, 5, 1])
    wrapped = PackedForward(model, pad_full_seq_to=64, row_capacity=2)
    with pytest.raises(PackingError, match=r"the batch has 3 rows, more than row_capacity=2; raise row_capacity to "
                                           r"at least 3"):
        wrapped(ids, lens)


def test_example_script_pads_to_a_multiple_of_2cp_for_every_cp():
    """``python -m scripts.packed_forward_example --cp N``: ``--multiple`` is rounded up to a multiple of
    ``2N`` and ``pad_full_seq_to`` is a multiple of it, so PackedForward accepts the configuration for
    every N from 1 to 8 (the spawned runs themselves: tests/multiprocess/test_examples_multiprocess.py)."""
    from scripts import packed_forward_example

    for cp in range(1, 9):
        args = packed_forward_example.parse_args(["--cp", str(cp)])
        multiple, full = packed_forward_example.padding(args)
        assert multiple % (2 * cp) == 0 and multiple >= args.multiple and full % multiple == 0, (cp, multiple, full)
        assert full >= args.rows * multiple * -(-args.seq_len // multiple)  # every full row fits
        _check_cp_config(cp, PackSequences(multiple, 1, full))
    assert packed_forward_example.padding(packed_forward_example.parse_args(["--cp", "3"])) == (12, 576)


@pytest.mark.parametrize("row_capacity", [None, 4])
def test_an_eager_forward_costs_one_host_sync(model, row_capacity):
    """The pack's read of the lengths; its plan travels to the gather and the unpack."""
    from nn_data.diagnostics import HostSyncCounter

    ids, lens = _batch([5, 0, 14])
    wrapped = PackedForward(model, pad_individual_seqs_to_multiple_of=2, pad_full_seq_to=48, row_capacity=row_capacity)
    with torch.no_grad():
        wrapped(ids, lens)
        with HostSyncCounter() as syncs:
            out = wrapped(ids, lens)
    assert syncs.count == 1, syncs.calls
    _assert_matches_alone(model, ids, lens, out)
