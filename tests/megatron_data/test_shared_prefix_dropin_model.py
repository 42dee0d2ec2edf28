"""Tier: pure CPU, single process (a gloo world of one rank on 127.0.0.1 for megatron-core's parallel_state).

A shared-prefix GRPO step through the NeMo-RL megatron drop-in end to end: shard_by_batch_size plans whole
groups, get_microbatch_iterator packs each microbatch with each group's prompt once (the record: packed ids,
rollout positions, PackedSeqParams with TransformerEngine's distinct q/kv boundaries, padding mask, the
shared-prefix layout and prefix rule), forward_shared_prefix runs the tiny GPTModel built with nn_data's layer
spec on it, and from_parallel_logits_to_logprobs_shared_prefix gives [B, S-1] per rollout (the hidden-state
sibling the same from forward_shared_prefix(..., output="hidden")). In float64 the
logits, the log-probs and the parameter gradients equal every rollout run alone through megatron-core's stock
unpacked path (1e-10). A stock model is refused by name; so are the companions without a shared-prefix form.
"""

from __future__ import annotations

import pytest
import torch

from nn_data.diagnostics import HostSyncCounter
from nn_data.errors import PackingError
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.nemo_rl.megatron_data import PackOptions, get_microbatch_iterator, process_microbatch
from nn_data.nemo_rl.megatron_data.tree_model import (
    forward_shared_prefix, from_parallel_hidden_states_to_logprobs_shared_prefix,
    from_parallel_logits_to_logprobs_shared_prefix,
)
from tests.support.megatron_config import megatron_cfg
from tests.support.megatron_release import needs_megatron_models, one_rank_parallel_state

S, M, BUDGET, VOCAB = 24, 4, 32, 97
# 5 groups (sizes 3, 1, 4, 2, 2), prompts 6, 10, 3, 0, 13 tokens, rows interleaved; an empty response (row 4)
GROUPS = [0, 1, 0, 2, 2, 0, 3, 2, 4, 3, 2, 4]
PROMPT = {0: 6, 1: 10, 2: 3, 3: 0, 4: 13}
RESPONSES = [4, 9, 1, 7, 0, 12, 5, 3, 8, 2, 6, 11]


def grpo_batch(seed: int = 0) -> BatchedDataDict:
    """Row b: its group's prompt (drawn once per group), then tokens of its own; 0 past its length."""
    gen = torch.Generator().manual_seed(seed)
    prefix = [PROMPT[g] for g in GROUPS]
    lengths = [p + r for p, r in zip(prefix, RESPONSES)]
    prompts = {g: torch.randint(1, VOCAB, (S,), generator=gen) for g in PROMPT}
    ids = torch.zeros(len(GROUPS), S, dtype=torch.long)
    for b, (g, p, n) in enumerate(zip(GROUPS, prefix, lengths)):
        ids[b, :p] = prompts[g][:p]
        ids[b, p:n] = torch.randint(1, VOCAB, (n - p,), generator=gen)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(lengths), group_ids=torch.tensor(GROUPS),
                           prefix_lengths=torch.tensor(prefix), names=[f"r{b}" for b in range(len(GROUPS))])


def _args() -> dict:
    return {"max_tokens_per_microbatch": BUDGET, "input_key": "input_ids", "input_lengths_key": "input_lengths",
            "algorithm": "nn_data_balanced", "sequence_length_pad_multiple": M, "shared_prefix": True}


def _cfg(cp: int = 1, **nn_data) -> dict:
    return {"sequence_packing": {"enabled": True}, "dynamic_batching": {"enabled": False},
            "megatron_cfg": megatron_cfg(pp=1, cp=cp), "make_sequence_length_divisible_by": M,
            "nn_data": {"shared_prefix": True, "device": "cpu", **nn_data}}


def planned_microbatches(cp: int = 1):
    """The step's microbatches as the iterator yields them (one DP rank, one global batch; ``cp``: the CP
    size of megatron-core's parallel_state, which the iterator reads)."""
    shards, _ = grpo_batch().shard_by_batch_size(1, sequence_packing_args=_args())
    batch = shards[0].get_batch(0)
    iterator, count, _, _, _ = get_microbatch_iterator(batch, _cfg(cp), 1, None)
    mbs = list(iterator)
    assert len(mbs) == count > 1
    return batch, mbs


