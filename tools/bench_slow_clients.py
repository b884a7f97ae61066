"""Slow clients: what clients that stop reading cost ``omni-trio serve``, and others.

Starts ``omni-trio serve`` (a real subprocess: ``python -m omni_trio serve CONFIG
--host 127.0.0.1 --port 0``) over a pipeline whose answers stream audio for minutes:
the demo's thinker -> talker -> code2wav, each in its worker process; a long answer
is 3,000 words, 8 minutes of audio, which it streams at 16 s of audio (768 KB of PCM)
per second, in outputs of ``--chunk-codes`` codes (25: 1 s of audio, 48,000 bytes;
2500: 100 s, 4.8 MB, more than a request's whole window); a prompt starting with
``short:`` gets a short answer (8 words, 1.3 s of audio). Then three rounds of
``--seconds`` each:

1. **baseline**: a well-behaved client alone: a short streaming text+audio request
   every ``--interval`` (0.5 s), each read to its end (started on schedule, whether
   or not the one before has finished);
2. **slow 1**: the same, while ``--slow`` clients each open a streaming text+audio
   request for a long answer, read only the response's headers, then read nothing
   while keeping their sockets open for ``--seconds``, then hang up;
3. **slow 2**: the same again (what a second identical round adds).

Measured, from outside the server: the RSS of its process tree (the server and its
workers, ``/proc``), sampled every 0.1 s, and each process's at the peak (the workers
named by their stage: the engines note their pid); each well-behaved request's latency (request
sent to ``[DONE]`` read) and whether it succeeded (status 200, its text, its audio,
``finish_reason: "stop"``); for each slow request, when the server stopped writing to
it (the bytes it wrote and the client did not read, the client's receive queue plus
the server's send queue in ``/proc/net/tcp``, stop growing), when its engines were
stopped at each stage (the engines here note it in a file), and that the
orchestrator ended it with an error (``omni_trio:orchestrator_requests_ended_total
{finish_reason="error"}`` on ``/metrics``); after every client hung up, every
per-request table of the orchestrator, the stages, their workers and the server
(the gauges on ``/metrics``) until all are 0.

Run::

    PYTHONPATH=src python tools/bench_slow_clients.py [--seconds 65] [--slow 4]
        [--idle-timeout 60] [--chunk-codes 25] [--json FILE]

The goal on memory: the tree grows by at most twice ``max_unread_bytes`` (4 MiB) per
slow client. The silence must outlast ``--idle-timeout`` by the time the sockets take
to fill and the first output takes to come (a few seconds more with large outputs):
the idle clock starts only once the server can write no more. This file is also the
engines' module (the workers import it by name) and the test's
(``tests/test_slow_clients.py``: ``await run(Options(...))``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent
#: A prompt starting with this gets a short answer.
SHORT = "short:"
MIB = 1024 * 1024


# -- the engines (imported by name in the workers: keep this module light) ----------------


def _note(events: str, event: str, request: Any) -> None:
    """Append one line to ``events``: what happened to the engine of ``request``."""
    if not events:
        return
    record = {
        "event": event,
        "stage": request.stage_id,
        "request": request.request_id,
        "t": time.monotonic(),  # CLOCK_MONOTONIC: one clock for every process on Linux
        "pid": os.getpid(),  # which worker is which stage's, for the RSS by process
    }
    if event == "start" and request.stage_id == 0:
        record["prompt"] = str(request.inputs)
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, json.dumps(record).encode() + b"\n")  # one write: one whole line
    finally:
        os.close(fd)


def _noted(events: str, pick: Callable[[Any], Any]) -> Any:
    """An engine running ``pick(request)``'s engine, noting in ``events`` its start and
    its end: ``done`` when it finished (returned, or yielded its ``Last``), ``stopped``
    when it was stopped before (an abort cancels it, or closes it at a ``yield``)."""
    from omni_trio.process import Last

    async def engine(request: Any, io: Any) -> AsyncIterator[Any]:
        _note(events, "start", request)
        finished = False
        try:
            async with aclosing(pick(request)(request, io)) as outputs:
                async for item in outputs:
                    finished = isinstance(item, Last)
                    box = [item]
                    del item  # held at its yield, this engine keeps no output: the inner
                    yield box.pop()  # one's own holding is what is measured
            finished = True
        finally:
            _note(events, "done" if finished else "stopped", request)

    return engine


def thinker(
    tokens_per_second: float = 100.0,
    max_tokens: int = 3_000,
    short_tokens: int = 8,
    events: str = "",
) -> Any:
    """The demo thinker: ``max_tokens`` words, or ``short_tokens`` for a prompt
    starting with :data:`SHORT`."""
    from omni_trio.demo.engines import thinker as demo_thinker

    long = demo_thinker(tokens_per_second, max_tokens)
    short = demo_thinker(tokens_per_second, short_tokens)
    return _noted(events, lambda r: short if str(r.inputs).startswith(SHORT) else long)


def talker(codes_per_second: float = 800.0, codes_per_token: int = 4, events: str = "") -> Any:
    """The demo talker."""
    from omni_trio.demo.engines import talker as demo_talker

    inner = demo_talker(codes_per_second, codes_per_token)
    return _noted(events, lambda r: inner)


def code2wav(chunk_codes: int = 25, events: str = "") -> Any:
    """The demo code2wav: a second of 24 kHz PCM (48,000 bytes) per output."""
    from omni_trio.demo.engines import code2wav as demo_code2wav

    inner = demo_code2wav(chunk_codes)
    return _noted(events, lambda r: inner)


# -- the pipeline ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """One run. ``seconds``: each round's length, and the slow clients' silence."""

    seconds: float = 65.0
    slow: int = 4
    idle_timeout: float = 60.0
    interval: float = 0.5
    tokens_per_second: float = 100.0
    long_tokens: int = 3_000
    short_tokens: int = 8
    codes_per_token: int = 4
    #: Codes per code2wav output: 25 is a second of audio (48,000 bytes of PCM).
    chunk_codes: int = 25
    #: The pipeline's ``max_unread_bytes``: what a request may leave unread.
    max_unread_bytes: int = 4 * MIB
    #: Bounds (the issue's goals). The tree's growth per slow client, in
    #: ``max_unread_bytes``: a stalled request holds at most twice its window.
    max_rss_per_slow: float = 2.0
    max_second_round_rss: int = 8 * MIB
    max_latency_ratio: float = 1.2
    #: Rounds with the slow clients (the goals look at the first two).
    slow_rounds: int = 2

    @property
    def codes_per_second(self) -> float:
        """The talker keeps up with the thinker twice over."""
        return 2 * self.codes_per_token * self.tokens_per_second

    @property
    def audio_seconds_per_second(self) -> float:
        """Of a long answer, at the thinker's pace (a code is 40 ms of audio)."""
        return self.tokens_per_second * self.codes_per_token * 0.04

    @property
    def long_audio_seconds(self) -> float:
        return self.long_tokens * self.codes_per_token * 0.04

    @property
    def output_bytes(self) -> int:
        """A code2wav output: ``chunk_codes`` codes of 40 ms of 24 kHz 16-bit PCM."""
        return self.chunk_codes * 1920

    @property
    def max_rss_growth(self) -> float:
        """The bound on the tree's growth with :attr:`slow` stalled requests."""
        return self.slow * self.max_rss_per_slow * self.max_unread_bytes


