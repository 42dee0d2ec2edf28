"""Tier: pure CPU, single process (tiny transformers and megatron-core models built from configs, models written
here).

The packing check (nn_data.model_check) proves the model a PackedForward wraps before its first packed
microbatch: a known model passes and runs exact; a model class transformers does not ship, a layer of one's own
that mixes tokens (a token shift, a convolution, a running mean, positions from the row, SDPA over the row) is
refused with a PackingError naming the model type, the layer, the reason and the fix; longrope is decided from the
batch; verify= checks the caller's own microbatches. Edits after wrapping: test_model_edits.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nn_data.errors import PackingError
from nn_data.model_identity import fingerprint
from nn_data.models.tiny_hf import tiny_hf_model
from nn_data.packed_forward import PackedForward
from tests.models.model_check_cases import FIX, POSITIONS, TOKENS, assert_exact, batch, wrapped_hf
from tests.support.megatron_release import needs_megatron_models

# -- a model nn_data knows --------------------------------------------------------------------------------


def test_a_known_exact_model_passes_the_check_and_runs_exact():
    model = tiny_hf_model("llama")
    model.train()
    model.model.layers[0].eval()  # a mixed mode, restored as it was
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    rng = torch.get_rng_state()
    out = wrapped(ids, lens)
    assert torch.equal(rng, torch.get_rng_state())  # the check drew from its own generator
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    assert wrapped.guard.seen == fingerprint(wrapped.model)  # checked, and the identity held
    model.eval()
    assert_exact(model, wrapped(ids, lens), ids, lens)


def test_the_check_runs_once_until_the_model_changes(monkeypatch):
    import nn_data.model_check as model_check

    runs = []
    real = model_check.check_packing
    monkeypatch.setattr(model_check, "check_packing", lambda *a, **k: runs.append(1) or real(*a, **k))
    model = tiny_hf_model("llama")
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    for _ in range(3):
        wrapped(ids, lens)
    assert len(runs) == 1
    from transformers.models.llama.modeling_llama import LlamaMLP

    model.model.layers[1].mlp = LlamaMLP(model.config)  # an edit: the next call checks again (and passes)
    wrapped(ids, lens)
    wrapped(ids, lens)
    assert len(runs) == 2


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
                                           rf"reach another\) \(max \|difference\| [^)]*, allowed [^)]*: 4 x its own run-to-run "
                                           rf"spread of 0, or 4 float32 epsilons at its scale\); "
                                           rf"{FIX}.*verify=False"):
        wrapped_hf(model)(*batch())


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
        PackedForward(_Contract(kind))(*batch(vocab=50))


def test_a_plain_model_on_the_contract_passes_and_verify_off_skips_the_check():
    ids, lens = batch(vocab=50)
    PackedForward(_Contract("exact"))(ids, lens)
    wrapped = PackedForward(_Contract("sdpa"), verify=False)  # the caller takes exactness on
    wrapped(ids, lens)
    assert wrapped.guard.seen is None


def test_a_custom_model_class_is_accepted_only_after_the_check_passes():
    from transformers import LlamaForCausalLM

    class MyLlama(LlamaForCausalLM):  # a class transformers does not ship, computing what Llama computes
        pass

    model = MyLlama(tiny_hf_model("llama").config).eval()
    wrapped = wrapped_hf(model)
    ids, lens = batch()
    assert_exact(model, wrapped(ids, lens), ids, lens)
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
    wrapped = wrapped_hf(model)
    ids, lens = batch(lengths=[12, 5, 9])
    assert_exact(model, wrapped(ids, lens), ids, lens)  # every row fits the original length
    long_ids, long_lens = batch(lengths=[20, 5])
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
    short, long = batch(vocab=50, lengths=[3, 4]), batch(vocab=50, lengths=[60, 50, 40])
    first = PackedForward(_MixesPastLength(limit=100))  # the default: the check's own microbatch only
    for microbatch in (short, long, long):
        first(*microbatch)  # the check's microbatch is short: a mix past 100 tokens is not seen
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
    ids, lens = batch()
    out = wrapped(ids, lens)
    with torch.no_grad():
        for b, n in enumerate(lens.tolist()):
            torch.testing.assert_close(out[b, :n], forward_alone(model, ids[b:b + 1, :n])[0], rtol=0, atol=1e-5)
    model.decoder.layers[1].mlp = _ShiftedMegatronMLP(model.decoder.layers[1].mlp)
    with pytest.raises(PackingError, match=rf"model_type='GPTModel': layer 'model.decoder.layers.1.mlp' "
                                           rf"\(_ShiftedMegatronMLP\): {TOKENS}.*{FIX}"):
        wrapped(ids, lens)

