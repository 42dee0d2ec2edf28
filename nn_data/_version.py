"""The installed distribution's version, for ``nn_data.__version__``."""

from __future__ import annotations

from importlib import metadata

UNKNOWN = "0+unknown"  # a source tree on sys.path that pip never installed (PEP 440 local version)


def package_version(distribution: str = "nn_data") -> str:
    """``distribution``'s version from the installed package metadata (pyproject.toml's ``version``
    once pip installed it, editable or not), else :data:`UNKNOWN`."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return UNKNOWN
