"""What one compiled pack graph is built for, and how the compiled cache tells graphs apart."""

from __future__ import annotations

from typing import NamedTuple, Optional


class GraphKey(NamedTuple):
    """One pack graph: the multiples, the packed length ``T`` (from the plan) and the CP split."""

    m: int
    p: int
    total: int
    cp_size: int
    cp_rank: int


class CompiledKey(NamedTuple):
    """The compiled cache's key: the graph, and how it was compiled."""

    graph: GraphKey
    backend_id: int  # id() of the backend object: a compile counter and "inductor" compile apart
    mode: Optional[str]
