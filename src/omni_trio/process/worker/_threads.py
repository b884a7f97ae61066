"""Threads, and the one place that refuses them in a simulation.

An engine that calls blocking code (a speech recogniser, a synthesiser) runs it with
:func:`run_in_thread`, which is ``trio.to_thread.run_sync`` -- except inside a
simulated pipeline (:func:`omni_trio.testing.open_simulated_pipeline`), whose workers
run in virtual time: a thread runs in real time, beside the scheduler, and would make
the run neither virtual nor repeatable. There it raises :class:`SimulationError`, and
the request fails saying so. (:mod:`omni_trio.process` exports them with the rest
of the engine API.)
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import TypeVar

import trio

__all__ = ["IN_SIMULATION", "SimulationError", "in_simulation", "run_in_thread"]

T = TypeVar("T")

#: True in the tasks of a simulated pipeline's workers (and the tasks they start).
IN_SIMULATION: ContextVar[bool] = ContextVar("omni_trio_in_simulation", default=False)


class SimulationError(RuntimeError):
    """Something a simulation cannot run: it would leave virtual time."""


def in_simulation() -> bool:
    """Whether this task is a simulated worker's (or was started by one): an
    engine's own blocking calls must not run here."""
    return IN_SIMULATION.get()


async def run_in_thread(
    fn: Callable[[], T], *, limiter: trio.CapacityLimiter | None = None, what: str
) -> T:
    """``await trio.to_thread.run_sync(fn, limiter=limiter)``, outside a simulation.

    Raises:
      SimulationError: in a simulated worker, naming ``what`` (``"eSpeak NG"``).
    """
    if IN_SIMULATION.get():
        raise SimulationError(
            f"simulation cannot run {what}: it runs in a thread, outside the "
            "simulation's virtual time"
        )
    return await trio.to_thread.run_sync(fn, limiter=limiter)
