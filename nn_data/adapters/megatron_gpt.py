"""megatron-core ``GPTModel`` as a :class:`~nn_data.packed_forward.PackedForward` model.

Shape legend
    Tq  local tokens (``T/C`` under context parallelism, else ``T``)
    T   packed tokens (keys, after the CP gather)
    Hq  query heads (per TP partition), Hk key/value groups, D head dim, E hidden size, V vocab

Build the model with :func:`megatron_gpt_layer_spec`, wrap it in :class:`MegatronGPTAdapter`: it drives the
model with THD ``PackedSeqParams``, megatron-core's own THD rotary embedding and nn_data's document mask, eagerly
(the rotary embedding reads ``cu_seqlens`` on the host). The contract, the supported models and the rotary
bound: docs/models.md, "Wrapping your model"; dynamic CP's group redirection: docs/dynamic-cp.md,
"megatron-core". On a torch without CUDA it applies :mod:`nn_data.adapters._megatron_cpu`. This module imports
megatron-core."""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings

import torch
from einops import rearrange
from torch import nn

from nn_data.adapters import _megatron_cpu
from nn_data.errors import PackingError
from nn_data.groups import OneRankGroup
from nn_data.masks import DocumentMask, document_attention, document_mask

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TransformerEngine/Apex missing: the local spec needs neither
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

#: Whether the installed megatron-core's attention applies the rotary embedding with the microbatch's
#: ``packed_seq_params.cp_group`` itself (Megatron-LM #6821; read from its source). Without it the
#: adapter redirects ``pg_collection.cp`` for the forward (module docstring).
ROPE_TAKES_RUNTIME_GROUP = "packed_seq_params.cp_group" in inspect.getsource(Attention.forward)


class PackedDotProductAttention(DotProductAttention):
    """megatron-core's local ``DotProductAttention`` that also takes packed THD input under CP.

    With ``attention_mask`` an nn_data :class:`~nn_data.masks.DocumentMask`: ``query [Tq, Hq, D]``,
    ``key/value [Tq, Hk, D]`` (THD, rotary-embedded) -> ``[Tq, Hq*D]``, keys and values all-gathered across the CP
    group (``mask.gather``). Anything else (a megatron-core mask tensor): the stock forward."""

    def __init__(self, config, *args, **kwargs):
        if config.context_parallel_size > 1:  # the stock __init__ refuses CP; this class handles it
            stock = copy.copy(config)
            stock.context_parallel_size = 1
            super().__init__(stock, *args, **kwargs)
            self.config = config
        else:
            super().__init__(config, *args, **kwargs)
        if config.softmax_type != "vanilla" or self.scale_mask_softmax.window_size is not None:
            raise PackingError(
                f"softmax_type={config.softmax_type!r} / window_size={config.window_size}: nn_data's packed "
                "attention supports vanilla softmax over full causal attention only"
            )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not isinstance(attention_mask, DocumentMask):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        if attention_bias is not None:
            raise PackingError("attention_bias is not supported by nn_data's packed attention")
        mask = attention_mask
        rows = query.dim() == 4  # [Tq, 1, H, D]: called without PackedSeqParams (a shared-prefix row)
        if rows:
            query, key, value = (x.squeeze(1) for x in (query, key, value))  # [Tq, H, D] each
        if mask.gather is not None:  # context parallel: every rank's keys and values, in packed order
            groups = key.shape[1]
            kv = rearrange(torch.stack([key, value]), "two t g d -> 1 t (two g d)")  # [1, Tq, 2*Hk*D]
            kv = mask.gather(kv)  # [1, T, 2*Hk*D]
            key, value = rearrange(kv, "1 t (two g d) -> two t g d", two=2, g=groups)  # [T, Hk, D] each
        q, k, v = (rearrange(x, "t h d -> 1 h t d") for x in (query, key, value))
        # apply_query_key_layer_scaling divides softmax_scale by the layer number and has the
        # softmax multiply it back: the scale the scores see is softmax_scale * layer number.
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        dropout = self.attention_dropout.p if self.training else 0.0
        out = document_attention(q, k, v, mask, scale=scale, dropout_p=dropout)  # [1, Hq, Tq, D]
        return rearrange(out, "1 h t d -> t 1 (h d)" if rows else "1 h t d -> t (h d)")  # [Tq, (1,) Hq*D]


