"""NeMo-RL's two records of a processed microbatch (its fields, in its order), plus nn_data's
``padding_mask`` last (None unless packed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover - annotations only; megatron-core is imported lazily
    from megatron.core.packed_seq_params import PackedSeqParams

    from nn_data.nemo_rl.batched_data_dict import BatchedDataDict


@dataclass
class ProcessedInputs:
    """Processed microbatch inputs used for the model forward pass (NeMo-RL's fields), and nn_data's
    ``padding_mask``: packed microbatches only, bool in the layout of ``input_ids_cp_sharded``
    (``[1, T/C]``; ``[1, T]`` when the model slices CP itself), True at padding (each segment's slack
    and the extended last segment): what megatron-core's ``GPTModel.forward(padding_mask=)`` takes
    to keep padding out of MoE routing statistics."""

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
