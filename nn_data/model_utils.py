"""Old path of :mod:`nn_data.nemo_rl.model_utils` (NeMo-RL's ``nemo_rl.distributed.model_utils``), kept
importable: ``nn_data.model_utils`` *is* that module (one object under both names)."""

from nn_data._alias import alias_module

alias_module(__name__, "nn_data.nemo_rl.model_utils")
