"""Tier: pure CPU, single process.

The length ``K`` of the key/value buffer a shared-prefix or rollout-tree microbatch carries at CP 1 in the NeMo-RL
megatron drop-in (``TreeRecord.kv``, for TransformerEngine's THD attention): without a fixed packed length,
each microbatch's exact need from the layout builder's host ints (``T`` plus the path tokens before its nodes); under
``pad_full_seq_to``, the run's ``cfg["nn_data"]["kv_capacity"]``, one buffer shape for every microbatch of a stream of
different trees and GRPO groups, with every rollout's attention through it (a CPU loop reference of the kernel) equal
to its attention alone (float64), and a compiled dense stand-in of the kernel over the stream's buffers is one graph.
A too small capacity is refused by name with the need and the fix, on the host, in the builder's one read; without
one under ``pad_full_seq_to`` the microbatch has no buffer, and a stock model is refused naming the key.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nn_data.adapters.tree_kv import tree_kv
from nn_data.errors import PackingError
from nn_data.layout import PackSpec, shared_prefix_layout, tree_layout
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.nemo_rl.megatron_data import PackOptions, get_microbatch_iterator, process_microbatch
from nn_data.nemo_rl.megatron_data.tree_inputs import kv_capacity
from tests.megatron_data.test_rollout_tree_dropin import BUDGET, M, _args, _cfg, tree_batch
from tests.support import shared_prefix_kv_cases as kv_cases


def _tree():
    """The docstring example's tree: L ``[5, 4]``, parent ``[-1, 0]``, branch_at ``[0, 3]``, m 1 (T 6, need 12)."""
    return tree_layout(torch.tensor([5, 4]), torch.tensor([-1, 0]), torch.tensor([0, 3]), row_len=5, spec=PackSpec(1))


def _groups():
    """The docstring example's groups: L ``[4, 3, 3]``, P ``[2, 2, 1]``, m 1 (T 8, need 13)."""
    return shared_prefix_layout(torch.tensor([4, 3, 3]), torch.tensor([2, 2, 1]), torch.tensor([7, 7, 9]), row_len=4,
                                spec=PackSpec(1))


def _need(layout) -> int:
    """A loop reference of the need from the tensors: ``T`` plus each non-empty slot's begin in its rollout."""
    bounds = layout.layout.bounds().tolist()
    owner, begin = layout.nodes.owner.tolist(), layout.nodes.begin.tolist()
    return layout.total + sum(begin[s] for s in range(len(bounds) - 1)
                              if bounds[s + 1] > bounds[s] and owner[s] < layout.rows)


def test_the_need_is_exact_from_the_builders_ints_for_trees_and_groups():
    for layout, need in ((_tree(), 12), (_groups(), 13)):
        assert kv_capacity(layout) == need == _need(layout)
        kv = tree_kv(layout, kv_capacity=need)  # exactly enough: the slack sequence is empty
        assert kv.cu_seqlens_kv.tolist()[-2:] == [need, need] and bool(kv.kv_valid.all())
        assert kv_capacity(layout, run_capacity=20) == 20
    unread = tree_layout(torch.tensor([5, 4]), torch.tensor([-1, 0]), torch.tensor([0, 3]), row_len=5,
                         spec=PackSpec(1, fixed_total=8), host_reads=False)
    with pytest.raises(PackingError, match=r"^kv_capacity needs a rollout-tree layout built on the host \(tree_layout "
                                           r"or shared_prefix_layout with host_reads=True\)$"):
        kv_capacity(unread)


def test_a_too_small_run_capacity_is_refused_with_the_need():
    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['kv_capacity'\]=12 is too small for this microbatch: "
                                           r"its key/value buffer needs K=13 \(T=8 plus 5 path tokens before its "
                                           r"nodes\); raise kv_capacity to at least 13$"):
        kv_capacity(_groups(), run_capacity=12)


