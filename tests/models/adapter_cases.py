"""Cases run on every spawned rank (tests/support/cp_harness.py) for tests/multiprocess/test_adapters_multiprocess.py.

Each rank builds the same tiny model and microbatches from fixed seeds, runs ``PackedForward``
around an adapter with its CP group, and compares with every sequence run alone through the
model's own unpacked path: outputs, and parameter gradients of a token-level loss (summed over
the CP group, as megatron-core's gradient all-reduce does). Float64, so any slip shows.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from nn_data.groups import context_parallel_info
from nn_data.packed_forward import PackedForward

VOCAB, SEQ_LEN = 97, 12

FLOAT32_STEP_TOL = 1e-5
"""|packed - each sequence alone| allowed on a float64 model where transformers computes a step in float32
whatever the model's dtype: Mamba-2's chunked scan (its einsums on ``.float()`` inputs, then its gated
RMSNorm) and Mamba2ForCausalLM's float32 logits, the gated delta rule, every RMSNorm (LFM2's too). A float32
step rounds to 2**-24 relative, and the rounding can change with the tensor's shape, which differs here: the
adapter runs a hybrid layer on ``[B', W, D]`` rows (one sequence per row, W slots) and the reference on
``[1, n, D]``. A float32 matmul sums in an order that depends on its sizes and on the CPU (MKL's blocking;
Mamba-2's scan contracts over ceil(W / chunk) + 1 chunks in a row and ceil(n / chunk) + 1 alone), and an
elementwise op computes the tail of a tensor past its last full vector with a scalar routine (``silu`` and
``softplus`` differ in the last bit there). Measured (2-core AVX-512 VM, 2026-12-02): Mamba-2's logits 2.4e-7
(one float32 step at |logit| < 4; 0 when its einsums run in float64), gradients 4.9e-7; elsewhere LFM2's
gradients 6.0e-7. 1e-5 is 8 float32 epsilons relative to the largest value these tiny models produce
(|logit| < 4, |gradient| < 10); a sequence mixed with its neighbour differs by 3.8e-4 (LFM2) to 2.6 (Mamba-2)."""


def batches(cp: int):
    """``(lengths, pad_full_seq_to)``: zero-length rows, full rows, a tail; multiples of 2C."""
    two_c = 2 * cp
    out = []
    for ls in ([5, 0, 12, 3], [12, 12], [1], [0, 7, 0, 9, 2]):
        natural = sum(-(-n // two_c) * two_c for n in ls)
        out.append((ls, natural + 2 * two_c))
    return out


def coded_ids(lengths, gen: torch.Generator) -> torch.Tensor:
    ids = torch.randint(1, VOCAB, (len(lengths), SEQ_LEN), generator=gen)
    return torch.where(torch.arange(SEQ_LEN) < torch.tensor(lengths)[:, None], ids, 0)


def token_loss(logits: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over every valid (token, next token) pair of ``[B, S, V]``."""
    s = torch.arange(ids.shape[1] - 1)
    valid = (s < (lengths[:, None] - 1)).to(logits.dtype)  # [B, S-1]
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return (ce * valid).sum()


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def check_equivalence(make_adapter, model, alone, cp, groups=None, every_grad=True, **packed_forward_kwargs) -> dict:
    """Packed (CP-sharded) forward of ``make_adapter(model)`` == ``alone(ids [1, n]) -> [1, n, V]`` per
    sequence, and the gradients of :func:`token_loss` equal; returns the largest differences.
    ``groups``: a ``ProcessGroupCollection`` PackedForward takes as ``pg_collection=`` (else ``cp.group``).
    ``every_grad=False``: some parameters may get no gradient (an MoE expert no token was routed to)."""
    group_kw = {"cp_group": cp.group} if groups is None else {"pg_collection": groups}
    gen = torch.Generator().manual_seed(1)
    worst_out = worst_grad = 0.0
    largest = {}  # the largest gradient entry of each parameter over the batches
    for lengths, full in batches(cp.size):
        ids, lens = coded_ids(lengths, gen), torch.tensor(lengths)
        wrapped = PackedForward(make_adapter(model), pad_individual_seqs_to_multiple_of=2 * cp.size,
                                pad_full_seq_to=full, **group_kw, **packed_forward_kwargs)
        model.zero_grad(set_to_none=True)
        out = wrapped(ids, lens)  # [B, S, V]
        token_loss(out, ids, lens).backward()
        packed_grads = _grads(model)
        for g in packed_grads.values():
            dist.all_reduce(g, group=cp.group)  # the CP part of megatron-core's gradient all-reduce
        model.zero_grad(set_to_none=True)
        total = 0.0
        for b, n in enumerate(lengths):
            if n:
                ref = alone(ids[b : b + 1, :n])  # [1, n, V]
                worst_out = max(worst_out, float((out[b, :n] - ref[0]).detach().abs().max()))
                total = total + token_loss(ref, ids[b : b + 1, :n], lens[b : b + 1])
            assert not out[b, n:].any(), "output past a row's length must be 0"
        total.backward()
        alone_grads = _grads(model)
        assert packed_grads.keys() == alone_grads.keys() and packed_grads
        for name, g in packed_grads.items():
            largest[name] = max(largest.get(name, 0.0), float(g.abs().max()))
            worst_grad = max(worst_grad, float((g - alone_grads[name]).abs().max()))
    zero = [name for name, value in largest.items() if value == 0]
    assert largest and (not zero or not every_grad and len(zero) < len(largest)), \
        f"zero gradients {zero}: the check would prove nothing for them"
    return dict(cp_rank=cp.rank, cp_size=cp.size, out=worst_out, grad=worst_grad)


def case_hf(kind: str) -> dict:
    """HFCausalLMAdapter on a tiny ``kind`` model (nn_data.models.tiny_hf: "llama", "qwen2", the
    sliding-window "mistral", the hybrids "qwen3_next" (without its MoE: float64), "mamba2", "lfm2"),
    float64; the oracle is the same model called on one sequence as transformers runs it."""
    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.models.tiny_hf import tiny_hf_model

    model = tiny_hf_model(kind, dtype=torch.float64, moe=False)
    before = model.config._attn_implementation
    result = check_equivalence(HFCausalLMAdapter, model, lambda ids: model(input_ids=ids, use_cache=False).logits,
                               context_parallel_info())
    assert model.config._attn_implementation == before, "the adapter must leave the model's attention as it was"
    return result


def case_hf_family(name: str) -> dict:
    """HFCausalLMAdapter on a family of the conformance matrix (tests.support.hf_families, tiny, float32)
    under this CP layout; the oracle is the model on one sequence as transformers runs it."""
    from nn_data.adapters import HFCausalLMAdapter
    from tests.support.hf_families import build, find

    model = build(find(name))
    return check_equivalence(HFCausalLMAdapter, model, lambda ids: model(input_ids=ids, use_cache=False).logits,
                             context_parallel_info(), every_grad=False)


def case_megatron() -> dict:
    """MegatronGPTAdapter on a tiny GPTModel (nn_data's layer spec), float64; the oracle is the same
    model on one unpacked sequence through megatron-core's stock DotProductAttention path."""
    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.models.tiny_megatron import forward_alone, tiny_gpt_config, tiny_gpt_model

    model = tiny_gpt_model(tiny_gpt_config(dtype=torch.float64))
    return check_equivalence(MegatronGPTAdapter, model, lambda ids: forward_alone(model, ids), context_parallel_info(),
                             make_packed_seq_params=True)


def case_empty_microbatch() -> dict:
    """A microbatch of no sequence (``B = 0``, no row capacity) through both adapters under this CP
    layout, forward and backward: ``[0, S, V]`` rows, as the core ops give (megatron-core receives
    the padding pseudo-segment ``[0, T]``); with a row capacity too. Returns the row shapes."""
    from nn_data.adapters import HFCausalLMAdapter, MegatronGPTAdapter
    from nn_data.models.tiny_hf import tiny_hf_model
    from nn_data.models.tiny_megatron import tiny_gpt_config, tiny_gpt_model

    cp = context_parallel_info()
    adapters = {"megatron": (MegatronGPTAdapter(tiny_gpt_model(tiny_gpt_config(dtype=torch.float64))), True),
                "hf": (HFCausalLMAdapter(tiny_hf_model("llama", dtype=torch.float64)), False)}
    ids, lens = torch.zeros(0, SEQ_LEN, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    shapes = {}
    for name, (adapter, params) in adapters.items():
        for capacity in (None, 3):
            wrapped = PackedForward(adapter, cp_group=cp.group, pad_individual_seqs_to_multiple_of=2 * cp.size,
                                    pad_full_seq_to=8 * cp.size, row_capacity=capacity, make_packed_seq_params=params)
            out = wrapped(ids, lens)  # [0, S, V]
            out.sum().backward()  # nothing flows, nothing fails
            shapes[f"{name}, row_capacity={capacity}"] = tuple(out.shape)
    return shapes


def case_megatron_config_cp() -> float:
    """A GPTModel whose config says ``context_parallel_size = C`` (as megatron-core users set it; the
    stock DotProductAttention refuses it) gives the same packed outputs as one whose config says 1;
    the PackedSeqParams carry the CP group PackedForward was given."""
    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.models.tiny_megatron import tiny_gpt_config, tiny_gpt_model

    cp = context_parallel_info()
    config = tiny_gpt_config(dtype=torch.float64)
    config.context_parallel_size = cp.size
    models = [tiny_gpt_model(config), tiny_gpt_model(tiny_gpt_config(dtype=torch.float64))]
    lengths, full = batches(cp.size)[0]
    ids, lens = coded_ids(lengths, torch.Generator().manual_seed(1)), torch.tensor(lengths)
    wrapped = [PackedForward(MegatronGPTAdapter(m), cp_group=cp.group, pad_individual_seqs_to_multiple_of=2 * cp.size,
                             pad_full_seq_to=full, make_packed_seq_params=True) for m in models]
    params = wrapped[0].prepare(ids, lens).packed.packed_seq_params
    assert params.cp_group is cp.group and params.local_cp_size is None  # the group the tokens were sharded over
    outs = [w(ids, lens) for w in wrapped]
    assert outs[0].abs().max() > 0
    return float((outs[0] - outs[1]).abs().max())


def case_compiled_stream() -> dict:
    """Rank 0 (the others idle; C = 1): ``PackedForward(compile_packing=True, pad_full_seq_to,
    row_capacity)`` around each adapter over a stream of microbatches of different row counts and
    lengths: every output equals the sequences run alone (float32), and the packing compiles on the
    first microbatch only (``frames``: compiled frames after each microbatch)."""
    if dist.get_rank() != 0:
        return {}
    from torch._dynamo.testing import CompileCounterWithBackend

    from nn_data.adapters import HFCausalLMAdapter, MegatronGPTAdapter
    from nn_data.models.tiny_hf import tiny_hf_model
    from nn_data.models.tiny_megatron import forward_alone, tiny_gpt_config, tiny_gpt_model

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    hf = tiny_hf_model("qwen2")
    mg = tiny_gpt_model(tiny_gpt_config())
    common = dict(pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=64, row_capacity=5, compile_packing=True,
                  compile_kwargs={"backend": counter})
    wrapped = {
        "hf": (PackedForward(HFCausalLMAdapter(hf), **common), lambda ids: hf(input_ids=ids, use_cache=False).logits),
        "megatron": (PackedForward(MegatronGPTAdapter(mg), make_packed_seq_params=True, **common),
                     lambda ids: forward_alone(mg, ids)),
    }
    gen = torch.Generator().manual_seed(2)
    worst, frames = {k: 0.0 for k in wrapped}, []
    with torch.no_grad():
        for step, lengths in enumerate(([5, 0, 12, 3], [12, 12], [1], [0, 7, 0, 9, 2], [11, 4, 12])):
            ids, lens = coded_ids(lengths, gen), torch.tensor(lengths)
            for name, (packed, alone) in wrapped.items():
                out = packed(ids, lens)  # [B, S, V]
                for b, n in enumerate(lengths):
                    if n:
                        worst[name] = max(worst[name], float((out[b, :n] - alone(ids[b : b + 1, :n])[0]).abs().max()))
            frames.append(counter.frame_count)
    torch._dynamo.reset()
    return dict(worst=worst, frames=frames)


def case_pipeline() -> dict:
    """PP = 2 with megatron-core's 1F1B schedule vs PP = 1 vs each sequence alone (float64):
    scripts/pipeline_example.compare on every rank (4 ranks: two pipelines side by side)."""
    from scripts.pipeline_example import compare

    return compare(torch.float64)


def case_pipeline_interleaved() -> dict:
    """PP = 2 x VPP = 2 (megatron-core's interleaved 1F1B, groups from parallel_state) vs PP = 1 vs
    each sequence alone (float64): scripts/pipeline_example.compare(vpp=2) on every rank."""
    from scripts.pipeline_example import compare

    return compare(torch.float64, vpp=2)


def case_megatron_errors() -> list:
    """The megatron adapter's clear errors (run with C = 2): a model built with the stock local
    spec, a PackedForward whose CP size differs from parallel_state's, a pipeline step without a
    constant T. Returns the messages."""
    import pytest
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from nn_data.adapters import MegatronGPTAdapter, megatron_gpt_layer_spec, pipeline_forward_step
    from nn_data.errors import PackingError
    from nn_data.models.tiny_megatron import tiny_gpt_config, tiny_gpt_model

    messages = []
    stock = GPTModel(tiny_gpt_config(), get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                     max_sequence_length=64, position_embedding_type="rope")
    with pytest.raises(PackingError, match="megatron_gpt_layer_spec") as e:
        MegatronGPTAdapter(stock)
    messages.append(str(e.value))
    adapter = MegatronGPTAdapter(tiny_gpt_model(tiny_gpt_config()))
    ids, lens = coded_ids([5, 3], torch.Generator().manual_seed(0)), torch.tensor([5, 3])
    with pytest.raises(PackingError, match=r"cp_size=1 ranks but the model's context-parallel group "
                                           r"\(model.pg_collection.cp, which megatron-core's rotary embedding uses\) "
                                           r"has 2; wrap it as PackedForward\(adapter, pg_collection=adapter"
                                           r".pg_collection, \.\.\.\)") as e:
        PackedForward(adapter, pad_full_seq_to=16)(ids, lens)
    messages.append(str(e.value))
    with pytest.raises(PackingError, match=r"needs THD PackedSeqParams: wrap it in PackedForward\(\.\.\., "
                                           r"make_packed_seq_params=True\)") as e:
        PackedForward(adapter, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=16,
                      cp_group=context_parallel_info().group)(ids, lens)
    messages.append(str(e.value))
    with pytest.raises(PackingError, match="pipeline_forward_step needs PackedForward\\(pad_full_seq_to=T\\)") as e:
        pipeline_forward_step(PackedForward(adapter), lambda *a: None)
    messages.append(str(e.value))
    with pytest.raises(PackingError, match="multi_latent_attention=True is not supported") as e:
        megatron_gpt_layer_spec(multi_latent_attention=True)
    messages.append(str(e.value))
    return messages


def case_hf_hidden_states_logprobs() -> dict:
    """``HFCausalLMAdapter(output="hidden_states")`` on a tiny Llama (float64) under this CP layout: ``prepare``,
    this rank's hidden states ``[1, T/C, H]``, ``TokenLogProbsFromHidden`` over the CP group with the output
    layer's weight; against each sequence's logits alone, log-softmax at the next tokens: values, and the
    parameter gradients of their sum (summed over the CP group)."""
    from nn_data import TokenLogProbsFromHidden
    from nn_data.adapters import HFCausalLMAdapter
    from nn_data.models.tiny_hf import tiny_hf_model

    cp = context_parallel_info()
    model = tiny_hf_model("llama", dtype=torch.float64)
    weight = model.get_output_embeddings().weight  # [V, H]
    gen = torch.Generator().manual_seed(2)
    worst_out = worst_grad = 0.0
    for lengths, full in batches(cp.size):
        ids, lens = coded_ids(lengths, gen), torch.tensor(lengths)
        wrapped = PackedForward(HFCausalLMAdapter(model, output="hidden_states"), pad_full_seq_to=full,
                                pad_individual_seqs_to_multiple_of=2 * cp.size, cp_group=cp.group, verify=False)
        inp = wrapped.prepare(ids, lens)
        hidden = wrapped.model(inp.input_ids, inp.position_ids, inp.packed)  # [1, T/C, H]
        assert hidden.shape == (1, full // cp.size, model.config.hidden_size)
        layout = wrapped.layout_of(inp)
        head = TokenLogProbsFromHidden(SEQ_LEN, cp_group=cp.group)
        got = head(hidden, weight, layout.pack(inp.row_ids), layout=layout)[: inp.rows]  # [B, S]
        model.zero_grad(set_to_none=True)
        got.sum().backward()
        packed_grads = _grads(model)
        for g in packed_grads.values():
            dist.all_reduce(g, group=cp.group)
        model.zero_grad(set_to_none=True)
        total = 0.0
        for b, n in enumerate(lengths):
            if n > 1:
                lp = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0, :-1].log_softmax(-1)  # [n-1, V]
                want = lp.gather(-1, ids[b, 1:n, None])[:, 0]
                worst_out = max(worst_out, float((got[b, 1:n] - want).detach().abs().max()))
                total = total + want.sum()
            assert not got[b, max(n, 1):].any() and not got[b, 0].any()
        if isinstance(total, float):  # no token pair to score (lengths [1]): nothing has a gradient
            assert not any(g.any() for g in packed_grads.values())
            continue
        total.backward()
        alone_grads = _grads(model)
        assert packed_grads.keys() == alone_grads.keys() and packed_grads
        worst_grad = max([worst_grad] + [float((g - alone_grads[k]).abs().max()) for k, g in packed_grads.items()])
    return dict(cp_rank=cp.rank, cp_size=cp.size, out=worst_out, grad=worst_grad)
