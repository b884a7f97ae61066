"""Real speech for the pipeline: eSpeak NG (the ``speech`` extra) as talker and
code2wav, and faster-whisper (the ``voice`` extra) as the stage that listens.

The talker turns the thinker's streamed text into eSpeak NG phoneme codes phrase by
phrase; code2wav speaks each phrase's codes as soon as it has them (16-bit mono PCM
at :data:`SAMPLE_RATE` Hz). Both work in async_chunk and forward mode, on any stage
backend. The shipped ``speech`` pipeline (``omni_trio/pipelines/speech.toml``) is the
one they make with the demo's thinker: ``omni-trio run speech``, ``omni-trio demo``
and ``omni_trio.open_pipeline("speech")`` use it.

The listen stage (:func:`listen`) turns a spoken utterance (:func:`utterance`) into
its transcript with Whisper; the shipped ``voice`` pipeline
(``omni_trio/pipelines/voice.toml``) puts it before a conversational thinker and
eSpeak NG: ``omni-trio run voice --audio question.wav`` answers aloud.

eSpeak NG is not thread-safe: a process speaks one phrase at a time
(:class:`ESpeak`). faster-whisper is imported when a listen stage starts, not with
this package.
"""

from typing import TYPE_CHECKING

from .._util import lazy_exports

if TYPE_CHECKING:
    from .._conversation import Sampling as Sampling
    from .._conversation import Turn as Turn
    from .._conversation import utterance as utterance
    from ._engines import SAMPLE_RATE as SAMPLE_RATE
    from ._engines import PhraseSplitter as PhraseSplitter
    from ._engines import code2wav as code2wav
    from ._engines import talker as talker
    from ._engines import talker2code2wav as talker2code2wav
    from ._espeak import ESpeak as ESpeak
    from ._espeak import SpeechUnavailableError as SpeechUnavailableError
    from ._espeak import speech_available as speech_available
    from ._listen import ListenUnavailableError as ListenUnavailableError
    from ._listen import context_of as context_of
    from ._listen import listen as listen
    from ._listen import listen2thinker as listen2thinker
    from ._resample import Resampler as Resampler
    from ._vad import MIN_SPEECH_MS as MIN_SPEECH_MS
    from ._vad import FrameModel as FrameModel
    from ._vad import SilenceStarted as SilenceStarted
    from ._vad import SileroModel as SileroModel
    from ._vad import SpeechResumed as SpeechResumed
    from ._vad import SpeechStarted as SpeechStarted
    from ._vad import SpeechStopped as SpeechStopped
    from ._vad import VadEvent as VadEvent
    from ._vad import VadOptions as VadOptions
    from ._vad import VoiceActivityDetector as VoiceActivityDetector
    from ._vad import WebRtcModel as WebRtcModel
    from ._vad import default_model as default_model
    from ._voices import VOICES as VOICES
    from ._voices import prewarm as prewarm
    from ._voices import say as say
    from ._voices import settings as settings

_EXPORTS = {
    "._engines": ["SAMPLE_RATE", "PhraseSplitter", "code2wav", "talker", "talker2code2wav"],
    "._espeak": ["ESpeak", "SpeechUnavailableError", "speech_available"],
    "._listen": ["ListenUnavailableError", "context_of", "listen", "listen2thinker"],
    # a conversational prompt: what a listening pipeline takes (and a language model)
    ".._conversation": ["Sampling", "Turn", "utterance"],
    "._resample": ["Resampler"],
    "._vad": [
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
    ],
    # a request's voice and speed (OpenAI's voices, eSpeak NG's), and how they travel
    "._voices": ["VOICES", "prewarm", "say", "settings"],
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
# Imported on first use: speech_available() must not need trio or eSpeak, and
# nothing here imports faster-whisper (a listen stage does, when it starts).
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