def megatron_gpt_layer_spec(**local_spec_kwargs):
    """megatron-core's ``get_gpt_layer_local_spec(**local_spec_kwargs)`` with :class:`PackedDotProductAttention`
    as the core attention. Raises :class:`PackingError` for ``multi_latent_attention=True``.

    Example: ``GPTModel(config, megatron_gpt_layer_spec(normalization="RMSNorm"), vocab_size=97,
    max_sequence_length=4096, position_embedding_type="rope")``."""
    if local_spec_kwargs.get("multi_latent_attention"):
        raise PackingError("multi_latent_attention=True is not supported by nn_data's packed attention")
    _megatron_cpu.apply_cpu_patches()
    spec = get_gpt_layer_local_spec(**local_spec_kwargs)
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec


#: What :class:`MegatronGPTAdapter`'s last pipeline stage returns.
OUTPUTS = ("logits", "logprobs")


class MegatronGPTAdapter(nn.Module):
    """A megatron-core ``GPTModel`` built with :func:`megatron_gpt_layer_spec`, as a ``PackedForward`` model:
    ``forward(input_ids [1, Tq], position_ids [1, Tq], packed, **model_kwargs)`` returns logits ``[1, Tq, V]`` on
    the last pipeline stage, the hidden states ``[Tq, 1, E]`` otherwise; wrap it in ``PackedForward(adapter,
    pg_collection=adapter.pg_collection, make_packed_seq_params=True)``. ``packed.padding_mask`` goes to the model
    where its forward takes one (``takes_padding_mask``); a tree row (``packed.prefix``) runs without
    ``PackedSeqParams``, its rotary embedding at the rollout positions (:func:`rotary_at_positions`).

    Args:
        model: the ``GPTModel``; its ``pg_collection`` becomes ``self.pg_collection``.
        mask_kind: the mask's form (:func:`nn_data.masks.document_mask`).
        output: ``"logits"``, or ``"logprobs"``: the last stage returns ``[1, Tq]`` log-probs of the next tokens
            from the hidden states by :class:`~nn_data.TokenLogProbsFromHidden` (the logits never exist).
        chunk_tokens: tokens per chunk of that head.

    Raises :class:`PackingError` for a core attention other than :class:`PackedDotProductAttention`, an unknown
    ``output``, a CP size other than the model's CP group's, no ``packed.packed_seq_params``, the keywords the
    adapter sets or a KV cache; with ``output="logprobs"``, for multi-token prediction and for a tree row."""

    def __init__(self, model: nn.Module, *, mask_kind: str = "auto", output: str = "logits", chunk_tokens: int = 256):
        super().__init__()
        if output not in OUTPUTS:
            raise PackingError(f"output={output!r} is invalid; expected one of {OUTPUTS}")
        _megatron_cpu.apply_cpu_patches()
        attention = [m for m in model.modules() if hasattr(m, "core_attention")]
        if attention and not all(isinstance(m.core_attention, PackedDotProductAttention) for m in attention):
            raise PackingError(
                f"model={type(model).__name__} has core attention {type(attention[0].core_attention).__name__}; "
                "build it with nn_data.adapters.megatron_gpt_layer_spec(...) so that it takes packed input"
            )
        self.model = model
        self.mask_kind = mask_kind
        self.pg_collection = getattr(model, "pg_collection", None)
        self.takes_padding_mask = "padding_mask" in inspect.signature(model.forward).parameters
        self._attention = attention
        groups = [m.pg_collection.cp for m in attention]
        if self.pg_collection is not None:
            groups.append(self.pg_collection.cp)
        self._cp_groups = {id(g): g for g in groups}
        self.output, self.head = output, None
        if output == "logprobs":
            if getattr(model.config, "mtp_num_layers", None):
                raise PackingError("output='logprobs' does not support multi-token prediction layers "
                                   f"(mtp_num_layers={model.config.mtp_num_layers})")
            from nn_data.logprobs import TokenLogProbsFromHidden

            self.head = TokenLogProbsFromHidden(cp_group=model.pg_collection.cp, tp_group=model.pg_collection.tp,
                                                chunk_tokens=chunk_tokens,
                                                sequence_parallel=model.config.sequence_parallel, validate=False,
                                                host_reads=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, packed, **model_kwargs) -> torch.Tensor:
        _check_model_kwargs(model_kwargs)
        params = packed.packed_seq_params
        runtime = None if params is None else _microbatch_cp_group(params)
        if runtime is None:
            self._check_cp(packed.cp_size)
        if params is None:
            raise PackingError("MegatronGPTAdapter needs THD PackedSeqParams: wrap it in "
                               "PackedForward(..., make_packed_seq_params=True)")
        dtype = next(self.model.parameters()).dtype
        prefix = packed.prefix
        mask = document_mask(packed.query_index, packed.segment_ids, kind=self.mask_kind, dtype=dtype,
                             gather=packed.gather, prefix=None if prefix is None else prefix.rule)
        params = rotary_from_sequence_start(params, packed.segment_ids.shape[0])
        if self.takes_padding_mask and "padding_mask" not in model_kwargs:
            model_kwargs["padding_mask"] = packed.padding_mask  # [1, Tq] bool, True at padding
        if prefix is not None:
            return self._shared_prefix(input_ids, position_ids, mask, packed, model_kwargs)
        with self._rotary_over(runtime):
            if self.head is not None and self.model.post_process:
                return self._logprobs(input_ids, position_ids, mask, params, packed, model_kwargs)
            return self.model(input_ids, position_ids, mask, packed_seq_params=params, **model_kwargs)

    def _shared_prefix(self, input_ids, position_ids, mask, packed, model_kwargs) -> torch.Tensor:
        """A tree row: no ``PackedSeqParams``, the rotary embedding at ``position_ids`` (:func:`rotary_at_positions`),
        the attention under ``mask`` (the prefix rule)."""
        if self.head is not None:
            raise PackingError("output='logprobs' scores each packed segment's next tokens, but a shared-prefix "
                               "row's prompt is scored against every response of its group: use output='logits' "
                               "(or nn_data.logprobs.TreeLogProbsFromHidden on the hidden "
                               "states)")
        with rotary_at_positions(self.model, position_ids[0], packed.segment_ids.shape[0]):
            return self.model(input_ids, position_ids, mask, packed_seq_params=None, **model_kwargs)

    @contextlib.contextmanager
    def _rotary_over(self, group):
        """For the forward, each attention module's ``pg_collection`` a copy whose ``cp`` is ``group`` (a dynamic-CP
        microbatch's; None: nothing changes); docs/dynamic-cp.md, "megatron-core"."""
        if group is None or ROPE_TAKES_RUNTIME_GROUP or all(g is group for g in self._cp_groups.values()):
            yield
            return
        if self.model.config.recompute_granularity is not None:
            raise PackingError(
                f"this microbatch runs over a CP group of {group.size()} ranks (dynamic CP) but megatron-core's "
                "attention applies rotary embeddings with its static pg_collection.cp (Megatron-LM #6821), and "
                f"activation recompute (recompute_granularity={self.model.config.recompute_granularity!r}) re-runs "
                "that forward where nn_data cannot hand it the microbatch's group; set recompute_granularity=None "
                "for dynamic CP, or use a megatron-core release whose attention passes packed_seq_params.cp_group "
                "to apply_rotary_pos_emb")
        saved = [(m, m.pg_collection) for m in self._attention]
        try:
            for m, collection in saved:
                redirected = copy.copy(collection)
                redirected.cp = group
                m.pg_collection = redirected
            yield
        finally:
            for m, collection in saved:
                m.pg_collection = collection

    def _logprobs(self, input_ids, position_ids, mask, params, packed, model_kwargs) -> torch.Tensor:
        """The last stage's log-probs ``[1, Tq]``: the decoder's hidden states (``post_process`` off), then the head."""
        if packed.bounds.cu_seqlens is None:
            raise PackingError("output='logprobs' needs packed.bounds.cu_seqlens (the real boundaries): run the "
                               "adapter inside PackedForward")
        self.model.post_process = False
        try:
            hidden = self.model(input_ids, position_ids, mask, packed_seq_params=params, **model_kwargs)  # [Tq, 1, E]
        finally:
            self.model.post_process = True
        model = self.model
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights \
            else model.output_layer.weight
        ids = input_ids if packed.gather is None else packed.gather(input_ids[..., None])[..., 0]  # [1, T]
        return self.head.local(hidden, weight, ids, packed.bounds.cu_seqlens, packed.cu_seqlens_padded)  # [1, Tq]

    @property
    def module(self) -> nn.Module:
        """The wrapped model: megatron-core's schedules find ``config`` and ``set_input_tensor`` through ``.module``."""
        return self.model

    def _check_cp(self, cp_size: int) -> None:
        for group in self._cp_groups.values():
            size = group.size() if group is not None else 1
            if size != cp_size:
                raise PackingError(
                    f"PackedForward splits over cp_size={cp_size} ranks but the model's context-parallel group "
                    f"(model.pg_collection.cp, which megatron-core's rotary embedding uses) has {size}; wrap it as "
                    "PackedForward(adapter, pg_collection=adapter.pg_collection, ...) or pass that group as cp_group= "
                    "(parallel_state.get_context_parallel_group() for a model built from parallel_state)"
                )


