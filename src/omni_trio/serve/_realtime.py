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

What a session decides is in ``_realtime_state`` (turns, speculation, barge-in, as
commands) and what it decides with in ``_realtime_conversation`` (the conversation,
the audio buffer, each response's events), both with no I/O; ``_realtime_session``
carries the commands out; the wire shapes are in ``_realtime_protocol``.
"""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING, Any

import attrs

from .._checks import check_positive_int, check_seconds
from .._priority import check_priority
from ._protocol import OpenAIError, encode
from ._realtime_protocol import RealtimeError, ServerEvents
from ._realtime_session import Session

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..speech import VadOptions
    from ._chat import Receive, Scope, Send
    from ._realtime_state import Detector
    from ._state import ServerState

__all__ = ["RealtimeEndpoint", "RealtimeOptions"]

#: The longest close reason a WebSocket frame carries, in bytes (RFC 6455: 125, of
#: which 2 are the code).
_MAX_REASON = 123


def _positive_seconds(name: str) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        check_seconds(name, value, positive=True)

    return check


def _positive_int(name: str) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        check_positive_int(name, value)

    return check


def _priority(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        check_priority(value, attribute.name)


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
      outbox_bytes: Server events a session may have queued, unwritten, before it
          waits for the client: its responses wait (their outputs stay unread in the
          orchestrator, bounded by ``max_unread_bytes`` and ``consumer_idle_timeout``
          like any request's), and so does the reading of its client's events (what
          one event makes is queued at once: at most this plus one event's worth).
          A speculation holds at most this much of its events, too, until its turn
          ends.
      priority: Its responses' priority (lower runs earlier) at every queue of
          their route; ``None``: the endpoint's default (the config's
          ``[serve.priority] realtime``, else -10: ahead of chat's 0). A response
          is never shed for a more urgent request once its turn began.
      detector: Makes each session's voice activity detector from its turn
          detection's settings, as ``detector(vad_options)``: anything with
          ``feed(pcm) -> events`` and ``reset()``, as
          :class:`~omni_trio.speech.VoiceActivityDetector` has. ``None``: that
          detector with Silero's model, at 24 kHz. WebRTC's model is cheaper and
          weaker in noise (``docs/voice.md`` measures both)::

              # every session's detector with WebRTC's model (docs/voice.md runs it)
              RealtimeOptions(detector=lambda vad: VoiceActivityDetector(
                  vad, sample_rate=24_000, model=WebRtcModel()))

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
    priority: int | None = attrs.field(default=None, validator=_priority)
    detector: Callable[[VadOptions], Detector] | None = None
    trace: Callable[[str, str, str], None] | None = None


def _query_model(scope: Scope) -> str | None:
    query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
    models = query.get("model")
    return models[0] if models else None


class RealtimeEndpoint:
    """The ASGI app of ``/v1/realtime``: one :class:`Session` per WebSocket."""

    def __init__(self, server: ServerState, options: RealtimeOptions) -> None:
        self._server = server
        self.options = options
        self.sessions: set[Session] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        server = self._server
        refusal = self._refusal()
        if refusal is not None:
            why, text = refusal
            server.metrics.realtime_refused[why].inc()
            await _deny(scope, send, 503, text)
            return
        await send({"type": "websocket.accept"})
        session = Session(server, self.options, send)
        model = _query_model(scope)
        if model != server.model.name:
            error = RealtimeError(
                f"model: this server serves {server.model.name!r}, not {model!r} "
                "(the URL's ?model=)",
                param="model",
                code="model_not_found",
            )
            server.metrics.realtime_refused["model"].inc()
            await session.close_with(error, code=1008)
            return
        self.sessions.add(session)
        server.metrics.realtime_sessions.inc()
        try:
            await session.run(receive)
        finally:
            self.sessions.discard(session)
            server.metrics.realtime_sessions.dec()

    def _refusal(self) -> tuple[str, str] | None:
        """Why a new session is refused, if it is: ``(reason, message)``."""
        server = self._server
        if server.draining or server.orchestrator is None:
            return "unavailable", "the server is not taking sessions (starting or shutting down)"
        if len(self.sessions) >= self.options.max_sessions:
            return "capacity", (
                f"the server is at capacity: {_sessions(len(self.sessions))} "
                f"(--realtime-max-sessions {self.options.max_sessions})"
            )
        return None

    def stop_all(self) -> None:
        """End every session (the server stops): each is told, then closed."""
        for session in self.sessions:
            session.stop("the server is shutting down")


def _sessions(count: int) -> str:
    return f"{count} realtime session{'' if count == 1 else 's'}"


async def _deny(scope: Scope, send: Send, status: int, message: str) -> None:
    """Refuse an upgrade with an HTTP status (where the server can), else close.

    A browser (its upgrade carries an ``Origin``) cannot read a refused upgrade's
    status or body: it is accepted instead, told ``message`` in an ``error`` event,
    and closed with code 1013 ("try again later") and the message as the reason.
    """
    headers = dict(scope.get("headers", ()))
    if b"origin" in headers:
        await send({"type": "websocket.accept"})
        error = RealtimeError(message, code="server_overloaded", type="server_error")
        await send({"type": "websocket.send", "text": ServerEvents("refused_").error(error)})
        reason = message.encode()[:_MAX_REASON].decode(errors="ignore")
        await send({"type": "websocket.close", "code": 1013, "reason": reason})
    elif "websocket.http.response" in scope.get("extensions", {}):
        body = OpenAIError(status, message, type="server_error", code="server_overloaded")
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
