"""Serving benchmark: the HTTP server's added latency, CPU and memory per SSE chunk.

Runs the demo pipeline (thinker -> talker -> code2wav, one worker process each) with
its pacing turned down, twice in one run, and a floor beside it:

1. **in-process**: this process opens the pipeline and an orchestrator and runs N
   concurrent ``open_request`` consumers (``receive_batch()``, as the server does);
2. **server**: a server process (``app_for_config`` + ``serve``, what ``omni-trio
   serve`` runs, plus the tracing below) over the same pipeline, and N concurrent
   streaming clients in this process (Trio, raw sockets, HTTP/1.1, chunked SSE);
3. **floor**: after each server level, the same clients at the same level, twice,
   against bare Hypercorn on Trio (``tools/_serve_floor.py``: one ASGI app, no
   Starlette, no orchestrator) streaming the same SSE bytes, traced the same way:
   *paced* (each stream on its own clock, at the pipeline's pace) and *replay* (each
   stream writing what and when the server's same stream wrote in that level).

The stages stamp every output with ``time.monotonic_ns()`` as they yield it (the
thinker puts it before each text token, code2wav in the first 8 bytes of each PCM
chunk; CLOCK_MONOTONIC is one clock for every process on Linux). Per chunk:

- in-process: stage -> consumer (``receive_batch()`` returned);
- server: stage -> response (``receive_batch()`` returned in the chat response),
  response -> socket (the ASGI ``send`` of its SSE events returned: Hypercorn wrote
  the bytes to the socket), stage -> socket, and stage -> client (this process read
  the bytes; not parsed yet).

**Added latency** per chunk is response -> socket, measured per chunk in the server
process; the stage -> socket distribution next to the in-process stage -> consumer one
shows it from the stage's output, with the orchestrator's own path in both. The
floor's response -> socket (its write's timer fired -> its ``send`` returned) is what
Hypercorn, h11, the socket and the scheduler cost with nothing of ours above them.
The goal: added p99 <= 2 ms at the top level, or within 1 ms of the floor's p99. The
tracing (``tools/_serve_trace.py``) is the same in the server and the floors.

The server process's CPU per chunk is its utime + stime (``/proc/PID/stat``) over a
level / the chunks its clients received; memory per open stream is its RSS with K
streams held open and idle (the thinker waits before its first token for a prompt
starting with ``hold``) minus its RSS with none, / K.

Run::

    PYTHONPATH=src python tools/bench_serve.py [--levels 1,10,50,200] [--json FILE]

This file is also the stamped stages' module (the workers import it by name) and the
server's entry (``python tools/bench_serve.py _server ...``).
"""

from __future__ import annotations

import argparse
import base64
import bisect
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
import urllib.request
from array import array
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import _serve_trace as tracing
import msgspec

HOLD = "hold"  # a prompt starting with this waits before its first token
PROMPT = "Tell me a story about a lighthouse."
TOOLS = Path(__file__).resolve().parent


# -- the stamped stages (imported by name in the workers: keep this module light) -------


def _stamp_text(token: str) -> str:
    return f"{time.monotonic_ns()} {token}"


def _stamp_pcm(pcm: bytes) -> bytes:
    return time.monotonic_ns().to_bytes(8, "little") + pcm[8:]


def stamped_thinker(tokens_per_second: float = 50.0, max_tokens: int = 40) -> Any:
    """The demo thinker; each text output starts with the monotonic ns it was yielded at."""
    from omni_trio.demo.engines import thinker
    from omni_trio.process import Last

    inner = thinker(tokens_per_second, max_tokens)

    async def engine(request: Any, io: Any) -> AsyncIterator[Any]:
        import trio

        if str(request.inputs).startswith(HOLD):
            await trio.sleep_forever()  # a stream held open, idle, until aborted
        async with aclosing(inner(request, io)) as outputs:  # type: ignore[type-var]
            async for item in outputs:
                if isinstance(item, Last):
                    yield Last(_stamp_text(item.data))
                else:
                    yield _stamp_text(item)

    return engine


