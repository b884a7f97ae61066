"""``POST /v1/chat/completions``: one request through the pipeline, as an ASGI response.

:class:`ChatResponse` is a small ASGI application of its own rather than a Starlette
``StreamingResponse`` over an async generator: a generator's cleanup runs when the
garbage collector gets to it, not in structured order. Here one nursery holds the
response and a task that listens for ``http.disconnect``; a client that hangs up --
before the first byte, mid-stream, or while the server is blocked writing to it --
cancels the response, and leaving :meth:`Orchestrator.open_request`'s block aborts
the request at every stage it was submitted to, before the handler returns.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._audio import wav_bytes
from .._messages import OrchOutput
from ._protocol import (
    AudioDelta,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    Message,
    MessageAudio,
    Metrics,
    OpenAIError,
    Usage,
    encode,
)

if TYPE_CHECKING:
    from .._messages import RequestMetrics
    from ._model import FinalOutput
    from ._state import ServerState, Ticket

__all__ = ["ChatResponse", "Plan", "send_json"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # a proxy in front must not hold the stream back
]
_DONE = b"data: [DONE]\n\n"
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


@attrs.frozen
class Plan:
    """A checked chat request, ready to run."""

    prompt: str
    outputs: tuple[FinalOutput, ...]
    stream: bool
    include_usage: bool
    audio_format: str
    token_limit: int | None

    @classmethod
    def of(cls, request: ChatCompletionRequest, outputs: tuple[FinalOutput, ...]) -> Plan:
        return cls(
            prompt=request.prompt(),
            outputs=outputs,
            stream=request.stream,
            include_usage=request.stream_options is not None
            and request.stream_options.include_usage,
            audio_format="wav" if request.audio is None else request.audio.format,
            token_limit=request.token_limit,
        )

    @property
    def stage_ids(self) -> frozenset[int]:
        return frozenset(o.stage_id for o in self.outputs)


class _Ended(Exception):
    """The request ended without completing; ``error`` says how, to the client."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error


