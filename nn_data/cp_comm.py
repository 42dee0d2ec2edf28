"""Gather context-parallel shards across processes: ``[1, T/C, *]`` on each rank -> ``[1, T, *]``.

Shape legend
    B   sequences; ``cu_seqlens_padded`` has B+1 entries
    T   packed tokens
    C   context-parallel size (ranks in the group); each rank holds ``T/C`` tokens
    N   rows one rank contributes to the all-gather (``T/C``)
    *   trailing feature dims

One functional all-gather of the whole local shard (captured by ``torch.compile``), then
:class:`~nn_data.UnshardFromContextParallel`."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from nn_data import _checks
from nn_data.context_parallel import UnshardFromContextParallel
from nn_data.groups import given_group_info

# torch >= 2.12 names these *_single; older releases only have the *_tensor spelling.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor

GRAD_MODES = ("own", "sum")


def all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``x [N, *]`` from every rank of ``group`` along dim 0: ``[size*N, *]``, rank-major.
    Not autograd-aware (see :func:`all_gather_rows`)."""
    return funcol.wait_tensor(_all_gather(x.contiguous(), 0, group))


def reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x [size*N, *]`` over the ranks of ``group`` and hand rank ``k`` block ``k``: ``[N, *]`` (the
    adjoint of :func:`all_gather_dim0`). Not autograd-aware."""
    return funcol.wait_tensor(_reduce_scatter(x.contiguous(), "sum", 0, group))


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over the ranks of ``group`` (a new tensor). Not autograd-aware."""
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


def all_to_all_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """All-to-all along dim 0 in equal blocks: ``x [size*M, *]`` -> ``[size*M, *]``, block ``j`` of the result block
    ``rank`` of rank ``j``'s ``x``; not autograd-aware. Example (2 ranks, M 1): rank 0 ``[a0, a1]``, rank 1 ``[b0,
    b1]`` -> rank 0 ``[a0, b0]``, rank 1 ``[a1, b1]``."""
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), None, None, group))


class _AllGatherRows(torch.autograd.Function):
    """``x [N, *]`` on each of ``C`` ranks -> ``[C*N, *]``, rank-major. Backward, ``grad_mode="own"``: this rank's
    rows of its own gradient (no communication); ``"sum"``: a reduce-scatter of every rank's."""

    @staticmethod
    def forward(ctx, x, group, rank: int, grad_mode: str):
        ctx.group, ctx.rank, ctx.rows, ctx.grad_mode = group, rank, x.shape[0], grad_mode
        return all_gather_dim0(x, group)  # [C*N, *]

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_mode == "sum":
            out = reduce_scatter_dim0(grad, ctx.group)  # [N, *]
        else:
            out = grad.narrow(0, ctx.rank * ctx.rows, ctx.rows)  # [N, *]
        return out, None, None, None


def all_gather_rows(x: torch.Tensor, group, rank: int, size: int, grad_mode: str = "own") -> torch.Tensor:
    """Autograd-aware all-gather along dim 0: ``[N, *] -> [C*N, *]`` (identity for ``size == 1``)."""
    if size == 1:
        return x
    return _AllGatherRows.apply(x, group, rank, grad_mode)


class GatherFromContextParallel(nn.Module):
    """Reassemble the packed tensor from every rank's zigzag shard: ``[1, T/C, *] -> [1, T, *]``.

    ``forward(local [1, T/C, *], cu_seqlens_padded [B+1] int = None, *, layout=None) -> [1, T, *]``, the same on
    every rank of ``group`` (``None``: no CP, the identity, unless ``pg_collection`` gives its ``cp``).
    ``grad_mode``: ``"own"`` (default, every rank computes the same loss: its own rows, no communication) or
    ``"sum"`` (a reduce-scatter; ``docs/design.md``, "Gradients across ranks").

    Example (2 ranks, ``cu_seqlens_padded [0, 8]``): rank 0 holds ``[[0, 1, 6, 7]]``, rank 1
    ``[[2, 3, 4, 5]]``; both get ``[[0, 1, 2, 3, 4, 5, 6, 7]]``.

    Raises :class:`~nn_data.errors.PackingError`: an unknown ``grad_mode``, a group this process is not in,
    ``group`` and ``pg_collection.cp`` different groups (``__init__``); as
    :class:`~nn_data.UnshardFromContextParallel` at call time."""

    def __init__(self, group: Optional["dist.ProcessGroup"] = None, *, grad_mode: str = "own", validate: bool = True,
                 host_reads: bool = True, pg_collection=None):
        super().__init__()
        if grad_mode not in GRAD_MODES:
            raise _checks.PackingError(f"grad_mode={grad_mode!r} is invalid; expected one of {GRAD_MODES}")
        self.cp_rank, self.cp_size, group = given_group_info(group, pg_collection=pg_collection, field="cp")
        self.group, self.grad_mode, self.validate = group, grad_mode, bool(validate)
        self.unshard = UnshardFromContextParallel(self.cp_size, validate=validate, host_reads=host_reads)

    def extra_repr(self) -> str:
        return f"cp_size={self.cp_size}, cp_rank={self.cp_rank}, grad_mode={self.grad_mode!r}"

    def forward(self, local: torch.Tensor, cu_seqlens_padded: Optional[torch.Tensor] = None, *,
                layout=None) -> torch.Tensor:
        _checks.check_packed("local", local)
        rows, trailing = local.shape[1], local.shape[2:]
        stacked = all_gather_rows(local.squeeze(0), self.group, self.cp_rank, self.cp_size, self.grad_mode)  # [C*T/C, *]
        shards = stacked.view(self.cp_size, rows, *trailing)  # [C, T/C, *]
        return self.unshard(shards, cu_seqlens_padded, layout=layout)  # [1, T, *]
