"""The ``omni-trio`` command line.

Every argument is checked before anything starts. A bad one -- argparse's own
complaints included -- is one line on stderr naming the option and the rule, and exit
status 2: ``omni-trio demo: --concurrency must be a positive integer, got 0``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import os
import platform
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._runtime import exits_on_interrupt

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr, no usage dump, status 2."""

    def error(self, message: str) -> NoReturn:
        # "argument --concurrency: must be ..." (our converters) reads as
        # "--concurrency must be ..."; argparse's own messages keep their words.
        message = re.sub(r"^argument (\S+): (must )", r"\1 \2", message)
        self.exit(2, f"{self.prog}: {_one_line(message)}\n")


class _UsageError(Exception):
    """A post-parse check failed; the message names the option and the rule."""


def _one_line(text: object) -> str:
    """``text`` with its line breaks (a multi-line cause, say) joined by spaces."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _shown(text: str) -> str:
    """An argument as typed, quoted only if it would not read plainly."""
    return text if text and text == text.strip() and " " not in text else repr(text)


def _integer(low: int, high: int | None, rule: str) -> Callable[[str], int]:
    """An argparse converter: an integer from ``low`` to ``high`` (``None``: no
    bound), else ``must be <rule>, got TEXT``."""

    def convert(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {_shown(text)}")
        return value

    return convert


_positive_int = _integer(1, None, "a positive integer")
_count = _integer(0, None, "an integer >= 0")
_port = _integer(0, 65535, "a port number 0-65535")


def _finite(text: str) -> float:
    """``text`` as a number; NaN (refused by every rule) if it is none."""
    try:
        value = float(text)
    except ValueError:
        return math.nan
    return value if math.isfinite(value) else math.nan


def _positive_number(text: str) -> float:
    value = _finite(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {_shown(text)}")
    return value


def _seconds(text: str) -> float:
    value = _finite(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {_shown(text)}")
    return value


def _text(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must not be empty, got {text!r}")
    return text


def _check_output(option: str, path: str) -> None:
    """``path`` can be created or overwritten as a file: checked before a run, not
    after it."""
    target = Path(path)
    directory = target.parent
    if target.is_dir():
        raise _UsageError(f"{option} must name a file, {path!r} is a directory")
    if not directory.is_dir():
        problem = "does not exist" if not directory.exists() else "is not a directory"
        raise _UsageError(
            f"{option} must be in an existing directory, {str(directory)!r} {problem}"
        )
    writable = os.access(target, os.W_OK) if target.exists() else os.access(directory, os.W_OK)
    if not writable:
        raise _UsageError(f"{option} must be a writable path, {path!r} is not")


def _check_compare(args: argparse.Namespace) -> None:
    from .compare.scenarios import SCENARIOS

    if args.k is not None and not any(args.k in s.key for s in SCENARIOS):
        keys = ", ".join(s.key for s in SCENARIOS)
        raise _UsageError(f"-k must match a scenario key, {args.k!r} matches none of {keys}")


def _check_bench(args: argparse.Namespace) -> None:
    args.report = None
    if args.only == "ray" and args.from_file is None and not _importable("ray"):
        raise _UsageError(
            "--only ray needs Ray, which is not installed: pip install 'omni-trio[ray]'"
        )
    if args.from_file is not None:
        try:
            with open(args.from_file) as saved:
                args.report = json.load(saved)
        except OSError as exc:
            raise _UsageError(
                f"--from must name a readable file, {args.from_file!r}: {exc.strerror or exc}"
            ) from None
        except ValueError as exc:
            raise _UsageError(
                f"--from must name a report saved with --json, {args.from_file!r}: {exc}"
            ) from None


def _check_demo(args: argparse.Namespace) -> None:
    from .demo.runner import resolve_engines

    _check_output("--output", args.output)
    if args.timeline:
        _check_output("--timeline", args.timeline)
    if args.engines == "speech":
        _need_speech("--engines speech")
    requested, args.engines = args.engines, resolve_engines(args.engines)
    fallback = requested == "auto" and args.engines == "simulated"
    args.engines_line = _ENGINES_LINE["fallback" if fallback else args.engines]
    if args.engines == "speech" and args.codes_per_second is not None:
        raise _UsageError(
            "--codes-per-second paces the simulated talker, not eSpeak NG: add --engines simulated"
        )


def _need_speech(what: str) -> None:
    if not _importable("espeakng_loader"):
        raise _UsageError(
            f"{what} needs eSpeak NG, which is not installed: pip install 'omni-trio[speech]'"
        )


def _config(args: argparse.Namespace) -> Any:
    """``args.pipeline``'s config (the demo's when there is none; a shipped one's
    when it names one, see :data:`_SHIPPED`), with the ``[pipeline]`` options the
    command line overrides."""
    from .config import ConfigError, load_pipeline

    try:
        shipped = _SHIPPED.get(args.pipeline or "demo")
        if shipped is not None and (args.pipeline is None or not Path(args.pipeline).is_file()):
            from .demo.runner import template

            if shipped == "speech":
                _need_speech("the speech pipeline")
            config = template(shipped)
        else:
            config = load_pipeline(args.pipeline)
        overrides = {
            key: getattr(args, key)
            for key in ("stage_idle_timeout", "max_in_flight", "shutdown_grace")
            if getattr(args, key) is not None
        }
        return config.with_pipeline(**overrides) if overrides else config
    except ConfigError as exc:
        raise _UsageError(str(exc)) from None


#: The pipelines shipped with the package, by the name ``run`` and ``serve`` take for
#: them (a file of that name in the current directory wins).
_SHIPPED = {"demo": "simulated", "speech": "speech"}


def _check_run(args: argparse.Namespace) -> None:
    args.config = _config(args)
    if args.timeline is not None:
        _check_output("--timeline", args.timeline)
        if not _importable("matplotlib"):
            raise _UsageError(
                "--timeline needs matplotlib, which is not installed: pip install 'omni-trio[plot]'"
            )
    audio = [s for s in args.config.stages if s.final_output and s.final_output_type == "audio"]
    if args.wav is not None:
        if not audio:
            raise _UsageError(f"--wav needs an audio final stage, {args.pipeline} has none")
        _check_output("--wav", args.wav)
    if args.sample_rate is None:
        args.sample_rate = audio[0].sample_rate if audio else None
    if args.prompt_file is not None:
        name = "standard input" if args.prompt_file == "-" else repr(args.prompt_file)
        try:
            if args.prompt_file == "-":
                text = sys.stdin.read()
            else:
                text = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise _UsageError(
                f"--prompt-file must name a readable file, {name}: {exc.strerror or exc}"
            ) from None
        except ValueError:
            raise _UsageError(f"--prompt-file must hold UTF-8 text, {name} does not") from None
        args.prompt = text.strip()
        if not args.prompt:
            raise _UsageError(f"--prompt-file must hold a prompt, {name} is empty")


def _check_serve(args: argparse.Namespace) -> None:
    missing = [m for m in ("hypercorn", "starlette", "prometheus_client") if not _importable(m)]
    if missing:
        raise _UsageError(
            f"needs the serve extra ({', '.join(missing)} missing): pip install 'omni-trio[serve]'"
        )
    args.config = _config(args)
    _check_address(args.host, args.port)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _check_address(host: str, port: int) -> None:
    """Bind ``host:port`` for a moment, as the server will (so a port in use is said
    now, not after the stages started)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise _UsageError(f"--host must be an address of this machine, {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise _UsageError(
                f"--port must be free on {host}, {port} is not: {exc.strerror or exc}"
            ) from None


