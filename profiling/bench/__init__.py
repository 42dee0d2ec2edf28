"""The benchmarks, one subject each, run as ``python -m profiling.bench.bench_<subject>``
(``--help`` lists each one's flags; profiling/README.md explains them, profiling/results/ has their figures). Every one that times
anything uses the shared timer, ``profiling.timing``."""
