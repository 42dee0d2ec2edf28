"""Where the context-parallel (and tensor-parallel) rank, size and group come from.

The ops never look this up themselves (SPEC section 6): they take a
``ProcessGroup`` (or ``cp_size``/``cp_rank`` ints) as arguments. This module is
the one place outside the NeMo-RL compatibility layer that reads megatron-core's
``parallel_state``, and it does so lazily: if ``megatron.core.parallel_state`` has
never been imported, it cannot have been initialised, so it is not imported here
either (``import megatron.core`` costs seconds).

Resolution order, for :func:`context_parallel_info` (and the same for
:func:`tensor_parallel_info`):

1. an explicit ``group`` argument: its rank and size;
2. megatron-core's ``parallel_state`` when it is initialised: its CP group;
3. ``torch.distributed`` not initialised: a single rank (``rank 0, size 1, group None``);
4. otherwise :class:`~nn_data.errors.PackingError`: with ``torch.distributed`` running
   but no megatron state, guessing (the world group) would silently mix data-parallel
   ranks into the CP split, so the group must be passed.

Example::

    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    cp = context_parallel_info()                      # from parallel_state
    shard = ShardForContextParallel(cp.size, cp.rank)
    gather = GatherFromContextParallel(cp.group)
"""

from __future__ import annotations

import sys
from typing import NamedTuple, Optional

import torch.distributed as dist

from nn_data.errors import PackingError


class ParallelInfo(NamedTuple):
    """``rank`` and ``size`` in ``group`` (``None`` for a single, non-distributed rank)."""

    rank: int
    size: int
    group: Optional["dist.ProcessGroup"]


def context_parallel_info(group: Optional["dist.ProcessGroup"] = None) -> ParallelInfo:
    """This process's context-parallel rank, size and group (resolution order: module docstring).

    Raises :class:`PackingError` for a group this process is not part of, a group
    without ``torch.distributed`` initialised, or ``torch.distributed`` running with
    neither a group nor an initialised megatron-core ``parallel_state``.
    """
    return _resolve(group, "context", "get_context_parallel_group")


def tensor_parallel_info(group: Optional["dist.ProcessGroup"] = None) -> ParallelInfo:
    """This process's tensor-parallel rank, size and group (for vocab-parallel logits).

    Same resolution order and errors as :func:`context_parallel_info`.
    """
    return _resolve(group, "tensor", "get_tensor_model_parallel_group")


def _resolve(group, kind: str, getter: str) -> ParallelInfo:
    if group is not None:
        return _from_group(group, f"{kind}-parallel group")
    state = _megatron_state()
    if state is not None:
        return _from_group(getattr(state, getter)(), f"megatron-core's {kind}-parallel group")
    if not (dist.is_available() and dist.is_initialized()):
        return ParallelInfo(0, 1, None)
    raise PackingError(
        f"torch.distributed is initialised but megatron-core's parallel_state is not, and no {kind}-parallel "
        f"group was given; pass the {kind}-parallel ProcessGroup explicitly or call "
        "parallel_state.initialize_model_parallel(...) first (the world group is not assumed: it may hold "
        "data-parallel ranks too)"
    )


def _megatron_state():
    """megatron-core's ``parallel_state`` if it was imported and initialised, else None."""
    state = sys.modules.get("megatron.core.parallel_state")
    if state is None or not state.model_parallel_is_initialized():
        return None
    return state


def _from_group(group, what: str) -> ParallelInfo:
    if not (dist.is_available() and dist.is_initialized()):
        raise PackingError(f"a {what} was given but torch.distributed is not initialised")
    rank = dist.get_rank(group)
    if rank < 0:
        raise PackingError(f"this process (global rank {dist.get_rank()}) is not a member of the {what} it was given")
    return ParallelInfo(rank, dist.get_world_size(group), group)