def _microbatch_cp_group(params):
    """The CP group a dynamic-CP microbatch runs over (``params.cp_group``, one rank for ``local_cp_size`` 1), or
    None for static CP (no ``local_cp_size``)."""
    size = getattr(params, "local_cp_size", None)
    if size is None:
        return None
    if size == 1:
        return OneRankGroup()
    group = params.cp_group
    if group is None or group.size() != size:
        raise PackingError(f"PackedSeqParams say local_cp_size={size} but cp_group has "
                           f"{None if group is None else group.size()} ranks; pass the microbatch's group of "
                           f"{size} ranks (nn_data.dynamic_cp builds both)")
    return group


def rotary_from_sequence_start(params, total: int):
    """A shallow copy of ``params`` (THD ``PackedSeqParams`` over ``total`` = T tokens) with ``max_seqlen_q``/``_kv``
    ``T + 1``, so that megatron-core's THD rotary embedding rotates every sequence from position 0, as alone
    (with ``T`` it rotates by packed position; docs/design.md, "megatron-core").

    Example: T = 40, boundaries ``[0, 16, 40]``: a table of 41 rows, the second sequence's tokens take rows 0..23
    (its own positions), not 16..39."""
    out = copy.copy(params)
    out.max_seqlen_q = out.max_seqlen_kv = int(total) + 1
    return out


