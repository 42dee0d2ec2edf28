"""Obviously-correct loop implementations of the ops: the tests' oracle and the benchmarks' baseline. One Python
iteration per sequence, plain slicing, host syncs allowed (as NeMo-RL packs); semantics: ``docs/design.md``.

Shape legend: ``B`` sequences, ``S`` row length, ``T`` packed tokens, ``C`` cp size, ``*`` trailing dims."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class ReferencePack(NamedTuple):
    packed: torch.Tensor  # [1, T, *]
    cu_seqlens: torch.Tensor  # [B+1] int32
    cu_seqlens_padded: torch.Tensor  # [B+1] int32
    max_seqlen: int


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def reference_pack(
    x: torch.Tensor,
    seq_lengths,
    pad_individual_seqs_to_multiple_of: int = 1,
    pad_packed_seq_to_multiple_of: int = 1,
    pad_full_seq_to: Optional[int] = None,
    fill=0,
) -> ReferencePack:
    """Pack ``x [B, S, *]`` sequence by sequence; pad positions hold ``fill``
    (a scalar or a tensor broadcastable to ``x.shape[2:]``)."""
    m, p = pad_individual_seqs_to_multiple_of, pad_packed_seq_to_multiple_of
    lengths = [int(v) for v in seq_lengths]
    cu, cu_pad = [0], [0]
    for n in lengths:
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + _round_up(n, m))
    if pad_full_seq_to is not None:
        assert cu_pad[-1] <= pad_full_seq_to, "packed total exceeds pad_full_seq_to"
        cu_pad[-1] = pad_full_seq_to
    else:
        cu_pad[-1] = _round_up(cu_pad[-1], p)
    total = cu_pad[-1]
    packed = torch.empty((total, *x.shape[2:]), dtype=x.dtype, device=x.device)
    packed[...] = torch.as_tensor(fill, dtype=x.dtype, device=x.device)
    for b, n in enumerate(lengths):
        packed[cu_pad[b] : cu_pad[b] + n] = x[b, :n]
    seg = [cu_pad[b + 1] - cu_pad[b] for b in range(len(lengths))]
    return ReferencePack(
        packed.unsqueeze(0),
        torch.tensor(cu, dtype=torch.int32),
        torch.tensor(cu_pad, dtype=torch.int32),
        max(seg, default=total),  # B = 0: one padding pseudo-segment [0, T]
    )


def reference_shard(packed: torch.Tensor, cu_seqlens_padded, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Rank ``cp_rank``'s zigzag shard ``[1, T/C, *]``: per segment, chunks ``r`` and ``2C-1-r``."""
    if cp_size == 1:
        return packed
    bounds = [int(v) for v in cu_seqlens_padded]
    if len(bounds) == 1:  # no sequence: the whole tensor is one padding segment
        bounds = [0, packed.shape[1]]
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        seq = packed[0, start:end]
        assert seq.shape[0] % (2 * cp_size) == 0, "segment not divisible by 2*cp_size"
        chunks = seq.chunk(2 * cp_size) if seq.shape[0] else [seq[:0]] * (2 * cp_size)
        pieces += [chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]]
    return torch.cat(pieces).unsqueeze(0)


def reference_unshard(shards: torch.Tensor, cu_seqlens_padded, cp_size: int) -> torch.Tensor:
    """Inverse of :func:`reference_shard` over all ranks: ``[C, T/C, *] -> [1, T, *]``."""
    if cp_size == 1:
        return shards
    bounds = [int(v) for v in cu_seqlens_padded]
    total = shards.shape[1] * cp_size
    if len(bounds) == 1:
        bounds = [0, total]
    out = shards.new_empty((total, *shards.shape[2:]))
    local_start = 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        k = (end - start) // (2 * cp_size)
        for r in range(cp_size):
            mine = shards[r, local_start : local_start + 2 * k]
            out[start + r * k : start + (r + 1) * k] = mine[:k]
            hi = 2 * cp_size - 1 - r
            out[start + hi * k : start + (hi + 1) * k] = mine[k:]
        local_start += 2 * k
    return out.unsqueeze(0)


