"""The main job (``omni-trio demo``) and ``omni-trio run``, in quick form."""

from __future__ import annotations

import json
import sys
import wave
from importlib.resources import files

import pytest
import trio
from rich.console import Console

from omni_trio.cli import main
from omni_trio.demo.engines import SAMPLE_RATE, code2wav, response_tokens
from omni_trio.demo.runner import DemoOptions, run_demo
from omni_trio.process import EngineRequest, Last


def test_the_demo_runs_both_modes_and_writes_a_wav(tmp_path, capsys):
    output = tmp_path / "demo.wav"
    assert main(["demo", "--quick", "--engines", "simulated", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    # chosen, not a fallback: no advice to install what is installed
    assert "Engines: simulated (--engines simulated), the audio a melody.\n" in printed
    assert "async_chunk" in printed
    assert "forward" in printed
    assert "mean TTFP" in printed
    with wave.open(str(output)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, SAMPLE_RATE)
        # 10 tokens x 4 codes x 40 ms of audio
        assert wav.getnframes() == 10 * 4 * int(SAMPLE_RATE * 0.04)


def test_async_chunk_gets_the_first_audio_out_sooner(tmp_path):
    options = DemoOptions.quick(tmp_path / "x.wav")
    options.engines, options.concurrency, options.requests = "simulated", [1], 1
    # A longer answer at a model-like pace: forward waits for all of it, twice.
    options.tokens_per_second, options.max_tokens, options.codes_per_second = 100.0, 30, 400.0
    report = trio.run(run_demo, options, Console(quiet=True))
    by_mode = {r.mode: r for r in report.results}
    assert by_mode["async_chunk"].ttfp < by_mode["forward"].ttfp / 3
    assert by_mode["async_chunk"].audio_seconds == by_mode["forward"].audio_seconds


def test_the_audio_is_deterministic_for_a_prompt():
    tokens = response_tokens("hello", 6)
    assert tokens == response_tokens("hello", 6)
    assert tokens != response_tokens("goodbye", 6)

    class NoConnector:
        connected = False

    async def render(codes):
        engine = code2wav()
        outputs = [pcm async for pcm in engine(EngineRequest("r", codes, 2), NoConnector())]
        assert isinstance(outputs[-1], Last)  # it knows its tail is its last output
        return [*outputs[:-1], outputs[-1].data]

    first = trio.run(render, list(range(30)))
    assert first == trio.run(render, list(range(30)))
    assert [len(pcm) for pcm in first] == [25 * 960 * 2, 5 * 960 * 2]  # a second, then the rest


def test_run_streams_one_request_through_a_config(tmp_path, capsys):
    pipeline = str(files("omni_trio") / "pipelines" / "demo.toml")
    wav_path = tmp_path / "run.wav"
    assert main(["run", pipeline, "--prompt", "Hello", "--wav", str(wav_path)]) == 0
    printed = capsys.readouterr().out
    assert response_tokens("Hello", 40)[0].strip() in printed
    assert "completed in" in printed
    assert wav_path.stat().st_size > 44


def test_run_reports_a_bad_config(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[stages]]\nstage_id = 0\n")
    assert main(["run", str(bad), "--prompt", "x"]) == 2
    assert "stages[0]: Object missing required field `engine`" in capsys.readouterr().err


def test_the_demo_options_reach_the_run(tmp_path, capsys):
    output = tmp_path / "one.wav"
    argv = ["demo", "--quick", "--engines", "simulated", "--mode", "forward"]
    argv += ["--concurrency", "1", "--requests", "1"]
    argv += ["--prompt", "hi", "--max-tokens", "5", "--tokens-per-second", "500"]
    argv += ["--codes-per-second", "3000", "--output", str(output)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "async_chunk" not in printed.split("mean TTFT")[1]  # one mode's rows only
    with wave.open(str(output)) as wav:
        assert wav.getnframes() == 5 * 4 * int(SAMPLE_RATE * 0.04)  # 5 tokens' audio


def test_the_first_request_streams_its_text_live(tmp_path):
    options = DemoOptions.quick(tmp_path / "x.wav")
    options.modes, options.concurrency, options.requests = ["async_chunk"], [1], 1
    options.prompts, options.live, options.engines = ["Hello"], True, "simulated"
    console = Console(record=True, width=200)
    trio.run(run_demo, options, console)
    shown = console.export_text()
    assert "request 0 (async_chunk): Hello" in shown
    assert "".join(response_tokens("Hello", options.max_tokens)).strip() in shown


def test_run_fails_cleanly_when_a_stage_cannot_start(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[stages]]\nstage_id = 0\nengine = "no_such_module:f"\nfinal_output = true\n')
    assert main(["run", str(bad), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omni-trio run: stage 0: cannot load engine")
    assert "ModuleNotFoundError" in err


def test_run_exits_1_when_the_request_fails(tmp_path, capsys):
    config = tmp_path / "failing.toml"
    config.write_text(
        '[pipeline]\nasync_chunk = false\nconnector = "none"\n'
        '[[stages]]\nstage_id = 0\nengine = "process_engines:fails"\nfinal_output = true\n'
    )
    assert main(["run", str(config), "--prompt", "boom"]) == 1
    printed = capsys.readouterr()
    assert printed.err == "omni-trio run: error: stage 0 failed: ValueError: the engine broke\n"
    assert "before" in printed.out


def test_run_writes_the_sample_rate_it_is_given(tmp_path):
    pipeline = str(files("omni_trio") / "pipelines" / "demo.toml")
    wav_path = tmp_path / "run.wav"
    argv = ["run", pipeline, "--prompt", "Hi", "--wav", str(wav_path), "--sample-rate", "16000"]
    assert main(argv) == 0
    with wave.open(str(wav_path)) as wav:
        assert wav.getframerate() == 16000


def test_run_draws_the_requests_timeline(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "one.png"
    assert main(["run", "demo", "--prompt", "Hi", "--timeline", str(png)]) == 0
    assert f"timeline drawn in {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_says_the_timeline_needs_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["run", "demo", "--prompt", "Hi", "--timeline", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == (
        "omni-trio run: --timeline needs matplotlib, which is not installed: "
        "pip install 'omni-trio[plot]'\n"
    )


def test_run_json_has_each_stages_submit_time(capsys):
    assert main(["run", "demo", "--prompt", "Hi", "--json"]) == 0
    *_, terminal = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    submitted = terminal["metrics"]["stage_submit_latency"]
    assert set(submitted) == {"0", "1", "2"}
    assert max(submitted.values()) < 0.1  # async_chunk: every stage at admission
