"""What a language model is asked, and what it answers, as plain data: no model, no
event loop.

:func:`chat_of` reads a request's input -- a ``str``, an utterance with its
``text`` (:func:`omni_trio.speech.utterance`), or, for a stage whose user turn
streams in from upstream, the utterance's context alone (:func:`conversation_of`,
its prewarm) -- as a :class:`Chat`: OpenAI-style ``messages`` and the request's
sampling. :class:`Reply` folds the model's streamed chunks (llama.cpp's OpenAI-style
``chat.completion.chunk`` objects) into text, and, at the end, what the stage says
about its answer (its ``meta``: usage and why it stopped).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .._conversation import (
    Sampling,
    Turn,
    check_context,
    check_sampling,
    checked_utterance,
)

__all__ = [
    "Chat",
    "LanguageModelError",
    "Reply",
    "chat_of",
    "conversation_of",
    "messages_of",
]


class LanguageModelError(RuntimeError):
    """The model refused or failed a request (a prompt longer than its context, say);
    the message is the model's own."""


def _invalid(message: str) -> ValueError:
    return ValueError(f"the language model's input: {message}")


@attrs.frozen
class Chat:
    """A request as the model reads it.

    Attributes:
      context: The conversation before the user's turn, system turns included.
      turn: The user's turn; ``None`` when it streams in from upstream (async_chunk,
          after a stage that listens), as UTF-8 chunks.
      sampling: The request's own settings (each absent one: the stage's).
    """

    context: list[Turn]
    turn: str | None
    sampling: Sampling


def chat_of(inputs: object) -> Chat:
    """A request's input as a :class:`Chat`.

    The input is one of:

    - a ``str``: the user's turn, with no context;
    - an utterance with ``text`` (:func:`omni_trio.speech.utterance`): the turn, its
      context and sampling;
    - ``{"context": [...], "sampling": {...}}`` (:func:`conversation_of`'s), or
      ``None``: the turn comes from upstream.

    Raises:
      ValueError: none of these (an utterance with ``audio``: a model reads text),
          naming what is wrong.
    """
    if inputs is None:
        return Chat([], None, {})
    if isinstance(inputs, str):
        return Chat([], inputs, {})
    if isinstance(inputs, Mapping) and "text" not in inputs and "audio" not in inputs:
        unknown = [repr(key) for key in inputs if key not in ("context", "sampling")]
        if unknown:
            raise _invalid(
                f"unknown key(s) {', '.join(unknown)}: a conversation without its turn "
                "has 'context' and 'sampling'"
            )
        return Chat(
            check_context(inputs.get("context", []), _invalid),
            None,
            check_sampling(inputs.get("sampling", {}), _invalid),
        )
    said = checked_utterance(inputs)
    if said.text is None:
        raise _invalid(
            "an utterance with audio: a language model reads text -- put a stage that "
            "listens before it"
        )
    return Chat(said.context, said.text, said.sampling)


def conversation_of(prompt: Any) -> dict[str, Any]:
    """async_chunk: a language model's prewarm after a stage that listens -- the
    utterance's conversation so far and its sampling. The user's turn comes later,
    through the stream (the listen stage's transcript).

    Raises:
      ValueError: the prompt is not an utterance (so the request fails before any
          stage starts on it, naming what is wrong).
    """
    said = checked_utterance(prompt)
    conversation: dict[str, Any] = {"context": said.context}
    if said.sampling:
        conversation["sampling"] = said.sampling
    return conversation


def messages_of(context: list[Turn], turn: str, system: str | None) -> list[dict[str, str]]:
    """OpenAI-style ``messages``: ``system`` first (unless the context has a system
    turn of its own), the context, then the user's turn."""
    messages = []
    if system and not any(t["role"] == "system" for t in context):
        messages.append({"role": "system", "content": system})
    messages += [{"role": t["role"], "content": t["text"]} for t in context]
    messages.append({"role": "user", "content": turn})
    return messages


@attrs.define
class Reply:
    """A streamed answer, folded chunk by chunk (:meth:`take`).

    Attributes:
      meta: Once the answer has ended: what the stage says about it --
          ``{"finish_reason": "stop" | "length", "usage": {"prompt_tokens",
          "completion_tokens", "total_tokens"}}``, and llama.cpp's ``timings``
          (milliseconds of prompt evaluation and of generation) where it gave them.
    """

    meta: dict[str, Any] | None = None
    #: Chunks of text taken so far: llama.cpp streams one per token.
    tokens: int = 0
    _finish: str | None = None

    def take(self, chunks: list[Any]) -> str:
        """The text of ``chunks``, in order; sets :attr:`meta` at the usage chunk
        (the last).

        Raises:
          LanguageModelError: a chunk is the model's error.
        """
        text = []
        for chunk in chunks:
            error = chunk.get("error")
            if error is not None:
                message = error.get("message") if isinstance(error, Mapping) else error
                raise LanguageModelError(str(message))
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    text.append(content)
                    self.tokens += 1
                if choice.get("finish_reason"):
                    self._finish = choice["finish_reason"]
            usage = chunk.get("usage")
            if usage is not None:
                meta: dict[str, Any] = {
                    "finish_reason": self._finish or "stop",
                    "usage": {
                        key: int(usage.get(key, 0))
                        for key in ("prompt_tokens", "completion_tokens", "total_tokens")
                    },
                }
                timings = chunk.get("timings")
                if isinstance(timings, Mapping):
                    meta["timings"] = {
                        key: float(timings[key])
                        for key in ("prompt_ms", "predicted_ms")
                        if key in timings
                    }
                self.meta = meta
        return "".join(text)
