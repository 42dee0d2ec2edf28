"""Global batch -> processed microbatch iterators (a dynamic-CP plan's too), and the global batch's loss normalisers.

The iterators move each microbatch to the caller's device (``device=``, else ``cfg["nn_data"]["device"]``, else
``"cuda"`` when available, else CPU); the functions call each other through the names ``nn_data.nemo_rl.megatron_data``
binds at call time, so patching those names takes effect."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterator, Optional, Tuple

import torch

from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.planning import Parallelism
from nn_data.extension import megatron, process_groups
from nn_data.nemo_rl.megatron_data.common import public, require
from nn_data.nemo_rl.megatron_data.packed import cp_rank_and_size
from nn_data.nemo_rl.megatron_data.options import PackOptions
from nn_data.nemo_rl.megatron_data.tree_inputs import check_tree_key, refuse_with_dynamic_cp
from nn_data.nemo_rl.megatron_data.microbatch import ProcessedMicrobatch

if TYPE_CHECKING:  # pragma: no cover
    from megatron.core.utils import StragglerDetector

    from nn_data.nemo_rl.batched_data_dict import BatchedDataDict


def resolve_device(device=None, cfg: Optional[dict] = None):
    """``device``, else ``cfg["nn_data"]["device"]``, else the string ``"cuda"`` (what NeMo-RL
    passes to ``.to``) when CUDA is available, else ``torch.device("cpu")``."""
    if device is None:
        device = ((cfg or {}).get("nn_data") or {}).get("device")
    if device is None:
        return "cuda" if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def make_processed_microbatch_iterator(
    raw_iterator: Iterator["BatchedDataDict[Any]"],
    cfg: dict[str, Any],
    seq_length_key: Optional[str],
    pad_individual_seqs_to_multiple_of: int,
    pad_packed_seq_to_multiple_of: int,
    straggler_timer: "StragglerDetector",
    pad_full_seq_to: Optional[int],
    delegate_pack_to_model: bool = False,
    delegate_mtp_loss_mask_to_model: bool = False,
    model_slices_context_parallel_inputs: bool = False,
    *,
    device=None,
    pg_collection=None,
) -> Iterator[ProcessedMicrobatch]:
    """Wrap a raw microbatch iterator to yield :class:`ProcessedMicrobatch` objects (NeMo-RL's arguments).

    Each raw batch is moved to the device (:func:`resolve_device`) and processed by :func:`process_microbatch`, with
    ``options=`` from ``cfg["nn_data"]`` only when that section sets one and ``pg_collection`` only when given.

    Raises :class:`~nn_data.errors.PackingError` when ``cfg["megatron_cfg"]["context_parallel_size"]`` is not the size
    of the CP group the microbatches would be sharded for (:func:`check_configured_cp`)."""
    check_configured_cp(cfg, pg_collection)
    pack_sequences = cfg["sequence_packing"]["enabled"]
    options = PackOptions.from_cfg(cfg)
    extra = {} if options == PackOptions() else {"options": options}
    if pg_collection is not None:
        extra["pg_collection"] = pg_collection
    return _processed(raw_iterator, resolve_device(device, cfg), extra, seq_length_key=seq_length_key,
                      pad_individual_seqs_to_multiple_of=pad_individual_seqs_to_multiple_of,
                      pad_packed_seq_to_multiple_of=pad_packed_seq_to_multiple_of, pad_full_seq_to=pad_full_seq_to,
                      pack_sequences=pack_sequences, delegate_pack_to_model=delegate_pack_to_model,
                      delegate_mtp_loss_mask_to_model=delegate_mtp_loss_mask_to_model,
                      model_slices_context_parallel_inputs=model_slices_context_parallel_inputs,
                      straggler_timer=straggler_timer)


def check_configured_cp(cfg: dict[str, Any], pg_collection=None) -> None:
    """``cfg["megatron_cfg"]["context_parallel_size"]`` (when set) must be the CP size the layer shards for
    (``pg_collection.cp``'s, else ``parallel_state``'s, 1 uninitialised): else every rank would run unsharded."""
    configured = ((cfg or {}).get("megatron_cfg") or {}).get("context_parallel_size")
    if configured is None:
        return
    size = cp_rank_and_size(pg_collection)[1]
    if int(configured) == size:
        return
    if pg_collection is not None:
        source = "pg_collection.cp"
    elif process_groups.megatron_state() is not None:
        source = "megatron-core's parallel_state"
    else:
        source = "megatron-core's parallel_state is not initialised and no pg_collection= was given"
    raise PackingAssertionError(f"cfg['megatron_cfg']['context_parallel_size']={configured} but the context-parallel group "
                                f"has {size} rank{'s' if size != 1 else ''} ({source}); initialise parallel_state with "
                                f"context_parallel_size={configured}, or pass pg_collection= (the model's groups), or set "
                                f"context_parallel_size={size}")


def _processed(raw_iterator, target, extra: dict, **kwargs) -> Iterator[ProcessedMicrobatch]:
    """:func:`make_processed_microbatch_iterator`'s microbatches: each raw one moved to ``target`` and
    processed by ``process_microbatch`` (the name the package binds now) with ``kwargs`` and ``extra``."""
    for data_dict in raw_iterator:
        data_dict = data_dict.to(target)
        inputs = public("process_microbatch")(data_dict=data_dict, **kwargs, **extra)
        fields = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
        yield ProcessedMicrobatch(data_dict=data_dict, **fields)


def get_microbatch_iterator(
    data: "BatchedDataDict[Any]",
    cfg: dict[str, Any],
    mbs: int,
    straggler_timer: "StragglerDetector",
    seq_length_key: Optional[str] = None,
    delegate_pack_to_model: bool = False,
    delegate_mtp_loss_mask_to_model: bool = False,
    model_slices_context_parallel_inputs: bool = False,
    *,
    device=None,
    pg_collection=None,
    dynamic_cp=None,
) -> Tuple[Iterator[ProcessedMicrobatch], int, int, int, int]:
    """A processed microbatch iterator over ``data``: ``(iterator, data_iterator_len, micro_batch_size, seq_dim_size,
    padded_seq_length)``.

    Dynamic batching uses ``data``'s dynamic-shape plan; packing its packable plan (micro_batch_size 1, padding from
    :func:`_get_pack_sequence_parameters_for_megatron` or a run-level ``pad_full_seq_to``: :func:`run_fixed_total`);
    otherwise ``mbs`` rows at a time. The ``delegate_*`` and ``model_slices_context_parallel_inputs`` flags go to
    :func:`process_microbatch` unchanged.

    Args (nn_data's, keyword-only):
        device: where each microbatch goes (:func:`resolve_device`).
        pg_collection: megatron-core's ``ProcessGroupCollection`` (the CP rank and size).
        dynamic_cp: ``(runner, plan)``: one microbatch per round of a dynamic-CP plan
            (:func:`dynamic_cp_microbatch_iterator`)."""
    if dynamic_cp is not None:
        refuse_with_dynamic_cp(cfg)
        return dynamic_cp_microbatch_iterator(data, cfg, *dynamic_cp, device=resolve_device(device, cfg))
    micro_batch_size, pad_factor, pad_full_seq_to, pad_packed = mbs, 1, None, 1
    _, seq_dim_size = public("get_and_validate_seqlen")(data)
    packing = cfg["sequence_packing"]["enabled"]
    if seq_length_key is None and packing:
        seq_length_key = "input_lengths"
    check_tree_key(data, cfg, packing)
    raw_iterator, data_iterator_len, pack_seq_dim_size = raw_microbatches(data, cfg, mbs, packing)
    if pack_seq_dim_size is not None:  # the packable plan
        pad_factor, pad_packed, pad_full_seq_to = public("_get_pack_sequence_parameters_for_megatron")(
            cfg["megatron_cfg"], cfg["make_sequence_length_divisible_by"], pack_seq_dim_size)
        pad_full_seq_to = run_fixed_total(cfg, pack_seq_dim_size, pad_full_seq_to)
        micro_batch_size = 1
    extra = {"device": device} if device is not None else {}  # nn_data's keywords, only when given
    if pg_collection is not None:
        extra["pg_collection"] = pg_collection
    iterator = public("make_processed_microbatch_iterator")(
        raw_iterator=raw_iterator,
        cfg=cfg,
        seq_length_key=seq_length_key,
        pad_individual_seqs_to_multiple_of=pad_factor,
        pad_packed_seq_to_multiple_of=pad_packed,
        pad_full_seq_to=pad_full_seq_to,
        straggler_timer=straggler_timer,
        delegate_pack_to_model=delegate_pack_to_model,
        delegate_mtp_loss_mask_to_model=delegate_mtp_loss_mask_to_model,
        model_slices_context_parallel_inputs=model_slices_context_parallel_inputs,
        **extra,
    )
    padded_seq_length = pad_full_seq_to if pad_full_seq_to is not None else seq_dim_size
    return iterator, data_iterator_len, micro_batch_size, seq_dim_size, padded_seq_length


def raw_microbatches(data: Any, cfg: dict[str, Any], mbs: int, packing: bool
                     ) -> tuple[Iterator[Any], int, Optional[int]]:
    """``(data's microbatch iterator, their count, the packable plan's longest microbatch or None)``: its
    dynamic-shape plan (``cfg["dynamic_batching"]``), its packable plan (``packing``), else ``mbs`` rows at a time."""
    if (cfg.get("dynamic_batching") or {}).get("enabled", False):
        iterator = data.make_microbatch_iterator_with_dynamic_shapes()
        return iterator, data.get_microbatch_iterator_dynamic_shapes_len(), None
    if packing:
        iterator = data.make_microbatch_iterator_for_packable_sequences()
        return (iterator, *data.get_microbatch_iterator_for_packable_sequences_len())
    require(isinstance(mbs, int) and mbs >= 1, f"mbs={mbs!r} is invalid; expected an int >= 1 (rows per microbatch)")
    return data.make_microbatch_iterator(mbs), data.size // mbs, None


def run_fixed_total(cfg: dict[str, Any], longest: int, step_length: Optional[int]) -> Optional[int]:
    """The fixed packed length of every microbatch of a step: the run-level ``cfg["nn_data"]["pad_full_seq_to"]`` when
    set (checked against the run's :class:`~nn_data.planning.Parallelism` and the ``longest`` microbatch), else
    ``step_length`` (docs/nemo-rl.md, "nn_data options").

    Example: run-level 8192, longest 6100 -> 8192; longest 8300 -> :class:`PackingError`."""
    run = PackOptions.from_cfg(cfg).pad_full_seq_to
    if run is None:
        return step_length
    parallelism = Parallelism.from_megatron_cfg(
        cfg["megatron_cfg"], make_sequence_length_divisible_by=cfg["make_sequence_length_divisible_by"])
    parallelism.check_fixed_total(run, "cfg['nn_data']['pad_full_seq_to']")
    require(longest <= run,
            f"a planned microbatch holds {longest} padded tokens, more than the run-level "
            f"cfg['nn_data']['pad_full_seq_to']={run}; plan the step with max_tokens_per_microbatch <= {run} or "
            f"raise pad_full_seq_to to at least {parallelism.round_fixed_total(longest)}")
    return run


def process_global_batch(
    data: "BatchedDataDict[Any]",
    loss_fn: Any,
    dp_group: Optional["torch.distributed.ProcessGroup"],
    *,
    batch_idx: int,
    batch_size: int,
) -> dict[str, Any]:
    """Extract global batch ``batch_idx`` and its loss normalisers, summed over the DP group (no host sync).

    Returns ``{"batch", "global_valid_seqs", "global_valid_toks"}``: the sum of ``sample_mask`` and of
    ``token_mask[:, 1:] * sample_mask`` (valid sequences times ``S`` without a token mask), all-reduced over
    ``dp_group`` (on the CUDA device for NCCL); with neither ``torch.distributed`` nor a group, the local sums.

    Raises :class:`~nn_data.errors.PackingError` (NeMo-RL's messages first) when the batch has no ``sample_mask``, or
    the loss is token-level and the batch has no ``token_mask``."""
    batch = data.get_batch(batch_idx=batch_idx, batch_size=batch_size)
    require("sample_mask" in batch, "sample_mask must be present in the data! (the global batch needs a "
                                    "sample_mask [B] to count its valid sequences)")
    sample_mask = batch["sample_mask"]
    local_valid_seqs = torch.sum(sample_mask)
    if "token_mask" not in batch:
        local_valid_toks = local_valid_seqs * batch["input_ids"].shape[1]
    else:
        local_valid_toks = torch.sum(batch["token_mask"][:, 1:] * sample_mask.unsqueeze(-1))
    dtype = torch.promote_types(local_valid_seqs.dtype, local_valid_toks.dtype)
    to_reduce = torch.stack([local_valid_seqs.to(dtype), local_valid_toks.to(dtype)])  # [2]
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if process_groups.is_group_form(dp_group):  # a DeviceMesh (or (mesh, dim)) is its ProcessGroup
        dp_group = process_groups.as_process_group(dp_group, "dp_group")
    if initialised or dp_group is not None:
        if initialised and "nccl" in str(torch.distributed.get_backend(dp_group)):
            to_reduce = to_reduce.to(torch.device("cuda", torch.cuda.current_device()))
        torch.distributed.all_reduce(to_reduce, group=dp_group)
    if _is_token_level(loss_fn):
        require("token_mask" in batch, "token_mask must be present in the data when using token-level loss "
                                       "(a token_mask [B, S] marks the tokens the loss counts)")
    return {"batch": batch, "global_valid_seqs": to_reduce[0], "global_valid_toks": to_reduce[1]}


def _is_token_level(loss_fn) -> bool:
    """NeMo-RL's ``loss_fn.loss_type == LossType.TOKEN_LEVEL``, without importing NeMo-RL."""
    loss_type = getattr(loss_fn, "loss_type", None)
    if loss_type is None:
        return False
    name, value = getattr(loss_type, "name", None), getattr(loss_type, "value", loss_type)
    return name == "TOKEN_LEVEL" or str(value).lower() in ("token_level", "losstype.token_level")


def dynamic_cp_microbatch_iterator(data, cfg: dict, runner, plan, *, device) -> Tuple[Iterator[ProcessedMicrobatch],
                                                                                      int, int, int, int]:
    """``(iterator, rounds, 1, S, padded_seq_length)`` as :func:`get_microbatch_iterator` returns them: one
    :class:`ProcessedMicrobatch` per round of a dynamic-CP plan, on ``device``, no host read (docs/dynamic-cp.md, "The
    NeMo-RL layer"); ``padded_seq_length`` is ``tokens_per_rank`` times the static CP size of ``cfg["megatron_cfg"]``.

    Raises :class:`PackingError` when the runner does not build ``PackedSeqParams`` or ``data`` does not hold the plan's
    sequences."""
    if not runner.make_packed_seq_params:
        raise PackingAssertionError("a dynamic-CP microbatch needs PackedSeqParams: build the runner with "
                                    "DynamicCPRunner(..., megatron.make_packed_seq_params=True)")
    if data.size != len(plan.lengths):
        raise PackingAssertionError(f"data holds {data.size} sequences but the plan was made for {len(plan.lengths)}; plan "
                                    "the global batch's lengths (data['input_lengths'])")
    target = device
    input_ids = data["input_ids"].to(target)
    step = runner.step(plan, input_ids)
    static_cp = int(((cfg or {}).get("megatron_cfg") or {}).get("context_parallel_size", 1))
    return _rounds(step, data, target), len(step), 1, input_ids.shape[1], plan.tokens_per_rank * static_cp


def _rounds(step, data, target) -> Iterator[ProcessedMicrobatch]:
    for k in range(len(step)):
        inputs = step.round(k)
        rows = data.select_indices(list(inputs.block.sequences)).to(target)
        cu_pad = rows_boundaries(inputs.packed.cu_seqlens_padded, len(inputs.block.sequences))
        total = inputs.block.size * step.plan.tokens_per_rank  # T = c * tpr
        params = megatron.make_packed_seq_params(cu_pad, total, step.plan.tokens_per_rank, total=total, cp_group=inputs.cp_group,
                                        local_cp_size=inputs.block.size)
        yield ProcessedMicrobatch(data_dict=rows, input_ids=inputs.packed_ids, input_ids_cp_sharded=inputs.input_ids,
                                  attention_mask=None, position_ids=inputs.position_ids, packed_seq_params=params,
                                  cu_seqlens_padded=cu_pad, padding_mask=inputs.packed.padding_mask)


def rows_boundaries(cu_seqlens_padded: torch.Tensor, rows: int) -> torch.Tensor:
    """NeMo-RL's ``[rows + 1]`` boundaries of a block's ``[Bc + 1]`` (a view); ``[T]`` for an empty block.

    Example: ``[0, 5, 16, 16, 16]``, 2 rows -> ``[0, 5, 16]``; 0 rows -> ``[16]``."""
    return cu_seqlens_padded[:rows + 1] if rows else cu_seqlens_padded[-1:]
