"""Voices and speeds: what a request asks the talker and code2wav for.

OpenAI's speech API names its voices (``alloy``, ``nova``, ...) and takes a speed
from 0.25 to 4.0. eSpeak NG has voices of its own -- a language, and a variant after
a ``+`` (``en-us+f3``: American English, the third female variant). :data:`VOICES`
maps each OpenAI name to one of them; any name eSpeak NG knows works as it is.

A request that asks for a voice or a speed carries :func:`settings` in its input:
``{"speech": {"voice": ..., "speed": ...}}`` beside its text (a speech request's, made
by :func:`say`) or its utterance. The talker and code2wav read it from their own
input -- the entry's is the request's, a stage downstream in async_chunk mode gets it
from :func:`prewarm` -- and speak the rest of the pipeline's defaults otherwise.
Pure data: no eSpeak here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_SPEED",
    "MIN_SPEED",
    "VOICES",
    "prewarm",
    "say",
    "settings",
    "settings_of",
    "words_per_minute",
]

#: OpenAI's voices, each an eSpeak NG voice and variant (its language, ``+``, the
#: variant: ``m1``-``m7`` male, ``f1``-``f5`` female). ``fable``, ``ballad`` and
#: ``marin`` speak British English, the others American.
VOICES: Mapping[str, str] = {
    "alloy": "en-us+f2",
    "ash": "en-us+m3",
    "ballad": "en+m4",
    "cedar": "en-us+m6",
    "coral": "en-us+f3",
    "echo": "en-us+m1",
    "fable": "en+m2",
    "marin": "en+f3",
    "nova": "en-us+f4",
    "onyx": "en-us+m7",
    "sage": "en-us+f1",
    "shimmer": "en-us+f5",
    "verse": "en-us+m5",
}
MIN_SPEED = 0.25
MAX_SPEED = 4.0
#: eSpeak NG's rates, in words per minute: it speaks no slower than 80.
_SLOWEST, _FASTEST = 80, 700


def settings(voice: str | None = None, speed: float = 1.0) -> dict[str, Any]:
    """A request's speech settings: ``voice`` (an OpenAI name, as :data:`VOICES`
    maps it, or an eSpeak NG voice; ``None``: the stage's own) and ``speed`` (1.0:
    the stage's ``words_per_minute``).

    Raises:
      ValueError: ``speed`` is not a number from 0.25 to 4.0, or ``voice`` is not a
          non-empty string.
    """
    if (
        isinstance(speed, bool)
        or not isinstance(speed, int | float)
        or not math.isfinite(speed)
        or not MIN_SPEED <= speed <= MAX_SPEED
    ):
        raise ValueError(f"speed must be a number from {MIN_SPEED} to {MAX_SPEED}, not {speed!r}")
    found: dict[str, Any] = {"speed": float(speed)}
    if voice is not None:
        if not isinstance(voice, str) or not voice.strip():
            raise ValueError(f"voice must be a voice's name, not {voice!r}")
        found["voice"] = VOICES.get(voice, voice)
    return found


def say(text: str, *, voice: str | None = None, speed: float = 1.0) -> dict[str, Any]:
    """A speech request's input (for a route that enters at the talker): ``text``
    to speak, in ``voice`` at ``speed`` (see :func:`settings`).

    Raises:
      TypeError: ``text`` is not a string.
      ValueError: a bad ``voice`` or ``speed`` (see :func:`settings`).
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, not {type(text).__name__}")
    return {"text": text, "speech": settings(voice, speed)}


def settings_of(inputs: Any) -> Mapping[str, Any]:
    """The speech settings a stage's input carries (``{}``: none): a request's own
    (``{"speech": ...}``), or the settings themselves, as :func:`prewarm` hands them
    downstream."""
    if isinstance(inputs, Mapping):
        found = inputs.get("speech", inputs)
        if isinstance(found, Mapping) and ("voice" in found or "speed" in found):
            return found
    return {}


def words_per_minute(base: int, speed: Any) -> int:
    """``base`` words per minute at ``speed``, within what eSpeak NG can speak (no
    slower than 80: a speed below ``80 / base`` speaks at 80)."""
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not speed > 0:
        speed = 1.0
    return max(_SLOWEST, min(_FASTEST, round(base * float(speed))))


def prewarm(prompt: Any) -> Any:
    """async_chunk: the talker's and code2wav's placeholder input -- the request's
    speech settings, if it has any (``None`` otherwise: they read the stream)."""
    found = settings_of(prompt) if isinstance(prompt, Mapping) and "speech" in prompt else {}
    return dict(found) or None
