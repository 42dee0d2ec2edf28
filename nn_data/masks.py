"""The document-causal attention mask of a packed microbatch, dense or as a flex ``BlockMask``.

Shape legend
    Tq  query tokens this call sees (``T/C`` under context parallelism, else ``T``)
    T   packed tokens (keys, after the CP gather)
    H   query heads, Hk key/value heads (``H`` a multiple of ``Hk``), D head dim

A query at packed position ``i`` may see key ``j`` iff both lie in the same segment and
``j <= i`` (and, with a sliding ``window``, ``i - j < window``: transformers' sliding-window rule
``kv_idx > q_idx - sliding_window``). Two forms of the same mask:

* **dense**: a boolean ``[Tq, T]`` tensor for SDPA. ``Tq * T`` bytes (1 GiB at T = 32768,
  no CP), any dtype, forward and backward;
* **block**: a flex-attention ``BlockMask`` (``torch.nn.attention.flex_attention``): per
  128 x 128 block, whether it is empty, full or partial, plus the mask function for the
  partial ones. ``O(T^2 / 128^2)`` small integers (about 1 MiB at T = 32768; measured by
  ``python -m profiling.bench.bench_mask_memory``). Built by a compiled ``create_block_mask`` *outside*
  the model's graph (building it inside one compiled graph with the attention failed here),
  and used by a compiled ``flex_attention``.

The flex backend on a CPU runs the forward only (no backward) and only in float32, float16
and bfloat16; on CUDA it runs both. :func:`document_mask` with ``kind="auto"`` picks the block
mask where the backend supports the call and the dense mask would be large, else the dense one.
:func:`document_attention` runs attention with either form.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from nn_data.errors import PackingError

#: ``kind="auto"`` keeps the dense mask while it has fewer elements than this (4 Mi: T = 2048 without
#: CP): below it the dense mask is small, and compiling flex (seconds, once per shape) does not pay.
DENSE_LIMIT = 1 << 22

_FLEX_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class DocumentMask(NamedTuple):
    """One packed microbatch's document-causal mask: exactly one of ``dense`` (``[Tq, T]`` bool,
    True where the query may see the key) and ``block`` (a flex ``BlockMask``) is set. ``gather``
    (None without CP) all-gathers this rank's ``[1, Tq, *]`` keys/values into ``[1, T, *]``.
    ``window`` (None: unlimited) is the sliding window this mask applies; ``sliding`` (None when not
    asked for) is the same microbatch's mask restricted to a sliding window, for the sliding layers of
    a model that mixes both kinds (:func:`document_mask` with ``window=``)."""

    dense: Optional[torch.Tensor]
    block: Any = None
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    window: Optional[int] = None
    sliding: Optional["DocumentMask"] = None

    @property
    def kind(self) -> str:
        return "dense" if self.dense is not None else "block"


def document_causal_mask(query_index: torch.Tensor, segment_ids: torch.Tensor, window: Optional[int] = None
                         ) -> torch.Tensor:
    """``[Tq, T]`` bool: query ``q`` (at packed position ``query_index[q]``) may see key ``j``
    (within ``window`` positions of it, when a sliding window is given).

    Example: segment_ids ``[0,0,1,1]``, query_index ``[1, 2]`` -> ``[[T,T,F,F], [F,F,T,F]]``;
    segment_ids ``[0,0,0]``, query_index ``[2]``, window 2 -> ``[[F,T,T]]``.
    """
    keys = torch.arange(segment_ids.shape[0], device=segment_ids.device)  # [T]
    same = segment_ids[query_index][:, None] == segment_ids[None, :]  # [Tq, T]
    allowed = same & (keys[None, :] <= query_index[:, None])
    if window is None:
        return allowed
    return allowed & (query_index[:, None] - keys[None, :] < window)  # transformers: kv_idx > q_idx - window


def _block_mask_uncompiled(query_index: torch.Tensor, segment_ids: torch.Tensor, block_size: int, window=None):
    from torch.nn.attention.flex_attention import create_block_mask

    query_segment = segment_ids[query_index]  # [Tq]
    reach = segment_ids.shape[0] if window is None else window  # T: no key is that far back

    def mask_mod(b, h, q, kv):  # the same rule as document_causal_mask, one (q, kv) pair at a time
        return (query_segment[q] == segment_ids[kv]) & (kv <= query_index[q]) & (query_index[q] - kv < reach)

    tq, t = query_index.shape[0], segment_ids.shape[0]
    return create_block_mask(mask_mod, None, None, tq, t, device=query_index.device, BLOCK_SIZE=block_size)


@functools.lru_cache(maxsize=1)
def _compiled_block_mask():
    return torch.compile(_block_mask_uncompiled, fullgraph=True)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Static shapes: a second shape (another model's heads, another T) compiles a graph of its own.
    # With symbolic sizes inductor's CPU flex template generated C++ that does not compile here
    # (torch 2.13: "'cur_kvSplitSize8' was not declared"), seen after a second model's call.
    return torch.compile(flex_attention, fullgraph=True, dynamic=False)


def document_block_mask(query_index: torch.Tensor, segment_ids: torch.Tensor, *, block_size: int = 128,
                        window: Optional[int] = None):
    """The document-causal mask of ``query_index [Tq]`` / ``segment_ids [T]`` (restricted to a sliding
    ``window``, when given) as a flex ``BlockMask``.

    Built by a compiled ``create_block_mask`` (compiled once per ``(Tq, T)``; call it outside
    any other compiled region). Memory ``O((Tq / block_size) * (T / block_size))``, never ``Tq * T``.
    """
    return _compiled_block_mask()(query_index, segment_ids, block_size, window)


def flex_supported(device: torch.device, dtype: torch.dtype, needs_grad: bool) -> bool:
    """Whether flex attention runs this call: on CUDA always; on a CPU forward only, in float32/16/bf16."""
    if torch.device(device).type == "cuda":
        return True
    return torch.device(device).type == "cpu" and not needs_grad and dtype in _FLEX_CPU_DTYPES


def document_mask(
    query_index: torch.Tensor,
    segment_ids: torch.Tensor,
    *,
    kind: str = "auto",
    dtype: torch.dtype = torch.float32,
    gather: Optional[Callable] = None,
    dense_limit: int = DENSE_LIMIT,
    window: Optional[int] = None,
) -> DocumentMask:
    """Build the mask for queries at ``query_index [Tq]`` over keys with ``segment_ids [T]``.

    ``kind``: ``"dense"``, ``"block"`` or ``"auto"`` (the block mask when
    :func:`flex_supported` for ``dtype`` under the current grad mode and ``Tq * T >=
    dense_limit``, else dense). ``gather`` is carried along for :func:`document_attention`.
    ``window`` (an int >= 1): the result also carries ``.sliding``, the same mask restricted to that
    sliding window (in the same form), for a model's sliding-window layers.

    Raises :class:`~nn_data.errors.PackingError` for an unknown ``kind``, or ``kind="block"``
    where flex attention cannot run (a CPU with grad enabled, or float64).

    Example: ``document_mask(torch.tensor([1, 2]), torch.tensor([0, 0, 1, 1])).dense`` is
    ``[[T,T,F,F], [F,F,T,F]]``.
    """
    device, needs_grad = query_index.device, torch.is_grad_enabled()
    if kind not in ("auto", "dense", "block"):
        raise PackingError(f"kind={kind!r} is invalid; expected 'auto', 'dense' or 'block'")
    supported = flex_supported(device, dtype, needs_grad)
    if kind == "block" and not supported:
        raise PackingError(
            f"kind='block' needs flex attention, which on {device.type} does not run dtype={dtype} with "
            f"grad enabled={needs_grad} (CPU: forward only, float32/float16/bfloat16); use kind='dense' or 'auto'"
        )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise PackingError(f"window={window!r} is invalid; expected a sliding window of at least 1 position, or None")
    big = query_index.shape[0] * segment_ids.shape[0] >= dense_limit
    block = kind == "block" or (kind == "auto" and supported and big)

    def build(w: Optional[int]) -> DocumentMask:
        if block:
            return DocumentMask(None, document_block_mask(query_index, segment_ids, window=w), gather, w)
        return DocumentMask(document_causal_mask(query_index, segment_ids, w), None, gather, w)

    full = build(None)
    return full if window is None else full._replace(sliding=build(window))


def causal_mask(length: int, device=None) -> DocumentMask:
    """The plain causal mask of one unpacked sequence of ``length`` tokens (dense ``[L, L]``)."""
    return DocumentMask(torch.ones(length, length, dtype=torch.bool, device=device).tril())


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: DocumentMask,
    *,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of ``q [1, H, Tq, D]`` over ``k, v [1, Hk, T, D]`` (all keys: gather them first
    under CP) under ``mask``; ``[1, H, Tq, D]``. ``H`` a multiple of ``Hk`` (grouped-query
    attention). Dense: SDPA with the boolean mask; block: compiled ``flex_attention``
    (no dropout there: raises :class:`~nn_data.errors.PackingError` for ``dropout_p > 0``).
    """
    gqa = q.shape[1] != k.shape[1]
    if mask.dense is not None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.dense, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    if dropout_p:
        raise PackingError(f"dropout_p={dropout_p} with a block mask: flex attention has no dropout; use kind='dense'")
    return _compiled_flex()(q, k, v, block_mask=mask.block, scale=scale, enable_gqa=gqa)
