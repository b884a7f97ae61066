"""The voice scenarios: a spoken conversation with ``/v1/realtime``, timed from the
client's side and, through :attr:`RealtimeOptions.trace`, from the server's.

``python -m omni_trio.bench._voice --part turns [--quick]`` and ``--part barge-in``
each run in a process of their own and print their results as JSON;
:mod:`omni_trio.bench._voice_report` runs them, judges the goals and prints the
tables. Everything goes through the real server over loopback: the shipped ``voice``
pipeline (Whisper tiny.en listens, the simulated thinker answers, eSpeak NG speaks),
served by :func:`omni_trio.serve.serve`, with server VAD in the session.

The client is a process of its own (``python -m omni_trio.bench._voice --client``,
a JSON plan on stdin), speaking the Realtime API's GA events over ``websockets``
directly, as the ``openai`` package's Realtime client does underneath (with its
defaults: permessage-deflate), but without parsing every event into a model first:
each frame is stamped with ``time.perf_counter()`` the moment it is read, and each
20 ms append the moment it is sent. In a process of its own it takes no GIL from the
server, whose trace stamps are ``time.perf_counter()`` too: on Linux both are
``CLOCK_MONOTONIC``, one clock for every process. The client is a microphone: it
streams 24 kHz PCM16 at real-time pace, 20 ms per append (each chunk sent once it
would have been recorded), silence between the questions, which eSpeak NG speaks.

- ``turns``: sessions that each ask questions turn after turn (a question, then,
  once the answer's ``response.done`` came and a pause passed, the next), at 1 and
  at 10 concurrent sessions (each session asks its own question, and their starts
  are spread over one turn, as independent users' are), with and without
  speculative recognition. Per turn, from ``input_audio_buffer.speech_stopped``: the
  transcript (``conversation.item.input_audio_transcription.completed``), the
  answer's first text (``response.output_audio_transcript.delta``) and first audio
  (``response.output_audio.delta``); before it, the VAD's hangover, on the audio
  clock: where the speech really ended (the question's last sample above
  :data:`SPEECH_LEVEL`), where the VAD put the end (``audio_end_ms``), and the wall
  time from sending the speech's last chunk to ``speech_stopped``. And whether each
  session heard its own question and the answer quoted it (isolation). The
  server's side of each turn, from its ``speech_stopped``: the served orchestrator
  is tapped, so each response's request has its outputs stamped as its session
  takes them -- when it was admitted, its transcript, the answer's first text, the
  talker's first phrase complete in that text, the first audio, the text's end.
  :func:`turns_part` runs another shipped pipeline too, in one mode or both: the
  language model's bench (:mod:`omni_trio.bench._llm`) times ``assistant``'s turns
  with it.
- ``barge-in``: one session, a slow thinker (:data:`BARGE_IN_THINKER`), questions
  chained: each new question starts the moment the previous answer's first audio
  arrives, so it interrupts that answer, and its own answer is the next trial's.
  Server side (the trace): from the VAD's decision (``speech_started``) to the
  response's cancellation, to its request's block exiting (every stage was sent
  its abort: ``request_ended``), to its ``response.done`` queued; and when every
  stage's worker had let go (polled, below). Client side: ``speech_started``'s
  arrival to ``response.done``'s, and any delta of the cancelled response after
  ``speech_started`` (there must be none).

Workers letting go: the orchestrator releases a request right after aborting it,
so a stage's ``in_flight`` (the supervisor's count) drops at once; what shows the
worker's side is the table its ``Ping`` answer reports (``worker_requests``): a
worker forgets the request, and cancels its engine, when it handles the release.
From each cancelled request's ``request_ended`` the bench calls
``refresh_statistics()`` on every stage in turn, until all report no request; a
``Ping`` is answered after every command sent before it, so the first round that
reports none bounds the moment from above, to within one round (its duration is
reported). An engine inside a thread (Whisper, eSpeak NG) finishes that call after
its cancellation.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import msgspec
import trio

from .. import open_pipeline
from ..config import PipelineConfig, shipped_pipeline

__all__ = [
    "BARGE_IN_THINKER",
    "QUESTIONS",
    "Sizes",
    "barge_in_part",
    "content_words",
    "main",
    "quotes",
    "recall",
    "speak",
    "summary",
    "turns_part",
    "voice_config",
]

RATE = 24_000  # the Realtime API's PCM rate
CHUNK_MS = 20
CHUNK_BYTES = RATE * 2 * CHUNK_MS // 1000
#: The session's server VAD: the Realtime API's defaults, spelled out.
SILENCE_MS = 500
TURN_DETECTION = {
    "type": "server_vad",
    "threshold": 0.5,
    "prefix_padding_ms": 300,
    "silence_duration_ms": SILENCE_MS,
    "create_response": True,
    "interrupt_response": True,
}
#: The ``session.update`` of a voice session: audio out, 24 kHz PCM both ways, server
#: VAD with barge-in.
SESSION = {
    "type": "realtime",
    "output_modalities": ["audio"],
    "audio": {
        "input": {
            "format": {"type": "audio/pcm", "rate": RATE},
            "turn_detection": TURN_DETECTION,
        },
        "output": {"format": {"type": "audio/pcm", "rate": RATE}},
    },
}
#: A sample louder than this (about -54 dBFS) is speech: where a question's speech
#: really begins and ends in its audio (eSpeak NG's own silence is digital zero).
SPEECH_LEVEL = 64
#: Questions Whisper tiny.en hears word for word in eSpeak NG's voice (each checked
#: through the listen stage; "How far is the moon from the earth?" and others were
#: not heard).
QUESTIONS = (
    "Can you recommend a good book to read?",
    "Which planet is the largest in our solar system?",
    "What is the weather like in London today?",
    "What is the capital city of France?",
    "What time does the train leave tomorrow morning?",
    "How do I make a cup of green tea?",
    "How tall is the highest mountain in the world?",
    "What is the best way to learn a new language?",
    "What is the population of Japan?",
    "What is the boiling point of water?",
    "Can you play some music for me?",
    "Where is the nearest train station?",
    "What is the longest river in Africa?",
)
#: The barge-in scenario's thinker: slow, so that its answer still streams when the
#: next question interrupts it (tests/test_voice.py's, too).
BARGE_IN_THINKER = {"tokens_per_second": 8.0}
#: Words that carry no content: a transcript is judged by the share of the question's
#: other words it holds (Whisper loses small words first).
_STOP_TEXT = """
    a an the and or but if so of to in on at by for with from as into about
    is are was were be been being am do does did done have has had
    i you he she it we they me him her us them my your his its our their
    this that these those there here what which who whom whose when where why how
    can could would should will shall may might must not no yes please
