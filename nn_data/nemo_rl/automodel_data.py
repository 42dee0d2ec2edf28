"""NeMo-RL's AutoModel (DTensor) data path, ``nemo_rl.models.automodel.data``, on nn_data's layout plan: switch by
changing one import (docs/nemo-rl.md, "The AutoModel data path", with every difference and its reason).

    # from nemo_rl.models.automodel.data import get_microbatch_iterator, process_global_batch
    from nn_data.nemo_rl.automodel_data import get_microbatch_iterator, process_global_batch

Shape legend
    B   sequences of a microbatch; S their padded row length
    T   the packed row length (sequence packing: one fixed length, :func:`fixed_total`; no host read)"""

from __future__ import annotations

import functools
import inspect
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Tuple

import torch
from torch import nn

from nn_data.nemo_rl.assertions import PackingAssertionError, translate_errors
from nn_data.extension import process_groups
from nn_data.nemo_rl import automodel_tree, megatron_data
from nn_data.nemo_rl.huggingface_common import get_flash_attention_kwargs, on_device, pack_sequences
from nn_data.nemo_rl.megatron_data.common import require
from nn_data.nemo_rl.megatron_data.iterators import raw_microbatches, resolve_device
from nn_data.nemo_rl.megatron_data.records import TreeRecord
from nn_data.nemo_rl.megatron_data.tree_inputs import check_tree_key
from nn_data.nemo_rl.megatron_data import PackOptions

__all__ = [
    "ProcessedInputs",
    "ProcessedMicrobatch",
    "check_sequence_dim",
    "filter_multimodal_kwargs_for_model",
    "get_flash_attention_kwargs",
    "get_microbatch_iterator",
    "make_processed_microbatch_iterator",
    "pack_sequences",
    "fixed_total",
    "process_global_batch",
    "process_microbatch",
]


@functools.cache
def _accepted_forward_kwargs(model_type: type) -> Optional[frozenset]:
    """The explicit keywords of ``model_type.forward``; None when it takes ``**kwargs`` (or has no signature)."""
    try:
        parameters = inspect.signature(model_type.forward).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return None
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters if p.name != "self")


