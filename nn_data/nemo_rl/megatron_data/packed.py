"""The packed (THD) path of ``process_microbatch``, and the CP partition indices of a packed row.

Shape legend
    B   sequences; S padded row length; T packed tokens; C context-parallel size
    Ly, K   MoE layers and top-k of routed experts ``[B, S, Ly, K]``

When NeMo-RL's names are nn_data's own (nothing patched), the packed branch is **one explicit
call**: :func:`~nn_data.nemo_rl.megatron_data.dispatch.pack_microbatch` packs ``input_ids`` and every
companion (``mtp_loss_mask``, the media-token mask, routed experts, R3 identities) on one plan, with
the microbatch's one host sync; ``PackedSeqParams``, the full-row parameters and the CP partition
indices come from that plan's host ints. Only when code patches ``_pack_sequences_for_megatron``,
``_shard_routed_experts_for_cp`` or ``get_packed_seq_cp_partition_indices`` on
``nn_data.nemo_rl.megatron_data`` (NeMo-RL's tests do) does it follow NeMo-RL's call sequence through those
names: the ids, then the routed experts, then the MTP and media masks, each call doing its own work.

``model_slices_context_parallel_inputs`` (NeMo-RL HEAD): the model inserts media into the
full THD row before selecting its CP-owned tokens, so it gets the full packed ids
``[1, T]``, the full ``mtp_loss_mask`` / media mask ``[1, T]``, and a ``PackedSeqParams``
with ``cu_seqlens_q = cu_seqlens`` (valid tokens), ``cu_seqlens_q_padded =
cu_seqlens_padded``, ``total_tokens = T`` and ``pad_between_seqs`` (the last two where
megatron-core has them); routed experts and R3 identities are CP-sliced with the same
partition indices the model uses (:func:`get_packed_seq_cp_partition_indices`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from nn_data import _checks
from nn_data.errors import PackingError
from nn_data.groups import as_process_group, is_group_form
from nn_data.nemo_rl.megatron_data.common import patched, public
from nn_data.nemo_rl.megatron_data.dispatch import check_extras, pack_microbatch
from nn_data.nemo_rl.megatron_data.options import PackConfig, PackOptions
from nn_data.nemo_rl.megatron_data.r3 import r3_verify_forward_enabled
from nn_data.megatron_parallel import make_packed_seq_params
from nn_data.layout import checks as plan_checks
from nn_data.layout import plan_from_boundaries
from nn_data.layout.index import zigzag_source
from nn_data.layout.rules import segment_bounds

NEMO_RL_CALLS = ("_pack_sequences_for_megatron", "_shard_routed_experts_for_cp", "get_packed_seq_cp_partition_indices")


def get_packed_seq_cp_partition_indices(
    packed_seq_params: Any,
    *,
    total_tokens: int,
    cp_size: int,
    cp_rank: int,
    device: Any,
    cp_group: Optional["torch.distributed.ProcessGroup"] = None,
) -> torch.Tensor:
    """This rank's positions in the full packed row: ``[T/C]`` int64 indices into ``[0, T)``.

    megatron-bridge's function of that name (NeMo-RL imports it), without megatron-bridge:
    segments are ``packed_seq_params.cu_seqlens_q_padded`` (``cu_seqlens_q`` when None), each
    cut into ``2C`` chunks of which rank ``r`` holds chunks ``r`` and ``2C-1-r`` (docs/design.md, "Zigzag",
    the split TransformerEngine and megatron-core use). ``C = 1``: ``arange(T)``.

    Example: ``cu_seqlens_q_padded [0, 4, 8]``, ``T = 8``, ``C = 2``: rank 0 -> ``[0, 3, 4, 7]``,
    rank 1 -> ``[1, 2, 5, 6]``.

    One host read of the boundaries (their validation); :func:`process_microbatch` computes the
    same indices from its plan without reading them. Raises :class:`~nn_data.errors.PackingError` (a ``ValueError``, as
    megatron-bridge) for a bad ``cp_rank``/``cp_size``, a ``cp_group`` whose rank or size
    differ from them, ``total_tokens`` not a multiple of ``2C``, boundaries that do not rise
    from 0 to ``total_tokens``, or a segment not divisible by ``2C``.
    """
    _checks.check_cp(cp_size, cp_rank)
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 0:
        raise PackingError(f"total_tokens={total_tokens!r} is invalid; expected an int >= 0 (the full packed length)")
    plan_checks.packed_length_arg("total_tokens", total_tokens or None)
    if is_group_form(cp_group):  # a DeviceMesh (or (mesh, dim)) is its ProcessGroup
        cp_group = as_process_group(cp_group, "cp_group")
    if cp_group is not None and (cp_group.size() != cp_size or cp_group.rank() != cp_rank):
        raise PackingError(f"Context-parallel group has rank {cp_group.rank()} and size {cp_group.size()}, but "
                           f"rank {cp_rank} and size {cp_size} were requested.")
    if cp_size == 1:
        return torch.arange(total_tokens, device=device, dtype=torch.int64)
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    bounds = padded if padded is not None else packed_seq_params.cu_seqlens_q
    _checks.check_int_vector("cu_seqlens_q_padded", bounds)
    plan_checks.total_divisible(total_tokens, cp_size)
    plan_from_boundaries(bounds, total_tokens, op="get_packed_seq_cp_partition_indices", cp_size=cp_size)
    return partition_indices(bounds.to(device), total_tokens, cp_size, cp_rank)


def partition_indices(cu_seqlens_padded: torch.Tensor, total: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[T/C]`` int64: this rank's zigzag positions in the full packed row (the device map, no read)."""
    return zigzag_source(segment_bounds(cu_seqlens_padded, total), total // cp_size, cp_size, cp_rank)  # [T/C]


def options_kw(options: Optional[PackOptions]) -> dict:
    """``{"options": options}`` unless they are the defaults: the pack is then called exactly as
    NeMo-RL calls it, so a replacement with NeMo-RL's signature can be patched in."""
    return {} if options is None or options == PackOptions() else {"options": options}


def packed_inputs(data_dict, input_ids, seq_lengths, routed, m: int, p: int, pad_full_seq_to,
                  model_slices: bool, options: Optional[PackOptions]) -> dict:
    """The ``ProcessedInputs`` fields of a packed microbatch (NeMo-RL HEAD's packed branch)."""
    cp_rank = public("get_context_parallel_rank")()
    cp_size = public("get_context_parallel_world_size")()
    identity = None
    if routed is not None and r3_verify_forward_enabled():
        identity = public("_make_r3_trace_token_identity")(input_ids, seq_lengths)
    mtp = data_dict["mtp_loss_mask"] if "mtp_loss_mask" in data_dict else None
    media = None
    if "media_token_validity_mask" in data_dict:  # packed in the ids' dtype: padding 0 is no bool
        media = data_dict["media_token_validity_mask"].to(input_ids.dtype)
    # Shapes and devices of everything riding the ids' layout, checked before any compiled region.
    check_extras(input_ids, {"mtp_loss_mask": mtp, "routed_experts": routed, "media_token_validity_mask": media})
    args = (input_ids, seq_lengths, routed, identity, mtp, media, m, p, pad_full_seq_to, cp_rank, cp_size,
            model_slices, options)
    fields = _nemo_rl_calls(*args) if patched(*NEMO_RL_CALLS) else _one_call(*args)
    public("_verify_r3_trace_cp_token_alignment")(
        source_input_ids=input_ids, source_routed_experts=routed, input_ids_cp_sharded=fields.pop("verify_ids"),
        routed_experts_cp_sharded=fields["routed_experts_cp_sharded"],
        token_identity_cp_sharded=fields.pop("identity_cp"),
    )
    if media is not None:
        fields["media_token_validity_mask"] = fields["media_token_validity_mask"].bool()
    return fields


def _one_call(input_ids, seq_lengths, routed, identity, mtp, media, m, p, pad_full_seq_to, cp_rank, cp_size,
              model_slices, options) -> dict:
    """Every tensor of the microbatch packed and sharded on one plan, one host sync (nothing patched)."""
    packed_length = (options or PackOptions()).packed_length(pad_full_seq_to)  # a run-level T wins
    config = PackConfig.nemo_rl(m, p, packed_length=packed_length, cp_rank=cp_rank, cp_size=cp_size,
                                name="pad_full_seq_to", options=options)
    out, layout = pack_microbatch(input_ids, seq_lengths, config, options=options, mtp_loss_mask=mtp,
                                  routed_experts=routed, token_identity=identity, media_token_validity_mask=media)
    host, total = layout.host, layout.total
    routed_cp, identity_cp = out.routed_local, out.identity_local
    if model_slices:  # the model slices CP itself: full rows, valid and padded boundaries apart
        pad_between = host.cu != host.cu_pad  # else one boundary object: TransformerEngine reads "no padding"
        params = make_packed_seq_params(out.cu_seqlens_padded, host.max_seqlen, total,
                                        cu_seqlens=out.cu_seqlens if pad_between else None,
                                        pad_between_seqs=pad_between, packed_length=total)
        if cp_size > 1 and out.routed_packed is not None:  # the very indices the model slices with
            index = partition_indices(out.cu_seqlens_padded, total, cp_size, cp_rank)  # [T/C]
            routed_cp = out.routed_packed.index_select(1, index)
            identity_cp = None if identity is None else out.identity_packed.index_select(1, index)
        elif cp_size == 1:
            routed_cp, identity_cp = out.routed_packed, out.identity_packed
    else:
        params = make_packed_seq_params(out.cu_seqlens_padded, host.max_seqlen, out.local.shape[1],
                                        packed_length=total)
    ids = out.packed if model_slices else out.local  # the layout the model's ids have; masks follow it
    fields = dict(input_ids=out.packed, input_ids_cp_sharded=ids, attention_mask=None, position_ids=None,
                  packed_seq_params=params, cu_seqlens_padded=out.cu_seqlens_padded, routed_experts=out.routed_packed,
                  routed_experts_cp_sharded=routed_cp, verify_ids=out.local, identity_cp=identity_cp)
    if mtp is not None:
        fields["mtp_loss_mask"] = out.mtp_packed if model_slices else out.mtp_local
    if media is not None:
        fields["media_token_validity_mask"] = out.media_packed if model_slices else out.media_local
    return fields


def _nemo_rl_calls(input_ids, seq_lengths, routed, identity, mtp, media, m, p, pad_full_seq_to, cp_rank, cp_size,
                   model_slices, options) -> dict:
    """NeMo-RL's call sequence through the (patched) public names, each call doing its own work."""
    pack = public("_pack_sequences_for_megatron")
    kw = dict(cp_rank=cp_rank, cp_size=cp_size, **options_kw(options))
    packed_ids, local_ids, params, cu, cu_pad = pack(input_ids, seq_lengths, m, p, pad_full_seq_to, **kw)
    if model_slices:
        params = _full_row_params(cu, cu_pad, packed_ids.shape[1])
    routed_packed, routed_cp, identity_cp = _routes(routed, identity, seq_lengths, cu, cu_pad, cp_rank, cp_size,
                                                    params if model_slices else None, packed_ids)
    fields = dict(input_ids=packed_ids, input_ids_cp_sharded=packed_ids if model_slices else local_ids,
                  attention_mask=None, position_ids=None, packed_seq_params=params, cu_seqlens_padded=cu_pad,
                  routed_experts=routed_packed, routed_experts_cp_sharded=routed_cp, verify_ids=local_ids,
                  identity_cp=identity_cp)
    for name, source in (("mtp_loss_mask", mtp), ("media_token_validity_mask", media)):
        if source is not None:
            full, local = pack(source, seq_lengths, m, p, pad_full_seq_to, **kw)[:2]
            fields[name] = full if model_slices else local  # the layout the model's ids have
    return fields


def _routes(routed, identity, seq_lengths, cu, cu_pad, cp_rank, cp_size, full_row_params, packed_ids):
    """``(routed [1, T, Ly, K], routed for the model, identity for the verifier)``; Nones without routes."""
    if routed is None:
        return None, None, None
    routed_packed, routed_cp, identity_packed, identity_cp = public("_shard_routed_experts_for_cp")(
        routed, identity, seq_lengths, cu, cu_pad, cp_rank, cp_size)
    if full_row_params is not None:  # the model's own CP slice: the very indices it uses
        index = public("get_packed_seq_cp_partition_indices")(
            full_row_params, total_tokens=packed_ids.shape[1], cp_size=cp_size, cp_rank=cp_rank,
            device=packed_ids.device)
        routed_cp = routed_packed.index_select(1, index).contiguous()  # [1, T/C, Ly, K]
        if identity_packed is not None:
            identity_cp = identity_packed.index_select(1, index).contiguous()  # [1, T/C, 3]
    if routed_cp is not None and routed_cp.dim() != 4:
        raise PackingError("CP-sharded routed_experts must have shape [1, tokens, num_moe_layers, topk] after "
                           f"Megatron packing; got {tuple(routed_cp.shape)}")
    return routed_packed, routed_cp, identity_cp


def _full_row_params(cu: torch.Tensor, cu_pad: torch.Tensor, total: int):
    """``PackedSeqParams`` for a model that slices CP itself from boundaries a (patched) packer returned:
    ``max_seqlen`` (longest padded segment) and ``pad_between_seqs`` (``cu != cu_pad``: some segment
    holds padding, TE must not infer it from the last boundary alone) cost one read of them.
    Example: ``cu [0, 3]``, ``cu_pad [0, 4]`` -> max_seqlen 4, pad_between_seqs True.
    """
    if cu_pad.shape[0] < 2 or cu.shape != cu_pad.shape:
        # sync: B = 0 or mismatched boundaries: a 1-entry compare
        max_seqlen, pad_between = total, cu.shape != cu_pad.shape or not torch.equal(cu, cu_pad)
    else:
        seg = cu_pad[1:].to(torch.int64) - cu_pad[:-1].to(torch.int64)  # [B]
        differs = (cu.to(torch.int64) != cu_pad.to(torch.int64)).any()
        stats = torch.stack([seg.max(), differs.to(torch.int64)])
        max_seqlen, pad_between = stats.tolist()  # sync: boundaries a patched packer returned
    # Valid boundaries of their own only where they differ: the same object tells TransformerEngine "no padding".
    return make_packed_seq_params(cu_pad, max_seqlen, total, cu_seqlens=cu if pad_between else None,
                                  pad_between_seqs=bool(pad_between), packed_length=total)