CONFIG = """\
# tools/bench_slow_clients.py: the demo pipeline with long answers
[pipeline]
name = "slow-clients"
async_chunk = true
connector = "shm"
consumer_idle_timeout = {o.idle_timeout}
max_unread_bytes = {o.max_unread_bytes}

[[stages]]
stage_id = 0
name = "thinker"
engine = "bench_slow_clients:thinker"
engine_args = {{ tokens_per_second = {o.tokens_per_second}, max_tokens = {o.long_tokens}, \
short_tokens = {o.short_tokens}, events = {events} }}
final_output = true
final_output_type = "text"

[[stages]]
stage_id = 1
name = "talker"
engine = "bench_slow_clients:talker"
engine_args = {{ codes_per_second = {o.codes_per_second}, \
codes_per_token = {o.codes_per_token}, events = {events} }}
engine_input_source = [0]
custom_process_input_func = "omni_trio.demo.engines:thinker2talker"
prewarm_func = "omni_trio.demo.engines:prewarm"

[[stages]]
stage_id = 2
name = "code2wav"
engine = "bench_slow_clients:code2wav"
engine_args = {{ chunk_codes = {o.chunk_codes}, events = {events} }}
engine_input_source = [1]
custom_process_input_func = "omni_trio.demo.engines:talker2code2wav"
prewarm_func = "omni_trio.demo.engines:prewarm"
final_output = true
final_output_type = "audio"
sample_rate = 24000
"""
STAGES = ("thinker", "talker", "code2wav")


def write_config(directory: Path, options: Options) -> Path:
    events = directory / "engines.jsonl"
    config = directory / "slow-clients.toml"
    config.write_text(CONFIG.format(o=options, events=json.dumps(str(events))))
    return config


# -- the server's process tree, through /proc ---------------------------------------------


