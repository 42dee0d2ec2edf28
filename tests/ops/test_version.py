"""Tier: pure CPU (package metadata; imports nothing heavy).

``nn_data.__version__`` is the installed distribution's version, read from the package metadata
(pyproject.toml's ``version`` once pip installed it), with a PEP 440 fallback for a source tree pip
never installed.
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import nn_data
from nn_data._version import UNKNOWN, package_version

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_installed_metadata_and_pyprojects_version():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert nn_data.__version__ == metadata.version("nn_data") == declared
    assert "__version__" in nn_data.__all__


def test_a_distribution_that_is_not_installed_gets_the_fallback():
    assert package_version("nn-data-not-installed-anywhere") == UNKNOWN == "0+unknown"
    assert re.fullmatch(r"\d+(\+[a-z0-9.]+)?", UNKNOWN)  # a valid PEP 440 version, sorts below every release


def test_the_license_is_an_spdx_string():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert metadata.metadata("nn_data")["License-Expression"] == "Apache-2.0"
