"""``POST /v1/audio/speech``: text spoken by the pipeline's own talker and code2wav.

A speech request is a request with a route of its own (see
:class:`~._model.SpeechRoute`): it enters at the talker with the text to say
(:func:`omni_trio.speech.say`: the text, the voice, the speed) and ends at the audio
output, so the thinker -- and a listening stage -- never see it, and chat requests on
the same pipeline run beside it. Its audio streams as the stages make it, resampled
to OpenAI's 24 kHz and encoded in the asked format (:class:`~._audio_out.AudioEncoder`):
raw bytes (``stream_format="audio"``), or SSE events, ``speech.audio.delta`` with
base64 audio and a last ``speech.audio.done`` with the usage (``"sse"``).

The response starts with the first audio: a request that fails before it gets an
OpenAI error object. One that fails after it ends with the body cut short (no last
chunk), which every HTTP client reports as an error -- never as a whole file. A
client that hangs up aborts the request at every stage on its route.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Annotated, Any

import attrs
import msgspec
import trio

from ..speech._voices import MAX_SPEED, MIN_SPEED, VOICES, say
from ._answer import Plan
from ._audio_out import AUDIO_FORMATS, MEDIA_TYPES, AudioEncoder
from ._protocol import (
    OpenAIError,
    Priority,
    check_model,
    decode_body,
    encode,
    not_served,
    unavailable,
)
from ._response import SSE_HEADERS, EndpointResponse
from ._voice import knows_voice, unknown_voice

if TYPE_CHECKING:
    from ._model import ServedModel, SpeechRoute
    from ._response import Send
    from ._state import ServerState, Ticket

__all__ = [
    "MAX_INPUT_CHARS",
    "SpeechPlan",
    "SpeechRequest",
    "SpeechResponse",
    "plan_speech",
]

#: OpenAI's limit on ``input``.
MAX_INPUT_CHARS = 4096


class VoiceId(msgspec.Struct):
    """A custom voice, as OpenAI names one: ``{"id": ...}`` (here, any voice name)."""

    id: str


class SpeechRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/audio/speech``'s body: OpenAI's fields (others are ignored)."""

    model: str
    input: str
    voice: str | VoiceId
    #: Accepted and ignored: eSpeak NG takes no instructions.
    instructions: str | None = None
    response_format: str = "mp3"
    speed: Annotated[float, msgspec.Meta(ge=MIN_SPEED, le=MAX_SPEED)] = 1.0
    stream_format: str = "audio"
    #: Lower runs earlier (as chat completions'); ``None``: the endpoint's default.
    priority: Priority | None = None


_decoder = msgspec.json.Decoder(SpeechRequest)


@attrs.frozen
class SpeechPlan:
    """A checked speech request, ready to run."""

    prompt: dict[str, Any]
    route: SpeechRoute
    format: str
    sse: bool
    words: int  # the input's: its usage's input tokens
    priority: int | None = None

    @property
    def chat_plan(self) -> Plan:
        """The same request as the server's metrics see a chat's: one audio output."""
        return Plan(self.prompt, (self.route.output,), True, False, self.format, None)


def _one_of(param: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise OpenAIError(
            400, f"unknown {param} {value!r}: it is one of {', '.join(allowed)}", param=param
        )


def plan_speech(body: bytes, model: ServedModel) -> SpeechPlan:
    """Decode and check a speech request for ``model``.

    Raises:
      OpenAIError: 404, the model is not this server's or has no speech route; 400,
          a field is wrong (named in ``param``).
    """
    request = decode_body(_decoder, body)
    check_model(request.model, model.name)
    route = model.speech
    if route is None:
        raise not_served(
            model.name,
            "/v1/audio/speech",
            "its pipeline has no stage that speaks its text output (a talker reading "
            "the text, on the way to an audio output)",
        )
    text = request.input
    if not text.strip():
        raise OpenAIError(400, "input must not be empty", param="input")
    if len(text) > MAX_INPUT_CHARS:
        raise OpenAIError(
            400,
            f"input is {len(text)} characters long: at most {MAX_INPUT_CHARS}",
            param="input",
        )
    _one_of("response_format", request.response_format, AUDIO_FORMATS)
    _one_of("stream_format", request.stream_format, ("audio", "sse"))
    voice = request.voice if isinstance(request.voice, str) else request.voice.id
    if voice not in VOICES and not knows_voice(voice):
        raise unknown_voice(voice, "voice")
    return SpeechPlan(
        prompt=say(text, voice=voice, speed=request.speed),
        route=route,
        format=request.response_format,
        sse=request.stream_format == "sse",
        words=len(text.split()),
        priority=request.priority,
    )


class _Usage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class _Done(msgspec.Struct, tag_field="type", tag="speech.audio.done"):
    usage: _Usage


def _delta(audio: bytes) -> bytes:
    return b'data: {"type":"speech.audio.delta","audio":"' + base64.b64encode(audio) + b'"}\n\n'


class SpeechResponse(EndpointResponse):
    """The ASGI response to one speech request: its audio, streamed."""

    endpoint = "speech"

    def __init__(self, server: ServerState, plan: SpeechPlan) -> None:
        super().__init__(server, plan.priority)
        self._plan = plan
        self._outputs = 0

    async def run(self, send: Send, ticket: Ticket) -> None:
        plan, server = self._plan, self.server
        orchestrator = server.orchestrator
        if orchestrator is None:
            raise unavailable("the server is not ready")
        route = plan.route
        stage = route.output.stage_id
        encoder = AudioEncoder(plan.format, route.output.sample_rate)
        counter = server.metrics.stage_outputs[stage]
        stream = None
        try:
            async with orchestrator.open_request(
                plan.prompt,
                entry_stage_ids={route.entry},
                final_stage_ids={stage},
                priority=ticket.priority,
            ) as stream:
                ticket.admitted()
                while stream.terminal is None:
                    batch = await stream.receive_batch()
                    if server.on_outputs is not None:
                        server.on_outputs(batch)
                    pieces = []
                    for output in batch:
                        if output.data is not None and output.finish_reason in (None, "completed"):
                            pieces.append(encoder.feed(_pcm(output.data, stage)))
                            self._outputs += 1
                            counter.inc()
                    if any(pieces):
                        await self._send(send, b"".join(pieces))
        except trio.ClosedResourceError:
            raise unavailable("the server is shutting down", "server_shutting_down") from None
        finally:
            self.count_end(stream, plan.chat_plan)
        self.completed(stream)
        rest = encoder.finish()
        if rest or not self.started:
            await self._send(send, rest)
        tail = b""
        if plan.sse:
            usage = _Usage(plan.words, self._outputs, plan.words + self._outputs)
            tail = b"data: " + encode(_Done(usage)) + b"\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _send(self, send: Send, audio: bytes) -> None:
        if not self.started:
            self.started = True
            media = MEDIA_TYPES[self._plan.format].encode()
            headers = SSE_HEADERS if self._plan.sse else [(b"content-type", media)]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
        body = _delta(audio) if self._plan.sse and audio else audio
        if body:
            await send({"type": "http.response.body", "body": body, "more_body": True})


def _pcm(data: object, stage: int) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise OpenAIError(
            500, f"stage {stage} sent {type(data).__name__}, not PCM bytes", type="server_error"
        )
    return bytes(data)
