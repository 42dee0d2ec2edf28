"""Tier: pure CPU, single process (tiny models built from a config, nothing downloaded; a one-rank gloo
group on 127.0.0.1 for megatron-core's parallel_state). Under CP (C = 2 and 4, gloo):
tests/multiprocess/test_tree_models_multiprocess.py. Cases: tests/models/tree_cases.py.

Rollout trees through the models: ``PackedForward(...)(ids, L, parent=, branch_at=)`` (every shared
prefix packed once, trees of depth 1 to 4) equals every rollout run alone on its full row, logits and
parameter gradients (float64), through the HF adapter (Llama) and the megatron-core adapter (the tiny
GPTModel), and the head's outputs per rollout from the packed logits (``prepare``, ``layout_of``); the
hybrids (recurrent or convolution layers) run each rollout along its path.
"""

from __future__ import annotations

import pytest
import torch

from torch._dynamo.testing import CompileCounterWithBackend

from nn_data import _compat
from nn_data.adapters import HFCausalLMAdapter
from nn_data.diagnostics import HostSyncCounter
from nn_data.errors import PackingError
from nn_data.logprobs import TreeLogProbs
from nn_data.models.tiny_hf import tiny_hf_model
from nn_data.packed_forward import PackedForward
from tests.models import tree_cases as cases
from tests.models.adapter_cases import FLOAT32_STEP_TOL
from tests.support.megatron_release import needs_megatron_models, one_rank_parallel_state
from tests.support.flex_release import needs_cpu_flex


def test_llama_tree_equals_each_rollout_alone_float64():
    result = cases.case_hf("llama")
    assert result["out"] < 1e-10 and result["grad"] < 1e-10, result


@needs_cpu_flex
def test_flex_block_mask_on_a_tree():
    """mask_kind="block": the path rule in flex attention's mask_mod (CPU: forward only, float32)."""
    assert cases.case_hf_flex_forward()["worst"] < 2e-5


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_next", "mamba2", "bamba", "qwen3_5"])
def test_hybrids_fork_each_node_from_its_parents_state(kind):
    """Short convolution, gated delta net, Mamba-2: each node's tokens run once from its parent node's state
    at the branch point (nn_data.adapters.tree_state), equal to each rollout alone. The convolution is exact
    in float64; the gated delta rule and the SSD compute in float32 whatever the model's dtype and here chunk
    the row at other places than the rollout alone does: float32 rounding (FLOAT32_STEP_TOL); gradients at
    transformers' float32 norms."""
    result = cases.case_hf(kind, exact_norms=False)
    out_tol = 1e-10 if kind == "lfm2" else FLOAT32_STEP_TOL
    assert result["out"] < out_tol and result["grad"] < 1e-4, result


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_next", "mamba2", "bamba", "qwen3_5"])
def test_hybrid_trees_in_bfloat16_stay_within_bfloat16s_rounding(kind):
    """A bfloat16 model on trees of depth 1 to 4: each rollout's logits equal it run alone in bfloat16 within
    the conformance matrix's bfloat16 bound (3e-2: one bfloat16 rounding of a logit is 4e-3 relative; these
    differ by one rounding at most), forward only as the matrix's bfloat16 column."""
    model = tiny_hf_model(kind, dtype=torch.bfloat16, moe=False)
    worst = 0.0
    with torch.no_grad():
        for ids, lens, call, total in cases.tree_batches(2):
            out = PackedForward(HFCausalLMAdapter(model), pad_full_seq_to=total,
                                pad_individual_seqs_to_multiple_of=2)(ids, lens, **call)  # [B, S, V]
            for b, n in enumerate(lens.tolist()):
                if n:
                    alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]
                    worst = max(worst, float((out[b, :n] - alone).float().abs().max()))
    assert worst < 3e-2, (kind, worst)


@pytest.mark.parametrize("kind", ["llama", "lfm2", "qwen3_next", "mamba2"])
def test_a_tree_costs_its_tokens_in_every_layer(kind):
    """torch's flop counter over the packed tree's forward / every rollout alone is at most 1.35 x the token
    ratio + 0.02, on a GRPO group and a two-level tree (profiling/bench/bench_hybrid_trees.py; flop counts
    are deterministic): recurrent and convolution layers compute each shared token once too."""
    from profiling.bench.bench_hybrid_trees import grpo_group, two_level, work_ratio

    for tree in (grpo_group(), two_level()):
        tokens, work = work_ratio(kind, tree)
        assert work <= 1.35 * tokens + 0.02, (kind, tokens, work)


@pytest.mark.parametrize("kind, name", [("qwen3_next", "torch_chunk_gated_delta_rule"),
                                        ("mamba2", "mamba2_chunk_scan")])
