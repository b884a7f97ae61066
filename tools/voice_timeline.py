"""One spoken conversation with a barge-in, drawn on a timeline: ``docs/voice_timeline.png``.

The shipped ``voice`` pipeline is served in this process on 127.0.0.1 (its thinker
slowed to 8 tokens a second, so that the first answer is still streaming when the
user interrupts it), and the ``openai`` package's own Realtime client talks to it, as
``tests/test_voice.py`` does: a microphone streams 24 kHz PCM16 in 20 ms appends at
real-time pace, silence but for two utterances said by eSpeak NG -- a question, and,
half a second after the answer's audio has begun to arrive, an interruption.

One clock, ``time.perf_counter()``, in one process, times both sides:

- **server-traced**: the moments :class:`omni_trio.serve.RealtimeOptions`'s ``trace``
  hook reports (the VAD's ``speech_started``, ``silence_started``, ``speech_stopped``;
  each response's ``response_started``, ``response_cancelled``, ``request_ended``,
  ``response_done``);
- **client-observed**: when each server event reached the client, and when the user's
  speech was sent.

The picture, x in seconds since the WebSocket opened, has a lane for the user's
speech, one for the server's VAD, and two per response: its orchestrator request
(from ``response_started`` to ``request_ended``: lighter while it is held as a
speculation, hatched red if cancelled) and what the client received of it (the
transcript, each text delta as a tick, each audio delta as a bar from its arrival as
long as the audio it carries, and ``response.done``). A speculation cancelled unseen
(speech resumed within a pause) is drawn in grey in the lane of the turn it guessed
at. A red line marks the barge-in. The barge-in's latencies are printed.

Run (the voice extra and matplotlib; the conversation takes about 15 s of wall time,
after the pipeline's start)::

    python tools/voice_timeline.py [--out docs/voice_timeline.png]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import math
import textwrap
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio

from omni_trio import open_pipeline
from omni_trio.bench._voice import SESSION as VOICE_SESSION
from omni_trio.bench._voice import voice_config
from omni_trio.serve import RealtimeOptions, ServedModel, create_app, serve
from omni_trio.speech import ESpeak, Resampler

OUT = Path(__file__).resolve().parents[1] / "docs" / "voice_timeline.png"
MODEL = "voice-omni"
RATE = 24_000
CHUNK_SECONDS = 0.02
CHUNK = int(RATE * CHUNK_SECONDS) * 2  # 20 ms of 24 kHz PCM16
QUESTION = "Please tell me a story about the ocean."
INTERRUPTION = "Wait. What is the weather like in London today?"
LEAD_IN = 0.5  # seconds of silence before the question
BARGE_IN_AFTER = 0.5  # seconds after the first answer's first audio delta
TOKENS_PER_SECOND = 8  # the thinker's pace: slow, so the answer is still streaming
SESSION: Any = VOICE_SESSION  # the openai package types it as a TypedDict


# --- the conversation ------------------------------------------------------------


@attrs.define
class Recording:
    """Everything timed, in ``time.perf_counter()`` seconds."""

    server: list[tuple[float, str, str]] = attrs.field(factory=list)  # (t, what, ref)
    client: list[tuple[float, dict[str, Any]]] = attrs.field(factory=list)
    speech: list[tuple[float, float, str]] = attrs.field(factory=list)  # sent: start, end
    t0: float = math.nan  # the WebSocket opened

    def trace(self, session_id: str, what: str, ref: str) -> None:
        """The server's ``trace`` hook (called in the server's thread)."""
        self.server.append((time.perf_counter(), what, ref))


def spoken(text: str) -> bytes:
    """``text`` said by eSpeak NG, at 24 kHz, trimmed to its first and last audible
    sample (so the drawn speech is the speech)."""
    speech = ESpeak.get()
    resampler = Resampler(speech.sample_rate, RATE)  # 22,050 Hz to 24 kHz
    pcm = resampler.feed(speech.synthesize(text)) + resampler.flush()
    loud = np.flatnonzero(np.abs(np.frombuffer(pcm, "<i2").astype(np.int32)) > 300)
    return pcm[loud[0] * 2 : (loud[-1] + 1) * 2]


class Microphone:
    """Streams 20 ms appends at real-time pace: silence, but for what :meth:`say`
    queues. Records when each utterance's audio was sent."""

    def __init__(self, conn: Any, recording: Recording) -> None:
        self._conn = conn
        self._recording = recording
        self._queue: collections.deque[tuple[str, bytes, asyncio.Event]] = collections.deque()
        self._silence = base64.b64encode(bytes(CHUNK)).decode()

    async def say(self, text: str) -> None:
        """Speak ``text`` into the stream; return when its last append was sent."""
        said = asyncio.Event()
        self._queue.append((text, spoken(text), said))
        await said.wait()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        tick = 0

        async def append(audio: str) -> None:
            nonlocal tick
            await self._conn.input_audio_buffer.append(audio=audio)
            tick += 1
            await asyncio.sleep(max(0.0, start + tick * CHUNK_SECONDS - loop.time()))

        while True:
            if not self._queue:
                await append(self._silence)
                continue
            text, pcm, said = self._queue.popleft()
            first = time.perf_counter()
            for offset in range(0, len(pcm), CHUNK):
                last = time.perf_counter()
                await append(base64.b64encode(pcm[offset : offset + CHUNK]).decode())
            self._recording.speech.append((first, last + CHUNK_SECONDS, text))
            said.set()


