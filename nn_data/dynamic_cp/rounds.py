"""One rank's microbatches of a dynamic-CP step: ids, positions, targets and THD metadata, ``[1, tpr]`` every round.

Shape legend
    n     rows of the step's ``input_ids [n, S]`` (the sequences of the plan, or this rank's subset)
    S     their padded row length
    K     rounds of the plan; each is one microbatch on every rank
    Bc    ``row_capacity``: the most sequences a block may hold (static: rows past a block's are empty)
    c     the CP size of this rank's block in a round; the block packs ``T = c * tpr`` tokens
    tpr   ``tokens_per_rank``: every rank's microbatch, every round, whatever ``c`` is

Per step (:meth:`DynamicCPRunner.step`) one ``[K, 1 + 2 Bc]`` int64 table of this rank's blocks is built from
the plan's Python ints and copied to the device once; per round (:meth:`DynamicCPStep.round`) the block's rows
are gathered, packed to ``T`` and sharded by one op per CP size (:class:`RoundPack`) with no host read, so a
compiled step has one graph per CP size (docs/dynamic-cp.md, "The data path").

Example (8 ranks, tpr 4096; the worked plan of nn_data.planning.dynamic_cp_plan): pool rank 5 runs round 0
in the block of all 8 ranks (``c = 8``, its CP rank 5: chunks 5 and 10 of the 30000-token sequence,
padded to 30000 + 2768 = 32768), round 1 in ranks 4..7 (``c = 4``, CP rank 1)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import nn

from nn_data import compile_cache
from nn_data.cp_comm import GatherFromContextParallel
from nn_data.dynamic_cp.block_groups import DynamicCPGroups
from nn_data.errors import PackingError
from nn_data.layout.internal import packed_segments
from nn_data.layout import PackSpec
from nn_data.packed_sides import PackedInfo, PackingSide
from nn_data.packed_tree import refuse_tree
from nn_data.rows import with_dynamic_row_length
from nn_data.targets import next_token_at


class RoundLocal(NamedTuple):
    """:class:`RoundPack`'s result: this rank's ``[1, tpr]`` tensors and the runtime's
    :class:`~nn_data.packed_forward.PackedInfo` of the block (its boundaries, segment ids, this rank's places
    and padding mask; the round adds the gather and ``PackedSeqParams``)."""

    input_ids: torch.Tensor  # [1, tpr]
    position_ids: torch.Tensor  # [1, tpr]
    targets: torch.Tensor  # [1, tpr] int64, ignore_index where no target
    loss_mask: torch.Tensor  # [1, tpr] float32
    packed: PackedInfo
    packed_ids: torch.Tensor  # [1, T]: the whole block packed (every rank of the block holds it)


class RoundPack(nn.Module):
    """Pack one block's rows ``[Bc, S]`` to ``T = c * tpr`` and take CP rank ``cp_rank``'s zigzag shard through the
    pack-and-shard runtime (:class:`~nn_data.packed_sides.PackingSide`, plain kind, device executor,
    ``validate=False``), every shape fixed by ``(c, tpr, Bc)``.

    ``forward(rows [Bc, S], lengths [Bc], num_rows 0-d) -> RoundLocal``. Targets are the next token within each
    sequence (:func:`nn_data.targets.next_token_at`); padding, last tokens and empty rows get ``ignore_index``."""

    def __init__(self, cp_size: int, cp_rank: int, tokens_per_rank: int, multiple: int, *, ignore_index: int = -100):
        super().__init__()
        self.cp_size, self.cp_rank, self.total, self.ignore_index = cp_size, cp_rank, cp_size * tokens_per_rank, ignore_index
        spec = PackSpec(multiple, 1, fixed_total=self.total)
        self.side = PackingSide(spec, cp_size, cp_rank, validate=False, host_reads=False)

    def extra_repr(self) -> str:
        return f"cp_size={self.cp_size}, cp_rank={self.cp_rank}, T={self.total}"

    def forward(self, rows: torch.Tensor, lengths: torch.Tensor, num_rows: torch.Tensor) -> RoundLocal:
        side = self.side(rows, lengths, num_rows)  # packed [1, T], this rank's [1, tpr], places, PackedInfo
        info = side.packed
        segments = packed_segments(info.bounds.cu_seqlens, info.cu_seqlens_padded, self.total)
        token, has_target = next_token_at(side.packed_ids[0], segments, side.places, self.total)  # [tpr] each
        targets = torch.where(has_target, token, self.ignore_index).unsqueeze(0)  # [1, tpr]
        return RoundLocal(side.input_ids, side.position_ids, targets, has_target.to(torch.float32).unsqueeze(0),
                          info, side.packed_ids)


class RoundInputs(NamedTuple):
    """What this rank runs in one round: the model's ``input_ids``, ``position_ids`` and ``packed`` (the block's
    :class:`~nn_data.packed_forward.PackedInfo`, with the block's gather and, when asked for, ``PackedSeqParams``),
    the loss's ``targets`` and ``loss_mask``, the ``block`` (:class:`~nn_data.planning.CPBlock`) with this rank's
    ``cp_rank`` and ``cp_group``, and ``packed_ids [1, T]`` (the whole block packed)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    packed: PackedInfo
    block: object
    cp_rank: int
    cp_group: Optional[object]
    packed_ids: Optional[torch.Tensor] = None


