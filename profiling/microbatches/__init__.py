"""The main job: nn_data on a stream of constant-length (PP > 1) packed microbatches, eager vs
torch.compile vs the NeMo-RL-style loops (``python -m profiling.microbatches``; profiling/README.md).

``run`` (flags, the run), ``plan`` (the workload), ``stream`` (pipelines, modes), ``measure``
(timing, compiles, syncs, trace, memory), ``report`` (table, summary.json, chart),
``real_models`` (``--model hf|megatron``)."""
