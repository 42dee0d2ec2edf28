"""The shared-prefix drop-in step as a case run on every spawned rank (tests/support/cp_harness.py;
tests/multiprocess/test_shared_prefix_dropin_multiprocess.py), and in one process: the planned GRPO step of
tests/megatron_data/test_shared_prefix_dropin_model.py (or the rollout-tree step of
tests/megatron_data/test_rollout_tree_dropin.py: ``module``) through ``get_microbatch_iterator`` under this rank's
CP group (megatron-core's ``parallel_state``), ``forward_shared_prefix`` on the tiny GPTModel (float64) and
``from_parallel_logits_to_logprobs_shared_prefix`` (and the hidden-state sibling), against every rollout run alone on this rank: the
largest differences of the logits, the log-probs and the parameter gradients (summed over the CP group, as
megatron-core's gradient all-reduce does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def case_dropin_step(module: str = "tests.megatron_data.test_shared_prefix_dropin_model") -> dict:
    import importlib

    from megatron.core import parallel_state

    from nn_data.cp_comm import GatherFromContextParallel
    from nn_data.models.tiny_megatron import forward_alone, tiny_gpt_config, tiny_gpt_model
    from nn_data.nemo_rl.megatron_data.tree_model import (
        forward_shared_prefix, from_parallel_hidden_states_to_logprobs_shared_prefix,
        from_parallel_logits_to_logprobs_shared_prefix,
    )
    from tests.megatron_data.test_shared_prefix_dropin_model import _next_token_logprobs

    step = importlib.import_module(module)

    cp_group = parallel_state.get_context_parallel_group()
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    model = tiny_gpt_model(tiny_gpt_config(dtype=torch.float64), vocab=step.VOCAB)
    _, mbs = step.planned_microbatches(cp=cp_size)
    weights = torch.Generator().manual_seed(3)
    gather = GatherFromContextParallel(cp_group, grad_mode="own", validate=False)
    worst_logits = worst_lp = worst_hidden = 0.0
    packed_loss = alone_loss = hidden_loss = 0.0
    for mb in mbs:
        data = mb.data_dict
        ids, lengths = data["input_ids"], data["input_lengths"].tolist()
        assert mb.shared_prefix.info.cp_size == cp_size and mb.input_ids_cp_sharded.shape[1] * cp_size == mb.input_ids.shape[1]
        logits = forward_shared_prefix(model, mb)  # [1, T/C, V]
        lp = from_parallel_logits_to_logprobs_shared_prefix(logits, mb.input_ids, mb.shared_prefix, step.S, 0,
                                                            step.VOCAB, None, cp_group=cp_group)  # [B, S-1]
        hidden = forward_shared_prefix(model, mb, output="hidden")  # [T/C, 1, H]
        from_hidden = from_parallel_hidden_states_to_logprobs_shared_prefix(
            hidden, model.output_layer.weight, mb.input_ids, mb.shared_prefix, step.S, 0, step.VOCAB, None,
            cp_group=cp_group)  # [B, S-1]
        worst_hidden = max(worst_hidden, float((from_hidden - lp).detach().abs().max()))
        full = gather(logits.detach(), layout=mb.shared_prefix.layout.layout)  # [1, T, V]
        rows = mb.shared_prefix.layout.unpack(full)  # [B, S, V]
        w = torch.rand(lp.shape, generator=weights, dtype=torch.float64)
        packed_loss = packed_loss + (lp * w).sum()
        hidden_loss = hidden_loss + (from_hidden * w).sum()
        for b, n in enumerate(lengths):
            ref = forward_alone(model, ids[b : b + 1, :n])[0]  # [n, V]
            ref_lp = _next_token_logprobs(ref, ids[b, :n])  # [n - 1]
            worst_logits = max(worst_logits, float((rows[b, :n] - ref).detach().abs().max()))
            worst_lp = max(worst_lp, float((lp[b, : n - 1] - ref_lp).detach().abs().max()))
            alone_loss = alone_loss + (ref_lp * w[b, : n - 1]).sum()
    packed, hidden = ({}, {})
    for loss, grads in ((packed_loss, packed), (hidden_loss, hidden)):
        model.zero_grad(set_to_none=True)
        loss.backward()
        grads.update(_grads(model))
        for g in grads.values():
            dist.all_reduce(g, group=cp_group)  # the CP part of megatron-core's gradient all-reduce
    model.zero_grad(set_to_none=True)
    alone_loss.backward()
    alone = _grads(model)
    assert packed.keys() == alone.keys() and packed and all(float(g.abs().max()) > 0 for g in alone.values())
    assert hidden.keys() == alone.keys()
    worst_grad = max(float((g[k] - alone[k]).abs().max()) for g in (packed, hidden) for k in g)
    return dict(cp_rank=cp_rank, cp_size=cp_size, logits=worst_logits, logprobs=max(worst_lp, worst_hidden),
                grad=worst_grad, microbatches=len(mbs), kinds=sorted({mb.shared_prefix.kind for mb in mbs}))