async def converse(url: str, recording: Recording) -> None:
    """The client's side (asyncio, in a thread): the whole conversation."""
    import openai

    client = openai.AsyncOpenAI(
        api_key="unused",
        base_url=f"{url}/v1",
        websocket_base_url=url.replace("http://", "ws://") + "/v1",
        max_retries=0,
    )
    first_audio = asyncio.Event()
    done: list[str] = []
    all_done = asyncio.Event()

    async def read(conn: Any) -> None:
        async for event in conn:
            now = time.perf_counter()
            data = event.model_dump()
            recording.client.append((now, data))
            if data["type"] == "response.output_audio.delta":
                first_audio.set()
            elif data["type"] == "response.done":
                done.append(data["response"]["status"])
                if len(done) == 2:
                    all_done.set()
            elif data["type"] == "error":
                raise RuntimeError(f"the server refused an event: {data['error']}")

    async with client.realtime.connect(model=MODEL) as conn:
        recording.t0 = time.perf_counter()
        await conn.session.update(session=SESSION)
        microphone = Microphone(conn, recording)
        tasks = [asyncio.create_task(read(conn)), asyncio.create_task(microphone.run())]
        try:
            await asyncio.sleep(LEAD_IN)
            await microphone.say(QUESTION)
            await asyncio.wait_for(first_audio.wait(), 30)
            await asyncio.sleep(BARGE_IN_AFTER)
            await microphone.say(INTERRUPTION)
            await asyncio.wait_for(all_done.wait(), 60)
            await asyncio.sleep(0.3)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    if done != ["cancelled", "completed"]:
        raise RuntimeError(f"expected a cancelled answer, then a completed one: {done}")


async def record() -> Recording:
    """Serve the voice pipeline, hold the conversation, and return what was timed."""
    config = voice_config(tokens_per_second=TOKENS_PER_SECOND)
    recording = Recording()

    @asynccontextmanager
    async def opener() -> AsyncIterator[Any]:
        async with open_pipeline(config) as pipeline:
            yield pipeline

    options = RealtimeOptions(trace=recording.trace)
    app = create_app(ServedModel.from_config(config), opener, realtime=options)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve, app, port=0))
        await trio.to_thread.run_sync(lambda: asyncio.run(converse(url, recording)))
        nursery.cancel_scope.cancel()
    return recording


# --- what it shows -----------------------------------------------------------------