def _processes() -> dict[int, int]:
    """Every process: its parent."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    return parents


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    parents = _processes()
    found = [pid]
    for each in found:
        found.extend(child for child, parent in parents.items() if parent == each)
    return found


def _rss(pid: int, kind: str = "VmRSS") -> int:
    """A process's resident memory (``kind``: ``VmRSS``, or its part ``RssAnon``,
    ``RssFile`` or ``RssShmem``), bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(kind + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0  # gone (or a zombie)


def tree_rss(pid: int) -> int:
    """The RSS of ``pid``'s process tree, bytes."""
    return sum(_rss(each) for each in tree(pid))


def rss_by_pid(pid: int) -> dict[int, int]:
    """The RSS of each process of ``pid``'s tree, bytes."""
    return {each: _rss(each) for each in tree(pid)}


def tree_rss_by_process(pid: int) -> dict[str, dict[str, int]]:
    """The RSS of each process of ``pid``'s tree, and its anonymous and shared-memory
    parts: ``pid command`` -> ``{"rss", "anon", "shmem"}``, bytes."""
    found = {}
    for each in tree(pid):
        try:
            command = Path(f"/proc/{each}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        found[f"{each} {command.decode(errors='replace')[-60:]}"] = {
            "rss": _rss(each),
            "anon": _rss(each, "RssAnon"),
            "shmem": _rss(each, "RssShmem"),
        }
    return found


def _tcp_queues() -> dict[tuple[int, int], tuple[int, int]]:
    """Loopback TCP sockets: (local port, remote port) -> (send queue, receive queue)."""
    queues = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, _, tx_rx = fields[1], fields[2], fields[3], fields[4]
        tx, rx = tx_rx.split(":")
        queues[int(local.split(":")[1], 16), int(remote.split(":")[1], 16)] = (
            int(tx, 16),
            int(rx, 16),
        )
    return queues


# -- the server -----------------------------------------------------------------------------


def _env() -> dict[str, str]:
    """The server's environment: it imports the omni_trio this process does, and its
    workers import the engines from here."""
    import omni_trio

    src = Path(omni_trio.__file__).resolve().parents[1]
    env = dict(os.environ)
    paths = [str(src), str(TOOLS), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return env


@dataclass
class Server:
    process: Any  # trio.Process
    url: str
    port: int
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@asynccontextmanager
async def serving(
    directory: Path, config: Path, *, startup: float = 120.0
) -> AsyncIterator[Server]:
    """``omni-trio serve CONFIG`` on a free loopback port, in its own process group;
    stopped with SIGTERM (a drain) at the end, killed with its group if need be."""
    import trio

    log = directory / "server.log"
    command = [sys.executable, "-m", "omni_trio", "serve", str(config)]
    command += ["--host", "127.0.0.1", "--port", "0"]
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=_env(),
            cwd=directory,
        )
    try:
        with trio.fail_after(startup):
            while " on http://" not in (text := log.read_text(errors="replace")):
                if process.poll() is not None:
                    raise RuntimeError(f"the server exited ({process.returncode}): {text}")
                await trio.sleep(0.05)
        url = text.split(" on ", 1)[1].split()[0]
        yield Server(process, url, int(url.rsplit(":", 1)[1]), log)
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            status = await process.wait()
        if status != 0:
            raise RuntimeError(f"the server exited with {status}: {log.read_text()}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            with trio.CancelScope(shield=True):
                await process.wait()


async def http_get(port: int, path: str) -> bytes:
    import trio

    stream = await trio.open_tcp_stream("127.0.0.1", port)
    received = bytearray()
    async with stream:
        head = f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\n\r\n"
        await stream.send_all(head.encode())
        async for data in stream:
            received += data
    head_bytes, _, body = bytes(received).partition(b"\r\n\r\n")
    if not head_bytes.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"GET {path}: {head_bytes[:100]!r}")
    if b"transfer-encoding: chunked" in head_bytes.lower():
        return _unchunk(body)
    return body


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(port: int) -> Samples:
    """``/metrics``: (name, labels but model_name) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await http_get(port, "/metrics")).decode()
    return {
        (sample.name, frozenset((k, v) for k, v in sample.labels.items() if k != "model_name")): (
            sample.value
        )
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the series ``name`` whose labels include ``labels`` (a counter
    by endpoint and finish reason, asked by reason: over every endpoint)."""
    wanted = frozenset(labels.items())
    return sum(
        number
        for (sample, sample_labels), number in samples.items()
        if sample == name and wanted <= sample_labels
    )


#: The per-request tables on ``/metrics``: each 0 once no request is in flight and
#: every output was read (every series of these names, whatever its labels).
TABLES = (
    "omni_trio:num_requests_running",
    "omni_trio:num_requests_waiting",
    "omni_trio:server_requests_active",
    "omni_trio:server_tickets",
    "omni_trio:orchestrator_requests_in_flight",
    "omni_trio:orchestrator_pending_final",
    "omni_trio:orchestrator_streams_open",
    "omni_trio:orchestrator_outputs_ready",
    "omni_trio:orchestrator_admissions_waiting",
    "omni_trio:orchestrator_commands_queued",
    "omni_trio:unread_requests",
    "omni_trio:unread_outputs",
    "omni_trio:unread_bytes",
    "omni_trio:stage_requests_in_flight",
    "omni_trio:stage_submits_waiting",
    "omni_trio:worker_requests",
    "omni_trio:worker_chunks_waiting",
    "omni_trio:worker_chunks_held",
    "omni_trio:worker_chunk_bytes_held",
    "omni_trio:worker_chunks_unacked",
    "omni_trio:worker_chunk_bytes_unacked",
    "omni_trio:worker_requests_written",
    "omni_trio:worker_acks_owed",
    "omni_trio:worker_ring_bytes_in_use",
)


def tables(samples: Samples) -> dict[str, float]:
    """Every per-request table's series, ``name{label=value}`` -> value."""
    found = {}
    for (name, labels), number in samples.items():
        if name in TABLES:
            suffix = ",".join(f"{k}={v}" for k, v in sorted(labels))
            found[f"{name}{{{suffix}}}" if suffix else name] = number
    missing = [name for name in TABLES if not any(key.startswith(name) for key in found)]
    if missing:
        raise RuntimeError(f"/metrics lacks {missing}")
    return found


def _report_age(samples: Samples) -> float:
    """Seconds since the stalest worker report (inf while one has not reported)."""
    ages = [
        number
        for (name, _), number in samples.items()
        if name == "omni_trio:worker_seconds_since_report"
    ]
    return max(ages) if len(ages) == len(STAGES) else math.inf


# -- the clients ------------------------------------------------------------------------------


def chat_request(port: int, prompt: str, *, close: bool) -> bytes:
    body = json.dumps(
        {
            "model": "slow-clients",
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "modalities": ["text", "audio"],
            "audio": {"format": "pcm16"},
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        + ("connection: close\r\n" if close else "")
        + "\r\n"
    )
    return head.encode() + body


def _unchunk(body: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        eol = body.index(b"\r\n", pos)
        size = int(body[pos:eol], 16)
        if size == 0:
            return bytes(out)
        out += body[eol + 2 : eol + 2 + size]
        pos = eol + 4 + size


@dataclass
class WellBehaved:
    """The well-behaved client's requests in one round."""

    latencies: list[float] = field(default_factory=list)  # seconds, of those that succeeded
    failures: list[str] = field(default_factory=list)
    started: int = 0


def expected_text(prompt: str, words: int) -> str:
    from omni_trio.demo.engines import response_tokens

    return "".join(response_tokens(prompt, words))


def check_answer(received: bytes, prompt: str, options: Options) -> None:
    """A well-behaved request's whole response: 200, its text, some audio, a stop."""
    head, _, body = received.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"status {head[:40]!r}: {body[:200]!r}")
    events = _unchunk(body).decode().split("\n\n")
    if events[-2:] != ["data: [DONE]", ""]:
        raise RuntimeError(f"no [DONE] at the end: {events[-3:]!r}")
    text, audio, finishes = [], 0, []
    for event in events[:-2]:
        chunk = json.loads(event.removeprefix("data: "))
        if "error" in chunk:
            raise RuntimeError(f"an error event: {chunk['error']}")
        for choice in chunk["choices"]:
            delta = choice["delta"]
            text.append(delta.get("content") or "")
            audio += delta.get("audio") is not None
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
    if finishes != ["stop"]:
        raise RuntimeError(f"finish reasons {finishes}")
    if "".join(text) != expected_text(prompt, options.short_tokens):
        raise RuntimeError(f"the text is not the answer: {''.join(text)!r}")
    if not audio:
        raise RuntimeError("no audio")


async def short_request(port: int, prompt: str, options: Options, into: WellBehaved) -> None:
    """One well-behaved request: read to its end, checked."""
    import trio

    sent = time.monotonic()
    try:
        with trio.fail_after(30):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            received = bytearray()
            async with stream:
                await stream.send_all(chat_request(port, prompt, close=True))
                async for data in stream:
                    received += data
                    if received.endswith(b"\r\n0\r\n\r\n"):  # the last chunk
                        break
        took = time.monotonic() - sent
        check_answer(bytes(received), prompt, options)
    except (OSError, RuntimeError, ValueError, trio.TooSlowError) as exc:
        into.failures.append(f"{prompt}: {type(exc).__name__}: {exc}")
    else:
        into.latencies.append(took)


async def well_behaved(port: int, options: Options, name: str, into: WellBehaved) -> None:
    """A short request every ``interval`` for ``seconds`` (each started on schedule)."""
    import trio

    count = max(1, round(options.seconds / options.interval))
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for index in range(count):
            await trio.sleep_until(start + index * options.interval)
            into.started += 1
            nursery.start_soon(short_request, port, f"{SHORT} {name} {index}", options, into)


@dataclass
class Slow:
    """One slow client."""

    prompt: str
    sent: float = 0.0  # monotonic
    headers: float = 0.0  # seconds from sent: the response's headers read
    status: str = ""
    #: Bytes the server wrote that this client did not read, and when they last grew.
    buffered: int = 0
    stalled: float = 0.0  # seconds from sent
    hung_up: float = 0.0  # seconds from sent
    local_port: int = 0


async def slow_client(port: int, client: Slow, silence: float, done: Any) -> None:
    """Send the request, read the response's headers and not a byte more, then keep
    the socket open, reading nothing, for ``silence`` seconds; then hang up (with
    unread data, the close resets the connection)."""
    import socket

    import trio

    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        await sock.connect(("127.0.0.1", port))
        client.local_port = sock.getsockname()[1]
        client.sent = time.monotonic()
        request = chat_request(port, client.prompt, close=False)
        while request:
            request = request[await sock.send(request) :]
        with trio.fail_after(30):
            while True:
                peeked = await sock.recv(65536, socket.MSG_PEEK)
                if not peeked:
                    raise ConnectionError("closed before the response's headers")
                end = peeked.find(b"\r\n\r\n")
                if end >= 0:
                    break
                await trio.sleep(0.01)  # the rest of the headers is on its way
        head = await sock.recv(end + 4)  # the headers, exactly
        assert len(head) == end + 4
        client.headers = time.monotonic() - client.sent
        client.status = head.split(b"\r\n", 1)[0].decode()
        await trio.sleep_until(trio.current_time() + silence)
    finally:
        client.hung_up = time.monotonic() - client.sent
        sock.close()
        done()


async def watch_queues(server_port: int, clients: list[Slow], until: Any) -> None:
    """Poll what each slow client's connection holds unread (its receive queue plus the
    server's send queue), noting when it last grew: when the server stopped writing."""
    import trio

    while not until.is_set():
        queues = _tcp_queues()
        now = time.monotonic()
        for client in clients:
            if not client.local_port or client.hung_up:
                continue
            _, rx = queues.get((client.local_port, server_port), (0, 0))
            tx, _ = queues.get((server_port, client.local_port), (0, 0))
            if rx + tx > client.buffered:
                client.buffered = rx + tx
                client.stalled = now - client.sent
        with trio.move_on_after(0.05):
            await until.wait()


class RssSampler:
    """The RSS of a process tree every 0.1 s: its peak, each process's RSS then, and
    its timeline."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.at_peak = rss_by_pid(pid)  # pid -> bytes, when the tree was at its peak
        self.peak = sum(self.at_peak.values())
        self.timeline: list[tuple[float, int]] = []  # (monotonic, bytes)

    async def run(self, until: Any) -> None:
        import trio

        while not until.is_set():
            each = rss_by_pid(self.pid)
            rss = sum(each.values())
            self.timeline.append((time.monotonic(), rss))
            if rss > self.peak:
                self.peak, self.at_peak = rss, each
            with trio.move_on_after(0.1):
                await until.wait()


def growth_by_process(
    server: int, before: dict[int, int], at: dict[int, int], events: list[dict[str, Any]]
) -> dict[str, int]:
    """Each process's RSS growth from ``before`` to ``at``, bytes: ``server``, and the
    workers by their stage's name (the engines note their pid)."""
    names = {server: "server"}
    for event in events:
        if "pid" in event:
            names[event["pid"]] = STAGES[event["stage"]]
    return {
        names.get(pid, f"pid {pid}"): at.get(pid, 0) - before.get(pid, 0)
        for pid in dict.fromkeys([*before, *at])
    }


# -- a round ----------------------------------------------------------------------------------


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


async def one_round(
    server: Server, options: Options, name: str, slow: int, events: Path
) -> dict[str, Any]:
    import trio

    port = server.port
    before_metrics = await scrape(port)
    by_process_before = tree_rss_by_process(server.pid)
    sampler = RssSampler(server.pid)
    rss_before, by_pid_before = sampler.peak, sampler.at_peak
    requests = WellBehaved()
    clients = [Slow(f"{name} slow client {i}: tell me a long story") for i in range(slow)]
    ended = trio.Event()
    hung_up = trio.Event()
    remaining = [slow]
    errors_seen: list[tuple[float, float]] = []  # (monotonic, errors so far this round)
    most_unread = {"bytes": 0.0, "outputs": 0.0}
    last_tables: dict[str, float] = {}
    base_errors = value(
        before_metrics, "omni_trio:orchestrator_requests_ended_total", finish_reason="error"
    )

    def one_hung_up() -> None:
        remaining[0] -= 1
        if not remaining[0]:
            hung_up.set()

    async def watch_server() -> None:
        """Until the hang-ups: the orchestrator's errors, the most left unread, and the
        tables as they were last."""
        while not hung_up.is_set():
            samples = await scrape(port)
            count = value(
                samples, "omni_trio:orchestrator_requests_ended_total", finish_reason="error"
            )
            if not errors_seen or errors_seen[-1][1] != count - base_errors:
                errors_seen.append((time.monotonic(), count - base_errors))
            found = tables(samples)
            for kind in ("bytes", "outputs"):
                unread = sum(
                    v for k, v in found.items() if k.startswith(f"omni_trio:unread_{kind}")
                )
                most_unread[kind] = max(most_unread[kind], unread)
            if time.monotonic() < start + options.seconds:  # no client has hung up yet
                last_tables.clear()
                last_tables.update({k: v for k, v in found.items() if v})
            with trio.move_on_after(0.1):
                await hung_up.wait()

    start = time.monotonic()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sampler.run, ended)
        if slow:
            for client in clients:
                nursery.start_soon(slow_client, port, client, options.seconds, one_hung_up)
            nursery.start_soon(watch_queues, port, clients, hung_up)
            nursery.start_soon(watch_server)
        await well_behaved(port, options, name, requests)
        if slow:
            await hung_up.wait()
        silence_end = time.monotonic()
        # Every per-request table empty, as reported after the last client left.
        empty_after, left = math.inf, {}
        with trio.move_on_after(15):
            while True:
                samples = await scrape(port)
                left = {k: v for k, v in tables(samples).items() if v}
                age = _report_age(samples)
                if not left and age < time.monotonic() - silence_end:
                    empty_after = time.monotonic() - silence_end
                    break
                await trio.sleep(0.1)
        await trio.sleep(0.5)
        ended.set()
    after_metrics = await scrape(port)
    rss_after = tree_rss(server.pid)

    def delta(name: str, **labels: str) -> float:
        return value(after_metrics, name, **labels) - value(before_metrics, name, **labels)

    slow_results = _slow_results(clients, read_events(events), errors_seen)
    return {
        "name": name,
        "slow": slow,
        "wall": time.monotonic() - start,
        "well_behaved": {
            "started": requests.started,
            "succeeded": len(requests.latencies),
            "failures": requests.failures,
            "latency": _summary(requests.latencies),
        },
        "rss": {"before": rss_before, "peak": sampler.peak, "after": rss_after},
        "rss_growth_at_peak": growth_by_process(
            server.pid, by_pid_before, sampler.at_peak, read_events(events)
        ),
        "rss_timeline": [[round(t - start, 2), rss] for t, rss in sampler.timeline[::5]],
        "rss_by_process": {
            "before": by_process_before,
            "after": tree_rss_by_process(server.pid),
        },
        "slow_requests": slow_results,
        "orchestrator_ended": {
            reason: delta("omni_trio:orchestrator_requests_ended_total", finish_reason=reason)
            for reason in ("completed", "aborted", "error")
        },
        "server_finished": {
            reason: delta("omni_trio:requests_finished_total", finish_reason=reason)
            for reason in ("completed", "aborted", "error", "length")
        },
        "errors_seen": [[round(t - start, 3), n] for t, n in errors_seen],
        "most_unread": most_unread,
        "tables_before_hang_up": last_tables,
        "tables_empty_after": empty_after,
        "tables_left": left,
    }


def _slow_results(
    clients: list[Slow], events: list[dict[str, Any]], errors_seen: list[tuple[float, float]]
) -> list[dict[str, Any]]:
    ids = {e["prompt"]: e["request"] for e in events if e["event"] == "start" and "prompt" in e}
    results = []
    for client in clients:
        rid = ids.get(client.prompt)
        ends = {e["stage"]: e for e in events if e["request"] == rid and e["event"] != "start"}
        stopped = {
            STAGES[stage]: round(end["t"] - client.sent, 3)
            for stage, end in sorted(ends.items())
            if end["event"] == "stopped"
        }
        done = [STAGES[stage] for stage, end in sorted(ends.items()) if end["event"] == "done"]
        first_stop = min(stopped.values(), default=math.nan)
        results.append(
            {
                "prompt": client.prompt,
                "status": client.status,
                "headers": round(client.headers, 3),
                "buffered_bytes": client.buffered,
                "stalled": round(client.stalled, 3),
                "stages_stopped": stopped,
                "stages_done": done,
                "stopped": round(first_stop, 3),
                "stopped_after_stall": round(first_stop - client.stalled, 3),
                "hung_up": round(client.hung_up, 3),
            }
        )
    return results


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "p50": math.nan, "p90": math.nan, "max": math.nan, "mean": math.nan}
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "p50": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }


# -- a run --------------------------------------------------------------------------------------


async def run(options: Options, directory: Path | None = None) -> dict[str, Any]:
    """Start the server, run the three rounds, stop it; the report."""
    with _directory(directory) as where:
        config = write_config(where, options)
        events = where / "engines.jsonl"
        async with serving(where, config) as server:
            for index in range(3):  # warm up: every stage has served a request
                await short_request(server.port, f"{SHORT} warm {index}", options, WellBehaved())
            rss_idle = tree_rss(server.pid)
            rounds = [
                await one_round(server, options, "baseline", 0, events),
            ]
            for index in range(options.slow_rounds):
                name = f"slow {index + 1}"
                rounds.append(await one_round(server, options, name, options.slow, events))
            processes = len(tree(server.pid))
            log = server.output()
    report = {
        "options": asdict(options),
        "pipeline": {
            "audio_seconds_per_second": options.audio_seconds_per_second,
            "long_answer_audio_seconds": options.long_audio_seconds,
        },
        "python": platform.python_version(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "server_processes": processes,
        "rss_idle": rss_idle,
        "rounds": rounds,
        "server_log": log[-4000:],
    }
    report["goals"] = goals(report)
    return report


@contextmanager
def _directory(directory: Path | None) -> Iterator[Path]:
    if directory is not None:
        yield directory
        return
    with tempfile.TemporaryDirectory(prefix="slow-clients-") as name:
        yield Path(name)


#: Seconds a slow request's engines may stop later than ``consumer_idle_timeout``
#: after the server last wrote to it (the handler's turn, the aborts' way to the
#: workers, on a loaded machine).
IDLE_SLACK = 1.0


def goals(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The issue's goals, each with what was measured and whether it was met."""
    options = Options(**report["options"])
    baseline, *slow_rounds = report["rounds"]
    first, second = slow_rounds[:2]
    timeout = options.idle_timeout
    growth = first["rss"]["peak"] - first["rss"]["before"]
    again = second["rss"]["peak"] - first["rss"]["peak"]
    ratios = [
        r["well_behaved"]["latency"]["p50"] / baseline["well_behaved"]["latency"]["p50"]
        for r in slow_rounds
    ]
    well = [r["well_behaved"] for r in report["rounds"]]
    slow = [s for r in slow_rounds for s in r["slow_requests"]]
    timed_out = [
        s
        for s in slow
        if s["status"].startswith("HTTP/1.1 200")
        and set(s["stages_stopped"]) == set(STAGES)
        and s["stopped"] >= timeout  # no output of it waited longer than it was there
        and s["stopped_after_stall"] <= timeout + IDLE_SLACK
    ]
    errors = [r["orchestrator_ended"]["error"] for r in slow_rounds]
    seen = [r["errors_seen"][-1][1] if r["errors_seen"] else 0 for r in slow_rounds]
    return {
        "rss_growth": {
            "value": growth,
            "limit": options.max_rss_growth,
            "met": growth <= options.max_rss_growth,
        },
        "well_behaved_succeed": {
            "value": [f"{w['succeeded']}/{w['started']}" for w in well],
            "met": all(w["succeeded"] == w["started"] and not w["failures"] for w in well),
        },
        "latency_p50_ratio": {
            "value": [round(r, 3) for r in ratios],
            "limit": options.max_latency_ratio,
            "met": all(r <= options.max_latency_ratio for r in ratios),
        },
        "idle_timeout_errors": {
            "value": f"{len(timed_out)}/{len(slow)} stopped at every stage at least "
            f"{timeout:g} s after they were sent and at most {timeout:g} + {IDLE_SLACK:g} s "
            f"after the server last wrote to them; orchestrator errors {errors}, "
            f"before the hang-ups {seen}",
            "met": len(timed_out) == len(slow)
            and errors == [options.slow] * len(slow_rounds)
            and seen == [options.slow] * len(slow_rounds),
        },
        "tables_empty": {
            "value": [r["tables_empty_after"] for r in report["rounds"]],
            "met": all(not r["tables_left"] for r in report["rounds"]),
        },
        "second_round_rss": {
            "value": again,
            "limit": options.max_second_round_rss,
            "met": again < options.max_second_round_rss,
        },
    }


# -- the report ---------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def render(report: dict[str, Any]) -> str:
    o = Options(**report["options"])
    lines = [
        f"Python {report['python']}; {report['machine']['cpus']} CPUs; "
        f"server tree: {report['server_processes']} processes, "
        f"{_mib(report['rss_idle'])} MiB RSS idle",
        f"long answers: {o.long_audio_seconds / 60:.0f} min of audio at "
        f"{o.audio_seconds_per_second:g} s of audio per second, in outputs of "
        f"{o.chunk_codes * 0.04:g} s ({o.output_bytes:,} bytes); short: {o.short_tokens} words",
        f"max_unread_bytes = {_mib(o.max_unread_bytes)} MiB; consumer_idle_timeout = "
        f"{o.idle_timeout:g} s; {o.slow} slow clients silent {o.seconds:g} s; a short "
        f"request every {o.interval:g} s",
        "",
        f"{'round':<9} {'ok':>7} {'p50 ms':>7} {'p90 ms':>7} {'max ms':>7} "
        f"{'RSS before':>10} {'peak':>7} {'after':>7} {'growth':>7} {'per slow':>8} "
        f"{'ended err':>9} {'empty s':>8}",
    ]
    for r in report["rounds"]:
        w = r["well_behaved"]
        lat = w["latency"]
        rss = r["rss"]
        growth = rss["peak"] - rss["before"]
        per_slow = _mib(growth / r["slow"]) if r["slow"] else "-"
        lines.append(
            f"{r['name']:<9} {w['succeeded']:>3}/{w['started']:<3} "
            f"{lat['p50'] * 1e3:>7.1f} {lat['p90'] * 1e3:>7.1f} {lat['max'] * 1e3:>7.1f} "
            f"{_mib(rss['before']):>10} {_mib(rss['peak']):>7} {_mib(rss['after']):>7} "
            f"{_mib(growth):>7} {per_slow:>8} {r['orchestrator_ended']['error']:>9.0f} "
            f"{r['tables_empty_after']:>8.2f}"
        )
    lines += ["", "RSS growth at the peak, by process (MiB):"]
    for r in report["rounds"]:
        by = ", ".join(f"{k} {_mib(v)}" for k, v in r.get("rss_growth_at_peak", {}).items())
        lines.append(f"  {r['name']:<9} {by}")
    lines += ["", "slow requests (seconds from the request sent):"]
    lines.append(
        f"  {'round':<8} {'client':>6} {'headers':>8} {'unread KiB':>10} {'stalled':>8} "
        f"{'stopped (thinker, talker, code2wav)':>36} {'after stall':>11} {'hung up':>8}"
    )
    for r in report["rounds"][1:]:
        for index, s in enumerate(r["slow_requests"]):
            stops = ", ".join(f"{s['stages_stopped'].get(n, math.nan):.2f}" for n in STAGES)
            lines.append(
                f"  {r['name']:<8} {index:>6} {s['headers']:>8.3f} "
                f"{s['buffered_bytes'] / 1024:>10.0f} {s['stalled']:>8.2f} {stops:>36} "
                f"{s['stopped_after_stall']:>11.2f} {s['hung_up']:>8.2f}"
            )
    for r in report["rounds"][1:]:
        held = ", ".join(f"{k} {v:g}" for k, v in r["tables_before_hang_up"].items())
        lines.append(f"  {r['name']}, the last look before the hang-ups: {held}")
    lines += ["", "goals:"]
    for name, goal in report["goals"].items():
        limit = f" (limit {goal['limit']})" if "limit" in goal else ""
        shown = goal["value"]
        if name == "rss_growth":
            shown = f"{_mib(goal['value'])} MiB, {_mib(goal['value'] / o.slow)} MiB per slow client"
            limit = (
                f" (limit {_mib(goal['limit'])} MiB: {o.max_rss_per_slow:g} x "
                f"max_unread_bytes per slow client)"
            )
        elif name == "second_round_rss":
            shown = f"{_mib(goal['value'])} MiB"
            limit = f" (limit {_mib(goal['limit'])} MiB)"
        lines.append(f"  {name}: {shown}{limit}: {'met' if goal['met'] else 'NOT MET'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/bench_slow_clients.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--seconds", type=float, default=65.0, help="each round, and the silence (default 65)"
    )
    parser.add_argument("--slow", type=int, default=4, help="slow clients (default 4)")
    parser.add_argument(
        "--idle-timeout", type=float, default=60.0, help="consumer_idle_timeout (default 60)"
    )
    parser.add_argument(
        "--interval", type=float, default=0.5, help="between short requests (default 0.5)"
    )
    parser.add_argument(
        "--chunk-codes",
        type=int,
        default=25,
        help="codes per code2wav output, 40 ms of audio each (default 25: 1 s, 48,000 bytes)",
    )
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    options = Options(
        seconds=args.seconds,
        slow=args.slow,
        idle_timeout=args.idle_timeout,
        interval=args.interval,
        chunk_codes=args.chunk_codes,
    )
    if options.idle_timeout and options.seconds < options.idle_timeout + 1:
        parser.error(
            "--seconds must outlast --idle-timeout by the time the sockets take to fill "
            "(the slow clients would hang up before their requests time out)"
        )
    import trio

    report = trio.run(run, options)
    report["command"] = "PYTHONPATH=src python tools/bench_slow_clients.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(goal["met"] for goal in report["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
