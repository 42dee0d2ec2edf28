"""Tier: pure CPU, single process (tiny transformers models built from configs).

A model edited after PackedForward wrapped it (a window, layer types, the bidirectional switch, the rotary module,
an attention module or its forward, an attention function registered and selected, a Mamba-2 mixer
re-initialised) either runs exact (each sequence as if alone, compared here with the plain model) or is refused
with a PackingError naming the model type, the layer, the reason and the fix: its fingerprint
(nn_data.model_identity) changes, and the adapter's allow-list and the packing check run again.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nn_data.adapters import HFCausalLMAdapter
from nn_data.errors import PackingError
from nn_data.model_identity import fingerprint
from nn_data.models.tiny_hf import tiny_hf_model
from tests.models.model_check_cases import (FIX, OWN_PATH, TOKENS, assert_exact, batch, family, registered_attention,
                                            wrapped_hf)

# -- edits after wrapping -----------------------------------------------------------------------------------


def test_a_window_the_model_ignores_but_the_list_would_apply_is_refused_by_its_own_path():
    model = tiny_hf_model("llama")  # Llama's attention ignores config.sliding_window
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    wrapped(ids, lens)
    model.config.sliding_window = 3
    try:
        out = wrapped(ids, lens)
    except PackingError as e:
        assert re.search(rf"model_type='llama': layer 'model.model.layers.0.self_attn' \(LlamaAttention\): "
                         rf"{OWN_PATH}.*{FIX}", str(e)), str(e)
    else:
        assert_exact(model, out, ids, lens)


def test_a_window_changed_after_wrapping_is_read_again_and_runs_exact():
    model = tiny_hf_model("mistral", window=3)
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    wrapped(ids, lens)
    model.config.sliding_window = 5
    assert_exact(model, wrapped(ids, lens), ids, lens)
    assert wrapped.model.layers.window == 5
    model.config.sliding_window = None  # no window at all
    assert_exact(model, wrapped(ids, lens), ids, lens)


@pytest.mark.parametrize("name", ["phimoe:sliding", "qwen2_moe:sliding", "gemma3_text"])
def test_a_family_window_changed_after_wrapping_runs_exact_or_is_refused(name):
    model = family(name).eval()
    wrapped = wrapped_hf(model)
    ids, lens = batch(vocab=model.config.vocab_size, lengths=[12, 7, 10])
    wrapped(ids, lens)
    model.config.sliding_window = 6
    try:
        out = wrapped(ids, lens)
    except PackingError as e:
        assert f"model_type='{model.config.model_type}': layer" in str(e) and FIX in str(e)
    else:
        assert_exact(model, out, ids, lens)


def test_layer_types_changed_in_place_after_wrapping_run_exact_or_are_refused():
    model = family("qwen2_moe:sliding").eval()
    wrapped = wrapped_hf(model)
    ids, lens = batch(vocab=model.config.vocab_size, lengths=[12, 7, 10])
    wrapped(ids, lens)
    model.config.layer_types.reverse()  # an edit in place: the sliding layer is now the other one
    try:
        out = wrapped(ids, lens)
    except PackingError as e:
        assert "model_type='qwen2_moe': layer" in str(e) and FIX in str(e)
    else:
        assert_exact(model, out, ids, lens)


def test_gemma3_turned_bidirectional_after_wrapping_is_refused():
    model = family("gemma3_text").eval()
    wrapped = wrapped_hf(model)
    ids, lens = batch(vocab=model.config.vocab_size)
    wrapped(ids, lens)
    model.config.use_bidirectional_attention = True
    with pytest.raises(PackingError, match=r"model_type='gemma3_text': layer '\(config\)': attention is not causal.*"
                                           r"run it unpacked"):
        wrapped(ids, lens)


def test_a_rotary_module_swapped_to_dynamic_or_given_a_rope_type_is_refused():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = tiny_hf_model("llama")
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    wrapped(ids, lens)
    model.model.rotary_emb.rope_type = "dynamic"
    with pytest.raises(PackingError, match=r"model_type='llama': layer 'model.rotary_emb': rotary type 'dynamic' "
                                           r"computes its frequencies from the batch's longest position.*run it "
                                           r"unpacked"):
        wrapped(ids, lens)
    config = type(model.config)(**model.config.to_dict())
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model.model.rotary_emb = LlamaRotaryEmbedding(config)
    with pytest.raises(PackingError, match=r"layer 'model.rotary_emb': rotary type 'dynamic'"):
        wrapped(ids, lens)


class _DirectSDPA(nn.Module):
    """Attention of its own: torch's SDPA over the whole row, causal in row positions."""

    def __init__(self, hidden: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv, self.o_proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, hidden_states, *args, **kwargs):
        b, t, d = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, h, t, d/h]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, d)), None


