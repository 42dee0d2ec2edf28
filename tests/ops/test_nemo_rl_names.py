"""Tier: pure CPU, one process (imports the NeMo-RL drop-in's modules; runs nothing).

``nn_data.nemo_rl`` declares ``__all__``: the drop-in's modules (NeMo-RL's, by the same names). Every one
of them is importable from it and declares its own ``__all__``, whose names all import; every public
class or function a module defines is in its ``__all__``, unless it is a helper another nn_data module
imports (the package's own use, not a NeMo-RL name).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import nn_data.nemo_rl

ROOT = Path(__file__).resolve().parents[2]


def _imported_elsewhere(module: str) -> set:
    """Names other nn_data modules import ``from module``."""
    names = set()
    for path in (ROOT / "nn_data").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == module:
                names.update(a.name for a in node.names)
    return names


def test_the_drop_in_lists_its_modules():
    assert sorted(nn_data.nemo_rl.__all__) == ["automodel_data", "batched_data_dict", "huggingface_common",
                                               "megatron_data", "model_utils", "sampling"]


@pytest.mark.parametrize("name", sorted(nn_data.nemo_rl.__all__))
def test_every_module_of_the_drop_in_lists_what_users_call(name):
    module = importlib.import_module(f"nn_data.nemo_rl.{name}")
    namespace: dict = {}
    exec(f"from nn_data.nemo_rl import {name} as m", namespace)  # noqa: S102  (the taught path)
    assert namespace["m"] is module
    assert isinstance(module.__all__, list) and len(set(module.__all__)) == len(module.__all__)
    for exported in module.__all__:
        assert hasattr(module, exported), f"{module.__name__}.__all__ names {exported}, which is not there"
    defined = {n for n, v in vars(module).items() if not n.startswith("_") and (inspect.isclass(v) or
               inspect.isfunction(v)) and v.__module__ == module.__name__}
    missing = defined - set(module.__all__) - _imported_elsewhere(module.__name__)
    assert not missing, f"{module.__name__}: public names missing from __all__: {sorted(missing)}"