@attrs.define
class Response:
    """One response, both sides, in seconds since the WebSocket opened."""

    id: str
    server: dict[str, float]  # what -> when (server-traced)
    status: str | None = None  # None: never seen by the client (a silent speculation)
    reason: str | None = None
    created: float | None = None  # client: response.created
    transcript: tuple[float, str] | None = None  # client: the turn's transcript
    text: list[tuple[float, str]] = attrs.field(factory=list)  # client: text deltas
    audio: list[tuple[float, float]] = attrs.field(factory=list)  # client: (t, seconds)
    done: float | None = None  # client: response.done
    turn_stopped: float | None = None  # server: its turn's speech_stopped

    @property
    def visible(self) -> bool:
        return self.status is not None

    @property
    def first_audio(self) -> float | None:
        return self.audio[0][0] if self.audio else None


@attrs.define
class Story:
    """The recording, made relative to the WebSocket's opening and sorted out."""

    speech: list[tuple[float, float, str]]
    vad: list[tuple[float, str]]  # server: (t, what)
    responses: list[Response]  # visible ones, in order
    unseen: list[Response]  # speculations cancelled before anyone saw them
    barge_in: float  # server: the speech_started that cancelled the first answer
    barge_in_client: float  # client: that speech_started event's arrival
    late_deltas: int  # the cancelled answer's deltas after its barge-in, in socket order


def story_of(recording: Recording) -> Story:
    """Sort the recording out by response. The visible responses are paired, in
    order, with the VAD's turns (``speech_stopped``) and the transcripts."""
    t0 = recording.t0
    server = [(t - t0, what, ref) for t, what, ref in recording.server]
    vad = [(t, what) for t, what, _ in server if what in VAD_MARKS]
    by_id: dict[str, Response] = {}
    for t, what, ref in server:
        if what not in VAD_MARKS:
            by_id.setdefault(ref, Response(ref, {})).server.setdefault(what, t)
    client = [(t - t0, e) for t, e in recording.client]
    turn_transcripts = [
        (t, e["transcript"])
        for t, e in client
        if e["type"] == "conversation.item.input_audio_transcription.completed"
    ]
    for t, e in client:
        kind = e["type"]
        rid = e.get("response_id") or (e.get("response") or {}).get("id")
        if rid is None:
            continue
        response = by_id.setdefault(rid, Response(rid, {}))
        if kind == "response.created":
            response.created = t
            response.status = "in_progress"
        elif kind == "response.output_audio_transcript.delta":
            response.text.append((t, e["delta"]))
        elif kind == "response.output_audio.delta":
            response.audio.append((t, len(base64.b64decode(e["delta"])) / (2 * RATE)))
        elif kind == "response.done":
            response.done = t
            response.status = e["response"]["status"]
            details = e["response"].get("status_details") or {}
            response.reason = details.get("reason")
    visible = sorted((r for r in by_id.values() if r.visible), key=lambda r: r.created or 0)
    unseen = [r for r in by_id.values() if not r.visible]
    stops = [t for t, what in vad if what == "speech_stopped"]
    for response, stopped, heard in zip(visible, stops, turn_transcripts, strict=False):
        response.turn_stopped = stopped
        response.transcript = heard
    cancelled = next(r for r in visible if r.status == "cancelled")
    starts = [t for t, what in vad if what == "speech_started"]
    barge_in = max(t for t in starts if t <= cancelled.server["response_cancelled"])
    # the client's view, in socket order: the speech_started that interrupted, and any
    # delta of the cancelled answer after it
    cut = next(
        i
        for i, (t, e) in enumerate(client)
        if e["type"] == "input_audio_buffer.speech_started" and t >= (cancelled.created or 0)
    )
    late = sum(
        1
        for _, e in client[cut:]
        if e.get("response_id") == cancelled.id and e["type"].endswith(".delta")
    )
    return Story(
        speech=[(a - t0, b - t0, text) for a, b, text in recording.speech],
        vad=vad,
        responses=visible,
        unseen=unseen,
        barge_in=barge_in,
        barge_in_client=client[cut][0],
        late_deltas=late,
    )


