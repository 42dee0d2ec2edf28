"""A rollout-tree or GRPO-groups microbatch through a megatron-core ``GPTModel`` and NeMo-RL's log-prob function.

Shape legend
    B   rollouts; S their row length (``unpacked_seqlen``)
    T   packed tokens; C context-parallel size; the model sees ``T/C`` local tokens
    V   vocabulary; ``Vt = V / TP`` on a tensor-parallel rank

The model must be built with :func:`nn_data.adapters.megatron_gpt_layer_spec` (nn_data's attention, which takes the
prefix rule); a stock model is refused by name (docs/nemo-rl.md, "Rollout trees and GRPO groups")."""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

from nn_data.layout import TreeLayout
from nn_data.extension import checks, process_groups
from nn_data.nemo_rl.assertions import PackingAssertionError


def _record(microbatch):
    record = getattr(microbatch, "shared_prefix", None)
    if record is None:
        raise PackingAssertionError("microbatch has no shared_prefix record: it was not packed with "
                                    "cfg['nn_data']['shared_prefix'] or ['rollout_tree'] (run the model on it as on any "
                                    "packed microbatch)")
    return record


def gpt_model(model):
    """``model`` without its wrappers (megatron-core's DDP, ``Float16Module``: each holds ``.module``)."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def check_prefix_attention(model, record) -> None:
    """:class:`PackingError` unless every attention layer of ``model`` runs nn_data's core attention, naming the class
    found and the other way to run the ``record``'s microbatch."""
    from nn_data.adapters import PackedDotProductAttention

    cores = [m.core_attention for m in model.modules() if hasattr(m, "core_attention")]
    stock = sorted({type(c).__name__ for c in cores if not isinstance(c, PackedDotProductAttention)})
    if not stock and cores:
        return
    found = ", ".join(stock or ["no attention layer"])
    tree = record.kind == "rollout-tree"
    sees = ("each node sees the shared tokens of every ancestor" if tree else "each response sees its group's prompt")
    key = "cfg['nn_data']['rollout_tree']" if tree else "cfg['nn_data']['shared_prefix']"
    if record.kv is not None:
        other = ("; a variable-length kernel of the model's own runs it exactly on the record's key/value buffer "
                 "(microbatch.shared_prefix.kv.gather(key) / .gather(value) with microbatch.packed_seq_params, "
                 "bottom-right causal: docs/nemo-rl.md), never on the T packed keys")
    elif record.info.cp_size == 1:
        other = ("; the microbatch has no key/value buffer for a variable-length kernel: under pad_full_seq_to set "
                 "cfg['nn_data']['kv_capacity'] to the buffer's one length for the run (docs/nemo-rl.md)")
    else:
        other = (f"; at cp_size={record.info.cp_size} there is no key/value buffer for a variable-length kernel "
                 "(TransformerEngine's context parallelism splits keys and values as it splits the queries), so "
                 "nn_data's attention is the only way")
    raise PackingAssertionError(f"a {record.kind} microbatch needs nn_data's attention ({sees}, which the packed row "
                                f"holds once); model={type(model).__name__} has core attention {found}, which cannot "
                                "honour the prefix rule: build the GPTModel with "
                                f"nn_data.adapters.megatron_gpt_layer_spec(...), or unset {key}{other}")


#: What :func:`forward_shared_prefix` returns.
OUTPUTS = ("logits", "hidden")


def forward_shared_prefix(model, microbatch, *, cp_group=None, mask_kind: str = "auto", output: str = "logits",
                          **model_kwargs) -> torch.Tensor:
    """The model's output for a tree microbatch's local tokens, equal at every real token to the rollout run alone.

    Args:
        model: a ``GPTModel`` built with :func:`~nn_data.adapters.megatron_gpt_layer_spec` (or a wrapper with ``.module``).
        microbatch: what the iterators yield, with ``shared_prefix``.
        cp_group: the CP group it was sharded over (default the model's ``pg_collection.cp``).
        mask_kind: passed to :class:`~nn_data.adapters.MegatronGPTAdapter`.
        output: ``"logits"`` (``[1, T/C, V]``) or ``"hidden"`` (final-normed ``[T/C, 1, H]``).
        model_kwargs: go to the model.

    Raises :class:`PackingError` for a model without nn_data's attention, a microbatch without the record, a CP group
    whose size is not the record's, and an unknown ``output``."""
    from nn_data.adapters import MegatronGPTAdapter

    if output not in OUTPUTS:
        raise PackingAssertionError(f"output={output!r} is invalid; expected one of {OUTPUTS}")
    record = _record(microbatch)
    inner = gpt_model(model)
    check_prefix_attention(inner, record)
    adapter = MegatronGPTAdapter(inner, mask_kind=mask_kind)
    group = cp_group if cp_group is not None else getattr(adapter.pg_collection, "cp", None)
    info = packed_info(record, microbatch, group)
    if output == "logits":
        return adapter(microbatch.input_ids_cp_sharded, microbatch.position_ids, info, **model_kwargs)
    last = inner.post_process
    inner.post_process = False  # megatron-core's GPTModel then returns the final-normed hidden states
    try:
        return adapter(microbatch.input_ids_cp_sharded, microbatch.position_ids, info, **model_kwargs)
    finally:
        inner.post_process = last


