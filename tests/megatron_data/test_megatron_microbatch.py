"""Tier: pure CPU, single process (CP ranks other than 0 are simulated by patching the
parallel_state lookup; the real parallel_state is exercised in
tests/multiprocess/test_megatron_distributed.py).

process_microbatch (packed, self-packing VLM, unpacked), routed experts and the R3 helpers,
get_ltor_masks_and_position_ids, the host-sync budget of the pack path.
"""

from __future__ import annotations

import pytest
import torch

from nn_data.nemo_rl import megatron_data
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.errors import PackingError
from nn_data.nemo_rl.megatron_data import (
    _fill_routed_experts_padding,
    _make_r3_trace_token_identity,
    _pack_sequences_for_megatron,
    _prepare_vlm_batch_for_megatron,
    _shard_routed_experts_for_cp,
    _verify_r3_trace_cp_token_alignment,
    get_ltor_masks_and_position_ids,
    process_microbatch,
)
from nn_data.testing.coded import coded_batch
from nn_data.testing.reference import reference_pack, reference_shard
from nn_data.diagnostics import HostSyncCounter

LENGTHS, S = [12, 3, 8, 1], 12


def _batch(lengths=LENGTHS, seq_len=S, routed=True, mtp=True):
    data = BatchedDataDict(input_ids=coded_batch(lengths, seq_len), input_lengths=torch.tensor(lengths))
    if routed:
        data["routed_experts"] = coded_batch(lengths, seq_len, (2, 3))
    if mtp:
        data["mtp_loss_mask"] = (coded_batch(lengths, seq_len) % 3 != 0).float()
    return data


@pytest.fixture
def cp2(monkeypatch):
    """Simulate CP rank ``r`` of 2 for process_microbatch."""
    def set_rank(rank):  # NeMo-RL's patch points: the module-level CP getters
        monkeypatch.setattr(megatron_data, "get_context_parallel_rank", lambda: rank)
        monkeypatch.setattr(megatron_data, "get_context_parallel_world_size", lambda: 2)
    return set_rank


@pytest.mark.parametrize("rank", [0, 1])
def test_packed_path_packs_every_tensor_with_one_layout(cp2, rank):
    cp2(rank)
    data = _batch()
    out = process_microbatch(data, "input_lengths", 4, 1, 40, pack_sequences=True)
    ref = reference_pack(data["input_ids"], LENGTHS, 4, 1, 40)
    assert torch.equal(out.input_ids, ref.packed)
    assert torch.equal(out.cu_seqlens_padded, ref.cu_seqlens_padded)  # [0, 12, 16, 24, 40]
    assert torch.equal(out.input_ids_cp_sharded, reference_shard(ref.packed, ref.cu_seqlens_padded, 2, rank))
    assert out.attention_mask is None and out.position_ids is None
    mtp = reference_pack(data["mtp_loss_mask"], LENGTHS, 4, 1, 40).packed
    assert torch.equal(out.mtp_loss_mask, reference_shard(mtp, ref.cu_seqlens_padded, 2, rank))
    routes = reference_pack(data["routed_experts"], LENGTHS, 4, 1, 40, fill=torch.arange(3)).packed
    assert torch.equal(out.routed_experts, routes)
    assert torch.equal(out.routed_experts_cp_sharded, reference_shard(routes, ref.cu_seqlens_padded, 2, rank))
    assert out.packed_seq_params.max_seqlen_q == 16 and out.packed_seq_params.cu_seqlens_q is out.cu_seqlens_padded


def test_routed_experts_follow_the_tokens_zigzag(cp2):
    cp2(1)
    out = process_microbatch(_batch(), "input_lengths", 4, 1, 40, pack_sequences=True)
    ids, routes = out.input_ids_cp_sharded[0], out.routed_experts_cp_sharded[0]  # [T/C], [T/C, 2, 3]
    real = ids > 0
    assert real.any()
    assert torch.equal(routes[real][:, 0, 0], ids[real] * 100)  # each route sits on its own token
    assert torch.equal(routes[~real], torch.arange(3).expand(int((~real).sum()), 2, 3))  # pads: arange(topk)


