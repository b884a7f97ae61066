"""The OpenAI-compatible server, in process: the real ``openai`` client and raw HTTP
against ``serve`` over a scripted pipeline (see ``serve_helpers``).

Real sockets and real time: no autojump clock, so every wait is on an event, bounded
by a generous ``fail_after`` that only a hang would reach.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import ClassVar

import httpx
import openai
import pytest
import trio
import trio.testing
from trio_util import AsyncValue

from omni_trio.serve import ServedModel, create_app
from omni_trio.serve._server import FULL_COLLECTION_EVERY
from omni_trio.serve._statistics import ServerStatistics
from serve_helpers import (
    AUDIO,
    AUDIO_CHUNKS,
    MANUAL,
    MODEL,
    PROMPTLY,
    SAMPLE_RATE,
    TEXT,
    TEXT_DELTAS,
    Metrics,
    audio_of,
    b64,
    chat_body,
    raw_request,
    running_server,
    sse_events,
    text_of,
    wav_frames,
)

# The openai client leaves its SSE decoder's async generators unfinished after
# ``[DONE]``; under Trio their garbage collection warns (the client's own comment:
# "support non asyncio runtimes here"). Only those warnings are let through.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2|httpcore2)\.:ResourceWarning"
)


@pytest.fixture
async def server():
    async with running_server() as server:
        yield server


def openai_client(server, **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=PROMPTLY, **kwargs
    )


def http_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=PROMPTLY)


async def scrape(server) -> Metrics:
    async with http_client() as client:
        response = await client.get(server.url + "/metrics")
    assert response.status_code == 200
    return Metrics(response.text)


def content_chunks(events):
    """The chunks that carry text or audio."""
    return [e for e in events if e != "[DONE]" and e.get("choices") and e["choices"][0]["delta"]]


def finish_chunks(events):
    return [
        (i, e)
        for i, e in enumerate(events)
        if e != "[DONE]" and e.get("choices") and e["choices"][0]["finish_reason"] is not None
    ]


def texts(events) -> list[str]:
    return [
        c["choices"][0]["delta"]["content"]
        for c in content_chunks(events)
        if "content" in c["choices"][0]["delta"]
    ]


def audios(events) -> list[dict]:
    return [
        c["choices"][0]["delta"]["audio"]
        for c in content_chunks(events)
        if "audio" in c["choices"][0]["delta"]
    ]


def assert_error_object(body, status_type=None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``, nothing else."""
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str)
    assert error["message"]
    if status_type is not None:
        assert error["type"] == status_type
    return error


# -- 1. streaming -------------------------------------------------------------------------


