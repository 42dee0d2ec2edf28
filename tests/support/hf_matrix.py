"""Tier: helper (no tests). The Hugging Face conformance matrix: every causal-LM family packed against each sequence alone.

For each family of :func:`tests.support.hf_families.families`: :class:`~nn_data.adapters.HFCausalLMAdapter`
inside :class:`~nn_data.packed_forward.PackedForward` on :data:`LENGTHS`, against the model run on each
sequence alone (logits and every parameter's gradient). Each family ends as one of :data:`STATUSES`:
``exact`` (within :data:`TOLERANCE`), ``refused`` (:func:`reason`), ``not built``, or ``MIXED`` / ``ERROR``
(never acceptable). :func:`table` renders docs/models.md's "Every family" table (``python -m
scripts.hf_family_table``; tests/models/test_hf_family_matrix.py holds the page to it)."""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

import torch

from nn_data.errors import PackingError

#: The representative set run in bfloat16 too (logits; tests/models/test_hf_family_matrix.py) and under
#: CP = 2 over gloo (float32, logits and gradients; tests/multiprocess/test_adapters_multiprocess.py).
BF16_FAMILIES = ("llama", "mistral", "mixtral", "gemma3_text", "gpt2", "deepseek_v3", "qwen2_moe:sliding",
                 "phimoe:sliding", "qwen3_next", "mamba2", "bamba", "lfm2")
CP_FAMILIES = ("gpt2", "gemma3_text", "deepseek_v3", "qwen2_moe:sliding", "phimoe:sliding")
#: One row per sequence: a zero-length one and one of the full row length (9).
LENGTHS = (5, 0, 9, 3)
STATUSES = ("exact", "refused", "not built", "MIXED", "ERROR")
#: Largest |packed - alone| accepted, relative to max(1, the largest |alone| value), per dtype:
#: (logits, gradients). float32: a reordered sum of ~100 products rounds ~1e-6 relative; bfloat16:
#: one bf16 rounding of a logit is 4e-3 relative (a mixed sequence differs by 1e-4 to 1 in float32).
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, None)}

#: What a refusal's message says (a phrase each of the adapter's refusals contains) -> the reason shown.
REASONS = (
    ("not causal", "non-causal attention"),
    ("ALiBi", "position bias (ALiBi)"),
    ("rotary type", "batch-dependent rotary scaling"),
    ("its own attention mask", "model-made attention mask"),
    ("learned positions with padding_idx", "positions counted from a padding index"),
    ("soft-capped", "soft-capped attention"),
    ("attention sinks", "attention sinks"),
    ("a position bias added", "position bias (relative)"),
    ("attends with keyword", "attention keyword outside the list"),
    ("differ between layers", "several sliding windows"),
    ("does not call transformers' attention interface", "attention bypasses the interface"),
    ("called transformers' attention interface", "attention bypasses the interface"),
    ("did not call transformers' attention interface", "attention bypasses the interface"),
    ("is not one nn_data routes through", "attention function of its own"),
    ("is not transformers' own", "attention function of its own"),
    ("switches every position", "longrope past its original length"),
    ("tokens of one sequence reach another", "the packing check: tokens reach another sequence"),
    ("takes positions from the row", "the packing check: positions from the row"),
    ("the model's own unpacked run", "the packing check: not the model's own path"),
    ("has layer type", "layer type outside the list"),
    ("mixes tokens", "token mixer nn_data does not know"),
)


class Result(NamedTuple):
    """One family's outcome: ``status`` (one of :data:`STATUSES`), ``detail`` (the reason, or the
    largest differences), and the largest differences ``out`` / ``grad`` (None where not run)."""

    name: str
    status: str
    detail: str
    out: Optional[float] = None
    grad: Optional[float] = None


def reason(error: PackingError) -> str:
    """The short reason of one of the adapter's refusals (:data:`REASONS`), or its first clause."""
    message = str(error)
    for phrase, label in REASONS:
        if phrase in message:
            return label
    return message.split(";")[0][:80]


def _coded_ids(lengths, vocab: int, width: int) -> torch.Tensor:
    """A distinct token per (row, position) inside the vocabulary, 0 past each length: ``[B, width]``."""
    b = torch.arange(len(lengths))[:, None]
    s = torch.arange(width)[None]
    ids = 1 + (b * 37 + s * 11 + b * s * 5) % (vocab - 1)
    return torch.where(s < torch.tensor(lengths)[:, None], ids, 0)


