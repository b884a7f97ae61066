"""Barge-in on short sounds, measured end to end: which of them interrupt an answer
at each ``turn_detection.interrupt_min_ms``, and how much later a real interruption
is decided for it.

Speech over an answer interrupts it only once it has lasted ``interrupt_min_ms``
(``docs/voice.md``, "Interruptions"): a backchannel ("yeah", "mm-hm") or a cough is
dropped and the answer goes on, and a real interruption pays for that bound. This
tool measures both sides through the real thing: the shipped ``voice`` pipeline
(Whisper tiny.en, the simulated thinker, eSpeak NG) served by
:func:`omni_trio.serve.serve` on a loopback port, one ``/v1/realtime`` session per
``interrupt_min_ms`` with server VAD (Silero, the default detector), one after the
other, and a WebSocket client (``websockets``, in a process of its own: it takes no
GIL from the server) that does what a client does:

1. it asks for an answer (a typed question, ``response.create``) and waits for its
   first audio: the answer is playing (the thinker is slow and long-winded:
   :data:`THINKER`, so it still plays when the trial ends);
2. it sends a clip -- :data:`LEAD_MS` of silence (plus 0 to 19 ms, seeded, so the
   speech starts anywhere in a 20 ms chunk), the sound trimmed to its first and last
   audible sample, :data:`TAIL_MS` of silence -- in 20 ms ``input_audio_buffer.append``
   events, faster than real time;
3. after each append from the sound's start to :data:`PINGED_MS` past the bound, and
   after the last, it sends an empty ``session.update`` (it changes nothing): the
   server handles a session's events in order and queues what each makes in order,
   so the ``session.updated`` replies count the appends the server had taken when
   any other event was made. An ``input_audio_buffer.speech_started`` made while the
   server took append ``k`` was decided with ``20 k`` ms of the clip heard: that,
   less where the speech began in the clip, is the decision's delay on the audio
   clock -- what a client streaming in real time waits, less the network.

A clip *interrupted* the answer when the client got ``speech_started`` and the
answer's ``response.done`` with status ``cancelled`` (reason ``turn_detected``); an
answer that was not interrupted is still streaming when the last reply comes. The
clips (:func:`clips`):

- short sounds: :data:`SOUNDS` said by eSpeak NG in each of :data:`VOICES`, and white
  noise bursts as loud as the speech (:data:`BURSTS_MS`, 5 ms fades: a cough's
  stand-in);
- real interruptions: :data:`SENTENCES` in each voice.

eSpeak NG's random breath noise is seeded before each clip (:func:`_seed`), and the
leads are seeded, so every run, and every setting's session, sends the same audio:
the settings differ in the bound alone, and a run repeats the last one's figures.

The session's detector is the default one (Silero, 24 kHz), wrapped to record what
it says (:class:`Heard`): how long it heard each sound as speech (from its
``speech_started``'s ``audio_start_ms`` to its ``speech_stopped``'s ``audio_end_ms``),
and where it put the speech's start. A sound interrupts exactly when the detector
heard it for at least ``interrupt_min_ms``; the run checks that each did
(``unlike_the_detector``). ``create_response`` is off in these sessions (the client asks
for each answer, with a typed question: no turn is transcribed or answered), which
changes nothing of how an interruption is decided. A full run also streams the
three sentences (voice ``en``) at real-time pace, 20 ms per 20 ms, and times
``speech_started`` and the cancelled answer's ``response.done`` on the wall clock,
from when the speech's first sample would have been recorded.

Run (1.5 to 2 minutes on 2 cores; ``--quick``: 2 voices, no real-time pace, about
25 s)::

    PYTHONPATH=src python tools/bench_interrupt.py [--quick] [--json PATH]
    PYTHONPATH=src python tools/bench_interrupt.py --from PATH    # re-print a saved run

It needs the voice extra (faster-whisper, eSpeak NG), the serve extra and
``websockets``.
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio
from rich.console import Console
from rich.table import Table

from omni_trio import open_pipeline
from omni_trio.bench._voice import (
    CHUNK_BYTES,
    CHUNK_MS,
    RATE,
    SPEECH_LEVEL,
    TURN_DETECTION,
    summary,
    voice_config,
)

#: The ``interrupt_min_ms`` measured (the server's default is 500).
SETTINGS = (0, 300, 400, 500, 800)
#: Backchannels, as eSpeak NG says them (it spells "mm-hm" out: four syllables).
SOUNDS = ("ah", "oh", "hmm", "yeah", "right", "uh-huh", "ok", "mm-hm")
VOICES = ("en", "en-us", "en+f3", "en+m3", "en-us+f2", "en+m7")
QUICK_VOICES = ("en", "en-us+f2")
#: White noise bursts (a cough's stand-in), as loud as the sentences' speech.
BURSTS_MS = (100, 200, 300, 400)
#: Real interruptions.
SENTENCES = (
    "Wait, stop, I have a question.",
    "Hold on, that is not what I asked.",
    "Sorry, could you say that again?",
)
#: The voices the sentences are also streamed in at real-time pace (a full run).
PACED_VOICES = ("en",)
LEAD_MS = 300  # silence before a clip's sound (and 0 to 19 ms more)
TAIL_MS = 800  # after it: the detector's hangover (500 ms) ends any turn within it
FADE_MS = 5  # a noise burst's fade in and out
SEED = 20_261_203
#: The answering thinker: slow enough that its first audio comes soon and its answer
#: plays on for half a minute (the trials are quicker than real time).
THINKER = {"tokens_per_second": 25.0, "max_tokens": 800}
QUESTION = "Tell me a long story about the sea, please."
TIMEOUT = 30.0  # seconds for any one step
#: A trial's appends each get a reply from the sound's start to this long past
#: ``interrupt_min_ms`` (a decision comes 150 ms and a frame or two after it, later
#: for a pause in the speech), then only the last does.
PINGED_MS = 600
_PING = json.dumps({"type": "session.update", "session": {"type": "realtime"}})
_AUDIO_DELTA = "response.output_audio.delta"


# -- the clips ---------------------------------------------------------------------------


@attrs.frozen
class Clip:
    """A sound, trimmed to its first and last audible sample (24 kHz PCM16)."""

    kind: str  # "backchannel", "noise" or "sentence"
    text: str
    voice: str | None
    pcm: bytes = attrs.field(repr=False)

    @property
    def name(self) -> str:
        return self.text if self.voice is None else f"{self.text} [{self.voice}]"

    @property
    def ms(self) -> float:
        return len(self.pcm) / 2 * 1000 / RATE


@functools.cache
def _seed() -> Callable[[int], None] | None:
    """eSpeak NG's ``espeak_ng_SetRandSeed``, where its library has it. Its voices'
    breath noise is random, from a seed of its own in each process: the same text
    in the same voice sounds a little different from run to run (and the detector
    hears 32 ms more or less of it). Seeded before each clip, every run speaks the
    same clips (in the same order: the voice's other state carries on)."""
    import ctypes

    import espeakng_loader

    library = ctypes.CDLL(espeakng_loader.get_library_path())  # the one ESpeak loaded
    seed = getattr(library, "espeak_ng_SetRandSeed", None)
    if seed is not None:
        seed.argtypes = [ctypes.c_long]
    return seed


def _said(text: str, voice: str) -> np.ndarray:
    from omni_trio.speech import ESpeak, Resampler

    espeak = ESpeak.get()
    seed = _seed()
    if seed is not None:
        seed(SEED)
    resampler = Resampler(espeak.sample_rate, RATE)
    pcm = resampler.feed(espeak.synthesize(text, voice=voice)) + resampler.flush()
    samples = np.frombuffer(pcm, "<i2")
    audible = np.flatnonzero(np.abs(samples.astype(np.int32)) > SPEECH_LEVEL)
    return samples[audible[0] : audible[-1] + 1]


def _burst(ms: int, rms: float, rng: np.random.Generator) -> np.ndarray:
    length = RATE * ms // 1000
    fade = RATE * FADE_MS // 1000
    ramp = np.minimum(1.0, np.minimum(np.arange(length) + 1, length - np.arange(length)) / fade)
    noise = rng.normal(0.0, rms, length) * ramp
    return np.clip(np.rint(noise), -32768, 32767).astype("<i2")


def clips(voices: Sequence[str]) -> list[Clip]:
    """The short sounds (each sound in each voice, then the noise bursts) and the
    sentences (each in each voice)."""
    found = [
        Clip("backchannel", sound, voice, _said(sound, voice).tobytes())
        for sound in SOUNDS
        for voice in voices
    ]
    sentences = [
        Clip("sentence", text, voice, _said(text, voice).tobytes())
        for text in SENTENCES
        for voice in voices
    ]
    speech = np.concatenate([np.frombuffer(c.pcm, "<i2") for c in sentences]).astype(np.float64)
    rms = float(np.sqrt(np.mean(speech**2)))
    rng = np.random.default_rng(SEED)
    found += [
        Clip("noise", f"noise {ms} ms", None, _burst(ms, rms, rng).tobytes()) for ms in BURSTS_MS
    ]
    return found + sentences


# -- the server --------------------------------------------------------------------------


class Heard:
    """Makes each session's detector -- the default one, as the server makes it --
    and records what it says: ``(audio ms fed by then, event)``, on the session's
    audio clock (the session's first append starts both). The sessions come one
    after the other, each with one detector (its turn detection is set once, before
    its first append): ``sessions[i]`` is the ``i``-th session's."""

    def __init__(self) -> None:
        self.sessions: list[list[tuple[int, Any]]] = []

    def detector(self, options: Any) -> Any:
        from omni_trio.speech import VoiceActivityDetector

        self.sessions.append([])
        return _Recording(VoiceActivityDetector(options, sample_rate=RATE), self.sessions[-1])


class _Recording:
    def __init__(self, vad: Any, events: list[tuple[int, Any]]) -> None:
        self.vad = vad
        self.events = events

    def feed(self, pcm: bytes) -> list[Any]:
        events = self.vad.feed(pcm)
        self.events += [(self.vad.audio_ms, e) for e in events]
        return events

    def reset(self) -> None:
        self.vad.reset()


@asynccontextmanager
async def served(heard: Heard) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The shipped voice pipeline (with :data:`THINKER`) behind ``/v1/realtime`` on a
    free loopback port: the session URL, and the pipeline's description."""
    from omni_trio.serve import RealtimeOptions, ServedModel, create_app, serve

    config = voice_config(**THINKER)
    async with open_pipeline(config) as pipeline:

        @asynccontextmanager
        async def opener() -> AsyncIterator[Any]:
            yield pipeline

        model = ServedModel.from_config(config)
        options = RealtimeOptions(detector=heard.detector)
        app = create_app(model, opener, realtime=options)
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(serve, app, port=0))
            ws = url.replace("http://", "ws://") + f"/v1/realtime?model={model.name}"
            described = {
                "name": config.pipeline.name,
                "stages": [s.name for s in config.stages],
                "thinker": THINKER,
            }
            yield ws, described
            nursery.cancel_scope.cancel()


