"""Cases for tests/multiprocess/test_pg_collection_multiprocess.py: the process groups come as megatron-core's
``ProcessGroupCollection`` built from a ``HyperCommGrid`` (as Megatron-Bridge builds them:
``nn_data.models.tiny_megatron.grid_process_groups``), megatron-core's ``parallel_state`` is never
initialised, and every nn_data entry point that reads CP or TP groups takes them as ``pg_collection=``.

Each case runs on every rank of a pool of 4 (tests/support/cp_harness.py, ``cp=None``: the pool leaves
``parallel_state`` alone); oracles are the loop references (single process, whole tensors). Float64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nn_data import GatherFromContextParallel, ShardForContextParallel, TokenLogProbs
from nn_data.errors import PackingError
from nn_data.groups import context_parallel_info, given_group_info, tensor_parallel_info
from nn_data.packed_forward import PackedForward
from nn_data.testing.reference import reference_padding_mask, reference_shard, reference_token_logprobs
from tests.support import cp_cases, model_utils_cases

_GROUPS: dict = {}


def groups(*, tp: int = 1, cp: int = 1, pp: int = 1):
    """This rank's ``ProcessGroupCollection`` for the layout (made once per pool; every rank asks for
    the same layouts in the same order, as group creation needs). Asserts that ``parallel_state`` is
    not initialised."""
    from megatron.core import parallel_state

    from nn_data.models.tiny_megatron import grid_process_groups

    assert not parallel_state.model_parallel_is_initialized(), "this pool must never initialise parallel_state"
    key = (tp, cp, pp)
    if key not in _GROUPS:
        _GROUPS[key] = grid_process_groups(tp=tp, cp=cp, pp=pp)
    return _GROUPS[key]


def _message(call) -> str:
    try:
        call()
    except PackingError as e:
        return str(e)
    raise AssertionError("no PackingError")


def case_resolver() -> list:
    """CP and TP rank, size and group from the collection; the messages for a group that disagrees
    with the collection, a collection without the field, and no source at all. Returns the messages."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nn_data.adapters import pipeline_forward_step
    from nn_data.megatron_parallel import make_packed_seq_params

    pgc = groups(tp=2, cp=2)
    cp, tp = context_parallel_info(pg_collection=pgc), tensor_parallel_info(pg_collection=pgc)
    assert cp.group is pgc.cp and (cp.rank, cp.size) == (dist.get_rank(pgc.cp), 2)
    assert tp.group is pgc.tp and (tp.rank, tp.size) == (dist.get_rank(pgc.tp), 2)
    assert cp.group is not tp.group and given_group_info(None, pg_collection=pgc) == cp
    assert given_group_info(pgc.cp, pg_collection=pgc) == cp  # the same group twice: fine
    assert given_group_info(None, pg_collection=pgc, field="tp") == tp
    no_cp = ProcessGroupCollection(tp=pgc.tp, pp=pgc.pp)
    bounds = torch.tensor([0, 8], dtype=torch.int32)
    messages = [
        _message(lambda: context_parallel_info(pgc.tp, pg_collection=pgc)),
        _message(lambda: context_parallel_info(pg_collection=no_cp)),
        _message(lambda: context_parallel_info()),
        _message(lambda: TokenLogProbs(8, tp_group=pgc.cp, pg_collection=pgc)),
        _message(lambda: PackedForward(lambda *a: None, cp_group=pgc.tp, pg_collection=pgc)),
        _message(lambda: make_packed_seq_params(bounds, 8, 4, cp_group=pgc.tp, pg_collection=pgc)),
        _message(lambda: pipeline_forward_step(PackedForward(lambda *a: None, pad_full_seq_to=8), None,
                                               pg_collection=pgc)),
    ]
    assert "the context-parallel group given and pg_collection.cp are different groups (sizes 2 and 2)" in messages[0]
    assert "pg_collection (ProcessGroupCollection) has no 'cp' group" in messages[1]
    assert "parallel_state is not, and no context-parallel group was given" in messages[2]
    assert "or pg_collection=" in messages[2]
    assert "the tensor-parallel group given and pg_collection.tp are different groups" in messages[3]
    assert "pg_collection.cp are different groups" in messages[4] and "pg_collection.cp" in messages[5]
    assert "packing shards over 1 context-parallel ranks, not over pg_collection.cp (2 ranks)" in messages[6]
    return messages


