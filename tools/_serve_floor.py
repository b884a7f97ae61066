"""The serving benchmark's floor: bare Hypercorn on Trio streaming the same SSE bytes.

``tools/bench_serve.py`` runs this as a process of its own (``python
tools/_serve_floor.py [pacing options]``; it prints its URL) beside the server, and
sends it the same clients at the same levels. It is one ASGI app -- no Starlette, no
orchestrator, no pipeline -- served by Hypercorn's Trio worker as the server is, that
answers every ``POST`` with the stream the server would send for the same request.
Its writes come at one of two paces:

- **paced**, as the stamped pipeline paces a stream on its own: the headers, then
  one text event every ``1 / tokens_per_second`` s (the thinker's words for the
  prompt), an audio event of code2wav's size half a token interval after the token
  whose codes complete it (the talker makes them twice as fast as tokens come), then
  the finish chunk and ``[DONE]``. Each stream keeps its own time: writes of
  different streams meet only by chance;
- **replayed**: each stream writes what and when the server's same stream (its
  client's key) wrote in the level just run, relative to the level's start -- the
  same bursts of writes, when the pipeline delivers many streams' outputs at once.

Each write is one ASGI ``send``, and each event's bytes are the server's (the same
JSON, keys in the same order; the chunk ids and stamps differ, not their sizes),
built from templates made before the stream starts: per write, one join. The
benchmark's trace middleware wraps this app as it wraps the server's, so *response
-> socket* here is the time from the write's timer firing to Hypercorn's ``send``
returning: what Hypercorn, h11, the socket and the scheduler cost, with nothing of
ours above them. Its garbage collector is set as ``omni_trio.serve`` sets the
server's while it serves (what it held at startup frozen, full collections rarer):
the floor pauses for collections no longer than the server does.
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import math
import time
import uuid
from typing import Any

import _serve_trace as tracing
import bench_serve
import msgspec
from starlette.types import Receive, Scope, Send

#: The server's SSE headers (``omni_trio.serve``'s chat response sends these).
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
#: PCM bytes per codec code: 40 ms of 16-bit mono at 24 kHz (the demo's code2wav).
PCM_PER_CODE = 1920
_HOLE = "\x00hole\x00"  # where an event's payload goes in its template
_DONE = b"data: [DONE]\n\n"


def schedule(pacing: bench_serve.Pacing) -> list[tuple[float, str]]:
    """The paced writes of one stream after its headers, in order: ``(seconds after
    the headers, its chunks: "t" text, "a" audio)``."""
    tick = 1.0 / pacing.tokens_per_second
    writes = [((index + 1) * tick, "t") for index in range(pacing.max_tokens)]
    codes = pacing.max_tokens * pacing.codes_per_token
    for index in range(pacing.audio_chunks):
        done = min(codes, (index + 1) * pacing.chunk_codes)  # codes that complete it
        token = min(pacing.max_tokens, math.ceil(done / pacing.codes_per_token))
        writes.append((token * tick + tick / 2, "a"))
    writes.sort(key=lambda write: write[0])
    return writes


def _pcm_sizes(pacing: bench_serve.Pacing) -> list[int]:
    codes = pacing.max_tokens * pacing.codes_per_token
    return [
        (min(codes, (i + 1) * pacing.chunk_codes) - i * pacing.chunk_codes) * PCM_PER_CODE
        for i in range(pacing.audio_chunks)
    ]


class _Events:
    """One stream's SSE events, from templates made before it starts."""

    def __init__(self, model: str) -> None:
        chunk_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.audio_id = f"audio-{chunk_id[9:]}"
        self.head = {"id": chunk_id, "object": "chat.completion.chunk"}
        self.head |= {"created": int(time.time()), "model": model}
        self.first_text = self._template({"role": "assistant", "content": _HOLE})
        self.text = self._template({"content": _HOLE})
        audio = {"audio": {"id": self.audio_id, "data": _HOLE}}
        self.first_audio = self._template({"role": "assistant", **audio})
        self.audio = self._template(audio)

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        body = msgspec.json.encode({**self.head, "choices": [choice], "usage": None})
        return b"data: " + body + b"\n\n"

    def _template(self, delta: dict[str, Any]) -> tuple[bytes, bytes]:
        before, _, after = self._chunk(delta).partition(msgspec.json.encode(_HOLE)[1:-1])
        return before, after

    def closing(self) -> bytes:
        return self._chunk({}, "stop") + _DONE


