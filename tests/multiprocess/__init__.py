"""CPU multi-process tests: spawned ranks over gloo on 127.0.0.1 (marked ``multiprocess`` by this folder's conftest)."""