"""
STOP_WORDS = frozenset(_STOP_TEXT.split())
#: How long a turn may wait for its answer, and a trial for its step.
TURN_TIMEOUT = 60.0


@attrs.frozen
class Sizes:
    """How much each part does.

    Attributes:
      sessions: The concurrency levels of ``turns``.
      turns: Turns per session at each level (``sessions``' order).
      trials: ``barge-in``'s interruptions.
      pause: Seconds of silence between an answer's ``response.done`` and the next
          question.
      spread: The sessions' starts are spread evenly over this many seconds (about
          one turn).
    """

    sessions: tuple[int, ...]
    turns: tuple[int, ...]
    trials: int
    pause: float = 0.5
    spread: float = 4.0

    @classmethod
    def full(cls) -> Sizes:
        return cls(sessions=(1, 10), turns=(6, 3), trials=50)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(sessions=(1, 2), turns=(1, 1), trials=2, pause=0.2, spread=0.5)


def summary(values: Sequence[float]) -> dict[str, float]:
    """Mean, min, p50, p90, p99 and max of ``values`` (nearest rank; p50 the median)."""
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {
        "count": len(ordered),
        "mean": statistics.fmean(ordered),
        "min": ordered[0],
        "p50": statistics.median(ordered),
        "p90": rank(0.9),
        "p99": rank(0.99),
        "max": ordered[-1],
    }


def content_words(text: str) -> list[str]:
    """``text``'s words, lowercase, without :data:`STOP_WORDS`, in order."""
    return [w for w in re.findall(r"[a-z0-9']+", text.lower()) if w not in STOP_WORDS]


def recall(said: str, heard: str) -> float:
    """The share of ``said``'s content words that ``heard`` holds (1.0 if it has none)."""
    wanted = content_words(said)
    got = set(content_words(heard))
    return sum(word in got for word in wanted) / len(wanted) if wanted else 1.0


def quotes(answer: str, transcript: str) -> bool:
    """Whether ``answer`` begins by quoting ``transcript`` as the voice thinker does
    (``You said: <transcript>.``; see :func:`omni_trio.demo.engines.voice_answer`)."""
    heard = " ".join(transcript.split())
    if not heard:
        return False
    if heard[-1] not in ".!?":
        heard = heard.rstrip(",;:") + "."
    return " ".join(answer.split()).startswith(f"You said: {heard}")


def speak(text: str) -> bytes:
    """``text`` said by eSpeak NG, as 24 kHz PCM16 (the Realtime API's), padded with
    silence to whole 20 ms chunks."""
    from ..speech import ESpeak, Resampler

    speech = ESpeak.get()
    pcm = speech.synthesize(text)
    resampler = Resampler(speech.sample_rate, RATE)
    pcm = resampler.feed(pcm) + resampler.flush()
    return pcm + bytes(-len(pcm) % CHUNK_BYTES)


