"""Small helpers of the drop-in: the straggler timer, ``require``, the CP getters NeMo-RL's
module exposes, and :func:`public` (how the drop-in's functions call each other, so that a patch of
``nn_data.nemo_rl.megatron_data.X`` reaches the call)."""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.extension import process_groups


def straggler_context(straggler_timer):
    """``straggler_timer(bdata=True)`` when a StragglerDetector is given, else a no-op context."""
    return straggler_timer(bdata=True) if straggler_timer is not None else contextlib.nullcontext()


def require(condition: bool, message: str) -> None:
    """Raise :class:`PackingError` (a ``ValueError`` and an ``AssertionError``) unless ``condition``."""
    if not condition:
        raise PackingAssertionError(message)


PUBLIC_MODULE = "nn_data.nemo_rl.megatron_data"


def public(name: str) -> Any:
    """What ``nn_data.nemo_rl.megatron_data`` binds to ``name`` now (a mock while it is patched).

    Example: inside ``mock.patch("nn_data.nemo_rl.megatron_data.get_ltor_masks_and_position_ids")``,
    ``public("get_ltor_masks_and_position_ids")`` is the mock."""
    return getattr(importlib.import_module(PUBLIC_MODULE), name)


def megatron_cp_rank_and_size() -> tuple[int, int]:
    """``(cp_rank, cp_size)`` from an initialised ``parallel_state``, else ``(0, 1)``."""
    state = process_groups.megatron_state()
    if state is None:
        return 0, 1
    return int(state.get_context_parallel_rank()), int(state.get_context_parallel_world_size())


def get_context_parallel_rank() -> int:
    """This rank's context-parallel rank (NeMo-RL imports megatron-core's; 0 when CP is not set up)."""
    return megatron_cp_rank_and_size()[0]


def get_context_parallel_world_size() -> int:
    """The context-parallel size (NeMo-RL imports megatron-core's; 1 when CP is not set up)."""
    return megatron_cp_rank_and_size()[1]