def test_shard_routed_experts_for_cp_matches_the_microbatch_path(cp2):
    cp2(0)
    data = _batch()
    out = process_microbatch(data, "input_lengths", 4, 1, 40, pack_sequences=True)
    identity = _make_r3_trace_token_identity(data["input_ids"], data["input_lengths"])
    cu = torch.tensor([0, 12, 15, 23, 24], dtype=torch.int32)
    routed, routed_cp, ident, ident_cp = _shard_routed_experts_for_cp(
        data["routed_experts"], identity, data["input_lengths"], cu, out.cu_seqlens_padded, 0, 2)
    assert torch.equal(routed, out.routed_experts) and torch.equal(routed_cp, out.routed_experts_cp_sharded)
    assert ident.shape == (1, 40, 3) and ident_cp.shape == (1, 20, 3)
    ref_ident = reference_pack(identity, LENGTHS, 4, 1, 40).packed
    assert torch.equal(ident, ref_ident)
    assert torch.equal(ident_cp, reference_shard(ref_ident, out.cu_seqlens_padded, 2, 0))
    assert _shard_routed_experts_for_cp(None, None, data["input_lengths"], cu, None, 0, 1) == (None,) * 4


@pytest.mark.parametrize("bounds, cp, match", [
    ([0, 12, 16, 24, 30], 2, r"segment 3 of cu_seqlens_padded is 6 tokens long, not a multiple of 2\*cp_size=4.*silently drop"),
    ([0, 12, 14, 24, 28], 1, r"seq_lengths\[1\] = 3 does not fit its segment of cu_seqlens_padded \(2 long\)"),
    ([1, 12, 16, 24, 28], 1, r"cu_seqlens_padded=\[1, 12, 16, 24, 28\] is invalid for a packed length T=28; it must "
                             r"start at 0, never decrease"),
])
def test_shard_routed_experts_errors(bounds, cp, match):
    with pytest.raises(PackingError, match=match):
        _shard_routed_experts_for_cp(coded_batch(LENGTHS, S, (2, 3)), None, torch.tensor(LENGTHS), torch.tensor(bounds),
                                     torch.tensor(bounds), 0, cp)


def test_fill_routed_experts_padding():
    routes = coded_batch([2, 0], 3, (2, 3))
    out = _fill_routed_experts_padding(routes, torch.tensor([2, 0]))
    assert torch.equal(out[0, :2], routes[0, :2])
    assert torch.equal(out[0, 2], torch.arange(3).expand(2, 3)) and torch.equal(out[1], torch.arange(3).expand(3, 2, 3))
    with pytest.raises(ValueError, match=r"routed_experts must have shape \[batch, seq, num_moe_layers, topk\]"):
        _fill_routed_experts_padding(routes[..., 0], torch.tensor([2, 0]))
    with pytest.raises(ValueError, match=r"seq_lengths must have one entry per routed_experts row"):
        _fill_routed_experts_padding(routes, torch.tensor([2]))


def test_token_identity_worked_example():
    ident = _make_r3_trace_token_identity(torch.zeros(2, 3), torch.tensor([2, 0]))
    assert ident.dtype == torch.int32
    assert ident.tolist() == [[[0, 0, 1], [0, 1, 1], [0, 2, 0]], [[1, 0, 0], [1, 1, 0], [1, 2, 0]]]
    assert _make_r3_trace_token_identity(torch.zeros(1, 2))[..., 2].tolist() == [[1, 1]]


# ---- R3 forward verifier (environment switch) ------------------------------------------------

def _identity_inputs():
    data = _batch()
    ident = _make_r3_trace_token_identity(data["input_ids"], data["input_lengths"])
    packed, local, _, cu, cu_pad = _pack_sequences_for_megatron(data["input_ids"], data["input_lengths"], 4)
    routed, routed_cp, _, ident_cp = _shard_routed_experts_for_cp(data["routed_experts"], ident,
                                                                  data["input_lengths"], cu, cu_pad, 0, 1)
    return dict(source_input_ids=data["input_ids"], source_routed_experts=data["routed_experts"],
                input_ids_cp_sharded=local, routed_experts_cp_sharded=routed_cp, token_identity_cp_sharded=ident_cp)


