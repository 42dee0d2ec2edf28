"""Tier: pure CPU, single process (a tiny transformers Llama built from a config, nothing downloaded; a tiny
megatron-core GPTModel on one rank).

What a caller may pass to ``PackedForward(adapter)`` besides the batch: model keywords go through to the
model, or are refused by name with the reason (a cache, the keywords nn_data sets itself);
a model and batch on the ``meta`` device run (shapes only, nothing to validate) with a fixed packed length,
and are refused by name without one.
"""

from __future__ import annotations

import pytest
import torch

from nn_data.adapters import HFCausalLMAdapter
from nn_data.errors import PackingError
from nn_data.models.tiny_hf import tiny_hf_model
from nn_data.packed_forward import PackedForward
from tests.support.megatron_release import needs_megatron_models, one_rank_parallel_state

LENGTHS, S = [5, 8, 0, 3], 8


@pytest.fixture(scope="module")
def wrapped():
    return PackedForward(HFCausalLMAdapter(tiny_hf_model("llama")))


def _batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 97, (len(LENGTHS), S), generator=gen)
    return ids, torch.tensor(LENGTHS)


def test_use_cache_false_and_other_model_keywords_go_through(wrapped):
    ids, lengths = _batch()
    plain = wrapped(ids, lengths)
    assert torch.equal(wrapped(ids, lengths, use_cache=False), plain)
    assert torch.equal(wrapped(ids, lengths, output_attentions=False, return_dict=True), plain)


@pytest.mark.parametrize("kwargs, name", [({"use_cache": True}, "use_cache=True"),
                                          ({"past_key_values": object()}, "past_key_values=<object>")])
def test_a_cache_is_refused_by_name_with_the_reason(wrapped, kwargs, name):
    ids, lengths = _batch()
    with pytest.raises(PackingError) as e:
        wrapped(ids, lengths, **kwargs)
    message = str(e.value)
    assert message.startswith(f"model_type='llama': {name}") and "cannot keep packed documents apart" in message
    assert "attends across documents" in message and "leave out use_cache and past_key_values" in message


@pytest.mark.parametrize("name", ["attention_mask", "cu_seq_lens_q", "max_length_k"])
def test_a_keyword_nn_data_sets_from_the_layout_is_refused_by_name(wrapped, name):
    ids, lengths = _batch()
    with pytest.raises(PackingError, match=rf"model_type='llama': the model keyword {name} is set by nn_data from "
                                           rf"the packed layout .* leave out {name}$"):
        wrapped(ids, lengths, **{name: torch.ones(1)})


def test_the_adapters_own_arguments_are_refused_by_name(wrapped):
    ids, lengths = _batch()
    with pytest.raises(PackingError, match=r"^position_ids= is made by PackedForward from the packed layout and "
                                           r"passed to the adapter itself; leave out position_ids"):
        wrapped(ids, lengths, position_ids=torch.arange(S))


def _meta_model():
    with torch.device("meta"):
        return tiny_hf_model("llama")


def test_a_model_on_the_meta_device_runs_with_a_fixed_packed_length():
    """Meta tensors have no values: the packing takes the device path (no read), whose checks have nothing to
    check; the logits have their shape, shared prefix included."""
    ids, lengths = (t.to("meta") for t in _batch())
    wrapped = PackedForward(HFCausalLMAdapter(_meta_model()), pad_full_seq_to=32)
    out = wrapped(ids, lengths)
    assert out.device.type == "meta" and out.shape == (len(LENGTHS), S, 97)
    groups, prefixes = torch.tensor([0, 1, 2, 3], device="meta"), torch.tensor([2, 3, 0, 1], device="meta")
    assert wrapped(ids, lengths, prefix_lengths=prefixes, group_ids=groups).shape == (len(LENGTHS), S, 97)


def test_a_model_on_the_meta_device_without_a_fixed_packed_length_is_refused_by_name():
    ids, lengths = (t.to("meta") for t in _batch())
    with pytest.raises(PackingError, match=r"seq_lengths is on the meta device \(no values\), so the packed length "
                                           r"T.* cannot be learned from it; set pad_full_seq_to"):
        PackedForward(HFCausalLMAdapter(_meta_model()))(ids, lengths)


@needs_megatron_models
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_megatron_adapter_passes_model_keywords_and_refuses_the_ones_it_sets_or_a_cache():
    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.models.tiny_megatron import tiny_gpt_config, tiny_gpt_model

    ids, lengths = _batch()
    with one_rank_parallel_state(), torch.no_grad():
        wrapped = PackedForward(MegatronGPTAdapter(tiny_gpt_model(tiny_gpt_config())), make_packed_seq_params=True)
        plain = wrapped(ids, lengths)
        assert torch.equal(wrapped(ids, lengths, decoder_input=None), plain)
        with pytest.raises(PackingError, match=r"^MegatronGPTAdapter: the model keyword packed_seq_params is set by "
                                               r"nn_data from the packed layout .* leave out packed_seq_params$"):
            wrapped(ids, lengths, packed_seq_params=None)
        with pytest.raises(PackingError, match=r"^MegatronGPTAdapter: inference_context \(a KV cache\) cannot keep "
                                               r"packed documents apart"):
            wrapped(ids, lengths, inference_context=object())
