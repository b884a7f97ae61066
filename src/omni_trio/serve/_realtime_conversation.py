"""A Realtime session's state, with no I/O: the conversation, the input audio buffer,
and each response's events built from its request's outputs.

``_realtime_state`` decides with these; the Trio driver (``_realtime_session``) owns
the tasks, the socket and the cancel scopes. All of it is testable with plain calls
(as ``_answer`` is for chat completions).
"""

from __future__ import annotations

import base64
import itertools
import math
from collections import deque
from typing import TYPE_CHECKING, Any, Literal

import attrs

from ._realtime_protocol import SAMPLE_RATE, RealtimeError, ServerEvents

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._messages import OrchOutput
    from ._model import FinalOutput

__all__ = ["AudioBuffer", "Conversation", "Item", "Out", "ResponseEvents", "Status"]

Status = Literal["completed", "cancelled", "failed", "incomplete"]
_BYTES_PER_MS = SAMPLE_RATE * 2 // 1000  # 16-bit mono at 24 kHz: 48 bytes per ms
#: The most audio one ``response.output_audio.delta`` carries: a vocoder's output (an
#: eSpeak phrase may be seconds long) goes out in pieces of at most this much, so no
#: one frame is large to encode and compress, and a client can play the first sooner.
DELTA_BYTES = 500 * _BYTES_PER_MS


def _ms(size: int) -> int:
    return size // _BYTES_PER_MS


@attrs.frozen
class Out:
    """A response's event on its way out, with what of the answer it carries: the
    answer's item counts it as heard once it is written (:meth:`ResponseEvents.sent`).
    """

    text: str
    words: str = ""
    audio_bytes: int = 0


@attrs.define(eq=False)
class Item:
    """One conversation item: a user's turn or an assistant's answer.

    Attributes:
      id: Its ``item_id``.
      role: ``"user"`` or ``"assistant"``.
      text: What was said, as far as it is known: a user's typed text or its audio's
          transcript (``None`` until the transcript comes); an answer's transcript
          as written to the client so far, cut to what was heard if the client
          truncated it.
      audio: A user turn's audio (24 kHz PCM16) until a response takes it.
      audio_ms: An answer's audio written to the client so far, in ms.
      cut: An answer the client truncated: its text and audio are what the client
          played, and stay so however much more of it is written.
    """

    id: str
    role: Literal["user", "assistant"]
    text: str | None = None
    audio: bytes | None = None
    audio_ms: int = 0
    spoken: bool = False  # a user turn of audio (its audio may be gone: it was heard)
    cut: bool = False

    def view(self, status: str = "completed") -> dict[str, Any]:
        """The item as its ``conversation.item.*`` events show it."""
        if self.role == "user":
            if self.spoken:
                content: dict[str, Any] = {"type": "input_audio", "transcript": self.text}
            else:
                content = {"type": "input_text", "text": self.text}
        else:
            content = {"type": "output_audio", "transcript": self.text or ""}
        return {
            "id": self.id,
            "type": "message",
            "object": "realtime.item",
            "status": status,
            "role": self.role,
            "content": [content],
        }


@attrs.define
class Conversation:
    """The items of a session, in order; at most ``max_items`` (the oldest go).

    What the thinker gets as context is every item with known text but the turn it
    answers (:meth:`context`).
    """

    max_items: int = 64
    items: deque[Item] = attrs.field(factory=deque)
    _ids: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))
    prefix: str = "item_"

    def new_id(self) -> str:
        return f"{self.prefix}{next(self._ids)}"

    def add(self, item: Item) -> Item:
        self.items.append(item)
        while len(self.items) > self.max_items:
            self.items.popleft()
        return item

    def find(self, item_id: str) -> Item | None:
        return next((item for item in self.items if item.id == item_id), None)

    def last_user(self) -> Item | None:
        return next((item for item in reversed(self.items) if item.role == "user"), None)

    def context(self, before: Item | None) -> list[dict[str, str]]:
        """The conversation before ``before`` (all of it if ``None``), as the listen
        stage's utterance carries it: ``[{"role", "text"}]``, items with text only."""
        turns = []
        for item in self.items:
            if item is before:
                break
            if item.text:
                turns.append({"role": item.role, "text": item.text})
        return turns

    def truncate(self, item_id: str, audio_end_ms: int, event_id: str | None) -> Item:
        """Cut an answer to the audio the client played: its text keeps the share of
        its words that the played share of its audio carried (the words and the
        audio of one answer go at about the same pace: this is an estimate, to the
        nearest word).

        Raises:
          RealtimeError: no such item, not an answer, or ``audio_end_ms`` past its
              audio.
        """
        item = self.find(item_id)
        if item is None:
            raise RealtimeError(
                f"item_id: no item {item_id!r} in the conversation",
                event_id=event_id,
                param="item_id",
                code="item_not_found",
            )
        if item.role != "assistant":
            raise RealtimeError(
                f"item_id: {item_id!r} is a {item.role} item; only answers can be truncated",
                event_id=event_id,
                param="item_id",
            )
        if audio_end_ms > item.audio_ms:
            raise RealtimeError(
                f"audio_end_ms: {audio_end_ms} is past the item's audio ({item.audio_ms} ms)",
                event_id=event_id,
                param="audio_end_ms",
            )
        words = (item.text or "").split()
        if item.audio_ms:
            keep = math.floor(len(words) * audio_end_ms / item.audio_ms + 0.5)
            item.text = " ".join(words[:keep])
            item.audio_ms = audio_end_ms
            item.cut = True
        return item


