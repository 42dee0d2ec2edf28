"""Tier: pure CPU, single process (inductor compiles a tiny graph twice, in two fresh cache folders).

nn_data.compile_cache: artifacts saved by one compile are loaded into an empty cache folder and
served from the cache by the next compile (no code generation).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.utils import counters

from nn_data import PackSequences, compile_cache


pytestmark = pytest.mark.compile

def _compile_and_run():
    torch._dynamo.reset()
    pack = torch.compile(PackSequences(4, pad_full_seq_to=16, validate=False), fullgraph=True, dynamic=False)
    return pack(torch.arange(1, 13).view(2, 6), torch.tensor([3, 6])).packed


def test_saved_artifacts_serve_the_next_compile_from_an_empty_cache_folder(tmp_path):
    path = compile_cache.artifacts_path(str(tmp_path / "shared"))
    assert compile_cache.load(path) is None  # nothing saved yet: a no-op
    previous = compile_cache.use_dir(str(tmp_path / "first"))
    try:
        first = _compile_and_run()
        info = compile_cache.save(path)
        assert info is not None and info.inductor_artifacts and os.path.getsize(path) > 0

        compile_cache.use_dir(str(tmp_path / "second"))  # an empty folder: only the artifacts can help
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "second" / "inductor")
        loaded = compile_cache.load(path)
        assert loaded is not None and loaded.inductor_artifacts == info.inductor_artifacts
        counters.clear()
        again = _compile_and_run()
        hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
        assert hits >= 1, dict(counters["inductor"]) | dict(counters["aot_autograd"])
        assert counters["inductor"]["fxgraph_cache_miss"] == 0
        assert torch.equal(again, first)
        assert first.tolist() == [[1, 2, 3, 0, 7, 8, 9, 10, 11, 12, 0, 0, 0, 0, 0, 0]]
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
        from torch._inductor.utils import clear_caches

        clear_caches()
        torch._dynamo.reset()
