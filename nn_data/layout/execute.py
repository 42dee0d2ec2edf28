"""Which executor runs a layout, in one place (``docs/design.md``, "Layouts and executors").

Shape legend
    B   rows; S the row length; T packed tokens; C context-parallel size; * trailing dims

The rule: a layout built on the host (it carries :class:`~nn_data.layout.pack_layout.HostBounds`) runs
on the host executor (:mod:`nn_data.layout.host`: Python-int sizes, no further read) unless
``torch.compile`` is tracing; every other layout runs on the device executor
(:mod:`nn_data.layout.device`: index maps, zero syncs), which is what compiled graphs and CUDA graphs
capture. Whether a layout is built on the host is the builders' rule
(:func:`nn_data.layout.build.reads_host`).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from nn_data import _checks
from nn_data.layout import device, host


def on_host(layout) -> bool:
    """Whether ``layout`` runs on the host executor: built on the host, and no compile tracing."""
    return layout.host is not None and not torch.compiler.is_compiling()


def pack(layout, x: torch.Tensor, fill=0) -> torch.Tensor:
    """``x [B, S, *] -> [1, T, *]`` along ``layout``; padding gets ``fill``. Raises
    :class:`~nn_data.errors.PackingError` if ``x`` is not ``[B, S, *]`` for the layout's ``B`` and
    ``S`` or lives on another device."""
    _checks.check_min_dims("x", x, 2, "[B, S, *]")
    rows, row_len = layout.rows, layout.row_len
    if row_len is None:
        raise _checks.PackingError("this layout was built from boundaries without a row length S; it can "
                                   "shard, unshard and unpack, not pack: build it from the lengths (PackSequences)")
    if x.shape[0] != rows or guard_or_false(x.shape[1] != row_len):
        rows, row_len = int(rows), int(row_len)  # error path: plain ints for the message
        raise _checks.PackingError(
            f"x has shape {_checks.dims(x)}; the layout was built for [B, S] = "
            f"[{rows}, {row_len}], so x must be [{rows}, {row_len}, *]"
        )
    if x.device != layout.cu_seqlens_padded.device:
        _checks.check_same_device(x=x, layout=layout.cu_seqlens_padded)  # raises, naming both
    if on_host(layout):
        return host.pack(layout.host, x, fill)
    return device.pack(layout, x, fill)


def shard(layout, packed: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's zigzag shard ``[1, T, *] -> [1, T/C, *]`` (``packed`` itself when ``C = 1``)."""
    if cp_size == 1:
        return packed
    if on_host(layout):
        return host.shard(layout.host, packed, cp_size, cp_rank)
    return device.shard(layout, packed, cp_size, cp_rank)


def unshard(layout, shards: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Every rank's shard, rank-major ``[C, T/C, *]``, back to the packed ``[1, T, *]``."""
    if cp_size == 1:
        return shards
    if on_host(layout):
        return host.unshard(layout, shards, cp_size)
    return device.unshard(layout, shards, cp_size)


def unpack(layout, packed: torch.Tensor, seq_len, fill=0, shift: int = 0) -> torch.Tensor:
    """``[1, T, *] -> [B, S, *]`` with ``S = seq_len``: each row's valid tokens, ``fill`` elsewhere
    (``shift=1``: the log-prob layout, token ``s`` from packed position ``start + s - 1``)."""
    rows, total, trailing = layout.rows, packed.shape[1], packed.shape[2:]
    if guard_or_false(total == 0):  # nothing to read: all fill
        out = packed.new_full((rows, seq_len, *trailing), fill)
        # + the sum of the empty packed tensor (exactly 0) keeps a backward through an empty microbatch
        return out + packed.sum().to(out.dtype) if packed.requires_grad else out
    if on_host(layout) and rows and (not packed.requires_grad or any(n > shift for n in layout.host.lengths)):
        return host.unpack(layout.host, packed, seq_len, fill, shift)
    # No row (B = 0), or no token to move while autograd records, takes the device's gather form: it
    # keeps the output in autograd's graph (the host form would be fill only).
    return device.unpack(packed, layout.lengths(), layout.cu_seqlens_padded.to(torch.int64), seq_len, fill, shift)
