"""The omni-trio command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_trio._cli import main


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
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_bench_quick_smoke(capsys):
    """Keeps the benchmark code from rotting; its numbers mean nothing at this size."""
    assert main(["bench", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quick"] is True
    assert report["machine"]["cpus"] >= 1
    for impl in ("trio", "asyncio"):
        result = report["results"][impl]
        assert result["throughput_next_output"] > 0
        assert set(result["per_event_cost"]) == {"10", "100", "1000", "10000"}
        assert 0 < result["latency"]["p50"] <= result["latency"]["p99"] <= result["latency"]["max"]
        assert result["memory_per_request"] > 0
    assert "latency p99 <= 1 ms" in report["goals"]


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
    assert "1,026k" in out  # the asyncio twin's scenario 1, as docs/performance.md shows
    assert "goal latency p99 <= 1 ms: 0.421" in out
