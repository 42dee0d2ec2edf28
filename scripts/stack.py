"""Print the stack a venv runs, one line: ``Python 3.13.0, torch 2.11.0+cu130, transformers 5.6.0, megatron-core
0.19.2`` (``python -m scripts.stack``; the CI jobs print it first). Reads the installed metadata, imports nothing."""

import sys
from importlib import metadata


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    print(f"Python {sys.version.split()[0]}, " + ", ".join(f"{n} {_version(n)}" for n in ("torch", "transformers",
                                                                                         "megatron-core")))
