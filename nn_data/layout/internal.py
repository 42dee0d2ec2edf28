"""The layout's second door, for nn_data's own ops, planners, adapters and NeMo-RL drop-in (not for users):
what nn_data's own code needs beyond :mod:`nn_data.layout`, never from a submodule (``tests/ops/test_structure.py``
holds both rules): the int32 limit and boundary rules, the data checks (``checks.<name>``), the device index
maps, :class:`RankOp` / :func:`op_layout`, and the builders' executor rule and forms. Each name has an importer
in nn_data, profiling or scripts.

Example::

    >>> from nn_data.layout.internal import checks, segment_bounds
    >>> segment_bounds([16], 16)  # no sequence: the pseudo-segment [0, T]
    [0, 16]
    >>> checks.total_divisible(16, 4)  # T = 16 splits into 2C = 8 chunks; T = 12 would raise PackingError"""

from __future__ import annotations

from nn_data.layout import checks
from nn_data.layout.build import RankOp, layout_from_read_lengths, op_layout, reads_host, take_layout
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
