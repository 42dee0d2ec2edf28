"""Cases run on every spawned rank (tests/support/cp_harness.py, 4 ranks) for
tests/multiprocess/test_groups_multiprocess.py: groups held as a DeviceMesh, as torchtitan and the
DTensor stacks hold them.

Each rank builds one 2-D ``("dp", "cp")`` mesh of the 4 ranks (``[[0, 1], [2, 3]]``: CP groups
``{0, 1}``, ``{2, 3}``; DP groups ``{0, 2}``, ``{1, 3}``) and one 1-D mesh of all 4, once per process
(every mesh is a set of gloo groups that lives as long as the process). Every op that takes a group
is run with the mesh forms and with the mesh's ProcessGroup: the results must be identical.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nn_data.errors import PackingError
from nn_data.groups import as_process_group, collection_group, context_parallel_info, group_info, is_group_form


@functools.lru_cache(maxsize=1)
def meshes():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp")), init_device_mesh("cpu", (4,),
                                                                                          mesh_dim_names=("cp",))


def case_resolution() -> dict:
    """Every form resolves to the mesh's own ProcessGroup, with this rank's rank and size in it."""
    mesh, flat = meshes()
    rank = dist.get_rank()
    cp_group, dp_group = mesh.get_group("cp"), mesh.get_group("dp")
    forms = {"mesh['cp']": mesh["cp"], "(mesh, 'cp')": (mesh, "cp"), "(mesh, 1)": (mesh, 1), "group": cp_group}
    for name, form in forms.items():
        info = group_info(form, "context-parallel group")
        assert info == (rank % 2, 2, cp_group) and info.group is cp_group, name
        assert as_process_group(form) is cp_group and is_group_form(form), name
        assert context_parallel_info(form) == info, name
    assert group_info((mesh, "dp")) == (rank // 2, 2, dp_group) and group_info(mesh["dp"]).group is dp_group
    assert group_info(flat) == (rank, 4, flat.get_group()) and group_info((flat, 0)).size == 4
    # megatron-core's ProcessGroupCollection form (a stand-in with its cp field), alone and with the same group
    assert context_parallel_info(pg_collection=SimpleNamespace(cp=mesh["cp"])).group is cp_group
    assert context_parallel_info(mesh["cp"], pg_collection=SimpleNamespace(cp=cp_group)).group is cp_group
    return {"members": sorted(dist.get_process_group_ranks(cp_group)),
            "dp_members": sorted(dist.get_process_group_ranks(dp_group))}


def case_refusals() -> list:
    """The forms nn_data refuses, with what it says."""
    mesh, _ = meshes()
    outsiders = dist.new_group([0, 1])  # ranks 2 and 3 get GroupMember.NON_GROUP_MEMBER
    checks = [
        (mesh, r"context-parallel group is a 2-D DeviceMesh \(dims \('dp', 'cp'\)\); pass the 1-D mesh of one "
               r"dimension \(mesh\['cp'\]\) or a \(mesh, dim\) pair"),
        ((mesh, "tp"), r"mesh dimension 'tp' is not one of the mesh's dims \('dp', 'cp'\) \(or an index below 2\)"),
        ((mesh, 2), r"mesh dimension 2 is not one of the mesh's dims"),
        ("cp", r"context-parallel group is a str; pass a torch.distributed ProcessGroup, a 1-D DeviceMesh, a "
               r"\(DeviceMesh, dim\) pair, or None \(not split\)"),
        ((mesh,), r"is a tuple"),
    ]
    if dist.get_rank() >= 2:
        checks.append((outsiders, r"this process is not a member of the context-parallel group it was given"))
    messages = []
    for form, match in checks:
        with pytest.raises(PackingError, match=match) as e:
            group_info(form, "context-parallel group")
        messages.append(str(e.value))
    with pytest.raises(PackingError, match=r"the context-parallel group given and pg_collection.cp are different "
                                           r"groups \(sizes 2 and 2\); pass one of them"):
        context_parallel_info(mesh["cp"], pg_collection=SimpleNamespace(cp=mesh["dp"]))
    with pytest.raises(PackingError, match=r"pg_collection \(SimpleNamespace\) has no 'cp' group"):
        collection_group(SimpleNamespace(tp=None), "cp")
    dist.destroy_process_group(outsiders) if dist.get_rank() < 2 else None
    return messages


def _forms(mesh, dim: str) -> dict:
    """The group of ``dim`` as a user may hold it: the 1-D mesh, the (mesh, dim) pair, the ProcessGroup."""
    return {"mesh[dim]": mesh[dim], "(mesh, dim)": (mesh, dim), "group": mesh.get_group(dim)}


def _same_for_every_form(run, forms: dict):
    """``run(form)`` for every form: the results must be bit for bit the ProcessGroup's."""
    results = {name: run(form) for name, form in forms.items()}
    want = results["group"]
    for name, got in results.items():
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(a, b), f"{name} differs from the ProcessGroup's result"
    return want


