"""Small helpers of the NeMo-RL-compatible layer: rounding, the straggler timer, ``require``.

megatron-core itself is reached only through :mod:`nn_data.megatron_parallel`.
"""

from __future__ import annotations

import contextlib

from nn_data.errors import PackingError


def _round_up_to_multiple(value: int, multiple: int) -> int:
    """Round a Python int up to a multiple (NeMo-RL's ``_round_up_to_multiple``).

    Example: ``_round_up_to_multiple(13, 8) -> 16``; ``_round_up_to_multiple(16, 8) -> 16``.
    """
    return ((value + multiple - 1) // multiple) * multiple


def straggler_context(straggler_timer):
    """``straggler_timer(bdata=True)`` when a StragglerDetector is given, else a no-op context."""
    return straggler_timer(bdata=True) if straggler_timer is not None else contextlib.nullcontext()


def require(condition: bool, message: str) -> None:
    """Raise :class:`PackingError` (a ``ValueError`` and an ``AssertionError``) unless ``condition``."""
    if not condition:
        raise PackingError(message)
