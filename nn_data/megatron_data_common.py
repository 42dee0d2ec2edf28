"""megatron-core glue for the NeMo-RL-compatible layer, imported lazily.

``import nn_data`` (and ``import nn_data.megatron_data``) never imports
megatron-core: it costs ~5 s and warns about missing TransformerEngine/Apex.
Only the functions here touch it, at call time:

* :func:`make_packed_seq_params` imports ``megatron.core.packed_seq_params`` on its
  first call and fills only the fields the installed release has (0.16.1 has no
  ``total_tokens``; newer releases do);
* :func:`cp_rank_and_size` reads ``parallel_state`` only when some code already
  imported and initialised it, else answers rank 0 of 1 without importing anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from typing import Any, Optional

import torch

from nn_data.errors import PackingError


def _round_up_to_multiple(value: int, multiple: int) -> int:
    """Round a Python int up to a multiple (NeMo-RL's ``_round_up_to_multiple``).

    Example: ``_round_up_to_multiple(13, 8) -> 16``; ``_round_up_to_multiple(16, 8) -> 16``.
    """
    return ((value + multiple - 1) // multiple) * multiple


@functools.lru_cache(maxsize=1)
def _packed_seq_params_class() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TransformerEngine/Apex missing: irrelevant for a dataclass
        from megatron.core.packed_seq_params import PackedSeqParams
    return PackedSeqParams


@functools.lru_cache(maxsize=1)
def packed_seq_params_fields() -> frozenset:
    """Field names of the installed megatron-core's ``PackedSeqParams``."""
    return frozenset(f.name for f in dataclasses.fields(_packed_seq_params_class()))


def make_packed_seq_params(cu_seqlens_padded: torch.Tensor, max_seqlen: int, local_tokens: Optional[int]) -> Any:
    """A THD ``PackedSeqParams`` whose four ``cu_seqlens_*`` fields are ``cu_seqlens_padded``.

    ``max_seqlen`` (a Python int) fills ``max_seqlen_q``/``max_seqlen_kv``; ``local_tokens``
    (this rank's packed length) fills ``total_tokens`` where the installed release has that
    field (None leaves it unset). No host sync.
    """
    cls = _packed_seq_params_class()
    kwargs = dict(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens_padded,
        cu_seqlens_kv=cu_seqlens_padded,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
    )
    if local_tokens is not None and "total_tokens" in packed_seq_params_fields():
        kwargs["total_tokens"] = int(local_tokens)
    return cls(**kwargs)


def cp_rank_and_size() -> tuple[int, int]:
    """``(cp_rank, cp_size)`` from megatron-core's ``parallel_state`` when it is initialised.

    When ``torch.distributed`` is not initialised, or ``parallel_state`` was never
    imported or never given a context-parallel group, this is ``(0, 1)``: a single rank.
    (megatron-core itself answers a world size of 0 there.)
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0, 1
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or getattr(ps, "_CONTEXT_PARALLEL_GROUP", None) is None:
        return 0, 1
    return int(ps.get_context_parallel_rank()), int(ps.get_context_parallel_world_size())


def straggler_context(straggler_timer):
    """``straggler_timer(bdata=True)`` when a StragglerDetector is given, else a no-op context."""
    return straggler_timer(bdata=True) if straggler_timer is not None else contextlib.nullcontext()


def require(condition: bool, message: str) -> None:
    """Raise :class:`PackingError` (a ``ValueError`` and an ``AssertionError``) unless ``condition``."""
    if not condition:
        raise PackingError(message)
