"""Tier: pure CPU, single process (imports megatron-core; builds nothing distributed).

nn_data/adapters/_megatron_cpu.py: where megatron-core (0.16.x, 0.19.x) is patched on a CPU-only torch.
"""

from __future__ import annotations

import importlib
import re
import sys

import pytest
import torch

from nn_data.adapters import _megatron_cpu
from tests.support.megatron_release import needs_megatron_models

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the patches apply on a torch without CUDA only")


@needs_megatron_models
def test_patches_apply_to_the_four_listed_modules_only():
    assert _megatron_cpu.needs_cpu_patches()
    assert _megatron_cpu.apply_cpu_patches() is True
    assert _megatron_cpu.apply_cpu_patches() is True  # idempotent
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


@needs_megatron_models
def test_rng_tracker_is_megatron_cores_inference_tracker():
    from megatron.core.tensor_parallel import random as mrandom

    _megatron_cpu.apply_cpu_patches()
    tracker = mrandom.get_cuda_rng_tracker()
    assert tracker.is_inference_rng_tracker
    with tracker.fork():  # what the stock attention does around dropout: a no-op here
        pass


@pytest.mark.parametrize("version", ["0.16.1", "0.16.0", "0.19.2", "0.19.0"])
def test_the_tested_releases_are_supported(monkeypatch, version):
    monkeypatch.setattr(_megatron_cpu, "megatron_version", lambda: version)
    assert _megatron_cpu.unsupported_reason() is None


@pytest.mark.parametrize("version", ["0.15.3", "0.17.0", "0.18.1", "0.20.0", "1.16.0"])
def test_other_megatron_core_releases_are_refused(monkeypatch, version):
    monkeypatch.setattr(_megatron_cpu, "megatron_version", lambda: version)
    message = (rf"megatron-core {re.escape(version)} on a CPU-only torch: nn_data's CPU patches "
               r"\(nn_data/adapters/_megatron_cpu.py\) are tested on megatron-core 0\.16\.x and 0\.19\.x only; "
               r"run on a GPU or install megatron-core==0\.16\.1 \(Python 3\.11\) or 0\.19\.2 "
               r"\(Python 3\.12 or newer\)")
    assert re.fullmatch(message, _megatron_cpu.unsupported_reason())
    with pytest.raises(RuntimeError, match=message):
        _megatron_cpu.apply_cpu_patches()


def test_the_version_is_read_without_importing_megatron_core():
    import subprocess

    code = ("import sys; from nn_data.adapters import _megatron_cpu; v = _megatron_cpu.megatron_version(); "
            "sys.exit(0 if v[:1].isdigit() and 'megatron.core' not in sys.modules else 1)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