def _compare(args: argparse.Namespace) -> int:
    from importlib.metadata import version

    from .compare.scenarios import SCENARIOS, expected_verdicts, run_scenario

    scenarios = [s for s in SCENARIOS if not args.k or args.k in s.key]
    rows: list[dict[str, Any]] = []
    for number, scenario in enumerate(SCENARIOS, 1):
        if scenario not in scenarios:
            continue
        on_asyncio, on_trio = run_scenario(scenario)
        expected = expected_verdicts(scenario.key)
        rows.append(
            {
                "number": number,
                "key": scenario.key,
                "title": scenario.title,
                "asyncio": {"verdict": on_asyncio.verdict, "detail": on_asyncio.detail},
                "trio": {"verdict": on_trio.verdict, "detail": on_trio.detail},
                "same": on_asyncio.verdict == on_trio.verdict,
                "as_documented": (on_asyncio.verdict, on_trio.verdict) == expected,
            }
        )
    versions = {
        "python": platform.python_version(),
        "trio": version("trio"),
        "implementation": platform.python_implementation(),
    }
    surprises = [row["key"] for row in rows if not row["as_documented"]]
    if args.json:
        print(json.dumps({"versions": versions, "scenarios": rows}, indent=2))
        return 1 if surprises else 0

    console = Console()
    console.print(
        Text(
            f"Cancellation semantics: asyncio vs Trio "
            f"(Python {versions['python']}, trio {versions['trio']})",
            style="bold",
        )
    )
    for row in rows:
        console.print(_scenario_view(row))
    console.print()
    if surprises:
        console.print(f"[red]Not as documented in docs/cancellation.md: {', '.join(surprises)}")
        return 1
    console.print("Every outcome is the one docs/cancellation.md documents for this Python.")
    return 0