@attrs.define
class AudioBuffer:
    """The input audio buffer: 24 kHz PCM16 appended since the last commit or clear,
    with its place on the session's audio clock (ms since the first append).

    Attributes:
      max_bytes: What it may hold (``--realtime-max-buffer-seconds``).
      start_ms: The session's audio clock at the buffer's first byte.
    """

    max_bytes: int
    pcm: bytearray = attrs.field(factory=bytearray)
    start_ms: int = 0

    @property
    def end_ms(self) -> int:
        return self.start_ms + _ms(len(self.pcm))

    def append(self, pcm: bytes, event_id: str | None) -> None:
        """Raises RealtimeError (the append is dropped) past ``max_bytes``."""
        if len(self.pcm) + len(pcm) > self.max_bytes:
            raise RealtimeError(
                f"audio: the input audio buffer would hold more than "
                f"{self.max_bytes / _BYTES_PER_MS / 1000:g} s (the server's "
                "--realtime-max-buffer-seconds): commit or clear it",
                event_id=event_id,
                param="audio",
                code="input_audio_buffer_full",
            )
        self.pcm += pcm

    def between(self, start_ms: int, end_ms: int) -> bytes:
        """The audio from ``start_ms`` to ``end_ms`` on the session's clock (clipped
        to what the buffer holds)."""
        first = max(0, start_ms - self.start_ms) * _BYTES_PER_MS
        last = max(0, end_ms - self.start_ms) * _BYTES_PER_MS
        return bytes(self.pcm[first:last])

    def drop_before(self, ms: int) -> None:
        """Forget the audio before ``ms`` (silence before a turn, past its padding)."""
        cut = max(0, ms - self.start_ms) * _BYTES_PER_MS
        if cut:
            cut = min(cut, len(self.pcm))
            del self.pcm[:cut]
            self.start_ms += _ms(cut)

    def take(self) -> bytes:
        """All of it; the buffer starts over at its end."""
        pcm = bytes(self.pcm)
        self.start_ms = self.end_ms
        self.pcm.clear()
        return pcm

    def clear(self) -> None:
        self.take()


