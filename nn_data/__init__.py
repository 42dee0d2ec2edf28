"""nn_data: Megatron THD packing, context-parallel sharding and unpacking as
stateless ``nn.Module`` ops that ``torch.compile`` captures whole.

Importing ``nn_data`` does not import megatron-core; only
:mod:`nn_data.megatron_data` (the NeMo-RL-compatible layer) does;
:mod:`nn_data.megatron_parallel` reads megatron-core's ``parallel_state`` only
when the caller has already imported and initialised it.
"""

from nn_data.context_parallel import ShardForContextParallel, UnshardFromContextParallel
from nn_data.cp_comm import GatherFromContextParallel
from nn_data.errors import PackingError
from nn_data.layout import PackLayout, pack_with_layout
from nn_data.logprobs import TokenLogProbs
from nn_data.pack import PackResult, PackSequences
from nn_data.packed_forward import PackedForward, PackedInfo
from nn_data.rows import RowPadded, pad_rows, pad_to_row_capacity
from nn_data.targets import NextTokenTargets, PositionIds, Targets
from nn_data.unpack import UnpackSequences

__all__ = [
    "GatherFromContextParallel",
    "NextTokenTargets",
    "PackLayout",
    "PackResult",
    "PackSequences",
    "PackedForward",
    "PackedInfo",
    "PackingError",
    "PositionIds",
    "RowPadded",
    "ShardForContextParallel",
    "Targets",
    "TokenLogProbs",
    "UnpackSequences",
    "UnshardFromContextParallel",
    "pack_with_layout",
    "pad_rows",
    "pad_to_row_capacity",
]
