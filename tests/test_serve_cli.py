"""``omni-trio serve`` as a user runs it: the real command in its own process group,
its stages in worker processes, driven with the real ``openai`` client and raw HTTP;
stopped by SIGTERM (a drain), Ctrl-C, or a client that hangs up."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import time
import wave
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.resources import files
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from helpers import END_TO_END
from omni_trio.demo.engines import response_tokens
from test_signals import _default_sigint, _env, _group, _segments

MODEL = "simulated-qwen-omni"
DEMO_TOML = (files("omni_trio") / "pipelines" / "demo.toml").read_text()
THINKER_ARGS = "engine_args = { tokens_per_second = 50, max_tokens = 40 }"
CONNECTOR = 'connector = "shm"'
#: The demo's stages, as the server's first line names them (the speech pipeline's too).
DEMO_CHAIN = "thinker -> talker -> code2wav"
FRAMES_PER_CODE = 960  # a 40 ms tone at 24 kHz (demo.engines.FRAME_SECONDS)
CODES_PER_TOKEN = 4  # the demo talker's codes_per_token


def pipeline(
    tmp_path: Path,
    *,
    tokens_per_second: float,
    max_tokens: int,
    in_segments: bool = False,
    keys: str = "",
) -> Path:
    """The demo pipeline, its thinker paced at ``tokens_per_second`` for ``max_tokens``
    words (so a request takes about ``max_tokens / tokens_per_second`` seconds);
    ``in_segments``: every chunk in a shared-memory segment (the demo's small chunks
    would otherwise travel inside their notices), for tests that watch them freed;
    ``keys``: more ``[pipeline]`` lines."""
    assert THINKER_ARGS in DEMO_TOML, "the demo's thinker args changed: update this test"
    args = f"engine_args = {{ tokens_per_second = {tokens_per_second}, max_tokens = {max_tokens} }}"
    text = DEMO_TOML.replace(THINKER_ARGS, args)
    assert CONNECTOR in text, "the demo's connector line changed: update this test"
    if in_segments:
        keys += "\ninline_chunk_bytes = 0"
    if keys:
        text = text.replace(CONNECTOR, f"{CONNECTOR}\n{keys}")
    config = tmp_path / "pipeline.toml"
    config.write_text(text)
    return config


class Server:
    """``omni-trio serve`` in its own process group, its output collected as it comes."""

    def __init__(self, process: trio.Process, chain: str) -> None:
        self.process = process
        self.chain = chain
        self.out = bytearray()
        self.err = bytearray()
        self.url = ""
        self.model = ""
        self.segments: list[str] = []  # in use while it served, if a test looked
        self._more = trio.Event()

    async def collect(self, stream: trio.abc.ReceiveStream, into: bytearray) -> None:
        async for data in stream:
            into += data
            self._more.set()
            self._more = trio.Event()

    async def started(self) -> None:
        while b"\n" not in self.out:
            if self.process.poll() is not None:
                pytest.fail(f"the server ended first ({self.process.returncode}): {self.text()}")
            with trio.move_on_after(0.1):
                await self._more.wait()
        line = self.out.decode().splitlines()[0]
        assert f" ({self.chain}, " in line, line
        self.model = line.removeprefix("omni-trio serve: ").split(" (")[0]
        self.url = line.rsplit(" on ", 1)[1]
        assert self.url.startswith("http://127.0.0.1:")

    def segments_in_use(self) -> list[str]:
        """Its shared-memory segments now (a request in flight has some), kept to show
        that the check for none left after its exit proves something."""
        self.segments = _segments(self.process.pid)
        assert self.segments, "a request is in flight, yet the server has no segment"
        return self.segments

    def text(self) -> str:
        return (self.out + self.err).decode(errors="replace")

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the server's whole process group, as a terminal's Ctrl-C
        or a service manager's stop does."""
        os.killpg(self.process.pid, signum)

    async def exit_status(self, bound: float = 15) -> int:
        """Wait for the server to exit; then nothing of it may be left."""
        with trio.fail_after(bound):
            status = await self.process.wait()
        # Its workers were reaped; their resource trackers leave once they see them gone.
        with trio.move_on_after(5):
            while _group(self.process.pid):  # noqa: ASYNC110 - other processes
                await trio.sleep(0.05)
        assert _group(self.process.pid) == [], "processes of the server's group outlived it"
        assert _segments(self.process.pid) == [], "shared memory left behind"
        return status


