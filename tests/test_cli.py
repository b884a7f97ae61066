"""The omni-trio command line."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import wave
from importlib.resources import files
from pathlib import Path

import pytest

import omni_trio
from helpers import END_TO_END, ONLY_FULL_SIZE
from omni_trio.cli import main


def test_compare_json(capsys):
    assert main(["compare", "--json", "-k", "put"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["versions"]["trio"]
    [row] = report["scenarios"]
    assert row["key"] == "cancelled-put"
    assert row["asyncio"]["verdict"] == row["trio"]["verdict"] == "item left out"
    assert row["same"]
    assert row["as_documented"]


def test_compare_table(capsys):
    assert main(["compare", "-k", "shield"]) == 0
    out = capsys.readouterr().out
    assert "orphaned" in out
    assert "waited" in out
    assert "different" in out


def test_a_command_is_required(capsys):
    assert main([]) == 2
    assert capsys.readouterr().err == "omni-trio: the following arguments are required: COMMAND\n"


@ONLY_FULL_SIZE
def test_bench_quick_smoke(capsys, monkeypatch):
    """Keeps the benchmark code from rotting; its numbers mean nothing at this size.

    The in-process scenarios run for real; the process scenarios' own run is
    tests/test_bench_process.py's, and the replica scenarios' tests/test_bench_replicas.py's
    (here they are stand-ins, so that they do not run twice, nor at once under xdist,
    whose shm floors the other test counts): this checks that a whole run reports
    them all."""
    import omni_trio.bench._report as bench_report

    stand_in = {"results": "the process scenarios"}
    monkeypatch.setattr(bench_report, "run_process_bench", lambda **_: stand_in)
    replicas = {"results": "the replica scenarios"}
    monkeypatch.setattr(bench_report, "run_replicas_bench", lambda **_: replicas)
    monkeypatch.setattr(bench_report, "ray_installed", lambda: False)
    assert main(["bench", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["process"] == stand_in
    assert report["replicas"] == replicas
    assert report["ray_skipped"].startswith("Ray is not installed")
    assert report["quick"] is True
    assert report["machine"]["cpus"] >= 1
    for impl in ("trio", "asyncio"):
        result = report["results"][impl]
        assert result["throughput_next_output"] > 0
        assert set(result["per_event_cost"]) == {"10", "100", "1000", "10000"}
        assert result["latency_capacity"] > 0
        for load in ("latency_50%", "latency_70%"):
            assert 0 < result[load]["p50"] <= result[load]["p99"] <= result[load]["max"]
        # every implementation is offered the same loads: fractions of Trio's capacity
        trio_capacity = report["results"]["trio"]["latency_capacity"]
        assert result["latency_50%"]["rate"] == pytest.approx(0.5 * trio_capacity)
        assert result["memory_per_request"] > 0
        assert result["throughput_streams_batches"] > 0
    # The plain design: scenarios 1 to 3, one output per await, and the goals against it.
    assert set(report["results"]["asyncio-plain"]) == {
        "throughput_next_output",
        "throughput_streams",
        "throughput_forward",
    }
    assert "latency p99 at 50% of capacity <= 1 ms" in report["goals"]
    assert "latency p99 at 70% of capacity <= 5 ms" in report["goals"]
    assert "throughput_streams vs plain asyncio >= 1.2" in report["goals"]


def test_compare_exits_1_when_an_outcome_is_not_the_documented_one(capsys, monkeypatch):
    import omni_trio.compare.scenarios as scenarios

    monkeypatch.setattr(scenarios, "expected_verdicts", lambda key: ("nothing", "nothing"))
    assert main(["compare", "-k", "put"]) == 1
    assert "Not as documented in docs/cancellation.md: cancelled-put" in capsys.readouterr().out


def test_bench_from_prints_the_saved_report(capsys):
    saved = Path(__file__).parent.parent / "docs" / "results" / "bench-python3.11.json"
    assert main(["bench", "--from", str(saved)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("$ omni-trio bench --json\nPython 3.11.7;")
    assert "2,053k" in out  # the asyncio twin's scenario 1, as docs/performance.md shows
    assert "goal latency p99 at 50% of capacity <= 1 ms: 0.174 (met)" in out
    assert "64 B: hop p50" in out  # and the process scenarios of the same run
    assert "goal 4 KB chunks: flood >= 0.4x the socket pair's: 0.787 (yes)" in out
    assert "Ray scenarios skipped: Ray is not installed" in out  # that machine had no Ray


def test_bench_from_prints_the_saved_ray_report(capsys):
    saved = Path(__file__).parent.parent / "docs" / "results" / "bench-ray-python3.11.json"
    assert main(["bench", "--from", str(saved)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal width
    assert out.startswith("$ omni-trio bench --only ray --json Python 3.11.7;")
    assert "ray 2.60.0" in out
    assert "4 KB: hop p50 │ 135 µs │ 108 µs │ <= 3 ms │ yes" in out  # as docs/cluster.md says
    assert "Ray goals met: 3 of 3" in out
    assert "node death -> error, trial 3 │ 1.83 s" in out


def test_bench_from_prints_the_saved_audio_report(capsys):
    saved = Path(__file__).parent.parent / "docs" / "results" / "bench-audio-python3.11.json"
    assert main(["bench", "--from", str(saved)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal width
    assert out.startswith("$ omni-trio bench --only audio --json Python 3.11.7;")
    # as docs/performance.md shows it
    assert "speech, 200 chars, pcm: first byte, alone │ 6.2 │ 8.1 │ 10" in out
    assert "transcription of 10.2 s of speech │ 583 │ 604 │ 6" in out
    assert "Audio goals met: 2 of 4" in out
    assert "no speech, concurrency 8: first byte p50 <= 2x concurrency 1: 4.42" in out


# --- the command as a user meets it: checked arguments, `run`, `python -m omni_trio` ---

SRC = str(Path(omni_trio.__file__).parent.parent)
DEMO_TOML = str(files("omni_trio") / "pipelines" / "demo.toml")

#: Engines a user keeps beside their config (forward mode: words, then their "audio").
MODELS = """
def words():
    async def engine(request, io):
        for word in request.inputs.split():
            yield word + " "
    return engine


