"""The document-causal attention mask of a packed microbatch, dense or as a flex ``BlockMask``.

Shape legend
    Tq  query tokens this call sees (``T/C`` under context parallelism, else ``T``)
    T   packed tokens (keys, after the CP gather)
    H   query heads, Hk key/value heads (``H`` a multiple of ``Hk``), D head dim

A query at packed position ``i`` may see key ``j`` iff both lie in the same segment and ``j <= i`` (and,
with a sliding ``window``, ``i - j < window``: transformers' rule). A rollout-tree microbatch widens "the
same segment" by a :class:`PrefixRule`: query ``i`` also sees every real key on its rollout's path;
:func:`sees` is the rule, once. Two forms of the same mask: **dense**, a boolean ``[Tq, T]`` tensor for
SDPA; **block**, a flex-attention ``BlockMask`` (``O(T^2 / 128^2)`` small integers) built by a compiled
``create_block_mask`` outside the model's graph. The flex backend on a CPU runs the forward only, in float32,
float16 and bfloat16; :func:`document_mask` with ``kind="auto"`` picks the block mask where the backend runs
the call and the dense mask would be large (docs/models.md, "Wrapping your model")."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from nn_data import _compat, compile_cache
from nn_data.errors import PackingError

#: ``kind="auto"`` keeps the dense mask while it has fewer elements than this (4 Mi: T = 2048 without
#: CP): below it the dense mask is small, and compiling flex (seconds, once per shape) does not pay.
DENSE_LIMIT = 1 << 22

_FLEX_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class DocumentMask(NamedTuple):
    """One packed microbatch's document-causal mask: exactly one of ``dense`` (``[Tq, T]`` bool, True where the query
    may see the key) and ``block`` (a flex ``BlockMask``) is set; ``gather`` (None without CP) all-gathers this
    rank's ``[1, Tq, *]`` keys/values; ``window`` the sliding window it applies (None: unlimited); ``sliding`` the
    same mask restricted to a window, for a model's sliding layers (:func:`document_mask` with ``window=``)."""

    dense: Optional[torch.Tensor]
    block: Any = None
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    window: Optional[int] = None
    sliding: Optional["DocumentMask"] = None

    @property
    def kind(self) -> str:
        return "dense" if self.dense is not None else "block"


class PrefixRule(NamedTuple):
    """What a rollout-tree microbatch adds to the document mask: ``rollout_ids [T]`` int64, the rollout
    whose node each packed position lies in (``B`` outside every node); ``visible [T]`` bool, a real token
    (a key other nodes may see; False on padding); ``positions [T]`` int64, its position in that rollout
    (what a sliding window measures); ``shared [B+1, B+1]`` int64, the tokens of rollout ``r`` that rollout
    ``q`` shares (``q``'s ancestors: its branch point below them; ``q`` itself: all; row and column ``B``:
    none). The whole packed row, never sharded. :meth:`nn_data.layout.TreeLayout.prefix_rule` builds it.

    Example: groups ``[7, 7]``, prefix ``[2, 2]``, lengths ``[4, 3]`` -> packed ``[p p r0 r0 r1]``,
    segment_ids ``[0,0,1,1,3]``, rollout_ids ``[0,0,0,0,1]``, visible all True, positions ``[0,1,2,3,2]``,
    shared ``[[E,0,0], [2,E,0], [0,0,0]]`` (E: every token): the query ``r1`` sees ``p p`` (positions 0, 1
    below 2).
    """

    rollout_ids: torch.Tensor
    visible: torch.Tensor
    positions: torch.Tensor
    shared: torch.Tensor

    def paths(self) -> torch.Tensor:
        """``[B+1, T]`` bool: whether key ``j`` is a real token on rollout ``r``'s path (``visible[j]``, and its
        position below the tokens ``r`` shares with ``j``'s rollout). The rule's lookup of ``shared``, done once per
        rollout and key instead of once per query and key. Example: the class's -> rows ``[T,T,T,T,F]``,
        ``[T,T,F,F,T]`` (rollout 1 sees the prompt and itself), ``[F]*5``."""
        return self.visible[None, :] & (self.positions[None, :] < self.shared[:, self.rollout_ids])  # [B+1, T]


