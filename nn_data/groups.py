"""Process groups as callers hold them: the one resolver of ``(rank, size, group)``
(``docs/design.md``, "Process groups").

Every op that takes a context- or tensor-parallel group resolves it here. ``None`` always means *not
split along that axis* (rank 0 of 1), never "the world group". :func:`context_parallel_info` /
:func:`tensor_parallel_info` add megatron-core's ``parallel_state`` as a fallback source, read only
when some code already imported and initialised it (this module never imports megatron-core).

Example::

    cp = group_info(cp_group)                    # ParallelInfo(rank=1, size=2, group=cp_group)
    group_info(None)                             # ParallelInfo(rank=0, size=1, group=None)
    context_parallel_info()                      # from an initialised parallel_state, else rank 0 of 1
"""

from __future__ import annotations

import sys
from typing import NamedTuple, Optional

import torch.distributed as dist

from nn_data.errors import PackingError


class ParallelInfo(NamedTuple):
    """``rank`` and ``size`` in ``group`` (``None``: a single rank, not split)."""

    rank: int
    size: int
    group: Optional["dist.ProcessGroup"]


SINGLE = ParallelInfo(0, 1, None)


def group_info(group: Optional["dist.ProcessGroup"], what: str = "group") -> ParallelInfo:
    """This process's rank and size in ``group``; ``None`` is a single rank ``(0, 1, None)``.

    Raises :class:`PackingError` when a group is given but ``torch.distributed`` is not
    initialised, or this process is not a member of it.
    """
    if group is None:
        return SINGLE
    if not (dist.is_available() and dist.is_initialized()):
        raise PackingError(f"a {what} was given but torch.distributed is not initialised")
    rank = dist.get_rank(group)
    if rank < 0:
        raise PackingError(f"this process (global rank {dist.get_rank()}) is not a member of the {what} it was given")
    return ParallelInfo(rank, dist.get_world_size(group), group)


def context_parallel_info(group: Optional["dist.ProcessGroup"] = None) -> ParallelInfo:
    """This process's context-parallel rank, size and group.

    Resolution: an explicit ``group``; else megatron-core's ``parallel_state`` when it is
    initialised; else a single rank when ``torch.distributed`` is not initialised.

    Raises :class:`PackingError` when ``torch.distributed`` runs with neither a group nor an
    initialised ``parallel_state`` (the world group may hold data-parallel ranks: never
    assumed), and as :func:`group_info`.
    """
    return _resolve(group, "context", "get_context_parallel_group")


def tensor_parallel_info(group: Optional["dist.ProcessGroup"] = None) -> ParallelInfo:
    """This process's tensor-parallel rank, size and group (vocab-parallel logits); as
    :func:`context_parallel_info`."""
    return _resolve(group, "tensor", "get_tensor_model_parallel_group")


def _resolve(group, kind: str, getter: str) -> ParallelInfo:
    if group is not None:
        return group_info(group, f"{kind}-parallel group")
    state = megatron_state()
    if state is not None:
        return group_info(getattr(state, getter)(), f"megatron-core's {kind}-parallel group")
    if not (dist.is_available() and dist.is_initialized()):
        return SINGLE
    raise PackingError(
        f"torch.distributed is initialised but megatron-core's parallel_state is not, and no {kind}-parallel "
        f"group was given; pass the {kind}-parallel ProcessGroup explicitly or call "
        "parallel_state.initialize_model_parallel(...) first (the world group is not assumed: it may hold "
        "data-parallel ranks too)"
    )


def megatron_state():
    """megatron-core's ``parallel_state`` if some code imported and initialised it, else None
    (never imports it: if it was never imported, it cannot have been initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    state = sys.modules.get("megatron.core.parallel_state")
    if state is None or not state.model_parallel_is_initialized():
        return None
    return state
