"""A simulated Qwen-Omni style pipeline: thinker -> talker -> code2wav.

Nothing here is a model; everything is deterministic for a given prompt, paced like
one, and audible. The thinker streams a text answer, the talker turns each text token
into codec codes, and code2wav turns every 25 codes into a second of PCM audio (each
code a 40 ms tone on a pentatonic scale, so the result is a little melody).

In async_chunk mode the stages stream to each other through the connector: the
thinker sends each token downstream as it yields it, the talker sends the codes of
each token. In forward mode each stage gets its predecessor's collected outputs.

:func:`voice_thinker` is the thinker of a conversation (the ``voice`` pipeline,
after a stage that listens): it quotes what it heard, then answers from the same
story -- where it starts depends on the words and on the conversation so far.
"""

from __future__ import annotations

import math
import zlib
from array import array
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import trio

from ..process import ChunkIO, Engine, EngineRequest, Last

__all__ = [
    "SAMPLE_RATE",
    "code2wav",
    "prewarm",
    "response_tokens",
    "subtitles",
    "talker",
    "talker2code2wav",
    "thinker",
    "thinker2talker",
    "to_subtitles",
    "voice_answer",
    "voice_thinker",
]

#: The rate of code2wav's PCM (16-bit mono).
SAMPLE_RATE = 24_000
FRAME_SECONDS = 0.04  # one codec code
CODES_PER_CHUNK = 25  # one second of audio per code2wav output
_SCALE = [0, 2, 4, 7, 9]  # a pentatonic scale: any sequence of codes sounds fine
_STORY_TEXT = (
    "The lighthouse keeper counted the waves every night. "
    "Each wave carried a small song from far away. "
    "She wrote the songs down and sang them to the ships. "
    "The ships answered with their horns, low and slow. "
    "By morning the sea was quiet and the songs were hers."
)
_STORY = _STORY_TEXT.split(" ")


_NOTHING_HEARD = "I did not hear anything."
_SENTENCE_STARTS = [0] + [i + 1 for i, word in enumerate(_STORY[:-1]) if word.endswith(".")]


def response_tokens(prompt: str, count: int, *, whole_sentences: bool = False) -> list[str]:
    """The thinker's answer: ``count`` words of a little story, starting at a place
    that depends on ``prompt`` -- the same answer every time for the same prompt.

    ``whole_sentences``: an answer to be read aloud -- it starts at the beginning of
    a sentence and ends at the end of one (the last that fits in ``count`` words,
    unless not even one does)."""
    seed = zlib.crc32(str(prompt).encode())
    if not whole_sentences:
        start = seed % len(_STORY)
        return [_STORY[(start + i) % len(_STORY)] + " " for i in range(count)]
    start = _SENTENCE_STARTS[seed % len(_SENTENCE_STARTS)]
    words = [_STORY[(start + i) % len(_STORY)] for i in range(count)]
    ends = [i + 1 for i, word in enumerate(words) if word.endswith(".")]
    return [word + " " for word in words[: ends[-1] if ends else count]]


def _codes(token: str, per_token: int) -> list[int]:
    seed = zlib.crc32(token.encode())
    return [(seed >> (3 * i)) % 15 for i in range(per_token)]


