"""The GPU check (``python -m profiling.gpu_check``, ``bash scripts/gpu_check.sh``): the CUDA test
tier, the op benchmark and the main job on one CUDA GPU, a PASS/FAIL line per check.

``run`` (flags, the steps, the summary), ``checks`` (how each step's output is judged), ``plugin``
(the pytest plugin that records each CUDA test's outcome)."""