def case_context_parallel_ops() -> int:
    """CP 2 from the collection (two CP groups side by side, DP 2): the all-gather, TokenLogProbs (values
    and gradients), PackedSeqParams' ``cp_group``, and nn_data.nemo_rl.model_utils' packed log-probs
    (values and NeMo-RL's C-times gradients) and all-gather, against the single-process oracles."""
    from nn_data.megatron_parallel import make_packed_seq_params, packed_seq_params_fields
    from nn_data.nemo_rl import model_utils

    pgc = groups(cp=2)
    cp = context_parallel_info(pg_collection=pgc)
    gather = GatherFromContextParallel(pg_collection=pgc)
    logprobs = TokenLogProbs(cp_cases.SEQ_LEN, chunk_tokens=8, pg_collection=pgc)
    for i, mb in enumerate(cp_cases.microbatches(cp.size)[:4]):
        r, ids, full, weight = cp_cases._logprob_inputs(mb, 70 + i)
        local = ShardForContextParallel(cp.size, cp.rank)(full, r.cu_seqlens_padded).clone().requires_grad_()
        assert torch.equal(gather(local.detach(), r.cu_seqlens_padded), full), mb.name
        out = logprobs(local, ids, r.cu_seqlens, r.cu_seqlens_padded)
        (out * weight).sum().backward()
        ref_logits = full.clone().requires_grad_()
        ref = reference_token_logprobs(ref_logits, ids, r.cu_seqlens, r.cu_seqlens_padded, cp_cases.SEQ_LEN)
        (ref * weight).sum().backward()
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(local.grad, reference_shard(ref_logits.grad, r.cu_seqlens_padded, cp.size, cp.rank),
                                   rtol=0, atol=1e-12)
        params = make_packed_seq_params(r.cu_seqlens_padded, full.shape[1], full.shape[1] // cp.size,
                                        total=full.shape[1], pg_collection=pgc)
        if "cp_group" in packed_seq_params_fields():
            assert params.cp_group is pgc.cp
    no_tp = given_group_info(None, pg_collection=pgc, field="tp")
    inp = model_utils_cases.packed_inputs([5, 0, 16, 3], cp.size)
    ref, ref_grad = model_utils_cases.reference_packed(inp, None)
    local = model_utils_cases._local(inp.logits, inp.cu_seqlens_padded, cp, no_tp).clone().requires_grad_()
    out = model_utils.from_parallel_logits_to_logprobs_packed_sequences(
        local, inp.ids, inp.cu_seqlens_padded, inp.seq_len, 0, model_utils_cases.VOCAB, None, pg_collection=pgc)
    model_utils_cases.finite_loss(out, inp.weight).backward()
    model_utils_cases.assert_same_values(out.detach(), ref, "packed log-probs from pg_collection")
    expected = cp.size * model_utils_cases._local(ref_grad, inp.cu_seqlens_padded, cp, no_tp)
    torch.testing.assert_close(local.grad, expected, **model_utils_cases.TOL)
    seq = torch.arange(2 * 8 * 3, dtype=torch.float64).view(2, 8, 3)
    mine = model_utils._get_tokens_on_this_cp_rank(seq, cp.rank, cp.size, seq_dim=1)
    assert torch.equal(model_utils.allgather_cp_sharded_tensor(mine, None, seq_dim=1, pg_collection=pgc), seq)
    return cp.rank


