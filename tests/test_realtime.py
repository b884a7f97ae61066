"""``/v1/realtime`` over the real server, driven by ``websockets``' client: the
conversation, the events' order, bad client events, the limits, and cancellation --
``response.cancel``, a socket closed mid-answer and barge-in -- each aborting the
response at every stage. The stages are scripted (tests/realtime_helpers.py), and
turns are heard by a detector that hears loudness: what is checked here is the
server, on every Python. The voice extra's detector on real speech is
tests/test_realtime_vad.py's; the real pipeline, Whisper and the ``openai`` client
are tests/test_voice.py's."""

from __future__ import annotations

import base64
import io
import json
import time
import wave
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from omni_trio.serve import RealtimeOptions
from realtime_helpers import (
    DEAF_MS,
    DELTAS,
    LISTENER_BROKE,
    MODEL,
    THINKER_BROKE,
    WORDS,
    Client,
    LoudnessDetector,
    answer_words,
    b64,
    loud,
    metric,
    quiet,
    realtime_server,
    talk,
)


def say(client: Client, text: str) -> None:
    client.send(
        "conversation.item.create",
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
    )


def answer(client: Client, text: str) -> dict:
    """Say ``text``, ask for a response, and wait for its ``response.done``."""
    say(client, text)
    client.send("response.create")
    return client.until("response.done")


def manual(client: Client, **session: object) -> None:
    client.send(
        "session.update",
        session={"type": "realtime", "audio": {"input": {"turn_detection": None}}, **session},
    )
    client.until("session.updated")


async def test_a_typed_turn_is_answered_in_order() -> None:
    async with realtime_server() as server:

        def script(client: Client) -> list[dict]:
            answer(client, "hello there")
            return client.events

        events = await talk(server.ws_url(), script)
        first_audio = [
            await metric(server, f"omni_trio:realtime_first_audio_seconds_{part}")
            for part in ("count", "sum")
        ]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["conversation.item.added", "conversation.item.done"]
    assert first_audio[0] == 1
    assert 0 < first_audio[1] < 10
    assert kinds[2:5] == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
    ]
    assert kinds[-1] == "response.done"
    assert events[-1]["response"]["status"] == "completed"
    text = "".join(e["delta"] for e in events if e["type"] == DELTAS[1])
    assert text == "".join(answer_words("hello there"))
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == DELTAS[0])
    assert len(audio) == WORDS * 4800
    done = next(e for e in events if e["type"] == "response.output_audio_transcript.done")
    assert done["transcript"] == text
    # every delta names the response and its item
    response_id = events[2]["response"]["id"]
    assert {e["response_id"] for e in events if e["type"] in DELTAS} == {response_id}


async def test_text_modality_gets_text_events_only() -> None:
    async with realtime_server() as server:

        def script(client: Client) -> list[dict]:
            client.send(
                "session.update", session={"type": "realtime", "output_modalities": ["text"]}
            )
            client.until("session.updated")
            answer(client, "plain")
            return client.events

        events = await talk(server.ws_url(), script)
        no_audio = await metric(server, "omni_trio:realtime_first_audio_seconds_count")
    assert no_audio == 0
    kinds = {e["type"] for e in events}
    assert {"response.output_text.delta", "response.output_text.done"} <= kinds
    assert not kinds & {*DELTAS, "response.output_audio.done"}
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert done["text"] == text == "".join(answer_words("plain"))
    assert server.script.prompts  # the request was made


async def test_a_committed_turn_is_heard_then_answered() -> None:
    async with realtime_server() as server:

        def script(client: Client) -> list[dict]:
            manual(client)
            client.append(quiet(500))
            client.send("input_audio_buffer.commit")
            client.until("conversation.item.added")
            client.send("response.create")
            client.until("response.done")
            return client.events

        events = await talk(server.ws_url(), script)
    heard = next(
        e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"
    )
    assert heard["transcript"] == "500 ms of audio"
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    assert heard["item_id"] == committed["item_id"]
    (prompt,) = server.script.prompts.values()
    assert prompt["sample_rate"] == 24_000
    assert len(prompt["audio"]) == 500 * 48


