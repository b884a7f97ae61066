"""A chat completion's answer, built from its request's outputs: no I/O.

:class:`Answer` is the sans-IO half of ``POST /v1/chat/completions`` (as h11 is of
HTTP): it turns batches of :class:`~omni_trio.OrchOutput` into OpenAI's SSE
``chat.completion.chunk`` events, or into one ``chat.completion`` object, and keeps
what the answer needs to know (the finish reason, the usage). The ASGI response in
``_chat`` drives it; tests can drive it with plain lists of outputs.

A streamed answer's content events are all alike but for one value (the text, or the
audio's base64), so each is made from a template -- the bytes of its chunk struct
with a hole where that value goes, encoded once per answer -- and the value's JSON:
per output, one encoded string and one join, not a struct encoded.

A large output's event is made a slice at a time (:meth:`Answer.pieces`): its audio's
base64 or its text's JSON comes in pieces of about :data:`PIECE_BYTES`, so that a
response that writes each piece before it makes the next never holds the whole event
encoded -- nor the server's HTTP framing a copy of it -- while its client is slow to
read (a stalled request holds its window, and a piece).
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import attrs

from .._audio import wav_bytes
from ..speech._resample import Resampler
from ._audio_out import OUT_RATE, AudioEncoder
from ._protocol import (
    AudioDelta,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    Message,
    MessageAudio,
    Metrics,
    OpenAIError,
    Usage,
    encode,
)

if TYPE_CHECKING:
    from .._messages import OrchOutput, RequestMetrics
    from ._model import FinalOutput

__all__ = [
    "DONE",
    "PIECE_BYTES",
    "STREAMED_FORMATS",
    "Answer",
    "Plan",
    "error_event",
    "with_voice",
]

DONE = b"data: [DONE]\n\n"
#: A delta's value while its event's template is made (only the delta's value can be
#: this string: the rest of a chunk comes before it, or is ``null``).
_HOLE = "\x00"
_HOLE_JSON = encode(_HOLE)
#: A streamed event's value (an audio output's base64, a text's JSON) is made and
#: written at most about this many bytes at a time; a larger one spans pieces.
PIECE_BYTES = 256 * 1024
#: Audio bytes whose base64 is :data:`PIECE_BYTES` (a multiple of 3: the slices'
#: base64 joins into the whole's, and of 2: whole samples). Larger audio is sliced.
_AUDIO_SLICE = PIECE_BYTES // 4 * 3
#: Characters whose JSON is at most :data:`PIECE_BYTES` (a control character's
#: escape, ``\u001f``, is 6 bytes). Longer text is sliced.
_TEXT_SLICE = PIECE_BYTES // 6
_WAV_HEADER = struct.Struct("<4sI4s4sIHHIIHH4sI")


@attrs.frozen
class Plan:
    """A checked chat request, ready to run."""

    prompt: Any  # text, or (a pipeline that listens) an utterance
    outputs: tuple[FinalOutput, ...]
    stream: bool
    include_usage: bool
    audio_format: str
    token_limit: int | None
    #: What the request asked (``None``: the endpoint's default).
    priority: int | None = None

    @classmethod
    def of(
        cls,
        request: ChatCompletionRequest,
        outputs: tuple[FinalOutput, ...],
        *,
        listens: bool,
        conversation: bool = False,
        speaks: bool = False,
    ) -> Plan:
        """``request``, checked, to run for ``outputs``.

        Raises:
          OpenAIError: 400, what :meth:`ChatCompletionRequest.prompt` refuses; a
              voice no talker has; a streamed answer in a format that cannot stream.
        """
        prompt = request.prompt(listens=listens, conversation=conversation)
        audio = request.audio
        wants_audio = any(o.modality == "audio" for o in outputs)
        if audio is not None and wants_audio:
            if request.stream and audio.format not in STREAMED_FORMATS:
                raise OpenAIError(
                    400,
                    f"audio.format {audio.format!r} is not streamed: a streamed answer's "
                    f"audio is {' or '.join(map(repr, STREAMED_FORMATS))}",
                    param="audio.format",
                )
            if audio.voice is not None and speaks:
                prompt = with_voice(prompt, audio.voice)
        return cls(
            prompt=prompt,
            outputs=outputs,
            stream=request.stream,
            include_usage=request.stream_options is not None
            and request.stream_options.include_usage,
            audio_format="wav" if audio is None else audio.format,
            token_limit=request.token_limit,
            priority=request.priority,
        )

    @property
    def stage_ids(self) -> frozenset[int]:
        return frozenset(o.stage_id for o in self.outputs)

    def first_output(self, metrics: RequestMetrics, modality: str) -> float | None:
        """Seconds from arrival to the first output of ``modality`` this request asked
        for (time to first token or first audio), or ``None`` if none came."""
        times = [
            t
            for o in self.outputs
            if o.modality == modality
            and (t := metrics.time_to_first_output(o.stage_id)) is not None
        ]
        return min(times, default=None)


#: What a streamed answer's audio may be: 24 kHz PCM (OpenAI's ``pcm16``), or each
#: delta a whole WAV file at the stage's rate.
STREAMED_FORMATS = ("pcm16", "wav")


def with_voice(prompt: Any, voice: str) -> Any:
    """``prompt`` asking the talker and code2wav for ``voice``
    (:func:`omni_trio.speech.settings`: an utterance's ``speech`` key; a plain text
    prompt becomes ``{"text": ..., "speech": ...}``).

    Raises:
      OpenAIError: 400, a voice neither OpenAI's nor eSpeak NG's.
    """
    from ..speech._voices import VOICES, settings
    from ._voice import knows_voice, unknown_voice

    if voice not in VOICES and not knows_voice(voice):
        raise unknown_voice(voice, "audio.voice")
    asked = settings(voice)
    if isinstance(prompt, dict):
        return {**prompt, "speech": asked}
    return {"text": prompt, "speech": asked}


def error_event(error: OpenAIError) -> bytes:
    """How a streamed answer ends in an error: the error object, then ``[DONE]``."""
    return b"data: " + encode(error.body()) + b"\n\n" + DONE


class Answer:
    """The answer to one chat completion request, as its outputs arrive.

    Args:
      plan: The checked request.
      model: The model's name, as every chunk says it.
      on_output: Called with the stage of every output that becomes content (the
          server counts them in its metrics).
      max_whole_bytes: A whole (non-streamed) answer keeps all its text and audio
          until the end: at most this many bytes of it (a ``str`` counts its
          length), the orchestrator's ``max_unread_bytes``. ``None``: no bound.

    Attributes:
      finish: ``None`` until the answer is complete: ``"stop"`` after a
          ``"completed"`` terminal, ``"length"`` once ``max_tokens`` text outputs
          were taken.
    """

    def __init__(
        self,
        plan: Plan,
        model: str,
        on_output: Callable[[int], None] = lambda _: None,
        *,
        max_whole_bytes: int | None = None,
    ) -> None:
        self._plan = plan
        self._model = model
        self._on_output = on_output
        self._id = f"chatcmpl-{uuid.uuid4().hex}"
        self._created = int(time.time())
        self._by_stage = {o.stage_id: o for o in plan.outputs}
        self.finish: str | None = None
        self._first = True  # the next delta is the first: it carries the role
        #: (modality, first) -> the bytes of a content event before and after its value
        self._templates: dict[tuple[str, bool], tuple[bytes, bytes]] = {}
        self._text: list[str] = []  # all of it, for a whole (non-streamed) answer
        self._audio: list[bytes] = []  # the same
        self._max_kept = max_whole_bytes
        self._kept = 0  # bytes in _text and _audio
        self._tokens = 0
        self._resamplers: dict[int, Resampler] = {}
        #: What the text stage said of its answer (a language model's usage and why
        #: it stopped: its completion's meta), once it has.
        self._meta: dict[str, Any] | None = None
        #: What closes the event that the last piece :meth:`pieces` gave left open
        #: (a large output's, cut between its slices); ``b""``: none is open.
        self.open_event_tail = b""

    @property
    def done(self) -> bool:
        """Whether the answer is complete (:attr:`finish` is set): take no more."""
        return self.finish is not None

    def take(self, batch: list[OrchOutput]) -> bytes:
        """Take a batch of the request's outputs, in order; return their SSE events
        (nothing when not streaming): :meth:`pieces`, joined."""
        return b"".join(self.pieces(batch))

    def pieces(self, batch: list[OrchOutput]) -> Iterator[bytes]:
        """Take a batch of the request's outputs, in order, as it is iterated; give
        their SSE events (nothing when not streaming) in pieces: one, the batch's
        events, unless an output is large (audio over ``_AUDIO_SLICE`` bytes, text
        over ``_TEXT_SLICE`` characters), whose event is made a slice at a time: its
        head (with the events before it), then each slice of its value (about
        :data:`PIECE_BYTES`), a piece each. A piece may end inside that event:
        :attr:`open_event_tail` is then what closes it (a response cut short there
        sends it before its error event, which keeps every event whole).

        Stops at the terminal, or at a text output beyond ``max_tokens``
        (:attr:`finish` is then ``"length"``: it and the rest of the batch are not
        taken) -- a thinker that keeps to ``max_tokens`` itself (a language model,
        told it in the prompt) is never cut: its request completes, its audio whole,
        and the model says why it stopped.

        Raises:
          OpenAIError: 500, an output the API cannot carry (audio that is not bytes);
              400, a whole answer that would grow over ``max_whole_bytes``.
        """
        parts: list[bytes] = []
        stream = self._plan.stream
        limit = self._plan.token_limit
        for output in batch:
            if output.data is not None and output.finish_reason in (None, "completed"):
                final = self._by_stage[output.stage_id]
                if final.modality == "text":
                    if limit is not None and self._tokens >= limit:
                        self.finish = "length"
                        break
                    value = self._take_text(output.data)
                else:
                    value = self._take_audio(output.data, final)
                self._on_output(output.stage_id)
                if stream:
                    before, after = self._template(final.modality)
                    if isinstance(value, bytes):
                        parts += (before, value, after)
                    else:  # large: its event a slice at a time, each a piece
                        if final.modality == "text":  # the slices: its JSON string's inside
                            before, after = before + b'"', b'"' + after
                        parts.append(before)
                        head = b"".join(parts)  # and the events before it
                        parts = []
                        self.open_event_tail = after
                        yield head
                        del head
                        yield from value  # (no name here keeps a slice while it is written)
                        parts.append(after)
                        self.open_event_tail = b""
            if output.meta is not None and self._by_stage[output.stage_id].modality == "text":
                self._meta = output.meta
            if output.finished and output.finish_reason == "completed":  # always the last
                said = None if self._meta is None else self._meta.get("finish_reason")
                self.finish = said if said in ("stop", "length") else "stop"
        if parts:
            yield b"".join(parts)

    def _take_text(self, data: object) -> bytes | Iterator[bytes]:
        """Take a text output; streaming, its JSON string (a long one's inside, in
        slices)."""
        text = data if isinstance(data, str) else str(data)
        stream = self._plan.stream
        if not stream:  # a whole response is built from all of it
            self._keep(len(text))
            self._text.append(text)
        self._tokens += 1
        if not stream:
            return b""
        if len(text) > _TEXT_SLICE:
            return _json_slices(text)
        return encode(text)

    def _take_audio(self, data: object, final: FinalOutput) -> bytes | Iterator[bytes]:
        """Take an audio output; streaming, its base64 (the JSON string's inside; a
        large output's, in slices)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise OpenAIError(
                500,
                f"{final.label} sent audio that is not bytes: {type(data).__name__}",
                type="server_error",
            )
        if not self._plan.stream:
            pcm = bytes(data)
            self._keep(len(pcm))
            self._audio.append(pcm)
            return b""
        pcm = data if isinstance(data, bytes) else bytes(data)
        if len(pcm) > _AUDIO_SLICE:
            return _base64_slices(self._audio_slices(pcm, final))
        if self._plan.audio_format == "wav":
            pcm = wav_bytes(pcm, final.sample_rate)
        else:  # pcm16: OpenAI's 24 kHz
            pcm = self._resampler(final).feed(pcm)
        return base64.b64encode(pcm)

    def _audio_slices(self, pcm: bytes, final: FinalOutput) -> Iterator[bytes]:
        """A large audio output, in the answer's format, a slice at a time (as it is
        iterated: the resampler is fed a slice at a time too)."""
        size = len(pcm)
        if self._plan.audio_format == "wav":
            yield _wav_header(size, final.sample_rate)
            for start in range(0, size, _AUDIO_SLICE):
                yield pcm[start : start + _AUDIO_SLICE]
        else:  # pcm16: OpenAI's 24 kHz
            resampler = self._resampler(final)
            for start in range(0, size, _AUDIO_SLICE):
                yield resampler.feed(pcm[start : start + _AUDIO_SLICE])

    def _resampler(self, final: FinalOutput) -> Resampler:
        """A streamed pcm16 answer's resampler for ``final``'s audio (one per stream:
        it keeps the filter's history from one delta to the next)."""
        resampler = self._resamplers.get(final.stage_id)
        if resampler is None:
            resampler = self._resamplers[final.stage_id] = Resampler(final.sample_rate, OUT_RATE)
        return resampler

    def _template(self, modality: str) -> tuple[bytes, bytes]:
        """The bytes of the next content event of ``modality`` before and after its
        value (a text's JSON string; the inside of the audio's JSON string)."""
        key = (modality, self._first)
        self._first = False
        template = self._templates.get(key)
        if template is None:
            template = self._templates[key] = self._make_template(*key)
        return template

    def _make_template(self, modality: str, first: bool) -> tuple[bytes, bytes]:
        role = "assistant" if first else None
        if modality == "text":
            delta = Delta(role=role, content=_HOLE)
        else:
            delta = Delta(role=role, audio=AudioDelta(self._audio_id, _HOLE))
        before, hole, after = self._event([ChunkChoice(0, delta)]).rpartition(_HOLE_JSON)
        assert hole, "a chunk's template has its hole"
        if modality == "text":
            return before, after
        return before + b'"', b'"' + after  # base64 needs no escapes: only its quotes

    def _keep(self, size: int) -> None:
        limit = self._max_kept
        if limit is not None and self._kept + size > limit:
            raise OpenAIError(
                400,
                f"the answer exceeds max_unread_bytes ({limit} bytes), what a whole "
                "answer may hold: stream it (stream=true), or raise [pipeline] "
                "max_unread_bytes",
                param="stream",
                code="answer_too_large",
            )
        self._kept += size

    @property
    def _audio_id(self) -> str:
        return f"audio-{self._id[9:]}"

    def _event(self, choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        chunk = ChatCompletionChunk(
            id=self._id, created=self._created, model=self._model, choices=choices, usage=usage
        )
        return b"data: " + encode(chunk) + b"\n\n"

    def _usage(self) -> Usage:
        """The model's own token counts, where its text stage said them (its
        completion's ``meta``); else words of the prompt and text outputs."""
        usage = None if self._meta is None else self._meta.get("usage")
        if isinstance(usage, dict):
            prompt_tokens = int(usage.get("prompt_tokens", 0))
            completion = int(usage.get("completion_tokens", 0))
            return Usage(prompt_tokens, completion, prompt_tokens + completion)
        prompt = self._plan.prompt
        if isinstance(prompt, dict):
            prompt = prompt.get("text") or ""
        words = len(str(prompt).split())
        return Usage(words, self._tokens, words + self._tokens)

    def closing(self) -> bytes:
        """The end of a streamed answer: the finish chunk, the usage chunk if asked
        for, ``[DONE]``."""
        events = b""
        for resampler in self._resamplers.values():  # the filter's last samples
            if rest := resampler.flush():
                before, after = self._template("audio")
                events += before + base64.b64encode(rest) + after
        events += self._event([ChunkChoice(0, Delta(), self.finish)])
        if self._plan.include_usage:
            events += self._event([], self._usage())
        return events + DONE

    def whole(self, metrics: RequestMetrics | None) -> ChatCompletion:
        """The ``chat.completion`` object of a whole (non-streamed) answer."""
        text = "".join(self._text)
        wants_text = any(o.modality == "text" for o in self._plan.outputs)
        audio = None
        audio_outputs = [o for o in self._plan.outputs if o.modality == "audio"]
        if audio_outputs:
            pcm = b"".join(self._audio)
            rate = audio_outputs[0].sample_rate
            if self._plan.audio_format == "wav":
                pcm = wav_bytes(pcm, rate)
            elif self._plan.audio_format == "pcm16":
                resampler = Resampler(rate, OUT_RATE)
                pcm = resampler.feed(pcm) + resampler.flush()
            else:  # mp3, opus, aac, flac: a whole file
                encoder = AudioEncoder(self._plan.audio_format, rate)
                pcm = encoder.feed(pcm) + encoder.finish()
            audio = MessageAudio(self._audio_id, _b64(pcm), int(time.time()) + 3600, text)
        message = Message(content=text if wants_text else None, audio=audio)
        return ChatCompletion(
            id=self._id,
            created=self._created,
            model=self._model,
            choices=[Choice(0, message, self.finish or "stop")],
            usage=self._usage(),
            metrics=self._metrics(metrics),
        )

    def _metrics(self, metrics: RequestMetrics | None) -> Metrics:
        if metrics is None:
            return Metrics(None, None, 0.0)
        plan = self._plan
        return Metrics(
            plan.first_output(metrics, "text"),
            plan.first_output(metrics, "audio"),
            metrics.e2e_latency,
        )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _base64_slices(slices: Iterable[bytes]) -> Iterator[bytes]:
    """The base64 of ``slices`` joined, a slice at a time: each slice's whole groups
    of 3 bytes, the rest carried to the next (so the pieces join into the whole's
    base64, padded only at its end)."""
    carry = b""
    for data in slices:
        if carry:
            data = carry + data
        whole = len(data) - len(data) % 3
        carry = data[whole:]
        piece = base64.b64encode(memoryview(data)[:whole])
        del data  # the slice is not kept while its base64 is written
        if piece:
            yield piece
        del piece
    if carry:
        yield base64.b64encode(carry)


def _json_slices(text: str) -> Iterator[bytes]:
    """The inside of the JSON string of ``text`` (no quotes), ``_TEXT_SLICE``
    characters at a time (JSON escapes one character at a time: the slices' insides
    join into the whole's)."""
    for start in range(0, len(text), _TEXT_SLICE):
        yield encode(text[start : start + _TEXT_SLICE])[1:-1]


def _wav_header(size: int, sample_rate: int) -> bytes:
    """The 44-byte header of :func:`~omni_trio._audio.wav_bytes` for ``size`` bytes of
    16-bit mono PCM at ``sample_rate`` Hz."""
    return _WAV_HEADER.pack(
        b"RIFF", 36 + size, b"WAVE", b"fmt ", 16, 1, 1, sample_rate, 2 * sample_rate,
        2, 16, b"data", size,
    )  # fmt: skip