@asynccontextmanager
async def serving(tmp_path: Path, *argv: str, chain: str = DEMO_CHAIN) -> AsyncIterator[Server]:
    """``omni-trio serve ARGV --port 0``, started (its URL known, its first line naming
    the stages ``chain``); killed with its group if the test left it running."""
    command = [sys.executable, "-m", "omni_trio", "serve", *argv, "--port", "0"]
    process = await trio.lowlevel.open_process(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group: a signal to it does not reach us
        preexec_fn=_default_sigint,
        env=_env(),
        cwd=tmp_path,
    )
    server = Server(process, chain)
    assert process.stdout is not None
    assert process.stderr is not None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.collect, process.stdout, server.out)
            nursery.start_soon(server.collect, process.stderr, server.err)
            try:
                with trio.fail_after(60):  # a loaded machine starts three workers slowly
                    await server.started()
                yield server
            finally:
                if process.poll() is None:  # the test failed: end it all
                    os.killpg(process.pid, signal.SIGKILL)
                    with trio.CancelScope(shield=True):
                        await process.wait()
    finally:
        await process.stdout.aclose()
        await process.stderr.aclose()


# -- clients ------------------------------------------------------------------------------


async def http(
    url: str, method: str = "GET", path: str = "/health", body: Any = None
) -> tuple[int, bytes]:
    """One request over a new connection: its status and body (not chunk-decoded)."""
    address = urlsplit(url)
    assert address.hostname is not None
    assert address.port is not None
    request = f"{method} {path} HTTP/1.1\r\nhost: {address.netloc}\r\nconnection: close\r\n"
    data = b""
    if body is not None:
        data = json.dumps(body).encode()
        request += f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
    stream = await trio.open_tcp_stream(address.hostname, address.port)
    received = bytearray()
    async with stream:
        await stream.send_all(request.encode() + b"\r\n" + data)
        async for chunk in stream:
            received += chunk
    head, _, payload = bytes(received).partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


async def metrics(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, body = await http(url, path="/metrics")
    assert status == 200
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def finished(values: dict[tuple[str, frozenset[tuple[str, str]]], float], reason: str) -> float:
    """Requests ended for ``reason``, over every endpoint."""
    labels = {("model_name", MODEL), ("finish_reason", reason)}
    return sum(
        value
        for (name, sample), value in values.items()
        if name == "omni_trio:requests_finished_total" and labels <= sample
    )


def running(values: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> float:
    return values[("omni_trio:num_requests_running", frozenset({("model_name", MODEL)}))]


def client(url: str, timeout: float = 30) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def chat(url: str, prompt: str, model: str = MODEL, **options: Any) -> Any:
    """A whole (not streamed) chat completion, with the real client."""
    with client(url) as openai_client:
        return openai_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], **options
        )


def stream_chat(
    url: str, prompt: str, on_first: Callable[[], None] | None = None, timeout: float = 30
) -> list[Any]:
    """A streamed chat completion's chunks, with the real client; ``on_first`` is
    called (in this thread) as the first one arrives. Run it in a thread."""
    chunks = []
    with (
        client(url, timeout) as openai_client,
        openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True
        ) as stream,
    ):
        for chunk in stream:
            chunks.append(chunk)
            if on_first is not None and len(chunks) == 1:
                on_first()
    return chunks


