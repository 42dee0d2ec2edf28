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


def _pins(path: Path) -> dict:
    return dict(line.split("==") for line in path.read_text().splitlines() if "==" in line and not line.startswith("#"))


def test_each_extra_allows_what_ci_tests_and_no_newer_minor_release():
    """``pip install "nn_data[hf]"`` / ``[megatron]`` resolve to a release CI tests: every pin of the two CI
    jobs (constraints.txt, constraints-mcore019.txt) is inside its extra's range, and the next minor release
    after the newest pin is not (transformers 5.25.0 is out, and untested)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    jobs = [_pins(ROOT / "constraints.txt"), _pins(ROOT / "constraints-mcore019.txt")]
    for extra, name in (("hf", "transformers"), ("megatron", "megatron-core")):
        (spec,) = [Requirement(r).specifier for r in extras[extra] if Requirement(r).name == name]
        tested = sorted({Version(job[name]) for job in jobs})
        assert all(v in spec for v in tested), (name, str(spec), tested)
        newest = tested[-1]
        assert Version(f"{newest.major}.{newest.minor + 1}.0") not in spec, (name, str(spec), newest)


def test_the_license_file_is_the_one_the_metadata_names():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