async def test_the_conversation_is_the_context_and_truncation_cuts_it() -> None:
    async with realtime_server() as server:

        def script(client: Client) -> None:
            done = answer(client, "first")
            item = done["response"]["output"][0]["id"]
            # the client played a quarter of the answer's audio
            client.send(
                "conversation.item.truncate",
                item_id=item,
                content_index=0,
                audio_end_ms=WORDS * 100 // 4,
            )
            truncated = client.until("conversation.item.truncated")
            assert truncated["item_id"] == item
            # ours: what the answer says now, so a client can show it
            said = "".join(answer_words("first")).split()[: WORDS // 4]
            assert truncated["transcript"] == " ".join(said)
            answer(client, "second")

        await talk(server.ws_url(), script)
    first, second = server.script.prompts.values()
    assert first["context"] == []
    heard_words = "".join(answer_words("first")).split()[: WORDS // 4]
    assert second["context"] == [
        {"role": "user", "text": "first"},
        {"role": "assistant", "text": " ".join(heard_words)},
    ]
    assert second["text"] == "second"


async def test_response_cancel_aborts_every_stage_and_nothing_follows() -> None:
    async with realtime_server(word_seconds=0.05) as server:

        def script(client: Client) -> list[dict]:
            say(client, "long")
            client.send("response.create")
            client.until(DELTAS[1])
            client.send("response.cancel")
            done = client.until("response.done")
            assert done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"]["reason"] == "client_cancelled"
            # the session goes on: a second response is answered
            answer(client, "again")
            return client.events

        events = await talk(server.ws_url(), script)
        with trio.fail_after(5):
            await server.script.aborted.wait()
    first_done = next(i for i, e in enumerate(events) if e["type"] == "response.done")
    first_id = events[first_done]["response"]["id"]
    assert not [e for e in events[first_done:] if e.get("response_id") == first_id]
    assert len(server.script.fully_aborted()) == 1
    assert events[-1]["response"]["status"] == "completed"


async def test_a_socket_closed_mid_answer_aborts_every_stage() -> None:
    async with realtime_server(word_seconds=0.05) as server:

        def script(client: Client) -> None:
            say(client, "bye")
            client.send("response.create")
            client.until(DELTAS[1])

        await talk(server.ws_url(), script)
        with trio.fail_after(5):
            await server.script.aborted.wait()
        assert len(server.script.fully_aborted()) == 1
        sessions = server.app.state.omni_trio.realtime.sessions
        with trio.fail_after(5):
            # the session's end follows its responses' aborts
            while sessions:  # noqa: ASYNC110
                await trio.sleep(0.01)


BAD_EVENTS = [
    ("not json", "malformed", None, None),
    (b"\x00binary", "binary", None, None),
    ({"type": "no.such.event", "event_id": "e1"}, "unknown type", "e1", "type"),
    ({"type": "conversation.item.truncate", "event_id": "e2"}, "missing field", "e2", "item_id"),
    (
        {"type": "input_audio_buffer.append", "event_id": "e3", "audio": "%%%"},
        "not base64",
        "e3",
        "audio",
    ),
    (
        {
            "type": "session.update",
            "event_id": "e4",
            "session": {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}},
        },
        "audio format",
        "e4",
        "session.audio.input.format.type",
    ),
    (
        {"type": "input_audio_buffer.append", "event_id": "e5", "audio": b64(quiet(1200))},
        "over the buffer",
        "e5",
        "audio",
    ),
    ({"type": "response.cancel", "event_id": "e6"}, "nothing to cancel", "e6", None),
    (
        {"type": "response.create", "event_id": "e7", "response": {"output_modalities": ["video"]}},
        "bad modality",
        "e7",
        "response.output_modalities[0]",
    ),
]


@pytest.mark.parametrize(
    ("frame", "why", "event_id", "param"), BAD_EVENTS, ids=[b[1] for b in BAD_EVENTS]
)
async def test_a_bad_client_event_gets_one_error_and_the_session_goes_on(
    frame: object, why: str, event_id: str | None, param: str | None
) -> None:
    options = RealtimeOptions(max_buffer_seconds=1.0)
    async with realtime_server(options=options) as server:

        def script(client: Client) -> list[dict]:
            manual(client)
            client.send_raw(frame if isinstance(frame, (str, bytes)) else json.dumps(frame))
            client.send("session.update", session={"type": "realtime"})
            client.until("session.updated")
            return client.events

        events = await talk(server.ws_url(), script)
    (error,) = [e for e in events if e["type"] == "error"]
    assert events[-1]["type"] == "session.updated"
    assert error["error"]["event_id"] == event_id
    if param is not None:
        assert error["error"]["param"] == param
    assert error["error"]["message"]


async def test_an_event_over_the_size_limit_is_refused_by_name() -> None:
    async with realtime_server(options=RealtimeOptions(max_event_bytes=1000)) as server:

        def script(client: Client) -> dict:
            manual(client)
            client.send("input_audio_buffer.append", audio=b64(quiet(100)))
            return client.until("error")

        error = await talk(server.ws_url(), script)
    assert error["error"]["code"] == "event_too_large"
    assert error["error"]["event_id"] == "c2"


async def test_a_wrong_model_is_refused_and_closed() -> None:
    async with realtime_server() as server:

        def script() -> tuple[dict, int | None]:
            with connect(server.ws_url("gpt-4o-realtime")) as ws:
                event = json.loads(ws.recv(timeout=5))
                with pytest.raises(ConnectionClosed):
                    ws.recv(timeout=5)
                return event, ws.close_code

        event, code = await trio.to_thread.run_sync(script)
        counted = await metric(server, "omni_trio:realtime_sessions_refused_total", reason="model")
    assert counted == 1
    assert event["type"] == "error"
    assert event["error"]["param"] == "model"
    assert MODEL in event["error"]["message"]
    assert code == 1008


async def test_a_session_over_the_limit_is_refused_at_the_upgrade() -> None:
    async with realtime_server(options=RealtimeOptions(max_sessions=1)) as server:
        open_sessions: list[float] = []

        def script() -> Any:
            with connect(server.ws_url()) as first:
                first.recv(timeout=5)
                sessions = trio.from_thread.run(metric, server, "omni_trio:realtime_sessions")
                open_sessions.append(sessions)
                with pytest.raises(InvalidStatus) as refused:
                    connect(server.ws_url())
                return refused.value.response

        refused = await trio.to_thread.run_sync(script)
        assert open_sessions == [1]
        counted = await metric(
            server, "omni_trio:realtime_sessions_refused_total", reason="capacity"
        )
        with trio.fail_after(5):
            while await metric(server, "omni_trio:realtime_sessions"):  # noqa: ASYNC110
                await trio.sleep(0.01)  # (polled: the first session closed)
    assert counted == 1
    assert refused.status_code == 503
    message = json.loads(refused.body)["error"]["message"]
    assert "1 realtime session (--realtime-max-sessions 1)" in message


async def test_an_idle_session_is_told_and_closed() -> None:
    async with realtime_server(options=RealtimeOptions(idle_timeout=0.3)) as server:

        def script(client: Client) -> dict:
            error = client.until("error")
            with pytest.raises(ConnectionClosed):
                client.recv(timeout=5)
            return error

        error = await talk(server.ws_url(), script)
    assert error["error"]["code"] == "session_idle_timeout"


async def test_sessions_are_isolated() -> None:
    async with realtime_server(word_seconds=0.005) as server:
        answers: dict[str, str] = {}

        async def one(question: str) -> None:
            def script(client: Client) -> str:
                answer(client, question)
                return "".join(e["delta"] for e in client.of(DELTAS[1]))

            answers[question] = await talk(server.ws_url(), script)

        async with trio.open_nursery() as nursery:
            for question in ("alpha one", "bravo two", "charlie three"):
                nursery.start_soon(one, question)
    assert answers == {q: "".join(answer_words(q)) for q in answers}


async def test_one_sessions_death_leaves_the_others_alone() -> None:
    """A session whose socket dies mid-answer ends with its answer aborted at every
    stage; the session beside it, mid-answer too, is answered in full and goes on."""
    async with realtime_server(word_seconds=0.02) as server:
        streaming = trio.Event()

        def dies(client: Client) -> None:
            say(client, "doomed")
            client.send("response.create")
            client.until(DELTAS[1])
            trio.from_thread.run_sync(streaming.set)
            client.ws.socket.close()  # no close frame: the connection just ends

        def lives(client: Client) -> list[str]:
            trio.from_thread.run(streaming.wait)
            first = answer(client, "steady")["response"]
            second = answer(client, "again")["response"]
            return [
                first["status"],
                second["status"],
                "".join(e["delta"] for e in client.of(DELTAS[1])),
            ]

        results: dict[str, object] = {}

        async def run(name: str, script: Callable[[Client], object]) -> None:
            try:
                results[name] = await talk(server.ws_url(), script)
            except ConnectionClosed:
                results[name] = "closed"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "dies", dies)
            nursery.start_soon(run, "lives", lives)
        with trio.fail_after(5):
            await server.script.aborted.wait()
    first, second, text = results["lives"]
    assert (first, second) == ("completed", "completed")
    assert text == "".join(answer_words("steady")) + "".join(answer_words("again"))
    (doomed,) = [rid for rid, p in server.script.prompts.items() if p["text"] == "doomed"]
    assert server.script.fully_aborted() == [doomed]


