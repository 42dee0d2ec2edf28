"""Hugging Face transformers causal LMs as :class:`~nn_data.packed_forward.PackedForward` models.

Shape legend
    Tq  local query tokens (``T/C`` under context parallelism, else ``T``)
    T   packed tokens (keys, after the CP gather)
    B'  segments (``max(B, 1)``); H query heads, Hk key/value heads, D head dim, V vocab

Every call hands the model the layout as transformers' padding-free keywords (:func:`boundary_kwargs`, no
host read). Attention layers run the function this module registers with ``transformers.AttentionInterface``
under :data:`ATTENTION_NAME`, with nn_data's document mask by keyword; non-attention mixers run one sequence
per row (:mod:`nn_data.adapters.hf_mixers`) or by kernels given the boundaries. What the model receives and
how each layer keeps the sequences apart: docs/models.md, "Wrapping your model"."""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from einops import rearrange
from torch import nn

from nn_data import _compat
from nn_data.adapters import hf_layers, hf_mixers, hf_support, tree_state
from nn_data.errors import PackingError
from nn_data.layout.internal import segment_bounds
from nn_data.masks import DocumentMask, document_attention, document_mask
from nn_data.model_identity import fingerprint

#: The name nn_data's attention function is registered under (``transformers.AttentionInterface``).
ATTENTION_NAME = "nn_data_packed"
#: What :class:`HFCausalLMAdapter` returns: the output layer's logits, or the final hidden states it reads.
OUTPUTS = ("logits", "hidden_states")
_MASK_KWARG = "nn_data_mask"
_CALLS_KWARG = "nn_data_calls"  # a list the attention function appends to: the adapter's first-call check
#: The mask keyword's value for a model with no attention layer (Mamba-2): no ``[Tq, T]`` mask is built for it,
#: and an attention call that still arrives is refused rather than run without a mask.
_NO_ATTENTION = "no attention layer"


def packed_attention(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                     scaling=None, **kwargs):
    """transformers attention function: ``query [1, H, Tq, D]``, ``key/value [1, Hk, Tq, D]`` -> ``([1, Tq, H, D],
    None)``; with nn_data's :class:`~nn_data.masks.DocumentMask` in ``kwargs["nn_data_mask"]`` keys and values are
    gathered across the CP group and attention runs under it (its ``sliding`` form with the layer's window), else
    transformers' SDPA. Raises :class:`PackingError` for what :func:`nn_data.adapters.hf_support.check_call`
    refuses and for a sliding window the mask was not built for."""
    mask = kwargs.pop(_MASK_KWARG, None)
    calls = kwargs.pop(_CALLS_KWARG, None)
    if isinstance(mask, str):  # _NO_ATTENTION
        raise PackingError(f"{hf_support.where(module)} calls transformers' attention interface, but the adapter "
                           "found no attention layer in the model (a module class named '...Attention') and built "
                           "no document mask; it will not attend across packed sequences, so the call is refused")
    if mask is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    hf_support.check_call(module, attention_mask, kwargs)  # keywords and mask within the lists, else refused
    mask = _for_window(mask, hf_support.call_window(module, kwargs), module)
    if calls is not None:
        calls.append(module)
    if mask.gather is not None:  # context parallel: every rank's keys and values, in packed order
        heads = key.shape[1]
        kv = rearrange(torch.stack([key, value]), "two 1 h t d -> 1 t (two h d)")  # [1, Tq, 2*Hk*D]
        kv = mask.gather(kv)  # [1, T, 2*Hk*D]
        key, value = rearrange(kv, "1 t (two h d) -> two 1 h t d", two=2, h=heads)  # [1, Hk, T, D] each
    out = document_attention(query, key, value, mask, scale=scaling, dropout_p=dropout)  # [1, H, Tq, D]
    return out.transpose(1, 2).contiguous(), None  # [1, Tq, H, D]


def _for_window(mask: DocumentMask, window, module: nn.Module) -> DocumentMask:
    """The mask for a layer called with ``sliding_window=window`` (None: the full document mask)."""
    if window is None:
        return mask
    if mask.sliding is None or mask.sliding.window != window:
        built = None if mask.sliding is None else mask.sliding.window
        raise PackingError(f"{hf_support.where(module)} attends with sliding_window={window!r}, but the adapter built "
                           f"its sliding mask for window={built!r} (config.sliding_window); they must agree: set one "
                           "window in the config (PackedForward reads it again on its next call), or run it unpacked")
    return mask.sliding


