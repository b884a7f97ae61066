"""``/v1/realtime`` with server VAD on eSpeak NG's speech: the voice extra's detector
(Silero) finds the turn and it is answered, a pause within a turn cancels the
speculation unseen, and speech over an answer cancels it at every stage. The
stages are scripted (tests/realtime_helpers.py); tests/test_realtime.py checks the
same rules with a detector that hears loudness, on every Python. These run in the
``voice`` session (they skip without the voice extra, unless
``OMNI_TRIO_REQUIRE_VOICE=1``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

from omni_trio.serve import RealtimeOptions
from realtime_helpers import DELTAS, Client, quiet, realtime_server, talk


@pytest.fixture
def speech() -> Callable[[str], bytes]:
    """``speech(text)``: ``text`` spoken by eSpeak NG at 24 kHz (skips without the
    voice extra's detector, unless ``OMNI_TRIO_REQUIRE_VOICE=1``)."""
    from voice_helpers import REQUIRE_VOICE, spoken

    try:
        from omni_trio.speech import VoiceActivityDetector, speech_available

        VoiceActivityDetector()
        import av  # noqa: F401
    except ImportError as exc:
        if REQUIRE_VOICE:
            raise
        pytest.skip(f"server VAD needs the voice extra: {exc}")
    if not speech_available():
        if REQUIRE_VOICE:
            pytest.fail("no eSpeak NG")
        pytest.skip("no eSpeak NG (the speech extra)")
    return lambda text: spoken(text, 24_000)


async def test_server_vad_finds_the_turn_and_answers_it(speech: Callable[[str], bytes]) -> None:
    said = speech("Hello there, how are you today?")
    async with realtime_server() as server:

        def script(client: Client) -> list[dict]:
            client.append(quiet(300) + said + quiet(800))
            client.until("response.done")
            return client.events

        events = await talk(server.ws_url(), script)
    kinds = [e["type"] for e in events]
    order = [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "response.created",
        "response.done",
    ]
    assert [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order)
    started = events[kinds.index(order[0])]
    stopped = events[kinds.index(order[1])]
    speech_ms = len(said) // 48
    # the turn starts prefix_padding_ms (300) before the speech (eSpeak's own
    # leading silence is part of `said`), and ends where its trailing silence began
    # (as the model hears it: within a frame or two)
    assert 0 <= started["audio_start_ms"] <= 250
    assert 300 + speech_ms - 400 <= stopped["audio_end_ms"] <= 300 + speech_ms + 100
    (heard,) = [e for e in events if e["type"].endswith("transcription.completed")]
    # the answering request is the last (an earlier one may be a speculation that a
    # pause cancelled: the comma's)
    *_, prompt = server.script.prompts.values()
    assert heard["transcript"] == f"{len(prompt['audio']) // 48} ms of audio"
    assert len(prompt["audio"]) // 48 == stopped["audio_end_ms"] - started["audio_start_ms"]
    assert events[-1]["response"]["status"] == "completed"


@pytest.mark.parametrize("speculate", [True, False])
async def test_a_pause_within_a_turn_cancels_the_speculation_unseen(
    speech: Callable[[str], bytes], speculate: bool
) -> None:
    first, second = speech("Tell me something."), speech("Something about the sea.")
    options = RealtimeOptions(speculate=speculate)
    async with realtime_server(options=options, word_seconds=0.05) as server:

        def script(client: Client) -> list[dict]:
            # a 300 ms pause: past speculate_after_ms (150), short of the hangover (500)
            client.append(quiet(300) + first + quiet(300) + second + quiet(900))
            client.until("response.done")
            return client.events

        events = await talk(server.ws_url(), script)
        requests = list(server.script.prompts)
        if speculate:
            with trio.fail_after(5):
                await server.script.aborted.wait()
    kinds = [e["type"] for e in events]
    assert kinds.count("input_audio_buffer.speech_started") == 1
    assert kinds.count("response.created") == 1
    assert kinds.count("conversation.item.input_audio_transcription.completed") == 1
    # with speculation: a first guess at the pause (aborted everywhere, never shown),
    # then the one that answers
    assert len(requests) == (2 if speculate else 1)
    assert server.script.fully_aborted() == (requests[:1] if speculate else [])
    answered = server.script.prompts[requests[-1]]
    heard = next(e for e in events if e["type"].endswith("transcription.completed"))
    assert heard["transcript"] == f"{len(answered['audio']) // 48} ms of audio"


async def test_barge_in_cancels_the_answer_at_every_stage(speech: Callable[[str], bytes]) -> None:
    question, interruption = speech("Tell me a long story."), speech("Wait, stop please.")
    async with realtime_server(word_seconds=0.05) as server:

        def script(client: Client) -> list[dict]:
            client.append(quiet(300) + question + quiet(800))
            client.until(DELTAS[0])
            client.append(interruption + quiet(800))
            cancelled = client.until("response.done")
            assert cancelled["response"]["status"] == "cancelled"
            assert cancelled["response"]["status_details"]["reason"] == "turn_detected"
            done = client.until("response.done")
            assert done["response"]["status"] == "completed"
            return client.events

        events = await talk(server.ws_url(), script)
    first_id = next(e for e in events if e["type"] == "response.created")["response"]["id"]
    barge = [i for i, e in enumerate(events) if e["type"] == "input_audio_buffer.speech_started"][1]
    assert not [e for e in events[barge:] if e["type"] in DELTAS and e["response_id"] == first_id]
    first_request = next(iter(server.script.prompts))
    assert first_request in server.script.fully_aborted()
    heard = [e for e in events if e["type"].endswith("transcription.completed")]
    assert len(heard) == 2
