"""Tier: pure CPU, single process (a gloo world of one rank on 127.0.0.1 for megatron-core's parallel_state).

Rollout trees in the NeMo-RL megatron drop-in: cfg["nn_data"]["rollout_tree"] (PackOptions) and its forms, the
planning through shard_by_batch_size(sequence_packing_args={"rollout_tree": ...}) with
nn_data.planning.plan_step_rollout_tree (each microbatch's parent / branch_at rewritten for its own rollouts, or
found from the token ids with "find"; without the sharding planner process_microbatch finds a microbatch's own
tree), the packed record, and a step of trees of depth 1 to 3 through
get_microbatch_iterator, forward_shared_prefix on the tiny GPTModel (float64) and the log-prob functions: logits,
log-probs and parameter gradients equal every rollout run alone (1e-10); at CP 1 the record's key/value buffer and
PackedSeqParams under a variable-length kernel (a CPU loop reference) give every rollout's attention alone (float64).
Bad config, fields and trees are refused by name, and so is a model whose attention cannot take a tree (naming the
buffer at CP 1, and that there is none under CP).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nn_data.errors import PackingError
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.nemo_rl.megatron_data import PackOptions, get_microbatch_iterator, process_microbatch
from nn_data.nemo_rl.megatron_data.options import RolloutTreeKeys
from nn_data.nemo_rl.megatron_data.tree_model import forward_shared_prefix
from nn_data.planning import Parallelism, plan_step_rollout_tree, subtree
from tests.support.megatron_config import megatron_cfg
from tests.support.megatron_release import needs_megatron_models, one_rank_parallel_state

S, M, BUDGET, VOCAB = 24, 4, 32, 97
# Rows interleaved: tree A (0, 3, 7, 9; depth 3: 7 branches from 3, which branches from 0; 9 a sibling of 3),
# tree B (1, 6, 10; 6 shares all of 1, 10 branches from 6), a GRPO star C (2, 5, 8; 8 has no own token), D (4, 11).
PARENT = [-1, -1, -1, 0, -1, 2, 1, 3, 2, 0, 6, 4]
BRANCH_AT = [0, 0, 0, 6, 0, 5, 10, 10, 5, 6, 13, 4]
LENGTHS = [14, 10, 12, 18, 7, 8, 16, 20, 5, 9, 15, 11]


def tree_batch(seed: int = 0, unique: bool = False, parent_key="parent", branch_at_key="branch_at") -> BatchedDataDict:
    """Row b: its parent's first ``BRANCH_AT[b]`` tokens, then its own: random in ``[1, VOCAB)``, or with ``unique``
    a code per own token (``1000 * (b + 1) + s``, so that the longest common prefixes are the tree's); 0 past L."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(LENGTHS), S, dtype=torch.long)
    for b, (p, at, n) in enumerate(zip(PARENT, BRANCH_AT, LENGTHS)):
        ids[b, :at] = ids[p, :at]
        own = 1000 * (b + 1) + torch.arange(at, n) if unique else torch.randint(1, VOCAB, (n - at,), generator=gen)
        ids[b, at:n] = own
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(LENGTHS), names=[f"r{b}" for b in range(len(LENGTHS))],
                           **{parent_key: torch.tensor(PARENT), branch_at_key: torch.tensor(BRANCH_AT)})


def _args(**extra) -> dict:
    return {"max_tokens_per_microbatch": BUDGET, "input_key": "input_ids", "input_lengths_key": "input_lengths",
            "algorithm": "nn_data_balanced", "sequence_length_pad_multiple": M, "rollout_tree": True, **extra}


def _cfg(cp: int = 1, **nn_data) -> dict:
    return {"sequence_packing": {"enabled": True}, "dynamic_batching": {"enabled": False},
            "megatron_cfg": megatron_cfg(pp=1, cp=cp), "make_sequence_length_divisible_by": M,
            "nn_data": {"rollout_tree": True, "device": "cpu", **nn_data}}


