"""Dynamic context parallelism: run a :func:`~nn_data.planning.plan_step_dynamic_cp` plan, each rank one
static shape ``[1, tokens_per_rank]`` every round, each round's CP group the block's (docs/dynamic-cp.md).

    from nn_data.dynamic_cp import DynamicCPRunner, dynamic_cp_groups
    from nn_data.planning import Parallelism, plan_step_dynamic_cp

    groups = dynamic_cp_groups(pg_collection=pgc)            # once per run: this rank's group per block size
    runner = DynamicCPRunner(groups, tokens_per_rank=16384, row_capacity=32, compile=True)
    plan = plan_step_dynamic_cp(lengths, Parallelism(dp=dp, cp=cp), tokens_per_rank=16384)
    for inputs in runner.step(plan, input_ids):              # the same number of rounds on every rank
        logits = model(inputs.input_ids, inputs.position_ids, inputs.packed)   # [1, 16384, V]"""

from nn_data.dynamic_cp.block_groups import DynamicCPGroups, create_block_groups, dynamic_cp_groups
from nn_data.dynamic_cp.rounds import DynamicCPRunner, DynamicCPStep, RoundInputs, RoundLocal, RoundPack

__all__ = ["DynamicCPGroups", "DynamicCPRunner", "DynamicCPStep", "RoundInputs", "RoundLocal", "RoundPack",
           "create_block_groups", "dynamic_cp_groups"]
