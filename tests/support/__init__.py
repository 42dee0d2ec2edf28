"""Helpers shared by the tests: the spawned-rank pool, the cases its ranks run, megatron-core configs."""
