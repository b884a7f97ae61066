"""eSpeak NG through :mod:`ctypes`: the shared library and voice data that the
``espeakng-loader`` package ships (the ``speech`` extra), nothing from the system.

eSpeak NG is a C library with global state -- one current voice, one synthesis
callback, one output buffer -- and it is not thread-safe. So a process has one
:class:`ESpeak`, and every call into the library holds that object's lock: a process
speaks one phrase at a time, whatever its requests and threads. A phrase takes a few
milliseconds, so one worker keeps up with many concurrent requests; more
parallelism means more worker processes, each with its own eSpeak.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from typing import Any, ClassVar

__all__ = ["ESpeak", "SpeechUnavailableError", "speech_available"]

# espeak_ng's speak_lib.h
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_DONT_EXIT = 0x8000  # fail with an error code instead of exit()
_CHARS_UTF8 = 1
_PHONEMES = 0x100  # [[...]] in the input is phoneme mnemonics
_RATE = 1  # espeak_SetParameter: words per minute
_ERRORS = {-1: "EE_INTERNAL_ERROR", 1: "EE_BUFFER_FULL", 2: "EE_NOT_FOUND"}
_SYNTH_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)
_INSTALL = "pip install 'omni-trio[speech]'"


class SpeechUnavailableError(RuntimeError):
    """eSpeak NG cannot be used here: the ``speech`` extra is not installed, or its
    library does not load. The message says which, and how to install it."""


def speech_available() -> bool:
    """Whether the ``speech`` extra (``espeakng-loader``) is installed."""
    return importlib.util.find_spec("espeakng_loader") is not None


class ESpeak:
    """This process's eSpeak NG: :meth:`get` it, then call :meth:`phonemes` and
    :meth:`synthesize` from any thread -- each call holds the process's one lock.

    Calls block for as long as eSpeak works (milliseconds a phrase): from Trio, run
    them in a thread (``trio.to_thread.run_sync``), as the speech engines do.

    Attributes:
      sample_rate: Of the PCM that :meth:`synthesize` returns (eSpeak NG's voices:
          22,050 Hz).
    """

    _instance: ClassVar[ESpeak | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, library: Any, sample_rate: int) -> None:
        self._lib = library
        self.sample_rate = sample_rate
        self._pcm: list[bytes] = []
        self._voice: str | None = None
        self._rate: int | None = None
        # Kept alive here: eSpeak holds a bare pointer to it.
        self._callback = _SYNTH_CALLBACK(self._collect)
        library.espeak_SetSynthCallback(self._callback)

    @classmethod
    def get(cls) -> ESpeak:
        """The process's eSpeak NG, loaded and initialized on first use.

        Raises:
          SpeechUnavailableError: The ``speech`` extra is not installed, or eSpeak NG
              does not load or initialize.
        """
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls._load()
            return cls._instance

    @classmethod
    def _load(cls) -> ESpeak:
        try:
            import espeakng_loader
        except ImportError:
            raise SpeechUnavailableError(
                f"the speech engines need eSpeak NG, from the speech extra: {_INSTALL}"
            ) from None
        try:
            lib = ctypes.CDLL(espeakng_loader.get_library_path())
        except OSError as exc:
            raise SpeechUnavailableError(f"eSpeak NG's library does not load: {exc}") from None
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_SYNTH_CALLBACK]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        lib.espeak_TextToPhonemes.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_int,
        ]
        lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        data = espeakng_loader.get_data_path().encode()
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, data, _INITIALIZE_DONT_EXIT)
        if rate <= 0:
            raise SpeechUnavailableError(f"eSpeak NG does not initialize (its data: {data!r})")
        return cls(lib, rate)

    def phonemes(self, text: str, voice: str = "en") -> str:
        """``text`` as eSpeak NG's phoneme mnemonics (what ``[[...]]`` input speaks),
        its clauses joined by spaces; ``""`` for text with nothing to say."""
        source = ctypes.create_string_buffer(text.encode("utf-8", "replace"))
        cursor = ctypes.c_void_p(ctypes.addressof(source))
        clauses = []
        with self._lock:
            self._select(voice, None)
            while cursor.value:  # eSpeak moves it clause by clause, to NULL at the end
                clause = self._lib.espeak_TextToPhonemes(ctypes.byref(cursor), _CHARS_UTF8, 0)
                if clause:
                    clauses.append(clause.decode("ascii", "replace").strip())
        return " ".join(c for c in clauses if c)

    def synthesize(
        self, text: str, *, voice: str = "en", words_per_minute: int = 175, phonemes: bool = False
    ) -> bytes:
        """``text`` spoken: 16-bit mono little-endian PCM at :attr:`sample_rate`.

        ``phonemes=True``: ``text`` is phoneme mnemonics (from :meth:`phonemes`), spoken
        as they are.

        Raises:
          ValueError: eSpeak NG has no voice ``voice``.
          RuntimeError: eSpeak NG failed (its error code is in the message).
        """
        flags = _CHARS_UTF8
        if phonemes:
            text = "[[" + text.replace("[", "").replace("]", "") + "]]"
            flags |= _PHONEMES
        source = text.encode("utf-8", "replace") + b"\0"
        with self._lock:
            self._select(voice, words_per_minute)
            self._pcm = []
            status = self._lib.espeak_Synth(source, len(source), 0, 0, 0, flags, None, None)
            pcm, self._pcm = b"".join(self._pcm), []
        if status != 0:
            raise RuntimeError(f"eSpeak NG failed to speak: {_ERRORS.get(status, status)}")
        return pcm

    def _select(self, voice: str, words_per_minute: int | None) -> None:
        """Make ``voice`` (and the rate) current; the lock is held."""
        if voice != self._voice:
            if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
                raise ValueError(f"eSpeak NG has no voice {voice!r}")
            self._voice, self._rate = voice, None  # a new voice starts at its own rate
        if words_per_minute is not None and words_per_minute != self._rate:
            self._lib.espeak_SetParameter(_RATE, words_per_minute, 0)
            self._rate = words_per_minute

    def _collect(self, wav: Any, samples: int, events: Any) -> int:
        """eSpeak's synthesis callback: runs inside :meth:`synthesize`, lock held."""
        if wav and samples > 0:
            self._pcm.append(ctypes.string_at(wav, samples * 2))
        return 0  # go on
