"""``omni-trio talk``'s conversation: one turn on ``/v1/realtime``, spoken (audio in
any format FFmpeg reads) or typed, and the answer it gets, timed from the client's
side of the socket."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import attrs
import trio

from ._audio_in import NotAudioError, decode_audio
from ._client import ClientError, RealtimeConnection, Server, get_json

__all__ = ["RATE", "TRAILING_SILENCE_MS", "Turn", "spoken_pcm", "talk"]

#: The Realtime API's audio: 16-bit mono PCM at 24 kHz, both ways.
RATE = 24_000
#: Silence sent after a spoken turn, so that the server's voice activity detection
#: ends it (its default ``silence_duration_ms`` is 500).
TRAILING_SILENCE_MS = 1000
#: Audio per ``input_audio_buffer.append`` event.
CHUNK_MS = 100
#: The longest audio a turn sends.
MAX_SECONDS = 60.0


@attrs.define
class Turn:
    """What one turn got.

    Attributes:
      heard: What the server heard the user say (a spoken turn; ``None`` if it said
          nothing of it).
      answer: The answer's transcript (its text, for a text-only answer).
      audio: The answer's audio: 16-bit mono PCM at :data:`RATE`.
      first_audio: Seconds from the end of the user's turn (the server's
          ``speech_stopped``, or the typed turn's sending) to the answer's first
          audio; ``None`` without audio.
      first_text: The same, to the answer's first text.
      done: The same, to ``response.done``.
      heard_after: The same, to the user's transcript.
    """

    heard: str | None = None
    answer: str = ""
    audio: bytes = b""
    first_audio: float | None = None
    first_text: float | None = None
    done: float | None = None
    heard_after: float | None = None


def spoken_pcm(data: bytes) -> bytes:
    """An audio file's sound, as the Realtime API takes it (16-bit mono at 24 kHz),
    with :data:`TRAILING_SILENCE_MS` of silence after it.

    Raises:
      NotAudioError: FFmpeg finds no audio in it, or it is longer than
          :data:`MAX_SECONDS`.
    """
    pcm, _ = decode_audio(data, max_seconds=MAX_SECONDS, rate=RATE)
    if not pcm:
        raise NotAudioError("the file has no sound in it")
    return pcm + b"\x00\x00" * (RATE * TRAILING_SILENCE_MS // 1000)


async def talk(
    server: Server,
    *,
    pcm: bytes | None = None,
    text: str | None = None,
    model: str | None = None,
    on_event: Callable[[str, Turn], None] = lambda what, turn: None,
) -> Turn:
    """Say ``pcm`` (see :func:`spoken_pcm`) or ``text`` to ``server``'s ``model``
    (default: the one it serves) in a new session, and return its answer once the
    response is done. ``on_event(what, turn)`` is called as the turn goes:
    ``"heard"``, ``"first_audio"``, ``"done"``.

    Raises:
      ClientError: the server cannot be reached, refuses the session, says an
          ``error``, or the response ends other than ``completed``.
    """
    if (pcm is None) == (text is None):
        raise ValueError("give exactly one of pcm and text")
    if model is None:
        served = await get_json(server, "/v1/models")
        try:
            model = str(served["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise ClientError(f"{server} lists no model at /v1/models") from None
    target = "/v1/realtime?model=" + _quoted(model)
    turn = Turn()
    async with await RealtimeConnection.open(server, target) as ws:
        await _expect(ws, "session.created")
        ended: float | None = None
        if text is not None:
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": text}],
            }
            await ws.send({"type": "conversation.item.create", "item": item})
            await ws.send({"type": "response.create"})
            ended = trio.current_time()
        else:
            assert pcm is not None
            step = RATE * 2 * CHUNK_MS // 1000
            for start in range(0, len(pcm), step):
                chunk = base64.b64encode(pcm[start : start + step]).decode()
                await ws.send({"type": "input_audio_buffer.append", "audio": chunk})
        audio: list[bytes] = []
        transcript: list[str] = []
        while True:
            event = await ws.receive()
            if event is None:
                raise ClientError(f"{server} closed the session: {ws.closed}")
            kind = event.get("type")
            now = trio.current_time()
            since = None if ended is None else now - ended
            if kind == "error":
                raise await _refused(ws, event)
            if kind == "input_audio_buffer.speech_stopped":
                ended = now
            elif kind == "conversation.item.input_audio_transcription.completed":
                turn.heard, turn.heard_after = event.get("transcript", ""), since
                on_event("heard", turn)
            elif kind == "response.output_audio.delta":
                if turn.first_audio is None:
                    turn.first_audio = since
                    on_event("first_audio", turn)
                audio.append(base64.b64decode(event["delta"]))
            elif kind in ("response.output_audio_transcript.delta", "response.output_text.delta"):
                if turn.first_text is None:
                    turn.first_text = since
                transcript.append(event["delta"])
            elif kind == "response.done":
                response = event["response"]
                turn.answer, turn.audio, turn.done = "".join(transcript), b"".join(audio), since
                if response.get("status") != "completed":
                    why = response.get("status_details") or {}
                    raise ClientError(
                        f"the response ended {response.get('status')}: "
                        f"{why.get('reason') or why.get('error') or 'no reason given'}"
                    )
                on_event("done", turn)
                return turn


async def _expect(ws: RealtimeConnection, kind: str) -> None:
    event = await ws.receive()
    if event is None:
        raise ClientError(f"the server closed the session: {ws.closed}")
    if event.get("type") == "error":
        raise await _refused(ws, event)
    if event.get("type") != kind:
        raise ClientError(f"the server sent {event.get('type')!r}, not {kind!r}")


async def _refused(ws: RealtimeConnection, event: dict[str, Any]) -> ClientError:
    """The server's ``error``, to raise -- once the session's close that may follow
    it has come (for a second at most): a client that closes while the server
    closes makes Hypercorn's reader and the app's task write to the socket at
    once, which Trio refuses (``BusyResourceError``)."""
    with trio.move_on_after(1):
        while await ws.receive() is not None:
            pass
    return ClientError(f"the server said: {event['error'].get('message')}")


def _quoted(text: str) -> str:
    import urllib.parse

    return urllib.parse.quote(text, safe="")
