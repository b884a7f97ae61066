"""What the endpoints' responses share: a place in the server (a
:class:`~._state.Ticket`), a task that watches for the client hanging up, and how a
request that ends without completing is told.

A response is a small ASGI application, not a Starlette ``StreamingResponse`` over an
async generator (whose cleanup runs when the garbage collector gets to it, not in
structured order): one nursery holds
the response and the watcher; a client that hangs up cancels the response, and
leaving :meth:`Orchestrator.open_request`'s block aborts the request at every stage
of its route before the handler returns.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import trio

from ._protocol import OpenAIError, encode, unavailable

if TYPE_CHECKING:
    from .._messages import OrchOutput
    from .._stream import RequestStream
    from ._answer import Plan
    from ._state import ServerState, Ticket

__all__ = ["SSE_HEADERS", "EndpointResponse", "Receive", "Scope", "Send", "send_json"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # a proxy in front must not hold the stream back
]
#: How long a response may spend telling its client why it ended, once cancelled.
_LAST_WORDS = 1.0


async def send_json(
    send: Send, status: int, body: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A whole JSON response (a msgspec struct or plain data)."""
    data = encode(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class EndpointResponse:
    """The ASGI response to one request of an endpoint: subclasses say how it runs
    (:meth:`run`) and how an error reaches a client that has its first bytes
    (:meth:`error_mid_stream`)."""

    #: The ``endpoint`` label of the server's metrics.
    endpoint = ""

    def __init__(self, server: ServerState, priority: int | None = None) -> None:
        self.server = server
        #: Its request's priority: what it asked, else the endpoint's default.
        self.priority = server.priority_of(self.endpoint, priority)
        #: The response's head went out.
        self.started = False
        #: The request's outcome is known and being sent: a cancellation from here
        #: on cuts it short, unsaid.
        self.answered = False
        self._disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            ticket = self.server.enter(self.priority)
        except OpenAIError as exc:
            await send_json(send, exc.status, exc.body(), exc.headers)
            return
        ended: OpenAIError | None = None
        with ticket:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
                ticket.cancel_scope = nursery.cancel_scope
                if ticket.shed:  # (shed before it had a scope to cancel)
                    nursery.cancel_scope.cancel()
                try:
                    await self.run(send, ticket)
                except OpenAIError as exc:  # the request ended without completing
                    ended = exc
                finally:
                    nursery.cancel_scope.cancel()  # the watcher
            if ticket.stopped and not self.answered and not self._disconnected:
                ended = unavailable(
                    "the server shut down before the request finished", "server_shutting_down"
                )
            elif ticket.shed and not ticket.running and not self._disconnected:
                ended = unavailable(
                    f"the server is at capacity, and this request (priority "
                    f"{self.priority}) gave its place to a more urgent one",
                    "server_overloaded",
                )
        if ended is not None and not self._disconnected:
            with trio.move_on_after(_LAST_WORDS):
                if self.started:
                    await self.error_mid_stream(send, ended)
                else:
                    await send_json(send, ended.status, ended.body(), ended.headers)

    async def _watch_disconnect(self, receive: Receive, scope: trio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._disconnected = True
                scope.cancel()
                return

    async def run(self, send: Send, ticket: Ticket) -> None:
        """Run the request and send its response; raise :class:`OpenAIError` if it
        ends without completing."""
        raise NotImplementedError

    async def error_mid_stream(self, send: Send, error: OpenAIError) -> None:
        """Tell a client that has the response's first bytes that it failed. By
        default nothing more is sent: the body ends without its last chunk, and
        Hypercorn closes the connection, which every HTTP client reports as a broken
        body -- never as a whole one."""

    def count_end(self, stream: RequestStream | None, plan: Plan, reason: str = "") -> None:
        """Count the request's end in the metrics (in a ``finally``: its block has
        exited, so its terminal is known; no stream: it was never admitted).
        ``reason``: the ``finish_reason`` label, if not the terminal's."""
        terminal = None if stream is None else stream.terminal
        if not reason:
            reason = "aborted" if terminal is None else (terminal.finish_reason or "aborted")
        self.server.finished(reason, terminal, plan, endpoint=self.endpoint)

    def completed(self, stream: RequestStream | None) -> OrchOutput:
        """The request's ``"completed"`` terminal -- from here on the response is
        :attr:`answered` -- or raise why it ended otherwise (:meth:`ended`)."""
        terminal = None if stream is None else stream.terminal
        if terminal is None or terminal.finish_reason != "completed":
            raise self.ended(terminal)
        self.answered = True  # from here on, a cancellation cuts it short, unsaid
        return terminal

    def ended(self, terminal: OrchOutput | None) -> OpenAIError:
        """Why a request that did not complete ended, as its client is told."""
        if terminal is not None and terminal.finish_reason == "error":
            return OpenAIError(500, terminal.error or "the request failed", type="server_error")
        return unavailable(
            "the request was aborted: the server is shutting down", "server_shutting_down"
        )
