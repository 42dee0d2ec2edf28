"""A ``forward_step_func`` for megatron-core's pipeline schedules that packs every microbatch to one constant
``T`` with :class:`~nn_data.packed_forward.PackedForward`: a stage receives its input into a buffer allocated
from the schedule's ``seq_length`` before the sender's microbatch is known (docs/pipeline.md).

Example (every pipeline rank runs the same code on the same microbatches)::

    adapter = MegatronGPTAdapter(stage_model)        # stage_model: GPTModel(pre_process=..., post_process=...)
    packing = PackedForward(adapter, pad_individual_seqs_to_multiple_of=8, pad_full_seq_to=T,
                            make_packed_seq_params=True)
    forward_backward = get_forward_backward_func()
    losses = forward_backward(forward_step_func=pipeline_forward_step(packing, token_loss),
                              data_iterator=iter(microbatches), model=[adapter],
                              num_microbatches=len(microbatches), seq_length=T, micro_batch_size=1)"""

from __future__ import annotations

from typing import Callable

import torch

from nn_data.groups import given_group_info
from nn_data.packed_forward import PackedForward

#: ``loss_fn(rows [B, S, *], input_ids [B, S], seq_lengths [B]) -> (loss, num_tokens)``.
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]


def pipeline_forward_step(packing: PackedForward, loss_fn: LossFn, *, pg_collection=None):
    """``forward_step_func(data_iterator, model)`` for ``get_forward_backward_func()``; each item of
    ``data_iterator`` is ``(input_ids [B, S], seq_lengths [B])`` (or a tree microbatch, :func:`_microbatch`),
    ``B`` and the lengths free to differ between microbatches. The model called is the schedule's (the adapter);
    it gets ``packed`` with its ``padding_mask``. With the interleaved schedule pass one data iterator per model
    chunk.

    Args:
        packing: a :class:`PackedForward` with ``pad_full_seq_to`` set (the constant ``T``; pass ``seq_length=T``
            and ``micro_batch_size=1`` to the schedule).
        loss_fn: on the last stage, ``loss_fn(rows [B, S, *], ...) -> (loss, num_tokens)`` on the unpacked output
            (``packing.finish``); the step returns ``(loss, num_tokens, {"loss": ..., "num_tokens": ...})``.
        pg_collection: megatron-core's ``ProcessGroupCollection``; ``packing`` must shard over its ``cp``.

    Raises :class:`~nn_data.errors.PackingError` without ``pad_full_seq_to``, for another CP group than
    ``pg_collection.cp``, and on the first step for the interleaved schedule with ``batch_p2p_comm=True`` over
    gloo (:func:`check_p2p_config`)."""
    from nn_data.errors import PackingError

    if packing.pack.pad_full_seq_to is None:
        raise PackingError("pipeline_forward_step needs PackedForward(pad_full_seq_to=T): every microbatch a "
                           "pipeline stage receives must have the same T")
    if pg_collection is not None:
        cp = given_group_info(None, pg_collection=pg_collection, field="cp")
        if cp.size != packing.cp_size or (cp.size > 1 and cp.group is not packing.cp_group):
            raise PackingError(f"packing shards over {packing.cp_size} context-parallel ranks, not over "
                               f"pg_collection.cp ({cp.size} ranks); build it with PackedForward(..., "
                               "pg_collection=pg_collection)")

    def forward_step(data_iterator, model):
        check_p2p_config(getattr(model, "config", None), _backend())
        input_ids, seq_lengths, tree = _microbatch(next(data_iterator))
        inp = packing.prepare(input_ids, seq_lengths, **tree)
        output = model(inp.input_ids, inp.position_ids, inp.packed)  # logits [1, T/C, V] (or log-probs [1, T/C]), hidden [T/C, 1, E]

        def loss_func(output_tensor: torch.Tensor):
            rows = packing.finish(output_tensor, inp)  # [B, S, *]
            loss, num_tokens = loss_fn(rows, input_ids, seq_lengths)
            num_tokens = torch.as_tensor(num_tokens, dtype=torch.int)
            return loss, num_tokens, {"loss": loss.detach().clone(), "num_tokens": num_tokens}

        return output, loss_func

    return forward_step


#: The keywords of a tree microbatch (:meth:`~nn_data.packed_forward.PackedForward.prepare`'s): a rollout tree's
#: ``parent`` / ``branch_at``, or GRPO groups' ``prefix_lengths`` / ``group_ids`` (its depth-1 spelling).
TREE_KEYS = ("prefix_lengths", "group_ids", "parent", "branch_at")