def _tone_table() -> list[array[int]]:
    """One 40 ms PCM frame per code: a sine with a short fade, so frames join cleanly."""
    frame = int(SAMPLE_RATE * FRAME_SECONDS)
    fade = frame // 8
    table = []
    for code in range(15):
        step = _SCALE[code % 5] + 12 * (code // 5)
        freq = 220.0 * 2 ** (step / 12)
        samples = array("h")
        for n in range(frame):
            envelope = min(1.0, n / fade, (frame - n) / fade)
            samples.append(int(9000 * envelope * math.sin(2 * math.pi * freq * n / SAMPLE_RATE)))
        table.append(samples)
    return table


# -- the engines (factories, called once in each worker) -----------------------------------


def thinker(
    tokens_per_second: float = 50.0, max_tokens: int = 40, whole_sentences: bool = False
) -> Engine:
    """Stage 0: text tokens at ``tokens_per_second`` (see :func:`response_tokens`)."""

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        prompt = request.inputs  # text; or, asking for a voice, {"text": ..., "speech": ...}
        if isinstance(prompt, Mapping):
            prompt = prompt.get("text", "")
        tokens = response_tokens(prompt, max_tokens, whole_sentences=whole_sentences)
        for index, token in enumerate(tokens, 1):
            await trio.sleep(1 / tokens_per_second)
            if io.connected:
                await io.send(token.encode())
            yield Last(token) if index == len(tokens) else token  # the last travels as the end

    return engine


def voice_answer(transcript: str, context: Sequence[Any] = (), max_tokens: int = 40) -> list[str]:
    """The voice thinker's answer, as word tokens (each with its trailing space): it
    quotes ``transcript`` (``You said: <transcript>.``), then answers with whole
    sentences of :func:`response_tokens`, at most ``max_tokens`` words, chosen by the
    transcript and the conversation so far (``context``: turns ``{"role": ...,
    "text": ...}``), so that the same words answer differently in another
    conversation. Nothing heard (an empty transcript) has a fixed answer."""
    heard = " ".join(str(transcript).split())
    if not heard:
        return [word + " " for word in _NOTHING_HEARD.split()]
    if heard[-1] not in ".!?":
        heard = heard.rstrip(",;:") + "."
    so_far = "\n".join(
        f"{turn.get('role')}: {turn.get('text')}" if isinstance(turn, Mapping) else str(turn)
        for turn in context
    )
    quote = [word + " " for word in f"You said: {heard}".split()]
    return quote + response_tokens(f"{heard}\n{so_far}", max_tokens, whole_sentences=True)


def voice_thinker(tokens_per_second: float = 50.0, max_tokens: int = 40) -> Engine:
    """Stage 1 of the voice pipeline: text tokens at ``tokens_per_second`` that answer
    what the listen stage heard (see :func:`voice_answer`).

    async_chunk: its input is the conversation so far (the prewarm's,
    :func:`omni_trio.speech.context_of`), and it reads the transcript from upstream
    (its chunks, UTF-8) before it answers. forward: its input is the transcript
    (:func:`omni_trio.speech.listen2thinker`); there is no context. Its tokens go
    out as the thinker's do: each sent downstream and yielded, the last as
    :class:`~omni_trio.process.Last`.
    """

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        if io.connected:
            context = request.inputs if request.inputs is not None else []
            if not isinstance(context, list | tuple):
                raise TypeError(
                    f"the voice thinker's input is the conversation so far, a list of "
                    f"turns, got {type(context).__name__}"
                )
            transcript = b"".join([bytes(chunk) async for chunk in io]).decode("utf-8", "replace")
        else:
            context, transcript = [], str(request.inputs)
        tokens = voice_answer(transcript, context, max_tokens)
        for index, token in enumerate(tokens, 1):
            await trio.sleep(1 / tokens_per_second)
            if io.connected:
                await io.send(token.encode())
            yield Last(token) if index == len(tokens) else token

    return engine


def talker(codes_per_second: float = 150.0, codes_per_token: int = 4) -> Engine:
    """Stage 1: codec codes from text, ``codes_per_token`` per token."""

    async def codes_for(tokens: AsyncIterator[str] | list[str]) -> AsyncGenerator[list[int], None]:
        async def each() -> AsyncGenerator[str, None]:
            if isinstance(tokens, list):
                for token in tokens:
                    yield token
            else:
                async for token in tokens:
                    yield token

        async with aclosing(each()) as tokens_in_turn:  # closed with its reader
            async for token in tokens_in_turn:
                codes = _codes(token, codes_per_token)
                await trio.sleep(len(codes) / codes_per_second)
                yield codes

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        given = _words_of(request.inputs)  # a request that enters here: text to speak
        if io.connected:  # async_chunk: tokens stream in, codes stream out

            async def tokens() -> AsyncGenerator[str, None]:
                async for chunk in io:
                    yield chunk.decode()

            text = tokens() if io.sources or given is None else _each(given)
            async with aclosing(text), aclosing(codes_for(text)) as coded:
                async for codes in coded:
                    await io.send(array("B", codes).tobytes())
        else:  # forward: the whole answer is the input
            answer = list(request.inputs) if given is None else given
            count = 0
            async with aclosing(codes_for(answer)) as each:  # closed with this engine
                async for codes in each:
                    count += 1
                    yield Last(codes) if count == len(answer) else codes

    return engine


def _words_of(inputs: Any) -> list[str] | None:
    """The words of a request's text where it enters at the talker (a string, or
    ``{"text": ...}``: :func:`omni_trio.speech.say`), as the thinker would stream
    them; ``None`` for any other input."""
    text = inputs.get("text") if isinstance(inputs, Mapping) else inputs
    return [f"{word} " for word in text.split()] if isinstance(text, str) else None


async def _each(words: list[str]) -> AsyncGenerator[str, None]:
    for word in words:
        yield word


def code2wav(chunk_codes: int = CODES_PER_CHUNK) -> Engine:
    """Stage 2: PCM audio (16-bit mono, 24 kHz), one output per ``chunk_codes`` codes."""
    # Each code's frame as bytes, joined once: the output is made in one allocation of
    # its final size (an array grown frame by frame left a trail of freed buffers up
    # to its size, which the worker's heap kept as RSS).
    frames = [frame.tobytes() for frame in _tone_table()]

    def render(codes: list[int]) -> bytes:
        return b"".join([frames[code % len(frames)] for code in codes])

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        pending: list[int] = []
        if io.connected:
            async for chunk in io:
                pending.extend(chunk)
                while len(pending) >= chunk_codes:
                    yield render(pending[:chunk_codes])
                    del pending[:chunk_codes]
                    await trio.lowlevel.checkpoint()
        else:
            pending = list(request.inputs)
            while len(pending) > chunk_codes:
                yield render(pending[:chunk_codes])
                del pending[:chunk_codes]
                await trio.lowlevel.checkpoint()
        if pending:  # the tail: the last output (in forward mode, always there)
            yield Last(render(pending))

    return engine


def cue(start: float, end: float, text: str) -> str:
    """One WebVTT cue: ``00:01.280 --> 00:02.560`` and its text on the next line."""
    return f"{_timestamp(start)} --> {_timestamp(end)}\n{text}"


def _timestamp(seconds: float) -> str:
    millis = round(seconds * 1000)
    minutes, millis = divmod(millis, 60_000)
    hours, minutes = divmod(minutes, 60)
    clock = f"{minutes:02d}:{millis // 1000:02d}.{millis % 1000:03d}"
    return f"{hours:02d}:{clock}" if hours else clock


class _Cues:
    """Pairs the thinker's words with the talker's codes (one chunk of codes per
    token, in order) and groups them into cues timed by the codes: each code is
    :data:`FRAME_SECONDS` of code2wav's audio."""

    def __init__(self, words_per_cue: int) -> None:
        self.words_per_cue = words_per_cue
        self.words: deque[str] = deque()
        self.durations: deque[float] = deque()
        self.start = self.end = 0.0
        self.cue: list[str] = []

    def add(self) -> str | None:
        """Take the next word whose codes are here; a cue, if it ends one."""
        word = self.words.popleft().strip()
        self.end += self.durations.popleft()
        self.cue.append(word)
        if len(self.cue) >= self.words_per_cue or word.endswith((".", ",", "!", "?")):
            return self.flush()
        return None

    def ready(self) -> bool:
        return bool(self.words) and bool(self.durations)

    def flush(self) -> str | None:
        if not self.cue:
            return None
        text, self.cue = " ".join(self.cue), []
        timed = cue(self.start, self.end, text)
        self.start = self.end
        return timed


def subtitles(words_per_cue: int = 7, text_stage: int = 0, codes_stage: int = 1) -> Engine:
    """A stage that reads two (a fan-in): the thinker's words (``text_stage``) and
    the talker's codes (``codes_stage``), and yields timed subtitles for code2wav's
    audio, one WebVTT cue (:func:`cue`) per phrase: at most ``words_per_cue`` words,
    ending early at punctuation. It reads both streams as they come: the thinker
    runs ahead of the talker, and each cue goes out as soon as its last word has
    its codes.

    forward: its input is both stages' outputs (:func:`to_subtitles`)."""

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        cues = _Cues(words_per_cue)
        if io.connected:
            async for source, chunk in io.chunks():
                if source == text_stage:
                    cues.words.append(bytes(chunk).decode())
                elif source == codes_stage:
                    cues.durations.append(len(chunk) * FRAME_SECONDS)
                while cues.ready():
                    if (timed := cues.add()) is not None:
                        yield timed
        else:
            cues.words.extend(str(word) for word in request.inputs["words"])
            cues.durations.extend(len(codes) * FRAME_SECONDS for codes in request.inputs["codes"])
            while cues.ready():
                if (timed := cues.add()) is not None:
                    yield timed
        if (timed := cues.flush()) is not None:
            yield Last(timed)

    return engine


# -- the orchestrator's functions ----------------------------------------------------------


def prewarm(prompt: Any) -> None:
    """async_chunk: the talker and code2wav get no input but the stream itself."""
    return None


def thinker2talker(outputs: list[Any]) -> list[str]:
    """forward: the talker's input is the thinker's whole answer, token by token."""
    return [str(token) for token in outputs]


def talker2code2wav(outputs: list[Any]) -> list[int]:
    """forward: code2wav's input is every code the talker produced."""
    return [code for codes in outputs for code in codes]


def to_subtitles(outputs: Mapping[int, list[Any]]) -> dict[str, list[Any]]:
    """forward: the subtitles' input, from the stages they read (a join, by stage
    id): the thinker's words (stage 0) and the talker's codes, a list per word
    (stage 1)."""
    return {"words": [str(word) for word in outputs[0]], "codes": list(outputs[1])}
