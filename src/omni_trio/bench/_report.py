"""``omni-trio bench``: run the workloads once per implementation and report them.

Each implementation runs in a process of its own (``python -m omni_trio.bench --impl
NAME``), Trio first: its scenario-5 capacity sets the offered loads for everyone. The
plain asyncio design (one item per queue hop) runs last, and only scenarios 1 to 3:
it is the yardstick of issue 12's goals, not a third orchestrator to weigh. Then the
process scenarios run, each beside its floor (see
:mod:`omni_trio.bench._process_report`); the report holds them under ``"process"``.
Then the replica pools (:mod:`omni_trio.bench._replicas_report`), under
``"replicas"``, and the Ray scenarios, under ``"ray"``. The voice scenarios
(:mod:`omni_trio.bench._voice_report`), under ``"voice"``, run alone (``--only
voice``): at the pace of speech, they take minutes; and so do the language model's
(:mod:`omni_trio.bench._llm_report`), under ``"llm"`` (``--only llm``).
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import re
import subprocess
import sys
from importlib.metadata import version
from importlib.util import find_spec
from typing import Any

from rich.console import Console
from rich.table import Table

from ._latency import LOADS
from ._process_report import header, print_header, print_process_report, run_process_bench
from ._ray_report import print_ray_report, ray_installed, run_ray_bench
from ._replicas_report import print_replicas_report, run_replicas_bench

__all__ = ["goals", "print_report", "run_bench"]

#: The plain asyncio design: scenarios 1 to 3 only, one output per await.
PLAIN = "asyncio-plain"

#: (key in a result, label, how to print it)
ROWS = [
    ("throughput_next_output", "1. throughput, next_output() (events/s)", "rate"),
    ("throughput_next_output_batches", "   in batches: next_outputs()", "rate"),
    ("throughput_streams", "2. throughput, per-request streams (events/s)", "rate"),
    ("throughput_streams_batches", "   in batches: receive_batch()", "rate"),
    ("throughput_forward", "3. throughput, forward mode (events/s)", "rate"),
    ("per_event_cost.10", "4. cost per event, 10 in flight", "time"),
    ("per_event_cost.100", "   100 in flight", "time"),
    ("per_event_cost.1000", "   1,000 in flight", "time"),
    ("per_event_cost.10000", "   10,000 in flight", "time"),
    ("latency_capacity", "5. capacity, one output per item (events/s)", "rate"),
    ("latency_50%.p50", "   added latency p50, at 50% of Trio's capacity", "time"),
    ("latency_50%.p99", "   p99", "time"),
    ("latency_50%.max", "   max", "time"),
    ("latency_70%.p50", "   p50, at 70% of Trio's capacity", "time"),
    ("latency_70%.p99", "   p99", "time"),
    ("latency_70%.max", "   max", "time"),
    ("memory_per_request", "6. orchestrator state per request", "bytes"),
    ("channel_hop", "7. one channel hop (the floor)", "time"),
]


#: The families that only run alone (``--only NAME``), in the order a report prints
#: them, and the module of each: its ``run_NAME_bench(quick=, console=)``,
#: ``print_NAME_report(report, console)`` and ``NAME_missing()`` (what the family
#: needs that is not installed, or ``None``).
ALONE = {
    "voice": "._voice_report",
    "llm": "._llm_report",
    "audio": "._audio",
    "priority": "._priority",
}


def family(name: str, part: str) -> Any:
    """The family ``name``'s function ``part`` (``"run"``, ``"print"`` or
    ``"missing"``), imported on first use."""
    module = importlib.import_module(ALONE[name], __package__)
    attribute = {"run": f"run_{name}_bench", "print": f"print_{name}_report"}.get(
        part, f"{name}_missing"
    )
    return getattr(module, attribute)


def run_bench(*, quick: bool, command: str, only: str | None = None) -> dict[str, Any] | None:
    """Run the in-process scenarios, then the process scenarios, then the replica
    pools, then the Ray scenarios if Ray is installed (``only``: ``"inprocess"``,
    ``"process"``, ``"replicas"``, ``"ray"``, ``"voice"``, ``"llm"``, ``"audio"`` or
    ``"priority"``, just those);
    the report, or ``None`` if a run failed (its error output is printed)."""
    if only in ("process", "replicas", "ray", *ALONE):
        report: dict[str, Any] | None = header(command=command, quick=quick)
    else:
        report = _run_inprocess(quick=quick, command=command)
    if report is None or only == "inprocess":
        return report
    console = Console(stderr=True)
    if only in ALONE:
        part = family(only, "run")(quick=quick, console=console)
        if part is None:
            return None
        report[only] = part
        return report
    if only in (None, "process"):
        process = run_process_bench(quick=quick, console=console)
        if process is None:
            return None
        report["process"] = process
    if only in (None, "replicas"):
        replicas = run_replicas_bench(quick=quick, console=console)
        if replicas is None:
            return None
        report["replicas"] = replicas
    if only == "replicas":
        return report
    if only == "ray" or ray_installed():
        ray = run_ray_bench(quick=quick, console=console)
        if ray is None:
            return None
        report["ray"] = ray
    else:
        report["ray_skipped"] = "Ray is not installed: pip install 'omni-trio[ray]'"
    return report


def _run_inprocess(*, quick: bool, command: str) -> dict[str, Any] | None:
    """Run every implementation; the report, or ``None`` if one failed (its error
    output is printed)."""
    implementations = ["trio", "asyncio"]
    if find_spec("uvloop") is not None:
        implementations.append("asyncio+uvloop")
    implementations.append(PLAIN)
    results: dict[str, Any] = {}
    console = Console(stderr=True)
    for impl in implementations:  # trio first: its capacity sets scenario 5's loads
        argv = [sys.executable, "-m", "omni_trio.bench", "--impl", impl]
        if quick:
            argv.append("--quick")
        if impl == PLAIN:
            argv.append("--throughput-only")
        if "trio" in results and impl != PLAIN:
            argv += ["--latency-capacity", str(results["trio"]["latency_capacity"])]
        with console.status(f"benchmarking {impl} ..."):
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode:
            console.print(done.stderr)
            return None
        results[impl] = json.loads(done.stdout)
    return {
        "command": command,
        "python": platform.python_version(),
        "packages": {name: _version(name) for name in ("omni-trio", "trio", "uvloop")},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "quick": quick,
        "results": results,
        "goals": goals(results),
    }


def _version(package: str) -> str | None:
    try:
        return version(package)
    except Exception:  # not installed
        return None


def goals(results: dict[str, Any]) -> dict[str, Any]:
    """The figures the project holds itself to, from a run's results."""
    trio_r, aio = results["trio"], results["asyncio"]
    uv = results.get("asyncio+uvloop")
    plain = results.get(PLAIN)
    found: dict[str, Any] = {}
    for key in ("throughput_next_output", "throughput_streams"):
        found[f"{key} vs asyncio >= 1.2"] = trio_r[key] / aio[key]
        if uv is not None:
            found[f"{key} vs uvloop >= 1.0"] = trio_r[key] / uv[key]
        if plain is not None:  # Trio in batches; the plain design has none
            found[f"{key} vs plain asyncio >= 1.2"] = trio_r[f"{key}_batches"] / plain[key]
    cost = trio_r["per_event_cost"]
    found["per-event cost 10,000 / 10 <= 1.25"] = cost["10000"] / cost["10"]
    found["latency p99 at 50% of capacity <= 1 ms"] = trio_r["latency_50%"]["p99"] * 1e3
    found["latency p99 at 70% of capacity <= 5 ms"] = trio_r["latency_70%"]["p99"] * 1e3
    found["memory per request <= 2048 B"] = trio_r["memory_per_request"]
    return found


