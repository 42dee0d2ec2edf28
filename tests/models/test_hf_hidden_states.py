"""Tier: pure CPU, single process (tiny transformers models built from a config, nothing downloaded;
``compile_packing=True`` with the eager backend).

``HFCausalLMAdapter(model, output="hidden_states")``: the packed final hidden states, no ``[T, V]`` logits.
Per sequence they equal the model's base run on that sequence alone, on every family; fed with the output
layer's weight to ``TokenLogProbsFromHidden`` they give the log-probs (and gradients) of the logits path.
"""

from __future__ import annotations

import pytest
import torch

from nn_data import TokenLogProbsFromHidden
from nn_data.adapters import HFCausalLMAdapter
from nn_data.diagnostics import Allocations, GraphCounter
from nn_data.errors import PackingError
from nn_data.models.tiny_hf import KINDS, tiny_hf_model
from nn_data.packed_forward import PackedForward
from tests.models.adapter_cases import coded_ids

LENGTHS = [5, 0, 12, 3, 9]
M, T = 4, 48  # pad_individual_seqs_to_multiple_of, pad_full_seq_to


def _alone(model, ids):
    """The model's base on one unpacked sequence ``[1, n] -> [1, n, H]``."""
    return model.base_model(input_ids=ids, use_cache=False).last_hidden_state


@pytest.mark.parametrize("kind", KINDS)
def test_packed_hidden_states_equal_each_sequence_alone(kind):
    """float64 (Qwen3-Next without its MoE, which refuses it); the packing check (``verify``) runs on the
    hidden states too. Llama: the gradients of a loss on the hidden states as well."""
    model = tiny_hf_model(kind, dtype=torch.float64, moe=False)
    wrapped = PackedForward(HFCausalLMAdapter(model, output="hidden_states"), pad_individual_seqs_to_multiple_of=M,
                            pad_full_seq_to=T)
    ids, lens = coded_ids(LENGTHS, torch.Generator().manual_seed(3)), torch.tensor(LENGTHS)
    grads = kind == "llama"
    out = wrapped(ids, lens)  # [B, S, H]
    assert out.shape == (*ids.shape, model.config.hidden_size)
    if grads:
        (out.square().sum()).backward()
        packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    total = 0.0
    for b, n in enumerate(LENGTHS):
        assert not out[b, n:].any()
        if n:
            alone = _alone(model, ids[b : b + 1, :n])[0]  # [n, H]
            torch.testing.assert_close(out[b, :n], alone, rtol=0, atol=1e-12)
            total = total + alone.square().sum()
    if grads:
        total.backward()
        assert sorted(packed) == sorted(n for n in dict(model.named_parameters()) if n != "lm_head.weight")
        for name, grad in packed.items():  # every parameter but the output layer's, which is not run
            torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("compile_packing", [False, True], ids=["eager", "compiled_packing"])
def test_hidden_states_into_token_logprobs_from_hidden_equal_the_logits_path(compile_packing):
    """float64 Llama: ``prepare``, the adapter's hidden states ``[1, T, H]``, ``layout_of`` and
    ``TokenLogProbsFromHidden`` with the output layer's weight give, for every row, the log-softmax of the
    logits adapter's rows at the next tokens, and the same parameter gradients (the output layer's
    included). Compiled packing: one graph (the packing side; nothing is unpacked) over the stream, no
    recompile."""
    model = tiny_hf_model("llama", dtype=torch.float64)
    kwargs = dict(pad_individual_seqs_to_multiple_of=M, pad_full_seq_to=T, row_capacity=6, verify=False)
    hidden_fw = PackedForward(HFCausalLMAdapter(model, output="hidden_states"), compile_packing=compile_packing,
                              compile_kwargs={"backend": "eager"}, **kwargs)
    logits_fw = PackedForward(HFCausalLMAdapter(model), **kwargs)
    weight = model.get_output_embeddings().weight  # [V, H]
    head = TokenLogProbsFromHidden()
    gen = torch.Generator().manual_seed(5)
    torch._dynamo.reset()
    with GraphCounter() as counted:
        for lengths in (LENGTHS, [12, 12, 1], [0, 7, 2, 11, 4, 6]):
            ids, lens = coded_ids(lengths, gen), torch.tensor(lengths)
            inp = hidden_fw.prepare(ids, lens)
            hidden = hidden_fw.model(inp.input_ids, inp.position_ids, inp.packed)  # [1, T, H]
            layout = hidden_fw.layout_of(inp)
            got = head(hidden, weight, layout.pack(inp.row_ids), layout=layout, seq_len=ids.shape[1])[: inp.rows]
            model.zero_grad(set_to_none=True)
            got.sum().backward()
            fused = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            lp = logits_fw(ids, lens).log_softmax(-1)  # [B, S, V]
            want = torch.zeros_like(got)
            want[:, 1:] = lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # log p(x[s] | x[:s])
            want = want * (torch.arange(ids.shape[1]) < lens[:, None])
            want.sum().backward()
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-10)
            for name, p in model.named_parameters():
                torch.testing.assert_close(fused[name], p.grad, rtol=0, atol=1e-10, msg=name)
    assert counted.recompiles == 0 and counted.graphs == int(compile_packing), vars(counted)  # the packing side
    torch._dynamo.reset()


def test_hidden_states_output_builds_no_vocab_sized_tensor():
    """The adapter's forward allocates nothing of ``T x V`` elements with ``output="hidden_states"``, where
    the logits path allocates its ``[1, T, V]`` logits (a vocabulary larger than every other width)."""
    model = tiny_hf_model("llama", vocab=1000)
    ids, lens = coded_ids(LENGTHS, torch.Generator().manual_seed(3)), torch.tensor(LENGTHS)
    largest = {}
    for output in ("logits", "hidden_states"):
        wrapped = PackedForward(HFCausalLMAdapter(model, output=output), pad_individual_seqs_to_multiple_of=M,
                                pad_full_seq_to=T, verify=False)
        inp = wrapped.prepare(ids, lens)
        with torch.no_grad(), Allocations() as allocated:
            wrapped.model(inp.input_ids, inp.position_ids, inp.packed)
        largest[output] = max(allocated.sizes)
    assert largest["logits"] >= T * 1000 > largest["hidden_states"], largest


def test_hidden_states_of_no_token_and_a_bad_output():
    """No token on the rank: ``[1, 0, H]`` with a graph to run backward through; ``output`` is checked."""
    model = tiny_hf_model("llama")
    adapter = HFCausalLMAdapter(model, output="hidden_states")
    out = PackedForward(adapter, verify=False)(torch.zeros(2, 3, dtype=torch.long), torch.tensor([0, 0]))
    assert out.shape == (2, 3, model.config.hidden_size) and not out.any()
    out.sum().backward()
    with pytest.raises(PackingError, match=r"output='hidden' is invalid; expected one of \('logits', 'hidden_st"):
        HFCausalLMAdapter(model, output="hidden")
