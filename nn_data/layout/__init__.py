"""One layout plan, two executors (``docs/design.md``, "Layout plan and executors").

Every entry point of nn_data packs, shards, unshards and unpacks through this package:

* :mod:`~nn_data.layout.rules`: the layout rules, each written once (round-up, the packed length,
  "extend last", the ``B = 0`` pseudo-segment, row-capacity collapse, the zigzag chunks, int32);
* :mod:`~nn_data.layout.checks`: every check of those rules, one wording each (host and device forms);
* :mod:`~nn_data.layout.plan`: the plan type, :class:`PackLayout`;
* :mod:`~nn_data.layout.planner`: :class:`LayoutSpec` and the planners (from lengths, from boundaries,
  a layout an op is given), and the rule that chooses where to plan (:func:`reads_host`);
* :mod:`~nn_data.layout.host` / :mod:`~nn_data.layout.device`: the two executors (Python-int sizes after
  one host read; index maps on the device, zero syncs), :mod:`~nn_data.layout.index` the device's maps,
  :mod:`~nn_data.layout.execute` the dispatch between them.
"""

from nn_data.layout.plan import HostBounds, PackLayout, pack_with_layout
from nn_data.layout.planner import LayoutSpec, plan_from_boundaries, plan_from_lengths, reads_host, take_layout

__all__ = [
    "HostBounds",
    "LayoutSpec",
    "PackLayout",
    "pack_with_layout",
    "plan_from_boundaries",
    "plan_from_lengths",
    "reads_host",
    "take_layout",
]
