"""The packed (THD) path of ``process_microbatch``, and the CP partition indices of a packed row.

Shape legend
    B   sequences; S padded row length; T packed tokens; C context-parallel size
    Ly, K   MoE layers and top-k of routed experts ``[B, S, Ly, K]``

One call of :func:`~nn_data.nemo_rl.megatron_data.dispatch.pack_microbatch` packs the ids and every companion on
one layout (docs/nemo-rl.md, "The path to the executor"). With ``model_slices_context_parallel_inputs`` the model
gets the full row ``[1, T]`` and a ``PackedSeqParams`` with valid and padded boundaries apart; routed experts are
CP-sliced with the partition the model uses."""

from __future__ import annotations

from typing import Any, Optional

import torch

from nn_data.layout import Boundaries, layout_from_boundaries
from nn_data.extension import checks, layout_checks, megatron, process_groups
from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.nemo_rl.megatron_data.common import public
from nn_data.nemo_rl.megatron_data.dispatch import pack_microbatch
from nn_data.nemo_rl.megatron_data.options import PackOptions, nemo_rl_spec
from nn_data.nemo_rl.megatron_data.r3 import r3_verify_forward_enabled
from nn_data.nemo_rl.megatron_data.records import ProcessedInputs

def get_packed_seq_cp_partition_indices(
    packed_seq_params: Any,
    *,
    total_tokens: int,
    cp_size: int,
    cp_rank: int,
    device: Any,
    cp_group: Optional["torch.distributed.ProcessGroup"] = None,
) -> torch.Tensor:
    """This rank's positions in the full packed row: ``[T/C]`` int64 indices into ``[0, T)`` (megatron-bridge's function).

    Segments are ``packed_seq_params.cu_seqlens_q_padded`` (``cu_seqlens_q`` when None), each cut into ``2C`` chunks
    of which rank ``r`` holds ``r`` and ``2C-1-r`` (docs/design.md, "Zigzag"); one host read of the boundaries.

    Args:
        packed_seq_params: a ``PackedSeqParams`` (its ``cu_seqlens_q_padded`` or ``cu_seqlens_q``).
        total_tokens: ``T``, a multiple of ``2C``.
        cp_size: ``C``.
        cp_rank: this rank.
        device: where the indices go.
        cp_group: optional; its rank and size must be ``cp_rank`` and ``cp_size``.

    Example: ``cu_seqlens_q_padded [0, 4, 8]``, ``T = 8``, ``C = 2``: rank 0 -> ``[0, 3, 4, 7]``, rank 1 -> ``[1, 2, 5, 6]``.

    Raises :class:`~nn_data.errors.PackingError` (a ``ValueError``, as megatron-bridge) for any of those broken, or
    boundaries that do not rise from 0 to ``total_tokens`` in segments divisible by ``2C``."""
    checks.check_cp(cp_size, cp_rank)
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 0:
        raise PackingAssertionError(f"total_tokens={total_tokens!r} is invalid; expected an int >= 0 (the full packed length)")
    layout_checks.fixed_total_arg("total_tokens", total_tokens or None)
    if process_groups.is_group_form(cp_group):  # a DeviceMesh (or (mesh, dim)) is its ProcessGroup
        cp_group = process_groups.as_process_group(cp_group, "cp_group")
    if cp_group is not None and (cp_group.size() != cp_size or cp_group.rank() != cp_rank):
        raise PackingAssertionError(f"Context-parallel group has rank {cp_group.rank()} and size {cp_group.size()}, but "
                                    f"rank {cp_rank} and size {cp_size} were requested.")
    if cp_size == 1:
        return torch.arange(total_tokens, device=device, dtype=torch.int64)
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    bounds = padded if padded is not None else packed_seq_params.cu_seqlens_q
    checks.check_int_vector("cu_seqlens_q_padded", bounds)
    layout_checks.total_divisible(total_tokens, cp_size)
    layout = layout_from_boundaries(Boundaries(bounds.to(device), total_tokens),
                                    op="get_packed_seq_cp_partition_indices", cp_size=cp_size)  # the one read
    return layout.local_places(cp_size, cp_rank).source  # [T/C] int64, the device map on the layout


