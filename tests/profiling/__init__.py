"""The profiler (profiling/microbatches/run.py) end to end with tiny sizes, and its argument errors."""