def case_tensor_parallel_ops() -> tuple:
    """TP 2 x CP 2 from the collection: vocab-parallel TokenLogProbs (values, gradients), and
    nn_data.nemo_rl.model_utils' vocab-parallel paths (unpacked rows through NeMo-RL's dispatcher, the
    distributed log-softmax, DistributedLogprob), against single-process oracles."""
    from nn_data.nemo_rl import model_utils

    pgc = groups(tp=2, cp=2)
    cp, tp = context_parallel_info(pg_collection=pgc), tensor_parallel_info(pg_collection=pgc)
    vocab = cp_cases.VOCAB
    cols = vocab // tp.size
    op = TokenLogProbs(cp_cases.SEQ_LEN, chunk_tokens=8, pg_collection=pgc)
    for i, mb in enumerate(cp_cases.microbatches(cp.size)[:3]):
        r, ids, full, weight = cp_cases._logprob_inputs(mb, 80 + i)
        mine = reference_shard(full, r.cu_seqlens_padded, cp.size, cp.rank)[..., tp.rank * cols : (tp.rank + 1) * cols]
        local = mine.clone().requires_grad_()
        out = op(local, ids, r.cu_seqlens, r.cu_seqlens_padded)
        (out * weight).sum().backward()
        ref_logits = full.clone().requires_grad_()
        ref = reference_token_logprobs(ref_logits, ids, r.cu_seqlens, r.cu_seqlens_padded, cp_cases.SEQ_LEN)
        (ref * weight).sum().backward()
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        grad = reference_shard(ref_logits.grad, r.cu_seqlens_padded, cp.size, cp.rank)
        torch.testing.assert_close(local.grad, grad[..., tp.rank * cols : (tp.rank + 1) * cols], rtol=0, atol=1e-12)
    gen = torch.Generator().manual_seed(9)
    rows, seq_len, padded, v = 3, 11, 16, model_utils_cases.VOCAB
    full = torch.randn(rows, padded, v, generator=gen, dtype=torch.float64)
    target = torch.randint(0, v, (rows, seq_len), generator=gen)
    ref = model_utils_cases.reference_row_logprobs(full, target)
    vcols = v // tp.size
    local = model_utils._get_tokens_on_this_cp_rank(full, cp.rank, cp.size, seq_dim=1)[..., tp.rank * vcols :
                                                                                        (tp.rank + 1) * vcols]
    out = model_utils.get_next_token_logprobs_from_logits(target, local, pg_collection=pgc)
    torch.testing.assert_close(out, ref, **model_utils_cases.TOL)
    softmax = model_utils._compute_distributed_log_softmax(local, None, pg_collection=pgc)
    whole = torch.log_softmax(model_utils._get_tokens_on_this_cp_rank(full, cp.rank, cp.size, seq_dim=1), dim=-1)
    torch.testing.assert_close(softmax, whole[..., tp.rank * vcols : (tp.rank + 1) * vcols], rtol=0, atol=1e-12)
    token = torch.randint(0, v, local.shape[:2], generator=gen)
    picked = model_utils.DistributedLogprob.apply(local, token, tp.rank * vcols, (tp.rank + 1) * vcols, None,
                                                  pg_collection=pgc)
    torch.testing.assert_close(picked, whole.gather(-1, token[..., None]).squeeze(-1), rtol=0, atol=1e-12)
    return (cp.rank, tp.rank)


def case_linear_ce() -> tuple:
    """TP 2 x CP 2 from the collection: NeMo-RL's log-probs from hidden states (the rows, the packed entry
    and ``ChunkedDistributedHiddenStatesToLogprobs.apply``) with ``pg_collection=`` and no group give
    exactly what they give with the collection's groups passed (those runs: tests/support/lm_head_cases.py)."""
    from nn_data.nemo_rl import model_utils
    from tests.support import lm_head_cases as heads

    pgc = groups(tp=2, cp=2)
    cp, tp = context_parallel_info(pg_collection=pgc), tensor_parallel_info(pg_collection=pgc)
    inp = heads.head_inputs([5, 0, 16, 3], cp.size, pad_full_seq_to=96, seed=3)
    hidden, weight = heads.local_parts(inp, cp, tp, sequence_parallel=False)  # [1, T/C, H], [V/TP, H]
    start, end = tp.rank * weight.shape[0], (tp.rank + 1) * weight.shape[0]
    packed = model_utils.from_parallel_hidden_states_to_logprobs_packed_sequences
    args = (hidden.detach().transpose(0, 1), weight.detach(), inp.ids, inp.cu_seqlens_padded, heads.SEQ_LEN, start, end)
    assert torch.equal(packed(*args, None, pg_collection=pgc), packed(*args, tp.group, cp_group=cp.group))
    gen = torch.Generator().manual_seed(4)
    rows_hidden = torch.randn(8 * cp.size, 3, heads.HIDDEN, generator=gen, dtype=torch.float64)  # [S, B, H]
    target = torch.randint(0, heads.VOCAB, (3, 8 * cp.size), generator=gen)
    local = model_utils._get_tokens_on_this_cp_rank(rows_hidden, cp.rank, cp.size, seq_dim=0)  # [S/C, B, H]
    rows = model_utils.from_parallel_hidden_states_to_logprobs
    assert torch.equal(rows(local, weight.detach(), None, target, start, end, None, pg_collection=pgc),
                       rows(local, weight.detach(), None, target, start, end, tp.group, cp_group=cp.group))
    fn = model_utils.ChunkedDistributedHiddenStatesToLogprobs.apply
    call = (rows_hidden, target, weight.detach(), start, end, 2)
    assert torch.equal(fn(*call, None, pg_collection=pgc), fn(*call, tp.group))
    return (cp.rank, tp.rank)