class DynamicCPRunner:
    """This rank's dynamic-CP data path for a run: one :class:`RoundPack` per CP size.

    Args:
        groups: this rank's :class:`~nn_data.dynamic_cp.DynamicCPGroups`.
        tokens_per_rank: the plans' (checked per step).
        row_capacity: the most sequences a block may hold (None: each plan's ``max_sequences`` rounded up to a
            power of two).
        make_packed_seq_params: build megatron-core's ``PackedSeqParams`` for every round.
        compile, compile_kwargs: compile each :class:`RoundPack` once (``fullgraph=True`` by default).

    Example::

        runner = DynamicCPRunner(dynamic_cp_groups(pg_collection=pgc), tokens_per_rank=16384, row_capacity=32)
        for step in steps:
            plan = plan_step_dynamic_cp(step.lengths, parallelism, tokens_per_rank=16384)
            for inputs in runner.step(plan, step.input_ids):          # K rounds, [1, 16384] each
                logits = model(inputs.input_ids, inputs.position_ids, inputs.packed)
                loss = (token_ce(logits, inputs.targets) * inputs.loss_mask).sum()
                loss.backward()"""

    def __init__(self, groups: DynamicCPGroups, *, tokens_per_rank: int, row_capacity: Optional[int] = None,
                 compile: bool = False, compile_kwargs: Optional[dict] = None, make_packed_seq_params: bool = False,
                 ignore_index: int = -100):
        if not isinstance(groups, DynamicCPGroups):
            raise PackingError(f"groups is a {type(groups).__name__}; pass nn_data.dynamic_cp.dynamic_cp_groups(...)")
        self.groups, self.tokens_per_rank, self.row_capacity = groups, tokens_per_rank, row_capacity
        self.compile, self.compile_kwargs = bool(compile), {"fullgraph": True, **(compile_kwargs or {})}
        self.make_packed_seq_params, self.ignore_index = bool(make_packed_seq_params), int(ignore_index)
        self._packs: dict = {}
        self._gathers: dict = {}

    def pack_for(self, c: int, multiple: int):
        """The (compiled) :class:`RoundPack` of this rank for blocks of ``c`` ranks."""
        key = (c, multiple)
        if key not in self._packs:
            op = RoundPack(c, self.groups.pool_rank - self.groups.block_start(c), self.tokens_per_rank, multiple,
                           ignore_index=self.ignore_index)
            if self.compile:
                compile_cache.announce(f"dynamic CP's round pack for blocks of {c} ranks")
            self._packs[key] = torch.compile(op, **self.compile_kwargs) if self.compile else op
        return self._packs[key]

    def gather_for(self, c: int) -> Optional[GatherFromContextParallel]:
        """The key/value all-gather over this rank's block of ``c`` ranks (``grad_mode="sum"``: the
        ranks' losses differ), planning from the boundaries on the device: no host read."""
        if c == 1:
            return None
        if c not in self._gathers:
            self._gathers[c] = GatherFromContextParallel(self.groups.group(c), grad_mode="sum", validate=False,
                                                         host_reads=False)
        return self._gathers[c]

    def step(self, plan, input_ids: torch.Tensor, *, rows: Optional[Sequence[int]] = None, **tree) -> "DynamicCPStep":
        """This rank's rounds of ``plan`` (a :class:`DynamicCPStep`) over ``input_ids [n, S]``, row ``j`` sequence
        ``rows[j]`` (default ``j``); a tree's keywords are refused by name (the plan shards each sequence alone)."""
        refuse_tree("DynamicCPRunner.step", tree, "its plan shards each sequence alone over the blocks of its rounds, "
                    "so a tree's rollouts land in different blocks without the prefix they share; plan trees with "
                    "plan_step_rollout_tree and run them through PackedForward (docs/ops.md, \"Rollout trees\")")
        return DynamicCPStep(self, plan, input_ids, rows)


