"""``POST /v1/audio/speech``: the shipped ``speech`` pipeline served, driven by the
official ``openai`` client; a speech request enters at the talker, so the thinker
never sees it.

Needs the speech extra (eSpeak NG) and PyAV (the serve extra's).
"""

from __future__ import annotations

import base64
import io
import json
from functools import partial
from typing import Any

import httpx
import msgspec
import pytest
import trio

from omni_trio import open_pipeline
from omni_trio.config import shipped_pipeline
from omni_trio.speech import VOICES, speech_available
from omni_trio.speech import say as say_input

pytestmark = pytest.mark.skipif(not speech_available(), reason="the speech extra is not installed")
av = pytest.importorskip("av")
openai = pytest.importorskip("openai")

from omni_trio.serve import ServedModel, create_app, serve  # noqa: E402
from omni_trio.serve._audio_out import OUT_RATE, AudioEncoder  # noqa: E402
from serve_helpers import served  # noqa: E402

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."
FORMATS = ["wav", "pcm", "mp3", "opus", "aac", "flac"]


def speech_server(name: str = "speech") -> Any:
    """A shipped pipeline served on a free port: its URL, and the running pipeline."""
    return served(shipped_pipeline(name))


def client_of(url: str) -> Any:
    """The official client (a context manager: it closes its connections)."""
    return openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0)


def decoded_seconds(data: bytes, format: str) -> float:
    """How long the audio lasts, decoded by FFmpeg (``pcm``: counted)."""
    if format == "pcm":
        return len(data) / 2 / OUT_RATE
    with av.open(io.BytesIO(data), format={"opus": "ogg", "aac": "aac"}.get(format)) as file:
        (stream,) = file.streams.audio
        assert stream.codec_context.sample_rate in (OUT_RATE, 48_000)  # Opus decodes at 48
        return sum(frame.samples / frame.sample_rate for frame in file.decode(stream))


async def speak(url: str, model: str = "espeak-omni", **fields: Any) -> bytes:
    def call() -> bytes:
        with client_of(url) as client:
            response = client.audio.speech.create(model=model, **fields)
            return bytes(response.content)

    return await trio.to_thread.run_sync(call)


# -- the encoder (no server) ---------------------------------------------------------


@pytest.mark.parametrize("format", FORMATS)
def test_each_format_decodes_to_the_audio_it_was_given(format):
    """A second of a 22,050 Hz stream, fed in uneven pieces, decodes to a second
    at 24 kHz (the codecs' padding aside)."""
    pcm = b"\x10\x00\xf0\xff" * 11_025
    encoder = AudioEncoder(format, 22_050)
    data = b"".join(encoder.feed(pcm[i : i + 3001]) for i in range(0, len(pcm), 3001))
    data += encoder.finish()
    assert encoder.media_type.startswith("audio/")
    assert decoded_seconds(data, format) == pytest.approx(1.0, abs=0.09)  # AAC: +67 ms


def test_a_streamed_wav_says_its_length_is_unknown():
    encoder = AudioEncoder("wav", 24_000)
    head = encoder.feed(b"\x00\x00" * 10)
    assert head[:4] == b"RIFF"
    assert head[8:16] == b"WAVEfmt "
    assert head[4:8] == head[40:44] == b"\xff\xff\xff\xff"
    assert int.from_bytes(head[24:28], "little") == OUT_RATE
    assert head[44:] == b"\x00\x00" * 10


def test_an_unknown_format_is_named():
    with pytest.raises(ValueError, match="unknown audio format 'ogg': the formats are mp3, opus"):
        AudioEncoder("ogg", 24_000)


def test_say_checks_its_speed_and_maps_openais_voices():
    assert say_input("hi", voice="nova", speed=2) == {
        "text": "hi",
        "speech": {"speed": 2.0, "voice": VOICES["nova"]},
    }
    assert say_input("hi", voice="en-gb")["speech"]["voice"] == "en-gb"
    for speed in (0.2, 4.5, float("nan"), True):
        with pytest.raises(ValueError, match=r"speed must be a number from 0\.25 to 4\.0"):
            say_input("hi", speed=speed)


# -- the endpoint ----------------------------------------------------------------------


async def test_each_format_lasts_what_its_text_takes_to_say():
    async with speech_server() as (url, _):
        lengths = {}
        for format in FORMATS:
            data = await speak(url, voice="alloy", input=SENTENCE, response_format=format)
            lengths[format] = decoded_seconds(data, format)
        # eSpeak NG says the sentence's 13 words at 175 words a minute, with its pauses
        assert 3.0 < lengths["pcm"] < 6.5, lengths
        for format, seconds in lengths.items():
            assert seconds == pytest.approx(lengths["pcm"], abs=0.1), (format, lengths)


