"""``--model hf|megatron`` for ``profiling.microbatches``: a real (tiny) transformer in place of the
model stand-in, and the model's own time per microbatch, so the data path's share of a real
forward can be read off.

Shape legend
    T   packed tokens (``pad_full_seq_to``); C simulated CP size, r the simulated rank
    R   row capacity; O features unpacked per token (``--out-features``); V vocab

:class:`AdapterStandIn` runs ``ids [1, T/C] -> [1, T/C, O]`` through
``nn_data.adapters.HFCausalLMAdapter`` (a transformers Llama built from a config) or
``MegatronGPTAdapter`` (a megatron-core ``GPTModel``, nn_data's layer spec), and returns the
first ``O`` logits of each token (the data path then unpacks ``O`` features, as for the linear
stand-in; the model computes all ``V``). The attention metadata PackedForward would compute in
its compiled prepare step (position ids, segment ids, query index: a few ``O(T)`` index ops)
is computed here, eagerly, and counts as model time.

Simulated CP (one process): keys and values from the other ranks are this rank's own, placed
the way an all-gather would (``simulate_all_gather`` then ``UnshardFromContextParallel``), so
attention has its real cost (``T/C`` queries over ``T`` keys) but not a real result. megatron-core's
THD rotary embedding reads the CP size from ``parallel_state``, so ``--model megatron`` needs
``--cp-size 1`` (this process becomes a one-rank gloo group with ``parallel_state``).
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

from nn_data import ShardForContextParallel, UnshardFromContextParallel, pad_to_row_capacity
from nn_data.diagnostics import HostSyncCounter
from nn_data.errors import PackingError
from nn_data.packed_forward import CPShare, PackedBounds, PackedInfo

REAL_MODELS = ("hf", "megatron")


class AdapterStandIn(nn.Module):
    """``forward(ids [1, T/C], cu_seqlens_padded [R+1]) -> [1, T/C, O]`` through a real model's
    nn_data adapter, as simulated CP rank ``cp_rank`` of ``cp_size`` (module docstring)."""

    def __init__(self, kind: str, vocab: int, hidden: int, out_features: int, seed: int, *, cp_size: int = 1,
                 cp_rank: int = 0, layers: int = 2, heads: int = 4):
        super().__init__()
        if kind not in REAL_MODELS:
            raise PackingError(f"--model={kind!r} is not a real model; expected one of {REAL_MODELS}")
        if kind == "megatron" and cp_size != 1:
            raise PackingError(f"--model=megatron with --cp-size={cp_size}: megatron-core's THD rotary embedding "
                               "reads the CP size from parallel_state, which one process cannot simulate; use "
                               "--cp-size 1 (scripts/packed_forward_example.py --model megatron --cp 2 runs real CP)")
        self.kind, self.out_features, self.cp_size, self.cp_rank = kind, out_features, cp_size, cp_rank
        self.shard = ShardForContextParallel(cp_size, cp_rank, validate=False, host_reads=False)
        self.unshard = UnshardFromContextParallel(cp_size, validate=False, host_reads=False)
        self._owns_dist = False
        kv_heads, ffn = max(1, heads // 2), 2 * hidden
        if kind == "hf":
            from nn_data.adapters import HFCausalLMAdapter
            from nn_data.models.tiny_hf import tiny_hf_model

            model = tiny_hf_model("llama", vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                                  ffn=ffn, seed=seed)
            self.adapter = HFCausalLMAdapter(model, mask_kind="dense")
        else:
            self._owns_dist = _one_rank_parallel_state()
            from nn_data.adapters import MegatronGPTAdapter
            from nn_data.models.tiny_megatron import tiny_gpt_config, tiny_gpt_model

            config = tiny_gpt_config(layers=layers, hidden=hidden, heads=heads, groups=kv_heads, ffn=ffn)
            self.adapter = MegatronGPTAdapter(tiny_gpt_model(config, vocab=vocab, seed=seed).eval(), mask_kind="dense")

    def packed_info(self, local_ids: torch.Tensor, cu_seqlens_padded: torch.Tensor):
        """``(position_ids [1, T/C], PackedInfo)`` for this rank's tokens of the packed layout."""
        total = local_ids.shape[1] * self.cp_size
        cu = cu_seqlens_padded.to(torch.int64)
        positions = torch.arange(total, device=local_ids.device)
        # segment of every packed position: boundaries cu [0, 4, 4, 12] -> [0,0,0,0, 2,2,...] (the empty one skipped)
        segment_ids = torch.searchsorted(cu[1:].contiguous(), positions, right=True)  # [T]
        query_index = self.shard(positions[None], cu_seqlens_padded)[0]  # [T/C], packed place of each local token
        position_ids = (query_index - cu[segment_ids[query_index]])[None]  # [1, T/C]
        gather, params = None, None
        if self.cp_size > 1:
            def gather(local: torch.Tensor) -> torch.Tensor:  # [1, T/C, *] -> [1, T, *], simulated
                stacked = local.expand(self.cp_size, *local.shape[1:]).contiguous()  # [C, T/C, *]
                return self.unshard(stacked, cu_seqlens_padded)
        if self.kind == "megatron":
            try:
                from nn_data.megatron_parallel import make_packed_seq_params
            except ImportError:  # nn_data before make_packed_seq_params moved to megatron_parallel
                from nn_data.megatron_data_common import make_packed_seq_params

            import inspect

            # T as a Python int keeps seq_idx (megatron-core 0.17+) sync-free; older nn_data lacks the argument.
            takes_length = "packed_length" in inspect.signature(make_packed_seq_params).parameters
            known = {"packed_length": total} if takes_length else {}
            params = make_packed_seq_params(cu_seqlens_padded, total, total, **known)
        info = PackedInfo(bounds=PackedBounds(cu_seqlens_padded=cu_seqlens_padded, max_seqlen=torch.tensor(total)),
                          segment_ids=segment_ids, query_index=query_index,
                          cp=CPShare(size=self.cp_size, rank=self.cp_rank, gather=gather), packed_seq_params=params)
        return position_ids, info

    def forward(self, ids: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
        position_ids, info = self.packed_info(ids, cu_seqlens_padded)
        return self.adapter(ids, position_ids, info)[..., : self.out_features]  # [1, T/C, O]

    def close(self) -> None:
        """Leave the one-rank gloo group this stand-in created (``--model megatron``)."""
        if self._owns_dist:
            import torch.distributed as dist
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
            self._owns_dist = False


def _one_rank_parallel_state() -> bool:
    """Make this process a one-rank gloo group with megatron-core's parallel_state (if it is not
    in a group already); True if it created the group."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    return True


def measure_model_alone(model: nn.Module, stream, *, cp_size: int, cp_rank: int, passes: int) -> dict:
    """The model's own time and host syncs per microbatch, on inputs prepared beforehand (the
    data path excluded): ``{"median_s", "mean_s", "syncs_per_microbatch"}``."""
    from profiling.microbatches.stream import MicrobatchPipeline
    from profiling.timing import timed_call

    pipeline = MicrobatchPipeline(model, seq_len=stream.seq_len, total=stream.total, multiple=stream.multiple,
                                  cp_size=cp_size, cp_rank=cp_rank)
    prepared = []
    with torch.no_grad():
        for mb in stream.microbatches:
            padded = pad_to_row_capacity(mb.input_ids, mb.lengths, stream.row_capacity)
            local, layout = pipeline.prepare(padded.x, padded.seq_lengths, padded.num_rows)  # [1, T/C], the plan
            prepared.append((local, layout.cu_seqlens_padded))  # the model's arguments: ([1, T/C], [R+1])
        model(*prepared[0])  # warm-up
        samples = [timed_call(lambda p=p: model(*p)) for _ in range(passes) for p in prepared]
        with HostSyncCounter() as syncs:
            for p in prepared:
                model(*p)
    return dict(median_s=statistics.median(samples), mean_s=sum(samples) / len(samples),
                syncs_per_microbatch=syncs.count / len(prepared))


def data_path_share(results, model_alone: dict) -> dict:
    """``{mode: share}``: the part of each mode's mean time per microbatch that is not the model's
    (``1 - model mean / mode mean``)."""
    return {r.name: 1.0 - model_alone["mean_s"] / r.mean_s for r in results}