def stamped_code2wav(chunk_codes: int = 25) -> Any:
    """The demo code2wav; each PCM output's first 8 bytes are the monotonic ns it was
    yielded at (little-endian)."""
    from omni_trio.demo.engines import code2wav
    from omni_trio.process import Last

    inner = code2wav(chunk_codes)

    async def engine(request: Any, io: Any) -> AsyncIterator[Any]:
        async with aclosing(inner(request, io)) as outputs:  # type: ignore[type-var]
            async for item in outputs:
                if isinstance(item, Last):
                    yield Last(_stamp_pcm(item.data))
                else:
                    yield _stamp_pcm(item)

    return engine


def stamp_of(data: Any) -> int:
    """The stage's stamp on an output's data (text or PCM)."""
    if isinstance(data, str):
        return int(data.partition(" ")[0])
    return int.from_bytes(bytes(data[:8]), "little")


@dataclass(frozen=True)
class Pacing:
    tokens_per_second: float
    max_tokens: int
    codes_per_token: int = 4
    chunk_codes: int = 25

    @property
    def audio_chunks(self) -> int:
        return math.ceil(self.max_tokens * self.codes_per_token / self.chunk_codes)

    def args(self) -> list[str]:
        return [
            f"--tokens-per-second={self.tokens_per_second}",
            f"--max-tokens={self.max_tokens}",
            f"--chunk-codes={self.chunk_codes}",
        ]


def bench_config(pacing: Pacing) -> Any:
    """The demo pipeline, its thinker and code2wav stamped, its pacing from ``pacing``
    (the talker makes codes twice as fast as the thinker's tokens need)."""
    import msgspec

    from omni_trio.demo.runner import template

    config = template()
    thinker, talker, code2wav = config.stages
    thinker = msgspec.structs.replace(
        thinker,
        engine="bench_serve:stamped_thinker",
        engine_args={
            "tokens_per_second": pacing.tokens_per_second,
            "max_tokens": pacing.max_tokens,
        },
    )
    talker = msgspec.structs.replace(
        talker,
        engine_args={
            "codes_per_token": pacing.codes_per_token,
            "codes_per_second": 2 * pacing.codes_per_token * pacing.tokens_per_second,
        },
    )
    code2wav = msgspec.structs.replace(
        code2wav,
        engine="bench_serve:stamped_code2wav",
        engine_args={"chunk_codes": pacing.chunk_codes},
    )
    return msgspec.structs.replace(config, stages=[thinker, talker, code2wav])


def _eventful(output: Any) -> bool:
    """Whether the chat response turns ``output`` into an SSE chunk (as its answer
    does: data, and not an aborted or failed end)."""
    return output.data is not None and output.finish_reason in (None, "completed")


# -- the server process ---------------------------------------------------------------


def _note_outputs(batch: list[Any]) -> None:
    """The app's ``on_outputs`` hook (runs as the response takes a batch, in its
    task): note when, and which stamped chunks, for the middleware's ``send``."""
    received = time.monotonic_ns()
    chunks = [o.data for o in batch if _eventful(o)]
    kinds = "".join("t" if isinstance(data, str) else "a" for data in chunks)
    tracing.note_sending([stamp_of(data) for data in chunks], kinds, received)


def _server_main(argv: list[str]) -> None:
    """``bench_serve.py _server``: serve the stamped pipeline on a free port; print
    the URL; stop gracefully on SIGTERM."""
    from omni_trio._runtime import run_under_signals
    from omni_trio.serve import app_for_config, serve

    parser = argparse.ArgumentParser(prog="bench_serve.py _server")
    pacing_arguments(parser)
    parser.add_argument("--profile", type=Path)
    args = parser.parse_args(argv)
    config = bench_config(pacing_of(args))
    app = app_for_config(config, on_outputs=_note_outputs)
    app.add_middleware(tracing.trace_middleware(tracing.Trace()))

    async def main(stopping: Any) -> None:
        import trio

        async with trio.open_nursery() as nursery:
            url = await nursery.start(partial(serve, app, port=0, stopping=stopping))
            print(url, flush=True)

    if args.profile is None:
        run_under_signals(main, grace=15.0)
        return
    from pyinstrument import Profiler

    with Profiler(interval=0.0005, async_mode="disabled") as profiler:
        run_under_signals(main, grace=15.0)
    args.profile.write_text(profiler.output_text(unicode=True, color=False, show_all=True))


# -- the clients ------------------------------------------------------------------------


class _AudioDelta(msgspec.Struct):
    data: str = ""


class _Delta(msgspec.Struct):
    content: str | None = None
    audio: _AudioDelta | None = None


