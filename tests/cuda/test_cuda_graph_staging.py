"""Tier: GPU-only (marker ``cuda``), skipped without CUDA; ``NN_DATA_CUDA_DRY_RUN=1`` runs the staged path
eagerly on the CPU with tiny sizes (``scripts/gpu_check.sh --dry-run``) and skips the captures ("dry
run: ..."). Timing: profiling/bench/bench_cuda_graph.py (the GPU check's ``graphs`` step).

A CUDA graph of the data path + the tiny model's forward, captured once on a StagedMicrobatch, replays a
stream of microbatches of varying row counts and lengths (an empty one among them): equal to the eager
path on every microbatch, no host sync and no new allocation in the steady state; megatron-core's own
full-iteration CUDA-graph wrapper (``FullCudaGraphWrapper``) over a staged forward step, where it accepts it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from profiling.bench import bench_cuda_graph
from tests.cuda.stream import DEVICE, ON_CUDA, TIER, cuda_only

pytestmark = TIER

SIZES = ["--rows", "64", "--seq-len", "32", "--microbatches", "16"] if ON_CUDA else \
        ["--rows", "6", "--seq-len", "8", "--multiple", "4", "--microbatches", "6"]
TOL = dict(rtol=1e-5, atol=1e-5)  # float32: the same kernels, captured or not


@pytest.fixture(scope="module")
def modes():
    return bench_cuda_graph.Modes(bench_cuda_graph.parse_args(SIZES + ["--device", str(DEVICE)]), DEVICE)


@pytest.fixture(scope="module")
def steady(modes):
    return bench_cuda_graph.steady_state(modes)


def test_the_staged_path_equals_eager_over_the_stream(modes, steady):
    assert steady["max_abs_difference"]["staged"] <= 1e-5, steady
    addresses = modes.stage.addresses()
    for mb in modes.stream:
        modes.staged(mb)
    assert modes.stage.addresses() == addresses


def test_graph_replay_equals_eager_with_no_sync_and_no_allocation(modes, steady):
    cuda_only("capturing and replaying a CUDA graph")
    assert steady["max_abs_difference"]["graph (steady state)"] <= 1e-5, steady
    assert steady["graph_syncs"] == 0, steady["graph_sync_locations"]
    assert steady["graph_new_allocations"] == 0, steady


def _megatron_step(stage, loss_of):
    """A ``forward_step_func`` over dicts of row-padded tensors (what megatron-core's ``StaticBufferLoader``
    keeps at fixed addresses): load them into the stage, run the data path and the model."""
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        stage.load_rows(batch["input_ids"], batch["seq_lengths"], batch["num_rows"]).prepare()
        output = model(stage.input_ids, stage.position_ids, stage.info)  # logits [1, T, V]

        def loss_func(logits):
            loss, tokens = loss_of(logits, stage.targets)
            return loss, tokens, {"loss": loss.detach()}

        return output, loss_func

    return forward_step


def _loss(logits, targets):
    ce = F.cross_entropy(logits[0].float(), targets[0], ignore_index=-100, reduction="sum")
    return ce, (targets != -100).sum().to(torch.int)


def test_megatron_full_cuda_graph_wrapper_replays_a_staged_step():
    """A tiny GPTModel without RoPE (megatron-core's THD rotary embedding reads the boundaries on the host,
    which a capture refuses) through megatron-core's no-pipelining schedule: every step's loss equals the
    eager path's; on a GPU the schedule runs inside ``FullCudaGraphWrapper`` (capture on the second step,
    replays after); if the wrapper refuses the capture, the test is marked a known failure with why."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state
            from megatron.core.pipeline_parallel import get_forward_backward_func
    except ImportError as error:
        pytest.skip(f"megatron-core not installed ({error})")
    import torch.distributed as dist

    from nn_data import PackedForward, pad_to_row_capacity
    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.models.tiny_megatron import tiny_gpt_config, tiny_gpt_model
    from nn_data.staging import StagedMicrobatch
    from nn_data.testing.dist import destroy_model_parallel_groups, free_port, init_gloo

    rows, seq_len, multiple = (16, 32, 8) if ON_CUDA else (4, 8, 4)
    init_gloo(0, 1, free_port())
    try:
        parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
        if ON_CUDA:
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(0)
        model = tiny_gpt_model(tiny_gpt_config(), position_embedding="none").to(DEVICE).eval()
        adapter = MegatronGPTAdapter(model, mask_kind="dense")
        packing = PackedForward(adapter, pad_individual_seqs_to_multiple_of=multiple, pad_full_seq_to=rows * seq_len,
                                row_capacity=rows, make_packed_seq_params=True)
        stage = StagedMicrobatch(packing, seq_len, device=DEVICE)
        stream = bench_cuda_graph.make_stream(rows, seq_len, 6, DEVICE, seed=5)
        schedule = get_forward_backward_func()
        if ON_CUDA:
            from megatron.core.full_cuda_graph import FullCudaGraphWrapper

            schedule = FullCudaGraphWrapper(schedule, cuda_graph_warmup_steps=1)
        step = _megatron_step(stage, _loss)
        for i, (ids, lengths) in enumerate(stream):
            padded = pad_to_row_capacity(ids, lengths, rows)
            batch = {"input_ids": padded.x, "seq_lengths": padded.seq_lengths, "num_rows": padded.num_rows}
            try:
                with torch.no_grad():
                    reduced = schedule(forward_step_func=step, data_iterator=iter([batch]), model=[adapter],
                                       num_microbatches=1, seq_length=rows * seq_len, micro_batch_size=1,
                                       forward_only=True)
            except Exception as error:  # noqa: BLE001 - the wrapper's refusal is the finding
                if ON_CUDA and i >= 1:
                    pytest.xfail(f"megatron-core's FullCudaGraphWrapper refused the staged step at step {i}: "
                                 f"{type(error).__name__}: {error}")
                raise
            with torch.no_grad():
                inp = packing.prepare(ids, lengths)
                want = _loss(adapter(inp.input_ids, inp.position_ids, inp.packed),
                             staged_targets(packing, ids, lengths))[0]
            torch.testing.assert_close(reduced[0]["loss"].float(), want.float(), **TOL)
        if hasattr(schedule, "reset_cuda_graph"):  # 0.19; 0.16's wrapper keeps its graph for the process
            schedule.reset_cuda_graph()
    finally:
        destroy_model_parallel_groups(parallel_state)
        dist.destroy_process_group()


def staged_targets(packing, ids, lengths):
    from tests.support.staging_values import staged_values

    return staged_values(packing, ids, lengths)["targets"]
