"""A microbatch at fixed addresses, so that a CUDA graph captured once (data path + model forward) replays
over a whole stream.

Shape legend
    B   real rows of a microbatch (varies, ``<= R``); S' its row length (``<= S``)
    R   row capacity; S the staged row length (the widest row the stream holds)
    T   packed tokens (``pad_full_seq_to``); C context-parallel size, a rank holds ``T/C``

:class:`StagedMicrobatch` allocates once the **rows** the data path reads (filled by
:meth:`StagedMicrobatch.load`, no allocation, no host sync) and the **packed** tensors the model reads
(refreshed by :meth:`StagedMicrobatch.prepare` on the device executor). How to capture and replay:
docs/models.md, "A microbatch for CUDA graphs"."""

from __future__ import annotations


import torch

from nn_data import _checks
from nn_data.errors import PackingError
from nn_data.layout.internal import checks, packed_segments
from nn_data.layout import PackSpec
from nn_data.packed_forward import PackedForward
from nn_data.packed_sides import PackingSide
from nn_data.packed_tree import refuse_tree
from nn_data.targets import next_token_at


class StagedMicrobatch:
    """Fixed-address buffers for one microbatch of ``packing``'s stream, sized by ``(R, T, C)``.

    Args:
        packing: a :class:`~nn_data.PackedForward` with ``pad_full_seq_to`` (T) and ``row_capacity`` (R).
        seq_len: S, the widest row a microbatch may have.
        device: where the buffers live (default: the CPU); ids_dtype: the dtype of the ids.
        validate: keep the data path's data checks as device asserts (no host read either way).

    Raises :class:`PackingError` when ``packing`` has no ``pad_full_seq_to`` or no ``row_capacity``, for a bad
    ``seq_len``; :meth:`load` for a batch that does not fit."""

    def __init__(self, packing: PackedForward, seq_len: int, *, device=None, ids_dtype: torch.dtype = torch.int64,
                 ignore_index: int = -100, validate: bool = True):
        if not isinstance(packing, PackedForward):
            raise PackingError(f"packing must be a PackedForward, got {type(packing).__name__}")
        pack = packing.pack
        if pack.pad_full_seq_to is None or packing.row_capacity is None:
            raise PackingError("StagedMicrobatch needs PackedForward(pad_full_seq_to=T, row_capacity=R): fixed "
                               f"shapes (got pad_full_seq_to={pack.pad_full_seq_to}, "
                               f"row_capacity={packing.row_capacity})")
        self.packing = packing
        self.rows, self.total = packing.row_capacity, pack.pad_full_seq_to
        self.seq_len = _checks.row_length("seq_len", seq_len)
        self.cp_size, self.cp_rank = packing.cp_size, packing.cp_rank
        self.ignore_index, self.validate = int(ignore_index), bool(validate)
        device = torch.device("cpu") if device is None else torch.device(device)
        spec = PackSpec(pack.m, pack.p, fixed_total=self.total)
        self._side = PackingSide(spec, self.cp_size, self.cp_rank, validate=validate, host_reads=False)
        r, local = self.rows, self.total // self.cp_size
        self.rows_ids = torch.zeros(r, self.seq_len, dtype=ids_dtype, device=device)  # [R, S]
        self.rows_lengths = torch.zeros(r, dtype=torch.int64, device=device)  # [R]
        self.num_rows = torch.zeros((), dtype=torch.int64, device=device)
        self.row_width = torch.full((), self.seq_len, dtype=torch.int64, device=device)  # S' of the rows loaded
        self.targets = torch.full((1, local), self.ignore_index, dtype=torch.int64, device=device)  # [1, T/C]
        # the packed tensors: the runtime's own results for the empty microbatch, kept as the staged tensors
        side = self._side(self.rows_ids, self.rows_lengths, self.num_rows)
        info = side.packed
        self.input_ids, self.position_ids = side.input_ids, side.position_ids  # [1, T/C] each
        self.padding_mask, self.query_index = info.padding_mask, info.query_index  # [1, T/C], [T/C]
        self.cu_seqlens_padded, self.max_seqlen = info.cu_seqlens_padded, info.max_seqlen  # [R+1], 0-d
        self.segment_ids = info.segment_ids  # [T]
        self.info = info.finished(gather=self._gather(), packed_seq_params=self._packed_seq_params())

    # -- the rows -----------------------------------------------------------------------------------------

    def load(self, input_ids: torch.Tensor, seq_lengths: torch.Tensor, **tree) -> "StagedMicrobatch":
        """Copy ``input_ids [B, S']`` and ``seq_lengths [B]`` (``B <= R``, ``S' <= S``) into the staged rows, zeroing the
        rest, by ``copy_``/``zero_``/``fill_`` on views (nothing allocated or read). ``S'`` is staged too
        (``row_width``): with ``validate`` every length must fit the rows *loaded*. A tree's keywords are refused by
        name: a tree's branching token has one next-token target per child."""
        refuse_tree("StagedMicrobatch.load", tree, "the staged targets [1, T/C] hold one next token per packed "
                    "position, and a tree's branching token has one per child; run it through "
                    "PackedForward.prepare with TreeLogProbs (docs/ops.md, \"Rollout trees\")")
        _checks.check_min_dims("input_ids", input_ids, 2, "[B, S]")
        if input_ids.dim() != 2:
            raise PackingError(f"input_ids must be [B, S], got {_checks.dims(input_ids)}")
        rows, width = input_ids.shape
        _checks.check_int_vector("seq_lengths", seq_lengths, rows)
        _checks.check_row_capacity(rows, self.rows, "row_capacity")
        if width > self.seq_len:
            raise PackingError(f"input_ids has rows of {width} tokens; this StagedMicrobatch holds rows of at "
                               f"most seq_len={self.seq_len}")
        _checks.check_same_device(input_ids=input_ids, seq_lengths=seq_lengths, staged=self.rows_ids)
        self.rows_ids[:rows, :width].copy_(input_ids)
        self.rows_ids[:rows, width:].zero_()
        self.rows_ids[rows:].zero_()
        self.rows_lengths[:rows].copy_(seq_lengths)
        self.rows_lengths[rows:].zero_()
        self.num_rows.fill_(rows)
        self.row_width.fill_(width)
        return self

    def load_rows(self, rows_ids: torch.Tensor, rows_lengths: torch.Tensor, num_rows: torch.Tensor) -> "StagedMicrobatch":
        """Copy a microbatch already padded to the row capacity (``rows_ids [R, S]``, ``rows_lengths [R]``, ``num_rows``
        0-d: :func:`nn_data.pad_to_row_capacity`'s result, or a loader's static buffers) into the staged rows."""
        for name, value, buffer in (("rows_ids", rows_ids, self.rows_ids), ("rows_lengths", rows_lengths,
                                                                             self.rows_lengths),
                                    ("num_rows", num_rows, self.num_rows)):
            if tuple(value.shape) != tuple(buffer.shape):
                raise PackingError(f"{name} has shape {_checks.dims(value)}; the staged {name} is {_checks.dims(buffer)}")
            buffer.copy_(value)
        self.row_width.fill_(self.seq_len)
        return self

    # -- the packed tensors -----------------------------------------------------------------------------

    def prepare(self) -> "StagedMicrobatch":
        """The data path on the staged rows into the staged packed tensors (pack, places, position ids, targets,
        padding mask, boundaries): no host read, fixed shapes, what a CUDA graph captures ahead of the model."""
        if self.validate:
            checks.lengths_device("StagedMicrobatch.prepare", self.rows_lengths, self.row_width, None,
                           row_len_name="the rows loaded: input_ids.shape[1] of load")
        side = self._side(self.rows_ids, self.rows_lengths, self.num_rows)
        info = side.packed
        segments = packed_segments(info.bounds.cu_seqlens, info.cu_seqlens_padded, self.total)
        token, has_target = next_token_at(side.packed_ids[0], segments, side.places, self.total)  # [T/C] each
        self.copy_(input_ids=side.input_ids, position_ids=side.position_ids,
                   targets=torch.where(has_target, token, self.ignore_index).unsqueeze(0),
                   padding_mask=info.padding_mask, cu_seqlens_padded=info.cu_seqlens_padded,
                   segment_ids=info.segment_ids, query_index=info.query_index, max_seqlen=info.max_seqlen)
        return self

    def copy_(self, **values: torch.Tensor) -> "StagedMicrobatch":
        """Copy tensors of the right shapes into the staged packed tensors of those names (``input_ids``,
        ``position_ids``, ``targets``, ``padding_mask``, ``cu_seqlens_padded``, ``segment_ids``,
        ``query_index``, ``max_seqlen``); ``PackedSeqParams.seq_idx`` follows the boundaries where the
        release has it. Raises :class:`PackingError` for an unknown name or another shape."""
        for name, value in values.items():
            if name not in STAGED:
                raise PackingError(f"StagedMicrobatch stages {STAGED}; got {name!r}")
            buffer = getattr(self, name)
            if tuple(value.shape) != tuple(buffer.shape):
                raise PackingError(f"{name} has shape {_checks.dims(value)}; the staged {name} is "
                                   f"{_checks.dims(buffer)} (R={self.rows}, T={self.total}, C={self.cp_size})")
            buffer.copy_(value)
        if "cu_seqlens_padded" in values and self._seq_idx is not None:
            from nn_data.megatron_parallel import sequence_index

            self._seq_idx.copy_(sequence_index(self.cu_seqlens_padded, self.total // self.cp_size, self.total))
        return self

    def addresses(self) -> dict:
        """``{name: data_ptr}`` of every staged tensor (rows and packed): the same on every microbatch."""
        return {name: getattr(self, name).data_ptr() for name in ("rows_ids", "rows_lengths", "num_rows", "row_width",
                                                              *STAGED)}

    # -- what the model gets ----------------------------------------------------------------------------

    def forward(self):
        """``packing.model`` on the staged tensors: ``model(input_ids, position_ids, info)`` ->
        ``[1, T/C, *]`` (the call a graph captures after :meth:`prepare`)."""
        return self.packing.model(self.input_ids, self.position_ids, self.info)

    def _gather(self):
        if self.cp_size == 1:
            return None
        gather_kv, bounds = self.packing.gather_kv, self.cu_seqlens_padded

        def gather(local: torch.Tensor) -> torch.Tensor:  # [1, T/C, *] -> [1, T, *] over the staged boundaries
            return gather_kv(local, bounds)

        return gather

    def _packed_seq_params(self):
        """megatron-core's ``PackedSeqParams`` over the staged boundaries (``max_seqlen = T``), when
        ``packing`` makes them; its ``seq_idx`` (0.17 and newer) is refreshed in place by :meth:`copy_`."""
        self._seq_idx = None
        if not self.packing.make_packed_seq_params:
            return None
        from nn_data.megatron_parallel import make_packed_seq_params

        params = make_packed_seq_params(self.cu_seqlens_padded, self.total, self.total // self.cp_size,
                                        total=self.total, cp_group=self.packing.cp_group)
        self._seq_idx = getattr(params, "seq_idx", None)
        return params


#: The packed tensors a :class:`StagedMicrobatch` stages (besides the rows).
STAGED = ("input_ids", "position_ids", "targets", "padding_mask", "cu_seqlens_padded", "segment_ids", "query_index",
          "max_seqlen")