def planned_microbatches(cp: int = 1):
    """The step's microbatches as the iterator yields them (one DP rank, one global batch; ``cp``: the CP size of
    megatron-core's parallel_state, which the iterator reads)."""
    shards, _ = tree_batch().shard_by_batch_size(1, sequence_packing_args=_args())
    batch = shards[0].get_batch(0)
    iterator, count, _, _, _ = get_microbatch_iterator(batch, _cfg(cp), 1, None)
    mbs = list(iterator)
    assert len(mbs) == count > 1
    return batch, mbs


def reference_subtree(rows: list) -> tuple[list, list]:
    """Loop reference from the tokens (unique codes: two rollouts share exactly what the tree says): each row's
    parent is the earliest earlier row of ``rows`` with the longest common prefix, and that prefix, or (-1, 0)."""
    ids = tree_batch(unique=True)["input_ids"].tolist()
    parent, branch_at = [], []
    for i, r in enumerate(rows):
        best, at = -1, 0
        for j, q in enumerate(rows[:i]):
            n = 0
            while n < min(LENGTHS[r], LENGTHS[q]) and ids[r][n] == ids[q][n]:
                n += 1
            if n > at:
                best, at = j, n
        parent.append(best)
        branch_at.append(at)
    return parent, branch_at


def test_the_config_key_and_its_forms():
    assert PackOptions.from_cfg({"nn_data": {"rollout_tree": True}}).rollout_tree == RolloutTreeKeys()
    assert PackOptions(rollout_tree="find").tree == RolloutTreeKeys()
    custom = PackOptions.from_cfg({"nn_data": {"rollout_tree": {"parent_key": "up"}}}).tree
    assert custom == RolloutTreeKeys(parent="up", branch_at="branch_at")
    assert PackOptions(rollout_tree=False).tree is None and PackOptions().tree is None
    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['rollout_tree'\]=\{'parent': 'up'\} is invalid; "
                                           r"expected True \(the batch keys 'parent' and 'branch_at'\), 'find'"):
        PackOptions(rollout_tree={"parent": "up"})
    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['rollout_tree'\]='yes' is invalid"):
        PackOptions.from_cfg({"nn_data": {"rollout_tree": "yes"}})
    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['shared_prefix'\]=True and cfg\['nn_data'\]"
                                           r"\['rollout_tree'\]=True are both set: a GRPO group is the depth-1 "
                                           r"rollout tree, set one of them$"):
        PackOptions(shared_prefix=True, rollout_tree=True)


@pytest.mark.parametrize("shards", [1, 2])
def test_sharding_plans_trees_and_rewrites_their_fields_per_microbatch(shards):
    data = tree_batch()
    out, order = data.shard_by_batch_size(shards, sequence_packing_args=_args())
    plan = plan_step_rollout_tree(LENGTHS, Parallelism(dp=shards, make_sequence_length_divisible_by=M), parent=PARENT,
                                  branch_at=BRANCH_AT, pad_full_seq_to=BUDGET)
    assert sorted(order) == list(range(len(LENGTHS)))
    options = PackOptions(rollout_tree=True)
    for r, shard in enumerate(out):
        assert shard.micro_batch_lengths == [plan.microbatch_tokens[r]]
        mbs = list(shard.get_batch(0).make_microbatch_iterator_for_packable_sequences())
        assert [mb["names"] for mb in mbs] == [[f"r{b}" for b in rows] for rows in plan.ranks[r]]
        for mb, rows, tokens in zip(mbs, plan.ranks[r], plan.microbatch_tokens[r]):
            parent, branch_at = reference_subtree(rows)
            assert mb["parent"].tolist() == parent and mb["branch_at"].tolist() == branch_at
            assert torch.equal(mb["input_ids"], data["input_ids"][rows])
            packed = process_microbatch(mb, "input_lengths", M, 1, None, pack_sequences=True, options=options)
            assert packed.input_ids.shape[1] == tokens <= BUDGET  # the plan's tokens are the layout's
    # tree A (44 tokens padded to 4) is split: one part packs again what it shares with the other
    holding = [rows for rank in plan.ranks for rows in rank if {0, 3, 7, 9} & set(rows)]
    assert len(holding) == 2 and sorted(b for rows in holding for b in rows if b in (0, 3, 7, 9)) == [0, 3, 7, 9]
    for rows in ([3, 9], [7, 9], [5, 8], [3, 7, 9, 10]):  # siblings share through an absent parent
        assert [x.tolist() for x in subtree(PARENT, BRANCH_AT, rows)] == list(reference_subtree(rows))


