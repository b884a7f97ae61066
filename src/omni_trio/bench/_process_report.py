"""The process part of ``omni-trio bench``: run the families, judge the goals, print.

Each family of :mod:`omni_trio.bench._process` runs in a process of its own
(``python -m omni_trio.bench._process --family NAME``), the demo once per
concurrency, so every process's peak memory is that run's alone. The goals are
ratios to the floors measured in the same run (or limits on memory), each with
whether it is met.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from importlib.metadata import version
from typing import Any

from rich.console import Console
from rich.table import Table

from ._process import DEMO_LEVELS, QUICK_DEMO_LEVELS, SHM_WINDOW, SIZES

__all__ = [
    "goals",
    "header",
    "print_header",
    "print_process_report",
    "run_process_bench",
    "show_met",
    "show_rate",
    "show_time",
    "size_label",
]

MIB = 1024 * 1024
#: Chunks up to this size are held to the socket pair; bigger ones to the shm copy.
SMALL_CHUNKS = 64 * 1024
HOP_P50_LIMIT = 2.0  # x the socket pair's hop p50, at most
FLOOD_LIMIT = 0.4  # x the socket pair's chunks/s, at least
SHM_LIMIT = 0.5  # x the shm copy's chunks/s, at least
RSS_LIMIT = 64  # MiB, every worker's peak, at the largest demo concurrency
JOIN_LIMIT = 1.2  # x the hop p50 it is compared with, at most (see graph_goals)


def header(*, command: str, quick: bool) -> dict[str, Any]:
    """What a report says about its run (for a run of the process scenarios alone)."""

    def installed(package: str) -> str | None:
        try:
            return version(package)
        except Exception:  # not installed
            return None

    return {
        "command": command,
        "python": platform.python_version(),
        "packages": {name: installed(name) for name in ("omni-trio", "trio", "msgspec", "ray")},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "quick": quick,
    }


def run_process_bench(*, quick: bool, console: Console) -> dict[str, Any] | None:
    """Run every family; ``{"results": ..., "goals": [...]}``, or ``None`` if one
    failed (its error output is printed)."""
    levels = QUICK_DEMO_LEVELS if quick else DEMO_LEVELS
    runs: list[tuple[str, list[str]]] = [("chunks", []), ("graph", []), ("control", [])]
    runs += [("demo", ["--concurrency", str(level)]) for level in levels]
    # and the largest again with every chunk through the rings: /dev/shm stays bounded
    runs.append(("demo", ["--concurrency", str(levels[-1]), "--inline-chunk-bytes", "0"]))
    results: dict[str, Any] = {"demo": {}, "demo_rings": {}}
    for family, extra in runs:
        argv = [sys.executable, "-m", "omni_trio.bench._process", "--family", family, *extra]
        if quick:
            argv.append("--quick")
        with console.status(f"benchmarking the process scenarios: {family} {' '.join(extra)}..."):
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode:
            console.print(done.stderr)
            return None
        found = json.loads(done.stdout)
        if family == "demo":
            key = "demo_rings" if "--inline-chunk-bytes" in extra else "demo"
            results[key][str(found["concurrency"])] = found
        else:
            results[family] = found
    return {"results": results, "goals": goals(results)}


def size_label(size: int) -> str:
    """``64 B``, ``4 KB``, ``1 MB`` (binary multiples, as the sizes are)."""
    if size % MIB == 0:
        return f"{size // MIB} MB"
    if size % 1024 == 0:
        return f"{size // 1024} KB"
    return f"{size} B"


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The figures the process data plane is held to, each ``{"key", "goal", "value",
    "limit", "met", "shown"}`` (``shown``: the limit as the table's goal column says
    it)."""
    found: list[dict[str, Any]] = []

    def goal(
        key: str, name: str, value: float, at_most: float | None, at_least: float | None, shown: str
    ) -> None:
        met = (at_most is None or value <= at_most) and (at_least is None or value >= at_least)
        limit = at_most if at_most is not None else at_least
        found.append(
            {"key": key, "goal": name, "value": value, "limit": limit, "met": met, "shown": shown}
        )

    for size in SIZES:
        sides = results["chunks"]["sizes"][str(size)]
        omni, socket = sides["omni"], sides["socket"]
        label = f"{size_label(size)} chunks"
        if size <= SMALL_CHUNKS:
            ratio = omni["hop_p50"] / socket["hop_p50"]
            name = f"{label}: hop p50 <= {HOP_P50_LIMIT:g}x the socket pair's"
            goal(
                f"chunks.{size}.hop_p50", name, ratio, HOP_P50_LIMIT, None, f"<= {HOP_P50_LIMIT:g}x"
            )
            ratio = omni["rate"] / socket["rate"]
            name = f"{label}: flood >= {FLOOD_LIMIT:g}x the socket pair's"
            goal(f"chunks.{size}.rate", name, ratio, None, FLOOD_LIMIT, f">= {FLOOD_LIMIT:g}x")
        else:
            ratio = omni["rate"] / sides["shm"]["rate"]
            name = f"{label}: flood >= {SHM_LIMIT:g}x the shm copy's"
            goal(f"chunks.{size}.shm_rate", name, ratio, None, SHM_LIMIT, f">= {SHM_LIMIT:g}x")
    if "graph" in results:
        graph_goals(results["graph"], goal)
    levels = sorted(results["demo"], key=int)
    for level in levels:
        name = f"demo, {level} requests: every request completed (failed)"
        goal(f"demo.{level}.failures", name, results["demo"][level]["failures"], 0, None, "0")
    top = levels[-1]
    rss = results["demo"][top]["peak_rss"]
    workers = [value for name, value in rss.items() if name != "orchestrator"]
    worst = max(workers, key=lambda value: math.inf if value is None else value)
    name = f"demo, {top} requests: every worker's peak RSS <= {RSS_LIMIT} MiB"
    value = math.inf if worst is None else worst / MIB
    goal(f"demo.{top}.worker_rss", name, value, RSS_LIMIT, None, f"<= {RSS_LIMIT} MiB")
    left = results["demo"][top]["shm_left_closed"]
    name = f"demo, {top} requests: nothing left in /dev/shm after close (entries)"
    goal(f"demo.{top}.shm_left", name, left["entries"], 0, None, "0")
    for level, run in results.get("demo_rings", {}).items():
        at, what = f"demo_rings.{level}", f"rings, {level} requests"
        name = f"{what}: every request completed (failed)"
        goal(f"{at}.failures", name, run["failures"], 0, None, "0")
        bound = run["shm_bound"] / MIB
        name = f"{what}: peak /dev/shm <= the rings' {bound:g} MiB"
        goal(f"{at}.shm_peak", name, run["peak_shm"] / MIB, bound, None, f"<= {bound:g} MiB")
        name = f"{what}: nothing left in /dev/shm after close (entries)"
        goal(f"{at}.shm_left", name, run["shm_left_closed"]["entries"], 0, None, "0")
    return found


