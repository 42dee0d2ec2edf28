"""Tier: pure CPU, single process (tiny transformers models built from configs, models written here).

The packing check (nn_data.model_check) proves the model a PackedForward wraps before its first packed
microbatch, and again when the model's fingerprint (nn_data.model_identity) changes: a model changed after
wrapping, a model class transformers does not ship, an attention function of one's own, each either runs
exact (each sequence as if alone, compared here with the plain model) or is refused with a PackingError
naming the model type, the layer, the reason and the fix.
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
from nn_data.packed_forward import PackedForward
from tests.support.megatron_release import needs_megatron_models

LENGTHS = [12, 5, 9]
FIX = r"run this model unpacked"
TOKENS = r"the outputs of documents it did not change changed when other documents of the same packed row changed"
POSITIONS = r"a document's outputs changed when it moved to another offset of the same packed row"
OWN_PATH = r"a document packed differs from the model's own unpacked run of it"


def _batch(vocab: int = 97, lengths=LENGTHS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=gen)
    return torch.where(torch.arange(width) < torch.tensor(lengths)[:, None], ids, 0), torch.tensor(lengths)


def _assert_exact(model, out, ids, lens, tol=1e-5):
    """Each row of ``out`` equals its sequence run alone through the plain model."""
    with torch.no_grad():
        for b, n in enumerate(lens.tolist()):
            alone = model(input_ids=ids[b:b + 1, :n], use_cache=False).logits[0]
            torch.testing.assert_close(out[b, :n].float(), alone.float(), rtol=0, atol=tol)


def _wrapped(model, **kwargs):
    return PackedForward(HFCausalLMAdapter(model), **kwargs)


# -- a model nn_data knows --------------------------------------------------------------------------------


def test_a_known_exact_model_passes_the_check_and_runs_exact():
    model = tiny_hf_model("llama")
    model.train()
    model.model.layers[0].eval()  # a mixed mode, restored as it was
    wrapped = _wrapped(model)
    ids, lens = _batch()
    rng = torch.get_rng_state()
    out = wrapped(ids, lens)
    assert torch.equal(rng, torch.get_rng_state())  # the check drew from its own generator
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    assert wrapped.guard.seen == fingerprint(wrapped.model)  # checked, and the identity held
    model.eval()
    _assert_exact(model, wrapped(ids, lens), ids, lens)


def test_the_check_runs_once_until_the_model_changes(monkeypatch):
    import nn_data.model_check as model_check

    runs = []
    real = model_check.check_packing
    monkeypatch.setattr(model_check, "check_packing", lambda *a, **k: runs.append(1) or real(*a, **k))
    model = tiny_hf_model("llama")
    wrapped = _wrapped(model)
    ids, lens = _batch()
    for _ in range(3):
        wrapped(ids, lens)
    assert len(runs) == 1
    from transformers.models.llama.modeling_llama import LlamaMLP

    model.model.layers[1].mlp = LlamaMLP(model.config)  # an edit: the next call checks again (and passes)
    wrapped(ids, lens)
    wrapped(ids, lens)
    assert len(runs) == 2


# -- edits after wrapping -----------------------------------------------------------------------------------


def test_a_window_the_model_ignores_but_the_list_would_apply_is_refused_by_its_own_path():
    model = tiny_hf_model("llama")  # Llama's attention ignores config.sliding_window
    wrapped = _wrapped(model)
    ids, lens = _batch()
    wrapped(ids, lens)
    model.config.sliding_window = 3
    try:
        out = wrapped(ids, lens)
    except PackingError as e:
        assert re.search(rf"model_type='llama': layer 'model.model.layers.0.self_attn' \(LlamaAttention\): "
                         rf"{OWN_PATH}.*{FIX}", str(e)), str(e)
    else:
        _assert_exact(model, out, ids, lens)


def test_a_window_changed_after_wrapping_is_read_again_and_runs_exact():
    model = tiny_hf_model("mistral", window=3)
    wrapped = _wrapped(model)
    ids, lens = _batch()
    wrapped(ids, lens)
    model.config.sliding_window = 5
    _assert_exact(model, wrapped(ids, lens), ids, lens)
    assert wrapped.model.layers.window == 5
    model.config.sliding_window = None  # no window at all
    _assert_exact(model, wrapped(ids, lens), ids, lens)


def _family(name):
    from nn_data.models.hf_families import build, find

    return build(find(name))


@pytest.mark.parametrize("name", ["phimoe:sliding", "qwen2_moe:sliding", "gemma3_text"])
def test_a_family_window_changed_after_wrapping_runs_exact_or_is_refused(name):
    model = _family(name).eval()
    wrapped = _wrapped(model)
    ids, lens = _batch(vocab=model.config.vocab_size, lengths=[12, 7, 10])
    wrapped(ids, lens)
    model.config.sliding_window = 6
    try:
        out = wrapped(ids, lens)
    except PackingError as e:
        assert f"model_type='{model.config.model_type}': layer" in str(e) and FIX in str(e)
    else:
        _assert_exact(model, out, ids, lens)


def test_layer_types_changed_in_place_after_wrapping_run_exact_or_are_refused():
    model = _family("qwen2_moe:sliding").eval()
    wrapped = _wrapped(model)
    ids, lens = _batch(vocab=model.config.vocab_size, lengths=[12, 7, 10])
    wrapped(ids, lens)
    model.config.layer_types.reverse()  # an edit in place: the sliding layer is now the other one
    try:
        out = wrapped(ids, lens)
    except PackingError as e:
        assert "model_type='qwen2_moe': layer" in str(e) and FIX in str(e)
    else:
        _assert_exact(model, out, ids, lens)


def test_gemma3_turned_bidirectional_after_wrapping_is_refused():
    model = _family("gemma3_text").eval()
    wrapped = _wrapped(model)
    ids, lens = _batch(vocab=model.config.vocab_size)
    wrapped(ids, lens)
    model.config.use_bidirectional_attention = True
    with pytest.raises(PackingError, match=r"model_type='gemma3_text': layer '\(config\)': attention is not causal.*"
                                           r"run it unpacked"):
        wrapped(ids, lens)


def test_a_rotary_module_swapped_to_dynamic_or_given_a_rope_type_is_refused():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = tiny_hf_model("llama")
    wrapped = _wrapped(model)
    ids, lens = _batch()
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
    wrapped = _wrapped(model)
    ids, lens = _batch()
    wrapped(ids, lens)
    model.model.layers[1].self_attn = _DirectSDPA()
    with pytest.raises(PackingError, match=rf"model_type='llama': layer 'model.model.layers.1.self_attn' "
                                           rf"\(_DirectSDPA\): {TOKENS}.*{FIX}"):  # not named *Attention: the check
        wrapped(ids, lens)


def test_an_attention_modules_forward_patched_after_wrapping_is_refused_naming_it():
    model = tiny_hf_model("llama")
    wrapped = _wrapped(model)
    ids, lens = _batch()
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


def _registered_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key * 1.5, value, attention_mask, scaling=scaling, **kwargs)


def test_an_attention_function_registered_and_selected_is_refused_before_or_after_wrapping():
    from transformers import AttentionInterface

    AttentionInterface.register("test_scaled_keys", _registered_attention)
    model = tiny_hf_model("llama")
    wrapped = _wrapped(model)
    ids, lens = _batch()
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

    AttentionInterface.register("sdpa", _registered_attention)
    try:
        with pytest.raises(PackingError, match=r"layer '\(config._attn_implementation\)': the function registered "
                                               r"under 'sdpa' .* is not transformers' own.*run the model unpacked"):
            HFCausalLMAdapter(tiny_hf_model("llama"))
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)


def test_a_mamba2_mixer_reinitialised_in_place_after_wrapping_runs_exact():
    model = tiny_hf_model("mamba2")
    wrapped = _wrapped(model)
    ids, lens = _batch()
    wrapped(ids, lens)
    mixer = model.backbone.layers[1].mixer
    type(mixer).__init__(mixer, model.config, layer_idx=1)  # the same object, its __init__ run again (no hooks)
    _assert_exact(model, wrapped(ids, lens), ids, lens)


def test_an_edit_between_building_the_adapter_and_its_first_call_is_read():
    model = tiny_hf_model("mistral", window=3)
    wrapped = _wrapped(model)
    model.config.sliding_window = 6  # before the first call
    ids, lens = _batch()
    _assert_exact(model, wrapped(ids, lens), ids, lens)
    assert wrapped.model.layers.window == 6


def test_a_mamba2_mixer_reinitialised_after_wrapping_runs_exact():
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    model = tiny_hf_model("mamba2")
    wrapped = _wrapped(model)
    ids, lens = _batch()
    wrapped(ids, lens)
    model.backbone.layers[0].mixer = Mamba2Mixer(model.config, layer_idx=0)
    _assert_exact(model, wrapped(ids, lens), ids, lens)


# -- models transformers does not ship ------------------------------------------------------------------------


class _ShiftMLP(nn.Module):
    """A token shift in the MLP: each token also sees the previous token of the row."""

    def __init__(self, mlp):
        super().__init__()
        self.inner = mlp

    def forward(self, x):
        return self.inner(x + F.pad(x, (0, 0, 1, 0))[:, :-1])


class _ConvMLP(nn.Module):
    """A causal depthwise convolution written with F.conv1d (no nn.Conv1d module)."""

    def __init__(self, mlp, hidden: int = 64, taps: int = 4):
        super().__init__()
        self.inner, self.taps = mlp, taps
        self.weight = nn.Parameter(torch.randn(hidden, 1, taps) * 0.2)

    def forward(self, x):
        y = F.conv1d(F.pad(x.transpose(1, 2), (self.taps - 1, 0)), self.weight, groups=x.shape[-1])
        return self.inner(x + y.transpose(1, 2))


def _running_mean_attention_model():
    from transformers.models.llama.modeling_llama import LlamaAttention

    class RunningMeanAttention(LlamaAttention):
        """transformers' attention plus a causal running mean of the hidden states over the row."""

        def forward(self, hidden_states, *args, **kwargs):
            out, weights = super().forward(hidden_states, *args, **kwargs)
            steps = torch.arange(1, hidden_states.shape[1] + 1, dtype=hidden_states.dtype)[None, :, None]
            return out + hidden_states.cumsum(1) / steps, weights

    model = tiny_hf_model("llama")
    old = model.model.layers[1].self_attn
    new = RunningMeanAttention(model.config, layer_idx=1)
    new.load_state_dict(old.state_dict())
    model.model.layers[1].self_attn = new
    return model


