"""``omni-trio bench``'s process scenarios: a ``--quick`` run's report has every figure
and every goal judged, and the goals are judged right. Whether they are met is the
benchmark's business, not the tests'."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from helpers import ONLY_FULL_SIZE
from omni_trio.bench._process import QUICK_DEMO_LEVELS, SIZES
from omni_trio.bench._process_report import MIB, goals
from omni_trio.cli import main

GOAL_KEYS = [
    "chunks.64.hop_p50",
    "chunks.64.rate",
    "chunks.4096.hop_p50",
    "chunks.4096.rate",
    "chunks.49152.hop_p50",
    "chunks.49152.rate",
    "chunks.1048576.shm_rate",
    "graph.join_hop_p50",
    "graph.join_two_hop_p50",
    "graph.routed_past",
    *(f"demo.{level}.failures" for level in QUICK_DEMO_LEVELS),
    f"demo.{QUICK_DEMO_LEVELS[-1]}.worker_rss",
    f"demo.{QUICK_DEMO_LEVELS[-1]}.shm_left",
    f"demo_rings.{QUICK_DEMO_LEVELS[-1]}.failures",
    f"demo_rings.{QUICK_DEMO_LEVELS[-1]}.shm_peak",
    f"demo_rings.{QUICK_DEMO_LEVELS[-1]}.shm_left",
]


def floor_areas() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("otfloor")}


def check_timed(figures: dict[str, Any]) -> None:
    assert 0 < figures["hop_p50"] <= figures["hop_p99"]
    assert figures["rate"] > 0
    assert len(figures["rounds"]) == 1


@ONLY_FULL_SIZE
def test_a_quick_run_reports_every_scenario_and_judges_every_goal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    areas_before = floor_areas()
    assert main(["bench", "--only", "process", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quick"] is True
    assert report["command"].startswith("omni-trio ")
    assert "results" not in report  # the in-process part did not run
    results = report["process"]["results"]

    for size in SIZES:
        sides = results["chunks"]["sizes"][str(size)]
        assert set(sides) == (
            {"omni", "socket", "shm"} if size == SIZES[-1] else {"omni", "socket"}
        )
        for figures in sides.values():
            check_timed(figures)
    graph = results["graph"]
    for shape in ("line", "join_one_sending", "join", "join_in_step"):
        check_timed(graph[shape])
    assert graph["line_two_streams"]["hop_p50"] > 0
    assert graph["routed_past"] == {"requests": 5, "submitted": 0, "worker_requests": 0}
    check_timed(results["control"]["omni"])
    check_timed(results["control"]["socket"])

    assert set(results["demo"]) == {str(level) for level in QUICK_DEMO_LEVELS}
    (rings,) = results["demo_rings"].values()
    assert rings["inline_chunk_bytes"] == 0
    assert 0 < rings["peak_shm"] <= rings["shm_bound"]  # it used the rings, within bounds
    assert rings["shm_left_closed"] == {"entries": 0, "bytes": 0}
    for level, run in results["demo"].items():
        assert run["concurrency"] == int(level)
        assert run["failures"] == 0, run["first_failure"]
        assert run["outputs"] > int(level)  # text and audio, and one terminal each
        assert run["wall"] > 0
        assert run["rate"] > 0
        assert set(run["peak_rss"]) == {"orchestrator", "thinker", "talker", "code2wav"}
        assert all(rss > 1 * MIB for rss in run["peak_rss"].values())
        assert run["peak_shm"] >= 0
        assert run["shm_left_closed"] == {"entries": 0, "bytes": 0}

    rows = report["process"]["goals"]
    assert [row["key"] for row in rows] == GOAL_KEYS
    for row in rows:
        assert isinstance(row["value"], (int, float))
        assert not isinstance(row["value"], bool)
        assert math.isfinite(row["value"])
        assert isinstance(row["met"], bool)
    assert floor_areas() <= areas_before  # the shm floor unlinks its area

    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(report))
    assert main(["bench", "--from", str(saved)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("$ omni-trio ")
    assert "Worker processes: omni_trio against its floors" in out
    assert f"Process goals met: {sum(row['met'] for row in rows)} of {len(rows)}" in out
    for row in rows:
        assert f"goal {row['goal']}: " in out


def results_with(
    *,
    hop: float = 1.0,
    flood: float = 1.0,
    shm: float = 1.0,
    rss: int = 30 * MIB,
    failures: int = 0,
    left: int = 0,
    shm_peak: int = 8 * MIB,
    join: float = 1.0,
    routed: int = 0,
) -> dict[str, Any]:
    """Results whose omni_trio figures are the floors' times these ratios."""

    def figures(p50: float, rate: float) -> dict[str, float]:
        return {"hop_p50": p50, "hop_p99": 2 * p50, "rate": rate}

    sizes: dict[str, dict[str, Any]] = {
        str(size): {"socket": figures(1e-4, 1e4), "omni": figures(1e-4 * hop, 1e4 * flood)}
        for size in SIZES
    }
    sizes[str(SIZES[-1])]["shm"] = figures(1e-4, 1e4 * flood / shm)
    demo = {
        "peak_rss": {"orchestrator": 500 * MIB, "thinker": 30 * MIB, "talker": rss},
        "failures": failures,
        "shm_left_closed": {"entries": left, "bytes": 4096 * left},
    }
    rings = {
        "failures": 0,
        "peak_shm": shm_peak,
        "shm_bound": 8 * MIB,
        "shm_left_closed": {"entries": 0, "bytes": 0},
    }
    graph = {
        "size": 4096,
        "line": figures(1e-4, 1e4),
        "join_one_sending": figures(1e-4 * join, 1e4),
        "join": figures(2e-4 * join, 1e4),
        "join_in_step": figures(2e-4, 1e4),
        "line_two_streams": {"hop_p50": 2e-4},
        "routed_past": {"requests": 100, "submitted": routed, "worker_requests": 0},
    }
    return {
        "chunks": {"sizes": sizes},
        "graph": graph,
        "demo": {"1000": demo},
        "demo_rings": {"1000": rings},
    }