def packed_info(record, microbatch, cp_group):
    """The record's :class:`~nn_data.packed_forward.PackedInfo` with the model call's parts (the CP key/value gather, the
    microbatch's ``PackedSeqParams`` and the row length)."""
    from nn_data import GatherFromContextParallel

    size = 1 if cp_group is None else cp_group.size()
    if size != record.info.cp_size:
        raise PackingAssertionError(f"the microbatch was packed for cp_size={record.info.cp_size} but cp_group has {size} "
                                    "rank(s); pass the group it was sharded over (pg_collection.cp)")
    gather = None
    if record.info.cp_size > 1:
        op = GatherFromContextParallel(cp_group, grad_mode="sum", validate=False, host_reads=False)  # keys/values: gradients sum
        gather = functools.partial(op, layout=record.layout.layout)  # [1, T/C, *] -> [1, T, *]
    return record.info.finished(gather=gather, packed_seq_params=microbatch.packed_seq_params,
                                row_len=record.layout.row_len)


def from_parallel_logits_to_logprobs_shared_prefix(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    shared_prefix,
    unpacked_seqlen: int,
    vocab_start_index: int,
    vocab_end_index: int,
    group: Optional["torch.distributed.ProcessGroup"],
    inference_only: bool = False,
    cp_group: Optional["torch.distributed.ProcessGroup"] = None,
    chunk_size: Optional[int] = None,
    *,
    pg_collection=None,
) -> torch.Tensor:
    """Rollout log-probs ``[B, S-1]`` of a tree microbatch from this rank's packed logits ``[1, T/C, Vt]`` (no host read).

    ``from_parallel_logits_to_logprobs_packed_sequences``' arguments with ``shared_prefix`` (the record or its
    ``TreeLayout``) in place of ``cu_seqlens_padded``: ``out[b, s] = log p(x[b, s+1] | x[b, :s+1])`` for
    ``s < L[b] - 1``, else 0, as if rollout b ran alone (:class:`nn_data.logprobs.TreeLogProbs`).

    Raises :class:`PackingError` as that op, for ``unpacked_seqlen`` or ``chunk_size`` below 1, and a vocabulary slice
    that is not this TP rank's."""
    from nn_data.logprobs import TreeLogProbs

    layout, seq_len, chunk = _call_args(shared_prefix, unpacked_seqlen, chunk_size)
    tp = process_groups.given_group_info(group, pg_collection=pg_collection, field="tp")
    checks.check_float_logits("vocab_parallel_logits", vocab_parallel_logits, "[1, T // CP, vocab_size // TP]", 3)
    checks.check_vocab_range(vocab_start_index, vocab_end_index, vocab_parallel_logits.shape[-1], tp.rank)
    op = TreeLogProbs(cp_group=cp_group, tp_group=group, pg_collection=pg_collection, chunk_tokens=chunk)
    with torch.no_grad() if inference_only else contextlib.nullcontext():
        return op(vocab_parallel_logits, target, layout, seq_len=seq_len)


def from_parallel_hidden_states_to_logprobs_shared_prefix(
    tensor_parallel_hidden_states: torch.Tensor,
    output_weight_layer: torch.Tensor,
    target: torch.Tensor,
    shared_prefix,
    unpacked_seqlen: int,
    vocab_start_index: int,
    vocab_end_index: int,
    group: Optional["torch.distributed.ProcessGroup"],
    inference_only: bool = False,
    cp_group: Optional["torch.distributed.ProcessGroup"] = None,
    chunk_size: Optional[int] = None,
    *,
    pg_collection=None,
) -> torch.Tensor:
    """:func:`from_parallel_logits_to_logprobs_shared_prefix` from hidden states ``[T/C, 1, H]`` and the output weight
    ``[V/TP, H]`` without ``[T, V]`` logits (:class:`nn_data.logprobs.TreeLogProbsFromHidden`); raises as it."""
    from nn_data.logprobs import TreeLogProbsFromHidden

    layout, seq_len, chunk = _call_args(shared_prefix, unpacked_seqlen, chunk_size)
    tp = process_groups.given_group_info(group, pg_collection=pg_collection, field="tp")
    checks.check_vocab_range(vocab_start_index, vocab_end_index, output_weight_layer.shape[0], tp.rank,
                              against="output_weight_layer", unit="rows")
    op = TreeLogProbsFromHidden(cp_group=cp_group, tp_group=group, pg_collection=pg_collection,
                                        chunk_tokens=chunk)
    with torch.no_grad() if inference_only else contextlib.nullcontext():
        return op(tensor_parallel_hidden_states, output_weight_layer, target, layout, seq_len=seq_len)


def _call_args(shared_prefix, unpacked_seqlen, chunk_size) -> tuple:
    """``(TreeLayout, S, tokens per chunk)`` of a log-prob call, each checked."""
    layout = shared_prefix if isinstance(shared_prefix, TreeLayout) else getattr(shared_prefix, "layout", None)
    if not isinstance(layout, TreeLayout):
        raise PackingAssertionError(f"shared_prefix must be a microbatch's shared_prefix record or its TreeLayout, "
                                    f"got {type(shared_prefix).__name__}")
    seq_len = checks.positive_int("unpacked_seqlen", unpacked_seqlen)
    return layout, seq_len, checks.positive_int("chunk_size", chunk_size, allow_none=True) or 256
