"""The one error class nn_data raises for bad configuration or bad input."""

from __future__ import annotations


class PackingError(ValueError):
    """Bad configuration or input for an nn_data op: the message names the argument, the value it had and
    what would be valid.

    Example: ``PackSequences(0)`` raises ``PackingError("pad_individual_seqs_to_multiple_of=0 is invalid;
    expected an int >= 1")``. The NeMo-RL drop-in raises its subclass
    :class:`~nn_data.nemo_rl.assertions.PackingAssertionError`, also an ``AssertionError`` as NeMo-RL's asserts are.
    """
