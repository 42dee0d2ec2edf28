"""Three tools, not part of the installed package: ``profiling.microbatches`` (the main job),
``profiling.bench`` (the benchmarks) and ``profiling.gpu_check`` (the GPU check); their shared
code at the top (``profiling.timing``: the one timer; ``profiling.cuda_counters``: sync and
CUDA-graph counters for the benchmarks and the CUDA tests). profiling/README.md."""
