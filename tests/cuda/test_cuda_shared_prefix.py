"""Tier: GPU-only (marker ``cuda``), skipped without CUDA; ``NN_DATA_CUDA_DRY_RUN=1`` runs it on the CPU
(float32; the variable-length kernel replaced by tests/support/shared_prefix_kv_cases.varlen_reference).
A step of the GPU check (``scripts/gpu_check.sh``: the CUDA tier). Not run on a GPU yet.

Shared-prefix attention through the real variable-length kernels, with the distinct query and
key/value boundaries of nn_data.adapters.tree_kv and each response's prompt keys gathered into
the buffer (a rollout tree's nodes, depth 1 to 4, their path's keys: ``tree_kv``): torch's ``varlen_attn`` (flash-attention, bottom-right causal) and, where it imports,
TransformerEngine's ``DotProductAttention`` (THD, ``padding_causal_bottom_right``) over megatron-core's
``PackedSeqParams``; each against the packed row under nn_data's dense prefix mask. Also the whole
shared-prefix forward of a tiny Llama on the device against each rollout alone.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nn_data import PackedForward
from nn_data.adapters import HFCausalLMAdapter
from nn_data.models.tiny_hf import tiny_hf_model
from tests.cuda.stream import DEVICE, ON_CUDA, TIER
from tests.models import shared_prefix_cases
from tests.support import shared_prefix_kv_cases as kv_cases
from tests.support.tree_reference import BY_DEPTH, depth

pytestmark = TIER

DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
TOL = 2e-2 if ON_CUDA else 1e-5  # bf16 on the device (values of magnitude ~1), float32 in the dry run
HEADS, DIM = 4, 64


def _qkv(total: int):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(total, HEADS, DIM, generator=gen).to(DEVICE, DTYPE) for _ in range(3)]


def _varlen(q, k, v, kv):
    if not ON_CUDA:
        return kv_cases.varlen_reference(q, k, v, kv.cu_seqlens_q, kv.cu_seqlens_kv)
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, kv.cu_seqlens_q, kv.cu_seqlens_kv, kv.max_seqlen_q, kv.max_seqlen_kv,
                       window_size=(-1, 0))


ROWS = [pytest.param(kv_cases.shared_row, row, id=f"P{row[1]}-m{row[3]}") for row in kv_cases.ROWS]
TREES = [pytest.param(kv_cases.tree_row, (tree, 4), id=f"tree-depth{depth(tree)}") for tree in BY_DEPTH]


@pytest.mark.parametrize("build, args", ROWS + TREES)
def test_varlen_kernel_over_the_prompt_buffer_equals_the_prefix_mask(build, args):
    """The shared prompt's rows (``shared_prefix_kv``) and trees of depth 1 to 4 (``tree_kv``: each node's
    path before it)."""
    if ON_CUDA and importlib.util.find_spec("torch.nn.attention.varlen") is None:
        pytest.skip("torch.nn.attention.varlen not installed (torch too old)")
    shared, kv, total = build(*args, device=DEVICE)
    q, k, v = _qkv(total)
    got = _varlen(q, kv.gather(k), kv.gather(v), kv)
    want = kv_cases.dense_reference(q.float(), k.float(), v.float(), shared)
    real = kv_cases.real_queries(shared)
    worst = float((got.float()[real] - want[real]).abs().max())
    assert worst < TOL, worst


@pytest.mark.parametrize("build, args", [ROWS[1], TREES[-1]])
def test_transformer_engine_thd_attention_over_the_packed_seq_params(build, args):
    """The shared prompt's row and the deepest tree (depth 4: ``tree_kv``, what the NeMo-RL drop-in's tree record
    carries at CP 1): TransformerEngine's THD attention over the buffer on the PackedSeqParams equals the mask."""
    if not ON_CUDA:
        pytest.skip("dry run: TransformerEngine's attention needs CUDA")
    if importlib.util.find_spec("transformer_engine") is None or importlib.util.find_spec("megatron") is None:
        pytest.skip("transformer_engine / megatron-core not installed")
    from transformer_engine.pytorch import DotProductAttention

    from nn_data.adapters.tree_kv import tree_packed_seq_params

    shared, kv, total = build(*args, device=DEVICE)
    params = tree_packed_seq_params(kv)
    q, k, v = _qkv(total)
    attention = DotProductAttention(HEADS, DIM, qkv_format="thd", attn_mask_type="padding_causal_bottom_right")
    got = attention(q, kv.gather(k), kv.gather(v), cu_seqlens_q=params.cu_seqlens_q,
                    cu_seqlens_kv=params.cu_seqlens_kv, max_seqlen_q=params.max_seqlen_q,
                    max_seqlen_kv=params.max_seqlen_kv).view(total, HEADS, DIM)
    want = kv_cases.dense_reference(q.float(), k.float(), v.float(), shared)
    real = kv_cases.real_queries(shared)
    assert float((got.float()[real] - want[real]).abs().max()) < TOL


def test_shared_prefix_forward_on_the_device_equals_each_rollout_alone():
    model = tiny_hf_model("llama", dtype=DTYPE).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    with torch.no_grad():
        for groups, prefix, lengths in shared_prefix_cases.MICROBATCHES:
            ids, lens, pre, gid = (t.to(DEVICE) for t in shared_prefix_cases.rollouts(groups, prefix, lengths, gen))
            wrapped = PackedForward(HFCausalLMAdapter(model), pad_individual_seqs_to_multiple_of=4,
                                    pad_full_seq_to=shared_prefix_cases.packed_length(groups, prefix, lengths, 4))
            out = wrapped(ids, lens, prefix_lengths=pre, group_ids=gid)
            for b, n in enumerate(lengths):
                alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]
                worst = max(worst, float((out[b, :n].float() - alone.float()).abs().max()))
    assert worst < (3e-2 if ON_CUDA else 2e-5), worst
