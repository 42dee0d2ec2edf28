"""Old path of :mod:`nn_data.nemo_rl.batched_data_dict` (NeMo-RL's ``nemo_rl.distributed.batched_data_dict``),
kept importable: ``nn_data.batched_data_dict`` *is* that module (one object under both names)."""

from nn_data._alias import alias_module

alias_module(__name__, "nn_data.nemo_rl.batched_data_dict")
