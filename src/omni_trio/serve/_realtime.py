"""``/v1/realtime``: a conversation over a WebSocket, OpenAI's Realtime API.

One session is one WebSocket and one nursery: the task that reads the client's
events (and runs the voice activity detector on its audio), the task that writes the
server's events, and a task per response. A response is one orchestrator request
(the turn's audio or text in, the listening stage's transcript and the answer's
text and audio out), run in its own cancel scope: **barge-in is that scope's
cancellation**. Leaving :meth:`Orchestrator.open_request`'s block aborts the request
at every stage it was submitted to, and ``response.done`` (status ``cancelled``)
follows. Every delta of a cancelled response still queued is dropped at once: none
is written after the ``input_audio_buffer.speech_started`` (or the ``response.cancel``)
that cancelled it.

Speculative recognition: with server VAD, a response starts when the detector hears
the first ``speculate_after_ms`` of silence, on the turn's audio so far, and its
events are held. If the silence lasts (the turn is over) the held events go out
after ``input_audio_buffer.committed``; if speech resumes, the response is
cancelled, unseen. The recognition thus overlaps the VAD's hangover.

What a session decides with (the conversation, the audio buffer, each response's
events) is in ``_realtime_conversation``, with no I/O; the wire shapes are in
``_realtime_protocol``.
"""

from __future__ import annotations

import collections
import logging
import secrets
import urllib.parse
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio

from .._checks import check_positive_int, check_seconds
from ._protocol import OpenAIError
from ._realtime_conversation import AudioBuffer, Conversation, Item, Out, ResponseEvents, Status
from ._realtime_protocol import (
    SAMPLE_RATE,
    ConversationItemCreate,
    ConversationItemTruncate,
    InputAudioBufferAppend,
    InputAudioBufferClear,
    InputAudioBufferCommit,
    RealtimeError,
    ResponseCancel,
    ResponseCreate,
    ServerEvents,
    SessionUpdate,
    decode_client_event,
    event_id_of,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._messages import OrchOutput
    from ._chat import Receive, Scope, Send
    from ._model import FinalOutput
    from ._realtime_protocol import ClientEvent, TurnDetection
    from ._state import ServerState

__all__ = ["RealtimeEndpoint", "RealtimeOptions"]

logger = logging.getLogger("omni_trio.serve")

#: How long a session may spend telling its client why it ends.
_LAST_WORDS = 1.0
#: The least audio a commit takes (OpenAI's rule: 100 ms).
_MIN_COMMIT_MS = 100


def _positive_seconds(name: str) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        check_seconds(name, value, positive=True)

    return check


def _positive_int(name: str) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        check_positive_int(name, value)

    return check


@attrs.frozen
class RealtimeOptions:
    """The limits and behaviour of ``/v1/realtime`` (``omni-trio serve
    --realtime-*``).

    Attributes:
      max_sessions: Sessions at once; the next upgrade gets 503.
      max_buffer_seconds: The input audio buffer's bound: an append past it gets an
          ``error`` and is dropped.
      max_event_bytes: The largest client event (a larger one gets an ``error``).
      idle_timeout: Seconds without a client event (audio included) after which a
          session is closed, with an ``error`` saying so. A session is not idle while
          a response streams to it.
      speculate: Start recognising a turn when its silence begins (see the module).
      speculate_after_ms: How much silence begins a speculation (less than the
          session's ``silence_duration_ms``; when it is not, half of that).
      outbox_bytes: Server events a session may have queued, unwritten, before its
          responses wait for the client (a response's outputs then stay unread in the
          orchestrator, bounded by ``max_unread_bytes`` and ``consumer_idle_timeout``
          like any request's).
      trace: Called as ``trace(session_id, what, ref)`` at each step of a turn and a
          response, the moment the session takes it: ``"speech_started"``,
          ``"silence_started"``, ``"speech_stopped"`` (``ref``: the turn's item id),
          ``"response_started"``, ``"response_cancelled"``, ``"request_ended"`` (its
          orchestrator request's block has exited: every stage was sent its abort),
          ``"response_done"`` (``ref``: the response id). A hook for timing, as the
          voice bench does; it must not block.
    """

    max_sessions: int = attrs.field(default=16, validator=_positive_int("max_sessions"))
    max_buffer_seconds: float = attrs.field(
        default=60.0, validator=_positive_seconds("max_buffer_seconds")
    )
    max_event_bytes: int = attrs.field(
        default=1024 * 1024, validator=_positive_int("max_event_bytes")
    )
    idle_timeout: float = attrs.field(default=300.0, validator=_positive_seconds("idle_timeout"))
    speculate: bool = True
    speculate_after_ms: int = attrs.field(
        default=150, validator=_positive_int("speculate_after_ms")
    )
    outbox_bytes: int = attrs.field(default=1024 * 1024, validator=_positive_int("outbox_bytes"))
    trace: Callable[[str, str, str], None] | None = None


@attrs.define(eq=False)
class _Response:
    events: ResponseEvents
    turn: Item | None  # the user item it answers
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    held: bool = False  # speculative: its events wait for the turn's commit
    backlog: list[Out] = attrs.field(factory=list)
    done: list[str] = attrs.field(factory=list)  # its last events, if it ended held
    cancelled: str | None = None  # why it was cancelled: its status_details reason
    silent: bool = False  # a speculation cancelled unseen: no events at all
    ended: bool = False


class _Outbox:
    """The session's events on their way out, written by one task, in order. A
    cancelled response's events still here are dropped (all but its
    ``response.done``, queued without a response)."""

    def __init__(self, limit: int) -> None:
        self._queue: collections.deque[tuple[Out, _Response | None]] = collections.deque()
        self._bytes = 0
        self._limit = limit
        self._wake = trio.Event()
        self._space = trio.lowlevel.ParkingLot()

        self._empty = trio.lowlevel.ParkingLot()

    async def wait_empty(self) -> None:
        """Wait until every queued event was written (or dropped)."""
        while self._queue:
            await self._empty.park()

    def put_nowait(self, out: Out | str, response: _Response | None = None) -> None:
        if isinstance(out, str):
            out = Out(out)
        self._queue.append((out, response))
        self._bytes += len(out.text)
        self._wake.set()

    async def put(self, out: Out, response: _Response) -> None:
        """Queue a response's event, waiting while the queue is over its bound."""
        while self._bytes > self._limit:
            await self._space.park()
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


def _query_model(scope: Scope) -> str | None:
    query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
    models = query.get("model")
    return models[0] if models else None


class RealtimeEndpoint:
    """The ASGI app of ``/v1/realtime``: one :class:`_Session` per WebSocket."""

    def __init__(self, server: ServerState, options: RealtimeOptions) -> None:
        self._server = server
        self.options = options
        self.sessions: set[_Session] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        server = self._server
        refusal = None
        if server.draining or server.orchestrator is None:
            refusal = "the server is not taking sessions (starting or shutting down)"
        elif len(self.sessions) >= self.options.max_sessions:
            refusal = (
                f"the server is at capacity: {len(self.sessions)} realtime sessions "
                f"(--realtime-max-sessions {self.options.max_sessions})"
            )
        if refusal is not None:
            await _deny(scope, send, 503, refusal)
            return
        await send({"type": "websocket.accept"})
        session = _Session(self, server, send)
        model = _query_model(scope)
        if model != server.model.name:
            error = RealtimeError(
                f"model: this server serves {server.model.name!r}, not {model!r} "
                "(the URL's ?model=)",
                param="model",
                code="model_not_found",
            )
            await session.close_with(error, code=1008)
            return
        self.sessions.add(session)
        try:
            await session.run(receive)
        finally:
            self.sessions.discard(session)

    def stop_all(self) -> None:
        """End every session (the server stops): each is told, then closed."""
        for session in self.sessions:
            session.stop("the server is shutting down")


async def _deny(scope: Scope, send: Send, status: int, message: str) -> None:
    """Refuse an upgrade with an HTTP status (where the server can), else close."""
    if "websocket.http.response" in scope.get("extensions", {}):
        body = OpenAIError(status, message, type="server_error", code="server_overloaded")
        from ._protocol import encode

        data = encode(body.body())
        await send(
            {
                "type": "websocket.http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                    (b"retry-after", b"1"),
                ],
            }
        )
        await send({"type": "websocket.http.response.body", "body": data})
    else:
        await send({"type": "websocket.close", "code": 1013})


