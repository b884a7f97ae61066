"""Real speech for the pipeline: eSpeak NG (the ``speech`` extra) as talker and
code2wav.

The talker turns the thinker's streamed text into eSpeak NG phoneme codes phrase by
phrase; code2wav speaks each phrase's codes as soon as it has them (16-bit mono PCM
at :data:`SAMPLE_RATE` Hz). Both work in async_chunk and forward mode, on any stage
backend. The shipped ``speech`` pipeline (``omni_trio/pipelines/speech.toml``) is the
one they make with the demo's thinker: ``omni-trio run speech``, ``omni-trio demo``
and ``omni_trio.open_pipeline("speech")`` use it.

eSpeak NG is not thread-safe: a process speaks one phrase at a time
(:class:`ESpeak`).
"""

from typing import TYPE_CHECKING

from .._util import lazy_exports

if TYPE_CHECKING:
    from ._engines import SAMPLE_RATE as SAMPLE_RATE
    from ._engines import PhraseSplitter as PhraseSplitter
    from ._engines import code2wav as code2wav
    from ._engines import talker as talker
    from ._engines import talker2code2wav as talker2code2wav
    from ._espeak import ESpeak as ESpeak
    from ._espeak import SpeechUnavailableError as SpeechUnavailableError
    from ._espeak import speech_available as speech_available

_EXPORTS = {
    "._engines": ["SAMPLE_RATE", "PhraseSplitter", "code2wav", "talker", "talker2code2wav"],
    "._espeak": ["ESpeak", "SpeechUnavailableError", "speech_available"],
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
# Imported on first use: speech_available() must not need trio or eSpeak.
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
