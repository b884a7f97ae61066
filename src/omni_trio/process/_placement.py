"""Which replica of each stage runs a request: chosen once, kept for its life.

Sans-IO: a :class:`Placement` is plain bookkeeping, with no event loop. A stage of
more than one replica (a pool) is added with the :class:`Balancer` that chooses among
them. The first time a request is placed -- its first credit or submit at any stage
of the placement -- a replica is chosen at every pooled stage at once, so the stage
upstream of a pool knows, when the request is submitted there, which replica its
chunks go to. The request keeps those replicas until it is released at every stage
it was submitted to, and a later admission of the same id is placed afresh. Until
its submit at a pooled stage, it is counted there as *reserved*; from then on the
replica's worker counts it, until it finishes (see ``Replica.load``).

A pipeline in async_chunk mode shares one placement, its connector's (its stages
stream to each other). Stages without a connector each keep one of their own: they
place a request when it reaches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .._util import final

__all__ = ["Balancer", "Placement", "choose_least_loaded", "choose_round_robin"]


class Balancer(Protocol):
    """A pool, as a placement uses it."""

    def choose(self, priority: int = 0) -> int:
        """Choose a replica for a new request of ``priority``, and reserve it there."""

    def unchoose(self, replica: int) -> None:
        """A request placed on ``replica`` was submitted there (its worker counts it
        from now on), or will never be: its reservation ends."""


def choose_least_loaded(
    live: Sequence[bool], loads: Sequence[int], ahead: Sequence[int] | None = None
) -> int:
    """The replica with the fewest requests among the live ones; on a tie, the one
    with the fewest ``ahead`` of the new request (those of its priority or more
    urgent, which its queues serve first), then the first; among all of them when
    none is live."""
    candidates = [i for i, alive in enumerate(live) if alive] or range(len(live))
    if ahead is None:
        return min(candidates, key=loads.__getitem__)
    return min(candidates, key=lambda i: (loads[i], ahead[i]))


def choose_round_robin(live: Sequence[bool], last: int) -> int:
    """The next live replica after ``last``, in turn; the next one when none is live."""
    count = len(live)
    for step in range(1, count + 1):
        replica = (last + step) % count
        if live[replica]:
            return replica
    return (last + 1) % count


@final
class _Placed:
    __slots__ = ("held", "open", "replicas")

    def __init__(self, replicas: dict[int, int]) -> None:
        self.replicas = replicas  # pooled stage -> its replica
        self.open = set(replicas)  # the pooled stages it is reserved at (not submitted)
        self.held: set[int] = set()  # the stages it was submitted to, not released


@final
class Placement:
    """The replicas of the requests in flight (see the module's docstring)."""

    def __init__(self) -> None:
        self._pools: dict[int, Balancer] = {}
        self._requests: dict[str, _Placed] = {}

    def __len__(self) -> int:
        """Requests placed and not released everywhere yet."""
        return len(self._requests)

    @property
    def pooled(self) -> bool:
        """Whether any of its stages has more than one replica."""
        return bool(self._pools)

    def add_pool(self, stage_id: int, balancer: Balancer) -> None:
        """Stage ``stage_id`` has replicas, chosen by ``balancer``."""
        self._pools[stage_id] = balancer

    def place(self, request_id: str, priority: int = 0) -> dict[int, int]:
        """The request's replica at every pooled stage, chosen now (for its
        ``priority``) if it has none."""
        placed = self._requests.get(request_id)
        if placed is None:
            replicas = {stage_id: pool.choose(priority) for stage_id, pool in self._pools.items()}
            placed = self._requests[request_id] = _Placed(replicas)
        return placed.replicas

    def submitted(self, request_id: str, stage_id: int) -> None:
        """The request is being submitted at ``stage_id``: its reservation there ends
        (the replica's worker counts it now), and it stays placed until its release
        there."""
        placed = self._requests.get(request_id)
        if placed is not None:
            placed.held.add(stage_id)
            self._unreserve(placed, stage_id)

    def release(self, request_id: str, stage_id: int) -> None:
        """The request is over at ``stage_id``; once it is over at every stage it was
        submitted to, it is forgotten, and its reservations at the pools it never
        reached end too."""
        placed = self._requests.get(request_id)
        if placed is None:
            return
        placed.held.discard(stage_id)
        self._unreserve(placed, stage_id)
        if not placed.held:
            del self._requests[request_id]
            for other in list(placed.open):
                self._unreserve(placed, other)

    def _unreserve(self, placed: _Placed, stage_id: int) -> None:
        if stage_id in placed.open:
            placed.open.discard(stage_id)
            self._pools[stage_id].unchoose(placed.replicas[stage_id])
