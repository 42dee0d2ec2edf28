"""megatron-core's ``PackedSeqParams``: the one module of the data path that imports megatron-core, lazily, on
the first ``PackedSeqParams`` (docs/ops.md, "megatron-core's PackedSeqParams"). The process groups' old names
here (moved to :mod:`nn_data.groups`) still work and warn.

Example::

    params = make_packed_seq_params(r.cu_seqlens_padded, r.layout.host.max_seqlen, None, total=r.layout.total)"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from nn_data import groups as _groups
from nn_data._alias import moved_attribute, warn_moved

__getattr__ = moved_attribute(__name__)  # the process-group names now in nn_data.groups (nn_data._alias)


#: What to do when megatron-core is missing (the ``megatron`` extra of pyproject.toml).
INSTALL_MEGATRON = 'pip install "nn_data[megatron]"'


@contextlib.contextmanager
def _megatron_import(what: str):
    """Around an import of megatron-core: its TransformerEngine/Apex warnings silenced; megatron-core missing, a
    ``ModuleNotFoundError`` naming the extra to install for ``what`` (another missing module as it is)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if missing == "megatron" or missing.startswith("megatron."):
                raise ModuleNotFoundError(f"{what} needs megatron-core, which is not installed (no module named "
                                          f"{missing!r}): {INSTALL_MEGATRON} (megatron-core>=0.16.1,<0.21)",
                                          name=missing) from e
            raise


@functools.lru_cache(maxsize=1)
def packed_seq_params_class() -> Any:
    """megatron-core's ``PackedSeqParams`` class (imported on the first call)."""
    with _megatron_import("megatron-core's PackedSeqParams (the packed NeMo-RL path)"):
        from megatron.core.packed_seq_params import PackedSeqParams
    return PackedSeqParams


@functools.lru_cache(maxsize=1)
def gpt_model_class() -> Any:
    """megatron-core's ``GPTModel`` class (imported on the first call), for the NeMo-RL drop-in's
    ``patch_gpt_model_forward_for_linear_ce_fusion``."""
    with _megatron_import("megatron-core's GPTModel (patch_gpt_model_forward_for_linear_ce_fusion)"):
        from megatron.core.models.gpt import GPTModel
    return GPTModel


def packed_seq_params_fields() -> frozenset:
    """Field names of the installed megatron-core's ``PackedSeqParams``."""
    return frozenset(f.name for f in dataclasses.fields(packed_seq_params_class()))


