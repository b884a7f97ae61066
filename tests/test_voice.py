"""The voice pipeline behind ``/v1/realtime``, driven by the ``openai`` package's own
Realtime client: a spoken question streamed at real-time pace is heard, quoted and
answered aloud; barge-in, ``response.cancel`` and a closed socket abort the answer
at every stage; sessions stay apart; ``input_audio`` in chat completions is heard;
``omni-trio serve voice`` answers a session.

Real parts throughout: eSpeak NG speaks the questions, server VAD finds the turns,
Whisper tiny.en (faster-whisper) hears them in the listen stage's worker process, and
the same Whisper checks the answer's audio. The voice extra; the ``voice`` nox
session runs this module.
"""

from __future__ import annotations

import asyncio
import base64
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from voice_helpers import need_voice, recall, spoken

need_voice()

import openai  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from omni_trio.bench._voice import SESSION, voice_config  # noqa: E402
from omni_trio.serve import RealtimeOptions  # noqa: E402
from serve_helpers import served  # noqa: E402
from test_serve_cli import realtime_url, serving, ws_event, ws_send  # noqa: E402

QUESTION = "What is the capital city of France?"
#: Questions Whisper tiny.en hears well in eSpeak NG's voice (checked one by one).
QUESTIONS = [
    "Can you recommend a good book to read?",
    "Which planet is the largest in our solar system?",
    "What is the weather like in London today?",
]
LONG_QUESTION = "Please tell me a story about the ocean."
RATE = 24_000
CHUNK = RATE * 2 // 50  # 20 ms of 24 kHz PCM16


def voice_server(config: Any = None, **options: Any) -> Any:
    """The voice pipeline served on a free port: its URL, and the running pipeline
    (``options``: :class:`RealtimeOptions`')."""
    return served(config or voice_config(), realtime=RealtimeOptions(**options))


def client_of(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        api_key="unused",
        base_url=f"{url}/v1",
        websocket_base_url=url.replace("http://", "ws://") + "/v1",
        max_retries=0,
    )


async def in_asyncio(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Run the ``openai`` client (asyncio, over ``websockets``) in a thread."""
    return await trio.to_thread.run_sync(lambda: asyncio.run(fn(*args)))


async def paced(conn: Any, pcm: bytes) -> None:
    """Stream ``pcm`` in 20 ms appends at real-time pace."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    for index, offset in enumerate(range(0, len(pcm), CHUNK)):
        chunk = base64.b64encode(pcm[offset : offset + CHUNK]).decode()
        await conn.input_audio_buffer.append(audio=chunk)
        await asyncio.sleep(max(0.0, start + (index + 1) * 0.02 - loop.time()))


def silence(seconds: float) -> bytes:
    return b"\x00\x00" * int(RATE * seconds)


class Events:
    """What a session received, with arrival times."""

    def __init__(self) -> None:
        self.all: list[tuple[float, dict[str, Any]]] = []

    async def read(self, conn: Any, until: Callable[[dict[str, Any]], bool]) -> None:
        loop = asyncio.get_running_loop()
        async for event in conn:
            data = event.model_dump()
            self.all.append((loop.time(), data))
            if until(data):
                return

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for _, e in self.all if e["type"] == kind]

    def index(self, kind: str, start: int = 0) -> int:
        return next(i for i, (_, e) in enumerate(self.all) if i >= start and e["type"] == kind)

    def done(self) -> list[dict[str, Any]]:
        return [e["response"] for e in self.of("response.done")]


def answer_after_quote(text: str, transcript: str) -> str:
    """The answer's text checked to quote ``transcript`` word for word (``You said:
    <transcript>.``), and what it says after the quote."""
    heard = " ".join(transcript.split())
    if heard and heard[-1] not in ".!?":
        heard += "."
    quote = f"You said: {heard} "
    assert text.startswith(quote), (text, transcript)
    return text[len(quote) :]


