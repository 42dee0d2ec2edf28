"""Helpers for the nn_data.megatron_data tests: coded batches, a host-sync counter, configs."""

from __future__ import annotations

import warnings

import torch

warnings.filterwarnings("ignore", message=".*(TransformerEngine|[Aa]pex).*")

PAD = -7  # content of input padding: a pad that leaks into a packed result shows up


def coded_ids(lengths, seq_len: int) -> torch.Tensor:
    """``[B, S]`` int64: token ``(b, t)`` = ``1000*b + t + 1`` on valid tokens, ``PAD`` elsewhere."""
    rows = len(lengths)
    b = torch.arange(rows).view(rows, 1)
    t = torch.arange(seq_len).view(1, seq_len)
    lens = torch.as_tensor(list(lengths), dtype=torch.int64).view(rows, 1)
    return torch.where(t < lens, 1000 * b + t + 1, torch.full((rows, seq_len), PAD))


def coded_routes(lengths, seq_len: int, layers: int = 2, topk: int = 3) -> torch.Tensor:
    """``[B, S, layers, topk]``: the token's code times 100 plus ``10*layer + k`` (PAD on padding)."""
    ids = coded_ids(lengths, seq_len)
    extra = (10 * torch.arange(layers).view(layers, 1) + torch.arange(topk).view(1, topk))  # [Ly, K]
    out = ids[:, :, None, None] * 100 + extra
    return torch.where(ids[:, :, None, None] == PAD, torch.full_like(out, PAD), out)


def megatron_cfg(tp=1, sp=False, pp=1, cp=1, fp8=None, dispatcher=None, backend=None) -> dict:
    cfg = {"tensor_model_parallel_size": tp, "sequence_parallel": sp, "pipeline_model_parallel_size": pp,
           "context_parallel_size": cp}
    if fp8 is not None:
        cfg["fp8_cfg"] = {"enabled": True, "fp8_recipe": fp8}
    if dispatcher is not None:
        cfg["moe_token_dispatcher_type"] = dispatcher
    if backend is not None:
        cfg["moe_flex_dispatcher_backend"] = backend
    return cfg


