"""``POST /v1/chat/completions``: one request through the pipeline, as an ASGI response.

:class:`ChatResponse` is an :class:`~._response.EndpointResponse`: one nursery holds
the response and a task that listens for ``http.disconnect``; a client that hangs up
-- before the first byte, mid-stream, or while the server is blocked writing to it
-- cancels the response, and leaving :meth:`Orchestrator.open_request`'s block
aborts the request at every stage it was submitted to, before the handler returns.

What the client reads is built by :class:`~._answer.Answer`, with no I/O; this
module only moves it, a bounded piece at a time: a response blocked writing to a
client that reads nothing holds its request's unread outputs (its window) and one
piece of their events, about :data:`WRITE_BYTES` (with the server's HTTP framing, a
copy of that piece), whatever the size of an output.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import trio

from .._util import output_size
from ._answer import PIECE_BYTES, Answer, Plan, error_event
from ._protocol import OpenAIError, unavailable
from ._response import SSE_HEADERS, EndpointResponse, Receive, Scope, Send, send_json

if TYPE_CHECKING:
    from .._messages import OrchOutput
    from ._state import ServerState, Ticket

__all__ = ["SSE_HEADERS", "ChatResponse", "Receive", "Scope", "Send", "send_json"]

#: A response encodes at most about this many bytes of outputs into one write: a
#: backlog taken at once (a client that was slow to read, say) is not one
#: multi-megabyte string of events in memory, and neither is one large output's
#: event (:meth:`~._answer.Answer.pieces`).
WRITE_BYTES = PIECE_BYTES


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


class ChatResponse(EndpointResponse):
    """The ASGI response to one chat completion request (streamed or whole)."""

    endpoint = "chat"

    def __init__(self, server: ServerState, plan: Plan) -> None:
        super().__init__(server, plan.priority)
        self._plan = plan
        counters = server.metrics.stage_outputs
        self._answer = Answer(
            plan,
            server.model.name,
            lambda stage: counters[stage].inc(),
            max_whole_bytes=None if plan.stream else server.max_answer_bytes,
        )
        self._broken = False  # the answer cannot carry it: not bytes, or too large
        #: What closes the event the last piece written left open (b"": none is).
        self._open_event_tail = b""

    async def error_mid_stream(self, send: Send, error: OpenAIError) -> None:
        """Streaming: an error event, then ``[DONE]`` (after the end of an event that
        was cut short between its pieces)."""
        body = self._open_event_tail + error_event(error)
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def run(self, send: Send, ticket: Ticket) -> None:
        plan = self._plan
        answer = self._answer
        orchestrator = self.server.orchestrator
        if orchestrator is None:
            raise unavailable("the server is not ready")
        stream = None
        try:
            async with orchestrator.open_request(
                plan.prompt, final_stage_ids=plan.stage_ids, priority=ticket.priority
            ) as stream:
                ticket.admitted()
                if plan.stream:
                    await send(
                        {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}
                    )
                    self.started = True
                on_outputs = self.server.on_outputs
                while stream.terminal is None and answer.finish is None:
                    batch = await stream.receive_batch()
                    if on_outputs is not None:
                        on_outputs(batch)
                    self.server.stage_waits(batch, ticket.priority)
                    for part in _parts(batch):  # a backlog goes out a bounded part at a time
                        await self._write(send, part)
                        if answer.done:
                            break
        except trio.ClosedResourceError:
            raise unavailable("the server is shutting down", "server_shutting_down") from None
        finally:
            terminal = None if stream is None else stream.terminal
            self.count_end(stream, plan, self._label(terminal))
        if answer.finish is None:
            raise self.ended(terminal)
        self.answered = True  # from here on, a cancellation cuts it short, unsaid
        if plan.stream:
            await send({"type": "http.response.body", "body": answer.closing(), "more_body": False})
        else:
            await send_json(send, 200, answer.whole(None if terminal is None else terminal.metrics))

    async def _write(self, send: Send, part: list[OrchOutput]) -> None:
        """Take ``part`` and, streaming, write its events a piece at a time (a large
        output's event in several: see :meth:`Answer.pieces`)."""
        answer = self._answer
        stream = self._plan.stream
        try:
            for events in answer.pieces(part):
                if stream and events:
                    await send({"type": "http.response.body", "body": events, "more_body": True})
                    self._open_event_tail = answer.open_event_tail
                del events  # written: not held while the next piece is made
        except OpenAIError:
            self._broken = True
            raise

    def _label(self, terminal: OrchOutput | None) -> str:
        """The ``finish_reason`` label of the request's end in the metrics."""
        if self._broken:
            return "error"
        if self._answer.finish == "length":
            return "length"  # we ended it: max_tokens reached
        if terminal is None or terminal.finish_reason is None:
            return "aborted"
        return terminal.finish_reason