def test_the_config_key_is_checked():
    assert PackOptions.from_cfg({"nn_data": {"rollout_tree": True, "kv_capacity": 64}}).kv_capacity == 64
    with pytest.raises(PackingError, match=r"^kv_capacity=0 is invalid; expected an int >= 1 or None$"):
        PackOptions(rollout_tree=True, kv_capacity=0)
    with pytest.raises(PackingError, match=r"^kv_capacity=True is invalid"):
        PackOptions(shared_prefix=True, kv_capacity=True)
    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['kv_capacity'\]=64 sizes the key/value buffer of a "
                                           r"shared-prefix or rollout-tree microbatch; set cfg\['nn_data'\]"
                                           r"\['shared_prefix'\] or \['rollout_tree'\], or drop kv_capacity$"):
        PackOptions(kv_capacity=64)
    with pytest.raises(PackingError, match=r"^cfg\['nn_data'\]\['kv_capacity'\]=16 is below pad_full_seq_to=32: .*"
                                           r"set kv_capacity to at least 32$"):
        PackOptions(rollout_tree=True, pad_full_seq_to=32, kv_capacity=16)


def _stream(**nn_data):
    """The planned step's microbatches (trees of depth 1 to 3 and a GRPO star, different in each) at CP 1."""
    shards, _ = tree_batch().shard_by_batch_size(1, sequence_packing_args=_args())
    iterator, count, _, _, _ = get_microbatch_iterator(shards[0].get_batch(0), _cfg(1, **nn_data), 1, None)
    mbs = list(iterator)
    assert len(mbs) == count > 1
    return mbs


def test_one_buffer_shape_for_a_stream_of_different_trees_under_pad_full_seq_to_float64():
    """Under one ``pad_full_seq_to`` and ``kv_capacity`` every microbatch's buffer is ``[K, *]`` for the one K,
    while the needs differ; through it (bottom-right causal over its boundaries: the kernel's loop reference) every
    rollout's attention equals its attention alone at every one of its tokens (1e-12)."""
    needs = {mb.shared_prefix.kv.max_seqlen_kv for mb in _stream()}  # without a fixed T: each one's exact need
    assert len(needs) > 1
    run_k = max(needs) + 8
    # Without kv_capacity a fixed T gets no buffer (its length would vary), and the record's boundaries are the slots'
    for mb in _stream(pad_full_seq_to=BUDGET):
        slots = mb.shared_prefix.layout.layout.cu_seqlens_padded
        assert mb.shared_prefix.kv is None and torch.equal(mb.packed_seq_params.cu_seqlens_kv, slots)
    gen = torch.Generator().manual_seed(5)
    shapes = set()
    for mb in _stream(pad_full_seq_to=BUDGET, kv_capacity=run_k):
        layout, kv, params = mb.shared_prefix.layout, mb.shared_prefix.kv, mb.packed_seq_params
        assert layout.total == BUDGET and kv.cu_seqlens_kv.tolist()[-2] == _need(layout) <= run_k
        q, k, v = (torch.randn(BUDGET, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
        keys, values = kv.gather(k), kv.gather(v)
        shapes.add((tuple(keys.shape), tuple(kv.kv_source.shape), tuple(kv.kv_valid.shape), params.max_seqlen_kv))
        got = kv_cases.varlen_reference(q, keys, values, params.cu_seqlens_q, params.cu_seqlens_kv)
        where, _ = layout.row_places(layout.row_len)  # [B, S] packed place of each rollout token
        for b, n in enumerate(layout.seq_lengths.tolist()):
            at = where[b, :n]
            alone = F.scaled_dot_product_attention(*(x[at].transpose(0, 1)[None] for x in (q, k, v)),
                                                   is_causal=True)[0].transpose(0, 1)  # [n, 2, 8]
            torch.testing.assert_close(got[at], alone, rtol=0, atol=1e-12)
    assert shapes == {((run_k, 2, 8), (run_k,), (run_k,), run_k)}


@pytest.mark.parametrize("options", [PackOptions(rollout_tree=True, kv_capacity=40),
                                     PackOptions(shared_prefix=True, kv_capacity=40)], ids=["tree", "groups"])
def test_the_run_capacity_costs_no_host_read(options):
    """The need comes from the builder's one read: still one host read per microbatch under ``pad_full_seq_to``
    (the call's) with the run's ``kv_capacity``; set, the capacity is the buffer's length without a fixed ``T``
    too."""
    from nn_data.diagnostics import HostSyncCounter

    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 3, 0, 0], [5, 6, 7, 4, 4]])
    fields = ({"parent": [-1, 0, 0], "branch_at": [0, 2, 3]} if options.rollout_tree is not None else
              {"group_ids": [1, 1, 1], "prefix_lengths": [2, 2, 2]})
    data = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([5, 3, 5]),
                           **{k: torch.tensor(v) for k, v in fields.items()})
    with HostSyncCounter() as syncs:
        mb = process_microbatch(data, "input_lengths", M, 1, 24, pack_sequences=True, options=options)
    assert syncs.count == 1, syncs.calls
    assert mb.shared_prefix.kv.max_seqlen_kv == 40 == mb.packed_seq_params.max_seqlen_kv
    unfixed = process_microbatch(data, "input_lengths", M, 1, None, pack_sequences=True, options=options)
    assert unfixed.shared_prefix.layout.total < 24 and unfixed.shared_prefix.kv.max_seqlen_kv == 40  # K without T


