"""The 0.1.x import paths of modules that moved (CHANGELOG.md, "One home for the NeMo-RL drop-in"), kept
working with a ``DeprecationWarning`` once per old path.

:data:`OLD_PATHS` is the one table of the released (0.1.x) module paths and their homes, :data:`OLD_NAMES`
that of the 0.1.x attributes whose home moved. Names that only ever existed between releases have no alias.
An old path has no file of its own. Each old path is the *same module object* as its home, for the package
and every submodule below it, imported yet or not: :class:`AliasFinder` (first on ``sys.meta_path``) maps
``old.sub`` to ``new.sub`` before Python's path finder could load ``new``'s file a second time under the old
name. So ``mock.patch("nn_data.megatron_data.X")`` patches what the functions call, and every class is one
class under both names. The first import through an old path (or the first use of an old name) warns.

Example: ``import nn_data.megatron_data.iterators`` -> ``nn_data.nemo_rl.megatron_data.iterators`` (the longest
old prefix, ``nn_data.megatron_data``, replaced by its home), warning once that ``nn_data.megatron_data`` is
now ``nn_data.nemo_rl.megatron_data``; ``nn_data.megatron_data.batched_data_sharding`` ->
``nn_data.nemo_rl.batched_data_sharding`` (its own row).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from typing import Optional

#: Every 0.1.x module path that moved -> the module it is now.
OLD_PATHS = {
    "nn_data.megatron_data": "nn_data.nemo_rl.megatron_data",
    "nn_data.megatron_data.pack": "nn_data.nemo_rl.megatron_data.pack_helpers",
    "nn_data.megatron_data.batched_data_sharding": "nn_data.nemo_rl.batched_data_sharding",
    "nn_data.model_utils": "nn_data.nemo_rl.model_utils",
    "nn_data.batched_data_dict": "nn_data.nemo_rl.batched_data_dict",
    "nn_data.models.masks": "nn_data.masks",
    "nn_data.sampling": "nn_data.logprobs.filters",
}

#: Every 0.1.x attribute that moved where its module stayed -> the object's home.
OLD_NAMES = {
    "nn_data.sampling.TrainingSamplingParams": "nn_data.nemo_rl.sampling.TrainingSamplingParams",
}

_WARNED: set = set()


def _warn_once(old: str, home: str) -> None:
    """One ``DeprecationWarning`` per old path or name and process, attributed to the caller's line (the first
    frame outside nn_data and the import machinery, so Python's default filters show it there)."""
    if old not in _WARNED:
        _WARNED.add(old)
        warnings.warn(f"{old} is the 0.1.x path of {home}; import {home} (CHANGELOG.md)", DeprecationWarning,
                      stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame above :func:`_warn_once` that is neither nn_data's nor importlib's."""
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


def home_of(name: str) -> Optional[str]:
    """The home of the module path ``name`` (its longest old prefix replaced, until no old prefix is left),
    or None if it is no old path."""
    home = None
    while True:
        prefixes = [old for old in OLD_PATHS if name == old or name.startswith(old + ".")]
        if not prefixes:
            return home
        old = max(prefixes, key=len)
        name = home = OLD_PATHS[old] + name[len(old):]


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as its home: the module Python registers under the old name is the home's."""

    def __init__(self, home: str):
        self.home = home

    def create_module(self, spec):
        return None  # a placeholder; exec_module replaces it in sys.modules, which the import returns

    def exec_module(self, module) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.home)


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds every old path (and anything below one) as its home (:func:`home_of`)."""

    def find_spec(self, fullname, path=None, target=None):
        home = home_of(fullname)
        if home is None or not _exists(home):  # no such home: Python's own "No module named <old>"
            return None
        row = max((old for old in OLD_PATHS if fullname == old or fullname.startswith(old + ".")), key=len)
        _warn_once(row, OLD_PATHS[row])
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(home), is_package=False)


def _exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent of it is missing
        return False


def _install() -> None:
    if not any(isinstance(finder, AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())


def old_name(module: str, name: str):
    """``module.name`` for an attribute of :data:`OLD_NAMES` (a module's ``__getattr__`` calls this)."""
    home = OLD_NAMES.get(f"{module}.{name}")
    if home is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _warn_once(f"{module}.{name}", home)
    where, _, attr = home.rpartition(".")
    return getattr(importlib.import_module(where), attr)


_install()
