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

One failure stays one failure: a case that fails, hangs (past its budget) or loses a rank tears the
pool down, and the next ``run`` starts a fresh one (a few seconds), so later tests never inherit a rank
left in a collective. Budgets: every case gets ``timeout_s`` (default :func:`case_budget_s`: 600 s, or
``NN_DATA_RANK_TIMEOUT_S``), start-up :func:`case_budget_s` too, gloo's collectives the case budget;
once one rank has failed the others get ``FAIL_GRACE_S`` more. A hung rank is named with its Python
stack (``faulthandler`` on SIGUSR1, all threads), so the report says which rank waited where.
"""

from __future__ import annotations

import faulthandler
import os
import pathlib
import queue
import shutil
import signal
import tempfile
import time
import traceback
import warnings
from typing import Optional

import torch.multiprocessing as mp

from nn_data.testing.dist import destroy_model_parallel_groups, free_port, init_gloo

TIMEOUT_ENV = "NN_DATA_RANK_TIMEOUT_S"
DEFAULT_BUDGET_S = 600.0  # a case's budget: room for a first compile per rank on a loaded 2-core machine
FAIL_GRACE_S = 30.0  # once a rank failed: how long the others may still take to report
_STARTUP_TRIES = 3  # a free port taken by another process between free_port() and the ranks' bind


def case_budget_s() -> float:
    """The default budget of a case and of a pool's start-up: ``NN_DATA_RANK_TIMEOUT_S`` if set (e.g.
    ``NN_DATA_RANK_TIMEOUT_S=1200`` on a heavily loaded machine), else 600 s."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_BUDGET_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r} is invalid; expected a number of seconds > 0")
    return value


def _port_lost(failure: str) -> bool:
    """Whether a start-up failure is the rendezvous port taken by another process (torch words it
    "Address already in use" or "... EADDRINUSE, message: address already in use")."""
    return "address already in use" in failure.lower() or "EADDRINUSE" in failure