class TestStreaming:
    @pytest.mark.parametrize("audio_format", ["pcm16", "wav"])
    async def test_the_stream_is_exactly_what_the_stages_emitted(self, server, audio_format):
        prompt = f"say it in {audio_format}"
        body = chat_body(
            prompt,
            stream=True,
            stream_options={"include_usage": True},
            audio={"format": audio_format, "voice": "Chelsie"},
        )
        async with http_client() as client:
            response = await client.post(server.chat_url(), json=body)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.content.endswith(b"data: [DONE]\n\n")
        events = sse_events(response.content)
        chunks = events[:-1]
        assert {(c["id"], c["object"], c["model"]) for c in chunks} == {
            (chunks[0]["id"], "chat.completion.chunk", MODEL)
        }

        assert texts(events) == text_of(prompt)
        audio = audios(events)
        assert len({a["id"] for a in audio}) == 1
        if audio_format == "pcm16":
            assert [b64(a["data"]) for a in audio] == audio_of(prompt)
        else:
            for delta, pcm in zip(audio, audio_of(prompt), strict=True):
                assert wav_frames(b64(delta["data"])) == (pcm, SAMPLE_RATE)
        # the role comes once, with the first delta
        roles = [c["choices"][0]["delta"].get("role") for c in content_chunks(events)]
        assert roles == ["assistant"] + [None] * (TEXT_DELTAS + AUDIO_CHUNKS - 1)

        # one finish chunk, after every content chunk; then the usage chunk; [DONE]
        [(at, finish)] = finish_chunks(events)
        assert finish["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
        assert at == len(content_chunks(events))
        usage = events[at + 1]
        assert usage["choices"] == []
        assert usage["usage"] == {
            "prompt_tokens": len(prompt.split()),
            "completion_tokens": TEXT_DELTAS,
            "total_tokens": len(prompt.split()) + TEXT_DELTAS,
        }
        assert events[at + 2 :] == ["[DONE]"]
        assert all(c["usage"] is None for c in chunks if c is not usage)

    async def test_without_include_usage_no_usage_chunk(self, server):
        async with http_client() as client:
            response = await client.post(server.chat_url(), json=chat_body("plain", stream=True))
        events = sse_events(response.content)
        [(at, _)] = finish_chunks(events)
        assert events[at + 1 :] == ["[DONE]"]
        assert all(e["choices"] for e in events[:-1])

    async def test_openai_client_streams_text_and_audio(self, server):
        prompt = "through the client"
        async with openai_client(server) as client:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                modalities=["text", "audio"],
                audio={"format": "pcm16", "voice": "Chelsie"},
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
        text = [
            c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
        ]
        audio = [
            b64(c.choices[0].delta.audio.data)
            for c in chunks
            if c.choices and c.choices[0].delta.audio is not None
        ]
        assert text == text_of(prompt)
        assert audio == audio_of(prompt)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons == [None] * (TEXT_DELTAS + AUDIO_CHUNKS) + ["stop"]
        assert chunks[-1].choices == []
        assert chunks[-1].usage.completion_tokens == TEXT_DELTAS


#: What every chunk of the golden streams starts with (ids and ``created`` made constant).
_CHUNK = (
    '{"id":"chatcmpl-ID","object":"chat.completion.chunk","created":0,'
    '"model":"qwen-omni-scripted","choices":'
)


def _delta_event(delta: str) -> str:
    return _CHUNK + '[{"index":0,"delta":' + delta + ',"finish_reason":null}],"usage":null}'


def _sse(*events: str) -> bytes:
    return b"".join(b"data: " + event.encode() + b"\n\n" for event in events)


def _audio(data: str) -> str:
    return '{"audio":{"id":"audio-ID","data":"' + data + '"}}'


#: The first text delta: JSON's escapes (quotes, a backslash, control characters),
#: and non-ASCII as UTF-8, beyond the BMP too.
_TEXT = 'He said "hi" \\ \n\t\x01 caf\u00e9 \U0001f600'
_TEXT_JSON = r'"He said \"hi\" \\ \n\t\u0001 ' + 'caf\u00e9 \U0001f600"'
_FINISH = _CHUNK + '[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}'


class TestTheBytes:
    """A streamed answer's SSE bytes, byte for byte (its ids and ``created`` aside)."""

    GOLDEN: ClassVar[dict[str, bytes]] = {
        "pcm16": _sse(
            _delta_event('{"role":"assistant","content":' + _TEXT_JSON + "}"),
            _delta_event(_audio("AQD/fw==")),
            _delta_event('{"content":"plain "}'),
            _delta_event(
                _audio("AAUKDxQZHiMoLTI3PEFGS1BVWl9kaW5zeH2Ch4yRlpugpaqvtLm+w8jN0tfc4ebr8PX6/w==")
            ),
            _delta_event('{"content":"end."}'),
            _delta_event(_audio("AIA=")),
            _FINISH,
            _CHUNK + '[],"usage":{"prompt_tokens":2,"completion_tokens":3,"total_tokens":5}}',
            "[DONE]",
        ),
        "wav": _sse(
            _delta_event('{"role":"assistant","content":' + _TEXT_JSON + "}"),
            _delta_event(
                _audio("UklGRigAAABXQVZFZm10IBAAAAABAAEAwF0AAIC7AAACABAAZGF0YQQAAAABAP9/")
            ),
            _delta_event('{"content":"plain "}'),
            _delta_event(
                _audio(
                    "UklGRlgAAABXQVZFZm10IBAAAAABAAEAwF0AAIC7AAACABAAZGF0YTQAAAAABQoPFBkeIygt"
                    "Mjc8QUZLUFVaX2RpbnN4fYKHjJGWm6Clqq+0ub7DyM3S19zh5uvw9fr/"
                )
            ),
            _delta_event('{"content":"end."}'),
            _delta_event(
                _audio("UklGRiYAAABXQVZFZm10IBAAAAABAAEAwF0AAIC7AAACABAAZGF0YQIAAAAAgA==")
            ),
            _FINISH,
            "[DONE]",
        ),
    }

    @pytest.mark.parametrize("audio_format", ["pcm16", "wav"])
    async def test_a_scripted_stream_is_the_golden_bytes(self, server, audio_format):
        prompt = MANUAL + "golden " + audio_format

        async def emit():
            rid = await server.engine.submitted(prompt, 2)
            # each output taken before the next is emitted: one order only
            for stage, data, finished in (
                (0, _TEXT, False),
                (2, b"\x01\x00\xff\x7f", False),
                (0, "plain ", False),
                (2, bytes(range(0, 256, 5)), False),
                (0, "end.", True),
                (1, None, True),
                (2, b"\x00\x80", True),
            ):
                await trio.testing.wait_all_tasks_blocked()
                await server.stages[stage].emit(rid, data, finished=finished)

        body = chat_body(
            prompt,
            stream=True,
            stream_options={"include_usage": audio_format == "pcm16"},
            audio={"format": audio_format},
        )
        async with http_client() as client, trio.open_nursery() as nursery:
            nursery.start_soon(emit)
            response = await client.post(server.chat_url(), json=body)
        assert response.status_code == 200
        assert _normalized(response.content) == self.GOLDEN[audio_format]


def _normalized(body: bytes) -> bytes:
    """``body`` with its chunk id, audio id and ``created`` made constant."""
    events = sse_events(body)
    chunk_id = events[0]["id"]
    body = body.replace(chunk_id.encode(), b"chatcmpl-ID")
    body = body.replace(b"audio-" + chunk_id[9:].encode(), b"audio-ID")
    return body.replace(b'"created":%d,' % events[0]["created"], b'"created":0,')


# -- 2. whole responses ----------------------------------------------------------------


class TestWhole:
    async def test_message_holds_all_text_and_a_wav_of_all_audio(self, server):
        prompt = "all at once"
        async with openai_client(server) as client:
            completion = await client.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": prompt},
                ],
            )
        [choice] = completion.choices
        assert choice.finish_reason == "stop"
        assert choice.message.role == "assistant"
        assert choice.message.content == "".join(text_of(prompt))
        audio = choice.message.audio
        assert wav_frames(b64(audio.data)) == (b"".join(audio_of(prompt)), SAMPLE_RATE)
        assert audio.transcript == "".join(text_of(prompt))
        assert audio.id.startswith("audio-")
        assert completion.usage.completion_tokens == TEXT_DELTAS
        metrics = completion.model_extra["metrics"]
        assert set(metrics) == {"time_to_first_token", "time_to_first_audio", "e2e_latency"}
        assert 0 < metrics["time_to_first_token"] <= metrics["e2e_latency"]
        assert 0 < metrics["time_to_first_audio"] <= metrics["e2e_latency"]

    async def test_content_parts_and_pcm16(self, server):
        prompt = "in parts"
        body = chat_body("", audio={"format": "pcm16"})
        body["messages"] = [
            {"role": "user", "content": "an earlier question"},
            {"role": "assistant", "content": "an answer"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "in "}, {"type": "text", "text": "parts"}],
            },
        ]
        async with http_client() as client:
            response = await client.post(server.chat_url(), json=body)
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        message = response.json()["choices"][0]["message"]
        assert message["content"] == "".join(text_of(prompt))  # the last user message
        assert b64(message["audio"]["data"]) == b"".join(audio_of(prompt))


# -- 3. modalities ------------------------------------------------------------------------


class TestModalities:
    async def test_text_only_submits_the_thinker_alone(self, server):
        prompt = "just text"
        async with http_client() as client:
            response = await client.post(
                server.chat_url(), json=chat_body(prompt, modalities=["text"], stream=True)
            )
        events = sse_events(response.content)
        assert texts(events) == text_of(prompt)
        assert audios(events) == []
        await trio.testing.wait_all_tasks_blocked()
        rid = await server.engine.submitted(prompt, 0)
        assert server.stages[1].submissions == []
        assert server.stages[2].submissions == []
        assert rid not in server.stages[0].aborts

    async def test_text_only_whole_response_has_no_audio(self, server):
        async with openai_client(server) as client:
            completion = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "words"}], modalities=["text"]
            )
        assert completion.choices[0].message.content == "".join(text_of("words"))
        assert completion.choices[0].message.audio is None
        assert completion.model_extra["metrics"]["time_to_first_audio"] is None

    async def test_audio_only_runs_every_stage_and_shows_no_text(self, server):
        prompt = "just audio"
        async with http_client() as client:
            streamed = await client.post(
                server.chat_url(),
                json=chat_body(
                    prompt, modalities=["audio"], stream=True, audio={"format": "pcm16"}
                ),
            )
            whole = await client.post(
                server.chat_url(), json=chat_body(prompt + "!", modalities=["audio"])
            )
        events = sse_events(streamed.content)
        assert texts(events) == []
        assert [b64(a["data"]) for a in audios(events)] == audio_of(prompt)
        for stage_id in range(3):
            await server.engine.submitted(prompt, stage_id)
        message = whole.json()["choices"][0]["message"]
        assert message["content"] is None
        assert wav_frames(b64(message["audio"]["data"])) == (
            b"".join(audio_of(prompt + "!")),
            SAMPLE_RATE,
        )


# -- 4. isolation ---------------------------------------------------------------------------