async def test_a_failed_answer_is_failed_and_names_why() -> None:
    async with realtime_server() as server:

        def script(client: Client) -> dict:
            done = answer(client, "fail now")
            answer(client, "after")
            return done["response"]

        response = await talk(server.ws_url(), script)
    assert response["status"] == "failed"
    assert THINKER_BROKE in response["status_details"]["error"]["message"]
    assert response["output"][0]["status"] == "incomplete"
    # what was heard of it stays in the conversation: two words
    after = [p for p in server.script.prompts.values() if p["text"] == "after"]
    assert after[0]["context"][-1] == {"role": "assistant", "text": "fail0 fail1 "}


async def test_a_turn_that_could_not_be_heard_says_so_and_the_session_goes_on() -> None:
    async with realtime_server() as server:

        def script(client: Client) -> list[dict]:
            manual(client)
            client.append(quiet(DEAF_MS))
            client.send("input_audio_buffer.commit")
            committed = client.until("input_audio_buffer.committed")
            client.send("response.create")
            client.until("response.done")
            client.append(quiet(300))  # the next turn is heard
            client.send("input_audio_buffer.commit")
            client.until("input_audio_buffer.committed")
            client.send("response.create")
            client.until("response.done")
            return [committed, *client.events]

        committed, *events = await talk(server.ws_url(), script)
    (failed,) = [
        e for e in events if e["type"] == "conversation.item.input_audio_transcription.failed"
    ]
    assert failed["item_id"] == committed["item_id"]
    assert LISTENER_BROKE in failed["error"]["message"]
    first, second = [e["response"] for e in events if e["type"] == "response.done"]
    assert (first["status"], second["status"]) == ("failed", "completed")
    (heard,) = [
        e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"
    ]
    assert heard["transcript"] == "300 ms of audio"


