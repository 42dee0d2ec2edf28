"""NeMo-RL's ``nemo_rl.models.huggingface.common`` packing helpers on nn_data's layouts: switch by changing one import
(docs/nemo-rl.md, "The AutoModel data path").

    # from nemo_rl.models.huggingface.common import pack_sequences, unpack_tensor, get_flash_attention_kwargs
    from nn_data.nemo_rl.huggingface_common import pack_sequences, unpack_tensor, get_flash_attention_kwargs

Shape legend
    B   sequences; R packed rows (``len(packed_sequence_size)``)
    S   padded row length of the input batch
    T   packed row length: ``pad_full_seq_to`` when given (no host read), else NeMo-RL's ``max(longest row, min_seq_len)``
    W   unpacked row length: ``max_seqlen`` when given (no host read), else the longest length
    *   trailing dims of an unpacked tensor (``V`` for logits)"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple, TypeVar

import torch

from nn_data.layout import PackSpec, layout_from_lengths
from nn_data.extension import checks, exclusive_cumsum, layout_checks, segment_ids, unpack_sequences
from nn_data.nemo_rl.assertions import PackingAssertionError, spelled, translate_errors
from nn_data.nemo_rl.megatron_data.graph import row_padded
from nn_data.nemo_rl.megatron_data.options import bucket_total

Tensor = TypeVar("Tensor", bound=torch.Tensor)


@dataclasses.dataclass
class FlashAttentionKwargs:
    """FlashAttention-2's variable-length arguments: ``cu_seqlens_q/k [B+1]`` int32, ``max_seqlen_q/k`` ints."""

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def on_device(lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``lengths`` on ``device``: a CPU tensor goes to an accelerator through pinned memory, asynchronously
    (no host sync); already there, it is returned as is."""
    if lengths.device == torch.device(device):
        return lengths
    if lengths.device.type == "cpu" and torch.device(device).type == "cuda":
        return lengths.pin_memory().to(device, non_blocking=True)
    return lengths.to(device)


def _pack_row(input_ids, lengths, num_rows, total: int, padding_value: int, name: str, validate: bool):
    """One packed row on the device executor (no host read): ``[B, S]`` ids and ``[B]`` lengths -> ``[1, T]`` ids,
    ``[1, T]`` position ids (0 on padding) and ``cu_seqlens [B+1]``.

    Example: lengths ``[2, 3]``, T 7, pad -1 -> ids ``[a0 a1 b0 b1 b2 -1 -1]``, positions ``[0 1 0 1 2 0 0]``."""
    if validate:  # first, naming the setting T came from (the layout's own assert names pad_full_seq_to)
        checks.device_assert(lengths.sum() <= total, f"nn_data.pack_sequences: the packed total sum(seq_lengths) "
                                                       f"exceeds {name}={total}")
    layout = layout_from_lengths(lengths, input_ids.shape[1], PackSpec(fixed_total=total), num_rows=num_rows,
                                 validate=validate, host_reads=False, op="pack_sequences")
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)  # [B, S]
    return layout.pack(input_ids, fill=padding_value), layout.pack(positions, fill=0), layout.cu_seqlens


@functools.lru_cache(maxsize=8)
def _compiled_pack_row(backend, mode):
    kwargs = {"mode": mode} if mode else {}
    return torch.compile(_pack_row, backend=backend, fullgraph=True, **kwargs)


def pack_row(input_ids, lengths, total: int, padding_value: int, *, name: str = "pad_full_seq_to",
             validate: bool = True, options=None):
    """:func:`_pack_row`, compiled when ``options.compile`` (rows padded as
    :func:`~nn_data.nemo_rl.megatron_data.graph.row_padded` pads them: a stream of one ``T`` compiles once)."""
    if options is None or not options.compile:
        return _pack_row(input_ids, lengths, None, total, padding_value, name, validate)
    ids, lengths, num_rows = row_padded(input_ids, lengths, options)  # [R, S], [R]
    fn = _compiled_pack_row(options.backend, options.mode)
    with torch.no_grad():
        return fn(ids, lengths, num_rows, total, padding_value, name, validate)


def pack_sequences(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    packed_sequence_size: list[int],
    padding_value: int = 0,
    return_attention_mask: bool = True,
    min_seq_len: int = 0,
    *,
    pad_full_seq_to: Optional[int] = None,
    options=None,
    pad_full_seq_to_name: str = "pad_full_seq_to",
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Pack ``packed_sequence_size[r]`` consecutive sequences of ``input_ids [B, S]`` into row ``r`` back to back ->
    ``(input_ids_packed [R, T], position_ids_packed [R, T], attention_mask [R, T, T] or None)``; the mask is
    document-causal.

    Args:
        input_ids: ``[B, S]``.
        input_lengths: ``[B]`` ints in ``[0, S]``.
        packed_sequence_size: non-negative ints summing to ``B``.
        padding_value: the ids' padding.
        return_attention_mask: return the ``[R, T, T]`` mask.
        min_seq_len: ``T``'s floor when it is read from the lengths.
        pad_full_seq_to: nn_data only: ``T``, no host read (a row holding more raises, a device assert).
        pad_full_seq_to_name: how the messages name ``pad_full_seq_to`` (the setting the caller took it from).
        options: ``PackOptions`` (``cfg["nn_data"]``): compile the packing, or round ``T`` up to a bucket.

    Example: lengths ``[2, 3, 1]``, ``packed_sequence_size [3]``, ``padding_value -1``, ``min_seq_len 8`` -> ids
    ``[[a0 a1 b0 b1 b2 c0 -1 -1]]``, positions ``[[0 1 0 1 2 0 0 0]]``.

    Raises :class:`PackingError` for any argument outside what is listed, or ``pad_full_seq_to`` below ``min_seq_len``."""
    checks.check_min_dims("input_ids", input_ids, 2, "[B, S]")
    rows, row_len = input_ids.shape[0], input_ids.shape[1]
    checks.check_int_vector("input_lengths", input_lengths, rows)
    groups = _groups(packed_sequence_size, rows)
    lengths = on_device(input_lengths, input_ids.device)
    total, validate, name = _row_length(input_lengths, groups, row_len, min_seq_len, pad_full_seq_to, options,
                                        pad_full_seq_to_name)
    if total == 0:
        empty = input_ids.new_zeros(len(groups), 0)
        mask = torch.zeros(len(groups), 0, 0, dtype=torch.bool, device=input_ids.device)
        return empty, empty.to(torch.int64), mask if return_attention_mask else None
    packed = [pack_row(input_ids[a:b], lengths[a:b], total, padding_value, name=name, validate=validate,
                       options=options) for a, b in groups]  # one layout per row
    ids = torch.cat([p[0] for p in packed])  # [R, T]
    positions = torch.cat([p[1] for p in packed])  # [R, T]
    mask = torch.stack([_row_mask(p[2], total) for p in packed]) if return_attention_mask else None  # [R, T, T]
    return ids, positions, mask


def _groups(packed_sequence_size, rows: int) -> list:
    """``[(start, end)]`` of every packed row. Example: ``[3, 0, 2]`` -> ``[(0, 3), (3, 3), (3, 5)]``."""
    sizes = list(packed_sequence_size) if isinstance(packed_sequence_size, (list, tuple)) else None
    if sizes is None or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes) \
            or sum(sizes) != rows:
        raise PackingAssertionError(f"packed_sequence_size={packed_sequence_size!r} is invalid; expected a list of "
                                    f"non-negative ints (sequences per packed row) summing to B = input_ids.shape[0] = {rows}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(a, a + n) for a, n in zip(starts, sizes)]


def _row_length(input_lengths, groups: list, row_len: int, min_seq_len: int, pad_full_seq_to, options,
                name: str = "pad_full_seq_to"):
    """``(T, validate on the device?, T's name for messages)``: ``pad_full_seq_to`` (called ``name``) with no
    read, else NeMo-RL's rule after the one read of the lengths (which is also their validation)."""
    checks.row_length("min_seq_len", min_seq_len)
    if pad_full_seq_to is not None:
        total = layout_checks.fixed_total_arg(name, pad_full_seq_to)
        if total < min_seq_len:
            raise PackingAssertionError(f"{name}={total} is below min_seq_len={min_seq_len}; the packed rows are at "
                                        f"least min_seq_len long, so {name} must be at least {min_seq_len}")
        return total, True, name
    lengths = input_lengths.tolist()  # sync: NeMo-RL's read; T depends on the data without pad_full_seq_to
    layout_checks.lengths_host(lengths, row_len)
    total = max([sum(lengths[a:b]) for a, b in groups] + [min_seq_len])
    buckets = getattr(options, "buckets", None)
    if buckets is not None and total:
        total = bucket_total(total, buckets, 1, 1)  # the megatron path's buckets, with p 1 and C 1
    layout_checks.total_limit_host(total, "the longest packed row")
    return total, False, "the packed row length"


def _row_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[T, T]`` bool document-causal mask of one row whose sequences end at ``cu_seqlens[1:]`` (padding sees nothing).

    Example: cu_seqlens ``[0, 2, 3]``, T 4 -> rows ``[T F F F], [T T F F], [F F T F], [F F F F]``."""
    cu = cu_seqlens.to(torch.int64)
    pos = torch.arange(total, device=cu.device)  # [T]
    seq = segment_ids(cu, total)  # [T]
    valid = pos < cu[-1]  # [T]
    return (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None]) & valid[:, None] & valid[None, :]


def unpack_tensor(tensor: torch.Tensor, input_lengths: torch.Tensor, *, max_seqlen: Optional[int] = None
                  ) -> torch.Tensor:
    """``tensor [1, T, *]`` holding the sequences back to back -> ``[B, W, *]``, 0 past each length.

    ``W`` is ``max_seqlen`` when given (no host read; a longer length is a device assert), else the longest length.

    Example: tensor ``[[1, 2, 3, 4, 5, 6, -1]]``, lengths ``[2, 3, 1]`` -> ``[[1, 2, 0], [3, 4, 5], [6, 0, 0]]``.

    Raises :class:`PackingError`: ``tensor`` not ``[1, T, *]``, ``input_lengths`` not ``[B]`` integer, lengths that do not
    fit ``T`` (or ``max_seqlen``)."""
    checks.check_packed("tensor", tensor)
    checks.check_int_vector("input_lengths", input_lengths)
    lengths = on_device(input_lengths, tensor.device)
    total = tensor.shape[1]
    if max_seqlen is None:
        host = input_lengths.tolist()  # sync: NeMo-RL's read; the unpacked width depends on the data
        width, validate = max(host, default=0), False
        layout_checks.lengths_host(host, width)
        layout_checks.natural_total_host(sum(host), 1, total, "tensor.shape[1]")
    else:
        width, validate = checks.row_length("max_seqlen", max_seqlen), True
    if total == 0 or lengths.shape[0] == 0:
        return tensor.new_zeros(lengths.shape[0], width, *tensor.shape[2:])
    with spelled("tensor.shape[1]"):
        layout = layout_from_lengths(lengths, width, PackSpec(fixed_total=total), validate=validate, host_reads=False,
                                     op="unpack_tensor")
    return unpack_sequences(tensor, None, None, width, layout=layout, validate=False)  # [B, W, *]


def get_flash_attention_kwargs(input_lengths: torch.Tensor, *, max_seqlen: Optional[int] = None
                               ) -> FlashAttentionKwargs:
    """FlashAttention-2's variable-length arguments for sequences of ``input_lengths [B]`` packed back to back.

    ``cu_seqlens_q = cu_seqlens_k = [0, cumsum(L)]`` int32; ``max_seqlen_q = max_seqlen_k`` is ``max_seqlen`` when given
    (no host read), else the longest length after one read, as NeMo-RL.

    Example: ``[2, 3, 1]`` -> cu_seqlens ``[0, 2, 5, 6]``, max_seqlen 3."""
    checks.check_int_vector("input_lengths", input_lengths)
    cu_seqlens = exclusive_cumsum(input_lengths).to(torch.int32)  # [B+1]
    if max_seqlen is None:
        longest = max(input_lengths.tolist(), default=0)  # sync: NeMo-RL's .max().item()
    else:
        longest = checks.row_length("max_seqlen", max_seqlen)
    return FlashAttentionKwargs(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens.clone(), max_seqlen_q=longest,
                                max_seqlen_k=longest)

__all__ = [
    "FlashAttentionKwargs",
    "get_flash_attention_kwargs",
    "pack_row",
    "pack_sequences",
    "unpack_tensor",
]

translate_errors(globals())  # the core's PackingError leaves as PackingAssertionError (nn_data.nemo_rl.assertions)
