"""Single-process CPU tests of the NeMo-RL-compatible layer (nn_data.megatron_data) and nn_data.megatron_parallel."""
