"""The one error class nn_data raises for bad configuration or bad input."""

from __future__ import annotations

from typing import Optional


class PackingError(ValueError):
    """Bad configuration or input for an nn_data op: the message names the argument, the value it had and what would
    be valid; ``argument`` is that argument's name where a caller may spell it differently (the NeMo-RL drop-in
    renames ``pad_full_seq_to`` by it, and raises its ``AssertionError`` subclass), else None.

    Example: ``PackSequences(0)`` raises ``PackingError("pad_individual_seqs_to_multiple_of=0 is invalid;
    expected an int >= 1", argument="pad_individual_seqs_to_multiple_of")``."""

    def __init__(self, *args, argument: Optional[str] = None):
        ValueError.__init__(self, *args)  # not super(): torch.compile traces this where an op raises
        self.argument = argument
