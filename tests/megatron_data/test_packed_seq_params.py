"""Tier: pure CPU, single process (imports megatron-core's ``PackedSeqParams``; the second CI job runs
this file on megatron-core 0.19.2, whose ``__post_init__`` builds ``seq_idx``; on 0.16.x the fields
``total_tokens``, ``seq_idx`` and ``pad_between_seqs`` do not exist).

nn_data.megatron_parallel.make_packed_seq_params on the installed megatron-core release: every field
equal to megatron-core's own construction, built without a host sync (on ``meta`` tensors), one
boundary object where nothing pads between sequences, the caller's CP group, and ``B = 0``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch

from nn_data.nemo_rl import megatron_data as md
from nn_data import megatron_parallel
from nn_data.diagnostics import HostSyncCounter
from nn_data.megatron_parallel import make_packed_seq_params, sequence_index
from nn_data.testing.coded import coded_batch

FIELDS = megatron_parallel.packed_seq_params_fields()
HAS_SEQ_IDX = "seq_idx" in FIELDS  # megatron-core 0.17 and newer


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


# (padded boundaries, valid boundaries or None, max_seqlen, total_tokens, pad_between_seqs); T = padded[-1].
CASES = {
    "one rank": ([0, 12, 16, 24, 40], None, 16, 40, None),
    "a CP rank's share (megatron clamps the last length)": ([0, 16, 40], None, 24, 20, None),
    "zero-length and row-capacity rows": ([0, 8, 8, 40, 40, 40], None, 32, 40, None),
    "row-capacity rows, CP rank": ([0, 8, 8, 40, 40, 40], None, 32, 10, None),
    "no sequence (B = 0)": ([40], None, 40, 40, None),
    "no sequence, CP rank": ([40], None, 40, 20, None),
    "nothing at all (T = 0)": ([0], None, 0, 0, None),
    "valid boundaries of their own (model slices CP)": ([0, 4, 12, 16], [0, 3, 11, 12], 8, 16, True),
    "total past the last boundary (megatron's example)": ([0, 5, 7, 11], None, 5, 16, None),
}


def _megatrons_own(padded, valid, max_seqlen, total, pad_between):
    """``PackedSeqParams`` built as megatron-core users build it: every field in the constructor, so
    the release's own ``__post_init__`` computes ``seq_idx``. ``B = 0`` as nn_data hands it over: the
    padding pseudo-segment ``[0, T]``."""
    if padded.shape[0] == 1:
        padded = torch.cat([torch.zeros_like(padded), padded])
        valid = None if valid is None else torch.cat([torch.zeros_like(valid), valid])
    valid = padded if valid is None else valid
    kwargs = dict(qkv_format="thd", cu_seqlens_q=valid, cu_seqlens_kv=valid, cu_seqlens_q_padded=padded,
                  cu_seqlens_kv_padded=padded, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    if "total_tokens" in FIELDS:
        kwargs["total_tokens"] = total
    if pad_between is not None and "pad_between_seqs" in FIELDS:
        kwargs["pad_between_seqs"] = pad_between
    return megatron_parallel.packed_seq_params_class()(**kwargs)


def _build(padded, valid, max_seqlen, total_tokens, pad_between, total=None):
    """nn_data's construction; ``total`` (T) read from the CPU boundaries unless given."""
    total = int(padded[-1]) if total is None else total
    return make_packed_seq_params(padded, max_seqlen, total_tokens, cu_seqlens=valid, pad_between_seqs=pad_between,
                                  total=total)


