"""The drop-in's error class and its edge: NeMo-RL checks its inputs with bare ``assert`` statements, so code
written against it catches ``AssertionError``; nn_data's core raises :class:`~nn_data.errors.PackingError`, a
``ValueError`` only. The drop-in raises :class:`PackingAssertionError` (both) and translates the core's errors
where they leave it (:func:`at_the_edge`), so the core knows nothing of NeMo-RL's habit.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable

from nn_data import PackingError


class PackingAssertionError(PackingError, AssertionError):
    """A :class:`~nn_data.errors.PackingError` that is also an ``AssertionError``, as NeMo-RL's asserts are.

    Example: ``process_microbatch(data, "lens", pack_sequences=True)`` without ``data["lens"]`` raises
    ``PackingAssertionError("lens not found in data_dict (keys: ['input_ids']) ...")``."""


def at_the_edge(fn: Callable) -> Callable:
    """``fn``, raising :class:`PackingAssertionError` where the core raises a plain :class:`~nn_data.errors.PackingError`
    (same message, the core's error chained as its cause)."""
    if getattr(fn, "at_the_edge", False):
        return fn

    @functools.wraps(fn)
    def translated(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PackingAssertionError:
            raise
        except PackingError as error:
            raise PackingAssertionError.about(error.argument, *error.args) from error

    translated.at_the_edge = True
    return translated


def translate_errors(namespace: dict) -> None:
    """Put every function a drop-in module exports (the names of its ``__all__``) behind :func:`at_the_edge`,
    in place: called once at the end of each such module (``translate_errors(globals())``)."""
    for name in namespace["__all__"]:
        if inspect.isfunction(namespace.get(name)):
            namespace[name] = at_the_edge(namespace[name])


@contextlib.contextmanager
def spelled(name: str):
    """Inside, the core's errors about ``pad_full_seq_to`` name it ``name`` instead, and leave as
    :class:`PackingAssertionError`.

    Example: ``with spelled("pad_packed_seq_to"):`` a core ``"... exceeds pad_full_seq_to=16; ..."`` leaves as
    ``"... exceeds pad_packed_seq_to=16; ..."``."""
    try:
        yield
    except PackingError as error:
        if name == "pad_full_seq_to":
            raise
        if error.argument != "pad_full_seq_to":
            raise PackingAssertionError.about(error.argument, *error.args) from error
        raise PackingAssertionError.about(name, str(error).replace("pad_full_seq_to", name)) from error
