"""Tier: pure CPU, single process, torch.compile(fullgraph=True) with the aot_eager backend (the graphs
are counted; the inductor path of the same ops is in test_compile_contract.py).

The compile contract of the entry points nn_data compiles itself: ``PackedForward(
compile_packing=True)`` and the profiler's compiled pipeline. One graph per side for a stream of row
lengths (``S = 0`` and ``1`` included) and row counts, compiled == eager on every field, and every
shape/dtype/device error raised as ``PackingError`` before the compiled region, with the eager
message; data errors stay device asserts.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from nn_data import PackingError
from nn_data.diagnostics import GraphCounter, HostSyncCounter
from nn_data.packed_forward import PackedForward
from profiling.microbatches.stream import MicrobatchPipeline, ModelStandIn, compile_pipeline
from nn_data.testing.coded import coded_batch

R, M, T = 6, 4, 96  # row capacity, multiple, pad_full_seq_to (6 rows x 14 tokens fit)
STREAM = [(14, 3), (9, 0), (1, 2), (0, 4), (5, 6), (2, 1), (3, 5), (4, 6), (6, 2), (7, 3), (8, 0), (10, 1),
          (11, 4), (12, 5), (13, 6), (1, 1), (0, 0)]  # 15 distinct S, rows 0..R


class Probe(torch.nn.Module):
    """A model that records what it was given and returns ``[1, T, 2]`` = (token, position id)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, input_ids, position_ids, packed):
        self.seen.append((input_ids, position_ids, packed))
        return torch.stack([input_ids, position_ids], dim=-1).float()  # [1, T, 2]


def _wrapped(model, **kwargs):
    return PackedForward(model, pad_individual_seqs_to_multiple_of=M, pad_full_seq_to=T, row_capacity=R, **kwargs)


@pytest.fixture(scope="module")
def packed_forward():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled_model, eager_model = Probe(), Probe()
    compiled = _wrapped(compiled_model, compile_packing=True, compile_kwargs={"backend": counter})
    yield compiled, compiled_model, _wrapped(eager_model), eager_model, counter
    torch._dynamo.reset()


def _batch(gen, seq_len, rows):
    lengths = torch.randint(0, seq_len + 1, (rows,), generator=gen)
    return coded_batch(lengths.tolist(), seq_len), lengths


def test_packed_forward_one_graph_per_side_for_a_stream_of_row_lengths(packed_forward):
    compiled, compiled_model, eager, eager_model, counter = packed_forward
    gen = torch.Generator().manual_seed(0)
    assert len({s for s, _ in STREAM}) >= 12 and {b for _, b in STREAM} == set(range(R + 1))
    with GraphCounter() as counted:  # the eager wrapper compiles nothing
        for seq_len, rows in STREAM:
            ids, lengths = _batch(gen, seq_len, rows)
            out = compiled(ids, lengths)
            want = eager(ids, lengths)
            assert out.shape == want.shape == (rows, seq_len, 2) and torch.equal(out, want)
            valid = torch.arange(seq_len) < lengths[:, None]
            assert torch.equal(out[..., 0], torch.where(valid, ids, 0).float())
            assert torch.equal(out[..., 1], torch.where(valid, torch.arange(seq_len).float(), 0.0))
            (ids_c, pos_c, info_c), (ids_e, pos_e, info_e) = compiled_model.seen[-1], eager_model.seen[-1]
            assert torch.equal(ids_c, ids_e) and torch.equal(pos_c, pos_e)
            for field in ("cu_seqlens_padded", "max_seqlen", "segment_ids", "query_index"):
                a, b = getattr(info_c, field), getattr(info_e, field)
                assert a.dtype == b.dtype and torch.equal(a, b), field
            assert (info_c.cp_size, info_c.cp_rank, info_c.gather) == (info_e.cp_size, info_e.cp_rank,
                                                                        info_e.gather)
    assert counter.frame_count == 2, f"{counter.frame_count} graphs (one packing, one unpacking side expected)"
    assert (counted.graphs, counted.compiles, counted.recompiles) == (2, 2, 0), vars(counted)


def _module_calls(call) -> list:
    """The modules ``call()`` calls (``nn.Module._call_impl`` frames on a module; a backend's compiled graph is
    not one), by class name, from Python's profile hook."""
    calls = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code is torch.nn.Module._call_impl.__code__:
            module = frame.f_locals.get("self")
            if isinstance(module, torch.nn.Module) and not isinstance(module, torch.fx.GraphModule):
                calls.append(type(module).__name__)

    torch._dynamo.eval_frame.skip_code(hook.__code__)  # the hook runs inside compiled calls: never compile it
    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return calls


def test_a_compiled_packed_forward_call_is_two_graphs_and_enters_no_module_but_its_own(packed_forward):
    """A steady call of ``PackedForward(compile_packing=True)`` runs its compiled sides as compiled functions,
    not modules: two ``nn.Module`` calls in all (the wrapper's and the model's), no host sync, and it reuses
    the two graphs (no new compilation)."""
    compiled, _, _, _, counter = packed_forward
    ids, lengths = coded_batch([3, 0, 5], 6), torch.tensor([3, 0, 5])
    compiled(ids, lengths)
    graphs = counter.frame_count
    assert _module_calls(lambda: compiled(ids, lengths)) == ["PackedForward", "Probe"]
    with HostSyncCounter() as syncs, GraphCounter() as counted:
        compiled(ids, lengths)
    assert syncs.count == 0, syncs.calls
    assert (counted.graphs, counted.recompiles) == (0, 0) and counter.frame_count == graphs == 2