async def test_an_answer_aborted_by_the_server_is_incomplete() -> None:
    async with realtime_server(word_seconds=0.05) as server:
        orchestrator = server.app.state.omni_trio.orchestrator

        def script(client: Client) -> dict:
            say(client, "cut short")
            client.send("response.create")
            client.until(DELTAS[1])
            (rid,) = server.script.prompts
            trio.from_thread.run(orchestrator.abort, rid)
            return client.until("response.done")["response"]

        response = await talk(server.ws_url(), script)
    assert response["status"] == "incomplete"
    assert response["status_details"] == {"type": "incomplete", "reason": "aborted"}


async def test_a_cancelled_answer_keeps_what_was_written() -> None:
    async with realtime_server(word_seconds=0.05) as server:

        def script(client: Client) -> str:
            say(client, "long")
            client.send("response.create")
            for _ in range(3):
                client.until(DELTAS[1])
            client.send("response.cancel")
            client.until("response.done")
            written = "".join(e["delta"] for e in client.of(DELTAS[1]))
            answer(client, "next")
            return written

        written = await talk(server.ws_url(), script)
    assert written.startswith("long0 long1 long2 ")
    assert written != "".join(answer_words("long"))
    (after,) = [p for p in server.script.prompts.values() if p["text"] == "next"]
    assert after["context"] == [
        {"role": "user", "text": "long"},
        {"role": "assistant", "text": written},
    ]


