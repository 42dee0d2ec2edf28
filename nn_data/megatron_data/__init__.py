"""Old path of :mod:`nn_data.nemo_rl.megatron_data` (NeMo-RL's ``nemo_rl.models.megatron.data``), kept
importable: ``nn_data.megatron_data`` *is* that module (one object under both names)."""

from nn_data._alias import alias_module

alias_module(__name__, "nn_data.nemo_rl.megatron_data")
