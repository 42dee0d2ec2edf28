"""The loop reference of shared-prefix packing, built rollout by rollout (tests/ops/test_shared_prefix_*.py
and the multi-process cases, tests/support/shared_prefix_cases.py).

Shape legend: ``B`` rollouts, ``S`` row length, ``T`` packed tokens, ``V`` vocabulary.
"""

from __future__ import annotations

import torch

from nn_data.layout import PackSpec, shared_prefix_layout
from nn_data.testing.reference import reference_pack

V = 12  # the vocabulary of the log-prob cases (a multiple of TP = 2)


def rollouts(groups, prefix, lengths, seq_len, trailing=()):
    """``input_ids [B, S, *]`` with a unique code per packed token: a group's prompt token ``s`` is
    ``1000 * (leader + 1) + s`` in every member's row, rollout ``b``'s response token ``s`` is
    ``1000 * (b + 1) + 500 + s``; padding ``-7``."""
    x = torch.full((len(lengths), seq_len), -7, dtype=torch.int64)
    for b, (g, p, n) in enumerate(zip(groups, prefix, lengths)):
        lead = groups.index(g)
        for s in range(n):
            x[b, s] = 1000 * (lead + 1) + s if s < p else 1000 * (b + 1) + 500 + s
    if trailing:
        x = x.view(*x.shape, 1) * 10 + torch.arange(trailing[0])
    return x


def reference(groups, prefix, lengths, x, m=1, fixed_total=None):
    """The packed row slot by slot (a prompt slot for each group's first rollout, a response slot for
    each rollout), its positions and, per packed position, ``(rollout, s)``: the rollout token it holds
    (the leader's for a prompt) or None for padding."""
    slot_rows, slot_lengths, base, owner = [], [], [], []
    for b, (g, p, n) in enumerate(zip(groups, prefix, lengths)):
        lead = groups.index(g) == b
        slot_rows += [x[b], torch.cat([x[b, p:], x[b, :p]])]  # the response moved to the row's start
        slot_lengths += [p if lead else 0, n - p]
        base += [0, p]
        owner += [(b, 0), (b, p)]
    slot_x = torch.stack(slot_rows) if slot_rows else x.new_zeros((0, *x.shape[1:]))
    ref = reference_pack(slot_x, slot_lengths, m, 1, fixed_total)
    bounds = ref.cu_seqlens_padded.tolist()
    bounds = [0, bounds[0]] if len(bounds) == 1 else bounds
    positions, token, seg = [], [], []
    for j in range(len(bounds) - 1):
        for k in range(bounds[j + 1] - bounds[j]):
            positions.append(base[j] + k if j < len(base) else k)
            real = j < len(slot_lengths) and k < slot_lengths[j]
            token.append((owner[j][0], owner[j][1] + k) if real else None)
            seg.append(j)
    return ref, positions, token, seg


def places(groups, prefix, token):
    """``{(b, s): packed position}`` from the loop reference: a prompt token is its leader's."""
    place = {}
    for i, t in enumerate(token):
        if t is not None:
            b, s = t
            members = [b] if s >= prefix[b] else [r for r in range(len(groups)) if groups[r] == groups[b]]
            for r in members:
                place[(r, s)] = i
    return place


def alone(per_position, groups, prefix, lengths, ids, token, seq_len):
    """``[B, S-1]``: each rollout alone, its logits the rows a model computes at its tokens' packed places
    (``per_position(index) -> [len, V]``), scored by a plain log_softmax."""
    place = places(groups, prefix, token)
    rows = []
    for b, n in enumerate(lengths):
        row = torch.zeros(max(seq_len - 1, 0), dtype=torch.float64)
        if n > 1:
            logits = per_position(torch.tensor([place[(b, s)] for s in range(n - 1)]))  # [L-1, V]
            lp = torch.log_softmax(logits, dim=-1).gather(1, ids[b, 1:n, None]).squeeze(1)  # [L-1]
            row = torch.cat([lp, row[n - 1:]])
        rows.append(row)
    return torch.stack(rows) if rows else torch.zeros(0, max(seq_len - 1, 0), dtype=torch.float64)


def alone_outputs(per_position, groups, prefix, lengths, seq_len, token, k):
    """The oracle of ``outputs()``: each rollout alone, entry ``s < L - 1`` from the log-softmax of its token
    ``s``'s logits (``per_position``), else 0: entropy ``[B, S-1]``, top-``k`` log-probs and ids, argmax."""
    place, width = places(groups, prefix, token), max(seq_len - 1, 0)
    ent, top, ids, arg = [], [], [], []
    for b, n in enumerate(lengths):
        e, t = torch.zeros(width, dtype=torch.float64), torch.zeros(width, k, dtype=torch.float64)
        i, a = torch.zeros(width, k, dtype=torch.int64), torch.zeros(width, dtype=torch.int64)
        if n > 1:
            lp = torch.log_softmax(per_position(torch.tensor([place[(b, s)] for s in range(n - 1)])), dim=-1)
            best = torch.topk(lp, k)
            e = torch.cat([-(lp.exp() * lp).sum(-1), e[n - 1:]])
            t, i = torch.cat([best.values, t[n - 1:]]), torch.cat([best.indices, i[n - 1:]])
            a = torch.cat([lp.argmax(-1), a[n - 1:]])
        ent.append(e), top.append(t), ids.append(i), arg.append(a)
    return torch.stack(ent), torch.stack(top), torch.stack(ids), torch.stack(arg)


def logprob_case(groups, prefix, lengths, seq_len, *, m=2, fixed_total=None, seed=0):
    """``(layout, ids [B, S], token, weights [B, S-1], generator)``: rollouts with ids in ``[0, V)``, their
    shared-prefix layout (slots rounded up to ``m``), the reference's token of each packed position and
    the weights of a test loss ``sum(out * weights)``."""
    gen = torch.Generator().manual_seed(seed)
    x = rollouts(groups, prefix, lengths, seq_len)
    ids = torch.where(x >= 0, x % V, 0)  # token ids in [0, V); padding 0
    sp = shared_prefix_layout(torch.tensor(lengths, dtype=torch.int64), torch.tensor(prefix, dtype=torch.int64),
                              torch.tensor(groups, dtype=torch.int64), row_len=seq_len,
                              spec=PackSpec(m, fixed_total=fixed_total), input_ids=ids)
    _, _, token, _ = reference(groups, prefix, lengths, x, m, fixed_total)
    weights = torch.randn(len(lengths), max(seq_len - 1, 0), generator=gen, dtype=torch.float64)
    return sp, ids, token, weights, gen
