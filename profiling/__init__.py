"""Benchmarks and the eager-vs-compiled profiling suite (not part of the installed package)."""
