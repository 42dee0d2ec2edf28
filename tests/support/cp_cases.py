"""Microbatches shared by the CP tests, and the cases every spawned rank runs (see cp_harness.py).

Each case runs on every rank of a gloo group whose megatron-core ``parallel_state``
was initialised with ``context_parallel_size = C``; it builds the same data on every
rank from fixed seeds, computes its CP shard and compares what comes back from the
group with the single-process result and the loop references. A case raises on
mismatch and returns a small summary.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from nn_data import (
    GatherFromContextParallel,
    NextTokenTargets,
    PackSequences,
    PositionIds,
    ShardForContextParallel,
    TokenLogProbs,
    pad_rows,
    pad_to_row_capacity,
)
from nn_data.errors import PackingError
from nn_data.groups import context_parallel_info, tensor_parallel_info
from nn_data.testing.coded import coded_batch
from nn_data.testing.reference import (
    reference_next_token_targets,
    reference_pack,
    reference_position_ids,
    reference_token_logprobs,
)

SEQ_LEN = 16  # S
LAYERS, TOPK = 2, 3  # routed experts [B, S, layers, topk]
VOCAB = 40


class Microbatch(NamedTuple):
    """One test microbatch: unique token codes ``1000*b + s + 1`` on the valid prefix."""

    ids: torch.Tensor  # [R, S] int64; positions past L hold a sentinel that must never be packed
    lengths: torch.Tensor  # [R] int64
    experts: torch.Tensor  # [R, S, layers, topk] int64
    num_rows: Optional[torch.Tensor]  # 0-d int64 when rows past it are capacity padding
    pad_full_seq_to: Optional[int]
    m: int
    p: int
    name: str


SENTINEL = 999_999


def make_microbatch(lengths, cp_size: int, pad_full_seq_to=None, num_rows=None, capacity=None, name="") -> Microbatch:
    """Codes ``1000*b + s + 1`` for ``s < L[b]``; experts ``100*code + TOPK*l + k``; optional row capacity."""
    ids = coded_batch(lengths, SEQ_LEN, pad=SENTINEL)  # [B, S]
    experts = coded_batch(lengths, SEQ_LEN, (LAYERS, TOPK), pad=SENTINEL)  # [B, S, layers, topk]
    lengths = torch.tensor(lengths, dtype=torch.int64)
    rows = lengths.shape[0]
    nr = None
    if capacity is not None:
        nr = torch.tensor(rows, dtype=torch.int64)
        ids, lengths, experts = pad_rows(ids, capacity, SENTINEL), pad_rows(lengths, capacity), pad_rows(experts, capacity)
    return Microbatch(ids, lengths, experts, nr, pad_full_seq_to, 2 * cp_size, 2 * cp_size, name)


def microbatches(cp_size: int) -> list[Microbatch]:
    """Zero-length rows, a ``pad_full_seq_to`` tail, all-empty, all-full, row capacity, no static T."""
    return [
        make_microbatch([5, 0, 16, 3], cp_size, pad_full_seq_to=80, name="zero-row+tail"),
        make_microbatch([0, 0, 0, 0], cp_size, pad_full_seq_to=80, name="all-empty"),
        make_microbatch([16, 16, 16, 16], cp_size, pad_full_seq_to=64, name="all-full"),
        make_microbatch([1, 7], cp_size, pad_full_seq_to=80, capacity=4, name="row-capacity"),
        make_microbatch([9, 2, 11], cp_size, name="no-pad_full_seq_to"),
        make_microbatch([], cp_size, pad_full_seq_to=16, name="no-rows"),
    ]


class Packed(NamedTuple):
    result: object  # PackResult of the ids
    experts: torch.Tensor  # [1, T, layers, topk]


def pack_single(mb: Microbatch) -> Packed:
    """The single-process packed microbatch (ids and routed experts)."""
    pack = PackSequences(mb.m, mb.p, mb.pad_full_seq_to)
    r = pack(mb.ids, mb.lengths, mb.num_rows)
    return Packed(r, r.layout.pack(mb.experts, torch.arange(TOPK)))


# --- shard producers: what each rank feeds to the model -------------------------------------------------
# A producer maps (microbatch, cp_size, cp_rank) to {name: (local shard [1, T/C, *], expected packed
# [1, T, *])} and the cu_seqlens_padded to gather with. "core_ops" uses PackSequences +
# ShardForContextParallel; a process_microbatch producer (nn_data.nemo_rl.megatron_data) plugs in here.


def core_ops_shards(mb: Microbatch, cp_size: int, cp_rank: int):
    single = pack_single(mb)
    cu_pad = single.result.cu_seqlens_padded
    shard = ShardForContextParallel(cp_size, cp_rank)
    truth_ids = reference_pack(mb.ids[: _real(mb)], mb.lengths[: _real(mb)], mb.m, mb.p, mb.pad_full_seq_to).packed
    truth_exp = reference_pack(mb.experts[: _real(mb)], mb.lengths[: _real(mb)], mb.m, mb.p, mb.pad_full_seq_to,
                               fill=torch.arange(TOPK)).packed
    assert torch.equal(single.result.packed, truth_ids), "single-process pack disagrees with the reference"
    assert torch.equal(single.experts, truth_exp), "single-process expert pack disagrees with the reference"
    return {
        "input_ids": (shard(single.result.packed, cu_pad), truth_ids),
        "routed_experts": (shard(single.experts, cu_pad), truth_exp),
    }, cu_pad


def _real(mb: Microbatch) -> int:
    return mb.ids.shape[0] if mb.num_rows is None else int(mb.num_rows)


def process_microbatch_shards(mb: Microbatch, cp_size: int, cp_rank: int):
    """NeMo-RL's entry point: ``nn_data.nemo_rl.megatron_data.process_microbatch`` with CP rank and size
    taken from megatron-core's ``parallel_state`` (checked against the harness's layout)."""
    from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
    from nn_data.nemo_rl.megatron_data import process_microbatch

    real = _real(mb)
    data = BatchedDataDict(input_ids=mb.ids[:real], input_lengths=mb.lengths[:real], routed_experts=mb.experts[:real])
    out = process_microbatch(data, "input_lengths", mb.m, mb.p, mb.pad_full_seq_to, pack_sequences=True)
    truth_ids = reference_pack(mb.ids[:real], mb.lengths[:real], mb.m, mb.p, mb.pad_full_seq_to).packed
    truth_exp = reference_pack(mb.experts[:real], mb.lengths[:real], mb.m, mb.p, mb.pad_full_seq_to,
                               fill=torch.arange(TOPK)).packed
    assert torch.equal(out.input_ids, truth_ids), "process_microbatch's full packed ids disagree with the reference"
    assert torch.equal(out.routed_experts, truth_exp), "process_microbatch's packed experts disagree"
    assert out.input_ids_cp_sharded.shape[1] * cp_size == truth_ids.shape[1]
    return {
        "input_ids": (out.input_ids_cp_sharded, truth_ids),
        "routed_experts": (out.routed_experts_cp_sharded, truth_exp),
    }, out.cu_seqlens_padded


SHARD_PRODUCERS: dict[str, Callable] = {"core_ops": core_ops_shards, "process_microbatch": process_microbatch_shards}


# --- cases ---------------------------------------------------------------------------------------------


def case_shard_gather_roundtrip(producer: str):
    """Every rank's shard gathers back to exactly the single-process packed tensor."""
    cp = context_parallel_info()
    gather = GatherFromContextParallel(cp.group)
    checked = []
    for mb in microbatches(cp.size):
        shards, cu_pad = SHARD_PRODUCERS[producer](mb, cp.size, cp.rank)
        for name, (local, truth) in shards.items():
            assert local.shape[1] * cp.size == truth.shape[1], (mb.name, name, local.shape, truth.shape)
            back = gather(local, cu_pad)
            assert torch.equal(back, truth), f"{mb.name}/{name}: gathered tensor differs from the packed one"
            assert not (back == SENTINEL).any(), f"{mb.name}/{name}: a padding value of the input was packed"
            checked.append(f"{mb.name}/{name}")
    return checked


