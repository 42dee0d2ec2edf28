"""Tier: pure CPU, single process, torch.compile with the inductor backend (small graphs here, and one
subprocess that compiles ``PackedForward(compile_packing=True)`` with 2 and 4 threads).

Device-side checks under inductor (``nn_data._checks.device_assert``, the one home of them): any message
compiles (quotes, backslashes, braces, non-ASCII: inductor once wrote the message into a C++ string literal),
the check is called between inductor's kernels, never inside one (read from inductor's generated code), and a
failed check raises a catchable ``RuntimeError`` with its message whatever the thread count: the process
lives on (inductor's C++ kernels once threw inside their OpenMP parallel region, which ends the process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

from nn_data import _checks

ROOT = Path(__file__).resolve().parents[2]
MESSAGE = 'nn_data.test: cfg["a"]["b"]=3 \\ {braces} {0} %s \'single\' é ü 中文 \n tab\t end'


def _check(x, limit):
    _checks.device_assert((x <= limit).all(), MESSAGE)  # [] flag from [N]
    return x * 2


@pytest.mark.compile
def test_any_message_compiles_and_the_check_runs_between_kernels():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_check, fullgraph=True, backend=counter)
    x = torch.arange(4096)
    out, code = run_and_get_code(compiled, x, torch.tensor(4096))
    assert torch.equal(out, x * 2)
    with pytest.raises(RuntimeError) as e:
        compiled(x, torch.tensor(7))
    assert str(e.value) == MESSAGE
    assert counter.frame_count == 1
    wrapper = "\n".join(code)
    assert "torch.ops.nn_data.device_check.default(" in wrapper  # called from the wrapper, outside the kernels
    assert "std::runtime_error" not in wrapper and "_assert_async" not in wrapper  # no check inside a kernel
    torch._dynamo.reset()


def test_eager_device_assert_raises_the_message_and_reduces_to_one_flag():
    with pytest.raises(RuntimeError, match=r"^nn_data.test: no$"):
        _checks.device_assert(torch.tensor([True, False, True]), "nn_data.test: no")
    _checks.device_assert(torch.ones(2, 3, dtype=torch.bool), "nn_data.test: never")
    _checks.device_assert(torch.zeros(0, dtype=torch.bool), "nn_data.test: never")  # no element: holds


def test_the_checks_of_a_call_are_one_check_naming_the_first_that_failed():
    found = _checks.DeviceChecks()
    found.add(torch.tensor([True, True]), "nn_data.test: first")
    found.add(torch.tensor(False), "nn_data.test: second")
    found.add(torch.tensor(False), "nn_data.test: third")
    with pytest.raises(RuntimeError, match=r"^nn_data.test: second$"):
        found.check()
    _checks.DeviceChecks().check()  # no check: nothing runs


def test_a_device_check_call_runs_one_python_function_of_its_own():
    """``nn_data::device_check`` (what every compiled call with data checks calls once) runs from the
    dispatcher straight into its one kernel: the Python frames of a passing call are the op's ``__call__`` and
    that kernel, nothing of ``torch.library``'s custom-op layers (autograd, redispatch)."""
    frames = []
    flags = torch.tensor([True, True])
    sys.setprofile(lambda frame, event, arg: frames.append(frame.f_code.co_name) if event == "call" else None)
    try:
        torch.ops.nn_data.device_check.default(flags, "nn_data.test: a || nn_data.test: b")
    finally:
        sys.setprofile(None)
    assert frames == ["__call__", "_device_check"], frames
    with pytest.raises(RuntimeError, match=r"^nn_data.test: b$"):
        torch.ops.nn_data.device_check.default(torch.tensor([True, False]), "nn_data.test: a || nn_data.test: b")


@pytest.mark.compile
def test_a_compiled_pack_and_shard_makes_one_device_check_call():
    """Pack + CP shard on the pack's travelling layout (m 4, T 32, C 2: the segments split into 2C by
    configuration): the pack's data checks fold into one call, the shard adds none; the pack's scatter and the
    shard's gather are one generated kernel, at most 4 in all; a failure still names the check that failed
    (the second of the two here: the packed total)."""
    from nn_data import PackSequences, ShardForContextParallel

    pack, shard = PackSequences(4, pad_full_seq_to=32), ShardForContextParallel(2, 1)

    def pack_shard(x, lengths):
        r = pack(x, lengths)
        return shard(r.packed, layout=r.layout)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(pack_shard, fullgraph=True, dynamic=False, backend=counter)
    x = torch.arange(1, 41).view(4, 10)
    lengths = torch.tensor([3, 10, 0, 7])
    out, code = run_and_get_code(compiled, x, lengths)
    assert torch.equal(out, pack_shard(x, lengths))
    call = "\n".join(code).split("def call(self, args)")[1]
    assert call.count("torch.ops.nn_data.device_check.default(") == 1
    kernels = re.findall(r"^\s*(cpp_fused_\w+)\(", call, flags=re.M)
    # the lengths' checks | the cu_seqlens checks | the zigzag pieces | one pass over the tokens that packs and shards
    assert len(kernels) <= 4, kernels
    assert [k for k in kernels if "index_put" in k and "index_select" in k], kernels  # pack and shard fused
    with pytest.raises(RuntimeError, match=r"every seq_lengths value must be in \[0, S\]"):
        compiled(x, torch.tensor([3, 11, 0, 7]))
    with pytest.raises(RuntimeError, match=r"the packed total sum\(round_up\(seq_lengths, m\)\) exceeds "
                                           r"pad_full_seq_to=32"):
        compiled(x, torch.tensor([10, 10, 10, 10]))  # 4 * 12 = 48 > 32
    assert counter.frame_count == 1
    torch._dynamo.reset()


