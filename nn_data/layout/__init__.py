"""The layout of a packed microbatch and its two executors (``docs/design.md``, "Layouts and executors").

This package's ``__init__`` is the user's door to the layout (its ``__all__``, what a user needs);
nn_data's own code enters by a second one, :mod:`nn_data.layout.internal`, and by no submodule. Every
entry point of nn_data packs, shards, unshards and unpacks through it:

* :class:`PackLayout` (``pack_layout``): one microbatch's boundaries and its executor (a host one,
  ``host``, or a device one, ``device``), with the methods that run it (``pack``, ``shard``, ``unshard``,
  ``unpack``, ``local_places``, ``positions``, ``padding_mask``);
* building one (``build``): :class:`PackSpec` (what a pack is asked for) and
  :func:`layout_from_lengths`; :class:`Boundaries` and :func:`layout_from_boundaries` for an op given
  boundaries; :func:`pack_with_layout` (:meth:`PackLayout.pack`);
* a rollout-tree microbatch (``tree``, its index tables ``tree_nodes``): :class:`TreeLayout`,
  :func:`tree_layout` (a :class:`PackLayout` over node slots); the GRPO shared prompt is its depth-1
  spelling, :func:`shared_prefix_layout` (GRPO groups as the tree);
* :func:`round_up`, the rounding rule (``rules``: every layout rule, written once for Python ints and
  tensors); their checks (``checks``, one wording each), the device executor's index maps (``index``)
  and the rest of what nn_data's own code uses: :mod:`nn_data.layout.internal`.


Example::

    >>> layout = layout_from_lengths(torch.tensor([3, 0, 5]), 5, PackSpec(4))
    >>> layout.cu_seqlens_padded.tolist(), layout.total, type(layout.executor).__name__
    ([0, 4, 4, 12], 12, 'HostExecutor')
"""

from __future__ import annotations

from nn_data.layout.build import Boundaries, PackSpec, layout_from_boundaries, layout_from_lengths
from nn_data.layout.pack_layout import PackLayout, pack_with_layout
from nn_data.layout.tree import TreeLayout, shared_prefix_layout, tree_layout
from nn_data.layout.rules import round_up

__all__ = [
    "Boundaries",
    "PackLayout",
    "PackSpec",
    "TreeLayout",
    "layout_from_boundaries",
    "layout_from_lengths",
    "pack_with_layout",
    "round_up",
    "shared_prefix_layout",
    "tree_layout",
]
