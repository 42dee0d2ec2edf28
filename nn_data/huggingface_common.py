"""Old-style path of :mod:`nn_data.nemo_rl.huggingface_common` (NeMo-RL's
``nemo_rl.models.huggingface.common``): ``nn_data.huggingface_common`` *is* that module (one object under
both names)."""

from nn_data._alias import alias_module

alias_module(__name__, "nn_data.nemo_rl.huggingface_common")
