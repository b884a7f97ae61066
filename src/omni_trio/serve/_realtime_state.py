"""One ``/v1/realtime`` session's decisions, with no I/O (as ``_core`` is the
orchestrator's): what each client event and each event of the voice activity
detector does to the conversation, the input audio buffer, the turn being spoken and
the responses -- and what must follow, as commands its Trio driver
(``_realtime_session``) carries out in order: :class:`SendEvent` an event to the client,
:class:`Start` a response's request, :class:`Cancel` one.

Turn-taking lives here: a turn starts with speech; with speculation a response starts
held when its silence begins, and is promoted when the turn ends or cancelled unseen
when speech resumes; speech over an answer cancels it (barge-in). Every step is a
plain call, so the rules are testable without a socket or an event loop.

The turn and each response are in explicit states (``TurnState``, ``ResponseState``),
and every change of one is looked up in ``_realtime_table``'s tables: a change with
no entry raises ``TransitionError`` (a bug here, never the client's). Client events
and the detector's reach their handlers through tables keyed by their types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeAlias

import attrs
from msgspec import UNSET

from ._realtime_conversation import AudioBuffer, Conversation, Item, Out, ResponseEvents, Status
from ._realtime_protocol import (
    SAMPLE_RATE,
    ConversationItemCreate,
    ConversationItemTruncate,
    InputAudioBufferAppend,
    InputAudioBufferClear,
    InputAudioBufferCommit,
    RealtimeError,
    ResponseCancel,
    ResponseCreate,
    ServerEvents,
    SessionUpdate,
)
from ._realtime_table import RESPONSES, TURNS, ResponseState, ResponseStep, TurnState, TurnStep

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._messages import OrchOutput
    from ..speech import SilenceStarted, SpeechResumed, SpeechStarted, SpeechStopped, VadEvent
    from ._model import FinalOutput, ServedModel
    from ._realtime_options import Detector, RealtimeOptions
    from ._realtime_protocol import ClientEvent, TurnDetection

__all__ = [
    "Cancel",
    "Command",
    "Response",
    "SendEvent",
    "SessionState",
    "Start",
    "failed",
    "status_of",
]

#: The least audio a commit takes (OpenAI's rule: 100 ms).
_MIN_COMMIT_MS = 100


@attrs.define(eq=False)
class Response:
    """One response: its events, the user turn it answers, and where it stands.

    Attributes:
      state: Where it stands (``_realtime_table.RESPONSES`` says where it may go).
      backlog: What it made while held (of ``held_bytes``), waiting for its turn's
          commit.
      done: Its last events, if it ended while held.
      cancelled: Why it was cancelled (its ``status_details.reason``), if it was.
    """

    events: ResponseEvents
    turn: Item | None
    state: ResponseState = ResponseState.LIVE
    backlog: list[Out] = attrs.field(factory=list)
    held_bytes: int = 0
    done: list[str] = attrs.field(factory=list)
    cancelled: str | None = None

    @property
    def held(self) -> bool:
        """A speculation not promoted: what it makes waits (for good, once dropped)."""
        return self.state in _HELD

    @property
    def silent(self) -> bool:
        """Cancelled unseen: the client hears nothing more of it."""
        return self.state in _SILENT

    @property
    def ended(self) -> bool:
        """Its request is over."""
        return self.state in _ENDED


_HELD = frozenset({ResponseState.HELD, ResponseState.HELD_ENDED, ResponseState.DROPPED})
_SILENT = frozenset({ResponseState.DROPPED, ResponseState.UNSEEN, ResponseState.FORGOTTEN})
_ENDED = frozenset({ResponseState.HELD_ENDED, ResponseState.TOLD, ResponseState.FORGOTTEN})
#: A speculation its turn's end makes the answer (not dropped).
_PROMOTABLE = frozenset({ResponseState.HELD, ResponseState.HELD_ENDED})
#: The turn over an answer, not yet long enough to interrupt it.
_PENDING = frozenset({TurnState.PENDING, TurnState.PENDING_SILENCE})
#: No turn (a set: a lookup is cheaper than ``TurnState.IDLE``, on every append).
_BETWEEN = frozenset({TurnState.IDLE})


@attrs.frozen
class SendEvent:
    """Command: queue ``out`` for the client. A response's event (``response`` set)
    is dropped if the response is cancelled before it is written."""

    out: Out
    response: Response | None = None


@attrs.frozen
class Start:
    """Command: run ``response``'s request, with ``prompt`` as its input; then tell
    :meth:`SessionState.ended`."""

    response: Response
    prompt: Any


@attrs.frozen
class Cancel:
    """Command: cancel ``response``'s request (its ``Start`` came first)."""

    response: Response