async def test_speed_and_voice_change_the_speech():
    async with speech_server() as (url, _):
        normal = await speak(url, voice="alloy", input=SENTENCE, response_format="pcm")
        fast = await speak(url, voice="alloy", input=SENTENCE, response_format="pcm", speed=2.0)
        other = await speak(url, voice="onyx", input=SENTENCE, response_format="pcm")
    assert len(fast) < 0.65 * len(normal)
    assert other != normal


async def test_the_audio_streams_as_it_is_spoken_and_the_thinker_never_sees_it():
    text = " ".join([SENTENCE] * 4)
    async with speech_server() as (url, pipeline):

        def call() -> list[bytes]:
            with (
                client_of(url) as client,
                client.audio.speech.with_streaming_response.create(
                    model="espeak-omni", voice="nova", input=text, response_format="pcm"
                ) as response,
            ):
                assert response.headers["content-type"] == "audio/pcm"
                return list(response.iter_bytes(4800))

        pieces = await trio.to_thread.run_sync(call)
        thinker = pipeline.stages[0].statistics()
    assert len(pieces) > 10
    assert thinker.submitted == 0  # the route entered at the talker


async def test_sse_sends_deltas_then_done_with_the_usage():
    async with speech_server() as (url, _), httpx.AsyncClient(base_url=url) as http:
        body = {"model": "espeak-omni", "input": SENTENCE, "voice": "echo"}
        body |= {"response_format": "pcm", "stream_format": "sse"}
        response = await http.post("/v1/audio/speech", json=body, timeout=60)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line]
    *deltas, done = events
    assert {e["type"] for e in deltas} == {"speech.audio.delta"}
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert 3.0 < len(audio) / 2 / OUT_RATE < 6.5
    assert done["type"] == "speech.audio.done"
    assert done["usage"]["input_tokens"] == len(SENTENCE.split())
    assert done["usage"]["total_tokens"] == sum(
        done["usage"][k] for k in ("input_tokens", "output_tokens")
    )


BAD = [
    ({"voice": "nobody"}, "voice", "unknown voice 'nobody': the voices are alloy, ash"),
    ({"input": ""}, "input", "input must not be empty"),
    ({"input": "x" * 4097}, "input", "input is 4097 characters long: at most 4096"),
    ({"speed": 5}, "speed", "Expected `float` <= 4.0"),
    ({"speed": 0.1}, "speed", "Expected `float` >= 0.25"),
    ({"response_format": "ogg"}, "response_format", "unknown response_format 'ogg': it is one"),
    ({"stream_format": "chunks"}, "stream_format", "unknown stream_format 'chunks'"),
    ({"model": "tts-1"}, "model", "the model 'tts-1' does not exist"),
    ({"extra_body": {"priority": 5000}}, "priority", "Expected `int` <= 1000"),
]


async def test_bad_input_is_a_clear_error_naming_the_field_and_the_server_goes_on():
    async with speech_server() as (url, _):
        for fields, param, message in BAD:
            call = {"voice": "alloy", "input": "Hello there.", **fields}

            def request(call: dict[str, Any] = call) -> Any:
                with client_of(url) as client:
                    model = call.pop("model", "espeak-omni")
                    with pytest.raises(openai.APIStatusError) as caught:
                        client.audio.speech.create(model=model, **call)
                    return caught.value

            error = await trio.to_thread.run_sync(request)
            assert error.status_code == (404 if param == "model" else 400), fields
            assert error.body["param"] == param
            assert message in error.body["message"], (fields, error.body)
        assert await speak(url, voice="alloy", input="Still here.", response_format="pcm")


def test_the_speech_route_enters_at_the_stage_that_reads_the_text():
    config = msgspec.structs.replace(
        shipped_pipeline("speech"),
        stages=shipped_pipeline("speech").stages[:1],
    )
    model = ServedModel.from_config(config)
    assert model.speech is None
    assert ServedModel.from_config(shipped_pipeline("assistant")).speech.entry == 2
    assert ServedModel.from_config(shipped_pipeline("speech")).speech.entry == 1


async def test_a_client_that_hangs_up_aborts_the_request_at_each_stage_of_its_route():
    text = " ".join([SENTENCE] * 30)  # about two minutes of speech
    async with speech_server() as (url, pipeline):
        orchestrator = pipeline.orchestrator

        def hang_up() -> int:
            with (
                client_of(url) as client,
                client.audio.speech.with_streaming_response.create(
                    model="espeak-omni", voice="alloy", input=text, response_format="pcm"
                ) as response,
            ):
                return len(next(response.iter_bytes(4800)))

        assert await trio.to_thread.run_sync(hang_up) == 4800
        with trio.fail_after(10):
            while orchestrator.statistics().in_flight:  # noqa: ASYNC110 - the server's doing
                await trio.sleep(0.02)
        stats = orchestrator.statistics()
        assert (stats.admitted, stats.aborted, stats.completed) == (1, 1, 0)
        talker, code2wav = (stage.statistics() for stage in pipeline.stages[1:])
        assert talker.submitted == code2wav.submitted == 1
        with trio.fail_after(10):  # each stage's worker let go of it
            while talker.worker_requests or code2wav.worker_requests:
                await trio.sleep(0.02)
                talker, code2wav = (stage.statistics() for stage in pipeline.stages[1:])