@pytest.mark.parametrize("case, layer", [
    ("shift", r"'model.model.layers.1.mlp' \(_ShiftMLP\)"),
    ("conv", r"'model.model.layers.0.mlp' \(_ConvMLP\)"),
    ("running_mean", r"'model.model.layers.1.self_attn' \(RunningMeanAttention\)"),
])
def test_custom_layers_that_mix_tokens_are_refused_naming_the_layer(case, layer):
    if case == "running_mean":
        model = _running_mean_attention_model()
    else:
        model = tiny_hf_model("llama")
        index = 1 if case == "shift" else 0
        mlp = model.model.layers[index].mlp
        model.model.layers[index].mlp = _ShiftMLP(mlp) if case == "shift" else _ConvMLP(mlp)
    with pytest.raises(PackingError, match=rf"model_type='llama': layer {layer}: {TOKENS} \(tokens of one sequence "
                                           rf"reach another\) \(max \|difference\| [^)]* where 0 is required\); "
                                           rf"{FIX}.*verify=False"):
        _wrapped(model)(*_batch())


class _Contract(nn.Module):
    """A plain model on the PackedForward contract: an embedding, an optional token mixer, a head."""

    def __init__(self, kind: str, vocab: int = 50, dim: int = 16):
        super().__init__()
        self.kind = kind
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.pos = nn.Embedding(256, dim)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, input_ids, position_ids, packed):
        x = self.emb(input_ids)  # [1, T, dim]
        if self.kind == "row_positions":  # learned absolute positions from torch.arange over the row
            x = x + self.pos(torch.arange(input_ids.shape[1])[None])
        elif self.kind == "sdpa":  # torch's SDPA over the whole row
            q, k, v = self.qkv(x)[:, None].chunk(3, dim=-1)  # [1, 1, T, dim] each
            x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0]
        else:  # exact: positions from the position ids
            x = x + self.pos(position_ids)
        return self.head(x)


