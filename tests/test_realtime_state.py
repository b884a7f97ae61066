"""A ``/v1/realtime`` session's decisions (``SessionState``), with no event loop and no
socket: client events and the detector's events in, commands out -- turns, speculation,
barge-in, and each response's end. The same rules run behind the real server in
tests/test_realtime.py; here each step and its commands are seen one by one.

The detector is scripted: each append hands the session the events the test queued,
so the rules are checked apart from any model's hearing.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from omni_trio import OrchOutput
from omni_trio.serve import FinalOutput, RealtimeOptions, ServedModel
from omni_trio.serve._realtime_conversation import Out
from omni_trio.serve._realtime_protocol import RealtimeError, decode_client_event
from omni_trio.serve._realtime_state import (
    Cancel,
    Response,
    Send,
    SessionState,
    Start,
    status_of,
)
from omni_trio.speech import SilenceStarted, SpeechResumed, SpeechStarted, SpeechStopped

MODEL = ServedModel(
    "omni-scripted",
    (
        FinalOutput(0, "transcript", "listen"),
        FinalOutput(1, "text", "thinker"),
        FinalOutput(2, "audio", "code2wav", 24_000),
    ),
)
#: 100 ms of 24 kHz PCM16.
PCM = bytes(4800)
#: A spoken turn's end, with a response to it: the events, in order.
TURN_ANSWERED = [
    "input_audio_buffer.speech_stopped",
    "input_audio_buffer.committed",
    "conversation.item.added",
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
]


class ScriptedDetector:
    """Hands the session, at each feed, the events queued in :attr:`next`."""

    def __init__(self, options: Any) -> None:
        self.options = options
        self.next: list[Any] = []
        self.resets = 0

    def feed(self, pcm: bytes) -> list[Any]:
        events, self.next = self.next, []
        return events

    def reset(self) -> None:
        self.resets += 1


class Harness:
    """A session's state, its scripted detector, and the client's side of it."""

    def __init__(self, **options: Any) -> None:
        self.detectors: list[ScriptedDetector] = []
        options = RealtimeOptions(detector=self._detector, **options)
        self.state = SessionState("sess_0123456789abcdef", MODEL, options)
        self.state.created()
        self.state.commands()

    def _detector(self, options: Any) -> ScriptedDetector:
        self.detectors.append(ScriptedDetector(options))
        return self.detectors[-1]

    def event(self, type: str, **fields: Any) -> list[Any]:
        """Handle a client event; its commands."""
        self.state.handle(decode_client_event(json.dumps({"type": type, **fields})))
        return self.state.commands()

    def append(self, *vad: Any, pcm: bytes = PCM) -> list[Any]:
        """Append audio, with the detector hearing ``vad`` in it."""
        if self.detectors:
            self.detectors[-1].next = list(vad)
        else:
            assert not vad, "the detector is made by the first append"
        return self.event("input_audio_buffer.append", audio=_b64(pcm))

    def say(self, text: str) -> list[Any]:
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        }
        return self.event("conversation.item.create", item=item)


def _b64(pcm: bytes) -> str:
    import base64

    return base64.b64encode(pcm).decode()


def kinds(commands: list[Any]) -> list[str]:
    """The commands, readably: an event's type, ``start``, ``cancel``."""
    out = []
    for command in commands:
        if isinstance(command, Send):
            out.append(json.loads(command.out.text)["type"])
        elif isinstance(command, Start):
            out.append("start")
        else:
            assert isinstance(command, Cancel)
            out.append("cancel")
    return out


def started(commands: list[Any]) -> Response:
    (start,) = [c for c in commands if isinstance(c, Start)]
    return start.response


def ended(state: SessionState, response: Response, reason: str = "completed") -> list[str]:
    terminal = OrchOutput("r", 2, None, True, reason)
    state.ended(response, *status_of(terminal))
    return kinds(state.commands())


# -- typed turns and manual commits ------------------------------------------------------


