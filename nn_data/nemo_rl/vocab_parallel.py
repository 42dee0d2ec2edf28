"""NeMo-RL's vocabulary-parallel and context-parallel helpers of ``nemo_rl.distributed.model_utils``, re-exported by
:mod:`nn_data.nemo_rl.model_utils`: docs/logprobs.md, "NeMo-RL's entropy, distillation and vocabulary-parallel
helpers".

Shape legend
    B   rows; T positions of a row on this rank
    V   vocabulary; ``Vt = V / TP`` columns on a tensor-parallel rank (rank ``r`` holds ``[r*Vt, (r+1)*Vt)``)
    K   vocabulary columns asked for
    C   context-parallel size"""

from __future__ import annotations


import torch

from nn_data.extension import checks as _checks, collectives, layout_checks, process_groups
from nn_data.nemo_rl.logprob_steps import gather_cp, row_layout


def _tp(group, pg_collection):
    return process_groups.given_group_info(group, pg_collection=pg_collection, field="tp")


def _local(logits):
    """A DTensor's local shard (NeMo-RL unwraps them), else ``logits``."""
    return logits.to_local() if type(logits).__name__ == "DTensor" else logits


def _compute_distributed_log_softmax_with_grad(vocab_parallel_logits: torch.Tensor, group, *,
                                               pg_collection=None) -> torch.Tensor:
    """The log-softmax over the TP-split vocabulary, this rank's columns ``[*, Vt]``; the log-sum-exp all-gather's
    backward sums the ranks' gradients (NeMo-RL's differentiable all-reduce)."""
    tp = _tp(group, pg_collection)
    lse = torch.logsumexp(vocab_parallel_logits, dim=-1)  # [*]
    if tp.size > 1:
        every = collectives.all_gather_rows(lse[None], tp.group, tp.rank, tp.size, grad_mode="sum")  # [TP, *]
        lse = torch.logsumexp(every, dim=0)
    return vocab_parallel_logits - lse[..., None]


@torch.no_grad()
def _compute_distributed_softmax(vocab_parallel_logits: torch.Tensor, group, *, pg_collection=None) -> torch.Tensor:
    """The softmax over the TP-split vocabulary, this rank's columns ``[*, Vt]`` (no autograd)."""
    return _compute_distributed_log_softmax_with_grad(vocab_parallel_logits, group, pg_collection=pg_collection).exp_()


class _AllReduceSum(torch.autograd.Function):
    """The sum over ``group`` in forward; the identity in backward (every rank holds the same sum)."""

    @staticmethod
    def forward(ctx, x, group):
        return collectives.all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def group_all_reduce_sum_with_grad(x: torch.Tensor, group, *, pg_collection=None, field: str = "tp") -> torch.Tensor:
    """``x`` summed over ``group`` (else ``pg_collection.<field>``; neither: ``x``), the gradient passed through unchanged.

    Example (2 ranks): ``[1.]``, ``[2.]`` -> ``[3.]`` on both."""
    info = process_groups.given_group_info(group, pg_collection=pg_collection, field=field)
    if info.size <= 1:
        return x
    return _AllReduceSum.apply(x, info.group)


def group_all_reduce_sum(x: torch.Tensor, group, *, pg_collection=None, field: str = "tp") -> torch.Tensor:
    """:func:`group_all_reduce_sum_with_grad` without a gradient (a normaliser such as a token count)."""
    with torch.no_grad():
        return group_all_reduce_sum_with_grad(x, group, pg_collection=pg_collection, field=field).detach()


