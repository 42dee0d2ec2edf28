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


JOBS = ("constraints.txt", "constraints-nemo-rl.txt", "constraints-newest.txt")  # scripts/setup_env.sh's jobs
JOB_PYTHONS = ("3.11", "3.13", "3.12")  # their Pythons, in the same order


def test_each_range_allows_what_ci_tests_from_the_oldest_and_no_newer_minor_release():
    """``pip install "nn_data[hf,megatron]"`` resolves to releases CI tests: torch, transformers (``[hf]``) and
    megatron-core (``[megatron]``) each admit every pin of the CI jobs (constraints.txt, constraints-nemo-rl.txt,
    constraints-newest.txt), no release older than the oldest pin's minor series, nor the next minor release
    after the newest pin; ``requires-python`` likewise admits the jobs' Pythons and nothing older."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    for extra in ("hf", "megatron"):
        requirements += [Requirement(r) for r in project["optional-dependencies"][extra]]
    jobs = [_pins(ROOT / name) for name in JOBS]
    for name in ("torch", "transformers", "megatron-core"):
        (spec,) = [r.specifier for r in requirements if r.name == name]
        tested = sorted({Version(job[name]) for job in jobs})
        oldest, newest = tested[0], tested[-1]
        assert all(v in spec for v in tested), (name, str(spec), tested)
        assert Version(f"{newest.major}.{newest.minor + 1}.0") not in spec, (name, str(spec), newest)
        assert oldest.minor == 0 or Version(f"{oldest.major}.{oldest.minor - 1}.99") not in spec, (name, str(spec))
    pythons = sorted(Version(v) for v in JOB_PYTHONS)
    python_spec = SpecifierSet(project["requires-python"])
    assert all(Version(f"{v}.0") in python_spec for v in pythons), (str(python_spec), pythons)
    assert Version(f"{pythons[0].major}.{pythons[0].minor - 1}.99") not in python_spec, str(python_spec)


def test_the_job_table_names_each_constraints_file_and_python():
    """The Pythons above are the set-up script's: each job's line names its constraints file and Python."""
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    for constraints, python in zip(JOBS, JOB_PYTHONS):
        assert re.search(rf"job_python={re.escape(python)} job_venv=\S+ job_constraints={re.escape(constraints)} ",
                         setup), (constraints, python)


def test_the_license_file_is_the_one_the_metadata_names():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
