"""Fixtures and hooks for every test tier: a fixed seed per test, deterministic hypothesis, and
``cuda`` tests skipped without a GPU.

Folders are subjects (tests/ops, tests/docs, tests/planning, tests/megatron_data, tests/profiling,
tests/models) and two tiers (tests/multiprocess, tests/cuda); every test file states its tier in its
docstring's first line, and the markers registered in pyproject.toml select across folders
(docs/testing.md, "Test folders" and "Tiers and markers"); tests/support holds the helpers they share. Hypothesis runs
the derandomized ``ci`` profile unless ``NN_DATA_HYPOTHESIS_PROFILE=explore`` asks for a long random
exploration (tests/support/hypothesis_profiles.py).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests.support import hypothesis_profiles

hypothesis_profiles.load()  # before any test module builds its settings objects

warnings.filterwarnings("ignore", message=".*(TransformerEngine|[Aa]pex).*")


def pytest_collection_modifyitems(config, items):
    """Skip ``cuda``-marked tests when torch sees no CUDA device (the CPU-only machines), unless
    ``NN_DATA_CUDA_DRY_RUN=1`` (``scripts/gpu_check.sh --dry-run``: tests/cuda on the CPU, tiny sizes)."""
    if torch.cuda.is_available() or os.environ.get("NN_DATA_CUDA_DRY_RUN") == "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
