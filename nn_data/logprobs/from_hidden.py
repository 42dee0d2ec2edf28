"""Per-token log-probs straight from CP-local hidden states and the output weight: the logits never exist.

Shape legend
    B   sequences; ``cu_seqlens`` and ``cu_seqlens_padded`` have B+1 entries
    S   row length of the output (``seq_len``)
    T   packed tokens; C context-parallel size; N = T/C positions on a rank
    H   hidden size; V vocabulary, ``Vt = V / TP`` rows of the output weight on a tensor-parallel rank
    n   hidden-state rows on this rank: ``N``, or ``N/TP`` with sequence parallelism

``TokenLogProbsFromHidden`` gives exactly what :class:`~nn_data.TokenLogProbs` gives from the logits
``hidden @ weight.T / temperature`` (values, gradients of the hidden states and the weight, one ``[1, T/C]``
all-gather), holding ``O(T/C)`` values and one ``[chunk_tokens, V/TP]`` chunk beyond its inputs instead of
the logits; the kernel is :func:`nn_data.logprobs.kernels.hidden_logprobs_local` (docs/logprobs.md, "Log-probs
straight from hidden states")."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from nn_data import _checks
from nn_data.cp_comm import GatherFromContextParallel
from nn_data.groups import context_parallel_info, group_info, tensor_parallel_info
from nn_data.layout import PackLayout
from nn_data.layout.internal import ZigzagLocal
from nn_data.logprobs.filters import sampling_filter
from nn_data.logprobs.from_logits import (
    check_outputs_asked, check_top_k_output, logprob_layout, output_rows, resolve_seq_len, rows_from_local, targets_on_rank
)
from nn_data.logprobs.kernels import hidden_logprobs_local
from nn_data.logprobs.outputs import HeadOutputs, head_outputs_local

HIDDEN_SHAPE = "[1, T/C, H] (or megatron-core's sequence-first [T/C, 1, H])"


def hidden_rows(hidden: torch.Tensor) -> torch.Tensor:
    """``[1, n, H]`` or megatron-core's ``[n, 1, H]`` -> ``[n, H]`` (a view)."""
    return hidden.squeeze(0) if hidden.shape[0] == 1 else hidden.squeeze(1)


def checked_rows(hidden: torch.Tensor, weight: torch.Tensor, packed_ids: torch.Tensor, cp_size: int, tp_size: int,
                 sequence_parallel: bool) -> tuple:
    """``(rows [n, H], T)`` after checking an output head's ``hidden`` and ``weight``, the full ``packed_ids
    [1, T]`` on ``hidden``'s device, and ``hidden`` holding this rank's share of ``T``."""
    _checks.check_output_head("hidden", hidden, "weight", weight, HIDDEN_SHAPE)
    if 1 not in hidden.shape[:2]:
        raise _checks.PackingError(f"hidden must be {HIDDEN_SHAPE}, got shape {tuple(hidden.shape)}")
    rows = hidden_rows(hidden)  # [n, H]
    _checks.check_packed_ids("packed_ids", packed_ids)
    total = packed_ids.shape[1]
    _checks.check_token_share("hidden", rows.shape[0], total, cp_size, tp_size, sequence_parallel)
    _checks.check_same_device(hidden=hidden, packed_ids=packed_ids)
    return rows, total


