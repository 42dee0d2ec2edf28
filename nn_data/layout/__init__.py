"""The layout of a packed microbatch and its two executors (``docs/design.md``, "Layouts and executors").

This package's ``__init__`` is the user's door to the layout (its ``__all__``, what a user needs);
nn_data's own code enters by a second one, :mod:`nn_data.layout.internal`, and by no submodule. Every
entry point of nn_data packs, shards, unshards and unpacks through it:

* :class:`PackLayout` (``pack_layout``): one microbatch's layout, with the methods that run it
  (``pack``, ``shard``, ``unshard``, ``unpack``, ``local_places``, ``positions``, ``padding_mask``);
* building one (``build``): :class:`PackSpec` (what a pack is asked for) and
  :func:`layout_from_lengths`; :class:`Boundaries` and :func:`layout_from_boundaries` for an op given
  boundaries; :func:`pack_with_layout` (:meth:`PackLayout.pack`);
* a shared-prefix microbatch (``prefix_layout``): :class:`SharedPrefixLayout`, :func:`shared_prefix_layout`;
* :class:`RankOp` and :func:`op_layout` (``op``): the base of the ops configured with a CP rank, and
  how an op gets its call's layout;
* :class:`SharedPrefixLayout` and :func:`shared_prefix_layout` (``shared_prefix``): a GRPO group's
  prompt packed once, then its responses: a :class:`PackLayout` over two slots per rollout;
* :func:`round_up`, the rounding rule (``rules``: every layout rule, written once for Python ints and
  tensors); their checks (``checks``, one wording each), the device executor's index maps (``index``),
  the executors (``host``, ``device``; which one runs is ``pack_layout.executor``) and the rest of what
  nn_data's own code uses: :mod:`nn_data.layout.internal`.
"""

from __future__ import annotations

from nn_data.layout.build import Boundaries, PackSpec, layout_from_boundaries, layout_from_lengths
from nn_data.layout.op import RankOp, op_layout
from nn_data.layout.pack_layout import PackLayout, pack_with_layout
from nn_data.layout.prefix_layout import SharedPrefixLayout, shared_prefix_layout
from nn_data.layout.rules import round_up

__all__ = [
    "Boundaries",
    "PackLayout",
    "PackSpec",
    "RankOp",
    "SharedPrefixLayout",
    "layout_from_boundaries",
    "layout_from_lengths",
    "op_layout",
    "pack_with_layout",
    "round_up",
    "shared_prefix_layout",
]
