"""Cases run on every spawned rank (tests/support/cp_harness.py) for tests/multiprocess/test_dynamic_cp_multiprocess.py.

Every rank plans the same step over the whole pool (the world: R = 4 or 8 ranks, all data-and-context
parallel), runs its rounds through nn_data.dynamic_cp with a tiny model in float64, sums the
parameter gradients over the pool (what megatron-core's data-and-context-parallel all-reduce does) and
compares the loss and the gradients with every sequence run alone through the model's own unpacked
path. The steps' lengths make the plan use CP sizes 1, 2 and 4 (and 8 on 8 ranks) in one step.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nn_data.diagnostics import HostSyncCounter
from nn_data.dynamic_cp import DynamicCPRunner, dynamic_cp_groups
from nn_data.planning import CPCost, Parallelism, plan_step_dynamic_cp

VOCAB, TPR = 97, 16
STEPS = {4: ([50, 21, 19, 12, 9, 5, 3, 0, 14, 7, 2, 11], [48, 20, 17, 13, 8, 6, 3, 1, 15, 7, 2, 10]),
         8: ([100, 50, 21, 19, 12, 9, 5, 3, 0, 14, 7, 2, 11, 30, 6, 4],)}
_GROUPS: dict = {}


def plan_of(lengths):
    return plan_step_dynamic_cp(lengths, Parallelism(dp=dist.get_world_size()), tokens_per_rank=TPR,
                                cost=CPCost(hidden_size=16))


def pool_groups(source: str = "create"):
    """This rank's groups, created once per process over the world (``source="create"``), or
    megatron-core's hybrid groups (``"megatron"``: parallel_state initialised with them)."""
    if source == "megatron":
        return dynamic_cp_groups()
    if "world" not in _GROUPS:
        _GROUPS["world"] = dynamic_cp_groups(pool=dist.group.WORLD)
    return _GROUPS["world"]


def coded_rows(lengths, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    width = max(max(lengths), 1)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=gen)
    return torch.where(torch.arange(width) < torch.tensor(lengths)[:, None], ids, 0)


def round_loss(logits: torch.Tensor, inputs) -> tuple:
    """Sum of next-token cross-entropies over this rank's local tokens of a round, and their count."""
    ce = F.cross_entropy(logits[0], inputs.targets[0].clamp(min=0), reduction="none")  # [tpr]
    return (ce * inputs.loss_mask[0].to(ce.dtype)).sum(), inputs.loss_mask.sum()


def _pool_sum(values: dict) -> dict:
    for g in values.values():
        dist.all_reduce(g)
    return values


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for n, p in
            model.named_parameters()}


def _alone(model, ids, lengths, forward) -> tuple:
    """Every sequence alone: the summed loss and the gradients."""
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for b, n in enumerate(lengths):
        if n > 1:
            logits = forward(ids[b : b + 1, :n])  # [1, n, V]
            total = total + F.cross_entropy(logits[0, :-1], ids[b, 1:n], reduction="sum")
    total.backward()
    return total.detach(), _grads(model)


def _compare(packed_loss, packed_grads, alone_loss, alone_grads) -> dict:
    zero = [n for n, g in alone_grads.items() if not g.abs().max() > 0]
    assert not zero, f"zero reference gradients {zero}: the check would prove nothing for them"
    return dict(loss=float((packed_loss - alone_loss).abs()),
                grad=max(float((packed_grads[n] - alone_grads[n]).abs().max()) for n in alone_grads))


@contextlib.contextmanager
def hybrid_state(static_cp: int):
    """megatron-core's ``parallel_state`` with its hybrid groups (``hybrid_context_parallel=True``) and a
    static CP size ``static_cp``, destroyed afterwards (the harness re-initialises for the next case)."""
    from megatron.core import parallel_state

    from nn_data.testing.dist import destroy_model_parallel_groups

    destroy_model_parallel_groups(parallel_state)
    parallel_state.initialize_model_parallel(context_parallel_size=static_cp, hybrid_context_parallel=True,
                                             create_gloo_process_groups=False)
    try:
        yield parallel_state
    finally:
        destroy_model_parallel_groups(parallel_state)


def case_tiny_exact(world: int, source: str = "create") -> dict:
    """TinyCausalLM, nn_data's own loop: each round forward + backward on this rank's ``[1, tpr]``; the
    groups created over the world (``"create"``) or megatron-core's hybrid groups (``"megatron"``)."""
    if source == "megatron":
        with hybrid_state(1):
            return _tiny_exact(world, source)
    return _tiny_exact(world, source)