@functools.lru_cache(maxsize=1)
def register_packed_attention() -> str:
    """Register :func:`packed_attention` (and SDPA's mask builder for it) with transformers, once;
    returns :data:`ATTENTION_NAME`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, packed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


class HFCausalLMAdapter(nn.Module):
    """A transformers causal LM (Llama, Qwen2, Qwen3-Next, Mamba-2, LFM2, ...) as a ``PackedForward`` model:
    ``forward(input_ids [1, Tq], position_ids [1, Tq], packed, **model_kwargs) -> logits [1, Tq, V]``, extra
    ``model_kwargs`` to the model (a KV cache and the keywords the adapter sets refused by name); no token: ``[1,
    0, V]`` without calling the model.

    Args:
        model: the transformers model.
        mask_kind: ``"auto"``, ``"dense"`` or ``"block"``: the mask's form (:func:`nn_data.masks.document_mask`).
        mixers: ``"auto"``, ``"per_sequence"`` or ``"kernels"``: how non-attention mixers keep sequences apart
            (:func:`nn_data.adapters.hf_layers.mixer_path`; under CP always per sequence).
        output: one of :data:`OUTPUTS`; ``"hidden_states"`` returns the final hidden states ``[1, Tq, H]`` (the
            base model runs, the output layer does not): feed them to :class:`~nn_data.TokenLogProbsFromHidden`.

    Raises :class:`PackingError` for a model that is not a transformers model, layers nn_data cannot keep apart
    (naming the layer and what to install), attention outside :mod:`nn_data.adapters.hf_support`'s list,
    ``mixers="kernels"`` without the kernels, transformers' gradient checkpointing in training, or (on the first
    call) an attention layer that bypasses the interface.

    Example::

        model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, ...))
        wrapped = PackedForward(HFCausalLMAdapter(model), cp_group=cp_group, pad_individual_seqs_to_multiple_of=8)
        logits = wrapped(input_ids, seq_lengths)  # [B, S, V]"""

    def __init__(self, model: nn.Module, *, mask_kind: str = "auto", mixers: str = "auto", output: str = "logits"):
        super().__init__()
        if not hasattr(model, "config") or not hasattr(model.config, "_attn_implementation"):
            raise PackingError(f"model={type(model).__name__} is not a transformers PreTrainedModel (no config)")
        if output not in OUTPUTS:
            raise PackingError(f"output={output!r} is invalid; expected one of {OUTPUTS}")
        self.model = model
        self.output = output
        self.mask_kind = mask_kind
        self.mixers = mixers
        self._attention = register_packed_attention()
        self._slot = hf_mixers.slot_for(model)
        self.revalidate()

    def revalidate(self) -> None:
        """Classify the layers and run :mod:`nn_data.adapters.hf_support`'s list on the model as it is now (when built,
        and when ``PackedForward``'s guard finds it changed); raises :class:`PackingError` for what it refuses."""
        model = self.model
        if fingerprint(model) == self.__dict__.get("_validated"):
            return
        self.layers = hf_layers.inspect_model(model)
        window = hf_support.check_model(model, self.layers.model_type)  # what it keeps exact, else refused
        if window is not None:
            self.layers = self.layers._replace(window=window)
        self.longrope = hf_support.longrope_limit(model)
        self.mixer_path = hf_layers.mixer_path(self.layers, self.mixers, _device_type(model))
        for _, module, _ in self.layers.mixers:
            hf_mixers.install(module, self._slot)  # no-ops outside this adapter's calls
        self._tree_chunk = min((tree_state.chunk_for(m) for _, m, _ in self.layers.mixers),
                               default=tree_state.DEFAULT_CHUNK)  # a rollout tree's chunk rows
        _compat.quiet_recurrent_masks(model)
        # every layer a recognised mixer, none an attention (Mamba-2): no mask to build
        self._attends = not self.layers.mixers or bool(hf_support.attention_modules(model))
        self._checked = False
        self._validated = fingerprint(model)

    @property
    def longest_sequence(self) -> Optional[int]:
        """The longest sequence this adapter packs (``longrope``'s original length: longer rows are refused);
        None: no bound."""
        return None if self.longrope is None else self.longrope[1]

    def reference(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The model's own unpacked forward of ``input_ids [1, L] -> logits [1, L, V]`` (or hidden states): the packing
        check's reference (:mod:`nn_data.model_check`)."""
        return self._run(input_ids=input_ids, use_cache=False)

    def _run(self, **kwargs) -> torch.Tensor:
        """The model called with ``kwargs``: its logits ``[1, Tq, V]``, or its base's last hidden states
        ``[1, Tq, H]`` (``output="hidden_states"``: the output layer is not called)."""
        if self.output == "logits":
            return self.model(**kwargs).logits
        return self.model.base_model(**kwargs).last_hidden_state

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, packed, **model_kwargs) -> torch.Tensor:
        if self.model.training and torch.is_grad_enabled() and _layer_checkpointing(self.model):
            raise PackingError(
                f"model_type={self.layers.model_type!r} has gradient checkpointing enabled: it recomputes each layer "
                "during backward, after this call, without nn_data's attention function and per-sequence rows "
                "(transformers then attends across sequences, or fails); call model.activation_checkpointing_disable() "
                "(gradient_checkpointing_disable), or checkpoint the whole packed forward (torch.utils.checkpoint.checkpoint(wrapped, input_ids, "
                "seq_lengths, use_reentrant=False))")
        model_kwargs = _model_kwargs(model_kwargs, self.layers.model_type)
        if input_ids.shape[1] == 0:  # no token on this rank (a microbatch of no sequence, or only empty ones)
            return self._no_tokens(input_ids)
        if self.longrope is not None:
            hf_support.check_longrope(self.layers.model_type, self.longrope, packed)
        kwargs = boundary_kwargs(packed, seq_idx=len(self.layers.mixers) > 0)  # not bool(): Dynamo 2.11
        mixer = fallback = None
        prefix = packed.prefix  # a rollout-tree row: each node once, from its parent's state (tree_state)
        if self.layers.mixers:
            rows = hf_mixers.mixer_rows(packed.cu_seqlens_padded, packed.segment_ids.shape[0], _row_width(packed),
                                        gather=packed.gather, query_index=packed.query_index,
                                        prefix=None if prefix is None else prefix.rule, chunk=self._tree_chunk)
            per_sequence = self.mixer_path == "per_sequence" or packed.gather is not None or prefix is not None
            mixer, fallback = (rows, None) if per_sequence else (None, rows if self.mixers == "auto" else None)
        kernels = len(self.layers.mixers) > 0 and mixer is None
        with hf_mixers.active(self._slot, mixer, require_boundaries=kernels, fallback=fallback):
            if packed.gather is None and prefix is None and \
                    str(self.model.config._attn_implementation).startswith("flash_attention"):
                out = self._run(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs,
                                **model_kwargs)  # [1, T, V or H]: flash-attention's varlen kernel takes the boundaries
            else:
                out = self._call_with_mask(input_ids, position_ids, packed, kwargs, model_kwargs)
            if self._slot.fell_back:  # the model's forward drops the boundaries: per sequence from now on
                self.mixer_path = "per_sequence"
        return out

    def _no_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[1, 0, V]`` logits through the output layer (``[1, 0, H]``: a slice of its weight), so that backward has a
        graph: transformers' layers cannot reshape 0 tokens."""
        head = self.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if weight is None:
            width = self.model.config.vocab_size if self.output == "logits" else self.model.config.hidden_size
            return torch.zeros(1, 0, width, device=input_ids.device, dtype=self.model.dtype)
        if self.output == "hidden_states":
            return weight[:0].unsqueeze(0)  # [V, H] -> [0, H] -> [1, 0, H]
        return head(weight.new_zeros(1, 0, weight.shape[1]))  # [1, 0, V]

    def _call_with_mask(self, input_ids, position_ids, packed, kwargs: dict, model_kwargs: dict) -> torch.Tensor:
        """The model under nn_data's attention function and document mask."""
        kwargs[_MASK_KWARG] = _NO_ATTENTION if not self._attends else document_mask(
            packed.query_index, packed.segment_ids, kind=self.mask_kind, dtype=self.model.dtype, gather=packed.gather,
            window=self.layers.window, prefix=None if packed.prefix is None else packed.prefix.rule)
        check = not self._checked and not torch.compiler.is_compiling()
        if check:
            kwargs[_CALLS_KWARG] = []
        with _attention_implementation(self.model.config, self._attention):
            out = self._run(input_ids=input_ids, position_ids=position_ids, attention_mask=_as_4d(packed),
                            use_cache=False, **kwargs, **model_kwargs)  # [1, Tq, V or H]
        if check:
            self._check_attention_calls(kwargs[_CALLS_KWARG])
        return out

    def _check_attention_calls(self, calls: list) -> None:
        """First call: every attention module went through the attention interface (saw nn_data's mask)."""
        called = {id(m) for m in calls}
        expected = hf_support.attention_modules(self.model)  # a layer calls if it or a module inside it did
        missing = [name for name, layer in expected if not any(id(m) in called for m in layer.modules())]
        if missing:
            raise PackingError(
                f"model_type={self.layers.model_type!r}: layer {missing[0]!r}: {len(expected)} attention layers but "
                f"{len(missing)} did not call transformers' attention interface, so they attend without nn_data's "
                "document mask (across packed sequences); run this model unpacked, or make that layer's attention "
                "call ALL_ATTENTION_FUNCTIONS[config._attn_implementation] as transformers' layers do")
        self._checked = True


