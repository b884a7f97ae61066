"""Audio in that holds no audio is a 400 naming its field, never a 200: an empty
``pcm16`` (or a WAV of no frames) in a chat completion's ``input_audio``, and an
empty file sent to ``/v1/audio/transcriptions``."""

from __future__ import annotations

import base64
import io
import wave

import httpx
import pytest

from omni_trio.serve._protocol import InputAudio, InputAudioPart, OpenAIError
from realtime_helpers import MODEL, quiet, realtime_server

PART = "messages[0].content[{index}].input_audio"


def wav_of(pcm: bytes, rate: int = 16_000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm)
    return out.getvalue()


def part(data: bytes, fmt: str) -> dict[str, object]:
    encoded = base64.b64encode(data).decode()
    return {"type": "input_audio", "input_audio": {"data": encoded, "format": fmt}}


@pytest.mark.parametrize(
    ("data", "fmt", "said"),
    [
        (b"", "pcm16", "empty, no audio samples"),
        (wav_of(b""), "wav", "the WAV holds no audio samples"),
    ],
    ids=["pcm16", "wav"],
)
def test_an_empty_input_audio_part_is_a_400_naming_its_data(data, fmt, said):
    with pytest.raises(OpenAIError) as caught:
        InputAudioPart(InputAudio(base64.b64encode(data).decode(), fmt)).pcm("where")
    assert caught.value.status == 400
    assert caught.value.param == "where.data"
    assert caught.value.message == f"where.data: {said}"


@pytest.mark.parametrize(
    ("content", "index"),
    [
        ([part(b"", "pcm16")], 0),
        ([{"type": "text", "text": "and this?"}, part(b"", "pcm16")], 1),
        ([part(wav_of(b""), "wav")], 0),
        ([part(quiet(100), "pcm16"), part(b"", "pcm16")], 1),  # the empty one is named
    ],
    ids=["pcm16", "pcm16-after-text", "wav", "pcm16-after-audio"],
)
async def test_a_chat_completion_with_empty_input_audio_is_a_400(content, index):
    body = {
        "model": MODEL,
        "modalities": ["text"],
        "messages": [{"role": "user", "content": content}],
    }
    async with realtime_server() as server, httpx.AsyncClient() as http:
        reply = await http.post(f"{server.url}/v1/chat/completions", json=body)
        assert not server.script.prompts  # nothing reached the pipeline
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == PART.format(index=index) + ".data"
    assert error["message"].startswith(PART.format(index=index) + ".data: ")
    assert "no audio samples" in error["message"]


@pytest.mark.parametrize("data", [b"", wav_of(b"")], ids=["no-bytes", "wav-of-no-frames"])
def test_an_empty_file_to_transcribe_is_refused(data):
    """``/v1/audio/transcriptions`` decodes its file with ``decode_audio``, whose
    refusal the endpoint answers with a 400 naming ``file``."""
    pytest.importorskip("av")
    from omni_trio.serve._audio_in import NotAudioError, decode_audio

    with pytest.raises(NotAudioError):
        decode_audio(data, max_seconds=10)
