"""Slow clients against ``omni-trio serve``: clients that open a streaming text+audio
request, read its headers and then nothing, with their sockets open, cost the server
bounded memory and the other clients nothing; the idle timeout ends their requests at
every stage; once they hang up, nothing of them is left.

It runs ``tools/bench_slow_clients.py`` (the benchmark, whose figures are in
docs/performance.md) at a small size: 4 slow clients, ``consumer_idle_timeout = 2``,
5 s of silence, a short request every 0.5 s; a baseline round, then two identical
rounds with the slow clients. Everything is observed from outside the server: its
process tree's RSS through ``/proc``, its sockets' queues through ``/proc/net/tcp``,
its per-request tables on ``/metrics``, and the engines' own notes of when they were
stopped. The long answers stream fast enough (64 s of audio per second) that their
final stages run out of credit before the timeout.

The long answers' audio comes in large outputs (80 s, 3.84 MB each, nearly the whole
4 MiB window), and what each stalled request holds is held to twice its window: the
server writes a large output's event a piece at a time, a worker out of credit holds
its engine before it makes its next output, not with it in hand, and the server and
its workers give freed buffers of 2 MiB or more back to the system.

The well-behaved requests' median latency against the baseline's (within 20%) is the
benchmark's to judge, over 60 s: ten requests on a shared two-core machine are too few
for it. Here none of them may wait on a slow client (at most 1 s, half the timeout).

First, in-process: ``/metrics`` shows every per-request table the test reads; and the
answer's pieces: a large output's event, a slice at a time, is the event it was.
"""

from __future__ import annotations

import base64
import random
import sys
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest
import trio

pytest.importorskip("hypercorn")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_slow_clients as bench

from helpers import ONLY_FULL_SIZE
from omni_trio import OrchOutput, open_orchestrator
from omni_trio._audio import wav_bytes
from omni_trio.process._stage import WORKER_TABLES
from omni_trio.serve import FinalOutput, ServedModel, create_app, serve
from omni_trio.serve._answer import PIECE_BYTES, Answer, Plan
from omni_trio.serve._app import server_state
from serve_helpers import (
    AUDIO,
    MANUAL,
    MODEL,
    PROMPTLY,
    TEXT,
    Engine,
    Metrics,
    ScriptedPipeline,
    chat_body,
    sse_events,
    warm,
)

#: What each stage's ``statistics()`` says, as a ProcessStage's would (``None``: not known).
TABLES = {
    "in_flight": 3,
    "submits_waiting": 1,
    "seconds_since_report": None,
    "worker_requests": 4,
    "chunks_waiting": 5,
    "chunks_held": 6,
    "chunk_bytes_held": 7,
    "chunks_unacked": 8,
    "chunk_bytes_unacked": 9,
    "requests_written": 10,
    "acks_owed": 11,
    "ring_bytes_in_use": 12,
    "engines_waiting": 13,
    "slots_waiting": 14,
}
STAGE_GAUGES = {
    "in_flight": "omni_trio:stage_requests_in_flight",
    "submits_waiting": "omni_trio:stage_submits_waiting",
    "seconds_since_report": "omni_trio:worker_seconds_since_report",
    "worker_requests": "omni_trio:worker_requests",
    **{name: f"omni_trio:worker_{name}" for name in WORKER_TABLES},
}


class Reporting:
    """What the server sees of a stage: its name, and its ``statistics()``."""

    def __init__(self, name: str, **tables: Any) -> None:
        self.name = name
        self.tables = tables

    def statistics(self) -> SimpleNamespace:
        return SimpleNamespace(**self.tables)


