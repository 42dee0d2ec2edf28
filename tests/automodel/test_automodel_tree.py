"""Tier: pure CPU, single process (tiny transformers models built from a config, nothing downloaded).

Rollout trees through NeMo-RL's AutoModel data path: cfg["nn_data"]["rollout_tree"] makes process_microbatch's
packed microbatch a tree microbatch (every shared token once, no host read), and forward_rollout_tree runs a
transformers hybrid (LFM2's short convolutions, Qwen3-Next's gated delta net, Mamba-2) on it with each rollout's
logits equal to it run alone and each shared token computed once (torch's flop counter); the key's spellings and
refusals.
"""

from __future__ import annotations

from unittest.mock import MagicMock

import pytest
import torch

from nn_data.diagnostics import HostSyncCounter
from nn_data.errors import PackingError
from nn_data.models.tiny_hf import tiny_hf_model
from nn_data.nemo_rl import automodel_data
from nn_data.nemo_rl.automodel_tree import forward_rollout_tree
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.nemo_rl.megatron_data.tree_model import from_parallel_logits_to_logprobs_shared_prefix
from tests.models.adapter_cases import FLOAT32_STEP_TOL
from tests.models.tree_cases import TREES, tree_ids


def _tokenizer():
    tokenizer = MagicMock()
    tokenizer.eos_token_id = 2
    return tokenizer


def _cfg(total=64, **nn_data):
    return {"dtensor_cfg": {"sequence_parallel": False}, "dynamic_batching": {"enabled": False},
            "sequence_packing": {"enabled": True, "train_mb_tokens": total}, "nn_data": {"rollout_tree": True, **nn_data}}


def _tree_batch(tree, seq_len=16, seed=0, parent="parent", branch_at="branch_at"):
    ids = tree_ids(tree, torch.Generator().manual_seed(seed), seq_len)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(tree.lengths),
                           **{parent: torch.tensor(tree.parent), branch_at: torch.tensor(tree.branch_at)})


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_next", "mamba2"])
def test_a_hybrid_on_the_tree_microbatch_equals_each_rollout_alone(kind):
    """Trees of depth 1 to 4 (a forest, a fully shared child, an empty rollout): each rollout's logits, and its
    log-probs from the packed logits, equal it run alone (float64 model; the gated delta rule and Mamba-2's SSD
    compute in float32 whatever the dtype: FLOAT32_STEP_TOL, as tests/models/test_tree_models.py)."""
    model = tiny_hf_model(kind, dtype=torch.float64, moe=False)
    tol = 1e-10 if kind == "lfm2" else FLOAT32_STEP_TOL
    for seed, tree in enumerate(TREES):
        mb = _tree_batch(tree, seed=seed)
        ids, seq_len = mb["input_ids"], mb["input_ids"].shape[1]
        inputs = automodel_data.process_microbatch(mb, _tokenizer(), True, _cfg(), cp_size=1)
        assert inputs.shared_prefix.kind == "rollout-tree" and inputs.flash_attn_kwargs == {}
        with torch.no_grad():
            logits = forward_rollout_tree(model, inputs)  # [1, T, V]
            rows = inputs.shared_prefix.layout.unpack(logits, seq_len)  # [B, S, V]
            logprobs = from_parallel_logits_to_logprobs_shared_prefix(
                logits, inputs.input_ids, inputs.shared_prefix, seq_len, 0, logits.shape[-1], None)
            for b, n in enumerate(tree.lengths):
                if n == 0:
                    continue
                alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]  # [n, V]
                torch.testing.assert_close(rows[b, :n], alone, rtol=0, atol=tol)
                want = alone[:-1].log_softmax(-1).gather(1, ids[b, 1:n, None])[:, 0]
                torch.testing.assert_close(logprobs[b, : n - 1], want, rtol=0, atol=tol)


@pytest.mark.parametrize("kind", ["qwen3_next", "mamba2"])
def test_the_tree_microbatch_computes_each_shared_token_once(kind):
    """torch's flop counter over the model on the drop-in's tree microbatch / every rollout alone is at most
    1.35 x the token ratio + 0.02 (a GRPO group of a 96-token prompt and 6 rollouts, packed to exactly its
    tokens): the mixer layers too compute the prompt once, not once per rollout."""
    from torch.utils.flop_counter import FlopCounterMode

    from profiling.bench.bench_hybrid_trees import grpo_group, tree_ids as bench_ids

    lengths, parent, branch_at = grpo_group(prompt=96, group=6)
    model = tiny_hf_model(kind, moe=False)
    ids = bench_ids(lengths, parent, branch_at, model.config.vocab_size)
    tokens = int(lengths.sum() - branch_at.sum())
    mb = BatchedDataDict(input_ids=ids, input_lengths=lengths, parent=parent, branch_at=branch_at)
    inputs = automodel_data.process_microbatch(mb, _tokenizer(), True, _cfg(total=tokens), cp_size=1)
    assert inputs.seq_len == tokens

    def flops(fn) -> int:
        counter = FlopCounterMode(display=False)
        with counter:  # grad on: torch 2.15's module tracker fails on transformers 5.25's kernel layers in no_grad
            fn()
        return counter.get_total_flops()

    tree = flops(lambda: forward_rollout_tree(model, inputs))
    alone = flops(lambda: [model(input_ids=ids[b : b + 1, :n], use_cache=False) for b, n in
                           enumerate(lengths.tolist())])
    ratio = tokens / int(lengths.sum())
    assert tree / alone <= 1.35 * ratio + 0.02, (kind, ratio, tree / alone)


