"""NeMo-RL's ``patch_gpt_model_forward_for_linear_ce_fusion``: megatron-core's ``GPTModel.forward`` returns log-probs
from the last hidden states (no logits) when called with ``return_logprobs_for_linear_ce_fusion=True``.

Shape legend
    B   rows; T packed tokens; C context-parallel size; TP tensor-parallel size; H hidden size

The same keyword and class attributes as NeMo-RL's; packed rows are scored within each padded segment, context
parallelism works, and the groups are the model's own: docs/nemo-rl.md, "The linear-CE fusion under context
parallelism"."""

from __future__ import annotations

from typing import Any, Optional

import torch

from nn_data import GatherFromContextParallel
from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.extension import megatron, process_groups
from nn_data.nemo_rl.linear_ce import from_parallel_hidden_states_to_logprobs, packed_hidden_logprobs
from nn_data.nemo_rl.logprob_steps import gather_cp, grad_mode, row_layout


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
