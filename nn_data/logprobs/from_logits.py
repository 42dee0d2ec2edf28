"""Per-token log-probs from CP-local packed logits, gathered as ``[1, T/C]`` values and unpacked to ``[B, S]``.

Shape legend
    B   sequences; ``cu_seqlens`` and ``cu_seqlens_padded`` have B+1 entries
    S   row length of the output (``seq_len``: a Python int, or a symbolic size under compile)
    T   packed tokens; C context-parallel size; N = T/C positions on a rank
    V   vocabulary; ``Vt = V / TP`` columns on a tensor-parallel rank (vocab-parallel logits)
    c   tokens per chunk of the log-sum-exp (``chunk_tokens``)

Beyond the logits the op holds ``O(T)`` values and one ``[c, Vt]`` float32 chunk; only ``[1, T/C]`` log-probs
cross the CP group. The kernel is :func:`nn_data.logprobs.kernels.token_logprobs_local`; the steps around it
(the call's layout, each rank's targets, the rows from the gathered values) serve every log-prob op."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from nn_data import _checks
from nn_data.cp_comm import GatherFromContextParallel
from nn_data.groups import given_group_info
from nn_data.layout import Boundaries, PackLayout, layout_from_boundaries
from nn_data.layout.internal import op_layout
from nn_data.layout.internal import ZigzagLocal, checks, reads_host
from nn_data.logprobs.kernels import token_logprobs_local
from nn_data.logprobs.outputs import HeadOutputs, head_outputs_local
from nn_data.targets import next_token_at


class TokenLogProbs(nn.Module):
    """Per-token log-probs ``[B, S]`` from CP-local packed logits ``[1, T/C, Vt]``, NeMo-RL's layout.

    ``forward(logits [1, T/C, Vt], packed_ids [1, T] int, cu_seqlens [B+1] int, cu_seqlens_padded [B+1] int,
    places=None, *, seq_len=None, layout=None) -> [B, S]`` (float32; float64 for float64 logits):
    ``out[b, s] = log p(x[b, s] | x[b, :s])`` for ``1 <= s < L[b]``, else 0 (``docs/design.md``, "Differences
    from NeMo-RL"). ``logits`` is this rank's zigzag shard (vocab-parallel over ``tp_group``: rank ``k`` holds
    columns ``[k*Vt, (k+1)*Vt)``), ``packed_ids`` the full packed ids. ``S`` is ``seq_len`` when given, else the
    configured one (under compile pass ``x.shape[1]`` of a tensor marked with
    :func:`nn_data.rows.with_dynamic_row_length`). Given the pack's ``layout`` nothing is read on the host;
    without it the boundaries are read once (the validation). ``None`` groups mean not split; ``pg_collection``
    stands for the groups not given. Gradients reach the local logits (``grad_mode="own"``).

    Example (C 1, V 3, uniform logits): cu_seqlens ``[0, 3]``, cu_seqlens_padded ``[0, 4]``,
    seq_len 4 -> ``[[0, log(1/3), log(1/3), 0]]``.

    Raises :class:`~nn_data.errors.PackingError`: ``seq_len`` below 0, ``chunk_tokens`` below 1, a
    group this process is not in (``__init__``); no ``seq_len`` at all, ``logits`` not ``[1, T/C, Vt]`` floating
    point, ``packed_ids`` not ``[1, T]``, ``T`` not a multiple of ``2C``, bad boundary tensors (call); bad
    boundaries, a length over ``seq_len`` or its segment, a target id outside ``[0, V)`` (validation)."""

    def __init__(
        self,
        seq_len: Optional[int] = None,
        *,
        cp_group: Optional["dist.ProcessGroup"] = None,
        tp_group: Optional["dist.ProcessGroup"] = None,
        chunk_tokens: int = 256,
        validate: bool = True,
        host_reads: bool = True,
        pg_collection=None,
    ):
        super().__init__()
        self.seq_len = _checks.row_length("seq_len", seq_len, allow_none=True)
        self.host_reads = bool(host_reads)
        self.chunk_tokens = _checks.positive_int("chunk_tokens", chunk_tokens)
        self.cp_rank, self.cp_size, cp_group = given_group_info(cp_group, pg_collection=pg_collection, field="cp")
        self.tp_rank, self.tp_size, tp_group = given_group_info(tp_group, pg_collection=pg_collection, field="tp")
        self.tp_group, self.validate = tp_group, bool(validate)
        self.gather = GatherFromContextParallel(cp_group, validate=False, host_reads=False) if self.cp_size > 1 else None

    def extra_repr(self) -> str:
        return (f"seq_len={self.seq_len}, cp_size={self.cp_size}, cp_rank={self.cp_rank}, "
                f"tp_size={self.tp_size}, tp_rank={self.tp_rank}, chunk_tokens={self.chunk_tokens}")

    def forward(
        self,
        logits: torch.Tensor,
        packed_ids: torch.Tensor,
        cu_seqlens: Optional[torch.Tensor] = None,
        cu_seqlens_padded: Optional[torch.Tensor] = None,
        places: Optional[ZigzagLocal] = None,
        *,
        seq_len=None,
        layout: Optional[PackLayout] = None,
    ) -> torch.Tensor:
        seq_len = resolve_seq_len("TokenLogProbs", seq_len, self.seq_len)
        cols, total, layout, target, keep = self._prepared(logits, packed_ids, cu_seqlens, cu_seqlens_padded, places,
                                                           layout, seq_len, 0)
        local = token_logprobs_local(
            logits.squeeze(0), target, keep, vocab_start=self.tp_rank * cols, tp_group=self.tp_group,
            tp_size=self.tp_size, chunk_tokens=self.chunk_tokens,
        )  # [T/C]
        return rows_from_local(local, layout, self.gather, total, seq_len)  # [B, S]

    def outputs(self, logits: torch.Tensor, packed_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                cu_seqlens_padded: Optional[torch.Tensor] = None, places: Optional[ZigzagLocal] = None, *,
                seq_len=None, layout: Optional[PackLayout] = None, logprobs: bool = True, entropy: bool = False,
                top_k: int = 0, argmax: bool = False) -> HeadOutputs:
        """Every asked output of the logits in one chunked pass, as ``[B, S]`` rows (``[B, S, K]`` for top-k), column
        ``s`` from the position before token ``s`` (``1 <= s < L[b]``, else 0): ``logprobs``, ``entropy``, the
        ``top_k`` log-probs and their global ids, the ``argmax`` id; a :class:`~nn_data.logprobs.outputs.HeadOutputs`
        (not asked: None). Differentiable through the log-probs, the entropy and the top-k; one CP all-gather each.

        Example (C 1, V 3, uniform logits): cu_seqlens ``[0, 3]``, cu_seqlens_padded ``[0, 4]``, seq_len 4,
        ``entropy=True`` -> entropy ``[[0, log 3, log 3, 0]]``.

        Raises :class:`~nn_data.errors.PackingError` as :meth:`forward`, for a negative ``top_k`` or one above
        ``V`` and for no output asked."""
        seq_len = resolve_seq_len("TokenLogProbs", seq_len, self.seq_len)
        check_outputs_asked(logprobs, entropy, top_k, argmax)
        cols, total, layout, target, keep = self._prepared(logits, packed_ids, cu_seqlens, cu_seqlens_padded, places,
                                                           layout, seq_len, top_k)
        local = head_outputs_local(
            logits.squeeze(0), ids=target if logprobs else None, keep=keep if logprobs else None, entropy=entropy,
            top_k=top_k, argmax=argmax, vocab_start=self.tp_rank * cols, tp_group=self.tp_group, tp_size=self.tp_size,
            chunk_tokens=self.chunk_tokens,
        )  # [T/C, *] each
        return output_rows(local, layout, self.gather, total, seq_len)


    def _prepared(self, logits, packed_ids, cu_seqlens, cu_seqlens_padded, places, layout, seq_len, top_k: int):
        """``(Vt, T, layout, target [T/C], keep [T/C])`` of a call, after every check."""
        _checks.check_packed("logits", logits)
        if logits.dim() != 3 or not logits.dtype.is_floating_point:
            raise _checks.PackingError(f"logits must be floating point [1, T/C, V], got shape "
                                       f"{tuple(logits.shape)} and dtype {logits.dtype}")
        local_total, cols = logits.shape[1], logits.shape[2]
        check_top_k_output(top_k, cols * self.tp_size)
        total = check_full_ids("logits", logits, packed_ids, local_total, self.cp_size)
        layout = logprob_layout("TokenLogProbs", packed_ids, total, cols * self.tp_size, cu_seqlens, cu_seqlens_padded,
                               seq_len, layout, cp_size=self.cp_size, validate=self.validate, host_reads=self.host_reads)
        target, keep = targets_on_rank(layout, packed_ids, total, places, self.cp_size, self.cp_rank)  # [T/C] each
        return cols, total, layout, target, keep


def resolve_seq_len(op: str, seq_len, configured: Optional[int]):
    """The row length ``S`` of a call: ``seq_len=`` (an int is checked; a symbolic size passes), else the
    configured one, else :class:`~nn_data.errors.PackingError`."""
    if seq_len is None:
        if configured is None:
            raise _checks.PackingError(f"{op} needs the row length S: pass seq_len= to forward (or to the constructor)")
        return configured
    if isinstance(seq_len, int):
        _checks.row_length("seq_len", seq_len)
    return seq_len


def check_full_ids(name: str, local: torch.Tensor, packed_ids: torch.Tensor, local_total: int, cp_size: int) -> int:
    """``T`` (``local_total * C``) after checking that ``packed_ids`` is the full packed ids ``[1, T]`` on
    ``local``'s device (``name`` holds this rank's ``T/C`` positions)."""
    _checks.check_packed_ids("packed_ids", packed_ids)
    total = local_total * cp_size
    if packed_ids.shape[1] != total:
        raise _checks.PackingError(
            f"packed_ids has shape {tuple(packed_ids.shape)} but {name} {tuple(local.shape)} on "
            f"cp_size={cp_size} ranks cover T={total} positions; pass the full packed ids [1, {total}]"
        )
    _checks.check_same_device(**{name: local, "packed_ids": packed_ids})
    return total


def targets_on_rank(layout: PackLayout, packed_ids: torch.Tensor, total: int, places, cp_size: int, cp_rank: int):
    """``(target [T/C], keep [T/C])``: each of this rank's positions' next token within its sequence and
    whether it has one (:func:`nn_data.targets.next_token_at` on the layout's real lengths)."""
    segments = layout.segments()
    if places is None:
        places = layout.local_places(cp_size, cp_rank)
    return next_token_at(packed_ids[0], segments, places, total)  # [T/C] each


def rows_from_local(local: torch.Tensor, layout: PackLayout, gather, total: int, seq_len) -> torch.Tensor:
    """This rank's ``[T/C, *]`` values -> ``[B, S, *]`` rows: one all-gather over the CP group (``gather``,
    None without CP), then the unpack shifted by one."""
    packed = local if gather is None else gather(local[None], layout=layout).squeeze(0)  # [T]
    if total == 0:  # nothing was packed (every row empty, no pad_full_seq_to): all zeros, still in the graph
        return packed.sum().expand(layout.rows, seq_len, *packed.shape[1:]).clone()
    # out[b, s] = packed[cu_seqlens_padded[b] + s - 1] for 1 <= s < L[b], else 0: the log-prob of token s
    # is scored at position s - 1. Example: [a0, a1, a2, pad], L 3, S 4 -> [0, lp(a0->a1), lp(a1->a2), 0].
    return layout.unpack(packed[None], seq_len, 0.0, shift=1)  # [B, S]


def output_rows(local: HeadOutputs, layout: PackLayout, gather, total: int, seq_len) -> HeadOutputs:
    """Each asked output's ``[T/C, *]`` values -> ``[B, S, *]`` rows (:func:`rows_from_local`, one CP
    all-gather each); ``lse`` is dropped (None)."""
    rows = {name: rows_from_local(value, layout, gather, total, seq_len)
            for name, value in local._asdict().items() if value is not None and name != "lse"}
    return HeadOutputs(**rows)


def check_outputs_asked(logprobs: bool, entropy: bool, top_k, argmax: bool) -> None:
    """An ``outputs`` call asks for at least one output and ``top_k`` is an int ``>= 0``."""
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise _checks.PackingError(f"top_k must be an int >= 0 (0: no top-k output), got {top_k!r}")
    if not (logprobs or entropy or top_k or argmax):
        raise _checks.PackingError("outputs() asked for nothing: set logprobs, entropy, top_k or argmax")


def check_top_k_output(top_k: int, vocab: int) -> None:
    """The top-k output asks for at most the whole vocabulary."""
    if top_k > vocab:
        raise _checks.PackingError(f"top_k={top_k} is more than the vocabulary of {vocab} tokens; expected "
                                   f"0 <= top_k <= {vocab}")


def logprob_layout(op: str, packed_ids, total: int, vocab: int, cu_seqlens, cu_seqlens_padded, seq_len, layout, *,
                  cp_size: int, validate: bool, host_reads: bool) -> PackLayout:
    """The layout of a log-prob call and its validation: the one read of the boundaries, with "every
    target id is in the vocabulary" folded into it (eager, no layout given), or device asserts."""
    if layout is None:
        if cu_seqlens is None or cu_seqlens_padded is None:
            raise _checks.PackingError(f"{op} needs cu_seqlens and cu_seqlens_padded, or layout=")
        checks.boundary_args("packed_ids", packed_ids, total, cu_seqlens_padded, cp_size, cu_seqlens)
    elif layout.cu_seqlens is None:
        raise _checks.PackingError(f"{op} needs a layout with cu_seqlens (PackResult.layout)")
    bad_ids = None
    if validate:
        if layout is None:  # a layout of the boundaries built on the device (no read): their segments
            view = layout_from_boundaries(Boundaries(cu_seqlens_padded, total, cu_seqlens=cu_seqlens), op=op,
                                          validate=False, host_reads=False)
        bounds, lengths = (layout if layout is not None else view).segments()
        bad_ids = checks.target_ids(packed_ids[0], bounds, lengths, total, vocab)  # [T]
    if layout is not None or not validate or not reads_host(host_reads, packed_ids):
        layout = op_layout(op, "packed_ids", packed_ids, total, cp_size, cu_seqlens_padded, layout,
                           validate=validate, host_reads=host_reads, cu_seqlens=cu_seqlens, seq_len=seq_len)
        if bad_ids is not None:
            checks.target_ids_device(op, bad_ids, vocab)
        return layout
    ids_ok = (~bad_ids.any(), lambda: checks.target_ids_host(bad_ids, packed_ids[0], vocab))
    bounds = Boundaries(cu_seqlens_padded, total, cu_seqlens=cu_seqlens, also_check=ids_ok)
    return layout_from_boundaries(bounds, op=op, seq_len=seq_len, cp_size=cp_size)
