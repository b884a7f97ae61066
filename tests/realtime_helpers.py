"""A scripted listening pipeline behind the real server's ``/v1/realtime``, and a
WebSocket client for it.

:func:`realtime_server` serves three :class:`ScriptedStage` stages: listen (stage 0,
``"transcript"``: it "hears" an utterance as ``"<N> ms of audio"``, or its text as
it is), thinker (stage 1, text: :data:`WORDS` words about what it heard, one every
``word_seconds``; a transcript that starts with "fail" makes it fail after two; a
turn of :data:`DEAF_MS` makes the listen stage fail) and
code2wav (stage 2, 24 kHz audio: a chunk per word). Each stage records its submits
and aborts, so a test can see every stage's abort of a cancelled response.

The client is ``websockets``' own synchronous one, run in a thread
(:func:`talk`), so the server keeps running in the test's Trio loop.
"""

from __future__ import annotations

import base64
import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import trio
from websockets.sync.client import ClientConnection, connect

from omni_trio import open_orchestrator
from omni_trio.serve import (
    FinalOutput,
    RealtimeOptions,
    ServedModel,
    SpeechRoute,
    create_app,
    serve,
)
from omni_trio.testing import ScriptedStage

MODEL = "omni-listening-scripted"
HEARD = FinalOutput(0, "transcript", "listen")
TEXT = FinalOutput(1, "text", "thinker")
AUDIO = FinalOutput(2, "audio", "code2wav", 24_000)
WORDS = 12
#: A response's deltas: its audio, its transcript.
DELTAS = ("response.output_audio.delta", "response.output_audio_transcript.delta")
#: What the scripted thinker says when it fails.
THINKER_BROKE = "the scripted thinker broke"
#: The scripted listen stage fails to hear a turn of exactly this many ms ...
DEAF_MS = 1_234  # no other test speaks for this long
#: ... and says this.
LISTENER_BROKE = "the scripted listener broke"
#: A chunk of audio per word: 100 ms at 24 kHz.
WORD_AUDIO = b"\x01\x00" * 2400


def heard(utterance: Any) -> str:
    """What the scripted listen stage hears in an utterance."""
    if isinstance(utterance, dict) and "audio" in utterance:
        return f"{len(utterance['audio']) // 48} ms of audio"
    if isinstance(utterance, dict):
        return str(utterance["text"])
    return str(utterance)


def answer_words(transcript: str) -> list[str]:
    return [f"{transcript.split()[0] if transcript else 'x'}{i} " for i in range(WORDS)]


@attrs.define
class Script:
    """Plays every request at the three stages; records submits and aborts."""

    nursery: trio.Nursery
    word_seconds: float = 0.0
    stages: list[ScriptedStage] = attrs.field(factory=list)
    prompts: dict[str, Any] = attrs.field(factory=dict)
    aborts: defaultdict[str, set[int]] = attrs.field(factory=lambda: defaultdict(set))
    aborted: trio.Event = attrs.field(factory=trio.Event)

    def __attrs_post_init__(self) -> None:
        self.stages = [
            ScriptedStage(on_submit=partial(self._submitted, i), on_abort=partial(self._aborted, i))
            for i in range(3)
        ]

    async def _submitted(self, stage_id: int, rid: str, inputs: Any) -> None:
        if stage_id == 0:
            self.prompts[rid] = inputs
            self.nursery.start_soon(self._play, rid, inputs)
        await trio.lowlevel.checkpoint()

    async def _aborted(self, stage_id: int, rid: str) -> None:
        self.aborts[rid].add(stage_id)
        if self.aborts[rid] >= {1, 2}:
            self.aborted.set()
        await trio.lowlevel.checkpoint()

    async def _play(self, rid: str, utterance: Any) -> None:
        listen, thinker, code2wav = self.stages
        transcript = heard(utterance)
        try:
            if transcript == f"{DEAF_MS} ms of audio":
                await listen.emit(rid, error=LISTENER_BROKE)
                return
            await listen.emit(rid, transcript, finished=True)
            for index, word in enumerate(answer_words(transcript)):
                if self.word_seconds:
                    await trio.sleep(self.word_seconds)
                if rid in self.aborts:
                    return
                if index == 2 and transcript.startswith("fail"):
                    await thinker.emit(rid, error=THINKER_BROKE)
                    return
                await thinker.emit(rid, word)
                await code2wav.emit(rid, WORD_AUDIO)
            await thinker.emit(rid, None, finished=True)
            await code2wav.emit(rid, None, finished=True)
        except Exception:  # the request ended under it: nothing more to play
            return

    def fully_aborted(self) -> list[str]:
        """The requests every stage still running them was told to abort (the
        thinker and code2wav: the listen stage finished first)."""
        return [rid for rid, stages in self.aborts.items() if stages >= {1, 2}]