def _round_up(n: int) -> int:
    return -(-n // M) * M


def reference_record(ids, lengths, prefix, groups):
    """Loop reference: the packed ids and positions, the padding, and TE's key count K."""
    seen, packed, positions, padding, kv = set(), [], [], [], 0
    for b, (n, p, g) in enumerate(zip(lengths, prefix, groups)):
        slots = [] if g in seen else [(0, p)]
        seen.add(g)
        slots.append((p, n))
        kv += p if n > p else 0
        for lo, hi in slots:
            width = _round_up(hi - lo)
            packed += ids[b, lo:hi].tolist() + [0] * (width - (hi - lo))
            positions += list(range(lo, lo + width))
            padding += [False] * (hi - lo) + [True] * (width - (hi - lo))
    return packed, positions, padding, len(packed) + kv


def test_the_record_packs_each_prompt_once_with_rollout_positions():
    batch, mbs = planned_microbatches()
    for mb, planned in zip(mbs, batch.micro_batch_lengths[0]):
        data = mb.data_dict
        ref_ids, ref_pos, ref_pad, ref_kv = reference_record(
            data["input_ids"], data["input_lengths"].tolist(), data["prefix_lengths"].tolist(), data["group_ids"].tolist())
        assert mb.input_ids.shape == (1, planned) and mb.input_ids.tolist() == [ref_ids]  # the plan's tokens
        assert mb.input_ids_cp_sharded is mb.input_ids and mb.attention_mask is None  # C = 1
        assert mb.position_ids.tolist() == [ref_pos] and mb.padding_mask.tolist() == [ref_pad]
        assert torch.equal(mb.cu_seqlens_padded, mb.shared_prefix.layout.layout.cu_seqlens_padded)
        params, rows = mb.packed_seq_params, data["input_ids"].shape[0]
        assert params.qkv_format == "thd" and params.cu_seqlens_q.shape == (2 * rows + 2,)
        assert params.cu_seqlens_q[-1] == planned and params.max_seqlen_q == planned
        kv = mb.shared_prefix.kv
        assert params.max_seqlen_kv == ref_kv == kv.max_seqlen_kv  # exact: the slack is empty
        assert params.cu_seqlens_kv[-2] == params.cu_seqlens_kv[-1] == ref_kv and bool(kv.kv_valid.all())
        assert params.cu_seqlens_kv is kv.cu_seqlens_kv and params.cu_seqlens_q is kv.cu_seqlens_q
        assert torch.equal(mb.shared_prefix.info.prefix.rule.positions, torch.tensor(ref_pos))


def test_one_host_read_per_microbatch():
    shards, _ = grpo_batch().shard_by_batch_size(1, sequence_packing_args=_args())
    mb = next(iter(shards[0].get_batch(0).make_microbatch_iterator_for_packable_sequences()))
    with HostSyncCounter() as syncs:
        process_microbatch(mb, "input_lengths", M, 1, None, pack_sequences=True, options=PackOptions(shared_prefix=True))
    assert syncs.count == 1, syncs.calls


@pytest.fixture(scope="module")
def megatron_state():
    with one_rank_parallel_state():
        yield


def _next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` logits of one rollout alone, ids ``[n]`` -> ``[n - 1]``."""
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@needs_megatron_models
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_grpo_step_through_the_drop_in_equals_each_rollout_alone_float64(megatron_state):
    from nn_data.models.tiny_megatron import forward_alone, tiny_gpt_config, tiny_gpt_model

    model = tiny_gpt_model(tiny_gpt_config(dtype=torch.float64), vocab=VOCAB)
    _, mbs = planned_microbatches()
    weights = torch.Generator().manual_seed(3)
    worst_logits = worst_lp = worst_hidden = 0.0
    packed_loss = alone_loss = hidden_loss = 0.0
    for mb in mbs:
        data = mb.data_dict
        ids, lengths = data["input_ids"], data["input_lengths"].tolist()
        logits = forward_shared_prefix(model, mb)  # [1, T, V]
        lp = from_parallel_logits_to_logprobs_shared_prefix(logits, mb.input_ids, mb.shared_prefix, S, 0, VOCAB, None)
        assert lp.shape == (len(lengths), S - 1) and lp.dtype == torch.float64
        hidden = forward_shared_prefix(model, mb, output="hidden")  # [T, 1, H]: no logits
        from_hidden = from_parallel_hidden_states_to_logprobs_shared_prefix(
            hidden, model.output_layer.weight, mb.input_ids, mb.shared_prefix, S, 0, VOCAB, None)
        assert hidden.shape[:2] == (mb.input_ids.shape[1], 1) and model.post_process
        worst_hidden = max(worst_hidden, float((from_hidden - lp).detach().abs().max()))
        rows = mb.shared_prefix.layout.unpack(logits)  # [B, S, V]
        w = torch.rand(lp.shape, generator=weights, dtype=torch.float64)
        packed_loss = packed_loss + (lp * w).sum()
        hidden_loss = hidden_loss + (from_hidden * w).sum()
        for b, n in enumerate(lengths):
            ref = forward_alone(model, ids[b : b + 1, :n])[0]  # [n, V]
            ref_lp = _next_token_logprobs(ref, ids[b, :n])  # [n - 1]
            worst_logits = max(worst_logits, float((rows[b, :n] - ref).detach().abs().max()))
            worst_lp = max(worst_lp, float((lp[b, : n - 1] - ref_lp).detach().abs().max()))
            assert not lp[b, n - 1:].any() and not rows[b, n:].any()
            alone_loss = alone_loss + (ref_lp * w[b, : n - 1]).sum()
    assert worst_logits < 1e-10 and worst_lp < 1e-10 and worst_hidden < 1e-10, (worst_logits, worst_lp, worst_hidden)
    model.zero_grad(set_to_none=True)
    packed_loss.backward()
    packed = _grads(model)
    model.zero_grad(set_to_none=True)
    hidden_loss.backward()
    hidden = _grads(model)
    model.zero_grad(set_to_none=True)
    alone_loss.backward()
    alone = _grads(model)
    assert packed.keys() == alone.keys() == hidden.keys() and packed
    assert all(float(g.abs().max()) > 0 for g in alone.values())  # every parameter's check means something
    worst_grad = max(float((packed[k] - alone[k]).abs().max()) for k in packed)
    worst_hidden_grad = max(float((hidden[k] - alone[k]).abs().max()) for k in hidden)
    assert worst_grad < 1e-10 and worst_hidden_grad < 1e-10, (worst_grad, worst_hidden_grad)


@needs_megatron_models
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_stock_megatron_model_is_refused_by_name(megatron_state):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel

    from nn_data.models.tiny_megatron import tiny_gpt_config

    stock = GPTModel(tiny_gpt_config(), get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                     max_sequence_length=64)
    _, mbs = planned_microbatches()
    with pytest.raises(PackingError, match=r"^a shared-prefix microbatch needs nn_data's attention .* core attention "
                                           r"DotProductAttention, which cannot honour the prefix rule: build the "
                                           r"GPTModel with .*, or unset cfg\['nn_data'\]\['shared_prefix'\]; a "
                                           r"variable-length kernel of the model's own runs it exactly on the "
                                           r"record's key/value buffer .*, never on the T packed keys$"):
        forward_shared_prefix(stock, mbs[0])


def test_refusals_name_what_has_no_shared_prefix_form():
    shards, _ = grpo_batch().shard_by_batch_size(1, sequence_packing_args=_args())
    mb = next(iter(shards[0].get_batch(0).make_microbatch_iterator_for_packable_sequences()))
    shared = PackOptions(shared_prefix=True)

    def process(data, options=shared, **kw):
        return process_microbatch(data, "input_lengths", M, 1, None, pack_sequences=kw.pop("pack", True),
                                  options=options, **kw)

    with pytest.raises(PackingError, match=r"needs cfg\['sequence_packing'\]\['enabled'\] = True$"):
        process(mb, pack=False)
    with pytest.raises(PackingError, match=r"^model_slices_context_parallel_inputs=True is not supported with "):
        process(mb, model_slices_context_parallel_inputs=True)
    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['compile'\]=True is not supported"):
        process(mb, options=PackOptions(shared_prefix=True, compile=True))
    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['buckets'\]=\(16, 32\) is not supported with "
                                           r"cfg\['nn_data'\]\['shared_prefix'\]"):
        process(mb, options=PackOptions(shared_prefix=True, buckets=[32, 16]))
    masked = BatchedDataDict({**mb, "mtp_loss_mask": torch.ones_like(mb["input_ids"])})
    with pytest.raises(PackingError, match=r"does not pack \['mtp_loss_mask'\] yet"):
        process(masked)
    with pytest.raises(PackingError, match=r"^get_microbatch_iterator\(\.\.\., dynamic_cp=\) packs each round's "
                                           r"sequences end to end and cannot share a prefix: unset cfg\['nn_data'\]\['shared_prefix'\]"):
        get_microbatch_iterator(grpo_batch(), _cfg(), 1, None, dynamic_cp=(None, None))
    with pytest.raises(PackingError, match=r"^microbatch has no shared_prefix record"):
        forward_shared_prefix(torch.nn.Linear(1, 1), process(mb, options=None))


def test_the_records_te_fields_give_the_prefix_rule_over_the_buffer():
    """Float64: attention through the record's key/value buffer (``shared_prefix.kv.gather``) on its
    PackedSeqParams' q/kv boundaries, bottom-right causal (a loop reference for TransformerEngine's THD
    kernel), equals the packed row under nn_data's dense prefix mask at every real query (1e-12)."""
    from tests.support import shared_prefix_kv_cases as kv_cases

    _, mbs = planned_microbatches()
    gen = torch.Generator().manual_seed(5)
    for mb in mbs:
        shared, kv, params = mb.shared_prefix.layout, mb.shared_prefix.kv, mb.packed_seq_params
        q, k, v = (torch.randn(shared.total, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
        got = kv_cases.varlen_reference(q, kv.gather(k), kv.gather(v), params.cu_seqlens_q, params.cu_seqlens_kv)
        want = kv_cases.dense_reference(q, k, v, shared)
        real = ~mb.padding_mask[0]
        torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-12)
