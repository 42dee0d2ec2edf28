"""Tier: pure CPU, single process.

Shared-prefix GRPO groups in the NeMo-RL megatron drop-in: cfg["nn_data"]["shared_prefix"] (PackOptions), the
planning through shard_by_batch_size(sequence_packing_args={"shared_prefix": ...}) with
nn_data.planning.plan_step_shared_prefix (whole groups per microbatch, the fields carried row for row), and the
iterator's checks of the key and fields (the packed step through a model: test_shared_prefix_dropin_model.py).
"""

from __future__ import annotations

import pytest
import torch

from nn_data.errors import PackingError
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.nemo_rl.megatron_data import PackOptions, _pack_sequences_for_megatron, get_microbatch_iterator
from nn_data.nemo_rl.megatron_data.options import SharedPrefixKeys
from nn_data.planning import Parallelism, plan_step_shared_prefix
from tests.support.megatron_config import megatron_cfg

S, M, BUDGET = 24, 4, 32
# 5 groups (sizes 3, 1, 4, 2, 2), prompts 6, 10, 3, 0, 13 tokens; the groups' rows interleaved
GROUPS = [0, 1, 0, 2, 2, 0, 3, 2, 4, 3, 2, 4]
PROMPT = {0: 6, 1: 10, 2: 3, 3: 0, 4: 13}
RESPONSES = [4, 9, 1, 7, 0, 12, 5, 3, 8, 2, 6, 11]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def grpo_batch(group_key="group_ids", prefix_key="prefix_lengths"):
    """Row b: its group's prompt tokens (100 * group + position), then its own response tokens (1000 + 10 * b + j)."""
    prefix = [PROMPT[g] for g in GROUPS]
    lengths = [p + r for p, r in zip(prefix, RESPONSES)]
    ids = torch.zeros(len(GROUPS), S, dtype=torch.long)
    for b, (g, p, n) in enumerate(zip(GROUPS, prefix, lengths)):
        ids[b, :p] = 100 * g + torch.arange(p)
        ids[b, p:n] = 1000 + 10 * b + torch.arange(n - p)
    names = [f"r{b}" for b in range(len(GROUPS))]
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(lengths), names=names,
                           **{group_key: torch.tensor(GROUPS), prefix_key: torch.tensor(prefix)})


def _args(**extra):
    return {"max_tokens_per_microbatch": BUDGET, "input_key": "input_ids", "input_lengths_key": "input_lengths",
            "algorithm": "nn_data_balanced", "sequence_length_pad_multiple": M, "shared_prefix": True, **extra}


def _cfg(nn_data):
    return {"sequence_packing": {"enabled": True}, "dynamic_batching": {"enabled": False},
            "megatron_cfg": megatron_cfg(pp=1, cp=1), "make_sequence_length_divisible_by": M, "nn_data": nn_data}


def reference_tokens(mb) -> int:
    """A microbatch's shared-prefix packed tokens from its own rows: each group's prompt once, each response."""
    seen, total = set(), 0
    for g, p, n in zip(mb["group_ids"].tolist(), mb["prefix_lengths"].tolist(), mb["input_lengths"].tolist()):
        total += _round_up(n - p, M) + (0 if g in seen else _round_up(p, M))
        seen.add(g)
    return total


def test_the_config_key_and_its_forms():
    assert PackOptions.from_cfg({"nn_data": {"shared_prefix": True}}).shared_prefix == SharedPrefixKeys()
    custom = PackOptions.from_cfg({"nn_data": {"shared_prefix": {"group_ids_key": "uid"}}}).shared_prefix
    assert custom == SharedPrefixKeys(group_ids="uid", prefix_lengths="prefix_lengths")
    assert PackOptions(shared_prefix=False).shared_prefix is None and PackOptions().shared_prefix is None
    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['shared_prefix'\]=\{'group_key': 'uid'\} is invalid; "
                                           r"expected True"):
        PackOptions(shared_prefix={"group_key": "uid"})
    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['shared_prefix'\]='yes' is invalid"):
        PackOptions.from_cfg({"nn_data": {"shared_prefix": "yes"}})


