"""The compatibility layer's eager pack path: plan every boundary on the host, move data with a few ops.

Shape legend
    B   sequences of the microbatch; S padded row length of the input batch
    T   packed tokens; C context-parallel size, r this rank; the local shard is ``T/C`` tokens
    k   a segment's zigzag chunk, ``n / (2C)`` for a padded segment of ``n`` tokens
    *   trailing dims (routed experts ``[layers, topk]``, token identities ``[3]``)

The NeMo-RL layer spends one host sync per microbatch anyway (``docs/design.md``, "Sync budget").
Reading the ``B`` lengths themselves in that sync, rather than a few statistics of them, gives
every boundary as a Python int, and then the data moves with a constant number of ops whatever
``B`` is (about a dozen for ``input_ids``, views included), no index map at all:

* pack: one ``split`` of ``x.reshape(B*S, *)`` at ``[L0, S-L0, L1, S-L1, ...]`` (one op that
  returns every row's valid prefix as a view), one padding buffer of ``T - sum(L)`` rows split
  at the padding lengths, and one ``cat`` of the two interleaved: ``[T, *]``, each byte written
  once.
* shard: one ``split`` of the packed tensor at ``[r k, k, (2C-2-2r) k, k, r k]`` per segment
  (pieces 1 and 3 are this rank's chunks ``r`` and ``2C-1-r``) and one ``cat``: ``[T/C, *]``.

Example: lengths ``[3, 0, 5]``, S 5, m 4 -> cu_seqlens_padded ``[0, 4, 4, 12]``; the input
splits at ``[3, 2, 0, 5, 5, 0]`` (valid prefixes ``x[0,:3]``, ``x[1,:0]``, ``x[2,:5]``), the
padding at ``[1, 0, 3]``, and the packed tensor is ``x[0,:3], 0, x[2,:5], 0, 0, 0``.

The compiled path keeps the device planning (``engine.plan_pack`` and ``PackShardGraph``):
there the lengths are data, and nothing may depend on their values.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate, compress
from typing import Callable, NamedTuple, Optional, Union

import torch

from nn_data._checks import INT32_MAX

Fill = Union[int, torch.Tensor]

#: Segments up to which the CP shard is a split + cat of views; above, an index_select along a
#: scanned map. Measured on this project's 2-core CPU (1 thread, C = 4, T/C = 65,536): views vs
#: index 43 vs 94 us at 8 segments, 104 vs 107 at 32, 192 vs 125 at 64, 771 vs 238 at 256.
SHARD_VIEWS_MAX_SEGMENTS = 32


class HostPlan(NamedTuple):
    """One microbatch's boundaries as Python ints.

    ``cu [B+1]`` and ``cu_pad [B+1]`` (the final boundaries, extend last; ``[T]`` when B = 0),
    ``total`` (T), ``max_seqlen`` (the longest padded segment; T when B = 0, the padding
    pseudo-segment), and the split
    sizes: ``rows`` (``[L0, S-L0, ...]``, splits the flat input), ``pads`` (each segment's
    padding after its valid tokens; ``[T]`` when B = 0) and ``chunks`` (each segment's zigzag
    chunk ``k``; ``[T / 2C]`` for the padding pseudo-segment when B = 0).
    """

    cu: list
    cu_pad: list
    total: int
    max_seqlen: int
    rows: list
    pads: list
    chunks: list


def plan_on_host(lengths: list, row_len: int, m: int, fixed: Optional[int], cp_size: int,
                 total_of: Callable[[int], int]) -> Optional[HostPlan]:
    """Plan one microbatch from its lengths (host ints); None when they are invalid.

    ``fixed`` is ``pad_full_seq_to`` (or None, then ``total_of(natural)`` chooses ``T`` from the
    natural total ``sum(round_up(L, m))``). Invalid means a length outside ``[0, S]``, a natural
    total above ``fixed`` or, with ``cp_size > 1``, a segment that does not split into ``2C``
    chunks: the caller then raises the precise error from the device tensor (error path only).

    Example: lengths ``[8, 5, 7]``, S 8, m 4, fixed 40 -> cu ``[0, 8, 13, 20]``, cu_pad
    ``[0, 8, 16, 40]``, max_seqlen 24, rows ``[8, 0, 5, 3, 7, 1]``, pads ``[0, 3, 17]``.
    """
    if lengths and (min(lengths) < 0 or max(lengths) > row_len):
        return None
    padded = [-(-n // m) * m for n in lengths]
    cu, cu_pad = list(accumulate(lengths, initial=0)), list(accumulate(padded, initial=0))
    natural = cu_pad[-1]
    if fixed is not None and natural > fixed:
        return None
    total = fixed if fixed is not None else total_of(natural)
    if total > INT32_MAX:
        return None
    two_c = 2 * cp_size
    if not lengths:  # no sequence: cu_seqlens_padded = [T], one padding pseudo-segment [0, T]
        return HostPlan(cu, [total], total, total, [], [total], [total // two_c])
    cu_pad[-1] = total  # extend last: the last segment absorbs the slack
    segments = [b - a for a, b in zip(cu_pad, cu_pad[1:])]  # [B]
    if cp_size > 1 and any(n % two_c for n in segments):
        return None
    rows = [0] * (2 * len(lengths))
    rows[::2] = lengths
    rows[1::2] = [row_len - n for n in lengths]
    pads = [n - v for n, v in zip(segments, lengths)]
    return HostPlan(cu, cu_pad, total, max(segments), rows, pads, [n // two_c for n in segments])


def pack_planned(plan: HostPlan, x: torch.Tensor, fill: Fill = 0) -> torch.Tensor:
    """``x [B, S, *] -> [1, T, *]`` along ``plan``: valid prefixes and ``fill`` padding, one ``cat``.

    ``fill`` is a scalar or a tensor broadcastable to ``x.shape[2:]`` (routed experts pass
    ``arange(topk)``, a valid route in every padding row).
    """
    trailing = x.shape[2:]
    pad = _padding((sum(plan.pads), *trailing), fill, x)  # [T - sum(L), *]
    pads = pad.split(plan.pads)
    if not plan.rows:  # B = 0: the whole packed tensor is padding (materialised: fill may be a view)
        return pad.contiguous().unsqueeze(0)
    valid = x.reshape(x.shape[0] * x.shape[1], *trailing).split(plan.rows)[::2]  # B views [L_b, *]
    pieces = [None] * (2 * len(valid))
    pieces[::2], pieces[1::2] = valid, pads
    sizes = [0] * len(pieces)
    sizes[::2], sizes[1::2] = plan.rows[::2], plan.pads
    return _cat(pieces, sizes, pad).unsqueeze(0)  # [1, T, *]


def shard_planned(plan: HostPlan, packed: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's zigzag shard ``[1, T, *] -> [1, T/C, *]``: chunks ``r`` and ``2C-1-r`` of every
    segment (``packed`` itself when ``cp_size == 1``).

    Up to :data:`SHARD_VIEWS_MAX_SEGMENTS` segments: one ``split`` and one ``cat`` of the chunks.
    More: one ``index_select`` along a map built from host ints by one scan (the split's
    Python-side cost per piece outgrows a scan over ``T/C`` positions).
    """
    if cp_size == 1:
        return packed
    flat = packed[0]  # [T, *]
    if plan.total % (2 * cp_size):  # only B = 0 gets here (plan_on_host checks real segments): all padding
        return flat[: plan.total // cp_size].clone().unsqueeze(0)
    if len(plan.chunks) <= SHARD_VIEWS_MAX_SEGMENTS:
        return _shard_views(plan.chunks, flat, cp_size, cp_rank).unsqueeze(0)
    return flat.index_select(0, _shard_source(plan, flat.device, cp_size, cp_rank)).unsqueeze(0)


def _shard_views(chunks: list, flat: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Split ``flat [T, *]`` at ``[r k, k, (2C-2-2r) k, k, r k]`` per segment; pieces 1 and 3 of each
    five are this rank's. Example: C 2, rank 0, k 4 and 6 -> ``[0, 4, 8, 4, 0, 0, 6, 12, 6, 0]``:
    positions ``0..3, 12..15, 16..21, 34..39``."""
    r, mid = cp_rank, 2 * cp_size - 2 - 2 * cp_rank
    parts = flat.split([size for k in chunks for size in (r * k, k, mid * k, k, r * k)])
    pieces = [None] * (2 * len(chunks))
    pieces[::2], pieces[1::2] = parts[1::5], parts[3::5]
    return _cat(pieces, [k for k in chunks for _ in (0, 1)], flat)  # [T/C, *]


def _shard_source(plan: HostPlan, device, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[T/C]`` int64: the packed position of each local position, as a scan of piece jumps.

    The local positions advance by 1 through the packed tensor and jump where a piece starts:
    segment ``b`` (start ``a``, chunk ``k``) gives pieces at local ``a/C`` and ``a/C + k``; the
    first jumps ``r (k + k_prev)`` (the previous segment's last ``r`` chunks and this one's first
    ``r``), the second ``(2C-2-2r) k``. Example: C 2, rank 0, cu_pad ``[0, 16, 40]`` -> ones with
    jumps 8 at local 4 and 12 at local 14 (and -1 at 0) -> cumsum ``0..3, 12..15, 16..21, 34..39``.
    """
    r, mid, local = cp_rank, 2 * cp_size - 2 - 2 * cp_rank, plan.total // cp_size
    starts, jumps, prev = [], [], 0
    for a, k in zip(plan.cu_pad, plan.chunks):
        starts += (a // cp_size, a // cp_size + k)
        jumps += (r * (k + prev), mid * k)
        prev = k
    jumps[0] -= 1  # cumsum of ones counts from 1
    keep = bisect_left(starts, local)  # trailing empty segments start at T/C: nothing left to jump
    table = host_tensor([starts[:keep], jumps[:keep]], torch.int64, device)  # [2, 2B]
    delta = torch.ones(local, dtype=torch.int64, device=device)  # [T/C]
    delta.index_add_(0, table[0], table[1])
    return delta.cumsum(0)  # [T/C]


class PackedBatch(NamedTuple):
    """Everything one microbatch packs to (this path and the engine's graph alike). ``*_packed`` are
    ``[1, T, *]``, ``*_local`` are ``[1, T/C, *]`` (the same tensor when C = 1); extras are None when
    not given."""

    packed: torch.Tensor
    local: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    mtp_packed: Optional[torch.Tensor] = None
    mtp_local: Optional[torch.Tensor] = None
    routed_packed: Optional[torch.Tensor] = None
    routed_local: Optional[torch.Tensor] = None
    identity_packed: Optional[torch.Tensor] = None
    identity_local: Optional[torch.Tensor] = None
    media_packed: Optional[torch.Tensor] = None
    media_local: Optional[torch.Tensor] = None


def pack_batch(plan: HostPlan, input_ids: torch.Tensor, cp_size: int, cp_rank: int, mtp_loss_mask=None,
               routed_experts=None, token_identity=None, media_token_validity_mask=None) -> PackedBatch:
    """Pack and shard ``input_ids [B, S]`` and each extra ``[B, S, *]`` along ``plan`` (the extras'
    shapes and devices are the caller's checks: ``engine.check_extras``).

    Padding is 0, except routed experts, whose padding rows are ``arange(topk)``.
    """

    def both(x, fill=0):
        if x is None:
            return None, None
        packed = pack_planned(plan, x, fill)  # [1, T, *]
        return packed, shard_planned(plan, packed, cp_size, cp_rank)  # [1, T/C, *]

    route = None
    if routed_experts is not None:  # [topk], broadcast over layers
        route = torch.arange(routed_experts.shape[-1], device=routed_experts.device, dtype=routed_experts.dtype)
    cu, cu_pad = boundaries(plan, input_ids.device)
    return PackedBatch(*both(input_ids), cu, cu_pad, *both(mtp_loss_mask), *both(routed_experts, route),
                      *both(token_identity), *both(media_token_validity_mask))


def boundaries(plan: HostPlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, cu_seqlens_padded)``, int32 ``[B+1]`` on ``device``, from one host tensor."""
    if len(plan.cu) != len(plan.cu_pad):  # B = 0: [0] and [T]
        both = host_tensor(plan.cu + plan.cu_pad, torch.int32, device)
        return both[:1], both[1:]
    both = host_tensor([plan.cu, plan.cu_pad], torch.int32, device)  # [2, B+1]
    return both[0], both[1]


def host_tensor(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of host ints on ``device``. On an accelerator it is staged in pinned memory and
    copied asynchronously: a copy from pageable memory would block the host (a sync, which
    ``torch.cuda.set_sync_debug_mode`` reports), while the microbatch's one sync is the read of
    the lengths."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _cat(pieces: list, sizes: list, like: torch.Tensor) -> torch.Tensor:
    """``cat`` of the non-empty ``pieces`` (``sizes`` their lengths): on the CPU an empty input moves
    ``cat`` off its serial memcpy kernel (measured here: 512 pieces of which half empty took 5x
    longer than the same pieces without the empty ones)."""
    kept = list(compress(pieces, sizes))
    if not kept:
        return like.new_empty((0, *like.shape[1:]))
    return torch.cat(kept)


def _padding(shape, fill: Fill, like: torch.Tensor) -> torch.Tensor:
    """A padding buffer: zeros, or ``fill`` broadcast (a view, no copy) for a tensor fill."""
    if isinstance(fill, torch.Tensor):
        return fill.to(device=like.device, dtype=like.dtype).expand(shape)
    if fill == 0:
        return like.new_zeros(shape)
    return like.new_full(shape, fill)
