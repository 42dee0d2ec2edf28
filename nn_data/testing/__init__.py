"""Testing helpers shipped with nn_data for its tests, benchmarks and users' own tests, not part of the ops:
``reference`` (loop versions of the ops, the oracle), ``coded`` (batches whose every token carries a unique
code), ``dist`` (a free port and a gloo process group on 127.0.0.1)."""