def test_the_tree_hands_the_models_own_chunked_function_its_states(kind, name, monkeypatch):
    """The tree forward calls the model module's chunked function (the name transformers binds to
    flash-linear-attention's or mamba-ssm's kernel where installed) with one initial state per chunk row and
    asks for the final states; a stand-in recording the call delegates to the torch path."""
    import sys

    model = tiny_hf_model(kind, moe=False)
    module = sys.modules[type(model).__module__]
    # transformers 5.6 has no mamba2_chunk_scan: nn_data._compat finds the scan, the stand-in takes that name
    original = _compat.ssd_chunk_scan(module) if kind == "mamba2" else getattr(module, name)
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, stand_in, raising=False)
    ids, lens, call, total = next(cases.tree_batches(2, cases.TREES[1:2]))
    with torch.no_grad():
        PackedForward(HFCausalLMAdapter(model), pad_full_seq_to=total, verify=False)(ids, lens, **call)
    assert calls and all(kw.get("output_final_state", kw.get("return_final_states")) for kw in calls)
    if kind == "qwen3_next":  # an identity beside a zero state per chunk row
        assert all(kw["initial_state"].shape[0] > 1 for kw in calls)


def test_the_call_takes_one_spelling():
    wrapped = PackedForward(lambda ids, pos, packed: ids[..., None].float(), pad_full_seq_to=8)
    ids, lens, one = torch.ones(2, 4, dtype=torch.int64), torch.tensor([4, 4]), torch.tensor([-1, 0])
    with pytest.raises(PackingError, match=r"parent/branch_at \(a rollout tree\) and prefix_lengths/group_ids"):
        wrapped(ids, lens, prefix_lengths=one, group_ids=one, parent=one, branch_at=one)
    with pytest.raises(PackingError, match=r"parent was given without branch_at: a tree call needs both"):
        wrapped(ids, lens, parent=one)


