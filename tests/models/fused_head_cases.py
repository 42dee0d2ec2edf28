"""Cases run on every spawned rank (tests/support/cp_harness.py) for the fused head on megatron-core models,
in tests/multiprocess/test_adapters_multiprocess.py: ``MegatronGPTAdapter(output="logprobs")`` against the
unfused adapter (logits, then their log-softmax), in ``PackedForward`` and in megatron-core's 1F1B
pipeline schedule; the NeMo-RL drop-in's patched ``GPTModel.forward`` against the unpatched model's
logits through the unfused drop-in. Float64 tiny models (``nn_data.models.tiny_megatron``), so any slip
shows: values and every parameter's gradient (summed over the CP group, as megatron-core's gradient
all-reduce does) at 1e-10.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nn_data.groups import context_parallel_info
from nn_data.packed_forward import PackedForward
from tests.models.adapter_cases import SEQ_LEN, VOCAB, batches, coded_ids

TOL = 1e-10


def _grads(model, cp_group=None) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().clone()
            if cp_group is not None:
                dist.all_reduce(g, group=cp_group)
            out[name] = g
    return out


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _tiny(tied: bool = False):
    """A float64 tiny GPTModel with nn_data's layer spec; ``tied``: output layer = embedding weight."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from nn_data.adapters import megatron_gpt_layer_spec
    from nn_data.models.tiny_megatron import init_by_global_name, tiny_gpt_config, tiny_gpt_model

    config = tiny_gpt_config(dtype=torch.float64)
    if not tied:
        return tiny_gpt_model(config, vocab=VOCAB)
    model = GPTModel(config, megatron_gpt_layer_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                     max_sequence_length=4096, position_embedding_type="rope",
                     share_embeddings_and_output_weights=True).to(torch.float64)
    init_by_global_name(model, 0)
    return model


def next_token_rows(logits: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, S]``: ``log_softmax(logits[b, s])[ids[b, s+1]]`` for ``s < L[b] - 1``, else 0 (the unfused
    adapter's rows turned into what ``output="logprobs"`` returns)."""
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)  # [B, S-1]
    valid = torch.arange(ids.shape[1] - 1) < (lengths[:, None] - 1)
    return torch.nn.functional.pad(torch.where(valid, lp, 0.0), (0, 1))  # [B, S]


def case_adapter_logprobs() -> dict:
    """``PackedForward(MegatronGPTAdapter(model, output="logprobs"))`` == the unfused adapter's logits
    rows at the next tokens (values and parameter gradients of a weighted sum), untied and tied."""
    from nn_data.adapters import MegatronGPTAdapter

    cp = context_parallel_info()
    worst = {"values": 0.0, "grads": 0.0}
    gen = torch.Generator().manual_seed(3)
    for tied in (False, True):
        model = _tiny(tied)
        for lengths, full in batches(cp.size):
            ids, lens = coded_ids(lengths, gen), torch.tensor(lengths)
            weight = torch.randn(len(lengths), SEQ_LEN, generator=gen, dtype=torch.float64)
            common = dict(cp_group=cp.group, pad_individual_seqs_to_multiple_of=2 * cp.size, pad_full_seq_to=full,
                          make_packed_seq_params=True)
            results = []
            for adapter in (MegatronGPTAdapter(model), MegatronGPTAdapter(model, output="logprobs", chunk_tokens=5)):
                model.zero_grad(set_to_none=True)
                out = PackedForward(adapter, **common)(ids, lens)
                rows = next_token_rows(out, ids, lens) if adapter.output == "logits" else out
                (rows * weight).sum().backward()
                results.append((rows.detach(), _grads(model, cp.group)))
            (want, want_g), (got, got_g) = results
            assert got.shape == (len(lengths), SEQ_LEN)
            worst["values"] = max(worst["values"], float((got - want).abs().max()))
            worst["grads"] = max(worst["grads"], _worst(got_g, want_g))
    return dict(cp_rank=cp.rank, cp_size=cp.size, **worst)