def reference_unpack(packed: torch.Tensor, seq_lengths, cu_seqlens_padded, seq_len: int, fill=0) -> torch.Tensor:
    """``out[b, :L[b]] = packed[0, cu_seqlens_padded[b] : cu_seqlens_padded[b] + L[b]]``, ``fill`` elsewhere."""
    lengths = [int(v) for v in seq_lengths]
    starts = [int(v) for v in cu_seqlens_padded]
    out = packed.new_full((len(lengths), seq_len, *packed.shape[2:]), fill)
    for b, n in enumerate(lengths):
        out[b, :n] = packed[0, starts[b] : starts[b] + n]
    return out


def reference_padding_mask(seq_lengths, pad_individual_seqs_to_multiple_of: int = 1, pad_packed_seq_to_multiple_of: int = 1,
                           pad_full_seq_to: Optional[int] = None, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """``[1, T/C]`` bool, rank ``cp_rank``'s shard of the packed layout, True where no valid token sits:
    the valid-token mask packed sequence by sequence (padding False), inverted, zigzag-sharded."""
    lengths = [int(v) for v in seq_lengths]
    seq_len = max(lengths, default=0)
    valid = torch.arange(seq_len)[None, :] < torch.tensor(lengths, dtype=torch.int64).view(-1, 1)  # [B, S]
    ref = reference_pack(valid, lengths, pad_individual_seqs_to_multiple_of, pad_packed_seq_to_multiple_of,
                         pad_full_seq_to, fill=False)
    return reference_shard(~ref.packed, ref.cu_seqlens_padded, cp_size, cp_rank)


def reference_position_ids(cu_seqlens_padded, total: int) -> torch.Tensor:
    """``[1, T]``: ``0, 1, ...`` inside every padded segment (``0..T-1`` with no sequence)."""
    bounds = [int(v) for v in cu_seqlens_padded]
    if len(bounds) == 1:
        bounds = [0, total]
    out = torch.zeros(total, dtype=torch.int64)
    for start, end in zip(bounds[:-1], bounds[1:]):
        out[start:end] = torch.arange(end - start)
    return out.unsqueeze(0)


def reference_next_token_targets(packed_ids: torch.Tensor, cu_seqlens, cu_seqlens_padded, ignore_index: int = -100):
    """``(targets [1, T], loss_mask [1, T])``: sequence by sequence, token ``s`` targets token ``s+1``
    for ``s < L-1``; everything else is ``ignore_index`` with mask 0."""
    total = packed_ids.shape[1]
    cu = [int(v) for v in cu_seqlens]
    starts = [int(v) for v in cu_seqlens_padded]
    targets = torch.full((total,), ignore_index, dtype=torch.int64)
    mask = torch.zeros(total, dtype=torch.float32)
    for b in range(len(cu) - 1):
        n, start = cu[b + 1] - cu[b], starts[b]
        if n > 1:
            targets[start : start + n - 1] = packed_ids[0, start + 1 : start + n]
            mask[start : start + n - 1] = 1.0
    return targets.unsqueeze(0), mask.unsqueeze(0)


def reference_token_logprobs(logits: torch.Tensor, packed_ids: torch.Tensor, cu_seqlens, cu_seqlens_padded,
                             seq_len: int) -> torch.Tensor:
    """``[B, S]`` from the *full* packed logits ``[1, T, V]``, one sequence at a time:
    ``out[b, s] = log_softmax(logits[start + s - 1])[x[start + s]]`` for ``1 <= s < L[b]``, 0 elsewhere.
    Differentiable w.r.t. ``logits`` (the tests' gradient oracle)."""
    cu = [int(v) for v in cu_seqlens]
    starts = [int(v) for v in cu_seqlens_padded]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = []
    for b in range(len(cu) - 1):
        n, start = cu[b + 1] - cu[b], starts[b]
        row = logits.new_zeros(seq_len, dtype=dtype)
        if n > 1:
            lp = torch.log_softmax(logits[0, start : start + n - 1].to(dtype), dim=-1)  # [n-1, V]
            picked = lp.gather(1, packed_ids[0, start + 1 : start + n, None].long()).squeeze(1)
            row = torch.cat([row[:1], picked, row[n:]])
        rows.append(row)
    out = torch.stack(rows) if rows else logits.new_zeros((0, seq_len), dtype=dtype)
    return out + 0 * logits.sum()  # keeps the output in the autograd graph when no row has a target
