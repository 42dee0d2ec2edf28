"""Shared-prefix cases, run in one process (tests/models/test_shared_prefix_models.py, C = 1) and on every
spawned rank (tests/multiprocess/test_shared_prefix_models_multiprocess.py, C = 2 and 4, gloo).

Each case runs ``PackedForward(...)(ids, L, prefix_lengths=P, group_ids=g)`` around an adapter (each
group's prompt packed once, then its responses) and compares it with every rollout run alone through
the model's own unpacked path, on its full row ``ids[b, :L[b]]``: the logits, and the parameter
gradients of a next-token loss over every rollout (summed over the CP group, as megatron-core's
gradient all-reduce does). Float64, so any slip shows.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from nn_data.groups import context_parallel_info
from nn_data.packed_forward import PackedForward
from tests.models.adapter_cases import VOCAB, token_loss

SEQ_LEN = 16

#: ``(group_ids, prefix_lengths, seq_lengths)`` per microbatch: groups of 3, 2 and 1, an empty response,
#: a prompt of 0 tokens, a response-only rollout beside a group, groups not contiguous in the batch.
MICROBATCHES = (
    ([7, 7, 7, 9], [5, 5, 5, 2], [8, 5, 11, 6]),
    ([3, 3], [4, 4], [16, 7]),
    ([1], [3], [3]),
    ([2, 5, 5, 2], [0, 3, 3, 0], [4, 6, 9, 5]),
    ([4, 6, 4], [6, 2, 6], [9, 12, 14]),
)


def rollouts(groups, prefix, lengths, gen: torch.Generator, seq_len: int = SEQ_LEN):
    """``(ids [B, S], L, P, g)``: every rollout of a group starts with the same ``P`` prompt tokens (drawn
    once per group), then tokens of its own; 0 past ``L``."""
    ids = torch.randint(1, VOCAB, (len(groups), seq_len), generator=gen)
    prompts = {g: torch.randint(1, VOCAB, (seq_len,), generator=gen) for g in dict.fromkeys(groups)}
    for b, (g, p) in enumerate(zip(groups, prefix)):
        ids[b, :p] = prompts[g][:p]
    ids = torch.where(torch.arange(seq_len) < torch.tensor(lengths)[:, None], ids, 0)
    return ids, torch.tensor(lengths), torch.tensor(prefix), torch.tensor(groups)


def packed_length(groups, prefix, lengths, multiple: int) -> int:
    """A fixed ``T``: every slot rounded up to ``multiple`` (each group's prompt once), plus two more."""
    up = lambda n: -(-n // multiple) * multiple  # noqa: E731
    prompts = {g: p for g, p in zip(groups, prefix)}
    natural = sum(up(p) for p in prompts.values()) + sum(up(n - p) for n, p in zip(lengths, prefix))
    return natural + 2 * multiple


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def shared_batches(microbatches, multiple: int):
    """``(ids, L, call kwargs, T)`` of each shared-prefix microbatch (``prefix_lengths``, ``group_ids``)."""
    gen = torch.Generator().manual_seed(1)
    for groups, prefix, lengths in microbatches:
        ids, lens, pre, gid = rollouts(groups, prefix, lengths, gen)
        yield ids, lens, dict(prefix_lengths=pre, group_ids=gid), packed_length(groups, prefix, lengths, multiple)


def check_shared_equivalence(make_adapter, model, alone, cp, *, microbatches=MICROBATCHES, batches=None,
                             **packed_forward_kwargs) -> dict:
    """Shared-prefix (or, with ``batches`` of ``(ids, L, call kwargs, T)``, rollout-tree) packed
    (CP-sharded) forward of ``make_adapter(model)`` == ``alone(ids [1, n]) -> [1, n, V]`` per rollout, and
    the gradients of the token loss equal; the largest differences."""
    worst_out = worst_grad = 0.0
    largest = {}
    multiple = 2 * cp.size
    for ids, lens, call, total in (batches or shared_batches(microbatches, multiple)):
        lengths = lens.tolist()
        wrapped = PackedForward(make_adapter(model), pad_individual_seqs_to_multiple_of=multiple,
                                pad_full_seq_to=total, cp_group=cp.group, **packed_forward_kwargs)
        model.zero_grad(set_to_none=True)
        out = wrapped(ids, lens, **call)  # [B, S, V]
        token_loss(out, ids, lens).backward()
        packed_grads = _grads(model)
        if cp.size > 1:
            for g in packed_grads.values():
                dist.all_reduce(g, group=cp.group)  # the CP part of megatron-core's gradient all-reduce
        model.zero_grad(set_to_none=True)
        total = 0.0
        for b, n in enumerate(lengths):
            assert not out[b, n:].any(), "output past a rollout's length must be 0"
            if n == 0:  # an empty rollout: nothing to run alone
                continue
            ref = alone(ids[b : b + 1, :n])  # [1, n, V]
            worst_out = max(worst_out, float((out[b, :n] - ref[0]).detach().abs().max()))
            total = total + token_loss(ref, ids[b : b + 1, :n], lens[b : b + 1])
        total.backward()
        alone_grads = _grads(model)
        assert packed_grads.keys() == alone_grads.keys() and packed_grads
        for name, g in packed_grads.items():
            largest[name] = max(largest.get(name, 0.0), float(g.abs().max()))
            worst_grad = max(worst_grad, float((g - alone_grads[name]).abs().max()))
    zero = [name for name, value in largest.items() if value == 0]
    assert largest and not zero, f"zero gradients {zero}: the check would prove nothing for them"
    return dict(cp_rank=cp.rank, cp_size=cp.size, out=worst_out, grad=worst_grad)


def _exact_rms_norm(module, hidden):
    return module.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + module.variance_epsilon))


