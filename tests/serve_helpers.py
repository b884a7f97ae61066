"""A scripted pipeline behind the real server, and ways to talk to it.

:func:`running_server` serves a three-stage pipeline of :class:`ScriptedStage` on a
free loopback port: the thinker (stage 0, text, final), the talker (stage 1) and
code2wav (stage 2, audio, final), in async_chunk mode. Its :class:`Engine` plays, for
every submission, a script that depends on the prompt (:func:`text_of`,
:func:`audio_of`), so a test can compare exactly what the stages emitted with what a
client got, and tell one request's data from another's. A prompt starting with
:data:`MANUAL` gets no script: the test emits for it by hand.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import wave
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from omni_trio import Orchestrator, open_orchestrator
from omni_trio.serve import FinalOutput, ServedModel, create_app, serve
from omni_trio.serve._app import server_state
from omni_trio.testing import ScriptedStage

MODEL = "qwen-omni-scripted"
SAMPLE_RATE = 24_000  # OpenAI's: pcm16 passes through as it is
TEXT = FinalOutput(0, "text", "thinker")
AUDIO = FinalOutput(2, "audio", "code2wav", SAMPLE_RATE)
#: Prompts starting with this get no script: the test drives their stages.
MANUAL = "manual:"
TEXT_DELTAS = 4
AUDIO_CHUNKS = 3
#: Generous bounds on waiting for something that should happen at once.
PROMPTLY = 5.0


def text_of(prompt: str) -> list[str]:
    """The text deltas the thinker emits for ``prompt``."""
    return [f"{prompt}#{i} " for i in range(TEXT_DELTAS)]


def audio_of(prompt: str) -> list[bytes]:
    """The PCM chunks code2wav emits for ``prompt`` (16-bit samples: even lengths)."""
    return [hashlib.sha256(f"{prompt}#{i}".encode()).digest() * 4 for i in range(AUDIO_CHUNKS)]


def warm(stage_id: int, prompt: str) -> tuple[str, int, str]:
    """The prewarm_fn: stages 1 and 2 get the prompt too, so scripts can use it."""
    return ("warm", stage_id, prompt)


class Engine:
    """Plays the script of every request the stages get, and records who got what.

    Attributes:
      stages: The thinker, the talker, code2wav.
    """

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.stages = [
            ScriptedStage(on_submit=partial(self._submitted, i), on_abort=partial(self._aborted, i))
            for i in range(3)
        ]
        self._events: defaultdict[tuple[str, int], trio.Event] = defaultdict(trio.Event)
        self._aborts: defaultdict[tuple[str, int], trio.Event] = defaultdict(trio.Event)
        self._rids: dict[str, str] = {}

    async def _submitted(self, stage_id: int, rid: str, inputs: Any) -> None:
        prompt = inputs if stage_id == 0 else inputs[2]
        if stage_id:
            assert inputs == warm(stage_id, prompt)
        assert self._rids.setdefault(prompt, rid) == rid, "prompts must be unique"
        self._events[prompt, stage_id].set()
        if not prompt.startswith(MANUAL):
            self._nursery.start_soon(self.play, stage_id, rid, prompt)

    async def _aborted(self, stage_id: int, rid: str) -> None:
        self._aborts[rid, stage_id].set()
        await trio.lowlevel.checkpoint()

    async def submitted(self, prompt: str, stage_id: int = 0) -> str:
        """Wait until the request with ``prompt`` was submitted to ``stage_id``; its id."""
        with trio.fail_after(PROMPTLY):
            await self._events[prompt, stage_id].wait()
        return self._rids[prompt]

    def was_submitted(self, prompt: str, stage_id: int) -> bool:
        return self._events[prompt, stage_id].is_set()

    async def play(self, stage_id: int, rid: str, prompt: str) -> None:
        """Emit stage ``stage_id``'s script for ``prompt``, ending with its finish."""
        stage = self.stages[stage_id]
        if stage_id == 0:
            *deltas, last = text_of(prompt)
            for delta in deltas:
                await stage.emit(rid, delta)
            await stage.emit(rid, last, finished=True)  # the finish carries data
        elif stage_id == 1:
            await stage.emit(rid, [1, 2, 3])  # codes: never shown to the client
            await stage.emit(rid, None, finished=True)
        else:
            for chunk in audio_of(prompt):
                await stage.emit(rid, chunk)
            await stage.emit(rid, None, finished=True)

    async def play_all(self, prompt: str) -> None:
        """Play the script of a :data:`MANUAL` request at every stage it was given."""
        rid = self._rids[prompt]
        for stage_id in range(3):
            if self.was_submitted(prompt, stage_id):
                await self.play(stage_id, rid, prompt)

    async def aborted_everywhere(self, prompt: str, stage_ids: tuple[int, ...] = (0, 1, 2)) -> str:
        """Wait (promptly) until the request was aborted at each of ``stage_ids``."""
        rid = self._rids[prompt]
        with trio.fail_after(PROMPTLY):
            for stage_id in stage_ids:
                await self._aborts[rid, stage_id].wait()
        return rid


