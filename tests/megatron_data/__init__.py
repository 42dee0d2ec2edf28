"""Single-process CPU tests of the NeMo-RL-compatible layer (nn_data.nemo_rl.megatron_data) and nn_data.megatron_parallel."""