def _scenario_view(row: dict[str, Any]) -> Table:
    """One scenario, then one row per framework: it fits 80 columns, and a word longer
    than its column is folded, never cut with an ellipsis."""
    outcomes = Table.grid(padding=(0, 1))
    outcomes.add_column(no_wrap=True)
    outcomes.add_column(overflow="fold")
    for label, key in (("asyncio", "asyncio"), ("Trio", "trio")):
        outcome = row[key]
        outcomes.add_row(
            f"{label}:", Text.assemble((outcome["verdict"], "bold"), "\n", outcome["detail"])
        )
    view = Table.grid(padding=(0, 1))
    view.add_column(justify="right", no_wrap=True, width=3)
    view.add_column(overflow="fold")
    same = Text("same", style="green") if row["same"] else Text("different", style="yellow")
    view.add_row("", "")
    view.add_row(
        Text(f"{row['number']}.", style="bold"),
        Text.assemble((row["title"], "bold"), " (", same, ")"),
    )
    view.add_row("", outcomes)
    return view


def _bench(args: argparse.Namespace) -> int:
    from .bench._report import print_report, run_bench

    if args.report is not None:  # --from, read by the check
        print_report(args.report)
        return 0
    argv = " ".join(["omni-trio", *sys.argv[1:]]) if args.argv is None else args.argv
    report = run_bench(quick=args.quick, command=argv, only=args.only)
    if report is None:
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from functools import partial

    from ._runtime import run_under_signals
    from .demo.runner import DemoOptions, results_table, run_demo

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
    if args.timeline is not None:
        options.timeline = Path(args.timeline) if args.timeline else None
    options.engines = args.engines  # resolved by the check
    console = Console()
    console.print(
        "omni_trio demo: thinker -> talker -> code2wav, each stage its own worker process; "
        "async_chunk streams through shared memory, forward hands each stage its "
        "predecessor's whole output.",
        highlight=False,
    )
    console.print(args.engines_line, highlight=False, soft_wrap=True, markup=False)
    report = run_under_signals(partial(run_demo, options, console))
    console.print(results_table(report.results, report.engines))
    console.print(
        "TTFT: first text token; TTFP: first audio packet; E2E: admission to terminal; "
        "RTF: E2E / audio duration (mean per request)."
    )
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


#: The demo's second line: which engines it runs, and for "fallback" (simulated,
#: because the speech extra is missing) how to get the others.
_ENGINES_LINE = {
    "speech": "Engines: the thinker is simulated; eSpeak NG speaks its answer "
    "(talker: text to phonemes, phrase by phrase; code2wav: phonemes to audio).",
    "simulated": "Engines: simulated (--engines simulated), the audio a melody.",
    "fallback": "Engines: simulated, the audio a melody (for real speech, install the "
    "speech extra: pip install 'omni-trio[speech]').",
}


def _run(args: argparse.Namespace) -> int:
    from ._runtime import run_under_signals
    from .config import ConfigError
    from .process import WorkerStartError

    with _import_path(Path(args.pipeline).parent, Path.cwd()):
        try:
            grace = args.config.pipeline.shutdown_grace
            return int(
                run_under_signals(lambda _stopping: _run_one(args.config, args), grace=grace)
            )
        except (ConfigError, WorkerStartError) as exc:  # the pipeline could not start
            return _fail(f"omni-trio run: {exc}", 2)


def _serve(args: argparse.Namespace) -> int:
    from functools import partial

    from ._runtime import run_under_signals
    from .config import ConfigError
    from .process import WorkerStartError

    config = args.config
    grace = config.pipeline.shutdown_grace
    directories = (
        [Path.cwd()] if args.pipeline is None else [Path(args.pipeline).parent, Path.cwd()]
    )
    with _import_path(*directories):
        try:
            # The server drains within the grace; what runs past twice that (the
            # orchestrator's and the workers' own bounded shutdowns) is cancelled.
            run_under_signals(partial(_serve_main, config, args), grace=2 * grace + 5.0)
        except (ConfigError, WorkerStartError) as exc:  # the pipeline could not start
            return _fail(f"omni-trio serve: {exc}", 2)
    return 0