def test_a_layer_replaced_by_one_calling_sdpa_directly_is_refused():
    model = tiny_hf_model("llama")
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    wrapped(ids, lens)
    model.model.layers[1].self_attn = _DirectSDPA()
    with pytest.raises(PackingError, match=rf"model_type='llama': layer 'model.model.layers.1.self_attn' "
                                           rf"\(_DirectSDPA\): {TOKENS}.*{FIX}"):  # not named *Attention: the check
        wrapped(ids, lens)


def test_an_attention_modules_forward_patched_after_wrapping_is_refused_naming_it():
    model = tiny_hf_model("llama")
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    wrapped(ids, lens)
    attn = model.model.layers[0].self_attn
    original = attn.forward

    def patched(hidden_states, *args, **kwargs):  # adds a causal running mean of the row's hidden states
        out, weights = original(hidden_states, *args, **kwargs)
        steps = torch.arange(1, hidden_states.shape[1] + 1, dtype=hidden_states.dtype)[None, :, None]
        return out + hidden_states.cumsum(1) / steps, weights

    attn.forward = patched
    with pytest.raises(PackingError, match=rf"model_type='llama': layer 'model.model.layers.0.self_attn' "
                                           rf"\(LlamaAttention\): {TOKENS}.*{FIX}"):
        wrapped(ids, lens)


def test_an_attention_function_registered_and_selected_is_refused_before_or_after_wrapping():
    from transformers import AttentionInterface

    AttentionInterface.register("test_scaled_keys", registered_attention)
    model = tiny_hf_model("llama")
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    wrapped(ids, lens)
    model.config._attn_implementation = "test_scaled_keys"
    message = (r"model_type='llama': layer '\(config._attn_implementation\)': attention implementation "
               r"'test_scaled_keys' is not one nn_data routes through.*run the model unpacked")
    with pytest.raises(PackingError, match=message):
        wrapped(ids, lens)
    with pytest.raises(PackingError, match=message):
        HFCausalLMAdapter(model)


def test_a_function_registered_over_transformers_own_name_is_refused():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("sdpa", registered_attention)
    try:
        with pytest.raises(PackingError, match=r"layer '\(config._attn_implementation\)': the function registered "
                                               r"under 'sdpa' .* is not transformers' own.*run the model unpacked"):
            HFCausalLMAdapter(tiny_hf_model("llama"))
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)


def test_a_mamba2_mixer_reinitialised_in_place_after_wrapping_runs_exact():
    model = tiny_hf_model("mamba2")
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    wrapped(ids, lens)
    mixer = model.backbone.layers[1].mixer
    type(mixer).__init__(mixer, model.config, layer_idx=1)  # the same object, its __init__ run again (no hooks)
    assert_exact(model, wrapped(ids, lens), ids, lens)


def test_an_edit_between_building_the_adapter_and_its_first_call_is_read():
    model = tiny_hf_model("mistral", window=3)
    wrapped = wrapped_hf(model)
    model.config.sliding_window = 6  # before the first call
    ids, lens = batch()
    assert_exact(model, wrapped(ids, lens), ids, lens)
    assert wrapped.model.layers.window == 6


def test_a_mamba2_mixer_reinitialised_after_wrapping_runs_exact():
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    model = tiny_hf_model("mamba2")
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    wrapped(ids, lens)
    model.backbone.layers[0].mixer = Mamba2Mixer(model.config, layer_idx=0)
    assert_exact(model, wrapped(ids, lens), ids, lens)


# -- the fingerprint --------------------------------------------------------------------------------------------


