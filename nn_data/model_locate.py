"""Which layer of a model first tells two runs apart: forward hooks on every module, outputs compared token by token.

Shape legend
    Tq  local tokens of a packed run (the wrapped model's ``input_ids [1, Tq]``)
    L   tokens of an unpacked run of one document

:func:`first_difference` records each module's input and output in call order over two runs and finds the
first module whose output differs on the tokens both hold while its input does not. A token is keyed by its
document and place (``key = doc * KEY_STRIDE + position``), so the runs may place documents anywhere.
Diagnosis only: it reads the device freely.

Example: documents 1 and 2 kept, run a = the microbatch, run b = the microbatch with documents 0 and 3
re-drawn -> ``(5, names)`` where ``names[5] == "'model.layers.0.mlp' (ShiftMLP)"``."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

KEY_STRIDE = 1 << 32
ULPS = 16
"""Tolerance of the comparisons across layouts (documents at other offsets, beside other lengths and counts, or
unpacked), in epsilons of the output's dtype (float32's at least: models compute norms, softmax and scans in float32
whatever their dtype) relative to the largest output: the runs sum in other orders; a mixed document is off by far
more (3e-4 relative and up)."""


def rounding(reference: torch.Tensor, ulps: float, *, islands: bool = True) -> float:
    """``ulps`` epsilons of ``reference``'s dtype (float32's at least with ``islands``: the float32 steps inside a
    float64 model) times its largest magnitude; 0 for an integer tensor."""
    if not reference.is_floating_point():
        return 0.0
    eps = torch.finfo(reference.dtype).eps
    eps = max(eps, torch.finfo(torch.float32).eps) if islands else eps
    return ulps * eps * max(float(reference.abs().max()) if reference.numel() else 0.0, 1e-30)  # sync: the check


def tolerance(reference: torch.Tensor) -> float:
    """:data:`ULPS` epsilons of ``reference``'s dtype (float32's at least) times its largest magnitude."""
    return rounding(reference, ULPS)


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    for name in ("logits", "last_hidden_state"):
        if isinstance(getattr(out, name, None), torch.Tensor):
            return getattr(out, name)
    return None


class _Recorder:
    """Forward hooks on every module of ``model``: ``records`` ``[(label, output, input)]`` in call order (the
    first tensor of each; input None when the call had none), and the
    ``packed`` argument of the last call of ``model`` itself."""

    def __init__(self, model: nn.Module):
        self.records, self.packed, self.handles = [], None, []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_hook(self._hook(name, module), with_kwargs=True))
        self.handles.append(model.register_forward_pre_hook(self._pre, with_kwargs=True))

    def _hook(self, name: str, module: nn.Module) -> Callable:
        label = f"{name!r} ({type(module).__name__})" if name else f"(the wrapped model: {type(module).__name__})"

        def hook(_module, args, kwargs, out):
            t = _first_tensor(out)
            if t is not None:
                given = _first_tensor(tuple(args) + tuple(kwargs.values()))
                self.records.append((label, t.detach().clone(), None if given is None else given.detach().clone()))
        return hook

    def _pre(self, _module, args, kwargs):
        self.packed = args[2] if len(args) > 2 else kwargs.get("packed")

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def packed_keys(packed, doc_of_segment: list, lengths: list) -> torch.Tensor:
    """``[Tq]`` key of each local token of a packed run (-1 on padding): segment ``s`` is document
    ``doc_of_segment[s]`` with ``lengths[s]`` real tokens. Example: cu_seqlens_padded ``[0, 4, 8]``, lengths
    ``[3, 2]``, docs ``[7, 9]`` -> ``[7K, 7K+1, 7K+2, -1, 9K, 9K+1, -1, -1]`` (K = KEY_STRIDE)."""
    seg = packed.segment_ids[packed.query_index].long().cpu()  # [Tq]
    start = packed.cu_seqlens_padded.long().cpu()[seg.clamp(max=len(doc_of_segment) - 1)]  # [Tq]
    pos = packed.query_index.long().cpu() - start  # [Tq]
    docs = torch.tensor(doc_of_segment + [-1])[seg.clamp(max=len(doc_of_segment))]
    real = torch.tensor(lengths + [0])[seg.clamp(max=len(lengths))]
    return torch.where((pos < real) & (docs >= 0), docs * KEY_STRIDE + pos, -1)


def first_difference(model, run_a: Callable, run_b: Callable, *, docs: list, exact: bool, lengths_a: list,
                     lengths_b: Optional[list] = None, second_docs: Optional[list] = None,
                     second_alone: Optional[int] = None) -> tuple:
    """``(index, labels)``: the index in ``labels`` (run a's modules in call order) of the first module whose output
    differs between ``run_a()`` and ``run_b()`` on the tokens of ``docs`` both hold (None: none). Run a's segment
    ``s`` is document ``s``; run b's is ``second_docs[s]`` (default the same), or with ``second_alone=L`` an
    unpacked run of ``docs[0]``'s ``L`` tokens. ``exact``: bit-identical, else within run a's rounding tolerance."""
    if not isinstance(model, nn.Module):
        return None, []
    runs = []
    for fn, seg_docs, lens in ((run_a, None, lengths_a), (run_b, second_docs, lengths_b or lengths_a)):
        rec = _Recorder(model)
        try:
            fn()
        finally:
            rec.close()
        if rec.packed is not None and not (fn is run_b and second_alone is not None):
            seg_docs = seg_docs or list(range(len(lens)))
            keys = packed_keys(rec.packed, seg_docs, list(lens))
        else:
            keys = docs[0] * KEY_STRIDE + torch.arange(second_alone or 0)
        runs.append((rec.records, keys))
    (rec_a, keys_a), (rec_b, keys_b) = runs
    labels = [record[0] for record in rec_a]
    where_b = {int(key): i for i, key in enumerate(keys_b.tolist()) if key >= 0 and key // KEY_STRIDE in docs}  # sync: the check's diagnosis, once per refusal
    pairs = [(i, where_b[int(key)]) for i, key in enumerate(keys_a.tolist()) if int(key) in where_b]  # sync: the check's diagnosis, once per refusal
    if not pairs:
        return None, labels
    ia, ib = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    counts, by_label = {}, {}
    for record in rec_b:
        by_label.setdefault(record[0], []).append(record)
    first = None
    for index, (label, out_a, in_a) in enumerate(rec_a):
        n = counts[label] = counts.get(label, -1) + 1
        if n >= len(by_label.get(label, [])):
            continue
        _, out_b, in_b = by_label[label][n]
        if _differs(out_a, out_b, ia, ib, len(keys_a), len(keys_b), exact) is True:
            first = index if first is None else first
            if _differs(in_a, in_b, ia, ib, len(keys_a), len(keys_b), exact) is not True:
                if first != index and not rec_a[index][0].startswith("(the wrapped"):
                    pass  # a layer: its own name says where
                elif first != index:  # the wrapped model's own code mixes: say which output shows it first
                    labels = labels[:index] + [f"{labels[index]} (first differing output inside: {labels[first]})"]
                return index, labels  # its inputs agree and its output does not: this module mixes
    return first, labels


def _differs(ta, tb, ia, ib, na: int, nb: int, exact: bool) -> Optional[bool]:
    """Whether ``ta`` and ``tb`` differ on the paired tokens (None: not comparable, no token dim)."""
    if ta is None or tb is None:
        return None
    dim = _token_dim(ta, tb, na, nb)
    if dim is None:
        return None
    xa, xb = ta.index_select(dim, ia.to(ta.device)), tb.index_select(dim, ib.to(tb.device)).to(ta.dtype)
    if exact:
        return not torch.equal(xa, xb)  # sync: the check's diagnosis, once per refusal
    if not ta.is_floating_point():
        return not torch.equal(xa, xb)  # sync: the check's diagnosis, once per refusal
    return float((xa.double() - xb.double()).abs().max()) > tolerance(xa) if xa.numel() else False


def _token_dim(ta: torch.Tensor, tb: torch.Tensor, na: int, nb: int) -> Optional[int]:
    """The dim holding the tokens in both tensors (others equal), trying dim 1, 2, 0, then the rest."""
    if ta.dim() != tb.dim():
        return None
    for d in [1, 2, 0] + list(range(3, ta.dim())):
        if d < ta.dim() and ta.shape[d] == na and tb.shape[d] == nb and \
                all(ta.shape[e] == tb.shape[e] for e in range(ta.dim()) if e != d):
            return d
    return None