def vocab_parallel_log_softmax(logits: torch.Tensor, temperature: float, *, tp_group=None,
                               pg_collection=None) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` over the TP-split vocabulary, this rank's columns ``[*, Vt]``
    (float32 or wider), differentiable (a loss summed over the ranks' shards gets its exact gradient).
    Example: ``[[0., log 3]]``, temperature 1 -> ``[[log 1/4, log 3/4]]``."""
    logits = _local(logits)
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    return _compute_distributed_log_softmax_with_grad(scaled, tp_group, pg_collection=pg_collection)


def vocab_parallel_full_log_softmax(logits: torch.Tensor, temperature: float, *, tp_group=None,
                                    pg_collection=None) -> torch.Tensor:
    """:func:`vocab_parallel_log_softmax` gathered to the whole vocabulary ``[*, V]`` on every TP rank (one
    all-gather; its backward keeps this rank's columns, megatron-core's gather from the TP region)."""
    tp = _tp(tp_group, pg_collection)
    shard = vocab_parallel_log_softmax(logits, temperature, tp_group=tp.group)  # [*, Vt]
    if tp.size == 1:
        return shard
    every = collectives.all_gather_rows(shard.movedim(-1, 0).contiguous(), tp.group, tp.rank, tp.size)  # [TP*Vt, *]
    return every.movedim(0, -1)  # [*, V]


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor, *, tp_group=None, pg_collection=None) -> torch.Tensor:
    """The global id of each position's largest logit, ``[*]`` int64, from this rank's ``[*, Vt]``: one chunked
    pass (:func:`~nn_data.logprobs.outputs.head_outputs_local`), the lowest id among equal logits. No gradient.
    Example (TP 1): ``[[[1., 5., 5.]]]`` -> ``[[1]]``."""
    from nn_data.logprobs import head_outputs_local

    tp, logits = _tp(tp_group, pg_collection), _local(logits)
    cols = logits.shape[-1]
    out = head_outputs_local(logits.reshape(-1, cols), argmax=True, vocab_start=tp.rank * cols, tp_group=tp.group,
                             tp_size=tp.size)
    return out.argmax.view(logits.shape[:-1])


def allgather_cp_sharded_tensor(tensor: torch.Tensor, cp_group, seq_dim: int = 1, *,
                                pg_collection=None):
    """This rank's zigzag shard of one sequence along ``seq_dim`` -> the whole sequence, on every rank (one all-gather).

    The gradient of a shard is the sum of the ranks' gradients for it (NeMo-RL's all-reduce then slice, as a
    reduce-scatter); ``cp_group=None``: the identity.

    Example (C 2): rank 0 ``[0, 1, 6, 7]``, rank 1 ``[2, 3, 4, 5]`` -> ``[0, 1, 2, 3, 4, 5, 6, 7]``."""
    cp = process_groups.given_group_info(cp_group, pg_collection=pg_collection, field="cp")
    if cp.size == 1:
        return tensor
    seq_dim = seq_dim % tensor.dim()
    _checks.check_even_shard("tensor", tensor.shape[seq_dim], cp.size, f"sequence (dim {seq_dim})")
    layout = row_layout(1, tensor.shape[seq_dim] * cp.size, tensor.device, op="allgather_cp_sharded_tensor")
    full = gather_cp(tensor.movedim(seq_dim, 0), layout, cp)  # [S_loc, ...] -> [1, S_loc*C, ...]
    return full.squeeze(0).movedim(0, seq_dim)


def _get_tokens_on_this_cp_rank(input_ids: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1):
    """Rank ``cp_rank``'s zigzag shard of one sequence along ``seq_dim``: chunks ``r`` and ``2C-1-r`` of ``2C``.

    Example: ``[0..7]``, C 2, rank 1 -> ``[2, 3, 4, 5]``.

    Raises :class:`~nn_data.errors.PackingError` for a bad ``cp_size`` / ``cp_rank`` and a length not a multiple of
    ``2 * cp_size``."""
    if cp_size == 1:
        return input_ids
    _checks.check_cp(cp_size, cp_rank)
    length = input_ids.shape[seq_dim]
    layout_checks.sequence_divisible("input_ids", length, cp_size, f"along seq_dim={seq_dim}")
    layout = row_layout(1, length, input_ids.device, op="_get_tokens_on_this_cp_rank")  # [0, n]: one segment
    return input_ids.index_select(seq_dim, layout.local_places(cp_size, cp_rank).source)


def cp_shift_next(x: torch.Tensor, cp_group=None, *, fill: float, pg_collection=None) -> torch.Tensor:
    """``out[:, t] = x[:, t + 1]`` along dim 1 of the whole sequence under contiguous CP sharding (one all-gather of
    ``x[:, 0]``), the sequence's last ``fill``; the neighbour's value is a constant, as NeMo-RL's.

    Example (C 1): ``[[1, 2, 3]]``, fill 0 -> ``[[2, 3, 0]]``."""
    cp = process_groups.given_group_info(cp_group, pg_collection=pg_collection, field="cp")
    last = torch.full_like(x[:, :1], fill)  # [B, 1, *]
    if cp.size > 1:
        firsts = collectives.all_gather_dim0(x[:, :1].detach().movedim(1, 0), cp.group)  # [C, B, *] every rank's first
        nxt = firsts[min(cp.rank + 1, cp.size - 1)][:, None]  # [B, 1, *]
        last = nxt if cp.rank < cp.size - 1 else last
    return torch.cat([x[:, 1:], last], dim=1)


def cp_load_balanced_to_contiguous(x: torch.Tensor, *, cp_group=None, seq_dim: int = 1,
                                   pg_collection=None) -> torch.Tensor:
    """This rank's zigzag shard along ``seq_dim`` -> its contiguous window ``[rank*L, (rank+1)*L)`` of the
    whole sequence (one all-gather, :func:`allgather_cp_sharded_tensor`).
    Example (C 2, rank 1): ``[2, 3, 4, 5]`` of ``[0..7]`` -> ``[4, 5, 6, 7]``."""
    cp = process_groups.given_group_info(cp_group, pg_collection=pg_collection, field="cp")
    if cp.size <= 1:
        return x
    full = allgather_cp_sharded_tensor(_local(x), cp.group, seq_dim=seq_dim)
    width = full.shape[seq_dim] // cp.size
    return full.narrow(seq_dim, cp.rank * width, width).contiguous()


class AllGatherCPTensor:
    """``apply(tensor, cp_group, seq_dim=1)``: NeMo-RL's autograd class, as
    :func:`allgather_cp_sharded_tensor`."""

    @staticmethod
    def apply(tensor, cp_group, seq_dim=1, *, pg_collection=None):
        return allgather_cp_sharded_tensor(tensor, cp_group, seq_dim, pg_collection=pg_collection)


def all_to_all_vp2sq(vocab_parallel_logits: torch.Tensor, tp_group, *, pg_collection=None) -> torch.Tensor:
    """``[BS, Vt]`` vocabulary-parallel -> ``[BS/TP, V]`` split by positions (one all-to-all): rank ``r``
    gets positions ``[r*BS/TP, (r+1)*BS/TP)`` with every rank's columns. Not differentiable (NeMo-RL's)."""
    tp = _tp(tp_group, pg_collection)
    if vocab_parallel_logits.dim() != 2:
        raise _checks.PackingError(f"all_to_all_vp2sq needs 2D vocab_parallel_logits [BS, V // TP], got shape "
                                   f"{tuple(vocab_parallel_logits.shape)}")
    total, cols = vocab_parallel_logits.shape
    if total % tp.size:
        raise _checks.PackingError(f"BS={total} must be divisible by the tensor-parallel size {tp.size}")
    if tp.size == 1:
        return vocab_parallel_logits
    got = collectives.all_to_all_dim0(vocab_parallel_logits, tp.group)  # [TP * BS/TP, Vt]: block j = rank j's columns
    return got.view(tp.size, total // tp.size, cols).permute(1, 0, 2).reshape(total // tp.size, tp.size * cols)


def all_to_all_sq2vp(seq_parallel_logits: torch.Tensor, tp_group, *, pg_collection=None) -> torch.Tensor:
    """The inverse of :func:`all_to_all_vp2sq`: ``[BS/TP, V]`` -> ``[BS, Vt]`` (one all-to-all)."""
    tp = _tp(tp_group, pg_collection)
    if seq_parallel_logits.dim() != 2:
        raise _checks.PackingError(f"all_to_all_sq2vp needs 2D seq_parallel_logits [BS // TP, V], got shape "
                                   f"{tuple(seq_parallel_logits.shape)}")
    rows, vocab = seq_parallel_logits.shape
    if vocab % tp.size:
        raise _checks.PackingError(f"Vocabulary size {vocab} must be divisible by the tensor-parallel size {tp.size}")
    if tp.size == 1:
        return seq_parallel_logits
    blocks = seq_parallel_logits.view(rows, tp.size, vocab // tp.size).permute(1, 0, 2).reshape(-1, vocab // tp.size)
    return collectives.all_to_all_dim0(blocks, tp.group)  # [TP * BS/TP, Vt]
