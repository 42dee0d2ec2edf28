"""Per-rollout token log-probs ``[B, S-1]`` of a rollout-tree microbatch (the shared prompt: its depth-1
case), from packed logits or hidden states.

Shape legend
    B   rollouts; S their row length (``seq_len``, default the layout's)
    N   node slots of the tree (``2B`` for the shared prompt)
    T   packed tokens; C context-parallel size; M = T/C positions on a rank
    V   vocabulary; ``Vt = V / TP`` on a tensor-parallel rank; H hidden size
    n   hidden-state rows on this rank: ``M``, or ``M/TP`` with sequence parallelism

Entry ``s`` of rollout ``b`` scores token ``s + 1`` from position ``s``, as if the rollout had run alone:
inside a node at the next packed position (a shared node's positions once for every rollout below it); where
token ``s + 1`` opens a node, one **boundary** score per node from the last token before it on its path, the
``N`` boundary rows scored by the same kernel as the ``T`` packed positions; 0 at ``s >= L - 1``. No
``[B, S, V]`` tensor. Under CP the values cross the group in one all-gather (``grad_mode="own"``).
docs/logprobs.md, "Shared-prefix microbatches"."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from nn_data import _checks
from nn_data.cp_comm import all_gather_rows
from nn_data.groups import given_group_info
from nn_data.layout import TreeLayout
from nn_data.layout.internal import checks, take_layout
from nn_data.logprobs.from_hidden import checked_rows
from nn_data.logprobs.from_logits import check_full_ids, check_outputs_asked, check_top_k_output, targets_on_rank
from nn_data.logprobs.kernels import hidden_logprobs_local, token_logprobs_local
from nn_data.logprobs.outputs import HeadOutputs, head_outputs_local


class RolloutTargets(NamedTuple):
    """One call's targets: ``target``, ``keep`` ``[T/C]`` (each local position's next token in its slot);
    ``rows``, ``boundary_target``, ``boundary_keep`` ``[N]`` (the local row scoring each node's first
    token, that token, and whether this rank scores it)."""

    target: torch.Tensor
    keep: torch.Tensor
    rows: torch.Tensor
    boundary_target: torch.Tensor
    boundary_keep: torch.Tensor


class _Groups:
    """The CP and TP groups of a shared-prefix log-prob op, resolved once in ``__init__``."""

    def __init__(self, cp_group, tp_group, pg_collection):
        self.cp_rank, self.cp_size, self.cp_group = given_group_info(cp_group, pg_collection=pg_collection, field="cp")
        self.tp_rank, self.tp_size, self.tp_group = given_group_info(tp_group, pg_collection=pg_collection, field="tp")


def rollout_targets(op: str, layout, packed_ids: torch.Tensor, total: int, vocab: int, groups: _Groups, places,
                    validate: bool) -> RolloutTargets:
    """Every check of the layout and ids (device asserts: nothing is read), then the targets."""
    if not isinstance(layout, TreeLayout):
        raise _checks.PackingError(f"{op}: layout must be a TreeLayout (shared_prefix_layout(...)), got "
                                   f"{type(layout).__name__}")
    slots = take_layout(layout.layout, total, op=op, cp_size=groups.cp_size, validate=validate)
    if validate:
        bounds, lengths = slots.segments()
        checks.target_ids_device(op, checks.target_ids(packed_ids[0], bounds, lengths, total, vocab), vocab)
    target, keep = targets_on_rank(slots, packed_ids, total, places, groups.cp_size, groups.cp_rank)  # [T/C] each
    edge = layout.boundary_places(groups.cp_size, groups.cp_rank)  # [N] each
    boundary_target = packed_ids[0].index_select(0, edge.first).to(torch.int64)  # [N]
    return RolloutTargets(target, keep, edge.local, boundary_target, edge.has & edge.owned)


def rollout_rows(layout: TreeLayout, local: torch.Tensor, boundary: torch.Tensor, groups: _Groups,
                 seq_len) -> torch.Tensor:
    """This rank's ``[T/C]`` in-slot values and ``[N]`` boundary values -> ``[B, S-1]`` on every CP rank. Example (the
    layout module's batch, S 4): rollout 1 (parent 0, branch_at 2, L 3) reads the in-slot value of packed position
    0 (token 0 -> 1), the boundary value of its slot 3 (position 1 -> its token 2 at packed 4), then 0."""
    total, n, rows = layout.total, local.shape[0], layout.rows
    layout.check_rows(seq_len)
    width = max(seq_len - 1, 0)
    if total == 0:  # nothing was packed (on any rank): zeros, still in the graph
        return (local.sum() + boundary.sum()).expand(rows, width).clone()
    if groups.cp_size > 1:
        both = torch.cat([local, boundary])  # [T/C + N]: one all-gather for both
        every = all_gather_rows(both, groups.cp_group, groups.cp_rank, groups.cp_size).view(groups.cp_size, -1)
        packed = layout.unshard(every[:, :n], groups.cp_size)[0]  # [T]
        boundary = every[:, n:].sum(0)  # [N]: the owning rank's value, 0 elsewhere
    else:
        packed = local  # [T]
    if rows == 0:
        return (local.sum() + boundary.sum()).expand(0, width).clone()
    rollout = torch.arange(rows, device=local.device)  # [B]
    s = torch.arange(width, device=rollout.device)  # [S-1]
    where, _ = layout.places(rollout, s.expand(rows, width))  # [B, S-1]: position s's packed place
    _, slot = layout.places(rollout, (s + 1).expand(rows, width))  # [B, S-1]: the node of token s + 1
    values = packed.index_select(0, where.clamp(0, total - 1).reshape(-1)).view(rows, width)  # [B, S-1]
    real = s < (layout.seq_lengths[:, None] - 1)  # [B, S-1]: token s + 1 is the rollout's
    at_boundary = layout.nodes.begin[slot] == s + 1  # [B, S-1]: token s + 1 opens a node (one of the boundaries)
    values = torch.where(at_boundary, boundary.to(values.dtype)[slot], values)
    return torch.where(real, values, 0.0)


def distribution_rows(layout: TreeLayout, local: HeadOutputs, groups: _Groups, seq_len) -> HeadOutputs:
    """The outputs of each position's distribution (entropy, top-k, argmax: ``[T/C, *]``) -> ``[B, S-1, *]`` on every
    CP rank: entry ``s`` of rollout ``b`` from the packed position of its token ``s`` on its path
    (:meth:`~nn_data.layout.TreeLayout.row_places`), for ``s < L[b] - 1``, else 0; one CP all-gather per output.

    Example (the layout module's batch, S 4): rollout 1 (parent 0, branch_at 2, L 3) reads packed positions 0
    and 1 (rollout 0's shared prompt slot), then 0 (``s = 2 = L - 1``)."""
    total, rows = layout.total, layout.rows
    layout.check_rows(seq_len)
    width = max(seq_len - 1, 0)
    where, _ = layout.row_places(width)  # [B, S-1] the packed position of token s
    valid = torch.arange(width, device=where.device) < layout.seq_lengths[:, None] - 1  # [B, S-1]
    out = {}
    for name, value in local._asdict().items():
        if value is None or name in ("logprobs", "lse"):
            continue
        trailing = value.shape[1:]
        if total == 0:  # nothing was packed: zeros, still in the graph
            out[name] = value.sum().expand(rows, width, *trailing).clone()
            continue
        packed = value  # [T, *]
        if groups.cp_size > 1:
            every = all_gather_rows(value, groups.cp_group, groups.cp_rank, groups.cp_size)  # [C*T/C, *]
            packed = layout.unshard(every.view(groups.cp_size, -1, *trailing), groups.cp_size)[0]  # [T, *]
        picked = packed.index_select(0, where.clamp(0, total - 1).reshape(-1)).view(rows, width, *trailing)
        out[name] = torch.where(valid.view(rows, width, *[1] * len(trailing)), picked, 0)
    return HeadOutputs(**out)


def tree_outputs(op, z, weight, packed_ids, layout, seq_len, places, asked: dict, logprob_call) -> HeadOutputs:
    """Both ops' ``outputs()``: the log-probs from ``logprob_call()`` (the op's forward), the distributions'
    outputs from one :func:`~nn_data.logprobs.outputs.head_outputs_local` pass over this rank's rows ``z``
    (logits, or hidden states with ``weight``)."""
    logprobs, entropy, top_k, argmax = (asked.get(k, d) for k, d in
                                        (("logprobs", True), ("entropy", False), ("top_k", 0), ("argmax", False)))
    check_outputs_asked(logprobs, entropy, top_k, argmax)
    g = op.groups
    cols = z.shape[-1] if weight is None else weight.shape[0]
    check_top_k_output(top_k, cols * g.tp_size)
    seq_len = layout.row_len if seq_len is None else seq_len
    if not logprobs:  # the layout's and the ids' checks, as the log-probs' call makes them
        rollout_targets(type(op).__name__, layout, packed_ids, packed_ids.shape[1], cols * g.tp_size, g, places,
                        op.validate)
    rest = HeadOutputs()
    if entropy or top_k or argmax:
        split = weight is not None and op.sequence_parallel and g.tp_size > 1
        local = head_outputs_local(z, weight, entropy=entropy, top_k=top_k, argmax=argmax, vocab_start=g.tp_rank * cols,
                                   tp_group=g.tp_group, tp_size=g.tp_size, sequence_parallel=split,
                                   chunk_tokens=op.chunk_tokens, temperature=getattr(op, "temperature", 1.0))
        rest = distribution_rows(layout, local, g, seq_len)  # [B, S-1, *] each
    # a new tuple, not ``rest._replace``: Dynamo 2.11 cannot return a NamedTuple that ``_make`` built in the graph
    return HeadOutputs(**{**rest._asdict(), "logprobs": logprob_call(seq_len) if logprobs else None})


class TreeLogProbs(nn.Module):
    """Rollout token log-probs ``[B, S-1]`` from a rollout tree's CP-local packed logits.

    ``forward(logits [1, T/C, Vt], packed_ids [1, T] int, layout: TreeLayout, *, seq_len=None,
    places=None) -> [B, S-1]`` (float32; float64 for float64 logits): ``out[b, s] = log p(x[b, s+1] |
    x[b, :s+1])`` for ``s < L[b] - 1``, else 0, equal to each rollout run alone. ``logits`` is this rank's
    zigzag shard of the slot layout (vocab-parallel over ``tp_group``, as :class:`~nn_data.TokenLogProbs`),
    ``packed_ids`` the full packed ids (``layout.pack(input_ids)``). Nothing is read on the host.

    Raises :class:`~nn_data.errors.PackingError`: ``chunk_tokens`` below 1, a group this process is not in
    (``__init__``); logits not ``[1, T/C, Vt]`` floating point, ``packed_ids`` not ``[1, T]``, a layout that is
    not a :class:`~nn_data.layout.TreeLayout` of this ``T`` (call)."""

    def __init__(self, *, cp_group=None, tp_group=None, pg_collection=None, chunk_tokens: int = 256,
                 validate: bool = True):
        super().__init__()
        self.chunk_tokens = _checks.positive_int("chunk_tokens", chunk_tokens)
        self.groups, self.validate = _Groups(cp_group, tp_group, pg_collection), bool(validate)

    def forward(self, logits: torch.Tensor, packed_ids: torch.Tensor, layout: TreeLayout, *, seq_len=None,
                places=None) -> torch.Tensor:
        g = self.groups
        _checks.check_float_logits("logits", logits, "[1, T/C, V]", 3)
        _checks.check_packed("logits", logits)
        total = check_full_ids("logits", logits, packed_ids, logits.shape[1], g.cp_size)
        cols = logits.shape[2]
        t = rollout_targets("TreeLogProbs", layout, packed_ids, total, cols * g.tp_size, g, places,
                            self.validate)
        flat = logits.squeeze(0)  # [T/C, Vt]
        kernel = dict(vocab_start=g.tp_rank * cols, tp_group=g.tp_group, tp_size=g.tp_size,
                      chunk_tokens=self.chunk_tokens)
        local = token_logprobs_local(flat, t.target, t.keep, **kernel)  # [T/C]
        boundary = token_logprobs_local(flat.index_select(0, t.rows), t.boundary_target, t.boundary_keep,
                                        **kernel)  # [N]
        return rollout_rows(layout, local, boundary, g, layout.row_len if seq_len is None else seq_len)

    def outputs(self, logits: torch.Tensor, packed_ids: torch.Tensor, layout: TreeLayout, *, seq_len=None,
                places=None, **asked) -> HeadOutputs:
        """``logprobs``, ``entropy``, ``top_k`` log-probs and ids, ``argmax`` of every rollout's positions as ``[B, S-1]``
        rows (``[B, S-1, K]``), each opt-in as in :meth:`nn_data.TokenLogProbs.outputs` (:func:`distribution_rows`);
        raises as :meth:`forward` and for the outputs asked."""
        _checks.check_float_logits("logits", logits, "[1, T/C, V]", 3)
        check_full_ids("logits", logits, packed_ids, logits.shape[1], self.groups.cp_size)
        return tree_outputs(self, logits.squeeze(0), None, packed_ids, layout, seq_len, places, asked,
                                     lambda s: self(logits, packed_ids, layout, seq_len=s, places=places))


def with_boundary_rows(rows: torch.Tensor, t: RolloutTargets, block: int, blocks: int):
    """``(rows [n + N, H], target, keep [blocks * (n + N)])``: this rank's hidden rows, then the ``N`` boundary rows it
    holds, with the targets in the kernel's gathered order, so that one kernel call scores both. ``blocks``: TP with
    sequence parallelism (rank ``block`` holds rows ``[block*n, (block+1)*n)``), else 1.

    Example (N 8, TP 2 with sequence parallelism, n 4, boundary rows ``t.rows = [5, 1]``): rank 0 appends
    its rows ``[3, 1]`` (``[5, 1]`` clamped to ``[0, 3]``), rank 1 ``[1, 0]`` (``[1, -3]`` clamped); ``keep``
    of block 0's boundary part ``[F, T]`` (row 5 is block 1's), of block 1's ``[T, F]`` (and ``boundary_keep``)."""
    n, (b, width) = rows.shape[0], (t.rows.shape[0], rows.shape[1])
    here = (t.rows - block * n).clamp(0, max(n - 1, 0))  # [N] the boundary row's place in this rank's rows
    edge = rows.index_select(0, here) if n else rows.new_zeros(b, width)  # [N, H] (T = 0: nothing to score)
    holder = torch.div(t.rows, max(n, 1), rounding_mode="floor")  # [N] the block holding each boundary row
    mine = torch.arange(blocks, device=rows.device)[:, None] == holder  # [blocks, N]
    target = torch.cat([t.target.view(blocks, n), t.boundary_target.expand(blocks, b)], 1).reshape(-1)  # [blocks*(n+N)]
    keep = torch.cat([t.keep.view(blocks, n), mine & t.boundary_keep], 1).reshape(-1)  # [blocks*(n+N)]
    return torch.cat([rows, edge]), target, keep


class TreeLogProbsFromHidden(nn.Module):
    """Rollout token log-probs ``[B, S-1]`` straight from a rollout tree's CP-local hidden states and the output
    weight: :class:`TreeLogProbs` of the logits ``hidden @ weight.T / temperature``, values and gradients,
    without ``[T, V]`` logits.

    ``forward(hidden [1, T/C, H] (or [T/C, 1, H]), weight [V/TP, H], packed_ids [1, T] int, layout, *,
    seq_len=None, places=None) -> [B, S-1]``; groups, ``chunk_tokens``, ``temperature`` and
    ``sequence_parallel`` as :class:`~nn_data.TokenLogProbsFromHidden` (the rows and the ``N`` boundary rows in
    one kernel call: :func:`with_boundary_rows`).

    Raises :class:`~nn_data.errors.PackingError`: as :class:`TreeLogProbs`, and for hidden states
    or a weight that are not an output head's, hidden states that are not this rank's share of ``T`` (call)."""

    def __init__(self, *, cp_group=None, tp_group=None, pg_collection=None, chunk_tokens: int = 256,
                 temperature: float = 1.0, sequence_parallel: bool = False, validate: bool = True):
        super().__init__()
        self.chunk_tokens = _checks.positive_int("chunk_tokens", chunk_tokens)
        self.temperature = _checks.check_temperature(temperature)
        self.groups, self.validate = _Groups(cp_group, tp_group, pg_collection), bool(validate)
        self.sequence_parallel = bool(sequence_parallel)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, packed_ids: torch.Tensor,
                layout: TreeLayout, *, seq_len=None, places=None) -> torch.Tensor:
        g, split = self.groups, self.sequence_parallel and self.groups.tp_size > 1
        rows, total = checked_rows(hidden, weight, packed_ids, g.cp_size, g.tp_size, self.sequence_parallel)  # [n, H]
        t = rollout_targets("TreeLogProbsFromHidden", layout, packed_ids, total, weight.shape[0] * g.tp_size,
                            g, places, self.validate)
        blocks = g.tp_size if split else 1
        both, target, keep = with_boundary_rows(rows, t, g.tp_rank if split else 0, blocks)  # [n + N, H], [..]
        values = hidden_logprobs_local(
            both, weight, target, keep, vocab_start=g.tp_rank * weight.shape[0], tp_group=g.tp_group,
            tp_size=g.tp_size, sequence_parallel=split, chunk_tokens=self.chunk_tokens, temperature=self.temperature,
        ).view(blocks, -1)  # [blocks, n + N]
        n = rows.shape[0]
        local, boundary = values[:, :n].reshape(-1), values[:, n:].sum(0)  # [T/C], [N]: the holder's value
        return rollout_rows(layout, local, boundary, g, layout.row_len if seq_len is None else seq_len)

    def outputs(self, hidden: torch.Tensor, weight: torch.Tensor, packed_ids: torch.Tensor,
                layout: TreeLayout, *, seq_len=None, places=None, **asked) -> HeadOutputs:
        """:meth:`TreeLogProbs.outputs` from the hidden states and the output weight, no ``[T, V]``
        logits (the distributions' outputs in one chunked pass over this rank's rows)."""
        g = self.groups
        rows, _ = checked_rows(hidden, weight, packed_ids, g.cp_size, g.tp_size, self.sequence_parallel)  # [n, H]
        return tree_outputs(self, rows, weight, packed_ids, layout, seq_len, places, asked,
                                     lambda s: self(hidden, weight, packed_ids, layout, seq_len=s, places=places))
