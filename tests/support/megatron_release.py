"""Which megatron-core release the tests run against, and the skip for tests that build megatron-core models.

Models (``GPTModel``, the pipeline schedules) need nn_data's CPU patches on a torch without CUDA;
the patches refuse a release they were not tested on (``nn_data.adapters._megatron_cpu``). Tests
that build models are then skipped with that refusal as the reason, never failed. Reading the
version does not import megatron-core.
"""

from __future__ import annotations

import pytest

from nn_data.adapters import _megatron_cpu

#: None where megatron-core models can run here, else why not (the patches' own message).
MODELS_UNSUPPORTED = _megatron_cpu.unsupported_reason()

needs_megatron_models = pytest.mark.skipif(MODELS_UNSUPPORTED is not None, reason=str(MODELS_UNSUPPORTED))
