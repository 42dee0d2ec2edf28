"""One shape per run: the step plan across data-parallel ranks and the one alignment rule (docs/planning.md).

    from nn_data.planning import Parallelism, plan_step

    parallelism = Parallelism(dp=8, tp=2, sequence_parallel=True, cp=2, pp=2)  # multiples: 8 per sequence
    plan = plan_step(lengths, parallelism, pad_full_seq_to=16384)            # every microbatch <= 16384
    plan.ranks[r][j]          # sequence indices of microbatch j on data-parallel rank r

:class:`Parallelism` (``alignment``) derives every multiple; :func:`plan_step` (``step``, ``balance``) plans
sequences, :func:`plan_step_shared_prefix` GRPO groups and :func:`plan_step_rollout_tree` rollout trees
(``tree_plan``); :func:`find_rollout_tree` finds a batch's tree from its ids; ``ffd`` is first-fit-decreasing
and NeMo-RL's bin rules; :func:`plan_step_dynamic_cp` plans dynamic context parallelism (``dynamic_cp_plan``,
``cp_cost``, ``cp_rounds``, ``cp_tree``). Host code: numpy and Python ints, no tensor op, no megatron-core."""

from nn_data._alias import moved_attribute
from nn_data.planning.alignment import INT32_MAX, Parallelism
from nn_data.planning.cp_cost import AttentionOnlyCost, CPCost
from nn_data.planning.dynamic_cp_plan import CPBlock, DynamicCPPlan, plan_step_dynamic_cp
from nn_data.planning.rollout_tree import RolloutTree, find_rollout_tree
from nn_data.planning.shared_prefix_plan import plan_step_shared_prefix
from nn_data.planning.tree_plan import plan_step_rollout_tree, subtree
from nn_data.planning.step import BALANCE_MODES, StepPlan, evaluate_plan, plan_step, sequence_work

__all__ = ["AttentionOnlyCost", "BALANCE_MODES", "CPBlock", "CPCost", "DynamicCPPlan", "INT32_MAX", "Parallelism",
           "RolloutTree", "StepPlan", "find_rollout_tree", "plan_step_rollout_tree", "subtree", "evaluate_plan", "plan_step", "plan_step_dynamic_cp", "plan_step_shared_prefix", "sequence_work"]


__getattr__ = moved_attribute(__name__)  # ParallelLayout, the 0.1.x name of Parallelism (nn_data._alias)
