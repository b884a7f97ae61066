"""Threads, and the one place that refuses them in a simulation.

An engine that calls blocking code (a speech recogniser, a synthesiser) runs it with
:func:`run_in_thread`, which is ``trio.to_thread.run_sync``; one that calls blocking
code that *streams* (a model that calls back with each token) runs it with
:func:`stream_in_thread`, and gets what it emits as it comes. Neither runs inside a
simulated pipeline (:func:`omni_trio.testing.open_simulated_pipeline`), whose workers
run in virtual time: a thread runs in real time, beside the scheduler, and would make
the run neither virtual nor repeatable. There they raise :class:`SimulationError`,
and the request fails saying so. (:mod:`omni_trio.process` exports them with the
rest of the engine API.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncGenerator, Callable
from contextvars import ContextVar
from functools import partial
from typing import TYPE_CHECKING, Generic, TypeVar

import trio

if TYPE_CHECKING:
    import outcome

__all__ = [
    "IN_SIMULATION",
    "STOP_BOUND",
    "Emit",
    "SimulationError",
    "in_simulation",
    "run_in_thread",
    "stream_in_thread",
]

T = TypeVar("T")
Item = TypeVar("Item")

Emit = Callable[[Item], bool]
"""``emit(item) -> stop``: what :func:`stream_in_thread`'s producer calls, in its
thread, with each item; ``True`` once no one is listening (stop then)."""

#: Seconds a stream's consumer that stopped listening waits for its producer to see
#: it (at the producer's next ``emit``) and return, before it lets the thread run on
#: unwatched.
STOP_BOUND = 10.0

#: True in the tasks of a simulated pipeline's workers (and the tasks they start).
IN_SIMULATION: ContextVar[bool] = ContextVar("omni_trio_in_simulation", default=False)


class SimulationError(RuntimeError):
    """Something a simulation cannot run: it would leave virtual time."""


def _refuse_in_simulation(what: str) -> None:
    if IN_SIMULATION.get():
        raise SimulationError(
            f"simulation cannot run {what}: it runs in a thread, outside the "
            "simulation's virtual time"
        )


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
    _refuse_in_simulation(what)
    return await trio.to_thread.run_sync(fn, limiter=limiter)


async def stream_in_thread(
    produce: Callable[[Emit[Item]], object], *, what: str
) -> AsyncGenerator[list[Item], None]:
    """Run ``produce(emit)`` in a thread, and yield what it emits, as it comes.

    ``produce`` is blocking code that streams: a model's call that hands each token
    to a callback, say. It calls ``emit(item)`` with each item, in its thread;
    ``emit`` never blocks, and returns ``True`` once no one listens any more -- this
    generator was closed, or its task cancelled (an abort) -- and ``produce`` should
    then stop at once (a model's callback returns it, and the model stops
    generating)::

        def generate(emit):                    # in a thread
            for token in model.tokens(prompt):
                if emit(token):                # True: the request was cancelled
                    return

        async with aclosing(stream_in_thread(generate, what="the model")) as batches:
            async for batch in batches:        # each: the tokens since the last one
                yield "".join(batch)

    The thread starts when the first batch is asked for. Each batch is every item
    emitted since the last, in order, so a consumer that
    fell behind takes the backlog at once (and checkpoints once for it).
    ``produce``'s return value is dropped; what it raises is raised here, after the
    items it emitted before it.

    The thread is not left behind: a consumer that stops early waits -- shielded,
    at most :data:`STOP_BOUND` seconds -- for ``produce`` to see it and return, so
    whatever ``produce`` holds (a model's slot) is free when this generator ends.

    Raises:
      SimulationError: in a simulated worker, naming ``what`` (``"llama.cpp"``).
    """
    _refuse_in_simulation(what)
    feed: _Feed[Item] = _Feed(trio.lowlevel.current_trio_token())
    trio.lowlevel.start_thread_soon(
        partial(produce, feed.emit), feed.end, name=f"omni_trio: {what}"
    )
    try:
        while True:
            batch, ended = await feed.take()
            if batch:
                yield batch
            if ended is not None:
                ended.unwrap()
                return
    finally:
        feed.stopped = True
        if feed.ended is None:
            with trio.move_on_after(STOP_BOUND, shield=True):
                while (await feed.take())[1] is None:
                    pass


class _Feed(Generic[Item]):
    """Items from a thread to a Trio task: the thread appends (never waiting), and
    wakes the task only when it waits for them -- one wake-up per batch."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self._lock = threading.Lock()
        self._items: list[Item] = []
        self._wakeup: trio.Event | None = None  # set while the task waits
        self.ended: outcome.Outcome[object] | None = None
        #: Read by the thread at each emit: no one listens any more.
        self.stopped = False

    # -- in the thread

    def emit(self, item: Item) -> bool:
        with self._lock:
            self._items.append(item)
            wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            self._wake(wakeup)
        return self.stopped

    def end(self, result: outcome.Outcome[object]) -> None:
        with self._lock:
            self.ended = result
            wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            self._wake(wakeup)

    def _wake(self, wakeup: trio.Event) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # the run is over: no one to wake
            self._token.run_sync_soon(wakeup.set)

    # -- in the Trio task

    async def take(self) -> tuple[list[Item], outcome.Outcome[object] | None]:
        """What was emitted since the last take, and the producer's outcome once it
        has returned; waits while there is neither."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            with self._lock:
                items, self._items = self._items, []
                ended = self.ended
                if not items and ended is None:
                    wakeup = self._wakeup = trio.Event()
            if items or ended is not None:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return items, ended
            await wakeup.wait()
