"""``POST /v1/chat/completions``: one request through the pipeline, as an ASGI response.

:class:`ChatResponse` is a small ASGI application of its own rather than a Starlette
``StreamingResponse`` over an async generator: a generator's cleanup runs when the
garbage collector gets to it, not in structured order. Here one nursery holds the
response and a task that listens for ``http.disconnect``; a client that hangs up --
before the first byte, mid-stream, or while the server is blocked writing to it --
cancels the response, and leaving :meth:`Orchestrator.open_request`'s block aborts
the request at every stage it was submitted to, before the handler returns.

What the client reads is built by :class:`~._answer.Answer`, with no I/O; this
module only moves it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import trio

from .._util import output_size
from ._answer import Answer, Plan, error_event
from ._protocol import OpenAIError, encode, unavailable

if TYPE_CHECKING:
    from .._messages import OrchOutput
    from ._state import ServerState, Ticket

__all__ = ["SSE_HEADERS", "ChatResponse", "send_json"]

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
#: A response encodes at most about this many bytes of outputs into one write: a
#: backlog taken at once (a client that was slow to read, say) is not one
#: multi-megabyte string of events in memory.
WRITE_BYTES = 256 * 1024


def _parts(batch: list[OrchOutput]) -> Iterator[list[OrchOutput]]:
    """``batch`` in parts of about :data:`WRITE_BYTES` of data each (one part, the
    batch itself, when it is small: the common case costs nothing)."""
    if len(batch) == 1:  # the commonest: one output, one part, nothing to count
        yield batch
        return
    start = size = 0
    for index, output in enumerate(batch):
        size += output_size(output.data)
        if size >= WRITE_BYTES:
            yield batch[start : index + 1]
            start, size = index + 1, 0
    if start < len(batch):
        yield batch if start == 0 else batch[start:]


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


class ChatResponse:
    """The ASGI response to one chat completion request (streamed or whole)."""

    def __init__(self, server: ServerState, plan: Plan) -> None:
        self._server = server
        self._plan = plan
        counters = server.metrics.stage_outputs
        self._answer = Answer(
            plan,
            server.model.name,
            lambda stage: counters[stage].inc(),
            max_whole_bytes=None if plan.stream else server.max_answer_bytes,
        )
        self._disconnected = False
        self._started = False  # the response's headers went out
        self._broken = False  # the answer cannot carry it: not bytes, or too large
        self._answered = False  # the request's outcome is known and being sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = self._server
        try:
            ticket = server.enter()
        except OpenAIError as exc:
            await send_json(send, exc.status, exc.body(), exc.headers)
            return
        ended: OpenAIError | None = None
        with ticket:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
                ticket.cancel_scope = nursery.cancel_scope
                try:
                    await self._run(send, ticket)
                except OpenAIError as exc:  # the request ended without completing
                    ended = exc
                finally:
                    nursery.cancel_scope.cancel()  # the watcher
            if ticket.stopped and not self._answered and not self._disconnected:
                ended = unavailable(
                    "the server shut down before the request finished", "server_shutting_down"
                )
        if ended is not None and not self._disconnected:
            with trio.move_on_after(_LAST_WORDS):
                await self._send_error(send, ended)

    async def _watch_disconnect(self, receive: Receive, scope: trio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._disconnected = True
                scope.cancel()
                return

    async def _run(self, send: Send, ticket: Ticket) -> None:
        plan = self._plan
        answer = self._answer
        orchestrator = self._server.orchestrator
        if orchestrator is None:
            raise unavailable("the server is not ready")
        stream = None
        try:
            async with orchestrator.open_request(
                plan.prompt, final_stage_ids=plan.stage_ids
            ) as stream:
                ticket.admitted()
                if plan.stream:
                    await send(
                        {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}
                    )
                    self._started = True
                on_outputs = self._server.on_outputs
                while stream.terminal is None and answer.finish is None:
                    batch = await stream.receive_batch()
                    if on_outputs is not None:
                        on_outputs(batch)
                    for part in _parts(batch):  # a backlog goes out a bounded part at a time
                        try:
                            events = answer.take(part)
                        except OpenAIError:
                            self._broken = True
                            raise
                        if plan.stream and events:
                            await send(
                                {"type": "http.response.body", "body": events, "more_body": True}
                            )
                        if answer.done:
                            break
        except trio.ClosedResourceError:
            raise unavailable("the server is shutting down", "server_shutting_down") from None
        finally:
            # The block has exited: stream.terminal is known. No stream: the request
            # was never admitted (its client left, or the server stopped, first).
            terminal = None if stream is None else stream.terminal
            self._server.finished(self._label(terminal), terminal, plan, endpoint="chat")
        if answer.finish is None:
            raise self._failure(terminal)
        self._answered = True  # from here on, a cancellation cuts it short, unsaid
        if plan.stream:
            await send({"type": "http.response.body", "body": answer.closing(), "more_body": False})
        else:
            await send_json(send, 200, answer.whole(None if terminal is None else terminal.metrics))

    def _label(self, terminal: OrchOutput | None) -> str:
        """The ``finish_reason`` label of the request's end in the metrics."""
        if self._broken:
            return "error"
        if self._answer.finish == "length":
            return "length"  # we ended it: max_tokens reached
        if terminal is None or terminal.finish_reason is None:
            return "aborted"
        return terminal.finish_reason

    # -- endings that are not a completion ------------------------------------------------

    def _failure(self, terminal: OrchOutput | None) -> OpenAIError:
        if terminal is not None and terminal.finish_reason == "error":
            return OpenAIError(500, terminal.error or "the request failed", type="server_error")
        return unavailable(
            "the request was aborted: the server is shutting down", "server_shutting_down"
        )

    async def _send_error(self, send: Send, error: OpenAIError) -> None:
        if self._started:  # mid-stream: an error event, then [DONE]
            body = error_event(error)
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await send_json(send, error.status, error.body(), error.headers)
