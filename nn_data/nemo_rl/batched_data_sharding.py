"""What NeMo-RL's training loop does to a ``BatchedDataDict`` around the microbatch iterators: shard a global batch
over the DP ranks (:func:`shard_by_batch_size`, planning packed or dynamic microbatches on the way), stack per-rank
results (:func:`stack_batches`), undo the planner's reordering (:func:`reorder_rows`) and chunk (:func:`chunk_rows`).
Host-side planning code; differences: docs/nemo-rl.md, "Differences from NeMo-RL"."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.nemo_rl.megatron_data.options import FIND, refuse_unknown_keys, rollout_tree_keys, shared_prefix_keys
from nn_data.planning import (
    Parallelism, RolloutTree, find_rollout_tree, plan_step, plan_step_rollout_tree, plan_step_shared_prefix, subtree,
)
from nn_data.extension import check_tree
from nn_data.layout import round_up

# NeMo-RL's packer names (nn_data plans every one with NeMo-RL's first-fit-decreasing and deal), and
# nn_data's work-balanced plan (nn_data.planning.plan_step).
PACKING_ALGORITHMS = ("concatenative", "first_fit_decreasing", "first_fit_shuffle", "modified_first_fit_decreasing",
                      "nn_data_balanced")

# sequence_packing_args: NeMo-RL's keys (its SequencePackingArgs), then nn_data's (read by "nn_data_balanced";
# "shared_prefix" / "rollout_tree" carry cfg["nn_data"]'s spellings to the planner). Any other key is refused.
NEMO_RL_PACKING_KEYS = ("max_tokens_per_microbatch", "input_key", "input_lengths_key", "algorithm",
                        "sequence_length_pad_multiple", "microbatch_order")
NN_DATA_PACKING_KEYS = ("parallelism", "balance", "hidden_size", "microbatches_per_rank", "shared_prefix",
                        "rollout_tree")


def round_up_lengths(lengths: Sequence[int], multiple: int) -> np.ndarray:
    """``lengths`` rounded up to ``multiple`` (int64 numpy array). Example: ``[3, 8], 4 -> [4, 8]``."""
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise PackingAssertionError(f"sequence_length_pad_multiple={multiple!r} is invalid; expected an int >= 1")
    return round_up(np.asarray(lengths, dtype=np.int64).reshape(-1), multiple)


def rows_of(value) -> int:
    """Leading (sample) dim of a tensor, length of anything else."""
    return int(value.shape[0]) if torch.is_tensor(value) else len(value)


def batch_rows(data: Mapping[str, Any], what: str = "Batch sizes are not the same across the rollout batch") -> int:
    """The common sample count of every value; :class:`PackingError` (NeMo-RL's message first) if they differ."""
    sizes = {k: rows_of(v) for k, v in data.items()}
    if len(set(sizes.values())) > 1:
        raise PackingAssertionError(f"{what}, found sizes: [{','.join(str(s) for s in sorted(set(sizes.values())))}] "
                                    f"({sizes})")
    return next(iter(sizes.values()), 0)


def stack_batches(out, batches: Sequence[Mapping[str, Any]], pad_value_dict: Optional[dict] = None):
    """Fill ``out`` (an empty dict of the caller's class) with ``batches`` stacked along dim 0; tensors with 2+ dims
    right-padded along dim 1 (with ``pad_value_dict.get(key, 0)``). A key missing from a non-empty batch: ``KeyError``.

    Example: ``[{"x": [[1, 2]]}, {"x": [[3, 4, 5]]}]`` (tensors) -> ``x = [[1, 2, 0], [3, 4, 5]]``."""
    pad_value_dict = pad_value_dict or {}
    keys = sorted({k for b in batches for k in b})
    for key in keys:
        missing = [i for i, b in enumerate(batches) if key not in b and _size(b)]
        if missing:
            raise KeyError(f"Key {key!r} is missing from non-empty batches {missing}.")
        values = [b[key] for b in batches if key in b]
        out[key] = _stack(key, values, pad_value_dict.get(key, 0))
    return out


def _size(batch: Mapping[str, Any]) -> int:
    return rows_of(next(iter(batch.values()))) if batch else 0


def _stack(key: str, values: list, pad_value):
    first = values[0]
    if isinstance(first, list):
        return [item for v in values for item in v]
    if not all(torch.is_tensor(v) for v in values):
        raise NotImplementedError(f"Attempted to stack for unsupported type {type(first)} with key {key}."
                                  "Please provide either a tensor or a list of picklable objects.")
    dims = {v.dim() for v in values}
    if dims == {1}:
        return torch.cat(values)
    if 1 in dims or 0 in dims:
        raise PackingAssertionError(f"cannot stack {key!r}: its tensors have dims {sorted(dims)}; expected all 1-D or all "
                                    "[B, S, *]")
    width = max(v.shape[1] for v in values)
    padded = [F.pad(v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1]), value=pad_value) for v in values]
    return torch.cat(padded, dim=0)  # [sum B, max S, *]