async def test_a_truncation_while_the_answer_streams_holds() -> None:
    """The client cuts an answer it is still receiving: the answer keeps what was
    played then, however much more of it comes."""
    async with realtime_server(word_seconds=0.06) as server:

        def script(client: Client) -> tuple[dict, dict]:
            say(client, "story")
            client.send("response.create")
            item = client.until("response.output_item.added")["item"]["id"]
            for _ in range(4):
                client.until(DELTAS[0])
            client.send(
                "conversation.item.truncate", item_id=item, content_index=0, audio_end_ms=200
            )
            truncated = client.until("conversation.item.truncated")
            done = client.until("response.done")["response"]
            answer(client, "then")
            return truncated, done

        truncated, done = await talk(server.ws_url(), script)
    assert truncated["audio_end_ms"] == 200
    assert done["status"] == "completed"
    kept = done["output"][0]["content"][0]["transcript"]
    words = "".join(answer_words("story")).split()
    # 200 ms of the 400-500 ms of audio written when the cut came: two words or three
    assert kept in (" ".join(words[:2]), " ".join(words[:3]))
    (then,) = [p for p in server.script.prompts.values() if p["text"] == "then"]
    assert then["context"][-1] == {"role": "assistant", "text": kept}


async def test_clearing_the_buffer_drops_its_audio() -> None:
    async with realtime_server() as server:

        def script(client: Client) -> None:
            manual(client)
            client.append(quiet(500))
            client.send("input_audio_buffer.clear")
            client.until("input_audio_buffer.cleared")
            client.send("input_audio_buffer.commit")
            client.until("error")
            client.append(quiet(300))
            client.send("input_audio_buffer.commit")
            client.until("input_audio_buffer.committed")
            client.send("response.create")
            client.until("response.done")

        await talk(server.ws_url(), script)
    (prompt,) = server.script.prompts.values()
    assert len(prompt["audio"]) == 300 * 48


async def test_a_session_is_not_idle_while_its_answer_streams() -> None:
    options = RealtimeOptions(idle_timeout=0.2)
    async with realtime_server(options=options, word_seconds=0.05) as server:

        def script(client: Client) -> list[str]:
            answer(client, "slowly")  # 0.6 s: three idle timeouts
            client.until("error")
            return [e["type"] for e in client.events]

        kinds = await talk(server.ws_url(), script)
    assert kinds.count("error") == 1
    assert kinds.index("response.done") < kinds.index("error")


# -- turns, with a detector that hears loudness (the voice extra's is below) ------------


def heard_answer(events: list[dict]) -> tuple[str, str]:
    """What the scripted listen stage heard, and the answer's text as streamed."""
    (heard,) = [
        e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"
    ]
    return heard["transcript"], "".join(e["delta"] for e in events if e["type"] == DELTAS[1])


async def test_a_speculation_holds_at_most_the_outbox_bound_until_its_turn_ends() -> None:
    options = RealtimeOptions(detector=LoudnessDetector, outbox_bytes=4096)
    async with realtime_server(options=options, word_seconds=0.04) as server:
        endpoint = server.app.state.omni_trio.realtime
        held: list[int] = []

        def holding() -> None:
            (session,) = endpoint.sessions
            (response,) = session._state.responses
            assert response.held
            held.append(response.held_bytes)

        def script(client: Client) -> list[dict]:
            client.append(loud(300) + quiet(200))  # 150 ms of silence: it speculates
            time.sleep(1.0)  # its whole answer would come in 0.5 s
            trio.from_thread.run_sync(holding)
            client.append(quiet(400))  # 500 ms of silence: the turn is over
            client.until("response.done")
            return client.events

        events = await talk(server.ws_url(), script)
    # a word's two deltas are about 6.8 kB: it stopped past the bound by a batch (a
    # word, or two), not at the whole answer's 82 kB
    assert 4096 < held[0] < 4096 + 3 * 7000
    kinds = [e["type"] for e in events]
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    heard, text = heard_answer(events)
    assert text == "".join(answer_words(heard))  # all of it, once promoted
    assert events[-1]["response"]["status"] == "completed"