async def _serve_main(config: Any, args: argparse.Namespace, stopping: Any) -> None:
    from functools import partial

    import trio

    from ._errors import unwrap_single_exception
    from .serve import app_for_config, serve

    app = app_for_config(config, max_waiting=args.max_waiting)
    names = " -> ".join(s.label for s in config.stages)
    # The server's error as it is (a WorkerStartError: one line), not in a group.
    with unwrap_single_exception():
        async with trio.open_nursery() as nursery:
            url = await nursery.start(
                partial(
                    serve,
                    app,
                    host=args.host,
                    port=args.port,
                    stopping=stopping,
                    shutdown_grace=config.pipeline.shutdown_grace,
                )
            )
            print(
                f"omni-trio serve: {config.pipeline.name} ({names}, {config.mode}) on {url}",
                flush=True,
            )


def _fail(message: str, status: int) -> int:
    print(_one_line(message), file=sys.stderr)
    return status


@contextlib.contextmanager
def _import_path(*directories: Path) -> Iterator[None]:
    """Put ``directories`` (the config's, then the current one) first on the import
    path of this process (``sys.path``: prewarm and forward functions) and of the
    workers it spawns (``PYTHONPATH``, after any entries it had), as ``python
    script.py`` puts the script's directory; both are restored afterwards."""
    entries = list(dict.fromkeys(str(d.resolve()) for d in directories))
    saved_path, saved_env = list(sys.path), os.environ.get("PYTHONPATH")
    sys.path[:0] = [e for e in entries if e not in sys.path]
    kept = [p for p in (saved_env or "").split(os.pathsep) if p and p not in entries]
    os.environ["PYTHONPATH"] = os.pathsep.join([*entries, *kept])
    try:
        yield
    finally:
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_env


def _output_json(out: Any, names: dict[int, str]) -> dict[str, Any]:
    """One output as JSON: bytes (audio) as base64, with ``data_encoding: "base64"``."""
    data, encoding = out.data, None
    if isinstance(data, bytes | bytearray | memoryview):
        data, encoding = base64.b64encode(data).decode("ascii"), "base64"
    record = {
        "request_id": out.request_id,
        "stage_id": out.stage_id,
        "stage": names.get(out.stage_id),
        "data": data,
        "data_encoding": encoding,
        "finished": out.finished,
        "finish_reason": out.finish_reason,
        "error": out.error,
    }
    metrics = out.metrics
    if metrics is not None:
        arrival = metrics.arrival_time
        record["metrics"] = {
            "e2e_latency": metrics.e2e_latency,
            "time_to_first_output": {
                str(k): t - arrival for k, t in sorted(metrics.first_output_times.items())
            },
            "stage_submit_latency": {
                str(k): t - arrival for k, t in sorted(metrics.stage_submit_times.items())
            },
            "stage_finish_latency": {
                str(k): t - arrival for k, t in sorted(metrics.stage_finish_times.items())
            },
            "num_outputs": metrics.num_outputs,
        }
    return record


