"""Test tools for the asyncio twin, mirroring :mod:`omni_trio.testing`.

asyncio has no ``wait_all_tasks_blocked`` and no mock clock; this module provides
the two pieces the shared test suite and the comparison scenarios need:
:func:`wait_all_tasks_blocked` (the loop has nothing ready to run but us) and
:class:`VirtualTimeEventLoop` (time jumps to the next timer whenever the loop would
sleep, like ``trio.testing.MockClock(autojump_threshold=0)``).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from .._messages import OrchOutput, StageItem
from .._scripted_base import ScriptedStageBase
from .asyncio_orchestrator import END_OF_OUTPUTS, AsyncioOrchestrator

__all__ = [
    "AsyncioScriptedStage",
    "VirtualTimeEventLoop",
    "collect_outputs",
    "run_with_virtual_time",
    "wait_all_tasks_blocked",
]

T = TypeVar("T")


class AsyncioScriptedStage(ScriptedStageBase):
    """The asyncio twin of :class:`omni_trio.testing.ScriptedStage`: the same calls
    are recorded, and :attr:`outputs` is an ``asyncio.Queue``."""

    def __init__(
        self,
        *,
        on_submit: Callable[[str, Any], Awaitable[None]] | None = None,
        on_abort: Callable[[str], Awaitable[None]] | None = None,
        takes_credit: bool = False,
    ) -> None:
        super().__init__(on_submit=on_submit, on_abort=on_abort, takes_credit=takes_credit)
        self.outputs: asyncio.Queue[Any] = asyncio.Queue()

    def _put(self, item: StageItem) -> None:
        self.outputs.put_nowait(item)

    async def _checkpoint(self) -> None:
        await asyncio.sleep(0)

    def close(self, cause: str | None = None) -> None:
        """End :attr:`outputs`, as a stage whose engine went away would (with
        ``cause`` as its :attr:`death_cause`)."""
        self.death_cause = cause
        self.outputs.put_nowait(END_OF_OUTPUTS)


async def wait_all_tasks_blocked() -> None:
    """Return once every other task is waiting (the loop has nothing else ready).

    asyncio offers no public way to ask; this peeks at the loop's ready queue
    (``loop._ready``), and on loops without one (uvloop) yields a fixed number of
    times, which is enough for the shallow task chains of the orchestrator.
    """
    loop = asyncio.get_running_loop()
    ready = getattr(loop, "_ready", None)
    quiet = 0
    for _ in range(100_000):
        await asyncio.sleep(0)
        if ready is None:
            quiet += 1
        else:
            quiet = quiet + 1 if not ready else 0
        if quiet >= 3:  # nothing became ready across three turns of the loop
            return
    raise RuntimeError("the event loop never went idle")


async def collect_outputs(orchestrator: AsyncioOrchestrator) -> list[OrchOutput]:
    """Let every task run until blocked, then take every output that is ready."""
    await wait_all_tasks_blocked()
    ready = orchestrator.statistics().outputs_ready
    return [await orchestrator.next_output() for _ in range(ready)]  # none waits


class _VirtualClock:
    now = 0.0
    passes = 0  # the loop's passes: it asks its selector once per pass


class _VirtualTimeSelector(selectors.DefaultSelector):
    """Never sleeps: when the loop would wait ``timeout`` s for I/O, time jumps instead."""

    def __init__(self, clock: _VirtualClock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        self._clock.passes += 1
        events: list[tuple[Any, int]] = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # no timer at all: only real I/O can wake us
            result: list[tuple[Any, int]] = super().select(None)
            return result
        self._clock.now += timeout
        return []


class VirtualTimeEventLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` only moves when everything waits for a timer."""

    def __init__(self) -> None:
        self._virtual_clock = _VirtualClock()
        super().__init__(_VirtualTimeSelector(self._virtual_clock))

    def time(self) -> float:
        return self._virtual_clock.now

    @property
    def passes(self) -> int:
        """The loop's passes so far (each asks the selector once)."""
        return self._virtual_clock.passes

    def block(self, seconds: float) -> None:
        """Pretend the running callback blocked the loop for ``seconds`` (a slow step)."""
        self._virtual_clock.now += seconds


def run_with_virtual_time(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``asyncio.run(main())`` on a :class:`VirtualTimeEventLoop` (any Python >= 3.10)."""
    loop = VirtualTimeEventLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main())
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