def cp_rank_and_size(pg_collection) -> tuple:
    """``(cp_rank, cp_size)``: from ``pg_collection.cp`` when a collection is given, else through the
    names NeMo-RL's module binds (megatron-core's ``parallel_state``; 0 of 1 when it is not set up)."""
    if pg_collection is not None:
        cp = process_groups.given_group_info(None, pg_collection=pg_collection, field="cp")
        return cp.rank, cp.size
    return public("get_context_parallel_rank")(), public("get_context_parallel_world_size")()


def packed_inputs(data_dict, input_ids, seq_lengths, routed, *, m: int, p: int, pad_full_seq_to, model_slices: bool,
                  options: Optional[PackOptions], pg_collection=None):
    """NeMo-RL HEAD's packed branch: the microbatch's ``ProcessedInputs`` (and nn_data's padding mask,
    in the layout of the model's ids)."""
    cp_rank, cp_size = cp_rank_and_size(pg_collection)
    extras = _extras(data_dict, input_ids, seq_lengths, routed)
    mask_ranks = (1, 0) if model_slices else (cp_size, cp_rank)  # the model's ids: the full row, or this share
    options = options or PackOptions()
    spec = nemo_rl_spec(m, p, fixed_total=options.fixed_total(pad_full_seq_to), cp_rank=cp_rank, cp_size=cp_size,
                        name="pad_full_seq_to")  # a run-level T wins
    batch = pack_microbatch(input_ids, seq_lengths, spec=spec, cp_rank=cp_rank, options=options, extras=extras)
    params, cu_pad = _params(batch.layout, cp_size, model_slices), batch.layout.cu_seqlens_padded
    padding = batch.layout.padding_mask(*mask_ranks)  # [1, T/C] (or [1, T]) bool, no read
    full, local = batch.full, batch.local
    public("_verify_r3_trace_cp_token_alignment")(
        source_input_ids=input_ids, source_routed_experts=routed, input_ids_cp_sharded=local["input_ids"],
        routed_experts_cp_sharded=local.get("routed_experts"), token_identity_cp_sharded=local.get("token_identity"),
    )
    model_side = full if model_slices else local  # the layout the model's ids have; masks follow it
    mask = model_side.get("media_token_validity_mask")
    return ProcessedInputs(
        input_ids=full["input_ids"], input_ids_cp_sharded=model_side["input_ids"], attention_mask=None,
        position_ids=None, packed_seq_params=params, cu_seqlens_padded=cu_pad,
        mtp_loss_mask=model_side.get("mtp_loss_mask"), routed_experts=full.get("routed_experts"),
        routed_experts_cp_sharded=local.get("routed_experts"),
        media_token_validity_mask=None if mask is None else mask.bool(), padding_mask=padding,
    )


def _extras(data_dict, input_ids, seq_lengths, routed) -> dict:
    """The companions that ride the ids' layout (None where absent): the MTP mask, routed experts with their R3
    identities when the verifier runs, the media-token mask (in the ids' dtype)."""
    identity = None
    if routed is not None and r3_verify_forward_enabled():
        identity = public("_make_r3_trace_token_identity")(input_ids, seq_lengths)
    media = None
    if "media_token_validity_mask" in data_dict:
        media = data_dict["media_token_validity_mask"].to(input_ids.dtype)
    return {"mtp_loss_mask": data_dict["mtp_loss_mask"] if "mtp_loss_mask" in data_dict else None,
            "routed_experts": routed, "token_identity": identity, "media_token_validity_mask": media}


def _params(layout, cp_size: int, model_slices: bool):
    """The microbatch's ``PackedSeqParams`` from its host layout's ints (no read)."""
    host, total = layout.host, layout.total
    if not model_slices:
        return megatron.make_packed_seq_params(layout.cu_seqlens_padded, host.max_seqlen, total // cp_size, total=total)
    # the model slices CP itself: full rows, valid and padded boundaries apart where they differ (one
    # boundary object tells TransformerEngine "no padding between sequences")
    pad_between = host.cu != host.cu_pad
    return megatron.make_packed_seq_params(layout.cu_seqlens_padded, host.max_seqlen, total,
                                  cu_seqlens=layout.cu_seqlens if pad_between else None,
                                  pad_between_seqs=pad_between, total=total)
