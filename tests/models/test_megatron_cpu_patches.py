"""nn_data/adapters/_megatron_cpu.py: where megatron-core 0.16.x is patched on a CPU-only torch.

Tier: pure CPU, single process (imports megatron-core; builds nothing distributed).
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from nn_data.adapters import _megatron_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the patches apply on a torch without CUDA only")


def test_patches_apply_to_the_four_listed_modules_only():
    assert _megatron_cpu.needs_cpu_patches()
    assert _megatron_cpu.apply_cpu_patches() is True
    assert _megatron_cpu.apply_cpu_patches() is True  # idempotent
    assert _megatron_cpu.cpu_patches_applied()
    for name in _megatron_cpu._PATCHED_MODULES:
        assert sys.modules[name].torch is _megatron_cpu._SHIM
    untouched = importlib.import_module("megatron.core.transformer.attention")
    assert untouched.torch is torch  # nothing global: other modules see the real torch


def test_the_stand_in_maps_cuda_placement_to_the_cpu():
    shim = _megatron_cpu._SHIM
    assert shim.cuda.current_device() == torch.device("cpu")
    assert shim.cuda.synchronize() is None
    assert shim.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert shim.empty((3,), device=shim.cuda.current_device()).shape == (3,)
    assert shim.float64 is torch.float64 and shim.Tensor is torch.Tensor  # everything else is torch's


def test_rng_tracker_is_megatron_cores_inference_tracker():
    from megatron.core.tensor_parallel import random as mrandom

    _megatron_cpu.apply_cpu_patches()
    tracker = mrandom.get_cuda_rng_tracker()
    assert tracker.is_inference_rng_tracker
    with tracker.fork():  # what the stock attention does around dropout: a no-op here
        pass


def test_other_megatron_core_releases_are_refused(monkeypatch):
    monkeypatch.setattr(_megatron_cpu, "megatron_version", lambda: "0.17.0")
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.17\.0 on a CPU-only torch.*megatron-core 0\.16\.x"):
        _megatron_cpu.apply_cpu_patches()