def speech_bounds(pcm: bytes) -> tuple[float, float]:
    """Where the speech in ``pcm`` begins and ends, in ms from its start."""
    import numpy as np

    loud = np.flatnonzero(np.abs(np.frombuffer(pcm, dtype="<i2").astype(np.int32)) > SPEECH_LEVEL)
    return float(loud[0]) * 1000 / RATE, float(loud[-1] + 1) * 1000 / RATE


def voice_config(name: str = "voice", /, **thinker: Any) -> PipelineConfig:
    """The shipped pipeline ``name`` (``voice``, or ``assistant``: the language model
    as thinker), its thinker's ``engine_args`` overridden."""
    config = shipped_pipeline(name)
    stages = [
        msgspec.structs.replace(s, engine_args={**s.engine_args, **thinker})
        if s.name == "thinker" and thinker
        else s
        for s in config.stages
    ]
    return msgspec.structs.replace(config, stages=stages)


# -- the client (asyncio, in a process of its own) ---------------------------------------------


class _Inbox:
    """A session's events as they arrived: ``(perf_counter, event)``."""

    def __init__(self) -> None:
        self.log: list[tuple[float, dict[str, Any]]] = []
        self.closed = False  # the connection: no more events will come
        self._changed = asyncio.Event()

    async def read(self, ws: Any) -> None:
        try:
            async for message in ws:
                at = time.perf_counter()
                self.log.append((at, json.loads(message)))
                self._changed.set()
        finally:
            self.closed = True
            self._changed.set()

    async def wait(self, wanted: Callable[[dict[str, Any]], bool], start: int, what: str) -> int:
        """The index of the first event from ``start`` on that is ``wanted``."""
        deadline = time.perf_counter() + TURN_TIMEOUT
        index = start
        while True:
            while index < len(self.log):
                if wanted(self.log[index][1]):
                    return index
                index += 1
            if self.closed:
                raise RuntimeError(f"the connection closed before {what}; {self._got(start)}")
            self._changed.clear()
            left = deadline - time.perf_counter()
            try:
                await asyncio.wait_for(self._changed.wait(), max(left, 0.0))
            except asyncio.TimeoutError:  # not TimeoutError on 3.10
                why = f"no {what} within {TURN_TIMEOUT:g} s; {self._got(start)}"
                raise RuntimeError(why) from None

    def _got(self, start: int) -> str:
        return f"the last events: {[event['type'] for _, event in self.log[start:]][-20:]}"

    def first(self, kind: str, start: int, **fields: Any) -> tuple[float, dict[str, Any]] | None:
        for at, event in self.log[start:]:
            if event["type"] == kind and all(event.get(k) == v for k, v in fields.items()):
                return at, event
        return None


def _type(kind: str) -> Callable[[dict[str, Any]], bool]:
    return lambda event: event["type"] == kind


