"""Tier: pure CPU, single process (tiny transformers models built from a config; nothing downloaded).

HFCausalLMAdapter refuses what it cannot keep apart: when built, or on the first call. Never a silent mix.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from nn_data.adapters import HFCausalLMAdapter
from nn_data.adapters.hf_layers import MIXERS, inspect_model, mixer_path
from nn_data.errors import PackingError
from nn_data.models.tiny_hf import tiny_hf_model
from nn_data.packed_forward import PackedForward
from tests.models.adapter_cases import coded_ids

SMALL = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2)


@pytest.mark.parametrize("model_type, build, layer, cls", [
    ("mamba", lambda: tf.MambaForCausalLM(tf.MambaConfig(**SMALL, state_size=8)), "backbone.layers.0.mixer",
     "MambaMixer"),
    ("falcon_mamba", lambda: tf.FalconMambaForCausalLM(tf.FalconMambaConfig(**SMALL, state_size=8)),
     "backbone.layers.0.mixer", "FalconMambaMixer"),
    ("rwkv", lambda: tf.RwkvForCausalLM(tf.RwkvConfig(**SMALL, attention_hidden_size=64, intermediate_size=128)),
     "rwkv.blocks.0.attention", "RwkvSelfAttention"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_token_mixer_nn_data_does_not_know_is_refused_when_built(model_type, build, layer, cls):
    with pytest.raises(PackingError) as e:
        HFCausalLMAdapter(build())
    message = str(e.value)
    assert f"model_type={model_type!r}" in message and f"layer {layer!r} ({cls})" in message
    assert "run its sequences unpacked" in message and all(name in message for name in MIXERS)


def test_a_convolution_outside_a_known_mixer_is_refused():
    model = tiny_hf_model("llama")
    model.model.layers[0].smear = torch.nn.Conv1d(64, 64, 3, groups=64, padding=2)
    with pytest.raises(PackingError, match=r"layer 'model.layers.0' \(LlamaDecoderLayer\) mixes tokens"):
        HFCausalLMAdapter(model)


def test_a_layer_type_nn_data_does_not_handle_is_refused():
    model = tiny_hf_model("llama")
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(PackingError, match=r"model_type='llama': layer 1 has layer type 'chunked_attention'"):
        HFCausalLMAdapter(model)


def test_the_layers_found():
    report = inspect_model(tiny_hf_model("qwen3_next"))
    assert report.model_type == "qwen3_next" and report.attention_layers == 1 and report.window is None
    assert [(name, kind.family) for name, _, kind in report.mixers] == [
        ("model.layers.0.linear_attn", "gated delta net (linear attention)")]
    assert inspect_model(tiny_hf_model("mamba2")).attention_layers == 0
    assert inspect_model(tiny_hf_model("mistral", window=5)).window == 5
    assert inspect_model(tiny_hf_model("llama")).mixers == ()


def test_the_kernels_path_names_what_to_install():
    """Without flash-linear-attention / causal-conv1d (this machine), mixers='kernels' is refused; 'auto'
    runs the layer one sequence per row."""
    model = tiny_hf_model("qwen3_next")
    with pytest.raises(PackingError, match=r"mixers='kernels': model_type='qwen3_next', layer "
                                           r"'model.layers.0.linear_attn' \(gated delta net \(linear attention\)\) "
                                           r"keeps packed sequences apart only with flash-linear-attention and "
                                           r"causal-conv1d installed"):
        HFCausalLMAdapter(model, mixers="kernels")
    assert HFCausalLMAdapter(model).mixer_path == "per_sequence"
    with pytest.raises(PackingError, match=r"mixers='fast' is invalid; expected one of \('auto', 'per_sequence', "
                                           r"'kernels'\)"):
        HFCausalLMAdapter(model, mixers="fast")
    report = inspect_model(model)
    assert mixer_path(report, "auto", "cuda") == "per_sequence"  # kernels not importable here


def _drop_packed_keywords(module, args, kwargs):
    """A forward that forgets the boundaries: the mixer is called without seq_idx, cu_seq_lens_* and the rest."""
    return args, {k: v for k, v in kwargs.items() if not k.startswith(("cu_seq", "max_length", "seq_idx"))}


def test_kernels_that_would_not_receive_the_boundaries_are_never_run_on_a_packed_row():
    """A model whose forward does not pass the packed keywords down to its mixers (Mamba2ForCausalLM before
    transformers 5.25; here a pre-hook registered first drops them, so the case holds on every release). On the
    kernels path (forced here, as with mamba-ssm installed on a GPU): mixers='kernels' is refused on the first
    call; 'auto' runs such a mixer per sequence instead (exact) and stays per sequence."""
    ids, lens = coded_ids([5, 3], torch.Generator().manual_seed(0)), torch.tensor([5, 3])
    model = tiny_hf_model("mamba2")
    for module in model.modules():
        if type(module).__name__ == "Mamba2Mixer":
            module.register_forward_pre_hook(_drop_packed_keywords, with_kwargs=True)
    strict = HFCausalLMAdapter(model, mixers="per_sequence")
    strict.mixers, strict.mixer_path = "kernels", "kernels"
    with pytest.raises(PackingError, match=r"model_type='mamba2': Mamba2Mixer received no packed boundaries"):
        PackedForward(strict, pad_full_seq_to=16)(ids, lens)
    auto = HFCausalLMAdapter(model)
    auto.mixer_path = "kernels"
    with torch.no_grad():
        out = PackedForward(auto, pad_full_seq_to=16)(ids, lens)
        alone = model(input_ids=ids[1:2, :3], use_cache=False).logits[0]
    assert auto.mixer_path == "per_sequence" and float((out[1, :3] - alone).abs().max()) < 2e-5


def test_soft_capped_attention_is_refused_on_the_first_call():
    config = tf.Gemma2Config(**SMALL, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, sliding_window=4)
    adapter = HFCausalLMAdapter(tf.Gemma2ForCausalLM(config).eval())
    ids = coded_ids([5, 3], torch.Generator().manual_seed(0)) % 64
    with pytest.raises(PackingError, match=r"softcap=50.0: nn_data's packed attention supports causal attention"):
        PackedForward(adapter, pad_full_seq_to=16)(ids, torch.tensor([5, 3]))


class _OwnAttention(torch.nn.Module):
    """An attention layer that does not call transformers' attention interface (it sums over the row)."""

    def forward(self, hidden_states, **kwargs):
        return hidden_states.cumsum(1), None


