"""The unstaged path's values of a staged microbatch: the oracle of nn_data.staging's CPU and GPU tests
(tests/ops/test_staging.py, tests/cuda/test_cuda_graph_staging.py, tests/support/pg_collection_cases.py)."""

from __future__ import annotations

import torch

from nn_data.rows import pad_to_row_capacity
from nn_data.targets import NextTokenTargets


def staged_values(packing, input_ids: torch.Tensor, seq_lengths: torch.Tensor, *,
                  ignore_index: int = -100) -> dict:
    """The unstaged path's values of the staged tensors (``packing.prepare`` and ``NextTokenTargets`` on its
    pack): what a ``StagedMicrobatch`` must hold after ``load(input_ids, seq_lengths).prepare()``."""
    inp = packing.prepare(input_ids, seq_lengths)
    padded = pad_to_row_capacity(input_ids, seq_lengths, packing.row_capacity, name="row_capacity")
    r = packing.pack(padded.x, padded.seq_lengths, padded.num_rows)
    targets = NextTokenTargets(packing.cp_size, packing.cp_rank, ignore_index=ignore_index)(r.packed, layout=r.layout)
    info = inp.packed
    return dict(input_ids=inp.input_ids, position_ids=inp.position_ids, targets=targets.targets,
                padding_mask=info.padding_mask, cu_seqlens_padded=info.cu_seqlens_padded,
                segment_ids=info.segment_ids, query_index=info.query_index, max_seqlen=info.max_seqlen)
