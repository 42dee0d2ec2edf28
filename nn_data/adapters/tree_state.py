"""Recurrent and convolution layers on a rollout tree: every node's tokens run once, each node starting from
its parent node's state at the branch point.

Shape legend
    T   packed tokens (the whole row; under CP the adapter gathers it first)
    B   rollouts (``prefix.shared`` is ``[B+1, B+1]``)
    c   slots per chunk (a Python int); N the layout's node slots; Nc chunk rows (``min(T, T // c + N)``)
    H   heads; K the state's key side (the gated delta rule's key dim, SSD's state size), V its value side
    k   a convolution's taps

A rollout tree (:class:`~nn_data.masks.PrefixRule`) packs every shared prefix once; the layout cuts each
rollout's tokens where a child branches, so every branch point is a node boundary. Each token has a
**predecessor**: the previous token on its rollout's path (the one before it in its node, or, for a node's
first token, its parent's token at the branch point), from which everything here follows:

* a causal convolution of ``k`` taps reads the token and its ``k - 1`` predecessors (one gather,
  :func:`tree_conv`): the convolution state at a branch point is the parent's last ``k - 1`` inputs;
* a linear recurrence (the gated delta rule, Mamba-2's SSD) runs on **chunk rows**: each node cut into
  chunks of ``c`` slots (a chunk never spans two nodes), every chunk of every node in one batched call of the
  family's own chunked function from a zero state, then the chunk's true initial state from its
  predecessor chunk's final state (:func:`tree_scan`, ``ceil(log2(Nc + 1))`` doubling steps over the
  affine maps ``state -> M state + U``), and each output corrected by its chunk's initial state (linear in
  it). The parent's final state at the branch point is its last chunk's; gradients flow back through the
  same maps into the parent's tokens.

Static shapes: ``Nc`` from ``T``, ``c`` and ``N`` (a node holds at most ``ceil(len / c)`` chunks; the layout
holds at most ``N`` nodes, ``2B`` for a depth-1 tree, at most ``3B``), no host read, any depth. Work: the
projections and the convolution on ``T`` tokens; the chunked recurrence on ``Nc * c`` slots (each node padded to
a multiple of ``c``), plus the scan's ``[Nc, H, K, K]`` products (the gated delta rule also carries ``K``
identity columns beside its values, to read its transition ``M``).
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nn_data import _compat
from nn_data.masks import PrefixRule

#: Slots per chunk row: the chunk of transformers' gated delta rule and of the flash-linear-attention kernel.
DEFAULT_CHUNK = 64


class TreeSteps(NamedTuple):
    """A tree row's token order (``[T]`` each, ``T`` standing for "none": a zero slot):
    ``pred`` (each token's predecessor on its path), ``chunk_source [Nc, c]`` (the packed token in each chunk
    slot), ``chunk_valid [Nc, c]``, ``packed_slot [T]`` (each token's flat chunk slot; ``Nc * c`` for padding),
    ``chunk_prev [Nc]`` (the chunk whose final state starts chunk ``j``; ``Nc``: none)."""

    pred: torch.Tensor
    chunk_source: torch.Tensor
    chunk_valid: torch.Tensor
    packed_slot: torch.Tensor
    chunk_prev: torch.Tensor


def tree_steps(prefix: PrefixRule, chunk: int, nodes: int) -> TreeSteps:
    """The :class:`TreeSteps` of a tree row with chunks of ``chunk`` slots and at most ``nodes`` nodes (the
    layout's node slots), on the device, no host read.

    Example: rollouts ``[p p r0 r0 r1]`` (rollout 1 branches from rollout 0 at position 2; positions
    ``[0,1,2,3,2]``), c 2, N 4 -> pred ``[5,0,1,2,1]`` (T = 5: none), chunks ``[p p] [r0 r0] [r1 -]``,
    chunk_prev ``[3, 0, 0]`` (Nc = 3: none; both rollouts start from the prompt's chunk).
    """
    owner, position, real = prefix.rollout_ids, prefix.positions, prefix.visible  # [T] each
    total, rollouts, device = owner.shape[0], prefix.shared.shape[0] - 1, owner.device
    places = torch.arange(total, device=device)  # [T]
    # place[r, s]: the packed index of rollout r's own token at position s (T: none); row B and column T: dump
    flat = torch.where(real, owner.clamp(max=rollouts) * (total + 1) + position.clamp(0, total), rollouts * (total + 1)
                       + total)  # [T]
    place = torch.full(((rollouts + 1) * (total + 1),), total, dtype=torch.int64, device=device)
    place = place.scatter(0, flat, torch.where(real, places, total)).view(rollouts + 1, total + 1)[:rollouts]
    # the token before: position s - 1 on the path, held by the one rollout r with place[r, s-1] and s-1 < shared
    before = (position - 1).clamp(0, total)  # [T]
    candidate = place.index_select(1, before).t()  # [T, B]
    sees = prefix.shared.index_select(0, owner.clamp(max=rollouts))[:, :rollouts]  # [T, B]
    hit = (candidate < total) & (before[:, None] < sees) & (real & (position > 0))[:, None]  # [T, B]
    pred = torch.where(hit, candidate, total).amin(dim=1) if rollouts else torch.full_like(owner, total)  # [T]
    # chunks: a node starts where the predecessor is not the token just before, or where another token
    # branches from that one (its state is handed on there); a chunk every c slots of a node
    jump = pred != places - 1  # [T]
    branched = torch.zeros(total + 1, dtype=torch.bool, device=device).scatter(0, torch.where(jump, pred, total),
                                                                              torch.ones_like(jump))  # [T+1]
    starts = real & (jump | torch.cat([branched.new_zeros(1), branched[: total - 1]]) if total else jump)  # [T]
    node_start = torch.cummax(torch.where(starts, places, 0), dim=0).values  # [T]
    offset = places - node_start  # [T]: the token's place in its node
    new_chunk = real & (starts | (offset % chunk == 0))  # [T]
    rows = max(1, min(total, total // chunk + nodes))
    chunk_id = torch.where(real, torch.cumsum(new_chunk.to(torch.int64), 0) - 1, rows).clamp(max=rows)  # [T]
    packed_slot = torch.where(chunk_id < rows, chunk_id * chunk + offset % chunk, rows * chunk)  # [T]
    source = torch.full((rows * chunk + 1,), total, dtype=torch.int64, device=device)
    source = source.scatter(0, packed_slot, torch.where(chunk_id < rows, places, total))[:-1]  # [Nc*c]
    first = torch.full((rows + 1,), total, dtype=torch.int64, device=device)
    first = first.scatter(0, torch.where(new_chunk, chunk_id, rows), places)[:-1]  # [Nc]: each chunk's first token
    pred_of = torch.cat([pred, pred.new_full((1,), total)])  # [T+1]
    chunk_of = torch.cat([chunk_id, chunk_id.new_full((1,), rows)])  # [T+1]
    chunk_prev = chunk_of.index_select(0, pred_of.index_select(0, first))  # [Nc]
    return TreeSteps(pred, source.view(rows, chunk), (source < total).view(rows, chunk), packed_slot, chunk_prev)


def tree_conv(x: torch.Tensor, conv: torch.nn.Conv1d, steps: TreeSteps) -> torch.Tensor:
    """``[T, C] -> [T, C]``: the depthwise causal convolution ``conv`` (weight ``[C, 1, k]``, oldest tap first)
    along each token's path (its ``k - 1`` predecessors, 0 before a root), no activation: one gather and a
    multiply-add per tap (no ``[T, k, C]`` intermediate).

    Example: k 3, a token t with predecessors p1 = pred[t], p2 = pred[p1] -> ``w2 x[t] + w1 x[p1] + w0 x[p2]``."""
    taps = conv.weight.shape[-1]
    total = x.shape[0]
    pred = torch.cat([steps.pred, steps.pred.new_full((1,), total)])  # [T+1]: the zero slot is its own pred
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])  # [T+1, C]
    acc = torch.promote_types(x.dtype, torch.float32)  # bfloat16 / float16 sum their taps in float32, once rounded
    weight = conv.weight[:, 0, :].to(acc)  # [C, k]
    index = torch.arange(total, device=x.device)  # [T]: the token itself, then each predecessor in turn
    out = x.to(acc) * weight[:, taps - 1]  # [T, C]
    for tap in range(taps - 2, -1, -1):
        index = pred.index_select(0, index)
        out = out + padded.index_select(0, index).to(acc) * weight[:, tap]
    out = out if conv.bias is None else out + conv.bias.to(acc)
    return out.to(x.dtype)


def to_chunks(x: torch.Tensor, steps: TreeSteps) -> torch.Tensor:
    """``[T, *] -> [Nc, c, *]``: each chunk's tokens, zeros in its empty slots."""
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])  # [T+1, *]
    rows, chunk = steps.chunk_source.shape
    return padded.index_select(0, steps.chunk_source.reshape(-1)).view(rows, chunk, *x.shape[1:])


def from_chunks(y: torch.Tensor, steps: TreeSteps) -> torch.Tensor:
    """``[Nc, c, *] -> [T, *]``: each token's slot, zeros for padding."""
    flat = y.reshape(-1, *y.shape[2:])
    flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])  # [Nc*c+1, *]
    return flat.index_select(0, steps.packed_slot)


