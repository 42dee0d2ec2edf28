"""Old path of :mod:`nn_data.masks` (the document mask the adapters use), kept importable:
``nn_data.models.masks`` *is* that module (one object under both names)."""

from nn_data._alias import alias_module

alias_module(__name__, "nn_data.masks")