def _tiny_exact(world: int, source: str) -> dict:
    from nn_data.models.tiny_transformer import TinyCausalLM

    torch.manual_seed(0)
    model = TinyCausalLM(vocab=VOCAB, dim=16, heads=2, layers=2).double()
    groups = pool_groups(source)
    runner = DynamicCPRunner(groups, tokens_per_rank=TPR, row_capacity=4)
    lengths = STEPS[world][0]
    plan, ids = plan_of(lengths), coded_rows(lengths)
    model.zero_grad(set_to_none=True)
    loss, syncs = torch.zeros((), dtype=torch.float64), 0
    step = runner.step(plan, ids)
    for k in range(len(step)):
        with HostSyncCounter() as counter:
            inputs = step.round(k)
        syncs += counter.count
        value, _ = round_loss(model(inputs.input_ids, inputs.position_ids, inputs.packed), inputs)
        value.backward()
        loss = loss + value.detach()
    dist.all_reduce(loss)
    packed = _pool_sum(_grads(model))
    out = _compare(loss, packed, *_alone(model, ids, lengths, model.forward_single))
    sizes = [b.size for b in plan.blocks_of(groups.pool_rank)]
    return dict(out, syncs=syncs, sizes=sizes, plan_sizes=sorted(set(plan.cp_sizes)), shapes=[tuple(inputs.input_ids.shape)])


