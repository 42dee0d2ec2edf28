"""One microbatch's shared work: NeMo-RL's call structure on nn_data's one sync and one graph.

NeMo-RL's ``process_microbatch`` packs ``input_ids`` with ``_pack_sequences_for_megatron``,
then calls it again for ``mtp_loss_mask`` and the media-token mask, and shards routed
experts with ``_shard_routed_experts_for_cp``; code written against NeMo-RL (its tests
too) patches those names. nn_data's :func:`process_microbatch` makes the same calls,
through ``nn_data.megatron_data`` (so patches apply), inside a :class:`MicrobatchScope`:

* the first real pack call for the microbatch's ``input_ids`` packs every companion
  registered on the scope (``[B, S, *]`` tensors riding the same layout) in the same graph
  run, with the microbatch's single host sync;
* a later real call for a companion, with the same lengths and configuration, returns
  that result instead of packing again (same arguments, same values);
* what the sync brought to the host (``T``, ``max_seqlen``, the valid-token total) is kept
  against the ``cu_seqlens_padded`` tensor the pack returned, so the routed-experts shard,
  the CP partition indices and the model-slicing ``PackedSeqParams`` do not sync again.

Outside a scope (a direct call) every function does its own work and its own sync.
Objects are keyed by identity and kept alive by the scope, which lives for one microbatch.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, NamedTuple, Optional

import torch

COMPANIONS = ("mtp_loss_mask", "routed_experts", "token_identity", "media_token_validity_mask")


class BoundsFacts(NamedTuple):
    """Host-side facts about one ``cu_seqlens_padded`` tensor (``bounds``), from the pack's sync."""

    bounds: torch.Tensor
    seq_lengths: Any
    row_len: int
    total: int
    max_seqlen: int
    valid_total: int
    cp_size: int


class MicrobatchScope:
    """Per-microbatch memo; see the module docstring. Created by :func:`microbatch_scope`."""

    def __init__(self):
        self.primary: Optional[torch.Tensor] = None
        self.companions: dict[str, torch.Tensor] = {}
        self._plans: dict = {}
        self._results: dict = {}
        self._facts: dict = {}

    def register(self, primary: torch.Tensor, **companions) -> None:
        """Declare ``primary`` ``[B, S]`` and the companions to pack with it (None ones and any
        whose leading dims are not ``[B, S]`` are left to their own calls)."""
        self.primary = primary
        lead = tuple(primary.shape[:2])
        self.companions = {k: v for k, v in companions.items()
                           if isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == lead}

    def companions_of(self, tensor) -> dict:
        """The companions to pack alongside ``tensor``: all of them when it is the primary."""
        return dict(self.companions) if tensor is self.primary else {}

    def plan(self, key: tuple, seq_lengths, compute):
        """The plan for ``key`` made with this very ``seq_lengths`` object, computing it once."""
        hit = self._plans.get(key)
        if hit is not None and hit[0] is seq_lengths:
            return hit[1]
        plan = compute()
        self._plans[key] = (seq_lengths, plan)
        return plan

    def store(self, tensor, key: tuple, result) -> None:
        self._results[(id(tensor), key)] = (tensor, result)

    def recall(self, tensor, key: tuple):
        hit = self._results.get((id(tensor), key))
        return hit[1] if hit is not None and hit[0] is tensor else None

    def keep_facts(self, facts: BoundsFacts) -> None:
        self._facts[id(facts.bounds)] = facts

    def facts(self, bounds, seq_lengths=None) -> Optional[BoundsFacts]:
        """The facts about this very ``bounds`` tensor (and, when given, these very lengths)."""
        hit = self._facts.get(id(bounds))
        if hit is None or hit.bounds is not bounds:
            return None
        if seq_lengths is not None and hit.seq_lengths is not seq_lengths:
            return None
        return hit


_CURRENT: contextvars.ContextVar[Optional[MicrobatchScope]] = contextvars.ContextVar(
    "nn_data_microbatch_scope", default=None)


@contextlib.contextmanager
def microbatch_scope() -> Iterator[MicrobatchScope]:
    """Open a fresh scope for one microbatch (nested scopes shadow the outer one)."""
    token = _CURRENT.set(MicrobatchScope())
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def current_scope() -> Optional[MicrobatchScope]:
    """The innermost open scope, or None outside :func:`microbatch_scope`."""
    return _CURRENT.get()


def known_facts(bounds, seq_lengths=None) -> Optional[BoundsFacts]:
    """:meth:`MicrobatchScope.facts` of the current scope, None outside one."""
    scope = current_scope()
    return scope.facts(bounds, seq_lengths) if scope is not None else None
