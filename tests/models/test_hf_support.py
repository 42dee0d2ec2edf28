"""Tier: pure CPU, single process (tiny transformers models built from their config classes; nothing downloaded).

HFCausalLMAdapter keeps exact what nn_data.adapters.hf_support lists and refuses the rest: the six
configurations that would give wrong logits with no error (a window known from the config alone, dynamic
masks and rotary scaling, bidirectional attention, padding-index positions, ALiBi) and Bloom's crash, each
exact or refused by name; a window known from the config applied whatever the call passes; keywords and
masks outside the lists refused; a microbatch with no token (no pad_full_seq_to) gives empty rows.
"""

from __future__ import annotations

import re

import pytest
import torch

from nn_data.adapters import HFCausalLMAdapter
from nn_data.adapters.hf import packed_attention
from nn_data.adapters.hf_support import call_window, layer_window
from nn_data.errors import PackingError
from nn_data.masks import document_mask
from tests.support.hf_families import build, find
from nn_data.models.tiny_hf import tiny_hf_model
from nn_data.packed_forward import PackedForward
from tests.support.hf_matrix import TOLERANCE, compare

EXACT_TOL = TOLERANCE[torch.float32]


def _wrapped(model, **kwargs):
    return PackedForward(HFCausalLMAdapter(model), pad_individual_seqs_to_multiple_of=4, **kwargs)


@pytest.mark.parametrize("name", ["qwen2_moe:sliding", "phimoe:sliding"])
def test_a_window_known_only_from_the_config_is_applied(name):
    """Their attention calls pass no sliding_window=: the layer's window (config) applies anyway. The window
    changes the result at these lengths (a wide window gives other logits), so exactness checks it."""
    model = build(find(name))
    out, grad = compare(model, _wrapped(model))
    assert out <= EXACT_TOL[0] and grad <= EXACT_TOL[1], (out, grad)
    windows = {layer_window(m, model.config) for n, m in model.named_modules() if n.endswith("self_attn")}
    assert 3 in windows
    ids = torch.arange(1, 10)[None]
    wide = build(find(name.split(":")[0]))  # the family as shipped: no window at these lengths
    with torch.no_grad():
        assert float((model(input_ids=ids).logits - wide(input_ids=ids).logits).abs().max()) > 1e-3


@pytest.mark.parametrize("name, layer, reason", [
    ("doge:dynamic_mask", r"layer 'model.layers.0.self_attn' \(DogeAttention\) attends with its own attention mask",
     "a dynamic mask"),
    ("llama:rope_dynamic", r"layer 'model.rotary_emb': rotary type 'dynamic'", "longest position"),
    ("phi3:longrope", r"layer 'model.rotary_emb': rotary type 'longrope'", "longest position"),
    ("gemma3_text:bidirectional", r"layer '\(config\)': attention is not causal", "use_bidirectional_attention"),
    ("bloom", r"layer '\(all\)': ALiBi adds a position bias", "use a rotary model"),
    ("roberta", r"layer 'roberta.embeddings.position_embeddings': learned positions with padding_idx=0", "from 0"),
])
def test_what_shapes_attention_outside_the_lists_is_refused_by_name(name, layer, reason):
    """Each gave wrong logits with no error (Bloom crashed): now a PackingError naming the model type, the
    layer and the reason, when built or on the first call."""
    family = find(name)
    model = build(family)
    with pytest.raises(PackingError) as e:
        wrapped = _wrapped(model)
        wrapped(torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 0, 0]]), torch.tensor([5, 3]))
    message = str(e.value)
    assert f"model_type={family.model_type!r}" in message and reason in message, message
    assert re.search(layer, message), message


def test_a_model_made_mask_is_refused_under_torch_compile_too():
    """Compiled from its first call (no eager check call): dynamo raises the refusal as its own error."""
    model = build(find("doge:dynamic_mask"))
    compiled = torch.compile(HFCausalLMAdapter(model), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"DogeAttention\) attends with its own attention mask"):
        PackedForward(compiled, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=16)(
            torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 0, 0]]), torch.tensor([5, 3]))
    torch._dynamo.reset()


def test_a_module_marked_not_causal_is_refused_when_built():
    model = tiny_hf_model("llama")
    model.model.layers[1].self_attn.is_causal = False
    with pytest.raises(PackingError, match=r"model_type='llama': layer 'model.layers.1.self_attn': "
                                           r"LlamaAttention.is_causal is False"):
        HFCausalLMAdapter(model)


def test_a_call_passing_another_window_than_its_layers_is_refused():
    model = tiny_hf_model("mistral", window=3)
    HFCausalLMAdapter(model)  # marks each layer with its window
    attn = model.model.layers[0].self_attn
    assert call_window(attn, {}) == 3 and call_window(attn, {"sliding_window": 3}) == 3
    with pytest.raises(PackingError, match=r"model_type='mistral': layer 'model.layers.0.self_attn' "
                                           r"\(MistralAttention\) attends with sliding_window=5, but its layer's "
                                           r"window is 3"):
        call_window(attn, {"sliding_window": 5})


@pytest.mark.parametrize("kwargs, match", [
    ({"relative_bias_table": torch.zeros(2)}, r"attends with keyword relative_bias_table=<tensor \(2,\)>, which is "
                                              r"not in nn_data's list"),
    ({"is_causal": False}, r"attention is not causal \(is_causal=False\)"),
    ({"position_bias": torch.zeros(1)}, r"position_bias=<tensor \(1,\)>: nn_data's packed attention supports causal "
                                        r"attention with an optional sliding window only \(a position bias"),
])
def test_attention_keywords_outside_the_list_are_refused(kwargs, match):
    q = torch.zeros(1, 4, 3, 8)
    mask = document_mask(torch.arange(3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(PackingError, match=match):
        packed_attention(torch.nn.Module(), q, q, q, None, nn_data_mask=mask, **kwargs)


def test_a_mask_the_model_made_is_refused():
    q = torch.zeros(1, 4, 3, 8)
    mask = document_mask(torch.arange(3), torch.zeros(3, dtype=torch.long))
    placeholder = torch.ones((), dtype=torch.bool).expand(1, 1, 3, 3)
    packed_attention(torch.nn.Module(), q, q, q, placeholder[:, :, :, :3], nn_data_mask=mask)  # a view: accepted
    with pytest.raises(PackingError, match=r"attends with its own attention mask \(<tensor \(1, 1, 3, 3\)>, "
                                           r"torch.float32\)"):
        packed_attention(torch.nn.Module(), q, q, q, torch.zeros(1, 1, 3, 3), nn_data_mask=mask)


@pytest.mark.parametrize("lengths", [[], [0, 0, 0]], ids=["B=0", "every row empty"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3_next", "mamba2", "lfm2"])
def test_a_microbatch_with_no_token_without_pad_full_seq_to(kind, lengths):
    """T = 0 (no pad_full_seq_to): [B, S, V] zero rows, and backward runs (finding 11)."""
    model = tiny_hf_model(kind)
    ids, lens = torch.zeros(len(lengths), 7, dtype=torch.long), torch.tensor(lengths, dtype=torch.long)
    out = _wrapped(model)(ids, lens)
    assert out.shape == (len(lengths), 7, model.config.vocab_size) and not out.any()
    out.sum().backward()
