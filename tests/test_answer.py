"""The sans-IO half of a chat completion: outputs in, OpenAI's shapes out (no loop)."""

from __future__ import annotations

import base64
import io
import wave

import msgspec
import pytest

from omni_trio import OrchOutput, RequestMetrics
from omni_trio._audio import wav_bytes
from omni_trio.serve import FinalOutput
from omni_trio.serve._answer import DONE, Answer, Plan, error_event
from omni_trio.serve._protocol import (
    AudioDelta,
    ChatCompletionChunk,
    ChunkChoice,
    Delta,
    OpenAIError,
    encode,
)

TEXT, AUDIO = FinalOutput(0, "text", "thinker"), FinalOutput(2, "audio", "code2wav", 24_000)


def plan(*, stream=True, usage=False, audio_format="pcm16", limit=None, outputs=(TEXT, AUDIO)):
    return Plan("tell me", outputs, stream, usage, audio_format, limit)


def out(stage, data, finished=False, reason=None):
    return OrchOutput("r", stage, data, finished, reason if finished else None)


def events(raw: bytes) -> list[object]:
    """The SSE events of ``raw``: decoded JSON, or the string ``[DONE]``."""
    found = []
    for block in raw.decode().split("\n\n"):
        if block:
            assert block.startswith("data: ")
            body = block[6:]
            found.append(body if body == "[DONE]" else msgspec.json.decode(body))
    return found


def test_a_streamed_answer_is_one_chunk_per_output_then_finish_usage_done():
    counted = []
    answer = Answer(plan(usage=True), "m", counted.append)
    raw = answer.take([out(0, "Hel"), out(2, b"\x01\x00"), out(0, "lo")])
    raw += answer.take([out(2, None, True, "completed")])
    assert answer.finish == "stop"
    raw += answer.closing()
    chunks = events(raw)
    assert chunks[-1] == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in chunks[:3]]
    assert deltas[0] == {"role": "assistant", "content": "Hel"}
    assert base64.b64decode(deltas[1]["audio"]["data"]) == b"\x01\x00"
    assert deltas[2] == {"content": "lo"}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, None, None, "stop"]
    assert chunks[4]["choices"] == []
    assert chunks[4]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert {c["id"] for c in chunks[:5]} == {chunks[0]["id"]}
    assert counted == [0, 2, 0]  # the bare completion is no content


@pytest.mark.parametrize("audio_format", ["pcm16", "wav"])
def test_streamed_events_are_the_bytes_their_chunk_structs_encode_to(audio_format):
    """The events come from per-answer templates; byte for byte, they are what
    encoding each chunk struct gives (escapes, non-ASCII, the role on the first)."""
    texts = ['a "quoted" \\ \n\t\x01\x1f \u2028 caf\u00e9 \U0001f600', "", " plain", 42]
    audios = [b"\x01\x00", bytearray(b"\xff\x7f" * 5), memoryview(b"\x00\x80" * 7), b""]
    batch = []
    for text, audio in zip(texts, audios, strict=True):
        batch += [out(0, text), out(2, audio)]
    answer = Answer(plan(audio_format=audio_format), "m\u00f6del")
    raw = answer.take(batch[:3]) + answer.take(batch[3:])
    head = events(raw)[0]
    expected = b""
    for index, output in enumerate(batch):
        role = None if index else "assistant"
        if output.stage_id == 0:
            delta = Delta(role=role, content=str(output.data))
        else:
            pcm = bytes(output.data)
            if audio_format == "wav":
                pcm = wav_bytes(pcm, AUDIO.sample_rate)
            audio = AudioDelta("audio-" + head["id"][9:], base64.b64encode(pcm).decode())
            delta = Delta(role=role, audio=audio)
        chunk = ChatCompletionChunk(
            id=head["id"],
            created=head["created"],
            model="m\u00f6del",
            choices=[ChunkChoice(0, delta)],
        )
        expected += b"data: " + encode(chunk) + b"\n\n"
    assert raw == expected


