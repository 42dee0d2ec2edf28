"""Three tools, not part of the installed package: ``profiling.microbatches`` (the main job),
``profiling.bench`` (the benchmarks) and ``profiling.gpu_check`` (the GPU check); their shared
code at the top (``profiling.timing``: the one timer). profiling/README.md explains them; their
dated figures are in profiling/results/, one page per subject."""

import os

# torch 2.13's profiler backend (kineto) prints a "USDT: ... profiler_start" / "profiler_stop" line
# on stderr for every torch.profiler session, which buries the tools' own output. Level 6 silences
# kineto's native log; it is read at each session, and a value already set in the environment wins.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