def graph_goals(graph: dict[str, Any], goal: Any) -> None:
    """A join's hop p50, with one of its two sources sending, against a line's; with
    both sending, against a line's reader taking two streams at once (the same
    load on one reader); and the stage routed past: nothing submitted to it."""
    p50 = graph["join_one_sending"]["hop_p50"] / graph["line"]["hop_p50"]
    name = f"a join's hop p50 <= {JOIN_LIMIT:g}x a line's (one source sending)"
    goal("graph.join_hop_p50", name, p50, JOIN_LIMIT, None, f"<= {JOIN_LIMIT:g}x")
    p50 = graph["join"]["hop_p50"] / graph["line_two_streams"]["hop_p50"]
    name = f"a join's hop p50 <= {JOIN_LIMIT:g}x a line's reader of two streams (both sending)"
    goal("graph.join_two_hop_p50", name, p50, JOIN_LIMIT, None, f"<= {JOIN_LIMIT:g}x")
    name = "a stage routed past: requests submitted to it"
    goal("graph.routed_past", name, graph["routed_past"]["submitted"], 0, None, "0")


# -- the table ----------------------------------------------------------------------------------


def show_time(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} µs" if seconds < 1e-3 else f"{seconds * 1e3:,.2f} ms"


def show_rate(per_second: float) -> str:
    return f"{per_second:,.0f}/s"


def _mib(count: float | None) -> str:
    return "?" if count is None else f"{count / MIB:,.1f} MiB"


def _entries(left: dict[str, int]) -> str:
    return f"{left['entries']} ({left['bytes']:,} B)"


def show_met(met: bool) -> str:
    return "[green]yes[/green]" if met else "[red]no[/red]"


