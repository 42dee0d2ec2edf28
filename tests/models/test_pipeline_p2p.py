"""Tier: pure CPU, one process.

The pipeline step refuses the one configuration measured to give silently wrong results on gloo: the
interleaved schedule with batched point-to-point sends (docs/pipeline.md).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nn_data import PackingError
from nn_data.adapters.megatron_pipeline import check_p2p_config


def test_interleaved_batched_p2p_over_gloo_is_refused_naming_the_fix():
    config = SimpleNamespace(virtual_pipeline_model_parallel_size=2, batch_p2p_comm=True)
    with pytest.raises(PackingError, match=r"batch_p2p_comm=True gives wrong losses and gradients over gloo .*set "
                                           r"config.batch_p2p_comm=False"):
        check_p2p_config(config, "gloo")


@pytest.mark.parametrize("vpp, batched, backend", [(2, False, "gloo"), (None, True, "gloo"), (1, True, "gloo"),
                                                  (2, True, "nccl"), (2, True, None)])
def test_every_other_configuration_passes(vpp, batched, backend):
    check_p2p_config(SimpleNamespace(virtual_pipeline_model_parallel_size=vpp, batch_p2p_comm=batched), backend)
    check_p2p_config(None, backend)
