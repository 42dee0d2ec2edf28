"""A pool of spawned ranks (gloo on 127.0.0.1) that runs named test cases, reused across tests.

Spawning ranks and importing torch and megatron-core costs seconds per process on
the 2-core CI machine, so one pool of 4 ranks serves every case of a test module:
the test sends a case name and a parallel layout ``(cp, tp)`` to every rank; each
rank makes megatron-core's ``parallel_state`` match the layout
(``initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)``,
the rest of the world being data parallel), runs ``cp_cases.CASES[name]`` and reports
``(rank, ok, result or traceback)``. With ``cp=2`` on 4 ranks there are two CP groups
side by side, so a case that used the world group instead of its CP group fails.
Spawned ranks start with the parent's ``sys.path`` (multiprocessing hands it over), so they
import ``tests.support`` and ``nn_data`` from the same checkout as the parent pytest process.
"""

from __future__ import annotations

import os
import queue
from typing import Optional
import traceback
import warnings

import torch.multiprocessing as mp

from nn_data.testing.dist import destroy_model_parallel_groups, free_port, init_gloo


class RankPool:
    """``world`` spawned ranks taking cases from per-rank queues.

    ``run(case, *args)`` returns the per-rank results (a list indexed by rank) or
    raises ``AssertionError`` with every failing rank's traceback. A case that times
    out leaves the ranks in an unknown state (a rank may wait in a collective), so the
    pool is then torn down and later cases fail fast.
    """

    def __init__(self, world: int, *, timeout_s: float = 150.0, megatron: bool = True):
        """``megatron=False``: the ranks never import megatron-core (cases that need no
        ``parallel_state``; ``run``'s ``cp``/``tp`` are then ignored): faster start-up for many ranks."""
        ctx = mp.get_context("spawn")
        self.world, self.timeout_s, self.broken = world, timeout_s, None
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_rank_main, args=(rank, world, port, self.commands[rank], self.results, megatron),
                        daemon=True)
            for rank in range(world)
        ]
        for p in self.procs:
            p.start()
        self._collect("startup")

    def run(self, case: str, *args, cp: Optional[int] = 1, tp: int = 1):
        """Run ``case(*args)`` on every rank under parallel_state with CP size ``cp`` and TP size ``tp``;
        ``cp=None``: leave parallel_state as it is (a pool that never initialises it, for cases that
        build their own process groups)."""
        if self.broken:
            raise AssertionError(f"rank pool unusable after an earlier failure: {self.broken}")
        for q in self.commands:
            q.put((case, args, cp, tp))
        return self._collect(f"{case} (cp={cp}, tp={tp})")

    def _collect(self, case: str):
        outcomes = {}
        while len(outcomes) < self.world:
            try:
                rank, ok, payload = self.results.get(timeout=self.timeout_s)
            except queue.Empty:
                self.broken = f"case {case!r} timed out after {self.timeout_s} s (ranks done: {sorted(outcomes)})"
                self.close()
                raise AssertionError(self.broken) from None
            outcomes[rank] = (ok, payload)
        failed = {r: p for r, (ok, p) in outcomes.items() if not ok}
        if failed:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
            raise AssertionError(f"case {case!r} failed on ranks {sorted(failed)}:\n{text}")
        return [outcomes[r][1] for r in range(self.world)]

    def close(self):
        for q in self.commands:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def _rank_main(rank: int, world: int, port: int, commands, results, megatron: bool = True) -> None:
    warnings.filterwarnings("ignore")
    parallel_state = None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        init_gloo(rank, world, port, timeout_s=120)
        if megatron:
            from megatron.core import parallel_state

        from tests.support import cp_cases
    except Exception:  # report start-up failures instead of hanging the parent
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, None))
    while True:
        item = commands.get()
        if item is None:
            break
        case, args, cp, tp = item
        try:
            if cp is not None and parallel_state is not None:
                _set_layout(parallel_state, cp, tp)
            results.put((rank, True, _case_function(cp_cases, case)(*args)))
        except Exception:
            results.put((rank, False, traceback.format_exc()))
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    # Interpreter shutdown with torch and megatron-core loaded took ~9 s per rank here; nothing is
    # left to clean up once the results are flushed, so leave at once.
    results.close()
    results.join_thread()
    os._exit(0)


def _case_function(cp_cases, case: str):
    """``"name"`` is ``cp_cases.CASES[name]``; ``"module:function"`` names a case in another module
    (a dotted name such as ``tests.support.packed_forward_cases``)."""
    if ":" not in case:
        return cp_cases.CASES[case]
    import importlib

    module, name = case.split(":", 1)
    return getattr(importlib.import_module(module), name)


def _set_layout(parallel_state, cp: int, tp: int) -> None:
    """(Re-)initialise megatron-core's parallel_state for CP size ``cp`` and TP size ``tp`` if needed."""
    if parallel_state.model_parallel_is_initialized():
        now = (parallel_state.get_context_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size())
        if now == (cp, tp):
            return
        _destroy_layout(parallel_state)
    # No extra gloo groups: the world backend is gloo already, and each gloo group keeps
    # transport threads alive for as long as the process lives.
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, create_gloo_process_groups=False
    )


def _destroy_layout(parallel_state) -> None:
    destroy_model_parallel_groups(parallel_state)