def case_compiled(world: int) -> dict:
    """The rounds of two steps through ``DynamicCPRunner(compile=True)``: compiled graphs after each step
    (one per CP size), host syncs in the second step's rounds (the first one compiles: inductor's own
    Python reads tensors while it builds the graphs), and every output equal to the eager runner's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    groups = pool_groups()
    eager = DynamicCPRunner(groups, tokens_per_rank=TPR, row_capacity=4)
    compiled = DynamicCPRunner(groups, tokens_per_rank=TPR, row_capacity=4, compile=True,
                               compile_kwargs={"backend": counter})
    frames, syncs, equal, sizes = [], 0, True, set()
    for n, lengths in enumerate(STEPS[world]):
        plan, ids = plan_of(lengths), coded_rows(lengths)
        a, b = eager.step(plan, ids), compiled.step(plan, ids)
        for k in range(len(a)):
            with HostSyncCounter() as counter_syncs:
                got = b.round(k)
            syncs += counter_syncs.count if n else 0
            want = a.round(k)
            sizes.add(want.block.size)
            for field in ("input_ids", "position_ids", "targets", "loss_mask"):
                equal &= torch.equal(getattr(got, field), getattr(want, field))
            for field in ("cu_seqlens_padded", "segment_ids", "query_index"):
                equal &= torch.equal(getattr(got.packed, field), getattr(want.packed, field))
        frames.append(counter.frame_count)
    torch._dynamo.reset()
    return dict(frames=frames, syncs=syncs, equal=equal, sizes=sorted(sizes))


def case_megatron_schedule(world: int, static_cp: int) -> dict:
    """A tiny megatron-core GPTModel (nn_data's layer spec) through megatron-core's own schedule
    (``get_forward_backward_func()``, PP = 1) with :func:`nn_data.adapters.dynamic_cp_forward_step`, under
    a ``parallel_state`` whose static CP size is ``static_cp`` (its rotary embedding's group), the rounds'
    groups megatron-core's hybrid groups (``hybrid_context_parallel=True``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from nn_data.adapters import MegatronGPTAdapter, dynamic_cp_forward_step
    from nn_data.models.tiny_megatron import forward_alone, tiny_gpt_config, tiny_gpt_model

    with hybrid_state(static_cp) as parallel_state:
        model = tiny_gpt_model(tiny_gpt_config(dtype=torch.float64), vocab=VOCAB)
        adapter = MegatronGPTAdapter(model)
        runner = DynamicCPRunner(pool_groups("megatron"), tokens_per_rank=TPR, row_capacity=4,
                                 make_packed_seq_params=True)
        lengths = STEPS[world][0]
        plan, ids = plan_of(lengths), coded_rows(lengths)
        step = runner.step(plan, ids)
        model.zero_grad(set_to_none=True)
        reduced = get_forward_backward_func()(
            forward_step_func=dynamic_cp_forward_step(round_loss), data_iterator=iter(step), model=[adapter],
            num_microbatches=len(step), seq_length=TPR * static_cp, micro_batch_size=1, forward_only=False)
        loss = torch.stack([r["loss"] for r in reduced]).sum()
        dist.all_reduce(loss)
        packed = _pool_sum(_grads(model))
        out = _compare(loss, packed, *_alone(model, ids, lengths, lambda x: forward_alone(model, x)))
        params = step.round(0).packed.packed_seq_params
        return dict(out, rounds=len(reduced), local_cp_size=params.local_cp_size,
                    group_size=params.cp_group.size() if params.cp_group is not None else 1,
                    static=parallel_state.get_context_parallel_world_size())


def case_errors(world: int) -> list:
    """The data path's refusals: a plan over another pool size, groups whose members are not the plan's
    blocks, a block over the row capacity, a missing row; the adapter's on a mismatched group."""
    import pytest

    from nn_data.dynamic_cp import DynamicCPGroups
    from nn_data.errors import PackingError

    groups = pool_groups()
    lengths = STEPS[world][0]
    plan, ids = plan_of(lengths), coded_rows(lengths)
    runner = DynamicCPRunner(groups, tokens_per_rank=TPR, row_capacity=4)
    messages = []
    other = plan_step_dynamic_cp([5, 3], Parallelism(dp=world // 2), tokens_per_rank=TPR)
    with pytest.raises(PackingError, match=rf"the plan is over {world // 2} ranks but the pool .* has {world}") as e:
        runner.step(other, ids)
    messages.append(str(e.value))
    swapped = dict(groups.groups)
    swapped[2], swapped[world] = swapped[world], swapped[2]  # a group of the wrong members for its size
    with pytest.raises(PackingError, match=r"the CP group of 2 ranks holds global ranks .*in pool order") as e:
        DynamicCPRunner(DynamicCPGroups(groups.pool_rank, groups.pool_ranks, swapped), tokens_per_rank=TPR,
                        row_capacity=4).step(plan, ids)
    messages.append(str(e.value))
    missing = {c: g for c, g in groups.groups.items() if c != 2}
    with pytest.raises(PackingError, match=r"no CP group of 2 ranks: the groups given hold sizes") as e:
        DynamicCPRunner(DynamicCPGroups(groups.pool_rank, groups.pool_ranks, missing), tokens_per_rank=TPR).step(
            plan, ids)
    messages.append(str(e.value))
    with pytest.raises(PackingError, match=r"holds 3 sequences, more than row_capacity=2; raise row_capacity") as e:
        DynamicCPRunner(groups, tokens_per_rank=TPR, row_capacity=2).step(plan, ids)
    messages.append(str(e.value))
    with pytest.raises(PackingError, match=r"input_ids has no row for sequence \d+, which this rank runs") as e:
        runner.step(plan, ids[:1], rows=[1])
    messages.append(str(e.value))
    with pytest.raises(PackingError, match=r"the plan has tokens_per_rank=32 but the runner 16") as e:
        runner.step(plan_step_dynamic_cp(lengths, Parallelism(dp=world), tokens_per_rank=32), ids)
    messages.append(str(e.value))
    return messages


def case_adapter_errors(world: int) -> dict:
    """MegatronGPTAdapter's refusals for a dynamic-CP round: activation recompute while the release's rotary
    embedding takes the static group, and ``local_cp_size`` that disagrees with ``cp_group``."""
    import copy

    import pytest

    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.adapters.megatron_gpt import ROPE_TAKES_RUNTIME_GROUP
    from nn_data.errors import PackingError
    from nn_data.models.tiny_megatron import tiny_gpt_config, tiny_gpt_model

    runner = DynamicCPRunner(pool_groups(), tokens_per_rank=TPR, row_capacity=4, make_packed_seq_params=True)
    lengths = STEPS[world][0]
    inputs = runner.step(plan_of(lengths), coded_rows(lengths)).round(0)  # the block of all ranks
    messages = []
    config = tiny_gpt_config(dtype=torch.float64)
    model = tiny_gpt_model(config, vocab=VOCAB)
    model.config.recompute_granularity = "full"
    if not ROPE_TAKES_RUNTIME_GROUP:
        with pytest.raises(PackingError, match=r"activation recompute \(recompute_granularity='full'\) re-runs .* set "
                                               r"recompute_granularity=None for dynamic CP") as e:
            MegatronGPTAdapter(model)(inputs.input_ids, inputs.position_ids, inputs.packed)
        messages.append(str(e.value))
    params = copy.copy(inputs.packed.packed_seq_params)
    params.local_cp_size = 2
    bad = inputs.packed._replace(packed_seq_params=params)
    with pytest.raises(PackingError, match=rf"local_cp_size=2 but cp_group has {world} ranks") as e:
        MegatronGPTAdapter(tiny_gpt_model(tiny_gpt_config(dtype=torch.float64), vocab=VOCAB))(
            inputs.input_ids, inputs.position_ids, bad)
    messages.append(str(e.value))
    return dict(messages=messages, rope_takes_runtime_group=ROPE_TAKES_RUNTIME_GROUP)


def case_plan_refused_everywhere(world: int) -> dict:
    """A plan one of whose blocks does not fit ``row_capacity=1`` (round 1: rank 0 holds one sequence, rank 1
    two), built on every rank: each rank refuses it (the plan is the same everywhere), none builds its step
    and waits in the first round's collective. Returns whether this rank raised, and the message."""
    from nn_data.errors import PackingError

    lengths = [30, 5, 3, 2]
    plan = plan_of(lengths)
    assert [[b.sequences for b in r] for r in plan.rounds] == [[(0,)], [(1,), (2, 3)]], plan.rounds
    runner = DynamicCPRunner(pool_groups(), tokens_per_rank=TPR, row_capacity=1)
    try:
        runner.step(plan, coded_rows(lengths))
    except PackingError as e:
        return dict(raised=True, message=str(e))
    return dict(raised=False, message="")