class TokenLogProbsFromHidden(nn.Module):
    """Per-token log-probs ``[B, S]`` from this rank's hidden states and the output weight, without logits.

    ``forward(hidden [1, T/C, H], weight [V/TP, H], packed_ids [1, T] int, cu_seqlens [B+1] int = None,
    cu_seqlens_padded [B+1] int = None, places=None, *, seq_len=None, layout=None) -> [B, S]`` (float32; float64
    for float64 inputs): ``out[b, s] = log p(x[b, s] | x[b, :s])`` for ``1 <= s < L[b]``, else 0, ``p =
    softmax(hidden @ weight.T / temperature)``; :meth:`local` gives this rank's ``[1, T/C]`` values. ``hidden`` is
    this rank's zigzag shard (or megatron-core's ``[T/C, 1, H]``; with ``sequence_parallel`` this TP rank's rows of
    it), ``weight`` the vocab-parallel output weight in ``hidden``'s dtype; ``vocab_size`` (optional) is checked
    against its rows times TP; ``sampling_params`` (``top_k`` / ``top_p``) take the softmax over the kept logits.
    The rest as :class:`~nn_data.TokenLogProbs`.

    Example (C 1, V 3, zero weight: uniform logits): cu_seqlens ``[0, 3]``, cu_seqlens_padded ``[0, 4]``,
    seq_len 4 -> ``[[0, log(1/3), log(1/3), 0]]``.

    Raises :class:`~nn_data.errors.PackingError`: ``seq_len`` below 0, ``chunk_tokens`` below 1, a temperature that
    is not positive, a group this process is not in (``__init__``); hidden states not floating point ``[1, T/C,
    H]`` or not this rank's share of ``T``, a weight whose columns are not ``H`` or rows times TP not
    ``vocab_size``, ``top_k`` above ``V``, as :class:`~nn_data.TokenLogProbs` for the ids and boundaries."""

    def __init__(
        self,
        seq_len: Optional[int] = None,
        *,
        cp_group=None,
        tp_group=None,
        pg_collection=None,
        sequence_parallel: bool = False,
        chunk_tokens: int = 256,
        temperature: float = 1.0,
        sampling_params=None,
        vocab_size: Optional[int] = None,
        validate: bool = True,
        host_reads: bool = True,
    ):
        super().__init__()
        self.seq_len = _checks.row_length("seq_len", seq_len, allow_none=True)
        self.chunk_tokens = _checks.positive_int("chunk_tokens", chunk_tokens)
        self.temperature = _checks.check_temperature(temperature)
        self.sampling = sampling_filter(sampling_params)
        self.vocab_size = _checks.positive_int("vocab_size", vocab_size, allow_none=True)
        if pg_collection is None:
            cp, tp = group_info(cp_group, "context-parallel group"), group_info(tp_group, "tensor-parallel group")
        else:
            cp, tp = context_parallel_info(cp_group, pg_collection=pg_collection), \
                tensor_parallel_info(tp_group, pg_collection=pg_collection)
        (self.cp_rank, self.cp_size, cp_group), (self.tp_rank, self.tp_size, self.tp_group) = cp, tp
        self.sequence_parallel = bool(sequence_parallel)
        self.validate, self.host_reads = bool(validate), bool(host_reads)
        self.gather = GatherFromContextParallel(cp_group, validate=False, host_reads=False) if self.cp_size > 1 else None

    def extra_repr(self) -> str:
        return (f"seq_len={self.seq_len}, cp_size={self.cp_size}, cp_rank={self.cp_rank}, tp_size={self.tp_size}, "
                f"tp_rank={self.tp_rank}, sequence_parallel={self.sequence_parallel}, "
                f"chunk_tokens={self.chunk_tokens}, temperature={self.temperature}")

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, packed_ids: torch.Tensor,
                cu_seqlens: Optional[torch.Tensor] = None, cu_seqlens_padded: Optional[torch.Tensor] = None,
                places: Optional[ZigzagLocal] = None, *, seq_len=None,
                layout: Optional[PackLayout] = None) -> torch.Tensor:
        seq_len = resolve_seq_len("TokenLogProbsFromHidden", seq_len, self.seq_len)
        local, layout, total = self._local(hidden, weight, packed_ids, cu_seqlens, cu_seqlens_padded, places, layout,
                                           seq_len)
        return rows_from_local(local, layout, self.gather, total, seq_len)  # [B, S]

    def local(self, hidden: torch.Tensor, weight: torch.Tensor, packed_ids: torch.Tensor,
              cu_seqlens: Optional[torch.Tensor] = None, cu_seqlens_padded: Optional[torch.Tensor] = None,
              places: Optional[ZigzagLocal] = None, *, layout: Optional[PackLayout] = None) -> torch.Tensor:
        """This rank's ``[1, T/C]`` values, in its zigzag order, before the CP gather: position ``t`` holds
        ``log p(x[t + 1] | x[:t + 1])`` when token ``t + 1`` is in ``t``'s sequence, else 0 (no host read with
        ``layout=``; the argument checks as :meth:`forward`, no ``seq_len`` needed)."""
        return self._local(hidden, weight, packed_ids, cu_seqlens, cu_seqlens_padded, places, layout, None)[0][None]

    def outputs(self, hidden: torch.Tensor, weight: torch.Tensor, packed_ids: torch.Tensor,
                cu_seqlens: Optional[torch.Tensor] = None, cu_seqlens_padded: Optional[torch.Tensor] = None,
                places: Optional[ZigzagLocal] = None, *, seq_len=None, layout: Optional[PackLayout] = None,
                logprobs: bool = True, entropy: bool = False, top_k: int = 0, argmax: bool = False) -> HeadOutputs:
        """Every asked output of the head in one chunked pass, as ``[B, S]`` rows (``[B, S, K]`` for top-k): a
        :class:`~nn_data.logprobs.outputs.HeadOutputs`, as :meth:`nn_data.TokenLogProbs.outputs` gives from the logits
        (with ``sampling_params``, the filtered distribution's).

        Example (C 1, V 3, zero weight): cu_seqlens ``[0, 3]``, cu_seqlens_padded ``[0, 4]``, seq_len 4,
        ``entropy=True`` -> entropy ``[[0, log 3, log 3, 0]]``.

        Raises :class:`~nn_data.errors.PackingError` as :meth:`forward`, for a negative ``top_k`` or one above
        ``V`` and for no output asked."""
        seq_len = resolve_seq_len("TokenLogProbsFromHidden", seq_len, self.seq_len)
        check_outputs_asked(logprobs, entropy, top_k, argmax)
        rows, layout, total, target, keep = self._prepared(hidden, weight, packed_ids, cu_seqlens, cu_seqlens_padded,
                                                           places, layout, seq_len, top_k)
        local = head_outputs_local(
            rows, weight, ids=target if logprobs else None, keep=keep if logprobs else None, entropy=entropy,
            top_k=top_k, argmax=argmax, vocab_start=self.tp_rank * weight.shape[0], tp_group=self.tp_group,
            tp_size=self.tp_size, sequence_parallel=self.sequence_parallel, chunk_tokens=self.chunk_tokens,
            temperature=self.temperature, sampling=self.sampling,
        )  # [T/C, *] each
        return output_rows(local, layout, self.gather, total, seq_len)

    def _local(self, hidden, weight, packed_ids, cu_seqlens, cu_seqlens_padded, places, layout, seq_len):
        """``(values [T/C], layout, T)`` after every check."""
        rows, layout, total, target, keep = self._prepared(hidden, weight, packed_ids, cu_seqlens, cu_seqlens_padded,
                                                           places, layout, seq_len, 0)
        return self._kernel(rows, weight, target, keep), layout, total

    def _kernel(self, rows, weight, target, keep):
        """The target log-probs ``[T/C]`` (top-k / top-p filtered when configured)."""
        return hidden_logprobs_local(
            rows, weight, target, keep, vocab_start=self.tp_rank * weight.shape[0], tp_group=self.tp_group,
            tp_size=self.tp_size, sequence_parallel=self.sequence_parallel, chunk_tokens=self.chunk_tokens,
            temperature=self.temperature, sampling=self.sampling,
        )  # [T/C]

    def _prepared(self, hidden, weight, packed_ids, cu_seqlens, cu_seqlens_padded, places, layout, seq_len, top_k):
        """``(rows [n, H], layout, T, target [T/C], keep [T/C])`` after every check."""
        rows, total = checked_rows(hidden, weight, packed_ids, self.cp_size, self.tp_size, self.sequence_parallel)
        vocab = weight.shape[0] * self.tp_size
        if self.vocab_size is not None and vocab != self.vocab_size:
            raise _checks.PackingError(
                f"weight holds {weight.shape[0]} vocabulary rows on each of tp_size={self.tp_size} ranks = {vocab}, "
                f"but vocab_size={self.vocab_size}; pass this rank's vocab-parallel slice [V/TP, H] of the output weight"
            )
        if self.sampling is not None:
            _checks.check_top_k(self.sampling.top_k, vocab)
        check_top_k_output(top_k, vocab)
        layout = logprob_layout("TokenLogProbsFromHidden", packed_ids, total, vocab, cu_seqlens, cu_seqlens_padded,
                               seq_len, layout, cp_size=self.cp_size, validate=self.validate,
                               host_reads=self.host_reads)
        target, keep = targets_on_rank(layout, packed_ids, total, places, self.cp_size, self.cp_rank)  # [T/C] each
        return rows, layout, total, target, keep
