"""Tier: pure CPU, single process (tiny transformers models built from configs, models written here).

How the packing check (nn_data.model_check) judges: against the model's own noise and its dtype. Exact models
pass whatever their first microbatch is (every edge shape, float32 and bf16, 1 and 2 threads); a model with one
float32 epsilon of run-to-run noise passes in every fresh wrapper and the same model mixing documents by 1e-6 of
its scale is refused in every one; a deterministic model whose rounding depends on the whole row passes;
float64 and float32 mixes far below float32's rounding (through other documents'
tokens, or through their count) are refused; verify=N looks in both directions.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nn_data.errors import PackingError
from nn_data.models.tiny_hf import KINDS, tiny_hf_model
from nn_data.packed_forward import PackedForward
from tests.models.model_check_cases import POSITIONS, TOKENS, batch, wrapped_hf

# -- exact models: no false refusal --------------------------------------------------------------------------

T = 32
EDGE_SHAPES = {  # the first microbatch: (input_ids [B, S], seq_lengths [B])
    "empty rows": (torch.zeros(3, 8, dtype=torch.long), torch.zeros(3, dtype=torch.long)),
    "no sequence": (torch.zeros(0, 8, dtype=torch.long), torch.zeros(0, dtype=torch.long)),
    "one token": (torch.full((1, 1), 5), torch.tensor([1])),
    "full T": (torch.randint(1, 97, (1, T), generator=torch.Generator().manual_seed(0)), torch.tensor([T])),
}


@pytest.fixture(scope="module")
def families():
    """Each family of docs/models.md's table, tiny, in float32 and bf16 (built once, wrapped afresh per case)."""
    return {(kind, dtype): tiny_hf_model(kind, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)
            for kind in KINDS}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_exact_families_pass_whatever_their_first_microbatch(families, dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    refused = []
    try:
        for kind in KINDS:
            for shape, (ids, lens) in EDGE_SHAPES.items():
                for pad in (None, T) if threads == 1 else (T,):  # 2 threads: the fixed T alone (time)
                    if pad is None and shape == "empty rows":
                        continue  # no token and no fixed T: the model is not called (nothing to check)
                    wrapped = wrapped_hf(families[kind, dtype], pad_full_seq_to=pad)
                    try:
                        wrapped(ids, lens)
                    except PackingError as e:
                        refused.append(f"{kind} {shape} pad_full_seq_to={pad}: {e}")
                    assert refused or wrapped.guard.seen is not None, (kind, shape, pad)  # the check ran
    finally:
        torch.set_num_threads(before)
    assert not refused, "\n".join(refused)


class _Head(nn.Module):
    """A model on the PackedForward contract whose head ``extra(logits, input_ids, packed)`` adds to: noise, a
    mix. ``generator``: its own noise stream (each wrapper its own)."""

    def __init__(self, extra, seed: int = 0, dtype=torch.float32, vocab: int = 50, dim: int = 16):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
            self.pos = nn.Embedding(256, dim)
        self.to(dtype)
        self.extra, self.generator = extra, torch.Generator().manual_seed(seed)
        with torch.no_grad():  # the model's scale, of no microbatch: its largest logit over the vocabulary
            self.scale = float(self.head(self.emb.weight + self.pos.weight[:1]).abs().max())

    def forward(self, input_ids, position_ids, packed):
        logits = self.head(self.emb(input_ids) + self.pos(position_ids))  # [1, T, V]
        return self.extra(self, logits, input_ids, packed)


def _one_ulp_noise(model, logits, input_ids, packed):
    """On about half of the calls, half of the values one epsilon up (atomics' order on a GPU)."""
    if torch.rand((), generator=model.generator) < 0.5:
        return logits
    up = torch.rand(logits.shape, generator=model.generator) < 0.5
    return torch.where(up, torch.nextafter(logits, torch.full_like(logits, float("inf"))), logits)


def _row_mix(relative):
    """Every token gets ``relative`` x the largest logit x cos(the sum of the whole row's ids): a path from every
    document's tokens into every other's, ``relative`` of the model's scale."""
    def extra(model, logits, input_ids, packed):
        scale = logits.detach().abs().max()
        return logits + relative * scale * torch.cos(input_ids.double().sum() * 0.1).to(logits.dtype)
    return extra


def _count_mix(relative):
    """Every token gets ``relative`` x the model's scale per sequence of the row (position-id restarts)."""
    def extra(model, logits, input_ids, packed):
        bounds = packed.bounds.cu_seqlens
        sequences = (bounds[1:] > bounds[:-1]).sum()
        return logits + relative * model.scale * sequences.to(logits.dtype)
    return extra


def _rounded_by_row(model, logits, input_ids, packed):
    """Deterministic and exact, but each value's rounding depends on the whole row (as a matrix product's blocking
    or kernel choice can): ``(logits + t) - t`` with ``t`` up to 0.35 of the scale chosen by the row's ids, about one
    epsilon of the scale off ``logits``, differently for another row."""
    t = model.scale * (0.1 + 0.02 * (input_ids.sum() % 13)).to(logits.dtype)
    return (logits + t) - t


def test_a_deterministic_model_whose_rounding_depends_on_the_row_passes():
    ids, lens = batch(vocab=50)
    for seed in range(5):
        PackedForward(_Head(_rounded_by_row, seed=seed))(ids, lens)


def test_one_epsilon_of_run_to_run_noise_is_never_refused():
    ids, lens = batch(vocab=50)
    for seed in range(50):  # 50 fresh wrappers, each with its own noise stream
        PackedForward(_Head(_one_ulp_noise, seed=seed))(ids, lens)


def test_the_noisy_model_mixing_by_1e6_of_its_scale_is_always_refused():
    ids, lens = batch(vocab=50)

    def noisy_mix(model, logits, input_ids, packed):
        return _row_mix(1e-6)(model, _one_ulp_noise(model, logits, input_ids, packed), input_ids, packed)

    for seed in range(50):
        with pytest.raises(PackingError, match=TOKENS):
            PackedForward(_Head(noisy_mix, seed=seed))(ids, lens)


def test_a_float64_model_mixing_by_1e9_of_its_scale_is_refused():
    PackedForward(_Head(lambda m, x, i, p: x, dtype=torch.float64))(*batch(vocab=50))  # exact: passes
    with pytest.raises(PackingError, match=rf"{TOKENS}.*float64 epsilons at its scale"):
        PackedForward(_Head(_row_mix(1e-9), dtype=torch.float64))(*batch(vocab=50))


@pytest.mark.parametrize("relative", [1e-5, 1e-6])
def test_a_float32_model_mixing_through_the_document_count_is_refused(relative):
    """1e-6 of the scale per sequence of the row: 4e-6 at the check's 4 documents, 6.4e-5 at 64 short ones."""
    with pytest.raises(PackingError, match=rf"model_type='_Head': layer .*: {POSITIONS}, beside documents of other "
                                           r"lengths and count"):
        PackedForward(_Head(_count_mix(relative)))(*batch(vocab=50))


# -- verify=N: both directions -----------------------------------------------------------------------------

TRIGGER = 7


class _DataTriggeredMix(nn.Module):
    """Exact, except when the ``source`` sequence of the row ("first" or "last" non-empty one) has at least 20
    tokens and starts with :data:`TRIGGER`: then its mean embedding is added to the other end's tokens."""

    def __init__(self, source: str, vocab: int = 50, dim: int = 16):
        super().__init__()
        self.source = source
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids, packed):
        x = self.emb(input_ids)  # [1, T, dim]
        bounds = packed.bounds.cu_seqlens.tolist()
        spans = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        if len(spans) >= 2:
            (src, dst) = (spans[0], spans[-1]) if self.source == "first" else (spans[-1], spans[0])
            if src[1] - src[0] >= 20 and int(input_ids[0, src[0]]) == TRIGGER:
                x = x.clone()
                x[:, dst[0]:dst[1]] += x[:, src[0]:src[1]].mean(1, keepdim=True)
        return self.head(x)


