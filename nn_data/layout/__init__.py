"""The layout of a packed microbatch and its two executors (``docs/design.md``, "Layouts and executors").

This ``__init__`` is the user's door (its ``__all__``); nn_data's own code enters by
:mod:`nn_data.layout.internal`, never a submodule. :class:`PackLayout` (``pack_layout``) is one microbatch's
boundaries and its executor (``host`` or ``device``) with the methods that run it; ``build`` makes one
(:class:`PackSpec`, :func:`layout_from_lengths`, :func:`layout_from_boundaries`); ``tree`` lays out a rollout
tree over node slots (:func:`tree_layout`; GRPO groups: :func:`shared_prefix_layout`); ``rules`` holds every
layout rule once (:func:`round_up`).

Example::

    >>> layout = layout_from_lengths(torch.tensor([3, 0, 5]), 5, PackSpec(4))
    >>> layout.cu_seqlens_padded.tolist(), layout.total, type(layout.executor).__name__
    ([0, 4, 4, 12], 12, 'HostExecutor')"""

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