def _dense_varlen(q, k, v, kv_source, cu_q, cu_kv):
    """A variable-length kernel as one dense masked attention (bottom-right causal per sequence, from the
    boundaries; no host read): ``q [T, H, D]``, ``k, v [T, H, D]`` gathered to ``[K, H, D]`` by ``kv_source [K]``
    -> ``[T, H, D]``. Each query sees at least its own key, so no row is all masked."""
    keys, values = k.index_select(0, kv_source), v.index_select(0, kv_source)  # [K, H, D]
    q_pos = torch.arange(q.shape[0], device=q.device)  # [T]
    k_pos = torch.arange(keys.shape[0], device=q.device)  # [K]
    sq = torch.searchsorted(cu_q[1:], q_pos.to(cu_q.dtype), right=True)  # [T] the sequence of each query
    sk = torch.searchsorted(cu_kv[1:], k_pos.to(cu_kv.dtype), right=True)  # [K]
    shift = (cu_kv[1:] - cu_kv[:-1]) - (cu_q[1:] - cu_q[:-1])  # [N+1] keys minus queries per sequence
    q_off, k_off = q_pos - cu_q[sq], k_pos - cu_kv[sk]  # [T], [K]
    allowed = (sq[:, None] == sk[None, :]) & (k_off[None, :] <= (q_off + shift[sq])[:, None])  # [T, K]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=allowed)  # [1, H, T, D]
    return out[0].transpose(0, 1)


def test_one_graph_over_the_stream_of_buffers_under_pad_full_seq_to_float64():
    """A compiled attention over the record's buffer (``fullgraph=True``; the boundaries' ``N + 2`` entries, which
    follow the rollout count, marked dynamic) compiles once for the stream: ``K`` is the run's; and it equals the
    kernel's loop reference (1e-12)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(_dense_varlen, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(6)
    mbs = _stream(pad_full_seq_to=BUDGET, kv_capacity=72)
    assert len({mb.shared_prefix.kv.cu_seqlens_q.shape[0] for mb in mbs}) > 1  # different rollout counts
    for mb in mbs:
        kv = mb.shared_prefix.kv
        q, k, v = (torch.randn(BUDGET, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
        cu_q, cu_kv = kv.cu_seqlens_q.clone(), kv.cu_seqlens_kv.clone()
        torch._dynamo.mark_dynamic(cu_q, 0)
        torch._dynamo.mark_dynamic(cu_kv, 0)
        got = compiled(q, k, v, kv.kv_source, cu_q, cu_kv)
        want = kv_cases.varlen_reference(q, kv.gather(k), kv.gather(v), kv.cu_seqlens_q, kv.cu_seqlens_kv)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert counter.frame_count == 1