class RouterProbe:
    """Forward pre-hooks on every MoE router of ``model``: what each router call was told about padding
    (the ``padding_mask`` megatron-core hands its router, ``[T/C, 1]`` bool, True at padding; None when
    it got none) and how many tokens it received."""

    def __init__(self, model):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.calls: list = []
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        assert layers, "the model has no MoE layer"
        self.handles = [m.router.register_forward_pre_hook(self._hook, with_kwargs=True) for m in layers]

    def _hook(self, module, args, kwargs):
        hidden = args[0]
        mask = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
        self.calls.append((hidden.shape[0] * hidden.shape[1], None if mask is None else mask.detach().clone()))

    def count(self, expected: torch.Tensor) -> dict:
        """Against ``expected [1, T/C]`` (True at padding), over the calls since the last count: padding
        tokens a router was not told are padding (``padding_seen_as_real``), real tokens it was told are
        padding, and the padding tokens it received."""
        out = dict(calls=len(self.calls), padding_received=0, padding_seen_as_real=0, real_seen_as_padding=0)
        for tokens, mask in self.calls:
            assert tokens == expected.shape[1], (tokens, expected.shape)
            told = torch.zeros_like(expected[0]) if mask is None else mask.reshape(-1).bool()  # [T/C]
            out["padding_received"] += int(expected.sum())
            out["padding_seen_as_real"] += int((expected[0] & ~told).sum())
            out["real_seen_as_padding"] += int((~expected[0] & told).sum())
        self.calls.clear()
        return out

    def close(self):
        for h in self.handles:
            h.remove()


def case_megatron_models(cp_size: int) -> dict:
    """A dense and a MoE tiny GPTModel built on the collection (CP ``cp_size``), wrapped with
    ``PackedForward(pg_collection=adapter.pg_collection)``: packed == each sequence alone (outputs and
    gradients, float64); the MoE routers are told every padding position (counted by hooks, against
    the reference padding mask), and told none when the adapter passes no mask (the control)."""
    from nn_data.adapters import MegatronGPTAdapter
    from nn_data.models.tiny_megatron import forward_alone, tiny_gpt_config, tiny_gpt_model
    from tests.models.adapter_cases import batches, check_equivalence, coded_ids

    pgc = groups(cp=cp_size)
    cp = context_parallel_info(pg_collection=pgc)
    out = {}
    for name, experts in (("dense", 0), ("moe", 4)):
        model = tiny_gpt_model(tiny_gpt_config(dtype=torch.float64, experts=experts), pg_collection=pgc)
        out[name] = check_equivalence(MegatronGPTAdapter, model, lambda ids, m=model: forward_alone(m, ids), cp,
                                      groups=pgc, make_packed_seq_params=True)
    probe = RouterProbe(model)  # the MoE model
    adapter = MegatronGPTAdapter(model)
    assert adapter.takes_padding_mask and adapter.pg_collection is pgc
    gen = torch.Generator().manual_seed(3)
    counts = {"with mask": [], "without mask": []}
    for lengths, full in batches(cp.size):
        ids, lens = coded_ids(lengths, gen), torch.tensor(lengths)
        expected = reference_padding_mask(lengths, 2 * cp.size, 1, full, cp.size, cp.rank)
        for label, passes in (("with mask", True), ("without mask", False)):
            adapter.takes_padding_mask = passes
            # verify=False: the packing check's own microbatches would reach the routers' probe, which counts
            # against this batch's padding (the check itself: tests/multiprocess/test_model_check_multiprocess.py)
            wrapped = PackedForward(adapter, pad_individual_seqs_to_multiple_of=2 * cp.size, pad_full_seq_to=full,
                                    make_packed_seq_params=True, pg_collection=adapter.pg_collection, verify=False)
            with torch.no_grad():
                wrapped(ids, lens)
            counts[label].append(probe.count(expected))
    probe.close()
    out["router"] = {label: {k: sum(c[k] for c in found) for k in found[0]} for label, found in counts.items()}
    return out


def case_pipeline(vpp: int, experts: int) -> dict:
    """scripts/pipeline_example.compare with ``groups="collection"``: PP = 2 (two pipelines side by side
    on 4 ranks), ``vpp`` virtual stages, ``experts`` MoE experts."""
    from scripts.pipeline_example import compare

    return compare(torch.float64, vpp=vpp, groups="collection", experts=experts)