async def whisper(pcm: bytes, rate: int) -> str:
    """The answer's audio, heard by the same Whisper the listen stage runs."""
    from omni_trio.speech import listen

    engine: Any = None

    def load() -> Any:
        return listen()

    engine = await trio.to_thread.run_sync(load)
    from omni_trio.process import EngineRequest

    class NoIO:
        connected = False

    request = EngineRequest("check", {"audio": pcm, "sample_rate": rate, "context": []}, 0)
    outputs = [out async for out in engine(request, NoIO())]
    return str(getattr(outputs[-1], "data", outputs[-1]))


async def test_a_spoken_question_through_the_openai_realtime_client() -> None:
    question = spoken(QUESTION, RATE)
    async with voice_server() as (url, _):

        async def turn() -> Events:
            events = Events()
            async with (
                client_of(url) as client,
                client.realtime.connect(model="voice-omni") as conn,
            ):
                await conn.session.update(session=SESSION)
                reader = asyncio.create_task(
                    events.read(conn, lambda e: e["type"] == "response.done")
                )
                await paced(conn, silence(0.3) + question + silence(1.0))
                await asyncio.wait_for(reader, 30)
            return events

        events = await in_asyncio(turn)
        kinds = [e["type"] for _, e in events.all]
        assert (
            kinds.index("input_audio_buffer.speech_started")
            < kinds.index("input_audio_buffer.speech_stopped")
            < kinds.index("input_audio_buffer.committed")
            < kinds.index("response.created")
        )
        (heard,) = events.of("conversation.item.input_audio_transcription.completed")
        transcript = heard["transcript"]
        assert recall(QUESTION, transcript) >= 0.6, transcript
        (done,) = events.done()
        assert done["status"] == "completed"
        text = "".join(e["delta"] for e in events.of("response.output_audio_transcript.delta"))
        answer = answer_after_quote(text, transcript)
        audio = b"".join(
            base64.b64decode(e["delta"]) for e in events.of("response.output_audio.delta")
        )
        assert len(audio) > RATE  # more than a second of speech
        said = await whisper(audio, RATE)
        assert recall(answer, said) >= 0.5, (answer, said)


def first_delta(e: dict[str, Any]) -> bool:
    return e["type"] == "response.output_audio.delta"


def record_calls(pipeline: Any, method: str) -> list[list[str]]:
    """Spy on every stage's ``method`` (``"submit"`` or ``"abort"``, as the
    orchestrator calls them: ``stage.<method>(request_id, ...)``): per stage, in stage
    order, the request ids it was called with. Each call still reaches the stage."""
    calls: list[list[str]] = []
    for stage in pipeline.stages:
        ids: list[str] = []
        setattr(stage, method, _spy(getattr(stage, method), ids))
        calls.append(ids)
    return calls


def _spy(real: Callable[..., Awaitable[None]], ids: list[str]) -> Callable[..., Awaitable[None]]:
    async def spy(first: Any, *args: Any, **kwargs: Any) -> None:
        ids.append(getattr(first, "request_id", first))  # a submit's envelope, or an id
        await real(first, *args, **kwargs)

    return spy


async def aborted_everywhere(pipeline: Any, aborts: list[list[str]], request_id: str) -> None:
    """The orchestrator told every stage still running ``request_id`` to abort it
    (``aborts``: from :func:`record_calls`; all but the listen stage, which finished
    it before the answer began), and every stage's worker has let go of every
    request."""
    running = aborts[1:]
    with trio.move_on_after(10):  # a closed socket's aborts go out as the server sees it
        while not all(request_id in ids for ids in running):  # noqa: ASYNC110 - polled
            await trio.sleep(0.02)
    told = [request_id in ids for ids in aborts]
    assert told == [False] + [True] * len(running), (request_id, aborts)
    with trio.fail_after(10):
        while True:
            for stage in pipeline.stages:
                await stage.refresh_statistics()
            if all(stage.statistics().in_flight == 0 for stage in pipeline.stages):
                return
            await trio.sleep(0.02)