@pytest.mark.parametrize("shards, batch_size", [(1, None), (2, None), (2, 6), (3, 12)])
def test_sharding_plans_whole_groups_and_carries_their_fields(shards, batch_size):
    data = grpo_batch()
    out, order = data.shard_by_batch_size(shards, batch_size=batch_size, sequence_packing_args=_args())
    size = batch_size or len(GROUPS)
    parallelism = Parallelism(dp=shards, make_sequence_length_divisible_by=M)
    chunks = range(0, len(GROUPS), size)
    plans = [plan_step_shared_prefix(data["input_lengths"][c:c + size], parallelism, group_ids=GROUPS[c:c + size],
                                     prefix_lengths=data["prefix_lengths"][c:c + size], pad_full_seq_to=BUDGET)
             for c in chunks]
    assert sorted(order) == list(range(len(GROUPS)))
    for r, shard in enumerate(out):
        assert shard.micro_batch_lengths == [plan.microbatch_tokens[r] for plan in plans]
        for g, (c, plan) in enumerate(zip(chunks, plans)):
            batch = shard.get_batch(g)
            mbs = list(batch.make_microbatch_iterator_for_packable_sequences())
            assert [mb["names"] for mb in mbs] == [[f"r{c + i}" for i in rows] for rows in plan.ranks[r]]
            for mb, tokens in zip(mbs, batch.micro_batch_lengths[0]):
                rows = [int(name[1:]) for name in mb["names"]]
                assert mb["group_ids"].tolist() == [GROUPS[b] for b in rows]  # carried row for row
                assert mb["prefix_lengths"].tolist() == [PROMPT[GROUPS[b]] for b in rows]
                assert torch.equal(mb["input_ids"], data["input_ids"][rows])
                assert tokens == reference_tokens(mb) <= BUDGET
                groups = mb["group_ids"].tolist()  # each group contiguous: its rows form one run
                assert all(groups[groups.index(x):groups.index(x) + groups.count(x)] == [x] * groups.count(x)
                           for x in groups)
    merged = BatchedDataDict.from_batches(out)
    merged.reorder_data(order)
    assert merged["names"] == data["names"] and torch.equal(merged["prefix_lengths"], data["prefix_lengths"])


def test_a_group_is_kept_whole_where_it_fits_and_split_with_its_prompt_where_not():
    out, _ = grpo_batch().shard_by_batch_size(2, sequence_packing_args=_args())
    holding = {}
    for r, shard in enumerate(out):
        for j, mb in enumerate(shard.get_batch(0).make_microbatch_iterator_for_packable_sequences()):
            for g in set(mb["group_ids"].tolist()):
                holding.setdefault(g, []).append((r, j))
    # padded to 4: group 0 prompt 8 + responses 4 + 4 + 12 = 28 <= 32 and group 2 4 + 8 + 0 + 4 + 8 = 24: whole;
    # group 4 16 + 8 + 12 = 36 > 32: two parts, its prompt in each (16 + 8 and 16 + 12); group 3 has no prompt:
    # its rollouts share nothing and are planned one by one (here in two microbatches)
    assert {g: len(places) for g, places in holding.items() if g != 3} == {0: 1, 1: 1, 2: 1, 4: 2}


def test_custom_batch_keys():
    data = grpo_batch("uid", "prompt_len")
    keys = {"group_ids_key": "uid", "prefix_lengths_key": "prompt_len"}
    out, _ = data.shard_by_batch_size(2, sequence_packing_args=_args(shared_prefix=keys))
    default, _ = grpo_batch().shard_by_batch_size(2, sequence_packing_args=_args())
    assert [s["names"] for s in out] == [s["names"] for s in default]


@pytest.mark.parametrize("extra, match", [
    (dict(algorithm="modified_first_fit_decreasing"),
     r"^sequence_packing_args\['shared_prefix'\] plans with nn_data's planner; set "
     r"sequence_packing_args\['algorithm'\]='nn_data_balanced'"),
    (dict(shared_prefix={"group_ids_key": "uid"}), r"^'uid' not found in the batch"),
    (dict(shared_prefix=1), r"^sequence_packing_args\['shared_prefix'\]=1 is invalid"),
    (dict(max_tokens_per_microbatch=24), r"^lengths\[11\] = 24 with prefix_lengths\[11\] = 13 takes 28 tokens alone"),
])
def test_sharding_refusals(extra, match):
    with pytest.raises(PackingError, match=match):
        grpo_batch().shard_by_batch_size(1, sequence_packing_args=_args(**extra))


def test_the_iterator_checks_the_key_and_the_fields():
    out, _ = grpo_batch().shard_by_batch_size(1, sequence_packing_args=_args())
    batch = out[0].get_batch(0)
    iterator, count, mbs, _, _ = get_microbatch_iterator(batch, _cfg({"shared_prefix": True}), 1, None)
    assert mbs == 1 and count == len(batch.micro_batch_lengths[0])  # packs lazily: nothing refused up front
    cfg = _cfg({"shared_prefix": True})
    cfg["sequence_packing"]["enabled"] = False
    with pytest.raises(PackingError, match=r"needs cfg\['sequence_packing'\]\['enabled'\] = True$"):
        get_microbatch_iterator(batch, cfg, 1, None)
    with pytest.raises(PackingError, match=r"^'uid' not found in the batch"):
        get_microbatch_iterator(batch, _cfg({"shared_prefix": {"group_ids_key": "uid"}}), 1, None)
    batch["prefix_lengths"] = batch["prefix_lengths"].float()
    with pytest.raises(PackingError, match=r"^the batch's 'prefix_lengths' is a torch.float32 tensor of shape \(12,\); "
                                           r"expected a \[B=12\] integer tensor$"):
        get_microbatch_iterator(batch, _cfg({"shared_prefix": True}), 1, None)
    with pytest.raises(PackingError, match=r"^this call packs rollouts end to end"):  # NeMo-RL's pack door
        _pack_sequences_for_megatron(batch["input_ids"], batch["input_lengths"], M,
                                     options=PackOptions(shared_prefix=True))
