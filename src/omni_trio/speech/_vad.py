"""Voice activity detection for realtime voice: the server's ``server_vad`` turn
detection, fed the client's audio as it arrives.

The OpenAI Realtime API's server VAD says when the user starts speaking (the server
interrupts its own answer: barge-in) and when the user's turn is over (the server
commits the audio and answers). :class:`VoiceActivityDetector` does that for one
stream of 16-bit PCM: :meth:`~VoiceActivityDetector.feed` it any amount and it
returns what happened, as events stamped in milliseconds of audio -- the audio's own
clock, not the wall clock, so a test, a benchmark and a live session agree, and a
client that sends faster or slower than real time changes nothing.

It is sans-IO (no trio, no asyncio): a feed is a few microseconds per model frame
plus the model's own cost, so the server calls it inline. It resamples its input to
16 kHz (:class:`~omni_trio.speech.Resampler`) and asks a :class:`FrameModel` for each
frame's speech probability:

* :class:`SileroModel`, the Silero VAD v6 network that faster-whisper ships
  (``faster_whisper/assets/silero_vad_v6.onnx``), run with onnxruntime. Its LSTM state
  is carried from frame to frame -- faster-whisper's own ``get_speech_timestamps``
  starts from zero state on every call, so it can judge a whole file but not a
  stream. One onnxruntime session per process, shared; the state is per model.
* :class:`WebRtcModel`, WebRTC's Gaussian-mixture VAD (``webrtcvad``): a yes or no
  per 20 or 30 ms frame, much cheaper.

``tools/bench_vad.py`` measured both on eSpeak NG speech with known pauses, clean and
in white noise (``docs/results/vad-python3.11.json``); :func:`default_model` is what
the numbers chose (its docstring says why).

The decisions follow Silero's own streaming rules, with a hysteresis: speech starts
at a frame whose probability reaches :attr:`VadOptions.threshold` (once
:data:`MIN_SPEECH_MS` of frames that stay above the exit threshold confirm it -- a
click is not a turn); after that, a frame below the exit threshold
(``threshold - 0.15``) begins silence, which frames in between the two thresholds
continue, and a frame at the threshold ends.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import attrs

from ._resample import Resampler

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "EXIT_MARGIN",
    "MIN_SPEECH_MS",
    "FrameModel",
    "SilenceStarted",
    "SileroModel",
    "SpeechResumed",
    "SpeechStarted",
    "SpeechStopped",
    "VadEvent",
    "VadOptions",
    "VoiceActivityDetector",
    "WebRtcModel",
    "default_model",
]

#: The models' sample rate: the detector resamples its input to this.
MODEL_RATE = 16_000

#: Speech must last this long (from a frame at the threshold, through frames none of
#: which falls below the exit threshold) before :class:`SpeechStarted`: a shorter
#: burst -- a click, a lip smack, a word's edge from a television -- is not a turn. It
#: rounds up to whole frames (96 ms: 3 Silero frames, 4 of WebRTC's 30 ms), and it is
#: what the event waits, after the speech began, before it comes. ``tools/bench_vad.py``
#: measured 0 to 96 ms with Silero: no false start in white noise or noise bursts at
#: any of them, while fragments of speech 10 to 60 ms long, one a second, started 15
#: turns a minute at 0 or 32 ms, 11 at 64 and 7 at 96; the start came (median) 73,
#: 112 and 143 ms after the speech began. A barge-in 70 ms later is not noticed; one
#: that interrupts for nothing is.
MIN_SPEECH_MS = 96

#: The exit threshold is this much below :attr:`VadOptions.threshold` (Silero's
#: ``neg_threshold``): a probability must fall clearly, not just dip, to begin silence.
EXIT_MARGIN = 0.15

_INSTALL = "pip install 'omni-trio[voice]'"


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer number of ms >= {minimum}, got {value!r}")


@attrs.frozen
class VadOptions:
    """The server VAD's parameters: those of the Realtime API's ``server_vad``
    turn detection, and one of ours.

    Attributes:
      threshold: The speech probability (0 to 1) at which a frame is speech. Higher
          asks for louder, clearer speech (fewer false starts in noise).
      prefix_padding_ms: Audio kept before the speech start, when the session cuts
          the turn out of its buffer (the detector itself does not use it).
      silence_duration_ms: The hangover: this much silence after speech ends the
          turn (:class:`SpeechStopped`).
      speculate_after_ms: After this much silence the turn *may* be over
          (:class:`SilenceStarted`): a hint to start recognising early, cancelled by
          :class:`SpeechResumed`. Less than ``silence_duration_ms``; 0 gives no hint.

    Raises:
      ValueError: a parameter is out of range (the message names it).
    """

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    speculate_after_ms: int = 150

    def __attrs_post_init__(self) -> None:
        threshold = self.threshold
        if (
            not isinstance(threshold, (int, float))
            or isinstance(threshold, bool)
            or not 0.0 <= threshold <= 1.0  # NaN fails this too
        ):
            raise ValueError(f"threshold must be a probability from 0 to 1, got {threshold!r}")
        _check_int("prefix_padding_ms", self.prefix_padding_ms, 0)
        _check_int("silence_duration_ms", self.silence_duration_ms, 1)
        _check_int("speculate_after_ms", self.speculate_after_ms, 0)
        if self.speculate_after_ms >= self.silence_duration_ms:
            raise ValueError(
                f"speculate_after_ms must be less than silence_duration_ms "
                f"({self.silence_duration_ms}), or 0 for no hint, got {self.speculate_after_ms}"
            )

    @property
    def exit_threshold(self) -> float:
        """Below this probability, speech gives way to silence."""
        return max(self.threshold - EXIT_MARGIN, 0.01)


@attrs.frozen
class SpeechStarted:
    """Speech began at ``audio_start_ms`` (its first speech frame): the user is
    speaking. The session keeps ``prefix_padding_ms`` of audio before it."""

    audio_start_ms: int


@attrs.frozen
class SilenceStarted:
    """``speculate_after_ms`` of silence after speech, which began at ``audio_ms``:
    the turn may be ending (start recognising; :class:`SpeechResumed` cancels)."""

    audio_ms: int


@attrs.frozen
class SpeechResumed:
    """Speech came back at ``audio_ms``, after a :class:`SilenceStarted` and before
    the turn ended: the speculation is off."""

    audio_ms: int


@attrs.frozen
class SpeechStopped:
    """``silence_duration_ms`` of silence: the turn ended at ``audio_end_ms``, where
    the silence began."""

    audio_end_ms: int


#: What :meth:`VoiceActivityDetector.feed` reports.
VadEvent: TypeAlias = SpeechStarted | SilenceStarted | SpeechResumed | SpeechStopped


class FrameModel(Protocol):
    """A speech probability per frame of 16 kHz audio.

    A model has state (a recurrent network's, an adaptive one's): one model serves
    one stream, one detector.
    """

    @property
    def frame_samples(self) -> int:
        """Samples (at 16 kHz) in each frame :meth:`probability` takes."""
        ...

    def probability(self, frame: bytes) -> float:
        """The probability (0 to 1) that ``frame`` -- :attr:`frame_samples` samples
        of 16-bit mono little-endian PCM at 16 kHz, following the previous frame --
        is speech."""
        ...

    def reset(self) -> None:
        """Forget the stream so far: the next frame begins a new one."""
        ...


# -- Silero -----------------------------------------------------------------------------

#: The Silero VAD network faster-whisper ships, next to its package.
_SILERO_ASSET = ("assets", "silero_vad_v6.onnx")
_SILERO_CONTEXT = 64  # samples of the previous frame the network sees before each frame
_SILERO_STATE = (1, 1, 128)  # its LSTM's h and c

_sessions: dict[str, Any] = {}
_sessions_lock = threading.Lock()


def _silero_path() -> Path:
    # find_spec, not import: faster_whisper's package loads CTranslate2 and tokenizers.
    spec = importlib.util.find_spec("faster_whisper")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"SileroModel uses the Silero VAD network faster-whisper ships: {_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations)), *_SILERO_ASSET)
    if not path.is_file():  # before 1.2.1: Silero v5, as an encoder and a decoder
        raise ImportError(
            f"SileroModel needs faster-whisper 1.2.1 or later, which ships {path.name}: {_INSTALL}"
        )
    return path


def _silero_session(path: str) -> Any:
    """The process's onnxruntime session for ``path``: made once, shared by every
    :class:`SileroModel` (``run`` may be called from any thread); each run uses one."""
    with _sessions_lock:
        session = _sessions.get(path)
        if session is None:
            try:
                import onnxruntime
            except ImportError:
                raise ImportError(f"SileroModel needs onnxruntime: {_INSTALL}") from None
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = 1  # one 32 ms frame: threads cost more than win
            options.inter_op_num_threads = 1
            options.log_severity_level = 4  # errors raise; no warnings on stderr
            session = onnxruntime.InferenceSession(
                path, sess_options=options, providers=["CPUExecutionProvider"]
            )
            _sessions[path] = session
        return session


class SileroModel:
    """Silero VAD v6 (faster-whisper's ONNX export) on a stream: 512-sample (32 ms)
    frames, each seen with the last 64 samples before it, the network's recurrent
    state carried from frame to frame -- so the probabilities are those
    faster-whisper computes over the whole audio at once, frame for frame.

    Args:
      path: The ONNX file (default: the one in the installed faster-whisper).

    Raises:
      ImportError: faster-whisper (1.2.1 or later), onnxruntime or numpy is missing
          (the ``voice`` extra).
    """

    frame_samples = 512

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._session = _silero_session(os.fspath(path if path is not None else _silero_path()))
        self._h: npt.NDArray[np.float32]
        self._c: npt.NDArray[np.float32]
        self._context: npt.NDArray[np.float32]
        self.reset()

    def reset(self) -> None:
        import numpy as np

        self._h = np.zeros(_SILERO_STATE, np.float32)
        self._c = np.zeros(_SILERO_STATE, np.float32)
        self._context = np.zeros(_SILERO_CONTEXT, np.float32)

    def probability(self, frame: bytes) -> float:
        import numpy as np

        samples = np.frombuffer(frame, "<i2").astype(np.float32) / np.float32(32768)
        if samples.shape != (self.frame_samples,):
            raise ValueError(
                f"a Silero frame is {self.frame_samples} samples, not {len(frame) / 2}"
            )
        window = np.concatenate((self._context, samples))[np.newaxis, :]
        speech, self._h, self._c = self._session.run(
            None, {"input": window, "h": self._h, "c": self._c}
        )
        self._context = samples[-_SILERO_CONTEXT:]
        return float(speech.reshape(-1)[0])


# -- WebRTC -----------------------------------------------------------------------------


class WebRtcModel:
    """WebRTC's voice activity detector (``webrtcvad``): 1.0 for a frame it calls
    speech, 0.0 otherwise.

    Args:
      aggressiveness: 0 (calls the most frames speech) to 3 (the fewest: the least
          fooled by noise).
      frame_ms: 20 or 30.

    Raises:
      ValueError: either argument is out of range.
      ImportError: ``webrtcvad`` (the ``webrtcvad-wheels`` package) is missing.
    """

    def __init__(self, aggressiveness: int = 3, *, frame_ms: int = 30) -> None:
        if aggressiveness not in (0, 1, 2, 3) or isinstance(aggressiveness, bool):
            raise ValueError(f"aggressiveness must be 0, 1, 2 or 3, got {aggressiveness!r}")
        if frame_ms not in (20, 30) or isinstance(frame_ms, bool):
            raise ValueError(f"frame_ms must be 20 or 30, got {frame_ms!r}")
        try:
            import webrtcvad
        except ImportError:
            raise ImportError(f"WebRtcModel needs webrtcvad-wheels: {_INSTALL}") from None
        self._webrtcvad = webrtcvad
        self.aggressiveness = aggressiveness
        self.frame_samples = MODEL_RATE * frame_ms // 1000
        self._vad = webrtcvad.Vad(aggressiveness)

    def reset(self) -> None:
        self._vad = self._webrtcvad.Vad(self.aggressiveness)  # its noise estimate adapts

    def probability(self, frame: bytes) -> float:
        return 1.0 if self._vad.is_speech(frame, MODEL_RATE) else 0.0


def default_model() -> FrameModel:
    """A new model of the default kind, for one detector: :class:`SileroModel`.

    ``tools/bench_vad.py`` chose it (``docs/results/vad-python3.11.json``; 90 s of
    eSpeak NG speech, 16 turns, clean and in white noise at 20, 10 and 5 dB SNR; the
    default options and :data:`MIN_SPEECH_MS`). Silero found all 16 turn ends in each,
    with no extra end and no false start; it started no turn in a minute of white
    noise at any of those levels nor on noise bursts, and 7 a minute on fragments of
    speech; its turn ends were 42 ms (median) after the true end in clean speech, 79
    ms at 5 dB. It costs 55 to 60 µs of CPU per 20 ms of audio (0.3% of a core).
    WebRTC's VAD costs a fifth of that and marks a start closer (5 ms early against
    Silero's 35 ms late), but its ends are 100 to 180 ms late in clean speech, it loses
    turn ends in noise (at aggressiveness 3, 11 of 16 at 5 dB; at 0 to 2, all of them
    at 5 or 10 dB), it starts turns in white noise (23 a minute at 5 dB, aggressiveness
    3), and on noise bursts and fragments of speech 31 to 55 times a minute.
    """
    return SileroModel()


# -- the detector -------------------------------------------------------------------------


class VoiceActivityDetector:
    """Server VAD over one stream of 16-bit mono little-endian PCM.

    :meth:`feed` it the audio as it comes, in chunks of any size: it returns the
    events the audio decided, in order, stamped in ms of audio since the detector
    began (every sample fed counts, :meth:`reset` or not). The events are the same
    however the audio is cut. They are decided a model frame at a time (32 ms for
    Silero), so an event comes when the frame that decides it is complete:
    :class:`SpeechStarted` :data:`MIN_SPEECH_MS` and a frame or two after the speech
    began, :class:`SpeechStopped` ``silence_duration_ms`` and a frame or two after it
    ended (with Silero and the defaults, in ``tools/bench_vad.py``: 143 and 568 ms
    after, median, in clean speech). A ``speculate_after_ms`` that is not less than
    ``silence_duration_ms`` is refused, so a session that takes a short
    ``silence_duration_ms`` from a client sets ``speculate_after_ms`` too (or 0).

    Args:
      options: The thresholds and durations.
      sample_rate: Of the audio fed (the Realtime API's 24 kHz by default).
      model: The speech probability per frame; its state is this detector's (default:
          :func:`default_model`).
      min_speech_ms: How long speech must last to start a turn (:data:`MIN_SPEECH_MS`).

    Raises:
      ValueError: ``sample_rate`` or ``min_speech_ms`` is out of range.
      ImportError: the ``voice`` extra is missing.

    Not thread-safe: one stream, one task.
    """

    def __init__(
        self,
        options: VadOptions = VadOptions(),  # frozen: one is as good as another
        *,
        sample_rate: int = 24_000,
        model: FrameModel | None = None,
        min_speech_ms: int = MIN_SPEECH_MS,
    ) -> None:
        if not isinstance(sample_rate, int) or isinstance(sample_rate, bool) or sample_rate <= 0:
            raise ValueError(f"sample_rate must be a positive integer (Hz), got {sample_rate!r}")
        _check_int("min_speech_ms", min_speech_ms, 0)
        self.options = options
        self.sample_rate = sample_rate
        self.min_speech_ms = min_speech_ms
        self.model = model if model is not None else default_model()
        self._frame_bytes = 2 * self.model.frame_samples
        self._resampler = Resampler(sample_rate, MODEL_RATE)
        self._fed = 0  # bytes fed
        self._pcm = bytearray()  # 16 kHz audio not yet in a frame
        self._at = 0  # the 16 kHz sample where _pcm begins
        self._speaking = False
        self._candidate: int | None = None  # ms: where speech may be starting
        self._silence: int | None = None  # ms: where the silence after speech began
        self._speculated = False  # SilenceStarted was sent for this silence

    def __repr__(self) -> str:
        return (
            f"<VoiceActivityDetector {type(self.model).__name__} at {self.audio_ms} ms"
            f"{', speaking' if self._speaking else ''}>"
        )

    @property
    def audio_ms(self) -> int:
        """Ms of audio fed so far."""
        return (self._fed // 2) * 1000 // self.sample_rate

    @property
    def speaking(self) -> bool:
        """Between a :class:`SpeechStarted` and its :class:`SpeechStopped`."""
        return self._speaking

    def feed(self, pcm: bytes) -> list[VadEvent]:
        """Take ``pcm`` (16-bit mono little-endian at :attr:`sample_rate`, any length:
        an odd trailing byte waits for the next feed); return the events it decided."""
        self._fed += len(pcm)
        self._pcm += self._resampler.feed(pcm)
        events: list[VadEvent] = []
        size = self._frame_bytes
        start = 0
        while len(self._pcm) - start >= size:
            self._decide(bytes(self._pcm[start : start + size]), events)
            start += size
        del self._pcm[:start]
        return events

    def reset(self) -> None:
        """Forget the speech so far (and the part of a frame not yet judged): the next
        audio starts afresh, as if after silence. The ms count on."""
        self._at += len(self._pcm) // 2
        self._pcm.clear()
        self.model.reset()
        self._speaking = False
        self._candidate = self._silence = None
        self._speculated = False

    def _decide(self, frame: bytes, events: list[VadEvent]) -> None:
        """One frame's probability, and what it changes."""
        probability = self.model.probability(frame)
        start = self._at * 1000 // MODEL_RATE
        self._at += self.model.frame_samples
        end = self._at * 1000 // MODEL_RATE
        options = self.options
        speech = probability >= options.threshold
        quiet = probability < options.exit_threshold
        if not self._speaking:
            if speech and self._candidate is None:
                self._candidate = start
            elif quiet:
                self._candidate = None
            if self._candidate is not None and end - self._candidate >= self.min_speech_ms:
                events.append(SpeechStarted(self._candidate))
                self._speaking = True
                self._candidate = None
            return
        if speech and self._silence is not None:
            if self._speculated:
                events.append(SpeechResumed(start))
            self._silence = None
            self._speculated = False
        elif quiet and self._silence is None:
            self._silence = start
        if self._silence is None:
            return
        silent = end - self._silence
        speculate = options.speculate_after_ms
        if speculate and not self._speculated and silent >= speculate:
            events.append(SilenceStarted(self._silence))
            self._speculated = True
        if silent >= options.silence_duration_ms:
            events.append(SpeechStopped(self._silence))
            self._speaking = False
            self._silence = None
            self._speculated = False