class RankPool:
    """``world`` spawned ranks taking cases from per-rank queues.

    ``run(case, *args)`` returns the per-rank results (a list indexed by rank) or raises
    ``AssertionError`` with every failing rank's traceback (or the stack of every rank that hung).
    After a failure the ranks are in an unknown state (one may wait in a collective), so the pool
    is torn down and the next ``run`` starts a fresh one.
    """

    def __init__(self, world: int, *, timeout_s: Optional[float] = None, megatron: bool = True):
        """``timeout_s``: each case's budget (None: :func:`case_budget_s`). ``megatron=False``: the ranks
        never import megatron-core (cases that need no ``parallel_state``; ``run``'s ``cp``/``tp`` are then
        ignored): faster start-up for many ranks. The ranks are spawned now; the first ``run`` waits for them."""
        self.world, self.megatron = world, megatron
        self.timeout_s = case_budget_s() if timeout_s is None else float(timeout_s)
        self.broken: Optional[str] = None  # the last failure (informational: the next run starts afresh)
        self.procs: list = []
        self._spawn()

    def run(self, case: str, *args, cp: Optional[int] = 1, tp: int = 1):
        """Run ``case(*args)`` on every rank under parallel_state with CP size ``cp`` and TP size ``tp``;
        ``cp=None``: leave parallel_state as it is (a pool that never initialises it, for cases that
        build their own process groups)."""
        if not self.procs:
            self._spawn()
        if self._starting:
            self._start_up()
        for q in self.commands:
            q.put((case, args, cp, tp))
        return self._collect(f"{case} (cp={cp}, tp={tp})", self.timeout_s)

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(self.world)]
        self.stacks = pathlib.Path(tempfile.mkdtemp(prefix="nn_data_ranks_"))
        port = free_port()
        self.procs = [
            ctx.Process(target=_rank_main, daemon=True,
                        args=(rank, self.world, port, self.commands[rank], self.results, self.megatron,
                              max(self.timeout_s, case_budget_s()), str(self.stacks / f"rank{rank}.txt")))
            for rank in range(self.world)
        ]
        for p in self.procs:
            p.start()
        self._starting = True

    def _start_up(self) -> None:
        """Wait for every rank to join; a port lost to another process between free_port() and the
        ranks' bind is retried with a new one."""
        for attempt in range(_STARTUP_TRIES):
            try:
                self._collect("start-up", case_budget_s())
                self._starting = False
                return
            except AssertionError as err:
                if attempt + 1 == _STARTUP_TRIES or not _port_lost(str(err)):
                    raise
                self._spawn()

    def _collect(self, what: str, budget: float):
        """Every rank's ``(ok, payload)`` for ``what`` within ``budget`` seconds, else tear down and raise."""
        outcomes: dict = {}
        deadline = time.monotonic() + budget
        while len(outcomes) < self.world:
            waiting = [r for r in range(self.world) if r not in outcomes]
            left = deadline - time.monotonic()
            if left <= 0:
                failed = any(not ok for ok, _ in outcomes.values())
                why = (f"ranks {waiting} did not report within {FAIL_GRACE_S:.0f} s after the failure below"
                       if failed else f"timed out after {budget:.0f} s: ranks {waiting} still running "
                       f"(ranks done: {sorted(outcomes)}; a slow machine may need {TIMEOUT_ENV}=<seconds>)")
                self._fail(what, why, outcomes, hung=waiting)
            try:
                rank, ok, payload = self.results.get(timeout=min(1.0, left))
            except queue.Empty:
                dead = {r: self.procs[r].exitcode for r in waiting if not self.procs[r].is_alive()}
                if dead:
                    self._fail(what, f"rank(s) exited during the case (rank: exit code) {dead}", outcomes,
                               hung=[r for r in waiting if r not in dead], culprits=sorted(dead))
                continue
            if not ok and all(o for o, _ in outcomes.values()):
                deadline = min(deadline, time.monotonic() + FAIL_GRACE_S)  # the others may wait for this one
            outcomes[rank] = (ok, payload)
        if any(not ok for ok, _ in outcomes.values()):
            self._fail(what, "failed", outcomes, hung=[])
        return [outcomes[r][1] for r in range(self.world)]

    def _fail(self, what: str, why: str, outcomes: dict, *, hung: list, culprits: Optional[list] = None):
        """Tear the pool down (after reading the stacks of the ``hung`` ranks) and raise AssertionError
        naming the ``culprits`` (default: the ranks that reported a failure, else the hung ones)."""
        failed = {r: p for r, (ok, p) in outcomes.items() if not ok}
        text = [f"--- rank {r} (traceback) ---\n{tb}" for r, tb in sorted(failed.items())]
        text += [f"--- rank {r} (still running; its Python stack) ---\n{stack}" for r, stack in self._stacks(hung)]
        culprits = culprits or sorted(failed) or hung
        self.broken = f"case {what!r} on ranks {culprits}: {why}"
        self.close(at_once=True)
        raise AssertionError(self.broken + ("\n" + "\n".join(text) if text else ""))

    def _stacks(self, ranks: list):
        """``(rank, its Python stack)`` for each live rank in ``ranks`` (faulthandler's dump on SIGUSR1)."""
        live = [r for r in ranks if self.procs[r].is_alive() and self.procs[r].pid]
        for r in live:
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(1.0 if live else 0.0)
        for r in live:
            path = self.stacks / f"rank{r}.txt"
            yield r, (path.read_text(errors="replace").strip() if path.exists() else "") or "(no stack written)"

    def close(self, *, at_once: bool = False):
        """Stop the ranks and forget them (a later ``run`` spawns new ones): each is asked to leave, then
        given 20 s (``at_once``, after a failure: 1 s, it may wait in a collective), then signalled."""
        if not self.procs:
            return
        for q in self.commands:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
            if at_once:
                q.cancel_join_thread()  # a rank that never reads it must not hold up this process's exit
        for p in self.procs:
            p.join(timeout=1 if at_once else 20)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []
        shutil.rmtree(self.stacks, ignore_errors=True)


def _rank_main(rank: int, world: int, port: int, commands, results, megatron: bool = True,
               timeout_s: float = DEFAULT_BUDGET_S, stack_file: Optional[str] = None) -> None:
    """One rank: join the gloo group (``timeout_s`` bounds each collective), then run cases until ``None``."""
    warnings.filterwarnings("ignore")
    if stack_file is not None and hasattr(signal, "SIGUSR1"):
        stacks = open(stack_file, "w")  # kept open for the rank's life: faulthandler writes to its descriptor
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    parallel_state = None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        init_gloo(rank, world, port, timeout_s=timeout_s)
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
