"""Streaming resampling of 16-bit mono PCM, for realtime voice: the client's 24 kHz
to the 16 kHz the voice activity detector and Whisper hear, eSpeak NG's 22,050 Hz to
the 24 kHz the Realtime API speaks.

Audio arrives in chunks of any size (20 ms is typical), and resampling each chunk on
its own would click at every boundary (the filter sees a cliff of zeros) and drift
(each chunk's output rounded to whole samples). :class:`Resampler` keeps the filter's
history and its fractional position from one :meth:`~Resampler.feed` to the next, so
the output is the same, sample for sample, however the input was cut.

The filter is FFmpeg's libswresample through PyAV's :class:`av.AudioResampler` (PyAV
comes with faster-whisper, as numpy does): ``tools/bench_vad.py`` measured it against
a windowed-sinc polyphase filter written with numpy. Both keep a tone's frequency
(to 0.01 Hz) and amplitude (to 0.1%) through 6 kHz, and leave an alias of a 9 kHz
tone 60 dB down or more going to 16 kHz; libswresample costs a quarter as much (9 µs
per 20 ms chunk against 34 to 37) and is no filter code of ours to keep. It looks a
few samples ahead (about 16 at the output rate: 1 ms at 16 kHz) so that its output
stays aligned in time with its input: those wait for more input or
:meth:`~Resampler.flush`. Sans-IO: no trio, no asyncio; a call takes microseconds.
Its ``s16`` is the machine's byte order: little-endian on every machine we run on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["Resampler"]

if TYPE_CHECKING:
    import av

_INSTALL = "pip install 'omni-trio[serve]'"


class Resampler:
    """Resample a stream of 16-bit mono little-endian PCM from ``in_rate`` to
    ``out_rate`` Hz, chunk by chunk.

    :meth:`feed` any number of bytes (an odd trailing byte waits for the next feed)
    and get what is ready; :meth:`flush` at the end of the stream gets the rest. The
    output is the same however the input is cut, and its length never drifts: after
    ``n`` input samples it is ``n * out_rate / in_rate`` less a constant few held
    back (the filter's lookahead, about 1 ms), and after :meth:`flush` that rounded
    down, or one more. The same rate in and out passes the audio through untouched.

    Not thread-safe: one stream, one task.

    Raises:
      ValueError: a rate is not a positive integer.
      ImportError: PyAV is not installed (the ``voice`` extra).
    """

    def __init__(self, in_rate: int, out_rate: int) -> None:
        for name, rate in (("in_rate", in_rate), ("out_rate", out_rate)):
            if isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
                raise ValueError(f"{name} must be a positive integer (Hz), not {rate!r}")
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._odd = b""  # a trailing byte: half a sample, completed by the next feed
        self._filter: av.AudioResampler | None = None
        self._taken = self._given = 0  # samples in and out since the stream began
        if in_rate != out_rate:
            self._filter = self._new_filter()

    def __repr__(self) -> str:
        return f"Resampler({self.in_rate}, {self.out_rate})"

    def feed(self, pcm: bytes) -> bytes:
        """The resampled audio that ``pcm`` (16-bit mono little-endian PCM at
        :attr:`in_rate`, any length) makes ready: 16-bit PCM at :attr:`out_rate`."""
        if self._odd:
            pcm = self._odd + pcm
            self._odd = b""
        if len(pcm) % 2:
            pcm, self._odd = pcm[:-1], pcm[-1:]
        if not pcm or self._filter is None:
            return bytes(pcm)
        self._taken += len(pcm) // 2
        out = self._run(self._filter, self._frame(pcm))
        self._given += len(out) // 2
        return out

    def flush(self) -> bytes:
        """The rest of the stream: what the filter held back, pushed out. An odd
        trailing byte is dropped. The resampler is then fresh for a new stream."""
        self._odd = b""
        if self._filter is None:
            return b""
        rest = self._run(self._filter, None)
        # libswresample gives nothing for a stream shorter than its lookahead (a couple
        # of ms): zeros keep the length a stream of that many samples must have.
        short = self._taken * self.out_rate // self.in_rate - self._given - len(rest) // 2
        if short > 0:
            rest += bytes(2 * short)
        self._filter = self._new_filter()
        self._taken = self._given = 0
        return rest

    def _new_filter(self) -> av.AudioResampler:
        try:
            import av
        except ImportError:
            raise ImportError(f"resampling needs PyAV (the serve extra's): {_INSTALL}") from None
        return av.AudioResampler(format="s16", layout="mono", rate=self.out_rate)

    def _frame(self, pcm: bytes) -> av.AudioFrame:
        import av

        frame = av.AudioFrame(format="s16", layout="mono", samples=len(pcm) // 2)
        frame.planes[0].update(pcm)  # packed, unaligned: the plane is exactly the bytes
        frame.sample_rate = self.in_rate
        return frame

    @staticmethod
    def _run(resampler: av.AudioResampler, frame: av.AudioFrame | None) -> bytes:
        out = resampler.resample(frame)
        return b"".join(bytes(f.planes[0])[: f.samples * 2] for f in out)