async def test_a_model_without_a_talker_answers_404_naming_the_endpoint():
    async with speech_server("demo") as (url, _):  # a talker of codec codes: it speaks too
        spoken = await speak(url, "simulated-qwen-omni", voice="alloy", input="Hi there.")
        assert decoded_seconds(spoken, "mp3") > 0.1
    config = shipped_pipeline("speech")
    thinker_only = msgspec.structs.replace(config, stages=config.stages[:1])
    async with trio.open_nursery() as nursery:
        app = create_app(ServedModel.from_config(thinker_only), lambda: open_pipeline(thinker_only))
        url = await nursery.start(partial(serve, app, port=0))
        async with httpx.AsyncClient(base_url=url) as http:
            body = {"model": "espeak-omni", "input": "Hi.", "voice": "alloy"}
            response = await http.post("/v1/audio/speech", json=body)
        nursery.cancel_scope.cancel()
    assert response.status_code == 404
    assert "does not serve /v1/audio/speech" in response.json()["error"]["message"]


async def test_speech_and_chat_run_side_by_side_each_on_its_route():
    async with speech_server() as (url, pipeline):

        def chat() -> str:
            with client_of(url) as client:
                answer = client.chat.completions.create(
                    model="espeak-omni",
                    modalities=["text"],
                    messages=[{"role": "user", "content": "Hello"}],
                )
                return str(answer.choices[0].message.content)

        results: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:

            async def run(name: str, fn: Any) -> None:
                results[name] = await fn()

            nursery.start_soon(run, "chat", partial(trio.to_thread.run_sync, chat))
            for index in range(3):
                nursery.start_soon(
                    run, f"speech{index}", partial(speak, url, voice="alloy", input=SENTENCE)
                )
        thinker = pipeline.stages[0].statistics()
    assert results["chat"]
    assert all(len(results[f"speech{i}"]) > 1000 for i in range(3))
    assert thinker.submitted == 1  # the chat's


# -- chat completions' audio: the same voices, OpenAI's 24 kHz ---------------------------


async def chat_audio(url: str, **audio: Any) -> tuple[bytes, str]:
    def call() -> tuple[bytes, str]:
        with client_of(url) as client:
            answer = client.chat.completions.create(
                model="espeak-omni",
                modalities=["text", "audio"],
                audio=audio,
                messages=[{"role": "user", "content": "Tell me a story"}],
            )
            message = answer.choices[0].message
            return base64.b64decode(message.audio.data), str(message.content)

    return await trio.to_thread.run_sync(call)


async def test_chat_audio_is_openais_24_khz_in_the_voice_asked_for():
    async with speech_server() as (url, _):
        nova, text = await chat_audio(url, format="pcm16", voice="nova")
        onyx, _ = await chat_audio(url, format="pcm16", voice="onyx")
        mp3, _ = await chat_audio(url, format="mp3", voice="nova")
        wav, _ = await chat_audio(url, format="wav", voice="nova")
    seconds = len(nova) / 2 / OUT_RATE
    # the text's words at 175 a minute, give or take eSpeak NG's pauses
    assert 0.6 * len(text.split()) / 175 * 60 < seconds < 1.6 * len(text.split()) / 175 * 60
    assert onyx != nova
    assert decoded_seconds(mp3, "mp3") == pytest.approx(seconds, abs=0.1)
    with av.open(io.BytesIO(wav)) as file:  # a WAV says its own rate: the stage's
        assert file.streams.audio[0].codec_context.sample_rate == 22_050


async def test_chat_audio_errors_name_the_field():
    async with speech_server() as (url, _):
        for audio, param, message in [
            ({"format": "pcm16", "voice": "nobody"}, "audio.voice", "unknown voice 'nobody'"),
            ({"format": "mp3", "voice": "nova"}, "audio.format", "'mp3' is not streamed"),
        ]:

            def call(audio: dict[str, Any] = audio) -> Any:
                with client_of(url) as client, pytest.raises(openai.BadRequestError) as caught:
                    client.chat.completions.create(
                        model="espeak-omni",
                        modalities=["text", "audio"],
                        audio=audio,
                        stream=True,
                        messages=[{"role": "user", "content": "Hi"}],
                    )
                return caught.value.body

            body = await trio.to_thread.run_sync(call)
            assert body["param"] == param
            assert message in body["message"]
