"""The packing check: the model a :class:`~nn_data.packed_forward.PackedForward` wraps, proven against itself.

Shape legend
    k   documents of the check's microbatch (4, fewer when the row capacity or ``pad_full_seq_to`` is smaller)
    S   their row length (the longest document)
    *   the model's trailing output dims (vocab ``V`` for logits)

Before the first packed microbatch trains, :func:`check_packing` runs a small packed microbatch of random ids
(its own ``torch.Generator``) through the wrapped model (no_grad, eval mode, both restored) and judges the
documents it leaves untouched against three changes: other offsets, tokens, lengths and count in one run
(:func:`_regrouped`); other tokens in the same shapes, within the model's own noise (:data:`NOISE`,
:data:`SAME_ULPS`); and the adapter's own unpacked path where it has one (``reference``). A failure names the
model type, the first differing layer (forward hooks), the reason and the fix; under CP the verdict is
all-reduced over the CP group. :class:`ModelGuard` decides when it runs (``PackedForward(verify=)``). The
rules, and why an exact model passes: docs/models.md, "Proven on your model"."""

from __future__ import annotations

import contextlib
import re
from typing import NamedTuple

import torch
from torch import nn

from nn_data.errors import PackingError
from nn_data.layout import round_up
from nn_data.model_identity import fingerprint
from nn_data.model_locate import first_difference, rounding, tolerance

CHECK_DOCS = 4  # documents of the check's microbatch
PIECES = 5  # the changed documents are cut into up to this many more documents (other lengths and count)
NOISE = 4
"""A kept document may move by this many times the model's own run-to-run spread (the same microbatch run again,
its inputs at other addresses): atomics on a GPU."""
SAME_ULPS = 4
"""... or by this many epsilons of the output's own dtype times the kept outputs' largest magnitude: a kernel whose
rounding of one row depends on the other rows (a matrix product's blocking, alignment or the kernel chosen) moves a
value by about one epsilon of it; a path between documents whose other tokens all changed moves it by far more."""
MIN_DOC_TOKENS = 8
MAX_DOC_TOKENS = 1024  # a window or rotary original length past this is not reached by the check
SEED = 20_241
_WINDOW_KEYS = ("sliding_window", "attention_chunk_size", "window_size", "conv_kernel", "conv_L_cache", "d_conv")


def _modules(model) -> list:
    return [m for m in ([model] if isinstance(model, nn.Module) else []) for m in m.modules()]


def model_type(model) -> str:
    """The model's name in refusals: its config's ``model_type``, else the inner model's class name."""
    for m in _modules(model):
        name = getattr(m.__dict__.get("config"), "model_type", None)
        if isinstance(name, str) and name:
            return name
    inner = getattr(model, "model", model)
    return type(inner).__name__ if isinstance(inner, nn.Module) else getattr(model, "__name__", type(model).__name__)


