"""Rollout trees in the megatron drop-in (``cfg["nn_data"]["rollout_tree"]``, and ``["shared_prefix"]``: GRPO groups,
its depth-1 spelling): every shared prefix packed once.

Shape legend
    B   rollouts of a microbatch (rows of its ``BatchedDataDict``); S their padded row length
    T   packed tokens in N node slots (``2B`` for GRPO groups, at most ``3B - 2`` for a tree: :mod:`nn_data.layout.tree`)
    C   context-parallel size; the model sees ``T/C`` local tokens
    K   keys of TransformerEngine's per-node key/value buffer at ``C = 1`` (:func:`kv_capacity`)

What is planned, packed and refused by name, and why a stock model must not get ``packed_seq_params``:
docs/nemo-rl.md, "Rollout trees and GRPO groups"."""

from __future__ import annotations

from typing import Any, Optional

import torch

from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.layout import TreeLayout
from nn_data.extension import megatron
from nn_data.nemo_rl.megatron_data.common import require
from nn_data.nemo_rl.megatron_data.dispatch import as_lengths, on_device
from nn_data.nemo_rl.megatron_data.options import FoundTreeKeys, PackOptions, SharedPrefixKeys, nemo_rl_spec
from nn_data.nemo_rl.megatron_data.packed import cp_rank_and_size
from nn_data.nemo_rl.megatron_data.records import ProcessedInputs, TreeRecord

#: Batch keys with no shared-prefix form: each would ride the packed row with the prompt once per group.
COMPANIONS = ("mtp_loss_mask", "routed_experts", "media_token_validity_mask")


def config_key(keys) -> str:
    """How messages name the config key of a spelling (``cfg['nn_data']['shared_prefix']`` or ``['rollout_tree']``)."""
    return f"cfg['nn_data']['{'shared_prefix' if isinstance(keys, SharedPrefixKeys) else 'rollout_tree'}']"


def tree_fields(data: Any, keys) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ``[B]`` integer fields of a batch under ``keys`` (no value read); :class:`PackingError` naming the key."""
    rows = data["input_ids"].shape[0]
    what = ("group ids and prefix lengths" if isinstance(keys, SharedPrefixKeys) else
            "parents and branch points (parent, branch_at)")
    out = []
    for key in keys:
        if key not in data:
            raise PackingAssertionError(f"{key!r} not found in the batch (keys: {list(data)}); {config_key(keys)} "
                                        f"needs the [B] {what} (keys {list(keys)})")
        value = data[key]
        ok = torch.is_tensor(value) and value.dim() == 1 and value.shape[0] == rows
        if not ok or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise PackingAssertionError(f"the batch's {key!r} is {_describe(value)}; expected a [B={rows}] integer tensor")
        out.append(value)
    return out[0], out[1]


def finds(data: Any, keys) -> bool:
    """``rollout_tree = "find"`` on a batch without the keys: the microbatch's own tree is found (:func:`found_tree`)."""
    return isinstance(keys, FoundTreeKeys) and not any(key in data for key in keys)