def _done_of(response_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda event: event["type"] == "response.done" and event["response"]["id"] == response_id


class _Mic:
    """A microphone: 20 ms appends at real-time pace, each sent once its audio would
    have been recorded; what was said, else silence. Chunk ``k`` holds the session's
    audio from ``20 k`` ms (the server's audio clock starts at the first append)."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self.sent_at: list[float] = []
        self._queue: collections.deque[bytes] = collections.deque()
        self._silence = json.dumps(
            {
                "type": "input_audio_buffer.append",
                "audio": base64.b64encode(bytes(CHUNK_BYTES)).decode(),
            }
        )

    def say(self, pcm: bytes) -> int:
        """Queue ``pcm`` (whole chunks): the audio clock (ms) at which it starts."""
        start = (len(self.sent_at) + len(self._queue)) * CHUNK_MS
        for offset in range(0, len(pcm), CHUNK_BYTES):
            self._queue.append(pcm[offset : offset + CHUNK_BYTES])
        return start

    def sent(self, ms: float) -> float | None:
        """When the chunk holding the audio at ``ms`` was sent (``None``: not yet)."""
        index = int(ms // CHUNK_MS)
        return self.sent_at[index] if 0 <= index < len(self.sent_at) else None

    async def run(self) -> None:
        started = time.perf_counter()
        while True:
            due = started + (len(self.sent_at) + 1) * CHUNK_MS / 1000
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if self._queue:
                chunk = base64.b64encode(self._queue.popleft()).decode()
                text = json.dumps({"type": "input_audio_buffer.append", "audio": chunk})
            else:
                text = self._silence
            await self._ws.send(text)
            self.sent_at.append(time.perf_counter())


@asynccontextmanager
async def _session(url: str) -> AsyncIterator[tuple[Any, _Inbox, _Mic, dict[str, Any]]]:
    """A connected session, its turn detection set, its microphone on."""
    from websockets.asyncio.client import connect

    async with connect(url, max_size=2**24) as ws:
        inbox = _Inbox()
        reader = asyncio.create_task(inbox.read(ws))
        created = inbox.log[await inbox.wait(_type("session.created"), 0, "session.created")][1]
        await ws.send(json.dumps({"type": "session.update", "session": SESSION}))
        await inbox.wait(_type("session.updated"), 0, "session.updated")
        mic = _Mic(ws)
        sender = asyncio.create_task(mic.run())
        info = {
            "id": created["session"]["id"],
            "extensions": None
            if ws.response is None
            else ws.response.headers.get("Sec-WebSocket-Extensions"),
        }
        try:
            yield ws, inbox, mic, info
        finally:
            sender.cancel()
            reader.cancel()


def _since(at: float | None, then: float) -> float | None:
    return None if at is None else at - then


async def _turns_session(
    url: str, questions: list[str], speech: dict[str, bytes], delay: float, pause: float
) -> dict[str, Any]:
    """One session asking ``questions`` in turn; each turn's figures."""
    turns = []
    async with _session(url) as (_, inbox, mic, info):
        await asyncio.sleep(delay)
        for question in questions:
            pcm = speech[question]
            start = mic.say(pcm)
            mark = len(inbox.log)
            index = mark
            while True:  # a question heard as two turns: the first answer is cancelled
                index = await inbox.wait(_type("response.done"), index, "response.done") + 1
                if inbox.log[index - 1][1]["response"]["status"] != "cancelled":
                    break
            turns.append(_turn(question, pcm, start, inbox, mic, mark, index))
            await asyncio.sleep(pause)
    return {"session_id": info["id"], "extensions": info["extensions"], "turns": turns}


def _turn(
    question: str, pcm: bytes, start: int, inbox: _Inbox, mic: _Mic, mark: int, end: int
) -> dict[str, Any]:
    """A turn's figures, from its events (``inbox.log[mark:end]``)."""
    events = inbox.log[mark:end]
    done_at, done = events[-1]
    response = done["response"]
    stops = [(at, e) for at, e in events if e["type"] == "input_audio_buffer.speech_stopped"]
    stopped_at, stopped = stops[-1]
    item = stopped["item_id"]
    begins, ends = speech_bounds(pcm)
    speech_end = start + ends
    heard = inbox.first("conversation.item.input_audio_transcription.completed", mark, item_id=item)
    text = inbox.first("response.output_audio_transcript.delta", mark, response_id=response["id"])
    audio = inbox.first("response.output_audio.delta", mark, response_id=response["id"])
    answer = "".join(
        e["delta"]
        for _, e in events
        if e["type"] == "response.output_audio_transcript.delta"
        and e.get("response_id") == response["id"]
    )
    transcript = "" if heard is None else heard[1]["transcript"]
    end_sent = mic.sent(speech_end)
    hangover_sent = mic.sent(stopped["audio_end_ms"] + SILENCE_MS)
    return {
        "question": question,
        "status": response["status"],
        "turns": len(stops),  # 1 unless the VAD heard the question as two turns
        "speech_start_ms": start + begins,
        "speech_end_ms": speech_end,
        "audio_end_ms": stopped["audio_end_ms"],
        # the VAD's end of speech against the speech's real end (audio clock)
        "vad_end_offset": (stopped["audio_end_ms"] - speech_end) / 1000,
        # sending the speech's last chunk -> speech_stopped arriving
        "hangover": _since(stopped_at, end_sent) if end_sent is not None else None,
        # sending the chunk that completes the hangover -> speech_stopped arriving
        "detect_delay": _since(stopped_at, hangover_sent) if hangover_sent else None,
        "speech_stopped_at": stopped_at,
        "item_id": item,
        "response_id": response["id"],
        "transcript": _since(None if heard is None else heard[0], stopped_at),
        "first_text": _since(None if text is None else text[0], stopped_at),
        "first_audio": _since(None if audio is None else audio[0], stopped_at),
        "done": done_at - stopped_at,
        "heard": transcript,
        "recall": recall(question, transcript),
        "quoted": quotes(answer, transcript),
    }


async def _barge_in_session(
    url: str, questions: list[str], speech: dict[str, bytes], trials: int
) -> dict[str, Any]:
    """One session, questions chained: each starts when the answer before has its
    first audio, and interrupts it."""
    found = []
    cancelled: set[str] = set()
    async with _session(url) as (_, inbox, mic, info):
        await asyncio.sleep(0.3)
        mic.say(speech[questions[0]])
        mark = 0
        for trial in range(trials):

            def first_audio(event: dict[str, Any]) -> bool:
                return (
                    event["type"] == "response.output_audio.delta"
                    and event["response_id"] not in cancelled
                )

            index = await inbox.wait(first_audio, mark, "an answer's first audio")
            audio_at, audio = inbox.log[index]
            response_id = audio["response_id"]
            question = questions[(trial + 1) % len(questions)]
            pcm = speech[question]
            start = mic.say(pcm)
            started = await inbox.wait(
                _type("input_audio_buffer.speech_started"), index, "the barge-in's speech_started"
            )
            done = await inbox.wait(
                _done_of(response_id), index, "the interrupted answer's response.done"
            )
            cancelled.add(response_id)
            started_at, speech_started = inbox.log[started]
            speech_start = start + speech_bounds(pcm)[0]
            speech_sent = mic.sent(speech_start)
            found.append(
                {
                    "response_id": response_id,
                    "item_id": speech_started["item_id"],
                    "status": inbox.log[done][1]["response"]["status"],
                    "first_audio_at": audio_at,
                    "speech_started_at": started_at,
                    "done_at": inbox.log[done][0],
                    # sending the barge-in's first speech -> speech_started arriving
                    "vad_delay": None if speech_sent is None else started_at - speech_sent,
                    "client_done": inbox.log[done][0] - started_at,
                    "started_index": started,
                }
            )
            mark = started + 1
        await asyncio.sleep(0.2)  # deltas that should not come would have by now
        for each in found:
            start_index = each.pop("started_index")
            each["late_deltas"] = sum(
                1
                for _, e in inbox.log[start_index:]
                if e.get("response_id") == each["response_id"] and e["type"].endswith(".delta")
            )
    return {"session_id": info["id"], "extensions": info["extensions"], "trials": found}


async def _client(plan: dict[str, Any]) -> dict[str, Any]:
    wanted = {q for session in plan.get("sessions", []) for q in session["questions"]}
    wanted |= set(plan.get("questions", []))
    speech = {question: speak(question) for question in sorted(wanted)}  # before connecting
    cpu = time.process_time()
    started = time.perf_counter()
    if plan["kind"] == "turns":
        sessions = await asyncio.gather(
            *(
                _turns_session(plan["url"], each["questions"], speech, each["delay"], plan["pause"])
                for each in plan["sessions"]
            )
        )
        found: dict[str, Any] = {"sessions": list(sessions)}
    else:
        found = await _barge_in_session(plan["url"], plan["questions"], speech, plan["trials"])
    wall = time.perf_counter() - started
    return {**found, "wall": wall, "client_cpu": (time.process_time() - cpu) / wall}


# -- the server (Trio) -------------------------------------------------------------------------


@attrs.define
class _Stamps:
    """A response's orchestrator request, as its session took the outputs
    (``perf_counter``): when it was admitted, each stage's first and last output,
    and when the text stage's text completed the talker's first phrase (or ended
    short of one)."""

    admitted: float
    kinds: dict[str, int]  # the final stages by output type: text, transcript, audio
    splitter: Any  # the talker's PhraseSplitter, fed the text stage's outputs
    first: dict[int, float] = attrs.field(factory=dict)
    last: dict[int, float] = attrs.field(factory=dict)
    phrase: float | None = None

    def took(self, batch: Sequence[Any], at: float) -> None:
        text = self.kinds.get("text")
        for out in batch:
            if out.data is None or out.finished:
                continue
            self.first.setdefault(out.stage_id, at)
            self.last[out.stage_id] = at
            if out.stage_id == text and self.phrase is None and self.splitter.feed(out.data):
                self.phrase = at

    def at(self, kind: str, *, last: bool = False) -> float | None:
        """When the final stage of output type ``kind`` gave its first output (its
        last: ``last``)."""
        stage = self.kinds.get(kind)
        return None if stage is None else (self.last if last else self.first).get(stage)

    def first_phrase(self) -> float | None:
        """When the talker's first phrase was complete: its words, or the whole text."""
        return self.at("text", last=True) if self.phrase is None else self.phrase


@attrs.define
class _Trace:
    """What the sessions' trace hook saw: ``(session, what, ref) -> perf_counter``;
    each cancelled request's workers letting go (polled); and each response's
    request as its session took the outputs (:class:`_Stamps`), by response id."""

    stages: Sequence[Any]
    seen: dict[tuple[str, str, str], float] = attrs.field(factory=dict)
    cancelled: set[str] = attrs.field(factory=set)
    let_go: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    requests: dict[str, _Stamps] = attrs.field(factory=dict)
    _reading: dict[Any, _Stamps] = attrs.field(factory=dict)  # by the task reading it
    _send: Any = None

    def __call__(self, session: str, what: str, ref: str) -> None:
        self.seen.setdefault((session, what, ref), time.perf_counter())
        if what == "response_cancelled":
            self.cancelled.add(ref)
        elif what == "request_ended":
            # in the task that read the response's request: whose stamps are its
            stamps = self._reading.pop(trio.lowlevel.current_task(), None)
            if stamps is not None:
                self.requests[ref] = stamps
            if ref in self.cancelled and self._send is not None:
                self._send.send_nowait(ref)

    def reading(self, stamps: _Stamps) -> None:
        """The current task reads the request of ``stamps`` (its response's)."""
        self._reading[trio.lowlevel.current_task()] = stamps

    def at(self, session: str, what: str, ref: str) -> float | None:
        return self.seen.get((session, what, ref))

    def responses(self, sessions: set[str]) -> dict[str, int]:
        """How many responses ``sessions`` started, and how many were cancelled (in
        the turns, only speculations dropped when speech resumed)."""
        counts = collections.Counter(what for (sid, what, _) in self.seen if sid in sessions)
        return {"started": counts["response_started"], "cancelled": counts["response_cancelled"]}

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Poll the stages after each cancelled request's ``request_ended``."""
        send, receive = trio.open_memory_channel[str](math.inf)
        self._send = send
        task_status.started()
        async for ref in receive:
            self.let_go[ref] = await self._let_go()

    async def _let_go(self) -> dict[str, Any]:
        rounds: list[float] = []
        with trio.move_on_after(2.0):
            while True:
                began = time.perf_counter()
                for stage in self.stages:
                    await stage.refresh_statistics()
                ended = time.perf_counter()
                rounds.append(ended - began)
                if all(
                    stage.statistics().worker_requests == 0 and stage.statistics().in_flight == 0
                    for stage in self.stages
                ):
                    return {"at": ended, "round": statistics.fmean(rounds), "rounds": len(rounds)}
                await trio.sleep(0.001)
        return {"at": None, "round": statistics.fmean(rounds), "rounds": len(rounds)}


class _Tapped:
    """An orchestrator whose requests' outputs are stamped as they are taken, into
    ``trace`` (:meth:`_Trace.reading`); the rest is the orchestrator's own."""

    def __init__(self, orchestrator: Any, trace: _Trace, config: PipelineConfig) -> None:
        from ..speech import PhraseSplitter

        self._orchestrator = orchestrator
        self._trace = trace
        self._kinds: dict[str, int] = {
            kind: stage for stage, kind in config.final_output_types.items()
        }
        talker = next((s for s in config.stages if s.name == "talker"), None)
        args = {} if talker is None else talker.engine_args
        self._splitter = partial(
            PhraseSplitter, args.get("first_phrase_words", 4), args.get("phrase_words", 12)
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._orchestrator, name)

    @asynccontextmanager
    async def open_request(self, prompt: Any, **kwargs: Any) -> AsyncIterator[Any]:
        stamps = _Stamps(time.perf_counter(), self._kinds, self._splitter())
        self._trace.reading(stamps)
        async with self._orchestrator.open_request(prompt, **kwargs) as stream:
            yield _TappedStream(stream, stamps)


class _TappedStream:
    """A request's stream whose batches are stamped as they are taken."""

    def __init__(self, stream: Any, stamps: _Stamps) -> None:
        self._stream = stream
        self._stamps = stamps

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def receive_batch(self) -> Any:
        batch = await self._stream.receive_batch()
        self._stamps.took(batch, time.perf_counter())
        return batch


@asynccontextmanager
async def _served(
    pipeline: Any, config: PipelineConfig, *, speculate: bool, trace: _Trace
) -> AsyncIterator[str]:
    """``pipeline`` served on a free port (it stays open after): the session URL.
    The server's requests are stamped into ``trace`` as their sessions read them."""
    from ..serve import RealtimeOptions, ServedModel, create_app, serve

    tapped = SimpleNamespace(
        orchestrator=_Tapped(pipeline.orchestrator, trace, config), stages=pipeline.stages
    )

    @asynccontextmanager
    async def opener() -> AsyncIterator[Any]:
        yield tapped

    options = RealtimeOptions(speculate=speculate, trace=trace)
    model = ServedModel.from_config(config)
    app = create_app(model, opener, realtime=options)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve, app, port=0))
        yield url.replace("http://", "ws://") + f"/v1/realtime?model={model.name}"
        nursery.cancel_scope.cancel()


