"""Single-process CPU tests of the core ops (nn_data): pack, shard, unshard, unpack, targets, log-probs, PackedForward."""