def case_patched_forward() -> dict:
    """NeMo-RL's ``patch_gpt_model_forward_for_linear_ce_fusion`` (nn_data's): with
    ``return_logprobs_for_linear_ce_fusion=True`` the model returns ``[1, T-1]`` packed log-probs (labels the
    CP-sharded ids, as NeMo-RL passes them, or the full ones) equal to the unpatched model's logits through
    the unfused packed drop-in, values and ``C``-times parameter gradients; at CP 1 also unpacked rows
    ``[B, S-1]``; without the switch the forward is the original one. Untied and tied."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.models.tiny_megatron import causal_attention_mask
    from nn_data.nemo_rl import model_utils as mu

    cp = context_parallel_info()
    original = GPTModel.forward
    mu.patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=3)
    worst = {"values": 0.0, "grads": 0.0, "plain": 0.0}
    gen = torch.Generator().manual_seed(4)
    try:
        for tied in (False, True):
            model = _tiny(tied)
            adapter = MegatronGPTAdapter(model)
            for lengths, full in batches(cp.size)[:2]:
                ids, lens = coded_ids(lengths, gen), torch.tensor(lengths)
                packing = PackedForward(adapter, cp_group=cp.group, pad_individual_seqs_to_multiple_of=2 * cp.size,
                                        pad_full_seq_to=full, make_packed_seq_params=True)
                inp = packing.prepare(ids, lens)
                cu_pad = inp.packed.cu_seqlens_padded
                full_ids = packing.pack(ids, lens).packed  # [1, T]
                lw = torch.randn(len(lengths), SEQ_LEN - 1, generator=gen, dtype=torch.float64)
                model.zero_grad(set_to_none=True)
                logits = adapter(inp.input_ids, inp.position_ids, inp.packed)  # [1, T/C, V], the original forward
                rows = mu.from_parallel_logits_to_logprobs_packed_sequences(
                    logits, full_ids, cu_pad, SEQ_LEN, 0, VOCAB, None, cp_group=cp.group)  # [B, S-1]
                (rows * lw).sum().backward()
                want_g = _grads(model, cp.group)
                at = _packed_positions(cu_pad, SEQ_LEN, full)  # where each row's values sit in [1, T-1]
                for labels in (inp.input_ids, full_ids):
                    model.zero_grad(set_to_none=True)
                    packed = adapter(inp.input_ids, inp.position_ids, inp.packed, labels=labels,
                                     return_logprobs_for_linear_ce_fusion=True)  # [1, T-1]
                    assert packed.shape == (1, full - 1)
                    got = torch.zeros_like(rows).index_put((at[0], at[1]), packed[0, at[2]])
                    (got * lw).sum().backward()
                    worst["values"] = max(worst["values"], float((got - rows).abs().max()))
                    worst["grads"] = max(worst["grads"], _worst(_grads(model, cp.group), want_g))
                plain = adapter(inp.input_ids, inp.position_ids, inp.packed)
                worst["plain"] = max(worst["plain"], float((plain - logits).abs().max()))
            if cp.size == 1:
                worst = _unpacked_rows(model, gen, worst, causal_attention_mask)
    finally:
        for name in ("_linear_ce_fusion_forward_patched", "_original_forward_for_linear_ce_fusion",
                     "_linear_ce_fusion_chunk_size"):
            if name in vars(GPTModel):
                delattr(GPTModel, name)
        GPTModel.forward = original
    return dict(cp_rank=cp.rank, cp_size=cp.size, **worst)


def _packed_positions(cu_pad: torch.Tensor, seq_len: int, total: int):
    """``(row, s, packed position)`` of every value NeMo-RL's ``[B, S-1]`` rows hold: ``s < min(n_b - 1, S - 1)``."""
    rows, cols, where = [], [], []
    bounds = [int(v) for v in cu_pad]
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        for s in range(min(end - start - 1, seq_len - 1)):
            rows.append(b), cols.append(s), where.append(start + s)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long), torch.tensor(where, dtype=torch.long)


