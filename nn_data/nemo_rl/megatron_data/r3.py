"""Router replay (R3) helpers: routed experts on the token layout, and the debug verifier.

Shape legend
    B   sequences; S padded row length; T packed tokens; C context-parallel size
    Ly  MoE layers; K top-k: routed experts are ``[B, S, Ly, K]`` (token-aligned expert ids)

Routed experts ride the tokens' layout (no roll); pad rows are ``arange(K)``, a valid top-k route. Token identities
``[B, S, 3]`` = ``[batch_idx, token_pos, valid]`` let the forward verifier check every CP-local token and route; it
runs when ``NN_DATA_R3_VERIFY`` (or NeMo-RL's ``NRL_R3_TRACE`` and ``NRL_R3_TRACE_VERIFY_FORWARD``) is on, at
one host sync per microbatch."""

from __future__ import annotations

import os
from typing import Optional

import torch

from nn_data.layout import Boundaries, layout_from_boundaries
from nn_data.extension import checks
from nn_data.nemo_rl.assertions import PackingAssertionError
from nn_data.nemo_rl.megatron_data.dispatch import as_lengths, on_device

R3_VERIFY_ENV = "NN_DATA_R3_VERIFY"
_TRUE = {"1", "true", "yes", "on"}


def _env_on(name: str) -> bool:
    return os.getenv(name, "0").strip().lower() in _TRUE


def r3_verify_forward_enabled() -> bool:
    """Whether the R3 forward verifier runs (``NN_DATA_R3_VERIFY``, or NeMo-RL's two variables)."""
    return _env_on(R3_VERIFY_ENV) or (_env_on("NRL_R3_TRACE") and _env_on("NRL_R3_TRACE_VERIFY_FORWARD"))