def chunk_rows(data, out, rank: int, chunks: int):
    """Fill ``out`` with split ``rank`` of ``chunks`` equal splits (copies), as NeMo-RL's ``chunk``.

    Example: rows ``[A A A B B B D D E]``, rank 2, chunks 3 -> ``[D D E]``."""
    total = batch_rows(data, "batch sizes are not the same across the rollout batch")
    if chunks < 1 or total % chunks:
        raise PackingAssertionError(f"batch size ({total}) is not a multiple of chunks ({chunks})")
    if not 0 <= rank < chunks:
        raise PackingAssertionError(f"index OOB: not enough splits for this rank. rollout_batch_size: {total}, chunks "
                                    f"({chunks}), rank_idx ({rank}) (rank must be in [0, {chunks}))")
    step = total // chunks
    for key, value in data.items():
        part = value[rank * step:(rank + 1) * step]
        out[key] = part.clone() if torch.is_tensor(part) else list(part)
    return out


def reorder_rows(data, reordered_indices: Sequence[int]) -> None:
    """In place: row ``j`` becomes the row whose entry in ``reordered_indices`` is the ``j``-th smallest (what
    :func:`shard_by_batch_size` returns restores the original order).

    Example: indices ``[2, 0, 1]``, rows ``[c, a, b]`` -> ``[a, b, c]``."""
    total = batch_rows(data)
    keys = np.asarray(list(reordered_indices))
    if keys.shape != (total,):
        raise PackingAssertionError(f"reorder_data got {keys.size} indices for a batch of {total} rows; it needs one per row "
                                    "(NeMo-RL silently drops the rows past the shorter of the two)")
    order = np.argsort(keys, kind="stable").tolist()  # sync: none, numpy on the host
    index = torch.tensor(order, dtype=torch.int64)
    for key, value in list(data.items()):
        if torch.is_tensor(value):
            data[key] = value.index_select(0, index.to(value.device))
        else:
            data[key] = [value[i] for i in order]


