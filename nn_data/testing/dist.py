"""Ranks on one machine for tests, benchmarks and examples: a free TCP port and a gloo group on 127.0.0.1."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it).

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, *, timeout_s: Optional[float] = None) -> None:
    """Join the default process group of ``world_size`` ranks over gloo at ``tcp://127.0.0.1:port``: every rank with
    the same ``port`` (:func:`free_port` in the parent) and its own ``rank``; ``timeout_s`` bounds each collective.
    Undo with ``torch.distributed.destroy_process_group()``. Example (in each spawned rank): ``init_gloo(rank, 2, port)``."""
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world_size,
                            timeout=timeout)


def destroy_model_parallel_groups(parallel_state) -> None:
    """Destroy every process group megatron-core's ``parallel_state`` holds, then forget them
    (``destroy_model_parallel()`` alone leaves them, and their polling threads, alive); no-op when uninitialised."""
    if not parallel_state.model_parallel_is_initialized():
        return
    seen = set()
    for value in list(vars(parallel_state).values()):
        for group in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(group, dist.ProcessGroup) and id(group) not in seen and group is not dist.group.WORLD:
                seen.add(id(group))
                try:
                    dist.destroy_process_group(group)
                except (ValueError, RuntimeError):  # not a group this rank belongs to, or gone already
                    pass
    parallel_state.destroy_model_parallel()
