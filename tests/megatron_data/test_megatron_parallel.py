"""Tier: pure CPU, single process (no torch.distributed; the multi-process resolution under
megatron-core's parallel_state is tested in
tests/multiprocess/test_cp_multiprocess.py).

Resolution of the CP/TP rank, size and group without torch.distributed, and that
importing nn_data (and nn_data.megatron_parallel) does not import megatron-core.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from nn_data import PackingError, TokenLogProbs
from nn_data.groups import ParallelInfo, context_parallel_info, tensor_parallel_info

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_without_torch_distributed_a_single_rank():
    assert not dist.is_initialized()
    assert context_parallel_info() == ParallelInfo(0, 1, None)
    assert tensor_parallel_info() == ParallelInfo(0, 1, None)


def test_a_group_without_torch_distributed_is_an_error():
    with pytest.raises(PackingError, match="a context-parallel group was given but torch.distributed is not"):
        context_parallel_info(object())
    with pytest.raises(PackingError, match="a context-parallel group was given but torch.distributed is not initialised"):
        TokenLogProbs(8, cp_group=object())


def test_importing_nn_data_does_not_import_megatron():
    code = ("import sys, nn_data, nn_data.megatron_parallel; "
            "sys.exit(any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