def _unpacked_rows(model, gen, worst: dict, causal_attention_mask) -> dict:
    """CP 1, unpacked rows ``[B, S]`` through the patched forward: ``[B, S-1]`` equal to the logits' log-probs."""
    from nn_data.nemo_rl import model_utils as mu

    ids = torch.randint(1, VOCAB, (2, SEQ_LEN), generator=gen)
    ids[1, 4] = VOCAB + 3  # an id past the vocabulary as a target only (the embedding never sees it)
    inputs = ids.clamp(max=VOCAB - 1)
    pos = torch.arange(SEQ_LEN)[None].expand(2, -1)
    mask = causal_attention_mask(SEQ_LEN)
    lw = torch.randn(2, SEQ_LEN - 1, generator=gen, dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    rows = mu.from_parallel_logits_to_logprobs(model(inputs, pos, mask), ids, 0, VOCAB, None)
    (rows * lw).sum().backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    got = model(inputs, pos, mask, labels=ids, return_logprobs_for_linear_ce_fusion=True)  # [B, S-1]
    (got * lw).sum().backward()
    worst["values"] = max(worst["values"], float((got - rows).abs().max()))
    worst["grads"] = max(worst["grads"], _worst(_grads(model), want))
    return worst


def case_pipeline_logprobs() -> dict:
    """megatron-core's 1F1B schedule (PP = 2, two pipelines side by side on 4 ranks) with the log-prob
    adapter and a loss on its rows == PP = 1 with the logits adapter and the same loss on the logits'
    log-probs: per-microbatch losses and every stage's gradients."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from nn_data.adapters import MegatronGPTAdapter, pipeline_forward_step
    from nn_data.models.tiny_megatron import global_parameter_names, tiny_gpt_config, tiny_gpt_model
    from scripts.pipeline_example import PipelineGroups, microbatches

    total, multiple = 112, 4
    mbs = microbatches(7, multiple)

    def run(model, output: str):
        adapter = MegatronGPTAdapter(model, output=output, chunk_tokens=7)
        packing = PackedForward(adapter, pad_individual_seqs_to_multiple_of=multiple, pad_full_seq_to=total,
                                make_packed_seq_params=True)

        def loss_fn(rows, ids, lengths):
            lp = rows if output == "logprobs" else next_token_rows(rows, ids, lengths)
            return -lp.sum(), (lengths - 1).clamp(min=0).sum()

        model.zero_grad(set_to_none=True)
        reduced = get_forward_backward_func()(
            forward_step_func=pipeline_forward_step(packing, loss_fn), data_iterator=iter(mbs), model=[adapter],
            num_microbatches=len(mbs), seq_length=total, micro_batch_size=1, forward_only=False)
        names = global_parameter_names(model)
        return [float(r["loss"]) for r in reduced], {names[n]: p.grad.clone() for n, p in model.named_parameters()}

    groups = PipelineGroups("parallel_state")
    try:
        groups.set(pp=2, vpp=1)
        first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
        stage = tiny_gpt_model(tiny_gpt_config(dtype=torch.float64, pipeline=2), pre_process=first, post_process=last)
        pp2_losses, pp2_grads = run(stage, "logprobs")
        groups.set(pp=1, vpp=1)
        whole = tiny_gpt_model(tiny_gpt_config(dtype=torch.float64))
        pp1_losses, pp1_grads = run(whole, "logits")
    finally:
        groups.close()
    out = dict(rank=dist.get_rank(), grads=max(float((pp2_grads[n] - pp1_grads[n]).abs().max()) for n in pp2_grads),
               parameters=len(pp2_grads))
    if last:
        out["losses"] = max(abs(a - b) for a, b in zip(pp2_losses, pp1_losses))
        out["count"] = len(pp2_losses)
        out["positive"] = min(abs(x) for i, x in enumerate(pp1_losses) if i != 3) > 0
    return out