def _loss(logits: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over every valid pair of ``logits [B, S, V]``."""
    valid = (torch.arange(ids.shape[1] - 1) < (lengths[:, None] - 1)).float()  # [B, S-1]
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    return (ce * valid).sum()


def compare(model, wrapped, lengths=LENGTHS, grads: bool = True) -> tuple:
    """``(out, grad)``: the largest |packed - alone| over the logits and (``grads``) the parameter
    gradients of :func:`_loss`, each relative to max(1, the largest |alone| value)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    ids, lens = _coded_ids(lengths, vocab, max(lengths)), torch.tensor(lengths)
    model.zero_grad(set_to_none=True)
    out = wrapped(ids, lens)  # [B, S, V]
    if grads:
        _loss(out, ids, lens).backward()
        packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    worst = scale = 0.0
    total = 0.0
    for b, n in enumerate(lengths):
        if n:
            alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits  # [1, n, V]
            worst = max(worst, float((out[b, :n].float() - alone[0].float()).detach().abs().max()))
            scale = max(scale, float(alone.detach().float().abs().max()))
            total = total + _loss(alone, ids[b : b + 1, :n], lens[b : b + 1])
        if out[b, n:].any():
            raise AssertionError(f"row {b}: output past its length {n} is not 0")
    if not grads:
        return worst / max(1.0, scale), None
    total.backward()
    alone_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if packed.keys() != alone_grads.keys():
        raise AssertionError(f"parameters with a gradient differ: {sorted(packed.keys() ^ alone_grads.keys())}")
    grad = max((float((packed[n] - alone_grads[n]).abs().max()) for n in packed), default=0.0)
    grad_scale = max((float(g.abs().max()) for g in alone_grads.values()), default=0.0)
    return worst / max(1.0, scale), grad / max(1.0, grad_scale)


def run_family(family, *, dtype: torch.dtype = torch.float32, model=None, verify=True) -> Result:
    """One family through the adapter (``model``: one already built, else :func:`~tests.support.hf_families.build`);
    ``verify``: ``PackedForward``'s (the packing check, on by default)."""
    from nn_data.adapters import HFCausalLMAdapter
    from tests.support.hf_families import Unbuilt, build
    from nn_data.packed_forward import PackedForward

    try:
        model = build(family, dtype=dtype) if model is None else model
    except Unbuilt as e:
        return Result(family.name, "not built", _stable(str(e)))
    try:
        wrapped = PackedForward(HFCausalLMAdapter(model), pad_individual_seqs_to_multiple_of=4, verify=verify)
        out, grad = compare(model, wrapped, grads=TOLERANCE[dtype][1] is not None)
    except PackingError as e:
        return Result(family.name, "refused", reason(e))
    except Exception as e:  # noqa: BLE001 - any other failure is a finding, reported as ERROR
        return Result(family.name, "ERROR", _stable(f"{type(e).__name__}: {e}")[:160])
    tol_out, tol_grad = TOLERANCE[dtype]
    exact = out <= tol_out and (grad is None or grad <= tol_grad)
    detail = f"logits {out:.1e}" + ("" if grad is None else f", gradients {grad:.1e}")
    return Result(family.name, "exact" if exact else "MIXED", detail, out, grad)


def _stable(text: str) -> str:
    """``text`` without what changes from run to run (object addresses) or breaks a table (pipes, newlines)."""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x...", text)
    return " ".join(text.replace("|", "/").split())


HEADER = ("| family | float32 | why |", "| --- | --- | --- |")


def table(results) -> str:
    """The Markdown of ``results`` for docs/models.md: a row per family with the reason of each refusal or
    unbuilt family (an exact family's figures are left out: they are the machine's, not the family's),
    then the counts and the bfloat16 / CP sets."""
    rows = list(HEADER)
    for r in results:
        why = "" if r.status == "exact" else r.detail
        rows.append(f"| {r.name} | {r.status} | {why} |")
    n = counts(results)
    rows += ["", f"{n['exact']} exact, {n['refused']} refused, {n['not built']} not built, {n['MIXED']} mixed, "
             f"{n['ERROR']} failing otherwise ({len(results)} entries: the families of "
             "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` and the variants of `tests.support.hf_families.VARIANTS`). "
             f"Also exact in bfloat16 (logits): {', '.join(BF16_FAMILIES)}; under CP = 2 over gloo (float32, "
             f"logits and gradients): {', '.join(CP_FAMILIES)}."]
    return "\n".join(rows)


def run_all(dtype: torch.dtype = torch.float32, names=None) -> list:
    """:func:`run_family` on every family (or those of ``names``), in the order of
    :func:`~tests.support.hf_families.families`."""
    import gc

    from tests.support.hf_families import families

    results = []
    for family in families():
        if names is None or family.name in names:
            results.append(run_family(family, dtype=dtype))
            gc.collect()  # the family's model and graph go before the next is built
    return results


def counts(results) -> dict:
    """How many families ended in each status."""
    return {s: sum(1 for r in results if r.status == s) for s in STATUSES}


#: The generated part of docs/models.md lies between these two lines.
BEGIN, END = "<!-- hf-families: generated by python -m scripts.hf_family_table -->", "<!-- hf-families: end -->"


def docs_section(page: str) -> str:
    """The generated part of ``page`` (docs/models.md's text); raises ValueError without the markers."""
    start, stop = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[start:stop].strip()


def with_section(page: str, generated: str) -> str:
    """``page`` with its generated part replaced by ``generated``."""
    start, stop = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[:start] + "\n" + generated + "\n" + page[stop:]