Command: TypeAlias = SendEvent | Start | Cancel


#: How long a turn whose speech started may go without audio before it is committed:
#: a client that stops sending mid-speech (a file with no silence after it) is not
#: waited for forever.
DEFAULT_TURN_IDLE_TIMEOUT_MS = 2_000
#: How long speech over an answer must last before it interrupts the answer: the
#: server VAD hears eSpeak NG's backchannels ("yeah", "hmm", "right", "uh-huh",
#: "ok") as 256 to 512 ms of speech, a real interruption as a second and more
#: (docs/voice.md, "Interruptions").
DEFAULT_INTERRUPT_MIN_MS = 500


@attrs.define
class _Turns:
    """The session's turn detection: server VAD's settings (``None``: manual)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    #: A turn in speech with no audio coming for this long is committed as it is.
    idle_timeout_ms: int = DEFAULT_TURN_IDLE_TIMEOUT_MS
    #: Speech over an answer interrupts it once it has lasted this long (ms).
    interrupt_min_ms: int = DEFAULT_INTERRUPT_MIN_MS

    def update(self, detection: TurnDetection) -> None:
        for name in (
            "threshold",
            "prefix_padding_ms",
            "silence_duration_ms",
            "create_response",
            "interrupt_response",
            "idle_timeout_ms",
            "interrupt_min_ms",
        ):
            value = getattr(detection, name)
            if value is not None:
                setattr(self, name, value)

    def view(self) -> dict[str, Any]:
        return {"type": "server_vad", **attrs.asdict(self)}


class SessionState:
    """One session's conversation and turns, driven by plain calls: each call queues
    the commands that follow from it, in order, for :meth:`commands`.

    Args:
      session_id: The session's id (``sess_...``).
      model: The served model: its name, its outputs, whether it listens.
      options: The endpoint's options (the buffer's limit, speculation, the trace
          hook).

    The session's voice activity detector is made at the first append with server
    VAD on, by ``options.detector``.
    """

    def __init__(self, session_id: str, model: ServedModel, options: RealtimeOptions) -> None:
        self.id = session_id
        self._model = model
        self._options = options
        self._events = ServerEvents(session_id[5:13] + "_")
        self._conversation = Conversation(prefix=f"item_{session_id[5:13]}_")
        self._buffer = AudioBuffer(int(options.max_buffer_seconds * SAMPLE_RATE) * 2)
        self._modality: Literal["audio", "text"] = (
            "audio" if "audio" in model.modalities else "text"
        )
        # server VAD by default, as OpenAI's; manual turns for a model that cannot hear
        self._turns: _Turns | None = None if model.hearing is None else _Turns()
        self._vad: Detector | None = None  # made at the first append
        self._vad_offset = 0  # the session's audio clock when the detector started
        #: Where the user's turn stands (``_realtime_table.TURNS`` says where it may go).
        self._turn_state = TurnState.IDLE
        self._turn: Item | None = None  # the user turn being spoken (server VAD)
        self._turn_start = 0
        #: A turn begun over an answer, not yet long enough to interrupt it (PENDING):
        #: the session's audio time at which it will.
        self._pending: int | None = None
        #: Where its silence began, if the detector has said (PENDING_SILENCE: its
        #: speech may be over).
        self._pending_silence: int | None = None
        #: The response answering now (not a speculation).
        self.response: Response | None = None
        self._speculation: Response | None = None
        #: Every response not yet ended and told.
        self.responses: set[Response] = set()
        self._instructions = ""
        #: The answers' voice (``audio.output.voice``; ``None``: the talker's own).
        self._voice: str | None = None
        self._ids = 0
        self._commands: list[Command] = []

    def commands(self) -> list[Command]:
        """The commands queued since the last call, in order."""
        commands, self._commands = self._commands, []
        return commands

    @property
    def turn_state(self) -> TurnState:
        """Where the user's turn stands."""
        return self._turn_state

    def _step(self, step: TurnStep) -> None:
        """The turn takes ``step``: its new state is the table's (or TransitionError)."""
        self._turn_state = TURNS(self._turn_state, step)

    # -- what the driver tells ----------------------------------------------------------

    def created(self) -> None:
        """The session has begun: ``session.created``."""
        self._put("session.created", session=self._view())

    def error(self, error: RealtimeError) -> None:
        """A client event was refused: the client gets ``error``."""
        self._commands.append(SendEvent(Out(self._events.error(error))))

    def handle(self, event: ClientEvent) -> None:
        """A client event, handed to its handler by its type.

        Raises:
          RealtimeError: the event is refused (the session goes on).
          TransitionError: a change of state the tables do not have: a bug here.
        """
        self._CLIENT_EVENTS[type(event)](self, event)

    def cancel_all(self, reason: str, *, silent: bool = False) -> None:
        """Cancel every response (the session ends)."""
        for response in list(self.responses):
            self._cancel(response, reason, silent=silent)

    def outgoing(self, response: Response, outs: list[Out]) -> list[Out]:
        """Of a response's new events, those to send now: none while it is held
        (they wait for its turn's commit)."""
        if response.state in _HELD:
            response.backlog += outs
            response.held_bytes += sum(len(out.text) for out in outs)
            return []
        return outs

    def holds_too_much(self, response: Response) -> bool:
        """``response`` is held and holds more than ``outbox_bytes``: it must wait
        (read no more of its request) until its turn ends or it is cancelled."""
        return response.state in _HELD and response.held_bytes > self._options.outbox_bytes

    def ended(self, response: Response, status: Status, details: dict[str, Any] | None) -> Status:
        """``response``'s request is over, as ``status``: its last events follow (or
        wait, if it is held). Returns its status as told (``cancelled`` if it was).

        Raises:
          TransitionError: its end was told already (a bug of the driver's).
        """
        if response.cancelled is not None:
            status, details = "cancelled", {"type": "cancelled", "reason": response.cancelled}
        state = response.state = RESPONSES(response.state, ResponseStep.END)
        if state is ResponseState.FORGOTTEN:  # cancelled unseen
            self.responses.discard(response)
            return status
        done = response.events.done(status, details)
        if state is ResponseState.HELD_ENDED:  # the turn is not over yet: these wait
            response.done = done
            return status
        self._commands += [SendEvent(Out(text)) for text in done]
        self.trace("response_done", response.events.id)
        self._finished(response)
        return status

    # -- client events ----------------------------------------------------------------

    def trace(self, what: str, ref: str) -> None:
        """Tell ``options.trace`` of a step of the session (``what``, of ``ref``)."""
        trace = self._options.trace
        if trace is not None:
            trace(self.id, what, ref)

    def _put(self, type: str, **fields: Any) -> None:
        self._commands.append(SendEvent(Out(self._events.event(type, **fields))))

    def _view(self) -> dict[str, Any]:
        audio = {"format": {"type": "audio/pcm", "rate": SAMPLE_RATE}}
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id,
            "model": self._model.name,
            "output_modalities": [self._modality],
            "instructions": self._instructions,
            "audio": {
                "input": {
                    **audio,
                    "turn_detection": None if self._turns is None else self._turns.view(),
                },
                "output": {**audio, "voice": self._voice},
            },
        }

    def _update(self, event: SessionUpdate) -> None:
        session = event.session
        if session.output_modalities is not UNSET:
            (wanted,) = session.output_modalities
            if wanted not in self._model.modalities:
                raise RealtimeError(
                    f"session.output_modalities: model {self._model.name!r} has no {wanted} output",
                    event_id=event.event_id,
                    param="session.output_modalities",
                )
            self._modality = wanted
        if session.instructions is not UNSET:
            self._instructions = session.instructions
        if session.audio is not UNSET and session.audio.output is not UNSET:
            voice = session.audio.output.voice
            if voice is not UNSET:
                self._voice = self._check_voice(voice, event.event_id)
        if session.audio is not UNSET and session.audio.input is not UNSET:
            detection = session.audio.input.turn_detection
            if detection is None:
                self._turns = None
                self._forget_turn()
                self._vad = None
            elif detection is not UNSET:
                turns = self._turns or _Turns()
                turns.update(detection)
                self._turns = turns
                self._forget_turn()
                self._vad = None  # made again, with these settings, at the next append
        self._put("session.updated", session=self._view())

    def _check_voice(self, voice: str, event_id: str | None) -> str | None:
        """The voice the answers will speak in: ``voice`` where the model speaks
        (one of OpenAI's voices or eSpeak NG's), else ``None`` (accepted, unused)."""
        if self._model.speech is None:
            return None
        from ..speech._voices import VOICES
        from ._voice import knows_voice

        if voice not in VOICES and not knows_voice(voice):
            raise RealtimeError(
                f"session.audio.output.voice: unknown voice {voice!r}: the voices are "
                f"{', '.join(sorted(VOICES))}, or an eSpeak NG voice's name",
                event_id=event_id,
                param="session.audio.output.voice",
            )
        return voice

    def _hearing(self, event_id: str | None, param: str) -> FinalOutput:
        hearing = self._model.hearing
        if hearing is None:
            raise RealtimeError(
                f"{param}: model {self._model.name!r} cannot listen: its pipeline "
                'has no listening stage (final_output_type = "transcript")',
                event_id=event_id,
                param=param,
                code="audio_not_supported",
            )
        return hearing

    def _append(self, event: InputAudioBufferAppend) -> None:
        self._hearing(event.event_id, "audio")
        self._buffer.append(event.pcm, event.event_id)
        turns = self._turns
        if turns is None:
            return
        if self._vad is None:
            self._vad = self._detector(turns, event.event_id)
            self._vad_offset = self._buffer.end_ms - len(event.pcm) // 48
        for happened in self._vad.feed(event.pcm):
            self._on_vad(happened)
        self._heard_long_enough()
        if self._turn_state in _BETWEEN:  # between turns: keep no more than a turn's padding
            self._buffer.drop_before(self._buffer.end_ms - turns.prefix_padding_ms)

    def _detector(self, turns: _Turns, event_id: str | None) -> Detector:
        try:
            from ..speech import VadOptions, VoiceActivityDetector

            options = VadOptions(
                threshold=turns.threshold,
                prefix_padding_ms=turns.prefix_padding_ms,
                silence_duration_ms=turns.silence_duration_ms,
                speculate_after_ms=(
                    self._speculate_after(turns.silence_duration_ms)
                    if self._options.speculate
                    else 0
                ),
            )
            if self._options.detector is not None:
                return self._options.detector(options)
            return VoiceActivityDetector(options, sample_rate=SAMPLE_RATE)
        except ImportError as exc:
            raise RealtimeError(
                f"audio: server VAD needs the voice extra (pip install 'omni-trio[voice]'): "
                f"{exc}; or turn it off (turn_detection null) and commit turns yourself",
                event_id=event_id,
                param="audio",
                type="server_error",
                code="vad_unavailable",
            ) from None

    def _speculate_after(self, silence_ms: int) -> int:
        wanted = self._options.speculate_after_ms
        return wanted if wanted < silence_ms else silence_ms // 2

    def _on_vad(self, happened: VadEvent) -> None:
        (self._VAD_EVENTS or self._vad_events())[type(happened)](self, happened)

    def _speech_began(self, happened: SpeechStarted) -> None:
        turns = self._turns
        assert turns is not None
        offset = self._vad_offset
        start = max(
            self._buffer.start_ms, offset + happened.audio_start_ms - turns.prefix_padding_ms
        )
        self._turn = Item(self._conversation.new_id(), "user")
        self._turn_start = start
        if turns.interrupt_response and self.response is not None and turns.interrupt_min_ms:
            # over an answer: it interrupts only once it has lasted long enough
            self._step(TurnStep.SPEECH_OVER_ANSWER)
            self._pending = offset + happened.audio_start_ms + turns.interrupt_min_ms
            self.trace("speech_pending", self._turn.id)
            return
        self._speech_started(TurnStep.SPEECH_STARTED)

    def _silence_began(self, happened: SilenceStarted) -> None:
        turns = self._turns
        assert turns is not None
        pending = self._turn_state in _PENDING  # a turn over an answer, too short so far
        self._step(TurnStep.SILENCE_STARTED)
        if pending:
            self._pending_silence = self._vad_offset + happened.audio_ms
            return
        turn = self._turn
        if turn is None:
            return
        self.trace("silence_started", turn.id)
        if turns.create_response and self._options.speculate:
            turn.audio = self._buffer.between(
                self._turn_start, self._vad_offset + happened.audio_ms
            )
            self._speculation = self._start(turn, self._modality, held=True)

    def _speech_resumed(self, happened: SpeechResumed) -> None:
        pending = self._turn_state in _PENDING
        self._step(TurnStep.SPEECH_RESUMED)
        if pending:
            self._pending_silence = None
        else:
            self._drop_speculation()

    def _speech_stopped(self, happened: SpeechStopped) -> None:
        turns = self._turns
        assert turns is not None
        end = self._vad_offset + happened.audio_end_ms
        if self._turn_state in _PENDING:  # a turn over an answer, too short so far
            assert self._pending is not None
            if end < self._pending and self.response is not None:
                self._backchannel(end)  # it did not last: the answer goes on
                return
            self._speech_started(TurnStep.INTERRUPT)  # it did, or the answer ended meanwhile
        self._step(TurnStep.SPEECH_STOPPED)
        turn, self._turn = self._turn, None
        if turn is None:
            return
        self.trace("speech_stopped", turn.id)
        self._put("input_audio_buffer.speech_stopped", audio_end_ms=end, item_id=turn.id)
        turn.audio = self._buffer.between(self._turn_start, end)
        self._buffer.drop_before(end)
        self._committed(turn)
        speculation, self._speculation = self._speculation, None
        if not turns.create_response:
            return
        if speculation is not None and speculation.state in _PROMOTABLE:
            self._promote(speculation)
        else:
            self.response = self._start(turn, self._modality)

    def _speech_started(self, step: TurnStep) -> None:
        """The turn is the user's (``step``): an answer it speaks over is interrupted,
        and the client is told (``speech_started``)."""
        turn, turns = self._turn, self._turns
        assert turn is not None
        assert turns is not None
        self._step(step)
        self._pending = self._pending_silence = None
        self.trace("speech_started", turn.id)
        if turns.interrupt_response and self.response is not None:
            self._cancel(self.response, "turn_detected")
        self._put(
            "input_audio_buffer.speech_started", audio_start_ms=self._turn_start, item_id=turn.id
        )

    def _backchannel(self, end: int) -> None:
        """Speech over an answer stopped before ``interrupt_min_ms``: a backchannel,
        a cough. It is dropped, unsaid: no turn, and the answer goes on."""
        turn = self._turn
        assert turn is not None
        self.trace("backchannel", turn.id)
        self._step(TurnStep.BACKCHANNEL)
        self._turn, self._pending, self._pending_silence = None, None, None
        self._buffer.drop_before(end)

    def _heard_long_enough(self) -> None:
        """After an append: a pending turn whose speech went on past
        ``interrupt_min_ms`` interrupts the answer now. The detector says a silence
        began only once it has lasted a while (its speculation hint, or the whole
        hangover without one), so the speech is known to have lasted only when the
        audio has gone that much further with no silence said -- or a silence was
        said that began after the bound."""
        state = self._turn_state
        if state not in _PENDING:
            return  # most appends
        pending, turns = self._pending, self._turns
        assert pending is not None
        assert turns is not None
        if state is TurnState.PENDING_SILENCE:
            silence = self._pending_silence
            assert silence is not None
            if silence >= pending:
                self._speech_started(TurnStep.INTERRUPT)
            return
        lag = (
            self._speculate_after(turns.silence_duration_ms)
            if self._options.speculate
            else turns.silence_duration_ms
        )
        if self._buffer.end_ms >= pending + lag:
            self._speech_started(TurnStep.INTERRUPT)

    @property
    def turn_idle_timeout(self) -> float | None:
        """Seconds the session may wait for more audio before :meth:`turn_timed_out`:
        while a turn's speech goes on under server VAD; else ``None``."""
        turns = self._turns
        if turns is None or self._turn_state in _BETWEEN:
            return None
        return turns.idle_timeout_ms / 1000

    def turn_timed_out(self) -> None:
        """No audio came for ``idle_timeout_ms`` while a turn's speech went on: the
        turn ends where its audio does (``input_audio_buffer.timeout_triggered``),
        and is committed and answered as one whose silence ended it."""
        from ..speech import SpeechStopped

        turn, turns = self._turn, self._turns
        if turn is None or turns is None:
            return
        end = self._buffer.end_ms
        self.trace("timeout_triggered", turn.id)
        self._put(
            "input_audio_buffer.timeout_triggered",
            audio_start_ms=self._turn_start,
            audio_end_ms=end,
            item_id=turn.id,
        )
        if self._vad is not None:
            self._vad.reset()
        self._on_vad(SpeechStopped(end - self._vad_offset))

    def _forget_turn(self) -> None:
        self._drop_speculation()
        self._step(TurnStep.FORGET)
        self._turn, self._pending, self._pending_silence = None, None, None

    def _drop_speculation(self) -> None:
        speculation, self._speculation = self._speculation, None
        if speculation is not None:
            self._cancel(speculation, "turn_detected", silent=True)

    def _committed(self, turn: Item) -> None:
        for item in self._conversation.items:  # only the newest turn keeps its audio
            item.audio = None
        turn.spoken = True
        previous = self._previous_id()
        self._conversation.add(turn)
        self._put("input_audio_buffer.committed", item_id=turn.id, previous_item_id=previous)
        self._put(
            "conversation.item.added", previous_item_id=previous, item=turn.view("in_progress")
        )

    def _commit(self, event: InputAudioBufferCommit) -> None:
        event_id = event.event_id
        self._hearing(event_id, "type")
        if self._buffer.end_ms - self._buffer.start_ms < _MIN_COMMIT_MS:
            raise RealtimeError(
                f"the input audio buffer holds {self._buffer.end_ms - self._buffer.start_ms} ms "
                f"of audio: a commit needs at least {_MIN_COMMIT_MS} ms",
                event_id=event_id,
                code="input_audio_buffer_commit_empty",
            )
        turn = self._turn or Item(self._conversation.new_id(), "user")
        self._forget_turn()
        if self._vad is not None:
            self._vad.reset()
        turn.audio = self._buffer.take()
        self._committed(turn)

    def _clear(self, event: InputAudioBufferClear) -> None:
        self._forget_turn()
        if self._vad is not None:
            self._vad.reset()
        self._buffer.clear()
        self._put("input_audio_buffer.cleared")

    def _truncate(self, event: ConversationItemTruncate) -> None:
        item = self._conversation.truncate(event.item_id, event.audio_end_ms, event.event_id)
        self._put(
            "conversation.item.truncated",
            item_id=item.id,
            content_index=event.content_index,
            audio_end_ms=event.audio_end_ms,
            transcript=item.text or "",  # ours: what the answer now says
        )

    def _create_item(self, event: ConversationItemCreate) -> None:
        text = event.text()
        item = event.item
        new = Item(item.id or self._conversation.new_id(), "user", text)
        if item.role == "assistant":
            new.role = "assistant"
        previous = self._previous_id()
        self._conversation.add(new)
        self._put("conversation.item.added", previous_item_id=previous, item=new.view())
        self._put("conversation.item.done", previous_item_id=previous, item=new.view())

    def _create_response(self, event: ResponseCreate) -> None:
        if self.response is not None:
            raise RealtimeError(
                f"a response is in progress ({self.response.events.id}): cancel it first, "
                "or wait for its response.done",
                event_id=event.event_id,
                code="conversation_already_has_active_response",
            )
        turn = self._conversation.last_user()
        if turn is None:
            raise RealtimeError(
                "there is nothing to respond to: commit audio or create a user message first",
                event_id=event.event_id,
                code="conversation_empty",
            )
        modality = self._modality
        params = event.response
        if params is not None and params.output_modalities:
            (modality,) = params.output_modalities[:1]
            if modality not in self._model.modalities:
                raise RealtimeError(
                    f"response.output_modalities: model {self._model.name!r} has no "
                    f"{modality} output",
                    event_id=event.event_id,
                    param="response.output_modalities",
                )
        instructions = None if params is None else params.instructions
        self.response = self._start(turn, modality, instructions=instructions)

    def _cancel_response(self, event: ResponseCancel) -> None:
        response = self.response
        if response is None:
            raise RealtimeError(
                "there is no response to cancel",
                event_id=event.event_id,
                code="response_cancel_not_active",
            )
        if event.response_id is not None and event.response_id != response.events.id:
            raise RealtimeError(
                f"response_id: {event.response_id!r} is not the response in progress "
                f"({response.events.id})",
                event_id=event.event_id,
                param="response_id",
                code="response_cancel_not_active",
            )
        self._cancel(response, "client_cancelled")

    # -- responses ----------------------------------------------------------------------

    def _start(
        self,
        turn: Item,
        modality: Literal["audio", "text"],
        held: bool = False,
        *,
        instructions: str | None = None,
    ) -> Response:
        model = self._model
        self._ids += 1
        answer = Item(self._conversation.new_id(), "assistant", "")
        outputs = {o.stage_id: o for o in model.outputs if o.modality in (modality, "transcript")}
        if modality == "audio":  # the answer's transcript, too
            outputs |= {o.stage_id: o for o in model.outputs if o.modality == "text"}
        heard = turn if turn.audio is not None else None
        events = ResponseEvents(
            self._events,
            f"resp_{self.id[5:13]}_{self._ids}",
            answer,
            heard,
            outputs,
            modality,
            _resampler(model.outputs) if modality == "audio" else _unchanged,
        )
        response = Response(events, turn, ResponseState.HELD if held else ResponseState.LIVE)
        self.responses.add(response)
        self.trace("response_started", response.events.id)
        if not held:
            self._announce(response)
        prompt = self._prompt(turn, self._instructions if instructions is None else instructions)
        if modality == "audio" and self._voice is not None:
            from ..speech._voices import settings

            asked = settings(self._voice)
            prompt = (
                {**prompt, "speech": asked}
                if isinstance(prompt, dict)
                else {"text": prompt, "speech": asked}
            )
        self._commands.append(Start(response, prompt))
        return response

    def _prompt(self, turn: Item, instructions: str) -> Any:
        """The response's request: for a model that takes utterances, the turn (its
        audio, or its text), the conversation before it, and the instructions (the
        session's, or the response's own) as the first, system, turn; for one that
        takes text, the turn's text."""
        if not self._model.takes_utterances:
            return turn.text or ""
        context = self._conversation.context(turn)
        if instructions.strip():
            context.insert(0, {"role": "system", "text": instructions})
        if turn.audio is not None:
            return {"audio": turn.audio, "sample_rate": SAMPLE_RATE, "context": context}
        return {"text": turn.text or "", "context": context}

    def _promote(self, response: Response) -> None:
        """The turn is over: the speculation becomes the response, and what it held
        goes out after the turn's commit."""
        self.response = response
        state = response.state = RESPONSES(response.state, ResponseStep.PROMOTE)
        self._announce(response)
        backlog, response.backlog = response.backlog, []
        response.held_bytes = 0
        self._commands += [SendEvent(out, response) for out in backlog]
        self._commands += [SendEvent(Out(text)) for text in response.done]  # it ended while held
        if state is ResponseState.TOLD:
            self._finished(response)

    def _announce(self, response: Response) -> None:
        """``response.created``: its answer joins the conversation."""
        previous = self._previous_id()
        self._conversation.add(response.events.answer)
        self._commands += [
            SendEvent(Out(text), response) for text in response.events.created(previous)
        ]

    def _previous_id(self) -> str | None:
        items = self._conversation.items
        return items[-1].id if items else None

    def _cancel(self, response: Response, reason: str, *, silent: bool = False) -> None:
        was = response.state
        state = response.state = RESPONSES(
            was, ResponseStep.CANCEL_UNSEEN if silent else ResponseStep.CANCEL
        )
        if response.cancelled is None:
            response.cancelled = reason
            self.trace("response_cancelled", response.events.id)
        if was not in _ENDED:  # its request runs
            self._commands.append(Cancel(response))
        elif state is ResponseState.FORGOTTEN:  # a speculation that ended held: unseen
            self.responses.discard(response)
        if self.response is response:
            self.response = None

    def _finished(self, response: Response) -> None:
        self.responses.discard(response)
        if self.response is response:
            self.response = None

    #: Each client event's handler, by its type.
    _CLIENT_EVENTS: ClassVar[dict[type[Any], Callable[[SessionState, Any], None]]] = {
        InputAudioBufferAppend: _append,
        SessionUpdate: _update,
        InputAudioBufferCommit: _commit,
        InputAudioBufferClear: _clear,
        ConversationItemCreate: _create_item,
        ConversationItemTruncate: _truncate,
        ResponseCreate: _create_response,
        ResponseCancel: _cancel_response,
    }
    #: Each of the detector's events' handler, by its type (:meth:`_vad_events`).
    _VAD_EVENTS: ClassVar[dict[type[Any], Callable[[SessionState, Any], None]]] = {}

    @classmethod
    def _vad_events(cls) -> dict[type[Any], Callable[[SessionState, Any], None]]:
        """:attr:`_VAD_EVENTS`, filled at the first detector's event (they are
        ``omni_trio.speech``'s, imported with the detector)."""
        from ..speech import SilenceStarted, SpeechResumed, SpeechStarted, SpeechStopped

        cls._VAD_EVENTS.update(
            {
                SpeechStarted: cls._speech_began,
                SilenceStarted: cls._silence_began,
                SpeechResumed: cls._speech_resumed,
                SpeechStopped: cls._speech_stopped,
            }
        )
        return cls._VAD_EVENTS


def failed(message: str) -> dict[str, Any]:
    """A failed response's ``status_details``."""
    return {"type": "failed", "error": {"type": "server_error", "message": message}}


def status_of(terminal: OrchOutput | None) -> tuple[Status, dict[str, Any] | None]:
    """A response's status and details from its request's terminal (``None``: the
    request was not admitted)."""
    if terminal is None:
        return "failed", failed("the request was not admitted")
    if terminal.finish_reason == "completed":
        return "completed", None
    if terminal.finish_reason == "error":
        return "failed", failed(terminal.error or "the request failed")
    return "incomplete", {"type": "incomplete", "reason": "aborted"}


def _unchanged(pcm: bytes) -> bytes:
    return pcm


def _resampler(outputs: tuple[FinalOutput, ...]) -> Callable[[bytes], bytes]:
    """24 kHz from the audio stage's rate, carried chunk to chunk (one per response)."""
    rate = next((o.sample_rate for o in outputs if o.modality == "audio"), SAMPLE_RATE)
    if rate == SAMPLE_RATE:
        return _unchanged
    from ..speech import Resampler

    return Resampler(rate, SAMPLE_RATE).feed