@pytest.mark.compile
def test_compiled_packing_one_graph_each_side_and_no_host_sync_over_a_stream_of_trees():
    """compile_packing=True with a fixed T and a row capacity: the tree packing and unpacking compile once
    each (2 frames) over trees whose shapes, depths and lengths vary; no host read in a call after the
    first; every output equals the eager tree path."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model = tiny_hf_model("llama")
    common = dict(pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=160)
    # verify=False: the packing check runs its own (plain) microbatch, which compiles the plain packing's two
    # graphs once more (docs/models.md); these are the tree side's
    compiled = PackedForward(HFCausalLMAdapter(model, mask_kind="dense"), row_capacity=6, compile_packing=True,
                             compile_kwargs={"backend": counter}, verify=False, **common)
    eager = PackedForward(HFCausalLMAdapter(model, mask_kind="dense"), **common)
    syncs = []
    with torch.no_grad():
        for ids, lens, call, total in cases.tree_batches(4):
            assert total <= 160
            with HostSyncCounter() as counted:
                out = compiled(ids, lens, **call)
            syncs.append(counted.count)
            torch.testing.assert_close(out, eager(ids, lens, **call), rtol=0, atol=2e-6)
    assert counter.frame_count == 2, counter.frame_count
    assert syncs[1:] == [0] * (len(cases.TREES) - 1), syncs
    torch._dynamo.reset()


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["qwen3_next", "mamba2"])
def test_a_compiled_hybrid_is_one_graph_over_a_stream_of_trees(kind):
    """torch.compile(fullgraph=True) of the adapter around a hybrid, fed by the compiled packing under one
    pad_full_seq_to: one graph for a stream of trees of depth 1 to 4 and different node counts, no host read
    in a call after the first, every rollout equal to it alone (float32 steps: FLOAT32_STEP_TOL)."""
    torch._dynamo.reset()
    model = tiny_hf_model(kind, moe=False)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(HFCausalLMAdapter(model, mask_kind="dense"), backend=counter, fullgraph=True)
    wrapped = PackedForward(compiled, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=160, row_capacity=6,
                            compile_packing=True, compile_kwargs={"backend": "aot_eager"}, verify=False)
    syncs, worst = [], 0.0
    with torch.no_grad():
        for ids, lens, call, total in cases.tree_batches(4, cases.TREES + cases.TREES[:1]):
            assert total <= 160
            with HostSyncCounter() as counted:
                out = wrapped(ids, lens, **call)
            syncs.append(counted.count)
            for b, n in enumerate(lens.tolist()):
                if n:
                    alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]
                    worst = max(worst, float((out[b, :n] - alone).abs().max()))
    torch._dynamo.reset()
    assert counter.frame_count == 1 and worst < FLOAT32_STEP_TOL, (counter.frame_count, worst)
    assert syncs[1:] == [0] * len(cases.TREES), syncs


@pytest.mark.parametrize("compile_packing", [False, True], ids=["eager", "layout_rebuilt"])
def test_head_outputs_through_packed_forward_equal_each_rollout_alone(compile_packing):
    """``prepare(ids, L, parent=, branch_at=)``, the model on the packed row, ``layout_of``, then
    ``TreeLogProbs.outputs``: every rollout's log-prob, entropy, top-3 and argmax rows equal those of
    its logits run alone (float64; with ``compile_packing=True`` the layout is built again on the device)."""
    model = tiny_hf_model("llama").double().eval()
    wrapped = PackedForward(HFCausalLMAdapter(model, mask_kind="dense"), pad_individual_seqs_to_multiple_of=2,
                            pad_full_seq_to=96, compile_packing=compile_packing, compile_kwargs={"backend": "eager"},
                            verify=False)
    with torch.no_grad():
        for ids, lens, call, _ in cases.tree_batches(2, cases.TREES[1:3]):  # depth 2 and 3 (branchings)
            inp = wrapped.prepare(ids, lens, **call)
            assert (inp.microbatch.layout is None) == compile_packing
            logits = wrapped.model(inp.input_ids, inp.position_ids, inp.packed)  # [1, T, V]
            layout = wrapped.layout_of(inp)
            got = TreeLogProbs().outputs(logits, layout.pack(inp.row_ids), layout, entropy=True, top_k=3,
                                                 argmax=True)
            width = ids.shape[1] - 1
            for b, n in enumerate(lens.tolist()):
                lp = model(ids[b:b + 1, :n]).logits[0, :-1].log_softmax(-1)  # [L-1, V]: rollout b alone
                best = lp.topk(3)
                want = (lp.gather(1, ids[b, 1:n, None])[:, 0], -(lp.exp() * lp).sum(-1), best.values, best.indices,
                        lp.argmax(-1))
                for name, value in zip(("logprobs", "entropy", "topk_logprobs", "topk_indices", "argmax"), want):
                    row = getattr(got, name)[b]
                    torch.testing.assert_close(row[: n - 1], value, rtol=0, atol=1e-10, msg=name)
                    assert not row[max(n - 1, 0): width].any(), name
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def megatron_state():
    with one_rank_parallel_state():
        yield


@needs_megatron_models
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_tiny_gpt_model_tree_equals_each_rollout_alone_float64(megatron_state):
    result = cases.case_megatron()
    assert result["out"] < 1e-10 and result["grad"] < 1e-10, result


def test_the_found_tree_goes_straight_into_the_wrapper():
    """find_rollout_tree's numpy tree is taken as it is (one copy to the ids' device), giving what [B] tensors give."""
    from nn_data.planning import find_rollout_tree

    model = tiny_hf_model("llama").double().eval()
    wrapped = PackedForward(HFCausalLMAdapter(model), pad_individual_seqs_to_multiple_of=2, verify=False)
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 3, 3, 3], [5, 6, 2, 0, 0, 0], [4, 4, 0, 0, 0, 0]])
    lens = torch.tensor([5, 6, 3, 2])
    tree = find_rollout_tree(ids, lens)
    assert tree.parent.tolist() == [-1, 0, 0, -1] and tree.branch_at.tolist() == [0, 3, 2, 0]
    with torch.no_grad():
        from_numpy = wrapped(ids, lens, parent=tree.parent, branch_at=tree.branch_at)
        from_tensors = wrapped(ids, lens, parent=torch.as_tensor(tree.parent), branch_at=torch.as_tensor(tree.branch_at))
        alone = [model(ids[b:b + 1, :lens[b]]).logits[0] for b in range(4)]
    assert torch.equal(from_numpy, from_tensors)
    assert max((from_numpy[b, :lens[b]] - alone[b]).abs().max().item() for b in range(4)) < 1e-10
    with pytest.raises(PackingError, match=r"parent=\[-1.0, 0.5, 0, -1\] is invalid: not all integers"):
        wrapped(ids, lens, parent=[-1.0, 0.5, 0, -1], branch_at=tree.branch_at)


def test_the_pipeline_step_runs_a_tree_microbatch_as_each_rollout_alone():
    """pipeline_forward_step (one stage, the schedule's calls made by hand) over trees of depth 1 to 4 given
    as dicts with ``parent`` / ``branch_at``: the rows its loss gets equal each rollout run alone (float64)."""
    from nn_data.adapters import pipeline_forward_step

    model = tiny_hf_model("llama", dtype=torch.float64, moe=False)
    for ids, lens, call, total in cases.tree_batches(2):
        packing = PackedForward(HFCausalLMAdapter(model, mask_kind="dense"), pad_full_seq_to=total, verify=False)
        got = {}

        def loss_fn(rows, input_ids, seq_lengths):
            got["rows"] = rows
            return rows.sum(), int(seq_lengths.sum())

        step = pipeline_forward_step(packing, loss_fn)
        with torch.no_grad():
            output, loss_func = step(iter([{"input_ids": ids, "seq_lengths": lens, **call}]), packing.model)
            loss_func(output)
            for b, n in enumerate(lens.tolist()):
                assert not got["rows"][b, n:].any()  # 0 past each rollout (all of an empty one)
                if n:
                    alone = model(input_ids=ids[b:b + 1, :n], use_cache=False).logits[0]  # [L, V]
                    torch.testing.assert_close(got["rows"][b, :n], alone, rtol=0, atol=1e-10)