async def test_speech_resuming_cancels_a_speculation_unseen() -> None:
    options = RealtimeOptions(detector=LoudnessDetector)
    async with realtime_server(options=options, word_seconds=0.05) as server:

        def script(client: Client) -> list[dict]:
            client.append(loud(300) + quiet(200))  # a speculation starts ...
            time.sleep(0.1)
            client.append(loud(200) + quiet(600))  # ... speech resumes; then the turn ends
            client.until("response.done")
            return client.events

        events = await talk(server.ws_url(), script)
        with trio.fail_after(5):
            await server.script.aborted.wait()
        unseen = await metric(
            server, "omni_trio:realtime_responses_total", status="unseen", reason="turn_detected"
        )
    speculation, answer = server.script.prompts  # in order of submission
    assert server.script.fully_aborted() == [speculation]
    assert unseen == 1
    assert len(server.script.prompts[answer]["audio"]) == 48 * (300 + 200 + 200)
    assert [e["type"] for e in events].count("response.created") == 1
    assert events[-1]["response"]["status"] == "completed"


async def test_speech_over_an_answer_cancels_it_and_nothing_of_it_follows() -> None:
    options = RealtimeOptions(detector=LoudnessDetector)
    async with realtime_server(options=options, word_seconds=0.05) as server:

        def script(client: Client) -> list[dict]:
            client.append(loud(300) + quiet(600))
            client.until(DELTAS[0])
            client.append(loud(800))  # the user talks over the answer (past interrupt_min_ms)
            done = client.until("response.done")
            assert done["response"]["status_details"]["reason"] == "turn_detected"
            client.append(quiet(600))  # the new turn ends: it is answered
            client.until("response.done")
            return client.events

        events = await talk(server.ws_url(), script)
        with trio.fail_after(5):
            await server.script.aborted.wait()
        responses = "omni_trio:realtime_responses_total"
        counted = [
            await metric(server, responses, status="cancelled", reason="turn_detected"),
            await metric(server, responses, status="completed", reason=""),
            await metric(server, "omni_trio:realtime_first_audio_seconds_count"),
        ]
    assert counted == [1, 1, 2]  # both answers' first audio was written
    first, second = [e["response"] for e in events if e["type"] == "response.done"]
    assert (first["status"], second["status"]) == ("cancelled", "completed")
    starts = [i for i, e in enumerate(events) if e["type"] == "input_audio_buffer.speech_started"]
    cut = starts[1]  # the speech over the answer
    late = [e for e in events[cut:] if e.get("response_id") == first["id"] and e["type"] in DELTAS]
    assert not late
    assert len(server.script.fully_aborted()) == 1


async def test_a_client_that_reads_nothing_is_not_read_from_past_the_bound() -> None:
    """Every server event a session queues is bounded, an error for each bad client
    event too: past ``outbox_bytes`` queued, the session reads no more events."""
    options = RealtimeOptions(outbox_bytes=4096)
    async with realtime_server(options=options) as server:
        endpoint = server.app.state.omni_trio.realtime
        frames = 0

        async def receive() -> dict:
            nonlocal frames
            await trio.lowlevel.checkpoint()
            frames += 1
            if frames == 1:
                return {"type": "websocket.connect"}
            if frames > 10_000:
                return {"type": "websocket.disconnect", "code": 1000}
            return {"type": "websocket.receive", "text": "not json"}

        async def send(message: dict) -> None:
            if message["type"] == "websocket.send":
                await trio.sleep_forever()  # the client reads nothing

        scope = {"type": "websocket", "query_string": f"model={MODEL}".encode()}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(endpoint, scope, receive, send)
            await trio.testing.wait_all_tasks_blocked()
            (session,) = endpoint.sessions
            queued = session.queued_bytes
            nursery.cancel_scope.cancel()
    error_bytes = 300  # an error event for a frame that is not JSON, about
    assert 4096 < queued <= 4096 + error_bytes
    assert frames < 2 + 4096 // 100


# -- audio in chat completions ----------------------------------------------------------


def wav_of(pcm: bytes, rate: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm)
    return out.getvalue()


def audio_message(data: bytes, fmt: str, text: str | None = None) -> dict:
    content: list[dict] = [
        {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}
    ]
    if text:
        content.insert(0, {"type": "text", "text": text})
    return {
        "model": MODEL,
        "modalities": ["text"],
        "messages": [{"role": "user", "content": content}],
    }