class DynamicCPStep:
    """One step of a :class:`DynamicCPRunner`: ``len(step)`` rounds, ``step.round(k)`` (or iterate) ->
    :class:`RoundInputs`, after the one host-to-device copy of the round table.

    Raises :class:`PackingError` (when built) for a plan the groups do not match, another ``tokens_per_rank``, a
    block of more sequences than ``row_capacity`` (any rank's), a sequence longer than the rows' ``S``, or
    ``input_ids`` that are not ``[n, S]`` or lack a row for a sequence this rank runs."""

    def __init__(self, runner: DynamicCPRunner, plan, input_ids: torch.Tensor, rows: Optional[Sequence[int]]):
        runner.groups.check(plan)
        if plan.tokens_per_rank != runner.tokens_per_rank:
            raise PackingError(f"the plan has tokens_per_rank={plan.tokens_per_rank} but the runner "
                               f"{runner.tokens_per_rank}: one static shape per rank needs one tokens_per_rank per run")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise PackingError(f"input_ids must be a [n, S] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
        self.runner, self.plan, self.input_ids = runner, plan, input_ids
        self.blocks = plan.blocks_of(runner.groups.pool_rank)
        self.capacity = runner.row_capacity or 1 << max(0, (plan.max_sequences - 1).bit_length())
        self._check_plan(rows)
        self.table = self._table(rows)

    def _check_plan(self, rows) -> None:
        """The checks of the whole plan (every rank's blocks), so that every rank refuses it and none waits in a round's
        first collective for a rank that refused."""
        cap, row_len = self.capacity, self.input_ids.shape[1]
        for k, blocks in enumerate(self.plan.rounds):
            for block in blocks:
                if len(block.sequences) > cap:
                    raise PackingError(f"round {k}'s block of ranks {block.start}..{block.start + block.size - 1} "
                                       f"holds {len(block.sequences)} sequences, more than row_capacity={cap}; raise "
                                       f"row_capacity to at least {self.plan.max_sequences} (the plan's largest block)")
        lengths = self.plan.lengths
        if rows is None and lengths and max(lengths) > row_len:
            raise PackingError(f"sequence {lengths.index(max(lengths))} has {max(lengths)} tokens in the plan but the "
                               f"rows of input_ids hold S={row_len}")

    def _table(self, rows) -> torch.Tensor:
        """``[K, 1 + 2 Bc]`` int64 on the data's device: per round the block's row count, its rows and
        their lengths (rows past the count: row 0, length 0). Example: Bc 2, a block of sequences 3 and 7
        held by rows 0 and 1, lengths 5 and 2 -> ``[2, 0, 1, 5, 2]``."""
        plan, cap, n, row_len = self.plan, self.capacity, self.input_ids.shape[0], self.input_ids.shape[1]
        where = {int(s): j for j, s in enumerate(range(n) if rows is None else rows)}
        table = np.zeros((len(self.blocks), 1 + 2 * cap), dtype=np.int64)
        for k, block in enumerate(self.blocks):  # (every block fits row_capacity: _check_plan)
            missing = [i for i in block.sequences if i not in where]
            if missing:
                raise PackingError(f"input_ids has no row for sequence {missing[0]}, which this rank runs in round {k} "
                                   "(pass rows= the sequence of each row, e.g. plan.sequences_of(pool_rank))")
            lengths = [plan.lengths[i] for i in block.sequences]
            if lengths and max(lengths) > row_len:
                raise PackingError(f"sequence {block.sequences[lengths.index(max(lengths))]} has {max(lengths)} tokens "
                                   f"in the plan but the rows of input_ids hold S={row_len}")
            m = len(block.sequences)
            table[k, 0] = m
            table[k, 1:1 + m] = [where[i] for i in block.sequences]
            table[k, 1 + cap:1 + cap + m] = lengths
        host = torch.from_numpy(table)
        device = self.input_ids.device
        if device.type == "cuda":
            return host.pin_memory().to(device, non_blocking=True)  # sync: none, a pinned asynchronous copy
        return host.to(device)

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self):
        return (self.round(k) for k in range(len(self.blocks)))

    @property
    def target_tokens(self) -> int:
        """The step's next-token targets over every rank (``sum(max(L - 1, 0))``): a loss normaliser."""
        return sum(max(n - 1, 0) for n in self.plan.lengths)

    def round(self, k: int) -> RoundInputs:
        """This rank's microbatch of round ``k`` (module docstring); no host read."""
        runner, block, cap = self.runner, self.blocks[k], self.capacity
        c = block.size
        row = self.table[k]  # [1 + 2 Bc]
        if self.input_ids.shape[0]:
            rows = self.input_ids.index_select(0, row[1:1 + cap])  # [Bc, S]
        else:  # no row at all (a rank whose blocks are all empty): Bc empty rows
            rows = self.input_ids.new_zeros((cap, self.input_ids.shape[1]))
        if runner.compile:
            rows = with_dynamic_row_length(rows)  # one graph per c for every row length S
        local = runner.pack_for(c, self.plan.sequence_multiples[c])(rows, row[1 + cap:], row[0])
        gather = runner.gather_for(c)
        group = runner.groups.group(c)
        gather_kv = None if gather is None else (lambda x, g=gather, cu=local.packed.cu_seqlens_padded: g(x, cu))
        params = self._packed_seq_params(local, c, group) if runner.make_packed_seq_params else None
        cp_rank = runner.groups.pool_rank - block.start
        info = local.packed.finished(gather=gather_kv, packed_seq_params=params, row_len=rows.shape[1],
                                     max_length=c * self.plan.tokens_per_rank)  # max_length: T, known without a read
        return RoundInputs(local.input_ids, local.position_ids, local.targets, local.loss_mask, info, block, cp_rank,
                           group, local.packed_ids)

    def _packed_seq_params(self, local: RoundLocal, c: int, group):
        """The round's THD ``PackedSeqParams``: ``max_seqlen = T``, ``total_tokens = tpr``, the block's ``cp_group`` and
        ``local_cp_size = c`` (1 without a group: megatron-core then turns CP off for the microbatch)."""
        from nn_data.megatron_parallel import make_packed_seq_params

        total = c * self.plan.tokens_per_rank
        return make_packed_seq_params(local.packed.cu_seqlens_padded, total, self.plan.tokens_per_rank, total=total,
                                      cp_group=group, local_cp_size=c)
