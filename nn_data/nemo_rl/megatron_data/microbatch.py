"""One microbatch for the Megatron forward: packed (THD, CP-sharded), self-packing VLM, or unpacked.

Shape legend
    B   sequences; S padded row length; T packed tokens; C context-parallel size
    Ly, K   MoE layers and top-k of routed experts ``[B, S, Ly, K]``
    P   the self-packing path's columns: the longest padded length
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F

from nn_data.layout import PackSpec, layout_from_lengths
from nn_data.extension import checks, layout_checks, layout_from_read_lengths, megatron
from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.nemo_rl.megatron_data.common import public, require, straggler_context
from nn_data.nemo_rl.megatron_data.dispatch import as_lengths
from nn_data.nemo_rl.megatron_data.options import PackOptions
from nn_data.nemo_rl.megatron_data.packed import packed_inputs
from nn_data.nemo_rl.megatron_data.records import ProcessedInputs, ProcessedMicrobatch  # noqa: F401
from nn_data.nemo_rl.megatron_data.r3 import r3_verify_forward_enabled
from nn_data.nemo_rl.megatron_data.tree_inputs import rollout_tree_inputs

if TYPE_CHECKING:  # pragma: no cover - annotations only; megatron-core is imported lazily
    from megatron.core.utils import StragglerDetector

    from nn_data.nemo_rl.batched_data_dict import BatchedDataDict


def get_ltor_masks_and_position_ids(*args: Any, **kwargs: Any) -> Any:
    """Left-to-right masks and position ids, as ``megatron.training.utils``' function (not in the megatron-core wheel).

    Signature: ``(data [B, S], eod_token, pad_token=None, reset_position_ids=False, reset_attention_mask=False,
    eod_mask_loss=False, pad_mask_loss=False)``. Returns ``(attention_mask, loss_mask [B, S] float32, position_ids
    [B, S] int64)``: ``attention_mask`` is bool, True where masked, ``[1, 1, S, S]`` (causal) or ``[B, 1, S, S]`` with
    ``reset_attention_mask`` (a document ends at its EOD); positions restart after each EOD with
    ``reset_position_ids``; ``loss_mask`` is 0 at EOD (``eod_mask_loss``) and pad (``pad_mask_loss``) tokens.

    Example: ``data [[5, 0, 7, 8]]``, eod 0, both resets -> positions ``[[0, 1, 0, 1]]``; position 2 may not attend to
    positions 0..1."""
    return _ltor(*args, **kwargs)


def _ltor(data, eod_token, pad_token=None, reset_position_ids=False, reset_attention_mask=False,
          eod_mask_loss=False, pad_mask_loss=False):
    if not isinstance(data, torch.Tensor) or data.dim() != 2:
        raise PackingAssertionError(f"data must be a [B, S] tensor, got {getattr(data, 'shape', type(data))}")
    rows, cols = data.shape
    pos = torch.arange(cols, device=data.device)  # [S]
    causal = pos[None, :] <= pos[:, None]  # [S(q), S(k)]: k may be seen from q
    eod = data == eod_token  # [B, S]
    loss_mask = torch.ones(data.shape, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask = loss_mask.masked_fill(eod, 0.0)
    if pad_mask_loss:
        require(pad_token is not None, "pad_mask_loss=True needs a pad_token")
        loss_mask = loss_mask.masked_fill(data == pad_token, 0.0)
    # doc[b, t] = number of EOD tokens before t: data [5, 0, 7, 8], eod 0 -> eod [F, T, F, F]
    # -> cumsum [0, 1, 1, 1] - eod [0, 1, 0, 0] = doc [0, 0, 1, 1] (an EOD ends its own document).
    doc = torch.cumsum(eod.to(torch.int64), dim=1) - eod.to(torch.int64)  # [B, S]
    if reset_attention_mask:
        allowed = causal[None] & (doc[:, :, None] == doc[:, None, :])  # [B, S, S]
        attention_mask = ~allowed[:, None]  # [B, 1, S, S]
    else:
        attention_mask = ~causal[None, None]  # [1, 1, S, S]
    if reset_position_ids:
        # Document start of t: the latest t' <= t that follows an EOD: starts [0, 0, 2, 2] above.
        after_eod = torch.zeros_like(eod)
        after_eod[:, 1:] = eod[:, :-1]
        starts = torch.where(after_eod, pos[None, :], 0).cummax(dim=1).values  # [B, S]
        position_ids = pos[None, :] - starts  # [B, S]
    else:
        position_ids = pos[None, :].expand(rows, cols)  # [B, S]
    return attention_mask, loss_mask, position_ids


def process_microbatch(
    data_dict: "BatchedDataDict[Any]",
    seq_length_key: Optional[str] = None,
    pad_individual_seqs_to_multiple_of: int = 1,
    pad_packed_seq_to_multiple_of: int = 1,
    pad_full_seq_to: Optional[int] = None,
    pack_sequences: bool = False,
    delegate_pack_to_model: bool = False,
    delegate_mtp_loss_mask_to_model: bool = False,
    model_slices_context_parallel_inputs: bool = False,
    straggler_timer: Optional["StragglerDetector"] = None,
    *,
    options: Optional[PackOptions] = None,
    pg_collection=None,
) -> ProcessedInputs:
    """Process a microbatch for the Megatron forward pass (NeMo-RL HEAD's arguments and results); one host sync.

    Packed: ids ``[1, T]`` and the CP-local ``[1, T/C]``, every companion packed on the same layout
    (:mod:`~nn_data.nemo_rl.megatron_data.packed`). Self-packing model: :func:`_prepare_vlm_batch_for_megatron`.
    Unpacked: the causal mask and position ids of :func:`get_ltor_masks_and_position_ids`.

    Args:
        data_dict: any mapping read as NeMo-RL reads it (``in``, ``[]``).
        seq_length_key: the key of the ``[B]`` lengths (packed only).
        pad_individual_seqs_to_multiple_of: each sequence's multiple.
        pad_packed_seq_to_multiple_of: ``T``'s multiple.
        pad_full_seq_to: a fixed ``T`` (a run-level ``options.pad_full_seq_to`` wins).
        pack_sequences: pack into THD.
        delegate_pack_to_model: the model packs and CP-shards itself (routed experts and a media mask refused).
        delegate_mtp_loss_mask_to_model: such a model packs the ``mtp_loss_mask`` (else it is refused).
        model_slices_context_parallel_inputs: the model takes the full row and selects its CP tokens.
        straggler_timer: megatron-core's ``StragglerDetector`` or None.
        options: nn_data only: :class:`~nn_data.nemo_rl.megatron_data.options.PackOptions` (compile, buckets, trees).
        pg_collection: nn_data only: megatron-core's ``ProcessGroupCollection`` (the CP rank and size).

    Raises :class:`~nn_data.errors.PackingError` (NeMo-RL's messages first) for a missing ``seq_length_key``, routed
    experts that are not 4-D, an unclaimed ``mtp_loss_mask``, and every bad input of the pack path."""
    with straggler_context(straggler_timer):
        input_ids = data_dict["input_ids"]
        routed = data_dict["routed_experts"] if "routed_experts" in data_dict else None
        if routed is not None and routed.dim() != 4:
            raise PackingAssertionError("routed_experts must have shape [batch, seq, num_moe_layers, topk] before "
                                        f"Megatron packing; got {tuple(routed.shape)}")
        if options is not None and options.tree is not None:  # every shared prefix once
            return rollout_tree_inputs(data_dict, seq_length_key=seq_length_key, pack_sequences=pack_sequences,
                                       m=pad_individual_seqs_to_multiple_of, p=pad_packed_seq_to_multiple_of,
                                       pad_full_seq_to=pad_full_seq_to, delegate=delegate_pack_to_model,
                                       model_slices=model_slices_context_parallel_inputs, options=options,
                                       pg_collection=pg_collection)
        if not pack_sequences:
            return ProcessedInputs(**_unpacked_inputs(data_dict, input_ids, routed))
        require(seq_length_key is not None, "seq_length_key must be provided for packed sequences")
        require(seq_length_key in data_dict, f"{seq_length_key} not found in data_dict{_keys_hint(data_dict)}")
        seq_lengths = data_dict[seq_length_key]
        if delegate_pack_to_model:
            return ProcessedInputs(**_vlm_inputs(data_dict, input_ids, seq_lengths, routed,
                                                 pad_individual_seqs_to_multiple_of, pad_full_seq_to,
                                                 delegate_mtp_loss_mask_to_model))
        return packed_inputs(data_dict, input_ids, seq_lengths, routed, m=pad_individual_seqs_to_multiple_of,
                             p=pad_packed_seq_to_multiple_of, pad_full_seq_to=pad_full_seq_to,
                             model_slices=model_slices_context_parallel_inputs, options=options,
                             pg_collection=pg_collection)


def _keys_hint(data_dict) -> str:
    """`` (keys: [...])`` when the mapping can list its keys, else nothing."""
    try:
        return f" (keys: {list(data_dict.keys())})"
    except Exception:  # a mapping stand-in without keys(): the message stays NeMo-RL's
        return ""


def _vlm_inputs(data_dict, input_ids, seq_lengths, routed, m, pad_full_seq_to, delegate_mtp: bool) -> dict:
    has_mtp = "mtp_loss_mask" in data_dict
    require(not has_mtp or delegate_mtp,
            "MTP training requires a self-packing VLM that advertises model_owns_mtp_loss_mask_packing "
            "(the batch has an mtp_loss_mask and delegate_pack_to_model=True: pass "
            "delegate_mtp_loss_mask_to_model=True for a model that packs the mask itself, or drop the mask)")
    if "media_token_validity_mask" in data_dict:
        raise NotImplementedError("media_token_validity_mask is not supported for models that pack sequences "
                                  "internally (delegate_pack_to_model); the mask would need to be packed inside "
                                  "the model.")
    if routed is not None:
        raise NotImplementedError("Router replay (routed_experts) is not supported with models that pack and "
                                  "context-parallel shard internally (delegate_pack_to_model=True).")
    packed, ids_2d, attention_mask, params, cu_seqlens, cu_seqlens_padded = public(
        "_prepare_vlm_batch_for_megatron")(input_ids, seq_lengths, m, pad_full_seq_to=pad_full_seq_to)
    mtp = None
    if has_mtp:
        source = data_dict["mtp_loss_mask"]
        require(source.dim() == 2 and source.shape[0] == ids_2d.shape[0],
                f"mtp_loss_mask must be [B, S] with B={ids_2d.shape[0]}; got {tuple(source.shape)}")
        width = min(source.shape[1], ids_2d.shape[1])
        mtp = source.new_zeros(ids_2d.shape)  # [B, P]
        mtp[:, :width] = source[:, :width]
        mtp = mtp * attention_mask.to(mtp.dtype)
    return dict(input_ids=packed, input_ids_cp_sharded=ids_2d, attention_mask=attention_mask, position_ids=None,
                packed_seq_params=params, cu_seqlens_padded=cu_seqlens_padded, mtp_loss_mask=mtp)


def _prepare_vlm_batch_for_megatron(
    input_ids: torch.Tensor,
    seq_lengths: torch.Tensor,
    pad_individual_seqs_to_multiple_of: int,
    pad_full_seq_to: Optional[int] = None,
):
    """Prepare a ``[B, S]`` batch for a model that packs and CP-shards internally (mbridge VLMs); one host sync.

    Each length is rounded up to the multiple; with ``pad_full_seq_to`` the last sequence absorbs the deficit (a
    multiple of the per-sequence multiple). Returns ``(input_ids [1, T], input_ids_cp_sharded [B, P], attention_mask
    [B, P] bool, packed_seq_params, None, cu_seqlens_padded [B+1] int32)``; with ``B = 0``, empty rows and ``[0]``.

    Args:
        input_ids: ``[B, S]``.
        seq_lengths: ``[B]`` ints in ``[0, S]``.
        pad_individual_seqs_to_multiple_of: each length's multiple.
        pad_full_seq_to: the packed total the model's own packing must give (PP > 1).

    Example: lengths ``[3, 5]``, multiple 4, ``pad_full_seq_to=16`` -> padded ``[4, 8]``, deficit 4 -> ``[4, 12]``,
    ``P = 12``, ``cu_seqlens_padded [0, 4, 16]``.

    Raises :class:`~nn_data.errors.PackingError` (NeMo-RL's wording first) for a padded total above
    ``pad_full_seq_to``, a deficit not a multiple, a length outside ``[0, S]``, or ``pad_full_seq_to`` above int32."""
    checks.check_min_dims("input_ids", input_ids, 2, "[B, S]")
    rows, cols = input_ids.shape[:2]
    m = max(1, int(pad_individual_seqs_to_multiple_of))
    layout_checks.fixed_total_arg("pad_full_seq_to", pad_full_seq_to)
    lengths = as_lengths(seq_lengths, rows, input_ids.device)
    if rows == 0:  # as NeMo-RL: the model packs nothing, so no slack either: [0] boundaries, no column
        cu_seqlens_padded = torch.zeros(1, dtype=torch.int32, device=input_ids.device)
        return (input_ids.new_zeros((1, 0)), input_ids[:, :0], torch.zeros(0, 0, dtype=torch.bool,
                device=input_ids.device), megatron.make_packed_seq_params(cu_seqlens_padded, 0, None), None, cu_seqlens_padded)
    layout = layout_from_lengths(lengths, cols, PackSpec(m), op="_prepare_vlm_batch_for_megatron")  # the one read
    if pad_full_seq_to is not None:  # the model pads every row itself: the slack must suit it (host ints)
        _check_deficit(layout.total, m, pad_full_seq_to)
        layout = layout_from_read_lengths(layout.host.lengths, lengths, cols, PackSpec(m, fixed_total=pad_full_seq_to))
    padded_max = layout.host.max_seqlen  # P: the model's columns
    if cols < padded_max:
        ids_2d = F.pad(input_ids, (0, padded_max - cols), value=0)  # [B, P]
    else:
        ids_2d = input_ids[:, :padded_max].contiguous()  # [B, P]; cut columns hold padding only
    cu_seqlens_padded = layout.cu_seqlens_padded  # [B+1]: each row's padded length, the slack on the last
    padded = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).to(torch.int64)  # [B]
    attention_mask = torch.arange(padded_max, device=input_ids.device)[None, :] < padded[:, None]  # [B, P]
    # The packed view holds exactly what the model packs: every row's first padded[b] columns, back to
    # back (the rows packed on the same layout with their padded lengths as lengths).
    whole = layout_from_read_lengths(layout.host.segments, padded, padded_max, PackSpec(fixed_total=layout.total),
                                     validate=False)  # segments [4, 12] (lengths [3, 5], m 4, T 16) -> lengths [4, 12]
    packed = whole.pack(ids_2d)  # [1, T]
    params = megatron.make_packed_seq_params(cu_seqlens_padded, padded_max, None)
    return packed, ids_2d, attention_mask, params, None, cu_seqlens_padded


def _check_deficit(natural: int, m: int, fixed_total: int) -> None:
    """The packed length must hold ``sum(round_up(L, m))`` and exceed it by a multiple of ``m`` (NeMo-RL's asserts).

    Example: lengths ``[3, 5]``, m 4: natural 12; ``pad_full_seq_to`` 16 passes, 8 and 14 are refused."""
    if natural > fixed_total:
        raise PackingAssertionError(
            f"pad_full_seq_to ({fixed_total}) < natural padded sum ({natural}); increase pad_full_seq_to to at least "
            f"{natural} (the packed total sum(round_up(seq_lengths, {m})) = {natural})")
    if (fixed_total - natural) % m:
        raise PackingAssertionError(
            f"pad_full_seq_to deficit ({fixed_total - natural}) must be a multiple of pad_individual_seqs_to_multiple_of "
            f"({m}) (the model pads every sequence to {m} itself, the last one included: choose pad_full_seq_to = "
            f"{natural} + a multiple of {m})")


def _unpacked_inputs(data_dict, input_ids, routed) -> dict:
    routed_cp, identity = routed, None
    if routed is not None:
        if "input_lengths" not in data_dict:
            raise PackingAssertionError("routed_experts requires input_lengths when sequence packing is disabled so padding "
                                        "rows can be repaired before router replay. (add input_lengths [B] to the batch)")
        routed = routed_cp = public("_fill_routed_experts_padding")(routed, data_dict["input_lengths"])
        if r3_verify_forward_enabled():
            identity = public("_make_r3_trace_token_identity")(input_ids, data_dict["input_lengths"])
    public("_verify_r3_trace_cp_token_alignment")(
        source_input_ids=input_ids, source_routed_experts=data_dict["routed_experts"] if routed is not None else None,
        input_ids_cp_sharded=input_ids, routed_experts_cp_sharded=routed_cp, token_identity_cp_sharded=identity,
    )
    attention_mask, _, position_ids = public("get_ltor_masks_and_position_ids")(
        data=input_ids, eod_token=0, pad_token=0, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, pad_mask_loss=False,
    )
    mtp = data_dict["mtp_loss_mask"] if "mtp_loss_mask" in data_dict else None
    media = None
    if "media_token_validity_mask" in data_dict:  # rows are still samples: already the model's layout
        media = data_dict["media_token_validity_mask"].bool()
    return dict(input_ids=input_ids, input_ids_cp_sharded=input_ids, attention_mask=attention_mask,
                position_ids=position_ids, packed_seq_params=None, cu_seqlens_padded=None, mtp_loss_mask=mtp,
                routed_experts=routed, routed_experts_cp_sharded=routed_cp, media_token_validity_mask=media)