def test_a_wav_chunk_is_a_whole_wav_file_at_the_stage_rate():
    answer = Answer(plan(audio_format="wav"), "m")
    [chunk] = events(answer.take([out(2, b"\x01\x00\x02\x00")]))
    data = base64.b64decode(chunk["choices"][0]["delta"]["audio"]["data"])
    with wave.open(io.BytesIO(data)) as wav:
        assert (wav.getframerate(), wav.getnframes()) == (24_000, 2)
        assert wav.readframes(2) == b"\x01\x00\x02\x00"


def test_max_tokens_stops_the_answer_mid_batch_with_length():
    answer = Answer(plan(limit=2), "m")
    chunks = events(answer.take([out(0, "a"), out(0, "b"), out(0, "c")]))
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["a", "b"]
    assert answer.finish == "length"
    assert events(answer.closing())[0]["choices"][0]["finish_reason"] == "length"


def test_a_thinker_that_keeps_to_max_tokens_is_not_cut_and_says_why_it_stopped():
    # A language model told max_tokens stops there itself: its audio comes whole,
    # the request completes, and its meta gives the finish reason and the usage.
    meta = {"finish_reason": "length", "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
    answer = Answer(plan(limit=2, usage=True), "m")
    answer.take([out(0, "a"), out(0, "b"), OrchOutput("r", 0, None, False, meta=meta)])
    assert answer.finish is None  # not cut: the rest of the answer's audio comes
    answer.take([out(2, b"\x01\x00"), out(2, b"\x02\x00", True, "completed")])
    assert answer.finish == "length"  # the model's word
    finish, usage, done = events(answer.closing())
    assert (finish["choices"][0]["finish_reason"], done) == ("length", "[DONE]")
    assert usage["usage"] == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}


def test_a_model_that_stopped_by_itself_finishes_with_stop_and_its_usage():
    meta = {"finish_reason": "stop", "usage": {"prompt_tokens": 30, "completion_tokens": 7}}
    answer = Answer(plan(stream=False, outputs=(TEXT,)), "m")
    answer.take([out(0, "cold"), OrchOutput("r", 0, ".", True, "completed", meta=meta)])
    whole = answer.whole(None)
    assert (whole.choices[0].finish_reason, whole.choices[0].message.content) == ("stop", "cold.")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (30, 7)


def test_a_terminal_that_is_not_completed_leaves_the_answer_unfinished():
    answer = Answer(plan(), "m")
    answer.take([out(0, "a"), out(0, None, True, "error")])
    assert answer.finish is None


def test_a_whole_answer_has_all_text_and_one_wav_of_all_audio():
    answer = Answer(plan(stream=False, audio_format="wav"), "m")
    assert answer.take([out(0, "Hi "), out(2, b"\x01\x00"), out(2, b"\x02\x00")]) == b""
    answer.take([out(0, "there", True, "completed")])
    metrics = RequestMetrics(10.0, 10.5, {0: 10.1, 2: 10.2}, {0: 10.4}, 4)
    whole = msgspec.to_builtins(answer.whole(metrics))
    message = whole["choices"][0]["message"]
    assert message["content"] == "Hi there"
    assert whole["choices"][0]["finish_reason"] == "stop"
    with wave.open(io.BytesIO(base64.b64decode(message["audio"]["data"]))) as wav:
        assert wav.readframes(10) == b"\x01\x00\x02\x00"
    assert message["audio"]["transcript"] == "Hi there"
    assert whole["metrics"] == pytest.approx(
        {"time_to_first_token": 0.1, "time_to_first_audio": 0.2, "e2e_latency": 0.5}
    )


def test_text_alone_has_no_audio_and_audio_alone_no_content():
    text = Answer(plan(stream=False, outputs=(TEXT,)), "m")
    text.take([out(0, "x", True, "completed")])
    assert text.whole(None).choices[0].message.audio is None
    audio = Answer(plan(stream=False, outputs=(AUDIO,)), "m")
    audio.take([out(2, b"\x00\x00", True, "completed")])
    assert audio.whole(None).choices[0].message.content is None


