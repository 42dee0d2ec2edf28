"""megatron-core glue for the NeMo-RL-compatible layer, imported lazily.

``import nn_data`` (and ``import nn_data.megatron_data``) never imports
megatron-core: it costs ~5 s and warns about missing TransformerEngine/Apex.
Only the functions here touch it, at call time:

* :func:`make_packed_seq_params` imports ``megatron.core.packed_seq_params`` on its
  first call and fills only the fields the installed release has (0.16.1 has no
  ``total_tokens``; newer releases do);
* :func:`cp_rank_and_size` reads ``parallel_state`` only when some code already
  imported and initialised it, else answers rank 0 of 1 without importing anything.

:func:`public` is how the compat layer's functions call each other: through the names
``nn_data.megatron_data`` binds *at call time*, so ``mock.patch("nn_data.megatron_data.X")``
(what code written against NeMo-RL patches as ``nemo_rl.models.megatron.data.X``) reaches
the call even though ``X`` is defined in a submodule and re-exported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
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


def make_packed_seq_params(
    cu_seqlens_padded: torch.Tensor,
    max_seqlen: int,
    total_tokens: Optional[int],
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
    pad_between_seqs: Optional[bool] = None,
) -> Any:
    """A THD ``PackedSeqParams`` over ``cu_seqlens_padded`` ``[B+1]``.

    ``cu_seqlens_q``/``_kv`` are ``cu_seqlens`` when given (the valid-token boundaries, what
    a model that slices CP itself needs), else ``cu_seqlens_padded``; the ``*_padded``
    fields are always ``cu_seqlens_padded``. ``max_seqlen`` (a Python int) fills
    ``max_seqlen_q``/``_kv``. ``total_tokens`` and ``pad_between_seqs`` are set only where
    the installed release has those fields (megatron-core 0.16.1 has neither; None leaves a
    field unset). No host sync.
    """
    cls = _packed_seq_params_class()
    valid = cu_seqlens if cu_seqlens is not None else cu_seqlens_padded
    kwargs = dict(
        qkv_format="thd",
        cu_seqlens_q=valid,
        cu_seqlens_kv=valid,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
    )
    fields = packed_seq_params_fields()
    if total_tokens is not None and "total_tokens" in fields:
        kwargs["total_tokens"] = int(total_tokens)
    if pad_between_seqs is not None and "pad_between_seqs" in fields:
        kwargs["pad_between_seqs"] = bool(pad_between_seqs)
    return cls(**kwargs)


PUBLIC_MODULE = "nn_data.megatron_data"


def public(name: str) -> Any:
    """What ``nn_data.megatron_data`` binds to ``name`` now (a mock while it is patched).

    Example: inside ``mock.patch("nn_data.megatron_data._pack_sequences_for_megatron")``,
    ``public("_pack_sequences_for_megatron")`` is the mock, so :func:`process_microbatch`
    calls the mock, as NeMo-RL's module-level calls would.
    """
    return getattr(importlib.import_module(PUBLIC_MODULE), name)


def get_context_parallel_rank() -> int:
    """This rank's context-parallel rank (NeMo-RL imports megatron-core's; 0 when CP is not set up)."""
    return cp_rank_and_size()[0]


def get_context_parallel_world_size() -> int:
    """The context-parallel size (NeMo-RL imports megatron-core's; 1 when CP is not set up,
    where megatron-core's answers 0 without torch.distributed)."""
    return cp_rank_and_size()[1]


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
