"""Tier: pure CPU, single process (torch.compile with inductor for the compiled stream). NeMo-RL's own
tests of this module, run against it: docs/nemo-rl.md, "The AutoModel data path".

nn_data.nemo_rl.automodel_data (NeMo-RL's nemo_rl.models.automodel.data): one import switches, no host sync
per packed microbatch, one compiled graph over a stream, NeMo-RL's results, and its CP buffers.
"""

from __future__ import annotations

from unittest.mock import MagicMock

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import nn_data.nemo_rl.automodel_data as automodel_data
from nn_data.nemo_rl.batched_data_dict import BatchedDataDict
from nn_data.diagnostics import HostSyncCounter
from nn_data.errors import PackingError
from nn_data.nemo_rl import megatron_data
from nn_data.testing.coded import coded_batch
from tests.automodel.test_huggingface_common import oracle_pack

EOS = 2


def _tokenizer():
    tokenizer = MagicMock()
    tokenizer.eos_token_id = EOS
    return tokenizer


def _cfg(**nn_data):
    cfg = {"dtensor_cfg": {"sequence_parallel": False}, "dynamic_batching": {"enabled": False},
           "sequence_packing": {"enabled": True, "train_mb_tokens": 64}}
    if nn_data:
        cfg["nn_data"] = nn_data
    return cfg


def _mb(lengths, seq_len):
    ids = coded_batch(lengths, seq_len)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(lengths, dtype=torch.int64),
                           sample_mask=torch.ones(len(lengths)))


def test_one_import_switches():
    import nn_data.nemo_rl.automodel_data as home

    assert automodel_data is home
    for name in ("ProcessedInputs", "ProcessedMicrobatch", "get_microbatch_iterator", "process_microbatch",
                 "process_global_batch", "make_processed_microbatch_iterator", "check_sequence_dim",
                 "filter_multimodal_kwargs_for_model", "pack_sequences", "get_flash_attention_kwargs"):
        assert hasattr(automodel_data, name), name


def test_a_packed_microbatch_is_nemo_rls_row_and_reads_nothing():
    lengths, mb = [9, 0, 12, 5], _mb([9, 0, 12, 5], 12)
    with HostSyncCounter() as syncs:
        out = automodel_data.process_microbatch(mb, _tokenizer(), True, _cfg(), cp_size=1)
    assert syncs.count == 0, syncs.calls
    want_ids, want_pos, _ = oracle_pack(mb["input_ids"], lengths, [4], EOS, 64)
    assert torch.equal(out.input_ids, want_ids) and torch.equal(out.position_ids, want_pos)
    assert out.seq_len == 64 and out.attention_mask is None and out.cp_buffers == [] and out.seq_index is None
    flash = out.flash_attn_kwargs
    assert flash.cu_seqlens_q.tolist() == [0, 9, 9, 21, 26] and flash.max_seqlen_q == flash.max_seqlen_k == 64
    assert out.has_flash_attention and not out.has_context_parallel and not out.is_multimodal


def test_the_packed_length_is_the_planners_budget():
    """T = max(train_mb_tokens, logprob_mb_tokens): one shape for the training and the log-prob passes;
    cfg["nn_data"]["pad_full_seq_to"] sets it; with buckets it comes from the data."""
    cfg = _cfg()
    assert automodel_data.fixed_total(cfg) == 64
    cfg["sequence_packing"]["logprob_mb_tokens"] = 128
    assert automodel_data.fixed_total(cfg) == 128
    assert automodel_data.fixed_total(_cfg(pad_full_seq_to=96)) == 96
    assert automodel_data.fixed_total(_cfg(buckets=[64, 128])) is None
    out = automodel_data.process_microbatch(_mb([30, 50], 50), _tokenizer(), True, _cfg(buckets=[64, 128]), 1)
    assert out.seq_len == 128  # 80 tokens: the 128 bucket, after one read


def test_a_microbatch_over_the_packed_length_is_refused_naming_the_setting_t_came_from():
    """The device assert names the setting the caller set: the token budget when T came from it (it named
    pad_full_seq_to, which this configuration never sets, before), pad_full_seq_to when that is set."""
    with pytest.raises(RuntimeError, match=r'exceeds cfg\["sequence_packing"\]\["train_mb_tokens"\]=64'):
        automodel_data.process_microbatch(_mb([40, 40], 40), _tokenizer(), True, _cfg(), 1)
    cfg = _cfg()
    cfg["sequence_packing"]["logprob_mb_tokens"] = 72
    with pytest.raises(RuntimeError, match=r'exceeds cfg\["sequence_packing"\]\["logprob_mb_tokens"\]=72'):
        automodel_data.process_microbatch(_mb([40, 40], 40), _tokenizer(), True, cfg, 1)
    with pytest.raises(RuntimeError, match=r'exceeds cfg\["nn_data"\]\["pad_full_seq_to"\]=72'):
        automodel_data.process_microbatch(_mb([40, 40], 40), _tokenizer(), True, _cfg(pad_full_seq_to=72), 1)


