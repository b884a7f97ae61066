"""``/v1/realtime``'s options (:class:`RealtimeOptions`, ``omni-trio serve
--realtime-*``), and what a session needs of the voice activity detector one of
them makes (:class:`Detector`).

Below the endpoint (``_realtime``), its sessions (``_realtime_session``) and their
decisions (``_realtime_state``), which all read them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import attrs

from .._checks import check_positive_int, check_seconds
from .._priority import check_priority
from . import _defaults as defaults

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..speech import VadEvent, VadOptions

__all__ = ["Detector", "RealtimeOptions"]


class Detector(Protocol):
    """What a session needs of its voice activity detector
    (:class:`~omni_trio.speech.VoiceActivityDetector` is one)."""

    def feed(self, pcm: bytes) -> list[VadEvent]: ...

    def reset(self) -> None: ...


def _positive_seconds(name: str) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        check_seconds(name, value, positive=True)

    return check


def _positive_int(name: str) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        check_positive_int(name, value)

    return check


def _priority(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        check_priority(value, attribute.name)


@attrs.frozen
class RealtimeOptions:
    """The limits and behaviour of ``/v1/realtime`` (``omni-trio serve
    --realtime-*``).

    Attributes:
      max_sessions: Sessions at once; the next upgrade gets 503.
      max_buffer_seconds: The input audio buffer's bound: an append past it gets an
          ``error`` and is dropped.
      max_event_bytes: The largest client event (a larger one gets an ``error``).
      idle_timeout: Seconds without a client event (audio included) after which a
          session is closed, with an ``error`` saying so. A session is not idle while
          a response streams to it.
      speculate: Start recognising a turn when its silence begins, its events held
          until the turn ends (and dropped unseen if speech resumes).
      speculate_after_ms: How much silence begins a speculation (less than the
          session's ``silence_duration_ms``; when it is not, half of that).
      outbox_bytes: Server events a session may have queued, unwritten, before it
          waits for the client: its responses wait (their outputs stay unread in the
          orchestrator, bounded by ``max_unread_bytes`` and ``consumer_idle_timeout``
          like any request's), and so does the reading of its client's events (what
          one event makes is queued at once: at most this plus one event's worth).
          A speculation holds at most this much of its events, too, until its turn
          ends.
      priority: Its responses' priority (lower runs earlier) at every queue of
          their route; ``None``: the endpoint's default (the config's
          ``[serve.priority] realtime``, else -10: ahead of chat's 0). A response
          is never shed for a more urgent request once its turn began.
      detector: Makes each session's voice activity detector from its turn
          detection's settings, as ``detector(vad_options)``: anything with
          ``feed(pcm) -> events`` and ``reset()``, as
          :class:`~omni_trio.speech.VoiceActivityDetector` has. ``None``: that
          detector with Silero's model, at 24 kHz. WebRTC's model is cheaper and
          weaker in noise (``docs/voice.md`` measures both)::

              # every session's detector with WebRTC's model (docs/voice.md runs it)
              RealtimeOptions(detector=lambda vad: VoiceActivityDetector(
                  vad, sample_rate=24_000, model=WebRtcModel()))

      trace: Called as ``trace(session_id, what, ref)`` at each step of a turn and a
          response, the moment the session takes it: ``"speech_started"``,
          ``"silence_started"``, ``"speech_stopped"`` (``ref``: the turn's item id),
          ``"response_started"``, ``"response_cancelled"``, ``"request_ended"`` (its
          orchestrator request's block has exited: every stage was sent its abort),
          ``"response_done"`` (``ref``: the response id). A hook for timing, as the
          voice bench does; it must not block.
    """

    max_sessions: int = attrs.field(
        default=defaults.REALTIME_MAX_SESSIONS, validator=_positive_int("max_sessions")
    )
    max_buffer_seconds: float = attrs.field(
        default=defaults.REALTIME_MAX_BUFFER_SECONDS,
        validator=_positive_seconds("max_buffer_seconds"),
    )
    max_event_bytes: int = attrs.field(
        default=defaults.REALTIME_MAX_EVENT_BYTES, validator=_positive_int("max_event_bytes")
    )
    idle_timeout: float = attrs.field(
        default=defaults.REALTIME_IDLE_TIMEOUT, validator=_positive_seconds("idle_timeout")
    )
    speculate: bool = True
    speculate_after_ms: int = attrs.field(
        default=150, validator=_positive_int("speculate_after_ms")
    )
    outbox_bytes: int = attrs.field(default=1024 * 1024, validator=_positive_int("outbox_bytes"))
    priority: int | None = attrs.field(default=None, validator=_priority)
    detector: Callable[[VadOptions], Detector] | None = None
    trace: Callable[[str, str, str], None] | None = None