def text_of(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def audio_of(chunks: list[Any]) -> list[bytes]:
    return [
        base64.b64decode(c.choices[0].delta.audio.data)
        for c in chunks
        if c.choices and c.choices[0].delta.audio is not None
    ]


def finish_reasons(chunks: list[Any]) -> list[str]:
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


def pcm_frames(data: bytes) -> int:
    """The frames of a WAV file: 16-bit mono at 24 kHz, or the test fails."""
    with wave.open(io.BytesIO(data)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24_000, 1, 2)
        frames = wav.getnframes()
        assert len(wav.readframes(frames)) == 2 * frames
        return frames


# -- the tests ----------------------------------------------------------------------------


@END_TO_END
async def test_streams_text_and_wav_audio_with_the_openai_client(tmp_path):
    config = pipeline(tmp_path, tokens_per_second=200, max_tokens=12)
    prompt = "Tell me about the sea"
    expected = "".join(response_tokens(prompt, 12))
    async with serving(tmp_path, str(config)) as server:
        chunks = await trio.to_thread.run_sync(stream_chat, server.url, prompt)
        assert text_of(chunks) == expected
        assert finish_reasons(chunks) == ["stop"]
        assert chunks[-1].choices[0].finish_reason == "stop"  # the last chunk, once
        assert chunks[0].choices[0].delta.role == "assistant"
        audio = audio_of(chunks)
        assert len(audio) == 2  # 48 codes: one chunk of 25, the tail of 23
        frames = [pcm_frames(wav_file) for wav_file in audio]
        assert frames == [25 * FRAMES_PER_CODE, 23 * FRAMES_PER_CODE]

        whole = await trio.to_thread.run_sync(chat, server.url, prompt)
        [choice] = whole.choices
        assert choice.finish_reason == "stop"
        assert choice.message.content == expected
        assert choice.message.audio is not None
        audio_frames = pcm_frames(base64.b64decode(choice.message.audio.data))
        assert audio_frames == 12 * CODES_PER_TOKEN * FRAMES_PER_CODE

        values = await metrics(server.url)
        assert finished(values, "completed") == 2
        assert finished(values, "aborted") == 0
        server.signal(signal.SIGTERM)
        assert await server.exit_status() == 0, server.text()
    assert server.err.decode() == ""


@END_TO_END
async def test_max_request_bytes_and_max_unread_bytes_bound_what_the_server_holds(tmp_path):
    """``--max-request-bytes``: a longer body is refused with 413 before it is read;
    ``[pipeline] max_unread_bytes``: a whole answer over it fails naming the key (its
    request aborted), while the same answer streamed arrives whole."""
    limit = 64 * 1024  # the whole answer: 12 words and 92,160 bytes of PCM
    config = pipeline(
        tmp_path, tokens_per_second=200, max_tokens=12, keys=f"max_unread_bytes = {limit}"
    )
    prompt = "Tell me about the sea"
    async with serving(tmp_path, str(config), "--max-request-bytes", "4096") as server:
        long = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 4096}]}
        status, body = await http(server.url, "POST", "/v1/chat/completions", long)
        assert status == 413, body
        error = json.loads(body)["error"]
        assert "max_request_bytes is 4096 bytes" in error["message"]

        with pytest.raises(openai.BadRequestError) as caught:
            await trio.to_thread.run_sync(chat, server.url, prompt)
        assert caught.value.code == "answer_too_large"
        assert f"max_unread_bytes ({limit} bytes)" in caught.value.message

        chunks = await trio.to_thread.run_sync(stream_chat, server.url, prompt)
        assert text_of(chunks) == "".join(response_tokens(prompt, 12))
        assert sum(pcm_frames(wav_file) for wav_file in audio_of(chunks)) == (
            12 * CODES_PER_TOKEN * FRAMES_PER_CODE
        )
        assert finish_reasons(chunks) == ["stop"]

        values = await metrics(server.url)
        assert (finished(values, "error"), finished(values, "completed")) == (1, 1)
        assert running(values) == 0
        server.signal(signal.SIGTERM)
        assert await server.exit_status() == 0, server.text()
    assert server.err.decode() == ""


