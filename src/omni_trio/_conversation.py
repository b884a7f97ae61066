"""A conversational prompt, as a request carries it: what the user said, the
conversation before it, and how the model should answer.

An *utterance* is plain data (msgpack carries it to every worker)::

    {"text": "What is the opposite of hot?",          # or "audio" and "sample_rate"
     "context": [{"role": "system", "text": "Be brief."},
                 {"role": "user", "text": "Hi"}, {"role": "assistant", "text": "Hello!"}],
     "sampling": {"temperature": 0.0, "max_tokens": 64}}   # optional

A listening pipeline's first stage hears ``audio`` (or passes ``text`` on) and a
language model answers the turn in its ``context``, sampled as ``sampling`` says
(:func:`omni_trio.speech.utterance` makes one; the server makes one per request
of a pipeline that takes them). Everything here is pure: no event loop, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

import attrs

__all__ = [
    "ROLES",
    "SAMPLING_KEYS",
    "Sampling",
    "Turn",
    "Utterance",
    "check_context",
    "check_sampling",
    "checked_utterance",
    "utterance",
]

#: Whisper's rate: an utterance given as text is said to have it (it has no audio).
TEXT_RATE = 16_000
ROLES = ("system", "user", "assistant")
#: An utterance's keys: what was said, its context and sampling; how to speak the
#: answer (``speech``: :func:`omni_trio.speech.settings`); and how to transcribe it
#: (``transcribe``: a transcription request's, see :func:`omni_trio.speech.listen`).
_KEYS = ("audio", "sample_rate", "text", "context", "sampling", "speech", "transcribe")
#: The sampling settings a request may carry, as OpenAI's API names them.
SAMPLING_KEYS = ("temperature", "top_p", "max_tokens", "seed", "stop")
#: OpenAI's bound on ``stop``.
MAX_STOPS = 4


class Turn(TypedDict):
    """One turn of the conversation so far: who spoke, and what they said
    (``"system"``: the instructions the model answers under)."""

    role: Literal["system", "user", "assistant"]
    text: str


class Sampling(TypedDict, total=False):
    """How a language model should answer one request (OpenAI's names; each optional:
    absent, the stage's own setting holds).

    Attributes:
      temperature: 0 (greedy: the same answer every time) to 2.
      top_p: Nucleus sampling's share, above 0 and at most 1.
      max_tokens: The answer's length at most, in the model's tokens.
      seed: The sampler's seed (a 64-bit signed integer, as OpenAI's).
      stop: Up to 4 strings; the answer ends before the first it would contain.
    """

    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    stop: list[str]


@attrs.frozen
class Utterance:
    """An utterance, checked: exactly one of ``audio`` and ``text``."""

    audio: bytes | None
    sample_rate: int
    text: str | None
    context: list[Turn]
    sampling: Sampling


def utterance(
    *,
    audio: bytes | None = None,
    sample_rate: int = 24_000,
    text: str | None = None,
    context: Sequence[Turn] = (),
    sampling: Sampling | None = None,
) -> dict[str, Any]:
    """A request's input for a conversational pipeline: what the user said, the
    conversation so far, and how to answer.

    Give exactly one of ``audio`` (16-bit mono little-endian PCM at ``sample_rate``
    Hz, for a pipeline that listens) and ``text`` (the user's words as text: a
    listening stage passes them through as the transcript). ``context``: the earlier
    turns, oldest first, each ``{"role": "system" | "user" | "assistant", "text":
    ...}``. ``sampling``: how a language model should answer (:class:`Sampling`:
    ``temperature``, ``top_p``, ``max_tokens``, ``seed``, ``stop``); engines that do
    not sample ignore it.

    Returns ``{"audio": bytes, "sample_rate": int, "context": [...]}`` or ``{"text":
    str, "context": [...]}``, with ``"sampling"`` when it was given: plain data, as
    the request carries it.

    Raises:
      ValueError: not exactly one of ``audio`` and ``text``, an odd number of audio
          bytes, a rate that is not a positive integer, a malformed turn, or a
          sampling setting out of range; the message names the field.
    """
    fields: dict[str, Any] = {"context": context}
    if audio is not None:
        fields["audio"] = audio
        fields["sample_rate"] = sample_rate
    if text is not None:
        fields["text"] = text
    if sampling is not None:
        fields["sampling"] = sampling
    checked = checked_utterance(fields)
    result: dict[str, Any]
    if checked.audio is not None:
        result = {
            "audio": checked.audio,
            "sample_rate": checked.sample_rate,
            "context": checked.context,
        }
    else:
        result = {"text": checked.text, "context": checked.context}
    if checked.sampling:
        result["sampling"] = checked.sampling
    return result


def _invalid(message: str) -> ValueError:
    return ValueError(f"utterance: {message}")


def checked_utterance(value: object) -> Utterance:
    """A request's input as an utterance (a ``str`` is the user's text, with no
    context).

    Raises:
      ValueError: it is not one (the message names what is wrong).
    """
    fail = _invalid
    if isinstance(value, str):
        return Utterance(None, TEXT_RATE, value, [], {})
    if not isinstance(value, Mapping):
        raise fail(
            "expected a dict ({'audio': PCM bytes, 'sample_rate': Hz} or {'text': str}, "
            f"with a 'context') or a str, got {type(value).__name__}"
        )
    unknown = [repr(k) for k in value if k not in _KEYS]
    if unknown:
        keys = ", ".join(repr(k) for k in _KEYS)
        raise fail(f"unknown key(s) {', '.join(unknown)}: the keys are {keys}")
    if ("audio" in value) == ("text" in value):
        raise fail(
            "give exactly one of 'audio' and 'text', got "
            + ("both" if "audio" in value else "neither")
        )
    context = check_context(value.get("context", []), fail)
    sampling = check_sampling(value.get("sampling", {}), fail)
    if "text" in value:
        text = value["text"]
        if not isinstance(text, str):
            raise fail(f"'text' must be a str, got {type(text).__name__}")
        if "sample_rate" in value:
            raise fail("'sample_rate' is the rate of 'audio': text has none")
        return Utterance(None, TEXT_RATE, text, context, sampling)
    audio = value["audio"]
    if not isinstance(audio, bytes | bytearray | memoryview):
        raise fail(f"'audio' must be bytes (16-bit mono PCM), got {type(audio).__name__}")
    audio = bytes(audio)
    if len(audio) % 2:
        raise fail(
            f"'audio' must be 16-bit PCM, 2 bytes a sample, got an odd number of bytes "
            f"({len(audio):,})"
        )
    if "sample_rate" not in value:
        raise fail("'sample_rate' is missing: the rate of 'audio', in Hz")
    rate = value["sample_rate"]
    if type(rate) is not int or rate < 1:
        raise fail(f"'sample_rate' must be a positive integer (Hz), got {rate!r}")
    return Utterance(audio, rate, None, context, sampling)


def check_context(turns: object, fail: Any = _invalid) -> list[Turn]:
    """``turns`` checked as a conversation so far: a list of ``{"role", "text"}``.

    Raises:
      ValueError: from ``fail(message)``, naming the turn and the field.
    """
    if not isinstance(turns, list | tuple):
        raise fail(f"'context' must be a list of turns, got {type(turns).__name__}")
    checked: list[Turn] = []
    for index, turn in enumerate(turns):
        where = f"context[{index}]"
        if not isinstance(turn, Mapping) or set(turn) != {"role", "text"}:
            shown = sorted(turn) if isinstance(turn, Mapping) else type(turn).__name__
            raise fail(f"{where} must be a dict of 'role' and 'text', got {shown}")
        role, text = turn["role"], turn["text"]
        if role not in ROLES:
            raise fail(f"{where}.role must be 'system', 'user' or 'assistant', got {role!r}")
        if not isinstance(text, str):
            raise fail(f"{where}.text must be a str, got {type(text).__name__}")
        checked.append({"role": role, "text": text})
    return checked


def check_sampling(value: object, fail: Any = _invalid) -> Sampling:
    """``value`` checked as :class:`Sampling` (``stop`` as a list, a lone string
    made one).

    Raises:
      ValueError: from ``fail(message)``: an unknown setting, or one of the wrong
          type or out of range, named as ``sampling.<key>``.
    """
    if not isinstance(value, Mapping):
        raise fail(f"'sampling' must be a dict, got {type(value).__name__}")
    unknown = [repr(k) for k in value if k not in SAMPLING_KEYS]
    if unknown:
        keys = ", ".join(repr(k) for k in SAMPLING_KEYS)
        raise fail(f"unknown sampling setting(s) {', '.join(unknown)}: they are {keys}")
    checked: Sampling = {}

    def number(key: str, low: float, high: float, *, low_open: bool = False) -> float | None:
        given = value.get(key)
        if given is None:
            return None
        fits = low < given if low_open else low <= given
        if (
            isinstance(given, bool)
            or not isinstance(given, int | float)
            or not math.isfinite(given)
            or not (fits and given <= high)
        ):
            bound = f"above {low:g}" if low_open else f"from {low:g}"
            raise fail(f"sampling.{key} must be a number {bound} to {high:g}, got {given!r}")
        return float(given)

    if (temperature := number("temperature", 0, 2)) is not None:
        checked["temperature"] = temperature
    if (top_p := number("top_p", 0, 1, low_open=True)) is not None:
        checked["top_p"] = top_p
    for key, low in (("max_tokens", 1), ("seed", -(2**63))):
        given = value.get(key)
        if given is None:
            continue
        if type(given) is not int or given < low or given >= 2**63:
            what = "a positive integer" if low == 1 else "an integer"
            raise fail(f"sampling.{key} must be {what}, got {given!r}")
        checked[key] = given  # type: ignore[literal-required]
    stop = value.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if (
            not isinstance(stops, list | tuple)
            or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOPS
        ):
            raise fail(
                f"sampling.stop must be a non-empty string or a list of up to {MAX_STOPS} "
                f"of them, got {stop!r}"
            )
        if stops:
            checked["stop"] = list(stops)
    return checked
