"""The wire shapes of the OpenAI-compatible API, as msgspec structs.

Requests are decoded strictly where it matters (types, ranges, the content part
types we understand) and leniently where OpenAI clients send more than we use:
unknown top-level fields (``user``, ``n``...) are accepted and ignored; the sampling
parameters (``temperature``, ``top_p``, ``max_tokens``, ``seed``, ``stop``) travel in
the prompt of a pipeline that takes conversations, checked as OpenAI checks them.
Responses are structs too, encoded with every field OpenAI documents present
(``null`` where it has no value), except a chunk's ``delta``, which carries only what
it has, as OpenAI's do.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import wave
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from .._priority import PRIORITY_MAX, PRIORITY_MIN

__all__ = [
    "AudioDelta",
    "AudioParams",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "Choice",
    "ChunkChoice",
    "Delta",
    "ErrorBody",
    "ErrorResponse",
    "InputAudio",
    "InputAudioPart",
    "Message",
    "MessageAudio",
    "Metrics",
    "Model",
    "ModelList",
    "OpenAIError",
    "StreamOptions",
    "TextPart",
    "Usage",
    "decode_body",
    "decode_request",
    "encode",
    "unavailable",
]


class OpenAIError(Exception):
    """An error the client is told about as an OpenAI error object.

    Attributes:
      status: The HTTP status.
      message: Says what was wrong, naming the field where there is one.
      type: OpenAI's error type (``invalid_request_error``, ``server_error``...).
      param: The offending field, if any.
      code: A machine-readable code, if any.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorBody(self.message, self.type, self.param, self.code))

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers beside the body: ``Retry-After`` on a 503."""
        return [(b"retry-after", b"1")] if self.status == 503 else []


def unavailable(message: str, code: str = "server_unavailable") -> OpenAIError:
    """A 503: the server cannot take the request now (a client may retry)."""
    return OpenAIError(503, message, type="server_error", code=code)


def check_model(asked: str, served: str) -> None:
    """A request's ``model`` against the one the server serves.

    Raises:
      OpenAIError: 404 ``model_not_found``, naming both.
    """
    if asked != served:
        raise OpenAIError(
            404,
            f"the model {asked!r} does not exist: this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def not_served(model: str, endpoint: str, why: str) -> OpenAIError:
    """The 404 for an endpoint ``model``'s pipeline cannot serve, saying ``why``."""
    return OpenAIError(
        404, f"model {model!r} does not serve {endpoint}: {why}", code="endpoint_not_served"
    )


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    """``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody


# -- requests -------------------------------------------------------------------------


#: A request's ``priority`` field: an integer from ``PRIORITY_MIN`` to ``PRIORITY_MAX``.
Priority = Annotated[int, msgspec.Meta(ge=PRIORITY_MIN, le=PRIORITY_MAX)]


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    """``{"type": "text", "text": ...}``."""

    text: str


#: The rate of ``"pcm16"`` input audio (an extension; OpenAI's own is 24 kHz too).
PCM16_RATE = 24_000


class InputAudio(msgspec.Struct):
    data: str  # base64
    format: str


class InputAudioPart(msgspec.Struct, tag_field="type", tag="input_audio"):
    """``{"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}``;
    ``"pcm16"`` (16-bit mono at 24 kHz) is an extension. Only a pipeline that
    listens takes it."""

    input_audio: InputAudio

    def pcm(self, param: str) -> tuple[bytes, int]:
        """The part's 16-bit mono PCM and its rate.

        Raises:
          OpenAIError: 400, naming ``param``: not base64, an unknown format, a WAV
              that is not 16-bit mono PCM, no audio (empty ``pcm16``, a WAV of no
              frames).
        """
        try:
            data = base64.b64decode(self.input_audio.data, validate=True)
        except (binascii.Error, ValueError):
            raise OpenAIError(400, f"{param}.data: not base64", param=f"{param}.data") from None
        fmt = self.input_audio.format
        if fmt == "pcm16":
            if len(data) % 2:
                raise OpenAIError(
                    400, f"{param}.data: not whole 16-bit samples", param=f"{param}.data"
                )
            if not data:
                raise OpenAIError(
                    400, f"{param}.data: empty, no audio samples", param=f"{param}.data"
                )
            return data, PCM16_RATE
        if fmt != "wav":
            raise OpenAIError(
                400,
                f"{param}.format: {fmt!r} is not served: 'wav' (16-bit mono PCM) or 'pcm16' "
                "(16-bit mono at 24000 Hz)",
                param=f"{param}.format",
            )
        try:
            with wave.open(io.BytesIO(data)) as wav:
                if wav.getsampwidth() != 2 or wav.getnchannels() != 1:
                    raise OpenAIError(
                        400,
                        f"{param}.data: the WAV is {wav.getnchannels()} channel(s) of "
                        f"{8 * wav.getsampwidth()}-bit audio: 16-bit mono PCM only",
                        param=f"{param}.data",
                    )
                pcm = wav.readframes(wav.getnframes())
                if not pcm:
                    raise OpenAIError(
                        400,
                        f"{param}.data: the WAV holds no audio samples",
                        param=f"{param}.data",
                    )
                return pcm, wav.getframerate()
        except (wave.Error, EOFError) as exc:
            raise OpenAIError(
                400, f"{param}.data: not a WAV file: {exc}", param=f"{param}.data"
            ) from None


#: The roles of an utterance's context, by the chat roles that become them.
_TURN_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
#: OpenAI's bound on ``stop``: up to 4 strings.
_STOPS = msgspec.Meta(min_length=1, max_length=4)


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | InputAudioPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def audio_parts(self) -> list[tuple[int, InputAudioPart]]:
        if not isinstance(self.content, list):
            return []
        return [(i, p) for i, p in enumerate(self.content) if isinstance(p, InputAudioPart)]


class AudioParams(msgspec.Struct):
    format: Literal["wav", "pcm16", "mp3", "opus", "aac", "flac"] = "wav"
    voice: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/chat/completions``: the fields we use; others are ignored."""

    model: str
    messages: list[ChatMessage]
    modalities: list[str] | None = None
    audio: AudioParams | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], _STOPS] | None = None
    #: Lower runs earlier (vLLM's extension); ``None``: the endpoint's default.
    priority: Priority | None = None

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens``, or the older ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    def sampling(self) -> dict[str, Any]:
        """The request's sampling parameters, as an utterance carries them
        (``omni_trio.speech.Sampling``): those it gives."""
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.token_limit,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop or None,
        }
        return {key: value for key, value in given.items() if value is not None}

    def prompt(self, *, listens: bool = False, conversation: bool = False) -> Any:
        """What the pipeline's first stage gets: the text of the last user message;
        for a pipeline that listens, or takes conversations, an utterance
        (``omni_trio.speech.utterance``'s shape): the last user message's audio (a
        pipeline that listens) or text, the messages before it as context (system
        and developer messages as system turns), and the request's sampling.

        Raises:
          OpenAIError: 400: no user message, one with nothing in it, audio for a
              pipeline that cannot listen (naming the part), or bad audio.
        """
        for index, message in enumerate(self.messages):
            for part, _ in message.audio_parts():
                if not listens:
                    where = f"messages[{index}].content[{part}]"
                    raise OpenAIError(
                        400,
                        f"{where}: this model cannot listen (its pipeline has no listening "
                        "stage): send text",
                        param=where,
                    )
        for index in range(len(self.messages) - 1, -1, -1):
            message = self.messages[index]
            if message.role != "user":
                continue
            text = message.text()
            parts = message.audio_parts()
            if not (listens or conversation):
                if not text.strip():
                    raise OpenAIError(400, "the last user message has no text", param="messages")
                return text
            context = [
                {"role": _TURN_ROLES[m.role], "text": m.text()}
                for m in self.messages[:index]
                if m.role in _TURN_ROLES and m.text().strip()
            ]
            sampling = self.sampling()
            said: dict[str, Any] = {"sampling": sampling} if sampling else {}
            if not parts:
                if not text.strip():
                    raise OpenAIError(400, "the last user message has no text", param="messages")
                return {"text": text, "context": context, **said}
            if text.strip():  # text beside the audio: said just before it
                context.append({"role": "user", "text": text})
            pcm, rate = b"", None
            for part, audio in parts:
                where = f"messages[{index}].content[{part}].input_audio"
                data, part_rate = audio.pcm(where)
                if rate is not None and part_rate != rate:
                    raise OpenAIError(
                        400,
                        f"{where}: at {part_rate} Hz, the parts before at {rate} Hz",
                        param=where,
                    )
                pcm, rate = pcm + data, part_rate
            return {"audio": pcm, "sample_rate": rate, "context": context, **said}
        raise OpenAIError(400, "messages has no message with role 'user'", param="messages")


