"""NeMo-RL's two records of a processed microbatch (its fields, in its order), plus nn_data's
``padding_mask`` (None unless packed) and ``shared_prefix`` (None unless the microbatch was packed with
each group's prompt once: :class:`SharedPrefixRecord`) last."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover - annotations only; megatron-core is imported lazily
    from megatron.core.packed_seq_params import PackedSeqParams

    from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
    from nn_data.adapters.shared_prefix_kv import SharedPrefixKV
    from nn_data.extension import SharedPrefixLayout
    from nn_data.extension import PrefixRule


class SharedPrefixRecord(NamedTuple):
    """nn_data's part of a rollout-tree or shared-prefix microbatch's record (``ProcessedInputs.shared_prefix``).

    ``layout``: the :class:`~nn_data.layout.TreeLayout` (``SharedPrefixLayout``; the loss side's unpack and log-probs:
    :func:`~nn_data.nemo_rl.megatron_data.shared_prefix_model.from_parallel_logits_to_logprobs_shared_prefix`);
    ``prefix``: the attention's :class:`~nn_data.masks.PrefixRule` (global ``[T]`` tensors);
    ``segment_ids [T]`` (the slot of every packed position) and ``query_index [T/C]`` (the packed
    position of each local token); ``cp_size`` / ``cp_rank`` the split it was packed for; ``kv``: at
    ``C = 1`` the :class:`~nn_data.adapters.shared_prefix_kv.SharedPrefixKV` of a variable-length kernel
    (TransformerEngine's THD attention, :func:`~nn_data.adapters.shared_prefix_kv.tree_kv`): each node slot's keys
    and values are those of its rollout's path before it (a response's: its prompt's), then its own,
    ``kv.gather(key [T, *]) -> [K, *]``, ``K = kv.max_seqlen_kv`` (``T`` plus those path keys, exactly, or
    the run's ``cfg["nn_data"]["kv_capacity"]``, required under ``pad_full_seq_to`` so that the buffer has one
    shape per run: :func:`~nn_data.nemo_rl.megatron_data.shared_prefix.kv_capacity`); None under CP
    (TransformerEngine's CP splits keys and values as it splits the queries, which the buffer is not);
    ``kind``: the kind of microbatch (``"shared-prefix"``: GRPO groups, ``cfg["nn_data"]["shared_prefix"]``;
    ``"rollout-tree"``: ``cfg["nn_data"]["rollout_tree"]``)."""

    layout: SharedPrefixLayout
    prefix: PrefixRule
    segment_ids: torch.Tensor
    query_index: torch.Tensor
    cp_size: int
    cp_rank: int
    kv: Optional["SharedPrefixKV"] = None
    kind: str = "shared-prefix"


@dataclass
class ProcessedInputs:
    """Processed microbatch inputs used for the model forward pass (NeMo-RL's fields), and nn_data's
    ``padding_mask``: packed microbatches only, bool in the layout of ``input_ids_cp_sharded``
    (``[1, T/C]``; ``[1, T]`` when the model slices CP itself), True at padding (each segment's slack
    and the extended last segment): what megatron-core's ``GPTModel.forward(padding_mask=)`` takes
    to keep padding out of MoE routing statistics; ``shared_prefix``: a shared-prefix microbatch's layout,
    prefix rule and places (``cfg["nn_data"]["shared_prefix"]``, docs/nemo-rl.md), None otherwise."""

    input_ids: torch.Tensor
    input_ids_cp_sharded: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]
    packed_seq_params: Optional["PackedSeqParams"]
    cu_seqlens_padded: Optional[torch.Tensor]
    mtp_loss_mask: Optional[torch.Tensor] = None
    routed_experts: Optional[torch.Tensor] = None
    routed_experts_cp_sharded: Optional[torch.Tensor] = None
    media_token_validity_mask: Optional[torch.Tensor] = None
    padding_mask: Optional[torch.Tensor] = None
    shared_prefix: Optional["SharedPrefixRecord"] = None


@dataclass
class ProcessedMicrobatch:
    """A processed microbatch ready for the model forward: the raw ``data_dict`` plus the
    :class:`ProcessedInputs` fields (packed tensors, ``PackedSeqParams`` ... or, unpacked,
    the causal mask and position ids; nn_data's ``padding_mask`` as in :class:`ProcessedInputs`)."""

    data_dict: "BatchedDataDict[Any]"
    input_ids: torch.Tensor
    input_ids_cp_sharded: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]
    packed_seq_params: Optional["PackedSeqParams"]
    cu_seqlens_padded: Optional[torch.Tensor]
    mtp_loss_mask: Optional[torch.Tensor] = None
    routed_experts: Optional[torch.Tensor] = None
    routed_experts_cp_sharded: Optional[torch.Tensor] = None
    media_token_validity_mask: Optional[torch.Tensor] = None
    padding_mask: Optional[torch.Tensor] = None
    shared_prefix: Optional["SharedPrefixRecord"] = None
