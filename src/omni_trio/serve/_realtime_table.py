"""A ``/v1/realtime`` session's states as data, in the style of h11's ``_state``: the
turn being spoken and each response are in one state of an enum at a time, and every
change of state is looked up in a table, (state, step) -> new state. A step with no
entry for the state it comes in is a bug of the session's own rules (``SessionState``),
never the client's: it raises :class:`TransitionError`, naming the machine, the state
and the step. (A client's mistake stays a ``RealtimeError``, told with its
``event_id``; the session goes on.)

What a state *does* -- the events it sends, the requests it starts and cancels --
stays in ``_realtime_state``; here is only where it may go. docs/architecture.md
("The realtime session's states") draws both tables.

The turn's steps are the voice activity detector's four events and what the session
decides of them; the detector is the session's own (or ``RealtimeOptions.detector``'s),
and one out of order (speech starting twice, a silence with no turn) changes nothing
or starts over, as it always did: those entries are marked "out of order" below.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "RESPONSES",
    "TURNS",
    "ResponseState",
    "ResponseStep",
    "TransitionError",
    "Transitions",
    "TurnState",
    "TurnStep",
]


class _Enum(enum.Enum):
    """An enum whose members hash as objects do, by identity (they are singletons):
    ``Enum`` hashes a member's name in Python, which a lookup in the tables, on a
    session's every transition, would pay for."""

    __hash__ = object.__hash__


class TurnState(_Enum):
    """Where the user's turn stands (server VAD; with manual turns, always ``IDLE``)."""

    #: No turn: between turns, or turns are manual.
    IDLE = "idle"
    #: A turn's speech goes on: the client was told ``speech_started``.
    SPEECH = "speech"
    #: A turn's silence began (with speculation on, its response starts held).
    SILENCE = "silence"
    #: Speech over an answer, not yet ``interrupt_min_ms`` long: untold, the answer
    #: goes on.
    PENDING = "pending"
    #: That speech's silence began: it interrupts if the silence began past the bound.
    PENDING_SILENCE = "pending_silence"


class TurnStep(_Enum):
    """What moves the turn: the detector's events, and what the session decides."""

    #: The detector: speech started, and the turn is the user's at once.
    SPEECH_STARTED = "speech_started"
    #: The detector: speech started over an answer it may interrupt only once it has
    #: lasted ``interrupt_min_ms``.
    SPEECH_OVER_ANSWER = "speech_over_answer"
    #: The detector: a silence began (``SilenceStarted``).
    SILENCE_STARTED = "silence_started"
    #: The detector: speech came back (``SpeechResumed``).
    SPEECH_RESUMED = "speech_resumed"
    #: The detector (or the turn's idle timeout): the turn is over (``SpeechStopped``).
    SPEECH_STOPPED = "speech_stopped"
    #: Speech over an answer lasted long enough (or the answer ended): the turn is
    #: the user's, and the answer is interrupted.
    INTERRUPT = "interrupt"
    #: Speech over an answer stopped short: dropped, unsaid.
    BACKCHANNEL = "backchannel"
    #: A commit, a clear or a new turn detection: the turn, if any, is gone.
    FORGET = "forget"


class ResponseState(_Enum):
    """Where one response stands."""

    #: A speculation: its request runs, its events wait for its turn's end.
    HELD = "held"
    #: A speculation whose request is over: its last events wait too.
    HELD_ENDED = "held_ended"
    #: Answering: its events go out.
    LIVE = "live"
    #: Cancelled (barge-in, ``response.cancel``, the server stopping): its request is
    #: being cancelled, and its end will say ``cancelled``.
    CANCELLED = "cancelled"
    #: A speculation cancelled unseen (speech resumed): its request is being
    #: cancelled, what it makes is still held, and nothing of it is ever told.
    DROPPED = "dropped"
    #: An answer cancelled unseen (the socket closed): its request is being
    #: cancelled, and nothing more of it is told.
    UNSEEN = "unseen"
    #: Over, and its ``response.done`` queued.
    TOLD = "told"
    #: Over, and never told.
    FORGOTTEN = "forgotten"


class ResponseStep(_Enum):
    """What moves a response."""

    #: Its turn is over: the speculation is the answer.
    PROMOTE = "promote"
    #: Cancel it (its end says ``cancelled``, or nothing if it is unseen already).
    CANCEL = "cancel"
    #: Cancel it with nothing more told (the client is gone).
    CANCEL_UNSEEN = "cancel_unseen"
    #: Its request is over.
    END = "end"


S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class TransitionError(RuntimeError):
    """A step with no transition from the state it came in: a bug in the session's
    rules, not a client's error (the client gets no ``error`` event for it).

    Attributes:
      machine: Which machine (``"turn"`` or ``"response"``).
      state: Its state.
      step: The step that has no transition from it.
    """

    def __init__(self, machine: str, state: enum.Enum, step: enum.Enum) -> None:
        super().__init__(
            f"realtime session bug: the {machine} has no transition from "
            f"{state.name} on {step.name}"
        )
        self.machine = machine
        self.state = state
        self.step = step


