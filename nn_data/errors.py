"""The one error class nn_data raises for bad configuration or bad input."""

from __future__ import annotations


class PackingError(ValueError, AssertionError):
    """Bad configuration or input for an nn_data op.

    It derives from both ``ValueError`` (what a bad argument is) and
    ``AssertionError`` (what NeMo-RL raises for the same mistakes with bare
    ``assert`` statements), so code written against NeMo-RL that catches
    ``AssertionError`` keeps working while the message says more: the argument,
    the value it had and what would be valid.
    """