def test_find_builds_the_tree_from_the_token_ids():
    explicit, _ = tree_batch(unique=True).shard_by_batch_size(2, sequence_packing_args=_args())
    plain = tree_batch(unique=True)
    del plain["parent"], plain["branch_at"]
    found, _ = plain.shard_by_batch_size(2, sequence_packing_args=_args(rollout_tree="find"))
    for a, b in zip(explicit, found):
        assert a["names"] == b["names"] and a.micro_batch_lengths == b.micro_batch_lengths
        assert torch.equal(a["parent"], b["parent"]) and torch.equal(a["branch_at"], b["branch_at"])
    iterator, count, _, _, _ = get_microbatch_iterator(found[0].get_batch(0), _cfg(rollout_tree="find"), 1, None)
    packed = [mb.input_ids.shape[1] for mb in iterator]
    assert len(packed) == count and packed == found[0].micro_batch_lengths[0]  # the planned tokens, packed


def test_custom_batch_keys():
    keys = {"parent_key": "up", "branch_at_key": "shared"}
    out, _ = tree_batch(parent_key="up", branch_at_key="shared").shard_by_batch_size(
        2, sequence_packing_args=_args(rollout_tree=keys))
    default, _ = tree_batch().shard_by_batch_size(2, sequence_packing_args=_args())
    assert [s["names"] for s in out] == [s["names"] for s in default]
    assert [s["up"].tolist() for s in out] == [s["parent"].tolist() for s in default]
    mb = next(iter(out[0].get_batch(0).make_microbatch_iterator_for_packable_sequences()))
    record = process_microbatch(mb, "input_lengths", M, 1, None, pack_sequences=True,
                                options=PackOptions(rollout_tree=keys)).shared_prefix
    assert record.kind == "rollout-tree" and record.kv is not None


@pytest.mark.parametrize("extra, match", [
    (dict(algorithm="first_fit_decreasing"),
     r"^sequence_packing_args\['rollout_tree'\] plans with nn_data's planner; set "
     r"sequence_packing_args\['algorithm'\]='nn_data_balanced'"),
    (dict(rollout_tree={"parent_key": "up"}), r"^'up' not found in the batch .* needs the \[B\] parents and branch "
                                              r"points \(parent, branch_at\) \(keys \['up', 'branch_at'\]\)$"),
    (dict(rollout_tree=1), r"^sequence_packing_args\['rollout_tree'\]=1 is invalid"),
    (dict(shared_prefix=True), r"^sequence_packing_args\['shared_prefix'\] and \['rollout_tree'\] are both set"),
    (dict(max_tokens_per_microbatch=16), r"^Sequence length 20 exceeds bin capacity 16 \(row 3,"),
])
def test_sharding_refusals(extra, match):
    with pytest.raises(PackingError, match=match):
        tree_batch().shard_by_batch_size(1, sequence_packing_args=_args(**extra))


@pytest.mark.parametrize("field, row, value, match", [
    ("parent", 3, 5, r"^parent\[3\] = 5 is invalid; rollout 3's parent must be an earlier rollout"),
    ("parent", 0, 0, r"^parent\[0\] = 0 is invalid"),  # its own parent: a cycle
    ("branch_at", 7, 6, r"^branch_at\[7\] = 6 is invalid for parent\[7\] = 3"),  # not past its parent's 6
])
def test_the_planner_refuses_a_bad_tree_by_field(field, row, value, match):
    data = tree_batch()
    data[field][row] = value
    with pytest.raises(PackingError, match=match):
        data.shard_by_batch_size(1, sequence_packing_args=_args())