def _audio_b64(size: int) -> bytes:
    """Base64 of ``size`` bytes of PCM, all but its first 12 characters (9 bytes):
    an event puts its stamp's there."""
    return base64.b64encode(bytes(size))[12:]


class FloorApp:
    """The ASGI app: every ``POST`` gets its stream, paced or replayed, the trace told
    each write's stamps before its ``send`` (``_serve_trace.note_sending``).

    ``POST /_bench/replay`` sets the writes to replay: ``{"start": ns, "streams":
    {key: [[ns after start, kinds], ...]}}`` (monotonic ns; a stream's key is its
    client's, ``_serve_trace.STREAM_HEADER``); a stream with no writes set is paced.
    """

    def __init__(self, pacing: bench_serve.Pacing, model: str) -> None:
        self.pacing = pacing
        self.model = model
        self.schedule = schedule(pacing)
        self.audio = [_audio_b64(size) for size in _pcm_sizes(pacing)]
        self.replay_start = 0
        self.replay: dict[str, list[list[Any]]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "http":
            body = await _body(receive)
            if scope["path"] == "/_bench/replay":
                plan = json.loads(body)
                self.replay_start, self.replay = plan["start"], plan["streams"]
                await send({"type": "http.response.start", "status": 204, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            await self._stream(_prompt(body), str(tracing.stream_key(scope)), send)

    def _writes(self, key: str) -> list[tuple[float, str]]:
        """The stream's writes: (Trio time, its chunks' kinds), in order."""
        import trio

        now = trio.current_time()
        replayed = self.replay.get(key)
        if replayed is None:
            return [(now + at, kinds) for at, kinds in self.schedule]
        zero = now - time.monotonic_ns() / 1e9  # Trio's time at monotonic 0
        return [(zero + (self.replay_start + at) / 1e9, kinds) for at, kinds in replayed]

    async def _stream(self, prompt: str, key: str, send: Send) -> None:
        import trio

        from omni_trio.demo.engines import response_tokens

        words = response_tokens(prompt, self.pacing.max_tokens)
        events = _Events(self.model)
        first = True
        texts = audios = 0
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for deadline, kinds in self._writes(key):
            await trio.sleep_until(deadline)
            now = time.monotonic_ns()
            parts = []
            for kind in kinds:
                if kind == "t":
                    before, after = events.first_text if first else events.text
                    word = words[texts % len(words)]
                    payload = msgspec.json.encode(f"{now} {word}")[1:-1]
                    texts += 1
                else:
                    before, after = events.first_audio if first else events.audio
                    stamp = now.to_bytes(8, "little") + b"\x00"
                    audio = self.audio[min(audios, len(self.audio) - 1)]
                    payload = base64.b64encode(stamp) + audio
                    audios += 1
                first = False
                parts += (before, payload, after)
            tracing.note_sending([now] * len(kinds), kinds, now)
            body = b"".join(parts)
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": events.closing(), "more_body": False})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _prompt(body: bytes) -> str:
    """The request's last message's text (what the thinker would get)."""
    try:
        return str(json.loads(body)["messages"][-1]["content"])
    except (ValueError, LookupError, TypeError):
        return ""


def main(argv: list[str] | None = None) -> None:
    """Serve the floor on a free loopback port; print its URL; run until killed."""
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    parser = argparse.ArgumentParser(prog="_serve_floor.py")
    bench_serve.pacing_arguments(parser)
    parser.add_argument("--model", default="qwen-omni-sim")
    args = parser.parse_args(argv)
    app = tracing.trace_middleware(tracing.Trace())(
        FloorApp(bench_serve.pacing_of(args), args.model)
    )
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(serve, app, config)
            # The garbage collector as omni_trio.serve sets it while it serves: the
            # floor's pauses no longer than the server's.
            gc.freeze()
            young, middle, full = gc.get_threshold()
            gc.set_threshold(young, middle, max(full, 100))
            print(urls[0], flush=True)

    trio.run(run)


if __name__ == "__main__":
    main()
