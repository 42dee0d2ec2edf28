"""Tier: pure CPU, single process (every causal-LM family of the pinned transformers built tiny from its config
class, nothing downloaded; the whole matrix runs once per module, a few minutes on 2 cores). CP = 2 of the
representative set: tests/multiprocess/test_adapters_multiprocess.py.

The conformance matrix (tests.support.hf_matrix): each family, packed through HFCausalLMAdapter against
each sequence run alone (float32 logits and every parameter's gradient), is exact within the matrix's stated
tolerance or refused by name when the adapter is built or on the first call; never ran-and-differed, never
another error. Families that cannot be built tiny are listed with the reason. docs/models.md's table is what
the matrix gives (regenerate it with ``python -m scripts.hf_family_table``).
"""

from __future__ import annotations

import contextlib
import pathlib
import warnings

import pytest
import torch

from tests.support.hf_families import families, find
from tests.support.hf_matrix import BF16_FAMILIES, docs_section, run_all, run_family, table

FAMILIES = [f.name for f in families()]
PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"


@contextlib.contextmanager
def _quiet():
    """transformers' advice on the tiny configs (rope factors, padding) is not the test's output."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def results():
    with _quiet():
        return run_all()


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_is_exact_or_refused(results, name):
    result = next(r for r in results if r.name == name)
    assert result.status in ("exact", "refused", "not built"), result


def test_the_matrix_covers_the_families_and_proves_something(results):
    """Every family of the mapping has a row, and the matrix is not vacuous: most decoders build and run exact."""
    assert [r.name for r in results] == FAMILIES
    exact = [r for r in results if r.status == "exact"]
    assert len(exact) >= 50 and all(r.grad is not None for r in exact)
    assert {"llama", "mistral", "qwen2_moe:sliding", "phimoe:sliding", "qwen3_next"} <= {r.name for r in exact}


def _rows(section: str) -> dict:
    """``{family: its table row}`` of a generated section."""
    return {line.split(" | ")[0][2:]: line for line in section.splitlines() if line.startswith("| ")}


def test_docs_table_is_what_the_matrix_gives(results):
    """docs/models.md's families table is generated from these results on the main CI job's transformers
    (constraints.txt): a family whose outcome changes fails here until the page is regenerated (python -m
    scripts.hf_family_table). On another release (the NeMo-RL and newest jobs), which has other families, every
    family both releases have has the page's row, or is refused by name there (transformers 5.6's GPT-J, CodeGen,
    CTRL and DiffLlama attention bypasses the attention interface that 5.24's calls); a family neither release
    builds tiny may give another reason on each."""
    import transformers

    page = docs_section(PAGE.read_text())
    pins = (PAGE.parents[1] / "constraints.txt").read_text().splitlines()
    if f"transformers=={transformers.__version__}" in pins:
        assert page == table(results)
        return
    ours, docs = _rows(table(results)), _rows(page)
    both = ours.keys() & docs.keys()
    assert len(both) >= 50, sorted(both)
    # not built on both releases: the reason is that release's own error text
    same = {n for n in both if " | not built | " in ours[n] and " | not built | " in docs[n]}
    differ = {n: (docs[n], ours[n]) for n in both - same if ours[n] != docs[n] and " | refused | " not in ours[n]}
    assert differ == {}


@pytest.mark.parametrize("name", BF16_FAMILIES)
def test_bfloat16_on_the_representative_set(name):
    """bfloat16 logits (gradients in bfloat16 are bfloat16 noise): exact within one bf16 rounding of a logit."""
    with _quiet():
        result = run_family(find(name), dtype=torch.bfloat16)
    assert result.status == "exact", result


def test_the_matrix_would_see_a_silent_mix(monkeypatch):
    """The matrix can fail: with the layer's own window ignored (the call's only) and the
    packing check off, Qwen2-MoE with a window known only from its config ends MIXED, not exact; with the check
    on (the default) the same adapter is refused by its comparison with the model's own unpacked path."""
    from nn_data.adapters import hf_support

    monkeypatch.setattr(hf_support, "call_window", lambda module, kwargs: kwargs.get("sliding_window"))
    with _quiet():
        result = run_family(find("qwen2_moe:sliding"), verify=False)
        checked = run_family(find("qwen2_moe:sliding"))
    assert result.status == "MIXED" and result.out > 1e-3, result
    assert checked.status == "refused" and checked.detail == "the packing check: not the model's own path", checked
