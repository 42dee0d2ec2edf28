"""Tier: GPU-only (marker ``cuda``), skipped without CUDA; ``NN_DATA_CUDA_DRY_RUN=1`` runs it on the CPU
with tiny sizes (``scripts/gpu_check.sh --dry-run``), where the sync and memory assertions skip. Not
run on a GPU yet (no GPU was lent to the session that wrote it).

TokenLogProbsFromHidden on a CUDA GPU: values and both gradients equal the unfused path (the logits, then
``TokenLogProbs``) in float32 and bf16, no host-device sync with ``validate=False`` and the pack's layout,
and the forward + backward peak of the fused head (bf16, T 16384) at most 1/4 of the unfused path's,
both less the bf16 weight gradient they return (the fused head's float32 accumulator of it counts
against it).
"""

from __future__ import annotations

import pytest
import torch

from nn_data import PackSequences, TokenLogProbs, TokenLogProbsFromHidden
from nn_data.diagnostics import forbid_syncs
from tests.cuda.stream import DEVICE, ON_CUDA, TIER, cuda_only

pytestmark = TIER

# (T, V, H, rows): a 16384-token microbatch, a 32k vocabulary on the GPU (1 GiB of bf16 logits); tiny in the dry run
T, V, H, ROWS = (16384, 32768, 1024, 8) if ON_CUDA else (64, 97, 16, 4)
CHUNK = 256 if ON_CUDA else 8


def _inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    seq = T // ROWS
    lengths = torch.randint(seq // 4, seq + 1, (ROWS,), generator=gen)
    ids = torch.randint(0, V, (ROWS, seq), generator=gen)
    pack = PackSequences(2, 2, T)(ids.to(DEVICE), lengths.to(DEVICE))
    hidden = torch.randn(1, T, H, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(V, H, generator=gen) / H**0.5).to(DEVICE, dtype)
    loss_weight = torch.randn(ROWS, seq, generator=gen).to(DEVICE)
    return pack, seq, hidden, weight, loss_weight


def _run(fn, hidden, weight, loss_weight):
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    out = fn(h, w)
    (out * loss_weight).sum().backward()
    return out.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 5e-2)])
def test_fused_head_equals_the_unfused_path(dtype, tol):
    pack, seq, hidden, weight, lw = _inputs(dtype)
    fused = TokenLogProbsFromHidden(seq, chunk_tokens=CHUNK, validate=False)
    unfused = TokenLogProbs(seq, chunk_tokens=CHUNK, validate=False)
    got = _run(lambda h, w: fused(h, w, pack.packed, layout=pack.layout), hidden, weight, lw)
    want = _run(lambda h, w: unfused(h @ w.T, pack.packed, layout=pack.layout), hidden, weight, lw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_no_sync_and_a_peak_far_below_the_unfused_paths():
    cuda_only("the device's sync check and memory statistics")
    pack, seq, hidden, weight, lw = _inputs(torch.bfloat16)
    fused = TokenLogProbsFromHidden(seq, chunk_tokens=CHUNK, validate=False)
    unfused = TokenLogProbs(seq, chunk_tokens=CHUNK, validate=False)
    paths = {"fused": lambda h, w: fused(h, w, pack.packed, layout=pack.layout),
             "unfused": lambda h, w: unfused(h @ w.T, pack.packed, layout=pack.layout)}
    peaks = {}
    for name, fn in paths.items():
        _run(fn, hidden, weight, lw)  # warm-up
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with forbid_syncs(DEVICE):
            _run(fn, hidden, weight, lw)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base - weight.numel() * weight.element_size()
    assert peaks["fused"] * 4 <= peaks["unfused"], peaks