# -- the client (a process of its own) ----------------------------------------------------


def _append(pcm: bytes) -> str:
    return json.dumps(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
    )


class Session:
    """One session from the client's side, at one ``interrupt_min_ms``."""

    def __init__(self, ws: Any, min_ms: int) -> None:
        self.ws = ws
        self.min_ms = min_ms
        self.sent_ms = 0  # the audio sent: the session's audio clock
        self.answer: str | None = None  # the response playing
        self.answers = 0
        self.answer_waits: list[float] = []  # response.create to its first audio, s
        self.ended: str | None = None  # why the answer ended, if it did: its status
        detection = {**TURN_DETECTION, "create_response": False, "interrupt_min_ms": min_ms}
        session = {"type": "realtime", "audio": {"input": {"turn_detection": detection}}}
        assert self.recv()["type"] == "session.created"
        self.ws.send(json.dumps({"type": "session.update", "session": session}))
        updated = self.until("session.updated")
        told = updated["session"]["audio"]["input"]["turn_detection"]
        assert told["interrupt_min_ms"] == min_ms, told

    def recv(self, timeout: float = TIMEOUT) -> dict[str, Any]:
        event: dict[str, Any] = json.loads(self.ws.recv(timeout=timeout))
        event["_at"] = time.perf_counter()
        if event["type"] == "error":
            raise RuntimeError(f"the server said: {event['error']}")
        if event["type"] == "response.done" and event["response"]["id"] == self.answer:
            response = event["response"]
            details = response.get("status_details") or {}
            self.ended = f"{response['status']} {details.get('reason', '')}".strip()
            self.answer = None
        return event

    def until(self, kind: str) -> dict[str, Any]:
        while True:
            event = self.recv()
            if event["type"] == kind:
                return event

    def play(self) -> None:
        """Ask for an answer and wait until its first audio: it is playing."""
        if self.answer is not None:
            return
        asked = time.perf_counter()
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": QUESTION}],
        }
        self.ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        self.ws.send(json.dumps({"type": "response.create"}))
        created = self.until("response.created")
        self.answer, self.ended = created["response"]["id"], None
        self.answers += 1
        while True:
            event = self.recv()
            if event["type"] == _AUDIO_DELTA and event["response_id"] == self.answer:
                break
            if self.answer is None:
                raise RuntimeError(f"the answer ended before its first audio: {self.ended}")
        self.answer_waits.append(time.perf_counter() - asked)

    def trial(self, clip: Clip, lead_ms: float) -> dict[str, Any]:
        """``clip`` over the playing answer, fast, a reply counted after each append."""
        start = self.sent_ms
        lead = int(RATE * lead_ms / 1000)
        pcm = bytes(2 * lead) + clip.pcm + bytes(2 * (RATE * TAIL_MS // 1000))
        pcm += bytes(-len(pcm) % CHUNK_BYTES)
        chunks = [pcm[i : i + CHUNK_BYTES] for i in range(0, len(pcm), CHUNK_BYTES)]
        answer = self.answer
        assert answer is not None
        # replies while the bound can be reached (and a frame or two more, and a
        # pause in the speech), then one at the end
        first = lead * 2 // CHUNK_BYTES  # the chunk the sound begins in
        window = range(first, first + (self.min_ms + PINGED_MS) // CHUNK_MS)
        pinged = [i for i in range(len(chunks)) if i in window or i == len(chunks) - 1]
        for index, chunk in enumerate(chunks):
            self.ws.send(_append(chunk))
            if index in window or index == len(chunks) - 1:
                self.ws.send(_PING)
        self.sent_ms += len(chunks) * CHUNK_MS
        replies = 0
        # event type -> the appends the server had taken by the time it came, at most
        seen: dict[str, int] = {}
        while replies < len(pinged) or (
            "speech_started" in seen and not {"cancelled", "ended"} & seen.keys()
        ):
            event = self.recv()
            kind = event["type"]
            taken = pinged[replies] + 1 if replies < len(pinged) else len(chunks)
            if kind == "session.updated":
                replies += 1
            elif kind.startswith("input_audio_buffer."):
                seen.setdefault(kind.removeprefix("input_audio_buffer."), taken)
            elif kind == "response.done" and event["response"]["id"] == answer:
                how = "cancelled" if self.ended == "cancelled turn_detected" else "ended"
                seen.setdefault(how, taken)
        onset = start + lead_ms  # the sound's first sample, on the session's clock
        return {
            "clip": clip.name,
            "start_ms": start,
            "end_ms": self.sent_ms,
            "onset_ms": round(onset, 3),
            "interrupted": "speech_started" in seen,
            "cancelled": "cancelled" in seen,
            # the answer ended by itself before the clip was decided: no trial
            "void": "ended" in seen and "speech_started" not in seen,
            "events": sorted(seen, key=seen.__getitem__),
            # the audio the server had of the clip when it decided, from the speech's start
            "decided_ms": _after(seen.get("speech_started"), start, onset),
            # to the append (not past the window, where it is the end: at most)
            "decided_exact": seen.get("speech_started", 0) <= window.stop,
            "cancel_told_ms": _after(seen.get("cancelled"), start, onset),
        }

    def paced(self, clip: Clip, lead_ms: float) -> dict[str, Any]:
        """``clip`` over the playing answer at real-time pace (20 ms per 20 ms, each
        chunk sent once it would have been recorded): when ``speech_started`` and the
        answer's cancelled ``response.done`` arrive, from when the speech's first
        sample would have been recorded."""
        start = self.sent_ms
        lead = int(RATE * lead_ms / 1000)
        pcm = bytes(2 * lead) + clip.pcm + bytes(2 * (RATE * TAIL_MS // 1000))
        pcm += bytes(-len(pcm) % CHUNK_BYTES)
        chunks = [pcm[i : i + CHUNK_BYTES] for i in range(0, len(pcm), CHUNK_BYTES)]
        answer = self.answer
        assert answer is not None
        got: dict[str, float] = {}
        began = time.perf_counter()
        for index, chunk in enumerate(chunks):
            due = began + (index + 1) * CHUNK_MS / 1000
            # once the answer is cancelled, the rest (silence) goes at once
            while "cancelled" not in got and (left := due - time.perf_counter()) > 0:
                try:
                    event = self.recv(timeout=left)
                except TimeoutError:
                    break
                self._stamp(event, answer, got)
            self.ws.send(_append(chunk))
        self.sent_ms += len(chunks) * CHUNK_MS
        self.ws.send(_PING)
        while "pinged" not in got or (
            "speech_started" in got and not {"cancelled", "ended"} & got.keys()
        ):
            self._stamp(self.recv(), answer, got)
        recorded = began + lead_ms / 1000  # when the speech's first sample was recorded
        return {
            "clip": clip.name,
            "start_ms": start,
            "end_ms": self.sent_ms,
            "onset_ms": round(start + lead_ms, 3),
            "interrupted": "speech_started" in got,
            "speech_started_ms": _wall(got.get("speech_started"), recorded),
            "cancelled_ms": _wall(got.get("cancelled"), recorded),
        }

    def _stamp(self, event: dict[str, Any], answer: str, got: dict[str, float]) -> None:
        kind = event["type"]
        if kind == "session.updated":
            got.setdefault("pinged", event["_at"])
        elif kind == "input_audio_buffer.speech_started":
            got.setdefault("speech_started", event["_at"])
        elif kind == "response.done" and event["response"]["id"] == answer:
            got.setdefault(
                "cancelled" if self.ended == "cancelled turn_detected" else "ended", event["_at"]
            )


def _after(taken: int | None, start: int, onset: float) -> float | None:
    return None if taken is None else round(start + taken * CHUNK_MS - onset, 3)


def _wall(at: float | None, recorded: float) -> float | None:
    return None if at is None else round((at - recorded) * 1000, 3)


def _vad_view(events: list[tuple[int, Any]], trial: dict[str, Any]) -> dict[str, Any]:
    """What the session's detector heard of a trial's clip: its speech's start (from
    the sound's first sample), when it said so, and how long it heard speech (each
    stretch)."""
    from omni_trio.speech import SpeechStarted, SpeechStopped

    onset = trial["onset_ms"]
    vad = [(at, e) for at, e in events if trial["start_ms"] <= at <= trial["end_ms"]]
    starts = [(at, e.audio_start_ms) for at, e in vad if isinstance(e, SpeechStarted)]
    stops = [e.audio_end_ms for _, e in vad if isinstance(e, SpeechStopped)]
    heard = [stop - begin for (_, begin), stop in zip(starts, stops, strict=False)]
    return {
        "heard_ms": heard,
        "vad_start_ms": round(starts[0][1] - onset, 3) if starts else None,
        "vad_said_ms": round(starts[0][0] - onset, 3) if starts else None,
    }


def run_setting(url: str, min_ms: int, sounds: list[Clip], paced: list[Clip]) -> dict[str, Any]:
    """Every clip over an answer, in one session at ``min_ms``; a void trial (the
    answer ended under it by itself) is run again, over a new answer. Every setting's
    session hears the same audio (the same seeded leads): its detector hears what
    the others' do."""
    from websockets.sync.client import connect

    rng = np.random.default_rng(SEED)
    found: dict[str, Any] = {"trials": [], "paced": [], "voided": 0}
    with connect(url, max_size=None) as ws:
        session = Session(ws, min_ms)
        for clip in sounds:
            lead = LEAD_MS + float(rng.integers(0, CHUNK_MS * RATE // 1000)) * 1000 / RATE
            for _ in range(3):
                session.play()
                trial = session.trial(clip, lead)
                if not trial["void"]:
                    break
                found["voided"] += 1
            found["trials"].append(
                {"kind": clip.kind, "text": clip.text, "voice": clip.voice, **trial}
            )
        for clip in paced:
            lead = LEAD_MS + float(rng.integers(0, CHUNK_MS * RATE // 1000)) * 1000 / RATE
            session.play()
            found["paced"].append(
                {"text": clip.text, "voice": clip.voice, **session.paced(clip, lead)}
            )
        found["answers"] = session.answers
        found["answer_first_audio_s"] = summary(session.answer_waits)
    return found


def client() -> None:
    """``--client``: the plan on stdin (JSON: the URL, the settings, the clips with
    their audio in base64, which of them to pace); a line of JSON on stdout per
    setting, as each is done."""
    plan = json.load(sys.stdin)
    made = [
        Clip(c["kind"], c["text"], c["voice"], base64.b64decode(c["pcm"])) for c in plan["clips"]
    ]
    paced = [made[i] for i in plan["paced"]]
    for min_ms in plan["settings"]:
        began = time.perf_counter()
        found = run_setting(plan["url"], min_ms, made, paced)
        found["seconds"] = round(time.perf_counter() - began, 3)
        print(json.dumps(found), flush=True)


# -- the sitting -------------------------------------------------------------------------


def _count(trials: list[dict[str, Any]], kinds: tuple[str, ...]) -> list[int]:
    chosen = [t for t in trials if t["kind"] in kinds]
    return [sum(t["interrupted"] for t in chosen), len(chosen)]


def _predicted(trial: dict[str, Any], min_ms: int) -> bool:
    """Whether the detector's view says ``trial`` interrupts: some stretch of speech
    at least ``min_ms`` long (any, at 0)."""
    return any(h >= min_ms for h in trial["heard_ms"])


def _summary(values: list[float | None]) -> dict[str, float] | None:
    found = [v for v in values if v is not None]
    return summary(found) if found else None


def _summaries(found: dict[str, Any], min_ms: int) -> dict[str, Any]:
    trials = found["trials"]
    sentences = [t for t in trials if t["kind"] == "sentence"]
    delays = [t["decided_ms"] for t in sentences]
    told = [t["cancel_told_ms"] for t in sentences]
    late = [
        None
        if None in (t["decided_ms"], t["vad_start_ms"])
        else t["decided_ms"] - t["vad_start_ms"]
        for t in sentences
    ]
    paced = found["paced"]
    return {
        "backchannels": _count(trials, ("backchannel",)),
        "noise": _count(trials, ("noise",)),
        "short": _count(trials, ("backchannel", "noise")),
        "sentences": _count(trials, ("sentence",)),
        "not_cancelled": sum(t["interrupted"] != t["cancelled"] for t in trials),
        "decided_late": sum(not t["decided_exact"] for t in trials),
        "unlike_the_detector": [
            t["clip"] for t in trials if t["interrupted"] != _predicted(t, min_ms)
        ],
        "decided_ms": _summary(delays),
        "decided_after_vad_start_ms": _summary(late),
        "cancel_told_ms": _summary(told),
        "paced_speech_started_ms": _summary([p["speech_started_ms"] for p in paced]),
        "paced_cancelled_ms": _summary([p["cancelled_ms"] for p in paced]),
    }


async def _run_client(plan: dict[str, Any], done: Callable[[int, dict[str, Any]], None]) -> None:
    """Run the client (``--client``, a process of its own: it takes no GIL from the
    server) on ``plan``; ``done(index, results)`` for each setting, as it finishes."""
    argv = [sys.executable, __file__, "--client"]
    with tempfile.TemporaryFile() as errors:
        async with trio.open_nursery() as nursery:
            process = await nursery.start(
                functools.partial(
                    trio.run_process,
                    argv,
                    stdin=json.dumps(plan).encode(),
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    check=False,
                )
            )
            pending = b""
            index = 0
            async for data in process.stdout:
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    done(index, json.loads(line))
                    index += 1
        if process.returncode or index != len(plan["settings"]):
            errors.seek(0)
            told = errors.read().decode(errors="replace")[-5000:]
            raise RuntimeError(f"the client failed (exit status {process.returncode}):\n{told}")


async def measure(console: Console, quick: bool, settings: Sequence[int]) -> dict[str, Any]:
    voices = QUICK_VOICES if quick else VOICES
    with console.status("eSpeak NG says the clips ..."):
        made = await trio.to_thread.run_sync(clips, voices)
    paced = [] if quick else [c for c in made if c.kind == "sentence" and c.voice in PACED_VOICES]
    report: dict[str, Any] = {
        "quick": quick,
        "voices": list(voices),
        "settings": list(settings),
        "clips": [
            {"kind": c.kind, "text": c.text, "voice": c.voice, "ms": round(c.ms, 3)} for c in made
        ],
        "lead_ms": LEAD_MS,
        "tail_ms": TAIL_MS,
        "turn_detection": {**TURN_DETECTION, "create_response": False},
        "by_setting": {},
    }
    heard = Heard()
    started = time.perf_counter()
    console.print("the voice pipeline starts ...")
    async with served(heard) as (url, report["pipeline"]):
        report["pipeline_start_s"] = round(time.perf_counter() - started, 3)
        plan = {
            "url": url,
            "settings": list(settings),
            "clips": [
                {
                    "kind": c.kind,
                    "text": c.text,
                    "voice": c.voice,
                    "pcm": base64.b64encode(c.pcm).decode(),
                }
                for c in made
            ],
            "paced": [made.index(c) for c in paced],
        }

        def done(index: int, found: dict[str, Any]) -> None:
            min_ms = settings[index]
            for trial in found["trials"] + found["paced"]:
                trial |= _vad_view(heard.sessions[index], trial)
            found["summary"] = _summaries(found, min_ms)
            report["by_setting"][str(min_ms)] = found
            s = found["summary"]
            console.print(
                f"interrupt_min_ms {min_ms}: {s['short'][0]}/{s['short'][1]} short sounds "
                f"and {s['sentences'][0]}/{s['sentences'][1]} sentences interrupted "
                f"({found['seconds']:.1f} s)"
            )

        await _run_client(plan, done)
    if len(heard.sessions) != len(settings):
        raise RuntimeError(f"{len(heard.sessions)} detectors for {len(settings)} sessions")
    return report


# -- printing ----------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def _spread(stats: dict[str, float] | None) -> str:
    if not stats:
        return "—"
    return f"{stats['p50']:.0f} ({stats['min']:.0f} to {stats['max']:.0f})"


def _range(values: list[float]) -> str:
    if not values:
        return "—"
    low, high = min(values), max(values)
    return f"{low:,.0f}" if low == high else f"{low:,.0f}-{high:,.0f}"


def _by_sound(report: dict[str, Any], settings: list[str]) -> Table:
    """Each sound in every voice (the noise bursts together, the sentences together):
    its length, the speech heard in it, and how many interrupted at each setting."""
    by = report["by_setting"]
    groups: dict[str, list[int]] = {}
    for index, trial in enumerate(by[settings[0]]["trials"]):
        name = {"noise": "noise bursts", "sentence": "sentences"}.get(trial["kind"], trial["text"])
        groups.setdefault(name, []).append(index)
    clips = {(c["text"], c["voice"]): c["ms"] for c in report["clips"]}
    table = Table(title="by sound, every voice: ms, and how many interrupted the answer")
    for column in ("sound", "length", "heard as speech"):
        table.add_column(column, justify="left" if column == "sound" else "right")
    for m in settings:
        table.add_column(m, justify="right")
    for name, indices in groups.items():
        trials = [by[settings[0]]["trials"][i] for i in indices]
        table.add_row(
            name,
            _range([clips[t["text"], t["voice"]] for t in trials]),
            _range([h for t in trials for h in t["heard_ms"]]),
            *(
                f"{sum(by[m]['trials'][i]['interrupted'] for i in indices)}/{len(indices)}"
                for m in settings
            ),
        )
    return table


def show(report: dict[str, Any], console: Console) -> None:
    console.print(f"$ {report['command']}")
    console.print(
        f"Python {report['python']} on {report['machine']}; onnxruntime "
        f"{report['versions']['onnxruntime']}, espeakng-loader "
        f"{report['versions']['espeakng-loader']}; pipeline {report['pipeline']['name']} "
        f"(thinker {report['pipeline']['thinker']}); {report['wall_s']:.0f} s"
    )
    settings = [str(m) for m in report["settings"]]
    by = report["by_setting"]
    first = by[settings[0]]["trials"]
    table = Table(
        title="short sounds over a playing answer: interrupted (✓) or not (·), by "
        "interrupt_min_ms; heard: the speech the server's detector heard in it (ms)"
    )
    table.add_column("sound")
    table.add_column("voice")
    table.add_column("length", justify="right")
    table.add_column("heard", justify="right")
    for m in settings:
        table.add_column(m, justify="center")
    short = [t for t in first if t["kind"] != "sentence"]
    clips = {(c["text"], c["voice"]): c for c in report["clips"]}
    for index, trial in enumerate(short):
        heard = "+".join(str(h) for h in trial["heard_ms"]) or "—"
        table.add_row(
            trial["text"],
            trial["voice"] or "",
            _ms(clips[trial["text"], trial["voice"]]["ms"]),
            heard,
            *("✓" if by[m]["trials"][index]["interrupted"] else "·" for m in settings),
        )
        if index + 1 < len(short) and short[index + 1]["text"] != trial["text"]:
            table.add_section()
    table.add_section()
    for label, key in (
        ("backchannels", "backchannels"),
        ("noise bursts", "noise"),
        ("all short sounds", "short"),
    ):
        table.add_row(
            label,
            "",
            "",
            "",
            *(f"{by[m]['summary'][key][0]}/{by[m]['summary'][key][1]}" for m in settings),
        )
    console.print(table)
    console.print(_by_sound(report, settings))

    table = Table(
        title="real interruptions (the sentences): detected, and when, in ms from the "
        "speech's first sample: median (min to max)"
    )
    table.add_column("interrupt_min_ms", justify="right")
    table.add_column("detected", justify="right")
    table.add_column("detector's start", justify="right")
    table.add_column("decided (audio clock)", justify="right")
    table.add_column("decided, from the detector's start", justify="right")
    table.add_column("real time: speech_started", justify="right")
    table.add_column("real time: response.done", justify="right")
    for m in settings:
        s = by[m]["summary"]
        sentences = [t for t in by[m]["trials"] if t["kind"] == "sentence"]
        starts = [t["vad_start_ms"] for t in sentences if t["vad_start_ms"] is not None]
        table.add_row(
            m,
            f"{s['sentences'][0]}/{s['sentences'][1]}",
            _spread(summary(starts) if starts else None),
            _spread(s["decided_ms"]),
            _spread(s["decided_after_vad_start_ms"]),
            _spread(s["paced_speech_started_ms"]),
            _spread(s["paced_cancelled_ms"]),
        )
    console.print(table)
    for m in settings:
        found, s = by[m], by[m]["summary"]
        odd = s["unlike_the_detector"]
        notes = [
            f"{found['answers']} answers (first audio after "
            f"{found['answer_first_audio_s']['p50'] * 1000:.0f} ms, p50)",
            f"{found['voided']} void trials run again",
            f"{s['not_cancelled']} speech_started without the answer's cancel",
            f"{s['decided_late']} decided past the replies",
            f"against the detector's length: {', '.join(odd) if odd else 'none differs'}",
        ]
        console.print(f"interrupt_min_ms {m}: " + "; ".join(notes))


def _dumps(value: Any, indent: str = "") -> str:
    """JSON with each object or list that holds no object, and no list but of plain
    values, on one line (a trial, a clip, a summary): a saved run stays readable."""

    def plain(v: Any) -> bool:
        if isinstance(v, list):
            return not any(isinstance(x, dict | list) for x in v)
        return not isinstance(v, dict) or not v

    if not isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    children = value.values() if isinstance(value, dict) else value
    if all(plain(v) for v in children):
        return json.dumps(value, ensure_ascii=False)
    inner = indent + " "
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {_dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    items = [inner + _dumps(v, inner) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + indent + "]"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python tools/bench_interrupt.py")
    parser.add_argument(
        "--quick", action="store_true", help=f"voices {', '.join(QUICK_VOICES)}; no real-time pace"
    )
    parser.add_argument(
        "--settings",
        default=",".join(map(str, SETTINGS)),
        help="the interrupt_min_ms values, comma-separated",
    )
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--from", dest="saved", type=Path, help="re-print a saved report")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        client()
        return
    console = Console(width=150)
    if args.saved is not None:
        show(json.loads(args.saved.read_text()), console)
        return
    settings = [int(m) for m in args.settings.split(",")]
    report: dict[str, Any] = {
        "command": "python tools/bench_interrupt.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "versions": {
            n: version(n)
            for n in ("onnxruntime", "faster-whisper", "espeakng-loader", "av", "websockets")
        },
        "load_average": os.getloadavg()[0],
    }
    began = time.perf_counter()
    report |= trio.run(measure, console, args.quick, settings)
    report["wall_s"] = round(time.perf_counter() - began, 3)
    if args.json is not None:
        args.json.write_text(_dumps(report) + "\n")
    show(report, console)


if __name__ == "__main__":
    main()