def test_a_planned_step_through_the_iterator_runs_every_rollout_as_if_alone():
    """The sharding planner (shard_by_batch_size with "nn_data_balanced" and "rollout_tree": each microbatch's
    parent / branch_at rewritten for its own rollouts) and the AutoModel iterator: every microbatch a tree
    microbatch, each rollout's logits through a tiny Mamba-2 (every layer a mixer) equal to it run alone."""
    from tests.megatron_data.test_rollout_tree_dropin import BUDGET, _args, tree_batch

    model = tiny_hf_model("mamba2", dtype=torch.float64, moe=False)
    shards, _ = tree_batch().shard_by_batch_size(1, sequence_packing_args=_args())
    batch = shards[0].get_batch(0)
    iterator, count = automodel_data.get_microbatch_iterator(batch, _cfg(total=BUDGET), 1, None, _tokenizer())
    seen = 0
    for mb in iterator:
        ids, lengths = mb.data_dict["input_ids"], mb.data_dict["input_lengths"].tolist()
        with torch.no_grad():
            rows = mb.processed_inputs.shared_prefix.layout.unpack(forward_rollout_tree(model, mb), ids.shape[1])
            for b, n in enumerate(lengths):
                alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]
                torch.testing.assert_close(rows[b, :n], alone, rtol=0, atol=FLOAT32_STEP_TOL)
        seen += len(lengths)
    assert count > 1 and seen == batch["input_ids"].shape[0]


def test_every_spelling_packs_the_same_tree_with_no_host_read():
    """True (the batch keys parent / branch_at), a dict naming other keys, "find" (the tree found from the ids:
    one read) and the GRPO spelling shared_prefix of a depth-1 tree give the same packed row and positions."""
    tree = TREES[0]  # depth 1: rollout 0 holds the prompt of 5 tokens
    mb = _tree_batch(tree)
    with HostSyncCounter() as syncs:
        want = automodel_data.process_microbatch(mb, _tokenizer(), True, _cfg(), cp_size=1)
    assert syncs.count == 0, syncs.calls
    assert want.input_ids.shape == want.position_ids.shape == (1, 64) and want.seq_len == 64
    assert want.position_ids[0, : sum(tree.lengths) - 10].tolist() == [*range(8), *range(5, 11)]
    named = _tree_batch(tree, parent="up", branch_at="shared")
    spellings = [(named, {"rollout_tree": {"parent_key": "up", "branch_at_key": "shared"}}),
                 (BatchedDataDict(input_ids=mb["input_ids"], input_lengths=mb["input_lengths"]), {"rollout_tree": "find"}),
                 (BatchedDataDict(input_ids=mb["input_ids"], input_lengths=mb["input_lengths"],
                                  group_ids=torch.tensor([4, 4, 4]), prefix_lengths=torch.tensor([5, 5, 5])),
                  {"rollout_tree": None, "shared_prefix": True})]
    for batch, keys in spellings:
        cfg = _cfg()
        cfg["nn_data"].update(keys)
        got = automodel_data.process_microbatch(batch, _tokenizer(), True, cfg, cp_size=1)
        valid = ~got.shared_prefix.info.padding_mask[0]
        assert torch.equal(got.input_ids[0, valid], want.input_ids[0, valid]), keys
        assert torch.equal(got.position_ids[0, valid], want.position_ids[0, valid]), keys


def test_what_the_tree_path_refuses_by_name():
    mb = _tree_batch(TREES[1])
    with pytest.raises(PackingError, match=r"rollout_tree'\] packs every shared prefix once and needs "
                                           r"cfg\['sequence_packing'\]\['enabled'\] = True"):
        automodel_data.process_microbatch(mb, _tokenizer(), False, _cfg(), cp_size=1)
    with pytest.raises(PackingError, match=r"without context parallelism on the AutoModel path \(cp_size=2\)"):
        automodel_data.process_microbatch(mb, _tokenizer(), True, _cfg(), cp_size=2)
    with pytest.raises(PackingError, match=r"cfg\['nn_data'\]\['compile'\] is not supported with"):
        automodel_data.process_microbatch(mb, _tokenizer(), True, _cfg(compile=True), cp_size=1)
    with pytest.raises(PackingError, match=r"'branch_at' not found in the batch"):
        automodel_data.process_microbatch(BatchedDataDict(input_ids=mb["input_ids"], input_lengths=mb["input_lengths"],
                                                          parent=mb["parent"]), _tokenizer(), True, _cfg(), 1)
    with pytest.raises(RuntimeError, match=r"packed total .* exceeds pad_full_seq_to=16"):  # a device assert: 23 tokens
        automodel_data.process_microbatch(mb, _tokenizer(), True, _cfg(total=16), cp_size=1)
    mb["branch_at"] = torch.tensor([0, 5, 13])  # rollout 2 (10 tokens) cannot share 13
    with pytest.raises(RuntimeError, match=r"every branch_at must be 0 for a root, else in \(branch_at\[parent\]"):
        automodel_data.process_microbatch(mb, _tokenizer(), True, _cfg(), cp_size=1)
    mb["branch_at"] = torch.tensor(TREES[1].branch_at)
    plain = automodel_data.process_microbatch(mb, _tokenizer(), True, _cfg(rollout_tree=None), cp_size=1)
    assert plain.shared_prefix is None
    with pytest.raises(PackingError, match=r"no shared_prefix record: it was not packed with cfg\['nn_data'\]"):
        forward_rollout_tree(tiny_hf_model("lfm2", moe=False), plain)