class ResponseEvents:
    """One response's events, from its request's outputs.

    Args:
      events: The session's event builder.
      response_id: The response's id.
      answer: The assistant item the response fills.
      heard: The user item whose audio the response's listening stage transcribes
          (``None``: a text turn, or no listening stage).
      outputs: The final outputs the response's request asks for, by stage.
      modality: ``"audio"`` (audio and its transcript) or ``"text"``.
      resample: Turns a chunk of the audio stage's PCM into 24 kHz (identity when
          it already is).
    """

    def __init__(
        self,
        events: ServerEvents,
        response_id: str,
        answer: Item,
        heard: Item | None,
        outputs: dict[int, FinalOutput],
        modality: Literal["audio", "text"],
        resample: Callable[[bytes], bytes],
    ) -> None:
        self._events = events
        self.id = response_id
        self.answer = answer
        self.heard = heard
        self._outputs = outputs
        self.modality = modality
        self._resample = resample
        self._text: list[str] = []  # the answer's, as made
        self._audio_sent = 0
        self._over = False  # done: the answer's text is known
        #: The model's token counts, where its text stage said them (its meta).
        self._usage: dict[str, Any] | None = None

    @property
    def stage_ids(self) -> frozenset[int]:
        """The final stages the response's request streams back."""
        return frozenset(self._outputs)

    def view(self, status: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "object": "realtime.response",
            "id": self.id,
            "status": status,
            "status_details": details,
            "output_modalities": [self.modality],
            "output": [] if status == "in_progress" else [self.answer.view(_item_status(status))],
            "conversation_id": None,
            "usage": self._usage_view(),
        }

    def _usage_view(self) -> dict[str, Any] | None:
        """``response.usage``, as OpenAI's Realtime API shapes it: the model's own
        counts (all of them text tokens), where it said them."""
        usage = self._usage
        if usage is None:
            return None
        prompt = int(usage.get("prompt_tokens", 0))
        answer = int(usage.get("completion_tokens", 0))
        return {
            "total_tokens": prompt + answer,
            "input_tokens": prompt,
            "output_tokens": answer,
            "input_token_details": {"text_tokens": prompt, "audio_tokens": 0, "cached_tokens": 0},
            "output_token_details": {"text_tokens": answer, "audio_tokens": 0},
        }

    def created(self, previous_item_id: str | None) -> list[str]:
        """``response.created``, and the answer's item added after
        ``previous_item_id``."""
        event = self._events.event
        item = self.answer.view("in_progress")
        return [
            event("response.created", response=self.view("in_progress")),
            event("response.output_item.added", response_id=self.id, output_index=0, item=item),
            event("conversation.item.added", previous_item_id=previous_item_id, item=item),
        ]

    def sent(self, out: Out) -> None:
        """``out`` was written to the client: the answer, as the user has it, holds it
        (unless the client cut it: then it holds what was played)."""
        answer = self.answer
        if out.words and not (answer.cut or self._over):
            answer.text = (answer.text or "") + out.words
        if out.audio_bytes:
            self._audio_sent += out.audio_bytes
            if not answer.cut:
                answer.audio_ms = _ms(self._audio_sent)

    def take(self, batch: list[OrchOutput]) -> list[Out]:
        """A batch of the request's outputs as events (the terminal's data too)."""
        events = []
        for output in batch:
            meta = output.meta
            if meta is not None and isinstance(meta.get("usage"), dict):
                final = self._outputs.get(output.stage_id)
                if final is not None and final.modality == "text":
                    self._usage = meta["usage"]
            if output.data is None or output.finish_reason not in (None, "completed"):
                continue
            final = self._outputs.get(output.stage_id)
            if final is None:
                continue
            if final.modality == "transcript":
                events += [Out(text) for text in self._heard(output.data)]
            elif final.modality == "text":
                events.append(self._delta(output.data))
            else:
                events += self._audio(output.data, final.label)
        return events

    def _heard(self, data: object) -> list[str]:
        heard = self.heard
        if heard is None:
            return []
        heard.text = str(data).strip()
        heard.audio = None  # transcribed: the audio is not kept
        event = self._events.event
        return [
            event(
                "conversation.item.input_audio_transcription.completed",
                item_id=heard.id,
                content_index=0,
                transcript=heard.text,
                usage={"type": "duration", "seconds": 0},
            ),
            event("conversation.item.done", previous_item_id=None, item=heard.view()),
        ]

    def _delta(self, data: object) -> Out:
        text = data if isinstance(data, str) else str(data)
        self._text.append(text)
        kind = (
            "response.output_audio_transcript.delta"
            if self.modality == "audio"
            else "response.output_text.delta"
        )
        event = self._events.event(
            kind,
            response_id=self.id,
            item_id=self.answer.id,
            output_index=0,
            content_index=0,
            delta=text,
        )
        return Out(event, words=text)

    def _audio(self, data: object, label: str) -> list[Out]:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"{label} sent audio that is not bytes: {type(data).__name__}")
        pcm = self._resample(bytes(data))
        if not pcm:
            return []
        return [
            Out(
                self._events.event(
                    "response.output_audio.delta",
                    response_id=self.id,
                    item_id=self.answer.id,
                    output_index=0,
                    content_index=0,
                    delta=base64.b64encode(piece).decode("ascii"),
                ),
                audio_bytes=len(piece),
            )
            for start in range(0, len(pcm), DELTA_BYTES)
            if (piece := pcm[start : start + DELTA_BYTES])
        ]

    def done(self, status: Status, details: dict[str, Any] | None = None) -> list[str]:
        """The response's last events: each part's ``done``, the item's, then
        ``response.done``. A completed answer holds all its text (its deltas are
        queued before these), and so does a failed or incomplete one; a cancelled
        one, only what was written to the client (the rest is dropped); one the
        client truncated, what it played."""
        event = self._events.event
        where = {"response_id": self.id, "item_id": self.answer.id, "output_index": 0}
        self._over = True
        if status != "cancelled" and not self.answer.cut:
            # every delta made is queued before these: it will all be written
            self.answer.text = "".join(self._text)
        text = self.answer.text or ""
        events = []
        heard = self.heard
        if status == "failed" and heard is not None and heard.text is None:
            # the turn was never heard: its transcript will not come
            error = (details or {}).get("error") or {"message": "the response failed"}
            events.append(
                event(
                    "conversation.item.input_audio_transcription.failed",
                    item_id=heard.id,
                    content_index=0,
                    error={
                        "type": "transcription_error",
                        "code": None,
                        "message": error.get("message"),
                        "param": None,
                    },
                )
            )
        if self.modality == "audio":
            events.append(event("response.output_audio.done", **where, content_index=0))
            events.append(
                event(
                    "response.output_audio_transcript.done",
                    **where,
                    content_index=0,
                    transcript=text,
                )
            )
        else:
            events.append(event("response.output_text.done", **where, content_index=0, text=text))
        item = self.answer.view(_item_status(status))
        events.append(
            event("response.output_item.done", response_id=self.id, output_index=0, item=item)
        )
        events.append(event("conversation.item.done", previous_item_id=None, item=item))
        events.append(event("response.done", response=self.view(status, details)))
        return events


def _item_status(status: str) -> str:
    return {"completed": "completed", "in_progress": "in_progress"}.get(status, "incomplete")