def tree_scan(transition: torch.Tensor, final: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Each chunk's initial state ``[Nc, H, K, V]`` from its zero-state ``final [Nc, H, K, V]`` and its
    ``transition [Nc, H, K, K]`` (or ``[Nc, H, 1, 1]``, a scalar decay): ``F_j = M_j F_prev(j) + U_j``, the
    initial state of ``j`` is ``F_prev(j)`` (0 for none). Pointer doubling: after step ``i`` each chunk holds the
    map from the final state ``2^i`` chunks up its path; ``ceil(log2(Nc + 1))`` steps reach every root.

    Example: a chain of 3 chunks (prev ``[3, 0, 1]``), scalars M ``[a, b, c]``, U ``[u, v, w]`` -> initial
    states ``[0, u, b u + v]``.
    """
    rows = prev.shape[0]
    scalar = transition.shape[-1] == 1 and final.shape[-2] != 1

    def apply(m, s):
        return m * s if scalar else m @ s

    m = torch.cat([transition, transition.new_zeros(1, *transition.shape[1:])])  # [Nc+1, H, K, K]
    u = torch.cat([final, final.new_zeros(1, *final.shape[1:])])  # [Nc+1, H, K, V]
    up = torch.cat([prev, prev.new_full((1,), rows)])  # [Nc+1]
    steps = math.ceil(math.log2(rows + 1))
    for i in range(steps):
        u = u + apply(m, u.index_select(0, up))
        if i + 1 < steps:
            m = apply(m, m.index_select(0, up))
            up = up.index_select(0, up)
    return u.index_select(0, torch.cat([prev, prev.new_full((1,), rows)]))[:rows]


# ---- the families -------------------------------------------------------------------------------------


def short_conv_forward(layer, hidden: torch.Tensor, steps: TreeSteps) -> torch.Tensor:
    """LFM2's short convolution (``Lfm2ShortConv``) on a tree row: ``[1, T, D] -> [1, T, D]``."""
    b, c, x = layer.in_proj(hidden[0]).chunk(3, dim=-1)  # [T, D] each
    y = c * tree_conv(b * x, layer.conv, steps)
    return layer.out_proj(y).unsqueeze(0)


def ssd_forward(layer, hidden: torch.Tensor, steps: TreeSteps, chunk_scan) -> torch.Tensor:
    """A Mamba-2 mixer (``Mamba2Mixer``, ``BambaMixer``) on a tree row: ``[1, T, D] -> [1, T, D]``, with
    ``chunk_scan`` the model's own chunked SSD (transformers' ``mamba2_chunk_scan`` or its kernel)."""
    dtype = hidden.dtype
    gate, xbc, dt = layer.in_proj(hidden[0]).split([layer.intermediate_size, layer.conv_dim, layer.num_heads], -1)
    xbc = layer.act(tree_conv(xbc, layer.conv1d, steps))  # [T, conv_dim]
    groups, state = layer.n_groups, layer.ssm_state_size
    x, b, c = xbc.split([layer.intermediate_size, groups * state, groups * state], dim=-1)
    heads, head_dim = layer.num_heads, layer.head_dim
    low, high = layer.time_step_limit
    dt = F.softplus(dt + layer.dt_bias.to(dt.dtype)).clamp(low, high)  # [T, H]
    a = -torch.exp(layer.A_log.float())  # [H]
    rows = (to_chunks(x.reshape(-1, heads, head_dim), steps), to_chunks(dt, steps),
            to_chunks(b.reshape(-1, groups, state), steps), to_chunks(c.reshape(-1, groups, state), steps))
    x_r, dt_r, b_r, c_r = rows  # [Nc, c, H, P], [Nc, c, H] (0 in empty slots: no decay), [Nc, c, G, N] x2
    y, final = chunk_scan(x_r, dt_r, a, b_r, c_r, chunk_size=steps.chunk_source.shape[1], D=None,
                          return_final_states=True)  # [Nc, c, H, P], [Nc, H, P, N]
    log_decay = torch.cumsum(a * dt_r, dim=1)  # [Nc, c, H]
    start = tree_scan(log_decay[:, -1].exp()[..., None, None], final, steps.chunk_prev)  # [Nc, H, P, N]
    c_heads = c_r.float().repeat_interleave(heads // groups, dim=2, output_size=heads)  # [Nc, c, H, N]
    y = y + log_decay.exp()[..., None] * torch.einsum("nchs,nhps->nchp", c_heads, start.to(y.dtype))
    y = y + layer.D.to(y.dtype)[:, None] * x_r.to(y.dtype)  # the skip
    out = from_chunks(y, steps).reshape(1, -1, heads * head_dim)  # [1, T, H*P]
    return layer.out_proj(layer.norm(out, gate.unsqueeze(0)).to(dtype))


def gated_delta_forward(layer, hidden: torch.Tensor, steps: TreeSteps, delta_rule) -> torch.Tensor:
    """A gated delta net (Qwen3-Next's, Qwen3.5's) on a tree row: ``[1, T, D] -> [1, T, D]``, with
    ``delta_rule`` the model's own chunked gated delta rule (transformers' ``torch_chunk_gated_delta_rule`` or
    its kernel). The values carry ``K`` identity columns from an identity state, which read each chunk's
    transition (the state's map ``S -> M S``) and each output's response to the initial state."""
    if hasattr(layer, "in_proj_qkvz"):
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(hidden), layer.in_proj_ba(hidden))
        mixed = torch.cat([t.reshape(1, t.shape[1], -1) for t in (q, k, v)], dim=-1)[0]  # [T, conv_dim]
    else:
        mixed = layer.in_proj_qkv(hidden)[0]
        z = layer.in_proj_z(hidden).reshape(1, hidden.shape[1], -1, layer.head_v_dim)
        b, a = layer.in_proj_b(hidden), layer.in_proj_a(hidden)
    mixed = _activation(layer.activation)(tree_conv(mixed, layer.conv1d, steps))  # [T, conv_dim]
    q, k, v = mixed.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    kd, vd = layer.head_k_dim, layer.head_v_dim
    beta = b[0].sigmoid()  # [T, Hv]
    g = -layer.A_log.float().exp() * F.softplus(a[0].float() + layer.dt_bias)  # [T, Hv]
    heads = beta.shape[-1]
    eye = torch.eye(kd, dtype=v.dtype, device=v.device)
    values = torch.cat([v.reshape(-1, heads, vd), v.new_zeros(v.shape[0], heads, kd)], dim=-1)  # [T, Hv, V+K]
    # each key head serves Hv / Hk consecutive value heads; repeated here, as transformers 5.6's function
    # expects (later releases repeat inside theirs, a no-op once the heads match)
    q_r, k_r = (to_chunks(_per_value_head(t.reshape(-1, layer.num_k_heads, kd), heads), steps) for t in (q, k))
    rows = steps.chunk_source.shape[0]
    start = torch.cat([v.new_zeros(rows, heads, kd, vd), eye.expand(rows, heads, kd, kd)], dim=-1)  # [Nc, Hv, K, V+K]
    out, final = delta_rule(q_r, k_r, to_chunks(values, steps), g=to_chunks(g, steps), beta=to_chunks(beta, steps),
                            chunk_size=steps.chunk_source.shape[1], initial_state=start, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)  # [Nc, c, Hv, V+K], [Nc, Hv, K, V+K]
    final = final.to(out.dtype)
    state = tree_scan(final[..., vd:], final[..., :vd], steps.chunk_prev)  # [Nc, Hv, K, V]
    out = out[..., :vd] + torch.einsum("nchk,nhkv->nchv", out[..., vd:], state)  # [Nc, c, Hv, V]
    out = from_chunks(out, steps)  # [T, Hv, V]
    out = layer.norm(out.reshape(-1, vd), z.reshape(-1, vd)).reshape(1, -1, heads * vd)
    return layer.out_proj(out)


def _per_value_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[T, Hk, K] -> [T, Hv, K]``: key head ``h`` repeated for value heads ``h * Hv/Hk ... (h+1) * Hv/Hk - 1``.

    Example: Hk 2, Hv 4 -> heads ``[k0, k0, k1, k1]``."""
    tokens, key_heads, dim = x.shape
    return x[:, :, None].expand(tokens, key_heads, heads // key_heads, dim).reshape(tokens, heads, dim)  # [T, Hv, K]


def chunk_for(layer) -> int:
    """Slots per chunk row for ``layer``: its state's key side (a gated delta net's key head size, a Mamba-2
    mixer's state size) clamped into ``[16, DEFAULT_CHUNK]``, and never more than a Mamba-2 mixer's own
    ``chunk_size``. The chunk's own work grows with ``c``, the scan's work with the number of chunks (each holds a
    whole state), each node's padding with ``c``: a released Mamba-2 config's 256 would pad every short rollout to
    256 slots, so its rows take 64. A convolution reads no chunks. Example: a Mamba-2 mixer of state 128 and chunk
    256 -> 64; of state 16 and chunk 8 -> 8; a gated delta net of key heads 128 -> 64."""
    side = getattr(layer, "head_k_dim", None) or getattr(layer, "ssm_state_size", None) or DEFAULT_CHUNK
    return min(max(16, min(DEFAULT_CHUNK, int(side))), int(getattr(layer, "chunk_size", DEFAULT_CHUNK)))


def tree_forward(layer, hidden: torch.Tensor, steps: TreeSteps) -> torch.Tensor:
    """``layer`` (a recognised mixer, by class name) on a tree row ``[1, T, D] -> [1, T, D]``, with the chunked
    function of the layer's own module (transformers' torch path, or the kernel it dispatches to)."""
    name, module = type(layer).__name__, sys.modules[type(layer).__module__]
    if name == "Lfm2ShortConv":
        return short_conv_forward(layer, hidden, steps)
    if name in ("Mamba2Mixer", "BambaMixer"):
        return ssd_forward(layer, hidden, steps, _compat.ssd_chunk_scan(module))
    if name in ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet"):
        return gated_delta_forward(layer, hidden, steps, module.torch_chunk_gated_delta_rule)
    raise ValueError(f"no tree forward for {name}")  # hf_layers.MIXERS lists only the classes above


def _activation(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]
