"""megatron-core glue: the one module that imports megatron-core, always lazily.

Two jobs (``docs/design.md``, "Process groups" and "megatron-core"):

* **Process groups.** The ops take a ``ProcessGroup`` (or ``cp_size``/``cp_rank`` ints);
  :func:`group_info` turns a group into ``(rank, size, group)`` and is the only resolver
  every op uses. ``None`` always means *not split along that axis* (rank 0 of 1), never
  "the world group". :func:`context_parallel_info` / :func:`tensor_parallel_info` add
  megatron-core's ``parallel_state`` as a source, for callers that use megatron.
* **PackedSeqParams.** :func:`make_packed_seq_params` builds megatron-core's THD
  ``PackedSeqParams``, filling only the fields the installed release has.

``import megatron.core`` costs seconds and warns about TransformerEngine/Apex, so nothing
here imports it at module import: ``parallel_state`` is read only if some code already
imported (and initialised) it, and ``PackedSeqParams`` is imported on its first use.

Example::

    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    cp = context_parallel_info()                      # from parallel_state
    shard = ShardForContextParallel(cp.size, cp.rank)
    gather = GatherFromContextParallel(cp.group)
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, NamedTuple, Optional

import torch
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


def megatron_cp_rank_and_size() -> tuple[int, int]:
    """``(cp_rank, cp_size)`` from an initialised ``parallel_state``, else ``(0, 1)``: what the
    NeMo-RL layer reads (megatron-core itself answers a world size of 0 when uninitialised)."""
    state = megatron_state()
    if state is None:
        return 0, 1
    return int(state.get_context_parallel_rank()), int(state.get_context_parallel_world_size())


@functools.lru_cache(maxsize=1)
def packed_seq_params_class() -> Any:
    """megatron-core's ``PackedSeqParams`` class (imported on the first call)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TransformerEngine/Apex missing: irrelevant for a dataclass
        from megatron.core.packed_seq_params import PackedSeqParams
    return PackedSeqParams


def packed_seq_params_fields() -> frozenset:
    """Field names of the installed megatron-core's ``PackedSeqParams``."""
    return frozenset(f.name for f in dataclasses.fields(packed_seq_params_class()))


def make_packed_seq_params(
    cu_seqlens_padded: torch.Tensor,
    max_seqlen: int,
    total_tokens: Optional[int],
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
    pad_between_seqs: Optional[bool] = None,
) -> Any:
    """A THD ``PackedSeqParams`` over ``cu_seqlens_padded [B+1]``.

    ``cu_seqlens_q``/``_kv`` are ``cu_seqlens`` when given (the valid-token boundaries, what a
    model that slices CP itself needs), else ``cu_seqlens_padded``; the ``*_padded`` fields are
    always ``cu_seqlens_padded``. ``max_seqlen`` (a Python int) fills ``max_seqlen_q``/``_kv``.
    ``total_tokens`` and ``pad_between_seqs`` are set only where the installed release has those
    fields (megatron-core 0.16.1 has neither; None leaves a field unset). No host sync.
    """
    valid = cu_seqlens if cu_seqlens is not None else cu_seqlens_padded
    kwargs = dict(
        qkv_format="thd",
        cu_seqlens_q=valid,
        cu_seqlens_kv=valid,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
    )
    fields = packed_seq_params_fields()
    if total_tokens is not None and "total_tokens" in fields:
        kwargs["total_tokens"] = int(total_tokens)
    if pad_between_seqs is not None and "pad_between_seqs" in fields:
        kwargs["pad_between_seqs"] = bool(pad_between_seqs)
    return packed_seq_params_class()(**kwargs)
