"""Tier: pure CPU, one process.

What the fifth round of checks found (issue 34's findings 5, 6 and 16), each a test that failed before its
fix: a staged microbatch that took lengths longer than the rows it was loaded with, ``PackLayout``'s
methods that ran another microbatch's packed tensor, and the README's NeMo-RL example without
megatron-core (a bare ``ModuleNotFoundError`` before; the extra to install now). The import paths:
tests/ops/test_old_names.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from nn_data import PackedForward, PackSequences, PackingError
from nn_data.diagnostics import HostSyncCounter
from nn_data.models import TinyCausalLM
from nn_data.staging import StagedMicrobatch


@pytest.fixture(scope="module")
def packing():
    torch.manual_seed(0)
    model = TinyCausalLM(vocab=16, dim=8, heads=2, layers=1, mask_kind="dense").eval()
    return PackedForward(model, pad_individual_seqs_to_multiple_of=1, pad_full_seq_to=16, row_capacity=4)


def test_a_staged_microbatch_refuses_lengths_past_the_rows_it_was_loaded_with(packing):
    ids, lengths = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([6, 2])  # rows of 3 tokens, a length of 6
    with pytest.raises(PackingError, match=r"^seq_lengths\[0\] = 6 is outside \[0, S=3\]"):
        packing.prepare(ids, lengths)  # the unstaged path
    stage = StagedMicrobatch(packing, 10)  # staged rows of 10: the check must be against the 3 loaded
    with pytest.raises(RuntimeError, match=r"StagedMicrobatch.prepare: every seq_lengths value must be in \[0, S\] "
                                           r"\(S = the rows loaded: input_ids.shape\[1\] of load"):
        stage.load(ids, lengths).prepare()
    with HostSyncCounter() as syncs:  # a length that fits: still no host read
        stage.load(ids, torch.tensor([3, 2])).prepare()
    assert syncs.count == 0, syncs.calls
    unvalidated = StagedMicrobatch(packing, 10, validate=False)
    unvalidated.load(ids, lengths).prepare()  # validate=False: no check (the caller's choice)
    full = torch.zeros(4, 10, dtype=torch.int64)
    stage.load_rows(full, torch.tensor([10, 0, 0, 0]), torch.tensor(1)).prepare()  # rows of S: a length of S fits


@pytest.mark.parametrize("host_reads", [True, False])
def test_pack_layout_methods_refuse_another_microbatchs_packed_tensor(host_reads):
    pack = PackSequences(4, pad_full_seq_to=16, host_reads=host_reads)
    a = pack(torch.arange(1, 11).view(2, 5), torch.tensor([3, 5]))
    b = pack(torch.arange(11, 21).view(2, 5), torch.tensor([5, 2]))
    if a.layout.token is None:  # only the host executor's tensors carry a token
        assert not host_reads
        return
    other = r"^packed was packed on another microbatch's layout"
    with pytest.raises(PackingError, match=other):
        b.layout.unpack(a.packed, 5)
    with pytest.raises(PackingError, match=other):
        b.layout.shard(a.packed, 2, 1)
    with pytest.raises(PackingError, match=other):
        b.layout.shard(a.packed, 1, 0)
    shards = a.layout.shard(a.packed, 2, 0)
    with pytest.raises(PackingError, match=r"^shards was packed on another microbatch's layout"):
        b.layout.unshard(shards, 2)
    assert torch.equal(a.layout.unpack(a.packed, 5), torch.arange(1, 11).view(2, 5) * (torch.arange(5) < torch.tensor(
        [[3], [5]])))  # its own layout still runs


README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_nemo_rl_example() -> str:
    """The README's runnable "Switching from NeMo-RL" block (the one importing nn_data.nemo_rl.megatron_data)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "from nn_data.nemo_rl.megatron_data import" in b]
    return block


def test_the_nemo_rl_example_without_megatron_core_names_the_extra(monkeypatch, capsys):
    from nn_data import megatron_parallel

    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")] + ["megatron"]:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it fails: megatron-core "not installed"
    megatron_parallel.packed_seq_params_class.cache_clear()
    megatron_parallel.gpt_model_class.cache_clear()
    try:
        extra = r'needs megatron-core, which is not installed .*: pip install "nn_data\[megatron\]"'
        with pytest.raises(ModuleNotFoundError, match=extra):
            exec(compile(_readme_nemo_rl_example(), "README.md", "exec"), {})
        with pytest.raises(ModuleNotFoundError, match=extra):
            megatron_parallel.gpt_model_class()
    finally:
        megatron_parallel.packed_seq_params_class.cache_clear()
        megatron_parallel.gpt_model_class.cache_clear()