#: The model keywords the adapter sets from the packed layout itself (a caller's value would replace
#: or contradict them).
_SET_BY_ADAPTER = ("input_ids", "position_ids", "attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                   "max_length_k", "seq_idx", _MASK_KWARG, _CALLS_KWARG)


def _model_kwargs(model_kwargs: dict, model_type) -> dict:
    """The caller's model keywords, less ``use_cache=False`` (the adapter's own); a cache (``use_cache`` true,
    ``past_key_values``: it would attend across documents) and :data:`_SET_BY_ADAPTER` refused by name.

    Example: ``{"use_cache": False, "output_hidden_states": True} -> {"output_hidden_states": True}``."""
    who = f"model_type={model_type!r}"
    if model_kwargs.get("use_cache") or model_kwargs.get("past_key_values") is not None:
        name = "use_cache" if model_kwargs.get("use_cache") else "past_key_values"
        value = model_kwargs[name]
        shown = repr(value) if name == "use_cache" else f"<{type(value).__name__}>"
        raise PackingError(
            f"{who}: {name}={shown} cannot keep packed documents apart: a KV cache of a packed row "
            "holds every document's keys and values together, and a call that reads it attends across documents; "
            "nn_data runs the model with use_cache=False: leave out use_cache and past_key_values (generate "
            "from each sequence unpacked)")
    taken = [k for k in _SET_BY_ADAPTER if k in model_kwargs]
    if taken:
        raise PackingError(
            f"{who}: the model keyword {taken[0]} is set by nn_data from the packed layout (the packed tokens, "
            "positions restarting at 0 per sequence, the document mask, the boundaries); pass the unpacked "
            "input_ids and seq_lengths to PackedForward and leave out " + ", ".join(taken))
    return {k: v for k, v in model_kwargs.items() if k != "use_cache"}


def boundary_kwargs(packed, *, seq_idx: bool) -> dict:
    """transformers' padding-free keywords for ``packed`` (a :class:`~nn_data.packed_forward.PackedInfo`), on the
    device; under CP this rank's local view (``// C``).

    Example: cu_seqlens_padded ``[0, 4, 12]``, no CP -> cu_seq_lens_q ``[0, 4, 12]``, max_length_q 8 (a host
    layout's longest segment), seq_idx ``[[0,0,0,0,1,...,1]]``; with C 2, rank 0 -> ``[0, 2, 6]``, 4."""
    total, cp = packed.segment_ids.shape[0], packed.cp_size
    bounds = segment_bounds(packed.cu_seqlens_padded, total)  # [B'+1]: [0, T] when B = 0
    cu = (bounds // cp).to(torch.int32)  # [B'+1] local boundaries (each segment splits into 2C chunks)
    longest = packed.bounds.max_length
    longest = (total if longest is None else longest) // cp
    out = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    if seq_idx:
        segment = packed.segment_ids if packed.gather is None else packed.segment_ids[packed.query_index]
        out["seq_idx"] = segment.to(torch.int32).unsqueeze(0)  # [1, Tq]
    return out


def _row_width(packed) -> int:
    """Slots per row for the per-sequence mixers: a Python-int bound on every valid length (the batch's
    row length ``S``, and the longest segment), ``T`` when the packed info carries neither."""
    total = packed.segment_ids.shape[0]
    longest = None if packed.prefix is not None else packed.bounds.max_length
    bounds = [b for b in (longest, packed.bounds.row_len) if b is not None]  # (a rollout spans 2 slots)
    return min(bounds) if bounds else total


def _layer_checkpointing(model: nn.Module) -> bool:
    """Whether transformers' layer-wise activation checkpointing is on (a module's ``gradient_checkpointing``
    flag: what ``is_activation_checkpointing`` reads, without its deprecated alias's warning)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _device_type(model: nn.Module) -> str:
    first: Optional[torch.Tensor] = next(iter(model.parameters()), None)
    return "cpu" if first is None else first.device.type


@contextlib.contextmanager
def _attention_implementation(config, name: str):
    """The model's attention implementation is ``name`` inside the block."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def _as_4d(packed) -> torch.Tensor:
    """A broadcast ``[1, 1, Tq, T]`` view of one bool as ``attention_mask``, which transformers passes through
    untouched, deriving no mask of its own; the attention function reads ``nn_data_mask`` instead."""
    tq, total = packed.query_index.shape[0], packed.segment_ids.shape[0]
    return torch.ones((), dtype=torch.bool, device=packed.segment_ids.device).expand(1, 1, tq, total)