class _Choice(msgspec.Struct):
    delta: _Delta
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    """What the clients read of a chat completion chunk."""

    choices: list[_Choice]


def _client_types() -> Any:
    return msgspec.json.Decoder(_Chunk)


@dataclass
class Level:
    """What one level (N concurrent streams) measured."""

    streams: int
    requests: int = 0
    wall: float = 0.0
    text_chunks: int = 0
    audio_chunks: int = 0
    latency: array[int] = field(default_factory=lambda: array("q"))  # stage -> here
    errors: list[str] = field(default_factory=list)
    start: int = 0  # monotonic ns, as its clients began
    cpu: float = 0.0  # seconds, of the process measured
    busy: float = 0.0  # the machine's CPU use over the level, 0..1
    others: float = 0.0  # of which processes not of this benchmark (other users)

    @property
    def chunks(self) -> int:
        return self.text_chunks + self.audio_chunks


class _Stream:
    """One streaming chat completion over a raw socket: HTTP/1.1, chunked, SSE."""

    def __init__(self, level: Level, decoder: Any, pacing: Pacing) -> None:
        self.level = level
        self.decoder = decoder
        self.pacing = pacing
        self.finishes: list[str] = []
        self.done = 0
        self.after_done = False
        self.text = 0
        self.audio = 0

    async def run(self, port: int, model: str, prompt: str, key: int) -> None:
        import trio

        body = json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "stream": True,
                "modalities": ["text", "audio"],
                "audio": {"format": "pcm16"},
            }
        ).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{tracing.STREAM_HEADER.decode()}: {key}\r\n\r\n"
        ).encode()
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(head + body)
            await self._read(stream)
        self._check()

    async def _read(self, stream: Any) -> None:
        buffer = bytearray()
        while b"\r\n\r\n" not in buffer:
            data = await stream.receive_some(65536)
            if not data:
                raise ConnectionError("closed before the response's headers")
            buffer += data
        end = buffer.index(b"\r\n\r\n")
        head = bytes(buffer[:end]).lower()
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            raise ConnectionError(f"status {status}: {bytes(buffer[end + 4 :])[:300]!r}")
        if b"transfer-encoding: chunked" not in head:
            raise ConnectionError("the SSE response is not chunked")
        body = buffer[end + 4 :]
        events = bytearray()
        arrived = time.monotonic_ns()
        while True:
            ended = self._unchunk(body, events)
            self._events(events, arrived)
            if ended:
                return
            data = await stream.receive_some(1 << 18)
            arrived = time.monotonic_ns()
            if not data:
                raise ConnectionError("closed mid-stream")
            body += data

    @staticmethod
    def _unchunk(body: bytearray, events: bytearray) -> bool:
        """Move the complete chunks of ``body`` to ``events``; ``True`` at the last."""
        pos = 0
        try:
            while True:
                eol = body.find(b"\r\n", pos)
                if eol < 0:
                    return False
                size = int(body[pos:eol], 16)
                if size == 0:
                    return True
                if len(body) < eol + 4 + size:
                    return False
                events += body[eol + 2 : eol + 2 + size]
                pos = eol + 4 + size
        finally:
            del body[:pos]

    def _events(self, events: bytearray, arrived: int) -> None:
        level = self.level
        while True:
            end = events.find(b"\n\n")
            if end < 0:
                return
            event = bytes(events[:end])
            del events[: end + 2]
            if not event.startswith(b"data: "):
                level.errors.append(f"not an SSE data line: {event[:80]!r}")
                continue
            if self.done:
                self.after_done = True
            if event == b"data: [DONE]":
                self.done += 1
                continue
            chunk = self.decoder.decode(event[6:])
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content is not None:
                    level.latency.append(arrived - stamp_of(delta.content))
                    self.text += 1
                if delta.audio is not None:
                    stamp = base64.b64decode(delta.audio.data[:12])
                    level.latency.append(arrived - stamp_of(stamp))
                    self.audio += 1
                if choice.finish_reason is not None:
                    self.finishes.append(choice.finish_reason)

    def _check(self) -> None:
        level = self.level
        level.text_chunks += self.text
        level.audio_chunks += self.audio
        problems = []
        if self.finishes != ["stop"]:
            problems.append(f"finish_reasons {self.finishes}")
        if self.done != 1 or self.after_done:
            problems.append(f"[DONE] {self.done} times, events after it: {self.after_done}")
        if self.text != self.pacing.max_tokens:
            problems.append(f"{self.text} text chunks, not {self.pacing.max_tokens}")
        if self.audio != self.pacing.audio_chunks:
            problems.append(f"{self.audio} audio chunks, not {self.pacing.audio_chunks}")
        if problems:
            level.errors.append("; ".join(problems))


