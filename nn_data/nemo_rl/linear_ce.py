"""NeMo-RL's log-probs from hidden states (its linear-CE fusion) on nn_data's fused head, with context parallelism:
docs/logprobs.md, "NeMo-RL's linear-CE fusion, with context parallelism".

    # from nemo_rl.distributed.model_utils import from_parallel_hidden_states_to_logprobs
    from nn_data.nemo_rl.model_utils import from_parallel_hidden_states_to_logprobs

Shape legend
    B   rows (sequences); ``cu_seqlens_padded`` has B+1 entries
    S   row length (unpacked rows: ``target.shape[1]``; packed: ``unpacked_seqlen``)
    T   packed tokens; C context-parallel size; TP tensor-parallel size
    H   hidden size (sequence-first states: ``[S/C, B, H]``, packed ``[T/C, 1, H]``, ``/TP`` more with SP)
    Vt  ``V / TP`` rows of the output weight on a TP rank"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nn_data.logprobs import hidden_logprobs_local
from nn_data.extension import checks, hidden_rows, process_groups
from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.nemo_rl.logprob_steps import (
    DEFAULT_CHUNK_TOKENS, chunk_and_filter, gather_cp, grad_mode, groups, in_vocab, nemo_rl_rows,
    out_of_vocab_as_nemo_rl, packed_logprobs, row_layout,
)

HIDDEN = "tensor_parallel_hidden_states"
WEIGHT = "output_weight_layer"
ROWS_SHAPE = "[S // CP, B, H] ([S // (CP * TP), B, H] with sequence parallelism)"
PACKED_SHAPE = "[T // CP, 1, H] or [1, T // CP, H] (// TP more with sequence parallelism)"


def from_parallel_hidden_states_to_logprobs(
    tensor_parallel_hidden_states: torch.Tensor,
    output_weight_layer: torch.Tensor,
    runtime_gather_output: Optional[bool],
    target: torch.Tensor,
    vocab_start_index: int, vocab_end_index: int, tp_group: Optional["dist.ProcessGroup"],
    inference_only: bool = False, cp_group: Optional["dist.ProcessGroup"] = None, chunk_size: Optional[int] = None,
    *,
    pg_collection=None,
) -> torch.Tensor:
    """Log-probs ``[B, S-1]`` of unpacked rows from hidden states ``[S/C, B, H]``: NeMo-RL's function.

    ``target [B, S]`` holds the whole rows; ``runtime_gather_output`` is accepted and unused, as in NeMo-RL;
    ``chunk_size`` positions of every row per chunk (None: 256 tokens); ``pg_collection`` (keyword-only) stands for
    the groups passed as None.

    Example (V 3, zero weight): ``target [[0, 1, 2]]`` -> ``[[log(1/3), log(1/3)]]``.

    Raises :class:`~nn_data.errors.PackingError`: hidden states not floating point 3-D, a weight whose columns are not
    ``H``, a vocabulary slice not this TP rank's, ``target`` not integer ``[B, S]`` matching the shard, an odd row
    shard under CP, ``chunk_size`` below 1, a group this process is not in."""
    cp, tp = groups(cp_group, tp_group, pg_collection)
    hidden, weight = tensor_parallel_hidden_states, output_weight_layer
    checks.check_output_head(HIDDEN, hidden, WEIGHT, weight, ROWS_SHAPE)
    chunk = _chunk_tokens(chunk_size, vocab_start_index, vocab_end_index, weight, tp, hidden.shape[1])
    batch = hidden.shape[1]
    checks.check_row_target(target, batch, target.shape[1] if isinstance(target, torch.Tensor) else 0)
    seq = target.shape[1]
    sequence_parallel = _sequence_parallel(hidden.shape[0], seq, cp, tp)
    local_len = seq // cp.size  # S_loc
    checks.check_even_shard(HIDDEN, local_len, cp.size, "row")
    checks.check_same_device(**{HIDDEN: hidden, "target": target})
    with grad_mode(inference_only):
        layout = row_layout(1, seq, target.device, op="from_parallel_hidden_states_to_logprobs")  # [0, S]
        source = layout.local_places(cp.size, cp.rank).source  # [S_loc] row positions on this rank
        # position p of row b scores target[b, p + 1]; values run position-major, as the hidden states:
        # S 8, C 2, rank 1 -> positions [2, 3, 4, 5] score targets [3, 4, 5, 6] of every row
        token = target.to(torch.int64).index_select(1, (source + 1).clamp(max=max(seq - 1, 0)))  # [B, S_loc]
        token = token.T.reshape(-1)  # [S_loc*B]
        keep = (source + 1 < seq)[:, None].expand(local_len, batch).reshape(-1)  # [S_loc*B]
        values = _values(hidden.reshape(-1, hidden.shape[-1]), weight, token, keep, vocab_start_index, tp,
                         sequence_parallel, chunk)  # [S_loc*B]
        full = gather_cp(values.view(local_len, batch), layout, cp)  # [1, S, B]
        return full[0].T[:, :-1]  # [B, S-1]


def from_parallel_hidden_states_to_logprobs_packed_sequences(
    tensor_parallel_hidden_states: torch.Tensor,
    output_weight_layer: torch.Tensor,
    # the unfused function's arguments from here on (its names, order and defaults)
    target: torch.Tensor, cu_seqlens_padded: torch.Tensor, unpacked_seqlen: int,
    vocab_start_index: int, vocab_end_index: int, group: Optional["dist.ProcessGroup"],
    inference_only: bool = False, cp_group: Optional["dist.ProcessGroup"] = None, chunk_size: Optional[int] = None,
    sampling_params=None, target_is_pre_rolled: bool = False,
    *,
    validate: bool = True, pg_collection=None,
) -> torch.Tensor:
    """Log-probs ``[B, S-1]`` from this rank's packed hidden states ``[T/C, 1, H]`` and the output weight, in place of
    the logits of ``from_parallel_logits_to_logprobs_packed_sequences`` (every other argument is that function's).

    Raises :class:`~nn_data.errors.PackingError` as :func:`from_parallel_hidden_states_to_logprobs` for the hidden states
    and the weight, and as the unfused function for everything else."""
    cp, tp = groups(cp_group, group, pg_collection)
    seq_len = checks.positive_int("unpacked_seqlen", unpacked_seqlen)
    with grad_mode(inference_only):
        packed, layout = packed_hidden_logprobs(
            tensor_parallel_hidden_states, output_weight_layer, target, cu_seqlens_padded, seq_len, vocab_start_index,
            vocab_end_index, cp, tp, chunk_size=chunk_size, sampling_params=sampling_params,
            pre_rolled=target_is_pre_rolled, validate=validate,
            op="from_parallel_hidden_states_to_logprobs_packed_sequences")  # [1, T]
        return nemo_rl_rows(packed, layout, seq_len)  # [B, S-1]


def packed_hidden_logprobs(hidden, weight, target, cu_seqlens_padded, seq_len: int, vocab_start_index: int,
                           vocab_end_index: int, cp: process_groups.ParallelInfo, tp: process_groups.ParallelInfo, *, chunk_size, sampling_params,
                           pre_rolled: bool, validate: bool, op: str):
    """``(packed [1, T], layout)`` from the hidden states: their and the weight's checks, then
    :func:`~nn_data.nemo_rl.logprob_steps.packed_logprobs`."""
    checks.check_output_head(HIDDEN, hidden, WEIGHT, weight, PACKED_SHAPE)
    if 1 not in hidden.shape[:2]:
        raise PackingAssertionError(f"{HIDDEN} must be {PACKED_SHAPE}, got shape {tuple(hidden.shape)}")
    rows = hidden_rows(hidden)  # [n, H]
    chunk, filt = chunk_and_filter(chunk_size, sampling_params, vocab_start_index, vocab_end_index, weight.shape[0],
                                   tp, against=WEIGHT, unit="rows")
    checks.check_packed_ids("target", target)
    total = target.shape[1] * (cp.size if pre_rolled else 1)
    sequence_parallel = _sequence_parallel(rows.shape[0], total, cp, tp)
    return packed_logprobs(
        op=op, name=HIDDEN, data=hidden, target=target, cu_seqlens_padded=cu_seqlens_padded, total=total,
        seq_len=seq_len, cp=cp, pre_rolled=pre_rolled, validate=validate, vocab=weight.shape[0] * tp.size,
        score=lambda token, keep: _kernel(rows, weight, token, keep, vocab_start_index, tp, sequence_parallel, chunk,
                                          filt),
    )


class ChunkedDistributedHiddenStatesToLogprobs:
    """``apply(tensor_parallel_hidden_states [S, B, H], target [B, S], output_weight_layer [Vt, H], vocab_start_index,
    vocab_end_index, chunk_size, tp_group, inference_only=False) -> [B, S]``: NeMo-RL's autograd function, ``log
    softmax(hidden @ weight.T)`` at every position for the rolled ``target``; no CP."""

    @staticmethod
    def apply(tensor_parallel_hidden_states, target, output_weight_layer, vocab_start_index, vocab_end_index,
              chunk_size, tp_group, inference_only=False, *, pg_collection=None):
        tp = process_groups.given_group_info(tp_group, pg_collection=pg_collection, field="tp")
        hidden, weight = tensor_parallel_hidden_states, output_weight_layer
        checks.check_output_head(HIDDEN, hidden, WEIGHT, weight, "[S, B, H] ([S // TP, B, H] with sequence "
                                                                  "parallelism)")
        batch = hidden.shape[1]
        chunk = _chunk_tokens(chunk_size, vocab_start_index, vocab_end_index, weight, tp, batch)
        checks.check_row_target(target, batch, target.shape[1] if isinstance(target, torch.Tensor) else 0)
        seq = target.shape[1]
        sequence_parallel = _sequence_parallel(hidden.shape[0], seq, process_groups.SINGLE, tp)
        with grad_mode(inference_only):
            token = target.to(torch.int64).T.reshape(-1)  # [S*B] position-major, as the hidden states
            keep = torch.ones_like(token, dtype=torch.bool)
            values = _values(hidden.reshape(-1, hidden.shape[-1]), weight, token, keep, vocab_start_index, tp,
                             sequence_parallel, chunk)  # [S*B]
            return values.view(seq, batch).T  # [B, S]


def _chunk_tokens(chunk_size, vocab_start_index, vocab_end_index, weight, tp: process_groups.ParallelInfo, batch: int) -> int:
    """Tokens per chunk: NeMo-RL's ``chunk_size`` counts positions of every row (``chunk_size * B`` tokens);
    None: 256 tokens. Checks the vocabulary slice against the weight's rows."""
    chunk, _ = chunk_and_filter(chunk_size, None, vocab_start_index, vocab_end_index, weight.shape[0], tp,
                                against=WEIGHT, unit="rows")
    return DEFAULT_CHUNK_TOKENS if chunk_size is None else chunk * max(batch, 1)


def _sequence_parallel(rows: int, positions: int, cp: process_groups.ParallelInfo, tp: process_groups.ParallelInfo) -> bool:
    """Whether ``rows`` hidden states are this rank's ``1/(C*TP)`` of ``positions`` rather than its ``1/C``.

    Example: 32 positions, C 2, TP 2: 16 rows -> False, 8 rows -> True, 12 rows -> PackingError."""
    if rows * cp.size == positions:
        return False
    if tp.size > 1 and rows * cp.size * tp.size == positions:
        return True
    shares = f"{positions}/{cp.size} = {positions / cp.size:g}"
    if tp.size > 1:
        shares += f" (or {positions}/{cp.size * tp.size} = {positions / (cp.size * tp.size):g} with sequence parallelism)"
    raise PackingAssertionError(
        f"{HIDDEN} hold {rows} positions per row but this rank's share of the {positions} positions of target is "
        f"{shares} (cp_size={cp.size}, tp_size={tp.size}); pass this rank's zigzag shard of the hidden states"
    )


def _kernel(rows, weight, token, keep, vocab_start: int, tp: process_groups.ParallelInfo, sequence_parallel: bool, chunk: int,
            filt=None) -> torch.Tensor:
    """The fused kernel's ``[N]`` values (:func:`nn_data.logprobs.hidden_logprobs_local`)."""
    return hidden_logprobs_local(rows, weight, token, keep, vocab_start=vocab_start, tp_group=tp.group,
                                 tp_size=tp.size, sequence_parallel=sequence_parallel, chunk_tokens=chunk,
                                 sampling=filt)


def _values(rows, weight, token, keep, vocab_start: int, tp: process_groups.ParallelInfo, sequence_parallel: bool, chunk: int,
            filt=None) -> torch.Tensor:
    """The fused kernel's ``[N]`` values with NeMo-RL's rule for a target outside the vocabulary."""
    values = _kernel(rows, weight, token, keep, vocab_start, tp, sequence_parallel, chunk, filt)
    return out_of_vocab_as_nemo_rl(values, in_vocab(token, weight.shape[0] * tp.size))
