"""Tier: pure CPU, single process (eager, plus torch.compile with the aot_eager backend).

PackedForward's one pipeline: the plain and the shared-prefix microbatch run the same prepare / finish
path (the kind of microbatch a strategy), reach the pack kernel in at most four nn_data frames, and keep
their records small; the whole wrapper compiles once over row lengths; a compiled shared-prefix call
gives its layout back for log-probs without ``[B, S, V]`` logits; a too-long shared-prefix microbatch is
refused with the shared total; a first compile is announced.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import nn_data
from nn_data.adapters import HFCausalLMAdapter
from nn_data.errors import PackingError
from nn_data.layout import host, tree as tree_module
from nn_data.logprobs import TreeLogProbs
from nn_data.models import TinyCausalLM
from nn_data.models.tiny_hf import tiny_hf_model
from nn_data import pack as pack_module, packed_forward, packed_tree, packed_sides
from nn_data.packed_forward import PackedForward
from nn_data.rows import pad_to_row_capacity, with_dynamic_row_length
from tests.models import shared_prefix_cases as cases

PACKAGE = str(Path(nn_data.__file__).parent)
VOCAB = 53


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return TinyCausalLM(vocab=VOCAB, dim=32, heads=4, layers=2).eval()


def _kernel_stacks(monkeypatch, owner, name, call):
    """The nn_data frames from PackedForward.forward (inclusive) down to the pack kernel ``owner.name``
    (exclusive): the host executor's ``pack``, or the gather the shared-prefix layout packs with."""
    seen, real = [], getattr(owner, name)

    def recording(*args, **kwargs):
        frames = [f.frame for f in inspect.stack()[1:]]
        ours = [f.f_code.co_name for f in frames if f.f_code.co_filename.startswith(PACKAGE)][::-1]
        seen.append(ours[ours.index("forward"):])
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    call()
    return seen


def test_forward_reaches_the_pack_kernel_in_at_most_four_frames(tiny, monkeypatch):
    ids, lens = torch.randint(1, VOCAB, (3, 6)), torch.tensor([4, 0, 6])
    wrapped = PackedForward(tiny, pad_individual_seqs_to_multiple_of=4, verify=False)  # the call's own pack only
    stacks = _kernel_stacks(monkeypatch, host.HostExecutor, "pack", lambda: wrapped(ids, lens))
    assert stacks == [["forward", "prepare", "forward", "pack"]], stacks


def test_a_shared_prefix_forward_reaches_its_kernel_in_at_most_four_frames(monkeypatch):
    ids, lens, pre, gid = cases.rollouts([7, 7, 9], [2, 2, 1], [4, 3, 3], torch.Generator().manual_seed(0))
    wrapped = PackedForward(HFCausalLMAdapter(tiny_hf_model("llama"), mask_kind="dense"), pad_full_seq_to=16)
    stacks = _kernel_stacks(monkeypatch, tree_module, "gather_pack",
                            lambda: wrapped(ids, lens, prefix_lengths=pre, group_ids=gid))
    assert stacks and all(len(s) <= 4 for s in stacks), stacks
    assert stacks[0] == ["forward", "prepare", "forward", "pack"], stacks


def test_records_have_at_most_seven_fields():
    records = [packed_forward.PackedInfo, packed_forward.PackedInput, packed_forward.PackedBounds,
               packed_forward.CPShare, packed_forward.Microbatch, packed_sides.PackedSide,
               packed_tree.TreeInfo, packed_tree.RolloutGroups, packed_sides.Shard, pack_module.PackResult]
    assert {r.__name__: len(r._fields) for r in records if len(r._fields) > 7} == {}


def test_every_kind_of_microbatch_runs_one_pipeline():
    """The kind is a strategy of PackingSide / UnpackingSide: the tree (GRPO groups its depth-1 spelling, one
    kind) has no module of its own, and the pipeline's sides are one class each whatever the kind."""
    assert {kind.name for kind in packed_forward.KINDS} == {"plain", "rollout-tree"}
    assert not [n for n, v in vars(packed_tree).items() if isinstance(v, type) and issubclass(v, torch.nn.Module)]


