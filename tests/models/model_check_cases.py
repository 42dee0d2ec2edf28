"""Shared by tests/models/test_model_check.py and test_model_edits.py: microbatches, the exactness oracle (each
sequence alone through the plain model) and the wordings the refusals are checked against."""

from __future__ import annotations

import torch

from nn_data.adapters import HFCausalLMAdapter
from nn_data.packed_forward import PackedForward

LENGTHS = [12, 5, 9]
FIX = r"run this model unpacked"
TOKENS = r"the outputs of documents it did not change changed when other documents of the same packed row changed"
POSITIONS = r"a document's outputs changed when it moved to another offset of the same packed row"
OWN_PATH = r"a document packed differs from the model's own unpacked run of it"


def batch(vocab: int = 97, lengths=LENGTHS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=gen)
    return torch.where(torch.arange(width) < torch.tensor(lengths)[:, None], ids, 0), torch.tensor(lengths)


def assert_exact(model, out, ids, lens, tol=1e-5):
    """Each row of ``out`` equals its sequence run alone through the plain model."""
    with torch.no_grad():
        for b, n in enumerate(lens.tolist()):
            alone = model(input_ids=ids[b:b + 1, :n], use_cache=False).logits[0]
            torch.testing.assert_close(out[b, :n].float(), alone.float(), rtol=0, atol=tol)


def wrapped_hf(model, **kwargs):
    return PackedForward(HFCausalLMAdapter(model), **kwargs)


def family(name):
    """A tiny model of one conformance-matrix entry (tests.support.hf_families)."""
    from tests.support.hf_families import build, find

    return build(find(name))


def registered_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention function of one's own (keys scaled): what transformers' sdpa computes, but not the same."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key * 1.5, value, attention_mask, scaling=scaling, **kwargs)
