"""Shared-prefix GRPO groups in the megatron drop-in (issue 36): ``cfg["nn_data"]["shared_prefix"]``.

Shape legend
    B   rollouts of a microbatch (rows of its ``BatchedDataDict``)

With the key set (True, or the batch keys: :func:`~nn_data.nemo_rl.megatron_data.options.shared_prefix_keys`),
a step's batch carries ``group_ids [B]`` (rollouts of a GRPO group share its prompt) and
``prefix_lengths [B]`` (that prompt's length) beside ``input_ids`` / ``input_lengths``:

* **planning** (done): ``shard_by_batch_size(..., sequence_packing_args={"algorithm": "nn_data_balanced",
  "shared_prefix": cfg["nn_data"]["shared_prefix"], ...})`` plans each global batch with
  :func:`nn_data.planning.plan_step_shared_prefix`: every microbatch holds whole groups (a group too large
  for ``max_tokens_per_microbatch`` split, its prompt in each part), a group's rollouts contiguous with its
  first (its leader) first, ``micro_batch_lengths`` the shared-prefix packed tokens, the two fields carried
  row for row in the shards and every microbatch slice;
* **packing** (not yet): the iterator's microbatches packed with ``SharedPrefixLayout`` and megatron-core's
  ``PackedSeqParams`` with the prompt's keys and values for each response. Until both are in nn_data,
  :func:`check_shared_prefix` refuses to pack such a step (it would not fit the plan's lengths, and
  the responses would not see their prompts), naming what is missing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from nn_data.errors import PackingError
from nn_data.nemo_rl.megatron_data.options import PackOptions, SharedPrefixKeys

PENDING = ("packing a shared-prefix microbatch for megatron-core (SharedPrefixLayout and PackedSeqParams with "
           "the prompt's keys and values per response, issue 36) is not in this nn_data yet; plan with "
           "sequence_packing_args['shared_prefix'] and pack the planned microbatches (their rows carry the group "
           "ids and prefix lengths) with nn_data.layout's shared-prefix layout once it is, or unset "
           "cfg['nn_data']['shared_prefix']")


def shared_prefix_fields(data: Any, keys: SharedPrefixKeys) -> tuple[torch.Tensor, torch.Tensor]:
    """``(group_ids [B], prefix_lengths [B])`` of a batch, each present and a 1-D integer tensor of ``B``
    entries (no value is read: the planner and the layout check the values); :class:`PackingError`
    naming the key otherwise."""
    rows = data["input_ids"].shape[0]
    out = []
    for key in keys:
        if key not in data:
            raise PackingError(f"{key!r} not found in the batch (keys: {list(data)}); cfg['nn_data']['shared_prefix'] "
                               f"needs the [B] group ids and prefix lengths (keys {list(keys)})")
        value = data[key]
        ok = torch.is_tensor(value) and value.dim() == 1 and value.shape[0] == rows
        if not ok or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise PackingError(f"the batch's {key!r} is {_describe(value)}; expected a [B={rows}] integer tensor")
        out.append(value)
    return out[0], out[1]


def _describe(value) -> str:
    if torch.is_tensor(value):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def check_shared_prefix(data: Any, cfg: dict, packing: bool) -> Optional[SharedPrefixKeys]:
    """None when ``cfg["nn_data"]["shared_prefix"]`` is unset. Set: the keys are checked against ``data``
    (:func:`shared_prefix_fields`), sequence packing must be on, and packing is refused (module docstring)."""
    keys = PackOptions.from_cfg(cfg).shared_prefix
    if keys is None:
        return None
    if not packing:
        raise PackingError("cfg['nn_data']['shared_prefix'] packs each group's prompt once and needs "
                           "cfg['sequence_packing']['enabled'] = True")
    shared_prefix_fields(data, keys)
    raise PackingError(PENDING)