def _per_client(streams: int) -> int:
    """Requests each client makes, back to back: at least 5 per level in all."""
    return math.ceil(max(streams, 5) / streams)


async def _clients(
    port: int, model: str, level: Level, pacing: Pacing, start: int | None = None
) -> None:
    """``level.streams`` clients, starting spread over one token interval (at the same
    offsets at every run of a level), from ``start`` (monotonic ns) if given."""
    import trio

    decoder = _client_types()
    spread = 1.0 / pacing.tokens_per_second
    offsets = random.Random(level.streams)
    if start is not None:
        await trio.sleep(max(0, start - time.monotonic_ns()) / 1e9)
    level.start = time.monotonic_ns()

    async def client(index: int, offset: float) -> None:
        await trio.sleep(offset)
        for round_ in range(_per_client(level.streams)):
            prompt, key = f"{PROMPT} {index}.{round_}", index * 1000 + round_
            try:
                await _Stream(level, decoder, pacing).run(port, model, prompt, key)
            except (OSError, ValueError) as exc:
                level.errors.append(f"{type(exc).__name__}: {exc}")
            level.requests += 1

    async with trio.open_nursery() as nursery:
        for index in range(level.streams):
            nursery.start_soon(client, index, offsets.random() * spread)


async def _hold(port: int, model: str, count: int, rss: Callable[[], int]) -> tuple[int, int]:
    """Open ``count`` streams whose first token never comes; RSS before and with them."""
    import trio

    before = rss()
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": HOLD}], "stream": True}
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    opened = 0
    streams: list[Any] = []
    try:
        for _ in range(count):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            streams.append(stream)
            await stream.send_all(head + body)
        for stream in streams:  # each response started: its request was admitted
            data = await stream.receive_some(65536)
            if data.startswith(b"HTTP/1.1 200"):
                opened += 1
        await trio.sleep(1.0)
        held = rss()
    finally:
        for stream in streams:
            await stream.aclose()
    if opened != count:
        raise RuntimeError(f"only {opened} of {count} held streams were admitted")
    await trio.sleep(1.0)  # the server aborts them
    return before, held


# -- the in-process path ----------------------------------------------------------------


async def _inprocess_level(orch: Any, level: Level, pacing: Pacing) -> None:
    import trio

    spread = 1.0 / pacing.tokens_per_second

    async def consumer(index: int) -> None:
        await trio.sleep(random.random() * spread)
        for round_ in range(_per_client(level.streams)):
            text = audio = 0
            async with orch.open_request(f"{PROMPT} {index}.{round_}") as stream:
                while stream.terminal is None:
                    batch = await stream.receive_batch()
                    now = time.monotonic_ns()
                    for output in batch:
                        if _eventful(output):
                            level.latency.append(now - stamp_of(output.data))
                            if output.stage_id == 0:
                                text += 1
                            else:
                                audio += 1
            level.requests += 1
            level.text_chunks += text
            level.audio_chunks += audio
            if stream.terminal.finish_reason != "completed":
                level.errors.append(f"finish_reason {stream.terminal.finish_reason}")

    async with trio.open_nursery() as nursery:
        for index in range(level.streams):
            nursery.start_soon(consumer, index)


async def _inprocess(levels: list[int], pacing: Pacing) -> list[Level]:
    from omni_trio import open_pipeline

    results = []
    config = bench_config(pacing)
    async with open_pipeline(config) as pipeline:
        orch = pipeline.orchestrator
        await _inprocess_level(orch, Level(2), pacing)  # warm up
        for streams in levels:
            level = Level(streams)
            with _Usage(os.getpid(), level):
                await _inprocess_level(orch, level, pacing)
            results.append(level)
    return results


# -- measuring a process through /proc ---------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    total = sum(values[:8])
    return total - idle, total


