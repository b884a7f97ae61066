"""Audio files in: any format FFmpeg decodes (through PyAV), as 16-bit mono PCM at
Whisper's 16 kHz. Sans-IO: bytes in, bytes out (run it in a thread: decoding a long
file takes a while).
"""

from __future__ import annotations

import io

__all__ = ["HEARD_RATE", "NotAudioError", "decode_audio"]

#: The rate of the PCM :func:`decode_audio` returns: Whisper's.
HEARD_RATE = 16_000


class NotAudioError(ValueError):
    """The file is not audio FFmpeg can decode, or it is longer than allowed; the
    message says which."""


def decode_audio(data: bytes, *, max_seconds: float, rate: int = HEARD_RATE) -> tuple[bytes, float]:
    """``data``, an audio file (WAV, MP3, Ogg, FLAC, M4A, WebM, ...), as 16-bit mono
    little-endian PCM at ``rate`` Hz (:data:`HEARD_RATE`: Whisper's), and its length
    in seconds.

    Raises:
      NotAudioError: FFmpeg finds no audio in it, cannot decode it, or it lasts
          longer than ``max_seconds`` (found while decoding: no more is decoded).
    """
    import av

    limit = int(max_seconds * rate)
    resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
    pieces: list[bytes] = []
    samples = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as file:
            if not file.streams.audio:
                raise NotAudioError("the file has no audio stream")
            for frame in file.decode(file.streams.audio[0]):
                for out in resampler.resample(frame):
                    pieces.append(bytes(out.planes[0])[: out.samples * 2])
                    samples += out.samples
                if samples > limit:
                    raise NotAudioError(f"the audio is longer than {max_seconds:g} s")
            for out in resampler.resample(None):
                pieces.append(bytes(out.planes[0])[: out.samples * 2])
                samples += out.samples
    except av.error.FFmpegError as exc:
        raise NotAudioError(f"the file is not audio FFmpeg can decode ({exc})") from None
    if samples > limit:
        raise NotAudioError(f"the audio is longer than {max_seconds:g} s")
    if not samples:
        raise NotAudioError("the file holds no audio samples")
    return b"".join(pieces), samples / rate