async def _run_client(plan: dict[str, Any]) -> dict[str, Any]:
    argv = [sys.executable, "-m", "omni_trio.bench._voice", "--client"]
    done = await trio.run_process(
        argv,
        stdin=json.dumps(plan).encode(),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"the bench's client failed:\n{done.stderr.decode()[-5000:]}")
    found: dict[str, Any] = json.loads(done.stdout)
    return found


async def _warm_up(pipeline: Any) -> None:
    """A question straight to the orchestrator, read to its first audio: every
    worker has run its engine once (Whisper's first decode is slow). The last
    question, which no session's turns ask: a language model would answer a turn
    it had been asked before from its prompt cache."""
    prompt = {"audio": speak(QUESTIONS[-1]), "sample_rate": RATE, "context": []}
    audio_stage = len(pipeline.stages) - 1
    async with pipeline.orchestrator.open_request(prompt) as stream:
        async for out in stream:
            if out.stage_id == audio_stage and isinstance(out.data, (bytes, bytearray)):
                break


class _Usage:
    """CPU seconds over a run: this process (the server: Hypercorn, the sessions,
    their VAD) and each stage's worker (from ``/proc``, where there is one)."""

    def __init__(self, pipeline: Any) -> None:
        self._pids = {stage.name: stage.statistics().pid for stage in pipeline.stages}
        self._start = self._now()

    def _now(self) -> dict[str, float | None]:
        times = os.times()
        now: dict[str, float | None] = {"server": times.user + times.system}
        for name, pid in self._pids.items():
            now[name] = _cpu_of(pid)
        return now

    def used(self, wall: float) -> dict[str, float | None]:
        """Each process's CPU over ``wall`` seconds (1.0: one core all the time)."""
        end = self._now()
        used: dict[str, float | None] = {}
        for name, start in self._start.items():
            stop = end[name]
            used[name] = None if stop is None or start is None else (stop - start) / wall
        return used