def latencies(story: Story) -> dict[str, float]:
    """The measured latencies, in ms."""
    cancelled = next(r for r in story.responses if r.status == "cancelled")
    ms: dict[str, float] = {}
    for what in ("response_cancelled", "request_ended", "response_done"):
        ms[f"speech_started -> {what}"] = (cancelled.server[what] - story.barge_in) * 1e3
    ms["speech_started -> its event at the client"] = (story.barge_in_client - story.barge_in) * 1e3
    if cancelled.done is not None:
        ms["speech_started -> response.done at the client"] = (
            cancelled.done - story.barge_in
        ) * 1e3
    for n, response in enumerate(story.responses, 1):
        if response.turn_stopped is not None and response.first_audio is not None:
            ms[f"turn {n}: speech_stopped -> first audio delta at the client"] = (
                response.first_audio - response.turn_stopped
            ) * 1e3
    for n, ((start, _, _), t) in enumerate(
        zip(story.speech, [t for t, w in story.vad if w == "speech_started"], strict=False), 1
    ):
        ms[f"turn {n}: speech sent -> the VAD's speech_started"] = (t - start) * 1e3
    return ms


def summary(story: Story) -> str:
    """What :func:`main` prints: the latencies, and what each response was."""
    lines = ["barge-in (one clock; 'at the client': when the client read the event):"]
    ms = latencies(story)
    for name, value in ms.items():
        if name.startswith("speech_started"):
            lines.append(f"  {name:<48} {value:8.2f} ms")
    lines.append(
        f"  deltas of the cancelled answer after its speech_started (socket order): "
        f"{story.late_deltas}"
    )
    lines.append("turns:")
    for name, value in ms.items():
        if name.startswith("turn"):
            lines.append(f"  {name:<60} {value:6.0f} ms")
    for n, response in enumerate(story.responses, 1):
        heard = response.transcript[1] if response.transcript else "-"
        audio = sum(d for _, d in response.audio)
        lines.append(
            f"  response {n}: {response.status}"
            + (f" ({response.reason})" if response.reason else "")
            + f", heard {heard!r}, {len(response.text)} text deltas,"
            f" {len(response.audio)} audio deltas ({audio:.1f} s of audio)"
        )
    if story.unseen:
        lines.append(f"  speculations cancelled unseen: {len(story.unseen)}")
    return "\n".join(lines)


# --- the picture -------------------------------------------------------------------

VAD_MARKS = {
    "speech_started": ("v", "speech_started"),
    "silence_started": ("|", "silence_started (speculation may start)"),
    "speech_stopped": ("^", "speech_stopped (turn committed)"),
}
SPEECH = "C0"
VAD = "C1"
COMPLETED = "C2"
CANCELLED = "C3"  # tab:red
UNSEEN = "0.55"
#: Lane heights, in y units: a response's events lane holds its audio deltas'
#: waterfall under its text.
SPEECH_LANE, VAD_LANE, REQUEST_LANE = 1.0, 1.0, 0.8
AUDIO_ROW = 0.14  # an audio delta's row in the waterfall


def events_lane(response: Response) -> float:
    """The height of a response's events lane: text, then one row per audio delta."""
    return 0.75 + AUDIO_ROW * max(len(response.audio), 2)