@attrs.define
class _Turns:
    """The session's turn detection: server VAD's settings (``None``: manual)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def update(self, detection: TurnDetection) -> None:
        for name in (
            "threshold",
            "prefix_padding_ms",
            "silence_duration_ms",
            "create_response",
            "interrupt_response",
        ):
            value = getattr(detection, name)
            if value is not None:
                setattr(self, name, value)

    def view(self) -> dict[str, Any]:
        return {"type": "server_vad", "idle_timeout_ms": None, **attrs.asdict(self)}


class _Session:
    """One WebSocket's conversation."""

    def __init__(self, endpoint: RealtimeEndpoint, server: ServerState, send: Send) -> None:
        self._endpoint = endpoint
        self._server = server
        self._send = send
        options = endpoint.options
        self._options = options
        self.id = f"sess_{secrets.token_hex(8)}"
        self._events = ServerEvents(self.id[5:13] + "_")
        self._outbox = _Outbox(options.outbox_bytes)
        self._conversation = Conversation(prefix=f"item_{self.id[5:13]}_")
        self._buffer = AudioBuffer(int(options.max_buffer_seconds * SAMPLE_RATE) * 2)
        model = server.model
        self._modality: Literal["audio", "text"] = (
            "audio" if "audio" in model.modalities else "text"
        )
        self._turns: _Turns | None = _Turns()
        self._vad: Any = None  # the detector, made at the first append
        self._vad_offset = 0  # the session's audio clock when the detector started
        self._turn: Item | None = None  # the user turn being spoken (server VAD)
        self._turn_start = 0
        self._response: _Response | None = None  # the one answering now
        self._speculation: _Response | None = None
        self._responses: set[_Response] = set()
        self._instructions = ""
        self._nursery: trio.Nursery | None = None
        self._stopping: str | None = None
        self._ids = 0

    # -- the session's life ---------------------------------------------------------

    async def run(self, receive: Receive) -> None:
        self._outbox.put_nowait(self._events.event("session.created", session=self._view()))
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._outbox.run, self._send)
            try:
                await self._read(receive)
            finally:
                for response in list(self._responses):
                    self._cancel(response, "client_disconnected", silent=True)
                nursery.cancel_scope.cancel()

    async def _read(self, receive: Receive) -> None:
        options = self._options
        while True:
            with trio.move_on_after(options.idle_timeout) as idle:
                message = await receive()
            if idle.cancelled_caught:
                if self._responses:  # one is streaming: the session is not idle
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
            if self._stopping is not None:
                await self._goodbye(
                    RealtimeError(self._stopping, type="server_error", code="server_shutting_down")
                )
                return
            try:
                self._handle(self._decode(message))
            except RealtimeError as error:
                self._outbox.put_nowait(self._events.error(error))

    def _decode(self, message: dict[str, Any] | Any) -> ClientEvent:
        text = message.get("text")
        if text is None:
            data = message.get("bytes") or b""
            raise RealtimeError(
                f"a binary frame ({len(data)} bytes): client events are JSON text frames",
                code="invalid_frame",
            )
        size = len(text)  # characters: at least as many bytes
        if size > self._options.max_event_bytes:
            raise RealtimeError(
                f"the event is {size} characters, over the server's "
                f"--realtime-max-event-bytes ({self._options.max_event_bytes})",
                event_id=event_id_of(text),
                code="event_too_large",
            )
        return decode_client_event(text)

    def stop(self, why: str) -> None:
        """End the session soon: at once if it reads nothing, else at its next event."""
        self._stopping = why
        for response in list(self._responses):
            self._cancel(response, "server_shutting_down")
        if self._nursery is not None:
            self._outbox.put_nowait(
                self._events.error(
                    RealtimeError(why, type="server_error", code="server_shutting_down")
                )
            )
            self._nursery.start_soon(self._close_soon)

    async def _close_soon(self) -> None:
        await trio.sleep(_LAST_WORDS)
        with trio.move_on_after(_LAST_WORDS):
            await self._send({"type": "websocket.close", "code": 1012})
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()

    async def close_with(self, error: RealtimeError, code: int = 1000) -> None:
        with trio.move_on_after(_LAST_WORDS):
            await self._send({"type": "websocket.send", "text": self._events.error(error)})
            await self._send({"type": "websocket.close", "code": code})

    async def _goodbye(self, error: RealtimeError) -> None:
        self._outbox.put_nowait(self._events.error(error))
        with trio.move_on_after(_LAST_WORDS):
            await self._outbox.wait_empty()
            await self._send({"type": "websocket.close", "code": 1000})

    # -- client events ----------------------------------------------------------------

    def _handle(self, event: ClientEvent) -> None:
        if isinstance(event, InputAudioBufferAppend):
            self._append(event)
        elif isinstance(event, SessionUpdate):
            self._update(event)
        elif isinstance(event, InputAudioBufferCommit):
            self._commit(event.event_id)
        elif isinstance(event, InputAudioBufferClear):
            self._clear()
        elif isinstance(event, ConversationItemCreate):
            self._create_item(event)
        elif isinstance(event, ConversationItemTruncate):
            item = self._conversation.truncate(event.item_id, event.audio_end_ms, event.event_id)
            self._put(
                "conversation.item.truncated",
                item_id=item.id,
                content_index=event.content_index,
                audio_end_ms=event.audio_end_ms,
            )
        elif isinstance(event, ResponseCreate):
            self._create_response(event)
        else:
            self._cancel_response(event)

    def _trace(self, what: str, ref: str) -> None:
        trace = self._options.trace
        if trace is not None:
            trace(self.id, what, ref)

    def _put(self, type: str, **fields: Any) -> None:
        self._outbox.put_nowait(self._events.event(type, **fields))

    def _view(self) -> dict[str, Any]:
        audio = {"format": {"type": "audio/pcm", "rate": SAMPLE_RATE}}
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id,
            "model": self._server.model.name,
            "output_modalities": [self._modality],
            "instructions": self._instructions,
            "audio": {
                "input": {
                    **audio,
                    "turn_detection": None if self._turns is None else self._turns.view(),
                },
                "output": {**audio, "voice": None},
            },
        }

    def _update(self, event: SessionUpdate) -> None:
        from msgspec import UNSET

        session = event.session
        if session.output_modalities is not UNSET:
            (wanted,) = session.output_modalities
            if wanted not in self._server.model.modalities:
                raise RealtimeError(
                    f"session.output_modalities: model {self._server.model.name!r} has no "
                    f"{wanted} output",
                    event_id=event.event_id,
                    param="session.output_modalities",
                )
            self._modality = wanted
        if session.instructions is not UNSET:
            self._instructions = session.instructions
        if session.audio is not UNSET and session.audio.input is not UNSET:
            detection = session.audio.input.turn_detection
            if detection is None:
                self._turns = None
                self._forget_turn()
                self._vad = None
            elif detection is not UNSET:
                turns = self._turns or _Turns()
                turns.update(detection)
                self._turns = turns
                self._forget_turn()
                self._vad = None  # made again, with these settings, at the next append
        self._put("session.updated", session=self._view())

    def _hearing(self, event_id: str | None, param: str) -> FinalOutput:
        hearing = self._server.model.hearing
        if hearing is None:
            raise RealtimeError(
                f"{param}: model {self._server.model.name!r} cannot listen: its pipeline "
                'has no listening stage (final_output_type = "transcript")',
                event_id=event_id,
                param=param,
                code="audio_not_supported",
            )
        return hearing

    def _append(self, event: InputAudioBufferAppend) -> None:
        self._hearing(event.event_id, "audio")
        self._buffer.append(event.pcm, event.event_id)
        turns = self._turns
        if turns is None:
            return
        if self._vad is None:
            self._vad = self._detector(turns, event.event_id)
            self._vad_offset = self._buffer.end_ms - len(event.pcm) // 48
        for happened in self._vad.feed(event.pcm):
            self._on_vad(happened)
        if self._turn is None:  # between turns: keep no more than a turn's padding
            self._buffer.drop_before(self._buffer.end_ms - turns.prefix_padding_ms)

    def _detector(self, turns: _Turns, event_id: str | None) -> Any:
        try:
            from ..speech import VadOptions, VoiceActivityDetector

            options = VadOptions(
                threshold=turns.threshold,
                prefix_padding_ms=turns.prefix_padding_ms,
                silence_duration_ms=turns.silence_duration_ms,
                speculate_after_ms=(
                    self._speculate_after(turns.silence_duration_ms)
                    if self._options.speculate
                    else 0
                ),
            )
            return VoiceActivityDetector(options, sample_rate=SAMPLE_RATE)
        except ImportError as exc:
            raise RealtimeError(
                f"audio: server VAD needs the voice extra (pip install 'omni-trio[voice]'): "
                f"{exc}; or turn it off (turn_detection null) and commit turns yourself",
                event_id=event_id,
                param="audio",
                type="server_error",
                code="vad_unavailable",
            ) from None

    def _speculate_after(self, silence_ms: int) -> int:
        wanted = self._options.speculate_after_ms
        return wanted if wanted < silence_ms else silence_ms // 2

    def _on_vad(self, happened: Any) -> None:
        from ..speech import SilenceStarted, SpeechResumed, SpeechStarted, SpeechStopped

        turns = self._turns
        assert turns is not None
        offset = self._vad_offset
        if isinstance(happened, SpeechStarted):
            start = max(
                self._buffer.start_ms, offset + happened.audio_start_ms - turns.prefix_padding_ms
            )
            self._turn = Item(self._conversation.new_id(), "user")
            self._turn_start = start
            self._trace("speech_started", self._turn.id)
            if turns.interrupt_response and self._response is not None:
                self._cancel(self._response, "turn_detected")
            self._put(
                "input_audio_buffer.speech_started",
                audio_start_ms=start,
                item_id=self._turn.id,
            )
        elif isinstance(happened, SilenceStarted):
            if self._turn is not None:
                self._trace("silence_started", self._turn.id)
            if self._turn is not None and turns.create_response and self._options.speculate:
                audio = self._buffer.between(self._turn_start, offset + happened.audio_ms)
                self._turn.audio = audio
                self._speculation = self._start(self._turn, self._modality, held=True)
        elif isinstance(happened, SpeechResumed):
            self._drop_speculation()
        elif isinstance(happened, SpeechStopped) and self._turn is not None:
            end = offset + happened.audio_end_ms
            turn, self._turn = self._turn, None
            self._trace("speech_stopped", turn.id)
            self._put("input_audio_buffer.speech_stopped", audio_end_ms=end, item_id=turn.id)
            turn.audio = self._buffer.between(self._turn_start, end)
            self._buffer.drop_before(end)
            self._committed(turn)
            speculation, self._speculation = self._speculation, None
            if not turns.create_response:
                return
            if speculation is not None and not speculation.cancelled:
                self._promote(speculation)
            else:
                self._response = self._start(turn, self._modality)

    def _forget_turn(self) -> None:
        self._drop_speculation()
        self._turn = None

    def _drop_speculation(self) -> None:
        speculation, self._speculation = self._speculation, None
        if speculation is not None:
            self._cancel(speculation, "turn_detected", silent=True)

    def _committed(self, turn: Item) -> None:
        for item in self._conversation.items:  # only the newest turn keeps its audio
            item.audio = None
        turn.spoken = True
        previous = self._previous_id()
        self._conversation.add(turn)
        self._put("input_audio_buffer.committed", item_id=turn.id, previous_item_id=previous)
        self._put(
            "conversation.item.added", previous_item_id=previous, item=turn.view("in_progress")
        )

    def _commit(self, event_id: str | None) -> None:
        self._hearing(event_id, "type")
        if self._buffer.end_ms - self._buffer.start_ms < _MIN_COMMIT_MS:
            raise RealtimeError(
                f"the input audio buffer holds {self._buffer.end_ms - self._buffer.start_ms} ms "
                f"of audio: a commit needs at least {_MIN_COMMIT_MS} ms",
                event_id=event_id,
                code="input_audio_buffer_commit_empty",
            )
        turn = self._turn or Item(self._conversation.new_id(), "user")
        self._forget_turn()
        if self._vad is not None:
            self._vad.reset()
        turn.audio = self._buffer.take()
        self._committed(turn)

    def _clear(self) -> None:
        self._forget_turn()
        if self._vad is not None:
            self._vad.reset()
        self._buffer.clear()
        self._put("input_audio_buffer.cleared")

    def _create_item(self, event: ConversationItemCreate) -> None:
        text = event.text()
        item = event.item
        new = Item(item.id or self._conversation.new_id(), "user", text)
        if item.role == "assistant":
            new.role = "assistant"
        previous = self._previous_id()
        self._conversation.add(new)
        self._put("conversation.item.added", previous_item_id=previous, item=new.view())
        self._put("conversation.item.done", previous_item_id=previous, item=new.view())

    def _create_response(self, event: ResponseCreate) -> None:
        if self._response is not None:
            raise RealtimeError(
                f"a response is in progress ({self._response.events.id}): cancel it first, "
                "or wait for its response.done",
                event_id=event.event_id,
                code="conversation_already_has_active_response",
            )
        turn = self._conversation.last_user()
        if turn is None:
            raise RealtimeError(
                "there is nothing to respond to: commit audio or create a user message first",
                event_id=event.event_id,
                code="conversation_empty",
            )
        modality = self._modality
        params = event.response
        if params is not None and params.output_modalities:
            (modality,) = params.output_modalities[:1]
            if modality not in self._server.model.modalities:
                raise RealtimeError(
                    f"response.output_modalities: model {self._server.model.name!r} has no "
                    f"{modality} output",
                    event_id=event.event_id,
                    param="response.output_modalities",
                )
        self._response = self._start(turn, modality)

    def _cancel_response(self, event: ResponseCancel) -> None:
        response = self._response
        if response is None:
            raise RealtimeError(
                "there is no response to cancel",
                event_id=event.event_id,
                code="response_cancel_not_active",
            )
        if event.response_id is not None and event.response_id != response.events.id:
            raise RealtimeError(
                f"response_id: {event.response_id!r} is not the response in progress "
                f"({response.events.id})",
                event_id=event.event_id,
                param="response_id",
                code="response_cancel_not_active",
            )
        self._cancel(response, "client_cancelled")

    # -- responses ----------------------------------------------------------------------

    def _start(
        self, turn: Item, modality: Literal["audio", "text"], held: bool = False
    ) -> _Response:
        server = self._server
        model = server.model
        self._ids += 1
        answer = Item(self._conversation.new_id(), "assistant", "")
        outputs = {o.stage_id: o for o in model.outputs if o.modality in (modality, "transcript")}
        if modality == "audio":  # the answer's transcript, too
            outputs |= {o.stage_id: o for o in model.outputs if o.modality == "text"}
        heard = turn if turn.audio is not None else None
        events = ResponseEvents(
            self._events,
            f"resp_{self.id[5:13]}_{self._ids}",
            answer,
            heard,
            outputs,
            modality,
            _resampler(model.outputs) if modality == "audio" else _unchanged,
        )
        response = _Response(events, turn, held=held)
        self._responses.add(response)
        self._trace("response_started", response.events.id)
        if not held:
            self._announce(response)
        assert self._nursery is not None
        self._nursery.start_soon(self._respond, response, self._prompt(turn))
        return response

    def _prompt(self, turn: Item) -> Any:
        context = self._conversation.context(turn)
        if turn.audio is not None:
            return {"audio": turn.audio, "sample_rate": SAMPLE_RATE, "context": context}
        if self._server.model.hearing is not None:
            return {"text": turn.text or "", "context": context}
        return turn.text or ""

    def _promote(self, response: _Response) -> None:
        """The turn is over: the speculation becomes the response, and what it held
        goes out after the turn's commit."""
        self._response = response
        response.held = False
        self._announce(response)
        backlog, response.backlog = response.backlog, []
        for out in backlog:
            self._outbox.put_nowait(out, response)
        for text in response.done:  # it ended while held
            self._outbox.put_nowait(text)
        if response.ended:
            self._finished(response)

    def _announce(self, response: _Response) -> None:
        """``response.created``: its answer joins the conversation."""
        previous = self._previous_id()
        self._conversation.add(response.events.answer)
        for text in response.events.created(previous):
            self._outbox.put_nowait(text, response)

    def _previous_id(self) -> str | None:
        items = self._conversation.items
        return items[-1].id if items else None

    def _cancel(self, response: _Response, reason: str, *, silent: bool = False) -> None:
        if response.cancelled is None:
            response.cancelled = reason
            response.silent = silent or response.held
            self._trace("response_cancelled", response.events.id)
        response.scope.cancel()
        if self._response is response:
            self._response = None

    async def _respond(self, response: _Response, prompt: Any) -> None:
        server = self._server
        events = response.events
        status: Status = "failed"
        details: dict[str, Any] | None = None
        try:
            ticket = server.enter()
        except OpenAIError as exc:
            status, details = "failed", _failed(exc.message)
            ticket = None
        if ticket is not None:
            with ticket, response.scope:
                ticket.cancel_scope = response.scope
                status, details = await self._stream(response, prompt, ticket)
            self._trace("request_ended", events.id)
        if response.cancelled is not None:
            status, details = "cancelled", {"type": "cancelled", "reason": response.cancelled}
        response.ended = True
        server.metrics.finished(
            {"completed": "completed", "cancelled": "aborted"}.get(status, "error")
        )
        if response.silent:
            self._responses.discard(response)
            return
        done = events.done(status, details)
        if response.held:  # the turn is not over yet: these wait with the rest
            response.done = done
            return
        for text in done:
            self._outbox.put_nowait(text)
        self._trace("response_done", events.id)
        self._finished(response)

    def _finished(self, response: _Response) -> None:
        self._responses.discard(response)
        if self._response is response:
            self._response = None

    async def _stream(
        self, response: _Response, prompt: Any, ticket: Any
    ) -> tuple[Status, dict[str, Any] | None]:
        orchestrator = self._server.orchestrator
        if orchestrator is None:
            return "failed", _failed("the server is shutting down")
        events = response.events
        stage_ids = set(events.stage_ids)
        stream = None
        try:
            async with orchestrator.open_request(prompt, final_stage_ids=stage_ids) as stream:
                ticket.admitted()
                while stream.terminal is None:
                    batch = await stream.receive_batch()
                    await self._emit(response, events.take(batch))
        except trio.ClosedResourceError:
            return "failed", _failed("the server is shutting down")
        except (ValueError, TypeError) as exc:  # a prompt the pipeline refused; bad audio
            return "failed", _failed(str(exc))
        terminal = None if stream is None else stream.terminal
        return _status(terminal)

    async def _emit(self, response: _Response, outs: list[Out]) -> None:
        if response.held:
            response.backlog += outs
            return
        for out in outs:
            await self._outbox.put(out, response)


def _failed(message: str) -> dict[str, Any]:
    return {"type": "failed", "error": {"type": "server_error", "message": message}}


def _status(terminal: OrchOutput | None) -> tuple[Status, dict[str, Any] | None]:
    if terminal is None:
        return "failed", _failed("the request was not admitted")
    if terminal.finish_reason == "completed":
        return "completed", None
    if terminal.finish_reason == "error":
        return "failed", _failed(terminal.error or "the request failed")
    return "incomplete", {"type": "incomplete", "reason": "aborted"}


def _unchanged(pcm: bytes) -> bytes:
    return pcm


def _resampler(outputs: tuple[FinalOutput, ...]) -> Callable[[bytes], bytes]:
    """24 kHz from the audio stage's rate, carried chunk to chunk (one per response)."""
    rate = next((o.sample_rate for o in outputs if o.modality == "audio"), SAMPLE_RATE)
    if rate == SAMPLE_RATE:
        return _unchanged
    from ..speech import Resampler

    return Resampler(rate, SAMPLE_RATE).feed
