"""Wrap a model's forward so it runs on packed, CP-sharded tokens and returns per-sequence rows.

Shape legend
    B   sequences (rows); R >= B with ``row_capacity``
    S   padded row length of the input batch
    T   packed tokens (``pad_full_seq_to`` when set)
    C   context-parallel size; the model sees ``T/C`` local tokens
    *   the model's trailing output dims (vocab ``V`` for logits)

``PackedForward(model, ...)(input_ids [B, S], seq_lengths [B]) -> [B, S, *]``:
pack -> shard for this rank -> position ids + attention metadata -> ``model`` on the
local tokens -> gather across the CP group -> unpack.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from nn_data import _checks
from nn_data.context_parallel import ShardForContextParallel
from nn_data.pack import PackSequences
from nn_data.rows import pad_to_row_capacity
from nn_data.unpack import unpack_sequences


class PackedInfo(NamedTuple):
    """What a wrapped model receives besides its local tokens and position ids.

    ``cu_seqlens_padded [B+1]`` int32 and ``max_seqlen`` (0-d int32) describe the packed
    layout (global, before the CP split); ``segment_ids [T]`` is the sequence of every
    packed position; ``query_index [T/C]`` the packed position of each local token
    (``arange(T)`` without CP); ``cp_size``/``cp_rank`` the split; ``gather`` (None
    without CP) turns a local ``[1, T/C, *]`` tensor into the packed ``[1, T, *]`` (one
    all-gather, autograd-aware: use it for keys and values); ``packed_seq_params`` a
    megatron-core ``PackedSeqParams`` when requested (``max_seqlen_q = T``: the only
    value known without a host sync).
    """

    cu_seqlens_padded: torch.Tensor
    max_seqlen: torch.Tensor
    segment_ids: torch.Tensor
    query_index: torch.Tensor
    cp_size: int
    cp_rank: int
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]]
    packed_seq_params: object = None


class _Prepared(NamedTuple):
    local_ids: torch.Tensor  # [1, T/C]
    position_ids: torch.Tensor  # [1, T/C]
    cu_seqlens_padded: torch.Tensor  # [B+1]
    max_seqlen: torch.Tensor  # 0-d
    segment_ids: torch.Tensor  # [T]
    query_index: torch.Tensor  # [T/C]


class PackedForward(nn.Module):
    """Run ``model`` on packed, context-parallel-sharded tokens; return ``[B, S, *]`` rows.

    ``PackedForward(model, *, pad_individual_seqs_to_multiple_of=1, pad_full_seq_to=None,
    pad_packed_seq_to_multiple_of=1, cp_group=None, row_capacity=None, compile_packing=False,
    make_packed_seq_params=False)``;
    ``forward(input_ids [B, S] int, seq_lengths [B] int, **model_kwargs) -> [B, S, *]`` with
    ``fill 0`` past each row's length.

    The model contract: ``model(input_ids [1, T/C], position_ids [1, T/C], packed: PackedInfo,
    **model_kwargs)`` returns a tensor ``[1, T/C, *]`` for the same local tokens in the same
    order. Position ids restart at 0 at each sequence start and keep counting through a
    segment's padding. Attention must stay inside a segment (``packed.segment_ids``) and be
    causal in packed positions (``packed.query_index``); under CP gather keys and values with
    ``packed.gather``. Outputs at padding positions are ignored.

    With ``cp_group`` (a ``torch.distributed`` process group of size ``C > 1``) each rank
    runs the model on its zigzag shard and the output is gathered to every rank, so every
    rank returns the full ``[B, S, *]``. Segments must then split into ``2C`` chunks:
    choose ``pad_individual_seqs_to_multiple_of`` and ``pad_full_seq_to`` as multiples of
    ``2C``.

    ``compile_packing=True`` compiles the packing side (pack, shard, position ids) and the
    unpacking side with ``fullgraph=True``; with ``pad_full_seq_to`` and ``row_capacity``
    set they compile once for a stream of microbatches of any lengths and row counts
    (rows are padded outside the compiled region). The model is called eagerly; compile it
    yourself if you want (``torch.compile(model)``).

    Raises :class:`~nn_data.errors.PackingError` for bad configuration (as the ops do) and
    when ``input_ids`` is not ``[B, S]``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_individual_seqs_to_multiple_of: int = 1,
        pad_full_seq_to: Optional[int] = None,
        pad_packed_seq_to_multiple_of: int = 1,
        cp_group=None,
        row_capacity: Optional[int] = None,
        compile_packing: bool = False,
        make_packed_seq_params: bool = False,
    ):
        super().__init__()
        self.model = model
        self.cp_size, self.cp_rank = _cp_of(cp_group)
        self.cp_group = cp_group
        self.pack = PackSequences(pad_individual_seqs_to_multiple_of, pad_packed_seq_to_multiple_of, pad_full_seq_to)
        self.shard = ShardForContextParallel(self.cp_size, self.cp_rank)
        self.row_capacity = None if row_capacity is None else _checks.positive_int("row_capacity", row_capacity)
        self.make_packed_seq_params = bool(make_packed_seq_params)
        self._gather = _make_gather(cp_group, self.cp_size)
        self.compile_packing = bool(compile_packing)
        if self.compile_packing:
            self._prepare_fn = torch.compile(self._prepare, fullgraph=True)
            self._finish_fn = torch.compile(unpack_sequences, fullgraph=True)
        else:
            self._prepare_fn, self._finish_fn = self._prepare, unpack_sequences

    def _prepare(self, input_ids, seq_lengths, num_rows) -> _Prepared:
        r = self.pack(input_ids, seq_lengths, num_rows)
        total = r.packed.shape[1]
        cu_pad = r.cu_seqlens_padded
        local_ids = self.shard(r.packed, cu_pad)  # [1, T/C]
        position_ids = self.shard(r.layout.position[None], cu_pad)  # [1, T/C]
        query_index = self.shard(torch.arange(total, device=input_ids.device)[None], cu_pad)[0]  # [T/C]
        return _Prepared(local_ids, position_ids, cu_pad, r.max_seqlen, r.layout.segment, query_index)

    def forward(self, input_ids: torch.Tensor, seq_lengths: torch.Tensor, **model_kwargs) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise _checks.PackingError(f"input_ids must be a [B, S] tensor, got {shape}")
        rows, seq_len = input_ids.shape
        num_rows = None
        if self.row_capacity is not None:
            padded = pad_to_row_capacity(input_ids, seq_lengths, self.row_capacity)
            input_ids, seq_lengths, num_rows = padded
        prep = self._prepare_fn(input_ids, seq_lengths, num_rows)
        gather = None
        if self._gather is not None:
            def gather(local: torch.Tensor, _cu=prep.cu_seqlens_padded) -> torch.Tensor:
                return self._gather(local, _cu)  # [1, T/C, *] -> [1, T, *]
        info = PackedInfo(
            prep.cu_seqlens_padded, prep.max_seqlen, prep.segment_ids, prep.query_index,
            self.cp_size, self.cp_rank, gather, self._packed_seq_params(prep),
        )
        local_out = self.model(prep.local_ids, prep.position_ids, info, **model_kwargs)  # [1, T/C, *]
        full = local_out if gather is None else gather(local_out)  # [1, T, *]
        out = self._finish_fn(full, seq_lengths, prep.cu_seqlens_padded, seq_len)  # [R, S, *]
        return out[:rows]

    def _packed_seq_params(self, prep: _Prepared):
        if not self.make_packed_seq_params:
            return None
        from nn_data.megatron_pack import make_packed_seq_params

        total = prep.segment_ids.shape[0]
        return make_packed_seq_params(prep.cu_seqlens_padded, max_seqlen=total, local_total=total // self.cp_size)


def _cp_of(cp_group) -> tuple[int, int]:
    """``(size, rank)`` of a process group; ``(1, 0)`` without one."""
    if cp_group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(cp_group), dist.get_rank(cp_group)


def _make_gather(cp_group, cp_size: int):
    """``[1, T/C, *] -> [1, T, *]`` across the CP group (None without CP)."""
    if cp_size == 1:
        return None
    from nn_data.cp_comm import GatherFromContextParallel

    return GatherFromContextParallel(cp_group)
