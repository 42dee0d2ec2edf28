"""The layout's second door, for nn_data's own ops, planners, adapters and NeMo-RL drop-in (not for users).

:mod:`nn_data.layout` is the user's door (the layout type, its spec, the builders, the op helper, the
rounding rule). What nn_data's own code needs beyond it comes through here, never from a submodule
(``tests/ops/test_structure.py`` holds both rules): the layout rules' int32 limit and boundary
rules (``rules``), the data checks with their one wording each (``checks``), the device executor's index
maps and their records (``index``), the host-read rule and the builders for an op given a layout, for lengths
already read or rows padded to their segments (``build``), the device pack form (``device``). Each name here has an importer in
nn_data, profiling or scripts.
"""

from __future__ import annotations

from nn_data.layout.build import layout_from_read_lengths, padded_rows, reads_host, take_layout
from nn_data.layout.checks import (
    boundary_args, fixed_total_arg, lengths_device, lengths_host, natural_total_host, packed_tensor_length,
    sequence_divisible, target_ids, target_ids_device, target_ids_host, total_divisible, total_limit_host,
)
from nn_data.layout.device import set_pack_form
from nn_data.layout.index import (
    SegmentRows, Segments, ZigzagLocal, exclusive_cumsum, packed_segments, segment_ids, segment_rows,
)
from nn_data.layout.rules import INT32_MAX, segment_bounds

__all__ = [
    "INT32_MAX",
    "SegmentRows",
    "Segments",
    "ZigzagLocal",
    "boundary_args",
    "exclusive_cumsum",
    "fixed_total_arg",
    "layout_from_read_lengths",
    "lengths_device",
    "lengths_host",
    "natural_total_host",
    "packed_segments",
    "packed_tensor_length",
    "padded_rows",
    "reads_host",
    "segment_bounds",
    "segment_ids",
    "segment_rows",
    "sequence_divisible",
    "set_pack_form",
    "take_layout",
    "target_ids",
    "target_ids_device",
    "target_ids_host",
    "total_divisible",
    "total_limit_host",
]
