"""The drop-in's compiled pack + shard graph (the core's :class:`~nn_data.packed_sides.PackingSide`), its cache and
the recompile-limit patch.

Shape legend
    B   sequences of the microbatch; R >= B rows after row-capacity padding
    S   padded row length (an unbacked symbolic size in the graph); T packed tokens
    C   context-parallel size; the local shard is ``T/C`` tokens
    *   trailing dims (routed experts ``[layers, topk]``, token identity ``[3]``)

The microbatch was laid out on the host before (:mod:`nn_data.nemo_rl.megatron_data.dispatch`), so the graph runs
the device executor with no sync; padded to a row capacity with a symbolic ``S``, a stream of microbatches reuses
one graph per ``(T, R)``."""

from __future__ import annotations

import torch

from nn_data.layout import PackSpec
from nn_data import with_dynamic_row_length
from nn_data.extension import checks, PackingSide
from nn_data.nemo_rl.megatron_data.options import PackOptions
from nn_data import pad_rows

# Every PackingSide shares one forward code object, and dynamo caps the graphs per code object
# (recompile_limit, 8 by default); each (T, R, C, rank, ...) needs its own graph, so the compiled
# calls lift the cap to this (never lowering a higher user setting).
_RECOMPILE_LIMIT = 64

#: What every compat graph packs besides the ids; ``routed_experts``' padding rows are ``arange(topk)``.
ROUTES = ("routed_experts",)

_COMPILED: dict = {}


def compiled_pack_shard(spec: PackSpec, total: int, cp_rank: int, options: PackOptions):
    """The compiled :class:`~nn_data.packed_sides.PackingSide` for this configuration, ``T`` and rank (cached)."""
    key = (spec.m, spec.p, total, spec.cp_size, cp_rank, options.backend, options.mode)
    fn = _COMPILED.get(key)
    if fn is None:
        module = PackingSide(PackSpec(spec.m, spec.p, fixed_total=total), spec.cp_size, cp_rank, routes=ROUTES,
                             validate=False, host_reads=False)
        kwargs = {"mode": options.mode} if options.mode else {}
        fn = torch.compile(module, backend=options.backend, fullgraph=True, **kwargs)
        _COMPILED[key] = fn
    return fn


def reset_compiled() -> None:
    """Forget every compiled pack graph (call with ``torch._dynamo.reset()``)."""
    _COMPILED.clear()


def run_graph(input_ids, lengths, extras: dict, *, spec: PackSpec, total: int, cp_rank: int,
              options: PackOptions) -> tuple[dict, dict]:
    """``(full, local)`` of the compiled graph for the batch padded to the row capacity."""
    ids, lengths, num_rows = row_padded(input_ids, lengths, options)
    padded = {k: _row_pad(v, ids.shape[0]) for k, v in extras.items() if v is not None}
    fn = compiled_pack_shard(spec, total, cp_rank, options)
    limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=limit):
        out = fn(ids, lengths, num_rows, **padded)
    return as_dicts(out)


def row_padded(input_ids, lengths, options: PackOptions) -> tuple:
    """``(ids [R, S], lengths [R], num_rows)`` for a compiled graph: empty rows up to ``options.row_capacity``
    (else the next power of two >= B), ``S`` symbolic, ``num_rows`` the real row count on the device.

    Example: 3 rows, no ``row_capacity`` -> R 4; ``row_capacity=2`` -> :class:`PackingError`."""
    rows = input_ids.shape[0]
    capacity = options.row_capacity or (1 << max(0, (rows - 1).bit_length()))
    checks.check_row_capacity(rows, capacity, "row_capacity", "cfg['nn_data']['row_capacity']")
    num_rows = torch.full((), rows, dtype=torch.int64, device=input_ids.device)  # on the device: no H2D copy
    return _row_pad(input_ids, capacity), pad_rows(lengths, capacity), num_rows


def as_dicts(out) -> tuple[dict, dict]:
    """``(full, local)`` by NeMo-RL's names from a :class:`~nn_data.packed_sides.PackedSide`."""
    full = {"input_ids": out.packed_ids, **{name: s.full for name, s in out.companions.items()}}
    local = {"input_ids": out.input_ids, **{name: s.local for name, s in out.companions.items()}}
    return full, local


def _row_pad(x: torch.Tensor, capacity: int) -> torch.Tensor:
    """Empty rows up to ``capacity``; the row length symbolic so every ``S`` reuses the graph."""
    return with_dynamic_row_length(pad_rows(x.contiguous(), capacity))  # [R, S, *]