async def test_metrics_show_every_per_request_table(nursery: trio.Nursery) -> None:
    engine = Engine(nursery)
    stages = [Reporting("thinker", **TABLES), Reporting("talker"), Reporting("code2wav")]

    @asynccontextmanager
    async def open_pipeline() -> Any:
        async with open_orchestrator(engine.stages, {0, 2}, prewarm_fn=warm) as orchestrator:
            yield ScriptedPipeline(orchestrator, stages)

    app = create_app(ServedModel(MODEL, (TEXT, AUDIO)), open_pipeline)
    url = await nursery.start(partial(serve, app, port=0))
    state = server_state(app)

    def scrape() -> Metrics:
        return Metrics(state.metrics.render().decode())

    # A stage's tables as it reports them; those it does not know are left out.
    metrics = scrape()
    for attribute, name in STAGE_GAUGES.items():
        samples = [s for s in metrics.samples if s[0] == name]
        expected = TABLES[attribute]
        if expected is None:
            assert samples == []
        else:
            assert [(s[1]["stage"], s[2]) for s in samples] == [("thinker", expected)], name

    prompt = MANUAL + "in flight"
    async with (
        httpx.AsyncClient(timeout=PROMPTLY) as client,
        client.stream(
            "POST", url + "/v1/chat/completions", json=chat_body(prompt, stream=True)
        ) as response,
    ):
        await engine.submitted(prompt, 2)
        metrics = scrape()
        for name in (
            "omni_trio:server_requests_active",
            "omni_trio:server_tickets",
            "omni_trio:num_requests_running",
            "omni_trio:orchestrator_requests_in_flight",
            "omni_trio:orchestrator_streams_open",
            "omni_trio:unread_requests",
        ):
            assert metrics[name] == 1, name
        assert metrics["omni_trio:orchestrator_requests_admitted_total"] == 1
        await engine.play_all(prompt)
        body = b"".join([chunk async for chunk in response.aiter_bytes()])
    assert sse_events(body)[-1] == "[DONE]"
    with trio.fail_after(PROMPTLY):  # the response's task ends a moment after its last byte
        await state.wait_idle()

    metrics = scrape()
    ended = "omni_trio:orchestrator_requests_ended_total"
    assert {r: metrics[ended, {"finish_reason": r}] for r in ("completed", "aborted", "error")} == {
        "completed": 1,
        "aborted": 0,
        "error": 0,
    }
    for name in bench.TABLES:
        if not name.startswith(("omni_trio:stage_", "omni_trio:worker_")):
            assert [s for s in metrics.samples if s[0] == name], f"no {name}"
            assert metrics[name] == 0, name
    for name in ("omni_trio:unread_outputs", "omni_trio:unread_bytes"):
        assert {s[1]["stage"] for s in metrics.samples if s[0] == name} == {
            "thinker",
            "talker",
            "code2wav",
        }


def _answer(audio_format: str, rate: int) -> Answer:
    outputs = (FinalOutput(0, "text", "thinker"), FinalOutput(2, "audio", "code2wav", rate))
    return Answer(Plan("tell me", outputs, True, False, audio_format, None), "m")


def _out(stage: int, data: object) -> OrchOutput:
    return OrchOutput("r", stage, data, False)


def _events(raw: bytes) -> list[Any]:
    blocks = raw.decode().split("\n\n")
    assert blocks[-1] == ""
    return [msgspec.json.decode(block.removeprefix("data: ")) for block in blocks[:-1]]


def _audio(events: list[Any]) -> bytes:
    return b"".join(
        base64.b64decode(e["choices"][0]["delta"]["audio"]["data"])
        for e in events
        if e["choices"][0]["delta"].get("audio")
    )


@pytest.mark.parametrize(
    ("audio_format", "rate"), [("pcm16", 24_000), ("pcm16", 22_050), ("wav", 24_000)]
)
def test_a_large_output_is_written_in_pieces_of_its_event(audio_format: str, rate: int) -> None:
    """An output of 4.8 MB goes out in pieces of about PIECE_BYTES, which join into
    the events it always made: the same audio, one event per output."""
    pcm = random.Random(7).randbytes(4_800_001)  # odd: a half sample at its end
    small = b"\x01\x00" * 10
    answer = _answer(audio_format, rate)
    pieces = list(answer.pieces([_out(0, "Hi"), _out(2, pcm), _out(2, small)]))

    assert len(pieces) > 4_800_000 * 4 // 3 // PIECE_BYTES
    assert max(map(len, pieces)) <= 1.1 * PIECE_BYTES  # (a resampled slice is longer)
    assert answer.open_event_tail == b""  # every event closed
    events = _events(b"".join(pieces))
    assert [e["choices"][0]["delta"].get("content") for e in events] == ["Hi", None, None]
    if audio_format == "wav":
        assert _audio(events) == wav_bytes(pcm, rate) + wav_bytes(small, rate)
    else:
        from omni_trio.speech._resample import Resampler

        resampler = Resampler(rate, 24_000)
        assert _audio(events) == resampler.feed(pcm) + resampler.feed(small)


def test_a_long_text_is_written_in_pieces_of_its_event() -> None:
    """Text is sliced too (its JSON may be 6 bytes a character); the pieces join
    into its one event, exactly its text."""
    rng = random.Random(7)
    text = "".join(rng.choice(["a", "\x00", "é", "😀", '"', "\\", "\n"]) for _ in range(200_000))
    pieces = list(_answer("pcm16", 24_000).pieces([_out(0, text), _out(0, "!")]))
    assert len(pieces) > 1
    assert max(map(len, pieces)) <= PIECE_BYTES
    events = _events(b"".join(pieces))
    assert [e["choices"][0]["delta"]["content"] for e in events] == [text, "!"]


