"""Hypothesis profiles: deterministic by default, a long random exploration on request.

* ``ci`` (the default: CI and the README's test command): ``derandomize=True`` (every property
  test draws the same examples on every machine and every run), no example database (nothing is
  read from or written to ``.hypothesis/``), no deadline (the 2-core machines are shared).
* ``explore``: random draws (a new seed per run, printed with a failure together with
  ``@reproduce_failure``), and every test's example count times ``NN_DATA_HYPOTHESIS_SCALE``
  (default 20). Still no database. Select it with ``NN_DATA_HYPOTHESIS_PROFILE=explore``.

Tests take their example counts from :func:`examples`, so the explore profile scales them.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_ENV = "NN_DATA_HYPOTHESIS_PROFILE"
SCALE_ENV = "NN_DATA_HYPOTHESIS_SCALE"
PROFILES = ("ci", "explore")

settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", derandomize=False, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])


def profile_name() -> str:
    """The profile ``NN_DATA_HYPOTHESIS_PROFILE`` selects (``ci`` when unset)."""
    name = os.environ.get(PROFILE_ENV, "ci")
    if name not in PROFILES:
        raise ValueError(f"{PROFILE_ENV}={name!r} is invalid; expected one of {PROFILES}")
    return name


def load() -> str:
    """Load the selected profile as hypothesis's default (conftest.py does, before any test module)."""
    name = profile_name()
    settings.load_profile(name)
    return name


def examples(count: int) -> int:
    """A test's example count: ``count`` under ``ci``, ``count * NN_DATA_HYPOTHESIS_SCALE`` under ``explore``."""
    if profile_name() == "ci":
        return count
    return count * int(os.environ.get(SCALE_ENV, "20"))