def case_ops_with_a_mesh() -> dict:
    """The ops that take a CP or TP group, with mesh forms: the CP gather (forward and backward),
    TokenLogProbs vocab-parallel over the mesh's "dp" dim standing in for TP, NeMo-RL's log-prob
    functions and CP all-gather, megatron-bridge's partition indices, and NeMo-RL's DP reductions of
    both data paths; each equal to the single-process (or ProcessGroup) result."""
    from nn_data import GatherFromContextParallel, ShardForContextParallel, TokenLogProbs
    from nn_data.nemo_rl import automodel_data, megatron_data, model_utils
    from nn_data.testing.reference import reference_token_logprobs
    from tests.support.cp_cases import SEQ_LEN, VOCAB, _logprob_inputs, microbatches

    mesh, _ = meshes()
    cp_rank, tp_rank = mesh.get_local_rank("cp"), mesh.get_local_rank("dp")
    shard = ShardForContextParallel(2, cp_rank)
    mb = microbatches(2)[0]
    r, ids, full, _ = _logprob_inputs(mb, 3)

    def gathered(form):
        local = shard(full, r.cu_seqlens_padded).clone().requires_grad_()
        out = GatherFromContextParallel(form)(local, r.cu_seqlens_padded)
        (out * torch.arange(out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        return out.detach(), local.grad

    out, grad = _same_for_every_form(gathered, _forms(mesh, "cp"))
    assert torch.equal(out, full)
    cols = VOCAB // 2
    mine = shard(full, r.cu_seqlens_padded)[..., tp_rank * cols : (tp_rank + 1) * cols]  # [1, T/2, V/2]

    def token_logprobs(form):
        op = TokenLogProbs(SEQ_LEN, cp_group=form, tp_group=(mesh, "dp"), chunk_tokens=8)
        return op(mine, ids, r.cu_seqlens, r.cu_seqlens_padded)

    values = _same_for_every_form(token_logprobs, _forms(mesh, "cp"))
    ref = reference_token_logprobs(full, ids, r.cu_seqlens, r.cu_seqlens_padded, SEQ_LEN)
    torch.testing.assert_close(values, ref, rtol=0, atol=1e-12)
    rows = full.view(2, -1, VOCAB)[:, :16]  # two unpacked rows [2, 16, V] of the same logits
    target = ids.view(2, -1)[:, :16]

    def nemo_logprobs(form):
        local = model_utils._get_tokens_on_this_cp_rank(rows, cp_rank, 2)[..., tp_rank * cols : (tp_rank + 1) * cols]
        lp = model_utils.from_parallel_logits_to_logprobs(local, target, tp_rank * cols, (tp_rank + 1) * cols,
                                                          (mesh, "dp"), cp_group=form)
        return lp, model_utils.allgather_cp_sharded_tensor(model_utils._get_tokens_on_this_cp_rank(rows, cp_rank, 2),
                                                           form)

    lp, regathered = _same_for_every_form(nemo_logprobs, _forms(mesh, "cp"))
    assert torch.equal(regathered, rows)
    single = model_utils.from_parallel_logits_to_logprobs(rows, target, 0, VOCAB, None)
    torch.testing.assert_close(lp, single, rtol=0, atol=1e-12)
    params = SimpleNamespace(cu_seqlens_q_padded=r.cu_seqlens_padded, cu_seqlens_q=r.cu_seqlens)
    indices = _same_for_every_form(lambda form: megatron_data.get_packed_seq_cp_partition_indices(
        params, total_tokens=full.shape[1], cp_size=2, cp_rank=cp_rank, device="cpu", cp_group=form),
        _forms(mesh, "cp"))
    assert torch.equal(full[0, indices], shard(full, r.cu_seqlens_padded)[0])
    return {"dp_sums": _dp_reductions(mesh, megatron_data, automodel_data)}


def _dp_reductions(mesh, megatron_data, automodel_data) -> dict:
    """NeMo-RL's DP reductions with the DP group as a mesh: over the mesh's "dp" group, not the world."""
    from nn_data.nemo_rl.batched_data_dict import BatchedDataDict

    rank = dist.get_rank()
    data = BatchedDataDict(input_ids=torch.zeros(2, 4, dtype=torch.long), sample_mask=torch.tensor([1.0, rank]))
    seqs = {name: float(fn(data, None, mesh["dp"], batch_idx=0, batch_size=2)["global_valid_seqs"])
            for name, fn in (("megatron", megatron_data.process_global_batch),
                             ("automodel", automodel_data.process_global_batch))}
    counting = SimpleNamespace(make_microbatch_iterator_for_packable_sequences=lambda: iter([]),
                               get_microbatch_iterator_for_packable_sequences_len=lambda: (rank + 1, 0))
    cfg = {"dynamic_batching": {"enabled": False}, "sequence_packing": {"enabled": True, "train_mb_tokens": 8}}
    most = automodel_data._most_microbatches(rank + 1, mesh["dp"])
    automodel_data.get_microbatch_iterator(counting, cfg, 1, mesh["dp"], None)  # the same all-reduce, end to end
    return {"valid_seqs": seqs, "most_microbatches": most}


def case_packed_forward_with_a_mesh(kind: str) -> float:
    """``PackedForward(HFCausalLMAdapter(model), cp_group=<mesh form>)`` end to end, forward and backward:
    the same outputs and gradients as with the ProcessGroup, and each sequence equal to its run alone."""
    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.models.tiny_hf import tiny_hf_model
    from nn_data.packed_forward import PackedForward
    from tests.models.adapter_cases import coded_ids, token_loss

    mesh, _ = meshes()
    model = tiny_hf_model(kind, dtype=torch.float64, moe=False)
    lengths = [5, 0, 12, 3]
    ids, lens = coded_ids(lengths, torch.Generator().manual_seed(1)), torch.tensor(lengths)

    def run(form):
        model.zero_grad(set_to_none=True)
        out = PackedForward(HFCausalLMAdapter(model), cp_group=form, pad_individual_seqs_to_multiple_of=4,
                            pad_full_seq_to=40)(ids, lens)
        token_loss(out, ids, lens).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return out.detach(), grads

    out, _ = _same_for_every_form(run, _forms(mesh, "cp"))
    with torch.no_grad():
        return max(float((out[b, :n] - model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]).abs().max())
                   for b, n in enumerate(lengths) if n)