@pytest.mark.parametrize("how", ["barge-in", "response.cancel", "socket closed"])
async def test_an_interrupted_answer_is_cancelled_at_every_stage(how: str) -> None:
    question = spoken(LONG_QUESTION, RATE)
    interruption = spoken("Stop. What time is it?", RATE)
    # a slow thinker: the answer is still streaming when the interruption comes
    async with voice_server(voice_config(tokens_per_second=8)) as (url, pipeline):
        submits = record_calls(pipeline, "submit")
        aborts = record_calls(pipeline, "abort")
        answers: list[str] = []  # the request of each answer that streamed audio

        async def converse() -> Events:
            events = Events()
            async with (
                client_of(url) as client,
                client.realtime.connect(model="voice-omni") as conn,
            ):
                await conn.session.update(session=SESSION)
                await paced(conn, silence(0.3) + question + silence(0.7))
                await asyncio.wait_for(events.read(conn, first_delta), 30)
                # No speech since the answer's turn: the last request submitted is its.
                answers.append(submits[0][-1])
                if how == "socket closed":
                    return events
                if how == "response.cancel":
                    await conn.response.cancel()
                    await asyncio.wait_for(
                        events.read(conn, lambda e: e["type"] == "response.done"), 10
                    )
                    await conn.conversation.item.create(
                        item={
                            "type": "message",
                            "role": "user",
                            "content": [{"type": "input_text", "text": "What time is it?"}],
                        }
                    )
                    await conn.response.create()
                else:
                    sender = asyncio.create_task(paced(conn, interruption + silence(1.0)))
                    await asyncio.wait_for(
                        events.read(conn, lambda e: e["type"] == "response.done"), 15
                    )
                    await sender
                await asyncio.wait_for(
                    events.read(conn, lambda e: e["type"] == "response.done"), 30
                )
                answers.append(submits[0][-1])  # the second answer's (no speech since)
            return events

        events = await in_asyncio(converse)
        await aborted_everywhere(pipeline, aborts, answers[0])
        if how != "socket closed":  # the check's control: the answer that completed
            completed = answers[1]  # was let go of, not aborted, at every stage
            assert completed != answers[0]
            assert not any(completed in ids for ids in aborts), (completed, aborts)
    if how == "socket closed":
        return  # the server saw the socket close: every stage was told to abort (above)
    first, second = events.done()
    assert first["status"] == "cancelled"
    assert second["status"] == "completed"
    cut = events.index(
        "input_audio_buffer.speech_started" if how == "barge-in" else "response.done",
        events.index("response.output_audio.delta"),
    )
    late = [
        e
        for _, e in events.all[cut:]
        if e.get("response_id") == first["id"] and e["type"].endswith(".delta")
    ]
    assert not late
    if how == "barge-in":
        heard = events.of("conversation.item.input_audio_transcription.completed")
        assert recall("What time is it?", heard[-1]["transcript"]) >= 0.5


async def test_sessions_hear_their_own_questions() -> None:
    async with voice_server() as (url, _):

        async def one(question: str) -> tuple[str, str]:
            events = Events()
            async with (
                client_of(url) as client,
                client.realtime.connect(model="voice-omni") as conn,
            ):
                await conn.session.update(session=SESSION)
                reader = asyncio.create_task(
                    events.read(conn, lambda e: e["type"] == "response.done")
                )
                await paced(conn, silence(0.2) + spoken(question, RATE) + silence(1.0))
                await asyncio.wait_for(reader, 60)
            (heard,) = events.of("conversation.item.input_audio_transcription.completed")
            text = "".join(e["delta"] for e in events.of("response.output_audio_transcript.delta"))
            return heard["transcript"], text

        async def all_three() -> list[tuple[str, str]]:
            return list(await asyncio.gather(*(one(q) for q in QUESTIONS)))

        results = await in_asyncio(all_three)
    for question, (transcript, text) in zip(QUESTIONS, results, strict=True):
        assert recall(question, transcript) >= 0.6, (question, transcript)
        answer_after_quote(text, transcript)