def test_max_request_bytes_must_be_positive():
    done = subprocess.run(
        [sys.executable, "-m", "omni_trio", "serve", "--max-request-bytes", "0"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr == "omni-trio serve: --max-request-bytes must be a positive integer, got 0\n"


BAD_REALTIME_FLAGS = [
    ("--realtime-max-sessions", "0", "a positive integer"),
    ("--realtime-max-buffer-seconds", "0", "a positive number"),
    ("--realtime-max-event-bytes", "-1", "a positive integer"),
    ("--realtime-idle-timeout", "nan", "a positive number"),
    ("--realtime-priority", "5000", "a priority from -1000 to 1000 (lower runs earlier)"),
]


@pytest.mark.parametrize(
    ("flag", "value", "rule"), BAD_REALTIME_FLAGS, ids=[f[0] for f in BAD_REALTIME_FLAGS]
)
def test_a_bad_realtime_limit_is_a_usage_error_naming_its_flag(flag, value, rule):
    done = subprocess.run(
        [sys.executable, "-m", "omni_trio", "serve", flag, value],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=30,
        check=False,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"omni-trio serve: {flag} must be {rule}, got {value}\n"


def test_the_realtime_flags_are_parsed_and_default_to_the_servers():
    """The command's ``--realtime-*`` defaults are :class:`RealtimeOptions`' own (the
    command names them without importing the serve extra), and each flag lands in
    the argument the server's options are made from (``cli/serve.py``'s
    ``_serve_main``; what the running server enforces is the next test's)."""
    from omni_trio.cli import _parse
    from omni_trio.serve import RealtimeOptions

    def realtime(args: Any) -> tuple[object, ...]:
        return (
            args.realtime_max_sessions,
            args.realtime_max_buffer_seconds,
            args.realtime_max_event_bytes,
            args.realtime_idle_timeout,
            args.realtime_speculate,
            args.realtime_priority,
        )

    defaults = RealtimeOptions()
    assert realtime(_parse(["serve", "demo", "--port", "0"])) == (
        defaults.max_sessions,
        defaults.max_buffer_seconds,
        defaults.max_event_bytes,
        defaults.idle_timeout,
        defaults.speculate,
        defaults.priority,
    )
    flags = ["--realtime-max-sessions", "3", "--realtime-max-buffer-seconds", "2.5"]
    flags += ["--realtime-max-event-bytes", "5000", "--realtime-idle-timeout", "7"]
    flags += ["--realtime-priority", "-20"]
    args = _parse(["serve", "demo", "--port", "0", *flags, "--no-realtime-speculation"])
    assert realtime(args) == (3, 2.5, 5000, 7.0, False, -20)


def realtime_url(server: Server) -> str:
    return server.url.replace("http://", "ws://") + f"/v1/realtime?model={server.model}"


def ws_event(ws: Any, type: str | None = None, timeout: float = 10) -> dict[str, Any]:
    """The session's next event (of ``type``: the next one of that type)."""
    while True:
        event = json.loads(ws.recv(timeout=timeout))
        if type is None or event["type"] == type:
            return event


def ws_send(ws: Any, type: str, **fields: Any) -> None:
    ws.send(json.dumps({"type": type, **fields}))


@END_TO_END
async def test_the_realtime_flags_bound_the_servers_sessions(tmp_path):
    """``--realtime-max-sessions 1``: a second session is refused at the upgrade (503);
    ``--realtime-max-event-bytes``: a larger event gets an ``error`` naming the flag
    and its value; ``--realtime-idle-timeout``: an idle session is told, then closed.
    (``--realtime-max-buffer-seconds`` needs a pipeline that listens: the voice
    extra's, see tests/test_voice.py; ``--no-realtime-speculation``, its detector:
    the previous test sees it parsed.)"""
    flags = ["--realtime-max-sessions", "1", "--realtime-max-event-bytes", "40000"]
    flags += ["--realtime-idle-timeout", "2"]

    def script(url: str) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        with connect(url, max_size=None) as ws:
            seen["created"] = ws_event(ws)
            with pytest.raises(InvalidStatus) as refused:
                connect(url, open_timeout=10)
            seen["refused"] = refused.value.response
            session = {"type": "realtime", "instructions": "x" * 40_000}
            ws_send(ws, "session.update", session=session, event_id="large")
            seen["large"] = ws_event(ws, "error")["error"]
            sent = time.monotonic()
            seen["idle"] = ws_event(ws, "error", timeout=20)["error"]
            seen["idle_after"] = time.monotonic() - sent
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
        return seen

    async with serving(tmp_path, "demo", *flags) as server:
        seen = await trio.to_thread.run_sync(script, realtime_url(server))
        server.signal(signal.SIGTERM)
        assert await server.exit_status() == 0, server.text()
    assert seen["created"]["type"] == "session.created"
    refused = seen["refused"]
    assert refused.status_code == 503
    assert "--realtime-max-sessions 1" in json.loads(refused.body)["error"]["message"]
    large = seen["large"]
    assert (large["code"], large["event_id"]) == ("event_too_large", "large")
    assert "--realtime-max-event-bytes (40000)" in large["message"]
    idle = seen["idle"]
    assert idle["code"] == "session_idle_timeout"
    assert "2 s" in idle["message"]
    assert "--realtime-idle-timeout" in idle["message"]
    assert 1.5 < seen["idle_after"] < 10


@END_TO_END
async def test_with_no_config_it_serves_the_demo(tmp_path):
    async with serving(tmp_path) as server:
        assert server.model == MODEL
        status, body = await http(server.url, path="/v1/models")
        assert status == 200
        assert [model["id"] for model in json.loads(body)["data"]] == [MODEL]
        assert (await http(server.url))[0] == 200  # /health: ready
        # A short answer: the server ends it at max_tokens, with the demo's words.
        whole = await trio.to_thread.run_sync(
            lambda: chat(server.url, "Hello", max_tokens=3, modalities=["text"])
        )
        assert whole.choices[0].finish_reason == "length"
        assert whole.choices[0].message.content == "".join(response_tokens("Hello", 3))
        assert whole.choices[0].message.audio is None
        server.signal(signal.SIGTERM)
        assert await server.exit_status() == 0, server.text()


@END_TO_END
async def test_it_serves_the_shipped_speech_pipeline(tmp_path):
    from omni_trio.speech import SAMPLE_RATE, ESpeak

    async with serving(tmp_path, "speech") as server:
        assert server.model == "espeak-omni"
        whole = await trio.to_thread.run_sync(
            lambda: chat(server.url, "Tell me a story", model="espeak-omni")
        )
        [choice] = whole.choices
        assert choice.finish_reason == "stop"
        answer = choice.message.content
        with wave.open(io.BytesIO(base64.b64decode(choice.message.audio.data))) as wav:
            assert wav.getframerate() == SAMPLE_RATE
            seconds = wav.getnframes() / SAMPLE_RATE
        spoken = len(ESpeak.get().synthesize(answer)) / 2 / SAMPLE_RATE
        assert seconds == pytest.approx(spoken, rel=0.3)  # eSpeak NG reads the answer
        server.signal(signal.SIGTERM)
        assert await server.exit_status() == 0, server.text()


@END_TO_END
async def test_it_serves_the_shipped_subtitled_graph(tmp_path):
    """A stage graph served: the answer's text and audio come as from the demo (the
    API has no place for subtitles: the requests' routes pass them by)."""
    chain = "thinker -> talker, talker -> code2wav, thinker -> subtitles, talker -> subtitles"
    async with serving(tmp_path, "subtitled", chain=chain) as server:
        assert server.model == "subtitled-qwen-omni"
        whole = await trio.to_thread.run_sync(
            lambda: chat(server.url, "Hello", model="subtitled-qwen-omni")
        )
        [choice] = whole.choices
        assert choice.finish_reason == "stop"
        words = response_tokens("Hello", 40, whole_sentences=True)
        assert choice.message.content == "".join(words)
        with wave.open(io.BytesIO(base64.b64decode(choice.message.audio.data))) as wav:
            assert wav.getnframes() == len(words) * CODES_PER_TOKEN * FRAMES_PER_CODE
        server.signal(signal.SIGTERM)
        assert await server.exit_status() == 0, server.text()


@END_TO_END
async def test_a_client_that_hangs_up_aborts_its_request(tmp_path):
    config = pipeline(tmp_path, tokens_per_second=10, max_tokens=40)  # 4 s
    async with serving(tmp_path, str(config)) as server:
        address = urlsplit(server.url)
        assert address.hostname is not None
        assert address.port is not None
        body = json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        ).encode()
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {address.netloc}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        stream = await trio.open_tcp_stream(address.hostname, address.port)
        async with stream:
            await stream.send_all(request + body)
            received = bytearray()
            with trio.fail_after(10):
                while b"data: " not in received:
                    received += await stream.receive_some()
        assert received.startswith(b"HTTP/1.1 200"), received
        # The connection is closed with the answer under way: the request is aborted
        # (counted as it ends; the running gauge drops a checkpoint later).
        with trio.fail_after(10):
            while True:
                values = await metrics(server.url)
                if finished(values, "aborted") and not running(values):
                    break
                await trio.sleep(0.05)
        assert finished(values, "aborted") == 1
        assert finished(values, "completed") == 0
        assert running(values) == 0
        # The server goes on serving.
        whole = await trio.to_thread.run_sync(
            lambda: chat(server.url, "again", max_tokens=2, modalities=["text"])
        )
        assert whole.choices[0].message.content == "".join(response_tokens("again", 2))
        values = await metrics(server.url)
        assert (finished(values, "aborted"), finished(values, "length")) == (1, 1)
        server.signal(signal.SIGTERM)
        assert await server.exit_status() == 0, server.text()


async def test_sigterm_drains_the_request_in_flight_and_refuses_new_ones(tmp_path):
    config = pipeline(tmp_path, tokens_per_second=10, max_tokens=20, in_segments=True)  # 2 s
    prompt = "a slow answer"
    first = trio.Event()
    results: list[list[Any]] = []

    def on_first() -> None:
        trio.from_thread.run_sync(first.set)

    async def consume() -> None:
        results.append(await trio.to_thread.run_sync(stream_chat, server.url, prompt, on_first))

    async with serving(tmp_path, str(config)) as server, trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        with trio.fail_after(10):
            await first.wait()
        server.segments_in_use()
        sent = time.monotonic()
        server.signal(signal.SIGTERM)
        # Draining: the listener still takes connections, to say 503.
        with trio.fail_after(5):
            while (health := await http(server.url))[0] == 200:  # noqa: ASYNC110 - polled
                await trio.sleep(0.02)
        assert health == (503, b"draining")
        status, body = await http(
            server.url,
            "POST",
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "late"}]},
        )
        assert status == 503
        assert json.loads(body)["error"]["code"] == "server_shutting_down"
        assert not results, "the request in flight ended before the checks: pace it slower"
        assert await server.exit_status() == 0, server.text()
        assert time.monotonic() - sent < 10
    [chunks] = results
    assert text_of(chunks) == "".join(response_tokens(prompt, 20))
    assert finish_reasons(chunks) == ["stop"]
    frames = sum(pcm_frames(wav_file) for wav_file in audio_of(chunks))
    assert frames == 20 * CODES_PER_TOKEN * FRAMES_PER_CODE  # all of its audio too
    assert server.err.decode() == ""