def _tree_seconds() -> float:
    """CPU seconds of this process and its descendants (the server, the workers)."""
    parents, seconds = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        seconds[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    ours, total = {os.getpid()}, 0.0
    for pid in sorted(seconds):
        chain, at = [], pid
        while at in parents and at not in ours and at > 1:
            chain.append(at)
            at = parents[at]
        if at in ours:
            ours.update(chain)
            total += seconds[pid]
    return total


class _Usage:
    """Over a block: a process's CPU seconds, the machine's busy fraction and the part
    of it not this benchmark's, the wall time."""

    def __init__(self, pid: int, level: Level) -> None:
        self.pid, self.level = pid, level

    def __enter__(self) -> None:
        self.cpu = _cpu_seconds(self.pid)
        self.tree = _tree_seconds()
        self.ticks = _machine_ticks()
        self.wall = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        level = self.level
        level.wall = time.monotonic() - self.wall
        level.cpu = _cpu_seconds(self.pid) - self.cpu
        tree = _tree_seconds() - self.tree
        busy, total = _machine_ticks()
        ticks = max(1, total - self.ticks[1])
        level.busy = (busy - self.ticks[0]) / ticks
        tree_share = tree * os.sysconf("SC_CLK_TCK") / ticks
        level.others = max(0.0, level.busy - tree_share)


# -- the server path ---------------------------------------------------------------------


@dataclass
class ServerRun:
    levels: list[Level]
    traces: list[dict[str, list[int]]]
    floor: list[Level]  # the same levels against the floor (``_serve_floor.py``), paced
    floor_traces: list[dict[str, list[int]]]
    replay: list[Level]  # and against the floor replaying the server's writes
    replay_traces: list[dict[str, list[int]]]
    rss_idle: int
    rss_held: int
    held: int


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(TOOLS), *sys.path[1:]]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        body: bytes = response.read()
        return body


