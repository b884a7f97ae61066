"""Which voices a request may ask for: OpenAI's names
(:data:`omni_trio.speech.VOICES`) or any voice eSpeak NG has in this process; and
the 400 that names them for any other. Every endpoint that speaks checks its voice
here (a chat answer's ``audio.voice``, ``/v1/audio/speech``'s ``voice``, a realtime
session's ``audio.output.voice``)."""

from __future__ import annotations

from ..speech._voices import VOICES
from ._protocol import OpenAIError

__all__ = ["knows_voice", "unknown_voice"]


def unknown_voice(voice: str, param: str) -> OpenAIError:
    """The 400 for a voice that is neither OpenAI's nor eSpeak NG's: it lists them."""
    return OpenAIError(
        400,
        f"unknown voice {voice!r}: the voices are {', '.join(sorted(VOICES))}, "
        "or an eSpeak NG voice's name ('en', 'en-us', 'fr', 'en-us+f3', ...)",
        param=param,
    )


def knows_voice(name: str) -> bool:
    """Whether eSpeak NG, loaded in this process, has a voice ``name``."""
    try:
        from ..speech._espeak import ESpeak

        speech = ESpeak.get()
    except Exception:  # no speech extra here: OpenAI's names only
        return False
    try:
        speech.phonemes("", name)
    except ValueError:
        return False
    return True
