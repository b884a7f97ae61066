"""The wire shapes of ``/v1/realtime``, OpenAI's Realtime API (the GA event names),
for the subset the server speaks: no I/O.

Client events are decoded in two steps, so an error can always name the event it
answers: first the envelope (``type`` and ``event_id``, whatever else the frame
holds), then the event itself, strictly where it matters (types, ranges, the formats
we serve) and leniently where OpenAI's clients send more than we use (``instructions``,
``voice``, ``tools``... are accepted and ignored). :func:`decode_client_event` raises
:class:`RealtimeError` naming the offending ``event_id`` (``None`` when the frame was
not a JSON object) and field.

Server events are built by :class:`ServerEvents`, which numbers them.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

__all__ = [
    "SAMPLE_RATE",
    "AudioFormat",
    "ClientEvent",
    "ConversationItemCreate",
    "ConversationItemTruncate",
    "InputAudioBufferAppend",
    "InputAudioBufferClear",
    "InputAudioBufferCommit",
    "RealtimeError",
    "ResponseCancel",
    "ResponseCreate",
    "ServerEvents",
    "SessionConfig",
    "SessionUpdate",
    "TurnDetection",
    "decode_client_event",
    "event_id_of",
]

#: The Realtime API's PCM rate, both ways: ``audio/pcm`` is 16-bit mono at 24 kHz.
SAMPLE_RATE = 24_000

Modality = Literal["text", "audio"]


class RealtimeError(Exception):
    """A client event the session refuses: sent back as an ``error`` event, and the
    session goes on.

    Attributes:
      message: Says what was wrong, naming the field where there is one.
      event_id: The offending client event's ``event_id`` (``None``: it had none, or
          the frame was not a JSON object).
      param: The offending field's path, if any.
      code: A machine-readable code.
      type: OpenAI's error type.
    """

    def __init__(
        self,
        message: str,
        *,
        event_id: str | None = None,
        param: str | None = None,
        code: str = "invalid_event",
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.event_id = event_id
        self.param = param
        self.code = code
        self.type = type


# -- client events --------------------------------------------------------------------


class AudioFormat(msgspec.Struct):
    """``{"type": "audio/pcm", "rate": 24000}``: the one format served."""

    type: str
    rate: int = SAMPLE_RATE

    def check(self, param: str) -> None:
        if self.type != "audio/pcm":
            raise RealtimeError(
                f"{param}.type: unsupported audio format {self.type!r}: this server "
                "speaks 'audio/pcm' (16-bit mono PCM at 24000 Hz)",
                param=f"{param}.type",
                code="unsupported_audio_format",
            )
        if self.rate != SAMPLE_RATE:
            raise RealtimeError(
                f"{param}.rate: unsupported rate {self.rate}: audio/pcm is at {SAMPLE_RATE} Hz",
                param=f"{param}.rate",
                code="unsupported_audio_format",
            )


class TurnDetection(msgspec.Struct, kw_only=True):
    """``audio.input.turn_detection``: server VAD (``null`` turns it off)."""

    type: str
    threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    prefix_padding_ms: Annotated[int, msgspec.Meta(ge=0, le=10_000)] | None = None
    silence_duration_ms: Annotated[int, msgspec.Meta(ge=1, le=10_000)] | None = None
    create_response: bool | None = None
    interrupt_response: bool | None = None
    #: A turn whose speech started and to which no audio came for this long is
    #: committed (``input_audio_buffer.timeout_triggered``).
    idle_timeout_ms: Annotated[int, msgspec.Meta(ge=100, le=60_000)] | None = None
    #: Ours: speech over an answer interrupts it once it has lasted this long;
    #: shorter sounds (a backchannel, a cough) are dropped.
    interrupt_min_ms: Annotated[int, msgspec.Meta(ge=0, le=10_000)] | None = None


class AudioInput(msgspec.Struct, kw_only=True):
    format: AudioFormat | UnsetType = UNSET
    turn_detection: TurnDetection | UnsetType | None = UNSET


class AudioOutput(msgspec.Struct, kw_only=True):
    format: AudioFormat | UnsetType = UNSET
    voice: str | UnsetType = UNSET  # accepted: the pipeline has the voice it has


class AudioConfig(msgspec.Struct, kw_only=True):
    input: AudioInput | UnsetType = UNSET
    output: AudioOutput | UnsetType = UNSET


class SessionConfig(msgspec.Struct, kw_only=True):
    """``session`` of a ``session.update``: only what is present changes."""

    type: str = "realtime"
    output_modalities: list[Modality] | UnsetType = UNSET
    audio: AudioConfig | UnsetType = UNSET
    #: the system turn of every response's conversation (a model that takes
    #: utterances reads it; a text model does not)
    instructions: str | UnsetType = UNSET


class SessionUpdate(msgspec.Struct, tag="session.update", tag_field="type", kw_only=True):
    session: SessionConfig
    event_id: str | None = None


class InputAudioBufferAppend(
    msgspec.Struct, tag="input_audio_buffer.append", tag_field="type", kw_only=True
):
    audio: str  # base64 of PCM16 at 24 kHz; :func:`decode_client_event` checks it
    event_id: str | None = None
    pcm: bytes = b""  # the decoded audio (not on the wire)


class InputAudioBufferCommit(
    msgspec.Struct, tag="input_audio_buffer.commit", tag_field="type", kw_only=True
):
    event_id: str | None = None


class InputAudioBufferClear(
    msgspec.Struct, tag="input_audio_buffer.clear", tag_field="type", kw_only=True
):
    event_id: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ItemParam(msgspec.Struct, kw_only=True):
    type: Literal["message"]
    role: Literal["user", "assistant", "system"]
    content: list[ContentPart]
    id: str | None = None


class ConversationItemCreate(
    msgspec.Struct, tag="conversation.item.create", tag_field="type", kw_only=True
):
    item: ItemParam
    previous_item_id: str | None = None
    event_id: str | None = None

    def text(self) -> str:
        """The message's text: its ``input_text`` / ``text`` / ``output_text`` parts."""
        parts = []
        for index, part in enumerate(self.item.content):
            if part.type not in ("input_text", "text", "output_text") or part.text is None:
                raise RealtimeError(
                    f"item.content[{index}]: only text parts can be created here "
                    f"(type 'input_text' with a 'text'), got type {part.type!r}",
                    event_id=self.event_id,
                    param=f"item.content[{index}]",
                )
            parts.append(part.text)
        return "".join(parts)