def test_the_microbatch_checks_the_tree_and_its_fields():
    shards, _ = tree_batch().shard_by_batch_size(1, sequence_packing_args=_args())
    batch = shards[0].get_batch(0)
    mbs = list(batch.make_microbatch_iterator_for_packable_sequences())
    mb = max(mbs, key=lambda m: int((m["parent"] >= 0).sum()))  # the deepest: rows 1, 6, 10
    tree = PackOptions(rollout_tree=True)

    def process(data, options=tree, **kw):
        return process_microbatch(data, "input_lengths", M, 1, None, pack_sequences=kw.pop("pack", True),
                                  options=options, **kw)

    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['rollout_tree'\] packs every shared prefix once and "
                                           r"needs cfg\['sequence_packing'\]\['enabled'\] = True$"):
        process(mb, pack=False)
    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['compile'\]=True is not supported with "
                                           r"cfg\['nn_data'\]\['rollout_tree'\]"):
        process(mb, options=PackOptions(rollout_tree=True, compile=True))
    masked = BatchedDataDict({**mb, "mtp_loss_mask": torch.ones_like(mb["input_ids"])})
    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['rollout_tree'\] does not pack \['mtp_loss_mask'\]"):
        process(masked)
    floats = BatchedDataDict({**mb, "branch_at": mb["branch_at"].float()})
    with pytest.raises(PackingError, match=r"^the batch's 'branch_at' is a torch.float32 tensor of shape"):
        process(floats)
    with pytest.raises(PackingError, match=r"^'parent' not found in the batch .* cfg\['nn_data'\]\['rollout_tree'\] "
                                           r"needs the \[B\] parents and branch points"):
        get_microbatch_iterator(BatchedDataDict({k: v for k, v in batch.items() if k != "parent"}), _cfg(), 1, None)
    child = mb["parent"].shape[0] - 1
    assert mb["parent"][child] >= 0 and mb["branch_at"][child] > 0
    late = mb["parent"].clone()
    late[1] = 2  # a parent after its child
    with pytest.raises(PackingError, match=r"parent\[1\] = 2"):
        process(BatchedDataDict({**mb, "parent": late}))
    differ = mb["input_ids"].clone()
    differ[child, 0] += 1  # a shared token that is not the parent's
    with pytest.raises(PackingError, match=rf"rollout {child}|input_ids\[{child}"):
        process(BatchedDataDict({**mb, "input_ids": differ}))
    with pytest.raises(PackingError, match=r"^get_microbatch_iterator\(\.\.\., dynamic_cp=\) packs each round's "
                                           r"sequences end to end and cannot share a prefix: unset "
                                           r"cfg\['nn_data'\]\['rollout_tree'\]"):
        get_microbatch_iterator(tree_batch(), _cfg(), 1, None, dynamic_cp=(None, None))


def test_one_host_read_per_microbatch():
    from nn_data.diagnostics import HostSyncCounter

    shards, _ = tree_batch().shard_by_batch_size(1, sequence_packing_args=_args())
    for mb in shards[0].get_batch(0).make_microbatch_iterator_for_packable_sequences():
        with HostSyncCounter() as syncs:
            process_microbatch(mb, "input_lengths", M, 1, None, pack_sequences=True,
                               options=PackOptions(rollout_tree=True))
        assert syncs.count == 1, syncs.calls


@pytest.fixture(scope="module")
def megatron_state():
    with one_rank_parallel_state():
        yield


@needs_megatron_models
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_tree_step_through_the_drop_in_equals_each_rollout_alone_float64(megatron_state):
    from tests.megatron_data.shared_prefix_dropin_cases import case_dropin_step

    result = case_dropin_step(__name__)
    assert result["kinds"] == ["rollout-tree"] and result["microbatches"] > 1
    assert result["logits"] < 1e-10 and result["logprobs"] < 1e-10 and result["grad"] < 1e-10, result


