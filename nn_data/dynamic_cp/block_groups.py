"""This rank's CP group for every block size of dynamic context parallelism, resolved and checked against a plan.

A block of ``c`` ranks starts at a multiple of ``c`` in pool order (rank ``p`` is in ``[p // c * c, p // c * c
+ c)``): megatron-core's hybrid groups. :func:`dynamic_cp_groups` takes them from plain ``groups={c: group}``,
from megatron-core's ``parallel_state`` (initialised with ``hybrid_context_parallel=True``), or creates them
from a pool (:func:`create_block_groups`); :meth:`DynamicCPGroups.check` refuses a plan they do not match
(docs/dynamic-cp.md, "The data path").

Example (8 ranks, one pool): pool rank 5 is in ``[4, 5]`` for ``c = 2`` (its rank there 1) and in
``[4, 5, 6, 7]`` for ``c = 4`` (rank 1)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch.distributed as dist

from nn_data.errors import PackingError
from nn_data.groups import as_process_group, collection_group, group_info, megatron_state


class DynamicCPGroups(NamedTuple):
    """``pool_rank`` (this rank's place in the pool), ``pool_ranks`` (the pool's global ranks in pool order),
    ``groups[c]`` (this rank's group of ``c`` ranks, every size ``c > 1`` it has)."""

    pool_rank: int
    pool_ranks: tuple
    groups: dict

    @property
    def pool_size(self) -> int:
        return len(self.pool_ranks)

    def block_start(self, c: int) -> int:
        """The first pool rank of this rank's block of ``c`` ranks. Example: rank 5, c 4 -> 4."""
        return self.pool_rank // c * c

    def group(self, c: int) -> Optional["dist.ProcessGroup"]:
        """This rank's group of ``c`` ranks (None for ``c = 1``); :class:`PackingError` naming ``c`` when missing."""
        if c == 1:
            return None
        if c not in self.groups:
            raise PackingError(f"no CP group of {c} ranks: the groups given hold sizes {sorted(self.groups)}; "
                               f"the plan runs a block of {c} ranks (create every power of two up to the pool, "
                               "e.g. parallel_state.initialize_model_parallel(..., hybrid_context_parallel=True) "
                               "or nn_data.dynamic_cp.create_block_groups)")
        return self.groups[c]

    def check(self, plan) -> None:
        """:class:`PackingError` when ``plan`` (a :class:`~nn_data.planning.DynamicCPPlan`) does not match these groups:
        another pool size, a block size without a group, a group that is not this rank's block in pool order."""
        if plan.ranks != self.pool_size:
            raise PackingError(f"the plan is over {plan.ranks} ranks but the pool (the data-and-context-parallel "
                               f"group) has {self.pool_size}; plan with Parallelism(dp * cp = {self.pool_size})")
        for c in plan.group_sizes:
            members = tuple(dist.get_process_group_ranks(self.group(c)))
            start = self.block_start(c)
            expected = self.pool_ranks[start:start + c]
            if members != expected:
                raise PackingError(
                    f"the CP group of {c} ranks holds global ranks {list(members)} but the plan's block of {c} ranks "
                    f"with pool rank {self.pool_rank} is pool ranks {start}..{start + c - 1} = global ranks "
                    f"{list(expected)} (in pool order); pass the groups of aligned blocks ranks[s:s+{c}] of the pool")


def dynamic_cp_groups(*, groups: Optional[dict] = None, pool: Any = None, pg_collection: Any = None) -> DynamicCPGroups:
    """This rank's :class:`DynamicCPGroups` (module docstring: the three sources, in that order).

    Args:
        groups: ``{c: group}``, plain process groups or DeviceMesh forms.
        pool: the data-and-context-parallel group; else ``pg_collection.dp_cp``; else megatron-core's
            ``parallel_state``.
        pg_collection: megatron-core's ``ProcessGroupCollection``.

    Without ``groups`` and without megatron-core's hybrid groups every rank of the world must call this together
    (the groups are created). Raises :class:`PackingError` when no pool can be found or ``torch.distributed`` is
    not initialised with a pool of more than one rank."""
    pool_group = _pool(pool, pg_collection)
    if pool_group is None:  # a pool of one rank: nothing to shard over
        return DynamicCPGroups(0, (dist.get_rank() if dist.is_initialized() else 0,), {})
    info = group_info(pool_group, "data-and-context-parallel group")
    ranks = tuple(dist.get_process_group_ranks(info.group))
    if groups is not None:
        resolved = {int(c): as_process_group(g, f"groups[{c}]") for c, g in groups.items() if int(c) > 1}
    else:
        resolved = _megatron_hybrid_groups(len(ranks)) or create_block_groups(info.group)
    if len(ranks) > 1:
        resolved.setdefault(len(ranks), info.group)  # the whole pool: the pool's own group
    return DynamicCPGroups(info.rank, ranks, resolved)


def _pool(pool, pg_collection):
    if pool is not None:
        return as_process_group(pool, "pool")
    if pg_collection is not None:
        return as_process_group(collection_group(pg_collection, "dp_cp"), "pg_collection.dp_cp")
    state = megatron_state()
    if state is not None:
        return state.get_data_parallel_group(with_context_parallel=True)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise PackingError("dynamic CP needs its pool of ranks (the data-and-context-parallel group): pass pool= or "
                           "pg_collection=, or initialise megatron-core's parallel_state (the world group is not "
                           "assumed: it may hold pipeline or tensor-parallel ranks too)")
    return None


def _power_sizes(ranks: int) -> list:
    """The block sizes above 1 of a pool: the powers of two below it and the pool itself (only the
    pool when it is not a power of two: nothing else tiles it). Example: 8 -> [2, 4, 8]; 6 -> [6]."""
    if ranks <= 1:
        return []
    if ranks & (ranks - 1):
        return [ranks]
    return [1 << e for e in range(1, ranks.bit_length())]


def _megatron_hybrid_groups(ranks: int) -> dict:
    """megatron-core's hybrid groups of every size below the pool, when ``parallel_state`` has them."""
    state = megatron_state()
    if state is None or not hasattr(state, "get_hybrid_data_context_parallel_groups"):
        return {}
    out = {}
    for c in _power_sizes(ranks)[:-1]:
        try:
            out[c] = state.get_hybrid_data_context_parallel_groups(group_size=c)
        except (KeyError, AssertionError):  # not initialised with hybrid_context_parallel=True
            return {}
    return out


def create_block_groups(pool: "dist.ProcessGroup") -> dict:
    """Create the groups of every aligned power-of-two block of every pool of the world and return this rank's ``{c:
    group}`` for the sizes below its pool (the pool serves ``c = R``). Collective over the default group: every
    process calls it with its own pool; the pools are gathered so that all create the same groups in the same order.

    Example: one pool of 8 -> groups ``[0, 1]``, ``[2, 3]``, ``[4, 5]``, ``[6, 7]``, ``[0..3]``, ``[4..7]``; rank 5
    gets ``{2: [4, 5], 4: [4..7]}``."""
    mine = tuple(dist.get_process_group_ranks(pool))
    pools: list = [None] * dist.get_world_size()
    dist.all_gather_object(pools, mine)
    out = {}
    for ranks in sorted(set(pools)):
        for c in _power_sizes(len(ranks))[:-1]:
            for start in range(0, len(ranks), c):
                block = list(ranks[start:start + c])
                group = dist.new_group(block)
                if ranks == mine and dist.get_rank() in block:
                    out[c] = group
    return out