@attrs.define
class Server:
    """A running server over an :class:`Engine`'s stages."""

    url: str
    app: Any
    engine: Engine
    stopping: trio.Event
    #: Set once ``serve`` returned by itself (a drain finished).
    returned: trio.Event

    @property
    def stages(self) -> list[ScriptedStage]:
        return self.engine.stages

    @property
    def state(self) -> Any:
        return server_state(self.app)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def chat_url(self) -> str:
        return self.url + "/v1/chat/completions"


@attrs.frozen
class ScriptedPipeline:
    """What the server needs of a running pipeline (``serve.ServedPipeline``), over
    the scripted stages."""

    orchestrator: Orchestrator
    stages: list[Any]


@asynccontextmanager
async def running_server(
    *,
    outputs: tuple[FinalOutput, ...] = (TEXT, AUDIO),
    max_in_flight: int | None = None,
    max_waiting: int = 64,
    shutdown_grace: float = 5.0,
    on_outputs: Any = None,
    max_request_bytes: int | None = None,
    max_unread_bytes: int | None = None,
    consumer_idle_timeout: float | None = None,
    middleware: Any = None,
    write_timeout: float | None = None,
    tune_gc: bool = True,
) -> AsyncIterator[Server]:
    """Serve the scripted pipeline on a free port for the duration of the block
    (``None``: the default of that bound); ``middleware``: an ASGI middleware class
    around the app."""
    bounds = {
        name: value
        for name, value in (
            ("max_unread_bytes", max_unread_bytes),
            ("consumer_idle_timeout", consumer_idle_timeout),
        )
        if value is not None
    }
    app_options = {} if max_request_bytes is None else {"max_request_bytes": max_request_bytes}
    serve_options: dict[str, Any] = {"tune_gc": tune_gc}
    if write_timeout is not None:
        serve_options["write_timeout"] = write_timeout
    async with trio.open_nursery() as nursery:
        engine = Engine(nursery)

        @asynccontextmanager
        async def open_pipeline() -> AsyncIterator[ScriptedPipeline]:
            async with open_orchestrator(
                engine.stages,
                {o.stage_id for o in outputs},
                prewarm_fn=warm,
                max_in_flight=max_in_flight,
                **bounds,
            ) as orchestrator:
                yield ScriptedPipeline(orchestrator, engine.stages)

        app = create_app(
            ServedModel(MODEL, outputs),
            open_pipeline,
            max_waiting=max_waiting,
            on_outputs=on_outputs,
            **app_options,
        )
        if middleware is not None:
            app.add_middleware(middleware)
        stopping, returned = trio.Event(), trio.Event()

        async def run(task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
            await serve(
                app,
                port=0,
                stopping=stopping,
                shutdown_grace=shutdown_grace,
                task_status=task_status,
                **serve_options,
            )
            returned.set()

        url = await nursery.start(run)
        yield Server(url, app, engine, stopping, returned)
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def served(config: Any, **options: Any) -> AsyncIterator[tuple[str, Any]]:
    """A pipeline config's real pipeline (``omni_trio.open_pipeline``) served on a
    free port: its URL, and the running pipeline; ``options``: ``create_app``'s."""
    from omni_trio import open_pipeline

    running: list[Any] = []

    @asynccontextmanager
    async def opener() -> AsyncIterator[Any]:
        async with open_pipeline(config) as pipeline:
            running.append(pipeline)
            yield pipeline

    app = create_app(ServedModel.from_config(config), opener, **options)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve, app, port=0))
        yield url, running[0]
        nursery.cancel_scope.cancel()


# -- reading responses ------------------------------------------------------------------


def sse_events(body: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body, decoded (``"[DONE]"`` as is); checks that
    every event is one ``data:`` line and the body ends with ``data: [DONE]``."""
    text = body.decode()
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        assert "\n" not in block, block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1
    return events


def wav_frames(data: bytes) -> tuple[bytes, int]:
    """A self-contained WAV's PCM and sample rate (checked: mono, 16-bit)."""
    with wave.open(io.BytesIO(data), "rb") as wav:
        assert (wav.getnchannels(), wav.getsampwidth()) == (1, 2)
        return wav.readframes(wav.getnframes()), wav.getframerate()


def b64(data: str) -> bytes:
    return base64.b64decode(data, validate=True)


def chat_body(prompt: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **fields}


def raw_request(port: int, body: dict[str, Any] | bytes) -> bytes:
    """An HTTP/1.1 chat request, as bytes for a raw socket."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


# -- metrics ----------------------------------------------------------------------------


class Metrics:
    """A ``/metrics`` scrape: ``metrics["name", {"label": "value"}]`` is a sample's value
    (labels: a subset to match; the matches' sum; 0.0 when none)."""

    def __init__(self, text: str) -> None:
        self.samples = [
            (sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]

    def __getitem__(self, key: str | tuple[str, dict[str, str]]) -> float:
        name, labels = (key, {}) if isinstance(key, str) else key
        labels = {"model_name": MODEL, **labels}
        return sum(
            value
            for sample_name, sample_labels, value in self.samples
            if sample_name == name and labels.items() <= sample_labels.items()
        )

    def finished(self, reason: str) -> float:
        return self["omni_trio:requests_finished_total", {"finish_reason": reason}]
