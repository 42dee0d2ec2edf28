"""Tier: pure CPU, single process (tiny models built from a config, nothing downloaded:
nn_data.models.tiny_hf). Under CP (C = 2): tests/multiprocess/test_adapters_multiprocess.py.
Families: attention (llama, qwen2), sliding-window attention (mistral), gated delta nets
(qwen3_next with a sparse MoE, qwen3_5), Mamba-2 (mamba2; bamba with attention), short convolutions
(lfm2). The lengths hold a zero-length sequence and one of the full row length; B = 0 is its own test.

HFCausalLMAdapter on every model family transformers 5.24 runs on a CPU: packed against each
sequence alone, or refused; the boundaries it passes; no host sync; one compiled graph over a stream.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from nn_data.adapters import HFCausalLMAdapter
from nn_data.adapters.hf import boundary_kwargs
from nn_data.diagnostics import HostSyncCounter
from nn_data.errors import PackingError
from nn_data.layout import PackSpec, layout_from_lengths
from nn_data.models.tiny_hf import HYBRIDS, KINDS, tiny_hf_model
from nn_data.packed_forward import CPShare, PackedBounds, PackedForward, PackedInfo
from tests.models.adapter_cases import FLOAT32_STEP_TOL, coded_ids, token_loss
from tests.support.flex_release import needs_cpu_flex

LENGTHS = [5, 0, 12, 3, 9]
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _wrapped(model, **kwargs):
    return PackedForward(HFCausalLMAdapter(model, **kwargs), pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=48)


def _alone(model, ids):
    return model(input_ids=ids, use_cache=False).logits  # [1, n, V]


def _compare(model, wrapped, lengths=LENGTHS, grads=True):
    """Largest |packed - alone| over the outputs and (``grads``) the gradients of the token loss."""
    ids, lens = coded_ids(lengths, torch.Generator().manual_seed(3)), torch.tensor(lengths)
    model.zero_grad(set_to_none=True)
    out = wrapped(ids, lens)  # [B, S, V]
    if grads:
        token_loss(out.float(), ids, lens).backward()
        packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    worst_out, total = 0.0, 0.0
    for b, n in enumerate(lengths):
        assert not out[b, n:].any(), "output past a row's length must be 0"
        if n:
            alone = _alone(model, ids[b : b + 1, :n])
            worst_out = max(worst_out, float((out[b, :n] - alone[0]).detach().float().abs().max()))
            total = total + token_loss(alone.float(), ids[b : b + 1, :n], lens[b : b + 1])
    if not grads:
        return worst_out, 0.0
    total.backward()
    alone_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert packed.keys() == alone_grads.keys() and packed
    return worst_out, max(float((packed[n] - alone_grads[n]).abs().max()) for n in packed)


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("llama", "qwen2")])  # those two: test_hf_adapter.py
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_packed_equals_each_sequence_alone(kind, dtype):
    """Every family: outputs (and, in float32, every parameter's gradient) equal each sequence run alone."""
    model = tiny_hf_model(kind, dtype=dtype)
    worst_out, worst_grad = _compare(model, _wrapped(model), grads=dtype is torch.float32)
    assert worst_out < TOL[dtype] and worst_grad < TOL[dtype], (worst_out, worst_grad)


@pytest.mark.parametrize("kind", ["qwen3_next", "mamba2", "lfm2"])
def test_packed_equals_alone_in_float64(kind):
    """Float64 (Qwen3-Next without its MoE, whose grouped_mm refuses float64): exact outputs, except
    Mamba-2's, whose chunked scan computes in float32 whatever the model's dtype (and whose logits are
    float32); gradients to float32 rounding wherever a float32 step runs inside (the gated delta rule,
    Mamba-2's scan, the RMSNorms): FLOAT32_STEP_TOL says what that allows and why it depends on the row."""
    model = tiny_hf_model(kind, dtype=torch.float64, moe=False)
    worst_out, worst_grad = _compare(model, _wrapped(model))
    out_tol = FLOAT32_STEP_TOL if kind == "mamba2" else 1e-12
    assert worst_out < out_tol and worst_grad < FLOAT32_STEP_TOL, (worst_out, worst_grad)


@pytest.mark.parametrize("kind", HYBRIDS)
def test_without_nn_data_the_packed_row_would_mix(kind):
    """What the tests above guard against: transformers on the packed row, with restarting position ids
    and no boundaries, carries every hybrid's state from one sequence into the next."""
    model = tiny_hf_model(kind)
    ids = coded_ids([7, 9], torch.Generator().manual_seed(4))[:, :9]
    row = torch.cat([ids[0, :7], ids[1, :9]])[None]  # [1, 16]
    position_ids = torch.cat([torch.arange(7), torch.arange(9)])[None]
    with torch.no_grad():
        naive = model(input_ids=row, position_ids=position_ids, use_cache=False).logits[0, 7:]
        alone = _alone(model, ids[1:2, :9])[0]
        packed = _wrapped(model)(ids, torch.tensor([7, 9]))[1, :9]
    assert float((packed - alone).abs().max()) < 2e-5
    assert float((naive - alone).abs().max()) > 1e-4, "the packed row should mix without nn_data"


def test_the_sliding_window_is_applied_and_never_dropped():
    """Mistral with a window of 3: the window changes the result at these lengths (so the test above checks
    it), and a layer attending with a window the adapter built no mask for is refused, not run unwindowed."""
    ids = coded_ids([9], torch.Generator().manual_seed(7))[:, :9]
    with torch.no_grad():
        narrow = _alone(tiny_hf_model("mistral", window=3), ids)
        wide = _alone(tiny_hf_model("mistral", window=64), ids)
    assert float((narrow - wide).abs().max()) > 1e-3
    adapter = HFCausalLMAdapter(tiny_hf_model("mistral", window=3))
    assert adapter.layers.window == 3
    adapter.layers = adapter.layers._replace(window=None)
    with pytest.raises(PackingError, match=r"sliding_window=3, but the adapter built its sliding mask for window=None"):
        PackedForward(adapter, pad_full_seq_to=16)(ids, torch.tensor([9]))


@pytest.mark.parametrize("kind", ["llama", "qwen3_next", "mamba2", "lfm2"])
def test_a_microbatch_of_no_sequence(kind):
    model = tiny_hf_model(kind)
    ids, lens = torch.zeros(0, 12, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    out = _wrapped(model)(ids, lens)
    assert out.shape == (0, 12, model.config.vocab_size)
    out.sum().backward()


def _info(lengths, row_len, total, multiple=4, device="cpu"):
    """PackedInfo of a device-planned microbatch (no read), as the compiled packing hands it over."""
    layout = layout_from_lengths(torch.tensor(lengths, device=device), row_len, PackSpec(multiple, fixed_total=total),
                               validate=False, host_reads=False)
    places = layout.local_places(1, 0)
    bounds = PackedBounds(cu_seqlens_padded=layout.cu_seqlens_padded, max_seqlen=layout.max_seqlen, max_length=total,
                          row_len=row_len)
    info = PackedInfo(bounds=bounds, segment_ids=layout.segment_ids(), query_index=places.source)
    return info, layout.positions()[None]


def test_boundaries_the_model_receives():
    """cu_seq_lens_q/k int32 on the device, max_length_q/k Python ints, seq_idx for models with mixers;
    B = 0 gives the pseudo-segment [0, T]."""
    info, _ = _info([3, 0, 5], 5, 16)
    kw = boundary_kwargs(info._replace(bounds=info.bounds._replace(max_length=12)), seq_idx=True)
    assert kw["cu_seq_lens_q"].dtype == torch.int32 and kw["cu_seq_lens_q"].tolist() == [0, 4, 4, 16]
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"] and kw["max_length_q"] == kw["max_length_k"] == 12
    assert type(kw["max_length_q"]) is int
    assert kw["seq_idx"].tolist() == [[0] * 4 + [2] * 12] and kw["seq_idx"].dtype == torch.int32
    assert "seq_idx" not in boundary_kwargs(info, seq_idx=False)
    empty, _ = _info([], 5, 16)
    assert boundary_kwargs(empty, seq_idx=False)["cu_seq_lens_q"].tolist() == [0, 16]
    cp = info._replace(cp=CPShare(size=2, gather=lambda x: x), query_index=torch.arange(8),
                       bounds=info.bounds._replace(max_length=12))
    kw = boundary_kwargs(cp, seq_idx=True)
    assert kw["cu_seq_lens_q"].tolist() == [0, 2, 2, 8] and kw["max_length_q"] == 6
    assert kw["seq_idx"].tolist() == [[0] * 4 + [2] * 4]


def test_the_model_gets_the_plans_longest_segment_from_the_host_plan(monkeypatch):
    """Eagerly the plan is made on the host: max_length is its longest segment, read with it (no extra read)."""
    model = tiny_hf_model("llama")
    seen = {}
    forward = model.forward

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    _wrapped(model)(coded_ids([3, 0, 5], torch.Generator().manual_seed(0)), torch.tensor([3, 0, 5]))
    assert seen["cu_seq_lens_q"].tolist() == [0, 4, 4, 48] and seen["max_length_q"] == 44
    assert "seq_idx" not in seen and seen["attention_mask"].shape == (1, 1, 48, 48)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3_next", "mamba2", "lfm2", "bamba"])
def test_the_adapter_and_model_read_nothing_on_meta_tensors(kind):
    """The adapter and the model it drives on meta tensors: any value-dependent op (a host read) fails."""
    model = tiny_hf_model(kind, moe=False)
    adapter = HFCausalLMAdapter(model)
    model.to("meta")
    info, positions = _info([5, 0, 12, 3, 9], 12, 48, device="meta")
    out = adapter(torch.zeros(1, 48, dtype=torch.long, device="meta"), positions, info)
    assert out.shape == (1, 48, model.config.vocab_size) and out.device.type == "meta"


STREAM = ([5, 0, 12, 3], [12, 12], [1], [0, 7, 0, 9, 2], [11, 4, 12])


@pytest.mark.parametrize("kind", ["llama", "qwen3_next", "mamba2", "lfm2"])
def test_no_host_sync_per_microbatch(kind):
    """Compiled packing (fixed T, row capacity) and the eager adapter + model: 0 syncs per microbatch
    (transformers' own derivation of the mask from the position ids would read once)."""
    model = tiny_hf_model(kind)
    wrapped = PackedForward(HFCausalLMAdapter(model), pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=64,
                            row_capacity=5, compile_packing=True, compile_kwargs={"backend": "aot_eager"})
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        wrapped(coded_ids(STREAM[0], gen), torch.tensor(STREAM[0]))  # compiles
        for lengths in STREAM:
            ids = coded_ids(lengths, gen)
            with HostSyncCounter() as syncs:
                wrapped(ids, torch.tensor(lengths))
            assert syncs.count == 0, syncs.calls


def test_the_adapter_and_model_compile_once_over_a_stream():
    """torch.compile(fullgraph=True) of the adapter around a hybrid (gated delta net + attention), fed by
    the compiled packing: one graph for the whole stream, outputs equal to each sequence alone. (The
    graph count is dynamo's; aot_eager keeps the test at seconds, inductor took ~30 s here.)"""
    torch._dynamo.reset()
    model = tiny_hf_model("qwen3_next")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(HFCausalLMAdapter(model), backend=counter, fullgraph=True)
    wrapped = PackedForward(compiled, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=64, row_capacity=5,
                            compile_packing=True, compile_kwargs={"backend": "aot_eager"})
    gen, worst = torch.Generator().manual_seed(6), 0.0
    with torch.no_grad():
        for lengths in STREAM:
            ids = coded_ids(lengths, gen)
            out = wrapped(ids, torch.tensor(lengths))
            for b, n in enumerate(lengths):
                if n:
                    worst = max(worst, float((out[b, :n] - _alone(model, ids[b : b + 1, :n])[0]).abs().max()))
    torch._dynamo.reset()
    assert counter.frame_count == 1 and worst < 2e-5, (counter.frame_count, worst)


@needs_cpu_flex
@pytest.mark.compile
@pytest.mark.parametrize("kind", ["mistral", "qwen3_next"])
def test_the_flex_block_mask_too(kind):
    """No grad on a CPU: the flex BlockMask form of the mask (sliding windows in its mask function; a
    hybrid's recurrent layers next to it) equals each sequence alone."""
    model = tiny_hf_model(kind)
    with torch.no_grad():
        worst, _ = _compare(model, _wrapped(model, mask_kind="block"), grads=False)
    assert worst < 2e-5, worst