class _SaysItCallsAttention(torch.nn.Module):
    """Its source names attention_interface (so the build-time check passes), but its forward never calls it."""

    def forward(self, hidden_states, **kwargs):
        return hidden_states.cumsum(1), None  # (no attention_interface call here)


def test_attention_that_bypasses_the_attention_interface_is_refused_when_built_or_on_the_first_call():
    model = tiny_hf_model("llama")
    model.model.layers[1].self_attn = _OwnAttention()
    with pytest.raises(PackingError, match=r"model_type='llama': layer 'model.layers.1.self_attn': _OwnAttention does "
                                           r"not call transformers' attention interface"):
        HFCausalLMAdapter(model)
    model.model.layers[1].self_attn = _SaysItCallsAttention()
    adapter = HFCausalLMAdapter(model)
    ids = coded_ids([5, 3], torch.Generator().manual_seed(0))
    with pytest.raises(PackingError, match=r"model_type='llama': layer 'model.layers.1.self_attn': 2 attention layers "
                                           r"but 1 did not call transformers' attention interface.*run this model "
                                           r"unpacked, or make that layer's attention call ALL_ATTENTION_FUNCTIONS"):
        PackedForward(adapter, pad_full_seq_to=16)(ids, torch.tensor([5, 3]))


def test_a_model_without_mixers_runs_them_nowhere_and_hooks_are_installed_once():
    model = tiny_hf_model("lfm2")
    first, second = HFCausalLMAdapter(model), HFCausalLMAdapter(model)
    conv = model.model.layers[0].conv
    assert len(conv._forward_pre_hooks) == 1 and len(conv._forward_hooks) == 1
    assert first._slot is second._slot
    with torch.no_grad():  # the model alone is unchanged by the hooks (no call in progress)
        ids = coded_ids([6], torch.Generator().manual_seed(1))[:, :6]
        again = tiny_hf_model("lfm2")
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, again(input_ids=ids, use_cache=False).logits)


def test_layer_wise_gradient_checkpointing_is_refused_and_checkpointing_the_whole_call_works():
    """transformers recomputes each layer in backward, after the adapter's call: outside nn_data's mask
    and plan, so it is refused; torch.utils.checkpoint around the whole packed forward recomputes the
    call itself and gives the same gradients."""
    model = tiny_hf_model("lfm2")
    ids, lens = coded_ids([5, 0, 7], torch.Generator().manual_seed(2)), torch.tensor([5, 0, 7])
    wrapped = PackedForward(HFCausalLMAdapter(model), pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=16)
    wrapped(ids, lens).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    with pytest.raises(PackingError, match=r"model_type='lfm2' has gradient checkpointing enabled"):
        wrapped(ids, lens)
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    torch.utils.checkpoint.checkpoint(wrapped, ids, lens, use_reentrant=False).sum().backward()
    assert all(torch.allclose(p.grad, w, rtol=0, atol=1e-6) for p, w in zip(model.parameters(), want))
