"""Process groups as callers hold them: the one resolver of ``(rank, size, group)`` (``docs/design.md``,
"Process groups"). A group is a ``torch.distributed.ProcessGroup``, a 1-D ``DeviceMesh`` or a ``(mesh, dim)``
pair, megatron-core's ``ProcessGroupCollection`` through ``pg_collection=``, or ``None``: *not split along
that axis*, never "the world group". :func:`given_group_info` is what the ops take;
:func:`context_parallel_info` / :func:`tensor_parallel_info` add megatron-core's initialised
``parallel_state`` (never imported here) as a fallback.

Example::

    group_info(cp_group)                         # ParallelInfo(rank=1, size=2, group=cp_group)
    group_info(mesh["cp"])                       # the same, from a torchtitan-style mesh
    group_info((mesh, "cp"))                     # the same, naming the mesh's dimension
    group_info(None)                             # ParallelInfo(rank=0, size=1, group=None)
    context_parallel_info(pg_collection=pgc)     # pgc.cp
    given_group_info(None, pg_collection=pgc)    # pgc.cp too; None and no collection: not split"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, Optional

import torch.distributed as dist

from nn_data.errors import PackingError


class ParallelInfo(NamedTuple):
    """``rank`` and ``size`` in ``group`` (``None``: a single rank, not split)."""

    rank: int
    size: int
    group: Optional["dist.ProcessGroup"]


SINGLE = ParallelInfo(0, 1, None)


class OneRankGroup:
    """A stand-in for a group of one rank where a model asks a CP group only ``size()`` and ``rank()``
    (megatron-core's rotary embedding): a microbatch on one rank, or a model without CP."""

    @staticmethod
    def size() -> int:
        return 1

    @staticmethod
    def rank() -> int:
        return 0


def as_process_group(group: Any, what: str = "group") -> Optional["dist.ProcessGroup"]:
    """The ``ProcessGroup`` that ``group`` (any form of the module docstring) stands for; ``None`` stays ``None``.
    Example: a 2-D mesh with dims ``("dp", "cp")``: ``(mesh, "cp")`` and ``mesh["cp"]`` give its CP group; the mesh
    itself is refused (which dimension is meant?)."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, int) and not isinstance(group, bool) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise PackingError(f"this process is not a member of the {what} it was given (torch.distributed.new_group "
                           "returned GroupMember.NON_GROUP_MEMBER on this rank); pass the group of this rank")
    mesh, dim = group if isinstance(group, tuple) and len(group) == 2 else (group, None)
    if not _is_device_mesh(mesh):
        raise PackingError(f"{what} is a {type(group).__name__}; pass a torch.distributed ProcessGroup, a 1-D "
                           "DeviceMesh, a (DeviceMesh, dim) pair, or None (not split)")
    if dim is None and mesh.ndim != 1:
        raise PackingError(f"{what} is a {mesh.ndim}-D DeviceMesh (dims {mesh.mesh_dim_names}); pass the 1-D mesh "
                           "of one dimension (mesh['cp']) or a (mesh, dim) pair")
    names = mesh.mesh_dim_names or ()
    if dim is not None and not (dim in names or (isinstance(dim, int) and 0 <= dim < mesh.ndim)):
        raise PackingError(f"{what}'s mesh dimension {dim!r} is not one of the mesh's dims {names} "
                           f"(or an index below {mesh.ndim})")
    return mesh.get_group(dim)


def is_group_form(obj: Any) -> bool:
    """Whether ``obj`` is one of the group forms :func:`as_process_group` resolves (``None`` excluded):
    a ``ProcessGroup``, a ``DeviceMesh`` or a ``(DeviceMesh, dim)`` pair."""
    if isinstance(obj, dist.ProcessGroup):
        return True
    return _is_device_mesh(obj[0] if isinstance(obj, tuple) and len(obj) == 2 else obj)


def _is_device_mesh(obj: Any) -> bool:
    if "torch.distributed.device_mesh" not in sys.modules:  # no mesh was ever built in this process
        return False
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(obj, DeviceMesh)


def group_info(group: Any, what: str = "group") -> ParallelInfo:
    """This process's rank and size in ``group`` (``None``: a single rank ``(0, 1, None)``), ``.group`` the resolved
    ``ProcessGroup``. Raises :class:`PackingError` when a group is given but ``torch.distributed`` is not
    initialised, this process is not a member of it, or it is not a form listed above."""
    if group is None:
        return SINGLE
    if not (dist.is_available() and dist.is_initialized()):
        raise PackingError(f"a {what} was given but torch.distributed is not initialised")
    group = as_process_group(group, what)
    rank = dist.get_rank(group)
    if rank < 0:
        raise PackingError(f"this process (global rank {dist.get_rank()}) is not a member of the {what} it was given")
    return ParallelInfo(rank, dist.get_world_size(group), group)


def context_parallel_info(group: Any = None, *, pg_collection: Any = None) -> ParallelInfo:
    """This process's context-parallel rank, size and group: an explicit ``group``, else ``pg_collection.cp``, else
    megatron-core's ``parallel_state`` when initialised, else a single rank without ``torch.distributed``.

    Raises :class:`PackingError` when ``torch.distributed`` runs with none of these (the world group is never
    assumed), when ``group`` and ``pg_collection.cp`` differ, for a collection without ``cp``, and as
    :func:`group_info`."""
    return _resolve(group, pg_collection, "context", "cp", "get_context_parallel_group")


def tensor_parallel_info(group: Any = None, *, pg_collection: Any = None) -> ParallelInfo:
    """This process's tensor-parallel rank, size and group (vocab-parallel logits), from ``group``,
    ``pg_collection.tp``, ``parallel_state``: as :func:`context_parallel_info`."""
    return _resolve(group, pg_collection, "tensor", "tp", "get_tensor_model_parallel_group")


#: The collection field of each parallel axis an op may split along, and the words its messages use.
AXES = {"cp": "context-parallel group", "tp": "tensor-parallel group"}


def given_group_info(group: Any = None, *, pg_collection: Any = None, field: str = "cp") -> ParallelInfo:
    """The group an op was *given*: ``group``, else ``pg_collection.<field>``, else ``None`` (not split); no
    ``parallel_state`` fallback. Raises :class:`PackingError` when both are given and differ, for a collection
    without that field (:func:`collection_group`), and as :func:`group_info`.

    Example: ``given_group_info(None, pg_collection=pgc)`` -> ``pgc.cp``'s rank and size;
    ``given_group_info(g, pg_collection=pgc)`` with ``g is not pgc.cp`` -> :class:`PackingError`."""
    what = AXES[field]
    from_collection = collection_group(pg_collection, field)
    if group is None:
        return group_info(from_collection, f"pg_collection.{field}") if pg_collection is not None else SINGLE
    info = group_info(group, what)
    if pg_collection is not None and as_process_group(from_collection, f"pg_collection.{field}") is not info.group:
        raise PackingError(f"the {what} given and pg_collection.{field} are different groups "
                           f"(sizes {info.size} and {_size(from_collection)}); pass one of them")
    return info


def _size(group) -> int:
    group = as_process_group(group)
    return 1 if group is None else dist.get_world_size(group)


def collection_group(pg_collection: Any, field: str) -> Optional["dist.ProcessGroup"]:
    """``pg_collection.<field>`` (``"cp"``, ``"tp"``, ...), refusing by name a collection without that field (an
    ``AttributeError`` on megatron-core 0.16, ``None`` on 0.19); a field set to ``None`` explicitly is not split."""
    if pg_collection is None:
        return None
    if not _holds(pg_collection, field):
        raise PackingError(f"pg_collection ({type(pg_collection).__name__}) has no {field!r} group; build it with "
                           f"one (ProcessGroupCollection(..., {field}=group)) or pass the group explicitly")
    return getattr(pg_collection, field)


def _holds(pg_collection: Any, field: str) -> bool:
    """Whether ``field`` was set on the collection (its instance attributes, or the class's own
    attribute or property), not answered by a ``__getattr__`` fallback."""
    if field in getattr(pg_collection, "__dict__", {}):
        return True
    if hasattr(type(pg_collection), field):
        return True
    return not hasattr(pg_collection, "__dict__") and hasattr(pg_collection, field)


def _resolve(group, pg_collection, kind: str, field: str, getter: str) -> ParallelInfo:
    what = f"{kind}-parallel group"
    if group is not None or pg_collection is not None:
        return given_group_info(group, pg_collection=pg_collection, field=field)
    state = megatron_state()
    if state is not None:
        return group_info(getattr(state, getter)(), f"megatron-core's {what}")
    if not (dist.is_available() and dist.is_initialized()):
        return SINGLE
    raise PackingError(
        f"torch.distributed is initialised but megatron-core's parallel_state is not, and no {what} "
        f"was given; pass the {kind}-parallel ProcessGroup (or DeviceMesh) explicitly, or pg_collection=, or call "
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