async def test_chat_completions_hear_input_audio_through_the_openai_client() -> None:
    wav = spoken(QUESTION, RATE)
    async with voice_server() as (url, _):

        async def ask() -> Any:
            from omni_trio._audio import wav_bytes

            async with client_of(url) as client:
                return await client.chat.completions.create(
                    model="voice-omni",
                    modalities=["text"],
                    messages=[
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "input_audio",
                                    "input_audio": {
                                        "data": base64.b64encode(wav_bytes(wav, RATE)).decode(),
                                        "format": "wav",
                                    },
                                }
                            ],
                        }
                    ],
                )

        completion = await in_asyncio(ask)
    text = completion.choices[0].message.content
    heard = text.removeprefix("You said: ")
    assert heard != text
    assert recall(QUESTION, heard[: len(heard) - len(text.split(".", 1)[-1])]) >= 0.6, text


async def test_omni_trio_serve_voice_answers_a_realtime_session(tmp_path: Path) -> None:
    """``omni-trio serve voice`` as a user starts it (tests/test_serve_cli.py's
    ``serving``): a session is created, a typed turn is answered in words and audio,
    and ``--realtime-max-buffer-seconds`` bounds the input audio buffer (only a
    pipeline that listens takes audio); SIGTERM then stops it cleanly."""
    chain = "listen -> thinker -> talker -> code2wav"
    flags = ["--realtime-max-buffer-seconds", "1"]
    question = "What time is it?"

    def session(url: str) -> list[dict[str, Any]]:
        with connect(url, max_size=None) as ws:
            events = [ws_event(ws)]
            manual = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
            ws_send(ws, "session.update", session=manual)
            content = [{"type": "input_text", "text": question}]
            item = {"type": "message", "role": "user", "content": content}
            ws_send(ws, "conversation.item.create", item=item)
            ws_send(ws, "response.create")
            while events[-1]["type"] != "response.done":
                events.append(ws_event(ws, timeout=60))
            audio = base64.b64encode(silence(0.6)).decode()
            ws_send(ws, "input_audio_buffer.append", audio=audio, event_id="fits")
            ws_send(ws, "input_audio_buffer.append", audio=audio, event_id="full")
            events.append(ws_event(ws, "error"))
        return events

    async with serving(tmp_path, "voice", *flags, chain=chain) as server:
        assert server.model == "voice-omni"
        events = await trio.to_thread.run_sync(session, realtime_url(server))
        server.signal(signal.SIGTERM)
        assert await server.exit_status() == 0, server.text()
    assert server.err.decode() == ""
    kinds = [e["type"] for e in events]
    assert kinds[0] == "session.created"
    done = next(e["response"] for e in events if e["type"] == "response.done")
    assert done["status"] == "completed", done
    text = "".join(
        e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"
    )
    assert answer_after_quote(text, question)
    assert "response.output_audio.delta" in kinds
    full = events[-1]["error"]
    assert (full["code"], full["event_id"]) == ("input_audio_buffer_full", "full")
    assert "1 s" in full["message"]
    assert "--realtime-max-buffer-seconds" in full["message"]


async def test_omni_trio_talk_speaks_a_wav_to_the_voice_pipeline_and_hears_its_answer(
    tmp_path: Path,
) -> None:
    """``omni-trio talk --wav`` as a user runs it, against the real voice pipeline:
    an eSpeak NG question at 22,050 Hz (talk resamples it and adds the silence that
    ends the turn, for the server's Silero detector), heard by Whisper, answered in
    speech; the answer saved."""
    from omni_trio._audio import wav_bytes

    question = tmp_path / "question.wav"
    question.write_bytes(wav_bytes(spoken(QUESTION, 22_050), 22_050))
    answer = tmp_path / "answer.wav"
    async with voice_server() as (url, _):
        command = [sys.executable, "-m", "omni_trio", "talk", url, "--wav", str(question)]
        done = await trio.run_process(
            [*command, "--save", str(answer)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    you, assistant, saved = out.splitlines()
    assert recall(QUESTION, you.split(": ", 1)[1]) >= 0.6, you
    assert assistant.startswith("assistant (first audio ")
    assert "You said" in assistant, assistant  # the simulated thinker quotes what it heard
    assert saved.startswith(f"saved {answer} (")
    assert answer.stat().st_size > 44
