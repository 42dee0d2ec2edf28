"""Reuse torch.compile's work across processes, so a new run's first compiled call is fast: inductor's cache
folder (:func:`use_dir`) and torch's portable cache artifacts (:func:`save`, :func:`load`; kernels missing
from the folder are rebuilt from their saved source). The cold and warm figures:
profiling/results/main_job.md.

Example (the profiler's ``--compile-cache DIR`` does exactly this)::

    from nn_data import compile_cache

    compile_cache.use_dir("~/.cache/nn_data")          # before the first compile
    compile_cache.load(compile_cache.artifacts_path("~/.cache/nn_data"))   # no-op if absent
    ...                                                 # compile and run
    compile_cache.save(compile_cache.artifacts_path("~/.cache/nn_data"))"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

ARTIFACTS_FILE = "torch_compile_artifacts.bin"


def announce(what: str) -> None:
    """Say on stderr that ``what`` compiles on its first call, so that a first call of minutes is not taken for a
    hang; every compile nn_data starts itself is announced here. Example: ``announce("PackedForward's packing
    side")`` prints ``nn_data: compiling PackedForward's packing side on its first call ...``."""
    print(f"nn_data: compiling {what} on its first call (seconds to minutes; nn_data.compile_cache keeps the "
          "work for the next process)", file=sys.stderr, flush=True)


def artifacts_path(directory: str) -> str:
    """Where :func:`save` / :func:`load` keep the artifacts file inside ``directory``."""
    return os.path.join(os.path.expanduser(directory), ARTIFACTS_FILE)


def use_dir(directory: str) -> Optional[str]:
    """Make ``directory/inductor`` inductor's cache folder (created if missing); returns the previous
    ``TORCHINDUCTOR_CACHE_DIR`` (None when it was unset). Call it before the first compile; a
    later call also clears inductor's in-memory caches so that they read the new folder."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    folder = os.path.join(os.path.abspath(os.path.expanduser(directory)), "inductor")
    os.makedirs(folder, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    utils = sys.modules.get("torch._inductor.utils")
    if utils is not None:  # inductor already imported: drop what it memoised from the old folder
        utils.clear_caches()
    return previous


def save(path: str) -> Optional[Any]:
    """Write the cache artifacts this process created to ``path``; returns torch's ``CacheInfo``
    (which entries were saved), or None when nothing was compiled (no file is written then)."""
    import torch

    result = torch.compiler.save_cache_artifacts()
    if result is None:
        return None
    data, info = result
    path = os.path.expanduser(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # a reader never sees half a file
    return info


def load(path: str) -> Optional[Any]:
    """Hot-load the artifacts in ``path`` into the current cache folder before compiling; returns
    torch's ``CacheInfo``, or None when ``path`` does not exist."""
    import torch

    path = os.path.expanduser(path)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return torch.compiler.load_cache_artifacts(f.read())
