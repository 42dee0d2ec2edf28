"""nn_data: Megatron THD packing, context-parallel sharding and unpacking as stateless ``nn.Module`` ops that
``torch.compile`` captures whole.

Importing ``nn_data`` (or :mod:`nn_data.nemo_rl.megatron_data`, or :mod:`nn_data.adapters`) imports neither
megatron-core nor transformers: each is imported at first use (docs/design.md, "megatron-core").
``__version__`` is the installed package's version (``"0+unknown"`` for a source tree pip never installed)."""

import nn_data._alias  # noqa: F401  (first: the old module paths resolve from here on)
from nn_data._version import package_version
from nn_data.context_parallel import ShardForContextParallel, UnshardFromContextParallel
from nn_data.cp_comm import GatherFromContextParallel
from nn_data.errors import PackingError
from nn_data.layout import PackLayout, pack_with_layout
from nn_data.logprobs import TokenLogProbs, TokenLogProbsFromHidden
from nn_data.pack import PackResult, PackSequences
from nn_data.packed_forward import PackedForward, PackedInfo
from nn_data.rows import RowPadded, pad_rows, pad_to_row_capacity, with_dynamic_row_length
from nn_data.targets import NextTokenTargets, PositionIds, Targets
from nn_data.unpack import UnpackSequences

__version__ = package_version()

__all__ = [
    "__version__",
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
    "TokenLogProbsFromHidden",
    "UnpackSequences",
    "UnshardFromContextParallel",
    "pack_with_layout",
    "pad_rows",
    "pad_to_row_capacity",
    "with_dynamic_row_length",
]