async def test_ten_concurrent_streams_each_get_their_own_data(server):
    results: dict[str, tuple[list[str], list[bytes]]] = {}

    async def one(client, prompt):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            audio={"format": "pcm16", "voice": "Ethan"},
            stream=True,
        )
        text, audio = [], []
        async for chunk in stream:
            delta = chunk.choices[0].delta
            if delta.content:
                text.append(delta.content)
            if delta.audio is not None:
                audio.append(b64(delta.audio.data))
        results[prompt] = (text, audio)

    prompts = [f"request {i}" for i in range(10)]
    async with openai_client(server) as client, trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(one, client, prompt)
    assert results == {p: (text_of(p), audio_of(p)) for p in prompts}
    assert len({server.stages[0].submitted_ids()[i] for i in range(10)}) == 10


async def test_the_outputs_hook_sees_every_output_the_response_takes():
    """``create_app(on_outputs=...)``: each batch as the response takes it, in order,
    before it becomes events (the serving benchmark times chunks with it)."""
    batches = []
    async with running_server(on_outputs=batches.append) as server:
        async with http_client() as client:
            response = await client.post(server.chat_url(), json=chat_body("hook", stream=True))
        assert response.status_code == 200
    outputs = [output for batch in batches for output in batch]
    assert all(batch for batch in batches)
    assert [o.data for o in outputs if o.stage_id == 0 and o.data] == text_of("hook")
    assert [o.data for o in outputs if o.stage_id == 2 and o.data] == audio_of("hook")
    assert outputs[-1].finished
    assert texts(sse_events(response.content)) == text_of("hook")


# -- 11. health and models ------------------------------------------------------------------


async def test_health_and_models(server):
    async with http_client() as client:
        assert (await client.get(server.url + "/health")).status_code == 200
        raw = (await client.get(server.url + "/v1/models")).json()
    assert raw["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in raw["data"]] == [
        (MODEL, "model", "omni_trio")
    ]
    async with openai_client(server) as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


# -- 5. errors before the pipeline ----------------------------------------------------------


def valid(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


class TestRequestErrors:
    @pytest.mark.parametrize(
        ("body", "param", "match"),
        [
            (b'{"model": "x", "messages": [', None, "not valid JSON"),
            (b"", None, "not valid JSON"),
            (json.dumps(valid(messages=[])).encode(), "messages", "must not be empty"),
            (json.dumps(valid(stream="yes")).encode(), "stream", "Expected `bool`"),
            (json.dumps(valid(messages="hi")).encode(), "messages", "Expected `array`"),
            (json.dumps(valid(max_tokens=0)).encode(), "max_tokens", ">= 1"),
            (json.dumps(valid(max_completion_tokens=-3)).encode(), "max_completion_tokens", ">= 1"),
            (
                json.dumps(valid(messages=[{"role": "robot", "content": "hi"}])).encode(),
                "messages[0].role",
                None,
            ),
            (
                json.dumps(valid(messages=[{"role": "system", "content": "be brief"}])).encode(),
                "messages",
                "no message with role 'user'",
            ),
            (
                json.dumps(valid(messages=[{"role": "user", "content": "  "}])).encode(),
                "messages",
                "no text",
            ),
            (json.dumps(valid(modalities=["video"])).encode(), "modalities", "unknown modality"),
            (json.dumps(valid(modalities=[])).encode(), "modalities", "must not be empty"),
            (json.dumps(valid(audio={"format": "ogg"})).encode(), "audio.format", None),
            (json.dumps({"messages": []}).encode(), None, "model"),
        ],
    )
    async def test_bad_requests_get_400_and_reach_no_stage(self, server, body, param, match):
        async with http_client() as client:
            response = await client.post(
                server.chat_url(), content=body, headers={"content-type": "application/json"}
            )
        assert response.status_code == 400, response.text
        assert response.headers["content-type"] == "application/json"
        error = assert_error_object(response.json(), "invalid_request_error")
        assert error["param"] == param
        if match is not None:
            assert match in error["message"]
        assert server.stages[0].submissions == []

    async def test_audio_from_a_text_only_model_is_400(self):
        async with running_server(outputs=(TEXT,)) as server, http_client() as client:
            response = await client.post(
                server.chat_url(), json=chat_body("speak", modalities=["text", "audio"])
            )
            assert response.status_code == 400
            error = assert_error_object(response.json(), "invalid_request_error")
            assert error["param"] == "modalities"
            assert "has no audio output" in error["message"]
            # without modalities it is text, from the thinker alone
            ok = await client.post(server.chat_url(), json=chat_body("write"))
            assert ok.json()["choices"][0]["message"] == {
                "content": "".join(text_of("write")),
                "role": "assistant",
                "audio": None,
            }
            assert server.stages[2].submissions == []

    async def test_unknown_model_is_404(self, server):
        async with http_client() as client:
            response = await client.post(
                server.chat_url(), json={**chat_body("hi"), "model": "gpt-4o"}
            )
        assert response.status_code == 404
        error = assert_error_object(response.json(), "invalid_request_error")
        assert (error["param"], error["code"]) == ("model", "model_not_found")
        async with openai_client(server) as client:
            with pytest.raises(openai.NotFoundError) as caught:
                await client.chat.completions.create(
                    model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True
                )
        assert caught.value.status_code == 404
        assert caught.value.code == "model_not_found"
        assert server.stages[0].submissions == []

    async def test_wrong_method_and_path(self, server):
        async with http_client() as client:
            assert (await client.get(server.chat_url())).status_code == 405
            assert (await client.get(server.url + "/v1/nothing")).status_code == 404


class TestCapacity:
    async def test_503_at_once_when_running_and_waiting_are_full(self):
        async with running_server(max_in_flight=1, max_waiting=0) as server:
            held = MANUAL + "holds the only slot"
            async with http_client() as client, trio.open_nursery() as nursery:
                first: list[httpx.Response] = []

                async def hold():
                    first.append(await client.post(server.chat_url(), json=chat_body(held)))

                nursery.start_soon(hold)
                await server.engine.submitted(held)
                with trio.fail_after(PROMPTLY):
                    refused = await client.post(server.chat_url(), json=chat_body("second"))
                assert refused.status_code == 503
                assert refused.headers["retry-after"] == "1"
                error = assert_error_object(refused.json(), "server_error")
                assert error["code"] == "server_overloaded"
                assert "max_in_flight=1" in error["message"]
                assert not server.engine.was_submitted("second", 0)
                await server.engine.play_all(held)
            assert first[0].status_code == 200
            assert first[0].json()["choices"][0]["message"]["content"] == "".join(text_of(held))

    async def test_a_waiting_request_runs_once_the_slot_frees(self):
        async with running_server(max_in_flight=1, max_waiting=1) as server:
            held, waiting = MANUAL + "first", "waits its turn"
            responses: dict[str, httpx.Response] = {}
            async with http_client() as client, trio.open_nursery() as nursery:

                async def post(prompt, **fields):
                    responses[prompt] = await client.post(
                        server.chat_url(), json=chat_body(prompt, **fields)
                    )

                nursery.start_soon(post, held)
                await server.engine.submitted(held)
                nursery.start_soon(partial(post, waiting, stream=True))
                with trio.fail_after(PROMPTLY):
                    await server.state.active.wait_value(2)
                metrics = await scrape(server)
                assert metrics["omni_trio:num_requests_running"] == 1
                assert metrics["omni_trio:num_requests_waiting"] == 1
                third = await client.post(server.chat_url(), json=chat_body("third"))
                assert third.status_code == 503
                await trio.testing.wait_all_tasks_blocked()
                assert not server.engine.was_submitted(waiting, 0)
                await server.engine.play_all(held)
            assert texts(sse_events(responses[waiting].content)) == text_of(waiting)
            assert responses[held].status_code == 200
            metrics = await scrape(server)
            assert metrics["omni_trio:num_requests_running"] == 0
            assert metrics["omni_trio:num_requests_waiting"] == 0
            assert metrics.finished("completed") == 2


# -- 6. a stage's error ---------------------------------------------------------------------


async def emit_text_then_fail(server, prompt, deltas):
    """The thinker sends ``deltas``, then (once they are on their way to the client:
    stages' outputs are not ordered across stages) the talker fails the request."""
    rid = await server.engine.submitted(prompt, 1)
    for delta in deltas:
        await server.stages[0].emit(rid, delta)
    await trio.testing.wait_all_tasks_blocked()
    await server.stages[1].emit(rid, error="talker crashed")


class TestStageError:
    async def test_mid_stream_an_error_event_then_done(self, server):
        prompt = MANUAL + "fails midway"
        async with http_client() as client, trio.open_nursery() as nursery:
            nursery.start_soon(emit_text_then_fail, server, prompt, ["one ", "two "])
            response = await client.post(server.chat_url(), json=chat_body(prompt, stream=True))
        assert response.status_code == 200  # the headers had gone out
        events = sse_events(response.content)
        assert texts(events) == ["one ", "two "]
        assert finish_chunks(events) == []
        *_, last, done = events
        assert done == "[DONE]"
        error = assert_error_object(last, "server_error")
        assert "stage 1 failed: talker crashed" in error["message"]
        await server.engine.aborted_everywhere(prompt, (0, 2))  # the others are stopped
        assert (await scrape(server)).finished("error") == 1

    async def test_the_openai_client_raises_while_iterating(self, server):
        prompt = MANUAL + "fails for the client"
        got: list[str] = []
        async with openai_client(server) as client, trio.open_nursery() as nursery:
            nursery.start_soon(emit_text_then_fail, server, prompt, ["only "])
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True
            )

            async def iterate():
                async for chunk in stream:
                    got.append(chunk.choices[0].delta.content)

            with pytest.raises(openai.APIError, match="talker crashed") as caught:
                await iterate()
        assert caught.value.body["type"] == "server_error"
        assert got == ["only "]

    async def test_whole_response_is_a_500_error_object(self, server):
        prompt = MANUAL + "fails whole"
        async with http_client() as client, trio.open_nursery() as nursery:
            nursery.start_soon(emit_text_then_fail, server, prompt, ["lost "])
            response = await client.post(server.chat_url(), json=chat_body(prompt))
        assert response.status_code == 500
        error = assert_error_object(response.json(), "server_error")
        assert "talker crashed" in error["message"]