@contextmanager
def _process(command: list[str], what: str) -> Iterator[tuple[str, int]]:
    """Run a server process that prints its URL once it listens: (URL, pid); it is
    terminated on the way out."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        if not url.startswith("http://"):
            raise RuntimeError(f"the {what} did not start (exit status {process.wait()})")
        yield url, process.pid
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _post(url: str, body: Any) -> None:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def _level(
    url: str, pid: int, model: str, streams: int, pacing: Pacing, start: int | None = None
) -> tuple[Level, dict[str, list[int]]]:
    """One level's clients against a traced server (from ``start``, monotonic ns, if
    given): what they and its trace saw."""
    import trio

    level = Level(streams)
    if start is not None:
        time.sleep(max(0, start - time.monotonic_ns() - 50_000_000) / 1e9)
    with _Usage(pid, level):
        trio.run(_clients, int(url.rpartition(":")[2]), model, level, pacing, start)
    return level, json.loads(_get(url + "/_bench/trace"))


def _schedule(trace: dict[str, list[int]], start: int) -> dict[str, list[list[Any]]]:
    """A server level's writes per stream, for the floor to replay: the stream's key ->
    its writes in order, each ``[ns after the level's start, its chunks' kinds]``."""
    writes: dict[int, dict[tuple[int, int], str]] = {}
    for key, audio, received, sent in zip(
        trace["stream"], trace["audio"], trace["received"], trace["sent"], strict=True
    ):
        stream = writes.setdefault(key, {})
        stream[received, sent] = stream.get((received, sent), "") + ("a" if audio else "t")
    return {
        str(key): [[received - start, kinds] for (received, _), kinds in sorted(stream.items())]
        for key, stream in writes.items()
    }


def _replay(
    url: str, pid: int, model: str, server: Level, trace: dict[str, list[int]], pacing: Pacing
) -> tuple[Level, dict[str, list[int]]]:
    """The level again against the floor, each of its streams writing when the
    server's same stream did, relative to the level's start (the clients start at the
    same offsets): the same bursts of writes, from bare Hypercorn."""
    start = time.monotonic_ns() + 300_000_000
    _post(url + "/_bench/replay", {"start": start, "streams": _schedule(trace, server.start)})
    try:
        return _level(url, pid, model, server.streams, pacing, start)
    finally:
        _post(url + "/_bench/replay", {"start": 0, "streams": {}})


def _server(levels: list[int], pacing: Pacing, held: int, profile: Path | None) -> ServerRun:
    """Each level against the server, then against the floor paced, then against the
    floor replaying the server's writes, one after the other (the machine as alike for
    all three as it gets)."""
    import trio

    command = [sys.executable, str(TOOLS / "bench_serve.py"), "_server", *pacing.args()]
    if profile is not None:
        command.append(f"--profile={profile}")
    with _process(command, "server") as (url, pid):
        model = json.loads(_get(url + "/v1/models"))["data"][0]["id"]
        floor_command = [sys.executable, str(TOOLS / "_serve_floor.py"), *pacing.args()]
        with _process([*floor_command, f"--model={model}"], "floor") as (floor_url, floor_pid):
            for warm_url, warm_pid in ((url, pid), (floor_url, floor_pid)):
                _level(warm_url, warm_pid, model, 2, pacing)  # warm up
            port = int(url.rpartition(":")[2])
            rss_idle, rss_held = trio.run(_hold, port, model, held, partial(_rss_bytes, pid))
            _get(url + "/_bench/trace")  # the collections while they were held
            run = ServerRun([], [], [], [], [], [], rss_idle, rss_held, held)
            for streams in levels:
                server, server_trace = _level(url, pid, model, streams, pacing)
                run.levels.append(server)
                run.traces.append(server_trace)
                level, trace = _level(floor_url, floor_pid, model, streams, pacing)
                run.floor.append(level)
                run.floor_traces.append(trace)
                level, trace = _replay(floor_url, floor_pid, model, server, server_trace, pacing)
                run.replay.append(level)
                run.replay_traces.append(trace)
            return run


# -- the report ---------------------------------------------------------------------------


def _percentiles(ns: Any) -> dict[str, float]:
    """p50, p99, max, mean of nanoseconds, in seconds."""
    values = sorted(ns)
    if not values:
        return {"p50": math.nan, "p99": math.nan, "max": math.nan, "mean": math.nan, "n": 0}

    def at(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] / 1e9

    return {
        "p50": at(0.50),
        "p99": at(0.99),
        "max": values[-1] / 1e9,
        "mean": sum(values) / len(values) / 1e9,
        "n": len(values),
    }


def _added(trace: dict[str, list[int]]) -> dict[str, float]:
    """Response -> socket per traced chunk."""
    return _percentiles(s - r for r, s in zip(trace["received"], trace["sent"], strict=True))


def _in_flight(trace: dict[str, list[int]]) -> dict[str, float]:
    """Per traced chunk: the writes, of every stream, taken and not yet sent when its
    own was taken -- how many wait on the server's one thread together (a burst of
    outputs arriving at once is a burst of writes). p50, p90, p99, max."""
    writes = sorted(set(zip(trace["received"], trace["sent"], strict=True)))
    starts = [received for received, _ in writes]
    ends = sorted(sent for _, sent in writes)
    counts = sorted(
        bisect.bisect_right(starts, r) - bisect.bisect_right(ends, r) for r in trace["received"]
    )
    if not counts:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "max": math.nan}
    at = {q: counts[min(len(counts) - 1, int(q * len(counts)))] for q in (0.5, 0.9, 0.99)}
    return {"p50": at[0.5], "p90": at[0.9], "p99": at[0.99], "max": counts[-1]}


def _collections(trace: dict[str, list[int]]) -> dict[str, float]:
    """The process's garbage collections over the level: how many, how many full,
    the longest and the total pause, in seconds."""
    pauses = trace["gc_pause"]
    return {
        "collections": len(pauses),
        "full": trace["gc_generation"].count(2),
        "max_pause": max(pauses, default=0) / 1e9,
        "total_pause": sum(pauses) / 1e9,
    }


def _costs(level: Level) -> dict[str, Any]:
    """What a side of a level cost the machine (every side reports these)."""
    return {
        "cpu_per_chunk": level.cpu / max(1, level.chunks),
        "cpu_share": level.cpu / level.wall,
        "machine_busy": level.busy,
        "machine_busy_others": level.others,
        "wall": level.wall,
    }


def _served(level: Level, trace: dict[str, list[int]]) -> dict[str, Any]:
    """What a side that served HTTP (the server, a floor) delivered, and its writes."""
    return {
        "requests": level.requests,
        "text_chunks": level.text_chunks,
        "audio_chunks": level.audio_chunks,
        "traced_chunks": len(trace["stamp"]),
        "errors": level.errors,
        "added": _added(trace),
        "writes_in_flight": _in_flight(trace),
        "gc": _collections(trace),
    }


def _floor_result(floor: Level, trace: dict[str, list[int]]) -> dict[str, Any]:
    return {
        **_served(floor, trace),
        "stage_to_client": _percentiles(floor.latency),
        **_costs(floor),
    }


def _level_result(
    inproc: Level,
    server: Level,
    trace: dict[str, list[int]],
    floor: Level,
    floor_trace: dict[str, list[int]],
    replay: Level,
    replay_trace: dict[str, list[int]],
) -> dict[str, Any]:
    stamp, received, sent = trace["stamp"], trace["received"], trace["sent"]
    return {
        "streams": server.streams,
        "inprocess": {
            "requests": inproc.requests,
            "chunks": inproc.chunks,
            "errors": inproc.errors,
            "stage_to_consumer": _percentiles(inproc.latency),
            **_costs(inproc),
        },
        "server": {
            **_served(server, trace),
            "stage_to_response": _percentiles(r - s for s, r in zip(stamp, received, strict=True)),
            "stage_to_socket": _percentiles(w - s for s, w in zip(stamp, sent, strict=True)),
            "stage_to_client": _percentiles(server.latency),
            **_costs(server),
        },
        "floor": _floor_result(floor, floor_trace),
        "replay": _floor_result(replay, replay_trace),
    }


#: The goal at the top level: the server's added p99 at most this, in seconds...
GOAL_P99 = 0.002
#: ... or at most this above the floor's in the same run.
GOAL_OVER_FLOOR = 0.001


def _goal(top: dict[str, Any]) -> dict[str, Any]:
    """The goal at the top level, against each floor: the paced one (``met``) and the
    one replaying the server's writes (``met_against_replay``)."""
    added = top["server"]["added"]["p99"]
    floor = top["floor"]["added"]["p99"]
    replay = top["replay"]["added"]["p99"]
    return {
        "streams": top["streams"],
        "rule": f"added p99 <= {GOAL_P99 * 1e3:g} ms, or within "
        f"{GOAL_OVER_FLOOR * 1e3:g} ms of the floor's p99",
        "added_p99": added,
        "floor_p99": floor,
        "replay_p99": replay,
        "met": added <= GOAL_P99 or added - floor <= GOAL_OVER_FLOOR,
        "met_against_replay": added <= GOAL_P99 or added - replay <= GOAL_OVER_FLOOR,
    }


