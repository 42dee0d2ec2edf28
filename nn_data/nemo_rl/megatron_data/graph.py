"""The compat layer's compiled pack graph, its cache and the recompile-limit patch.

Shape legend
    B   sequences of the microbatch; R >= B rows after row-capacity padding
    S   padded row length (an unbacked symbolic size in the graph); T packed tokens
    C   context-parallel size; the local shard is ``T/C`` tokens
    *   trailing dims (routed experts ``[layers, topk]``, token identity ``[3]``)

:class:`PackShardGraph` packs ``input_ids`` and every tensor that rides the same layout and takes this
rank's zigzag places, on the device executor (:mod:`nn_data.layout`) with no sync: the microbatch was
planned and checked on the host before (:mod:`nn_data.nemo_rl.megatron_data.dispatch`), so ``T`` is in the key.
Compiled (``PackOptions(compile=True)``), the batch is padded with empty rows to a fixed row capacity
and ``S`` is a symbolic size (unbacked: ``S = 0`` and ``1`` too), so a stream of microbatches with
other lengths, row counts and ``S`` reuses one compiled graph per ``(T, R)``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from nn_data import _checks
from nn_data.nemo_rl.megatron_data.keys import CompiledKey, GraphKey
from nn_data.nemo_rl.megatron_data.options import PackOptions
from nn_data.pack import PackSequences
from nn_data.rows import pad_rows, with_dynamic_row_length

# Every PackShardGraph shares one forward code object, and dynamo caps the graphs per code
# object (recompile_limit, 8 by default); each (T, R, C, rank, ...) key needs its own graph,
# so the compiled calls lift the cap to this (never lowering a higher user setting).
_RECOMPILE_LIMIT = 64


class PackedBatch(NamedTuple):
    """Everything one microbatch packs to (the host executor and the compiled graph alike). ``*_packed`` are
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


class PackShardGraph(nn.Module):
    """Pack ``input_ids`` and its companions with one layout and take this rank's zigzag places.

    ``forward(input_ids [B, S], seq_lengths [B] int64, num_rows=None, mtp_loss_mask [B, S]=None,
    routed_experts [B, S, layers, topk]=None, token_identity [B, S, 3]=None,
    media_token_validity_mask [B, S]=None) -> PackedBatch``.
    The layout and this rank's places are computed once and applied to every tensor (one
    scatter/gather to pack, one ``index_select`` to shard). Pad positions hold 0, except routed
    experts, whose pad rows are ``arange(topk)`` (a valid top-k route). No host sync: ``T`` is in
    the key, data checks are the plan's (the compat layer plans on the host first).
    """

    def __init__(self, key: GraphKey):
        super().__init__()
        self.key = key
        self.pack = PackSequences(key.m, key.p, key.total, validate=False)

    def forward(self, input_ids, seq_lengths, num_rows=None, mtp_loss_mask=None, routed_experts=None,
                token_identity=None, media_token_validity_mask=None) -> PackedBatch:
        res = self.pack(input_ids, seq_lengths, num_rows)
        cp_size = self.key.cp_size
        source = None
        if cp_size > 1:  # [T/C]: the packed position of each of this rank's tokens, for every tensor
            source = res.layout.local_places(cp_size, self.key.cp_rank).source

        def both(x, fill=0):
            if x is None:
                return None, None
            packed = x if fill is None else res.layout.pack(x, fill=fill)  # [1, T, *]
            return packed, packed if source is None else packed.index_select(1, source)  # [1, T/C, *]

        topk_route = None
        if routed_experts is not None:
            topk_route = torch.arange(routed_experts.shape[-1], device=routed_experts.device,
                                      dtype=routed_experts.dtype)  # [topk], broadcast over layers
        return PackedBatch(*both(res.packed, None), res.cu_seqlens, res.cu_seqlens_padded,
                           *both(mtp_loss_mask), *both(routed_experts, topk_route), *both(token_identity),
                           *both(media_token_validity_mask))


_COMPILED: dict = {}


def compiled_graph(key: GraphKey, options: PackOptions):
    """The compiled :class:`PackShardGraph` for ``key`` and these compile options (cached)."""
    cache_key = CompiledKey(key, id(options.backend), options.mode)
    fn = _COMPILED.get(cache_key)
    if fn is None:
        kwargs = {"mode": options.mode} if options.mode else {}
        fn = torch.compile(PackShardGraph(key), backend=options.backend, fullgraph=True, **kwargs)
        _COMPILED[cache_key] = fn
    return fn


def reset_compiled() -> None:
    """Forget every compiled pack graph (call with ``torch._dynamo.reset()``)."""
    _COMPILED.clear()


def run_graph(key: GraphKey, options: PackOptions, input_ids, lengths, extras: dict) -> PackedBatch:
    """Run the compiled graph for ``key`` on the batch padded to the row capacity; the packed and local
    tensors come back (the boundaries are the plan's)."""
    rows = input_ids.shape[0]
    capacity = options.row_capacity or (1 << max(0, (rows - 1).bit_length()))
    _checks.check_row_capacity(rows, capacity, "row_capacity", "cfg['nn_data']['row_capacity']")
    num_rows = torch.full((), rows, dtype=torch.int64, device=input_ids.device)  # on the device: no H2D copy
    padded = {k: _row_pad(v, capacity) for k, v in extras.items() if v is not None}
    fn = compiled_graph(key, options)
    limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=limit):
        return fn(_row_pad(input_ids, capacity), pad_rows(lengths, capacity), num_rows, **padded)


def _row_pad(x: torch.Tensor, capacity: int) -> torch.Tensor:
    """Empty rows up to ``capacity``; the row length is a symbolic size so every ``S`` (0 and 1
    included) reuses the graph."""
    return with_dynamic_row_length(pad_rows(x.contiguous(), capacity))  # [R, S, *]
