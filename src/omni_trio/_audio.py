"""Audio for people: the WAV files the command line and the demo write."""

from __future__ import annotations

import wave
from pathlib import Path

__all__ = ["write_wav"]


def write_wav(path: str | Path, pcm: bytes, sample_rate: int) -> None:
    """Write 16-bit mono little-endian PCM at ``sample_rate`` Hz as a WAV file.

    Raises:
      OSError: the file cannot be written (opened here, not by :mod:`wave`, whose
          half-made writer would also complain from its ``__del__``).
    """
    with open(path, "wb") as file, wave.open(file, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm)
