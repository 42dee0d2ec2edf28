"""Published import paths kept for the drop-in's old homes (``docs/design.md``, "Where things live").

``nn_data.megatron_data``, ``nn_data.model_utils`` and ``nn_data.batched_data_dict`` were the drop-in's
homes before it moved into :mod:`nn_data.nemo_rl`. Each old path is the *same module object* as the new
one, so ``mock.patch("nn_data.megatron_data.X")`` patches what the functions call, and every class
is one class under both names.
"""

from __future__ import annotations

import importlib
import sys


def alias_module(old: str, new: str) -> None:
    """Make ``old`` (and every submodule of ``new`` imported so far) the module object ``new`` is."""
    importlib.import_module(new)
    for name, module in list(sys.modules.items()):
        if name == new or name.startswith(new + "."):
            sys.modules[old + name[len(new):]] = module