def make_packed_seq_params(
    cu_seqlens_padded: torch.Tensor,
    max_seqlen: int,
    total_tokens: Optional[int],
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
    pad_between_seqs: Optional[bool] = None,
    total: Optional[int] = None,
    cp_group: Optional["dist.ProcessGroup"] = None,
    packed_length: Optional[int] = None,
    pg_collection: Any = None,
    local_cp_size: Optional[int] = None,
) -> Any:
    """A THD ``PackedSeqParams`` over ``cu_seqlens_padded [B+1]`` (``[0, T]`` for no sequence), with no host sync
    and no copy of Python data to the device, filling only the fields the installed release has (docs/ops.md,
    "megatron-core's PackedSeqParams").

    Args:
        cu_seqlens: the valid boundaries as a tensor of their own (for a model that slices CP itself), else
            ``cu_seqlens_q``/``_kv`` are the same tensor object as the padded fields (TransformerEngine's "no
            padding between sequences").
        max_seqlen: a Python int, ``max_seqlen_q``/``_kv``.
        total_tokens: ``total_tokens`` where the release has it (0.17+), or None.
        pad_between_seqs: where the release has it; default True when ``cu_seqlens`` is given.
        total: the packed length ``T`` as a Python int, for ``seq_idx`` (:func:`sequence_index`) and
            ``total_tokens`` (set after construction); without it one host read learns it
            (``packed_length=``, its 0.1.x name, still works and warns).
        cp_group, local_cp_size: set only when given (dynamic CP's per-microbatch group and size).
        pg_collection: its ``cp`` group stands for ``cp_group`` when that is not given; both given must agree."""
    if packed_length is not None:
        warn_moved("nn_data.megatron_parallel:make_packed_seq_params(packed_length=)")
        total = packed_length if total is None else total
    if pg_collection is not None:  # cp_group alone is stored as given
        cp_group = _groups.given_group_info(cp_group, pg_collection=pg_collection, field="cp").group
    padded = _with_start(cu_seqlens_padded)
    own_valid = cu_seqlens is not None and cu_seqlens is not cu_seqlens_padded
    valid = _with_start(cu_seqlens) if own_valid else padded
    kwargs = dict(
        qkv_format="thd",
        cu_seqlens_q=valid,
        cu_seqlens_kv=valid,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
    )
    fields = packed_seq_params_fields()
    if own_valid and pad_between_seqs is None:
        pad_between_seqs = True
    if pad_between_seqs is not None and "pad_between_seqs" in fields:
        kwargs["pad_between_seqs"] = bool(pad_between_seqs)
    if cp_group is not None and "cp_group" in fields:
        kwargs["cp_group"] = _groups.as_process_group(cp_group, "cp_group") if _groups.is_group_form(cp_group) \
            else cp_group  # a DeviceMesh form: its ProcessGroup
    if local_cp_size is not None and "local_cp_size" in fields:
        kwargs["local_cp_size"] = int(local_cp_size)
    params = packed_seq_params_class()(**kwargs)  # no total_tokens yet: __post_init__ builds nothing
    if total_tokens is not None and "total_tokens" in fields:
        _set_total_tokens(params, padded, int(total_tokens), total, "seq_idx" in fields)
    return params


def _set_total_tokens(params, padded: torch.Tensor, total_tokens: int, total: Optional[int],
                      has_seq_idx: bool) -> None:
    """``params.total_tokens`` and, where the release has the field, the ``seq_idx`` its
    ``__post_init__`` would have built (:func:`sequence_index`)."""
    params.total_tokens = total_tokens
    if has_seq_idx:
        if total is None:
            total = int(padded[-1])  # sync: the caller did not pass the packed length T
        params.seq_idx = sequence_index(padded, total_tokens, int(total))


def _with_start(bounds: torch.Tensor) -> torch.Tensor:
    """Boundaries as megatron-core receives them: ``[T]`` (no sequence) -> ``[0, T]``, on the
    device and in its dtype; ``[B+1]`` with ``B > 0`` as given (the same object)."""
    if bounds.shape[0] != 1:
        return bounds
    return torch.cat([torch.zeros_like(bounds), bounds])  # [2]


def sequence_index(bounds: torch.Tensor, total_tokens: int, total: int) -> torch.Tensor:
    """megatron-core's ``PackedSeqParams.seq_idx`` (0.17+): ``[1, N]`` int32, each position's sequence, as its
    ``__post_init__`` computes it (the boundaries followed by ``total_tokens``, each difference clamped at 0) but
    with the size given, ``N = max(total, total_tokens)``; no host sync.

    Example: bounds ``[0, 16, 40]``, total_tokens 20 (a CP rank's share of T = 40) -> lengths
    ``[16, 24, 0]`` (the last one clamped from -20) -> ``[[0]*16 + [1]*24]``, N = 40; bounds
    ``[0, 5, 7, 11]``, total_tokens 16 -> lengths ``[5, 2, 4, 5]`` -> ``[[0]*5 + [1]*2 + [2]*4 + [3]*5]``."""
    end = torch.full((1,), total_tokens, dtype=bounds.dtype, device=bounds.device)
    lengths = torch.diff(torch.cat([bounds, end])).clamp(min=0)  # [B+1]
    index = torch.arange(lengths.shape[0], device=bounds.device)  # [B+1]
    size = max(total, total_tokens)
    return torch.repeat_interleave(index, lengths, output_size=size).to(torch.int32).unsqueeze(0)  # [1, N]