@pytest.mark.parametrize("env", [{"NN_DATA_R3_VERIFY": "1"},
                                 {"NRL_R3_TRACE": "1", "NRL_R3_TRACE_VERIFY_FORWARD": "true"}])
def test_r3_verifier_checks_every_valid_token_when_switched_on(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert _verify_r3_trace_cp_token_alignment(**_identity_inputs()) == sum(LENGTHS)


def test_r3_verifier_is_off_by_default(monkeypatch):
    for key in ("NN_DATA_R3_VERIFY", "NRL_R3_TRACE", "NRL_R3_TRACE_VERIFY_FORWARD"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NRL_R3_TRACE", "1")  # tracing alone does not verify
    assert _verify_r3_trace_cp_token_alignment(**_identity_inputs()) is None


@pytest.mark.parametrize("corrupt, what", [("input_ids_cp_sharded", "input_ids"),
                                           ("routed_experts_cp_sharded", "routed_experts")])
def test_r3_verifier_finds_misaligned_tokens(monkeypatch, corrupt, what):
    monkeypatch.setenv("NN_DATA_R3_VERIFY", "on")
    inputs = _identity_inputs()
    swapped = inputs[corrupt].clone()
    swapped[0, [13, 14]] = swapped[0, [14, 13]]  # two valid tokens of sequence 1 trade places
    inputs[corrupt] = swapped
    match = (rf"verifier found {what} that do not match their source \[batch_idx, token_pos\] identities\. "
             r"\(2 CP-local tokens; the first at local position 13, identity \[1, 1, 1\]\)")
    with pytest.raises(RuntimeError, match=match):
        _verify_r3_trace_cp_token_alignment(**inputs)


def test_r3_verifier_shape_errors(monkeypatch):
    monkeypatch.setenv("NN_DATA_R3_VERIFY", "1")
    inputs = _identity_inputs()
    with pytest.raises(RuntimeError, match="routed_experts and token identity tensors to be present together"):
        _verify_r3_trace_cp_token_alignment(**{**inputs, "routed_experts_cp_sharded": None})
    with pytest.raises(RuntimeError, match=r"trailing \[batch_idx, token_pos, valid\] dimension; got \(1, 28, 2\)"):
        _verify_r3_trace_cp_token_alignment(
            **{**inputs, "token_identity_cp_sharded": inputs["token_identity_cp_sharded"][..., :2]})
    with pytest.raises(RuntimeError, match="different token counts: identity=28 tokens=27"):
        _verify_r3_trace_cp_token_alignment(
            **{**inputs, "input_ids_cp_sharded": inputs["input_ids_cp_sharded"][:, :-1]})


@pytest.mark.parametrize("pack", [True, False])
def test_process_microbatch_runs_the_verifier_on_both_paths(monkeypatch, cp2, pack):
    monkeypatch.setenv("NN_DATA_R3_VERIFY", "1")
    cp2(1)
    seen = []
    real = megatron_data._verify_r3_trace_cp_token_alignment
    monkeypatch.setattr(megatron_data, "_verify_r3_trace_cp_token_alignment",
                        lambda **kw: seen.append(real(**kw)))
    process_microbatch(_batch(), "input_lengths", 4, 1, 40, pack_sequences=pack)
    assert seen == ([12] if pack else [sum(LENGTHS)])  # CP rank 1 holds 6 + 2 + 4 + 0 of the 24 valid tokens


# ---- unpacked path ----------------------------------------------------------------------------

def test_unpacked_path_builds_the_causal_mask_and_positions():
    data = _batch()
    out = process_microbatch(data)
    assert out.input_ids is data["input_ids"] and out.input_ids_cp_sharded is data["input_ids"]
    assert out.attention_mask.shape == (1, 1, S, S) and out.attention_mask.dtype == torch.bool
    assert torch.equal(out.attention_mask[0, 0], ~torch.ones(S, S, dtype=torch.bool).tril())  # True = masked
    assert torch.equal(out.position_ids, torch.arange(S).expand(4, S))
    assert out.packed_seq_params is None and out.cu_seqlens_padded is None
    assert out.mtp_loss_mask is data["mtp_loss_mask"]
    assert torch.equal(out.routed_experts, _fill_routed_experts_padding(data["routed_experts"], data["input_lengths"]))
    assert out.routed_experts_cp_sharded is out.routed_experts


def test_unpacked_routed_experts_need_input_lengths():
    data = _batch()
    del data["input_lengths"]
    with pytest.raises(ValueError, match="routed_experts requires input_lengths"):
        process_microbatch(data)


def _ltor_loop(data, eod, pad, reset_pos, reset_att, eod_loss, pad_loss):
    """Megatron-LM's loop semantics (EOD tokens end documents), as a reference."""
    rows, cols = data.shape
    att = torch.ones(rows if reset_att else 1, cols, cols).tril()
    loss = torch.ones(rows, cols)
    pos = torch.arange(cols).repeat(rows, 1)
    for b in range(rows):
        prev = 0
        for i in range(cols):
            if data[b, i] == eod:
                if reset_att:
                    att[b, i + 1:, : i + 1] = 0
                if reset_pos:
                    pos[b, i + 1:] -= i + 1 - prev
                    prev = i + 1
            if (eod_loss and data[b, i] == eod) or (pad_loss and data[b, i] == pad):
                loss[b, i] = 0
    return att[:, None] < 0.5, loss, pos


@pytest.mark.parametrize("flags", [(False, False, False, False), (True, True, True, True), (True, False, False, True),
                                   (False, True, True, False)])
def test_ltor_masks_match_the_loop_semantics(flags):
    data = torch.tensor([[5, 0, 7, 8, 0, 9], [1, 2, 3, 0, 0, 4]])
    got = get_ltor_masks_and_position_ids(data, 0, 9, *flags)
    want = _ltor_loop(data, 0, 9, *flags)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    kw = get_ltor_masks_and_position_ids(data=data, eod_token=0, pad_token=9, reset_position_ids=flags[0],
                                         reset_attention_mask=flags[1], eod_mask_loss=flags[2], pad_mask_loss=flags[3])
    assert all(torch.equal(a, b) for a, b in zip(got, kw))


def test_ltor_rejects_bad_data():
    with pytest.raises(PackingError, match=r"data must be a \[B, S\] tensor"):
        get_ltor_masks_and_position_ids(torch.zeros(3), 0)


# ---- self-packing (VLM) path -------------------------------------------------------------------

def test_vlm_deficit_goes_to_the_last_sequence():
    ids = coded_batch([3, 5], 6)
    packed, ids_2d, mask, params, cu, cu_pad = _prepare_vlm_batch_for_megatron(ids, torch.tensor([3, 5]), 4, 16)
    assert cu is None and cu_pad.tolist() == [0, 4, 16] and cu_pad.dtype == torch.int32
    assert ids_2d.shape == (2, 12) and torch.equal(ids_2d[:, :6], ids) and ids_2d[:, 6:].eq(0).all()
    assert mask.tolist() == [[True] * 4 + [False] * 8, [True] * 12]
    assert packed.tolist() == [ids[0, :4].tolist() + ids[1].tolist() + [0] * 6]  # the model's own packing
    assert params.max_seqlen_q == 12 and params.cu_seqlens_kv_padded is cu_pad and params.qkv_format == "thd"


def test_vlm_without_target_and_with_wide_rows():
    ids = coded_batch([3, 5], 16)
    packed, ids_2d, mask, params, _, cu_pad = _prepare_vlm_batch_for_megatron(ids, torch.tensor([3, 5]), 4)
    assert ids_2d.shape == (2, 8) and torch.equal(ids_2d, ids[:, :8])  # columns past max(padded) are cut
    assert cu_pad.tolist() == [0, 4, 12] and packed.shape == (1, 12) and params.max_seqlen_q == 8
    assert mask.sum(1).tolist() == [4, 8]


@pytest.mark.parametrize("target, match", [(8, r"pad_full_seq_to \(8\) < natural padded sum \(12\)"),
                                           (14, r"deficit \(2\) must be a multiple of "
                                                r"pad_individual_seqs_to_multiple_of \(4\)")])
def test_vlm_deficit_errors(target, match):
    with pytest.raises(AssertionError, match=match):
        _prepare_vlm_batch_for_megatron(coded_batch([3, 5], 6), torch.tensor([3, 5]), 4, target)


def test_vlm_rejects_lengths_past_the_row():
    with pytest.raises(PackingError, match=r"seq_lengths\[1\] = 7 is outside \[0, S=6\]"):
        _prepare_vlm_batch_for_megatron(coded_batch([3, 5], 6), torch.tensor([3, 7]), 4)


def test_process_microbatch_delegates_packing_to_the_model():
    data = _batch(routed=False)
    out = process_microbatch(data, "input_lengths", 4, 1, 40, pack_sequences=True, delegate_pack_to_model=True,
                             delegate_mtp_loss_mask_to_model=True)
    assert out.input_ids.shape == (1, 40) and out.input_ids_cp_sharded.shape == (4, 16)
    assert out.cu_seqlens_padded.tolist() == [0, 12, 16, 24, 40]
    assert out.attention_mask.sum(1).tolist() == [12, 4, 8, 16]
    expected = torch.zeros(4, 16)
    expected[:, :12] = data["mtp_loss_mask"]
    assert torch.equal(out.mtp_loss_mask, expected * out.attention_mask)
    with pytest.raises(NotImplementedError, match="Router replay"):
        process_microbatch(_batch(), "input_lengths", 4, 1, 40, pack_sequences=True, delegate_pack_to_model=True,
                           delegate_mtp_loss_mask_to_model=True)


# ---- arguments and the host-sync budget -------------------------------------------------------

@pytest.mark.parametrize("key, match", [(None, "seq_length_key must be provided"),
                                        ("lens", "lens not found in data_dict")])
def test_packed_path_argument_errors(key, match):
    with pytest.raises(AssertionError, match=match):
        process_microbatch(_batch(), key, 4, pack_sequences=True)


def test_routed_experts_must_be_4d():
    data = _batch()
    data["routed_experts"] = data["routed_experts"][..., 0]
    with pytest.raises(ValueError, match=r"\[batch, seq, num_moe_layers, topk\].*got \(4, 12, 2\)"):
        process_microbatch(data, "input_lengths", 4, pack_sequences=True)


def test_straggler_timer_wraps_the_work():
    calls = []

    class Timer:
        def __call__(self, bdata=False):
            calls.append(bdata)
            return self

        def __enter__(self):
            calls.append("enter")

        def __exit__(self, *exc):
            calls.append("exit")

    process_microbatch(_batch(), "input_lengths", 4, pack_sequences=True, straggler_timer=Timer())
    assert calls == [True, "enter", "exit"]


@pytest.mark.parametrize("pad_full", [None, 40])
def test_pack_path_syncs_the_host_at_most_once_per_microbatch(cp2, monkeypatch, pad_full):
    monkeypatch.delenv("NN_DATA_R3_VERIFY", raising=False)
    cp2(1)
    data = _batch()
    process_microbatch(data, "input_lengths", 4, 1, pad_full, pack_sequences=True)  # warm caches
    counter = HostSyncCounter()
    with counter:
        for _ in range(3):
            process_microbatch(data, "input_lengths", 4, 1, pad_full, pack_sequences=True)
    assert counter.count <= 3, counter.calls


def test_the_sync_counter_sees_a_loop_packer():
    counter = HostSyncCounter()
    lengths = torch.tensor(LENGTHS)
    with counter:
        for b in range(4):  # NeMo-RL's loop reads each length with .item()
            lengths[b].item()
        bool(lengths.sum() > 0)
        torch.nonzero(lengths)
    assert counter.count == 6


def test_vlm_with_no_sequence_is_nemo_rls_empty_batch():
    packed, ids_2d, mask, params, cu, cu_pad = _prepare_vlm_batch_for_megatron(
        torch.zeros(0, 6, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 4, 16)
    assert packed.shape == (1, 0) and ids_2d.shape == (0, 0) and mask.shape == (0, 0)
    assert cu is None and cu_pad.tolist() == [0] and params.max_seqlen_q == 0
