"""Non-attention token mixers (linear attention, state-space, short convolution) on packed sequences,
one sequence per row, so that no state or convolution tap crosses a sequence boundary.

Shape legend
    Tq  local tokens (``T/C`` under context parallelism, else ``T``)
    T   packed tokens
    B'  segments (``max(B, 1)``: a microbatch of no sequence is one padding segment ``[0, T]``)
    W   slots per row: a Python-int bound on every sequence's valid length (no host read)
    D   hidden size in, D' hidden size out (the same for every mixer here)

nn_data runs such a layer's own ``forward``, unchanged, on a batch of ``B'`` rows, one segment each:

    packed [1, Tq, D] --(CP: all-gather)--> [1, T, D] --gather--> rows [B', W, D]
        --layer.forward (batch B', no boundary kwargs, no mask)--> [B', W, D']
        --gather back--> [1, T, D'] --(CP: this rank's places)--> [1, Tq, D']

Each row starts from the layer's initial state and sees only its own tokens, so every valid output equals
the sequence run alone; the two index maps are :func:`nn_data.layout.index.segment_rows`'. A rollout-tree row
is not re-laid: the layer runs once over the packed row, each node from its parent's state
(:mod:`nn_data.adapters.tree_state`). The layer is switched by hooks registered once (:func:`install`) that act
only while the adapter's call holds the rows in the model's :class:`MixerSlot`. Cost and the kernels path:
docs/models.md, "Wrapping your model"."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from nn_data.adapters import tree_state
from nn_data.errors import PackingError
from nn_data.layout.internal import SegmentRows, segment_bounds, segment_rows
from nn_data.masks import PrefixRule

# Keywords the layer must not see on the per-sequence rows: the packed row's boundaries (transformers'
# fallbacks refuse them), its masks and positions ([1, Tq] shapes, not [B', W]).
_PACKED_ONLY = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens",
                "position_ids", "attention_mask", "nn_data_mask", "nn_data_calls")  # (the fallback rows stay)
_BOUNDARIES = ("seq_idx", "cu_seq_lens_q")
_ROWS_KWARG = "nn_data_fallback_rows"  # a fallback call's rows, from the pre-hook to the forward hook


class MixerRows(NamedTuple):
    """One microbatch's per-sequence rows: the row maps, the CP ``gather`` (None without CP) that
    turns this rank's ``[1, Tq, *]`` into the packed ``[1, T, *]``, and ``query_index [Tq]`` (the
    packed position of each local token)."""

    rows: SegmentRows
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]]
    query_index: torch.Tensor


class TreeMixer(NamedTuple):
    """One rollout-tree microbatch's :class:`~nn_data.adapters.tree_state.TreeSteps` (the whole row), the CP
    ``gather`` (None without CP) and ``query_index [Tq]``."""

    steps: tree_state.TreeSteps
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]]
    query_index: torch.Tensor


def mixer_rows(cu_seqlens_padded: torch.Tensor, total: int, width: int, *, gather=None,
               query_index: Optional[torch.Tensor] = None, prefix: Optional[PrefixRule] = None,
               chunk: int = tree_state.DEFAULT_CHUNK):
    """The :class:`MixerRows` of a packed microbatch: boundaries ``[B+1]`` (``[T]`` for ``B = 0``), ``total`` (T),
    ``width`` (W, clamped into ``[1, T]``); with a rollout tree's ``prefix`` rule its :class:`TreeMixer` instead.
    Example: cu_seqlens_padded ``[0, 3, 8]``, T 8, W 5 -> rows ``[[0..4], [3..7]]`` (row 0's slots 3 and 4 outside
    its segment)."""
    width = max(1, min(int(width), max(total, 1)))
    if query_index is None:
        query_index = torch.arange(total, device=cu_seqlens_padded.device)  # [T]
    if prefix is not None and prefix.shared.shape[0] > 1:
        return TreeMixer(tree_state.tree_steps(prefix, chunk, cu_seqlens_padded.shape[0] - 1), gather, query_index)
    bounds = segment_bounds(cu_seqlens_padded, total)  # [B'+1]: [0, T] when B = 0
    return MixerRows(segment_rows(bounds, total, width), gather, query_index)


def to_rows(hidden: torch.Tensor, mixer: MixerRows) -> torch.Tensor:
    """``[1, Tq, D] -> [B', W, D]``: every segment in a row of its own, zeros past its end."""
    full = hidden if mixer.gather is None else mixer.gather(hidden)  # [1, T, D]
    rows, valid = mixer.rows.row_source, mixer.rows.row_valid  # [B', W] each
    flat = full[0].index_select(0, rows.reshape(-1)).view(*rows.shape, *full.shape[2:])  # [B', W, D]
    return torch.where(valid.view(*valid.shape, *([1] * (flat.dim() - 2))), flat, torch.zeros((), dtype=flat.dtype,
                                                                                              device=flat.device))


def to_packed(out: torch.Tensor, mixer: MixerRows) -> torch.Tensor:
    """``[B', W, D'] -> [1, Tq, D']``: the rows back in packed order (this rank's places under CP)."""
    rows = mixer.rows
    flat = out.reshape(-1, *out.shape[2:]).index_select(0, rows.packed_source)  # [T, D']
    keep = rows.packed_valid.view(-1, *([1] * (flat.dim() - 1)))
    packed = torch.where(keep, flat, torch.zeros((), dtype=flat.dtype, device=flat.device))  # [T, D']
    if mixer.gather is not None:
        packed = packed.index_select(0, mixer.query_index)  # [Tq, D']
    return packed.unsqueeze(0)  # [1, Tq, D']


class MixerSlot:
    """The state of a model's mixer hooks during one adapter call: the per-sequence ``mixer`` (None: pass through),
    ``require_boundaries`` (the kernels path: every mixer must receive the boundaries), a ``fallback`` mixer that
    runs one that did not per sequence (``mixers="auto"``) and ``fell_back``, whether it did."""

    def __init__(self):
        self.mixer: Optional[MixerRows] = None
        self.require_boundaries = False
        self.fallback: Optional[MixerRows] = None
        self.fell_back = False
        self.model_type = "?"


def slot_for(model: nn.Module) -> MixerSlot:
    """The :class:`MixerSlot` of ``model`` (one per model, shared by every adapter built on it)."""
    slot = model.__dict__.get("_nn_data_mixer_slot")
    if slot is None:
        slot = model.__dict__["_nn_data_mixer_slot"] = MixerSlot()
        slot.model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    return slot


@contextlib.contextmanager
def active(slot: MixerSlot, mixer: Optional[MixerRows], *, require_boundaries: bool = False,
           fallback: Optional[MixerRows] = None):
    """The hooks of ``slot`` run ``mixer`` (or check for the boundaries, with ``fallback``) inside the block."""
    slot.mixer, slot.require_boundaries, slot.fallback, slot.fell_back = mixer, require_boundaries, fallback, False
    try:
        yield
    finally:
        slot.mixer, slot.require_boundaries, slot.fallback = None, False, None


def _before(slot: MixerSlot, module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: during a per-sequence call the layer gets the rows and none of the packed keywords."""
    mixer = slot.mixer
    if mixer is None and slot.require_boundaries and not any(kwargs.get(name) is not None for name in _BOUNDARIES):
        mixer = slot.fallback  # the kernels would not see the boundaries: run this one per sequence
        slot.fell_back = mixer is not None
        if mixer is None:
            raise PackingError(
                f"model_type={slot.model_type!r}: {type(module).__name__} received no packed boundaries (seq_idx, "
                "cu_seq_lens_q): this model's forward does not pass them down to its layers, so its kernels would "
                "mix the sequences; use mixers='per_sequence'")
        kwargs = {**kwargs, _ROWS_KWARG: mixer}  # the forward hook maps this call's rows back
    if mixer is None:
        return None
    for name in ("cache", "past_key_values", "cache_params"):
        if kwargs.get(name) is not None:
            raise PackingError(f"{type(module).__name__} got {name}=...: packed sequences run without a cache "
                               "(use_cache=False)")
    if args:
        hidden, rest = args[0], args[1:]
    else:
        kwargs = dict(kwargs)
        hidden, rest = kwargs.pop("hidden_states"), ()
    kwargs = {k: v for k, v in kwargs.items() if k not in _PACKED_ONLY}
    if isinstance(mixer, TreeMixer):  # the whole row to the tree forward (_forward)
        return (hidden if mixer.gather is None else mixer.gather(hidden), *rest), kwargs
    return (to_rows(hidden, mixer), *rest), kwargs


def _after(slot: MixerSlot, module: nn.Module, args: tuple, kwargs: dict, output: Any):
    """Forward hook: the layer's ``[B', W, D']`` output (or the first of a tuple) back to ``[1, Tq, D']``."""
    mixer = slot.mixer if slot.mixer is not None else kwargs.get(_ROWS_KWARG)
    if mixer is None:
        return None
    back = _tree_back if isinstance(mixer, TreeMixer) else to_packed
    if isinstance(output, tuple):
        return (back(output[0], mixer), *output[1:])
    return back(output, mixer)


def _tree_back(out: torch.Tensor, mixer: TreeMixer) -> torch.Tensor:
    """``[1, T, D'] -> [1, Tq, D']``: this rank's places under CP."""
    return out if mixer.gather is None else out.index_select(1, mixer.query_index)


def _forward(slot: MixerSlot, module: nn.Module, *args, **kwargs):
    """The layer's forward: its family's tree forward during a rollout-tree call, else its class's own."""
    if isinstance(slot.mixer, TreeMixer):
        return tree_state.tree_forward(module, args[0], slot.mixer.steps)
    return type(module).forward(module, *args, **kwargs)


def install(module: nn.Module, slot: MixerSlot) -> None:
    """Register the per-sequence hooks of ``slot`` on ``module`` and wrap its ``forward`` for rollout trees (an
    attribute of this module only, which calls the class's own forward outside a tree call); once, a second
    call is a no-op."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, functools.partial) and hook.func is _before and hook.args[0] is slot:
            return
    module.forward = functools.partial(_forward, slot, module)  # (no bound method held: a deep copy stays its own)
    module.register_forward_pre_hook(functools.partial(_before, slot), with_kwargs=True)
    module.register_forward_hook(functools.partial(_after, slot), with_kwargs=True)