def test_a_typed_turn_is_answered_and_the_response_ends_told():
    h = Harness()
    assert kinds(h.say("hello")) == ["conversation.item.added", "conversation.item.done"]
    commands = h.event("response.create")
    assert kinds(commands) == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "start",
    ]
    response = started(commands)
    assert commands[-1].prompt == {"text": "hello", "context": []}
    assert h.state.response is response
    assert ended(h.state, response) == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert h.state.response is None
    assert not h.state.responses


def test_instructions_are_the_conversations_system_turn_and_usage_the_models():
    h = Harness()
    h.event("session.update", session={"type": "realtime", "instructions": "Be brief."})
    h.say("hello")
    commands = h.event("response.create")
    system = {"role": "system", "text": "Be brief."}
    assert commands[-1].prompt == {"text": "hello", "context": [system]}
    response = started(commands)
    usage = {"prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35}
    response.events.take([OrchOutput("r", 1, "Hi.", False, meta={"usage": usage})])
    ended(h.state, response)
    h.say("again")  # a response's own instructions stand for the session's, for it alone
    commands = h.event("response.create", response={"instructions": "Be long."})
    prompt = commands[-1].prompt
    assert prompt["context"][0] == {"role": "system", "text": "Be long."}
    assert prompt["context"][1:] == [
        {"role": "user", "text": "hello"},
        {"role": "assistant", "text": "Hi."},
    ]
    assert response.events.view("completed")["usage"] == {
        "total_tokens": 35,
        "input_tokens": 30,
        "output_tokens": 5,
        "input_token_details": {"text_tokens": 30, "audio_tokens": 0, "cached_tokens": 0},
        "output_token_details": {"text_tokens": 5, "audio_tokens": 0},
    }


def test_one_response_at_a_time():
    h = Harness()
    h.say("hello")
    h.event("response.create")
    with pytest.raises(RealtimeError, match="a response is in progress"):
        h.event("response.create", event_id="e9")


def test_response_cancel_cancels_and_the_end_says_cancelled():
    h = Harness()
    h.say("hello")
    response = started(h.event("response.create"))
    assert kinds(h.event("response.cancel")) == ["cancel"]
    assert h.state.response is None  # a new response may start at once
    h.state.ended(response, "completed", None)  # what the request said is overruled
    (*_, done) = h.state.commands()
    assert json.loads(done.out.text)["response"]["status"] == "cancelled"
    assert json.loads(done.out.text)["response"]["status_details"]["reason"] == ("client_cancelled")


def test_a_manual_commit_is_a_turn_of_the_buffers_audio():
    h = Harness()
    h.event(
        "session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
    )
    h.state.commands()
    h.append(pcm=bytes(48 * 300))
    assert kinds(h.event("input_audio_buffer.commit")) == [
        "input_audio_buffer.committed",
        "conversation.item.added",
    ]
    commands = h.event("response.create")
    prompt = commands[-1].prompt
    assert len(prompt["audio"]) == 48 * 300
    assert prompt["sample_rate"] == 24_000
    assert not h.detectors  # manual turns: no detector


# -- server VAD: turns, speculation, barge-in -------------------------------------------


def test_a_spoken_turn_is_committed_and_answered_when_it_ends():
    h = Harness(speculate=False)
    h.append()
    assert kinds(h.append(SpeechStarted(100))) == ["input_audio_buffer.speech_started"]
    h.append()
    commands = h.append(SpeechStopped(300))
    assert kinds(commands) == [*TURN_ANSWERED, "start"]
    # the turn: from the prefix padding before the speech (at most the buffer's
    # start) to where the silence began
    prompt = commands[-1].prompt
    assert len(prompt["audio"]) == 48 * 300


def test_a_speculation_is_held_then_promoted_when_the_turn_ends():
    h = Harness()
    h.append()
    h.append(SpeechStarted(100))
    commands = h.append(SilenceStarted(200))
    assert kinds(commands) == ["start"]  # unseen: nothing for the client yet
    speculation = started(commands)
    assert speculation.held
    delta = Out(json.dumps({"type": "response.output_audio_transcript.delta"}), words="hi")
    assert h.state.outgoing(speculation, [delta]) == []  # held back
    commands = h.append(SpeechStopped(200))
    # what it held goes out after the commit and the response's start
    assert kinds(commands) == [*TURN_ANSWERED, "response.output_audio_transcript.delta"]
    assert commands[-1].response is speculation
    assert h.state.response is speculation
    assert not speculation.held
    assert h.state.outgoing(speculation, [delta]) == [delta]


def test_a_speculation_that_ended_while_held_tells_its_end_after_the_commit():
    h = Harness()
    h.append()
    h.append(SpeechStarted(100))
    speculation = started(h.append(SilenceStarted(200)))
    assert ended(h.state, speculation) == []  # held: its end waits too
    commands = kinds(h.append(SpeechStopped(200)))
    assert commands.index("input_audio_buffer.committed") < commands.index("response.created")
    assert commands[-1] == "response.done"
    assert not h.state.responses


def test_speech_resuming_cancels_the_speculation_unseen():
    h = Harness()
    h.append()
    h.append(SpeechStarted(100))
    speculation = started(h.append(SilenceStarted(200)))
    assert kinds(h.append(SpeechResumed(300))) == ["cancel"]
    assert speculation.silent
    assert ended(h.state, speculation) == []  # never heard of
    assert not h.state.responses
    # the turn goes on, and its end starts a response of its own
    commands = h.append(SpeechStopped(400))
    assert started(commands) is not speculation


@pytest.mark.parametrize("interrupt", [True, False])
def test_speech_over_an_answer_cancels_it_before_saying_so(interrupt):
    h = Harness()
    h.event(
        "session.update",
        session={
            "type": "realtime",
            "audio": {
                "input": {
                    "turn_detection": {
                        "type": "server_vad",
                        "interrupt_response": interrupt,
                        "interrupt_min_ms": 0,  # at once (the default waits: below)
                    }
                }
            },
        },
    )
    h.say("tell me a story")
    answer = started(h.event("response.create"))
    h.append()
    commands = kinds(h.append(SpeechStarted(100)))
    if interrupt:
        # the cancel comes first: no delta of the answer after speech_started
        assert commands == ["cancel", "input_audio_buffer.speech_started"]
        assert answer.cancelled == "turn_detected"
        assert h.state.response is None
    else:
        assert commands == ["input_audio_buffer.speech_started"]
        assert h.state.response is answer


def test_speech_over_an_answer_interrupts_it_once_it_has_lasted_interrupt_min_ms():
    """By default speech over an answer must last 500 ms before it interrupts: until
    then the client hears nothing of it, and the answer goes on."""
    h = Harness()
    h.say("tell me a story")
    answer = started(h.event("response.create"))
    h.append()  # 0-100 ms: the detector is made
    # to 200 ms: speech from 150 ms must last to 650 ms; with no silence said by 800
    # ms (the detector says one 150 ms into it), it did
    assert kinds(h.append(SpeechStarted(150))) == []
    for _ in range(5):  # to 700 ms
        assert kinds(h.append()) == []
    assert answer.cancelled is None
    assert kinds(h.append()) == ["cancel", "input_audio_buffer.speech_started"]  # 800 ms
    assert answer.cancelled == "turn_detected"
    stopped = kinds(h.append(SpeechStopped(900)))  # a turn: committed and answered
    assert stopped[:2] == ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed"]
    assert "start" in stopped


def test_a_backchannel_over_an_answer_is_dropped_and_the_answer_goes_on():
    h = Harness()
    h.say("tell me a story")
    answer = started(h.event("response.create"))
    h.append()
    assert kinds(h.append(SpeechStarted(150))) == []  # "yeah": 250 ms of speech
    assert kinds(h.append(SpeechStopped(400), SilenceStarted(400))) == []
    assert answer.cancelled is None
    assert h.state.response is answer
    assert kinds(h.append(SpeechStopped(800))) == []  # no turn to end


def test_clear_drops_the_turn_and_its_speculation():
    h = Harness()
    h.append()
    h.append(SpeechStarted(100))
    speculation = started(h.append(SilenceStarted(200)))
    assert kinds(h.event("input_audio_buffer.clear")) == ["cancel", "input_audio_buffer.cleared"]
    assert speculation.silent
    assert h.detectors[-1].resets == 1
    # the turn is gone: its end is no turn
    assert kinds(h.append(SpeechStopped(300))) == []


def test_a_session_update_remakes_the_detector_with_its_settings():
    h = Harness()
    h.append()
    h.event(
        "session.update",
        session={
            "type": "realtime",
            "audio": {
                "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 800}}
            },
        },
    )
    h.append()
    first, second = h.detectors
    assert (first.options.silence_duration_ms, second.options.silence_duration_ms) == (500, 800)
    assert second.options.speculate_after_ms == 150


def test_cancel_all_cancels_every_response():
    h = Harness()
    detection = {"type": "server_vad", "interrupt_min_ms": 0}
    h.event(
        "session.update",
        session={"type": "realtime", "audio": {"input": {"turn_detection": detection}}},
    )
    h.say("one")
    answer = started(h.event("response.create"))
    h.append()
    h.append(SpeechStarted(100))
    speculation = started(h.append(SilenceStarted(200)))
    h.state.cancel_all("client_disconnected", silent=True)
    assert kinds(h.state.commands()) == ["cancel", "cancel"]
    # the answer was cancelled by the speech already (turn_detected): that stays
    assert (answer.cancelled, speculation.cancelled) == ("turn_detected", "client_disconnected")


def test_status_of_a_terminal():
    assert status_of(None)[0] == "failed"
    assert status_of(OrchOutput("r", 1, None, True, "completed")) == ("completed", None)
    failed, details = status_of(OrchOutput("r", 1, None, True, "error", error="boom"))
    assert failed == "failed"
    assert details["error"]["message"] == "boom"
    assert status_of(OrchOutput("r", 1, None, True, "aborted"))[0] == "incomplete"


def test_the_state_module_needs_no_event_loop():
    import subprocess
    import sys

    probe = (
        "import sys; import omni_trio.serve._realtime_state; "
        "assert not {'trio', 'asyncio', 'anyio'} & set(sys.modules), "
        "sorted({'trio', 'asyncio', 'anyio'} & set(sys.modules))"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)


def test_turn_detection_starts_as_server_vad_for_a_model_that_hears_only():
    text_only = ServedModel("omni-text", (FinalOutput(0, "text", "thinker"),))
    for model, expected in [(MODEL, "server_vad"), (text_only, None)]:
        state = SessionState("sess_0123456789abcdef", model, RealtimeOptions())
        state.created()
        (created,) = state.commands()
        detection = json.loads(created.out.text)["session"]["audio"]["input"]["turn_detection"]
        assert (detection and detection["type"]) == expected


def test_a_speculation_that_ended_held_is_forgotten_when_speech_resumes():
    """Its request is over (nothing to cancel), its end was never told: it goes
    unseen, and the session holds nothing of it (an idle session can time out)."""
    h = Harness()
    h.append()
    h.append(SpeechStarted(100))
    speculation = started(h.append(SilenceStarted(200)))
    assert ended(h.state, speculation) == []
    assert h.state.responses == {speculation}
    assert kinds(h.append(SpeechResumed(300))) == []
    assert speculation.silent
    assert not h.state.responses


def test_a_speculation_holds_its_events_up_to_the_outbox_bound():
    h = Harness(outbox_bytes=1000)
    h.append()
    h.append(SpeechStarted(100))
    speculation = started(h.append(SilenceStarted(200)))
    delta = Out(json.dumps({"type": "response.output_audio.delta", "delta": "x" * 400}))
    h.state.outgoing(speculation, [delta, delta])
    assert not h.state.holds_too_much(speculation)
    h.state.outgoing(speculation, [delta])
    assert h.state.holds_too_much(speculation)  # its request waits
    h.append(SpeechStopped(200))  # the turn is over: what it held goes out
    assert not h.state.holds_too_much(speculation)
    assert speculation.held_bytes == 0