class ConversationItemTruncate(
    msgspec.Struct, tag="conversation.item.truncate", tag_field="type", kw_only=True
):
    item_id: str
    content_index: Annotated[int, msgspec.Meta(ge=0)]
    audio_end_ms: Annotated[int, msgspec.Meta(ge=0)]
    event_id: str | None = None


class ResponseParams(msgspec.Struct, kw_only=True):
    output_modalities: list[Modality] | None = None
    instructions: str | None = None  # this response's, instead of the session's


class ResponseCreate(msgspec.Struct, tag="response.create", tag_field="type", kw_only=True):
    response: ResponseParams | None = None
    event_id: str | None = None


class ResponseCancel(msgspec.Struct, tag="response.cancel", tag_field="type", kw_only=True):
    response_id: str | None = None
    event_id: str | None = None


ClientEvent = (
    SessionUpdate
    | InputAudioBufferAppend
    | InputAudioBufferCommit
    | InputAudioBufferClear
    | ConversationItemCreate
    | ConversationItemTruncate
    | ResponseCreate
    | ResponseCancel
)

_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    cls.__struct_config__.tag: msgspec.json.Decoder(cls) for cls in ClientEvent.__args__
}


class _Envelope(msgspec.Struct):
    type: Any = None
    event_id: Any = None


