"""Every cancellation scenario behaves as docs/cancellation.md says, on this Python."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs
import pytest

from omni_trio.cli import main
from omni_trio.compare import barge_in
from omni_trio.compare.scenarios import (
    EXPECTED,
    EXPECTED_PLAIN,
    SCENARIOS,
    expected_plain_verdict,
    expected_verdicts,
    run_plain,
    run_scenario,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "cancellation.md"


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.key)
def test_observed_outcome_is_the_documented_one(scenario):
    on_asyncio, on_trio = run_scenario(scenario)
    expected = expected_verdicts(scenario.key)
    assert (on_asyncio.verdict, on_trio.verdict) == expected, (
        f"Python {sys.version_info[:2]}: asyncio {on_asyncio}, trio {on_trio}"
    )
    on_plain = run_plain(scenario)
    assert (None if on_plain is None else on_plain.verdict) == expected_plain_verdict(
        scenario.key
    ), f"Python {sys.version_info[:2]}: asyncio-plain {on_plain}"


def test_every_scenario_is_expected_and_documented():
    keys = [s.key for s in SCENARIOS]
    assert len(keys) == len(set(keys))
    assert set(keys) == set(EXPECTED)
    assert set(EXPECTED_PLAIN) == {s.key for s in SCENARIOS if s.run_plain is not None}
    doc = DOC.read_text()
    for number, scenario in enumerate(SCENARIOS, 1):
        assert f"`{scenario.key}`" in doc, f"docs/cancellation.md does not explain {scenario.key}"
        assert f"## {number}. {scenario.title} — `{scenario.key}`" in doc
        assert f"| {number} | `{scenario.key}` |" in doc


# -- barge-in: its measurements, design by design ------------------------------------------

DESIGNS = {
    "trio": barge_in.on_trio,
    "asyncio": barge_in.on_asyncio_twin,
    "asyncio-plain": barge_in.on_asyncio_plain,
}


@pytest.fixture(scope="module")
def barge_ins():
    return {design: run() for design, run in DESIGNS.items()}


@pytest.mark.parametrize("design", DESIGNS)
def test_barge_in_stops_the_answer_at_once_and_leaves_nothing(barge_ins, design):
    report = barge_ins[design]
    assert report.design == design
    assert report.heard == barge_in.HEARD
    assert report.delivered_after == 0  # no audio over the user's voice
    assert report.unplayed > 0  # chunks were waiting: skipped, not played
    assert report.aborted == (0, 1, 2, 3)
    # The aborts go out in the instant of the interruption (no timer in between), in a
    # few passes of the scheduler: 3 (4 for the asyncio designs on 3.10); the consumer
    # may start the next answer after 2 or 3 (Trio shuffles its batches; 5 on 3.10).
    assert report.quiet_ms == 0
    assert report.quiet_passes is not None
    assert 1 <= report.quiet_passes <= 4
    assert report.free_passes is not None
    assert 1 <= report.free_passes <= 5
    # Each engine's step in progress still came out, and was dropped.
    assert report.late == report.statistics.dropped_outputs == len(barge_in.STAGES)
    assert report.left == dict.fromkeys(report.left, 0)  # tasks_left included
    assert (report.statistics.aborted, report.statistics.completed) == (1, 0)


def test_barge_in_is_the_same_interruption_on_every_design(barge_ins):
    def what_a_user_notices(report):
        return attrs.evolve(report, design="", quiet_passes=0, free_passes=0)

    trio_report = what_a_user_notices(barge_ins["trio"])
    for design in ("asyncio", "asyncio-plain"):
        assert what_a_user_notices(barge_ins[design]) == trio_report
    assert len({report.verdict() for report in barge_ins.values()}) == 1


@pytest.mark.parametrize("design", DESIGNS)
def test_a_barge_in_swallowed_by_the_player(design):
    """docs/cancellation.md: a player that catches ``BaseException`` (scenario 2) plays
    the whole answer over the user on asyncio; on Trio the next receive raises again."""
    report = DESIGNS[design](player_swallows=True)
    if design == "trio":
        assert report.delivered_after == 0
        assert report.aborted == (0, 1, 2, 3)
        assert report.statistics.aborted == 1
    else:
        assert report.delivered_after == barge_in.LENGTH - barge_in.HEARD
        assert report.aborted == ()
        assert report.quiet_ms is None
        assert report.statistics.completed == 1
    assert report.left == dict.fromkeys(report.left, 0)


def test_the_barge_in_verdict_names_what_went_wrong(barge_ins):
    report = attrs.evolve(
        barge_ins["trio"],
        delivered_after=2,
        aborted=(3,),
        quiet_ms=None,
        quiet_passes=None,
        tasks_left=1,
        statistics=attrs.evolve(barge_ins["trio"].statistics, in_flight=1, pending_final=1),
    )
    assert report.verdict() == (
        "2 chunks after the barge-in; stages [3] aborted; "
        "left: in_flight 1, pending_final 1, tasks 1"
    )
    assert "the abort reached stages [3] only" in report.detail()
    assert "left: in_flight 1, pending_final 1, tasks 1" in report.detail()
    assert (
        attrs.evolve(report, aborted=())
        .verdict()
        .startswith("2 chunks after the barge-in; no abort; ")
    )


# -- omni-trio compare: the plain design's third column ------------------------------------


def test_compare_reports_the_plain_design_in_a_third_column(capsys, monkeypatch):
    assert main(["compare", "--json", "-k", "barge"]) == 0
    [row] = json.loads(capsys.readouterr().out)["scenarios"]
    assert (row["number"], row["key"]) == (11, "barge-in")
    verdicts = {row[design]["verdict"] for design in ("asyncio", "trio", "asyncio-plain")}
    assert verdicts == {expected_plain_verdict("barge-in")}
    assert row["asyncio-plain"]["detail"].startswith("plain asyncio: ")
    assert row["same"]
    assert row["as_documented"]
    assert main(["compare", "--json", "-k", "put"]) == 0  # no third run: null
    [row] = json.loads(capsys.readouterr().out)["scenarios"]
    assert row["asyncio-plain"] is None

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["compare", "-k", "barge"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    flat = " ".join(out.split())
    for label in ("asyncio:", "Trio:", "asyncio-plain:"):
        assert f"{label} {expected_plain_verdict('barge-in')}" in flat


def test_compare_exits_1_when_the_plain_design_is_not_as_documented(capsys, monkeypatch):
    import omni_trio.compare.scenarios as scenarios

    monkeypatch.setattr(scenarios, "expected_plain_verdict", lambda key: "nothing")
    assert main(["compare", "-k", "barge"]) == 1
    assert "Not as documented in docs/cancellation.md: barge-in" in capsys.readouterr().out