def _assert_same_fields(ours, theirs):
    assert type(ours) is type(theirs)
    for field in dataclasses.fields(theirs):
        a, b = getattr(ours, field.name), getattr(theirs, field.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (field.name, a, b)
        else:
            assert a == b and type(a) is type(b), (field.name, a, b)


@pytest.mark.parametrize("case", CASES)
def test_every_field_equals_megatron_cores_own_construction(case):
    padded, valid, max_seqlen, total, pad_between = CASES[case]
    padded, valid = _i32(padded), None if valid is None else _i32(valid)
    ours = _build(padded, valid, max_seqlen, total, pad_between)
    _assert_same_fields(ours, _megatrons_own(padded, valid, max_seqlen, total, pad_between))
    if HAS_SEQ_IDX:  # the tensor megatron-core would build, not None: the comparison above compared something
        assert ours.seq_idx is not None and ours.seq_idx.shape == (1, max(int(padded[-1]), total))


@pytest.mark.parametrize("case", CASES)
def test_built_on_meta_tensors_with_no_host_sync(case):
    padded, valid, max_seqlen, total, pad_between = CASES[case]
    cpu = _build(_i32(padded), None if valid is None else _i32(valid), max_seqlen, total, pad_between)
    padded_m = _i32(padded).to("meta")
    valid_m = None if valid is None else _i32(valid).to("meta")
    with HostSyncCounter() as syncs:
        ours = _build(padded_m, valid_m, max_seqlen, total, pad_between, total=padded[-1])
    assert syncs.count == 0, syncs.calls
    for field in dataclasses.fields(cpu):  # same fields, same shapes and dtypes as on the CPU
        a, b = getattr(ours, field.name), getattr(cpu, field.name)
        if isinstance(b, torch.Tensor):
            assert a.device.type == "meta" and a.shape == b.shape and a.dtype == b.dtype, field.name
        else:
            assert a == b, field.name


@pytest.mark.skipif(not HAS_SEQ_IDX, reason="megatron-core 0.16.x has no total_tokens/seq_idx to build")
def test_megatron_cores_own_construction_would_sync():
    """What the test above guards against: the release's ``__post_init__`` copies a Python int to the
    device (counted on ``meta``) and cannot size ``repeat_interleave`` there."""
    bounds = _i32([0, 16, 40]).to("meta")
    with HostSyncCounter() as syncs, pytest.raises(RuntimeError, match="repeat_interleave.*output_size"):
        megatron_parallel.packed_seq_params_class()(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_q_padded=bounds,
                                                    total_tokens=20)
    assert syncs.calls == ["torch.tensor"]


def test_one_boundary_object_when_nothing_pads_between_sequences():
    cu_pad = _i32([0, 4, 12, 16])
    for valid in (None, cu_pad):
        params = make_packed_seq_params(cu_pad, 8, 16, cu_seqlens=valid, total=16)
        assert all(getattr(params, f"cu_seqlens_{s}") is cu_pad for s in ("q", "kv", "q_padded", "kv_padded"))
        assert getattr(params, "pad_between_seqs", None) is None  # TransformerEngine infers False from identity
    cu = _i32([0, 3, 11, 12])
    params = make_packed_seq_params(cu_pad, 8, 16, cu_seqlens=cu, total=16)
    assert params.cu_seqlens_q is cu and params.cu_seqlens_kv is cu and params.cu_seqlens_q_padded is cu_pad
    if "pad_between_seqs" in FIELDS:
        assert params.pad_between_seqs is True  # boundaries of their own: padding assumed, always correct
        assert make_packed_seq_params(cu_pad, 8, 16, cu_seqlens=cu, pad_between_seqs=False).pad_between_seqs is False


def test_no_sequence_gives_megatron_core_the_padding_pseudo_segment():
    params = make_packed_seq_params(_i32([40]), 40, 20, total=40)
    assert params.cu_seqlens_q.tolist() == [0, 40] and params.cu_seqlens_q.dtype == torch.int32
    assert all(getattr(params, f"cu_seqlens_{s}") is params.cu_seqlens_q for s in ("kv", "q_padded", "kv_padded"))
    params = make_packed_seq_params(_i32([40]), 40, 40, cu_seqlens=_i32([0]), pad_between_seqs=True, total=40)
    assert params.cu_seqlens_q.tolist() == [0, 0] and params.cu_seqlens_q_padded.tolist() == [0, 40]


def test_the_cp_group_is_the_callers_and_local_cp_size_stays_unset():
    group = object()  # stored, never called
    params = make_packed_seq_params(_i32([0, 8]), 8, 4, total=8, cp_group=group)
    assert params.cp_group is group and params.local_cp_size is None
    assert make_packed_seq_params(_i32([0, 8]), 8, 4, total=8).cp_group is None


def test_without_the_packed_length_one_host_read_learns_it():
    bounds = _i32([0, 16, 40])
    with HostSyncCounter() as syncs:
        params = make_packed_seq_params(bounds, 24, 20)
    assert syncs.count == (1 if HAS_SEQ_IDX else 0), syncs.calls
    _assert_same_fields(params, _megatrons_own(bounds, None, 24, 20, None))


@pytest.mark.parametrize("bounds, total, length, expected", [
    ([0, 16, 40], 20, 40, [0] * 16 + [1] * 24),
    ([0, 5, 7, 11], 16, 11, [0] * 5 + [1] * 2 + [2] * 4 + [3] * 5),
    ([0, 0, 3, 3, 6], 6, 6, [1] * 3 + [3] * 3),
    ([0, 6], 0, 6, [0] * 6),
])
def test_sequence_index_worked_examples(bounds, total, length, expected):
    got = sequence_index(_i32(bounds), total, length)
    assert got.dtype == torch.int32 and got.tolist() == [expected]


@pytest.mark.parametrize("cp_rank, cp_size", [(0, 1), (1, 2)])
def test_the_compat_layers_params_equal_megatron_cores_own(monkeypatch, cp_rank, cp_size):
    monkeypatch.setattr(md, "get_context_parallel_rank", lambda: cp_rank)
    monkeypatch.setattr(md, "get_context_parallel_world_size", lambda: cp_size)
    lengths = [12, 3, 8, 1]
    packed, local, params, cu, cu_pad = md._pack_sequences_for_megatron(
        coded_batch(lengths, 12), torch.tensor(lengths), 4, 1, 40, cp_rank=cp_rank, cp_size=cp_size)
    _assert_same_fields(params, _megatrons_own(cu_pad, None, 16, local.shape[1], None))
    assert params.cu_seqlens_q is cu_pad


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
