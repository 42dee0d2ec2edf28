"""Published import paths kept for modules that moved (``docs/design.md``, "Where things live").

:data:`OLD_PATHS` is the one table of the old module paths (0.1.x, and 0.2's renamed modules) and their
homes, :data:`OLD_NAMES` that of the 0.1.x attributes whose home moved (CHANGELOG.md, "One home for the
NeMo-RL drop-in", "One name per module"). An old path has no file of its own. Each old path
is the *same module object* as its home, for the package and every submodule below it, imported yet or
not: :class:`AliasFinder` (first on ``sys.meta_path``) maps ``old.sub`` to ``new.sub`` before Python's
path finder could load ``new``'s file a second time under the old name. So
``mock.patch("nn_data.megatron_data.dynamic_cp.X")`` patches what the functions call, and every class is
one class under both names.

Example: ``import nn_data.megatron_data.dynamic_cp`` -> ``nn_data.nemo_rl.megatron_data.dynamic_cp`` (the longest
old prefix, ``nn_data.megatron_data``, replaced by its home), itself an old path: the module
``nn_data.nemo_rl.megatron_data.dynamic_cp_iterator``;
``nn_data.megatron_data.batched_data_sharding`` -> ``nn_data.nemo_rl.batched_data_sharding`` (its own row).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Optional

#: Every earlier module path that still works (0.1.x, and 0.2.0's before the log-prob code moved into
#: :mod:`nn_data.logprobs`) -> the module it is now.
OLD_PATHS = {
    "nn_data.megatron_data": "nn_data.nemo_rl.megatron_data",
    "nn_data.megatron_data.batched_data_sharding": "nn_data.nemo_rl.batched_data_sharding",
    "nn_data.model_utils": "nn_data.nemo_rl.model_utils",
    "nn_data.batched_data_dict": "nn_data.nemo_rl.batched_data_dict",
    "nn_data.automodel_data": "nn_data.nemo_rl.automodel_data",
    "nn_data.huggingface_common": "nn_data.nemo_rl.huggingface_common",
    "nn_data.models.masks": "nn_data.masks",
    "nn_data.lm_head": "nn_data.logprobs.from_hidden",
    "nn_data.linear_logprob": "nn_data.logprobs.kernels",
    "nn_data.sampling": "nn_data.logprobs.filters",
    "nn_data.shared_prefix_logprobs": "nn_data.logprobs.from_shared_prefix",
    # 0.2: no module basename means two things (CHANGELOG.md, "One name per module")
    "nn_data.nemo_rl.megatron_data.pack": "nn_data.nemo_rl.megatron_data.pack_helpers",
    "nn_data.nemo_rl.megatron_data.dynamic_cp": "nn_data.nemo_rl.megatron_data.dynamic_cp_iterator",
    "nn_data.dynamic_cp.groups": "nn_data.dynamic_cp.block_groups",
    "nn_data.planning.dynamic_cp": "nn_data.planning.dynamic_cp_plan",
    "nn_data.planning.shared_prefix": "nn_data.planning.shared_prefix_plan",
    "nn_data.layout.shared_prefix": "nn_data.layout.prefix_layout",
}

#: Every earlier attribute that still works where its module stayed -> the object's home.
OLD_NAMES = {
    "nn_data.sampling.TrainingSamplingParams": "nn_data.nemo_rl.sampling.TrainingSamplingParams",
    "nn_data.logprobs.target_columns": "nn_data.logprobs.kernels.target_columns",
    "nn_data.logprobs.chunk_lse_and_target": "nn_data.logprobs.kernels.chunk_lse_and_target",
    "nn_data.logprobs.combine_vocab_parallel": "nn_data.logprobs.kernels.combine_vocab_parallel",
    "nn_data.logprobs.chunk_logit_grad": "nn_data.logprobs.kernels.chunk_logit_grad",
    "nn_data.logprobs.resolve_seq_len": "nn_data.logprobs.from_logits.resolve_seq_len",
    "nn_data.logprobs.check_full_ids": "nn_data.logprobs.from_logits.check_full_ids",
    "nn_data.logprobs.targets_on_rank": "nn_data.logprobs.from_logits.targets_on_rank",
    "nn_data.logprobs.rows_from_local": "nn_data.logprobs.from_logits.rows_from_local",
    "nn_data.logprobs.logprob_layout": "nn_data.logprobs.from_logits.logprob_layout",
}


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
    where, _, attr = home.rpartition(".")
    return getattr(importlib.import_module(where), attr)


_install()