def _edits():
    """Each edit after wrapping that the fingerprint must see, as a function of a fresh tiny Llama."""
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import LlamaMLP

    def layer_types_in_place(m):
        m.config.layer_types[1] = "sliding_attention"

    def patched_forward(m):
        attn = m.model.layers[0].self_attn
        attn.forward = attn.forward

    def class_forward(m):
        LlamaMLP.forward = _shifted(LlamaMLP.forward)

    return {
        "class forward patched": class_forward,
        "hook registered": lambda m: m.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: out),
        "hook registered on every module": lambda m: nn.modules.module.register_module_forward_hook(
            lambda mod, args, out: out),
        "sliding_window": lambda m: setattr(m.config, "sliding_window", 5),
        "layer_types in place": layer_types_in_place,
        "bidirectional": lambda m: setattr(m.config, "use_bidirectional_attention", True),
        "rope_type": lambda m: setattr(m.model.rotary_emb, "rope_type", "dynamic"),
        "rope_parameters": lambda m: m.config.rope_parameters.update(rope_type="linear", factor=2.0),
        "module replaced": lambda m: setattr(m.model.layers[1], "mlp", LlamaMLP(m.config)),
        "forward patched": patched_forward,
        "attention implementation": lambda m: setattr(m.config, "_attn_implementation", "eager"),
        "function registered under the selected name": lambda m: AttentionInterface.register("sdpa", registered_attention),
    }


def _shifted(forward):
    """``forward`` with each token also seeing the previous token of the row (a path between packed sequences)."""
    def mixing_forward(self, x):
        return forward(self, x + F.pad(x, (0, 0, 1, 0))[:, :-1])
    return mixing_forward


@pytest.fixture
def restored():
    """Whatever a test patches on classes or registers globally is put back after it."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import LlamaMLP

    forward, hooks = LlamaMLP.forward, dict(nn.modules.module._global_forward_hooks)
    yield
    LlamaMLP.forward = forward
    nn.modules.module._global_forward_hooks.clear()
    nn.modules.module._global_forward_hooks.update(hooks)
    AttentionInterface.register("sdpa", sdpa_attention_forward)


@pytest.mark.parametrize("edit", list(_edits()))
def test_the_fingerprint_sees_each_edit_and_holds_across_calls(edit, restored):
    model = tiny_hf_model("llama")
    model.config.layer_types = ["full_attention", "full_attention"]
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    wrapped(ids, lens)
    seen = fingerprint(wrapped.model)
    wrapped(ids, lens)
    assert fingerprint(wrapped.model) == seen  # a call changes nothing it holds
    _edits()[edit](model)
    assert fingerprint(wrapped.model) != seen


def test_a_class_forward_patched_after_some_calls_is_refused_on_the_next_call(restored):
    from transformers.models.llama.modeling_llama import LlamaMLP

    model = tiny_hf_model("llama")
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    for _ in range(3):
        wrapped(ids, lens)
    LlamaMLP.forward = _shifted(LlamaMLP.forward)  # every LlamaMLP, the wrapped model's included
    with pytest.raises(PackingError, match=rf"model_type='llama': layer 'model.model.layers.0.mlp' \(LlamaMLP\): "
                                           rf"{TOKENS}.*{FIX}"):
        wrapped(ids, lens)


def test_a_hook_that_mixes_registered_after_wrapping_is_refused(restored):
    model = tiny_hf_model("llama")
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    wrapped(ids, lens)
    model.model.layers[1].mlp.register_forward_hook(lambda mod, args, out: out + F.pad(out, (0, 0, 1, 0))[:, :-1])
    with pytest.raises(PackingError, match=rf"model_type='llama': layer 'model.model.layers.1.mlp' \(LlamaMLP\): "
                                           rf"{TOKENS}.*{FIX}"):
        wrapped(ids, lens)


def test_the_fingerprint_reads_no_device_value():
    from nn_data.diagnostics import HostSyncCounter

    wrapped = wrapped_hf(tiny_hf_model("qwen3_next"))
    with HostSyncCounter() as syncs:
        fingerprint(wrapped.model)
    assert syncs.count == 0, syncs.calls




def test_a_tool_that_registers_the_same_global_hooks_again_is_no_edit():
    """torch's flop counter registers its module tracker's hooks for every module on each entry (new handles, the
    same code): the fingerprint inside one counter equals the fingerprint inside the next, and differs from the
    fingerprint outside (a hook of new code is an edit)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = HFCausalLMAdapter(tiny_hf_model("llama", moe=False))
    outside = fingerprint(model)
    with FlopCounterMode(display=False):
        first = fingerprint(model)
    with FlopCounterMode(display=False):
        second = fingerprint(model)
    assert first == second and first != outside