@pytest.mark.compile
def test_a_compiled_packing_side_without_cp_scans_the_packed_positions_twice():
    """``PackedForward(compile_packing=True)`` without CP: the packing side's graph makes one device check and two
    scans over the ``T`` packed positions (a scatter of marks, then a cumsum: the segment ids, and the pack's
    source map), the segment ids of ``PackedInfo`` being this rank's places' own (every position, in order) rather
    than a second scan; the same segment ids as the eager wrapper; no sync and no new graph on the next call."""
    from nn_data.diagnostics import HostSyncCounter
    from nn_data.packed_forward import PackedForward

    seen = []

    def probe(input_ids, position_ids, packed):
        seen.append(packed.segment_ids)
        return input_ids.unsqueeze(-1).float()  # [1, T, 1]

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = PackedForward(probe, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=64, row_capacity=4,
                             compile_packing=True, compile_kwargs={"backend": counter}, verify=False)
    ids, lengths = torch.arange(1, 49).view(4, 12), torch.tensor([5, 8, 12, 3])
    out, code = run_and_get_code(compiled, ids, lengths)
    eager = PackedForward(probe, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=64, verify=False)
    assert torch.equal(out, eager(ids, lengths)) and torch.equal(seen[0], seen[1])
    packing = code[0].split("def call(self, args)")[1]
    assert packing.count("torch.ops.nn_data.device_check.default(") == 1
    scatters = re.findall(r"^\s*aten\.scatter_reduce_", packing, flags=re.M)
    scans = re.findall(r"torch\.ops\.aten\.cumsum\.default\(reinterpret_tensor", packing)  # over T; not the [R] lengths'
    assert len(scatters) <= 2 and len(scans) <= 2, (scatters, scans)
    with HostSyncCounter() as syncs:
        compiled(ids, lengths)
    assert syncs.count == 0 and counter.frame_count == 2  # the packing and the unpacking side, once each
    torch._dynamo.reset()


_THREADS = r'''
import torch
from nn_data.packed_forward import PackedForward

def probe(input_ids, position_ids, packed):
    return torch.stack([input_ids, position_ids], dim=-1).float()  # [1, T, 2]

def caught(call):
    try:
        call()
    except RuntimeError as e:
        return str(e)
    return "no error"

ids = torch.arange(1, 49).view(4, 12)
ids[1, :2] = ids[0, :2]
lengths, groups = torch.tensor([5, 8, 12, 3]), torch.tensor([0, 0, 1, 2])
shared = PackedForward(probe, pad_full_seq_to=64, compile_packing=True)
plain = PackedForward(probe, pad_full_seq_to=64, compile_packing=True)
for threads in (2, 4):
    torch.set_num_threads(threads)
    if threads == 2:  # a good call first: the unpacking side compiles too
        out = shared(ids, lengths, prefix_lengths=torch.tensor([2, 2, 4, 1]), group_ids=groups)
        assert torch.equal(out[..., 0], torch.where(torch.arange(12) < lengths[:, None], ids, 0))
    print(threads, "prefix:", caught(lambda: shared(ids, lengths, prefix_lengths=torch.tensor([2, 2, 13, 1]),
                                                    group_ids=groups)))
    other = ids.clone()
    other[1, 1] += 1  # rollout 1's prompt differs from its group's first rollout's
    print(threads, "prompt:", caught(lambda: shared(other, lengths, prefix_lengths=torch.tensor([2, 2, 4, 1]),
                                                    group_ids=groups)))
print(4, "lengths:", caught(lambda: plain(ids, torch.tensor([5, 8, 13, 3]))))
print("alive")
'''


@pytest.mark.compile
def test_a_failed_check_in_a_compiled_packed_forward_is_a_catchable_error_with_2_and_4_threads():
    """In a subprocess (a failure there would end that process, not the suite's): a prefix length past its
    rollout and a prompt that differs within its group, with 2 and then 4 threads (a recompile: inductor's
    kernels are built for the thread count), and a length past the row with 4."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", _THREADS], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    lines = run.stdout.splitlines()
    prefix = "nn_data.shared_prefix_layout: every prefix_lengths value must be in [0, seq_lengths[b]]"
    lengths = "every seq_lengths value must be in [0, S]"
    prompt = ("nn_data.shared_prefix_layout: the rollouts of one group (equal group_ids) must share their prompt "
              "tokens input_ids[b, :prefix_lengths[b]]")
    for threads in (2, 4):
        assert f"{threads} prefix: {prefix}" in lines and f"{threads} prompt: {prompt}" in lines, run.stdout
    assert any(line.startswith("4 lengths: ") and lengths in line for line in lines), run.stdout
    assert lines[-1] == "alive"
