"""``python -m profiling.microbatches [flags]``: the main job (``--help`` lists the flags)."""

from profiling.microbatches.run import main

main()