def _rows(process: dict[str, Any]) -> list[tuple[str, ...]]:
    """``(scenario, omni_trio, floor, ratio, goal, met?)`` rows; the ratio is
    omni_trio's figure over the floor's."""
    results = process["results"]
    goals_by_key = {row["key"]: row for row in process["goals"]}
    rows: list[tuple[str, ...]] = []

    def judged(key: str) -> tuple[str, str]:
        row = goals_by_key.get(key)
        return ("", "") if row is None else (row["shown"], show_met(row["met"]))

    def compare(label: str, omni: float, floor: float, kind: str, key: str = "") -> None:
        show = show_time if kind == "time" else show_rate
        rows.append((label, show(omni), show(floor), f"{omni / floor:.2f}x", *judged(key)))

    def alone(label: str, value: str, key: str = "") -> None:  # no floor
        rows.append((label, value, "", "", *judged(key)))

    for size in SIZES:
        sides = results["chunks"]["sizes"][str(size)]
        omni, socket = sides["omni"], sides["socket"]
        at = f"chunks.{size}"
        compare(
            f"{size_label(size)}: hop p50",
            omni["hop_p50"],
            socket["hop_p50"],
            "time",
            f"{at}.hop_p50",
        )
        compare("   hop p99", omni["hop_p99"], socket["hop_p99"], "time")
        compare("   flood, chunks/s", omni["rate"], socket["rate"], "rate", f"{at}.rate")
        if "shm" in sides:
            shm = sides["shm"]
            compare("   hop p50, shm copy", omni["hop_p50"], shm["hop_p50"], "time")
            compare("   flood, shm copy", omni["rate"], shm["rate"], "rate", f"{at}.shm_rate")
    if "graph" in results:
        graph = results["graph"]
        line = graph["line"]["hop_p50"]
        alone(f"graph, {size_label(graph['size'])} chunks: line hop p50", show_time(line))
        for key, label, judged_by in (
            ("join_one_sending", "   join, one source sending", "graph.join_hop_p50"),
            ("join", "   join, both sending apart", ""),
            ("join_in_step", "   join, both sending in step", ""),
        ):
            compare(label, graph[key]["hop_p50"], line, "time", judged_by)
        two = graph["line_two_streams"]["hop_p50"]
        compare("   line, two streams at once", two, line, "time")
        compare(
            "   join (both) vs two streams",
            graph["join"]["hop_p50"],
            two,
            "time",
            "graph.join_two_hop_p50",
        )
        past = graph["routed_past"]
        alone(
            f"   routed past: submitted of {past['requests']}",
            str(past["submitted"]),
            "graph.routed_past",
        )
    omni, socket = results["control"]["omni"], results["control"]["socket"]
    compare("outputs: latency p50", omni["hop_p50"], socket["hop_p50"], "time")
    compare("   p99", omni["hop_p99"], socket["hop_p99"], "time")
    compare("   flood, outputs/s", omni["rate"], socket["rate"], "rate")
    for level, run in sorted(results["demo"].items(), key=lambda item: int(item[0])):
        at = f"demo.{level}"
        alone(f"demo, {level} requests:", "")
        alone("   wall time", f"{run['wall']:.2f} s")
        alone("   outputs/s", show_rate(run["rate"]))
        alone("   failed requests", str(run["failures"]), f"{at}.failures")
        rss_goal = goals_by_key.get(f"{at}.worker_rss")
        for name, rss in run["peak_rss"].items():
            goal, met = "", ""
            if rss_goal is not None and name != "orchestrator":
                goal = rss_goal["shown"]
                met = show_met(rss is not None and rss <= rss_goal["limit"] * MIB)
            rows.append((f"   peak RSS, {name}", _mib(rss), "", "", goal, met))
        alone("   peak /dev/shm", _mib(run["peak_shm"]))
        # once every request had ended (the pipeline still open), and once it was closed
        alone("   /dev/shm left (open)", _entries(run["shm_left_open"]))
        alone("   /dev/shm left (closed)", _entries(run["shm_left_closed"]), f"{at}.shm_left")
    for level, run in sorted(results.get("demo_rings", {}).items(), key=lambda i: int(i[0])):
        at = f"demo_rings.{level}"
        alone(f"rings: demo, {level} requests, inline_chunk_bytes = 0:", "")
        alone("   wall time", f"{run['wall']:.2f} s")
        alone("   failed requests", str(run["failures"]), f"{at}.failures")
        alone("   peak /dev/shm", _mib(run["peak_shm"]), f"{at}.shm_peak")
        alone("   /dev/shm left (closed)", _entries(run["shm_left_closed"]), f"{at}.shm_left")
    return rows


def print_header(report: dict[str, Any], console: Console) -> None:
    """The command and the machine, for a report without the in-process table."""
    packages = ", ".join(f"{k} {v}" for k, v in report["packages"].items() if v)
    console.print(f"$ {report['command']}")
    console.print(
        f"Python {report['python']}; {packages}; {report['machine']['cpus']} CPUs"
        + ("; --quick (sizes too small to compare)" if report["quick"] else "")
    )


def print_process_report(report: dict[str, Any], console: Console) -> None:
    """The process scenarios' table, then how many goals are met."""
    process = report["process"]
    if "results" not in report:  # the in-process table, which says this, is not there
        print_header(report, console)
    table = Table(title="Worker processes: omni_trio against its floors, in the same run")
    table.add_column("scenario")
    for column in ("omni_trio", "floor", "ratio", "goal", "met?"):
        table.add_column(column, justify="right")
    for row in _rows(process):
        table.add_row(*row)
    console.print(table)
    rounds = process["results"]["chunks"]["counts"]["rounds"]
    console.print(
        "Ratio: omni_trio's figure / the floor's. Floor: two bare processes and a Trio "
        "socket pair, the same framing (4-byte length + msgpack); shm copy: through a "
        f"pre-mapped {SHM_WINDOW}-slot shared-memory area. Timed figures: the best of "
        f"{rounds} round{'s' if rounds > 1 else ''}, floor and omni_trio alternating."
    )
    met = sum(row["met"] for row in process["goals"])
    console.print(f"Process goals met: {met} of {len(process['goals'])}")
    for row in process["goals"]:
        console.print(f"  goal {row['goal']}: {row['value']:.3g} ({show_met(row['met'])})")