@needs_megatron_models
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_model_without_nn_datas_attention_is_refused_for_a_tree_naming_the_fix(megatron_state):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel

    from nn_data.models.tiny_megatron import tiny_gpt_config

    stock = GPTModel(tiny_gpt_config(), get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                     max_sequence_length=64)
    _, mbs = planned_microbatches()
    with pytest.raises(PackingError, match=r"^a rollout-tree microbatch needs nn_data's attention \(each node sees "
                                           r"the shared tokens of every ancestor, .* core attention "
                                           r"DotProductAttention, which cannot honour the prefix rule: build the "
                                           r"GPTModel with nn_data.adapters.megatron_gpt_layer_spec\(\.\.\.\), or "
                                           r"unset cfg\['nn_data'\]\['rollout_tree'\]; a variable-length kernel of "
                                           r"the model's own runs it exactly on the record's key/value buffer "
                                           r"\(microbatch.shared_prefix.kv.gather\(key\) / .gather\(value\) with "
                                           r"microbatch.packed_seq_params, bottom-right causal: docs/nemo-rl.md\), "
                                           r"never on the T packed keys$"):
        forward_shared_prefix(stock, mbs[0])
    # Under CP the record has no buffer (TransformerEngine's CP splits keys as queries): nn_data's attention only.
    record = mbs[0].shared_prefix
    info = record.info.finished()._replace(cp=record.info.cp._replace(size=2, rank=1))
    sharded = dataclasses.replace(mbs[0], shared_prefix=record._replace(info=info, kv=None))
    with pytest.raises(PackingError, match=r"^a rollout-tree microbatch needs nn_data's attention .*; at cp_size=2 "
                                           r"there is no key/value buffer for a variable-length kernel "
                                           r"\(TransformerEngine's context parallelism splits keys and values as it "
                                           r"splits the queries\), so nn_data's attention is the only way$"):
        forward_shared_prefix(stock, sharded)
    # At CP 1 under pad_full_seq_to without kv_capacity: no buffer either, and the message names the key.
    unsized = dataclasses.replace(mbs[0], shared_prefix=mbs[0].shared_prefix._replace(kv=None))
    with pytest.raises(PackingError, match=r"^a rollout-tree microbatch needs nn_data's attention .*; the microbatch "
                                           r"has no key/value buffer for a variable-length kernel: under "
                                           r"pad_full_seq_to set cfg\['nn_data'\]\['kv_capacity'\] to the buffer's "
                                           r"one length for the run \(docs/nemo-rl.md\)$"):
        forward_shared_prefix(stock, unsized)


def test_find_without_the_sharding_planner_finds_the_microbatchs_tree():
    # no planner wrote parent / branch_at: process_microbatch finds the tree from the microbatch's own token ids,
    # and packs what the true tree packs
    plain = tree_batch(unique=True)
    given = process_microbatch(plain, "input_lengths", M, 1, None, pack_sequences=True,
                               options=PackOptions(rollout_tree=True))
    del plain["parent"], plain["branch_at"]
    found = process_microbatch(plain, "input_lengths", M, 1, None, pack_sequences=True,
                               options=PackOptions(rollout_tree="find"))
    assert torch.equal(found.input_ids, given.input_ids) and torch.equal(found.position_ids, given.position_ids)
    assert found.shared_prefix.layout.parent.tolist() == PARENT
    assert found.shared_prefix.layout.branch_at.tolist() == BRANCH_AT
    with pytest.raises(PackingError, match=r"^'parent' not found in the batch .* needs the \[B\] parents and branch "
                                           r"points"):  # True names the keys it needs
        process_microbatch(plain, "input_lengths", M, 1, None, pack_sequences=True,
                           options=PackOptions(rollout_tree=True))