@pytest.mark.compile
def test_the_whole_wrapper_compiles_once_over_row_lengths(tiny):
    """torch.compile(PackedForward(..., row_capacity=R), fullgraph=True) given R rows (pad_to_row_capacity
    outside) with the row length marked (with_dynamic_row_length): one graph for every row count and every
    S, 0 and 1 included, equal to the eager call."""
    torch._dynamo.reset()
    wrapped = PackedForward(tiny, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=64, row_capacity=8)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(wrapped, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for rows, row_len in ((3, 10), (5, 12), (2, 7), (4, 0), (1, 1)):
            ids = torch.randint(1, VOCAB, (rows, row_len), generator=gen)
            lens = torch.randint(0, row_len + 1, (rows,), generator=gen)
            ids = torch.where(torch.arange(row_len) < lens[:, None], ids, 0)
            padded = pad_to_row_capacity(ids, lens, 8)
            out = compiled(with_dynamic_row_length(padded.x), padded.seq_lengths)[:rows]
            torch.testing.assert_close(out, wrapped(ids, lens), rtol=0, atol=1e-6)
    assert counter.frame_count == 1, counter.frame_count
    torch._dynamo.reset()


@pytest.mark.compile
def test_the_whole_wrapper_compiles_with_inductor(tiny):
    """docs/compile-contract.md's whole-wrapper compile with the default backend (inductor's C++ on the CPU; torch
    2.11's could not build the row padding's kernel): equal to the eager call."""
    torch._dynamo.reset()
    wrapped = PackedForward(tiny, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=64, row_capacity=8)
    compiled = torch.compile(wrapped, fullgraph=True)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        ids, lens = torch.randint(1, VOCAB, (3, 10), generator=gen), torch.tensor([10, 4, 7])
        ids = torch.where(torch.arange(10) < lens[:, None], ids, 0)
        padded = pad_to_row_capacity(ids, lens, 8)
        out = compiled(with_dynamic_row_length(padded.x), padded.seq_lengths)[:3]
        torch.testing.assert_close(out, wrapped(ids, lens), rtol=0, atol=1e-5)
    torch._dynamo.reset()


def _token_logprobs(rows_logits: torch.Tensor, ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """``[B, S-1]``: log p(ids[b, s+1]) from the rows' logits, 0 at ``s >= L - 1`` (the loop reference)."""
    out = torch.log_softmax(rows_logits[:, :-1].double(), dim=-1).gather(2, ids[:, 1:, None])[..., 0]
    keep = torch.arange(ids.shape[1] - 1) < (lens[:, None] - 1)
    return torch.where(keep, out, 0.0)


@pytest.mark.compile
def test_compiled_shared_prefix_logprobs_without_vocab_rows_and_the_first_compile_is_announced(capfd):
    torch._dynamo.reset()
    adapter = HFCausalLMAdapter(tiny_hf_model("llama"), mask_kind="dense")
    common = dict(pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=64)
    compiled = PackedForward(adapter, row_capacity=6, compile_packing=True,
                             compile_kwargs={"backend": "aot_eager"}, **common)
    eager = PackedForward(adapter, **common)
    gen = torch.Generator().manual_seed(2)
    for step, (groups, prefix, lengths) in enumerate(cases.MICROBATCHES[:3]):
        ids, lens, pre, gid = cases.rollouts(groups, prefix, lengths, gen)
        with torch.no_grad():
            inp = compiled.prepare(ids, lens, prefix_lengths=pre, group_ids=gid)
            announced = capfd.readouterr().err
            assert inp.layout is None  # the compiled packing side keeps its index maps
            logits = adapter(inp.input_ids, inp.position_ids, inp.packed)  # [1, T, V]
            shared = compiled.layout_of(inp)
            got = TreeLogProbs()(logits, shared.pack(inp.row_ids), shared)[: inp.rows]  # [B, S-1]
            want = _token_logprobs(eager(ids, lens, prefix_lengths=pre, group_ids=gid), ids, lens)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
        if step == 0:
            assert "compiling PackedForward's packing side of a rollout-tree microbatch" in announced, announced
        else:
            assert "compiling" not in announced, announced
    torch._dynamo.reset()


def test_a_shared_prefix_microbatch_too_long_names_the_shared_total():
    """Two rollouts of one group, P 20, L [30, 29]: the slots hold 20 + 10 + 9 = 39 tokens (the lengths
    sum to 59); pad_full_seq_to=32 is refused naming 39 and the fix."""
    ids, lens, pre, gid = cases.rollouts([0, 0], [20, 20], [30, 29], torch.Generator().manual_seed(3), seq_len=30)
    wrapped = PackedForward(TinyCausalLM(vocab=VOCAB, dim=8, heads=2, layers=1), pad_full_seq_to=32)
    with pytest.raises(PackingError, match=r"the shared-prefix packed total \(each group's prompt once, then every "
                                           r"response, each slot rounded up to m=1\) = 39 exceeds pad_full_seq_to=32; "
                                           r"pad_full_seq_to must be at least 39 \(the rollouts' own lengths sum to 59: "
                                           r"each prompt is packed once\).*plan_step_shared_prefix"):
        wrapped(ids, lens, prefix_lengths=pre, group_ids=gid)


def test_a_rollout_tree_too_long_names_the_trees_packed_total_and_its_planner():
    """A root of 6 tokens, two children branching at 4 and one grandchild at 5: lengths [6, 7, 8, 9] (sum 30);
    the tree holds 6 + 3 + 4 + 4 = 17 tokens, each shared one once; pad_full_seq_to=16 is refused naming 17."""
    lens = torch.tensor([6, 7, 8, 9])
    parent, branch_at = torch.tensor([-1, 0, 0, 2]), torch.tensor([0, 4, 4, 5])
    ids = torch.randint(1, VOCAB, (4, 9), generator=torch.Generator().manual_seed(3))
    for b in (1, 2):  # each child shares its parent's first 4 tokens
        ids[b, :4] = ids[0, :4]
    ids[3, :5] = ids[2, :5]
    ids = torch.where(torch.arange(9) < lens[:, None], ids, 0)
    wrapped = PackedForward(TinyCausalLM(vocab=VOCAB, dim=8, heads=2, layers=1), pad_full_seq_to=16)
    with pytest.raises(PackingError, match=r"the rollout tree's packed total \(each shared token once, each node's "
                                           r"slot rounded up to m=1\) = 17 exceeds pad_full_seq_to=16; "
                                           r"pad_full_seq_to must be at least 17 \(the rollouts' own lengths sum to "
                                           r"30: each shared prefix is packed once\).*plan_step_rollout_tree"):
        wrapped(ids, lens, parent=parent, branch_at=branch_at)
    PackedForward(TinyCausalLM(vocab=VOCAB, dim=8, heads=2, layers=1), pad_full_seq_to=17)(
        ids, lens, parent=parent, branch_at=branch_at)  # 17 fits


@pytest.mark.compile
def test_a_compiled_shared_prefix_microbatch_too_long_gives_the_value_to_reach_and_the_fix():
    torch._dynamo.reset()
    ids, lens, pre, gid = cases.rollouts([0, 0], [20, 20], [30, 29], torch.Generator().manual_seed(3), seq_len=30)
    wrapped = PackedForward(TinyCausalLM(vocab=VOCAB, dim=8, heads=2, layers=1), pad_full_seq_to=32,
                            compile_packing=True, compile_kwargs={"backend": "aot_eager"})
    with pytest.raises(RuntimeError, match=r"shared-prefix packed total .* exceeds pad_full_seq_to=32; raise "
                                           r"pad_full_seq_to to at least sum\(round_up\(P, m\)\) over the groups \+ "
                                           r"sum\(round_up\(L - P, m\)\) over the rollouts, or split the microbatch"):
        wrapped.prepare(ids, lens, prefix_lengths=pre, group_ids=gid)
    torch._dynamo.reset()