_envelope = msgspec.json.Decoder(_Envelope)
_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]*)`")


def decode_client_event(frame: str | bytes) -> ClientEvent:
    """One client frame as its event, checked.

    Raises:
      RealtimeError: the frame is not JSON, not an object, has no known ``type``, or
          breaks its event's shape: the message names the field, the error the
          ``event_id``.
    """
    try:
        envelope = _envelope.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RealtimeError(f"the event is not a JSON object: {exc}") from None
    event_id = envelope.event_id if isinstance(envelope.event_id, str) else None
    if envelope.event_id is not None and event_id is None:
        raise RealtimeError("event_id: must be a string", param="event_id")
    kind = envelope.type
    if kind is None:
        raise RealtimeError("type: the event has no 'type'", event_id=event_id, param="type")
    decoder = _DECODERS.get(kind) if isinstance(kind, str) else None
    if decoder is None:
        raise RealtimeError(
            f"type: unknown event type {kind!r}; this server takes: " + ", ".join(_DECODERS),
            event_id=event_id,
            param="type",
            code="unknown_event_type",
        )
    try:
        event: ClientEvent = decoder.decode(frame)
    except msgspec.ValidationError as exc:
        message, param = _invalid(str(exc))
        raise RealtimeError(message, event_id=event_id, param=param) from None
    if isinstance(event, InputAudioBufferAppend):
        event.pcm = _pcm(event.audio, event_id)
    elif isinstance(event, SessionUpdate):
        _check_session(event.session, event_id)
    return event


def _invalid(text: str) -> tuple[str, str | None]:
    """msgspec's account of a bad event as ``(message, param)``: the field it names
    (a missing one too: ``item.role``), and the message led by it."""
    match = _PATH.search(text)
    path = match["path"] if match else ""
    reason = text if match is None else text[: match.start()]
    missing = _MISSING.match(reason)
    if missing is not None:
        field = missing["field"]
        path = f"{path}.{field}" if path else field
        reason = "missing required field"
    return (f"{path}: {reason}" if path else reason), (path or None)


def event_id_of(frame: str | bytes) -> str | None:
    """A frame's ``event_id``, if it is a JSON object that has a string one."""
    try:
        event_id = _envelope.decode(frame).event_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return event_id if isinstance(event_id, str) else None


def _pcm(audio: str, event_id: str | None) -> bytes:
    try:
        pcm = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError(
            "audio: not base64", event_id=event_id, param="audio", code="invalid_audio"
        ) from None
    if len(pcm) % 2:
        raise RealtimeError(
            f"audio: {len(pcm)} bytes is not whole 16-bit samples",
            event_id=event_id,
            param="audio",
            code="invalid_audio",
        )
    return pcm


def _check_session(session: SessionConfig, event_id: str | None) -> None:
    try:
        _check_session_fields(session)
    except RealtimeError as exc:
        exc.event_id = event_id
        raise


def _check_session_fields(session: SessionConfig) -> None:
    if session.type != "realtime":
        raise RealtimeError(
            f"session.type: {session.type!r} sessions are not served: 'realtime' only",
            param="session.type",
        )
    if session.output_modalities is not UNSET and len(session.output_modalities) != 1:
        raise RealtimeError(
            "session.output_modalities: one of ['audio'] or ['text']",
            param="session.output_modalities",
        )
    audio = session.audio
    if audio is UNSET:
        return
    if audio.input is not UNSET:
        if audio.input.format is not UNSET:
            audio.input.format.check("session.audio.input.format")
        detection = audio.input.turn_detection
        if detection is not UNSET and detection is not None and detection.type != "server_vad":
            raise RealtimeError(
                "session.audio.input.turn_detection.type: only 'server_vad' (or "
                f"turn_detection null, for manual turns), got {detection.type!r}",
                param="session.audio.input.turn_detection.type",
            )
    if audio.output is not UNSET and audio.output.format is not UNSET:
        audio.output.format.check("session.audio.output.format")


# -- server events --------------------------------------------------------------------

_encode = msgspec.json.Encoder().encode


class ServerEvents:
    """Builds the server's events, as JSON text, each with its own ``event_id``."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._count = 0

    def event(self, type: str, **fields: Any) -> str:
        self._count += 1
        body = {"type": type, "event_id": f"event_{self._prefix}{self._count}", **fields}
        return _encode(body).decode()

    def error(self, error: RealtimeError) -> str:
        return self.event(
            "error",
            error={
                "type": error.type,
                "code": error.code,
                "message": error.message,
                "param": error.param,
                "event_id": error.event_id,
            },
        )