@pytest.mark.parametrize(
    ("changes", "unmet"),
    [
        ({}, set()),
        ({"hop": 2.0, "flood": 0.4, "shm": 0.5, "rss": 64 * MIB}, set()),  # the limits hold
        ({"hop": 2.01}, {"chunks.64.hop_p50", "chunks.4096.hop_p50", "chunks.49152.hop_p50"}),
        ({"flood": 0.39}, {"chunks.64.rate", "chunks.4096.rate", "chunks.49152.rate"}),
        ({"shm": 0.49}, {"chunks.1048576.shm_rate"}),
        ({"rss": 64 * MIB + 1}, {"demo.1000.worker_rss"}),
        ({"failures": 1}, {"demo.1000.failures"}),
        ({"left": 1}, {"demo.1000.shm_left"}),
        ({"shm_peak": 8 * MIB + 1}, {"demo_rings.1000.shm_peak"}),
        ({"join": 1.2}, set()),
        ({"join": 1.21}, {"graph.join_hop_p50", "graph.join_two_hop_p50"}),
        ({"routed": 1}, {"graph.routed_past"}),
    ],
)
def test_goals_are_judged_at_their_limits(changes: dict[str, Any], unmet: set[str]) -> None:
    rows = goals(results_with(**changes))
    assert {row["key"] for row in rows if not row["met"]} == unmet
    by_key = {row["key"]: row for row in rows}
    assert by_key["chunks.64.hop_p50"]["value"] == pytest.approx(changes.get("hop", 1.0))
    # the orchestrator's own memory is reported, not held to the workers' limit
    assert by_key["demo.1000.worker_rss"]["value"] == pytest.approx(
        max(30 * MIB, changes.get("rss", 30 * MIB)) / MIB
    )
