"""The serving benchmark's tracing, in the server's process and the floor's: per SSE
chunk, when the response got it and when the ASGI ``send`` that carried it returned.

The response (the app's outputs hook, or the floor) calls :func:`note_sending` with
the stamps of the chunks its next body ``send`` carries, in its own task; the ASGI
middleware from :func:`trace_middleware` wraps ``send`` and notes, when that ``send``
returns, each chunk's stream, kind, stamp, and both times in a :class:`Trace`. It
also counts the process's garbage collections, and serves ``GET /_bench/trace``: the
trace so far, emptied.
"""

from __future__ import annotations

import gc
import json
import time
from array import array
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Pending:
    stream: int  # the client's key for the stream (STREAM_HEADER), or -1
    received: int = 0
    stamps: list[int] | None = None
    kinds: str = ""  # per stamp: "t" text, "a" audio


#: The header the clients name their stream with (``index * 1000 + round``), for the
#: trace: the floor replays a server stream's writes for the client's same stream.
STREAM_HEADER = b"x-bench-stream"


_current: ContextVar[_Pending] = ContextVar("serve_trace_pending")


@dataclass
class Trace:
    """Per SSE chunk: its stream (the client's key), whether it is audio, the stage's
    stamp, when the response got it, when its send returned; and the process's garbage
    collections (generation, ns it stopped for)."""

    stream: array[int] = field(default_factory=lambda: array("q"))
    audio: array[int] = field(default_factory=lambda: array("q"))
    stamp: array[int] = field(default_factory=lambda: array("q"))
    received: array[int] = field(default_factory=lambda: array("q"))
    sent: array[int] = field(default_factory=lambda: array("q"))
    gc_generation: array[int] = field(default_factory=lambda: array("q"))
    gc_pause: array[int] = field(default_factory=lambda: array("q"))
    _gc_start: int = 0

    def __post_init__(self) -> None:
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.monotonic_ns()
        else:
            self.gc_generation.append(info["generation"])
            self.gc_pause.append(time.monotonic_ns() - self._gc_start)

    def take(self) -> dict[str, list[int]]:
        names = ("stream", "audio", "stamp", "received", "sent", "gc_generation", "gc_pause")
        taken = {name: getattr(self, name).tolist() for name in names}
        for name in names:
            setattr(self, name, array("q"))
        return taken


def note_sending(stamps: list[int], kinds: str, received: int) -> None:
    """In a response's task: the stamps of the chunks its next body ``send`` carries,
    their kinds ("t" text, "a" audio, one per stamp), and when it got them (monotonic
    ns), for :func:`trace_middleware`."""
    pending = _current.get(None)
    if pending is not None:
        pending.received = received
        pending.stamps = stamps
        pending.kinds = kinds


def stream_key(scope: Any) -> int:
    """The client's key for the stream of an HTTP ``scope`` (-1: none)."""
    for name, value in scope.get("headers", ()):
        if name == STREAM_HEADER:
            return int(value)
    return -1


def trace_middleware(trace: Trace) -> type:
    """An ASGI middleware that notes when the ``send`` of the chunks
    :func:`note_sending` was told of returned, and serves ``GET /_bench/trace``."""

    class TraceMiddleware:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await self.app(scope, receive, send)
                return
            if scope["path"] == "/_bench/trace":
                body = json.dumps(trace.take()).encode()
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": body})
                return
            pending = _Pending(stream_key(scope))
            _current.set(pending)

            async def traced_send(message: Any) -> None:
                await send(message)
                if pending.stamps and message["type"] == "http.response.body":
                    sent = time.monotonic_ns()
                    for stamp, kind in zip(pending.stamps, pending.kinds, strict=True):
                        trace.stream.append(pending.stream)
                        trace.audio.append(kind == "a")
                        trace.stamp.append(stamp)
                        trace.received.append(pending.received)
                        trace.sent.append(sent)
                    pending.stamps = None

            await self.app(scope, receive, traced_send)

    return TraceMiddleware
