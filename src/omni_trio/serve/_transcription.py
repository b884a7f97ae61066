"""``POST /v1/audio/transcriptions``: what the pipeline's listening stage hears in an
uploaded file.

A transcription request has a route of its own: it enters at the listening stage
and ends there, so no other stage sees it, and chat, realtime and speech requests run
beside it on the same workers. The file (a multipart upload, any format FFmpeg
decodes) is decoded to 16 kHz PCM in a thread (:func:`~._audio_in.decode_audio`) and
goes in as an utterance with a ``transcribe`` key; the stage answers with each
segment as Whisper decodes it, then the whole transcript
(:func:`omni_trio.speech.listen`). The answer is in OpenAI's ``response_format``:
``json``, ``text``, ``verbose_json`` (the segments with their times), ``srt`` or
``vtt``; with ``stream=true``, ``transcript.text.delta`` events as the segments come,
then ``transcript.text.done``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs
import trio
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request

from .._priority import PRIORITY_MAX, PRIORITY_MIN, check_priority
from ._audio_in import HEARD_RATE, NotAudioError, decode_audio
from ._protocol import OpenAIError, check_model, encode, not_served, unavailable
from ._response import SSE_HEADERS, EndpointResponse, send_json

if TYPE_CHECKING:
    from ._answer import Plan
    from ._model import FinalOutput, ServedModel
    from ._response import Receive, Scope, Send
    from ._state import ServerState, Ticket

__all__ = [
    "TRANSCRIPTION_FORMATS",
    "TranscriptionPlan",
    "TranscriptionResponse",
    "plan_transcription",
]

TRANSCRIPTION_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


@attrs.frozen
class TranscriptionPlan:
    """A checked transcription request, its file not yet decoded."""

    file: bytes
    output: FinalOutput  # the listening stage's
    settings: dict[str, Any]  # language, prompt, temperature: as given
    format: str
    stream: bool
    priority: int | None = None

    @property
    def chat_plan(self) -> Plan:
        """The request as the server's metrics see a chat's: one transcript output."""
        from ._answer import Plan

        return Plan(None, (self.output,), self.stream, False, self.format, None)


def _replay(body: bytes) -> Receive:
    """A ``receive`` that gives the body, already read, once."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def plan_transcription(
    scope: Scope, body: bytes, model: ServedModel, *, max_request_bytes: int
) -> TranscriptionPlan:
    """Parse and check a transcription request's multipart body for ``model``.

    Raises:
      OpenAIError: 404, the model is not this server's or cannot listen; 400, the
          body is not a multipart form with a file, or a field is wrong (``param``).
    """
    request = Request(scope, _replay(body))
    try:
        form = await request.form(max_files=1, max_fields=32, max_part_size=max_request_bytes)
    except (MultiPartException, HTTPException) as exc:
        detail = getattr(exc, "detail", None) or getattr(exc, "message", None) or str(exc)
        raise OpenAIError(400, f"the body is not a valid multipart form: {detail}") from None
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise OpenAIError(
                400,
                "file: send the audio as a multipart/form-data upload named 'file'",
                param="file",
            )
        fields = {key: value for key, value in form.items() if isinstance(value, str)}
        name = fields.get("model")
        if name is None:
            raise OpenAIError(400, "model: a required field", param="model")
        check_model(name, model.name)
        hearing = model.hearing
        if hearing is None:
            raise not_served(
                model.name, "/v1/audio/transcriptions", "its pipeline has no listening stage"
            )
        settings: dict[str, Any] = {}
        if (language := fields.get("language")) is not None:
            if not language.strip():
                raise OpenAIError(400, "language: must not be empty", param="language")
            settings["language"] = language.strip()
        if (prompt := fields.get("prompt")) is not None:
            settings["prompt"] = prompt
        if (temperature := fields.get("temperature")) is not None:
            settings["temperature"] = _number(temperature, "temperature", 0.0, 1.0)
        format = fields.get("response_format", "json")
        if format not in TRANSCRIPTION_FORMATS:
            raise OpenAIError(
                400,
                f"unknown response_format {format!r}: it is one of "
                + ", ".join(TRANSCRIPTION_FORMATS),
                param="response_format",
            )
        stream = fields.get("stream", "false").lower()
        if stream not in ("true", "false"):
            raise OpenAIError(400, f"stream: true or false, not {stream!r}", param="stream")
        asked = fields.get("priority")
        priority = None if asked is None else _priority(asked)
        data = await upload.read()
    finally:
        await form.close()
    return TranscriptionPlan(data, hearing, settings, format, stream == "true", priority)


