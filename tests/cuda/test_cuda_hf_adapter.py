"""Tier: GPU-only (marker ``cuda``), skipped without CUDA; ``NN_DATA_CUDA_DRY_RUN=1`` runs it on the CPU
(float32, the per-sequence path, no flash-attention). Not run on a GPU yet.

HFCausalLMAdapter on a CUDA GPU: attention, a sliding window and the hybrids packed against each
sequence alone, on whichever path ``mixers="auto"`` takes there (the boundary-honouring kernels when
flash-linear-attention / causal-conv1d / mamba-ssm are importable, else one sequence per row), the
flash-attention path when flash-attn is importable, and no host-device sync in the adapter and model
under compiled packing (``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nn_data import PackedForward
from nn_data.adapters import HFCausalLMAdapter
from nn_data.models.tiny_hf import tiny_hf_model
from nn_data.diagnostics import forbid_syncs
from tests.cuda.stream import DEVICE, ON_CUDA, TIER
from tests.models.adapter_cases import coded_ids

pytestmark = TIER

DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
TOL = 3e-2 if ON_CUDA else 2e-5
LENGTHS = [5, 0, 12, 3, 9]


def _worst(model, wrapped) -> float:
    ids, lens = coded_ids(LENGTHS, torch.Generator().manual_seed(3)).to(DEVICE), torch.tensor(LENGTHS, device=DEVICE)
    with torch.no_grad():
        out = wrapped(ids, lens)
        return max(float((out[b, :n] - model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]).abs().max())
                   for b, n in enumerate(LENGTHS) if n)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3_next", "mamba2", "lfm2"])
def test_packed_equals_each_sequence_alone_on_the_device(kind):
    model = tiny_hf_model(kind, dtype=DTYPE).to(DEVICE)
    adapter = HFCausalLMAdapter(model)
    worst = _worst(model, PackedForward(adapter, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=64))
    assert worst < TOL, (kind, adapter.mixer_path, worst)


def test_flash_attentions_variable_length_kernel_takes_the_boundaries():
    if not ON_CUDA or importlib.util.find_spec("flash_attn") is None:
        pytest.skip("dry run: flash-attention needs CUDA and flash-attn" if not ON_CUDA else "flash-attn not installed")
    model = tiny_hf_model("llama", dtype=torch.bfloat16, attn_implementation="flash_attention_2").to(DEVICE)
    assert _worst(model, PackedForward(HFCausalLMAdapter(model), pad_full_seq_to=64)) < TOL


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_no_host_device_sync_in_the_adapter_and_model(kind):
    model = tiny_hf_model(kind, dtype=DTYPE).to(DEVICE)
    wrapped = PackedForward(HFCausalLMAdapter(model), pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=64,
                            row_capacity=5, compile_packing=True, compile_kwargs={"backend": "aot_eager"})
    ids, lens = coded_ids(LENGTHS, torch.Generator().manual_seed(4)).to(DEVICE), torch.tensor(LENGTHS, device=DEVICE)
    with torch.no_grad():
        wrapped(ids, lens)  # compiles
        inp = wrapped.prepare(ids, lens)
        with forbid_syncs(DEVICE):
            wrapped.model(inp.input_ids, inp.position_ids, inp.packed)
