"""The replica part of ``omni-trio bench``: run the replica scenarios, judge the goals,
print the tables.

The scenarios (:mod:`omni_trio.bench._replicas`) run in processes of their own: the
device-time pipeline once per batch size, then the speech demo if the speech extra is
installed. The goals are issue 25's: with device-time engines, 2 and 4 replicas of the
bottleneck stage give at least 1.8x and 3.5x the throughput of 1 replica; with 8
replicas at concurrency 8, the first output is at most 1.25x its value at concurrency
1 (means over the level's requests). Beside them, the first output's inflation from
concurrency 1 to 10, and vLLM-Omni's published figure for the same (:data:`VLLM_OMNI`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from ._process_report import show_met

__all__ = [
    "BATCHES",
    "VLLM_OMNI",
    "comparison",
    "goals",
    "print_replicas_report",
    "run_replicas_bench",
    "speech_installed",
]

#: The device's slots per replica: one request at a time, then up to 4 sharing a step.
BATCHES = (1, 4)
#: Replicas -> throughput at least this many times 1 replica's.
THROUGHPUT_LIMITS = {2: 1.8, 4: 3.5}
#: With the most replicas, at as many concurrent requests: first output at most this
#: many times its value at concurrency 1.
FIRST_OUTPUT_LIMIT = 1.25
#: The first output's inflation is from concurrency 1 to this.
INFLATION_AT = 10
#: vLLM-Omni's published first-audio latency (mean TTFP, ms) at concurrency 1 and 10.
VLLM_OMNI = {
    "source": "vLLM-Omni, docs/design/feature/async_chunk_design.md, 'Performance' "
    "(Qwen3-Omni, async_chunk on, Code2Wav batch size 1, 50 prompts, H800 GPUs)",
    "first_audio_ms": {"1": 522.99, "10": 1628.88},
    "inflation": 1628.88 / 522.99,
}
SPEECH_MISSING = "the speech extra is not installed: pip install 'omni-trio[speech]'"


def speech_installed() -> bool:
    from ..speech import speech_available

    return bool(speech_available())


def _run(argv: list[str], what: str, console: Console) -> Any:
    with console.status(f"benchmarking replica pools: {what} ..."):
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        console.print(done.stderr[-5000:])
        return None
    return json.loads(done.stdout)


def run_replicas_bench(*, quick: bool, console: Console) -> dict[str, Any] | None:
    """``{"results": ..., "goals": [...], "comparison": ...}``, or ``None`` if a run
    failed (its error output is printed)."""
    base = [sys.executable, "-m", "omni_trio.bench._replicas"] + (["--quick"] if quick else [])
    results: dict[str, Any] = {"device": {}}
    for batch in BATCHES:
        argv = [*base, "--part", "device", "--batch", str(batch)]
        found = _run(argv, f"device-time engines, batch {batch}", console)
        if found is None:
            return None
        results["device"][str(batch)] = found
    if speech_installed():
        found = _run([*base, "--part", "speech"], "the speech demo", console)
        if found is None:
            return None
        results["speech"] = found
    else:
        results["speech_skipped"] = SPEECH_MISSING
    return {"results": results, "goals": goals(results), "comparison": comparison(results)}


def _rate(part: dict[str, Any], replicas: int) -> float:
    top = max(part["concurrency"])
    return float(part["replicas"][str(replicas)]["levels"][str(top)]["rate"])


def _first(part: dict[str, Any], replicas: int, concurrency: int) -> float:
    level = part["replicas"][str(replicas)]["levels"][str(concurrency)]
    return float(level["first_output"]["mean"])


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each ``{"key", "goal", "value", "limit", "met", "shown"}``, as the process goals
    are: per batch size, the throughput of 2 and 4 replicas against 1 (at the highest
    concurrency), and the first output with the most replicas at as many concurrent
    requests against concurrency 1. A quick run judges the replica counts it has."""
    found = []
    for batch, part in results["device"].items():
        counts = sorted(int(replicas) for replicas in part["replicas"])
        top = max(part["concurrency"])
        for replicas, limit in THROUGHPUT_LIMITS.items():
            if replicas not in counts:
                continue
            ratio = _rate(part, replicas) / _rate(part, 1)
            found.append(
                {
                    "key": f"batch{batch}.throughput.{replicas}",
                    "goal": f"batch {batch}: {replicas} replicas' throughput >= {limit:g}x "
                    f"1 replica's (concurrency {top})",
                    "value": ratio,
                    "limit": limit,
                    "met": ratio >= limit,
                    "shown": f">= {limit:g}x",
                }
            )
        most = counts[-1]
        if most in part["concurrency"]:
            ratio = _first(part, most, most) / _first(part, most, 1)
            found.append(
                {
                    "key": f"batch{batch}.first_output.{most}",
                    "goal": f"batch {batch}, {most} replicas: mean first output at concurrency "
                    f"{most} <= {FIRST_OUTPUT_LIMIT:g}x at concurrency 1",
                    "value": ratio,
                    "limit": FIRST_OUTPUT_LIMIT,
                    "met": ratio <= FIRST_OUTPUT_LIMIT,
                    "shown": f"<= {FIRST_OUTPUT_LIMIT:g}x",
                }
            )
    return found