@pytest.mark.compile
def test_the_packing_compiles_once_over_a_stream_with_inductor_and_refuses_an_over_budget_microbatch():
    """Inductor, the backend users run: the device check's message names the budget with its quotes
    (``cfg["sequence_packing"]["train_mb_tokens"]``), which inductor once wrote unescaped into C++."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    cfg = _cfg(compile=True, row_capacity=6, backend=counter)
    stream = [([9, 0, 12, 5], 12), ([3], 3), ([20, 20, 1], 20), ([], 7), ([1, 2, 3, 4, 5, 6], 6)]
    for lengths, seq_len in stream:
        mb = _mb(lengths, seq_len)
        compiled = automodel_data.process_microbatch(mb, _tokenizer(), True, cfg, 1)
        eager = automodel_data.process_microbatch(mb, _tokenizer(), True, _cfg(), 1)
        assert torch.equal(compiled.input_ids, eager.input_ids) and torch.equal(compiled.position_ids,
                                                                                eager.position_ids)
    with pytest.raises(RuntimeError, match=r'exceeds cfg\["sequence_packing"\]\["train_mb_tokens"\]=64$'):
        automodel_data.process_microbatch(_mb([40, 40], 40), _tokenizer(), True, cfg, 1)
    torch._dynamo.reset()
    assert counter.frame_count == 1


def test_no_packing_keeps_the_rows():
    mb = _mb([3, 5], 5)
    out = automodel_data.process_microbatch(mb, _tokenizer(), False, _cfg(), cp_size=1)
    assert torch.equal(out.input_ids, mb["input_ids"]) and out.attention_mask.all() and out.seq_len == 5
    assert out.position_ids.tolist() == [list(range(5))] * 2 and out.flash_attn_kwargs == {}


def test_context_parallel_buffers_and_packing_under_cp_refused():
    mb = _mb([3, 8], 8)
    out = automodel_data.process_microbatch(mb, _tokenizer(), False, _cfg(), cp_size=2)
    assert out.attention_mask is None and out.seq_index.tolist() == [list(range(8))]
    assert out.cp_buffers[0] is out.input_ids and out.cp_buffers[1] is out.position_ids and len(out.cp_buffers) == 3
    mb["token_mask"] = torch.ones(2, 8)
    mb["alignment_student_chunk_id"] = torch.zeros(2, 8)
    out = automodel_data.process_microbatch(mb, _tokenizer(), False, _cfg(), cp_size=2)
    assert out.cp_buffers[3] is mb["token_mask"] and out.cp_buffers[4] is mb["alignment_student_chunk_id"]
    with pytest.raises(PackingError, match=r"Context parallel is not supported for sequence packing"):
        automodel_data.process_microbatch(mb, _tokenizer(), True, _cfg(), cp_size=2)


def test_torchs_context_parallel_split_of_a_row_is_nn_datas_zigzag():
    """The head-tail split torch's context_parallel() gives each unpacked row (S divisible by 2C) is
    nn_data's zigzag of a single segment: the same tokens on every rank, in the same order."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    from nn_data.layout.index import zigzag_source

    seq_len, cp = 24, 3
    order = _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()[0]  # [S]: rank-major
    for rank in range(cp):
        ours = zigzag_source(torch.tensor([0, seq_len]), seq_len // cp, cp, rank)
        assert torch.equal(order[rank * seq_len // cp : (rank + 1) * seq_len // cp], ours)


def test_the_iterators():
    data = BatchedDataDict(input_ids=coded_batch([3, 5, 2, 4], 5), input_lengths=torch.tensor([3, 5, 2, 4]),
                           sample_mask=torch.ones(4))
    cfg = _cfg()
    cfg["sequence_packing"]["enabled"] = False
    iterator, count = automodel_data.get_microbatch_iterator(data, cfg, 2, None, _tokenizer())
    batches = list(iterator)
    assert count == 2 and [b.original_batch_size for b in batches] == [2, 2]
    assert [b.processed_inputs.input_ids.shape for b in batches] == [(2, 5), (2, 5)]
    with pytest.raises(PackingError, match=r"mbs=0 is invalid"):
        automodel_data.get_microbatch_iterator(data, cfg, 0, None, _tokenizer())


def test_process_global_batch_is_the_megatron_paths():
    data = BatchedDataDict(input_ids=torch.zeros(4, 6, dtype=torch.long), sample_mask=torch.tensor([1, 1, 0, 1]),
                           token_mask=torch.ones(4, 6))
    ours = automodel_data.process_global_batch(data, None, None, batch_idx=0, batch_size=4)
    theirs = megatron_data.process_global_batch(data, None, None, batch_idx=0, batch_size=4)
    assert int(ours["global_valid_seqs"]) == int(theirs["global_valid_seqs"]) == 3
    assert int(ours["global_valid_toks"]) == 15


def test_check_sequence_dim():
    data = BatchedDataDict(input_ids=torch.zeros(2, 6), token_mask=torch.zeros(2, 6), teacher=torch.zeros(2, 9))
    assert automodel_data.check_sequence_dim(data, skip_keys=["teacher"]) == (1, 6)
    with pytest.raises(PackingError, match=r"Dim 1 must be the sequence dim, expected dim 1=6 .* \(key 'teacher'\)"):
        automodel_data.check_sequence_dim(data)
