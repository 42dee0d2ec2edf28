"""A small causal transformer that runs on packed (and CP-sharded) tokens: the tests' and
``scripts/packed_forward_example.py``'s proof that packing is exact.

Shape legend
    Tq  query tokens this call sees (``T/C`` under context parallelism, else ``T``)
    T   packed tokens (keys after the CP gather)
    H   attention heads, D head dim, E model dim (``H * D``), V vocab

Attention is document-causal under :func:`nn_data.masks.document_mask`; under context parallelism each rank
all-gathers keys and values (``PackedInfo.gather``): exact, not ring attention."""

from __future__ import annotations

from typing import Optional

import torch
from einops import rearrange
from torch import nn

from nn_data.masks import DocumentMask, causal_mask, document_attention, document_causal_mask, document_mask

__all__ = ["TinyCausalLM", "document_causal_mask", "rope"]


def rope(x: torch.Tensor, position_ids: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``x [1, H, Tq, D]`` at ``position_ids [1, Tq]`` (rotate-half form)."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)  # [D/2]
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [1, Tq, D/2]
    cos, sin = angles.cos()[:, None].to(x.dtype), angles.sin()[:, None].to(x.dtype)  # [1, 1, Tq, D/2]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_mult: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_mult * dim), nn.GELU(), nn.Linear(mlp_mult * dim, dim))

    def forward(self, h, position_ids, mask: DocumentMask) -> torch.Tensor:
        qkv = rearrange(self.qkv(self.norm1(h)), "1 t (three h d) -> three 1 h t d", three=3, h=self.heads)
        q, k, v = rope(qkv[0], position_ids), rope(qkv[1], position_ids), qkv[2]  # [1, H, Tq, D]
        if mask.gather is not None:  # context parallel: every rank's keys and values, in packed order
            kv = rearrange(torch.stack([k, v]), "two 1 h t d -> 1 t (two h d)")  # [1, Tq, 2E]
            kv = mask.gather(kv)  # [1, T, 2E]
            k, v = rearrange(kv, "1 t (two h d) -> two 1 h t d", two=2, h=self.heads)
        attn = document_attention(q, k, v, mask)  # [1, H, Tq, D]
        h = h + self.proj(rearrange(attn, "1 h t d -> 1 t (h d)"))
        return h + self.mlp(self.norm2(h))


class TinyCausalLM(nn.Module):
    """Embedding, ``layers`` pre-norm blocks (RoPE attention + MLP), final norm, LM head.

    ``forward(input_ids [1, Tq], position_ids [1, Tq], packed) -> logits [1, Tq, V]``, ``packed`` a
    :class:`~nn_data.packed_forward.PackedInfo`; :meth:`forward_single` runs one unpacked sequence ``[1, L]`` (the
    equivalence tests' oracle). ``mask_kind`` chooses the mask's form (:func:`nn_data.masks.document_mask`)."""

    def __init__(self, vocab: int = 97, dim: int = 32, heads: int = 4, layers: int = 2, mlp_mult: int = 2,
                 mask_kind: str = "auto"):
        super().__init__()
        self.mask_kind = mask_kind
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_mult) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def _run(self, input_ids, position_ids, mask: DocumentMask) -> torch.Tensor:
        h = self.embed(input_ids)  # [1, Tq, E]
        for block in self.blocks:
            h = block(h, position_ids, mask)
        return self.head(self.norm(h))  # [1, Tq, V]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, packed) -> torch.Tensor:
        dtype = self.head.weight.dtype
        mask = document_mask(packed.query_index, packed.segment_ids, kind=self.mask_kind, dtype=dtype,
                             gather=packed.gather)  # dense [Tq, T] or a flex BlockMask
        return self._run(input_ids, position_ids, mask)

    def forward_single(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One sequence ``[1, L]`` alone, causal mask, positions ``0..L-1``: ``[1, L, V]``."""
        length = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device)[None]
        return self._run(input_ids, position_ids, causal_mask(length, input_ids.device))
