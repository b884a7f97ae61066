"""One ``/v1/realtime`` session's Trio driver: its nursery, its tasks, its responses'
cancel scopes (the design is in ``_realtime``'s docstring and ``docs/voice.md``).

:class:`Session` carries out what :class:`~._realtime_state.SessionState` decides,
with no I/O: the reader task hands it the client's events, each response runs as a
task in a cancel scope of its own, and :class:`_Outbox`'s task writes the events in
order, dropping those of a cancelled response.
"""

from __future__ import annotations

import collections
import secrets
import weakref
from typing import TYPE_CHECKING, Any

import trio

from ._protocol import OpenAIError
from ._realtime_protocol import RealtimeError, decode_client_event, event_id_of
from ._realtime_state import Cancel, Response, SendEvent, SessionState, Start, failed, status_of

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ._chat import Receive, Send
    from ._realtime_conversation import Out, Status
    from ._realtime_options import RealtimeOptions
    from ._realtime_protocol import ClientEvent
    from ._state import ServerState

__all__ = ["Session"]


#: How long a session may spend telling its client why it ends.
_LAST_WORDS = 1.0


class _Outbox:
    """The session's events on their way out, written by one task, in order. A
    cancelled response's events still here are dropped (all but its
    ``response.done``, queued without a response).

    ``first_audio(seconds)`` is told, for each response, how long after its first
    event was queued (its ``response.created``: the turn is over, or the client
    asked) its first audio was written.
    """

    def __init__(self, limit: int, first_audio: Callable[[float], None]) -> None:
        self._queue: collections.deque[tuple[Out, Response | None]] = collections.deque()
        self._bytes = 0
        self._limit = limit
        self._first_audio = first_audio
        # when each response's first event was queued (None: its first audio was
        # written); weak: a response that never had audio written is not kept
        self._announced: weakref.WeakKeyDictionary[Response, float | None] = (
            weakref.WeakKeyDictionary()
        )
        self._wake = trio.Event()
        self._space = trio.lowlevel.ParkingLot()
        self._empty = trio.lowlevel.ParkingLot()

    async def wait_empty(self) -> None:
        """Wait until every queued event was written (or dropped)."""
        while self._queue:
            await self._empty.park()

    def put_nowait(self, out: Out, response: Response | None = None) -> None:
        if response is not None and response.events.modality == "audio":
            self._announced.setdefault(response, trio.current_time())
        self._queue.append((out, response))
        self._bytes += len(out.text)
        self._wake.set()

    @property
    def nbytes(self) -> int:
        """The bytes of the events queued."""
        return self._bytes

    async def wait_space(self) -> None:
        """Wait while the queue is over its bound."""
        while self._bytes > self._limit:
            await self._space.park()

    async def put(self, out: Out, response: Response) -> None:
        """Queue a response's event, waiting while the queue is over its bound."""
        await self.wait_space()
        self.put_nowait(out, response)

    async def run(self, send: Send) -> None:
        while True:
            if not self._queue:
                self._empty.unpark_all()
                self._wake = trio.Event()
                await self._wake.wait()
            out, response = self._queue.popleft()
            self._bytes -= len(out.text)
            if self._bytes <= self._limit:
                self._space.unpark_all()
            if response is not None:
                if response.cancelled:
                    continue  # a cancelled response says nothing more
                response.events.sent(out)
            await send({"type": "websocket.send", "text": out.text})
            if out.audio_bytes and response is not None:
                announced = self._announced.get(response)
                if announced is not None:
                    self._announced[response] = None  # told once
                    self._first_audio(trio.current_time() - announced)