def case_resolver():
    """CP rank/size/group come from parallel_state, or from an explicit group; never guessed."""
    from megatron.core import parallel_state as ps

    cp = context_parallel_info()
    assert (cp.rank, cp.size) == (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size())
    assert cp.group is ps.get_context_parallel_group()
    tp = tensor_parallel_info()
    assert (tp.rank, tp.size) == (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    explicit = context_parallel_info(dist.group.WORLD)
    assert (explicit.rank, explicit.size) == (dist.get_rank(), dist.get_world_size())
    ps.destroy_model_parallel()
    try:
        try:
            context_parallel_info()
        except PackingError as e:
            assert "pass the context-parallel ProcessGroup" in str(e)
        else:
            raise AssertionError("no error without parallel_state and without a group")
        assert context_parallel_info(cp.group)[:2] == cp[:2]
    finally:
        ps.initialize_model_parallel(context_parallel_size=cp.size, create_gloo_process_groups=False)
    return cp.rank


def case_gather_backward(grad_mode: str):
    """``own``: replicated loss -> the local gradient is the single-process one. ``sum``: rank-specific
    losses -> the local gradient is the sum over ranks of what each computed for this shard."""
    cp = context_parallel_info()
    mb = microbatches(cp.size)[0]
    single = pack_single(mb)
    cu_pad = single.result.cu_seqlens_padded
    total = single.result.packed.shape[1]
    full = torch.randn(1, total, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    local = ShardForContextParallel(cp.size, cp.rank)(full, cu_pad).clone().requires_grad_()
    gathered = GatherFromContextParallel(cp.group, grad_mode=grad_mode)(local, cu_pad)
    assert torch.equal(gathered, full)

    def weight(seed):
        return torch.randn(1, total, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    if grad_mode == "own":
        (gathered * weight(7)).sum().backward()
        expected_full = weight(7)
    else:
        (gathered * weight(100 + cp.rank)).sum().backward()
        expected_full = sum(weight(100 + r) for r in range(cp.size))
    expected = ShardForContextParallel(cp.size, cp.rank)(expected_full, cu_pad)
    torch.testing.assert_close(local.grad, expected, rtol=0, atol=1e-12)
    return grad_mode


def case_positions_targets():
    """Sharded position ids and targets gather back to the single-process ones; targets stay in their sequence."""
    cp = context_parallel_info()
    gather = GatherFromContextParallel(cp.group)
    positions, targets = PositionIds(cp.size, cp.rank), NextTokenTargets(cp.size, cp.rank)
    count = 0
    for mb in microbatches(cp.size):
        r = pack_single(mb).result
        total = r.packed.shape[1]
        pos = positions(r.packed, r.cu_seqlens_padded)
        tg = targets(r.packed, r.cu_seqlens, r.cu_seqlens_padded)
        assert pos.shape == tg.targets.shape == tg.loss_mask.shape == (1, total // cp.size)
        assert torch.equal(gather(pos, r.cu_seqlens_padded), reference_position_ids(r.cu_seqlens_padded, total))
        ref_t, ref_m = reference_next_token_targets(r.packed, r.cu_seqlens, r.cu_seqlens_padded)
        assert torch.equal(gather(tg.targets, r.cu_seqlens_padded), ref_t), mb.name
        assert torch.equal(gather(tg.loss_mask, r.cu_seqlens_padded), ref_m), mb.name
        # Never across a boundary: with codes 1000*b + s + 1, the target of a token is its code + 1.
        local_ids = ShardForContextParallel(cp.size, cp.rank)(r.packed, r.cu_seqlens_padded)
        has = tg.loss_mask.bool()
        assert torch.equal(tg.targets[has], local_ids[has] + 1), f"{mb.name}: a target left its sequence"
        assert (tg.targets[~has] == -100).all()
        n = tg.loss_mask.sum().to(torch.int64)
        dist.all_reduce(n, group=cp.group)
        expected = int((mb.lengths - 1).clamp_min(0).sum())
        assert int(n) == expected, f"{mb.name}: {int(n)} targets over the CP group, expected {expected}"
        count += expected
    return count


def _logprob_inputs(mb: Microbatch, seed: int):
    r = pack_single(mb).result
    ids = (r.packed * 7 + 3) % VOCAB  # [1, T] token ids in the vocabulary (codes stay distinct per row)
    total = ids.shape[1]
    full = torch.randn(1, total, VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    rows = r.cu_seqlens.shape[0] - 1
    weight = torch.randn(rows, SEQ_LEN, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return r, ids, full, weight


def case_logprobs():
    """CP log-probs and their gradients w.r.t. the local logits equal the single-process ones;
    every valid token (s >= 1) gets exactly one non-zero log-prob."""
    cp = context_parallel_info()
    op = TokenLogProbs(SEQ_LEN, cp_group=cp.group, chunk_tokens=8)
    shard = ShardForContextParallel(cp.size, cp.rank)
    for i, mb in enumerate(microbatches(cp.size)):
        r, ids, full, weight = _logprob_inputs(mb, 10 + i)
        local = shard(full, r.cu_seqlens_padded).clone().requires_grad_()
        out = op(local, ids, r.cu_seqlens, r.cu_seqlens_padded)
        (out * weight).sum().backward()
        ref_logits = full.clone().requires_grad_()
        ref = reference_token_logprobs(ref_logits, ids, r.cu_seqlens, r.cu_seqlens_padded, SEQ_LEN)
        (ref * weight).sum().backward()
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12, msg=lambda m: f"{mb.name}: {m}")
        torch.testing.assert_close(local.grad, shard(ref_logits.grad, r.cu_seqlens_padded), rtol=0, atol=1e-12,
                                   msg=lambda m: f"{mb.name} grad: {m}")
        lengths = r.cu_seqlens[1:] - r.cu_seqlens[:-1]
        s = torch.arange(SEQ_LEN)
        expected_nonzero = (s >= 1) & (s < lengths[:, None])
        assert torch.equal(out != 0, expected_nonzero), f"{mb.name}: log-probs outside the valid tokens"
    return cp.rank


def case_logprobs_vocab_parallel():
    """Vocab-parallel (TP) and CP-sharded logits give the single-process log-probs and gradients."""
    cp, tp = context_parallel_info(), tensor_parallel_info()
    op = TokenLogProbs(SEQ_LEN, cp_group=cp.group, tp_group=tp.group, chunk_tokens=8)
    shard = ShardForContextParallel(cp.size, cp.rank)
    cols = VOCAB // tp.size
    for i, mb in enumerate(microbatches(cp.size)[:3]):
        r, ids, full, weight = _logprob_inputs(mb, 40 + i)
        mine = shard(full, r.cu_seqlens_padded)[..., tp.rank * cols : (tp.rank + 1) * cols]
        local = mine.clone().requires_grad_()
        out = op(local, ids, r.cu_seqlens, r.cu_seqlens_padded)
        (out * weight).sum().backward()
        ref_logits = full.clone().requires_grad_()
        ref = reference_token_logprobs(ref_logits, ids, r.cu_seqlens, r.cu_seqlens_padded, SEQ_LEN)
        (ref * weight).sum().backward()
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12, msg=lambda m: f"{mb.name}: {m}")
        expected = shard(ref_logits.grad, r.cu_seqlens_padded)[..., tp.rank * cols : (tp.rank + 1) * cols]
        torch.testing.assert_close(local.grad, expected, rtol=0, atol=1e-12, msg=lambda m: f"{mb.name} grad: {m}")
    return (cp.rank, tp.rank)


ROW_LENGTHS = (5, 0, 1, 16, 3, 9, 2, 12, 7, 4, 11, 6, 0, 1)  # 12 distinct S, 0 and 1 among them, again at the end


def case_compiled_logprobs():
    """TokenLogProbs with its CP all-gather under torch.compile(fullgraph=True): one frame for a
    stream of microbatches whose row length S varies (0 and 1 included, ``seq_len=x.shape[1]`` of a
    tensor marked with ``with_dynamic_row_length``) and whose row count varies under a row capacity,
    forward and backward equal to eager (eager given ``seq_len=S`` as an int)."""
    import torch._dynamo.testing

    from nn_data.rows import with_dynamic_row_length

    cp = context_parallel_info()
    op = TokenLogProbs(cp_group=cp.group, chunk_tokens=16)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def step(logits, ids, cu, cu_pad, like):
        return op(logits, ids, cu, cu_pad, seq_len=like.shape[1])

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    shard = ShardForContextParallel(cp.size, cp.rank)
    gen = torch.Generator().manual_seed(60)  # the same draws on every rank
    for row_len in ROW_LENGTHS:
        rows = int(torch.randint(0, 5, (), generator=gen))
        lengths = torch.randint(0, row_len + 1, (rows,), generator=gen)
        padded = pad_to_row_capacity(coded_batch(lengths.tolist(), row_len), lengths, 4)
        r = PackSequences(2 * cp.size, pad_full_seq_to=80)(padded.x, padded.seq_lengths, padded.num_rows)
        ids = (r.packed * 7 + 3) % VOCAB
        full = torch.randn(1, 80, VOCAB, generator=gen)
        weight = torch.randn(4, row_len, generator=gen)
        results = []
        for fn in (lambda x: compiled(x, ids, r.cu_seqlens, r.cu_seqlens_padded, with_dynamic_row_length(padded.x)),
                   lambda x: op(x, ids, r.cu_seqlens, r.cu_seqlens_padded, seq_len=row_len)):
            local = shard(full, r.cu_seqlens_padded).clone().requires_grad_()
            out = fn(local)
            (out * weight).sum().backward()
            results.append((out.detach(), local.grad))
        (out_c, grad_c), (out_e, grad_e) = results
        assert out_c.shape == (4, row_len)
        torch.testing.assert_close(out_c, out_e, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad_c, grad_e, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1, f"{counter.frame_count} frames compiled"
    return counter.frame_count


CASES: dict[str, Callable] = {
    "shard_gather_roundtrip": case_shard_gather_roundtrip,
    "resolver": case_resolver,
    "gather_backward": case_gather_backward,
    "positions_targets": case_positions_targets,
    "logprobs": case_logprobs,
    "logprobs_vocab_parallel": case_logprobs_vocab_parallel,
    "compiled_logprobs": case_compiled_logprobs,
}
