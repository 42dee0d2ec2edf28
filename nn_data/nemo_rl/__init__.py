"""The NeMo-RL drop-in: everything that carries NeMo-RL's names, in one home nothing else in nn_data imports
(docs/nemo-rl.md). Switch by changing one import:

| NeMo-RL module | nn_data module (its 0.1.x path warns) |
| --- | --- |
| ``nemo_rl.models.megatron.data`` | :mod:`nn_data.nemo_rl.megatron_data` (``nn_data.megatron_data``) |
| ``nemo_rl.distributed.model_utils`` | :mod:`nn_data.nemo_rl.model_utils` (``nn_data.model_utils``) |
| ``nemo_rl.distributed.batched_data_dict`` | :mod:`nn_data.nemo_rl.batched_data_dict` (``nn_data.batched_data_dict``) |
| ``nemo_rl.models.automodel.data`` | :mod:`nn_data.nemo_rl.automodel_data` |
| ``nemo_rl.models.huggingface.common`` (packing helpers) | :mod:`nn_data.nemo_rl.huggingface_common` |
| ``TrainingSamplingParams`` | :mod:`nn_data.nemo_rl.sampling` |

Importing this package imports none of them (nor megatron-core, nor transformers)."""

__all__ = ["automodel_data", "batched_data_dict", "huggingface_common", "megatron_data", "model_utils", "sampling"]