# -- 7. max_tokens ---------------------------------------------------------------------------


class TestTokenLimit:
    @pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
    async def test_the_stream_stops_after_n_deltas_and_the_request_is_aborted(self, server, field):
        prompt = MANUAL + field
        deltas = text_of(prompt)  # the stages go on; the server stops after 2

        async def emit():
            rid = await server.engine.submitted(prompt, 2)
            for delta in deltas:
                await server.stages[0].emit(rid, delta)

        async with http_client() as client, trio.open_nursery() as nursery:
            nursery.start_soon(emit)
            response = await client.post(
                server.chat_url(), json=chat_body(prompt, stream=True, **{field: 2})
            )
        events = sse_events(response.content)
        assert texts(events) == deltas[:2]
        [(at, finish)] = finish_chunks(events)
        assert finish["choices"][0]["finish_reason"] == "length"
        assert events[at + 1 :] == ["[DONE]"]
        await server.engine.aborted_everywhere(prompt)
        metrics = await scrape(server)
        assert (metrics.finished("length"), metrics.finished("aborted")) == (1, 0)

    async def test_whole_response_finish_reason_length(self, server):
        prompt = MANUAL + "whole and long"

        async def emit():
            rid = await server.engine.submitted(prompt, 2)
            for delta in text_of(prompt):
                await server.stages[0].emit(rid, delta)

        async with openai_client(server) as client, trio.open_nursery() as nursery:
            nursery.start_soon(emit)
            completion = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                max_completion_tokens=3,
            )
        assert completion.choices[0].finish_reason == "length"
        assert completion.choices[0].message.content == "".join(text_of(prompt)[:3])
        assert completion.usage.completion_tokens == 3
        await server.engine.aborted_everywhere(prompt)

    async def test_a_limit_the_answer_stays_under_is_no_limit(self, server):
        body = chat_body(
            "short", stream=True, max_tokens=TEXT_DELTAS + 1, audio={"format": "pcm16"}
        )
        async with http_client() as client:
            response = await client.post(server.chat_url(), json=body)
        events = sse_events(response.content)
        assert texts(events) == text_of("short")
        assert [b64(a["data"]) for a in audios(events)] == audio_of("short")
        [(_, finish)] = finish_chunks(events)
        assert finish["choices"][0]["finish_reason"] == "stop"


# -- 8. clients that hang up -------------------------------------------------------------------


@asynccontextmanager
async def connected(server, receive_buffer: int | None = None) -> AsyncIterator[trio.SocketStream]:
    """A raw connection, closed at the latest when the block is left; with its kernel
    receive buffer fixed at ``receive_buffer`` bytes (no autotuning) if given."""
    sock = trio.socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, receive_buffer)
    async with trio.SocketStream(sock) as stream:
        await sock.connect(("127.0.0.1", server.port))
        yield stream


async def stage_outputs(server, label: str) -> float:
    return (await scrape(server))["omni_trio:stage_outputs_total", {"stage": label}]


NOTHING = ServerStatistics(active=0, running=0, waiting=0, tickets=0)


async def nothing_left(server) -> None:
    """Once the requests' handlers are done, the server keeps no record of them."""
    with trio.fail_after(PROMPTLY):
        await server.state.active.wait_value(0)
    assert server.state.statistics() == NOTHING
    assert server.state.tickets == set()