def _lookup(result: dict[str, Any], key: str) -> float | None:
    """``result``'s figure under a dotted ``key``, or ``None`` if it was not measured
    (the plain design's other scenarios, or a report saved before the row existed)."""
    value: Any = result
    for part in key.split("."):
        if part not in value:
            return None
        value = value[part]
    return float(value)


def met(goal: str, value: float) -> bool:
    """Whether ``value`` meets ``goal``, whose name ends with its bound (``>= 1.2``,
    ``<= 1 ms``)."""
    bound = re.search(r"(>=|<=) ([\d.,]+)[^<>=]*$", goal)
    if bound is None:
        raise ValueError(f"goal {goal!r} names no bound")
    limit = float(bound[2].replace(",", ""))
    return value >= limit if bound[1] == ">=" else value <= limit


def _format(value: float, kind: str) -> str:
    if kind == "rate":
        return f"{value / 1e3:,.0f}k"
    if kind == "bytes":
        return f"{value:,.0f} B"
    return f"{value * 1e6:,.2f} µs" if value < 1e-3 else f"{value * 1e3:,.2f} ms"


def print_report(report: dict[str, Any]) -> None:
    """The comparison table, then the goals; then the process scenarios', the replica
    pools', the Ray scenarios', and each family of :data:`ALONE`'s (a report may hold
    any part alone)."""
    if "results" in report:
        _print_inprocess(report)
    if "process" in report:
        print_process_report(report, Console())
    if "replicas" in report:
        if "results" not in report and "process" not in report:
            print_header(report, Console())
        print_replicas_report(report, Console())
    if "ray" in report:
        if not {"results", "process", "replicas"} & report.keys():
            print_header(report, Console())
        print_ray_report(report, Console())
    elif "ray_skipped" in report:
        Console().print(f"Ray scenarios skipped: {report['ray_skipped']}")
    printed = {"results", "process", "replicas", "ray"} & report.keys()
    for name in ALONE:
        if name in report:
            if not printed:
                print_header(report, Console())
            family(name, "print")(report, Console())
            printed.add(name)