async def test_ctrl_c_with_a_request_in_flight_exits_130(tmp_path):
    config = pipeline(tmp_path, tokens_per_second=10, max_tokens=40, in_segments=True)  # 4 s
    prompt = "interrupt me"
    first = trio.Event()
    results: list[list[Any] | Exception] = []

    def on_first() -> None:
        trio.from_thread.run_sync(first.set)

    async def consume() -> None:
        try:
            chunks = await trio.to_thread.run_sync(stream_chat, server.url, prompt, on_first, 20)
        except Exception as exc:
            results.append(exc)
        else:  # pragma: no cover - the test fails on it
            results.append(chunks)

    async with serving(tmp_path, str(config)) as server, trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        with trio.fail_after(10):
            await first.wait()
        server.segments_in_use()
        sent = time.monotonic()
        server.signal(signal.SIGINT)
        assert await server.exit_status() == 130, server.text()
        with trio.fail_after(10):  # the client is not left hanging
            while not results:  # noqa: ASYNC110 - a thread: it sets no Trio event
                await trio.sleep(0.02)
        assert time.monotonic() - sent < 10
    assert server.err.decode() == "interrupted\n"
    # The stream ended, not as a completion: the connection closed under it (or an
    # error event came); either is an APIError from the client.
    [result] = results
    assert isinstance(result, openai.APIError), result