def case_compat_layer() -> int:
    """NeMo-RL's ``process_microbatch`` and ``get_microbatch_iterator`` with ``pg_collection=`` (CP 2):
    this rank's zigzag shard of the ids and routed experts and its padding mask, against the loop
    references; without the collection (``parallel_state`` never initialised) the layer sees one rank."""
    from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
    from nn_data.nemo_rl.megatron_data import get_context_parallel_world_size, get_microbatch_iterator
    from nn_data.nemo_rl.megatron_data import process_microbatch
    from nn_data.testing.coded import coded_batch
    from nn_data.testing.reference import reference_pack

    pgc = groups(cp=2)
    cp = context_parallel_info(pg_collection=pgc)
    lengths = [12, 3, 0, 8, 1]
    data = BatchedDataDict(input_ids=coded_batch(lengths, 12), input_lengths=torch.tensor(lengths),
                           routed_experts=coded_batch(lengths, 12, (2, 3)))
    out = process_microbatch(data, "input_lengths", 4, 1, 48, pack_sequences=True, pg_collection=pgc)
    ref = reference_pack(data["input_ids"], lengths, 4, 1, 48)
    assert torch.equal(out.input_ids, ref.packed)
    assert torch.equal(out.input_ids_cp_sharded, reference_shard(ref.packed, ref.cu_seqlens_padded, 2, cp.rank))
    routes = reference_pack(data["routed_experts"], lengths, 4, 1, 48, fill=torch.arange(3)).packed
    assert torch.equal(out.routed_experts_cp_sharded, reference_shard(routes, ref.cu_seqlens_padded, 2, cp.rank))
    assert torch.equal(out.padding_mask, reference_padding_mask(lengths, 4, 1, 48, 2, cp.rank))
    assert get_context_parallel_world_size() == 1  # parallel_state was never initialised
    alone = process_microbatch(data, "input_lengths", 4, 1, 48, pack_sequences=True)
    assert torch.equal(alone.input_ids_cp_sharded, ref.packed)
    planned, _ = data.plan_sequence_packing(16, sequence_length_pad_multiple=4)
    cfg = {"sequence_packing": {"enabled": True}, "make_sequence_length_divisible_by": 4,
           "megatron_cfg": {"tensor_model_parallel_size": 1, "sequence_parallel": False,
                            "pipeline_model_parallel_size": 2, "context_parallel_size": 2}}
    it, *_ = get_microbatch_iterator(planned, cfg, 1, None, pg_collection=pgc)
    seen = 0
    for mb, (start, end) in zip(it, planned.micro_batch_indices[0]):
        part = planned["input_lengths"][start:end].tolist()
        total = mb.input_ids.shape[1]
        r = reference_pack(planned["input_ids"][start:end], part, 4, 1, total)
        assert torch.equal(mb.input_ids_cp_sharded, reference_shard(r.packed, r.cu_seqlens_padded, 2, cp.rank))
        assert torch.equal(mb.padding_mask, reference_padding_mask(part, 4, 1, total, 2, cp.rank))
        seen += len(part)
    assert seen == len(lengths)
    return cp.rank


def case_staging() -> int:
    """StagedMicrobatch under CP 2 (the collection's group): each rank's staged tensors equal the unstaged
    path's on a stream, at fixed addresses, and the model on them (keys and values gathered over the
    staged boundaries) gives PackedForward's local output."""
    from nn_data.models import TinyCausalLM
    from nn_data.staging import STAGED, StagedMicrobatch
    from nn_data.testing.coded import coded_batch
    from tests.support.staging_values import staged_values

    pgc = groups(cp=2)
    torch.manual_seed(0)
    model = TinyCausalLM(vocab=53, dim=16, heads=2, layers=1, mask_kind="dense").double().eval()
    packing = PackedForward(model, pad_individual_seqs_to_multiple_of=4, pad_full_seq_to=64, row_capacity=5,
                            pg_collection=pgc)
    stage = StagedMicrobatch(packing, 12)
    addresses = stage.addresses()
    for lengths in ([3, 12, 0], [12, 12, 12, 4, 1], [], [7]):
        ids = coded_batch(lengths, 12) % 53
        lens = torch.tensor(lengths, dtype=torch.int64)
        stage.load(ids, lens).prepare()
        assert stage.addresses() == addresses
        want = staged_values(packing, ids, lens)
        for name in STAGED:
            assert torch.equal(getattr(stage, name), want[name].to(getattr(stage, name).dtype)), (name, lengths)
        inp = packing.prepare(ids, lens)
        with torch.no_grad():
            assert torch.equal(stage.forward(), model(inp.input_ids, inp.position_ids, inp.packed)), lengths
    return packing.cp_rank