class TestDisconnect:
    async def test_before_the_first_byte_every_stage_gets_abort(self, server):
        prompt = MANUAL + "hangs up before any output"
        async with connected(server) as sock:
            await sock.send_all(raw_request(server.port, chat_body(prompt)))
            for stage_id in range(3):
                await server.engine.submitted(prompt, stage_id)
        await server.engine.aborted_everywhere(prompt)
        metrics = await scrape(server)
        assert metrics.finished("aborted") == 1
        assert metrics["omni_trio:num_requests_running"] == 0
        await nothing_left(server)

    async def test_while_waiting_for_admission_the_request_never_runs(self):
        async with running_server(max_in_flight=1, max_waiting=4) as server:
            held, gone = MANUAL + "holds the slot", "hangs up while waiting"
            async with http_client() as client, trio.open_nursery() as nursery:
                first: list[httpx.Response] = []

                async def hold():
                    first.append(await client.post(server.chat_url(), json=chat_body(held)))

                nursery.start_soon(hold)
                await server.engine.submitted(held)
                async with connected(server) as sock:
                    await sock.send_all(raw_request(server.port, chat_body(gone, stream=True)))
                    with trio.fail_after(PROMPTLY):
                        await server.state.active.wait_value(2)
                    assert (await scrape(server))["omni_trio:num_requests_waiting"] == 1
                with trio.fail_after(PROMPTLY):
                    await server.state.active.wait_value(1)
                assert (await scrape(server))["omni_trio:num_requests_waiting"] == 0
                assert server.state.statistics() == ServerStatistics(
                    active=1, running=1, waiting=0, tickets=1
                )
                await server.engine.play_all(held)
            assert first[0].status_code == 200
            await trio.testing.wait_all_tasks_blocked()
            assert not server.engine.was_submitted(gone, 0)  # it never took the slot
            metrics = await scrape(server)
            assert metrics.finished("completed") == 1
            assert metrics.finished("aborted") == 1  # its client left: it ended, unrun
            await nothing_left(server)

    async def test_mid_stream_every_stage_gets_abort(self, server):
        prompt = MANUAL + "hangs up midway"
        async with openai_client(server) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True
            )
            rid = await server.engine.submitted(prompt, 2)
            got = []
            for delta in text_of(prompt)[:2]:
                await server.stages[0].emit(rid, delta)
                chunk = await stream.__anext__()
                got.append(chunk.choices[0].delta.content)
            assert got == text_of(prompt)[:2]
            await stream.close()
            await server.engine.aborted_everywhere(prompt)
        metrics = await scrape(server)
        assert metrics.finished("aborted") == 1
        assert metrics["omni_trio:stage_outputs_total", {"stage": "thinker"}] == 2
        await nothing_left(server)

    async def test_while_the_server_is_blocked_writing_every_stage_gets_abort(self, server):
        """A client that sends its request and never reads: once the socket buffers are
        full the server's send blocks and the outputs pile up; hanging up ends it."""
        prompt = MANUAL + "never reads"
        chunk = b"\x01\x02" * (1 << 17)  # 256 KiB of PCM: ~350 KB as an SSE event
        async with connected(server, receive_buffer=16 * 1024) as sock:
            body = chat_body(prompt, stream=True, audio={"format": "pcm16"})
            await sock.send_all(raw_request(server.port, body))
            rid = await server.engine.submitted(prompt, 2)
            emitted = taken = 0
            with trio.fail_after(PROMPTLY * 2):
                # Rounds of 8 outputs, until the server has been given far more than the
                # kernel buffers hold (<= ~4 MiB) and takes none of a whole round.
                while True:
                    for _ in range(8):
                        await server.stages[2].emit(rid, chunk)
                    emitted += 8
                    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                    now = await stage_outputs(server, "code2wav")
                    if emitted >= 32 and now == taken:
                        break
                    taken = now
            assert 1 <= taken < emitted  # the outputs pile up: the server is stuck
            metrics = await scrape(server)
            assert metrics["omni_trio:num_requests_running"] == 1
            assert metrics.finished("aborted") == 0
            assert rid not in server.stages[2].aborts
            assert server.state.statistics() == ServerStatistics(
                active=1, running=1, waiting=0, tickets=1
            )
        await server.engine.aborted_everywhere(prompt)
        metrics = await scrape(server)
        assert metrics.finished("aborted") == 1
        assert metrics["omni_trio:num_requests_running"] == 0
        await nothing_left(server)

    async def test_while_sending_its_body_nothing_is_left(self):
        """A client that hangs up halfway through its request's body: the handler
        reading it returns, the server never made a request of it, and it answers
        the next client as before."""
        async with running_server(middleware=Handlers) as server:
            handlers = Handlers.last
            prompt = MANUAL + "never finishes its body"
            request = raw_request(server.port, chat_body(prompt))
            async with connected(server) as sock:
                await sock.send_all(request[: len(request) - 10])
                with trio.fail_after(PROMPTLY):
                    await handlers.running.wait_value(1)
            with trio.fail_after(PROMPTLY):
                await handlers.running.wait_value(0)
            assert not server.engine.was_submitted(prompt, 0)
            await nothing_left(server)
            async with http_client() as client:
                response = await client.post(server.chat_url(), json=chat_body("next"))
            content = response.json()["choices"][0]["message"]["content"]
            assert content == "".join(text_of("next"))
            await nothing_left(server)

    async def test_many_clients_hang_up_at_every_moment_and_nothing_is_left(self, server):
        """Streams whose clients leave mid-stream and whole answers whose clients
        leave before their first byte, all at once: the server's records are empty
        after."""
        prompts = [MANUAL + f"crowd {i}" for i in range(6)]
        async with trio.open_nursery() as nursery:
            for i, prompt in enumerate(prompts):
                nursery.start_soon(self._hang_up, server, prompt, i % 2 == 0)
        for prompt in prompts:
            await server.engine.aborted_everywhere(prompt)
        await nothing_left(server)
        assert (await scrape(server)).finished("aborted") == len(prompts)

    @staticmethod
    async def _hang_up(server, prompt: str, midway: bool) -> None:
        async with connected(server) as sock:
            await sock.send_all(raw_request(server.port, chat_body(prompt, stream=midway)))
            rid = await server.engine.submitted(prompt, 2)
            if midway:
                await server.stages[0].emit(rid, "some ")
                received = b""
                while b'"content":"some "' not in received:
                    received += await sock.receive_some()


# -- 9. /metrics ---------------------------------------------------------------------------------