def figure(story: Story) -> Any:
    """The conversation's timeline (a matplotlib ``Figure``, no pyplot)."""
    from matplotlib.figure import Figure

    lanes = [("user speaks\n(client sent)", SPEECH_LANE), ("server VAD\n(traced)", VAD_LANE)]
    for k, response in enumerate(story.responses, 1):
        lanes += [
            (f"answer {k}: request\n(server-traced)", REQUEST_LANE),
            (f"answer {k}: events\n(client-observed)", events_lane(response)),
        ]
    tops = np.concatenate([[0.0], np.cumsum([h for _, h in lanes])])
    fig = Figure(figsize=(12, 5.8), layout="constrained")
    ax = fig.subplots()
    for i, (_, height) in enumerate(lanes):
        if i % 2:
            ax.axhspan(tops[i], tops[i] + height, color="0.96", zorder=0)

    y = tops[0] + SPEECH_LANE / 2
    for start, stop, text in story.speech:
        ax.barh(y, stop - start, left=start, height=0.6, color=SPEECH, alpha=0.55)
        words = textwrap.fill(f"\u201c{text}\u201d", max(12, int((stop - start) * 15)))
        ax.text((start + stop) / 2, y, words, fontsize="x-small", ha="center", va="center")

    y = tops[1] + VAD_LANE / 2
    for what, (marker, _) in VAD_MARKS.items():
        xs = [t for t, w in story.vad if w == what]
        ax.plot(xs, [y] * len(xs), ls="none", marker=marker, ms=8, color=VAD, mew=2)

    for k, response in enumerate(story.responses):
        colour = CANCELLED if response.status == "cancelled" else COMPLETED
        request_top, events_top = tops[2 + 2 * k], tops[3 + 2 * k]
        y = request_top + REQUEST_LANE / 2
        _request(ax, response, y, colour)
        for spec in (r for r in story.unseen if _belongs(r, response, story.responses)):
            _request(ax, spec, y, UNSEEN)
            ax.text(
                spec.server["request_ended"] + 0.08,
                y,
                "speculation",
                fontsize="x-small",
                color="0.35",
                va="center",
            )
        _events(ax, response, events_top, colour)
        if response.done is not None:
            ax.vlines(
                response.done,
                request_top,
                events_top + events_lane(response),
                color="grey",
                lw=1,
                ls=":",
            )

    _barge_in(ax, story)
    ax.set_yticks((tops[:-1] + tops[1:]) / 2, [name for name, _ in lanes], fontsize="small")
    ax.tick_params(axis="y", length=0)
    ax.set_ylim(tops[-1], 0)
    end = max(
        [r.done or 0 for r in story.responses]
        + [t + d for r in story.responses for t, d in r.audio]
    )
    ax.set_xlim(0, end + 0.3)
    ax.set_xlabel("seconds since the WebSocket opened (one clock for both sides)")
    ax.grid(axis="x", color="0.88")
    ax.set_axisbelow(True)
    fig.legend(handles=_legend(), loc="outside lower center", ncols=4, fontsize="small")
    fig.suptitle(
        "One voice conversation over /v1/realtime, with a barge-in"
        f" ({MODEL}; thinker at {TOKENS_PER_SECOND} tokens/s; the user is eSpeak NG)"
    )
    return fig


def _request(ax: Any, response: Response, y: float, colour: str) -> None:
    """A request's span, from ``response_started`` to ``request_ended``: lighter while
    it was held (speculative: its turn not yet over), hatched if cancelled."""
    server = response.server
    start, stop = server["response_started"], server["request_ended"]
    cancelled = "response_cancelled" in server
    held_until = min(max(response.turn_stopped or start, start), stop)
    if held_until > start:
        ax.barh(y, held_until - start, left=start, height=0.45, color=colour, alpha=0.3, lw=0)
    ax.barh(
        y,
        stop - held_until,
        left=held_until,
        height=0.45,
        facecolor="white" if cancelled else colour,
        edgecolor=colour,
        hatch="///" if cancelled else None,
        alpha=1.0 if cancelled else 0.7,
        lw=0.8,
    )
    if cancelled:
        ax.plot([server["response_cancelled"]], [y], ls="none", marker="x", color=colour, mew=2)
    if response.status == "cancelled":
        ax.text(
            stop + 0.12,
            y,
            f"cancelled: {response.reason}",
            color=colour,
            va="center",
            fontsize="small",
        )