@pytest.mark.parametrize("fmt", ["wav", "pcm16"])
async def test_chat_completions_take_input_audio(fmt: str) -> None:
    async with realtime_server() as server, httpx.AsyncClient() as http:
        data = wav_of(quiet(300), 16_000) if fmt == "wav" else quiet(300)
        reply = await http.post(f"{server.url}/v1/chat/completions", json=audio_message(data, fmt))
    assert reply.status_code == 200, reply.text
    (prompt,) = server.script.prompts.values()
    assert prompt["sample_rate"] == (16_000 if fmt == "wav" else 24_000)
    heard = "300 ms of audio" if fmt == "pcm16" else f"{len(prompt['audio']) // 48} ms of audio"
    assert reply.json()["choices"][0]["message"]["content"] == "".join(answer_words(heard))


@pytest.mark.parametrize(
    ("data", "fmt", "param"),
    [
        (b"not a wav file", "wav", "messages[0].content[0].input_audio.data"),
        (b"\x00" * 10, "mp3", "messages[0].content[0].input_audio.format"),
        (b"\x00" * 3, "pcm16", "messages[0].content[0].input_audio.data"),
    ],
)
async def test_bad_input_audio_is_a_400_naming_the_part(data: bytes, fmt: str, param: str) -> None:
    async with realtime_server() as server, httpx.AsyncClient() as http:
        reply = await http.post(f"{server.url}/v1/chat/completions", json=audio_message(data, fmt))
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param