class Session:
    """One WebSocket's conversation."""

    def __init__(self, server: ServerState, options: RealtimeOptions, send: Send) -> None:
        self._server = server
        self._send = send
        self._options = options
        self._priority = server.priority_of("realtime", options.priority)
        self.id = f"sess_{secrets.token_hex(8)}"
        self._state = SessionState(self.id, server.model, options)
        self._outbox = _Outbox(options.outbox_bytes, server.metrics.realtime_first_audio.observe)
        self._scopes: dict[Response, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None
        self._reading = trio.CancelScope()
        self._changed = trio.lowlevel.ParkingLot()  # the state took a step
        self._stopping: str | None = None

    @property
    def queued_bytes(self) -> int:
        """The bytes of the server's events queued for the client, not yet written."""
        return self._outbox.nbytes

    def _apply(self) -> None:
        """Carry out what the session's state decided, in order."""
        for command in self._state.commands():
            if isinstance(command, SendEvent):
                self._outbox.put_nowait(command.out, command.response)
            elif isinstance(command, Start):
                scope = self._scopes[command.response] = trio.CancelScope()
                assert self._nursery is not None
                self._nursery.start_soon(self._respond, command.response, command.prompt, scope)
            else:
                assert isinstance(command, Cancel)
                self._scopes[command.response].cancel()
        self._changed.unpark_all()

    # -- the session's life ---------------------------------------------------------

    async def run(self, receive: Receive) -> None:
        self._state.created()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._apply()
            nursery.start_soon(self._outbox.run, self._send)
            try:
                with self._reading:
                    await self._read(receive)
                if self._stopping is not None:
                    error = RealtimeError(
                        self._stopping, type="server_error", code="server_shutting_down"
                    )
                    await self._goodbye(error, code=1012)
            finally:
                self._state.cancel_all("client_disconnected", silent=True)
                self._apply()
                nursery.cancel_scope.cancel()

    async def _read(self, receive: Receive) -> None:
        options = self._options
        while True:
            # What a client event makes (errors, the detector's events, a response's
            # start) is queued at once: a client that reads none of it is not read
            # from while the queue is over its bound.
            await self._outbox.wait_space()
            timeout = options.idle_timeout
            turn_timeout = self._state.turn_idle_timeout  # a turn in speech waits for audio
            waits_for_turn = turn_timeout is not None and turn_timeout < timeout
            if turn_timeout is not None and waits_for_turn:
                timeout = turn_timeout
            with trio.move_on_after(timeout) as idle:
                message = await receive()
            if idle.cancelled_caught:
                if waits_for_turn:
                    self._state.turn_timed_out()
                    self._apply()
                    continue
                if self._state.responses:  # one is streaming: the session is not idle
                    continue
                await self._goodbye(
                    RealtimeError(
                        f"the session was idle for {options.idle_timeout:g} s "
                        "(--realtime-idle-timeout): closed",
                        code="session_idle_timeout",
                    )
                )
                return
            kind = message["type"]
            if kind == "websocket.disconnect":
                return
            if kind != "websocket.receive":
                continue
            try:
                self._state.handle(self._decode(message))
            except RealtimeError as error:
                self._state.error(error)
            self._apply()

    def _decode(self, message: Mapping[str, Any]) -> ClientEvent:
        text = message.get("text")
        if text is None:
            data = message.get("bytes") or b""
            raise RealtimeError(
                f"a binary frame ({len(data)} bytes): client events are JSON text frames",
                code="invalid_frame",
            )
        size = len(text) if text.isascii() else len(text.encode())  # its UTF-8 bytes
        if size > self._options.max_event_bytes:
            raise RealtimeError(
                f"the event is {size} bytes, over the server's "
                f"--realtime-max-event-bytes ({self._options.max_event_bytes})",
                event_id=event_id_of(text),
                code="event_too_large",
            )
        return decode_client_event(text)

    def stop(self, why: str) -> None:
        """End the session: its responses are cancelled, and the client is told
        ``why`` in an ``error`` event before the socket closes (1012)."""
        self._stopping = why
        self._state.cancel_all("server_shutting_down")
        self._apply()
        self._reading.cancel()

    async def close_with(self, error: RealtimeError, code: int = 1000) -> None:
        """Tell the client ``error`` and close, before the session has begun."""
        self._state.error(error)
        (told,) = self._state.commands()
        assert isinstance(told, SendEvent)
        with trio.move_on_after(_LAST_WORDS):
            await self._send({"type": "websocket.send", "text": told.out.text})
            await self._send({"type": "websocket.close", "code": code})

    async def _goodbye(self, error: RealtimeError, code: int = 1000) -> None:
        """Tell the client ``error`` after its responses' ends and what is queued,
        then close (bounded)."""
        with trio.move_on_after(_LAST_WORDS, shield=True):
            while self._state.responses:
                await self._changed.park()
            self._state.error(error)
            self._apply()
            await self._outbox.wait_empty()
            await self._send({"type": "websocket.close", "code": code})

    # -- responses ----------------------------------------------------------------------

    async def _respond(self, response: Response, prompt: Any, scope: trio.CancelScope) -> None:
        server = self._server
        status: Status = "failed"
        details: dict[str, Any] | None = None
        try:
            ticket = server.enter(self._priority, sheddable=False)
        except OpenAIError as exc:
            status, details = "failed", failed(exc.message)
            ticket = None
        if ticket is not None:
            with ticket, scope:
                ticket.cancel_scope = scope
                status, details = await self._stream(response, prompt, ticket)
            self._state.trace("request_ended", response.events.id)
        del self._scopes[response]
        status = self._state.ended(response, status, details)
        metrics = server.metrics
        metrics.finished(
            {"completed": "completed", "cancelled": "aborted"}.get(status, "error"), "realtime"
        )
        metrics.realtime_response("unseen" if response.silent else status, response.cancelled)
        self._apply()

    async def _stream(
        self, response: Response, prompt: Any, ticket: Any
    ) -> tuple[Status, dict[str, Any] | None]:
        orchestrator = self._server.orchestrator
        if orchestrator is None:
            return "failed", failed("the server is shutting down")
        events = response.events
        stage_ids = set(events.stage_ids)
        stream = None
        try:
            async with orchestrator.open_request(
                prompt, final_stage_ids=stage_ids, priority=ticket.priority
            ) as stream:
                ticket.admitted()
                while stream.terminal is None:
                    batch = await stream.receive_batch()
                    await self._emit(response, events.take(batch))
        except trio.ClosedResourceError:
            return "failed", failed("the server is shutting down")
        except (ValueError, TypeError) as exc:  # a prompt the pipeline refused; bad audio
            return "failed", failed(str(exc))
        terminal = None if stream is None else stream.terminal
        return status_of(terminal)

    async def _emit(self, response: Response, outs: list[Out]) -> None:
        for out in self._state.outgoing(response, outs):
            await self._outbox.put(out, response)
        while self._state.holds_too_much(response):
            await self._changed.park()
