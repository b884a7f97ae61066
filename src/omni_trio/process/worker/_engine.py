"""The engine API: what a user writes to run a stage in a worker process.

An engine is an async generator function ``engine(request, io)``: it gets the
request's input and a :class:`ChunkIO` handle, and yields the stage's output data
items, which travel to the orchestrator as the stage's outputs (a final stage's reach
the user); an engine that knows which item is its last yields it wrapped in
:class:`Last`, and that item travels as the stage's completion. In async_chunk mode
it also streams to its neighbours through ``io``: it receives its upstream stage's
chunks with ``async for chunk in io`` and sends chunks downstream with ``await
io.send(...)``. The worker runs it under Trio; an ``abort`` cancels it, an exception
fails the request.

A stage is configured with the import path of a *factory*, called once in the worker
with the stage's ``engine_args`` as keyword arguments, which returns the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import attrs

__all__ = [
    "ChunkIO",
    "ChunkLostError",
    "Engine",
    "EngineFactory",
    "EngineRequest",
    "Last",
    "ReaderUnavailableError",
]


@attrs.frozen
class EngineRequest:
    """What an engine is asked to do.

    Attributes:
      request_id: The request's id.
      inputs: Where the request enters (its route's entries; by default the
          first stage): the prompt. Elsewhere: ``prewarm_fn``'s placeholder
          (async_chunk) or ``input_fn``'s (``forward_fn``'s) input (forward mode).
          In async_chunk mode an entry's chunk stream (``async for chunk in io``)
          is empty.
      stage_id: The stage this engine serves.
      priority: The request's priority (lower first, see
          :attr:`omni_trio.StageRequest.priority`): what an engine's own queue --
          its slots, say, with :class:`omni_trio.PrioritySlots` -- orders by.
    """

    request_id: str
    inputs: Any
    stage_id: int
    priority: int = 0


@attrs.frozen
class Last:
    """An engine's last output: ``yield Last(data)``.

    The worker sends ``data`` as the stage's completion (an output with
    ``finished=True``), so it reaches the orchestrator -- and, from a final stage, the
    user's terminal -- with the completion instead of before a bare one. It does so
    after the end of the engine's chunk stream and stops the engine there, as a
    ``break`` out of an ``async for`` would: the generator is closed, so code after the
    ``yield`` does not run (``finally`` blocks and ``async with`` exits do). An engine
    that yields no ``Last`` ends with a bare completion (``data=None``) when it returns.

    Nothing is held back to find the last output: each item is sent as it is yielded.
    Mark the last one where the engine knows it, as an LLM engine does when its
    backend reports a sequence finished.

    ``meta`` says something about the output beside its data, for whoever reads it
    (an LLM engine's token counts and why it stopped: ``Last(text, meta={"usage":
    {...}, "finish_reason": "length"})``). It is plain data, msgpack's as ``data``
    is, and travels with the completion: a final stage's reaches the user as the
    :attr:`~omni_trio.OrchOutput.meta` of the output it comes with.

    Attributes:
      data: The output data item, as for any other yield.
      meta: What the engine says about it; ``None``: nothing.
    """

    data: Any
    meta: dict[str, Any] | None = None


class ChunkLostError(Exception):
    """Raised by ``async for chunk in io`` when chunks of the request were lost: the
    upstream stage's worker died before they were read (its shared memory went with
    it). The request cannot complete; letting the error end the engine fails it."""


class ReaderUnavailableError(Exception):
    """Raised by :meth:`ChunkIO.send` when a stage it streams to has had no worker
    (it died and is restarting) for longer than that stage's ``startup_timeout``:
    ``stage 1 (talker) has no worker: it did not come back within 30 s
    (startup_timeout)``. Letting the error end the engine fails the request."""


class ChunkIO(Protocol):
    """A request's link to the neighbouring stages on its route (async_chunk mode).

    Chunks are bytes; they go straight to the workers of the stages downstream (a
    small one inside its frame, a big one through the sender's shared-memory ring).
    :meth:`send` waits while the reader is behind (each request may have a window of
    chunks unread, and a share of the sender's ring) or has no worker (it is
    restarting: for that stage's ``startup_timeout`` at most, then it raises
    :class:`ReaderUnavailableError`). Chunks arrive whole and in
    order; where some went missing -- their reader's predecessor died with them, or
    their writer died before they could be read -- reading raises
    :class:`ChunkLostError`.

    A stage that reads several stages (a fan-in) reads each one's chunks apart,
    ``async for chunk in io.source(stage_id)`` for each of :attr:`sources`, or all
    of them as they come, ``async for stage_id, chunk in io.chunks()``. Windows,
    order and losses are per source: a source not being read holds back its own
    sender and nobody else. (Read the sources one after the other only where the
    later does not wait for the earlier: in a diamond, where one stage feeds both,
    read them as they come.) A stage that several stages read (a fan-out) sends
    every chunk to each of :attr:`targets`, or to one, ``send(chunk, to=stage_id)``.
    """

    @property
    def sources(self) -> tuple[int, ...]:
        """The stages whose chunks this request reads here, on its route (``()``
        where it enters the pipeline)."""

    @property
    def targets(self) -> tuple[int, ...]:
        """The stages this request's chunks go to from here, on its route."""

    @property
    def priority(self) -> int:
        """The request's priority, from its envelope (lower first; 0 unless set)."""

    @property
    def connected(self) -> bool:
        """Whether this stage streams to and from its neighbours (async_chunk mode
        with a connector). When it does not, :meth:`send` raises ``RuntimeError``."""

    async def send(self, chunk: bytes | bytearray | memoryview, *, to: int | None = None) -> None:
        """Hand ``chunk`` to the downstream stages on the route (``to``: to that one
        alone; each target's stream is its own, in order).

        Raises:
          ReaderUnavailableError: one of them has had no worker for longer than its
              ``startup_timeout``.
          ValueError: ``to`` does not read this stage on the request's route.
        """

    def __aiter__(self) -> AsyncIterator[bytes]:
        """The upstream stage's chunks for this request, until it is done.

        Raises :class:`ChunkLostError` where chunks went missing, and
        ``RuntimeError`` (at once) where the request reads several stages here:
        read each with :meth:`source`."""

    def chunks(self) -> AsyncIterator[tuple[int, bytes]]:
        """Every source's chunks for this request, as they come, each with the stage
        it came from, until every source is done.

        Raises:
          ChunkLostError: (while reading) a source's chunks went missing.
        """

    def source(self, stage_id: int) -> AsyncIterator[bytes]:
        """Stage ``stage_id``'s chunks for this request, until it is done; where
        there is one source, the same as ``async for chunk in io``.

        Raises:
          ValueError: ``stage_id`` is not one of :attr:`sources`.
          ChunkLostError: (while reading) that source's chunks went missing.
        """


Engine = Callable[[EngineRequest, ChunkIO], AsyncIterator[Any]]
"""``engine(request, io)``: an async generator yielding output data items (anything
msgpack can carry: ``str``, ``bytes``, numbers, lists, dicts, ``None``), the last one
optionally wrapped in :class:`Last`.

An engine that keeps its requests waiting for slots of its own says so with a
``slots`` attribute (``engine.slots = slots``, an :class:`omni_trio.PrioritySlots`):
its worker reports how many wait there (the stage's ``slots_waiting``)."""

EngineFactory = Callable[..., Engine]
"""``factory(**engine_args) -> Engine``, named by an import path ``"package.module:name"``."""