def _print_inprocess(report: dict[str, Any]) -> None:
    """The comparison table, then the goals."""
    results = report["results"]
    impls = list(results)
    console = Console()
    packages = ", ".join(f"{k} {v}" for k, v in report["packages"].items() if v)
    console.print(f"$ {report['command']}")
    console.print(
        f"Python {report['python']}; {packages}; {report['machine']['cpus']} CPUs"
        + ("; --quick (sizes too small to compare)" if report["quick"] else "")
    )
    table = Table(show_lines=False)
    table.add_column("scenario")
    for impl in impls:
        table.add_column(impl, justify="right")
    for impl in impls[1:]:
        table.add_column(f"trio / {impl}", justify="right")
    for key, label, kind in ROWS:
        values = [_lookup(results[impl], key) for impl in impls]
        cells = [_cell(v, kind) for v in values]
        if PLAIN in impls and values[impls.index(PLAIN)] is None and key.endswith("_batches"):
            # It has no batches: Trio's batches against its one output per await.
            values[impls.index(PLAIN)] = value = _lookup(results[PLAIN], key[: -len("_batches")])
            cells[impls.index(PLAIN)] = f"({_cell(value, kind)})"
        for other in values[1:]:
            if values[0] is None or other is None:
                cells.append("—")
            else:
                ratio = values[0] / other if kind == "rate" else other / values[0]
                cells.append(f"{ratio:.2f}x")
        table.add_row(label, *cells)
    console.print(table)
    rates = [_lookup(results["trio"], f"latency_{x:.0%}.rate") for x in LOADS]
    loads = " and ".join(f"{rate:,.0f}" for rate in rates if rate is not None)
    console.print(
        "Ratios > 1 mean Trio is faster, cheaper or smaller."
        + (f" 5. ran at {loads} events/s." if loads else "")
    )
    if PLAIN in impls:
        console.print(
            f"{PLAIN}: the plain design (one item per asyncio.Queue hop), scenarios 1 to 3 "
            "only. It has no batches: its batch cells (in parentheses) repeat its one output "
            "per await, and the goals against it weigh Trio's batches."
        )
    for goal, value in report["goals"].items():
        verdict = "met" if met(goal, value) else "not met"
        console.print(f"  goal {goal}: {value:.3g} ({verdict})")


def _cell(value: float | None, kind: str) -> str:
    return "—" if value is None else _format(value, kind)