class Transitions(Generic[S, E]):
    """One machine's table: ``table(state, step)`` is the new state, or raises
    :class:`TransitionError`.

    Args:
      machine: Its name, for the error.
      table: For each state, its steps and where each goes.
    """

    def __init__(self, machine: str, table: Mapping[S, Mapping[E, S]]) -> None:
        self.machine = machine
        self.table: dict[S, dict[E, S]] = {state: dict(steps) for state, steps in table.items()}

    def __call__(self, state: S, step: E) -> S:
        try:
            return self.table[state][step]
        except KeyError:
            raise TransitionError(self.machine, state, step) from None

    def pairs(self) -> set[tuple[S, E]]:
        """Every (state, step) with a transition."""
        return {(state, step) for state, steps in self.table.items() for step in steps}


_T, _R = TurnState, ResponseState
_t, _r = TurnStep, ResponseStep

#: The turn's transitions.
TURNS: Transitions[TurnState, TurnStep] = Transitions(
    "turn",
    {
        _T.IDLE: {
            _t.SPEECH_STARTED: _T.SPEECH,
            _t.SPEECH_OVER_ANSWER: _T.PENDING,
            _t.SILENCE_STARTED: _T.IDLE,  # out of order: no turn, nothing to do
            _t.SPEECH_RESUMED: _T.IDLE,  # out of order
            _t.SPEECH_STOPPED: _T.IDLE,  # the turn was committed, cleared, dropped
            _t.FORGET: _T.IDLE,
        },
        _T.SPEECH: {
            _t.SPEECH_STARTED: _T.SPEECH,  # out of order: a new turn
            _t.SPEECH_OVER_ANSWER: _T.PENDING,  # out of order: a new turn
            _t.SILENCE_STARTED: _T.SILENCE,
            _t.SPEECH_RESUMED: _T.SPEECH,  # out of order
            _t.SPEECH_STOPPED: _T.IDLE,
            _t.FORGET: _T.IDLE,
        },
        _T.SILENCE: {
            _t.SPEECH_STARTED: _T.SPEECH,  # out of order: a new turn
            _t.SPEECH_OVER_ANSWER: _T.PENDING,  # out of order: a new turn
            _t.SILENCE_STARTED: _T.SILENCE,  # out of order
            _t.SPEECH_RESUMED: _T.SPEECH,
            _t.SPEECH_STOPPED: _T.IDLE,
            _t.FORGET: _T.IDLE,
        },
        # SPEECH_STOPPED over an answer is a BACKCHANNEL or an INTERRUPT first
        _T.PENDING: {
            _t.SPEECH_STARTED: _T.SPEECH,  # out of order: a new turn
            _t.SPEECH_OVER_ANSWER: _T.PENDING,  # out of order: a new turn
            _t.SILENCE_STARTED: _T.PENDING_SILENCE,
            _t.SPEECH_RESUMED: _T.PENDING,  # out of order
            _t.INTERRUPT: _T.SPEECH,
            _t.BACKCHANNEL: _T.IDLE,
            _t.FORGET: _T.IDLE,
        },
        _T.PENDING_SILENCE: {
            _t.SPEECH_STARTED: _T.SPEECH,  # out of order: a new turn
            # out of order: a new turn, and the silence said stays
            _t.SPEECH_OVER_ANSWER: _T.PENDING_SILENCE,
            _t.SILENCE_STARTED: _T.PENDING_SILENCE,  # out of order: the later one
            _t.SPEECH_RESUMED: _T.PENDING,
            _t.INTERRUPT: _T.SILENCE,
            _t.BACKCHANNEL: _T.IDLE,
            _t.FORGET: _T.IDLE,
        },
    },
)

#: A response's transitions. It starts ``HELD`` (a speculation) or ``LIVE``; every
#: cancel of one still running cancels its request (again, if it was already).
RESPONSES: Transitions[ResponseState, ResponseStep] = Transitions(
    "response",
    {
        _R.HELD: {
            _r.PROMOTE: _R.LIVE,
            _r.CANCEL: _R.DROPPED,
            _r.CANCEL_UNSEEN: _R.DROPPED,
            _r.END: _R.HELD_ENDED,
        },
        _R.HELD_ENDED: {
            _r.PROMOTE: _R.TOLD,
            _r.CANCEL: _R.FORGOTTEN,
            _r.CANCEL_UNSEEN: _R.FORGOTTEN,
        },
        _R.LIVE: {
            _r.CANCEL: _R.CANCELLED,
            _r.CANCEL_UNSEEN: _R.UNSEEN,
            _r.END: _R.TOLD,
        },
        _R.CANCELLED: {
            _r.CANCEL: _R.CANCELLED,
            _r.CANCEL_UNSEEN: _R.CANCELLED,  # told it is cancelled all the same
            _r.END: _R.TOLD,
        },
        _R.DROPPED: {
            _r.CANCEL: _R.DROPPED,
            _r.CANCEL_UNSEEN: _R.DROPPED,
            _r.END: _R.FORGOTTEN,
        },
        _R.UNSEEN: {
            _r.CANCEL: _R.UNSEEN,
            _r.CANCEL_UNSEEN: _R.UNSEEN,
            _r.END: _R.FORGOTTEN,
        },
        _R.TOLD: {},
        # the session's speculation, forgotten by cancel_all, dropped once more
        _R.FORGOTTEN: {_r.CANCEL_UNSEEN: _R.FORGOTTEN},
    },
)
