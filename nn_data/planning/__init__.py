"""One shape per run: the step plan across data-parallel ranks and the one alignment rule.

    from nn_data.planning import Parallelism, plan_step

    parallelism = Parallelism(dp=8, tp=2, sequence_parallel=True, cp=2, pp=2)  # multiples: 8 per sequence
    plan = plan_step(lengths, parallelism, pad_full_seq_to=16384)            # every microbatch <= 16384
    plan.ranks[r][j]          # sequence indices of microbatch j on data-parallel rank r

* :class:`Parallelism` (:mod:`nn_data.planning.alignment`): the per-sequence and packed-length
  multiples every part of nn_data derives from it (the planner, the packer's checks, NeMo-RL's
  ``_get_pack_sequence_parameters_for_megatron``).
* :func:`plan_step` (:mod:`nn_data.planning.step`) -> :class:`StepPlan`: every sequence exactly
  once, every microbatch at most ``pad_full_seq_to`` padded tokens, the same microbatch count on
  every rank, work balanced across ranks (:mod:`nn_data.planning.balance`); O(n log n) on the host.
* :func:`plan_step_shared_prefix` (:mod:`nn_data.planning.shared_prefix_plan`): the same plan over GRPO groups,
  each group kept together and its prompt packed once per microbatch it lands in.
* :func:`plan_step_rollout_tree` (:mod:`nn_data.planning.tree_plan`): the same plan over rollout trees, each
  tree kept together where it fits and every shared node packed once per microbatch it lands in.
* :func:`find_rollout_tree` (:mod:`nn_data.planning.rollout_tree`): a batch's rollout tree (each rollout's
  parent and branch point) from its token ids, for a data loader whose rollouts carry none.
* :mod:`nn_data.planning.ffd`: first-fit-decreasing in O(n log n) and NeMo-RL's bin rules.
* :func:`plan_step_dynamic_cp` (:mod:`nn_data.planning.dynamic_cp_plan`) -> :class:`DynamicCPPlan`: dynamic
  context parallelism, every sequence sharded over only as many ranks as it needs, planned over the
  whole DP x CP pool in rounds of aligned power-of-two blocks, ``tokens_per_rank`` tokens on every
  rank every round; :mod:`nn_data.planning.cp_cost` (what a block costs), :mod:`~nn_data.planning.cp_rounds`
  and :mod:`~nn_data.planning.cp_tree` (the algorithm).

Host-side planning: numpy and Python ints, no tensor op, no megatron-core.
"""

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