def shard_by_batch_size(data, make, shards: int, batch_size: Optional[int] = None, allow_uneven_shards: bool = False,
                        dynamic_batching_args: Optional[dict] = None, sequence_packing_args: Optional[dict] = None):
    """NeMo-RL's ``shard_by_batch_size``; ``make()`` builds an empty shard (a ``SlicedDataDict``).

    Shard ``i`` gets the ``i``-th of ``shards`` equal parts of every chunk of ``batch_size`` rows; with
    ``dynamic_batching_args`` or ``sequence_packing_args`` returns ``(shards, sorted_indices)``, the shards carrying
    the plan.

    Example: ``problem_id [0 0 1 1 2 2 3 3]``, shards 2, batch_size 4 -> ``[0 0 2 2]``, ``[1 1 3 3]``."""
    if allow_uneven_shards and batch_size is not None:
        raise PackingAssertionError("batch_size must be None if allow_uneven_shards is True")
    if dynamic_batching_args is not None and sequence_packing_args is not None:
        raise PackingAssertionError("dynamic_batching_args and sequence_packing_args cannot be passed together")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise PackingAssertionError(f"shards={shards!r} is invalid; expected an int >= 1")
    total = batch_rows(data)
    batch_size = total if batch_size is None else batch_size
    if batch_size < 1 or total % batch_size:
        raise PackingAssertionError(f"Total batch size ({total}) is not a multiple of batch_size ({batch_size})")
    if not allow_uneven_shards and batch_size % shards:
        raise PackingAssertionError(f"Batch size ({batch_size}) is not a multiple of shards ({shards})")
    if sequence_packing_args is not None:
        return _pack_shards(data, make, shards, batch_size, sequence_packing_args)
    order = None
    if dynamic_batching_args is not None:
        if batch_size % shards:
            raise PackingAssertionError(f"dynamic batching needs equal shards: batch size ({batch_size}) is not a multiple of "
                                        f"shards ({shards}) (allow_uneven_shards cannot be used with it)")
        order = _length_sorted_order(data, shards, batch_size, dynamic_batching_args["input_lengths_key"])
        data = {k: _take(v, order) for k, v in data.items()}
    size = -(-batch_size // shards) if allow_uneven_shards else batch_size // shards
    out = [make() for _ in range(shards)]
    for i, shard in enumerate(out):
        ranges = [(min(c + i * size, total), min(c + (i + 1) * size, total)) for c in range(0, total, batch_size)]
        rows = [r for a, b in ranges if a < b for r in range(a, b)]
        for key, value in data.items():
            shard[key] = _take(value, rows)
    if dynamic_batching_args is None:
        return out
    _plan_dynamic(out, data, shards, batch_size, dynamic_batching_args)
    return out, order


def _take(value, rows: list):
    if torch.is_tensor(value):
        return value.index_select(0, torch.tensor(rows, dtype=torch.int64, device=value.device))
    return [value[r] for r in rows]


def _host_lengths(data, key: str) -> list:
    value = data[key]
    return value.tolist() if torch.is_tensor(value) else list(value)  # sync: the planner runs on the host


def _length_sorted_order(data, shards: int, batch_size: int, lengths_key: str) -> list:
    """Each chunk sorted by length (stable), then strided over the shards.

    Example: lengths ``[5, 1, 3, 2]``, 2 shards -> sorted ``[1, 3, 2, 0]`` -> ``[1, 2] + [3, 0]``."""
    lengths = _host_lengths(data, lengths_key)
    order = []
    for start in range(0, len(lengths), batch_size):
        chunk = sorted(range(start, start + batch_size), key=lambda r: lengths[r])
        order += [r for i in range(shards) for r in chunk[i::shards]]
    return order


def _plan_dynamic(out: list, data, shards: int, batch_size: int, args: dict) -> None:
    """Microbatches over the shards' rows: every shard gets the same boundaries, each the
    longest rounded length over the shards at that position times the rows within budget."""
    budget, multiple = args["max_tokens_per_microbatch"], args["sequence_length_round"]
    row_len = data[args["input_key"]].shape[1]
    per_shard = [_host_lengths(shard, args["input_lengths_key"]) for shard in out]
    size = batch_size // shards
    all_indices, all_lengths = [], []
    for start in range(0, len(per_shard[0]), size):
        need = [min(round_up(max(s[start + j] for s in per_shard), multiple), row_len) for j in range(size)]
        over = [n for n in need if n > budget]
        if over:
            raise PackingAssertionError(f"got an input of padded ({multiple}) sequence length of {over[0]}, however max "
                                        f"microbatch size is {budget} tokens (raise max_tokens_per_microbatch)")
        indices, lengths = greedy_groups(np.asarray(need), budget, range(start, start + size))
        all_indices.append(indices)
        all_lengths.append(lengths)
    for shard in out:
        shard.micro_batch_indices = [[list(r) for r in c] for c in all_indices]
        shard.micro_batch_lengths = [list(c) for c in all_lengths]


def greedy_groups(needs: np.ndarray, budget: int, rows: list) -> tuple[list, list]:
    """Consecutive groups with ``len(group) * max(needs in group) <= budget``, greedily (both dynamic-batching
    planners'); ``rows`` name the needs in the error.

    Example: needs ``[4, 4, 4, 8, 8, 12]``, budget 16 -> ``[[0, 3], [3, 5], [5, 6]]``, lengths ``[4, 8, 12]``."""
    groups, lengths, start, longest = [], [], 0, 0
    for pos, need in enumerate(needs.tolist()):  # sync: none, numpy
        if need > budget:
            raise PackingAssertionError(f"row {rows[pos]} needs {need} tokens (rounded), more than "
                                        f"max_tokens_per_microbatch={budget}")
        if pos > start and (pos - start + 1) * max(longest, need) > budget:
            groups.append([start, pos])
            lengths.append(longest)
            start, longest = pos, 0
        longest = max(longest, need)
    if len(needs):
        groups.append([start, len(needs)])
        lengths.append(longest)
    return groups, lengths


def _pack_shards(data, make, shards: int, batch_size: int, args: dict):
    """Sequence packing: per chunk, :func:`nn_data.planning.plan_step` over the shards (NeMo-RL's packer names plan as
    NeMo-RL does; ``"nn_data_balanced"`` balances work: :func:`_packing_layout`)."""
    refuse_unknown_keys(args, NEMO_RL_PACKING_KEYS + NN_DATA_PACKING_KEYS, "sequence_packing_args")
    order_mode = args.get("microbatch_order")
    if order_mode not in (None, "packer", "largest_first"):
        raise PackingAssertionError(f"sequence packing microbatch_order must be 'packer' or 'largest_first', got {order_mode!r}")
    algorithm = args.get("algorithm")
    if algorithm not in PACKING_ALGORITHMS:
        raise PackingAssertionError(f"sequence_packing_args['algorithm']={algorithm!r} is not one of NeMo-RL's packers "
                                    f"{list(PACKING_ALGORITHMS[:-1])} or {PACKING_ALGORITHMS[-1]!r}")
    multiple, budget = args["sequence_length_pad_multiple"], args["max_tokens_per_microbatch"]
    lengths = _host_lengths(data, args["input_lengths_key"])
    padded = round_up_lengths(lengths, multiple)
    over = [r for r, n in enumerate(padded.tolist()) if n > budget]  # sync: none, numpy
    if over:
        raise PackingAssertionError(f"Sequence length {int(padded[over[0]])} exceeds bin capacity {budget} (row {over[0]}, "
                                    f"padded to a multiple of {multiple}; raise max_tokens_per_microbatch)")
    parallelism, options = _packing_layout(args, shards)
    parallelism.check_fixed_total(budget, "max_tokens_per_microbatch")
    planner, tree = _planner(data, args, lengths, parallelism, budget, options)
    rows = [[] for _ in range(shards)]
    rewritten = [{} for _ in range(shards)]  # a tree's fields per shard, rewritten for each microbatch's rollouts
    indices = [[] for _ in range(shards)]
    loads = [[] for _ in range(shards)]
    for start in range(0, len(padded), batch_size):
        plan = planner(start, start + batch_size)
        for i in range(shards):
            mine = list(zip(plan.ranks[i], plan.microbatch_tokens[i]))
            if order_mode == "largest_first":
                mine = sorted(mine, key=lambda bin_load: bin_load[1], reverse=True)
            bounds, first = [], len(rows[i])
            for b, _ in mine:
                at = len(rows[i]) - first
                bounds.append([at, at + len(b)])
                rows[i] += [start + j for j in b]
                if tree is not None:
                    for key, values in zip(tree.keys, tree.local(start, b)):
                        rewritten[i].setdefault(key, []).extend(values)
            indices[i].append(bounds)
            loads[i].append([load for _, load in mine])
    out = []
    for i in range(shards):
        shard = make()
        for key, value in data.items():
            shard[key] = _take(value, rows[i])
        for key, values in rewritten[i].items():
            shard[key] = torch.tensor(values, dtype=torch.int64)
        shard.micro_batch_indices, shard.micro_batch_lengths = indices[i], loads[i]
        shard.elem_counts_per_gb = [c[-1][1] if c else 0 for c in indices[i]]
        out.append(shard)
    return out, [r for shard_rows in rows for r in shard_rows]


def _planner(data, args: dict, lengths: list, parallelism: Parallelism, budget: int, options: dict):
    """``(plan(start, stop), tree)``: ``plan_step``, or with a tree key ``plan_step_rollout_tree`` over the batch's tree
    (:class:`_BatchTree`, returned as ``tree``) or ``plan_step_shared_prefix`` over its GRPO groups (``tree`` None)."""
    groups = shared_prefix_keys(args.get("shared_prefix"), "sequence_packing_args['shared_prefix']")
    found = args.get("rollout_tree")
    tree_keys = rollout_tree_keys(found, "sequence_packing_args['rollout_tree']")
    if groups is None and tree_keys is None:
        return (lambda start, stop: plan_step(lengths[start:stop], parallelism, pad_full_seq_to=budget, **options)), None
    name = "rollout_tree" if groups is None else "shared_prefix"
    if groups is not None and tree_keys is not None:
        raise PackingAssertionError("sequence_packing_args['shared_prefix'] and ['rollout_tree'] are both set: a GRPO "
                                    "group is the depth-1 rollout tree, set one of them")
    if args["algorithm"] != "nn_data_balanced":
        raise PackingAssertionError(f"sequence_packing_args['{name}'] plans with nn_data's planner; set "
                                    f"sequence_packing_args['algorithm']='nn_data_balanced' (got {args['algorithm']!r})")
    if tree_keys is not None:
        tree = _BatchTree(data, tree_keys, find=isinstance(found, str) and found == FIND, lengths=lengths,
                          ids_key=args.get("input_key", "input_ids"))
        return (lambda start, stop: plan_step_rollout_tree(
            lengths[start:stop], parallelism, parent=tree.chunk(start, stop).parent,
            branch_at=tree.chunk(start, stop).branch_at, pad_full_seq_to=budget, **options)), tree
    first, second = (_host_lengths(_field(data, key, groups, "group ids and prefix lengths"), key) for key in groups)
    return (lambda start, stop: plan_step_shared_prefix(
        lengths[start:stop], parallelism, group_ids=first[start:stop], prefix_lengths=second[start:stop],
        pad_full_seq_to=budget, **options)), None


def _field(data, key: str, keys, what: str):
    """``data`` itself once ``key`` is found in it; :class:`PackingError` naming the key otherwise."""
    if key not in data:
        raise PackingAssertionError(f"{key!r} not found in the batch (keys: {list(data)}); shared-prefix packing "
                                    f"needs the [B] {what} (keys {list(keys)})")
    return data


class _BatchTree:
    """A step's rollout tree on the host, for the sharding planner: the batch's ``parent`` / ``branch_at``, or with
    ``find`` each global batch's tree found from its token ids. ``chunk`` is a global batch's tree, ``local`` a
    microbatch's ``(parent, branch_at)`` lists, indices into the microbatch.

    Example: parent ``[-1, 0, 1]``, branch_at ``[0, 6, 8]``, a microbatch of rows ``[0, 2]`` -> ``[-1, 0]``, ``[0, 6]``."""

    def __init__(self, data, keys, *, find: bool, lengths: list, ids_key: str):
        self.keys, self.data, self.lengths, self.ids_key = keys, data, lengths, ids_key
        self.span, self.tree, self.whole = None, None, None
        if not find:
            what = "parents and branch points (parent, branch_at)"
            self.whole = [np.asarray(_host_lengths(_field(data, key, keys, what), key), dtype=np.int64) for key in keys]
            check_tree(np.asarray(lengths, dtype=np.int64), *self.whole)  # the batch's tree as given, by field

    def chunk(self, start: int, stop: int) -> RolloutTree:
        """The global batch ``[start, stop)``'s tree (kept until the next global batch's)."""
        if self.span != (start, stop):
            if self.whole is None:
                ids = self.data[self.ids_key]
                ids = ids[start:stop].cpu() if torch.is_tensor(ids) else np.asarray(ids)[start:stop]  # sync: host planner
                self.tree = find_rollout_tree(ids, self.lengths[start:stop])
            else:
                self.tree = RolloutTree(*subtree(self.whole[0], self.whole[1], range(start, stop)))
            self.span = (start, stop)
        return self.tree

    def local(self, start: int, rows: list) -> tuple:
        """A microbatch's ``(parent, branch_at)`` lists (the plan lists its rollouts ascending, as ``subtree``
        takes them) in the global batch at ``start`` (:meth:`chunk`'s last)."""
        assert self.span[0] == start and list(rows) == sorted(rows), (self.span, start, rows)  # the planner's order
        parent, at = subtree(self.tree.parent, self.tree.branch_at, rows)
        return parent.tolist(), at.tolist()  # sync: none, numpy on the host


def _packing_layout(args: dict, shards: int):
    """``(Parallelism, plan_step keywords)`` for ``sequence_packing_args``: NeMo-RL's packers ``balance="nemo-rl"``;
    ``"nn_data_balanced"`` reads the optional ``"balance"`` (``"work"``), ``"hidden_size"`` (4096),
    ``"microbatches_per_rank"`` and ``"parallelism"`` (``dp == shards``)."""
    multiple = args["sequence_length_pad_multiple"]
    if args["algorithm"] != "nn_data_balanced":
        ignored = [key for key in NN_DATA_PACKING_KEYS[:4] if args.get(key) is not None]
        if ignored:
            raise PackingAssertionError(f"sequence_packing_args[{ignored[0]!r}] is read by nn_data's planner only; set "
                                        f"sequence_packing_args['algorithm']='nn_data_balanced' (got "
                                        f"{args['algorithm']!r}) or drop {ignored[0]!r}")
        return Parallelism(dp=shards, make_sequence_length_divisible_by=multiple), {"balance": "nemo-rl"}
    key, parallelism = "parallelism", args.get("parallelism")
    if parallelism is None:
        parallelism = Parallelism(dp=shards, make_sequence_length_divisible_by=multiple)
    elif not isinstance(parallelism, Parallelism) or parallelism.dp != shards:
        raise PackingAssertionError(f"sequence_packing_args['{key}']={parallelism!r} is invalid; expected a "
                                    f"Parallelism with dp={shards} (the shards)")
    elif parallelism.make_sequence_length_divisible_by not in (None, multiple):
        raise PackingAssertionError(f"sequence_packing_args['{key}'] pads sequences to a multiple of "
                                    f"{parallelism.make_sequence_length_divisible_by}, but sequence_length_pad_multiple="
                                    f"{multiple}; give one value")
    else:
        parallelism = dataclasses.replace(parallelism, make_sequence_length_divisible_by=multiple)
    options = {"balance": args.get("balance", "work"), "hidden_size": args.get("hidden_size", 4096),
               "microbatches_per_rank": args.get("microbatches_per_rank")}
    return parallelism, options