def _microbatch(item) -> tuple:
    """One item of the data iterator as ``(input_ids, seq_lengths, tree)``, ``tree`` the keywords of a tree microbatch
    (:data:`TREE_KEYS`) or ``{}``. Example: ``(ids, L)`` -> ``(ids, L, {})``; ``(ids, L, P, g)`` -> ``(ids, L,
    {"prefix_lengths": P, "group_ids": g})``; ``{"input_ids": ids, "seq_lengths": L, "parent": p, "branch_at": a}``
    -> ``(ids, L, {"parent": p, "branch_at": a})``; ``(ids,)`` -> PackingError."""
    from nn_data.errors import PackingError

    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1], {}
    if isinstance(item, (tuple, list)) and len(item) == 4:
        return item[0], item[1], {"prefix_lengths": item[2], "group_ids": item[3]}
    if isinstance(item, dict) and {"input_ids", "seq_lengths"} <= set(item) <= {"input_ids", "seq_lengths", *TREE_KEYS}:
        return item["input_ids"], item["seq_lengths"], {k: item[k] for k in TREE_KEYS if k in item}
    size = f"{len(item)} items" if isinstance(item, (tuple, list)) else type(item).__name__
    raise PackingError(f"pipeline_forward_step's data_iterator gave a microbatch of {size}; expected "
                       "(input_ids, seq_lengths), (input_ids, seq_lengths, prefix_lengths, group_ids) for GRPO "
                       f"groups, or a dict of input_ids, seq_lengths and the tree's keywords {TREE_KEYS}")


def check_p2p_config(config, backend) -> None:
    """Refuse megatron-core's interleaved schedule with batched point-to-point sends over gloo (its losses and
    gradients came out wrong with no error; docs/pipeline.md). ``config`` is the model's ``TransformerConfig``
    (None: nothing to check), ``backend`` the pipeline's backend name (None: not distributed).

    Example: ``virtual_pipeline_model_parallel_size=2, batch_p2p_comm=True`` on ``"gloo"`` -> PackingError;
    ``batch_p2p_comm=False``, or ``"nccl"``, passes."""
    from nn_data.errors import PackingError

    if config is None or backend != "gloo":
        return
    interleaved = (getattr(config, "virtual_pipeline_model_parallel_size", None) or 1) > 1
    if interleaved and getattr(config, "batch_p2p_comm", False):
        raise PackingError("the interleaved pipeline schedule with batch_p2p_comm=True gives wrong losses and "
                           "gradients over gloo (megatron-core 0.16 and 0.19, no error raised); set "
                           "config.batch_p2p_comm=False (and config.overlap_p2p_comm=False) for gloo")


def _backend():
    """The default process group's backend name, or None when torch.distributed is not initialised."""
    import torch.distributed as dist

    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None
#: ``loss_fn(logits [1, tpr, V], inputs: RoundInputs) -> (loss, num_tokens)``: a round's loss on this rank's
#: local tokens (``inputs.targets``, ``inputs.loss_mask``).
RoundLossFn = Callable[[torch.Tensor, object], tuple]


def dynamic_cp_forward_step(loss_fn: RoundLossFn):
    """``forward_step_func(data_iterator, model)`` over a dynamic-CP step: each item is one round's
    :class:`~nn_data.dynamic_cp.RoundInputs` (iterate a ``DynamicCPStep``; ``num_microbatches`` is its ``len``);
    the model gets the round's ``input_ids [1, tpr]``, ``position_ids`` and ``packed``, whose ``PackedSeqParams``
    carry the round's group. Pass ``seq_length = tpr * cp`` to the schedule. On the last stage
    ``loss_fn(logits, inputs) -> (loss, num_tokens)``, returned as :func:`pipeline_forward_step` does.

    Raises :class:`~nn_data.errors.PackingError` for a round without ``PackedSeqParams`` (build the runner with
    ``make_packed_seq_params=True``)."""

    def forward_step(data_iterator, model):
        check_p2p_config(getattr(model, "config", None), _backend())
        inputs = next(data_iterator)
        if inputs.packed.packed_seq_params is None:
            from nn_data.errors import PackingError

            raise PackingError("dynamic_cp_forward_step needs each round's PackedSeqParams: build the runner with "
                               "DynamicCPRunner(..., make_packed_seq_params=True)")
        output = model(inputs.input_ids, inputs.position_ids, inputs.packed)  # logits [1, tpr, V] or hidden

        def loss_func(output_tensor: torch.Tensor):
            loss, num_tokens = loss_fn(output_tensor, inputs)
            num_tokens = torch.as_tensor(num_tokens, dtype=torch.int)
            return loss, num_tokens, {"loss": loss.detach().clone(), "num_tokens": num_tokens}

        return output, loss_func

    return forward_step