@contextlib.contextmanager
def rotary_at_positions(model: nn.Module, positions: torch.Tensor, total: int):
    """Inside the block ``model.rotary_pos_emb`` returns the rotation at ``positions [Tq]`` (``[Tq, 1, 1, D]``, rows of
    its table ``get_emb(T)``, clamped into ``[0, T)``: padding counts on past a rollout), whatever length it is
    asked for. A model without a rotary embedding is left as it is; another position embedding (yarn, mrope)
    raises :class:`PackingError`."""
    rope = getattr(model, "rotary_pos_emb", None)
    kind = getattr(model, "position_embedding_type", "rope")
    if rope is None:
        yield
        return
    if kind != "rope":
        raise PackingError(f"position_embedding_type={kind!r}: shared-prefix rows support 'rope' or 'none'")
    table = rope.get_emb(int(total)).index_select(0, positions.clamp(0, max(int(total) - 1, 0)))  # [Tq, 1, 1, D]
    rope.forward = lambda *args, **kwargs: table  # an instance attribute: nn.Module.__call__ takes it
    try:
        yield
    finally:
        del rope.forward


def _check_model_kwargs(model_kwargs: dict) -> None:
    """Refuses by name the keywords the adapter sets (``attention_mask``, ``packed_seq_params``) and a KV cache
    (``inference_context``, ``inference_params``: it would hold every document's keys and values together)."""
    taken = [k for k in ("attention_mask", "packed_seq_params") if k in model_kwargs]
    if taken:
        raise PackingError(f"MegatronGPTAdapter: the model keyword {taken[0]} is set by nn_data from the packed layout "
                           "(the document mask, the THD boundaries); leave out " + ", ".join(taken))
    cache = [k for k in ("inference_context", "inference_params") if model_kwargs.get(k) is not None]
    if cache:
        raise PackingError(f"MegatronGPTAdapter: {cache[0]} (a KV cache) cannot keep packed documents apart: it would "
                           "hold every document's keys and values together; leave it out (run inference on each "
                           "sequence unpacked)")
