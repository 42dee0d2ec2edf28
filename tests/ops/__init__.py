"""Single-process CPU tests of the core ops: pack, shard, unshard, unpack, targets, log-probs, PackedForward."""
