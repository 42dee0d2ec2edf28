"""Tier: pure CPU, one process (one test runs a shell script).

What an independent round of checks found on 0.1.x, each a test that failed before its fix: a pack of
empty rows that dropped out of autograd, lengths given as a list, another microbatch's layout, the GPU
check without torch, the license and the README, a wrapped uint64 length, and error messages that
could say what to do.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from nn_data import PackSequences, PackingError, ShardForContextParallel, UnpackSequences
from nn_data.planning import Parallelism, plan_step

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("host_reads", [True, False])  # the host executor, and the device executor
def test_an_all_empty_pack_of_features_stays_in_autograd(host_reads):
    ids = torch.zeros(2, 4, dtype=torch.int64)
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    layout = PackSequences(4, 1, 16, host_reads=host_reads)(ids, torch.tensor([0, 0])).layout
    packed = layout.pack(x)
    assert packed.requires_grad and packed.shape == (1, 16, 3)
    (grad,) = torch.autograd.grad(packed.sum(), x)  # raised "does not require grad" before
    assert torch.equal(grad, torch.zeros_like(x))


@pytest.mark.parametrize("lengths", [[3, 2, 5], (3, 2, 5), np.array([3, 2, 5])])
def test_pack_sequences_takes_lengths_as_a_list_tuple_or_numpy_array(lengths):
    ids = torch.arange(1, 16).view(3, 5)
    r = PackSequences(4)(ids, lengths)
    assert r.cu_seqlens_padded.tolist() == [0, 4, 8, 16]
    assert torch.equal(UnpackSequences(5)(r.packed, layout=r.layout), ids * (torch.arange(5) < torch.tensor(
        [3, 2, 5])[:, None]))


def test_another_microbatchs_layout_of_the_same_length_is_refused():
    pack = PackSequences(4, pad_full_seq_to=16)
    a = pack(torch.arange(1, 11).view(2, 5), torch.tensor([3, 5]))
    b = pack(torch.arange(11, 21).view(2, 5), torch.tensor([5, 2]))
    with pytest.raises(PackingError, match=r"^packed was packed on another microbatch's layout"):
        UnpackSequences(seq_len=5)(a.packed, layout=b.layout)
    with pytest.raises(PackingError, match=r"^packed was packed on another microbatch's layout"):
        ShardForContextParallel(2, 0)(a.packed, layout=b.layout)
    from nn_data import NextTokenTargets

    with pytest.raises(PackingError, match=r"^packed_ids was packed on another microbatch's layout"):
        NextTokenTargets()(a.packed, layout=b.layout)
    assert UnpackSequences(seq_len=5)(a.packed, layout=a.layout)[0].tolist() == [1, 2, 3, 0, 0]


def test_a_cp_shard_given_to_unpack_is_named_as_one():
    r = PackSequences(4, pad_full_seq_to=16)(torch.arange(1, 11).view(2, 5), torch.tensor([3, 5]))
    local = ShardForContextParallel(2, 1)(r.packed, layout=r.layout)
    with pytest.raises(PackingError, match=r"has T=8 = T/2: a context-parallel shard\? Gather it first "
                                           r"\(GatherFromContextParallel, or UnshardFromContextParallel"):
        UnpackSequences(seq_len=5)(local, layout=r.layout)


def test_swapped_lengths_and_boundaries_are_named_as_swapped():
    r = PackSequences(4)(torch.arange(1, 11).view(2, 5), torch.tensor([3, 5]))
    with pytest.raises(PackingError, match=r"^cu_seqlens_padded has 2 entries; expected 4 \(B \+ 1 for the B = 3 "
                                           r"entries of seq_lengths\); seq_lengths has one entry more than "
                                           r"cu_seqlens_padded: were the two swapped\?$"):
        UnpackSequences(5)(r.packed, r.cu_seqlens_padded, torch.tensor([3, 5]))


def test_a_uint64_length_above_2_63_is_named_as_given():
    big = 2**63 + 5
    with pytest.raises(PackingError, match=rf"^lengths\[0\] = {big} is invalid; a length above 2147483647 cannot "
                                           r"fit the int32 boundaries"):
        plan_step(np.array([big, 3], dtype=np.uint64), Parallelism(dp=1), pad_full_seq_to=64)


def test_the_gpu_check_without_a_python_that_has_torch_says_what_to_run():
    env = {**os.environ, "PYTHON": "false"}  # an interpreter that cannot import torch
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2, run.stderr
    assert "false has no torch" in run.stderr and "--dry-run" in run.stderr
    assert "ModuleNotFoundError" not in run.stderr


def test_the_license_file_is_the_one_the_metadata_names():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()


def test_the_readme_says_what_ran_where():
    readme = (ROOT / "README.md").read_text()
    assert "never run on a GPU" in readme  # the CUDA paths: prepared, dry-run on the CPU only
    assert "Tested: torch 2.13.0" in readme and "only" in readme.split("Tested: torch 2.13.0")[1][:200]