@pytest.mark.parametrize("kind, reason, layer", [
    ("row_positions", POSITIONS, r"\(the wrapped model: _Contract\) \(first differing output inside: 'pos' "
                                 r"\(Embedding\)\)"),
    ("sdpa", TOKENS, r"\(the wrapped model: _Contract\) \(first differing output inside: 'head' \(Linear\)\)"),
])
def test_plain_models_that_take_the_row_are_refused(kind, reason, layer):
    with pytest.raises(PackingError, match=rf"model_type='_Contract': layer {layer}: {reason}.*{FIX}"):
        PackedForward(_Contract(kind))(*_batch(vocab=50))


def test_a_plain_model_on_the_contract_passes_and_verify_off_skips_the_check():
    ids, lens = _batch(vocab=50)
    PackedForward(_Contract("exact"))(ids, lens)
    wrapped = PackedForward(_Contract("sdpa"), verify=False)  # the caller takes exactness on
    wrapped(ids, lens)
    assert wrapped.guard.seen is None


def test_a_custom_model_class_is_accepted_only_after_the_check_passes():
    from transformers import LlamaForCausalLM

    class MyLlama(LlamaForCausalLM):  # a class transformers does not ship, computing what Llama computes
        pass

    model = MyLlama(tiny_hf_model("llama").config).eval()
    wrapped = _wrapped(model)
    ids, lens = _batch()
    _assert_exact(model, wrapped(ids, lens), ids, lens)
    assert wrapped.guard.seen is not None


