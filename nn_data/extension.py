"""The extension surface: what a package built on nn_data (its NeMo-RL drop-in, ``nn_data.nemo_rl``) uses beyond
the public API and the user's doors. A drop-in re-implements another library's functions with that library's
signatures, so it needs a few steps one level below the ops; they are gathered here so that the drop-in imports
nn_data through its public doors and this one (``tests/ops/test_structure.py`` holds it) and a rename inside
nn_data touches no file of it. Each name is its home's object and has a caller inside the core besides the
drop-in.

Example::

    from nn_data.extension import PackingSide
    side = PackingSide(PackSpec(4, fixed_total=64), cp_size=2, cp_rank=0)(ids, lengths)  # side.packed: PackedInfo"""

from __future__ import annotations

from nn_data import _checks as checks  # the argument checks, one wording each (check_cp, positive_int, ...)
from nn_data import cp_comm as collectives  # the autograd-aware collectives (all_gather_dim0, all_gather_rows, ...)
from nn_data import groups as process_groups  # process-group resolution (given_group_info, ParallelInfo, ...)
from nn_data import megatron_parallel as megatron  # megatron-core's PackedSeqParams and classes, at first use
from nn_data.layout.internal import checks as layout_checks  # the layout's data checks, one wording each
from nn_data.layout.internal import exclusive_cumsum, layout_from_read_lengths, segment_ids
from nn_data.logprobs.from_hidden import hidden_rows
from nn_data.logprobs.outputs import combine_topk, local_ids
from nn_data.packed_sides import PackingSide, pack_shard
from nn_data.packed_tree import TREE, RolloutGroups
from nn_data.planning.ffd import first_fit_decreasing
from nn_data.planning.tree_plan import check_tree
from nn_data.targets import next_token_at
from nn_data.unpack import unpack_sequences

__all__ = [
    # modules: one wording per check, one resolver of process groups, the collectives, megatron-core's records
    "checks", "layout_checks", "process_groups", "collectives", "megatron",
    # the pack-and-shard runtime (every caller's), a tree microbatch's kind and GRPO groups' spelling of it
    "PackingSide", "pack_shard", "TREE", "RolloutGroups",
    # the layout's host builder from lengths read with other values, and its index steps
    "layout_from_read_lengths", "exclusive_cumsum", "segment_ids",
    # the ops' steps: rows back from packed boundaries, the next token within a sequence
    "unpack_sequences", "next_token_at",
    # planning: first-fit-decreasing (NeMo-RL's bins) and a rollout tree's checks
    "first_fit_decreasing", "check_tree",
    # the head kernel's steps: hidden states as rows, top-k across vocabulary shards, ids in a shard
    "hidden_rows", "combine_topk", "local_ids",
]