_T = TypeVar("_T")
_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")


def decode_request(body: bytes) -> ChatCompletionRequest:
    """Decode and check a chat completion request body.

    Raises:
      OpenAIError: 400, saying what is wrong and where (``param``: the field's path).
    """
    request = decode_body(_decoder, body)
    if not request.messages:
        raise OpenAIError(400, "messages must not be empty", param="messages")
    return request


def decode_body(decoder: msgspec.json.Decoder[_T], body: bytes) -> _T:
    """Decode a JSON request body with ``decoder``.

    Raises:
      OpenAIError: 400, saying what is wrong and where (``param``: the field's path).
    """
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text)
        param = match["path"] if match else None
        message = text if match is None else f"{param}: {text[: match.start()]}"
        raise OpenAIError(400, message, param=param or None) from None
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None


# -- responses ------------------------------------------------------------------------


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AudioDelta(msgspec.Struct):
    """``choices[0].delta.audio`` of a streamed chunk: one chunk of audio, base64."""

    id: str
    data: str


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    audio: AudioDelta | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One ``data:`` event of a streamed response."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class MessageAudio(msgspec.Struct):
    """``choices[0].message.audio``: all of the audio, base64."""

    id: str
    data: str
    expires_at: int
    transcript: str


class Message(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    audio: MessageAudio | None = None


class Choice(msgspec.Struct):
    index: int
    message: Message
    finish_reason: str


class Metrics(msgspec.Struct):
    """The request's timings in seconds (``None``: that output never came)."""

    time_to_first_token: float | None
    time_to_first_audio: float | None
    e2e_latency: float


class ChatCompletion(msgspec.Struct, kw_only=True):
    """A whole (non-streamed) response; ``metrics`` is ours, beyond OpenAI's shape."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    metrics: Metrics


class Model(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "omni_trio"


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[Model]


_encoder = msgspec.json.Encoder()
encode = _encoder.encode
