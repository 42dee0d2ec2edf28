"""The drop-in's one packing call: lay the microbatch out on the host, then the host executor or the compiled graph.

Shape legend
    B   sequences of the microbatch; S padded row length of the input batch
    T   packed tokens (the fixed packed length, a bucket, or the natural total rounded up to ``p``)
    C   context-parallel size; the local shard is ``T/C`` tokens
    *   trailing dims (routed experts ``[layers, topk]``, token identity ``[3]``)

The lengths are read to the host once (docs/design.md, "Sync budget"); eagerly the host executor packs every
tensor (:func:`nn_data.pack.pack_shard`), with ``PackOptions(compile=True)`` one compiled graph
(:mod:`nn_data.nemo_rl.megatron_data.graph`). This is the one place that decides which runs."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from nn_data import PackLayout
from nn_data.layout import layout_from_lengths
from nn_data.extension import checks, layout_checks, layout_from_read_lengths, pack_shard
from nn_data.nemo_rl.assertions import PackingAssertionError, spelled
from nn_data.nemo_rl.megatron_data.graph import ROUTES, run_graph
from nn_data.nemo_rl.megatron_data.options import DropInSpec, PackOptions, bucket_total

EXTRAS = ("mtp_loss_mask", "routed_experts", "token_identity", "media_token_validity_mask")
#: Why this door never packs a shared-prefix microbatch (it has no group ids to share a prompt by).
END_TO_END = ("this call packs rollouts end to end, so with PackOptions.shared_prefix / rollout_tree (cfg['nn_data']"
              "['shared_prefix'] / ['rollout_tree']) it would repeat every shared prefix; process_microbatch (and the "
              "microbatch iterators) pack such a microbatch from its batch's tree fields: call those, or unset the key")


class PackedMicrobatch(NamedTuple):
    """One packed microbatch: its host ``layout`` and, by name, every tensor packed, ``full [1, T, *]`` and this rank's
    ``local [1, T/C, *]`` (the same tensors when ``C = 1``)."""

    layout: PackLayout
    full: dict
    local: dict


def as_lengths(seq_lengths, rows: int, device, like: str = "input_ids") -> torch.Tensor:
    """``seq_lengths`` (a tensor, list, tuple or numpy array of ints) as a ``[B]`` int64 tensor on ``device`` (no sync);
    non-integers and lengths on ``meta`` raise :class:`PackingError`."""
    seq_lengths = checks.as_int_vector("seq_lengths", seq_lengths, rows)
    return on_device("seq_lengths", seq_lengths, like, device).to(dtype=torch.int64)


def on_device(name: str, t: torch.Tensor, like: str, device) -> torch.Tensor:
    """``t`` on ``device`` (the device of the tensor ``like`` names); a ``meta`` tensor on one side only has no values
    to copy and raises :class:`PackingError`.

    Example: lengths on ``meta``, ids on ``cpu`` -> "seq_lengths is on meta but input_ids is on cpu"."""
    device = torch.device(device)
    if t.device != device and "meta" in (t.device.type, device.type):
        raise PackingAssertionError(f"{name} is on {t.device} but {like} is on {device}; a meta tensor has no values "
                                    f"to copy: pass {name} with its values (on {device} or any device but meta)")
    return t.to(device)


def check_extras(input_ids: torch.Tensor, extras: dict) -> None:
    """Every tensor riding the tokens' layout must be ``[B, S, *]`` like ``input_ids``, on its device
    (checked before any compiled region, so a mismatch raises :class:`PackingError`)."""
    for name, value in extras.items():
        if value is None:
            continue
        checks.check_min_dims(name, value, 2, "[B, S, *]")
        if tuple(value.shape[:2]) != tuple(input_ids.shape[:2]):
            raise PackingAssertionError(f"{name} has shape {checks.dims(value)}; it must be [B, S, *] = "
                                        f"[{input_ids.shape[0]}, {input_ids.shape[1]}, *] like input_ids")
        checks.check_same_device(input_ids=input_ids, **{name: value})


def pack_microbatch(input_ids, seq_lengths, *, spec: DropInSpec, cp_rank: int, options: PackOptions,
                    extras: dict, name: str = "pad_full_seq_to") -> PackedMicrobatch:
    """Lay out (one sync) and pack ``input_ids [B, S]`` plus the ``extras`` (a dict over :data:`EXTRAS`) for this rank.

    Padding is 0, except routed experts' ``arange(topk)``; every shape and device is checked here, before any compiled
    region; ``name`` is the caller's spelling of the fixed packed length (:func:`lay_out`)."""
    if options.tree is not None:  # never packed end to end in its place
        raise PackingAssertionError(END_TO_END)
    unknown = [k for k in extras if k not in EXTRAS]
    if unknown:
        raise PackingAssertionError(f"pack_microbatch packs {EXTRAS} with the ids; got {sorted(unknown)}")
    checks.check_min_dims("input_ids", input_ids, 2, "[B, S]")
    check_extras(input_ids, extras)
    lengths = as_lengths(seq_lengths, input_ids.shape[0], input_ids.device)
    layout = lay_out(lengths, input_ids.shape[1], spec, buckets=options.buckets, name=name)
    if options.compile and layout.total:
        full, local = run_graph(input_ids, lengths, extras, spec=spec, total=layout.total, cp_rank=cp_rank,
                                options=options)
    else:
        full, local = pack_shard(layout, {"input_ids": input_ids, **extras}, cp_size=spec.cp_size, cp_rank=cp_rank,
                                 routes=ROUTES)
    return PackedMicrobatch(layout, full, local)


def lay_out(lengths: torch.Tensor, row_len: int, spec: DropInSpec, *, buckets, name: str) -> PackLayout:
    """The microbatch's host layout (the one read of ``lengths [B]``), ``T`` rounded up to a bucket when ``buckets`` are
    set and no packed length is fixed; errors name the fixed packed length as the caller spelled it (``name``).

    Example: lengths ``[3, 5]``, m 4, buckets ``(16, 32)`` -> natural T 12 -> T 16, cu_seqlens_padded ``[0, 4, 16]``."""
    with spelled(name):
        layout = layout_from_lengths(lengths, row_len, spec, op="_pack_sequences_for_megatron")
        if buckets is not None and spec.fixed_total is None:
            total = bucket_total(layout.total, buckets, spec.p, spec.cp_size)
            if total != layout.total:
                layout = layout_from_read_lengths(layout.host.lengths, lengths, row_len,
                                                  dataclasses.replace(spec, fixed_total=total))
        if layout.on_host:
            layout_checks.segments_host(layout.host.segments, spec.cp_size)  # each splits into 2C zigzag chunks
        return layout
