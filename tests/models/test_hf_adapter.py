"""Tier: pure CPU, single process (transformers 5.24 tiny Llama / Qwen2 built from a config; nothing
downloaded). Under CP: tests/multiprocess/test_adapters_multiprocess.py; the other families (sliding
windows, hybrids), the boundaries, host syncs and compiling: tests/models/test_hf_hybrids.py.

HFCausalLMAdapter without context parallelism, and nn_data's transformers attention function.
"""

from __future__ import annotations

import pytest
import torch

from nn_data.adapters import HFCausalLMAdapter
from nn_data.adapters.hf import ATTENTION_NAME, packed_attention
from nn_data.errors import PackingError
from nn_data.models.tiny_hf import tiny_hf_model
from nn_data.packed_forward import PackedForward
from tests.models.adapter_cases import coded_ids, token_loss

LENGTHS = [5, 0, 12, 3, 9]


def _run(model, wrapped, dtype):
    """Largest |packed - alone| over outputs and over the gradients of the token loss."""
    ids, lens = coded_ids(LENGTHS, torch.Generator().manual_seed(3)), torch.tensor(LENGTHS)
    model.zero_grad(set_to_none=True)
    out = wrapped(ids, lens)  # [B, S, V]
    token_loss(out, ids, lens).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    worst_out, total = 0.0, 0.0
    for b, n in enumerate(LENGTHS):
        if n:
            alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits  # [1, n, V]
            worst_out = max(worst_out, float((out[b, :n] - alone[0]).detach().abs().max()))
            total = total + token_loss(alone, ids[b : b + 1, :n], lens[b : b + 1])
        assert not out[b, n:].any()
    total.backward()
    worst_grad = max(float((packed[n] - p.grad).abs().max()) for n, p in model.named_parameters())
    assert all(float(g.abs().max()) > 0 for g in packed.values())
    return worst_out, worst_grad


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_equals_each_sequence_alone(kind, dtype, tol):
    """No CP: nn_data's document mask through the registered attention function (transformers would
    derive one from the restarting position ids too, with a host read)."""
    model = tiny_hf_model(kind, dtype=dtype)
    wrapped = PackedForward(HFCausalLMAdapter(model), pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=48)
    worst_out, worst_grad = _run(model, wrapped, dtype)
    assert worst_out < tol and worst_grad < tol, (worst_out, worst_grad)


def test_an_all_ones_attention_mask_would_leak_across_sequences():
    """Why the adapter passes no attention_mask without CP: all-ones turns the derivation off."""
    model = tiny_hf_model("llama", dtype=torch.float64)
    ids = coded_ids([6, 6], torch.Generator().manual_seed(4))[:, :6].reshape(1, 12)
    pos = torch.arange(6).repeat(2)[None]
    derived = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    leaky = model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False).logits
    alone = model(input_ids=ids[:, 6:], use_cache=False).logits
    torch.testing.assert_close(derived[:, 6:], alone, rtol=0, atol=1e-12)
    assert (leaky[:, 6:] - alone).abs().max() > 1e-3


class _IdentityGather(torch.nn.Module):
    """The adapter's CP path on one process: a 'gather' over a group of one is the identity."""

    def __init__(self, model):
        super().__init__()
        self.adapter = HFCausalLMAdapter(model, mask_kind="dense")

    def forward(self, input_ids, position_ids, packed):
        return self.adapter(input_ids, position_ids, packed._replace(cp=packed.cp._replace(gather=lambda kv: kv)))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_nn_data_attention_function_equals_transformers_derivation(kind):
    """The registered attention function (nn_data's mask, K/V through ``gather``) on one process,
    and the model's attention implementation restored after the call."""
    model = tiny_hf_model(kind, dtype=torch.float64)
    wrapped = PackedForward(_IdentityGather(model), pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=48)
    worst_out, worst_grad = _run(model, wrapped, torch.float64)
    assert worst_out < 1e-12 and worst_grad < 1e-12, (worst_out, worst_grad)
    assert model.config._attn_implementation == "sdpa"


def test_attention_function_refuses_sliding_window_and_softcap():
    from nn_data.masks import document_mask

    q = torch.zeros(1, 4, 3, 8)
    mask = document_mask(torch.arange(3), torch.zeros(3, dtype=torch.long))
    for name in ("sliding_window", "softcap"):
        with pytest.raises(PackingError, match=f"{name}=4"):
            packed_attention(torch.nn.Module(), q, q, q, None, **{name: 4, "nn_data_mask": mask})


def test_a_model_with_no_attention_layer_builds_no_mask_and_refuses_an_attention_call(monkeypatch):
    import nn_data.adapters.hf as hf

    def no_mask(*args, **kwargs):
        raise AssertionError("a document mask was built for a model without attention")

    model = tiny_hf_model("mamba2", dtype=torch.float64)
    monkeypatch.setattr(hf, "document_mask", no_mask)
    ids, lens = coded_ids(LENGTHS, torch.Generator().manual_seed(3)), torch.tensor(LENGTHS)
    out = PackedForward(HFCausalLMAdapter(model), verify="off")(ids, lens)  # [B, S, V]
    for b, n in enumerate(LENGTHS):
        if n:
            alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]
            assert torch.allclose(out[b, :n], alone, atol=1e-5, rtol=0)
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(PackingError, match="found no attention layer"):
        packed_attention(torch.nn.Module(), q, q, q, None, nn_data_mask=hf._NO_ATTENTION)


def test_adapter_refuses_a_model_without_a_transformers_config():
    with pytest.raises(PackingError, match="not a transformers PreTrainedModel"):
        HFCausalLMAdapter(torch.nn.Linear(2, 2))
    assert ATTENTION_NAME == "nn_data_packed"