def _make_r3_trace_token_identity(input_ids: torch.Tensor, seq_lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, S, 3]`` int32 identities ``[batch_idx, token_pos, valid]``, ``valid`` 1 below ``seq_lengths[b]``; no sync.

    Example: ``input_ids [2, 3]``, lengths ``[2, 0]`` -> ``[[[0,0,1],[0,1,1],[0,2,0]], [[1,0,0],[1,1,0],[1,2,0]]]``."""
    rows, cols = input_ids.shape[:2]
    device = input_ids.device
    batch_idx = torch.arange(rows, dtype=torch.int32, device=device)[:, None].expand(rows, cols)  # [B, S]
    token_pos = torch.arange(cols, dtype=torch.int32, device=device)[None, :].expand(rows, cols)  # [B, S]
    if seq_lengths is None:
        valid = torch.ones(rows, cols, dtype=torch.int32, device=device)
    else:
        lengths = as_lengths(seq_lengths, rows, device)
        valid = (token_pos < lengths[:, None]).to(torch.int32)  # [B, S]
    return torch.stack([batch_idx, token_pos, valid], dim=-1)  # [B, S, 3]


def _verify_r3_trace_cp_token_alignment(
    *,
    source_input_ids: torch.Tensor,
    source_routed_experts: Optional[torch.Tensor],
    input_ids_cp_sharded: torch.Tensor,
    routed_experts_cp_sharded: Optional[torch.Tensor],
    token_identity_cp_sharded: Optional[torch.Tensor],
) -> Optional[int]:
    """Check CP-local tokens and routes against the source rows their identities name (one host sync).

    Returns None when the verifier is off or no identities are given, else the number of valid tokens checked.
    Raises ``RuntimeError`` (as NeMo-RL) naming the first mismatch, or when routes and identities are not together."""
    if not r3_verify_forward_enabled() or token_identity_cp_sharded is None:
        return None
    if source_routed_experts is None or routed_experts_cp_sharded is None:
        raise RuntimeError("R3 forward verifier expected routed_experts and token identity tensors to be present "
                           f"together. (source_routed_experts is {type(source_routed_experts).__name__}, "
                           f"routed_experts_cp_sharded is {type(routed_experts_cp_sharded).__name__})")
    if token_identity_cp_sharded.shape[-1] != 3:
        raise RuntimeError("R3 token identity must have trailing [batch_idx, token_pos, valid] dimension; got "
                           f"{tuple(token_identity_cp_sharded.shape)} (the last dim must be 3)")
    ident = token_identity_cp_sharded.reshape(-1, 3).to(torch.int64)  # [N, 3]
    tokens = input_ids_cp_sharded.reshape(-1)  # [N]
    routed = routed_experts_cp_sharded.reshape(-1, *routed_experts_cp_sharded.shape[2:])  # [N, Ly, K]
    if not ident.shape[0] == tokens.shape[0] == routed.shape[0]:
        raise RuntimeError("R3 token identity, input_ids, and routed_experts CP slices have different token counts: "
                           f"identity={ident.shape[0]} tokens={tokens.shape[0]} routed={routed.shape[0]}")
    rows, cols = source_input_ids.shape[:2]
    r, c, valid = ident[:, 0], ident[:, 1], ident[:, 2] == 1  # [N] each
    in_range = (r >= 0) & (r < rows) & (c >= 0) & (c < cols)
    src = r.clamp(0, max(rows - 1, 0)) * cols + c.clamp(0, max(cols - 1, 0))  # [N] into [B*S]
    exp_tok = source_input_ids.reshape(rows * cols, *source_input_ids.shape[2:]).to(tokens.device)[src]
    bad_tok = valid & (~in_range | (tokens != exp_tok.to(tokens.dtype)))
    src_routed = source_routed_experts.reshape(rows * cols, *source_routed_experts.shape[2:]).to(routed.device)
    bad_route = valid & (~in_range | (routed != src_routed[src].to(routed.dtype)).flatten(1).any(1))
    counts = torch.stack([valid.sum(), bad_tok.sum(), bad_route.sum()])
    checked, n_tok, n_route = counts.tolist()  # sync: debug verifier, one per microbatch
    for count, mask, what in ((n_tok, bad_tok, "input_ids"), (n_route, bad_route, "routed_experts")):
        if count:
            i = checks.first_index(mask)
            raise RuntimeError(f"R3 CP token identity verifier found {what} that do not match their source "
                               f"[batch_idx, token_pos] identities. ({count} CP-local tokens; the first at local "
                               f"position {i}, identity {ident[i].tolist()})")  # sync: error path
    return checked


def _fill_routed_experts_padding(routed_experts: torch.Tensor, seq_lengths: torch.Tensor) -> torch.Tensor:
    """Set every padding position (``s >= seq_lengths[b]``) of ``[B, S, Ly, K]`` to ``arange(K)`` (a new tensor, no sync).

    Example: K 2, lengths ``[1]``, S 2 -> position 1 of every layer becomes ``[0, 1]``.

    Raises :class:`~nn_data.errors.PackingError` (a ``ValueError``, as NeMo-RL) when ``routed_experts`` is not 4-D or
    ``seq_lengths`` does not have one entry per row."""
    if routed_experts.dim() != 4:
        raise PackingAssertionError("routed_experts must have shape [batch, seq, num_moe_layers, topk]; got "
                                    f"{tuple(routed_experts.shape)}")
    rows, cols, _, topk = routed_experts.shape
    if tuple(seq_lengths.shape) != (rows,):
        raise PackingAssertionError(f"seq_lengths must have one entry per routed_experts row; got shape "
                                    f"{tuple(seq_lengths.shape)} for batch={rows}")
    lengths = seq_lengths.to(device=routed_experts.device, dtype=torch.int64)
    pad = torch.arange(cols, device=routed_experts.device)[None, :] >= lengths[:, None]  # [B, S]
    route = torch.arange(topk, device=routed_experts.device, dtype=routed_experts.dtype)  # [K]
    return torch.where(pad[:, :, None, None], route, routed_experts)


def _shard_routed_experts_for_cp(
    routed_experts: Optional[torch.Tensor],
    token_identity: Optional[torch.Tensor],
    seq_lengths: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: Optional[torch.Tensor],
    cp_rank: int,
    cp_size: int,
):
    """Pack and CP-shard routed experts / token identities on the tokens' layout (one host sync).

    Returns ``(routed_packed [1, T, Ly, K], routed_cp_sharded [1, T/C, Ly, K], identity_packed [1, T, 3],
    identity_cp_sharded [1, T/C, 3])``, None where the input is None; routed pad rows ``arange(K)``, identity pad rows 0.
    Segments are ``cu_seqlens_padded``'s (``cu_seqlens`` when None).

    Raises :class:`~nn_data.errors.PackingError` for a bad ``cp_rank``/``cp_size``, boundaries not ``[B+1]`` rising from
    0, a length outside ``[0, S]`` or its segment, or (CP > 1) a segment not divisible by ``2 * cp_size``."""
    ref = routed_experts if routed_experts is not None else token_identity
    if ref is None:
        return None, None, None, None
    checks.check_cp(cp_size, cp_rank)
    rows, cols = ref.shape[:2]
    given = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
    lengths = as_lengths(seq_lengths, rows, ref.device)
    checks.check_int_vector("cu_seqlens_padded", given, rows + 1)
    bounds = on_device("cu_seqlens_padded", given, "routed_experts", ref.device)
    # One read of the boundaries and lengths (T is the last boundary): the checks, then the host executor.
    layout = layout_from_boundaries(Boundaries(bounds, None, seq_lengths=lengths), op="_shard_routed_experts_for_cp",
                                    row_len=cols, cp_size=cp_size)
    out = []
    for x, fill in ((routed_experts, "route"), (token_identity, 0)):
        if x is None:
            out += [None, None]
            continue
        if fill == "route":
            fill = torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)  # [K]
        packed = layout.pack(x, fill)  # [1, T, *]
        out += [packed, layout.shard(packed, cp_size, cp_rank)]  # [1, T/C, *]
    return tuple(out)
