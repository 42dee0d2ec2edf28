"""Every test in this folder spawns ranks over gloo: mark it ``multiprocess`` (deselect with -m "not multiprocess")."""

from __future__ import annotations

import pathlib

import pytest

_HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.multiprocess)
