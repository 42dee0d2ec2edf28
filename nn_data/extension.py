"""The extension surface: what a package built on nn_data (its NeMo-RL drop-in, ``nn_data.nemo_rl``) uses
beyond the public API (``nn_data.__all__``, the ``nn_data.adapters`` door and its ``tree_kv`` module).

A drop-in re-implements another library's functions with that library's signatures, so it needs nn_data's
steps one level below the ops a user calls: the argument checks (``checks``, the module, so messages keep
one wording), the layout's builders, checks and index maps, the pack + shard step, the process-group
resolver, megatron-core's ``PackedSeqParams`` builder, the planner's first-fit-decreasing, the log-prob
kernels and the shared-prefix pieces. They are gathered here, in one module, so that ``nn_data.nemo_rl``
imports nn_data through exactly two doors (``tests/ops/test_structure.py`` holds it): a rename inside nn_data
touches this file and no file of the drop-in, and the drop-in could leave the package as a folder that
depends on ``nn_data`` and ``nn_data.extension``. Each name below is its home's object, unchanged; none is
new API for users, and the set is the drop-in's imports, no more (the structure test checks each is used).

Example::

    from nn_data.extension import PackSpec, layout_from_lengths, pack_shard
    layout = layout_from_lengths(lengths, ids.shape[1], PackSpec(4, 1, cp_size=2))
    full, local = pack_shard(layout, {"input_ids": ids}, cp_size=2, cp_rank=0)
"""

from __future__ import annotations

from nn_data import _checks as checks  # the argument checks: check_cp, positive_int, check_int_vector, ...
from nn_data.cp_comm import all_gather_dim0, all_gather_rows, all_reduce_sum, all_to_all_dim0
from nn_data.groups import (
    SINGLE, ParallelInfo, as_process_group, given_group_info, group_info, is_group_form, megatron_state,
)
from nn_data.layout import (
    Boundaries, PackSpec, TreeLayout, layout_from_boundaries, layout_from_lengths, round_up,
)
from nn_data.layout.internal import checks as _layout_checks
from nn_data.layout.internal import exclusive_cumsum, layout_from_read_lengths, padded_rows, segment_ids

# the layout's data checks, one wording each (their module is the internal door's ``checks``)
boundary_args = _layout_checks.boundary_args
fixed_total_arg = _layout_checks.fixed_total_arg
lengths_host = _layout_checks.lengths_host
natural_total_host = _layout_checks.natural_total_host
sequence_divisible = _layout_checks.sequence_divisible
total_divisible = _layout_checks.total_divisible
total_limit_host = _layout_checks.total_limit_host
from nn_data.logprobs import (
    TreeLogProbs, TreeLogProbsFromHidden, hidden_logprobs_local, sampling_filter,
    token_logprobs_local,
)
from nn_data.logprobs.from_hidden import hidden_rows
from nn_data.logprobs.outputs import combine_topk, head_outputs_local, local_ids
from nn_data.logprobs.soft_targets import soft_cross_entropy_local
from nn_data.megatron_parallel import gpt_model_class, make_packed_seq_params
from nn_data.packed_tree import TREE, RolloutGroups
from nn_data.packed_sides import PLAIN, PackingSide, pack_shard
from nn_data.planning import (
    Parallelism, RolloutTree, find_rollout_tree, plan_step, plan_step_rollout_tree, plan_step_shared_prefix, subtree,
)
from nn_data.planning.ffd import first_fit_decreasing, round_up_lengths
from nn_data.planning.tree_plan import check_tree
from nn_data.rows import with_dynamic_row_length
from nn_data.targets import next_token_at
from nn_data.unpack import unpack_sequences

__all__ = [
    # the argument checks (a module)
    "checks",
    # the layout: its user's door, then its internal door
    "Boundaries", "PackSpec", "TreeLayout", "layout_from_boundaries", "layout_from_lengths", "round_up",
    "boundary_args", "exclusive_cumsum", "fixed_total_arg", "layout_from_read_lengths", "lengths_host",
    "natural_total_host", "padded_rows", "segment_ids", "sequence_divisible", "total_divisible", "total_limit_host",
    # the ops' steps
    "pack_shard", "unpack_sequences", "with_dynamic_row_length", "next_token_at",
    "PackingSide", "PLAIN", "TREE", "RolloutGroups", "RolloutTree",
    # process groups, collectives, megatron-core's PackedSeqParams
    "ParallelInfo", "SINGLE", "as_process_group", "given_group_info", "group_info", "is_group_form",
    "megatron_state", "all_gather_dim0", "all_gather_rows", "all_reduce_sum", "all_to_all_dim0", "gpt_model_class", "make_packed_seq_params",
    # planning
    "Parallelism", "plan_step", "plan_step_rollout_tree", "plan_step_shared_prefix", "find_rollout_tree", "subtree", "check_tree", "first_fit_decreasing", "round_up_lengths",
    # log-probs
    "TreeLogProbs", "TreeLogProbsFromHidden", "hidden_logprobs_local", "hidden_rows",
    "sampling_filter", "token_logprobs_local", "combine_topk", "head_outputs_local", "local_ids",
    "soft_cross_entropy_local",
]