def test_graph_counter_counts_graphs_compilations_and_recompiles():
    """nn_data.diagnostics.GraphCounter agrees with torch's test counter (``frame_count``) on the graphs, counts
    a graph break's two graphs as one frame's compilation plus its resume function's, and a recompile for
    each compilation of a frame after its first (a new shape under ``dynamic=False``, a new dtype)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    double = torch.compile(lambda x: x * 2 + 1, backend=counter, dynamic=False, fullgraph=True)
    with GraphCounter() as counted:
        for x in (torch.ones(3), torch.ones(4), torch.ones(4), torch.ones(3, dtype=torch.float64), torch.ones(3)):
            double(x)
    assert (counted.graphs, counted.compiles, counted.recompiles) == (3, 3, 2) and counter.frame_count == 3

    def broken(x):
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    with GraphCounter() as counted:
        torch.compile(broken, backend="eager")(torch.ones(2))
    assert (counted.graphs, counted.compiles, counted.recompiles) == (2, 2, 0)
    with GraphCounter() as counted:
        double(torch.ones(4))  # compiled already: nothing new
    assert (counted.graphs, counted.compiles, counted.recompiles) == (0, 0, 0)
    torch._dynamo.reset()


def _both_raise(compiled, eager, *args) -> str:
    """The same PackingError, with the same message, from the compiled and the eager wrapper."""
    with pytest.raises(PackingError) as got:
        compiled(*args)
    with pytest.raises(PackingError) as want:
        eager(*args)
    assert str(got.value) == str(want.value)
    return str(got.value)


def test_packed_forward_metadata_errors_raise_before_the_compiled_region(packed_forward):
    compiled, _, eager, _, counter = packed_forward
    ids, lengths = coded_batch([3, 0, 5], 6), torch.tensor([3, 0, 5])
    assert "dtype torch.float32" in _both_raise(compiled, eager, ids, lengths.float())
    assert "x on cpu, seq_lengths on meta" in _both_raise(compiled, eager, ids, lengths.to("meta"))
    assert "seq_lengths has 2 entries; expected 3" in _both_raise(compiled, eager, ids, lengths[:2])
    assert "input_ids must be a [B, S] tensor, got (3, 6, 1)" in _both_raise(compiled, eager, ids[..., None], lengths)
    # no row capacity: the pack's own checks run before the graph
    bare = PackedForward(Probe(), pad_full_seq_to=T, compile_packing=True, compile_kwargs={"backend": "eager"})
    assert "seq_lengths has 2 entries; expected 3" in _both_raise(bare, PackedForward(Probe(), pad_full_seq_to=T),
                                                                 ids, lengths[:2])
    assert counter.frame_count == 2  # nothing was compiled for them


def test_packed_forward_checks_the_model_output():
    def bad_model(input_ids, position_ids, packed):
        return torch.zeros(1, 5, 2)

    kwargs = dict(pad_individual_seqs_to_multiple_of=M, pad_full_seq_to=T, row_capacity=R)
    compiled = PackedForward(bad_model, compile_packing=True, compile_kwargs={"backend": "eager"}, **kwargs)
    message = _both_raise(compiled, PackedForward(bad_model, **kwargs), coded_batch([3, 5], 6), torch.tensor([3, 5]))
    assert message.startswith("the model returned (1, 5, 2); it must return [1, T/C, *] = [1, 96, *]")


def test_packed_forward_data_errors_stay_device_asserts():
    kwargs = dict(pad_individual_seqs_to_multiple_of=M, pad_full_seq_to=T, row_capacity=R)
    compiled = PackedForward(Probe(), compile_packing=True, compile_kwargs={"backend": "aot_eager"}, **kwargs)
    ids, lengths = coded_batch([3, 6], 6), torch.tensor([3, 9])  # 9 > S = 6
    with pytest.raises(RuntimeError, match=r"every seq_lengths value must be in \[0, S\]"):
        compiled(ids, lengths)
    with pytest.raises(PackingError, match=r"seq_lengths\[1\] = 9 is outside \[0, S=6\]"):
        PackedForward(Probe(), **kwargs)(ids, lengths)


@pytest.mark.parametrize("scope", ["data", "whole"])
def test_profiler_checks_before_its_compiled_region(scope):
    model = ModelStandIn("identity", vocab=16, hidden=4, out_features=1, seed=0)
    pipeline = MicrobatchPipeline(model, seq_len=6, total=32, multiple=4, cp_size=2, cp_rank=0)
    run = compile_pipeline(pipeline, scope=scope, mode=None)
    ids, num_rows = coded_batch([3, 0, 5], 6), torch.tensor(3)
    for lengths, message in ((torch.tensor([3.0, 0, 5]), "dtype torch.float32"),
                             (torch.tensor([3, 0]), "seq_lengths has 2 entries; expected 3"),
                             (torch.tensor([3, 0, 5], device="meta"), "x on cpu, seq_lengths on meta")):
        with pytest.raises(PackingError, match=message) as got:
            run(ids, lengths, num_rows)
        with pytest.raises(PackingError) as want:
            pipeline(ids, lengths, num_rows)
        assert str(got.value) == str(want.value)
