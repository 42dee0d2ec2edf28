"""The pack path behind the NeMo-RL-compatible layer: plan with one host sync, then one graph.

Shape legend
    B   sequences of the microbatch; R >= B rows after row-capacity padding (compiled path)
    S   padded row length of the input batch
    T   packed tokens (``pad_full_seq_to``, a bucket, or the natural total rounded up to ``p``)
    C   context-parallel size; the local shard is ``T/C`` tokens
    *   trailing dims (routed experts ``[layers, topk]``, token identity ``[3]``)

Eagerly (the default), :mod:`~nn_data.megatron_data.host_pack` brings the lengths themselves
to the host in the microbatch's **one** sync, plans every boundary in Python ints and moves
the data with a constant number of ops (split and cat of views; no index map). Compiled, a
microbatch goes through two steps:

1. :func:`plan_pack` brings a few statistics of ``seq_lengths`` to the host in **one**
   sync. They validate the batch (lengths in ``[0, S]``, a packed total that fits
   ``pad_full_seq_to``, segments divisible by ``2C``) and give the two Python ints
   that must be Python ints: ``T`` (an output shape when ``pad_full_seq_to`` is unset)
   and ``max_seqlen`` (``PackedSeqParams`` wants an int).
2. :class:`PackShardGraph` packs ``input_ids`` and every tensor that rides the same
   layout (``mtp_loss_mask``, ``routed_experts``, R3 token identities), and zigzag-shards
   them for CP, with the core ops and no further sync, compiled
   (:class:`PackOptions` ``compile=True``): the batch is padded with empty rows to a fixed
   row capacity and ``S`` is a symbolic size (unbacked: ``S = 0`` and ``1`` too), so a stream
   of microbatches with other lengths, row counts and ``S`` reuses one compiled graph per
   ``(T, R)``. Every shape, dtype and device check runs before the compiled call and raises
   :class:`PackingError` as in eager mode.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from nn_data import _checks
from nn_data._index import exclusive_cumsum, round_up
from nn_data.errors import PackingError
from nn_data.megatron_data import host_pack
from nn_data.megatron_data.host_pack import PackedBatch
from nn_data.megatron_data.scope import current_scope
from nn_data.pack import PackSequences
from nn_data.planning.alignment import ParallelLayout
from nn_data.rows import pad_rows, with_dynamic_row_length

# Every PackShardGraph shares one forward code object, and dynamo caps the graphs per code
# object (recompile_limit, 8 by default); each (T, R, C, rank, ...) key needs its own graph,
# so the compiled calls lift the cap to this (never lowering a higher user setting).
_RECOMPILE_LIMIT = 64


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """nn_data-only switches of the pack path (NeMo-RL has no equivalent).

    ``compile``: run packing + CP sharding through ``torch.compile(fullgraph=True)``.
        The batch is padded with empty rows to ``row_capacity`` rows (default: the next
        power of two >= B, so at most log2(B_max) graphs) and the row length ``S`` is an
        unbacked symbolic size (``S = 0`` and ``1`` included). With ``pad_full_seq_to`` set
        (PP > 1) and a fixed ``row_capacity`` a whole stream compiles once.
    ``row_capacity``: fixed row count ``R`` the compiled graph sees; a microbatch with
        more rows raises :class:`PackingError`.
    ``buckets``: only used when ``pad_full_seq_to`` is None (PP = 1). The packed length
        ``T`` is rounded up to the smallest bucket that holds it (the last sequence's
        segment absorbs the slack, exactly as with ``pad_full_seq_to``), so at most
        ``len(buckets)`` distinct shapes occur. A sorted tuple of ints (each a multiple of
        ``pad_packed_seq_to_multiple_of`` and, under CP, of ``2 * cp_size``) or ``"pow2"``
        (``unit * 2**k``, ``unit = lcm(p, 2C)``). Note that ``T`` then differs from what
        NeMo-RL would produce (it is larger); the valid tokens and their offsets do not.
    ``backend``/``mode``: passed to ``torch.compile`` (tests pass a compile counter).
    ``pad_full_seq_to``: a run-level packed length, in place of the call's (:meth:`packed_length`),
        so every microbatch of the run has one shape (one graph; fixed PP receive buffers). Not
        with ``buckets``.

    Built from a config with :meth:`from_cfg` (``cfg["nn_data"]``, see the README).
    """

    compile: bool = False
    row_capacity: Optional[int] = None
    buckets: Optional[Union[tuple, str]] = None
    backend: Any = "inductor"
    mode: Optional[str] = None
    pad_full_seq_to: Optional[int] = None

    def __post_init__(self):
        _checks.positive_int("row_capacity", self.row_capacity, allow_none=True)
        _checks.positive_int("pad_full_seq_to", self.pad_full_seq_to, allow_none=True)
        if self.pad_full_seq_to is not None and self.buckets is not None:
            raise PackingError(f"pad_full_seq_to={self.pad_full_seq_to} and buckets={self.buckets!r} cannot both be "
                               "set: buckets only choose T when there is no fixed packed length; drop one")
        b = self.buckets
        if b is None or b == "pow2":
            return
        if isinstance(b, str) or not isinstance(b, Sequence) or not b:
            raise PackingError(f"buckets={b!r} is invalid; expected None, 'pow2' or a non-empty list of ints")
        for v in b:
            _checks.check_int32("buckets entry", _checks.positive_int("buckets entry", v))
        object.__setattr__(self, "buckets", tuple(sorted(set(b))))

    def packed_length(self, given: Optional[int], name: str = "pad_full_seq_to") -> Optional[int]:
        """The run-level ``pad_full_seq_to`` when set (a ``given`` above it raises), else ``given``.
        Example: run-level 8192, given 6144 (a step's longest bin) or None -> 8192."""
        run = self.pad_full_seq_to
        if run is None:
            return given
        if given is not None and given > run:
            raise PackingError(f"{name}={given} exceeds the run-level packed length pad_full_seq_to={run} "
                               f"(cfg['nn_data']['pad_full_seq_to'] or PackOptions); raise it to at least {given}")
        return run

    @classmethod
    def from_cfg(cls, cfg: Optional[dict]) -> "PackOptions":
        """``PackOptions(**cfg["nn_data"])`` minus ``device`` (the iterators' key); defaults when absent."""
        section = dict((cfg or {}).get("nn_data") or {})
        section.pop("device", None)
        unknown = set(section) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise PackingError(f"cfg['nn_data'] has unknown keys {sorted(unknown)}; valid keys are "
                               f"{sorted(f.name for f in dataclasses.fields(cls))} and 'device'")
        return cls(**section)


class PackPlan(NamedTuple):
    """Host-side facts of one microbatch: packed length ``total`` (T), ``max_seqlen`` and
    ``valid_total = sum(seq_lengths)`` (``valid_total != T`` means padding sits between or
    after the sequences)."""

    total: int
    max_seqlen: int
    valid_total: int = 0


@dataclasses.dataclass(frozen=True)
class PackConfig:
    """The packing configuration of one call, checked once (no data read).

    ``m`` / ``p``: ``pad_individual_seqs_to_multiple_of`` / ``pad_packed_seq_to_multiple_of``;
    ``pad_full_seq_to``: the constant ``T`` or None; ``cp_size``, ``cp_rank``: the CP split.
    ``total_name`` is how the caller spelled the constant-``T`` argument (NeMo-RL's
    ``_pack_sequences_for_megatron`` calls it ``pad_packed_seq_to``, ``process_microbatch``
    ``pad_full_seq_to``), so every message names the argument the caller passed.
    """

    m: int
    p: int
    pad_full_seq_to: Optional[int]
    cp_size: int
    cp_rank: int
    total_name: str = "pad_full_seq_to"

    def __post_init__(self):
        _checks.positive_int("pad_individual_seqs_to_multiple_of", self.m)
        _checks.positive_int("pad_packed_seq_to_multiple_of", self.p)
        _checks.check_int32(self.total_name, _checks.positive_int(self.total_name, self.pad_full_seq_to, allow_none=True))
        _checks.check_cp(self.cp_size, self.cp_rank)
        if self.pad_full_seq_to is not None and self.pad_full_seq_to % self.p:
            raise PackingError(
                f"{self.total_name}={self.pad_full_seq_to} is not a multiple of "
                f"pad_packed_seq_to_multiple_of={self.p}; choose a multiple of {self.p}"
            )

    def graph_key(self, total: int) -> "GraphKey":
        return GraphKey(self.m, self.p, total, self.cp_size, self.cp_rank)


class GraphKey(NamedTuple):
    """What one pack graph is built for: the multiples, the packed length ``T`` and the CP split."""

    m: int
    p: int
    total: int
    cp_size: int
    cp_rank: int


def plan_pack(lengths, row_len: int, config: PackConfig, buckets=None) -> PackPlan:
    """Validate ``lengths [B]`` (int64) and choose ``T`` and ``max_seqlen``: one host sync.

    Example: lengths ``[8, 5, 7]``, m 4, p 1, no ``pad_full_seq_to`` -> padded ``[8, 8, 8]``,
    T 24, max_seqlen 8. With ``pad_full_seq_to=40`` the last segment is ``40 - 16 = 24`` long
    and max_seqlen is 24.
    """
    m, p, fixed, cp_size = config.m, config.p, config.pad_full_seq_to, config.cp_size
    rows, two_c = lengths.shape[0], 2 * cp_size
    if rows == 0:  # the packed tensor is one padding pseudo-segment [0, T], as in the core op
        total = fixed if fixed is not None else _bucket(0, p, cp_size, buckets)
        return PackPlan(total, total, 0)
    padded = round_up(lengths, m)  # [B]
    zero = padded.new_zeros(())
    nonlast = padded[:-1]  # [B-1]
    bad_nonlast = (nonlast % two_c != 0).sum() if cp_size > 1 and rows > 1 else zero
    stats = torch.stack([lengths.min(), lengths.max(), padded.sum(),
                         nonlast.max() if rows > 1 else zero, nonlast.sum(), bad_nonlast, lengths.sum()])
    lo, hi, natural, max_nonlast, last_start, bad, valid = stats.tolist()  # sync: the one per microbatch
    if lo < 0 or hi > row_len:
        _checks.raise_length_outside((lengths < 0) | (lengths > row_len), lengths, row_len)
    if fixed is not None:
        if natural > fixed:
            raise PackingError(
                f"the packed total sum(round_up(seq_lengths, {m})) = {natural} exceeds {config.total_name}="
                f"{fixed}; raise it to at least {natural} (NeMo-RL silently truncates the "
                "packed tensor here and drops the tail tokens)"
            )
        total = fixed
    else:
        total = _bucket(round_up(natural, p), p, cp_size, buckets)
        if total > _checks.INT32_MAX:
            raise PackingError(_checks.int32_limit(f"the packed total {total} of seq_lengths (sum(round_up("
                                                   f"seq_lengths, {m})) = {natural}, rounded up to {p})"))
    last = total - last_start
    if cp_size > 1 and (bad or last % two_c):
        padded_all = torch.cat([nonlast, torch.full((1,), last, dtype=nonlast.dtype, device=nonlast.device)])
        _checks.raise_first(padded_all % two_c != 0, padded_all, _checks.segment_not_divisible(two_c))
    return PackPlan(total, max(max_nonlast, last), valid)


def _bucket(natural: int, p: int, cp_size: int, buckets) -> int:
    """The packed length for a natural total (already a multiple of ``p``) under ``buckets``.

    Example: natural 40, buckets ``(64, 128)`` -> 64; ``"pow2"`` with p 8, C 1 -> 8 * 2**3 = 64.
    """
    if buckets is None:
        return natural
    unit = math.lcm(p, ParallelLayout(dp=1, cp=cp_size).sequence_multiple)  # 2C under CP: the alignment rule
    if buckets == "pow2":
        return unit * (1 << max(0, math.ceil(math.log2(max(natural, 1) / unit))))
    bad = [b for b in buckets if b % unit]
    if bad:
        raise PackingError(f"bucket {bad[0]} is not a multiple of {unit} (lcm of pad_packed_seq_to_multiple_of"
                           f"={p} and 2*cp_size); every bucket must be one")
    for b in buckets:
        if b >= natural:
            return b
    raise PackingError(f"the packed total {natural} exceeds the largest bucket {buckets[-1]}; "
                       f"add a bucket of at least {natural}")


class PackShardGraph(nn.Module):
    """Pack ``input_ids`` and its companions with one layout and take this rank's zigzag places.

    ``forward(input_ids [B, S], seq_lengths [B] int64, num_rows=None, mtp_loss_mask [B, S]=None,
    routed_experts [B, S, layers, topk]=None, token_identity [B, S, 3]=None,
    media_token_validity_mask [B, S]=None) -> PackedBatch``.
    The layout and this rank's places are computed once and applied to every tensor (one
    scatter/gather to pack, one ``index_select`` to shard). Pad positions hold 0, except routed
    experts, whose pad rows are ``arange(topk)`` (a valid top-k route). No host sync: ``T`` is in
    the key, data checks are :func:`plan_pack`'s.
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


@functools.lru_cache(maxsize=256)
def _eager_graph(key: GraphKey) -> PackShardGraph:
    return PackShardGraph(key)


class _CompiledKey(NamedTuple):
    graph: GraphKey
    backend_id: int  # id() of the backend object: a compile counter and "inductor" compile apart
    mode: Optional[str]


_COMPILED: dict = {}


def _compiled_graph(key: GraphKey, options: PackOptions):
    cache_key = _CompiledKey(key, id(options.backend), options.mode)
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
    """Run the eager or the compiled graph for ``key``; slice row padding off."""
    if key.total == 0:
        return _empty_batch(input_ids, lengths, extras)
    if not options.compile:
        return _eager_graph(key)(input_ids, lengths, None, **extras)
    rows = input_ids.shape[0]
    capacity = options.row_capacity or (1 << max(0, (rows - 1).bit_length()))
    if rows > capacity:
        raise PackingError(f"the microbatch has {rows} sequences, more than row_capacity={capacity}; "
                           f"raise cfg['nn_data']['row_capacity'] to at least {rows}")
    num_rows = torch.full((), rows, dtype=torch.int64, device=input_ids.device)  # on the device: no H2D copy
    padded = {k: _row_pad(v, capacity) for k, v in extras.items() if v is not None}
    fn = _compiled_graph(key, options)
    limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=limit):
        out = fn(_row_pad(input_ids, capacity), pad_rows(lengths, capacity), num_rows, **padded)
    # The real rows' boundaries; the padding rows' collapse onto T. With no row (B = 0) that is
    # [T], as in eager mode (the last entry, not the first: the first is 0).
    cu_pad = out.cu_seqlens_padded[: rows + 1] if rows else out.cu_seqlens_padded[-1:]
    return out._replace(cu_seqlens=out.cu_seqlens[: rows + 1], cu_seqlens_padded=cu_pad)


def _empty_batch(input_ids, lengths, extras: dict) -> PackedBatch:
    """T = 0 (no sequence, or only empty ones and no padding target): empty packed tensors."""
    def empty(x):
        return None if x is None else x.new_zeros((1, 0, *x.shape[2:]))

    cu = exclusive_cumsum(lengths).to(torch.int32)  # [B+1], all zeros
    e = {k: empty(v) for k, v in extras.items()}
    ids = empty(input_ids)
    return PackedBatch(ids, ids, cu, cu.clone(), e.get("mtp_loss_mask"), e.get("mtp_loss_mask"),
                       e.get("routed_experts"), e.get("routed_experts"), e.get("token_identity"),
                       e.get("token_identity"), e.get("media_token_validity_mask"),
                       e.get("media_token_validity_mask"))


def _row_pad(x: torch.Tensor, capacity: int) -> torch.Tensor:
    """Empty rows up to ``capacity``; the row length is a symbolic size so every ``S`` (0 and 1
    included) reuses the graph."""
    return with_dynamic_row_length(pad_rows(x.contiguous(), capacity))  # [R, S, *]


def as_lengths(seq_lengths, rows: int, device, like: str = "input_ids") -> torch.Tensor:
    """``seq_lengths`` (a tensor, list, tuple or numpy array of ints) as a ``[B]`` int64 tensor on
    ``device`` (no sync). Non-integers (``[1.5, 2, 3]``, a float tensor) raise :class:`PackingError`,
    so do lengths on a device they cannot be copied from (:func:`on_device`)."""
    seq_lengths = _checks.as_int_vector("seq_lengths", seq_lengths, rows)
    return on_device("seq_lengths", seq_lengths, like, device).to(dtype=torch.int64)


def on_device(name: str, t: torch.Tensor, like: str, device) -> torch.Tensor:
    """``t`` on ``device`` (the device of the tensor ``like`` names). As NeMo-RL, which reads them on
    the host, the layer takes boundaries and lengths from any device whose values can be copied; a
    ``meta`` tensor on one side only has no values to copy and raises :class:`PackingError` naming
    both devices. Example: lengths on ``meta``, ids on ``cpu`` -> "seq_lengths is on meta but
    input_ids is on cpu"."""
    device = torch.device(device)
    if t.device != device and "meta" in (t.device.type, device.type):
        raise PackingError(f"{name} is on {t.device} but {like} is on {device}; a meta tensor has no values "
                           f"to copy: pass {name} with its values (on {device} or any device but meta)")
    return t.to(device)


def check_extras(input_ids: torch.Tensor, extras: dict) -> None:
    """Every tensor riding the tokens' layout must be ``[B, S, *]`` like ``input_ids``, on its device
    (checked before any compiled region, so a mismatch raises :class:`PackingError`)."""
    for name, value in extras.items():
        if value is None:
            continue
        _checks.check_min_dims(name, value, 2, "[B, S, *]")
        if tuple(value.shape[:2]) != tuple(input_ids.shape[:2]):
            raise PackingError(f"{name} has shape {_checks.dims(value)}; it must be [B, S, *] = "
                               f"[{input_ids.shape[0]}, {input_ids.shape[1]}, *] like input_ids")
        _checks.check_same_device(input_ids=input_ids, **{name: value})


def pack_microbatch(input_ids, seq_lengths, config: PackConfig, *, options: Optional[PackOptions] = None,
                    **extras) -> tuple[PackedBatch, PackPlan]:
    """Plan (one sync) and pack ``input_ids [B, S]`` plus ``extras`` (``mtp_loss_mask``,
    ``routed_experts``, ``token_identity``, ``media_token_validity_mask``: ``[B, S, *]`` or
    None) for ``config``'s CP rank. Inside a microbatch scope (:mod:`nn_data.megatron_data.scope`)
    a plan made for the same ``seq_lengths`` object and configuration is reused: no sync."""
    options = options or PackOptions()
    _checks.check_min_dims("input_ids", input_ids, 2, "[B, S]")
    check_extras(input_ids, extras)
    lengths = as_lengths(seq_lengths, input_ids.shape[0], input_ids.device)
    rows, row_len = input_ids.shape[:2]
    scope = current_scope()
    if not options.compile:  # eager: the host plans every boundary, a few ops move the data

        def make_host_plan():
            return _plan_on_host(lengths, row_len, config, options.buckets)

        key = ("host plan", id(seq_lengths), rows, row_len, config, options.buckets)
        host = scope.plan(key, seq_lengths, make_host_plan) if scope is not None else make_host_plan()
        out = host_pack.pack_batch(host, input_ids, config.cp_size, config.cp_rank, **extras)
        return PackedBatch(*out), PackPlan(host.total, host.max_seqlen, host.cu[-1])

    def make_plan():
        return plan_pack(lengths, row_len, config, options.buckets)

    key = ("plan", id(seq_lengths), rows, row_len, config, options.buckets)
    plan = scope.plan(key, seq_lengths, make_plan) if scope is not None else make_plan()
    out = run_graph(config.graph_key(plan.total), options, input_ids, lengths, extras)
    return out, plan


def _plan_on_host(lengths, row_len: int, config: PackConfig, buckets) -> host_pack.HostPlan:
    """The eager path's plan (:mod:`nn_data.megatron_data.host_pack`): the lengths come to the host
    in the microbatch's one sync; invalid ones raise :func:`plan_pack`'s precise errors."""
    host = lengths.tolist()  # sync: the one per microbatch (the lengths themselves)

    def total_of(natural: int) -> int:
        return _bucket(round_up(natural, config.p), config.p, config.cp_size, buckets)

    plan = host_pack.plan_on_host(host, row_len, config.m, config.pad_full_seq_to, config.cp_size, total_of)
    if plan is None:  # invalid lengths: plan_pack raises the precise error (error path only)
        plan_pack(lengths, row_len, config, buckets)
        raise PackingError(f"seq_lengths={host} cannot be packed with {config}")
    return plan
