"""One ``/v1/realtime`` session: its nursery, its tasks, its responses' cancel
scopes (the design is in ``_realtime``'s docstring and ``docs/voice.md``).

:class:`Session` drives what ``_realtime_conversation`` decides with no I/O: the
reader task handles the client's events and the voice activity detector's, each
response runs as a task in a cancel scope of its own, and :class:`_Outbox`'s task
writes the events in order, dropping those of a cancelled response.
"""

from __future__ import annotations

import collections
import secrets
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio
from msgspec import UNSET

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
    from ._chat import Receive, Send
    from ._model import FinalOutput
    from ._realtime import RealtimeOptions
    from ._realtime_protocol import ClientEvent, TurnDetection
    from ._state import ServerState

__all__ = ["Session"]


#: How long a session may spend telling its client why it ends.
_LAST_WORDS = 1.0
#: The least audio a commit takes (OpenAI's rule: 100 ms).
_MIN_COMMIT_MS = 100


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

    @property
    def nbytes(self) -> int:
        """The bytes of the events queued."""
        return self._bytes

    async def wait_space(self) -> None:
        """Wait while the queue is over its bound."""
        while self._bytes > self._limit:
            await self._space.park()

    async def put(self, out: Out, response: _Response) -> None:
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


class Session:
    """One WebSocket's conversation."""

    def __init__(self, server: ServerState, options: RealtimeOptions, send: Send) -> None:
        self._server = server
        self._send = send
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
        self._reading = trio.CancelScope()
        self._ended = trio.lowlevel.ParkingLot()  # a response ended
        self._stopping: str | None = None
        self._ids = 0

    # -- the session's life ---------------------------------------------------------

    async def run(self, receive: Receive) -> None:
        self._outbox.put_nowait(self._events.event("session.created", session=self._view()))
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
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
                for response in list(self._responses):
                    self._cancel(response, "client_disconnected", silent=True)
                nursery.cancel_scope.cancel()

    async def _read(self, receive: Receive) -> None:
        options = self._options
        while True:
            # What a client event makes (errors, the detector's events, a response's
            # start) is queued at once: a client that reads none of it is not read
            # from while the queue is over its bound.
            await self._outbox.wait_space()
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
        for response in list(self._responses):
            self._cancel(response, "server_shutting_down")
        self._reading.cancel()

    async def close_with(self, error: RealtimeError, code: int = 1000) -> None:
        with trio.move_on_after(_LAST_WORDS):
            await self._send({"type": "websocket.send", "text": self._events.error(error)})
            await self._send({"type": "websocket.close", "code": code})

    async def _goodbye(self, error: RealtimeError, code: int = 1000) -> None:
        """Tell the client ``error`` after its responses' ends and what is queued,
        then close (bounded)."""
        with trio.move_on_after(_LAST_WORDS, shield=True):
            while self._responses:
                await self._ended.park()
            self._outbox.put_nowait(self._events.error(error))
            await self._outbox.wait_empty()
            await self._send({"type": "websocket.close", "code": code})

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
            self._forget(response)
            return
        done = events.done(status, details)
        if response.held:  # the turn is not over yet: these wait with the rest
            response.done = done
            return
        for text in done:
            self._outbox.put_nowait(text)
        self._trace("response_done", events.id)
        self._finished(response)

    def _forget(self, response: _Response) -> None:
        self._responses.discard(response)
        self._ended.unpark_all()

    def _finished(self, response: _Response) -> None:
        self._forget(response)
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
