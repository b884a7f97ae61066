"""What the language model engine is asked and what it makes of the model's chunks:
pure, no model and no event loop, on every Python (the model's own tests are
tests/test_llm.py's, in the llm session)."""

from __future__ import annotations

import re

import pytest

from omni_trio.llm import LanguageModelError, conversation_of
from omni_trio.llm._chat import Chat, Reply, chat_of, messages_of
from omni_trio.speech import utterance

SYSTEM = {"role": "system", "text": "Be brief."}
EARLIER = [SYSTEM, {"role": "user", "text": "Hi"}, {"role": "assistant", "text": "Hello!"}]


@pytest.mark.parametrize(
    ("inputs", "chat"),
    [
        ("Hello", Chat([], "Hello", {})),
        (None, Chat([], None, {})),  # a generic prewarm's: the turn streams in
        (
            utterance(text="Why?", context=EARLIER, sampling={"max_tokens": 3}),
            Chat(EARLIER, "Why?", {"max_tokens": 3}),
        ),
        (
            conversation_of(utterance(audio=b"\0\0", context=EARLIER, sampling={"seed": 1})),
            Chat(EARLIER, None, {"seed": 1}),
        ),
        ({"context": []}, Chat([], None, {})),
    ],
)
def test_what_a_request_asks(inputs, chat):
    assert chat_of(inputs) == chat


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (utterance(audio=b"\0\0"), "an utterance with audio: a language model reads text"),
        ({"context": [], "turn": "x"}, "unknown key(s) 'turn'"),
        ({"context": "x"}, "'context' must be a list of turns, got str"),
        ({"context": [], "sampling": {"top_k": 3}}, "unknown sampling setting(s) 'top_k'"),
        (42, "expected a dict"),
    ],
)
def test_a_bad_input_names_what_is_wrong(inputs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        chat_of(inputs)


def test_the_prewarm_keeps_the_conversation_and_drops_the_audio():
    said = utterance(audio=b"\1\0" * 8, context=EARLIER, sampling={"temperature": 0})
    assert conversation_of(said) == {"context": EARLIER, "sampling": {"temperature": 0.0}}
    assert conversation_of("just text") == {"context": []}
    with pytest.raises(ValueError, match="utterance: expected a dict"):
        conversation_of(3)


def test_messages_put_the_system_prompt_first_unless_the_conversation_has_one():
    assert messages_of([], "Hi", "Be kind.") == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
    ]
    assert messages_of(EARLIER, "Why?", "Be kind.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Why?"},
    ]


def chunk(content=None, finish=None, **rest):
    delta = {} if content is None else {"content": content}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **rest}


def test_a_reply_is_its_deltas_then_its_meta_at_the_usage_chunk():
    reply = Reply()
    assert reply.take([chunk(), chunk("The"), chunk(" opposite")]) == "The opposite"
    assert reply.meta is None
    assert reply.take([chunk(" is cold."), chunk(finish="length")]) == " is cold."
    assert reply.meta is None  # the usage comes last, in a chunk of its own
    usage = {"prompt_tokens": 37, "completion_tokens": 5, "total_tokens": 42, "extra": {}}
    timings = {"prompt_ms": 120.5, "predicted_ms": 50.25, "cache_n": 0}
    assert reply.take([{"choices": [], "usage": usage, "timings": timings}]) == ""
    assert reply.meta == {
        "finish_reason": "length",
        "usage": {"prompt_tokens": 37, "completion_tokens": 5, "total_tokens": 42},
        "timings": {"prompt_ms": 120.5, "predicted_ms": 50.25},
    }


def test_the_models_error_fails_the_request_with_its_own_words():
    error = {"code": 400, "message": "request (331 tokens) exceeds the available context"}
    with pytest.raises(LanguageModelError, match=re.escape("request (331 tokens) exceeds")):
        Reply().take([{"error": error}])
