"""The Ray part of ``omni-trio bench``: run the Ray scenarios, judge the goals, print.

The scenarios (:mod:`omni_trio.bench._ray`) run in a process of their own, which
starts and stops its local multi-node cluster. The goals are the Ray backend's
issue's: between two Ray stages on different nodes, 4 KB chunks with a hop p50 of at
most 3 ms and at least 1,000 chunks/s per stream; a node's death ends its requests
with an error terminal naming the node within 5 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec
from typing import Any

from rich.console import Console
from rich.table import Table

from ._process_report import show_met, show_rate, show_time, size_label
from ._ray import RAY_SIZES

__all__ = ["goals", "print_ray_report", "ray_installed", "run_ray_bench"]

#: The chunk size the goals are set at.
GOAL_SIZE = 4096
HOP_P50_LIMIT = 3e-3  # seconds, at most
RATE_LIMIT = 1000  # chunks/s per stream, at least
DEATH_LIMIT = 5.0  # seconds from a node's death to its requests' error terminals


def ray_installed() -> bool:
    return find_spec("ray") is not None


def run_ray_bench(*, quick: bool, console: Console) -> dict[str, Any] | None:
    """``{"results": ..., "goals": [...]}``, or ``None`` if the run failed (its error
    output is printed)."""
    argv = [sys.executable, "-m", "omni_trio.bench._ray"]
    if quick:
        argv.append("--quick")
    with console.status("benchmarking Ray stages on a local two-node cluster ..."):
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()  # Ray's nodes print to stdout too: ours is last
    if done.returncode or not lines:
        console.print(done.stderr[-5000:])
        return None
    results = json.loads(lines[-1])
    return {"results": results, "goals": goals(results)}


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each ``{"key", "goal", "value", "limit", "met", "shown"}``, as the process
    goals are."""
    ray = results["chunks"]["sizes"][str(GOAL_SIZE)]["ray"]
    label = f"Ray, {size_label(GOAL_SIZE)} chunks between two nodes"
    trials = results["node_death"]["trials"]
    worst = max(trial["seconds"] for trial in trials)
    named = all(t["finish_reason"] == "error" and t["names_node"] for t in trials)
    return [
        {
            "key": "ray.hop_p50",
            "goal": f"{label}: hop p50 <= {HOP_P50_LIMIT * 1e3:g} ms",
            "value": ray["hop_p50"],
            "limit": HOP_P50_LIMIT,
            "met": ray["hop_p50"] <= HOP_P50_LIMIT,
            "shown": f"<= {HOP_P50_LIMIT * 1e3:g} ms",
        },
        {
            "key": "ray.rate",
            "goal": f"{label}: >= {RATE_LIMIT:,} chunks/s per stream",
            "value": ray["rate"],
            "limit": RATE_LIMIT,
            "met": ray["rate"] >= RATE_LIMIT,
            "shown": f">= {RATE_LIMIT:,}/s",
        },
        {
            "key": "ray.node_death",
            "goal": f"Ray, a node's death to its requests' error terminals <= {DEATH_LIMIT:g} s "
            "(the slowest trial; the error names the node)",
            "value": worst,
            "limit": DEATH_LIMIT,
            "met": worst <= DEATH_LIMIT and named,
            "shown": f"<= {DEATH_LIMIT:g} s",
        },
    ]


def print_ray_report(report: dict[str, Any], console: Console) -> None:
    """The Ray scenarios' table, then how many goals are met."""
    ray = report["ray"]
    results = ray["results"]
    by_key = {row["key"]: row for row in ray["goals"]}
    table = Table(title="Ray stages on two nodes of a local cluster, beside worker processes")
    for column, justify in [
        ("scenario", "left"),
        ("Ray", "right"),
        ("processes", "right"),
        ("goal", "right"),
        ("met?", "right"),
    ]:
        table.add_column(column, justify=justify)  # type: ignore[arg-type]

    def judged(key: str) -> tuple[str, str]:
        row = by_key.get(key) if key else None
        return ("", "") if row is None else (row["shown"], show_met(row["met"]))

    for size in RAY_SIZES:
        sides = results["chunks"]["sizes"][str(size)]
        on_ray, on_processes = sides["ray"], sides["process"]
        goal = size == GOAL_SIZE
        table.add_row(
            f"{size_label(size)}: hop p50",
            show_time(on_ray["hop_p50"]),
            show_time(on_processes["hop_p50"]),
            *judged("ray.hop_p50" if goal else ""),
        )
        table.add_row(
            "   hop p99", show_time(on_ray["hop_p99"]), show_time(on_processes["hop_p99"])
        )
        table.add_row(
            "   flood, chunks/s",
            show_rate(on_ray["rate"]),
            show_rate(on_processes["rate"]),
            *judged("ray.rate" if goal else ""),
        )
        table.add_row(
            "   per chunk (flood)",
            show_time(1 / on_ray["rate"]),
            show_time(1 / on_processes["rate"]),
        )
    startup = results["chunks"]["startup"]
    table.add_row("cluster up (head + 2 nodes)", f"{startup['cluster']:.1f} s", "")
    table.add_row("two Ray stages ready", f"{startup['ray_pipeline_ready']:.2f} s", "")
    for number, trial in enumerate(results["node_death"]["trials"], 1):
        last = number == len(results["node_death"]["trials"])
        table.add_row(
            f"node death -> error, trial {number}",
            f"{trial['seconds']:.2f} s",
            "",
            *judged("ray.node_death" if last else ""),
        )
    console.print(table)
    rounds = results["chunks"]["counts"]["rounds"]
    console.print(
        "Both sides run the same two-stage pipeline in the same run: the sender's stamp "
        "to the reader's `async for` (hop, chunks one per ms), then chunks back to back "
        f"(flood). Best of {rounds} round{'s' if rounds > 1 else ''}, alternating. "
        "The Ray stages' chunks go over TCP between the actors, inline."
    )
    met = sum(row["met"] for row in ray["goals"])
    console.print(f"Ray goals met: {met} of {len(ray['goals'])}")
    for row in ray["goals"]:
        console.print(f"  goal {row['goal']}: {row['value']:.3g} ({show_met(row['met'])})")
    if "error" in results["node_death"]["trials"][-1]:
        console.print(f"  the error terminal: {results['node_death']['trials'][-1]['error']}")
