"""The profiler (profiling/profile_microbatches.py) end to end with tiny sizes, and its argument errors."""