@pytest.mark.parametrize("stage", [0, 2], ids=["text", "audio"])
def test_an_event_cut_between_its_pieces_is_closed_by_its_tail(stage: int) -> None:
    """A response cut short after a piece that ends inside an event (the server shut
    down, say) sends ``open_event_tail`` before its error event: the cut event is
    whole, its value shorter."""
    answer = _answer("pcm16", 24_000)
    data: str | bytes = "x" * 200_000 if stage == 0 else bytes(1_000_000)
    pieces = answer.pieces([_out(0, "Hi"), _out(stage, data)])
    written = b""
    for count in range(3):  # the event's head (and the one before), then two slices
        written += next(pieces)
        assert answer.open_event_tail
        hi, event = _events(written + answer.open_event_tail)
        delta = event["choices"][0]["delta"]
        value = delta["content"] if stage == 0 else _audio([event])
        assert hi["choices"][0]["delta"]["content"] == "Hi"
        assert value == data[: len(value)]
        assert (len(value) > 0) == (count > 0)
    assert len(value) < len(data)


TIMEOUT = 2.0
#: Long answers whose audio comes in outputs of 80 s (3.84 MB): a stalled request's
#: window is nearly one output.
OPTIONS = bench.Options(
    seconds=5.0, slow=4, idle_timeout=TIMEOUT, tokens_per_second=400.0, chunk_codes=2000
)
MIB = 1024 * 1024


@ONLY_FULL_SIZE  # the benchmark end to end, in real time (about 20 s)
async def test_slow_clients_cost_bounded_memory_and_the_others_nothing(tmp_path: Path) -> None:
    report = await bench.run(OPTIONS, tmp_path)
    print(bench.render(report))  # shown when it fails
    baseline, first, second = report["rounds"]
    goals = report["goals"]

    # The server's process tree (the server and its workers) grew by at most twice the
    # window per stalled request: 32 MiB for 4 (it grew by 71 MiB when the server held
    # each large output's event whole, twice, and code2wav its next output).
    assert OPTIONS.max_unread_bytes == 4 * MIB
    for slow_round in (first, second):
        growth = slow_round["rss"]["peak"] - first["rss"]["before"]
        bound = OPTIONS.slow * 2 * OPTIONS.max_unread_bytes
        assert growth <= bound, (f"{growth / MIB:.1f} MiB", slow_round["rss_growth_at_peak"])
    assert goals["rss_growth"]["met"]
    # What the slow requests left unread stayed within their windows (4 MiB each).
    for slow_round in (first, second):
        assert 0 < slow_round["most_unread"]["bytes"] <= OPTIONS.slow * 4 * MIB

    # Every well-behaved request succeeded, and none waited on a slow client.
    for each in report["rounds"]:
        well = each["well_behaved"]
        assert well["failures"] == []
        assert well["succeeded"] == well["started"] == 10
        assert well["latency"]["max"] < TIMEOUT / 2, each["name"]

    # Each slow request ended with an error at consumer_idle_timeout, while its client
    # still held its socket, and was stopped at every stage.
    for slow_round in (first, second):
        assert slow_round["orchestrator_ended"] == {"completed": 10, "aborted": 0, "error": 4}
        assert slow_round["errors_seen"][-1][1] == 4  # before the hang-ups
        assert slow_round["server_finished"]["error"] == 4
        for slow in slow_round["slow_requests"]:
            assert slow["status"].startswith("HTTP/1.1 200"), slow
            assert slow["buffered_bytes"] > 0, slow  # the server wrote what it could
            assert set(slow["stages_stopped"]) == set(bench.STAGES), slow
            assert slow["stages_done"] == [], slow
            assert slow["stopped"] >= TIMEOUT, slow
            assert slow["stopped_after_stall"] <= TIMEOUT + bench.IDLE_SLACK, slow
            assert slow["hung_up"] >= OPTIONS.seconds, slow
    assert goals["idle_timeout_errors"]["met"]

    # After the slow clients hung up, every per-request table is empty (on /metrics:
    # the server's, the orchestrator's, each stage's and its worker's).
    for each in report["rounds"]:
        assert each["tables_left"] == {}, each["name"]
        assert each["tables_empty_after"] < 15

    # A second identical round added less than 8 MiB of RSS.
    again = second["rss"]["peak"] - first["rss"]["peak"]
    assert again < 8 * MIB, f"{again / MIB:.1f} MiB"
    assert baseline["slow_requests"] == []