def _events(ax: Any, response: Response, top: float, colour: str) -> None:
    """What the client received of a response: the transcript, the text deltas (a
    row of ticks), and the audio deltas, one per row, each a bar from its arrival as
    long as the audio it carries."""
    y_text = top + 0.42
    if response.transcript is not None:
        t, heard = response.transcript
        ax.plot([t], [y_text], ls="none", marker="o", ms=7, color="black", zorder=4)
        ax.text(t, top + 0.2, f"heard: \u201c{heard.strip()}\u201d", fontsize="x-small")
    if response.text:
        ticks = [t for t, _ in response.text]
        ax.plot(ticks, [y_text] * len(ticks), ls="none", marker="|", ms=8, color="black")
    for j, (t, seconds) in enumerate(response.audio):
        ax.barh(
            top + 0.68 + AUDIO_ROW * (j + 0.5),
            seconds,
            left=t,
            height=AUDIO_ROW * 0.8,
            color=colour,
            alpha=0.75,
            edgecolor="black",
            lw=0.4,
        )
    if response.done is not None:
        ax.plot([response.done], [y_text], ls="none", marker="s", ms=6, color="grey", zorder=4)
    if response.first_audio is not None and response.turn_stopped is not None:
        after = (response.first_audio - response.turn_stopped) * 1e3
        ax.text(
            response.first_audio - 0.1,
            top + 0.68 + AUDIO_ROW / 2,
            f"speech_stopped \u2192 first audio: {after:.0f} ms",
            fontsize="x-small",
            ha="right",
            va="center",
        )


def _barge_in(ax: Any, story: Story) -> None:
    """The red line at the ``speech_started`` that cancelled the answer, annotated
    above the lanes."""
    cancelled = next(r for r in story.responses if r.status == "cancelled")
    ms = {what: (t - story.barge_in) * 1e3 for what, t in cancelled.server.items()}
    late = "no delta after it" if not story.late_deltas else f"{story.late_deltas} deltas after it"
    client = (
        ""
        if cancelled.done is None
        else f"; response.done at the client +{(cancelled.done - story.barge_in) * 1e3:.1f} ms"
    )
    ax.axvline(story.barge_in, color=CANCELLED, lw=1.2, zorder=1)
    ax.text(
        story.barge_in,
        -0.06,
        f"barge-in: response cancelled {ms['response_cancelled']:.2f} ms after the VAD's"
        f" decision; {late}\n(server: its request ended +{ms['request_ended']:.1f} ms{client})",
        fontsize="small",
        color=CANCELLED,
        va="bottom",
    )


def _legend() -> list[Any]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    return [
        Patch(color=SPEECH, alpha=0.55, label="user speech sent (20 ms appends)"),
        *(
            Line2D([], [], ls="none", marker=marker, color=VAD, mew=2, label=label)
            for marker, label in VAD_MARKS.values()
        ),
        Patch(color=COMPLETED, alpha=0.3, label="request held (speculative)"),
        Patch(color=COMPLETED, alpha=0.7, label="request: response_started \u2192 request_ended"),
        Patch(
            facecolor="white",
            edgecolor=CANCELLED,
            hatch="///",
            label="request cancelled (\u00d7: response_cancelled)",
        ),
        Patch(
            facecolor="white",
            edgecolor=UNSEEN,
            hatch="///",
            label="speculation cancelled unseen",
        ),
        Line2D([], [], ls="none", marker="o", color="black", label="transcript (listen stage)"),
        Line2D([], [], ls="none", marker="|", ms=8, color="black", label="text delta"),
        Patch(
            facecolor=COMPLETED,
            edgecolor="black",
            lw=0.4,
            alpha=0.75,
            label="audio delta: arrival + its duration",
        ),
        Line2D([], [], ls=":", marker="s", color="grey", label="response.done"),
    ]


def _belongs(spec: Response, response: Response, responses: list[Response]) -> bool:
    """Whether the unseen speculation ``spec`` guessed at ``response``'s turn: it
    started after the response before ``response`` and before ``response``."""
    start = spec.server["response_started"]
    index = responses.index(response)
    earlier = sum(r.server["response_started"] < start for r in responses)
    return earlier == index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"the PNG (default: {OUT})")
    args = parser.parse_args()
    recording = trio.run(record)
    story = story_of(recording)
    print(summary(story))
    fig = figure(story)
    fig.savefig(args.out, format="png", dpi=110, bbox_inches="tight")
    print(f"{args.out}: {args.out.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
