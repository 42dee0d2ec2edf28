"""Rollout trees in NeMo-RL's AutoModel data path (:mod:`nn_data.nemo_rl.automodel_data`): with
``cfg["nn_data"]["rollout_tree"]`` (or ``["shared_prefix"]``) each packed microbatch is a tree microbatch, every
shared token once, and :func:`forward_rollout_tree` runs a transformers model on it through
:class:`~nn_data.adapters.HFCausalLMAdapter`.

Shape legend
    B   rollouts of a microbatch; S their padded row length
    T   packed tokens (:func:`~nn_data.nemo_rl.automodel_data.fixed_total`); N node slots
    V   vocabulary

The option parsing, batch keys, checks and record are the megatron drop-in's
(:mod:`nn_data.nemo_rl.megatron_data.tree_inputs`); what is refused by name: docs/nemo-rl.md, "The AutoModel data
path"."""

from __future__ import annotations

from typing import Any

import torch

from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.nemo_rl.megatron_data.common import require
from nn_data.nemo_rl.megatron_data.options import PackOptions, SharedPrefixKeys
from nn_data.nemo_rl.megatron_data.records import TreeRecord
from nn_data.nemo_rl.megatron_data.tree_inputs import config_key, finds, found_tree, tree_fields


def tree_microbatch(mb: Any, input_ids: torch.Tensor, lengths: torch.Tensor, *, total: int, options: PackOptions,
                    cp_size: int) -> tuple:
    """``(packed ids [1, T], position ids [1, T], TreeRecord)`` of the microbatch ``mb`` packed as its rollout tree to
    ``T = total`` on the device (no host read, except ``"find"`` on a batch without the fields).

    Example: L ``[5, 4]``, parent ``[-1, 0]``, branch_at ``[0, 3]``, T 8 -> ids ``[x0 x1 x2 | x3 x4 | y3 | 0 0]``,
    positions ``[0, 1, 2, 3, 4, 3, 0, 0]``."""
    from nn_data.extension import PackingSide, RolloutGroups, TREE
    from nn_data.layout import PackSpec
    from nn_data.planning import RolloutTree

    keys = options.tree
    key = config_key(keys)
    require(cp_size == 1, f"{key} packs without context parallelism on the AutoModel path (cp_size={cp_size}), as "
                          "its sequence packing does; run trees under CP with nn_data's PackedForward(HFCausalLMAdapter"
                          "(model), cp_group=...)(ids, lengths, parent=, branch_at=)")
    for name, on in (("cfg['nn_data']['compile']", options.compile),
                     ("cfg['nn_data']['buckets']", options.buckets is not None)):
        require(not on, f"{name} is not supported with {key} (a tree microbatch packs eagerly to the one T of "
                        "fixed_total(cfg), with no host read); unset one of them")
    first, second = found_tree(input_ids, lengths) if finds(mb, keys) else tree_fields(mb, keys)
    first, second = first.to(input_ids.device), second.to(input_ids.device)
    args = RolloutGroups(second, first) if isinstance(keys, SharedPrefixKeys) else RolloutTree(first, second)
    side = PackingSide(PackSpec(fixed_total=total), kind=TREE, host_reads=False)(input_ids, lengths, args=args)
    kind = "shared-prefix" if isinstance(keys, SharedPrefixKeys) else "rollout-tree"
    return side.packed_ids, side.position_ids, TreeRecord(side.layout, side.packed, None, kind)


def forward_rollout_tree(model, microbatch, **model_kwargs) -> torch.Tensor:
    """The packed logits ``[1, T, V]`` of a tree microbatch, each rollout's tokens equal to it run alone.

    Args:
        model: a transformers causal LM, or an :class:`~nn_data.adapters.HFCausalLMAdapter` around one.
        microbatch: a ``ProcessedMicrobatch`` or ``ProcessedInputs`` with ``shared_prefix`` (per rollout:
            ``microbatch.shared_prefix.layout.unpack(logits, S)``).
        model_kwargs: go to the model.

    Raises :class:`PackingError` for a microbatch without the record and as the adapter does."""
    from nn_data.adapters import HFCausalLMAdapter

    inputs = getattr(microbatch, "processed_inputs", microbatch)
    record = getattr(inputs, "shared_prefix", None)
    if record is None:
        raise PackingAssertionError("the microbatch has no shared_prefix record: it was not packed with "
                                    "cfg['nn_data']['rollout_tree'] (or ['shared_prefix']); call the model on its "
                                    "input_ids, position_ids and flash_attn_kwargs as on any packed microbatch")
    adapter = model if isinstance(model, HFCausalLMAdapter) else HFCausalLMAdapter(model)
    info = record.info.finished(row_len=record.layout.row_len)
    return adapter(inputs.input_ids, inputs.position_ids, info, **model_kwargs)
