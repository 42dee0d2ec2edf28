"""Tier: pure CPU, single process. The DeviceMesh forms over gloo: tests/multiprocess/test_groups_multiprocess.py.

nn_data.groups in one process without torch.distributed: None is a single rank, every other form
needs torch.distributed, and what is not a group form is named in the error.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nn_data.errors import PackingError
from nn_data.groups import (
    SINGLE,
    as_process_group,
    collection_group,
    context_parallel_info,
    group_info,
    is_group_form,
    tensor_parallel_info,
)


def test_none_is_a_single_rank():
    assert group_info(None) == SINGLE == (0, 1, None) and as_process_group(None) is None
    assert context_parallel_info() == SINGLE and tensor_parallel_info() == SINGLE
    assert not is_group_form(None) and not is_group_form("cp") and not is_group_form((1, 2))


def test_a_group_without_torch_distributed_is_refused():
    with pytest.raises(PackingError, match=r"a context-parallel group was given but torch.distributed is not "
                                           r"initialised"):
        group_info(object(), "context-parallel group")


def test_what_is_not_a_group_is_named():
    with pytest.raises(PackingError, match=r"cp_group is a str; pass a torch.distributed ProcessGroup, a 1-D "
                                           r"DeviceMesh, a \(DeviceMesh, dim\) pair, or None \(not split\)"):
        as_process_group("cp", "cp_group")
    with pytest.raises(PackingError, match=r"cp_group is a tuple"):
        as_process_group(("mesh", "cp"), "cp_group")


def test_a_collection_without_the_field_is_refused():
    assert collection_group(None, "cp") is None and collection_group(SimpleNamespace(cp=None), "cp") is None
    with pytest.raises(PackingError, match=r"pg_collection \(SimpleNamespace\) has no 'tp' group; build it with one "
                                           r"\(ProcessGroupCollection\(\.\.\., tp=group\)\)"):
        tensor_parallel_info(pg_collection=SimpleNamespace(cp=None))
