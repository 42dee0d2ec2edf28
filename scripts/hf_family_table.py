"""Write the Hugging Face families table of docs/models.md from the conformance matrix.

    python -m scripts.hf_family_table           # run the matrix (~3 min on 2 cores), rewrite the table
    python -m scripts.hf_family_table --check   # exit 1 if docs/models.md's table is not what the matrix gives

The matrix is tests.support.hf_matrix (every causal-LM family of the installed transformers, built tiny,
packed against each sequence alone); tests/models/test_hf_family_matrix.py makes the same comparison in CI.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import warnings

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "models.md"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers

    from tests.support.hf_matrix import counts, docs_section, run_all, table, with_section

    transformers.logging.set_verbosity_error()
    results = run_all()
    generated, page = table(results), PAGE.read_text()
    print(counts(results))
    if args.check:
        same = docs_section(page) == generated
        print("docs/models.md's table is up to date" if same else "docs/models.md's table differs from the matrix")
        return 0 if same else 1
    PAGE.write_text(with_section(page, generated))
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