# -- a pipeline that does not start --------------------------------------------------------

RAISES = """
def factory():
    raise RuntimeError("the weights are missing")
"""

BROKEN = """
[pipeline]
name = "broken"

[[stages]]
stage_id = 0
engine = "{engine}"
final_output = true
"""

NOT_STARTING = [
    ("no_such_module_xyz:thinker", "No module named 'no_such_module_xyz'"),
    ("raises_on_load:factory", "RuntimeError: the weights are missing"),
]


@pytest.mark.parametrize(("engine", "cause"), NOT_STARTING, ids=["missing module", "raises"])
def test_a_pipeline_that_does_not_start_is_one_line_and_status_2(tmp_path, engine, cause):
    models = tmp_path / "models"
    models.mkdir()
    (models / "raises_on_load.py").write_text(RAISES)  # beside the config: importable
    (models / "broken.toml").write_text(BROKEN.format(engine=engine))
    command = [sys.executable, "-m", "omni_trio", "serve", str(models / "broken.toml")]
    process = subprocess.Popen(
        [*command, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=_env(),
        cwd=tmp_path,
    )
    try:
        out, err = process.communicate(timeout=30)
    finally:
        if process.returncode is None:  # pragma: no cover - it hung
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 2, err
    assert out == b""  # no URL of a server that serves nothing
    [line] = err.decode().splitlines()
    assert line.startswith(f"omni-trio serve: stage 0: cannot load engine '{engine}': ")
    assert cause in line
    deadline = time.monotonic() + 5
    while _group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _group(process.pid) == []
    assert _segments(process.pid) == []


def test_the_commands_defaults_are_the_servers():
    """``omni-trio serve`` names its defaults without importing the serve extra (it
    may be missing): they must be the server's own, and RealtimeOptions'."""
    import inspect

    from omni_trio.cli import _parse
    from omni_trio.serve import RealtimeOptions, app_for_config, serve

    args = _parse(["serve", "demo"])
    served = inspect.signature(serve).parameters
    app = inspect.signature(app_for_config).parameters
    realtime = RealtimeOptions()
    assert (args.host, args.port) == (served["host"].default, served["port"].default)
    assert args.write_timeout == served["write_timeout"].default
    for name in ("max_waiting", "max_request_bytes", "max_audio_seconds"):
        assert getattr(args, name) == app[name].default, name
    for name in ("max_sessions", "max_buffer_seconds", "max_event_bytes", "idle_timeout"):
        assert getattr(args, f"realtime_{name}") == getattr(realtime, name), name
    assert args.tune_gc is True
    assert _parse(["serve", "--no-gc-tuning"]).tune_gc is False
