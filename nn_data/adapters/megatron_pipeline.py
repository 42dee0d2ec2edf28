"""A ``forward_step_func`` for megatron-core's pipeline schedules that packs every microbatch
to one constant ``T`` with :class:`~nn_data.packed_forward.PackedForward`.

Why one ``T``: a pipeline stage receives its input activations ``[T/C, 1, E]`` into a buffer
allocated from the schedule's ``seq_length`` before the sender's microbatch is known, so
every microbatch must have the same ``T``. ``pad_full_seq_to`` gives exactly that; without it
gloo accepted a shorter message into the longer buffer silently and the next stage failed
later (seen here), NCCL may hang. NeMo-RL pads to ``pad_full_seq_to`` for PP > 1 for this reason.

Example (every pipeline rank runs the same code on the same microbatches)::

    adapter = MegatronGPTAdapter(stage_model)        # stage_model: GPTModel(pre_process=..., post_process=...)
    packing = PackedForward(adapter, pad_individual_seqs_to_multiple_of=8, pad_full_seq_to=T,
                            make_packed_seq_params=True)
    forward_backward = get_forward_backward_func()
    losses = forward_backward(forward_step_func=pipeline_forward_step(packing, token_loss),
                              data_iterator=iter(microbatches), model=[adapter],
                              num_microbatches=len(microbatches), seq_length=T, micro_batch_size=1)
"""

from __future__ import annotations

from typing import Callable

import torch

from nn_data.packed_forward import PackedForward

#: ``loss_fn(rows [B, S, *], input_ids [B, S], seq_lengths [B]) -> (loss, num_tokens)``.
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]


def pipeline_forward_step(packing: PackedForward, loss_fn: LossFn):
    """``forward_step_func(data_iterator, model)`` for ``get_forward_backward_func()``.

    ``packing`` is a :class:`PackedForward` with ``pad_full_seq_to`` set (the constant ``T``;
    pass ``seq_length=T`` and ``micro_batch_size=1`` to the schedule); its ``.model`` is only
    used for the contract, the model called is the schedule's ``model`` (the adapter, e.g.
    :class:`~nn_data.adapters.MegatronGPTAdapter`, which forwards ``set_input_tensor`` and
    ``config`` to megatron-core). Each item of ``data_iterator`` is ``(input_ids [B, S],
    seq_lengths [B])``; ``B`` and the lengths may differ between microbatches.

    On the last stage ``loss_fn`` gets the microbatch's rows ``[B, S, *]`` (the model's packed
    output unpacked by ``packing.finish``: logits ``[B, S, V]``, or with
    ``MegatronGPTAdapter(..., output="logprobs")`` the next tokens' log-probs ``[B, S]``, the logits never
    built) and returns ``(loss, num_tokens)``; the step returns
    them to the schedule as ``(loss, num_tokens, {"loss": ..., "num_tokens": ...})`` (megatron-core
    divides by ``num_tokens`` unless ``config.calculate_per_token_loss``).

    Raises :class:`~nn_data.errors.PackingError` when ``packing`` has no ``pad_full_seq_to``.
    """
    if packing.pack.pad_full_seq_to is None:
        from nn_data.errors import PackingError

        raise PackingError("pipeline_forward_step needs PackedForward(pad_full_seq_to=T): every microbatch a "
                           "pipeline stage receives must have the same T")

    def forward_step(data_iterator, model):
        input_ids, seq_lengths = next(data_iterator)
        inp = packing.prepare(input_ids, seq_lengths)
        output = model(inp.input_ids, inp.position_ids, inp.packed)  # logits [1, T/C, V] (or log-probs [1, T/C]), hidden [T/C, 1, E]

        def loss_func(output_tensor: torch.Tensor):
            rows = packing.finish(output_tensor, inp)  # [B, S, *]
            loss, num_tokens = loss_fn(rows, input_ids, seq_lengths)
            num_tokens = torch.as_tensor(num_tokens, dtype=torch.int)
            return loss, num_tokens, {"loss": loss.detach().clone(), "num_tokens": num_tokens}

        return output, loss_func

    return forward_step