def sees(q: torch.Tensor, kv: torch.Tensor, segment_ids: torch.Tensor, window: Optional[int] = None,
         prefix: Optional[PrefixRule] = None, on_path: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The attention rule, once: whether the query at packed position ``q`` may see the key at ``kv`` (index tensors
    that broadcast, or scalars in a flex ``mask_mod``): ``kv <= q`` in the same segment, or (``prefix``) ``kv`` a
    real token on the path of ``q``'s rollout; with a ``window``, ``q - kv < window`` (rollout positions).
    ``on_path``: ``prefix.paths()[prefix.rollout_ids[q], kv]`` when the caller has it (the dense mask gathers
    whole rows of it; a ``mask_mod`` indexes a table built once), else looked up here."""
    same = segment_ids[q] == segment_ids[kv]
    if prefix is not None:
        p_q, p_kv = prefix.positions[q], prefix.positions[kv]
        if on_path is None:
            on_path = prefix.paths()[prefix.rollout_ids[q], kv]
        same = same | (on_path & (p_kv <= p_q))
    allowed = same & (kv <= q)
    if window is None:
        return allowed
    distance = q - kv if prefix is None else prefix.positions[q] - prefix.positions[kv]
    return allowed & (distance < window)  # transformers: kv_idx > q_idx - window


def document_causal_mask(query_index: torch.Tensor, segment_ids: torch.Tensor, window: Optional[int] = None,
                         prefix: Optional[PrefixRule] = None) -> torch.Tensor:
    """``[Tq, T]`` bool: query ``q`` (at packed position ``query_index[q]``) may see key ``j`` (:func:`sees`, with the
    ``window`` and ``prefix`` given). Example: segment_ids ``[0,0,1,1]``, query_index ``[1, 2]`` -> ``[[T,T,F,F],
    [F,F,T,F]]``; segment_ids ``[0,0,0]``, query_index ``[2]``, window 2 -> ``[[F,T,T]]``."""
    keys = torch.arange(segment_ids.shape[0], device=segment_ids.device)  # [T]
    # every key: rows of the path table, one per query (a row copy each, not a lookup per query and key)
    on_path = None if prefix is None else prefix.paths().index_select(0, prefix.rollout_ids[query_index])  # [Tq, T]
    return sees(query_index[:, None], keys[None, :], segment_ids, window, prefix, on_path)  # [Tq, T]


def _block_mask_uncompiled(query_index: torch.Tensor, segment_ids: torch.Tensor, block_size: int, window=None,
                           prefix: Optional[PrefixRule] = None):
    from torch.nn.attention.flex_attention import create_block_mask

    paths = None if prefix is None else prefix.paths()  # [B+1, T], built once for every (q, kv) pair

    def mask_mod(b, h, q, kv):  # the rule of document_causal_mask, one (q, kv) pair at a time
        on_path = None if prefix is None else paths[prefix.rollout_ids[query_index[q]], kv]
        return sees(query_index[q], kv, segment_ids, window, prefix, on_path)

    tq, t = query_index.shape[0], segment_ids.shape[0]
    return create_block_mask(mask_mod, None, None, tq, t, device=query_index.device, BLOCK_SIZE=block_size)


@functools.lru_cache(maxsize=1)
def _compiled_block_mask():
    compile_cache.announce("the flex block mask")
    return torch.compile(_block_mask_uncompiled, fullgraph=True)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    compile_cache.announce("flex attention")
    # Static shapes: a second shape (another model's heads, another T) compiles a graph of its own.
    # With symbolic sizes inductor's CPU flex template generated C++ that does not compile here
    # (torch 2.13: "'cur_kvSplitSize8' was not declared"), seen after a second model's call.
    return torch.compile(flex_attention, fullgraph=True, dynamic=False)


def document_block_mask(query_index: torch.Tensor, segment_ids: torch.Tensor, *, block_size: int = 128,
                        window: Optional[int] = None, prefix: Optional[PrefixRule] = None):
    """The document-causal mask of ``query_index [Tq]`` / ``segment_ids [T]`` (``window``, ``prefix`` as
    :func:`document_mask`) as a flex ``BlockMask``, by a compiled ``create_block_mask`` (once per ``(Tq, T)``; call
    it outside any other compiled region). Memory ``O((Tq / block_size) * (T / block_size))``."""
    return _compiled_block_mask()(query_index, segment_ids, block_size, window, prefix)


def flex_supported(device: torch.device, dtype: torch.dtype, needs_grad: bool) -> bool:
    """Whether flex attention runs this call: on CUDA always; on a CPU forward only, in float32/16/bf16, with
    torch >= :data:`nn_data._compat.FLEX_CPU_TORCH` (torch 2.11's CPU kernel aborts: :mod:`nn_data._compat`)."""
    if torch.device(device).type == "cuda":
        return True
    return (torch.device(device).type == "cpu" and not needs_grad and dtype in _FLEX_CPU_DTYPES
            and _compat.flex_on_cpu())


def document_mask(
    query_index: torch.Tensor,
    segment_ids: torch.Tensor,
    *,
    kind: str = "auto",
    dtype: torch.dtype = torch.float32,
    gather: Optional[Callable] = None,
    dense_limit: int = DENSE_LIMIT,
    window: Optional[int] = None,
    prefix: Optional[PrefixRule] = None,
) -> DocumentMask:
    """Build the mask for queries at ``query_index [Tq]`` over keys with ``segment_ids [T]``.

    Args:
        kind: ``"dense"``, ``"block"`` or ``"auto"`` (the block mask when :func:`flex_supported` for ``dtype``
            under the current grad mode and ``Tq * T >= dense_limit``).
        gather: carried along for :func:`document_attention`.
        window: an int >= 1; the result also carries ``.sliding``, the mask restricted to that window.
        prefix: a tree microbatch's :class:`PrefixRule`, applied to both forms and to ``.sliding``.

    Raises :class:`~nn_data.errors.PackingError` for an unknown ``kind``, or ``kind="block"`` where flex attention
    cannot run (a CPU with grad enabled, float64, or torch before :data:`nn_data._compat.FLEX_CPU_TORCH`).

    Example: ``document_mask(torch.tensor([1, 2]), torch.tensor([0, 0, 1, 1])).dense`` is
    ``[[T,T,F,F], [F,F,T,F]]``."""
    device, needs_grad = query_index.device, torch.is_grad_enabled()
    if kind not in ("auto", "dense", "block"):
        raise PackingError(f"kind={kind!r} is invalid; expected 'auto', 'dense' or 'block'")
    supported = flex_supported(device, dtype, needs_grad)
    if kind == "block" and not supported:
        raise PackingError(
            f"kind='block' needs flex attention, which on {device.type} does not run dtype={dtype} with "
            f"grad enabled={needs_grad} with torch {torch.__version__} (CPU: forward only, float32/float16/bfloat16, "
            f"torch >= {_compat.FLEX_CPU_TORCH}); use kind='dense' or 'auto'"
        )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise PackingError(f"window={window!r} is invalid; expected a sliding window of at least 1 position, or None")
    _check_prefix(prefix, segment_ids)
    big = query_index.shape[0] * segment_ids.shape[0] >= dense_limit
    block = kind == "block" or (kind == "auto" and supported and big)

    def build(w: Optional[int], sliding: Optional[DocumentMask] = None) -> DocumentMask:
        if block:
            return DocumentMask(None, document_block_mask(query_index, segment_ids, window=w, prefix=prefix), gather,
                                w, sliding)
        return DocumentMask(document_causal_mask(query_index, segment_ids, w, prefix), None, gather, w, sliding)

    # built by the class, not with _replace: torch 2.11's dynamo cannot rebuild the tuple _replace makes
    # when it leaves a compiled region
    return build(None, None if window is None else build(window))


def _check_prefix(prefix, segment_ids: torch.Tensor) -> None:
    """``prefix``: None or a :class:`PrefixRule` of ``[T]`` tensors, ``T`` the keys of ``segment_ids``."""
    if prefix is None:
        return
    if not isinstance(prefix, PrefixRule):
        raise PackingError(f"prefix must be a PrefixRule (TreeLayout.prefix_rule()) or None, got "
                           f"{type(prefix).__name__}")
    total = segment_ids.shape[0]
    for name, t in zip(PrefixRule._fields[:3], prefix[:3]):
        if t.dim() != 1 or t.shape[0] != total:
            raise PackingError(f"prefix.{name} has shape {tuple(int(d) for d in t.shape)}; expected "
                               f"[{int(total)}], one entry per packed position like segment_ids")
    if prefix.shared.dim() != 2 or prefix.shared.shape[0] != prefix.shared.shape[1]:
        raise PackingError(f"prefix.shared has shape {tuple(int(d) for d in prefix.shared.shape)}; expected "
                           "[B+1, B+1], the tokens each rollout shares with each other (TreeLayout.prefix_rule())")


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
    """Attention of ``q [1, H, Tq, D]`` over ``k, v [1, Hk, T, D]`` (all keys: gather them first under CP; ``H`` a
    multiple of ``Hk``) under ``mask``: ``[1, H, Tq, D]``. Dense: SDPA with the boolean mask; block: compiled
    ``flex_attention`` (no dropout: :class:`~nn_data.errors.PackingError` for ``dropout_p > 0``)."""
    gqa = q.shape[1] != k.shape[1]
    if mask.dense is not None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.dense, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    if dropout_p:
        raise PackingError(f"dropout_p={dropout_p} with a block mask: flex attention has no dropout; use kind='dense'")
    return _compiled_flex()(q, k, v, block_mask=mask.block, scale=scale, enable_gqa=gqa)