@contextlib.contextmanager
def norms_in_model_dtype(model):
    """Inside the block the model's Llama-style RMSNorms compute in the model's dtype. transformers casts
    to float32 inside them whatever the dtype; a shared prompt's gradient sums its rollouts' in another
    order than each rollout alone, and that float32 cast rounds the 1e-16 differences to ~1e-7. The
    stand-in is checked against the original on float32 input first (the same formula)."""
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")]
    probe = torch.randn(3, norms[0].weight.shape[0], generator=torch.Generator().manual_seed(0))
    for m in norms:
        torch.testing.assert_close(_exact_rms_norm(m, probe.to(m.weight.dtype)).float(), m(probe).float())
        m.forward = _exact_rms_norm.__get__(m)
    try:
        yield
    finally:
        for m in norms:
            del m.forward


def case_hf(kind: str, dtype: torch.dtype = torch.float64, mask_kind: str = "dense", exact_norms: bool = False
            ) -> dict:
    """HFCausalLMAdapter on a tiny ``kind`` model (nn_data.models.tiny_hf), shared prefix, against each
    rollout as transformers runs it alone (``exact_norms``: under :func:`norms_in_model_dtype`)."""
    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.models.tiny_hf import tiny_hf_model

    model = tiny_hf_model(kind, dtype=dtype, moe=False)
    with norms_in_model_dtype(model) if exact_norms else contextlib.nullcontext():
        return check_shared_equivalence(lambda m: HFCausalLMAdapter(m, mask_kind=mask_kind), model,
                                        lambda ids: model(input_ids=ids, use_cache=False).logits,
                                        context_parallel_info())


def case_megatron(dtype: torch.dtype = torch.float64) -> dict:
    """MegatronGPTAdapter on the tiny GPTModel, shared prefix, against each rollout through megatron-core's
    stock unpacked path (its rotary embedding from position 0 of the rollout)."""
    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.models.tiny_megatron import forward_alone, tiny_gpt_config, tiny_gpt_model

    model = tiny_gpt_model(tiny_gpt_config(dtype=dtype))
    return check_shared_equivalence(MegatronGPTAdapter, model, lambda ids: forward_alone(model, ids),
                                    context_parallel_info(), make_packed_seq_params=True)


def case_hf_exact_norms(kind: str) -> dict:
    """:func:`case_hf` in float64 with the model's norms in float64 (:func:`norms_in_model_dtype`)."""
    return case_hf(kind, exact_norms=True)


