"""NeMo-RL's two records of a processed microbatch (its fields, in its order), plus nn_data's ``padding_mask``
and ``shared_prefix`` (:class:`TreeRecord`) last."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover - annotations only; megatron-core is imported lazily
    from megatron.core.packed_seq_params import PackedSeqParams

    from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
    from nn_data.adapters.tree_kv import TreeKV
    from nn_data.layout import TreeLayout


class TreeRecord(NamedTuple):
    """nn_data's part of a rollout-tree or GRPO-groups microbatch's record (``ProcessedInputs.shared_prefix``).

    Args:
        layout: the :class:`~nn_data.layout.TreeLayout` (the loss side's unpack and log-probs).
        info: the pack-and-shard runtime's :class:`~nn_data.PackedInfo` before the model call's parts.
        kv: at CP 1 the :class:`~nn_data.adapters.tree_kv.TreeKV` of a variable-length kernel (each node slot's keys
            are its path's, then its own; ``K = kv.max_seqlen_kv``, or ``cfg["nn_data"]["kv_capacity"]``); None
            under CP.
        kind: the config key's spelling: ``"shared-prefix"`` (GRPO groups) or ``"rollout-tree"``."""

    layout: TreeLayout
    info: object
    kv: Optional["TreeKV"] = None
    kind: str = "shared-prefix"


@dataclass
class ProcessedInputs:
    """Processed microbatch inputs for the model forward pass (NeMo-RL's fields), then nn_data's two.

    ``padding_mask``: packed microbatches only, bool in the layout of ``input_ids_cp_sharded`` (``[1, T/C]``;
    ``[1, T]`` when the model slices CP itself), True at padding: megatron-core's ``GPTModel.forward(padding_mask=)``.
    ``shared_prefix``: a shared-prefix microbatch's :class:`TreeRecord`, None otherwise."""

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
    shared_prefix: Optional["TreeRecord"] = None


ProcessedMicrobatch = dataclasses.make_dataclass(  # NeMo-RL's field order: data_dict, then ProcessedInputs'
    "ProcessedMicrobatch", [("data_dict", "BatchedDataDict[Any]")] + [
        (f.name, f.type) if f.default is dataclasses.MISSING else (f.name, f.type, dataclasses.field(default=f.default))
        for f in dataclasses.fields(ProcessedInputs)],
    namespace={"__module__": __name__, "__doc__": "A processed microbatch ready for the model forward: the raw "
               "``data_dict`` plus the :class:`ProcessedInputs` fields (packed tensors, ``PackedSeqParams`` ... or, "
               "unpacked, the causal mask and position ids), in NeMo-RL's order."})
