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
carries the commands out; the wire shapes are in ``_realtime_protocol``, and the
endpoint's options in ``_realtime_options``.
"""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING

from ._protocol import OpenAIError, encode
from ._realtime_protocol import RealtimeError, ServerEvents
from ._realtime_session import Session

if TYPE_CHECKING:
    from ._chat import Receive, Scope, Send
    from ._realtime_options import RealtimeOptions
    from ._state import ServerState

__all__ = ["RealtimeEndpoint"]

#: The longest close reason a WebSocket frame carries, in bytes (RFC 6455: 125, of
#: which 2 are the code).
_MAX_REASON = 123


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