async def _run_one(config: Any, args: argparse.Namespace) -> int:
    from functools import partial

    import trio

    from . import open_orchestrator
    from ._audio import write_wav
    from .process import open_process_pipeline

    types = config.final_output_types  # what the user gets: outputs of final stages only
    names = config.stage_names
    audio = bytearray()
    console = Console(quiet=args.json)  # with --json, stdout is the JSON lines alone
    console.print(
        f"{config.pipeline.name}: {' -> '.join(names.values())} ({config.mode})",
        markup=False,
        highlight=False,
    )
    async with (
        open_process_pipeline(config) as pipeline,
        open_orchestrator(*pipeline.orchestrator_args, **pipeline.orchestrator_kwargs) as orch,
        orch.open_request(args.prompt) as stream,
    ):
        async for out in stream:
            if args.json:
                print(json.dumps(_output_json(out, names), default=repr), flush=True)
            if out.data is None or out.finish_reason in ("aborted", "error"):
                continue  # a bare completion shows as nothing
            if types.get(out.stage_id) == "audio":
                audio += out.data
            else:
                console.out(str(out.data), end="", highlight=False)
    console.out("")
    terminal = stream.terminal
    assert terminal is not None
    if terminal.finish_reason != "completed":
        return _fail(f"omni-trio run: {terminal.finish_reason}: {terminal.error or 'no cause'}", 1)
    metrics = terminal.metrics
    assert metrics is not None
    firsts = ", ".join(
        f"{names[k]} {(metrics.time_to_first_output(k) or 0.0) * 1e3:,.0f} ms"
        for k in sorted(metrics.first_output_times)
    )
    console.print(
        f"completed in {metrics.e2e_latency * 1e3:,.0f} ms; first output: {firsts}",
        highlight=False,
    )
    if audio:
        seconds = len(audio) / 2 / args.sample_rate
        console.print(
            f"{len(audio):,} bytes of audio ({seconds:.2f} s at {args.sample_rate:,} Hz)",
            highlight=False,
        )
        if args.wav:
            try:
                write_wav(args.wav, bytes(audio), args.sample_rate)
            except OSError as exc:
                return _fail(f"omni-trio run: cannot write {args.wav}: {exc}", 1)
            console.print(f"written to {args.wav}", highlight=False)
    if args.timeline:
        from .timeline import plot_timeline

        draw = partial(
            plot_timeline,
            args.timeline,
            {config.mode: [metrics]},
            stage_names=names,
            output_types=types,
            title=f"{config.pipeline.name}: {' -> '.join(names.values())}",
        )
        try:
            await trio.to_thread.run_sync(draw)
        except OSError as exc:
            return _fail(f"omni-trio run: cannot write {args.timeline}: {exc}", 1)
        console.print(f"timeline drawn in {args.timeline}", highlight=False, soft_wrap=True)
    return 0


@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    """Run ``omni-trio ARGV`` (default: ``sys.argv[1:]``); return its exit status (2 for
    a bad argument, whose one line is on stderr; 0 after ``--help`` or ``--version``)."""
    try:
        args = _parse(argv)
    except SystemExit as exit:  # argparse's way out, and ours for a failed check
        return exit.code if isinstance(exit.code, int) else 2
    args.argv = None if argv is None else " ".join(["omni-trio", *argv])
    status: int = args.run(args)
    return status


