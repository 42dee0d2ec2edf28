"""Cases run on every spawned rank (cp_harness.py) for tests/multiprocess/test_packed_forward_cp.py.

Each rank builds the same model and microbatches from fixed seeds, runs ``PackedForward``
with its CP group, and compares with the single-process run (outputs, and parameter
gradients of a token-level loss after summing them over the CP group).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from nn_data.groups import context_parallel_info
from nn_data.models import TinyCausalLM
from nn_data.packed_forward import PackedForward

VOCAB, SEQ_LEN = 61, 12


def _batches(cp: int):
    """(lengths, pad_full_seq_to) with zero-length rows and pad_full_seq_to tails; m = 2C."""
    two_c = 2 * cp
    natural = lambda ls: sum(-(-n // two_c) * two_c for n in ls)  # noqa: E731
    cases = [[5, 0, 12, 3], [12, 12], [1], [0, 7, 0, 9, 2]]
    out = []
    for ls in cases:
        full = -(-(natural(ls) + 3 * two_c) // two_c) * two_c  # a tail of a few chunks
        out.append((ls, full))
    return out


def _ids(lengths, gen):
    ids = torch.randint(1, VOCAB, (len(lengths), SEQ_LEN), generator=gen)
    valid = torch.arange(SEQ_LEN) < torch.tensor(lengths)[:, None]
    return torch.where(valid, ids, 0)


def _token_loss(logits: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over every valid (token, next token) pair of every row."""
    s = torch.arange(SEQ_LEN - 1)
    mask = (s < (lengths[:, None] - 1)).to(logits.dtype)  # [B, S-1]
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return (ce * mask).sum()


def case_equivalence():
    """CP outputs == single-process outputs == each sequence alone; parameter gradients equal."""
    cp = context_parallel_info()
    torch.manual_seed(0)
    model = TinyCausalLM(vocab=VOCAB, dim=32, heads=4, layers=2).double()
    single_model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    checked = 0
    for lengths, full in _batches(cp.size):
        ids, lens = _ids(lengths, gen), torch.tensor(lengths)
        kwargs = dict(pad_individual_seqs_to_multiple_of=2 * cp.size, pad_full_seq_to=full)
        out = PackedForward(model, cp_group=cp.group, **kwargs)(ids, lens)
        ref = PackedForward(single_model, **kwargs)(ids, lens)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
        for b, n in enumerate(lengths):
            if n:
                alone = single_model.forward_single(ids[b : b + 1, :n])[0]
                torch.testing.assert_close(out[b, :n], alone, rtol=0, atol=1e-10)
            assert not out[b, n:].any()
        model.zero_grad(), single_model.zero_grad()
        _token_loss(out, ids, lens).backward()
        _token_loss(ref, ids, lens).backward()
        for (name, p), q in zip(model.named_parameters(), single_model.parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad, group=cp.group)  # the CP part of megatron-core's gradient all-reduce
            torch.testing.assert_close(grad, q.grad, rtol=1e-9, atol=1e-10, msg=f"gradient of {name}")
        checked += 1
    return (cp.rank, checked)
