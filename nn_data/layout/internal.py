"""The layout's second door, for nn_data's own ops, planners, adapters and NeMo-RL drop-in (not for users).

:mod:`nn_data.layout` is the user's door (the layout type, its spec, the builders, the op helper, the
rounding rule). What nn_data's own code needs beyond it comes through here, never from a submodule
(``tests/ops/test_structure.py`` holds both rules): the layout rules' int32 limit and boundary
rules (``rules``), the data checks with their one wording each (``checks``, the module: ``checks.<name>``),
the device index maps and their records (``index``), the base of the ops configured with a CP rank and how an
op gets its call's layout (``op``: :class:`RankOp`, :func:`op_layout`), and the builders' rule of which executor a layout gets
and their forms for an op given a layout or rows padded to their segments (``build``). Each name here has
an importer in nn_data, profiling or scripts.

Example::

    >>> from nn_data.layout.internal import checks, segment_bounds
    >>> segment_bounds([16], 16)  # no sequence: the pseudo-segment [0, T]
    [0, 16]
    >>> checks.total_divisible(16, 4)  # T = 16 splits into 2C = 8 chunks; T = 12 would raise PackingError
"""

from __future__ import annotations

from nn_data.layout import checks
from nn_data.layout.build import layout_from_read_lengths, reads_host, take_layout
from nn_data.layout.op import RankOp, op_layout
from nn_data.layout.index import (
    SegmentRows, Segments, ZigzagLocal, exclusive_cumsum, packed_segments, segment_ids, segment_rows,
)
from nn_data.layout.rules import INT32_MAX, segment_bounds

__all__ = [
    "INT32_MAX",
    "RankOp",
    "SegmentRows",
    "Segments",
    "ZigzagLocal",
    "checks",
    "exclusive_cumsum",
    "layout_from_read_lengths",
    "op_layout",
    "packed_segments",
    "reads_host",
    "segment_bounds",
    "segment_ids",
    "segment_rows",
    "take_layout",
]