def _priority(text: str) -> int:
    try:
        return check_priority(int(text.strip()))
    except ValueError:
        raise OpenAIError(
            400,
            f"priority: an integer from {PRIORITY_MIN} to {PRIORITY_MAX} (lower runs "
            f"earlier), not {text!r}",
            param="priority",
        ) from None


def _number(text: str, param: str, low: float, high: float) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not low <= value <= high:
        raise OpenAIError(
            400, f"{param}: a number from {low:g} to {high:g}, not {text!r}", param=param
        )
    return value


# -- the answer --------------------------------------------------------------------------


def _clock(seconds: float, separator: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def subtitles(segments: list[dict[str, Any]], format: str) -> str:
    """The segments as SubRip (``srt``) or WebVTT (``vtt``) cues."""
    if format == "srt":
        return "".join(
            f"{index}\n{_clock(s['start'], ',')} --> {_clock(s['end'], ',')}\n"
            f"{s['text'].strip()}\n\n"
            for index, s in enumerate(segments, 1)
        )
    return "WEBVTT\n\n" + "".join(
        f"{_clock(s['start'], '.')} --> {_clock(s['end'], '.')}\n{s['text'].strip()}\n\n"
        for s in segments
    )


def _event(kind: str, **fields: Any) -> bytes:
    return b"data: " + encode({"type": kind, **fields}) + b"\n\n"


class TranscriptionResponse(EndpointResponse):
    """The ASGI response to one transcription request."""

    endpoint = "transcription"

    def __init__(self, server: ServerState, plan: TranscriptionPlan, max_seconds: float) -> None:
        super().__init__(server, plan.priority)
        self._plan = plan
        self._max_seconds = max_seconds

    async def run(self, send: Send, ticket: Ticket) -> None:
        plan, server = self._plan, self.server
        try:
            pcm, seconds = await trio.to_thread.run_sync(
                lambda: decode_audio(plan.file, max_seconds=self._max_seconds)
            )
        except NotAudioError as exc:
            raise OpenAIError(400, f"file: {exc}", param="file") from None
        orchestrator = server.orchestrator
        if orchestrator is None:
            raise unavailable("the server is not ready")
        stage = plan.output.stage_id
        prompt = {"audio": pcm, "sample_rate": HEARD_RATE, "transcribe": plan.settings}
        segments: list[dict[str, Any]] = []
        result: dict[str, Any] = {}
        stream = None
        try:
            async with orchestrator.open_request(
                prompt, entry_stage_ids={stage}, final_stage_ids={stage}, priority=ticket.priority
            ) as stream:
                ticket.admitted()
                while stream.terminal is None:
                    events = []
                    for output in await stream.receive_batch():
                        data = output.data
                        if data is None or output.finish_reason not in (None, "completed"):
                            continue
                        server.metrics.stage_outputs[stage].inc()
                        if isinstance(data, str):  # a listening stage that says it all at once
                            result = {"text": data}
                        elif not output.finished:
                            segments.append(data)
                            events.append(_event("transcript.text.delta", delta=data["text"]))
                        else:
                            result = dict(data)
                    if plan.stream and events:
                        await self._start(send, SSE_HEADERS)
                        await send(
                            {
                                "type": "http.response.body",
                                "body": b"".join(events),
                                "more_body": True,
                            }
                        )
        except trio.ClosedResourceError:
            raise unavailable("the server is shutting down", "server_shutting_down") from None
        finally:
            self.count_end(stream, plan.chat_plan)
        self.completed(stream)
        text = str(result.get("text", "")).strip()
        if plan.stream:
            await self._start(send, SSE_HEADERS)
            done = _event("transcript.text.done", text=text)
            await send({"type": "http.response.body", "body": done, "more_body": False})
            return
        self.started = True
        usage = {"type": "duration", "seconds": math.ceil(seconds)}
        if plan.format == "json":
            await send_json(send, 200, {"text": text, "usage": usage})
        elif plan.format == "verbose_json":
            whole = {
                "task": "transcribe",
                "language": result.get("language", plan.settings.get("language", "")),
                "duration": result.get("duration", seconds),
                "text": text,
                "segments": segments,
                "usage": usage,
            }
            await send_json(send, 200, whole)
        else:
            body = text + "\n" if plan.format == "text" else subtitles(segments, plan.format)
            media = {"text": b"text/plain", "srt": b"application/x-subrip", "vtt": b"text/vtt"}
            await _send_text(send, body.encode(), media[plan.format])

    async def _start(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        if not self.started:
            self.started = True
            await send({"type": "http.response.start", "status": 200, "headers": headers})

    async def error_mid_stream(self, send: Send, error: OpenAIError) -> None:
        """Streaming: the error object as the last event."""
        body = b"data: " + encode(error.body()) + b"\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_text(send: Send, body: bytes, media: bytes) -> None:
    headers = [
        (b"content-type", media + b"; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
