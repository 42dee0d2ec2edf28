"""The one home of 0.1.x compatibility: :data:`MOVED`, every released name that moved -> its home, and the stubs
that keep each old name working with one ``DeprecationWarning`` per old name and process (attributed to the
caller's line). A row's old name is one of four kinds, told by its spelling:

* ``nn_data.model_utils``, a module path: it and every submodule below it import as the *very module* of its
  home (:class:`AliasFinder`, first on ``sys.meta_path``), so ``mock.patch`` on the old path patches what the
  functions call. Example: ``import nn_data.megatron_data.iterators`` -> ``nn_data.nemo_rl.megatron_data.iterators``.
* ``module:Name``, an attribute of a module that stayed: the module sets ``__getattr__ = moved_attribute(__name__)``.
* ``module:Class.method``, a renamed method: the class sets ``method = renamed_method("module:Class.method")``.
* ``module:function(keyword=)``, a renamed keyword: the function calls :func:`warn_moved` when it is given."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from typing import Callable, Optional

#: Every 0.1.x name that moved -> its home (the module docstring says how each kind is spelled and served).
MOVED = {
    "nn_data.megatron_data": "nn_data.nemo_rl.megatron_data",
    "nn_data.megatron_data.pack": "nn_data.nemo_rl.megatron_data.pack_helpers",
    "nn_data.megatron_data.batched_data_sharding": "nn_data.nemo_rl.batched_data_sharding",
    "nn_data.model_utils": "nn_data.nemo_rl.model_utils",
    "nn_data.batched_data_dict": "nn_data.nemo_rl.batched_data_dict",
    "nn_data.models.masks": "nn_data.masks",
    "nn_data.sampling": "nn_data.logprobs.filters",
    "nn_data.sampling:TrainingSamplingParams": "nn_data.nemo_rl.sampling:TrainingSamplingParams",
    "nn_data.planning:ParallelLayout": "nn_data.planning:Parallelism",
    "nn_data.planning:Parallelism.check_packed_length": "nn_data.planning:Parallelism.check_fixed_total",
    "nn_data.planning:Parallelism.round_packed_length": "nn_data.planning:Parallelism.round_fixed_total",
    "nn_data.megatron_parallel:make_packed_seq_params(packed_length=)":
        "nn_data.megatron_parallel:make_packed_seq_params(total=)",
    **{f"nn_data.megatron_parallel:{name}": f"nn_data.groups:{name}" for name in (
        "ParallelInfo", "SINGLE", "group_info", "context_parallel_info", "tensor_parallel_info", "megatron_state")},
}

#: The module paths among :data:`MOVED` (no ``:`` in the old name).
MODULE_PATHS = {old: new for old, new in MOVED.items() if ":" not in old}

_WARNED: set = set()


def _dotted(name: str) -> str:
    return name.replace(":", ".")


def warn_moved(old: str) -> None:
    """One ``DeprecationWarning`` per process for the row ``old`` of :data:`MOVED`, at the caller's line."""
    if old not in _WARNED:
        _WARNED.add(old)
        home = _dotted(MOVED[old])
        warnings.warn(f"{_dotted(old)} is the 0.1.x name of {home}; use {home} (CHANGELOG.md)", DeprecationWarning,
                      stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame above :func:`warn_moved` that is neither nn_data's nor importlib's."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(2), 2
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:  # not counted: warnings skips these frames itself
            frame = frame.f_back
            continue
        if not os.path.abspath(name).startswith(package + os.sep) and "importlib" not in name:
            return level
        frame, level = frame.f_back, level + 1
    return 2


def moved_attribute(module: str) -> Callable[[str], object]:
    """The ``__getattr__`` of ``module``: its rows ``module:Name`` of :data:`MOVED`, as the home's object."""

    def __getattr__(name: str):
        old = f"{module}:{name}"
        if old not in MOVED:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_moved(old)
        where, _, attr = MOVED[old].partition(":")
        return getattr(importlib.import_module(where), attr)

    return __getattr__


def renamed_method(old: str) -> Callable:
    """The stub of the renamed method ``old`` (``module:Class.method``): it warns and calls the new method."""
    new = MOVED[old].rpartition(".")[2]

    def stub(self, *args, **kwargs):
        warn_moved(old)
        return getattr(self, new)(*args, **kwargs)

    stub.__name__, stub.__doc__ = old.rpartition(".")[2], f"The 0.1.x name of :meth:`{new}` (warns once)."
    return stub


def home_of(name: str) -> Optional[str]:
    """The home of the module path ``name`` (its longest old prefix replaced, until no old prefix is left), or
    None if it is no old path."""
    home = None
    while True:
        old = _row(name)
        if old is None:
            return home
        name = home = MODULE_PATHS[old] + name[len(old):]


def _row(name: str) -> Optional[str]:
    """The longest old module path that ``name`` is or lies below, None if none."""
    rows = [old for old in MODULE_PATHS if name == old or name.startswith(old + ".")]
    return max(rows, key=len) if rows else None


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as its home: the module Python registers under the old name is the home's."""

    def __init__(self, home: str):
        self.home = home

    def create_module(self, spec):
        return None  # a placeholder; exec_module replaces it in sys.modules, which the import returns

    def exec_module(self, module) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.home)


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds every old module path (and anything below one) as its home (:func:`home_of`)."""

    def find_spec(self, fullname, path=None, target=None):
        home = home_of(fullname)
        if home is None or not _exists(home):  # no such home: Python's own "No module named <old>"
            return None
        warn_moved(_row(fullname))
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(home), is_package=False)


def _exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent of it is missing
        return False


if not any(isinstance(finder, AliasFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, AliasFinder())