@pytest.mark.parametrize("source, refused_at", [("first", 1), ("last", 2)])
def test_verify_1_catches_a_data_triggered_mix_in_either_direction_within_4_microbatches(source, refused_at):
    gen = torch.Generator().manual_seed(1)
    wrapped = PackedForward(_DataTriggeredMix(source), verify=1)
    calls = 0
    with pytest.raises(PackingError, match=r"not located on a verified microbatch"):
        for calls in range(1, 5):
            ids, lens = batch(vocab=50, lengths=[24, 9, 14, 22], seed=int(torch.randint(0, 1000, (), generator=gen)))
            ids[0, 0] = ids[-1, 0] = TRIGGER  # the data that triggers the mix, at both ends
            wrapped(ids, lens)
    assert calls == refused_at  # first into last: the first changed; last into first: the first alone, next


def test_verify_turns_through_the_sequences():
    """Each verified microbatch changes the next sequence and runs the one before it alone."""
    import nn_data.model_check as model_check

    seen = []
    real = model_check.verify_microbatch
    wrapped = PackedForward(_Head(lambda m, x, i, p: x), verify=1)
    try:
        model_check.verify_microbatch = lambda *a, turn, **k: seen.append(turn) or real(*a, turn=turn, **k)
        for _ in range(3):
            wrapped(*batch(vocab=50))
    finally:
        model_check.verify_microbatch = real
    assert seen == [0, 1, 2]