def _packages() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("omni-trio", "trio", "hypercorn", "h11", "starlette", "msgspec"):
        with suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def _table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    def ms(value: float) -> str:
        return f"{value * 1e3:.2f}"

    table = Table(title="serving: per SSE chunk, ms (p50 / p99)")
    for column in (
        "streams",
        "chunks",
        "in-process\nstage→consumer",
        "server\nstage→response",
        "server added\nresponse→socket",
        "floor added\nresponse→socket",
        "replay added\nresponse→socket",
        "server\nstage→socket",
        "client\nstage→client",
        "writes in flight p99\nserver·floor·replay",
        "CPU µs/chunk\nserver·floor·replay",
        "in-proc CPU\nµs/chunk",
        "machine busy (others)\nserver · floor · replay",
        "ok",
    ):
        table.add_column(column, justify="right")
    for row in report["levels"]:
        inproc, server, floor, replay = (row[k] for k in ("inprocess", "server", "floor", "replay"))

        def pair(dist: dict[str, float]) -> str:
            return f"{ms(dist['p50'])} / {ms(dist['p99'])}"

        failures = sum(len(where["errors"]) for where in (inproc, server, floor, replay))
        threes = (server, floor, replay)
        table.add_row(
            str(row["streams"]),
            f"{server['text_chunks'] + server['audio_chunks']:,}",
            pair(inproc["stage_to_consumer"]),
            pair(server["stage_to_response"]),
            pair(server["added"]),
            pair(floor["added"]),
            pair(replay["added"]),
            pair(server["stage_to_socket"]),
            pair(server["stage_to_client"]),
            "·".join(str(where["writes_in_flight"]["p99"]) for where in threes),
            "·".join(f"{where['cpu_per_chunk'] * 1e6:.0f}" for where in threes),
            f"{inproc['cpu_per_chunk'] * 1e6:.0f}",
            " · ".join(
                f"{where['machine_busy']:.0%} ({where['machine_busy_others']:.0%})"
                for where in threes
            ),
            "yes" if not failures else f"[red]{failures} failed",
        )
    return table


