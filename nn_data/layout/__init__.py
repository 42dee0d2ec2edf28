"""The layout of a packed microbatch and its two executors (``docs/design.md``, "Layouts and executors").

This package is the only door to the layout: code outside it imports from ``nn_data.layout`` alone.
Every entry point of nn_data packs, shards, unshards and unpacks through it:

* :class:`PackLayout` (``pack_layout``): one microbatch's layout, with the methods that run it
  (``pack``, ``shard``, ``unshard``, ``unpack``, ``local_places``, ``positions``, ``padding_mask``);
* building one (``build``): :class:`PackSpec` (what a pack is asked for) and
  :func:`layout_from_lengths`; :class:`Boundaries` and :func:`layout_from_boundaries` for an op given
  boundaries; :func:`take_layout` for an op given a layout; :func:`reads_host`, the rule for where a
  layout is built (one host read, or none);
* :class:`RankOp` and :func:`op_layout` (``op``): the base of the ops configured with a CP rank, and
  how an op gets its call's layout;
* :class:`SharedPrefixLayout` and :func:`shared_prefix_layout` (``shared_prefix``): a GRPO group's
  prompt packed once, then its responses: a :class:`PackLayout` over two slots per rollout;
* the layout rules (``rules``, each written once for Python ints and tensors), their checks
  (``checks``, one wording each), the device executor's index maps (``index``), the executors
  (``host``, ``device``); which one runs is ``pack_layout.on_host``.

Old names (0.1.x) still work and warn: ``LayoutSpec`` (:class:`PackSpec`), ``plan_from_lengths``
(:func:`layout_from_lengths`), ``plan_from_boundaries`` (:func:`layout_from_boundaries`); CHANGELOG.md.
"""

from __future__ import annotations

from nn_data.layout.build import (
    Boundaries, PackSpec, layout_from_boundaries, layout_from_lengths, padded_rows, reads_host, take_layout,
)
from nn_data.layout.checks import (
    boundary_args, fixed_total_arg, lengths_device, lengths_host, natural_total_host, packed_tensor_length,
    sequence_divisible, target_ids, target_ids_device, target_ids_host, total_divisible, total_limit_host,
)
from nn_data.layout.device import set_pack_form
from nn_data.layout.index import (
    SegmentRows, Segments, ZigzagLocal, exclusive_cumsum, local_places, packed_segments, padding_at, segment_ids,
    segment_rows, zigzag_source,
)
from nn_data.layout.op import RankOp, op_layout
from nn_data.layout.pack_layout import Fill, HostBounds, PackLayout, pack_with_layout
from nn_data.layout.rules import INT32_MAX, bucket_total, round_up, segment_bounds
from nn_data.layout.shared_prefix import SharedPrefixLayout, shared_prefix_layout
from nn_data.layout._deprecated import __getattr__  # noqa: F401  (the 0.1.x names, with a warning)

__all__ = [
    "INT32_MAX",
    "Boundaries",
    "Fill",
    "HostBounds",
    "PackLayout",
    "PackSpec",
    "RankOp",
    "SegmentRows",
    "SharedPrefixLayout",
    "Segments",
    "ZigzagLocal",
    "boundary_args",
    "bucket_total",
    "exclusive_cumsum",
    "fixed_total_arg",
    "layout_from_boundaries",
    "layout_from_lengths",
    "lengths_device",
    "lengths_host",
    "local_places",
    "op_layout",
    "natural_total_host",
    "pack_with_layout",
    "packed_segments",
    "packed_tensor_length",
    "padding_at",
    "padded_rows",
    "reads_host",
    "round_up",
    "segment_bounds",
    "segment_ids",
    "segment_rows",
    "set_pack_form",
    "shared_prefix_layout",
    "sequence_divisible",
    "take_layout",
    "target_ids",
    "target_ids_device",
    "target_ids_host",
    "total_divisible",
    "total_limit_host",
    "zigzag_source",
]