def found_tree(input_ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(parent, branch_at)`` ``[B]`` of the microbatch's rollouts (:func:`~nn_data.planning.find_rollout_tree`), one read.

    Example: rollouts ``[1 2 3]``, ``[1 2 9 9]`` -> ``[-1, 0]``, ``[0, 2]``."""
    from nn_data.planning import find_rollout_tree

    host = torch.cat([input_ids.to(torch.int64), lengths.to(torch.int64)[:, None]], dim=1)  # [B, S+1]
    host = host.cpu()  # sync: "find" without the sharding planner reads the microbatch's ids once
    tree = find_rollout_tree(host[:, :-1].numpy(), host[:, -1].numpy())
    return tuple(torch.from_numpy(t).to(input_ids.device) for t in tree)


def _describe(value) -> str:
    if torch.is_tensor(value):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _needs_packing(keys) -> PackingAssertionError:
    return PackingAssertionError(f"{config_key(keys)} packs every shared prefix once and needs "
                                 "cfg['sequence_packing']['enabled'] = True")


def check_tree_key(data: Any, cfg: dict, packing: bool):
    """The spelling's keys (None when unset); set, packing must be on and ``data`` must carry the keys."""
    keys = PackOptions.from_cfg(cfg).tree
    if keys is None:
        return None
    if not packing:
        raise _needs_packing(keys)
    if not finds(data, keys):
        tree_fields(data, keys)
    return keys


def refuse_with_dynamic_cp(cfg: dict) -> None:
    """:class:`PackingError` when a tree key is set: a dynamic-CP plan packs its rounds end to end."""
    keys = PackOptions.from_cfg(cfg).tree
    if keys is not None:
        raise PackingAssertionError("get_microbatch_iterator(..., dynamic_cp=) packs each round's sequences end to end and "
                                    f"cannot share a prefix: unset {config_key(keys)} for a dynamic-CP step, or drop "
                                    "dynamic_cp= to pack the planned microbatches with their shared prefixes")


def _refuse_unsupported(data_dict, *, delegate: bool, model_slices: bool, options: PackOptions) -> None:
    """What a tree microbatch does not take (companions, self-packing, model slicing, compile, buckets), by name."""
    key = config_key(options.tree)
    given = [k for k in COMPANIONS if k in data_dict]
    if given:
        raise PackingAssertionError(f"{key} does not pack {given} yet (a shared prefix's tokens would carry them once "
                                    f"for every rollout through it); drop them from the batch or unset the key")
    flags = {"delegate_pack_to_model": delegate, "model_slices_context_parallel_inputs": model_slices,
             "cfg['nn_data']['compile']": options.compile}
    for name, on in flags.items():
        if on:
            raise PackingAssertionError(f"{name}=True is not supported with {key} (the shared-prefix pack runs eagerly "
                                        "in process_microbatch, for a model that takes its CP share); set it to False "
                                        "or unset the key")
    if options.buckets is not None:
        raise PackingAssertionError(f"cfg['nn_data']['buckets']={options.buckets!r} is not supported with {key} (a "
                                    "shared-prefix microbatch's T is the data's, or cfg['nn_data']['pad_full_seq_to'] "
                                    "for one shape); unset one of them")


def rollout_tree_inputs(data_dict, *, seq_length_key: Optional[str], pack_sequences: bool, m: int, p: int,
                        pad_full_seq_to: Optional[int], delegate: bool, model_slices: bool, options: PackOptions,
                        pg_collection=None) -> ProcessedInputs:
    """``process_microbatch`` for a microbatch of rollout trees or GRPO groups (one host read, checking the tree).

    Returns :class:`ProcessedInputs` with the packed ids ``[1, T]`` / ``[1, T/C]``, rollout ``position_ids [1, T/C]``
    (a node continues from its path), ``attention_mask`` None, ``packed_seq_params`` (:func:`shared_prefix_params`),
    the node slots' ``cu_seqlens_padded [N+1]``, ``padding_mask`` and the :class:`TreeRecord`.

    Example: groups ``[7, 7, 9]``, P ``[2, 2, 1]``, L ``[4, 3, 3]``, m 1 -> ids ``[p0 p0 r0 r0 | r1 | p2 | r2 r2]``,
    position_ids ``[0, 1, 2, 3, 2, 0, 1, 2]``, cu_seqlens_padded ``[0, 2, 4, 4, 5, 6, 8]``."""
    from nn_data.adapters.tree_kv import tree_kv
    from nn_data.planning import RolloutTree
    from nn_data.extension import PackingSide, RolloutGroups, TREE

    keys = options.tree
    if not pack_sequences:
        raise _needs_packing(keys)
    require(seq_length_key is not None, "seq_length_key must be provided for packed sequences")
    require(seq_length_key in data_dict, f"{seq_length_key} not found in data_dict")
    _refuse_unsupported(data_dict, delegate=delegate, model_slices=model_slices, options=options)
    input_ids = data_dict["input_ids"]
    device = input_ids.device
    lengths = as_lengths(data_dict[seq_length_key], input_ids.shape[0], device)
    first, second = found_tree(input_ids, lengths) if finds(data_dict, keys) else tree_fields(data_dict, keys)
    first, second = (on_device(name, t, "input_ids", device) for name, t in zip(keys._fields, (first, second)))
    groups = isinstance(keys, SharedPrefixKeys)
    args = RolloutGroups(second, first) if groups else RolloutTree(first, second)  # GRPO groups: the depth-1 tree
    cp_rank, cp_size = cp_rank_and_size(pg_collection)
    spec = nemo_rl_spec(m, p, fixed_total=options.fixed_total(pad_full_seq_to), cp_rank=cp_rank, cp_size=cp_size,
                        name="pad_full_seq_to")
    side = PackingSide(spec, cp_size, cp_rank, kind=TREE)(input_ids, lengths, args=args)
    shared, info = side.layout, side.packed
    kv = None
    # A variable-length kernel's q/kv boundaries (each node slot's path keys, then its own) at CP 1: one length per
    # run where kv_capacity sets it, each microbatch's need without a fixed T; under a fixed T without kv_capacity
    # none (its length would change the shapes pad_full_seq_to fixes; check_prefix_attention names the key).
    if cp_size == 1 and (options.kv_capacity is not None or spec.fixed_total is None):
        kv = tree_kv(shared, kv_capacity=kv_capacity(shared, run_capacity=options.kv_capacity))
    record = TreeRecord(shared, info, kv, "shared-prefix" if groups else "rollout-tree")
    return ProcessedInputs(
        input_ids=side.packed_ids, input_ids_cp_sharded=side.input_ids, attention_mask=None,
        position_ids=side.position_ids,
        packed_seq_params=shared_prefix_params(record), cu_seqlens_padded=shared.layout.cu_seqlens_padded,
        padding_mask=info.padding_mask, shared_prefix=record,
    )


def kv_capacity(shared: TreeLayout, *, run_capacity: Optional[int] = None) -> int:
    """``K`` of the record's key/value buffer from the builder's host ints: ``T`` plus the path tokens ahead of every
    non-empty node slot, or the run's ``run_capacity`` (``cfg["nn_data"]["kv_capacity"]``) when given.

    Example: groups L ``[4, 3, 3]``, P ``[2, 2, 1]``, T 8 -> K ``8 + 2 + 2 + 1 = 13``; ``run_capacity=16`` -> 16,
    ``run_capacity=12`` -> :class:`PackingError` (needs 13)."""
    host = shared.layout.host
    if host is None or shared.host_begins is None:
        raise PackingAssertionError("kv_capacity needs a rollout-tree layout built on the host (tree_layout or "
                                    "shared_prefix_layout with host_reads=True)")
    path = sum(begin for begin, padded in zip(shared.host_begins, host.segments) if padded > 0)
    need = shared.total + path
    if run_capacity is None:
        return need
    if need > run_capacity:
        raise PackingAssertionError(
            f"cfg['nn_data']['kv_capacity']={run_capacity} is too small for this microbatch: its key/value buffer "
            f"needs K={need} (T={shared.total} plus {path} path tokens before its nodes); raise kv_capacity to at "
            f"least {need}")
    return run_capacity


def shared_prefix_params(record: TreeRecord):
    """The record's THD ``PackedSeqParams``: at ``C = 1`` the query and key/value boundaries over ``record.kv``
    (:func:`~nn_data.adapters.tree_kv.tree_packed_seq_params`); under CP the slots' padded boundaries, for nn_data's
    attention (docs/nemo-rl.md, "Rollout trees and GRPO groups")."""
    from nn_data.adapters.tree_kv import tree_packed_seq_params

    shared = record.layout
    slots = shared.layout
    if record.kv is None:
        return megatron.make_packed_seq_params(slots.cu_seqlens_padded, slots.host.max_seqlen,
                                               shared.total // record.info.cp_size,
                                               total=shared.total)
    return tree_packed_seq_params(record.kv)
