"""The one error class nn_data raises for bad configuration or bad input."""

from __future__ import annotations

from typing import Optional


class PackingError(ValueError):
    """Bad configuration or input for an nn_data op: the message names the argument, the value it had and what would
    be valid; ``argument`` is that argument's name where a caller may spell it differently (the NeMo-RL drop-in
    renames ``pad_full_seq_to`` by it, and raises its ``AssertionError`` subclass), else None.

    The class has no ``__init__`` of its own (torch.compile traces the raise of a plain exception subclass on every
    supported torch release and keeps its message); :meth:`about` builds one that names its argument.

    Example: ``PackSequences(0)`` raises ``PackingError.about("pad_individual_seqs_to_multiple_of",
    "pad_individual_seqs_to_multiple_of=0 is invalid; expected an int >= 1")``."""

    argument: Optional[str] = None

    @classmethod
    def about(cls, argument: Optional[str], *args) -> "PackingError":
        """The error with message ``args`` about the argument named ``argument``."""
        error = cls(*args)
        error.argument = argument
        return error