@attrs.define
class RealtimeServer:
    url: str
    script: Script
    app: Any

    def ws_url(self, model: str = MODEL) -> str:
        return self.url.replace("http://", "ws://") + f"/v1/realtime?model={model}"


@asynccontextmanager
async def realtime_server(
    *,
    options: RealtimeOptions | None = None,
    word_seconds: float = 0.0,
    outputs: tuple[FinalOutput, ...] = (HEARD, TEXT, AUDIO),
    speech: SpeechRoute | None = None,
) -> AsyncIterator[RealtimeServer]:
    async with trio.open_nursery() as nursery:
        script = Script(nursery, word_seconds)

        @asynccontextmanager
        async def open_pipeline() -> AsyncIterator[Any]:
            async with open_orchestrator(
                script.stages,
                {o.stage_id for o in outputs},
                prewarm_fn=lambda stage_id, prompt: None,
            ) as orchestrator:
                yield attrs.make_class("P", ["orchestrator", "stages"])(orchestrator, script.stages)

        model = ServedModel(MODEL, outputs, speech=speech)
        app = create_app(model, open_pipeline, realtime=options)
        url = await nursery.start(partial(serve, app, port=0))
        yield RealtimeServer(url, script, app)
        nursery.cancel_scope.cancel()


class Client:
    """A session from the client's side: send events, read them (with a deadline)."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self._ids = 0

    def send(self, type: str, **fields: Any) -> str:
        self._ids += 1
        event_id = f"c{self._ids}"
        self.ws.send(json.dumps({"type": type, "event_id": event_id, **fields}))
        return event_id

    def send_raw(self, frame: str | bytes) -> None:
        self.ws.send(frame)

    def append(self, pcm: bytes, chunk_ms: int = 20) -> None:
        step = 48 * chunk_ms
        for start in range(0, len(pcm), step):
            self.send("input_audio_buffer.append", audio=b64(pcm[start : start + step]))

    def recv(self, timeout: float = 10.0) -> dict[str, Any]:
        event = json.loads(self.ws.recv(timeout=timeout))
        event["_at"] = time.monotonic()
        self.events.append(event)
        return event

    def until(self, type: str, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            event = self.recv(max(0.01, deadline - time.monotonic()))
            if event["type"] == type:
                return event

    def of(self, type: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == type]


class LoudnessDetector:
    """A voice activity detector for tests (``RealtimeOptions.detector``): audio with
    any sample not zero is speech, audio of zeros silence, and the turn's rules are
    the session's settings -- so a test says exactly when a turn starts, pauses and
    ends, without the voice extra's model."""

    def __init__(self, options: Any) -> None:
        self.options = options
        self._ms = 0  # the audio's clock: it counts on through a reset
        self.reset()

    def reset(self) -> None:
        self._speaking = False
        self._silence_at: int | None = None
        self._speculated = False

    def feed(self, pcm: bytes) -> list[Any]:
        from omni_trio.speech import SilenceStarted, SpeechResumed, SpeechStarted, SpeechStopped

        start, self._ms = self._ms, self._ms + len(pcm) // 48
        events: list[Any] = []
        if any(pcm):
            if not self._speaking:
                self._speaking = True
                events.append(SpeechStarted(start))
            elif self._speculated:
                events.append(SpeechResumed(start))
            self._silence_at, self._speculated = None, False
        elif self._speaking:
            if self._silence_at is None:
                self._silence_at = start
            silent = self._ms - self._silence_at
            after = self.options.speculate_after_ms
            if after and not self._speculated and silent >= after:
                self._speculated = True
                events.append(SilenceStarted(self._silence_at))
            if silent >= self.options.silence_duration_ms:
                events.append(SpeechStopped(self._silence_at))
                self.reset()
        return events


def loud(ms: int) -> bytes:
    """``ms`` of "speech" for :class:`LoudnessDetector`."""
    return b"\x01\x00" * (24 * ms)


async def metric(server: RealtimeServer, name: str, **labels: str) -> float:
    """A sample of the server's ``/metrics`` (0 if it has none with ``labels``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{server.url}/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return 0.0


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def talk(url: str, script: Callable[[Client], Any]) -> Any:
    """Run ``script(client)`` against a new session, in a thread."""

    def run() -> Any:
        with connect(url, max_size=None) as ws:
            client = Client(ws)
            assert client.recv()["type"] == "session.created"
            client.events.clear()
            return script(client)

    return await trio.to_thread.run_sync(run)


def quiet(ms: int) -> bytes:
    return b"\x00\x00" * (24 * ms)
