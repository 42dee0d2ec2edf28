"""Tier: helper (no tests). The marker for tests that run flex attention on the CPU: torch before
``nn_data._compat.FLEX_CPU_TORCH`` is refused there by name (tests/models/test_masks.py checks the refusal on
that release), so those tests cannot run on it."""

from __future__ import annotations

import pytest
import torch

from nn_data._compat import FLEX_CPU_TORCH, flex_on_cpu

needs_cpu_flex = pytest.mark.skipif(
    not flex_on_cpu(),
    reason=f"torch {torch.__version__}: flex attention on the CPU needs torch >= {FLEX_CPU_TORCH} (refused by name; "
    "tests/models/test_masks.py checks the refusal)",
)