def comparison(results: dict[str, Any]) -> dict[str, Any]:
    """The mean first output's inflation from concurrency 1 to :data:`INFLATION_AT`,
    per batch size and replica count, beside vLLM-Omni's."""
    inflation = {
        batch: {
            replicas: _first(part, int(replicas), INFLATION_AT) / _first(part, int(replicas), 1)
            for replicas in part["replicas"]
        }
        for batch, part in results["device"].items()
        if INFLATION_AT in part["concurrency"]
    }
    return {"at": INFLATION_AT, "inflation": inflation, "vllm_omni": VLLM_OMNI}


# -- the tables ---------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def _short_ms(seconds: float) -> str:
    """Milliseconds, a decimal below 100."""
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms < 100 else f"{ms:,.0f}"


def _device_table(batch: str, part: dict[str, Any], inflation: dict[str, float]) -> Table:
    top = max(part["concurrency"])
    table = Table(
        title=f"Replica pools, device-time engines, batch {batch}: {part['steps']} steps of "
        f"{part['step_seconds'] * 1e3:g} ms per request"
    )
    table.add_column("replicas")
    table.add_column(f"req/s at {top}", justify="right")
    table.add_column("x 1", justify="right")
    for concurrency in part["concurrency"]:
        table.add_column(f"@{concurrency}", justify="right")
    if inflation:
        table.add_column(f"@{INFLATION_AT} / @1", justify="right")
    one = _rate(part, 1)
    for replicas, run in part["replicas"].items():
        levels = run["levels"]
        cells = [
            replicas,
            f"{levels[str(top)]['rate']:,.1f}",
            f"{levels[str(top)]['rate'] / one:.2f}x",
            *(_short_ms(levels[str(c)]["first_output"]["mean"]) for c in part["concurrency"]),
        ]
        if inflation:
            cells.append(f"{inflation[replicas]:.1f}x")
        table.add_row(*cells)
    return table


def _speech_table(speech: dict[str, Any]) -> Table:
    table = Table(
        title=f"The speech demo (eSpeak NG), {speech['mode']} mode, concurrency "
        f"{speech['concurrency']} ({speech['requests']} requests)"
    )
    for column in (
        "talker, code2wav replicas",
        "mean first text",
        "mean first audio",
        "p90 first audio",
        "mean E2E",
        "p90 E2E",
        "req/s",
    ):
        table.add_column(column, justify="left" if column.startswith("talker") else "right")
    for replicas, run in speech["replicas"].items():
        table.add_row(
            f"{replicas} and {replicas}",
            _ms(run["ttft"]["mean"]),
            _ms(run["ttfp"]["mean"]),
            _ms(run["ttfp"]["p90"]),
            _ms(run["e2e"]["mean"]),
            _ms(run["e2e"]["p90"]),
            f"{run['rate']:.2f}",
        )
    return table


def print_replicas_report(report: dict[str, Any], console: Console) -> None:
    """The device-time tables, the comparison with vLLM-Omni, the speech demo's table,
    then how many goals are met."""
    pools = report["replicas"]
    results, compared = pools["results"], pools["comparison"]
    for batch, part in results["device"].items():
        console.print(_device_table(batch, part, compared["inflation"].get(batch, {})))
    console.print(
        "@N: the mean first output at concurrency N, in ms (from entering open_request "
        "to the first output). Two stages: host (one worker, no device time) streams "
        "each request's plan to device, the bottleneck, whose replicas run one device "
        "each; batch B: B requests share each step. Clients run requests back to back; "
        "req/s: the level's requests over its wall time."
    )
    misses = [
        f"batch {batch}, {replicas} replicas at {concurrency}: {level['queued']} of "
        f"{level['requests']}"
        for batch, part in results["device"].items()
        for replicas, run in part["replicas"].items()
        for concurrency, level in run["levels"].items()
        if int(concurrency) <= int(replicas) * int(batch) and level["queued"]
    ]
    console.print(
        "Requests that found their replica's slots all taken while another replica had "
        "one free (a balancer miss: concurrency <= replicas x batch): "
        + ("; ".join(misses) if misses else "none")
        + "."
    )
    loads = [part["load_average"] for part in results["device"].values() if "load_average" in part]
    if loads:
        console.print(
            "Load average (1 min) before and after each batch size's runs: "
            + ", ".join(f"{before:.2f} -> {after:.2f}" for before, after in loads)
            + "."
        )
    vllm = compared["vllm_omni"]
    console.print(
        f"vLLM-Omni: mean first audio {vllm['first_audio_ms']['1']:,.0f} ms at concurrency 1, "
        f"{vllm['first_audio_ms']['10']:,.0f} ms at 10: {vllm['inflation']:.1f}x "
        f"({vllm['source']})."
    )
    if "speech" in results:
        console.print(_speech_table(results["speech"]))
    else:
        console.print(f"The speech demo skipped: {results['speech_skipped']}")
    met = sum(row["met"] for row in pools["goals"])
    console.print(f"Replica goals met: {met} of {len(pools['goals'])}")
    for row in pools["goals"]:
        console.print(f"  goal {row['goal']}: {row['value']:.2f} ({show_met(row['met'])})")
