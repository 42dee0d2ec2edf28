"""Tier: pure CPU, single process. The block-mask test compiles create_block_mask and
flex_attention once (~10-15 s cold on 2 cores); flex on a CPU runs forward only, in float32.

The document mask, dense or as a flex-attention BlockMask (nn_data.masks).
"""

from __future__ import annotations

import pytest
import torch

from nn_data._compat import FLEX_CPU_TORCH, flex_on_cpu
from nn_data.errors import PackingError
from nn_data.models import TinyCausalLM
from nn_data.masks import document_causal_mask, document_mask, flex_supported
from nn_data.packed_forward import PackedForward
from tests.support.flex_release import needs_cpu_flex


def _loop_mask(query_index, segment_ids):
    """The obviously-correct reference: one (query, key) pair at a time."""
    out = torch.zeros(len(query_index), len(segment_ids), dtype=torch.bool)
    for q, i in enumerate(query_index.tolist()):
        for j in range(len(segment_ids)):
            out[q, j] = bool(segment_ids[i] == segment_ids[j]) and j <= i
    return out


def test_dense_mask_matches_the_loop_reference():
    segment_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
    query_index = torch.tensor([0, 1, 8, 9, 4, 5])  # a CP shard's places, in any order
    mask = document_mask(query_index, segment_ids, kind="dense")
    assert mask.kind == "dense" and mask.block is None and mask.gather is None
    assert torch.equal(mask.dense, _loop_mask(query_index, segment_ids))
    assert torch.equal(document_causal_mask(query_index, segment_ids), mask.dense)


def test_auto_keeps_dense_where_flex_cannot_run_or_the_mask_is_small():
    q, s = torch.arange(4), torch.zeros(4, dtype=torch.long)
    assert document_mask(q, s).kind == "dense"  # small
    assert document_mask(q, s, dense_limit=1).kind == "dense"  # grad enabled on a CPU: flex has no backward
    with torch.no_grad():
        assert document_mask(q, s, dtype=torch.float64, dense_limit=1).kind == "dense"  # no float64 flex on CPU
    assert flex_supported(torch.device("cpu"), torch.float32, needs_grad=False) == flex_on_cpu()
    assert not flex_supported(torch.device("cpu"), torch.float32, needs_grad=True)
    assert flex_supported(torch.device("cuda"), torch.float64, needs_grad=True)


def test_bad_kind_and_unsupported_block_raise():
    q, s = torch.arange(4), torch.zeros(4, dtype=torch.long)
    with pytest.raises(PackingError, match=r"kind='sparse' is invalid; expected 'auto', 'dense' or 'block'"):
        document_mask(q, s, kind="sparse")
    with pytest.raises(PackingError, match=r"kind='block' needs flex attention.*grad enabled=True"):
        document_mask(q, s, kind="block")
    with torch.no_grad(), pytest.raises(PackingError, match=r"dtype=torch.float64"):
        document_mask(q, s, kind="block", dtype=torch.float64)


@pytest.mark.skipif(flex_on_cpu(), reason=f"torch {torch.__version__} runs flex on the CPU")
def test_block_on_the_cpu_is_refused_by_name_before_the_release_that_runs_it():
    """torch 2.11's compiled CPU flex kernel aborts the process (nn_data._compat): ``kind="block"`` on the CPU is
    refused naming the release needed and the alternative, and ``auto`` keeps the dense mask however large."""
    q, s = torch.arange(4), torch.zeros(4, dtype=torch.long)
    with torch.no_grad():
        with pytest.raises(PackingError, match=rf"torch >= {FLEX_CPU_TORCH}\); use kind='dense' or 'auto'"):
            document_mask(q, s, kind="block")
        assert document_mask(q, s, dense_limit=1).kind == "dense"


@needs_cpu_flex
def test_block_mask_forward_equals_dense_and_is_smaller():
    """TinyCausalLM with the flex BlockMask == with the dense mask (inference, float32), and
    ``auto`` picks the block mask for a large enough mask under no_grad."""
    dense_model = TinyCausalLM(vocab=61, dim=32, heads=4, layers=2).eval()
    block_model = TinyCausalLM(vocab=61, dim=32, heads=4, layers=2, mask_kind="block").eval()
    block_model.load_state_dict(dense_model.state_dict())
    lengths = torch.tensor([40, 7, 0, 23, 31])
    ids = torch.randint(1, 61, (5, 40), generator=torch.Generator().manual_seed(5))
    ids = torch.where(torch.arange(40) < lengths[:, None], ids, 0)
    kwargs = dict(pad_individual_seqs_to_multiple_of=8, pad_full_seq_to=256)
    with torch.no_grad():
        dense = PackedForward(dense_model, **kwargs)(ids, lengths)
        block = PackedForward(block_model, **kwargs)(ids, lengths)
        torch.testing.assert_close(block, dense, rtol=0, atol=2e-6)
        segment_ids = torch.repeat_interleave(torch.arange(4), torch.tensor([64, 64, 64, 64]))
        auto = document_mask(torch.arange(256), segment_ids, dense_limit=256 * 256)
    assert auto.kind == "block" and auto.dense is None
    block_bytes = sum(t.numel() * t.element_size() for t in auto.block.as_tuple() if isinstance(t, torch.Tensor))
    assert block_bytes < 256 * 256  # a bool [T, T] mask's bytes
