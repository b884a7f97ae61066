"""Audio for people: the WAV files the command line and the demo write."""

from __future__ import annotations

import struct
import wave
from pathlib import Path

__all__ = ["wav_bytes", "write_wav"]

_WAV_HEADER = struct.Struct("<4sI4s4sIHHIIHH4sI")


def wav_bytes(pcm: bytes, sample_rate: int) -> bytes:
    """16-bit mono little-endian PCM at ``sample_rate`` Hz as a whole WAV file, in memory
    (the 44-byte header :mod:`wave` writes, then ``pcm``)."""
    header = _WAV_HEADER.pack(
        b"RIFF", 36 + len(pcm), b"WAVE", b"fmt ", 16, 1, 1, sample_rate, 2 * sample_rate,
        2, 16, b"data", len(pcm),
    )  # fmt: skip
    return header + pcm


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
