"""Old-style path of :mod:`nn_data.nemo_rl.automodel_data` (NeMo-RL's ``nemo_rl.models.automodel.data``):
``nn_data.automodel_data`` *is* that module (one object under both names)."""

from nn_data._alias import alias_module

alias_module(__name__, "nn_data.nemo_rl.automodel_data")
