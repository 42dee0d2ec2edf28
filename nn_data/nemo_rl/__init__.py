"""The NeMo-RL drop-in: everything that carries NeMo-RL's names, in one home that nothing else in nn_data
imports (``docs/nemo-rl.md``). Switch by changing one import:

| NeMo-RL module | nn_data module (0.1.x path, the same module object) |
| --- | --- |
| ``nemo_rl.models.megatron.data`` | :mod:`nn_data.nemo_rl.megatron_data` (``nn_data.megatron_data``) |
| ``nemo_rl.distributed.model_utils`` | :mod:`nn_data.nemo_rl.model_utils` (``nn_data.model_utils``); its linear-CE fusion lives in :mod:`nn_data.nemo_rl.linear_ce` and :mod:`nn_data.nemo_rl.linear_ce_patch`, re-exported there |
| ``nemo_rl.distributed.batched_data_dict`` | :mod:`nn_data.nemo_rl.batched_data_dict` (``nn_data.batched_data_dict``) |
| ``nemo_rl.models.automodel.data`` | :mod:`nn_data.nemo_rl.automodel_data` |
| ``nemo_rl.models.huggingface.common`` (its packing helpers) | :mod:`nn_data.nemo_rl.huggingface_common` |
| ``TrainingSamplingParams`` | :mod:`nn_data.nemo_rl.sampling` (also on ``nn_data.nemo_rl.model_utils``) |

Importing this package imports none of them (nor megatron-core, nor transformers). ``__all__`` lists these
modules (NeMo-RL's, by the same names); each declares its own ``__all__``, every public name users call.
The paths in parentheses are the 0.1.x ones: they keep working with a warning; the ``nn_data.nemo_rl`` paths
are taught.
"""

__all__ = ["automodel_data", "batched_data_dict", "huggingface_common", "megatron_data", "model_utils", "sampling"]
