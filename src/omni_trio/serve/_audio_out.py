"""Audio as the API sends it: a stage's PCM, resampled to 24 kHz and encoded as it
streams, in each of OpenAI's formats. Sans-IO: bytes in, bytes out.

OpenAI's audio is 24 kHz mono (``pcm``: 16-bit little-endian samples, no header);
a stage speaks at its own rate (eSpeak NG's 22,050 Hz), so :class:`AudioEncoder`
resamples first (:class:`~omni_trio.speech.Resampler`), then encodes: ``wav`` is a
header and the samples, the header's lengths unknown (``0xFFFFFFFF``, what a
streamed WAV says: players read to the end); ``mp3``, ``opus`` (in Ogg), ``aac``
(ADTS) and ``flac`` are FFmpeg's encoders through PyAV, their muxers flushed after
every packet so that each :meth:`~AudioEncoder.feed` gives what is ready.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from ..speech._resample import Resampler

if TYPE_CHECKING:
    import av.container

__all__ = ["AUDIO_FORMATS", "MEDIA_TYPES", "OUT_RATE", "AudioEncoder"]

#: What the API's audio is: 24 kHz, 16-bit, mono.
OUT_RATE = 24_000
#: OpenAI's formats, each with the media type its response says.
MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
AUDIO_FORMATS = tuple(MEDIA_TYPES)
#: format -> (FFmpeg's muxer, its encoder)
_CODECS = {
    "mp3": ("mp3", "libmp3lame"),
    "opus": ("ogg", "libopus"),
    "aac": ("adts", "aac"),
    "flac": ("flac", "flac"),
}
_UNKNOWN = 0xFFFFFFFF
_WAV_HEADER = struct.Struct("<4sI4s4sIHHIIHH4sI")


def streamed_wav_header(sample_rate: int = OUT_RATE) -> bytes:
    """A WAV header for 16-bit mono PCM of a length not yet known."""
    return _WAV_HEADER.pack(
        b"RIFF", _UNKNOWN, b"WAVE", b"fmt ", 16, 1, 1, sample_rate, 2 * sample_rate,
        2, 16, b"data", _UNKNOWN,
    )  # fmt: skip


class _Sink:
    """Where a PyAV muxer writes: what it wrote since it was last taken."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data


class AudioEncoder:
    """16-bit mono little-endian PCM at ``in_rate`` Hz in, ``format`` at 24 kHz out,
    a piece at a time: :meth:`feed` gives what each piece makes ready, :meth:`finish`
    the rest. One stream, one task.

    Raises:
      ValueError: ``format`` is not one of :data:`AUDIO_FORMATS`.
      ImportError: PyAV is not installed (the ``serve`` extra brings it).
    """

    def __init__(self, format: str, in_rate: int) -> None:
        if format not in MEDIA_TYPES:
            raise ValueError(
                f"unknown audio format {format!r}: the formats are {', '.join(AUDIO_FORMATS)}"
            )
        self.format = format
        self.media_type = MEDIA_TYPES[format]
        self._resampler = Resampler(in_rate, OUT_RATE)
        self._head = streamed_wav_header() if format == "wav" else b""
        self._sink: _Sink | None = None
        self._container: av.container.OutputContainer | None = None
        self._stream: Any = None
        self._pts = 0
        if format in _CODECS:
            import av

            muxer, codec = _CODECS[format]
            self._sink = _Sink()
            options = {"flush_packets": "1"}
            if muxer == "ogg":
                options["page_duration"] = "20000"  # µs: a page per 20 ms, not per second
            self._container = av.open(self._sink, mode="w", format=muxer, options=options)
            self._stream = self._container.add_stream(codec, rate=OUT_RATE, layout="mono")

    def feed(self, pcm: bytes) -> bytes:
        """What ``pcm`` makes ready of the encoded stream (maybe nothing yet)."""
        return self._encode(self._resampler.feed(pcm))

    def finish(self) -> bytes:
        """The rest of the stream: what the resampler and the encoder held back."""
        out = self._encode(self._resampler.flush())
        if self._container is not None and self._sink is not None:
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._container.close()
            self._container = None
            out += self._sink.take()
        return out

    def _encode(self, pcm: bytes) -> bytes:
        head, self._head = self._head, b""
        if self._container is None or self._sink is None:
            return head + pcm
        if pcm:
            import av

            frame = av.AudioFrame(format="s16", layout="mono", samples=len(pcm) // 2)
            frame.planes[0].update(pcm)
            frame.sample_rate = OUT_RATE
            frame.pts = self._pts
            self._pts += len(pcm) // 2
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        return self._sink.take()
