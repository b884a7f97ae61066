"""``POST /v1/audio/transcriptions``: the shipped ``voice`` pipeline served, driven by
the official ``openai`` client, on speech made by eSpeak NG; a transcription request
enters at the listening stage and ends there.

Needs the voice extra (Whisper): ``nox -s voice``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import trio

from voice_helpers import need_voice, recall, spoken

need_voice()

import httpx  # noqa: E402
import openai  # noqa: E402

from omni_trio._audio import wav_bytes  # noqa: E402
from omni_trio.config import shipped_pipeline  # noqa: E402
from serve_helpers import served  # noqa: E402

QUESTION = "Which planet is the largest in our solar system?"
MODEL = "voice-omni"


def voice_server(name: str = "voice", **options: Any) -> Any:
    """A shipped pipeline served on a free port: its URL, and the running pipeline
    (``options``: ``create_app``'s)."""
    return served(shipped_pipeline(name), **options)


def wav_of(text: str) -> bytes:
    return wav_bytes(spoken(text, 22_050), 22_050)


async def transcribe(url: str, audio: bytes, **fields: Any) -> Any:
    def call() -> Any:
        with openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0) as client:
            return client.audio.transcriptions.create(
                model=MODEL, file=("question.wav", audio), **fields
            )

    return await trio.to_thread.run_sync(call)


async def test_each_response_format_holds_what_was_said():
    audio = wav_of(QUESTION)
    async with voice_server() as (url, pipeline):
        found = {
            format: await transcribe(url, audio, response_format=format)
            for format in ("json", "text", "verbose_json", "srt", "vtt")
        }
        thinker = pipeline.stages[1].statistics()
    assert recall(QUESTION, found["json"].text) >= 0.6, found["json"]
    assert found["text"].strip() == found["json"].text
    verbose = found["verbose_json"]
    assert verbose.text == found["json"].text
    assert verbose.language == "en"
    assert verbose.duration == pytest.approx(len(spoken(QUESTION, 16_000)) / 32_000, abs=0.1)
    (segment,) = verbose.segments
    assert 0 <= segment.start < segment.end <= verbose.duration + 0.5
    assert found["srt"].startswith("1\n00:00:00,000 --> 00:00:0")
    assert found["vtt"].startswith("WEBVTT\n\n00:00:00.000 --> 00:00:0")
    assert verbose.text.strip() in found["srt"]
    assert thinker.submitted == 0  # the route ended at listen


async def test_streaming_sends_deltas_then_done():
    audio = wav_of(QUESTION)
    async with voice_server() as (url, _):

        def call() -> list[Any]:
            with openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0) as client:
                stream = client.audio.transcriptions.create(
                    model=MODEL, file=("q.wav", audio), stream=True
                )
                return list(stream)

        events = await trio.to_thread.run_sync(call)
    *deltas, done = events
    assert deltas
    assert {e.type for e in deltas} == {"transcript.text.delta"}
    assert done.type == "transcript.text.done"
    assert "".join(e.delta for e in deltas).strip() == done.text
    assert recall(QUESTION, done.text) >= 0.6


async def test_speech_from_the_speech_endpoint_transcribes_back():
    """Round trip on one deployment: /v1/audio/speech's mp3, then its words heard."""
    async with voice_server() as (url, _):

        def say() -> bytes:
            with openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0) as client:
                return client.audio.speech.create(
                    model=MODEL, voice="alloy", input=QUESTION, response_format="mp3"
                ).content

        mp3 = await trio.to_thread.run_sync(say)
        heard = await transcribe(url, mp3)
    assert recall(QUESTION, heard.text) >= 0.6, heard.text