def test_the_records_te_fields_give_each_rollout_its_attention_alone_float64():
    """Float64: attention through a tree microbatch's key/value buffer (``shared_prefix.kv.gather``) on its
    PackedSeqParams' q/kv boundaries, bottom-right causal (tests/support/shared_prefix_kv_cases.py's loop reference
    for TransformerEngine's THD kernel), equals each rollout's causal attention run alone at every one of its tokens
    (1e-12), for trees of depth 1 to 3."""
    import torch.nn.functional as F

    from tests.support import shared_prefix_kv_cases as kv_cases

    _, mbs = planned_microbatches()
    gen = torch.Generator().manual_seed(3)
    deepest = 0
    for mb in mbs:
        record, params = mb.shared_prefix, mb.packed_seq_params
        layout, kv = record.layout, record.kv
        assert params.cu_seqlens_kv is kv.cu_seqlens_kv and params.cu_seqlens_q is kv.cu_seqlens_q
        assert params.max_seqlen_q == layout.total and params.max_seqlen_kv == kv.max_seqlen_kv
        q, k, v = (torch.randn(layout.total, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
        got = kv_cases.varlen_reference(q, kv.gather(k), kv.gather(v), params.cu_seqlens_q, params.cu_seqlens_kv)
        where, _ = layout.row_places(layout.row_len)  # [B, S] packed place of each rollout token
        for b, n in enumerate(layout.seq_lengths.tolist()):
            at = where[b, :n]
            alone = F.scaled_dot_product_attention(*(x[at].transpose(0, 1)[None] for x in (q, k, v)),
                                                   is_causal=True)[0].transpose(0, 1)  # [n, 2, 8]
            torch.testing.assert_close(got[at], alone, rtol=0, atol=1e-12)
        parent = layout.parent.tolist()
        for b in range(len(parent)):
            d, up = 0, b
            while parent[up] >= 0:
                d, up = d + 1, parent[up]
            deepest = max(deepest, d)
    assert deepest >= 2  # a node below a node below a root, not only the GRPO-like star


@pytest.mark.parametrize("options, fields", [
    (PackOptions(shared_prefix=True), {"group_ids": [7, 7], "prefix_lengths": [2, 2]}),
    (PackOptions(rollout_tree=True), {"parent": [-1, 0], "branch_at": [0, 2]}),
], ids=["groups", "tree"])
def test_a_last_rollout_without_own_tokens_under_pad_full_seq_to_gets_its_buffer(options, fields):
    """The last rollout shares all its tokens and ``pad_full_seq_to`` extends its empty slot with padding: the
    record's buffer still holds that slot's path keys (the need counts every non-empty padded slot), and
    every real query's attention over it equals its rollout's alone (float64)."""
    import torch.nn.functional as F

    from tests.support import shared_prefix_kv_cases as kv_cases

    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]])
    data = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([4, 2]),
                           **{k: torch.tensor(v) for k, v in fields.items()})
    options = dataclasses.replace(options, kv_capacity=16)  # the run's K, required under pad_full_seq_to
    mb = process_microbatch(data, "input_lengths", 1, 1, 10, pack_sequences=True, options=options)
    layout, kv, params = mb.shared_prefix.layout, mb.shared_prefix.kv, mb.packed_seq_params
    assert layout.total == 10 and kv.cu_seqlens_kv.tolist()[-2] == 14 and kv.max_seqlen_kv == 16  # 10 + 2 + 2
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(10, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    got = kv_cases.varlen_reference(q, kv.gather(k), kv.gather(v), params.cu_seqlens_q, params.cu_seqlens_kv)
    where, _ = layout.row_places(4)
    for b, n in enumerate([4, 2]):
        at = where[b, :n]
        alone = F.scaled_dot_product_attention(*(x[at].transpose(0, 1)[None] for x in (q, k, v)),
                                               is_causal=True)[0].transpose(0, 1)  # [n, 2, 8]
        torch.testing.assert_close(got[at], alone, rtol=0, atol=1e-12)