# -- longrope, verify= ---------------------------------------------------------------------------------------


def _longrope_model(original: int):
    from transformers import Phi3Config, Phi3ForCausalLM

    half = 8  # head_dim 16 -> 8 rotary factors
    config = Phi3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=original,
                        original_max_position_embeddings=original, pad_token_id=0,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
                                         "long_factor": [4.0] * half, "original_max_position_embeddings": original})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Phi3ForCausalLM(config).eval()


def test_longrope_is_decided_from_the_batchs_longest_position():
    model = _longrope_model(original=16)
    wrapped = _wrapped(model)
    ids, lens = _batch(lengths=[12, 5, 9])
    _assert_exact(model, wrapped(ids, lens), ids, lens)  # every row fits the original length
    long_ids, long_lens = _batch(lengths=[20, 5])
    with pytest.raises(PackingError, match=r"model_type='phi3': layer 'model.rotary_emb': rotary type 'longrope' "
                                           r"switches every position.*original_max_position_embeddings=16.*rows can "
                                           r"hold sequences of 20 tokens.*pack sequences of at most 16 tokens"):
        wrapped(long_ids, long_lens)


class _MixesPastLength(nn.Module):
    """Exact on short rows, mixing (a running mean over the row) when the packed row passes ``limit`` tokens."""

    def __init__(self, limit: int, vocab: int = 50, dim: int = 8):
        super().__init__()
        self.limit = limit
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids, packed):
        x = self.emb(input_ids)
        if input_ids.shape[1] > self.limit:
            x = x + x.cumsum(1) / 10
        return self.head(x)


def test_verify_every_nth_microbatch_checks_the_callers_own_microbatches():
    short, long = _batch(vocab=50, lengths=[3, 4]), _batch(vocab=50, lengths=[60, 50, 40])
    first = PackedForward(_MixesPastLength(limit=100))  # the default: the check's own microbatch only
    for batch in (short, long, long):
        first(*batch)  # the check's microbatch is short: a mix past 100 tokens is not seen
    every = PackedForward(_MixesPastLength(limit=100), verify=2)
    every(*short)  # microbatch 1: the check
    every(*short)  # 2: verified, exact
    every(*long)  # 3: not verified
    with pytest.raises(PackingError, match=rf"model_type='_MixesPastLength': layer \(not located on a verified "
                                           rf"microbatch\): {TOKENS}.*on the caller's microbatch.*{FIX}"):
        every(*long)  # 4: verified: 150 packed tokens mix