def pacing_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokens-per-second", type=float, default=10.0, help="per stream (default 10)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=50, help="text chunks per stream (default 50)"
    )
    parser.add_argument(
        "--chunk-codes", type=int, default=25, help="codes per audio chunk (default 25)"
    )


def pacing_of(args: argparse.Namespace) -> Pacing:
    return Pacing(args.tokens_per_second, args.max_tokens, chunk_codes=args.chunk_codes)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_server"]:
        _server_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(
        prog="python tools/bench_serve.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--levels", default="1,10,50,200", help="concurrent streams, comma-separated"
    )
    parser.add_argument("--hold", type=int, default=200, help="streams held open for memory")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--profile-server", type=Path, help="profile the server process (pyinstrument) to here"
    )
    pacing_arguments(parser)
    args = parser.parse_args(argv)
    levels = [int(n) for n in args.levels.split(",")]
    pacing = pacing_of(args)

    import trio
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=240)
    sys.path.insert(1, str(TOOLS))  # the workers import the stamped stages from here
    with console.status("in-process"):
        inproc = trio.run(_inprocess, levels, pacing)
    with console.status("server"):
        served = _server(levels, pacing, args.hold, args.profile_server)
    report = {
        "command": "python tools/bench_serve.py " + " ".join(argv),
        "python": platform.python_version(),
        "packages": _packages(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "pacing": {
            "tokens_per_second": pacing.tokens_per_second,
            "max_tokens": pacing.max_tokens,
            "codes_per_token": pacing.codes_per_token,
            "chunk_codes": pacing.chunk_codes,
            "audio_chunks": pacing.audio_chunks,
        },
        "levels": [
            _level_result(*level)
            for level in zip(
                inproc,
                served.levels,
                served.traces,
                served.floor,
                served.floor_traces,
                served.replay,
                served.replay_traces,
                strict=True,
            )
        ],
        "memory": {
            "held_streams": served.held,
            "rss_idle": served.rss_idle,
            "rss_held": served.rss_held,
            "per_stream": (served.rss_held - served.rss_idle) / max(1, served.held),
        },
    }
    report["goal"] = _goal(report["levels"][-1])
    console.print(
        f"Python {report['python']}; "
        + ", ".join(f"{k} {v}" for k, v in report["packages"].items())
        + f"; {report['machine']['cpus']} CPUs"
    )
    console.print(
        f"each stream: {pacing.max_tokens} text chunks at {pacing.tokens_per_second:g}/s "
        f"and {pacing.audio_chunks} audio chunks ({pacing.chunk_codes * 1920:,} B of PCM each)"
    )
    console.print(_table(report))
    for row in report["levels"]:
        collections = [row[where]["gc"] for where in ("server", "floor", "replay")]
        console.print(
            f"garbage collections at {row['streams']} streams, server · floor · replay: "
            + " · ".join(str(c["collections"]) for c in collections)
            + ", full "
            + " · ".join(str(c["full"]) for c in collections)
            + ", longest "
            + " · ".join(f"{c['max_pause'] * 1e3:.1f}" for c in collections)
            + " ms"
        )
    memory = report["memory"]
    console.print(
        f"server RSS: {memory['rss_idle'] / 2**20:.1f} MiB idle, "
        f"{memory['rss_held'] / 2**20:.1f} MiB with {served.held} streams open: "
        f"{memory['per_stream'] / 1024:.1f} KiB per open stream"
    )
    failed = False
    for row in report["levels"]:
        for where in ("inprocess", "server", "floor", "replay"):
            for error in row[where]["errors"][:5]:
                failed = True
                console.print(f"[red]{row['streams']} streams, {where}: {error}")
    goal = report["goal"]
    console.print(
        f"goal at {goal['streams']} streams: {goal['rule']}: added p99 "
        f"{goal['added_p99'] * 1e3:.2f} ms; floor p99 {goal['floor_p99'] * 1e3:.2f} ms "
        + ("(met)" if goal["met"] else "(not met)")
        + f"; floor replaying the server's writes, p99 {goal['replay_p99'] * 1e3:.2f} ms "
        + ("(met)" if goal["met_against_replay"] else "(not met)")
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