def _cpu_of(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _packages() -> dict[str, str | None]:
    from importlib.metadata import version

    def installed(package: str) -> str | None:
        try:
            return version(package)
        except Exception:  # not installed
            return None

    names = ("faster-whisper", "ctranslate2", "onnxruntime", "websockets", "hypercorn")
    return {name: installed(name) for name in names}


async def turns_part(
    sizes: Sizes, pipeline_name: str = "voice", speculation: Sequence[bool] = (True, False)
) -> dict[str, Any]:
    """Every concurrency level of ``sizes``, in each mode of ``speculation`` (with
    it, without), one shipped pipeline for all (``voice``; ``assistant``, whose
    thinker is the language model)."""
    config = voice_config(pipeline_name)
    load = os.getloadavg()[0]
    runs: dict[str, dict[str, Any]] = {
        "speculate" if speculate else "no_speculation": {} for speculate in speculation
    }
    async with open_pipeline(config) as pipeline:
        await _warm_up(pipeline)
        for speculate in speculation:
            trace = _Trace(pipeline.stages)
            async with _served(pipeline, config, speculate=speculate, trace=trace) as url:
                for sessions, turns in zip(sizes.sessions, sizes.turns, strict=True):
                    plan: dict[str, Any] = {
                        "kind": "turns",
                        "url": url,
                        "pause": sizes.pause,
                        "sessions": [
                            {
                                "questions": _questions(index, sessions, turns),
                                "delay": 0.3 + index * sizes.spread / sessions,
                            }
                            for index in range(sessions)
                        ],
                    }
                    usage = _Usage(pipeline)
                    found = await _run_client(plan)
                    found["cpu"] = usage.used(found["wall"])
                    key = "speculate" if speculate else "no_speculation"
                    runs[key][str(sessions)] = _turns_run(found, trace, sessions, turns)
    return {
        "pipeline": pipeline_name,
        "silence_duration_ms": SILENCE_MS,
        "speculate_after_ms": min(150, SILENCE_MS // 2),
        "pause": sizes.pause,
        "spread": sizes.spread,
        "thinker": dict(config.stages[1].engine_args),
        "runs": runs,
        "packages": _packages(),
        "load_average": [load, os.getloadavg()[0]],  # 1 minute, before and after
    }


def _questions(index: int, sessions: int, turns: int) -> list[str]:
    """Alone, a session asks a different question each turn; among others, each
    session asks its own, every turn (no two sessions ask the same)."""
    if sessions == 1:
        return [QUESTIONS[turn % len(QUESTIONS)] for turn in range(turns)]
    return [QUESTIONS[index % len(QUESTIONS)]] * turns


#: A turn's figures summarised, from ``speech_stopped`` (seconds).
MILESTONES = ("transcript", "first_text", "first_audio", "done")
HANGOVER = ("hangover", "vad_end_offset", "detect_delay")
#: The server's side of a turn, from its ``speech_stopped`` (seconds), as the
#: session took its response's outputs: the request admitted (before it, with
#: speculation), the transcript, the answer's first text, the talker's first phrase
#: complete in it, the first audio, and the text's end.
SERVER_MILESTONES = (
    "admitted",
    "transcript",
    "first_text",
    "first_phrase",
    "first_audio",
    "text_done",
)


def _server_turn(trace: _Trace, session: str, turn: dict[str, Any]) -> dict[str, float | None]:
    """The server's side of ``turn`` (:data:`SERVER_MILESTONES`); ``{}`` if the trace
    missed it."""
    stopped = trace.at(session, "speech_stopped", turn["item_id"])
    stamps = trace.requests.get(turn["response_id"])
    if stopped is None or stamps is None:
        return {}
    moments = {
        "admitted": stamps.admitted,
        "transcript": stamps.at("transcript"),
        "first_text": stamps.at("text"),
        "first_phrase": stamps.first_phrase(),
        "first_audio": stamps.at("audio"),
        "text_done": stamps.at("text", last=True),
    }
    return {key: None if at is None else at - stopped for key, at in moments.items()}


def _turns_run(found: dict[str, Any], trace: _Trace, sessions: int, turns: int) -> dict[str, Any]:
    every = [turn for session in found["sessions"] for turn in session["turns"]]
    for session in found["sessions"]:
        for turn in session["turns"]:
            stopped = trace.at(session["session_id"], "speech_stopped", turn["item_id"])
            # the server's speech_stopped -> its arrival at the client
            turn["stopped_transit"] = (
                None if stopped is None else turn["speech_stopped_at"] - stopped
            )
            turn["server"] = _server_turn(trace, session["session_id"], turn)
    figures = {
        key: summary([t[key] for t in every if t[key] is not None])
        for key in (*MILESTONES, *HANGOVER, "stopped_transit")
        if any(t[key] is not None for t in every)
    }
    server = {
        key: summary(values)
        for key in SERVER_MILESTONES
        if (values := [t["server"][key] for t in every if t["server"].get(key) is not None])
    }
    passed = [
        all(t["recall"] >= 0.6 and t["quoted"] for t in session["turns"])
        for session in found["sessions"]
    ]
    return {
        "responses": trace.responses({s["session_id"] for s in found["sessions"]}),
        "sessions": sessions,
        "turns_per_session": turns,
        "turns": len(every),
        "completed": sum(t["status"] == "completed" for t in every),
        "split": sum(t["turns"] > 1 for t in every),
        "missing": {key: sum(t[key] is None for t in every) for key in MILESTONES},
        **figures,
        "server": server,
        "isolation": {"sessions": sessions, "passed": sum(passed)},
        "wall": found["wall"],
        "cpu": {**found["cpu"], "client": found["client_cpu"]},
        "extensions": found["sessions"][0]["extensions"],
        "each": every,
    }


async def barge_in_part(sizes: Sizes) -> dict[str, Any]:
    """``sizes.trials`` interruptions in one session, with the slow thinker."""
    config = voice_config(**BARGE_IN_THINKER)
    load = os.getloadavg()[0]
    async with open_pipeline(config) as pipeline:
        await _warm_up(pipeline)
        trace = _Trace(pipeline.stages)
        async with trio.open_nursery() as nursery:
            await nursery.start(trace.run)
            async with _served(pipeline, config, speculate=True, trace=trace) as url:
                plan = {
                    "kind": "barge_in",
                    "url": url,
                    "questions": list(QUESTIONS),
                    "trials": sizes.trials,
                }
                usage = _Usage(pipeline)
                found = await _run_client(plan)
                found["cpu"] = usage.used(found["wall"])
            await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
    session = found["session_id"]
    trials = []
    for trial in found["trials"]:
        rid = trial["response_id"]
        vad = trace.at(session, "speech_started", trial["item_id"])
        let_go = trace.let_go.get(rid, {})

        def after(at: float | None, vad: float | None = vad) -> float | None:
            return None if at is None or vad is None else at - vad

        trials.append(
            {
                **trial,
                "cancelled": after(trace.at(session, "response_cancelled", rid)),
                "request_ended": after(trace.at(session, "request_ended", rid)),
                "response_done": after(trace.at(session, "response_done", rid)),
                "let_go": after(let_go.get("at")),
                "poll_round": let_go.get("round"),
                # the server's speech_started -> its arrival at the client
                "started_transit": after(trial["speech_started_at"]),
            }
        )
    interrupted = [t for t in trials if t["status"] == "cancelled"]
    keys = (
        "cancelled",
        "request_ended",
        "response_done",
        "let_go",
        "client_done",
        "vad_delay",
        "started_transit",
        "poll_round",
    )
    return {
        "thinker": dict(config.stages[1].engine_args),
        "responses": trace.responses({session}),
        "trials": len(trials),
        "interrupted": len(interrupted),
        "late_deltas": sum(t["late_deltas"] for t in trials),
        **{
            key: summary([t[key] for t in interrupted if t[key] is not None])
            for key in keys
            if any(t[key] is not None for t in interrupted)
        },
        "missing": {key: sum(t[key] is None for t in interrupted) for key in keys},
        "wall": found["wall"],
        "cpu": {**found["cpu"], "client": found["client_cpu"]},
        "extensions": found["extensions"],
        "each": trials,
        "load_average": [load, os.getloadavg()[0]],  # 1 minute, before and after
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_trio.bench._voice")
    parser.add_argument("--part", choices=["turns", "barge-in"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--client", action="store_true", help="be the client: a JSON plan on stdin")
    args = parser.parse_args(argv)
    if args.client:
        print(json.dumps(asyncio.run(_client(json.load(sys.stdin)))))
        return
    if args.part is None:
        parser.error("--part or --client is required")
    sizes = Sizes.quick() if args.quick else Sizes.full()
    part = turns_part if args.part == "turns" else barge_in_part
    print(json.dumps(trio.run(part, sizes)))


if __name__ == "__main__":
    main()