async def test_a_pipeline_that_cannot_listen_refuses_input_audio() -> None:
    from serve_helpers import MODEL as TEXT_MODEL
    from serve_helpers import running_server

    async with running_server() as server, httpx.AsyncClient() as http:
        body = audio_message(quiet(100), "pcm16", text="what is this?")
        body["model"] = TEXT_MODEL
        reply = await http.post(server.chat_url(), json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "messages[0].content[1]"
    assert "cannot listen" in reply.json()["error"]["message"]


def test_a_long_vocoder_output_goes_out_in_half_second_deltas() -> None:
    from omni_trio import OrchOutput
    from omni_trio.serve._realtime_conversation import DELTA_BYTES, Item, ResponseEvents
    from omni_trio.serve._realtime_protocol import ServerEvents
    from realtime_helpers import AUDIO

    answer = Item("item_1", "assistant", "")
    events = ResponseEvents(
        ServerEvents("t_"), "resp_1", answer, None, {2: AUDIO}, "audio", lambda pcm: pcm
    )
    pcm = bytes(range(256)) * 225  # 1.2 s of 24 kHz PCM16
    outs = events.take([OrchOutput("r", 2, pcm, False)])
    assert [o.audio_bytes for o in outs] == [DELTA_BYTES, DELTA_BYTES, len(pcm) - 2 * DELTA_BYTES]
    sent = b"".join(base64.b64decode(json.loads(o.text)["delta"]) for o in outs)
    assert sent == pcm
    assert answer.audio_ms == 0  # nothing written yet
    for out in outs:
        events.sent(out)
    assert answer.audio_ms == 1200


async def test_a_stopping_server_tells_its_sessions_and_closes_them() -> None:
    async with realtime_server(word_seconds=0.05) as server:
        endpoint = server.app.state.omni_trio.realtime
        answering = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def script(client: Client) -> tuple[dict, dict, int | None]:
            say(client, "long")
            client.send("response.create")
            client.until(DELTAS[1])
            trio.from_thread.run_sync(answering.set, trio_token=token)
            done = client.until("response.done")
            error = client.until("error")
            with pytest.raises(ConnectionClosed):
                client.recv(timeout=5)
            return done, error, client.ws.close_code

        async with trio.open_nursery() as nursery:
            result: list = []

            async def run() -> None:
                result.append(await talk(server.ws_url(), script))

            nursery.start_soon(run)
            await answering.wait()
            endpoint.stop_all()  # what a drain does once its grace ran out
        done, error, code = result[0]
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "server_shutting_down"
    assert error["error"]["code"] == "server_shutting_down"
    assert code == 1012
    assert len(server.script.fully_aborted()) == 1


@pytest.mark.parametrize(("options", "priority"), [(None, -10), (RealtimeOptions(priority=3), 3)])
async def test_a_response_runs_at_the_sessions_priority(
    options: RealtimeOptions | None, priority: int
) -> None:
    """A realtime response's request carries the endpoint's priority (-10: ahead of
    chat's 0) or ``RealtimeOptions.priority`` to every stage of its route."""
    async with realtime_server(options=options) as server:

        def script(client: Client) -> list[dict]:
            answer(client, "urgent")
            return client.events

        events = await talk(server.ws_url(), script)
        requests = [r for stage in server.script.stages for r in stage.requests]
    assert events[-1]["response"]["status"] == "completed"
    assert requests
    assert {r.priority for r in requests} == {priority}


async def test_a_turn_whose_audio_stops_mid_speech_is_committed_after_the_idle_timeout() -> None:
    """A client that stops sending while its turn's speech goes on (a file with no
    silence after it) is not waited for forever: after ``idle_timeout_ms`` without
    audio the turn ends where its audio does, as OpenAI's API does it."""
    options = RealtimeOptions(detector=LoudnessDetector)
    async with realtime_server(options=options) as server:

        def script(client: Client) -> list[dict]:
            detection = {"type": "server_vad", "idle_timeout_ms": 300}
            client.send(
                "session.update",
                session={"type": "realtime", "audio": {"input": {"turn_detection": detection}}},
            )
            updated = client.until("session.updated")
            turn = updated["session"]["audio"]["input"]["turn_detection"]
            assert turn["idle_timeout_ms"] == 300, turn
            client.append(loud(600))  # and nothing more
            began = time.monotonic()
            client.until("input_audio_buffer.timeout_triggered")
            waited = time.monotonic() - began
            assert 0.25 < waited < 3.0, waited
            client.until("response.done")
            return client.events

        events = await talk(server.ws_url(), script)
    kinds = [e["type"] for e in events]
    (timeout,) = [e for e in events if e["type"] == "input_audio_buffer.timeout_triggered"]
    assert (timeout["audio_start_ms"], timeout["audio_end_ms"]) == (0, 600)
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index(
        "input_audio_buffer.timeout_triggered"
    )
    assert kinds.index("input_audio_buffer.timeout_triggered") < kinds.index(
        "input_audio_buffer.committed"
    )
    heard, text = heard_answer(events)
    assert heard == "600 ms of audio"
    assert text == "".join(answer_words(heard))
    assert events[-1]["response"]["status"] == "completed"


async def test_the_turns_idle_timeout_has_a_default_and_a_range() -> None:
    options = RealtimeOptions(detector=LoudnessDetector)
    async with realtime_server(options=options) as server:

        def script(client: Client) -> tuple[dict, dict]:
            client.send(
                "session.update",
                session={
                    "type": "realtime",
                    "audio": {"input": {"turn_detection": {"type": "server_vad"}}},
                },
            )
            updated = client.until("session.updated")
            detection = {"type": "server_vad", "idle_timeout_ms": 50}
            client.send(
                "session.update",
                session={"type": "realtime", "audio": {"input": {"turn_detection": detection}}},
            )
            return updated, client.until("error")

        updated, error = await talk(server.ws_url(), script)
    assert updated["session"]["audio"]["input"]["turn_detection"]["idle_timeout_ms"] == 2000
    assert "idle_timeout_ms" in error["error"]["param"]
    assert "Expected `int` >= 100" in error["error"]["message"]


async def test_a_backchannel_over_an_answer_does_not_interrupt_it() -> None:
    """Speech over an answer shorter than ``interrupt_min_ms`` (500 ms by default):
    a "yeah" or a cough. The answer goes on to its end, and no turn is made of it."""
    options = RealtimeOptions(detector=LoudnessDetector)
    async with realtime_server(options=options, word_seconds=0.05) as server:

        def script(client: Client) -> list[dict]:
            client.append(loud(300) + quiet(600))
            client.until(DELTAS[0])
            client.append(loud(250) + quiet(600))  # "yeah", over the answer
            client.until("response.done")
            time.sleep(0.3)  # nothing more comes of it
            client.send("input_audio_buffer.clear")
            client.until("input_audio_buffer.cleared")
            return client.events

        events = await talk(server.ws_url(), script)
    kinds = [e["type"] for e in events]
    assert kinds.count("input_audio_buffer.speech_started") == 1
    assert kinds.count("response.created") == 1
    (done,) = [e for e in events if e["type"] == "response.done"]
    assert done["response"]["status"] == "completed"
