"""Which megatron-core release the tests run against, and the skip for tests that build megatron-core models.

Models (``GPTModel``, the pipeline schedules) need nn_data's CPU patches on a torch without CUDA;
the patches refuse a release they were not tested on (``nn_data.adapters._megatron_cpu``). Tests
that build models are then skipped with that refusal as the reason, never failed. Reading the
version does not import megatron-core.
"""

from __future__ import annotations

import contextlib

import pytest

from nn_data.adapters import _megatron_cpu

#: None where megatron-core models can run here, else why not (the patches' own message).
MODELS_UNSUPPORTED = _megatron_cpu.unsupported_reason()

needs_megatron_models = pytest.mark.skipif(MODELS_UNSUPPORTED is not None, reason=str(MODELS_UNSUPPORTED))


@contextlib.contextmanager
def one_rank_parallel_state():
    """megatron-core's ``parallel_state`` over one gloo rank (every parallel size 1) for the duration of
    the block, torn down afterwards: what a test that builds a tiny ``GPTModel`` in this process needs."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from nn_data.testing.dist import destroy_model_parallel_groups, free_port, init_gloo

    init_gloo(0, 1, free_port())
    try:
        parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
        yield parallel_state
    finally:
        destroy_model_parallel_groups(parallel_state)
        dist.destroy_process_group()
