"""Hugging Face transformers causal LMs as :class:`~nn_data.packed_forward.PackedForward` models.

Shape legend
    Tq  local query tokens (``T/C`` under context parallelism, else ``T``)
    T   packed tokens (keys, after the CP gather)
    H   query heads, Hk key/value heads, D head dim, V vocab

Without CP the adapter calls ``model(input_ids, position_ids, use_cache=False)`` with **no**
``attention_mask``: transformers then derives the document-causal mask itself from the
position ids, which restart at 0 at every sequence (``find_packed_sequence_indices``), for
whatever attention implementation the model was built with (sdpa, eager, flex, or
flash-attention's variable-length kernels on a GPU). Passing an all-ones ``attention_mask``
would switch that derivation off and let attention leak across sequences.

Under CP the local position ids come in zigzag order, so that derivation would give wrong
segments. For the duration of each CP call the adapter sets the model's attention
implementation to the function this module registers with ``transformers.AttentionInterface``
under :data:`ATTENTION_NAME` (and restores it afterwards). nn_data's mask
(:mod:`nn_data.masks`: dense, or a flex ``BlockMask`` where that backend runs the call)
reaches it as the 4-D ``attention_mask``, which transformers passes through untouched, and the
mask's ``gather`` all-gathers the (already rotary-embedded) keys and values across the CP group
before attention. Called without nn_data's mask, that function is transformers' own SDPA
attention.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from einops import rearrange
from torch import nn

from nn_data.errors import PackingError
from nn_data.masks import DocumentMask, document_attention, document_mask

#: The name nn_data's attention function is registered under (``transformers.AttentionInterface``).
ATTENTION_NAME = "nn_data_packed"
_MASK_KWARG = "nn_data_mask"


def packed_attention(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                     scaling=None, **kwargs):
    """transformers attention function: ``query [1, H, Tq, D]``, ``key/value [1, Hk, Tq, D]`` ->
    ``([1, Tq, H, D], None)``.

    With nn_data's :class:`~nn_data.masks.DocumentMask` in ``kwargs["nn_data_mask"]``:
    keys and values are gathered across the CP group (``mask.gather``) and attention runs under
    the document-causal mask. Without it: transformers' SDPA attention, unchanged.
    Raises :class:`PackingError` for sliding-window or soft-capped attention (not supported).
    """
    mask = kwargs.pop(_MASK_KWARG, None)
    if mask is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise PackingError(f"{name}={kwargs[name]!r}: nn_data's packed attention supports full causal attention "
                               "only; build the model without it")
    if mask.gather is not None:  # context parallel: every rank's keys and values, in packed order
        heads = key.shape[1]
        kv = rearrange(torch.stack([key, value]), "two 1 h t d -> 1 t (two h d)")  # [1, Tq, 2*Hk*D]
        kv = mask.gather(kv)  # [1, T, 2*Hk*D]
        key, value = rearrange(kv, "1 t (two h d) -> two 1 h t d", two=2, h=heads)  # [1, Hk, T, D] each
    out = document_attention(query, key, value, mask, scale=scaling, dropout_p=dropout)  # [1, H, Tq, D]
    return out.transpose(1, 2).contiguous(), None  # [1, Tq, H, D]


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
    """A transformers causal LM (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...) as a
    :class:`~nn_data.packed_forward.PackedForward` model.

    ``forward(input_ids [1, Tq], position_ids [1, Tq], packed, **model_kwargs) -> logits [1, Tq, V]``.
    ``mask_kind`` (``"auto"``, ``"dense"``, ``"block"``) chooses the form of nn_data's mask under
    CP (:func:`nn_data.masks.document_mask`). Extra ``model_kwargs`` go to the model.

    Example::

        model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, ...))
        wrapped = PackedForward(HFCausalLMAdapter(model), cp_group=cp_group, pad_individual_seqs_to_multiple_of=8)
        logits = wrapped(input_ids, seq_lengths)  # [B, S, V]
    """

    def __init__(self, model: nn.Module, *, mask_kind: str = "auto"):
        super().__init__()
        if not hasattr(model, "config") or not hasattr(model.config, "_attn_implementation"):
            raise PackingError(f"model={type(model).__name__} is not a transformers PreTrainedModel (no config)")
        self.model = model
        self.mask_kind = mask_kind

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, packed, **model_kwargs) -> torch.Tensor:
        if packed.gather is None:  # transformers derives the document mask from the restarting position ids
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **model_kwargs)
            return out.logits  # [1, T, V]
        mask = document_mask(packed.query_index, packed.segment_ids, kind=self.mask_kind, dtype=self.model.dtype,
                             gather=packed.gather)
        with _attention_implementation(self.model.config, register_packed_attention()):
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=_as_4d(mask),
                             use_cache=False, **{_MASK_KWARG: mask}, **model_kwargs)
        return out.logits  # [1, Tq, V]


@contextlib.contextmanager
def _attention_implementation(config, name: str):
    """The model's attention implementation is ``name`` inside the block (sub-configs too)."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def _as_4d(mask: DocumentMask):
    """The mask in the 4-D form transformers passes through to the attention function unchanged."""
    return mask.dense[None, None] if mask.dense is not None else mask.block  # [1, 1, Tq, T] or a BlockMask