async def test_metrics_count_what_happened(server):
    """Two completed requests, one failed by a stage, one hung up on, one cut by
    max_tokens: the counters, gauges and histograms say exactly that."""
    async with http_client() as client:
        for prompt in ("first", "second"):
            ok = await client.post(server.chat_url(), json=chat_body(prompt, stream=True))
            assert (
                finish_chunks(sse_events(ok.content))[0][1]["choices"][0]["finish_reason"] == "stop"
            )

        failing = MANUAL + "error"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(emit_text_then_fail, server, failing, ["a "])
            await client.post(server.chat_url(), json=chat_body(failing))

        gone = MANUAL + "gone"
        async with connected(server) as sock:
            await sock.send_all(raw_request(server.port, chat_body(gone, stream=True)))
            rid = await server.engine.submitted(gone, 2)
            await server.stages[0].emit(rid, "b ")
            received = b""
            while b'"content":"b "' not in received:
                received += await sock.receive_some()
        await server.engine.aborted_everywhere(gone)

        cut = MANUAL + "cut"

        async def emit():
            rid = await server.engine.submitted(cut, 2)
            for delta in ("c ", "d "):
                await server.stages[0].emit(rid, delta)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(emit)
            await client.post(server.chat_url(), json=chat_body(cut, max_tokens=1))
        await server.engine.aborted_everywhere(cut)

    metrics = await scrape(server)
    assert {r: metrics.finished(r) for r in ("completed", "error", "aborted", "length")} == {
        "completed": 2,
        "error": 1,
        "aborted": 1,
        "length": 1,
    }
    assert metrics["omni_trio:num_requests_running"] == 0
    assert metrics["omni_trio:num_requests_waiting"] == 0
    # text deltas: 4 + 4 + 1 (error) + 1 (gone) + 1 (cut); audio: 3 + 3
    assert metrics["omni_trio:stage_outputs_total", {"stage": TEXT.label}] == 2 * TEXT_DELTAS + 3
    assert metrics["omni_trio:stage_outputs_total", {"stage": AUDIO.label}] == 2 * AUDIO_CHUNKS
    assert metrics["omni_trio:e2e_request_latency_seconds_count"] == 5
    assert metrics["omni_trio:time_to_first_token_seconds_count"] == 5
    assert metrics["omni_trio:time_to_first_audio_seconds_count"] == 2
    assert metrics["omni_trio:e2e_request_latency_seconds_sum"] > 0
    for label in ("stage0", "stage1", "stage2"):
        assert metrics["omni_trio:stage_alive", {"stage": label}] == 1


# -- 10. draining -------------------------------------------------------------------------------


class TestDrain:
    async def test_a_graceful_stop_lets_the_request_in_flight_finish(self):
        """/health and new requests get 503 at once; the request in flight streams to
        its end; then serve returns."""
        prompt = MANUAL + "in flight"
        async with running_server() as server:
            async with http_client() as client:
                async with client.stream(
                    "POST", server.chat_url(), json=chat_body(prompt, stream=True)
                ) as response:
                    rid = await server.engine.submitted(prompt, 2)
                    await server.stages[0].emit(rid, text_of(prompt)[0])
                    chunks = response.aiter_bytes()
                    body = b""
                    while b"\n\n" not in body:
                        body += await chunks.__anext__()
                    assert json.loads(body[6 : body.index(b"\n")])["choices"][0]["delta"]

                    server.stopping.set()
                    async with http_client() as other:  # a new connection
                        health = await other.get(server.url + "/health")
                        refused = await other.post(server.chat_url(), json=chat_body("too late"))
                    assert (health.status_code, health.text) == (503, "draining")
                    assert refused.status_code == 503
                    assert refused.headers["retry-after"] == "1"
                    error = assert_error_object(refused.json(), "server_error")
                    assert error["code"] == "server_shutting_down"
                    assert not server.engine.was_submitted("too late", 0)

                    *deltas, last = text_of(prompt)[1:]
                    for delta in deltas:
                        await server.stages[0].emit(rid, delta)
                    await server.stages[0].emit(rid, last, finished=True)
                    await server.engine.play(1, rid, prompt)
                    await server.engine.play(2, rid, prompt)
                    body += b"".join([chunk async for chunk in chunks])
                events = sse_events(body)
                assert texts(events) == text_of(prompt)
                assert len(audios(events)) == AUDIO_CHUNKS
                [(_, finish)] = finish_chunks(events)
                assert finish["choices"][0]["finish_reason"] == "stop"
            with trio.fail_after(PROMPTLY):  # the client's connections are closed
                await server.returned.wait()
            assert rid not in server.stages[0].aborts
            assert Metrics(server.state.metrics.render().decode()).finished("completed") == 1

    async def test_requests_still_running_after_the_grace_are_told_and_aborted(self):
        async with running_server(shutdown_grace=0.2) as server, http_client() as client:
            prompt = MANUAL + "too slow"

            async def stop_once_streaming():
                rid = await server.engine.submitted(prompt, 2)
                await server.stages[0].emit(rid, "partial ")
                await trio.testing.wait_all_tasks_blocked()
                server.stopping.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stop_once_streaming)
                response = await client.post(server.chat_url(), json=chat_body(prompt, stream=True))
            events = sse_events(response.content)
            assert texts(events) == ["partial "]
            assert finish_chunks(events) == []
            error = assert_error_object(events[-2], "server_error")
            assert error["code"] == "server_shutting_down"
            await server.engine.aborted_everywhere(prompt)
            with trio.fail_after(PROMPTLY):
                await server.returned.wait()
            metrics = Metrics(server.state.metrics.render().decode())
            assert metrics.finished("aborted") == 1


# -- 12. the server's own bounds -----------------------------------------------------------

LIMIT = 2000  # max_request_bytes of these tests


def body_of_size(size: int, prompt: str, **fields) -> bytes:
    """A valid chat request body of exactly ``size`` bytes (padded in ``user``, which
    the server ignores)."""
    body = chat_body(prompt, user="", **fields)
    body["user"] = "x" * (size - len(json.dumps(body).encode()))
    data = json.dumps(body).encode()
    assert len(data) == size
    return data


async def read_to_eof(sock: trio.SocketStream) -> tuple[int, dict[str, str], bytes]:
    """The one response on a connection the server closes after it: status, headers
    (lowercase names) and body."""
    received = b""
    with trio.fail_after(PROMPTLY):
        async for data in sock:
            received += data
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


def assert_too_large(status: int, body: bytes, limit: int = LIMIT) -> None:
    assert status == 413
    error = assert_error_object(json.loads(body), "invalid_request_error")
    assert error["code"] == "request_too_large"
    assert f"max_request_bytes is {limit} bytes" in error["message"]


@pytest.fixture
async def bounded():
    async with running_server(max_request_bytes=LIMIT) as server:
        yield server


