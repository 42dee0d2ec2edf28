"""Dynamic context parallelism: run a :func:`~nn_data.planning.plan_step_dynamic_cp` plan, each rank one
static shape ``[1, tokens_per_rank]`` every round, each round's CP group the block's.

    from nn_data.dynamic_cp import DynamicCPRunner, dynamic_cp_groups
    from nn_data.planning import Parallelism, plan_step_dynamic_cp

    groups = dynamic_cp_groups(pg_collection=pgc)            # once per run: this rank's group per block size
    runner = DynamicCPRunner(groups, tokens_per_rank=16384, row_capacity=32, compile=True)
    plan = plan_step_dynamic_cp(lengths, Parallelism(dp=dp, cp=cp), tokens_per_rank=16384)
    for inputs in runner.step(plan, input_ids):              # the same number of rounds on every rank
        logits = model(inputs.input_ids, inputs.position_ids, inputs.packed)   # [1, 16384, V]

* :mod:`nn_data.dynamic_cp.block_groups`: :func:`dynamic_cp_groups` (megatron-core's hybrid groups, a
  ``ProcessGroupCollection``'s pool, or plain process groups), :class:`DynamicCPGroups` (checked against
  each plan), :func:`create_block_groups`;
* :mod:`nn_data.dynamic_cp.rounds`: :class:`DynamicCPRunner` (one compiled graph per CP size),
  :class:`DynamicCPStep` (one host-to-device copy per step), :class:`RoundInputs`, :class:`RoundPack`.

docs/dynamic-cp.md explains the plan, the data path and what megatron-core needs.
"""

from nn_data.dynamic_cp.block_groups import DynamicCPGroups, create_block_groups, dynamic_cp_groups
from nn_data.dynamic_cp.rounds import DynamicCPRunner, DynamicCPStep, RoundInputs, RoundLocal, RoundPack

__all__ = ["DynamicCPGroups", "DynamicCPRunner", "DynamicCPStep", "RoundInputs", "RoundLocal", "RoundPack",
           "create_block_groups", "dynamic_cp_groups"]