def document_lengths(wrapped) -> list:
    """The check's document lengths for the model ``wrapped`` holds: the longest past every declared
    window, convolution and rotary original length (capped), fitted to the row capacity and
    ``pad_full_seq_to``. Example: no window, no cap -> ``[4, 16, 9, 15]``; window 20 -> ``[5, 22, 12, 21]``."""
    reach = 0
    for m in _modules(wrapped.model):
        state = m.__dict__
        sizes = [state.get(k) for k in _WINDOW_KEYS]
        if isinstance(m, nn.Conv1d):
            sizes.append(m.kernel_size[0])
        config = state.get("config")
        if config is not None:
            sizes += [getattr(config, k, None) for k in _WINDOW_KEYS] + _original_lengths(config)
        reach = max([reach] + [s for s in sizes if isinstance(s, int) and not isinstance(s, bool)])
    longest = min(MAX_DOC_TOKENS, max(MIN_DOC_TOKENS * 2, reach + 2))
    limit = getattr(wrapped.model, "longest_sequence", None)  # what the adapter packs at most (longrope)
    longest = longest if limit is None else max(3, min(longest, limit))
    pack = getattr(wrapped, "pack", None)
    multiple, total = getattr(pack, "m", 1), getattr(pack, "pad_full_seq_to", None)
    docs = CHECK_DOCS if wrapped.row_capacity is None else min(CHECK_DOCS, wrapped.row_capacity)
    while True:
        lengths = [max(3, longest // 4), longest, max(3, longest // 2 + 1), max(3, longest - 1)][:docs]
        if total is None or sum(round_up(n, multiple) for n in lengths) <= total:
            return lengths
        if longest > 3:
            longest = max(3, longest * 3 // 4)
        elif docs > 1:
            docs, longest = docs - 1, MAX_DOC_TOKENS
        else:
            return []


def _original_lengths(config) -> list:
    out = [getattr(config, "original_max_position_embeddings", None)]
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    stack = [params]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            out.append(item.get("original_max_position_embeddings"))
            stack += [v for v in item.values() if isinstance(v, dict)]
    return out


def _vocab(model, like: torch.Tensor) -> int:
    for m in _modules(model):
        size = getattr(m.__dict__.get("config"), "vocab_size", None) or m.__dict__.get("vocab_size")
        if isinstance(size, int) and size > 1:
            return size
    for name, m in (model.named_modules() if isinstance(model, nn.Module) else ()):
        if isinstance(m, nn.Embedding) and "pos" not in name.rsplit(".", 1)[-1]:
            return m.num_embeddings
    return int(like.max()) + 1 if like.numel() else 2  # sync: once, for a model whose vocabulary nothing declares


@contextlib.contextmanager
def quiet(model, device: torch.device):
    """Eval mode (each module's mode restored after) and the caller's RNG state kept."""
    modes = [(m, m.training) for m in _modules(model)]
    devices = [device] if device.type == "cuda" else []
    try:
        for m, _ in modes:
            m.training = False
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def compiled(model) -> bool:
    """Whether the model holds a module the caller compiled (``torch.compile(module)`` or ``module.compile()``)."""
    return any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) or
               getattr(m, "_compiled_call_impl", None) is not None for m in _modules(model))


def runner(wrapped, **model_kwargs):
    """``run(input_ids [B, S], seq_lengths [B]) -> [B, S, *]`` (detached): ``wrapped``'s packing and unpacking
    in the caller's grad mode (so that compiled packing reuses its graphs), the model under ``torch.no_grad``
    (in the caller's grad mode for a model the caller compiled, whose graphs guard on it)."""
    def run(input_ids: torch.Tensor, seq_lengths: torch.Tensor) -> torch.Tensor:
        inp = wrapped.prepare(input_ids, seq_lengths)
        grad = contextlib.nullcontext() if compiled(wrapped.model) else torch.no_grad()
        with grad:
            local = wrapped.model(inp.input_ids, inp.position_ids, inp.packed, **model_kwargs)  # [1, T/C, *]
        return wrapped.finish(local, inp).detach()
    return run


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0  # sync: the check


def _elsewhere(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` at another address (one element into a new buffer): the model's run-to-run spread includes
    what its kernels' rounding takes from alignment."""
    buffer = t.new_zeros(t.numel() + 1)
    copy = buffer[1:].view(t.shape)
    copy.copy_(t)
    return copy


class Microbatch(NamedTuple):
    """One of the check's microbatches: ``ids [R, S]``, ``lens [R]``, their ``lengths`` as ints and ``docs``, the
    document each row holds (the base microbatch's number for a kept one, a new number for a piece)."""

    ids: torch.Tensor
    lens: torch.Tensor
    lengths: list
    docs: list


def _regrouped(wrapped, base: Microbatch, other: torch.Tensor, kept: list, changed: list,
               same_shapes: bool) -> Microbatch:
    """The kept documents in reverse order at the start of the row (each at another offset), then the changed
    documents' re-drawn tokens (``other``) cut into up to :data:`PIECES` documents of other lengths: more
    documents in the same padded tokens, so the packed total ``T`` stays (no new shape for a kernel compiled
    per ``T``), as many rows as the row capacity holds. ``same_shapes`` (a model the caller compiled): the
    changed documents as they were, after the kept ones.

    Example: lengths ``[4, 16, 9, 15]``, m 1, kept ``[1, 2]`` -> ``[9, 16, 4, 3, 3, 3, 3, 3]``, docs
    ``[2, 1, 4, ..., 9]``; m 4: the changed documents' 20 padded tokens as 5 blocks of 4 -> ``[9, 16, 4, 3, 2, 1, 4]``.
    """
    multiple = getattr(getattr(wrapped, "pack", None), "m", 1)
    rows, width = wrapped.row_capacity, base.ids.shape[1]
    front = [base.lengths[j] for j in kept[::-1]]
    pieces = [base.lengths[j] for j in changed]
    blocks = sum(round_up(base.lengths[j], multiple) for j in changed) // multiple  # their padded tokens / m
    for count in range(1 if same_shapes else PIECES + len(changed) - 1, len(changed), -1):
        sizes = [(blocks // count + (i < blocks % count)) * multiple for i in range(count)]  # padded, same sum
        cut = [size - i % multiple for i, size in enumerate(sizes)]  # each rounds up to its size again
        if count <= blocks and max(cut) <= width and (rows is None or len(front) + count <= rows):
            pieces = cut
            break
    stream = torch.cat([other[j, : base.lengths[j]] for j in changed])  # [N]: the changed documents' tokens
    stream = stream.repeat(-(-sum(pieces) // max(stream.shape[0], 1)))  # as many as the pieces take
    lengths = front + pieces
    ids = torch.zeros(len(lengths), width, dtype=base.ids.dtype, device=base.ids.device)
    for r, j in enumerate(kept[::-1]):
        ids[r] = base.ids[j]
    start = 0
    for r, n in enumerate(pieces, start=len(front)):
        ids[r, :n] = stream[start:start + n]
        start += n
    lens = torch.tensor(lengths, device=base.lens.device)
    return Microbatch(ids, lens, lengths, kept[::-1] + [len(base.lengths) + i for i in range(len(pieces))])


def check_packing(wrapped, *, device: torch.device, run, row_width: int = 0) -> None:
    """Prove ``wrapped.model`` keeps packed documents apart (module docstring); raises :class:`PackingError` naming
    the model type, the first differing layer, the reason and the fix. ``run(input_ids [k, S], seq_lengths [k])
    -> [k, S, *]`` is the wrapped forward (:func:`runner`); ``row_width`` the caller's row length ``S`` (the same
    shapes for a model the caller compiled).

    Example: ``check_packing(wrapped, device=torch.device("cpu"), run=runner(wrapped))`` -> None, or PackingError."""
    if device.type == "meta":  # no values to compare: nothing is proven, nothing is trained either
        return
    lengths = document_lengths(wrapped)
    same_shapes = bool(row_width) and compiled(wrapped.model)
    if same_shapes:  # the caller's row length: no new graph for the check
        lengths = [min(n, row_width) for n in lengths]
    if len(lengths) < 2:  # a microbatch that holds one document cannot mix
        return
    model = wrapped.model
    gen = torch.Generator().manual_seed(SEED)
    with quiet(model, device):
        vocab = _vocab(model, torch.zeros(0))
        k, width = len(lengths), max(max(lengths), row_width)  # the caller's row length where it is longer
        lens = torch.tensor(lengths)
        valid = torch.arange(width) < lens[:, None]  # [k, S]
        ids = torch.where(valid, torch.randint(0, vocab, (k, width), generator=gen), 0)  # [k, S]
        changed = [0, k - 1] if k > 2 else [0]
        kept = [j for j in range(k) if j not in changed]
        shift = torch.randint(1, max(vocab, 2), (k, width), generator=gen)  # every token of a changed document moves
        other = torch.where(valid, (ids + shift) % max(vocab, 2), 0)
        other[kept] = ids[kept]
        base = Microbatch(ids.to(device), lens.to(device), lengths, list(range(k)))
        other = other.to(device)
        moved = _regrouped(wrapped, base, other, kept, changed, same_shapes)
        out = run(base.ids, base.lens)  # [k, S, *]
        out_moved = run(moved.ids, moved.lens)  # [k', S, *]: other tokens, offsets, lengths and count at once
        moved_diff = max(_max_diff(out_moved[r, :n], out[j, :n]) for r, (j, n) in
                         enumerate(zip(moved.docs, moved.lengths)) if j in kept)
        verdict, detail = 0, ""
        if moved_diff > rounding(out[kept], SAME_ULPS, islands=False):  # which change moved them: the tokens alone?
            verdict, detail, spread = _compare(run, base.ids, other, base.lens, out, kept, model, lengths,
                                               split=getattr(wrapped, "cp_size", 1) > 1)
            allowed = max(tolerance(out), NOISE * spread)
            if verdict == 0 and moved_diff > allowed:
                verdict, detail = 2, f"max |difference| {moved_diff:.3g}, allowed {allowed:.3g}"
        verdict = agree(verdict, wrapped, out.device)  # every rank takes the next step together
        reference = getattr(model, "reference", None)
        if verdict == 0 and callable(reference):
            with torch.no_grad():
                alone = reference(base.ids[1:2, : lengths[1]])  # [1, L, *]: the model's own unpacked path
            mine = out[1:2, : lengths[1]]
            if alone.shape != mine.shape or _max_diff(alone.to(mine.dtype), mine) > tolerance(alone):
                diff = _max_diff(alone.to(mine.dtype), mine) if alone.shape == mine.shape else float("nan")
                verdict, detail = 3, f"max |difference| {diff:.3g}, allowed {tolerance(alone):.3g}"
        verdict = agree(verdict, wrapped, out.device)
        if verdict:
            layer = locate(wrapped, run, verdict, base, other, moved, kept)
            raise refusal(model, layer, verdict, detail)


ROUTED = re.compile(r"Expert|MoE|Moe|SparseMlp|SparseMLP")
"""Layers whose kernels' shapes follow the tokens (a mixture of experts groups the tokens of each expert): changing
other documents' tokens moves the rounding of the kept ones there, without a path between documents."""


def _compare(run, ids, other, lens, out, kept, model=None, lengths=None, split=False) -> tuple:
    """The tokens comparison (the same shapes, other documents' tokens changed): ``(0, "", spread)`` when the kept
    documents' outputs stay within the model's noise (:data:`NOISE` times its run-to-run spread, or
    :data:`SAME_ULPS` epsilons at their scale, the larger), or within the rounding where the first layer whose bits
    move is a routed one (:data:`ROUTED`); else ``(1, detail, spread)``; ``spread`` 0 when nothing moved."""
    out_other = run(other, lens)
    diff = _max_diff(out_other[kept], out[kept])
    if diff == 0:
        return 0, "", 0.0
    spread = _max_diff(run(_elsewhere(ids), _elsewhere(lens)), out)  # the model's own run-to-run spread
    floor = rounding(out[kept], SAME_ULPS, islands=False)
    bound = max(NOISE * spread, floor)
    if diff <= bound:
        return 0, "", spread
    if model is not None and diff <= tolerance(out):
        index, labels = first_difference(model, lambda: run(ids, lens), lambda: run(other, lens), docs=kept,
                                         exact=True, lengths_a=lengths)
        if index is not None and ROUTED.search(labels[index].split("(")[-1]):
            return 0, "", spread
        if index is None and split:  # this rank's tokens did not move: the ranks that hold them judge
            return 0, "", spread
    dtype = str(out.dtype).replace("torch.", "")
    return 1, (f"max |difference| {diff:.3g}, allowed {bound:.3g}: {NOISE} x its own run-to-run spread of "
               f"{spread:.3g}, or {SAME_ULPS} {dtype} epsilons at its scale"), spread


def agree(verdict: int, wrapped, device: torch.device) -> int:
    """The verdict all ranks of the CP group share (the largest): refused everywhere or nowhere."""
    if getattr(wrapped, "cp_size", 1) == 1 or wrapped.cp_group is None:
        return verdict
    import torch.distributed as dist

    flag = torch.tensor([verdict], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=wrapped.cp_group)
    return int(flag)  # sync: the check


REASONS = {
    1: "the outputs of documents it did not change changed when other documents of the same packed row changed "
       "(tokens of one sequence reach another)",
    2: "a document's outputs changed when it moved to another offset of the same packed row, beside documents of "
       "other lengths and count (it takes positions from the row, not from the position ids, or reads the other "
       "documents' lengths or count)",
    3: "a document packed differs from the model's own unpacked run of it (what the adapter computes packed is "
       "not what this model computes: an attention function, window or mask of its own)",
    4: "a sequence packed alone differs from the same sequence packed with the others (tokens of one sequence "
       "reach another)",
}


def refusal(model, layer: str, verdict: int, detail: str) -> PackingError:
    return PackingError(
        f"model_type={model_type(model)!r}: layer {layer}: {REASONS[verdict]} ({detail}); run this model unpacked "
        "(one sequence per row), or make that layer keep packed sequences apart (attention through transformers' "
        "attention interface or nn_data.masks.document_attention, positions from the position ids, no state or "
        "convolution carried across tokens of the row); PackedForward(verify=False) skips this check and leaves "
        "exactness to you")


def locate(wrapped, run, verdict, base: Microbatch, other, moved: Microbatch, kept) -> str:
    """The first module (in call order) whose output differs on the compared tokens, as ``'name' (Class)``;
    agreed over the CP group (the earliest any rank saw)."""
    model, ids, lens, lengths = wrapped.model, base.ids, base.lens, base.lengths
    if verdict == 1:
        found = first_difference(model, lambda: run(ids, lens), lambda: run(other, lens), docs=kept, exact=True,
                                 lengths_a=lengths)
    elif verdict == 2:
        found = first_difference(model, lambda: run(ids, lens), lambda: run(moved.ids, moved.lens), docs=kept,
                                 exact=False, lengths_a=lengths, lengths_b=moved.lengths, second_docs=moved.docs)
    else:
        found = first_difference(model, lambda: run(ids, lens),
                                 lambda: torch.no_grad()(model.reference)(ids[1:2, : lengths[1]]),
                                 docs=[1], exact=False, lengths_a=lengths, second_alone=lengths[1])
    index, names = found
    if getattr(wrapped, "cp_size", 1) > 1 and wrapped.cp_group is not None:
        import torch.distributed as dist

        where = torch.tensor([-(index if index is not None else 1 << 30)], device=ids.device)
        dist.all_reduce(where, op=dist.ReduceOp.MAX, group=wrapped.cp_group)
        index = -int(where)  # sync: the check
        index = None if index >= 1 << 30 else index
    if index is None or index >= len(names):
        return "(not located: only the model's output differs)"
    return names[index]


def verify_microbatch(wrapped, input_ids: torch.Tensor, seq_lengths: torch.Tensor, *, run, turn: int = 0) -> None:
    """The caller's own microbatch checked as :func:`check_packing` checks its own: of its ``n`` non-empty sequences,
    sequence ``turn % n`` gets other tokens (each id one lower, 0 -> 1) and every other row must stay within the
    model's noise, and sequence ``(turn - 1) % n`` packed alone must give its row to the rounding; so a path from
    any sequence into any other shows within ``n`` verified microbatches."""
    lengths = seq_lengths.tolist()  # sync: a verified microbatch reads its lengths once
    docs = [b for b, n in enumerate(lengths) if n > 0]
    if len(docs) < 2:
        return
    changed, single = docs[turn % len(docs)], docs[(turn - 1) % len(docs)]
    kept = [b for b in docs if b != changed]
    with quiet(wrapped.model, input_ids.device):
        out = run(input_ids, seq_lengths)  # [B, S, *]
        other = input_ids.clone()
        head = input_ids[changed, : lengths[changed]]
        other[changed, : lengths[changed]] = torch.where(head > 0, head - 1, 1)  # other ids, inside the vocabulary
        verdict, detail, _ = _compare(run, input_ids, other, seq_lengths, out, kept, wrapped.model, lengths,
                                      split=getattr(wrapped, "cp_size", 1) > 1)
        detail = f"row {changed} changed: {detail}" if verdict else detail
        verdict = agree(verdict, wrapped, out.device)  # every rank takes the next step together
        if verdict == 0:
            alone = run(input_ids[single:single + 1], seq_lengths[single:single + 1])  # [1, S, *]
            if _max_diff(alone, out[single:single + 1]) > tolerance(out):
                verdict = 4
                detail = f"row {single} alone: max |difference| {_max_diff(alone, out[single:single + 1]):.3g}, " \
                         f"allowed {tolerance(out):.3g}"
        verdict = agree(verdict, wrapped, out.device)
        if verdict:
            raise refusal(wrapped.model, "(not located on a verified microbatch)", verdict,
                          f"on the caller's microbatch: {detail}")


VERIFY_MODES = "False/'off', True/'first' (the default) or a positive int N (the first call and every Nth microbatch)"


class ModelGuard:
    """When :class:`~nn_data.packed_forward.PackedForward` proves its model (its ``verify=``).

    Args:
        verify: ``"off"`` (or False): never; ``"first"`` (or True, the default): :func:`check_packing` on the
            first call and whenever the model's :func:`~nn_data.model_identity.fingerprint` changed, after the
            adapter's ``revalidate()``; an int ``N``: that, and :func:`verify_microbatch` every Nth microbatch.
            Nothing runs while compiling or inside the check's own calls.

    Example::

        guard = ModelGuard("first")
        guard.before(wrapped, input_ids)      # first call: the check; later calls: the fingerprint only"""

    def __init__(self, verify=True):
        if verify is True or verify == "first":
            every = 0
        elif verify is False or verify == "off" or verify is None:
            every = None
        elif isinstance(verify, int) and not isinstance(verify, bool) and verify > 0:
            every = verify
        else:
            raise PackingError(f"verify={verify!r} is invalid; expected {VERIFY_MODES}")
        self.every, self.calls, self.turn, self.seen, self.busy = every, 0, 0, None, False

    def before(self, wrapped, input_ids: torch.Tensor) -> bool:
        """Run before a call's packing; returns whether :meth:`after` should verify this microbatch."""
        if self.every is None or self.busy or torch.compiler.is_compiling():
            return False
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            return False  # the packing refuses it by name
        self.calls += 1
        now = fingerprint(wrapped.model)
        if now != self.seen:
            revalidate = getattr(wrapped.model, "revalidate", None)
            if callable(revalidate):  # the adapter's allow-list on the model as it is now (an edit since it was built)
                revalidate()
            with self.running():
                check_packing(wrapped, device=input_ids.device, run=runner(wrapped), row_width=input_ids.shape[1])
            self.seen = fingerprint(wrapped.model)
        return bool(self.every) and self.calls % self.every == 0

    def after(self, wrapped, input_ids: torch.Tensor, seq_lengths: torch.Tensor, **model_kwargs) -> None:
        """Verify this microbatch (:func:`verify_microbatch`), each time with the next sequence changed and the one
        before it alone."""
        with self.running():
            verify_microbatch(wrapped, input_ids, seq_lengths, run=runner(wrapped, **model_kwargs), turn=self.turn)
        self.turn += 1

    @contextlib.contextmanager
    def running(self):
        self.busy = True
        try:
            yield
        finally:
            self.busy = False