def test_a_whole_answer_keeps_at_most_max_whole_bytes():
    """Text counts its length, audio its bytes; the output that would pass the bound
    is refused (400, naming max_unread_bytes) and not kept."""
    answer = Answer(plan(stream=False), "m", max_whole_bytes=10)
    answer.take([out(0, "abcd"), out(2, b"\x01\x00" * 3)])  # 4 + 6: the bound exactly
    with pytest.raises(OpenAIError) as caught:
        answer.take([out(0, "e")])
    error = caught.value
    assert (error.status, error.type, error.param, error.code) == (
        400,
        "invalid_request_error",
        "stream",
        "answer_too_large",
    )
    assert error.message == (
        "the answer exceeds max_unread_bytes (10 bytes), what a whole answer may hold: "
        "stream it (stream=true), or raise [pipeline] max_unread_bytes"
    )
    with pytest.raises(OpenAIError, match="max_unread_bytes"):
        answer.take([out(2, b"\x00\x00")])
    answer.take([out(0, None, True, "completed")])  # a finish without data adds nothing
    assert answer.whole(None).choices[0].message.content == "abcd"


def test_a_streamed_answer_keeps_nothing_so_the_bound_does_not_apply():
    answer = Answer(plan(stream=True), "m", max_whole_bytes=1)
    raw = answer.take([out(0, "abcd"), out(2, b"\x01\x00" * 8)])
    assert len(events(raw)) == 2


def test_audio_that_is_not_bytes_is_an_error_naming_the_stage():
    with pytest.raises(OpenAIError, match="code2wav sent audio that is not bytes: int") as caught:
        Answer(plan(), "m").take([out(2, 7)])
    assert caught.value.status == 500


def test_an_error_event_is_the_error_object_then_done():
    raw = error_event(OpenAIError(500, "stage 1 failed", type="server_error"))
    assert raw.endswith(DONE)
    assert events(raw)[0] == {
        "error": {"message": "stage 1 failed", "type": "server_error", "param": None, "code": None}
    }


def test_a_backlog_is_written_in_bounded_parts():
    """A response that takes a big backlog at once encodes and writes it a part of
    about WRITE_BYTES of data at a time; a small batch is one part, itself."""
    from omni_trio.serve._chat import WRITE_BYTES, _parts

    small = [OrchOutput("r", 2, b"x" * 100, False) for _ in range(3)]
    assert list(_parts(small)) == [small]
    [only] = _parts(small)
    assert only is small
    big = [OrchOutput("r", 2, b"y" * (WRITE_BYTES // 4), False) for _ in range(10)]
    parts = list(_parts(big))
    assert [len(part) for part in parts] == [4, 4, 2]
    assert [o for part in parts for o in part] == big


def test_a_pipeline_that_takes_conversations_gets_the_messages_and_the_sampling():
    from omni_trio.serve._protocol import decode_request

    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "tool", "content": "ignored"},
            {"role": "user", "content": [{"type": "text", "text": "What is the opposite of hot?"}]},
        ],
        "temperature": 0,
        "top_p": 0.5,
        "max_completion_tokens": 16,
        "seed": 3,
        "stop": "\n",
    }
    request = decode_request(msgspec.json.encode(body))
    assert Plan.of(request, (TEXT,), listens=False).prompt == "What is the opposite of hot?"
    prompt = Plan.of(request, (TEXT,), listens=False, conversation=True).prompt
    assert prompt == {
        "text": "What is the opposite of hot?",
        "context": [
            {"role": "system", "text": "Be brief."},
            {"role": "user", "text": "Hi"},
            {"role": "assistant", "text": "Hello!"},
        ],
        "sampling": {"temperature": 0, "top_p": 0.5, "max_tokens": 16, "seed": 3, "stop": ["\n"]},
    }
    from omni_trio._conversation import checked_utterance

    checked_utterance(prompt)  # what the stages check, it passes


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("temperature", 2.5, "temperature"),
        ("top_p", 0, "top_p"),
        ("seed", "x", "seed"),
        ("seed", 2**63, "seed"),
        ("stop", ["a", "b", "c", "d", "e"], "stop"),
        ("stop", [""], "stop[0]"),
    ],
)
def test_sampling_parameters_out_of_range_are_400_naming_them(field, value, param):
    from omni_trio.serve._protocol import decode_request

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(OpenAIError) as raised:
        decode_request(msgspec.json.encode(body))
    assert (raised.value.status, raised.value.param) == (400, param)