#: A stream for the compiled cases: group sizes, prompt and response lengths vary; one T (96).
STREAM = (
    ([1, 1, 1, 1], [6, 6, 6, 6], [9, 7, 12, 6]),
    ([2, 2, 3], [3, 3, 5], [10, 4, 11]),
    ([4], [2], [14]),
    ([5, 5, 6, 6, 6], [4, 4, 1, 1, 1], [8, 16, 3, 9, 5]),
)


def case_compiled_cp() -> dict:
    """``PackedForward(compile_packing=True, row_capacity=6, pad_full_seq_to=96)`` around the HF adapter
    (tiny Llama, float32) under this rank's CP group, over :data:`STREAM`: the largest difference from
    each rollout alone and the compiled frames after each microbatch."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.models.tiny_hf import tiny_hf_model

    cp = context_parallel_info()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model = tiny_hf_model("llama")
    wrapped = PackedForward(HFCausalLMAdapter(model, mask_kind="dense"), pad_individual_seqs_to_multiple_of=2 * cp.size,
                            pad_full_seq_to=96, row_capacity=6, compile_packing=True,
                            compile_kwargs={"backend": counter}, cp_group=cp.group,
                            verify=False)  # the shared-prefix side's graphs only (the check's microbatch is plain)
    gen = torch.Generator().manual_seed(6)
    worst, frames = 0.0, []
    with torch.no_grad():
        for groups, prefix, lengths in STREAM:
            ids, lens, pre, gid = rollouts(groups, prefix, lengths, gen)
            out = wrapped(ids, lens, prefix_lengths=pre, group_ids=gid)
            for b, n in enumerate(lengths):
                alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]
                worst = max(worst, float((out[b, :n] - alone).abs().max()))
            frames.append(counter.frame_count)
    torch._dynamo.reset()
    return dict(worst=worst, frames=frames)


def case_hf_flex_forward() -> dict:
    """The tiny Llama (float32) with ``mask_kind="block"`` (flex attention: forward only on a CPU) under this
    rank's CP group, no grad: the largest difference from each rollout alone."""
    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.models.tiny_hf import tiny_hf_model

    cp = context_parallel_info()
    model = tiny_hf_model("llama")
    gen = torch.Generator().manual_seed(7)
    worst = 0.0
    with torch.no_grad():
        for groups, prefix, lengths in MICROBATCHES[:2]:
            ids, lens, pre, gid = rollouts(groups, prefix, lengths, gen)
            multiple = 2 * cp.size
            wrapped = PackedForward(HFCausalLMAdapter(model, mask_kind="block"), cp_group=cp.group,
                                    pad_individual_seqs_to_multiple_of=multiple,
                                    pad_full_seq_to=packed_length(groups, prefix, lengths, multiple))
            out = wrapped(ids, lens, prefix_lengths=pre, group_ids=gid)
            for b, n in enumerate(lengths):
                alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]
                worst = max(worst, float((out[b, :n] - alone).abs().max()))
    return dict(worst=worst)


def case_pipeline() -> dict:
    """megatron-core's 1F1B schedule at PP = 2 (two pipelines side by side on 4 ranks) over shared-prefix
    microbatches ``(ids, L, P, g)`` through ``pipeline_forward_step`` == PP = 1 == each rollout alone
    (float64): scripts/pipeline_example.compare with these microbatches, one of them empty (B = 0).
    ``T`` is the largest microbatch's shared-prefix length, shorter than that microbatch packed end to
    end (``end_to_end``): only the shared-prefix path fits it."""
    from scripts.pipeline_example import compare

    multiple = 4
    up = lambda n: -(-n // multiple) * multiple  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    batches = [rollouts(*mb, gen) for mb in MICROBATCHES]
    empty = torch.zeros(0, dtype=torch.long)
    batches.insert(2, (torch.zeros(0, SEQ_LEN, dtype=torch.long), empty, empty, empty))
    total = max(packed_length(*mb, multiple) - 2 * multiple for mb in MICROBATCHES)
    out = compare(torch.float64, multiple=multiple, total=total, batches=batches)
    return dict(out, end_to_end=max(sum(up(n) for n in lengths) for _, _, lengths in MICROBATCHES))
