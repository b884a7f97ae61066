"""Faults as data: a :class:`FaultPlan` is a list of :class:`Fault`\\ s, each at a
virtual time, built from a seed (:meth:`FaultPlan.random`) or written by hand.

A plan is plain data -- it prints as the Python that builds it, so a failing seed's
plan (or a shrunk one) can be pasted into a test -- and a simulation applies it
through public handles only: ``ProcessStage.kill``, the simulated network's wires,
and the simulated pipeline's own request streams.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Literal, get_args

import attrs

from .._util import final

__all__ = ["FAULT_KINDS", "Fault", "FaultKind", "FaultPlan"]

FaultKind = Literal["kill", "stall", "break_link", "delay_link", "stop_reading", "abort", "cancel"]
#: Every kind of fault, in the order :meth:`FaultPlan.random` draws from.
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)

_WORKER_FAULTS = frozenset({"kill", "stall", "break_link", "delay_link"})
_TIMED_FAULTS = frozenset({"stall", "delay_link", "stop_reading"})


def _check_kind(_: object, __: attrs.Attribute[str], kind: str) -> None:
    if kind not in FAULT_KINDS:
        raise ValueError(f"a fault's kind must be one of {', '.join(FAULT_KINDS)}; got {kind!r}")


def _non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:
        raise ValueError(f"a fault's {attribute.name} must be >= 0, got {value!r}")


@final
@attrs.frozen
class Fault:
    """One fault, at virtual time ``at`` (seconds after the simulation started).

    ``kind`` says what it does, and to what:

    * ``"kill"``: kill replica ``replica`` of stage ``stage``'s worker (as SIGKILL would);
    * ``"stall"``: freeze that worker for ``duration`` seconds -- nothing in or out,
      as a stopped process (past its ``heartbeat_timeout``, it is killed for it);
    * ``"break_link"``: break every chunk link that worker sends on;
    * ``"delay_link"``: delay what it sends on its links by ``delay`` seconds, for
      ``duration`` seconds;
    * ``"stop_reading"``: the consumer of request ``request`` (the index of the
      simulated pipeline's ``open_request`` calls, from 0) stops reading for
      ``duration`` seconds;
    * ``"abort"``: ``orchestrator.abort`` that request;
    * ``"cancel"``: cancel its consumer (its ``open_request`` block is left).

    A fault whose target does not exist at its time (a request not open, a worker
    restarting) does nothing, and the trace says so.
    """

    at: float = attrs.field(validator=_non_negative)
    kind: FaultKind = attrs.field(validator=_check_kind)
    stage: int = 0
    replica: int = 0
    request: int = 0
    duration: float = attrs.field(default=0.0, validator=_non_negative)
    delay: float = attrs.field(default=0.0, validator=_non_negative)

    @property
    def on_worker(self) -> bool:
        """Whether it acts on a worker (else on a request)."""
        return self.kind in _WORKER_FAULTS

    def __str__(self) -> str:
        fields = [f"at={self.at!r}", f"kind={self.kind!r}"]
        if self.on_worker:
            fields += [f"stage={self.stage}", f"replica={self.replica}"]
        else:
            fields.append(f"request={self.request}")
        if self.kind in _TIMED_FAULTS:
            fields.append(f"duration={self.duration!r}")
        if self.kind == "delay_link":
            fields.append(f"delay={self.delay!r}")
        return f"Fault({', '.join(fields)})"


def _in_time_order(faults: Iterable[Fault]) -> tuple[Fault, ...]:
    return tuple(sorted(faults, key=lambda fault: fault.at))


@final
@attrs.frozen
class FaultPlan:
    """Faults to apply, in time order (the constructor sorts them, stably)."""

    faults: tuple[Fault, ...] = attrs.field(default=(), converter=_in_time_order)

    @classmethod
    def random(
        cls,
        seed: int,
        *,
        stages: int,
        replicas: int = 1,
        requests: int = 0,
        count: int = 3,
        horizon: float = 2.0,
        kinds: Iterable[FaultKind] = FAULT_KINDS,
    ) -> FaultPlan:
        """``count`` faults drawn from ``seed``, at times up to ``horizon`` seconds,
        on ``stages`` stages of ``replicas`` replicas and ``requests`` requests (no
        request faults if 0)."""
        rng = random.Random(seed)
        kinds = [kind for kind in kinds if requests or kind in _WORKER_FAULTS]
        if not kinds:
            raise ValueError("no kind of fault to draw from")
        faults = []
        for _ in range(count):
            kind = rng.choice(kinds)
            at = round(rng.uniform(0, horizon), 3)
            stage, replica = rng.randrange(stages), rng.randrange(replicas)
            request = rng.randrange(requests) if requests else 0
            duration = round(rng.uniform(0.05, 1.0), 3)
            delay = round(rng.uniform(0.001, 0.2), 3)
            # only what the kind uses: a plan prints as the Python that builds it
            if kind in _WORKER_FAULTS:
                request = 0
            else:
                stage = replica = 0
            if kind not in _TIMED_FAULTS:
                duration = 0.0
            if kind != "delay_link":
                delay = 0.0
            faults.append(Fault(at, kind, stage, replica, request, duration, delay))
        return cls(faults)

    def without(self, index: int) -> FaultPlan:
        """The plan less its ``index``-th fault: a step of shrinking."""
        return FaultPlan(self.faults[:index] + self.faults[index + 1 :])

    def __iter__(self) -> Iterator[Fault]:
        return iter(self.faults)

    def __len__(self) -> int:
        return len(self.faults)

    def __str__(self) -> str:
        if not self.faults:
            return "FaultPlan([])"
        inner = "".join(f"    {fault},\n" for fault in self.faults)
        return f"FaultPlan([\n{inner}])"