# httpx leaves its request body's async generator unfinished when the server answers
# before it was all sent (as the openai client does its SSE decoder's, above).
@pytest.mark.filterwarnings(r"ignore:Async generator 'httpx\._content\.:ResourceWarning")
class TestRequestBodyBound:
    async def test_a_body_of_the_limit_is_read_one_byte_more_is_413(self, bounded):
        async with http_client() as client:
            at = await client.post(
                bounded.chat_url(),
                content=body_of_size(LIMIT, "at the limit"),
                headers={"content-type": "application/json"},
            )
            over = await client.post(
                bounded.chat_url(),
                content=body_of_size(LIMIT + 1, "over the limit"),
                headers={"content-type": "application/json"},
            )
        assert at.status_code == 200
        assert at.json()["choices"][0]["message"]["content"] == "".join(text_of("at the limit"))
        assert_too_large(over.status_code, over.content)
        assert over.headers["connection"] == "close"
        assert f"({LIMIT + 1} bytes)" in over.json()["error"]["message"]
        assert not bounded.engine.was_submitted("over the limit", 0)
        await nothing_left(bounded)

    async def test_a_content_length_over_the_limit_is_413_before_the_body_comes(self, bounded):
        """The request's head alone: the server answers without waiting for a byte of
        the body, and closes the connection."""
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n"
        )
        async with connected(bounded) as sock:
            await sock.send_all(head.encode())
            status, headers, body = await read_to_eof(sock)
        assert_too_large(status, body)
        assert "(10000000000 bytes)" in json.loads(body)["error"]["message"]
        assert headers["connection"] == "close"
        await nothing_left(bounded)

    async def test_a_chunked_body_is_refused_once_it_passes_the_limit(self, bounded):
        """Transfer-Encoding: chunked, no length: the server reads until the count
        passes the limit, answers 413 and reads no more (the body never ends)."""
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"%x\r\n%s\r\n" % (LIMIT // 2, b" " * (LIMIT // 2))
        async with connected(bounded) as sock:
            await sock.send_all(head.encode() + chunk + chunk)  # exactly the limit
            with trio.move_on_after(0.2):  # not refused: it waits for more
                assert await sock.receive_some() == b"never"
            await sock.send_all(b"1\r\n \r\n")  # one byte over
            status, headers, body = await read_to_eof(sock)
        assert_too_large(status, body)
        assert headers["connection"] == "close"
        await nothing_left(bounded)

    async def test_a_body_of_many_small_chunks_gets_413_and_the_connection_closes(self, bounded):
        """Many chunks arrive at once: the server has received far more of the body
        than it read when it answers (a queue of messages for the app, full), and it
        still ends the response and closes the connection."""
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"10\r\n" + b" " * 16 + b"\r\n"
        async with connected(bounded) as sock:
            await sock.send_all(head.encode() + chunk * (LIMIT // 16 + 200))
            status, headers, body = await read_to_eof(sock)
        assert_too_large(status, body)
        assert headers["connection"] == "close"
        await nothing_left(bounded)

    async def test_the_413_goes_out_while_the_server_holds_a_full_queue_of_the_body(self):
        """When the 413's send is slow (here: held until it is so) while the client
        keeps sending, Hypercorn's queue of body messages for the app fills up; the
        response still ends and the connection closes (the server drops what it
        queued rather than wait forever for the app to take it)."""
        async with running_server(max_request_bytes=LIMIT, middleware=SlowToAnswer) as server:
            size = 4 * 1024 * 1024
            head = (
                "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
            )
            async with connected(server) as sock, trio.open_nursery() as nursery:

                async def send_body():
                    with contextlib.suppress(trio.BrokenResourceError):
                        await sock.send_all(head.encode() + b" " * size)

                nursery.start_soon(send_body)
                status, headers, body = await read_to_eof(sock)
                nursery.cancel_scope.cancel()
            assert SlowToAnswer.held == [True]
            assert_too_large(status, body)
            assert headers["connection"] == "close"
            await nothing_left(server)

    async def test_an_endless_streamed_body_gets_413_through_httpx(self, bounded):
        """httpx sending a body that never ends (a generator's): the server stops
        reading it, answers 413, closes the connection; the client reads the 413."""
        sent = [0]

        class Endless:
            def __aiter__(self):
                return self

            async def __anext__(self) -> bytes:
                sent[0] += 16384
                await trio.lowlevel.checkpoint()
                return b" " * 16384

        async with http_client() as client:
            response = await client.post(
                bounded.chat_url(), content=Endless(), headers={"content-type": "application/json"}
            )
        assert_too_large(response.status_code, response.content)
        assert sent[0] > LIMIT
        await nothing_left(bounded)
        async with http_client() as client:  # the server goes on as before
            ok = await client.post(bounded.chat_url(), json=chat_body("after"))
        assert ok.json()["choices"][0]["message"]["content"] == "".join(text_of("after"))

    async def test_a_long_head_is_431(self, server):
        """Hypercorn's own bound on a request's line and headers (as docs/serving.md
        says): a head still incomplete past 16 KiB is 431, and the connection closes."""
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"X-Padding: {'x' * 100_000}\r\nContent-Length: 2\r\n\r\n{{}}"
        )
        async with connected(server) as sock:
            with contextlib.suppress(trio.BrokenResourceError):  # it may close first
                await sock.send_all(head.encode())
            status, _, _ = await read_to_eof(sock)
        assert status == 431
        await nothing_left(server)

    async def test_the_default_is_one_mib(self, server):
        async with http_client() as client:
            ok = await client.post(
                server.chat_url(),
                content=body_of_size(1024 * 1024, "a MiB"),
                headers={"content-type": "application/json"},
            )
            over = await client.post(
                server.chat_url(),
                content=body_of_size(1024 * 1024 + 1, "over a MiB"),
                headers={"content-type": "application/json"},
            )
        assert ok.status_code == 200
        assert_too_large(over.status_code, over.content, 1024 * 1024)

    @pytest.mark.parametrize("value", [0, -1, True, 1.5, "1024"])
    def test_create_app_checks_it(self, value):
        with pytest.raises(ValueError, match=r"^max_request_bytes must be an integer >= 1, got "):
            create_app(ServedModel(MODEL, (TEXT,)), None, max_request_bytes=value)


class Handlers:
    """ASGI middleware: counts the app's HTTP calls still running (``running``);
    ``Handlers.last`` is the one the last app was built with."""

    last: ClassVar[Handlers]

    def __init__(self, app) -> None:
        self.app = app
        self.running = AsyncValue(0)
        type(self).last = self

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.running.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.running.value -= 1


class SlowToAnswer:
    """ASGI middleware: holds the app's first ``http.response.start`` until Hypercorn's
    queue of request messages for the app is full (as when the send waits on a slow
    socket while the client goes on sending). ``held``: whether it did, per request.

    Hypercorn's ``receive`` is its Trio memory channel's ``receive``: the queue's
    statistics are its channel's."""

    held: ClassVar[list[bool]] = []

    def __init__(self, app) -> None:
        self.app = app
        type(self).held.clear()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        channel = receive.__self__
        assert isinstance(channel, trio.MemoryReceiveChannel)

        async def slow_send(message) -> None:
            if message["type"] == "http.response.start":
                stats = channel.statistics
                with trio.fail_after(PROMPTLY):
                    # polled: a channel has no event for being full
                    while stats().current_buffer_used < stats().max_buffer_size:  # noqa: ASYNC110
                        await trio.sleep(0.01)
                type(self).held.append(True)
            await send(message)

        await self.app(scope, receive, slow_send)


def whole_size(prompt: str) -> int:
    """Bytes a whole answer of ``prompt`` keeps: its text's length, and its PCM's."""
    return len("".join(text_of(prompt))) + len(b"".join(audio_of(prompt)))


class TestWholeAnswerBound:
    async def test_a_whole_answer_over_max_unread_bytes_fails_naming_it(self):
        """The same answer: whole, it is over the bound and fails (400, and the
        request is aborted at every stage); streamed, it all arrives; a whole answer
        of exactly the bound is answered."""
        whole, streamed, fits = MANUAL + "whole", MANUAL + "strm!", MANUAL + "fit"
        limit = whole_size(fits)
        assert whole_size(streamed) == whole_size(whole) > limit
        async with (
            running_server(max_unread_bytes=limit) as server,
            http_client() as client,
            trio.open_nursery() as nursery,
        ):
            assert server.state.max_answer_bytes == limit

            async def emit_all_unfinished():
                rid = await server.engine.submitted(whole, 2)
                for delta in text_of(whole):
                    await server.stages[0].emit(rid, delta)
                for chunk in audio_of(whole):
                    await server.stages[2].emit(rid, chunk)

            nursery.start_soon(emit_all_unfinished)
            response = await client.post(
                server.chat_url(), json=chat_body(whole, audio={"format": "pcm16"})
            )
            assert response.status_code == 400
            error = assert_error_object(response.json(), "invalid_request_error")
            assert (error["param"], error["code"]) == ("stream", "answer_too_large")
            assert f"max_unread_bytes ({limit} bytes)" in error["message"]
            assert "stream=true" in error["message"]
            assert "[pipeline] max_unread_bytes" in error["message"]
            await server.engine.aborted_everywhere(whole)

            nursery.start_soon(self._play_once_submitted, server, streamed)
            response = await client.post(
                server.chat_url(), json=chat_body(streamed, stream=True, audio={"format": "pcm16"})
            )
            events = sse_events(response.content)
            assert texts(events) == text_of(streamed)
            assert [b64(a["data"]) for a in audios(events)] == audio_of(streamed)
            [(_, finish)] = finish_chunks(events)
            assert finish["choices"][0]["finish_reason"] == "stop"

            nursery.start_soon(self._play_once_submitted, server, fits)
            response = await client.post(
                server.chat_url(), json=chat_body(fits, audio={"format": "pcm16"})
            )
            assert response.status_code == 200
            message = response.json()["choices"][0]["message"]
            assert message["content"] == "".join(text_of(fits))
            assert b64(message["audio"]["data"]) == b"".join(audio_of(fits))

            metrics = await scrape(server)
            assert (metrics.finished("error"), metrics.finished("completed")) == (1, 2)
            await nothing_left(server)

    @staticmethod
    async def _play_once_submitted(server, prompt: str) -> None:
        await server.engine.submitted(prompt, 2)
        await server.engine.play_all(prompt)


async def test_a_stream_left_unread_ends_after_consumer_idle_timeout():
    """A client that stops reading and stays: after consumer_idle_timeout the request
    ends (aborted at every stage); when the client reads on, it gets what was sent,
    then the error event and [DONE]; then nothing is left."""
    async with running_server(consumer_idle_timeout=0.5) as server:
        prompt = MANUAL + "left unread"
        chunk = b"\x01\x02" * (1 << 17)
        async with connected(server, receive_buffer=16 * 1024) as sock:
            body = chat_body(prompt, stream=True, audio={"format": "pcm16"})
            await sock.send_all(raw_request(server.port, body))
            rid = await server.engine.submitted(prompt, 2)
            taken = -1
            with trio.fail_after(PROMPTLY * 2):  # until the server is stuck writing
                while taken < (taken := await stage_outputs(server, "code2wav")):
                    for _ in range(8):
                        await server.stages[2].emit(rid, chunk)
                    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            await server.engine.aborted_everywhere(prompt)
            received = b""
            with trio.fail_after(PROMPTLY):
                while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                    received += await sock.receive_some()
        assert received.startswith(b"HTTP/1.1 200 ")
        error = json.loads(received.rsplit(b"data: ", 2)[1])
        assert_error_object(error, "server_error")
        assert "consumer_idle_timeout" in error["error"]["message"]
        assert (await scrape(server)).finished("error") == 1
        await nothing_left(server)


async def stuck_writing(server, sock, prompt: str) -> str:
    """Send a streamed audio request for ``prompt`` on ``sock`` (which then reads
    nothing), and feed its code2wav until the server is stuck writing to it."""
    chunk = b"\x01\x02" * (1 << 17)
    body = chat_body(prompt, stream=True, audio={"format": "pcm16"})
    await sock.send_all(raw_request(server.port, body))
    rid = await server.engine.submitted(prompt, 2)
    taken = -1
    with trio.fail_after(PROMPTLY * 2):
        while taken < (taken := await stage_outputs(server, "code2wav")):
            for _ in range(8):
                await server.stages[2].emit(rid, chunk)
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
    return rid


async def test_a_client_that_reads_nothing_is_disconnected_after_the_write_timeout():
    """Its socket open, its receive window shut, no idle timeout to end its request:
    the kernel drops the connection after write_timeout (a write Hypercorn cannot
    cancel), and the request ends as a hang-up does, at every stage."""
    async with running_server(consumer_idle_timeout=0, write_timeout=1.0) as server:
        prompt = MANUAL + "never read"
        async with connected(server, receive_buffer=16 * 1024) as sock:
            await stuck_writing(server, sock, prompt)
            with trio.fail_after(PROMPTLY):  # 1 s, and the kernel's own probing
                await server.engine.aborted_everywhere(prompt)
            await nothing_left(server)


async def test_a_stop_waits_for_a_client_that_reads_nothing_no_longer_than_the_write_timeout():
    """A graceful stop ends the request at once, but its response is stuck in a write
    to a client that reads nothing: the server returns once the kernel drops it."""
    async with running_server(
        consumer_idle_timeout=0, write_timeout=1.0, shutdown_grace=0
    ) as server:
        prompt = MANUAL + "stuck at the stop"
        async with connected(server, receive_buffer=16 * 1024) as sock:
            await stuck_writing(server, sock, prompt)
            server.stopping.set()
            with trio.fail_after(PROMPTLY):
                await server.returned.wait()


# -- 13. the heap ------------------------------------------------------------------------------


async def test_while_serving_the_heap_is_frozen_and_full_collections_are_rarer():
    """What the process held once the pipeline started is frozen (no collection scans
    it again) and full collections come at most once per FULL_COLLECTION_EVERY middle
    ones. The last server to stop restores both; one that stops while another runs
    leaves them."""
    thresholds = gc.get_threshold()
    # Other tests in this process may have frozen objects (the bench's scenarios do):
    # start from none, as a fresh server process would.
    gc.unfreeze()
    async with running_server() as first:
        assert gc.get_freeze_count() > 0
        young, middle, full = gc.get_threshold()
        assert (young, middle) == thresholds[:2]
        assert full == max(thresholds[2], FULL_COLLECTION_EVERY)
        async with running_server():
            assert gc.get_threshold()[2] == full
        assert gc.get_freeze_count() > 0  # the first one still runs
        assert gc.get_threshold()[2] == full
        async with http_client() as client:  # and serves as before
            response = await client.post(first.chat_url(), json=chat_body("frozen"))
        assert response.json()["choices"][0]["message"]["content"] == "".join(text_of("frozen"))
    assert gc.get_threshold() == thresholds
    assert gc.get_freeze_count() == 0


async def test_a_server_told_not_to_tune_the_collector_leaves_it_alone():
    thresholds = gc.get_threshold()
    gc.unfreeze()
    async with running_server(tune_gc=False) as server:
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == thresholds
        async with http_client() as client:
            response = await client.post(server.chat_url(), json=chat_body("as it is"))
        assert response.status_code == 200
    assert gc.get_threshold() == thresholds
