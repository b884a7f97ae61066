"""The speech engines: a talker that turns streamed text into eSpeak NG phoneme codes
phrase by phrase, and a code2wav that speaks each phrase's codes as soon as it has
them.

In async_chunk mode the talker reads the thinker's text chunks as they come and
sends one chunk of phoneme codes downstream per phrase; code2wav yields the phrase's
PCM as soon as that chunk arrives. A phrase ends at a clause's punctuation or after a
number of words -- a short first phrase, so the first audio comes early. In forward
mode the talker gets the thinker's whole answer (its tokens) and yields the codes of
every phrase; code2wav gets those phrases (:func:`talker2code2wav`) and yields their
PCM, phrase by phrase.

Every call into eSpeak runs in a thread, one at a time per process (see
:class:`ESpeak`): the worker's Trio loop keeps serving other requests, heartbeats
and chunks while a phrase is spoken, and each call returns its own request's
phonemes or PCM, so concurrent requests never share audio.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator, Iterable, Mapping
from functools import partial
from typing import Any

import attrs

from .._slots import PrioritySlots
from ..process import ChunkIO, Engine, EngineRequest, Last, run_in_thread
from ._espeak import ESpeak
from ._voices import settings_of
from ._voices import words_per_minute as rate_at

__all__ = ["SAMPLE_RATE", "PhraseSplitter", "code2wav", "talker", "talker2code2wav"]

#: The rate of eSpeak NG's voices, and so of code2wav's PCM (16-bit mono).
SAMPLE_RATE = 22_050

_CLAUSE_END = ",;:"
_SENTENCE_END = ".!?"
#: Appended to a phrase's codes: the pause eSpeak makes after a clause or a sentence
#: when it speaks whole text (one ``_:`` is about 45 ms).
_PAUSES = {"clause": " _:", "sentence": " _:_:_:_:"}


@attrs.define
class PhraseSplitter:
    """Streamed text in, whole phrases out: pure, no eSpeak.

    Text arrives in pieces of any size (an LLM's tokens split words anywhere); a word
    is complete once whitespace follows it. A phrase ends at a word that ends with
    punctuation (``, ; : . ! ?``), or at ``first_words`` words for the first phrase and
    ``max_words`` for later ones: a short first phrase brings the first audio early,
    longer ones sound more natural.
    """

    first_words: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    max_words: int = attrs.field(default=12, validator=attrs.validators.ge(1))
    _partial: str = attrs.field(default="", init=False)
    _words: list[str] = attrs.field(factory=list, init=False)
    _phrases: int = attrs.field(default=0, init=False)

    def feed(self, text: str) -> list[str]:
        """The phrases that ``text`` completes, in order."""
        pieces = (self._partial + text).split()
        ends_with_space = text[-1:].isspace() if text else False
        if pieces and not ends_with_space:
            self._partial = pieces.pop()  # a word may go on in the next piece
        else:
            self._partial = ""
        phrases = []
        for word in pieces:
            self._words.append(word)
            limit = self.first_words if self._phrases == 0 else self.max_words
            if word[-1] in _CLAUSE_END + _SENTENCE_END or len(self._words) >= limit:
                phrases.append(self._take())
        return phrases

    def flush(self) -> list[str]:
        """The text's end: what is left, as a last phrase (none if nothing is)."""
        if self._partial:
            self._words.append(self._partial)
            self._partial = ""
        return [self._take()] if self._words else []

    def _take(self) -> str:
        phrase = " ".join(self._words)
        self._words.clear()
        self._phrases += 1
        return phrase


def phrase_codes(speech: ESpeak, phrase: str, voice: str) -> str:
    """One phrase's phoneme codes, with the pause its punctuation asks for; ``""`` if
    it has nothing to say."""
    codes = speech.phonemes(phrase, voice)
    if not codes:
        return ""
    if phrase[-1] in _SENTENCE_END:
        codes += _PAUSES["sentence"]
    elif phrase[-1] in _CLAUSE_END:
        codes += _PAUSES["clause"]
    return codes


# -- the engines (factories, called once in each worker) -----------------------------------


def talker(voice: str = "en", first_phrase_words: int = 4, phrase_words: int = 12) -> Engine:
    """Stage 1: text to eSpeak NG phoneme codes, a phrase at a time (see
    :class:`PhraseSplitter` for ``first_phrase_words`` and ``phrase_words``), in
    ``voice`` or the one the request asks for (:func:`~omni_trio.speech.settings`).

    async_chunk: reads text chunks (UTF-8) from upstream, sends each phrase's codes
    (ASCII) downstream. forward: its input is the thinker's tokens; it yields each
    phrase's codes as a string, the last as :class:`~omni_trio.process.Last` (first
    the request's speech settings, if it has any: :func:`talker2code2wav` hands them
    on). Where a request enters the pipeline here (a speech request's route: see
    :func:`~omni_trio.speech.say`), its input is the text itself.
    """
    speech = ESpeak.get()  # loaded once per worker, before its first request
    speech.phonemes("", voice)  # an unknown voice fails the stage's start, not a request
    turns = PrioritySlots(1)  # one phrase at a time, the most urgent request's first

    async def codes_of(phrase: str, voice: str, priority: int) -> str:
        call = partial(phrase_codes, speech, phrase, voice)
        async with turns.slot(priority):
            return await run_in_thread(call, what="eSpeak NG")

    def splitter() -> PhraseSplitter:
        return PhraseSplitter(first_phrase_words, phrase_words)

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        asked = settings_of(request.inputs)
        said = asked.get("voice", voice)
        text = _text_of(request.inputs)
        if io.connected:  # async_chunk: codes stream out (text streams in, or is given)
            phrases = splitter()

            async def send(done: list[str]) -> None:
                for phrase in done:
                    if codes := await codes_of(phrase, said, request.priority):
                        await io.send(codes.encode("ascii"))

            if io.sources:
                decoder = codecs.getincrementaldecoder("utf-8")("replace")
                async for chunk in io:
                    await send(phrases.feed(decoder.decode(chunk)))
                await send(phrases.feed(decoder.decode(b"", final=True)) + phrases.flush())
            elif text is None:
                raise ValueError(
                    "the talker's input, where a request enters the pipeline there, is "
                    "the text to speak (a string, or omni_trio.speech.say(text)), not "
                    f"{type(request.inputs).__name__}"
                )
            else:  # the route enters here: the request's own text
                await send(phrases.feed(text) + phrases.flush())
        else:  # forward: the whole answer is the input
            if asked:
                yield dict(asked)
            held: str | None = None  # one phrase behind, to mark the last one
            tokens = request.inputs if text is None else [text]
            for phrase in _phrases(splitter(), tokens):
                if codes := await codes_of(phrase, said, request.priority):
                    if held is not None:
                        yield held
                    held = codes
            if held is not None:
                yield Last(held)

    engine.slots = turns  # type: ignore[attr-defined] # its waiters, for the worker
    return engine


def _text_of(inputs: Any) -> str | None:
    """A speech request's text (its input where it enters at the talker), or ``None``:
    the thinker's text streams in, or is the input's tokens."""
    if isinstance(inputs, str):
        return inputs
    if isinstance(inputs, Mapping) and isinstance(inputs.get("text"), str):
        return str(inputs["text"])
    return None


def code2wav(voice: str = "en", words_per_minute: int = 175) -> Engine:
    """Stage 2: phoneme codes to speech, one PCM output (16-bit mono,
    :data:`SAMPLE_RATE` Hz) per phrase, at ``words_per_minute``, in ``voice`` -- or
    the voice and speed the request asks for (:func:`~omni_trio.speech.settings`).

    async_chunk: speaks each upstream chunk (one phrase's codes) as it arrives.
    forward: its input is the phrases' codes (:func:`talker2code2wav`).
    """
    speech = ESpeak.get()
    speech.synthesize("", voice=voice, words_per_minute=words_per_minute)  # checks the voice
    if speech.sample_rate != SAMPLE_RATE:  # what the configs and the demo's WAV say
        raise RuntimeError(f"eSpeak NG speaks at {speech.sample_rate} Hz, not {SAMPLE_RATE}")
    turns = PrioritySlots(1)  # one phrase at a time, the most urgent request's first

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        asked = settings_of(request.inputs)
        call = partial(
            speech.synthesize,
            voice=asked.get("voice", voice),
            words_per_minute=rate_at(words_per_minute, asked.get("speed", 1.0)),
            phonemes=True,
        )

        async def speak(codes: str) -> bytes:
            async with turns.slot(request.priority):
                return await run_in_thread(partial(call, codes), what="eSpeak NG")

        if io.connected:
            async for chunk in io:
                if pcm := await speak(bytes(chunk).decode("ascii", "replace")):
                    yield pcm
        else:
            inputs = request.inputs
            codes_list = inputs.get("codes", []) if isinstance(inputs, Mapping) else inputs
            phrases = [str(codes) for codes in codes_list]
            for index, codes in enumerate(phrases, 1):
                pcm = await speak(codes)
                yield Last(pcm) if index == len(phrases) else pcm

    engine.slots = turns  # type: ignore[attr-defined] # its waiters, for the worker
    return engine


def _phrases(splitter: PhraseSplitter, tokens: Iterable[Any]) -> list[str]:
    phrases = [phrase for token in tokens for phrase in splitter.feed(str(token))]
    return phrases + splitter.flush()


# -- the orchestrator's function -----------------------------------------------------------


def talker2code2wav(outputs: list[Any]) -> list[str] | dict[str, Any]:
    """forward: code2wav's input is the talker's phrases' codes, in order (with the
    request's speech settings, ``{"speech": ..., "codes": [...]}``, where the talker
    handed some on)."""
    if outputs and isinstance(outputs[0], Mapping):
        return {"speech": dict(outputs[0]), "codes": [str(codes) for codes in outputs[1:]]}
    return [str(codes) for codes in outputs]
