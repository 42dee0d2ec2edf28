"""``python -m profiling.gpu_check [flags]``: the GPU check (``--help`` lists the flags)."""

import sys

from profiling.gpu_check.run import main

sys.exit(main())