def tone():
    async def engine(request, io):
        for word in request.inputs:
            yield bytes(2 * len(word))  # 16-bit silence, one sample per letter
    return engine


def to_tone(outputs):  # imported by the parent process: a forward function
    return [word for word in outputs if word]
"""

TINY = """
[pipeline]
name = "tiny"
async_chunk = false
connector = "none"

[[stages]]
stage_id = 0
name = "words"
engine = "{module}:words"
final_output = true

[[stages]]
stage_id = 1
name = "tone"
engine = "{module}:tone"
custom_process_input_func = "{module}:to_tone"
final_output = true
final_output_type = "audio"
sample_rate = 16000
"""


def user_pipeline(directory: Path, module: str) -> Path:
    """A config and its engine module side by side in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{module}.py").write_text(MODELS)
    config = directory / "tiny.toml"
    config.write_text(TINY.format(module=module))
    return config


def omni_trio_cli(*argv: str, cwd: Path, stdin: str = "", timeout: float = 5.0):
    """``python -m omni_trio ARGV`` with only this checkout's ``src`` on PYTHONPATH."""
    return subprocess.run(
        [sys.executable, "-m", "omni_trio", *argv],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": SRC},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


BAD_ARGUMENTS = [
    ("demo --concurrency 0", "omni-trio demo: --concurrency must be a positive integer, got 0"),
    ("demo --concurrency -1", "omni-trio demo: --concurrency must be a positive integer, got -1"),
    ("demo --concurrency 1 x", "--concurrency must be a positive integer, got x"),
    ("demo --max-tokens 0", "omni-trio demo: --max-tokens must be a positive integer, got 0"),
    ("demo --tokens-per-second 0", "--tokens-per-second must be a positive number, got 0"),
    ("demo --tokens-per-second inf", "--tokens-per-second must be a positive number, got inf"),
    ("demo --codes-per-second -2", "--codes-per-second must be a positive number, got -2"),
    ("demo --requests 0", "omni-trio demo: --requests must be a positive integer, got 0"),
    ("demo --prompt ' '", "omni-trio demo: --prompt must not be empty"),
    (
        "demo --output /nonexistent/dir/x.wav",
        "omni-trio demo: --output must be in an existing directory, '/nonexistent/dir' does",
    ),
    ("demo --output .", "omni-trio demo: --output must name a file, '.' is a directory"),
    ("demo --mode both", "omni-trio demo: argument --mode: invalid choice: 'both'"),
    ("demo --bogus", "omni-trio demo: unrecognized arguments: --bogus"),
    ("demo --requests", "omni-trio demo: argument --requests: expected one argument"),
    (
        "run {demo} --prompt hi --wav /nonexistent/x.wav",
        "omni-trio run: --wav must be in an existing directory, '/nonexistent' does not exist",
    ),
    ("run text.toml --prompt hi --wav x.wav", "--wav needs an audio final stage, text.toml has"),
    ("run {demo} --prompt ''", "omni-trio run: --prompt must not be empty"),
    ("run {demo} --prompt-file empty.txt", "--prompt-file must hold a prompt, 'empty.txt' is"),
    ("run {demo} --prompt-file -", "--prompt-file must hold a prompt, standard input is empty"),
    ("run {demo} --prompt-file nope.txt", "--prompt-file must name a readable file, 'nope.txt'"),
    ("run {demo} --prompt a --prompt-file b", "argument --prompt-file: not allowed with"),
    ("run {demo}", "run: one of the arguments --prompt --prompt-file --audio is required"),
    ("run {demo} --prompt hi --sample-rate 0", "--sample-rate must be a positive integer, got 0"),
    ("run {demo} --prompt hi --stage-idle-timeout 0", "--stage-idle-timeout must be a positive"),
    ("run {demo} --prompt hi --max-in-flight 0", "--max-in-flight must be a positive integer"),
    ("run {demo} --prompt hi --shutdown-grace -1", "--shutdown-grace must be a number of seconds"),
    ("run missing.toml --prompt hi", "omni-trio run: missing.toml: cannot read it"),
    ("run dmeo --prompt hi", "dmeo: cannot read it: No such file or directory (and no pipeline"),
    ("run bad.toml --prompt hi", "bad.toml: stages[0]: Object missing required field `engine`"),
    ("compare -k nothing", "omni-trio compare: -k must match a scenario key, 'nothing' matches"),
    ("bench --from nope.json", "omni-trio bench: --from must name a readable file, 'nope.json'"),
    *(
        []
        if importlib.util.find_spec("ray")
        else [("bench --only ray", "omni-trio bench: --only ray needs Ray, which is not installed")]
    ),
    *(
        []
        if importlib.util.find_spec("xllamacpp")
        else [
            (
                "run llm.toml --prompt hi",
                "omni-trio run: the stage0 stage of llm.toml needs xllamacpp (llama.cpp), which "
                "is not installed: pip install 'omni-trio[llm]'",
            ),
            ("serve llm.toml", "omni-trio serve: the stage0 stage of llm.toml needs xllamacpp"),
        ]
    ),
    ("", "omni-trio: the following arguments are required: COMMAND"),
    ("serv", "omni-trio: argument COMMAND: invalid choice: 'serv'"),
    ("serve --port 70000", "omni-trio serve: --port must be a port number 0-65535, got 70000"),
    ("serve --port abc", "omni-trio serve: --port must be a port number 0-65535, got abc"),
    ("serve --max-waiting -1", "omni-trio serve: --max-waiting must be an integer >= 0, got -1"),
    ("serve --max-in-flight 0", "omni-trio serve: --max-in-flight must be a positive integer"),
    ("serve --shutdown-grace -1", "--shutdown-grace must be a number of seconds >= 0, got -1"),
    ("serve --stage-idle-timeout 0", "--stage-idle-timeout must be a positive number, got 0"),
    ("serve missing.toml", "omni-trio serve: missing.toml: cannot read it"),
    ("serve bad.toml", "bad.toml: stages[0]: Object missing required field `engine`"),
    ("serve --port {busy}", "omni-trio serve: --port must be free on 127.0.0.1, {busy} is not"),
    (
        "serve --host 192.0.2.1",  # TEST-NET-1: an address no machine of ours has
        "omni-trio serve: --host must be an address of this machine, 192.0.2.1 is not",
    ),
    ("serve {demo} extra", "omni-trio serve: unrecognized arguments: extra"),
]


@END_TO_END
@pytest.mark.parametrize(("argv", "message"), BAD_ARGUMENTS, ids=[a for a, _ in BAD_ARGUMENTS])
def test_a_bad_argument_is_one_line_and_status_2_before_anything_starts(tmp_path, argv, message):
    (tmp_path / "empty.txt").write_text(" \n\n")
    (tmp_path / "text.toml").write_text(
        '[[stages]]\nstage_id = 0\nengine = "m:f"\nfinal_output = true\n'
    )
    (tmp_path / "bad.toml").write_text("[[stages]]\nstage_id = 0\n")
    (tmp_path / "llm.toml").write_text(
        '[[stages]]\nstage_id = 0\nengine = "omni_trio.llm:llama_cpp"\nfinal_output = true\n'
    )
    with socket.socket() as busy:  # a port in use, for `serve --port`
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        started = time.monotonic()
        done = omni_trio_cli(*shlex.split(argv.format(demo=DEMO_TOML, busy=port)), cwd=tmp_path)
    assert time.monotonic() - started < 5
    assert done.returncode == 2
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert message.replace("{busy}", port) in line
    assert "Traceback" not in done.stderr
    assert not list(tmp_path.glob("*.wav"))  # nothing ran


@END_TO_END
def test_run_finds_the_engines_beside_its_config_and_prints_json(tmp_path):
    config = user_pipeline(tmp_path / "models", "my_models")
    (tmp_path / "prompt.txt").write_text("Hello there\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    argv = ["run", str(config), "--prompt-file", str(tmp_path / "prompt.txt"), "--json"]
    done = omni_trio_cli(*argv, cwd=elsewhere, timeout=60)
    assert done.returncode == 0, done.stderr
    outputs = [json.loads(line) for line in done.stdout.splitlines()]  # nothing but JSON
    *streamed, terminal = outputs
    text = [o["data"] for o in streamed if o["stage"] == "words" and o["data"] is not None]
    assert text == ["Hello ", "there "]
    audio = [o for o in streamed if o["stage"] == "tone" and o["data"] is not None]
    assert {o["data_encoding"] for o in audio} == {"base64"}
    assert [len(base64.b64decode(o["data"])) for o in audio] == [12, 12]
    assert terminal["finished"] is True
    assert terminal["finish_reason"] == "completed"
    assert (terminal["stage_id"], terminal["stage"]) == (1, "tone")
    metrics = terminal["metrics"]
    assert set(metrics["time_to_first_output"]) == {"0", "1"}
    assert 0 < metrics["time_to_first_output"]["0"] <= metrics["e2e_latency"]
    assert metrics["num_outputs"] == len(outputs)


@END_TO_END
def test_run_reads_the_prompt_from_stdin_and_takes_the_sample_rate_from_the_config(
    tmp_path, monkeypatch, capsys
):
    config = user_pipeline(tmp_path / "models", "my_stdin_models")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO("  One two three \n"))
    path_before, env_before = list(sys.path), os.environ.get("PYTHONPATH")
    assert main(["run", str(config), "--prompt-file", "-", "--wav", "out.wav"]) == 0
    assert (sys.path, os.environ.get("PYTHONPATH")) == (path_before, env_before)  # restored
    out = capsys.readouterr().out
    header, text, *rest = out.splitlines()
    assert header == "tiny: words -> tone (forward)"
    assert text == "One two three "  # and nothing for the bare completions
    assert "first output: words" in rest[0]
    assert "28 bytes of audio (0.00 s at 16,000 Hz)" in out  # "One ", "two ", "three "
    with wave.open(str(tmp_path / "out.wav")) as wav:
        assert (wav.getframerate(), wav.getnframes()) == (16_000, 14)


def test_the_version_and_python_m(tmp_path, capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"omni-trio {omni_trio.__version__}\n"
    done = omni_trio_cli("--help", cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout.startswith("usage: omni-trio [-h] [--version] COMMAND ...")


@pytest.mark.parametrize("host", ["192.0.2.1", "2001:db8::1"])
def test_serve_on_an_address_this_machine_lacks_names_the_host_not_the_port(host, capsys):
    """EADDRNOTAVAIL is the host's fault: the port is free, the address is not ours
    (192.0.2.1 and 2001:db8::1 are for documentation: no machine has them)."""
    assert main(["serve", "demo", "--host", host, "--port", "0"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"omni-trio serve: --host must be an address of this machine, {host} ")
    assert "--port" not in line


def serve_parser():
    """``omni-trio serve``'s parser, as ``--help`` shows it."""
    import argparse

    from omni_trio.cli import serve

    commands = argparse.ArgumentParser(prog="omni-trio").add_subparsers()
    serve.add_parser(commands)
    return commands.choices["serve"]


def test_serve_help_shows_every_default(capsys):
    parser = serve_parser()
    for action in parser._actions:
        if action.dest != "help":
            assert "default" in (action.help or ""), f"{action.option_strings}: {action.help}"
    assert main(["serve", "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "--host HOST the address to listen on (default: 127.0.0.1)" in shown
    assert "--port PORT 0: any free port (default: 8000)" in shown
    assert "(default: 1048576, 1 MiB)" in shown
    assert "(default: 300)" in shown  # %(default)g: not 300.0
    assert "%(" not in shown


def test_the_commands_shutdown_grace_default_is_the_configs():
    from omni_trio.cli._common import _DEFAULT_GRACE
    from omni_trio.config import PipelineSection

    assert PipelineSection().shutdown_grace == _DEFAULT_GRACE


def test_compare_fits_80_columns_and_cuts_nothing(capsys, monkeypatch):
    assert main(["compare", "--json"]) == 0
    scenarios = json.loads(capsys.readouterr().out)["scenarios"]
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["compare"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out
    flat = " ".join(out.split())  # wrapped at spaces only: every text is there whole
    for row in scenarios:
        assert f"{row['number']}. {row['title']} (" in flat
        for framework, label in (("asyncio", "asyncio"), ("trio", "Trio")):
            outcome = row[framework]
            assert f"{label}: {outcome['verdict']} {' '.join(outcome['detail'].split())}" in flat


HUNG_MODELS = """
import trio


def hangs():
    async def engine(request, io):
        yield "thinking..."
        await trio.sleep_forever()  # a hung backend: it never says another word
    return engine
"""

HUNG = """
[pipeline]
async_chunk = false
connector = "none"
stage_idle_timeout = 2.0

[[stages]]
stage_id = 0
name = "thinker"
engine = "hung_models:hangs"
final_output = true
"""


@END_TO_END
def test_a_hung_engine_ends_run_with_status_1_and_its_cause(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "hung_models.py").write_text(HUNG_MODELS)
    config = tmp_path / "models" / "hung.toml"
    config.write_text(HUNG)
    started = time.monotonic()
    done = omni_trio_cli("run", str(config), "--prompt", "hi", cwd=tmp_path, timeout=10)
    assert time.monotonic() - started < 10
    assert done.returncode == 1, done.stderr
    assert "thinking..." in done.stdout
    [line] = done.stderr.splitlines()
    assert "stage 0 (thinker) sent nothing for 2 s (stage_idle_timeout)" in line
    assert "Traceback" not in done.stdout + done.stderr


@END_TO_END
def test_run_takes_the_orchestrator_options_from_the_command_line(tmp_path):
    (tmp_path / "hung_models.py").write_text(HUNG_MODELS)
    config = tmp_path / "hung.toml"
    config.write_text(HUNG)
    argv = ["run", str(config), "--prompt", "hi", "--stage-idle-timeout", "0.5"]
    done = omni_trio_cli(*argv, cwd=tmp_path, timeout=10)
    assert done.returncode == 1, done.stderr
    assert "sent nothing for 0.5 s (stage_idle_timeout)" in done.stderr