def _pipeline_options(command: argparse.ArgumentParser, *, grace: str) -> None:
    """The ``[pipeline]`` options a command may override (read by :func:`_config`)."""
    command.add_argument(
        "--stage-idle-timeout",
        type=_positive_number,
        metavar="SECONDS",
        help="end a request whose stage sends nothing for this long (overrides [pipeline])",
    )
    command.add_argument(
        "--max-in-flight", type=_positive_int, metavar="N", help="overrides [pipeline]"
    )
    command.add_argument(
        "--shutdown-grace", type=_seconds, metavar="SECONDS", help=f"{grace} (overrides [pipeline])"
    )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed and checked arguments; raises :exc:`SystemExit` after printing
    help, the version, or the one line that says what is wrong."""
    from . import __version__

    parser = _Parser(
        prog="omni-trio",
        description="omni_trio: a Trio control plane for multi-stage streaming pipelines.",
    )
    parser.add_argument("--version", action="version", version=f"omni-trio {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    compare = commands.add_parser(
        "compare",
        help="run the cancellation scenarios on asyncio and on Trio, side by side",
        description="Run every cancellation scenario on asyncio and on Trio under this "
        "Python and print what each did. Exits 1 if an outcome is not the documented one.",
    )
    compare.add_argument("--json", action="store_true", help="print JSON instead of a table")
    compare.add_argument("-k", metavar="TEXT", help="only the scenarios whose key contains TEXT")
    compare.set_defaults(run=_compare, check=_check_compare)
    bench = commands.add_parser(
        "bench",
        help="benchmark the Trio orchestrator against its asyncio twin (and uvloop), "
        "and the process data plane against its floors",
        description="Run the benchmark scenarios once per implementation, each in its own "
        "process, and print the comparison. Stages are in-process and emit as fast as "
        "possible, so the figures are the orchestrator's own cost. Then the process "
        "scenarios: chunks and outputs between worker processes, and the demo pipeline "
        "unpaced, each beside its floor (two bare processes and a socket pair) measured "
        "in the same run, with the goals they are held to. Then, if Ray is installed, "
        "two Ray stages on different nodes of a local cluster beside the same stages as "
        "worker processes, and a node's death.",
    )
    bench.add_argument("--json", action="store_true", help="print JSON instead of a table")
    bench.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    bench.add_argument(
        "--only",
        choices=["inprocess", "process", "ray"],
        help="run only the in-process scenarios, only the process scenarios "
        "(worker processes against their floors), or only the Ray scenarios (Ray "
        "stages on a local two-node cluster beside worker processes)",
    )
    bench.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE",
        help="print the table of a report saved with --json instead of running",
    )
    bench.set_defaults(run=_bench, check=_check_bench)
    demo = commands.add_parser(
        "demo",
        help="the main job: an omni pipeline in worker processes that speaks, both modes",
        description="Run a thinker -> talker -> code2wav pipeline (one worker process per "
        "stage; eSpeak NG speaks when the speech extra is installed) in async_chunk and "
        "forward mode at several concurrencies; stream request 0's text, write its audio "
        "as a WAV and a timeline of the first requests as a PNG, print TTFT/TTFP/E2E/RTF.",
    )
    demo.add_argument("--quick", action="store_true", help="tiny and fast (a smoke run)")
    demo.add_argument("--mode", action="append", choices=["async_chunk", "forward"])
    demo.add_argument("--concurrency", type=_positive_int, nargs="+", metavar="N")
    demo.add_argument(
        "--requests", type=_positive_int, metavar="N", help="requests per concurrency level"
    )
    demo.add_argument("--prompt", type=_text, action="append", help="a prompt (repeat for several)")
    demo.add_argument("--tokens-per-second", type=_positive_number, help="the thinker's rate")
    demo.add_argument("--max-tokens", type=_positive_int, help="the thinker's answer length")
    demo.add_argument("--codes-per-second", type=_positive_number, help="the talker's rate")
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
    demo.set_defaults(run=_demo, check=_check_demo)
    run = commands.add_parser(
        "run",
        help="stream one request through a pipeline config (TOML)",
        description="Start the stages of PIPELINE (a TOML config, or a shipped one: "
        "'demo', the simulated pipeline, or 'speech', eSpeak NG's, the speech extra) and "
        "stream one request: text as it comes, audio counted (and written with --wav). "
        "The config's directory and the current directory are put on the import path "
        "(of this process and of the workers), so engines beside the config are found.",
    )
    run.add_argument("pipeline", metavar="PIPELINE")
    prompt = run.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", type=_text, metavar="TEXT", help="the prompt")
    prompt.add_argument(
        "--prompt-file", metavar="PATH", help="read the prompt from PATH ('-': standard input)"
    )
    run.add_argument("--wav", metavar="PATH", help="write the audio outputs to this WAV file")
    run.add_argument(
        "--timeline",
        metavar="PATH",
        help="draw the request's stages (submit to completion, first outputs) as a PNG "
        "(the plot extra)",
    )
    run.add_argument(
        "--sample-rate",
        type=_positive_int,
        metavar="HZ",
        help="of the audio, overriding the audio stage's sample_rate in the config",
    )
    _pipeline_options(run, grace="how long stopping may take before what is left is killed")
    run.add_argument(
        "--json",
        action="store_true",
        help="print every output as a line of JSON (the terminal last, with its metrics); "
        "audio data as base64",
    )
    run.set_defaults(run=_run, check=_check_run)
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible streaming server for a pipeline (the serve extra)",
        description="Serve PIPELINE (a TOML config, or a shipped one: 'demo', the default, "
        "or 'speech') over HTTP: "
        "POST /v1/chat/completions (streamed or not, text and audio), GET /v1/models, "
        "/health, /metrics. SIGTERM drains: requests in flight finish within "
        "shutdown_grace, new ones get 503. See docs/serving.md.",
    )
    serve.add_argument("pipeline", metavar="PIPELINE", nargs="?")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serve.add_argument("--port", type=_port, default=8000, help="0: any free port")
    serve.add_argument(
        "--max-waiting",
        type=_count,
        default=64,
        metavar="N",
        help="requests that may wait for a max_in_flight slot; more get 503 at once",
    )
    _pipeline_options(serve, grace="how long a drain lets requests in flight run")
    serve.set_defaults(run=_serve, check=_check_serve)
    args, extra = parser.parse_known_args(argv)
    command = commands.choices[args.command]
    if extra:  # said by the subcommand, as argparse would not
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        args.check(args)
    except _UsageError as exc:
        command.error(str(exc))
    return args


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
