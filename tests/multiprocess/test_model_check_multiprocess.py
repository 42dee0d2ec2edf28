"""Tier: CPU multi-process over gloo (2 spawned ranks on 127.0.0.1, tests/support/cp_harness.py; the CP
group is the world of the 2 ranks).

The packing check under context parallelism: every rank runs it in lockstep (its microbatches, the
re-runs that locate the layer, the verdict's all-reduce) and the verdict is the same on both ranks:
refused on both with the same message, or passed on both.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.cp_harness import RankPool


@pytest.fixture(scope="module")
def rank_pool():
    pool = RankPool(2, megatron=False)
    yield pool
    pool.close()


class _RowMean(nn.Module):
    """Per-token embedding and head; ``mix=True`` adds a running mean over this rank's local row (mixes)."""

    def __init__(self, mix: bool):
        super().__init__()
        torch.manual_seed(0)
        self.mix = mix
        self.emb, self.head = nn.Embedding(50, 8), nn.Linear(8, 50)

    def forward(self, input_ids, position_ids, packed):
        x = self.emb(input_ids)  # [1, T/C, 8]
        if self.mix:
            x = x + x.cumsum(1) / 4
        return self.head(x)


def case_verdict(kind: str):
    """``(rank, outcome)``: "passed", or the refusal's message."""
    import torch.distributed as dist

    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.errors import PackingError
    from nn_data.models.tiny_hf import tiny_hf_model
    from nn_data.packed_forward import PackedForward

    group = dist.group.WORLD
    model = HFCausalLMAdapter(tiny_hf_model("llama")) if kind == "llama" else _RowMean(mix=kind == "mixes")
    wrapped = PackedForward(model, cp_group=group, pad_individual_seqs_to_multiple_of=4, pad_packed_seq_to_multiple_of=4)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 4, 11])
    ids = torch.where(torch.arange(11) < lengths[:, None], torch.randint(1, 50, (3, 11), generator=gen), 0)
    try:
        wrapped(ids, lengths)
    except PackingError as e:
        return dist.get_rank(), str(e)
    return dist.get_rank(), "passed"


@pytest.mark.parametrize("kind", ["exact", "llama"])
def test_an_exact_model_passes_on_every_rank(rank_pool, kind):
    assert rank_pool.run(f"{__name__}:case_verdict", kind, cp=None) == [(0, "passed"), (1, "passed")]


def test_a_mixing_model_is_refused_on_every_rank_with_one_message(rank_pool):
    (r0, first), (r1, second) = rank_pool.run(f"{__name__}:case_verdict", "mixes", cp=None)
    assert (r0, r1) == (0, 1) and first == second
    assert first.startswith("model_type='_RowMean': layer (the wrapped model: _RowMean)") and \
        "tokens of one sequence reach another" in first and "run this model unpacked" in first