@pytest.mark.parametrize("bad", ["always", 0, -2, 1.5])
def test_an_invalid_verify_is_refused_by_name(bad):
    with pytest.raises(PackingError, match=rf"verify={bad!r} is invalid; expected False/'off', True/'first'"):
        PackedForward(_Contract("exact"), verify=bad)


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

    return {
        "sliding_window": lambda m: setattr(m.config, "sliding_window", 5),
        "layer_types in place": layer_types_in_place,
        "bidirectional": lambda m: setattr(m.config, "use_bidirectional_attention", True),
        "rope_type": lambda m: setattr(m.model.rotary_emb, "rope_type", "dynamic"),
        "rope_parameters": lambda m: m.config.rope_parameters.update(rope_type="linear", factor=2.0),
        "module replaced": lambda m: setattr(m.model.layers[1], "mlp", LlamaMLP(m.config)),
        "forward patched": patched_forward,
        "attention implementation": lambda m: setattr(m.config, "_attn_implementation", "eager"),
        "function registered under the selected name": lambda m: AttentionInterface.register("sdpa", _registered_attention),
    }


@pytest.mark.parametrize("edit", list(_edits()))
def test_the_fingerprint_sees_each_edit_and_holds_across_calls(edit):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = tiny_hf_model("llama")
    model.config.layer_types = ["full_attention", "full_attention"]
    wrapped = _wrapped(model)
    ids, lens = _batch()
    wrapped(ids, lens)
    seen = fingerprint(wrapped.model)
    wrapped(ids, lens)
    assert fingerprint(wrapped.model) == seen  # a call changes nothing it holds
    try:
        _edits()[edit](model)
        assert fingerprint(wrapped.model) != seen
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)


def test_the_fingerprint_reads_no_device_value():
    from nn_data.diagnostics import HostSyncCounter

    wrapped = _wrapped(tiny_hf_model("qwen3_next"))
    with HostSyncCounter() as syncs:
        fingerprint(wrapped.model)
    assert syncs.count == 0, syncs.calls


# -- megatron-core ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_state():
    from tests.support.megatron_release import one_rank_parallel_state

    with one_rank_parallel_state():
        yield


class _ShiftedMegatronMLP(nn.Module):
    """megatron-core's MLP on ``[s, b, h]`` hidden states, each token also seeing the previous one of the row."""

    def __init__(self, mlp):
        super().__init__()
        self.inner = mlp

    def forward(self, hidden_states, *args, **kwargs):
        return self.inner(hidden_states + F.pad(hidden_states, (0, 0, 0, 0, 1, 0))[:-1], *args, **kwargs)


@needs_megatron_models
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_megatron_gpt_model_passes_the_check_and_an_edit_after_wrapping_is_refused(megatron_state):
    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.models.tiny_megatron import forward_alone, tiny_gpt_config, tiny_gpt_model

    model = tiny_gpt_model(tiny_gpt_config()).eval()
    wrapped = PackedForward(MegatronGPTAdapter(model), make_packed_seq_params=True)
    ids, lens = _batch()
    out = wrapped(ids, lens)
    with torch.no_grad():
        for b, n in enumerate(lens.tolist()):
            torch.testing.assert_close(out[b, :n], forward_alone(model, ids[b:b + 1, :n])[0], rtol=0, atol=1e-5)
    model.decoder.layers[1].mlp = _ShiftedMegatronMLP(model.decoder.layers[1].mlp)
    with pytest.raises(PackingError, match=rf"model_type='GPTModel': layer 'model.decoder.layers.1.mlp' "
                                           rf"\(_ShiftedMegatronMLP\): {TOKENS}.*{FIX}"):
        wrapped(ids, lens)
