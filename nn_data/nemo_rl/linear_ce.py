"""NeMo-RL's log-probs from hidden states (its linear-CE fusion) on nn_data's fused head, with context parallelism:
docs/logprobs.md, "NeMo-RL's linear-CE fusion, with context parallelism".

    # from nemo_rl.distributed.model_utils import from_parallel_hidden_states_to_logprobs
    from nn_data.nemo_rl.model_utils import from_parallel_hidden_states_to_logprobs

Shape legend
    B   rows (sequences); ``cu_seqlens_padded`` has B+1 entries
    S   row length (unpacked rows: ``target.shape[1]``; packed: ``unpacked_seqlen``)
    T   packed tokens; C context-parallel size; TP tensor-parallel size
    H   hidden size (sequence-first states: ``[S/C, B, H]``, packed ``[T/C, 1, H]``, ``/TP`` more with SP)
    Vt  ``V / TP`` rows of the output weight on a TP rank

:func:`patch_gpt_model_forward_for_linear_ce_fusion` makes megatron-core's ``GPTModel.forward`` return these log-probs
(no logits) under NeMo-RL's keyword, context parallelism included (docs/nemo-rl.md, "The linear-CE fusion under
context parallelism")."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from nn_data import GatherFromContextParallel
from nn_data.logprobs import hidden_logprobs_local
from nn_data.extension import checks, hidden_rows, megatron, process_groups
from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.nemo_rl.logprob_steps import (
    DEFAULT_CHUNK_TOKENS, chunk_and_filter, gather_cp, grad_mode, groups, in_vocab, nemo_rl_rows,
    out_of_vocab_as_nemo_rl, packed_logprobs, row_layout,
)

HIDDEN = "tensor_parallel_hidden_states"
WEIGHT = "output_weight_layer"
ROWS_SHAPE = "[S // CP, B, H] ([S // (CP * TP), B, H] with sequence parallelism)"
PACKED_SHAPE = "[T // CP, 1, H] or [1, T // CP, H] (// TP more with sequence parallelism)"


def from_parallel_hidden_states_to_logprobs(
    tensor_parallel_hidden_states: torch.Tensor,
    output_weight_layer: torch.Tensor,
    runtime_gather_output: Optional[bool],
    target: torch.Tensor,
    vocab_start_index: int, vocab_end_index: int, tp_group: Optional["dist.ProcessGroup"],
    inference_only: bool = False, cp_group: Optional["dist.ProcessGroup"] = None, chunk_size: Optional[int] = None,
    *,
    pg_collection=None,
) -> torch.Tensor:
    """Log-probs ``[B, S-1]`` of unpacked rows from hidden states ``[S/C, B, H]``: NeMo-RL's function.

    ``target [B, S]`` holds the whole rows; ``runtime_gather_output`` is accepted and unused, as in NeMo-RL;
    ``chunk_size`` positions of every row per chunk (None: 256 tokens); ``pg_collection`` (keyword-only) stands for
    the groups passed as None.

    Example (V 3, zero weight): ``target [[0, 1, 2]]`` -> ``[[log(1/3), log(1/3)]]``.

    Raises :class:`~nn_data.errors.PackingError`: hidden states not floating point 3-D, a weight whose columns are not
    ``H``, a vocabulary slice not this TP rank's, ``target`` not integer ``[B, S]`` matching the shard, an odd row
    shard under CP, ``chunk_size`` below 1, a group this process is not in."""
    cp, tp = groups(cp_group, tp_group, pg_collection)
    hidden, weight = tensor_parallel_hidden_states, output_weight_layer
    checks.check_output_head(HIDDEN, hidden, WEIGHT, weight, ROWS_SHAPE)
    chunk = _chunk_tokens(chunk_size, vocab_start_index, vocab_end_index, weight, tp, hidden.shape[1])
    batch = hidden.shape[1]
    checks.check_row_target(target, batch, target.shape[1] if isinstance(target, torch.Tensor) else 0)
    seq = target.shape[1]
    sequence_parallel = _sequence_parallel(hidden.shape[0], seq, cp, tp)
    local_len = seq // cp.size  # S_loc
    checks.check_even_shard(HIDDEN, local_len, cp.size, "row")
    checks.check_same_device(**{HIDDEN: hidden, "target": target})
    with grad_mode(inference_only):
        layout = row_layout(1, seq, target.device, op="from_parallel_hidden_states_to_logprobs")  # [0, S]
        source = layout.local_places(cp.size, cp.rank).source  # [S_loc] row positions on this rank
        # position p of row b scores target[b, p + 1]; values run position-major, as the hidden states:
        # S 8, C 2, rank 1 -> positions [2, 3, 4, 5] score targets [3, 4, 5, 6] of every row
        token = target.to(torch.int64).index_select(1, (source + 1).clamp(max=max(seq - 1, 0)))  # [B, S_loc]
        token = token.T.reshape(-1)  # [S_loc*B]
        keep = (source + 1 < seq)[:, None].expand(local_len, batch).reshape(-1)  # [S_loc*B]
        values = _values(hidden.reshape(-1, hidden.shape[-1]), weight, token, keep, vocab_start_index, tp,
                         sequence_parallel, chunk)  # [S_loc*B]
        full = gather_cp(values.view(local_len, batch), layout, cp)  # [1, S, B]
        return full[0].T[:, :-1]  # [B, S-1]


def from_parallel_hidden_states_to_logprobs_packed_sequences(
    tensor_parallel_hidden_states: torch.Tensor,
    output_weight_layer: torch.Tensor,
    # the unfused function's arguments from here on (its names, order and defaults)
    target: torch.Tensor, cu_seqlens_padded: torch.Tensor, unpacked_seqlen: int,
    vocab_start_index: int, vocab_end_index: int, group: Optional["dist.ProcessGroup"],
    inference_only: bool = False, cp_group: Optional["dist.ProcessGroup"] = None, chunk_size: Optional[int] = None,
    sampling_params=None, target_is_pre_rolled: bool = False,
    *,
    validate: bool = True, pg_collection=None,
) -> torch.Tensor:
    """Log-probs ``[B, S-1]`` from this rank's packed hidden states ``[T/C, 1, H]`` and the output weight, in place of
    the logits of ``from_parallel_logits_to_logprobs_packed_sequences`` (every other argument is that function's).

    Raises :class:`~nn_data.errors.PackingError` as :func:`from_parallel_hidden_states_to_logprobs` for the hidden states
    and the weight, and as the unfused function for everything else."""
    cp, tp = groups(cp_group, group, pg_collection)
    seq_len = checks.positive_int("unpacked_seqlen", unpacked_seqlen)
    with grad_mode(inference_only):
        packed, layout = packed_hidden_logprobs(
            tensor_parallel_hidden_states, output_weight_layer, target, cu_seqlens_padded, seq_len, vocab_start_index,
            vocab_end_index, cp, tp, chunk_size=chunk_size, sampling_params=sampling_params,
            pre_rolled=target_is_pre_rolled, validate=validate,
            op="from_parallel_hidden_states_to_logprobs_packed_sequences")  # [1, T]
        return nemo_rl_rows(packed, layout, seq_len)  # [B, S-1]


def packed_hidden_logprobs(hidden, weight, target, cu_seqlens_padded, seq_len: int, vocab_start_index: int,
                           vocab_end_index: int, cp: process_groups.ParallelInfo, tp: process_groups.ParallelInfo, *, chunk_size, sampling_params,
                           pre_rolled: bool, validate: bool, op: str):
    """``(packed [1, T], layout)`` from the hidden states: their and the weight's checks, then
    :func:`~nn_data.nemo_rl.logprob_steps.packed_logprobs`."""
    checks.check_output_head(HIDDEN, hidden, WEIGHT, weight, PACKED_SHAPE)
    if 1 not in hidden.shape[:2]:
        raise PackingAssertionError(f"{HIDDEN} must be {PACKED_SHAPE}, got shape {tuple(hidden.shape)}")
    rows = hidden_rows(hidden)  # [n, H]
    chunk, filt = chunk_and_filter(chunk_size, sampling_params, vocab_start_index, vocab_end_index, weight.shape[0],
                                   tp, against=WEIGHT, unit="rows")
    checks.check_packed_ids("target", target)
    total = target.shape[1] * (cp.size if pre_rolled else 1)
    sequence_parallel = _sequence_parallel(rows.shape[0], total, cp, tp)
    return packed_logprobs(
        op=op, name=HIDDEN, data=hidden, target=target, cu_seqlens_padded=cu_seqlens_padded, total=total,
        seq_len=seq_len, cp=cp, pre_rolled=pre_rolled, validate=validate, vocab=weight.shape[0] * tp.size,
        score=lambda token, keep: _kernel(rows, weight, token, keep, vocab_start_index, tp, sequence_parallel, chunk,
                                          filt),
    )


class ChunkedDistributedHiddenStatesToLogprobs:
    """``apply(tensor_parallel_hidden_states [S, B, H], target [B, S], output_weight_layer [Vt, H], vocab_start_index,
    vocab_end_index, chunk_size, tp_group, inference_only=False) -> [B, S]``: NeMo-RL's autograd function, ``log
    softmax(hidden @ weight.T)`` at every position for the rolled ``target``; no CP."""

    @staticmethod
    def apply(tensor_parallel_hidden_states, target, output_weight_layer, vocab_start_index, vocab_end_index,
              chunk_size, tp_group, inference_only=False, *, pg_collection=None):
        tp = process_groups.given_group_info(tp_group, pg_collection=pg_collection, field="tp")
        hidden, weight = tensor_parallel_hidden_states, output_weight_layer
        checks.check_output_head(HIDDEN, hidden, WEIGHT, weight, "[S, B, H] ([S // TP, B, H] with sequence "
                                                                  "parallelism)")
        batch = hidden.shape[1]
        chunk = _chunk_tokens(chunk_size, vocab_start_index, vocab_end_index, weight, tp, batch)
        checks.check_row_target(target, batch, target.shape[1] if isinstance(target, torch.Tensor) else 0)
        seq = target.shape[1]
        sequence_parallel = _sequence_parallel(hidden.shape[0], seq, process_groups.SINGLE, tp)
        with grad_mode(inference_only):
            token = target.to(torch.int64).T.reshape(-1)  # [S*B] position-major, as the hidden states
            keep = torch.ones_like(token, dtype=torch.bool)
            values = _values(hidden.reshape(-1, hidden.shape[-1]), weight, token, keep, vocab_start_index, tp,
                             sequence_parallel, chunk)  # [S*B]
            return values.view(seq, batch).T  # [B, S]


def _chunk_tokens(chunk_size, vocab_start_index, vocab_end_index, weight, tp: process_groups.ParallelInfo, batch: int) -> int:
    """Tokens per chunk: NeMo-RL's ``chunk_size`` counts positions of every row (``chunk_size * B`` tokens);
    None: 256 tokens. Checks the vocabulary slice against the weight's rows."""
    chunk, _ = chunk_and_filter(chunk_size, None, vocab_start_index, vocab_end_index, weight.shape[0], tp,
                                against=WEIGHT, unit="rows")
    return DEFAULT_CHUNK_TOKENS if chunk_size is None else chunk * max(batch, 1)


def _sequence_parallel(rows: int, positions: int, cp: process_groups.ParallelInfo, tp: process_groups.ParallelInfo) -> bool:
    """Whether ``rows`` hidden states are this rank's ``1/(C*TP)`` of ``positions`` rather than its ``1/C``.

    Example: 32 positions, C 2, TP 2: 16 rows -> False, 8 rows -> True, 12 rows -> PackingError."""
    if rows * cp.size == positions:
        return False
    if tp.size > 1 and rows * cp.size * tp.size == positions:
        return True
    shares = f"{positions}/{cp.size} = {positions / cp.size:g}"
    if tp.size > 1:
        shares += f" (or {positions}/{cp.size * tp.size} = {positions / (cp.size * tp.size):g} with sequence parallelism)"
    raise PackingAssertionError(
        f"{HIDDEN} hold {rows} positions per row but this rank's share of the {positions} positions of target is "
        f"{shares} (cp_size={cp.size}, tp_size={tp.size}); pass this rank's zigzag shard of the hidden states"
    )


def _kernel(rows, weight, token, keep, vocab_start: int, tp: process_groups.ParallelInfo, sequence_parallel: bool, chunk: int,
            filt=None) -> torch.Tensor:
    """The fused kernel's ``[N]`` values (:func:`nn_data.logprobs.hidden_logprobs_local`)."""
    return hidden_logprobs_local(rows, weight, token, keep, vocab_start=vocab_start, tp_group=tp.group,
                                 tp_size=tp.size, sequence_parallel=sequence_parallel, chunk_tokens=chunk,
                                 sampling=filt)


def _values(rows, weight, token, keep, vocab_start: int, tp: process_groups.ParallelInfo, sequence_parallel: bool, chunk: int,
            filt=None) -> torch.Tensor:
    """The fused kernel's ``[N]`` values with NeMo-RL's rule for a target outside the vocabulary."""
    values = _kernel(rows, weight, token, keep, vocab_start, tp, sequence_parallel, chunk, filt)
    return out_of_vocab_as_nemo_rl(values, in_vocab(token, weight.shape[0] * tp.size))


def patch_gpt_model_forward_for_linear_ce_fusion(*, chunk_size: int) -> None:
    """Patch megatron-core's ``GPTModel.forward`` (the class) so that ``return_logprobs_for_linear_ce_fusion=True`` returns
    log-probs, ``chunk_size`` positions of every row per chunk; calling it again updates the chunk size."""
    model_class = megatron.gpt_model_class()
    if not getattr(model_class, "_linear_ce_fusion_forward_patched", False):
        model_class._original_forward_for_linear_ce_fusion = model_class.forward
        model_class._linear_ce_fusion_forward_patched = True
    model_class._linear_ce_fusion_chunk_size = chunk_size
    model_class.forward = _gpt_forward_with_linear_ce_fusion


def _gpt_forward_with_linear_ce_fusion(
    self,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    decoder_input: torch.Tensor = None,
    labels: torch.Tensor = None,
    inference_context: Any = None,
    packed_seq_params: Any = None,
    extra_block_kwargs: Optional[dict] = None,
    runtime_gather_output: Optional[bool] = None,
    *,
    inference_params: Optional[Any] = None,
    loss_mask: Optional[torch.Tensor] = None,
    padding_mask: Optional[torch.Tensor] = None,
    is_spec_decode: Optional[bool] = None,
    return_logprobs_for_linear_ce_fusion: bool = False,
) -> torch.Tensor:
    """``GPTModel.forward`` with NeMo-RL's switch: log-probs ``[B, S-1]`` (rows) or ``[1, T-1]`` (packed)."""
    if not return_logprobs_for_linear_ce_fusion:
        passthrough = {} if is_spec_decode is None else {"is_spec_decode": is_spec_decode}
        return self._original_forward_for_linear_ce_fusion(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
            decoder_input=decoder_input, labels=labels, inference_context=inference_context,
            packed_seq_params=packed_seq_params, extra_block_kwargs=extra_block_kwargs,
            runtime_gather_output=runtime_gather_output, inference_params=inference_params, loss_mask=loss_mask,
            padding_mask=padding_mask, **passthrough,
        )
    if labels is None:
        raise PackingAssertionError("labels must be provided when linear CE fusion is enabled (the token ids: "
                                    "labels=input_ids, as NeMo-RL's model_forward passes them)")
    if inference_context is None:
        inference_context = inference_params  # megatron-core's renamed argument
    hidden = _decoder_hidden_states(self, input_ids, position_ids, attention_mask, decoder_input, inference_context,
                                    packed_seq_params, extra_block_kwargs, padding_mask)
    if not self.post_process or not hasattr(self, "output_layer"):
        return hidden  # an earlier pipeline stage: the hidden states go to the next one
    weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
        else self.output_layer.weight
    cp, tp = process_groups.group_info(self.cp_group, "context-parallel group"), process_groups.group_info(self.pg_collection.tp,
                                                                             "tensor-parallel group")
    rows = weight.shape[0]
    vocab = (tp.rank * rows, (tp.rank + 1) * rows)  # this rank's slice: NeMo-RL's (vocab_size // TP) split
    inference_only = inference_context is not None and not self.training
    chunk = self._linear_ce_fusion_chunk_size
    local = hidden.shape[0] * _split(self, tp)  # this CP rank's positions: T/C (packed) or S/C (each row)
    with grad_mode(inference_only):  # no graph in inference, and an outer no_grad() holds
        if cp.size > 1 and labels.shape[1] == local:  # CP-sharded labels, as NeMo-RL passes the input ids
            labels = _gather_labels(labels, packed_seq_params, cp)
        if _is_thd(packed_seq_params):
            packed = packed_hidden_logprobs(hidden, weight, labels, _boundaries(packed_seq_params), labels.shape[1],
                                            *vocab, cp, tp, chunk_size=chunk, sampling_params=None, pre_rolled=False,
                                            validate=False, op="GPTModel.forward (linear CE fusion)")[0]  # [1, T]
            return packed[:, :-1]  # [1, T-1]
        return from_parallel_hidden_states_to_logprobs(hidden, weight, runtime_gather_output, labels, *vocab, tp.group,
                                                       cp_group=cp.group, chunk_size=chunk)


def _decoder_hidden_states(model, input_ids, position_ids, attention_mask, decoder_input, inference_context,
                           packed_seq_params, extra_block_kwargs, padding_mask) -> torch.Tensor:
    """The embedding and the decoder as megatron-core's ``GPTModel.forward`` runs them: ``[T/C, B, H]``."""
    out = model._preprocess(input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input,
                            inference_context=inference_context, packed_seq_params=packed_seq_params,
                            padding_mask=padding_mask)
    decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset, padding_mask = out[:6]
    return model.decoder(
        hidden_states=decoder_input, attention_mask=attention_mask, inference_context=inference_context,
        rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
        rotary_pos_cos_sin=out[6] if len(out) == 7 else None, packed_seq_params=packed_seq_params,
        sequence_len_offset=sequence_len_offset, padding_mask=padding_mask, **(extra_block_kwargs or {}),
    )


def _split(model, tp) -> int:
    """How many ranks share one CP rank's positions of the hidden states: TP with sequence parallelism."""
    return tp.size if getattr(model.config, "sequence_parallel", False) else 1


def _is_thd(params) -> bool:
    return params is not None and getattr(params, "qkv_format", None) == "thd"


def _boundaries(params) -> torch.Tensor:
    """The padded boundaries of a THD ``PackedSeqParams`` (``cu_seqlens_q`` when it has no padded ones)."""
    padded = getattr(params, "cu_seqlens_q_padded", None)
    return padded if padded is not None else params.cu_seqlens_q


def _gather_labels(labels: torch.Tensor, params, cp) -> torch.Tensor:
    """This CP rank's labels -> every rank's, in order: packed ``[1, T/C] -> [1, T]`` (the zigzag of the
    packed segments) or rows ``[B, S/C] -> [B, S]`` (each row's zigzag); one all-gather of ints."""
    if _is_thd(params):
        gather = GatherFromContextParallel(cp.group, validate=False, host_reads=False)
        return gather(labels[..., None], _boundaries(params))[..., 0]  # [1, T]
    layout = row_layout(1, labels.shape[1] * cp.size, labels.device, op="GPTModel.forward (linear CE fusion)")
    return gather_cp(labels.T, layout, cp)[0].T  # [S/C, B] -> [1, S, B] -> [B, S]: each row one segment [0, S]