async def test_bad_uploads_are_clear_errors_and_the_server_goes_on():
    async with voice_server(max_audio_seconds=2.0) as (url, _):
        async with httpx.AsyncClient(base_url=url) as http:
            cases = [
                ({"files": {"file": ("x.wav", b"not audio at all")}}, 400, "file"),
                ({"files": {"file": ("q.wav", wav_of(QUESTION))}}, 400, "file"),  # > 2 s
                ({"json": {"model": MODEL, "file": "q.wav"}}, 400, "file"),  # not multipart
                ({"files": {"other": ("q.wav", b"x")}}, 400, "file"),
            ]
            for options, status, param in cases:
                data = {"model": MODEL} if "files" in options else None
                response = await http.post("/v1/audio/transcriptions", data=data, **options)
                assert response.status_code == status, (options.keys(), response.text)
                assert response.json()["error"]["param"] == param, response.text
            bad = {"model": MODEL, "response_format": "docx"}
            files = {"file": ("q.wav", wav_of("Hi."))}
            response = await http.post("/v1/audio/transcriptions", data=bad, files=files)
            assert response.status_code == 400
            assert "unknown response_format 'docx'" in response.json()["error"]["message"]
            body = {"model": MODEL, "temperature": "hot"}
            response = await http.post("/v1/audio/transcriptions", data=body, files=files)
            assert response.json()["error"]["param"] == "temperature"
            body = {"model": MODEL, "priority": "soon"}
            response = await http.post("/v1/audio/transcriptions", data=body, files=files)
            assert response.json()["error"]["param"] == "priority"
            assert "an integer from -1000 to 1000" in response.json()["error"]["message"]
        assert (await transcribe(url, wav_of("Hello there."))).text


async def test_a_body_over_max_request_bytes_gets_413():
    async with (
        voice_server(max_request_bytes=10_000) as (url, _),
        httpx.AsyncClient(base_url=url) as http,
    ):
        files = {"file": ("q.wav", wav_of(QUESTION))}
        response = await http.post("/v1/audio/transcriptions", data={"model": MODEL}, files=files)
    assert response.status_code == 413


async def test_a_client_that_hangs_up_aborts_the_transcription():
    long = wav_of(" ".join([QUESTION] * 12))  # about 40 s of speech: seconds of Whisper
    async with voice_server(max_request_bytes=4 << 20) as (url, pipeline):
        orchestrator = pipeline.orchestrator
        upload = httpx.Request(
            "POST", f"{url}/v1/audio/transcriptions", data={"model": MODEL}, files={"file": long}
        )
        body = upload.read()  # whole: the hang-up cuts the wait for the answer
        async with httpx.AsyncClient() as http, trio.open_nursery() as nursery:
            nursery.start_soon(partial(http.post, upload.url, content=body, headers=upload.headers))
            with trio.fail_after(20):
                while not orchestrator.statistics().admitted:  # noqa: ASYNC110 - the server's
                    await trio.sleep(0.02)
            await trio.sleep(0.2)  # Whisper is at work
            nursery.cancel_scope.cancel()  # the client hangs up
        with trio.fail_after(20):
            while orchestrator.statistics().in_flight:  # noqa: ASYNC110 - the server's doing
                await trio.sleep(0.02)
        stats = orchestrator.statistics()
        assert (stats.admitted, stats.aborted, stats.completed) == (1, 1, 0)
        assert pipeline.stages[0].statistics().submitted == 1


async def test_a_model_that_cannot_listen_answers_404_naming_the_endpoint():
    async with (
        voice_server("speech") as (url, _),
        httpx.AsyncClient(base_url=url) as http,
    ):
        files = {"file": ("q.wav", wav_of("Hi."))}
        data = {"model": "espeak-omni"}
        response = await http.post("/v1/audio/transcriptions", data=data, files=files)
    assert response.status_code == 404
    assert "does not serve /v1/audio/transcriptions" in response.json()["error"]["message"]


def test_srt_and_vtt_times():
    from omni_trio.serve._transcription import subtitles

    segments = [
        {"start": 0.0, "end": 1.5, "text": " Hi."},
        {"start": 3661.25, "end": 3662.0, "text": "Yo"},
    ]
    assert subtitles(segments, "srt") == (
        "1\n00:00:00,000 --> 00:00:01,500\nHi.\n\n2\n01:01:01,250 --> 01:01:02,000\nYo\n\n"
    )
    assert subtitles(segments, "vtt").startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHi.\n\n")