class ChatResponse:
    """The ASGI response to one chat completion request (streamed or whole)."""

    def __init__(self, server: ServerState, plan: Plan) -> None:
        self._server = server
        self._plan = plan
        self._model = server.model.name
        self._id = f"chatcmpl-{uuid.uuid4().hex}"
        self._created = int(time.time())
        self._by_stage = {o.stage_id: o for o in plan.outputs}
        self._disconnected = False
        self._started = False  # the response's headers went out
        self._finish: str | None = None  # "stop" or "length", once known
        self._text: list[str] = []
        self._audio: list[bytes] = []
        self._tokens = 0
        self._broken = False  # a stage sent what the API cannot carry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = self._server
        try:
            ticket = server.enter()
        except OpenAIError as exc:
            await send_json(send, exc.status, exc.body(), _retry_after(exc))
            return
        ended: OpenAIError | None = None
        ran = False  # _run returned, or ended the request itself: not cut short
        with ticket:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
                ticket.cancel_scope = nursery.cancel_scope
                try:
                    await self._run(send, ticket)
                    ran = True
                except _Ended as exc:
                    ended = exc.error
                    ran = True
                finally:
                    # Stops the watcher; so the scope has caught a Cancelled even when
                    # nothing else cancelled it, and ``ran`` says whether _run was cut.
                    nursery.cancel_scope.cancel()
            if not ran and ticket.cancel_scope.cancelled_caught and not self._disconnected:
                ended = OpenAIError(
                    503,
                    "the server shut down before the request finished",
                    type="server_error",
                    code="server_shutting_down",
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
        orchestrator = self._server.orchestrator
        if orchestrator is None:
            raise _Ended(_unavailable("the server is not ready"))
        stream = None
        try:
            async with orchestrator.open_request(
                plan.prompt, final_stage_ids=plan.stage_ids
            ) as stream:
                ticket.admitted()
                if plan.stream:
                    await send(
                        {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS}
                    )
                    self._started = True
                while stream.terminal is None and self._finish is None:
                    events = self._take(await stream.receive_batch())
                    if plan.stream and events:
                        await send(
                            {"type": "http.response.body", "body": events, "more_body": True}
                        )
        except trio.ClosedResourceError:
            raise _Ended(_unavailable("the server is shutting down")) from None
        finally:
            if stream is not None:  # the block has exited: stream.terminal is known
                self._server.finished(self._label(stream.terminal), stream.terminal, plan)
        terminal = stream.terminal
        if self._finish is None:
            raise _Ended(self._failure(terminal))
        if plan.stream:
            await send({"type": "http.response.body", "body": self._closing(), "more_body": False})
        else:
            await send_json(send, 200, self._whole(None if terminal is None else terminal.metrics))

    def _label(self, terminal: OrchOutput | None) -> str:
        """The ``finish_reason`` label of the request's end in the metrics."""
        if self._broken:
            return "error"
        if self._finish == "length":
            return "length"  # we ended it: max_tokens reached
        if terminal is None or terminal.finish_reason is None:
            return "aborted"
        return terminal.finish_reason

    # -- outputs to events --------------------------------------------------------------

    def _take(self, batch: list[OrchOutput]) -> bytes:
        """Record a batch of outputs; return its SSE events (streaming)."""
        events = bytearray()
        counters = self._server.metrics.stage_outputs
        limit = self._plan.token_limit
        for output in batch:
            if output.data is not None and output.finish_reason in (None, "completed"):
                counters[output.stage_id].inc()
                delta = self._delta(output)
                if self._plan.stream:
                    events += self._event([ChunkChoice(0, delta)])
            if output.finished:  # always the last
                if output.finish_reason == "completed":
                    self._finish = "stop"
            elif limit is not None and self._tokens >= limit:
                self._finish = "length"
                break
        return bytes(events)

    def _delta(self, output: OrchOutput) -> Delta:
        final = self._by_stage[output.stage_id]
        role = None if self._tokens or self._audio else "assistant"
        if final.modality == "text":
            text = output.data if isinstance(output.data, str) else str(output.data)
            self._text.append(text)
            self._tokens += 1
            return Delta(role=role, content=text)
        data = output.data
        if not isinstance(data, (bytes, bytearray, memoryview)):
            self._broken = True
            raise _Ended(
                OpenAIError(
                    500,
                    f"{final.label} sent audio that is not bytes: {type(data).__name__}",
                    type="server_error",
                )
            )
        pcm = bytes(data)
        self._audio.append(pcm)
        if self._plan.audio_format == "wav":
            pcm = wav_bytes(pcm, final.sample_rate)
        return Delta(role=role, audio=AudioDelta(self._audio_id, _b64(pcm)))

    @property
    def _audio_id(self) -> str:
        return f"audio-{self._id[9:]}"

    def _event(self, choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        chunk = ChatCompletionChunk(
            id=self._id, created=self._created, model=self._model, choices=choices, usage=usage
        )
        return b"data: " + encode(chunk) + b"\n\n"

    def _usage(self) -> Usage:
        prompt = len(self._plan.prompt.split())
        return Usage(prompt, self._tokens, prompt + self._tokens)

    def _closing(self) -> bytes:
        """The finish chunk, the usage chunk if asked for, ``[DONE]``."""
        events = self._event([ChunkChoice(0, Delta(), self._finish)])
        if self._plan.include_usage:
            events += self._event([], self._usage())
        return events + _DONE

    def _whole(self, metrics: RequestMetrics | None) -> ChatCompletion:
        text = "".join(self._text)
        wants_text = any(o.modality == "text" for o in self._plan.outputs)
        audio = None
        audio_outputs = [o for o in self._plan.outputs if o.modality == "audio"]
        if audio_outputs:
            pcm = b"".join(self._audio)
            if self._plan.audio_format == "wav":
                pcm = wav_bytes(pcm, audio_outputs[0].sample_rate)
            audio = MessageAudio(self._audio_id, _b64(pcm), int(time.time()) + 3600, text)
        message = Message(content=text if wants_text else None, audio=audio)
        return ChatCompletion(
            id=self._id,
            created=self._created,
            model=self._model,
            choices=[Choice(0, message, self._finish or "stop")],
            usage=self._usage(),
            metrics=_metrics(metrics, self._plan),
        )

    # -- endings that are not a completion ------------------------------------------------

    def _failure(self, terminal: OrchOutput | None) -> OpenAIError:
        if terminal is not None and terminal.finish_reason == "error":
            return OpenAIError(500, terminal.error or "the request failed", type="server_error")
        return OpenAIError(
            503,
            "the request was aborted: the server is shutting down",
            type="server_error",
            code="server_shutting_down",
        )

    async def _send_error(self, send: Send, error: OpenAIError) -> None:
        if self._started:  # mid-stream: an error event, then [DONE]
            body = b"data: " + encode(error.body()) + b"\n\n" + _DONE
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await send_json(send, error.status, error.body(), _retry_after(error))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, type="server_error", code="server_unavailable")


def _retry_after(error: OpenAIError) -> list[tuple[bytes, bytes]]:
    return [(b"retry-after", b"1")] if error.status == 503 else []


def _metrics(metrics: RequestMetrics | None, plan: Plan) -> Metrics:
    def first(modality: str) -> float | None:
        if metrics is None:
            return None
        times = [
            t
            for o in plan.outputs
            if o.modality == modality
            and (t := metrics.time_to_first_output(o.stage_id)) is not None
        ]
        return min(times, default=None)

    return Metrics(first("text"), first("audio"), 0.0 if metrics is None else metrics.e2e_latency)