def filter_multimodal_kwargs_for_model(model: nn.Module, multimodal_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The multimodal keywords ``model.forward`` accepts. Raises ``ValueError`` (NeMo-RL's message) for
    mixed-resolution images (``imgs_sizes`` not all equal) to a model that cannot take ``imgs_sizes``."""
    accepted = _accepted_forward_kwargs(type(model))
    if accepted is None:
        return multimodal_kwargs
    sizes = multimodal_kwargs.get("imgs_sizes")
    if sizes is not None and "imgs_sizes" not in accepted and not _all_image_sizes_equal(sizes):
        raise ValueError(
            "This AutoModel does not accept `imgs_sizes` and cannot crop padded pixel_values, but the batch contains "
            "mixed-resolution images. The AutoModel backend only supports equal-resolution images/tiles; use the "
            "Megatron backend for mixed-resolution inputs.")
    return {key: value for key, value in multimodal_kwargs.items() if key in accepted}


def _all_image_sizes_equal(imgs_sizes: torch.Tensor) -> bool:
    if imgs_sizes.ndim != 2 or imgs_sizes.shape[0] <= 1:
        return True
    return bool((imgs_sizes == imgs_sizes[0]).all())  # sync: multimodal metadata, not on the packing path


@dataclass
class ProcessedInputs:
    """A microbatch ready for the model's forward (NeMo-RL's fields), then nn_data's ``shared_prefix``: a tree
    microbatch's record (:mod:`nn_data.nemo_rl.automodel_tree`), else None."""

    input_ids: torch.Tensor
    seq_len: int
    attention_mask: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    flash_attn_kwargs: dict[str, Any] = field(default_factory=dict)
    vlm_kwargs: dict[str, Any] = field(default_factory=dict)
    cp_buffers: list[torch.Tensor] = field(default_factory=list)
    seq_index: Optional[torch.Tensor] = None
    shared_prefix: Optional[TreeRecord] = None

    @property
    def has_context_parallel(self) -> bool:
        return len(self.cp_buffers) > 0

    @property
    def has_flash_attention(self) -> bool:
        """True for a non-empty dict or a ``FlashAttentionKwargs`` record."""
        return bool(self.flash_attn_kwargs)

    @property
    def is_multimodal(self) -> bool:
        return len(self.vlm_kwargs) > 0


@dataclass
class ProcessedMicrobatch:
    """The raw microbatch (``data_dict``), its :class:`ProcessedInputs`, and its shape before packing."""

    data_dict: Any
    processed_inputs: ProcessedInputs
    original_batch_size: int
    original_seq_len: int


def make_processed_microbatch_iterator(raw_iterator: Iterator[Any], tokenizer: Any, cfg: dict[str, Any],
                                       cp_size: int) -> Iterator[ProcessedMicrobatch]:
    """Each raw microbatch through :func:`process_microbatch` (packing when
    ``cfg["sequence_packing"]["enabled"]``), with its original ``[B, S]`` shape."""
    enable_seq_packing = (cfg.get("sequence_packing") or {}).get("enabled", False)
    for data_dict in raw_iterator:
        batch_size, seq_len = data_dict.get("input_ids").shape[:2]
        processed = process_microbatch(data_dict, tokenizer, enable_seq_packing, cfg, cp_size)
        yield ProcessedMicrobatch(data_dict=data_dict, processed_inputs=processed, original_batch_size=batch_size,
                                  original_seq_len=seq_len)


def get_microbatch_iterator(data: Any, cfg: dict[str, Any], mbs: int, dp_mesh: Any, tokenizer: Any,
                            cp_size: int = 1) -> tuple[Iterator[ProcessedMicrobatch], int]:
    """``(processed microbatch iterator, this rank's microbatch count)``: dynamic batching, sequence packing (padded with
    repeated microbatches to the largest count over the DP ranks: one all-reduce) or ``mbs`` rows at a time."""
    enable_seq_packing = (cfg.get("sequence_packing") or {}).get("enabled", False)
    mb_iterator, iterator_len, longest = raw_microbatches(data, cfg, mbs, enable_seq_packing)
    dummy: Iterator[Any] = iter([])
    if longest is not None:  # the packable plan: every rank runs as many microbatches
        dummy = itertools.islice(itertools.cycle(data.make_microbatch_iterator_for_packable_sequences()),
                                 _most_microbatches(iterator_len, dp_mesh) - iterator_len)
    processed = make_processed_microbatch_iterator(itertools.chain(mb_iterator, dummy), tokenizer, cfg, cp_size)
    return processed, iterator_len


def _most_microbatches(count: int, dp_mesh: Any) -> int:
    """The largest microbatch count over the data-parallel ranks: ``dp_mesh``'s group when it is a
    ``DeviceMesh`` (or a ``ProcessGroup``), else the default group as NeMo-RL (which ignores it)."""
    group = process_groups.as_process_group(dp_mesh, "dp_mesh") if process_groups.is_group_form(dp_mesh) else None
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not initialised and dp_mesh is None:
        return count
    device = "cpu"
    if initialised and "nccl" in str(torch.distributed.get_backend(group)):
        device = torch.device("cuda", torch.cuda.current_device())
    most = torch.full((1,), count, dtype=torch.int64, device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(most[0].item())  # sync: once per global batch, the number of microbatches to run


def fixed_total(cfg: dict[str, Any], options: Optional[PackOptions] = None) -> Optional[int]:
    """The fixed packed row length ``T``: ``cfg["nn_data"]["pad_full_seq_to"]``, else the packer's budget
    ``max(train_mb_tokens, logprob_mb_tokens)``; None with ``cfg["nn_data"]["buckets"]`` (``T`` from the data)."""
    options = PackOptions.from_cfg(cfg) if options is None else options
    if options.pad_full_seq_to is not None or options.buckets is not None:
        return options.pad_full_seq_to
    budgets = cfg["sequence_packing"]
    return max(budgets["train_mb_tokens"], budgets.get("logprob_mb_tokens") or 0)


def _fixed_total_name(cfg: dict[str, Any], options: Optional[PackOptions] = None) -> str:
    """The setting :func:`fixed_total` took ``T`` from, as messages name it: ``cfg["nn_data"]["pad_full_seq_to"]``,
    else the larger budget (``cfg["sequence_packing"]["train_mb_tokens"]`` or ``["logprob_mb_tokens"]``)."""
    options = PackOptions.from_cfg(cfg) if options is None else options
    if options.pad_full_seq_to is not None:
        return 'cfg["nn_data"]["pad_full_seq_to"]'
    budgets = cfg["sequence_packing"]
    larger = (budgets.get("logprob_mb_tokens") or 0) > budgets["train_mb_tokens"]
    key = "logprob_mb_tokens" if larger else "train_mb_tokens"
    return f'cfg["sequence_packing"]["{key}"]'


def process_microbatch(mb: Any, tokenizer: Any, enable_seq_packing: bool, cfg: dict[str, Any],
                       cp_size: int) -> ProcessedInputs:
    """A microbatch's :class:`ProcessedInputs` on the device (``cfg["nn_data"]["device"]``, else CUDA, else the CPU).

    Packed: one row ``[1, T]`` (padding ``tokenizer.eos_token_id``), position ids restarting at 0, no attention mask
    and ``flash_attn_kwargs`` with ``max_seqlen = T``; no host read. A tree microbatch (``cfg["nn_data"]["rollout_tree"]``
    or ``["shared_prefix"]``) is :mod:`nn_data.nemo_rl.automodel_tree`'s. Otherwise the rows as they are, an all-ones
    mask and ``arange(S)`` positions. With ``cp_size > 1``: the buffers torch's ``context_parallel()`` shards.

    Raises :class:`PackingError` (NeMo-RL's message first) for multimodal inputs with packing, sequence parallelism or
    CP, and for packing under CP."""
    options = PackOptions.from_cfg(cfg)
    input_ids = mb.get("input_ids").to(resolve_device(cfg=cfg))
    tree = None
    if check_tree_key(mb, cfg, enable_seq_packing) is not None:  # every shared token once (automodel_tree)
        lengths = on_device(mb["input_lengths"], input_ids.device)
        input_ids, position_ids, tree = automodel_tree.tree_microbatch(
            mb, input_ids, lengths, total=fixed_total(cfg, options), options=options, cp_size=cp_size)
        seq_len, attention_mask, flash_attn_kwargs = input_ids.shape[1], None, {}
    elif enable_seq_packing:
        lengths = on_device(mb["input_lengths"], input_ids.device)
        input_ids, position_ids, _ = pack_sequences(
            input_ids=input_ids, input_lengths=lengths, packed_sequence_size=[len(mb["input_lengths"])],
            padding_value=tokenizer.eos_token_id, return_attention_mask=False,
            min_seq_len=cfg["sequence_packing"]["train_mb_tokens"], pad_full_seq_to=fixed_total(cfg, options),
            options=options, pad_full_seq_to_name=_fixed_total_name(cfg, options))
        seq_len = input_ids.shape[1]
        attention_mask = None
        flash_attn_kwargs = get_flash_attention_kwargs(input_lengths=lengths, max_seqlen=seq_len)
    else:
        batch_size, seq_len = input_ids.shape
        attention_mask = torch.ones((batch_size, seq_len), dtype=torch.bool, device=input_ids.device)
        position_ids = torch.arange(seq_len, device=input_ids.device).repeat(batch_size, 1)
        flash_attn_kwargs = {}
    vlm_kwargs = _multimodal(mb, input_ids.device)
    if vlm_kwargs:
        position_ids = None
        require(not enable_seq_packing, "multimodal kwargs are not supported for sequence packing")
        require(not cfg["dtensor_cfg"]["sequence_parallel"],
                "Sequence parallel is not supported with multimodal since there's an issue when you do not pass "
                "position_ids. See https://github.com/NVIDIA-NeMo/Automodel/issues/652")
    cp_buffers, seq_index = [], None
    if cp_size > 1:
        require(not vlm_kwargs, f"multimodal kwargs={vlm_kwargs} are not supported for context parallel")
        require(not enable_seq_packing,
                "Context parallel is not supported for sequence packing (torch's context_parallel() shards the packed "
                "row without its boundaries; nn_data's PackedForward(HFCausalLMAdapter(model), cp_group=...) packs "
                "and shards per sequence)")
        attention_mask = None  # torch's CP attention is causal with no explicit mask
        seq_index = torch.arange(seq_len, device=input_ids.device).repeat(1, 1)  # [1, S]
        cp_buffers = [input_ids, position_ids, seq_index] + _student_aligned(mb)
    return ProcessedInputs(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           flash_attn_kwargs=flash_attn_kwargs, vlm_kwargs=vlm_kwargs, cp_buffers=cp_buffers,
                           seq_index=seq_index, seq_len=seq_len, shared_prefix=tree)


def _multimodal(mb: Any, device) -> dict:
    """NeMo-RL's ``mb.get_multimodal_dict(as_tensors=True, device=...)``; {} for a batch without it
    (nn_data's ``BatchedDataDict``, a dict: no multimodal values)."""
    getter = getattr(mb, "get_multimodal_dict", None)
    return {} if getter is None else getter(as_tensors=True, device=device)


def _student_aligned(mb: Any) -> list:
    """Cross-tokenizer distillation's student-aligned fields (and ``token_mask`` with them), sharded with
    the ids: keys ``alignment_*_student_chunk_id`` / ``alignment_*_student_exact_partition_mask``."""
    fields = [k for k in mb if k.startswith("alignment_")
              and (k.endswith("_student_chunk_id") or k.endswith("_student_exact_partition_mask"))]
    if not fields:
        return []
    return ([mb["token_mask"]] if "token_mask" in mb else []) + [mb[k] for k in fields]


#: The megatron path's function itself (NeMo-RL's two are identical too).
process_global_batch = megatron_data.process_global_batch


def check_sequence_dim(data: Any, *, skip_keys: Optional[Iterable[str]] = None) -> Tuple[int, int]:
    """``(1, S)``: dim 1 is the sequence dim of every tensor of ``data`` with 2+ dims (``skip_keys`` excepted); else
    :class:`PackingError` (an ``AssertionError``) naming the first tensor whose dim 1 is not ``data["input_ids"].shape[1]``."""
    skip = set(skip_keys) if skip_keys is not None else set()
    sequence_dim = 1
    seq_dim_size = data.get("input_ids").shape[sequence_dim]
    for key, value in data.items():
        if key in skip or not torch.is_tensor(value) or value.dim() <= 1:
            continue
        if value.shape[sequence_dim] != seq_dim_size:
            raise PackingAssertionError(f"Dim 1 must be the sequence dim, expected dim 1={seq_dim_size} but got shape "
                                        f"{value.shape} (key {key!r})")
    return sequence_dim, seq_dim_size

translate_errors(globals())  # the core's PackingError leaves as PackingAssertionError (nn_data.nemo_rl.assertions)
